//! The lock service's force-revoke audit in etcd is tamper-evident (issue 17, section 3): each
//! record is chained to the one before it by hash and a head names the last one
//! (`grant_signing::audit_chain`), and `lock_audit_chain_intact` finds an edited record, a
//! deleted one, a removed tail and a removed head. The records are written by a real lock
//! service (in-process, on the shared etcd, under a prefix of its own) through real
//! force-revokes; the tampering is done directly in etcd, as only someone holding etcd
//! credentials can. The untampered chain, and a record rewritten with its own value, pass: the
//! controls that show each finding below is the tampering's, not the check's.

use std::time::Duration;

use grant_signing::audit_chain;
use lock_client::{Acquired, LockClient};
use lock_server::backend::etcd::GRANT_RETENTION_MS_DEFAULT;
use lock_server::{BackendConfig, Config, InProcess};
use reconciler::lock_audit::{lock_audit_chain, lock_audit_chain_intact};
use reconciler::{LockGrants, Options, Sources};
use testkit::etcd::EtcdRole;
use testkit::pki::{tls, Role, TEST_OPERATOR};
use testkit::Stack;

struct Chain {
    server: InProcess,
    operator: LockClient,
    worker: LockClient,
    prefix: String,
    grants: LockGrants,
    _dir: tempfile::TempDir,
}

/// A lock service on the shared etcd under its own prefix, with `revokes` force-revokes done
/// (keys `k1`, `k2`, ..., each granted to a worker and then revoked by the operator).
async fn chain(revokes: usize) -> Chain {
    let stack = Stack::shared();
    let prefix = stack.unique_prefix("lock-audit");
    let dir = tempfile::tempdir().unwrap();
    let config = Config {
        backend: BackendConfig::Etcd {
            endpoints: stack.etcd_endpoints(),
            tls: stack.etcd_identity_tls(EtcdRole::LockServer, &prefix),
            prefix: prefix.clone(),
            grant_retention_ms: GRANT_RETENTION_MS_DEFAULT,
        },
        issued_tokens_path: dir.path().join("issued-tokens.json"),
        issued_tokens_limits: Default::default(),
        caller_limits: Default::default(),
        signer: std::sync::Arc::new(grant_signing::Signer::generate("lock-audit-1").unwrap().0),
    };
    let server = InProcess::start_with_policy(
        &config,
        &tls(Role::LockServer),
        testkit::pki::every_role(&lock_server::authz::POLICY),
    )
    .await
    .expect("lock-server starts");
    let worker = LockClient::connect(&server.endpoint, &tls(Role::Worker))
        .await
        .unwrap();
    let operator = LockClient::connect(&server.endpoint, &tls(Role::Operator))
        .await
        .unwrap();
    let grants = LockGrants::new(
        stack.etcd_endpoints(),
        stack.etcd_identity_tls(EtcdRole::Reconciler, &prefix),
        prefix.clone(),
    );
    let c = Chain {
        server,
        operator,
        worker,
        prefix,
        grants,
        _dir: dir,
    };
    for n in 1..=revokes {
        c.revoke(
            &format!("payout:k{n}"),
            &format!("stuck worker, ticket {n}"),
        )
        .await
        .0
        .unwrap();
    }
    c
}

impl Chain {
    /// Grants `key` to a worker, then force-revokes it as the operator: the operator's answer,
    /// and the worker's session (alive while the caller keeps it).
    async fn revoke(
        &self,
        key: &str,
        reason: &str,
    ) -> (Result<(), lock_client::ClientError>, lock_client::Session) {
        let session = self
            .worker
            .open_session("worker-a", Duration::from_secs(10))
            .await
            .unwrap();
        let token = match session.acquire(key, Duration::ZERO).await.unwrap() {
            Acquired::Granted(g) => g.token(),
            Acquired::NotAcquired { holder_owner, .. } => panic!("{key} held by {holder_owner}"),
        };
        let answer = self
            .operator
            .force_revoke(key, token, TEST_OPERATOR, reason)
            .await
            .map(drop);
        (answer, session)
    }

    async fn findings(&self) -> Vec<String> {
        let check = lock_audit_chain(&self.grants, &Options::default())
            .await
            .unwrap()
            .0;
        assert!(check.skipped.is_none());
        check.violations
    }

    fn record_key(&self, seq: u64) -> String {
        audit_chain::record_key(&self.prefix, seq)
    }
}

async fn etcd() -> testkit::etcd::RootClient {
    Stack::shared().etcd_client().await.unwrap()
}

/// The test's edits of the lock service's keys, as the kit's root (whose calls are sent again
/// while another test of this binary provisions an identity: `testkit::etcd::RootClient`).
async fn put(key: String, value: impl Into<Vec<u8>>) {
    etcd().await.put(key, value, None).await.unwrap();
}

async fn delete(key: String) {
    etcd().await.delete(key, None).await.unwrap();
}

async fn value(key: &str) -> Vec<u8> {
    let got = etcd().await.get(key, None).await.unwrap();
    got.kvs()
        .first()
        .unwrap_or_else(|| panic!("{key} exists"))
        .value()
        .to_vec()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_force_revokes_make_an_intact_chain_and_a_rewrite_with_the_same_value_changes_nothing(
) {
    let c = chain(3).await;
    // Written as the chain says: seq 1..3 at their keys, each linked to the one before, the head
    // at the last.
    let lock_server::backend::Backend::Etcd(etcd_backend) = c.server.service.backend() else {
        panic!("an etcd backend")
    };
    let audit = etcd_backend.audit_records().await.unwrap();
    assert_eq!(audit.len(), 3);
    let mut prev = audit_chain::to_hex(&audit_chain::genesis());
    for (i, v) in audit.iter().enumerate() {
        let r: audit_chain::Record = serde_json::from_value(v.clone()).unwrap();
        assert_eq!(r.seq, i as u64 + 1);
        assert_eq!(r.prev_hash, prev, "seq {} links to the one before", r.seq);
        assert!(r.hash_holds());
        assert_eq!(
            (r.operator.as_str(), r.key.as_str()),
            (TEST_OPERATOR, format!("payout:k{}", i + 1).as_str())
        );
        let stored: audit_chain::Record =
            serde_json::from_slice(&value(&c.record_key(r.seq)).await).unwrap();
        assert_eq!(stored, r, "seq {} is at its own key", r.seq);
        prev = r.hash;
    }
    let head: audit_chain::Head =
        serde_json::from_slice(&value(&audit_chain::head_key(&c.prefix)).await).unwrap();
    assert_eq!((head.seq, head.hash), (3, prev));

    let check = lock_audit_chain(&c.grants, &Options::default())
        .await
        .unwrap()
        .0;
    assert!(check.violations.is_empty(), "{:?}", check.violations);
    assert_eq!(check.examined, 3);

    // Control for the edit case: record 2 put again with its own value is not flagged.
    let same = value(&c.record_key(2)).await;
    put(c.record_key(2), same).await;
    assert!(c.findings().await.is_empty());

    // And the chain goes on from its head.
    c.revoke("payout:k4", "one more").await.0.unwrap();
    let check = lock_audit_chain(&c.grants, &Options::default())
        .await
        .unwrap()
        .0;
    assert!(check.violations.is_empty(), "{:?}", check.violations);
    assert_eq!(check.examined, 4);
    c.server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_edited_record_is_found() {
    let c = chain(3).await;
    let mut edited: serde_json::Value =
        serde_json::from_slice(&value(&c.record_key(2)).await).unwrap();
    edited["reason"] = "nothing to see here".into();
    put(c.record_key(2), edited.to_string()).await;
    let violations = c.findings().await;
    assert_eq!(violations.len(), 1, "{violations:?}");
    assert!(
        violations[0].contains("(seq 2)") && violations[0].contains("edited"),
        "{violations:?}"
    );
    c.server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deleted_middle_record_is_found() {
    let c = chain(3).await;
    delete(c.record_key(2)).await;
    let violations = c.findings().await;
    assert_eq!(violations.len(), 1, "{violations:?}");
    assert!(
        violations[0].contains("(seq 3)")
            && violations[0].contains("seq 2 missing")
            && violations[0].contains("deleted"),
        "{violations:?}"
    );
    c.server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deleted_last_record_is_found_by_the_head() {
    let c = chain(3).await;
    delete(c.record_key(3)).await;
    let violations = c.findings().await;
    assert_eq!(violations.len(), 1, "{violations:?}");
    assert!(
        violations[0].contains("head is at seq 3")
            && violations[0].contains("last record is seq 2")
            && violations[0].contains("tail removed"),
        "{violations:?}"
    );
    c.server.stop().await;
}

/// A removed head is found; the lock service refuses to append to that chain (it would have to
/// guess where it ends, or write over record 1) and revokes nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_removed_head_is_found_and_force_revoke_refuses_to_append_to_the_broken_chain() {
    let c = chain(2).await;
    delete(audit_chain::head_key(&c.prefix)).await;
    let violations = c.findings().await;
    assert_eq!(violations.len(), 1, "{violations:?}");
    assert!(
        violations[0].contains("records up to seq 2") && violations[0].contains("head removed"),
        "{violations:?}"
    );
    let (answer, _session) = c.revoke("payout:k3", "after the head went").await;
    let refused = answer.unwrap_err();
    assert!(
        format!("{refused:?}").contains("audit chain is not consistent"),
        "{refused:?}"
    );
    assert!(
        c.operator.describe("payout:k3").await.unwrap().held,
        "a refused revoke takes nothing"
    );
    assert_eq!(
        lock_audit_chain(&c.grants, &Options::default())
            .await
            .unwrap()
            .0
            .examined,
        2,
        "nothing was written"
    );
    c.server.stop().await;
}

/// Without an etcd source (the PostgreSQL lock backend, which chains lock_audit in lockdb) the
/// check says it was skipped, not that it passed.
#[tokio::test]
async fn without_an_etcd_source_the_check_is_skipped() {
    let lazy = || sqlx::PgPool::connect_lazy("postgres://nobody@127.0.0.1:1/none").unwrap();
    let sources = Sources {
        paydb: lazy(),
        proxydb: lazy(),
        gldb: lazy(),
        rail_proxy: None,
        lock_grants: None,
        operators: None,
    };
    let (check, head) = lock_audit_chain_intact(&sources, &Options::default())
        .await
        .unwrap();
    assert!(head.is_none());
    assert_eq!(check.name, "lock_audit_chain_intact");
    assert!(check.skipped.is_some() && check.violations.is_empty());
}

/// A rewrite of the whole chain (record 2's reason changed, every later hash and the head
/// recomputed with the public definitions) is consistent in itself: without the anchor it passes
/// (the anchor's negative control); against the head an earlier run reported it is found.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rewritten_chain_is_found_only_against_the_anchor() {
    let c = chain(3).await;
    let (check, anchor) = lock_audit_chain(&c.grants, &Options::default())
        .await
        .unwrap();
    assert!(check.violations.is_empty(), "{:?}", check.violations);
    let anchor = anchor.expect("a head at seq 3");
    assert_eq!(
        (anchor.chain.as_str(), anchor.seq),
        (reconciler::lock_audit::ANCHOR_CHAIN, 3)
    );
    let mut prev = audit_chain::genesis();
    for seq in 1..=3 {
        let r: audit_chain::Record =
            serde_json::from_slice(&value(&c.record_key(seq)).await).unwrap();
        let reason = if seq == 2 {
            "routine maintenance"
        } else {
            &r.reason
        };
        let rewritten = audit_chain::Record::chained(
            seq,
            &prev,
            &r.action,
            &r.key,
            &r.revoked_owner,
            &r.revoked_session_id,
            r.revoked_token,
            &r.operator,
            reason,
            r.at_unix_ms,
        );
        prev = audit_chain::from_hex(&rewritten.hash).unwrap();
        put(
            c.record_key(seq),
            serde_json::to_string(&rewritten).unwrap(),
        )
        .await;
    }
    let head = audit_chain::Head {
        seq: 3,
        hash: audit_chain::to_hex(&prev),
    };
    put(
        audit_chain::head_key(&c.prefix),
        serde_json::to_string(&head).unwrap(),
    )
    .await;
    assert!(c.findings().await.is_empty(), "consistent in itself");
    let options = Options {
        audit_anchor: Some(vec![anchor]),
        ..Options::default()
    };
    let (check, _) = lock_audit_chain(&c.grants, &options).await.unwrap();
    assert_eq!(check.violations.len(), 1, "{:?}", check.violations);
    assert!(
        check.violations[0].contains("rewritten"),
        "{:?}",
        check.violations
    );
    c.server.stop().await;
}
