//! `payoutdev stack up | status | down` as a newcomer runs them: every part healthy, the UI
//! answering, data kept across down/up, and nothing left running after down.

use std::path::Path;
use std::process::Command;

use testkit::free_port;

fn payoutdev(state: &Path, args: &[&str], ports: &[(&str, u16)]) -> std::process::Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_payoutdev"));
    cmd.args(args).env("PAYOUT_STATE_DIR", state);
    for (var, port) in ports {
        cmd.env(var, port.to_string());
    }
    cmd.output().expect("payoutdev runs")
}

/// The first port of `len` consecutive free ports (our services listen on base+1..base+16).
fn free_port_block(len: u16) -> u16 {
    loop {
        let base = free_port();
        if base.checked_add(len).is_some()
            && (0..len).all(|i| std::net::TcpListener::bind(("127.0.0.1", base + i)).is_ok())
        {
            return base;
        }
    }
}

fn status_json(state: &Path) -> (bool, serde_json::Value) {
    let out = payoutdev(state, &["stack", "status", "--json"], &[]);
    let value: serde_json::Value =
        serde_json::from_slice(&out.stdout).expect("status --json is JSON");
    (out.status.success(), value)
}

#[tokio::test]
async fn stack_up_status_down_up_keeps_data() {
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("stack");
    // One block of free ports, laid out so that the ports each part derives from its own
    // (etcd's peer port = client + 1; Temporal's HTTP and metrics = UI + 1, + 2; our services =
    // base + 1..16) never land on another part's.
    let b = free_port_block(40);
    let ports = [
        ("PAYOUT_PG_MAIN_PORT", b),
        ("PAYOUT_PG_PROXY_PORT", b + 1),
        ("PAYOUT_ETCD_PORT", b + 2),
        ("PAYOUT_TEMPORAL_PORT", b + 5),
        ("PAYOUT_TEMPORAL_UI_PORT", b + 6),
        ("PAYOUT_SERVICE_PORT_BASE", b + 10),
    ];
    let up = payoutdev(&state, &["stack", "up"], &ports);
    let stop = scopeguard(&state);
    assert!(
        up.status.success(),
        "up failed: {}\n{}",
        String::from_utf8_lossy(&up.stdout),
        String::from_utf8_lossy(&up.stderr)
    );
    let (ok, status) = status_json(&state);
    assert!(ok, "status: {status}");
    let parts = status["parts"].as_array().unwrap();
    for name in [
        "postgres-main",
        "postgres-proxy",
        "etcd-m0",
        "temporal",
        "temporal-ui",
    ] {
        let part = parts
            .iter()
            .find(|p| p["name"] == name)
            .unwrap_or_else(|| panic!("{name} in {status}"));
        assert_eq!(part["healthy"], true, "{name}: {status}");
    }
    // The reconciler logs in as its own role and stays up: it creates its schedule and polls.
    // (It was once handed the superuser's URL without a password: it retried for about twenty
    // seconds, so the status above still saw it, then exited, and the stack ran no reconciler.)
    let reconciler_log = state.join("system").join("reconciler.log");
    testkit::eventually(
        std::time::Duration::from_secs(60),
        "the reconciler polls",
        || async {
            std::fs::read_to_string(&reconciler_log)
                .unwrap_or_default()
                .contains("reconciler worker polling")
                .then_some(())
        },
    )
    .await
    .unwrap_or_else(|e| {
        panic!(
            "{e}: {}",
            std::fs::read_to_string(&reconciler_log).unwrap_or_default()
        )
    });
    let (ok, status) = status_json(&state);
    assert!(
        ok,
        "every part still healthy once the reconciler runs: {status}"
    );

    // The UI serves its page.
    let ui_port = ports[4].1;
    let (code, body) =
        testkit::util::http_get(ui_port, "/", std::time::Duration::from_secs(5)).unwrap();
    assert!((200..400).contains(&code), "UI answered {code}");
    assert!(
        body.to_lowercase().contains("<html") || code >= 300,
        "UI page: {body:.200}"
    );

    // Write into paydb, go down, come up: the row is still there.
    // What the stack prints holds no password; the superuser's is in the stack's credentials file.
    let printed = status["databases"]["paydb"].as_str().unwrap().to_string();
    assert!(
        printed.starts_with("postgres://postgres@") && printed.contains("sslmode=verify-full"),
        "{printed}"
    );
    let credentials =
        testkit::db_access::Credentials::load(&state.join(testkit::db_access::CREDENTIALS_FILE))
            .expect("the stack's generated credentials");
    let paydb = printed.replacen(
        "postgres://postgres@",
        &format!("postgres://postgres:{}@", credentials.superuser),
        1,
    );
    {
        let pool = sqlx::PgPool::connect(&paydb).await.unwrap();
        sqlx::query("CREATE TABLE kit_persisted (x int)")
            .execute(&pool)
            .await
            .unwrap();
        sqlx::query("INSERT INTO kit_persisted VALUES (42)")
            .execute(&pool)
            .await
            .unwrap();
        pool.close().await;
    }
    let pids: Vec<i32> = parts
        .iter()
        .filter_map(|p| p["pid"].as_i64())
        .map(|p| p as i32)
        .collect();
    let down = payoutdev(&state, &["stack", "down"], &[]);
    assert!(
        down.status.success(),
        "down: {} {}",
        String::from_utf8_lossy(&down.stdout),
        String::from_utf8_lossy(&down.stderr)
    );
    eprintln!("down said: {}", String::from_utf8_lossy(&down.stdout));
    for pid in &pids {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
        assert!(
            !testkit::util::pid_alive(*pid as u32),
            "pid {pid} still alive after down: {stat}"
        );
    }
    let (ok, _) = status_json(&state);
    assert!(!ok, "status must fail while the stack is down");

    let up = payoutdev(&state, &["stack", "up"], &ports);
    assert!(
        up.status.success(),
        "second up failed: {}\n{}",
        String::from_utf8_lossy(&up.stdout),
        String::from_utf8_lossy(&up.stderr)
    );
    let pool = sqlx::PgPool::connect(&paydb).await.unwrap();
    let x: i32 = sqlx::query_scalar("SELECT x FROM kit_persisted")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(x, 42);
    pool.close().await;
    drop(stop);
}

/// Brings the stack down even when an assertion fails.
fn scopeguard(state: &Path) -> impl Drop + '_ {
    struct Down<'a>(&'a Path);
    impl Drop for Down<'_> {
        fn drop(&mut self) {
            let _ = payoutdev(self.0, &["stack", "down"], &[]);
        }
    }
    Down(state)
}
