//! The kit's etcd runs with authentication (issue 34, plan commit 11): the kit's own client is
//! `root`, and a test's lock-server or reconciler gets an identity of its own on its own prefix
//! (`Stack::etcd_identity`), with `mtls::etcd_access`'s permissions and nothing else. The control
//! is the same calls on a cluster with authentication off: every one is allowed,
//! which is what every certificate of etcd's authority could do before.

use etcd_client::GetOptions;
use testkit::etcd::{connect_as, EtcdCluster, EtcdRole, EtcdTls};
use testkit::Stack;

/// What `identity` of each role may do on `cluster`, asked with the calls the roles are about.
struct Answers {
    lock_server_own_prefix: Result<(), String>,
    lock_server_other_prefix: Result<(), String>,
    lock_server_auth_disable: Result<(), String>,
    lock_server_member_remove: Result<(), String>,
    reconciler_reads_grants: Result<usize, String>,
    reconciler_puts_grants: Result<(), String>,
}

async fn ask(
    cluster: &EtcdCluster,
    lock_server: &mtls::EtcdTlsArgs,
    reconciler: &mtls::EtcdTlsArgs,
    (a, b): (&str, &str),
) -> Answers {
    let endpoints = cluster.endpoints();
    let mut root = cluster.client().await.unwrap();
    root.put(format!("{a}grants/payout:a/1"), "record", None)
        .await
        .unwrap();
    let member = root.raw().member_list().await.unwrap().members()[0].id();
    let mut lock = connect_as(&endpoints, lock_server).await.unwrap();
    let mut reader = connect_as(&endpoints, reconciler).await.unwrap();
    Answers {
        lock_server_own_prefix: said(lock.put(format!("{a}locks/payout:a"), "v", None).await),
        lock_server_other_prefix: said(lock.put(format!("{b}locks/payout:a"), "v", None).await),
        // Both refused before they act when authentication is on; the member remove is asked last
        // of the lock-server's calls, since on a cluster without authentication it is let through
        // to etcd's own check (a lone member is not removed).
        lock_server_auth_disable: said(lock.auth_disable().await),
        lock_server_member_remove: said(lock.member_remove(member).await),
        reconciler_reads_grants: reader
            .get(format!("{a}grants/"), Some(GetOptions::new().with_prefix()))
            .await
            .map(|r| r.kvs().len())
            .map_err(|e| e.to_string()),
        reconciler_puts_grants: said(
            reader
                .put(format!("{a}grants/payout:a/2"), "forged", None)
                .await,
        ),
    }
}

/// An answer as the test compares it: allowed, or what etcd said.
fn said<T>(answer: Result<T, etcd_client::Error>) -> Result<(), String> {
    answer.map(drop).map_err(|e| e.to_string())
}

fn permission_denied<T: std::fmt::Debug>(what: &str, answer: &Result<T, String>) {
    match answer {
        Err(e) => assert!(
            e.contains("permission denied"),
            "{what}: refused, but for another reason: {e}"
        ),
        Ok(v) => panic!("{what}: allowed ({v:?})"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_identity_reaches_its_own_prefix_and_only_what_its_role_allows() {
    let stack = Stack::shared();
    let (a, b) = (stack.unique_prefix("a"), stack.unique_prefix("b"));
    let lock_server = stack.etcd_identity(EtcdRole::LockServer, &a).unwrap();
    let reconciler = stack.etcd_identity(EtcdRole::Reconciler, &a).unwrap();
    let answers = ask(&stack.etcd, &lock_server, &reconciler, (&a, &b)).await;

    answers
        .lock_server_own_prefix
        .expect("the lock-server writes its own prefix");
    permission_denied(
        "the lock-server writes another test's prefix",
        &answers.lock_server_other_prefix,
    );
    permission_denied(
        "the lock-server disables authentication",
        &answers.lock_server_auth_disable,
    );
    permission_denied(
        "the lock-server removes a member",
        &answers.lock_server_member_remove,
    );
    assert_eq!(
        answers.reconciler_reads_grants,
        Ok(1),
        "the reconciler reads its prefix's grant records"
    );
    permission_denied(
        "the reconciler writes a grant record",
        &answers.reconciler_puts_grants,
    );

    // A certificate of etcd's authority whose name is no user reads nothing.
    let stranger = stack.etcd_certificate_without_user("stranger");
    let read = testkit::etcd::read_as(&stack.etcd_endpoints()[0], Some(&stranger), &a).await;
    permission_denied("a stranger reads a test's prefix", &read);

    // The kit's own client is root: it reads both prefixes.
    let mut root = stack.etcd_client().await.unwrap();
    for prefix in [&a, &b] {
        root.get(prefix.as_str(), Some(GetOptions::new().with_prefix()))
            .await
            .unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_authentication_every_identity_may_do_anything() {
    let dir = tempfile::tempdir().unwrap();
    let tls = EtcdTls::with_own_authority(dir.path()).unwrap();
    let cluster = EtcdCluster::start_without_auth_for_tests(
        &dir.path().join("etcd"),
        testkit::Lifetime::Attached,
        tls,
    )
    .unwrap();
    let (a, b) = ("/control/a/", "/control/b/");
    let identity = |user: &str, role| cluster.identity(dir.path(), user, role, a).unwrap();
    let lock_server = identity("payout-lock-server-0", EtcdRole::LockServer);
    let reconciler = identity("payout-reconciler-0", EtcdRole::Reconciler);
    let answers = ask(&cluster, &lock_server, &reconciler, (a, b)).await;

    answers.lock_server_own_prefix.unwrap();
    answers
        .lock_server_other_prefix
        .expect("without authentication the lock-server writes another prefix");
    answers
        .lock_server_auth_disable
        .expect("without authentication anyone may disable it");
    // Let through to etcd's own reconfiguration check, which keeps a lone member.
    let remove = answers.lock_server_member_remove.unwrap_err();
    assert!(!remove.contains("permission denied"), "{remove}");
    assert_eq!(answers.reconciler_reads_grants, Ok(1));
    answers
        .reconciler_puts_grants
        .expect("without authentication the reconciler writes a grant record");
}
