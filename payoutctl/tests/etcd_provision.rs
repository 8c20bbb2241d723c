//! `payoutctl etcd provision` against a real etcd (issue 34, rows 2b and 2c, on an etcd of the
//! test's own): once provisioned, the reconciler's certificate reads the grant records and the
//! audit chain and can change nothing (no put, no delete, no junk against the quota, no revoke of
//! a retention lease, no member removed, authentication not disabled); the lock-server's writes
//! its own prefix and nothing outside it; any other certificate of etcd's authority reads nothing.
//! The control is the same cluster before provisioning: the reconciler's certificate writes and
//! deletes as it likes (every certificate of etcd's authority could, until now).

use etcd_client::{Client, DeleteOptions, GetOptions, PutOptions};
use testkit::etcd::{EtcdCluster, EtcdTls};

const PREFIX: &str = "payout-locks/";
const LOCK_SERVER: &str = "payout-lock-server";
const RECONCILER: &str = "payout-reconciler";

async fn connect(endpoints: &[String], identity: &mtls::EtcdTlsArgs) -> Client {
    testkit::etcd::connect_as(endpoints, identity)
        .await
        .unwrap()
}

/// What etcd said to a refused request, for the assertion's message.
fn refused<T: std::fmt::Debug>(what: &str, result: Result<T, etcd_client::Error>) {
    match result {
        Err(e) => assert!(
            e.to_string().contains("permission denied")
                || e.to_string().contains("user name not found"),
            "{what}: refused, but for another reason: {e}"
        ),
        Ok(answer) => panic!("{what}: allowed: {answer:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_provisioned_etcd_gives_each_identity_its_prefix_and_nothing_else() {
    let dir = tempfile::tempdir().unwrap();
    let tls = EtcdTls::issue(&dir.path().join("etcd-tls")).unwrap();
    // Authentication is what provisioning turns on: the kit's own start would have done it.
    let cluster = EtcdCluster::start_without_auth_for_tests(
        &dir.path().join("etcd"),
        testkit::Lifetime::Attached,
        tls.clone(),
    )
    .unwrap();
    let endpoints = cluster.endpoints();
    let identity = |name: &str| EtcdTls::client_of(&tls.pki, dir.path(), name).unwrap();
    let mut root = connect(&endpoints, &identity("root")).await;
    for key in [
        "locks/payout:a",
        "grants/payout:a/1",
        "audit/00000000000000000001",
        "audit-head",
    ] {
        root.put(format!("{PREFIX}{key}"), "v", None).await.unwrap();
    }
    root.put("elsewhere/x", "v", None).await.unwrap();
    let lease = root.lease_grant(3_600, None).await.unwrap().id();
    root.put(
        format!("{PREFIX}retention/{lease}"),
        "v",
        Some(PutOptions::new().with_lease(lease)),
    )
    .await
    .unwrap();

    // The control: before provisioning, the reconciler's certificate writes and deletes anything.
    let mut reconciler = connect(&endpoints, &identity(RECONCILER)).await;
    reconciler
        .put(format!("{PREFIX}junk"), "x", None)
        .await
        .expect("before provisioning, any certificate of etcd's authority writes");
    reconciler
        .delete(format!("{PREFIX}junk"), None)
        .await
        .unwrap();

    // Provisioned twice: the second run changes nothing and does not fail.
    for _ in 0..2 {
        let users = mtls::etcd_access::users(LOCK_SERVER, RECONCILER, &[]);
        payoutctl::etcd::provision(&mut root, PREFIX, &users)
            .await
            .unwrap();
    }

    // The reconciler reads the grant records and the audit chain, and nothing else; writes nothing.
    let mut reconciler = connect(&endpoints, &identity(RECONCILER)).await;
    let grants = reconciler
        .get(
            format!("{PREFIX}grants/"),
            Some(GetOptions::new().with_prefix()),
        )
        .await
        .unwrap();
    assert_eq!(grants.kvs().len(), 1);
    let head = reconciler
        .get(format!("{PREFIX}audit-head"), None)
        .await
        .unwrap();
    assert_eq!(head.kvs().len(), 1);
    // What the reconciler itself reads with that certificate: the lock service's horizon and
    // the audit chain (its seeded records are no chain: violations, but read).
    let grants = reconciler::LockGrants::new(
        endpoints.clone(),
        identity(RECONCILER).load().unwrap(),
        PREFIX.to_string(),
    );
    assert!(grants.horizon().await.unwrap() > 0);
    reconciler::lock_audit::lock_audit_chain(&grants, &reconciler::Options::default())
        .await
        .expect("the reconciler reads the audit chain");
    refused(
        "the reconciler reads the locks",
        reconciler
            .get(
                format!("{PREFIX}locks/"),
                Some(GetOptions::new().with_prefix()),
            )
            .await,
    );
    refused(
        "the reconciler rewrites the audit head",
        reconciler
            .put(format!("{PREFIX}audit-head"), "forged", None)
            .await,
    );
    refused(
        "the reconciler deletes the locks",
        reconciler
            .delete(
                format!("{PREFIX}locks/"),
                Some(DeleteOptions::new().with_prefix()),
            )
            .await,
    );
    refused(
        "the reconciler fills the quota",
        reconciler
            .put(format!("{PREFIX}junk"), vec![0u8; 1 << 20], None)
            .await,
    );
    refused(
        "the reconciler revokes a retention lease",
        reconciler.lease_revoke(lease).await,
    );
    let member = root.member_list().await.unwrap().members()[0].id();
    refused(
        "the reconciler removes a member",
        reconciler.member_remove(member).await,
    );
    refused(
        "the reconciler disables authentication",
        reconciler.auth_disable().await,
    );

    // The lock-server writes its own prefix, and nothing outside it.
    let mut lock_server = connect(&endpoints, &identity(LOCK_SERVER)).await;
    lock_server
        .put(format!("{PREFIX}locks/payout:b"), "v", None)
        .await
        .unwrap();
    lock_server
        .delete(format!("{PREFIX}locks/payout:b"), None)
        .await
        .unwrap();
    refused(
        "the lock-server writes outside its prefix",
        lock_server.put("elsewhere/x", "forged", None).await,
    );
    refused(
        "the lock-server disables authentication",
        lock_server.auth_disable().await,
    );

    // Any other certificate of etcd's authority (a name no user has) reads nothing.
    let mut stranger = connect(&endpoints, &identity("payout-worker")).await;
    refused(
        "a stranger reads the grant records",
        stranger
            .get(
                format!("{PREFIX}grants/"),
                Some(GetOptions::new().with_prefix()),
            )
            .await,
    );

    // Everything the refused calls aimed at is as it was.
    let all = root
        .get(PREFIX, Some(GetOptions::new().with_prefix()))
        .await
        .unwrap();
    let keys: Vec<String> = all
        .kvs()
        .iter()
        .map(|kv| kv.key_str().unwrap().to_string())
        .collect();
    assert_eq!(keys.len(), 5, "{keys:?}");
    assert_eq!(
        root.get(format!("{PREFIX}audit-head"), None)
            .await
            .unwrap()
            .kvs()[0]
            .value(),
        b"v"
    );
    assert_eq!(root.member_list().await.unwrap().members().len(), 1);
    drop(cluster);
}
