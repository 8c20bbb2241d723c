//! The kit's own tests: each part comes up, answers, survives a restart with its data, is
//! isolated per test, and is cleaned up.

use std::time::Duration;

use testkit::{PgServer, Stack};

async fn count_rows(url: &str) -> i64 {
    let pool = sqlx::PgPool::connect(url).await.unwrap();
    sqlx::query_scalar("SELECT count(*) FROM kept")
        .fetch_one(&pool)
        .await
        .unwrap()
}

#[tokio::test]
async fn postgres_servers_are_separate_and_databases_fresh() {
    let stack = Stack::shared();
    assert_ne!(
        stack.main.port, stack.proxy.port,
        "proxydb must live on its own server"
    );
    let a = stack.fresh_db(PgServer::Main).await;
    let b = stack.fresh_db(PgServer::Main).await;
    assert_ne!(a, b);
    let pool = sqlx::PgPool::connect(&a).await.unwrap();
    sqlx::query("CREATE TABLE only_in_a (x int)")
        .execute(&pool)
        .await
        .unwrap();
    let pool_b = sqlx::PgPool::connect(&b).await.unwrap();
    let visible: bool = sqlx::query_scalar("SELECT to_regclass('only_in_a') IS NOT NULL")
        .fetch_one(&pool_b)
        .await
        .unwrap();
    assert!(
        !visible,
        "a fresh database must not see another test's tables"
    );
    let c = stack.fresh_db(PgServer::Proxy).await;
    assert!(c.contains(&stack.proxy.port.to_string()));
}

#[tokio::test]
async fn etcd_answers_and_prefixes_are_unique() {
    let stack = Stack::shared();
    let mut client = stack.etcd_client().await.unwrap();
    let p1 = stack.unique_prefix("k");
    let p2 = stack.unique_prefix("k");
    assert_ne!(p1, p2);
    let put = client.put(format!("{p1}x"), "1", None).await.unwrap();
    assert!(put.header().unwrap().revision() > 0);
    let got = client.get(format!("{p2}x"), None).await.unwrap();
    assert!(got.kvs().is_empty());
}

#[tokio::test]
async fn dedicated_stack_survives_restarts_with_its_data_and_pauses() {
    let stack = Stack::builder().start().unwrap();
    let url = stack.fresh_db(PgServer::Main).await;
    {
        let pool = sqlx::PgPool::connect(&url).await.unwrap();
        sqlx::query("CREATE TABLE kept (x int)")
            .execute(&pool)
            .await
            .unwrap();
        sqlx::query("INSERT INTO kept VALUES (1)")
            .execute(&pool)
            .await
            .unwrap();
        pool.close().await;
    }
    // SIGKILL, then restart: committed data is still there.
    stack.main.process.kill().unwrap();
    assert!(!stack.main.process.is_running());
    stack.main.process.restart().unwrap();
    stack.main.wait_ready().unwrap();
    assert_eq!(count_rows(&url).await, 1);
    // Graceful restart too.
    stack.main.restart().unwrap();
    assert_eq!(count_rows(&url).await, 1);

    // etcd: a key survives a member kill and restart.
    let endpoints = stack.etcd_endpoints();
    let mut client = stack.etcd.tls.connect(&endpoints).await.unwrap();
    client.put("/kept", "yes", None).await.unwrap();
    stack.etcd.members[0].process.kill().unwrap();
    stack.etcd.members[0].restart().unwrap();
    stack.etcd.wait_healthy().unwrap();
    let mut client = stack.etcd.tls.connect(&endpoints).await.unwrap();
    let got = client.get("/kept", None).await.unwrap();
    assert_eq!(got.kvs()[0].value(), b"yes");

    // A paused server does not answer; resumed, it does.
    stack.main.process.pause().unwrap();
    let paused =
        tokio::time::timeout(Duration::from_millis(500), sqlx::PgPool::connect(&url)).await;
    assert!(
        paused.is_err() || paused.unwrap().is_err(),
        "a SIGSTOPped server must not answer"
    );
    stack.main.process.resume().unwrap();
    assert_eq!(count_rows(&url).await, 1);

    let state = stack.state_dir().to_path_buf();
    let pid = stack.main.process.pid().unwrap();
    drop(stack);
    std::thread::sleep(Duration::from_millis(200));
    // Dropping a dedicated stack kills its processes and removes its state.
    let alive = unsafe { libc::kill(pid as i32, 0) } == 0;
    assert!(!alive, "postgres must be gone after the stack is dropped");
    assert!(!state.exists(), "state directory must be removed");
}

#[tokio::test]
async fn three_member_etcd_survives_a_leader_kill() {
    let stack = Stack::builder().etcd_members(3).start().unwrap();
    let leader = stack.etcd.leader().await.unwrap();
    stack.etcd.members[leader].process.kill().unwrap();
    let endpoints = stack.etcd_endpoints();
    let new_leader = testkit::eventually(Duration::from_secs(20), "a new etcd leader", || async {
        stack.etcd.leader().await.ok().filter(|l| *l != leader)
    })
    .await
    .unwrap();
    assert_ne!(new_leader, leader);
    // A client of the surviving members only (a client may otherwise pick the dead one first).
    let survivors: Vec<String> = endpoints
        .iter()
        .enumerate()
        .filter(|(i, _)| *i != leader)
        .map(|(_, e)| e.clone())
        .collect();
    let mut client = stack.etcd.tls.connect(&survivors).await.unwrap();
    client.put("/after-failover", "ok", None).await.unwrap();
}

#[tokio::test]
async fn temporal_dev_server_answers_with_search_attributes() {
    let stack = Stack::shared();
    let temporal = stack.temporal();
    let out = temporal
        .cli(&[
            "operator",
            "search-attribute",
            "list",
            "--namespace",
            "default",
        ])
        .unwrap();
    assert!(out.contains("PayoutState"), "{out}");
    assert!(out.contains("AccountId"), "{out}");
}
