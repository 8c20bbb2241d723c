//! The lock service against REAL etcd and REAL PostgreSQL (testkit). Every behavioural test runs
//! against both backends through the same client code.

use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use grant_signing::{Forged, Verifier};
use lock_client::{
    Acquired, ClientError, FencingToken, GrantHandle, LockClient, Rejection, Session,
};
use lock_server::backend::etcd::GRANT_RETENTION_MS_DEFAULT;
use lock_server::checker::{self, GrantRecord};
use lock_server::{BackendConfig, Config, InProcess};
use rand::RngExt;
use testkit::etcd::EtcdRole;
use testkit::pki::{tls, Role};
use testkit::{PgServer, Stack};

mod support;
use lock_server::service::LockServiceImpl;
use support::{
    backend, every_role, grant, lockdb, on_three_etcd_members, signer, start_bounded, start_shaped,
    start_with, start_with_bounds, unix_now_ms, Kind, Server, SIGNING_KEY_ID,
};

/// The etcd backend's shortest lease (whole seconds; etcd's minimum is about 1.5 s and is rounded
/// up): short so expiry tests are quick.
const TTL: Duration = Duration::from_secs(2);

async fn start(kind: Kind) -> Server {
    start_with(backend(kind, "lock").await).await
}

fn rejection(e: &ClientError) -> &Rejection {
    e.rejection()
        .unwrap_or_else(|| panic!("expected a typed rejection, got {e:?}"))
}

// ---------------------------------------------------------------------------------------------
// Grants, idempotence, refusals

async fn grants_and_refusals(kind: Kind) {
    let s = start(kind).await;
    let a = s.client.open_session("worker-a", TTL).await.unwrap();
    let b = s.client.open_session("worker-b", TTL).await.unwrap();

    let g1 = grant(&a, "payout:acc-1").await;
    assert!(g1.is_held());
    // A retried acquire by the same owner and session mints nothing: the same token.
    let again = grant(&a, "payout:acc-1").await;
    assert_eq!(
        again.token(),
        g1.token(),
        "idempotent re-acquire returns the same token"
    );
    assert_eq!(s.server.service.event_count("acquired"), 1);
    assert_eq!(s.server.service.event_count("reacquired"), 1);

    // Two units of work on ONE session (two workflows on one worker) are two owners: the second
    // is not handed the first one's grant. Negative control: under the session's own owner both
    // get the same grant (the idempotent re-acquire above), which is why workers use acquire_as.
    let unit_1 = match a
        .acquire_as("payout:acc-2", "worker-a/p-1", Duration::ZERO)
        .await
        .unwrap()
    {
        Acquired::Granted(g) => g,
        other => panic!("first unit not granted: {other:?}"),
    };
    assert_eq!(unit_1.owner(), "worker-a/p-1");
    match a
        .acquire_as("payout:acc-2", "worker-a/p-2", Duration::ZERO)
        .await
        .unwrap()
    {
        Acquired::NotAcquired { holder_owner, .. } => assert_eq!(holder_owner, "worker-a/p-1"),
        Acquired::Granted(g) => panic!(
            "a second unit on the same session shares the key: token {}",
            g.token()
        ),
    }
    let unit_1_again = match a
        .acquire_as("payout:acc-2", "worker-a/p-1", Duration::ZERO)
        .await
        .unwrap()
    {
        Acquired::Granted(g) => g,
        other => panic!("idempotent re-acquire by the same unit: {other:?}"),
    };
    assert_eq!(unit_1_again.token(), unit_1.token());
    unit_1
        .release()
        .await
        .expect("the unit releases its own grant");
    match a
        .acquire_as("payout:acc-2", "worker-a/p-2", Duration::ZERO)
        .await
        .unwrap()
    {
        Acquired::Granted(g) => assert!(
            g.token() > unit_1_again.token(),
            "a new grant mints a higher token"
        ),
        other => panic!("second unit after release: {other:?}"),
    }

    // Another owner is not granted.
    match b.acquire("payout:acc-1", Duration::ZERO).await.unwrap() {
        Acquired::NotAcquired {
            holder_owner,
            holder_token,
        } => {
            assert_eq!(holder_owner, "worker-a");
            assert_eq!(holder_token, g1.token().get());
        }
        Acquired::Granted(g) => panic!("two holders: {g:?}"),
    }

    // Release by a non-holder (the other session presenting the holder's token) is refused.
    let forged =
        GrantHandle::reestablish(&s.client, "payout:acc-1", "worker-b", b.id(), g1.token()).await;
    assert!(matches!(
        rejection(&forged.unwrap_err()),
        Rejection::NotHolder(_)
    ));
    let mut rpc = s.client.rpc();
    let refused = rpc
        .release(payout_proto::lock::ReleaseRequest {
            handle: Some(payout_proto::lock::Handle {
                key: "payout:acc-1".into(),
                owner: "worker-b".into(),
                session_id: b.id().into(),
                token: g1.token().get(),
            }),
        })
        .await
        .unwrap_err();
    match rejection(&refused.into()) {
        Rejection::NotHolder(n) => assert_eq!(n.current_token, g1.token().get()),
        other => panic!("expected NotHolder, got {other:?}"),
    }

    // Describe is introspection of the same facts.
    let d = s.client.describe("payout:acc-1").await.unwrap();
    assert!(d.held);
    assert_eq!(
        (d.holder_owner.as_str(), d.token),
        ("worker-a", g1.token().get())
    );

    // A handle re-established elsewhere (another worker process) renews and releases it.
    let adopted =
        GrantHandle::reestablish(&s.client, "payout:acc-1", "worker-a", a.id(), g1.token())
            .await
            .unwrap();
    assert!(adopted.is_held());
    adopted.renew().await.unwrap();
    adopted.release().await.unwrap();
    // The old handle is no longer the holder.
    assert!(matches!(
        rejection(&g1.release().await.unwrap_err()),
        Rejection::NotHolder(_)
    ));

    // The token sequence outlives the entry: the next grant is higher.
    let g2 = grant(&b, "payout:acc-1").await;
    assert!(g2.token() > again.token());

    // A waiter is woken by the release (watch / NOTIFY), long before its bound.
    let a2 = a.clone();
    let waiter = tokio::spawn(async move {
        let t0 = Instant::now();
        let r = a2
            .acquire("payout:acc-1", Duration::from_secs(20))
            .await
            .unwrap();
        (r.granted().map(|g| g.token()), t0.elapsed())
    });
    testkit::eventually(Duration::from_secs(5), "waiter registered", || {
        let c = s.client.clone();
        async move {
            c.describe("payout:acc-1")
                .await
                .ok()
                .filter(|d| d.waiter_count == 1)
        }
    })
    .await
    .unwrap();
    let g2_token = g2.token();
    g2.release().await.unwrap();
    let (token, waited) = waiter.await.unwrap();
    assert!(token.expect("waiter granted") > g2_token);
    assert!(
        waited < Duration::from_secs(10),
        "woken by the release, not the bound: {waited:?}"
    );

    // Typed argument refusals.
    let e = s
        .operator
        .force_revoke("payout:acc-1", FencingToken::new(1).unwrap(), "", "reason")
        .await
        .unwrap_err();
    assert!(matches!(rejection(&e), Rejection::InvalidArgument(_)));
    let e = s
        .operator
        .force_revoke(
            "payout:acc-1",
            FencingToken::new(1).unwrap(),
            testkit::pki::TEST_OPERATOR,
            " ",
        )
        .await
        .unwrap_err();
    assert!(matches!(rejection(&e), Rejection::InvalidArgument(_)));
    s.server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_grants_and_refusals() {
    grants_and_refusals(Kind::Etcd).await;
}
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_grants_and_refusals() {
    grants_and_refusals(Kind::Postgres).await;
}

/// The lock service restates the account id grammar (it links nothing of the payout domain):
/// for every key of this table, `lock_server::key::check` accepts exactly what
/// `payout_domain::lock_key(AccountId::parse(..))` can produce.
#[test]
fn the_key_grammar_agrees_with_the_payout_domain() {
    use payout_domain::{ids::ID_LENGTH_MAX, AccountId};
    assert_eq!(lock_server::key::ACCOUNT_ID_LENGTH_MAX, ID_LENGTH_MAX);
    let accounts = [
        "acct-1".to_string(),
        "A.b_c-9".to_string(),
        "a".repeat(64),
        "a".repeat(65),
        String::new(),
        "a/b".into(),
        "a b".into(),
        "a\0".into(),
        "é".into(),
        "a:b".into(),
        "a*".into(),
    ];
    for account in accounts {
        let key = format!("payout:{account}");
        let domain = AccountId::parse(account.clone()).map(|a| payout_domain::lock_key(&a));
        let lock = lock_server::key::check("key", &key);
        assert_eq!(
            domain.is_ok(),
            lock.is_ok(),
            "{account:?}: the domain says {domain:?}, the lock service {lock:?}"
        );
        if let Ok(domain_key) = domain {
            assert_eq!(domain_key, key);
        }
    }
    for foreign in [
        "other",
        "payout",
        "Payout:acct-1",
        " payout:acct-1",
        "payout:",
    ] {
        assert!(
            lock_server::key::check("key", foreign).is_err(),
            "{foreign:?}"
        );
    }
}

/// Issue 34, row 4e: the lock service serves only `payout:{account id}` keys. Anything else (a
/// key of the caller's own invention, an account id past 64 characters, a 512-byte key, a slash)
/// is refused INVALID_ARGUMENT on `key` at Acquire, Describe and ForceRevoke, before the backend,
/// the waiter queues or the issued-token record see it. Control: an account's key is granted.
async fn only_account_keys_are_served(kind: Kind) {
    let s = start(kind).await;
    let a = s.client.open_session("worker-a", TTL).await.unwrap();
    let long_account = format!("payout:{}", "a".repeat(65));
    let big = "k".repeat(512);
    for key in [
        "other",
        long_account.as_str(),
        big.as_str(),
        "payout:a/b",
        "payout:",
    ] {
        let refused = |e: &ClientError, call: &str| match rejection(e) {
            Rejection::InvalidArgument(i) => {
                assert_eq!(i.field, "key", "{call} {key:?}: {i:?}")
            }
            other => panic!("{call} {key:?}: expected INVALID_ARGUMENT on key, got {other:?}"),
        };
        refused(
            &a.acquire(key, Duration::ZERO).await.unwrap_err(),
            "acquire",
        );
        refused(&s.operator.describe(key).await.unwrap_err(), "describe");
        refused(
            &s.operator
                .force_revoke(
                    key,
                    FencingToken::new(1).unwrap(),
                    testkit::pki::TEST_OPERATOR,
                    "row 4e",
                )
                .await
                .unwrap_err(),
            "force_revoke",
        );
    }
    let granted = grant(&a, "payout:acct-1").await;
    assert_eq!(granted.key(), "payout:acct-1");
    granted.release().await.unwrap();
    s.server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_only_account_keys_are_served() {
    only_account_keys_are_served(Kind::Etcd).await;
}
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_only_account_keys_are_served() {
    only_account_keys_are_served(Kind::Postgres).await;
}

/// Every grant the lock service hands out carries its signature over (key, token, owner): the
/// first grant, a narrower owner's (`acquire_as`), a waiter's, and the Renew answer a handle is
/// re-established from. Each verifies with the server's public key alone, and only for its own
/// key, token and owner (a guard refuses it on another account's write). Control: the same
/// grants checked against another key (same key id) do not verify, so the check discriminates.
async fn every_grant_is_signed_for_its_key_token_and_owner(kind: Kind) {
    let s = start(kind).await;
    let a = s.client.open_session("signed-a", TTL).await.unwrap();
    let b = s.client.open_session("signed-b", TTL).await.unwrap();
    let verify = |v: &Verifier, g: &GrantHandle| {
        v.verify(g.key(), g.token().get(), g.owner(), g.signature())
    };

    let first = grant(&a, "payout:signed-1").await;
    let narrower = match a
        .acquire_as("payout:signed-2", "signed-a/p-1", Duration::ZERO)
        .await
        .unwrap()
    {
        Acquired::Granted(g) => g,
        other => panic!("not granted: {other:?}"),
    };
    let adopted = GrantHandle::reestablish(
        &s.client,
        "payout:signed-1",
        "signed-a",
        a.id(),
        first.token(),
    )
    .await
    .unwrap();
    for g in [&first, &narrower, &adopted] {
        assert_eq!(g.signature().key_id, SIGNING_KEY_ID, "{g:?}");
        assert_eq!(verify(&s.verifier, g), Ok(()), "{g:?}");
    }
    assert_eq!(
        adopted.signature(),
        first.signature(),
        "one grant, one signature"
    );
    // Bound to its key, token and owner.
    let sig = first.signature();
    let token = first.token().get();
    for (key, token, owner) in [
        ("payout:signed-2", token, "signed-a"),
        ("payout:signed-1", token + 1, "signed-a"),
        ("payout:signed-1", i64::MAX as u64, "signed-a"),
        ("payout:signed-1", token, "signed-b"),
    ] {
        assert_eq!(
            s.verifier.verify(key, token, owner, sig),
            Err(Forged::BadSignature),
            "{key} {token} {owner}"
        );
    }

    // A waiter's grant, handed over by the release, is signed too.
    let b2 = b.clone();
    let waiter = tokio::spawn(async move {
        b2.acquire("payout:signed-1", Duration::from_secs(20))
            .await
            .unwrap()
            .granted()
            .expect("waiter granted")
    });
    testkit::eventually(Duration::from_secs(5), "waiter registered", || {
        let c = s.client.clone();
        async move {
            c.describe("payout:signed-1")
                .await
                .ok()
                .filter(|d| d.waiter_count == 1)
        }
    })
    .await
    .unwrap();
    adopted.release().await.unwrap();
    let waited = waiter.await.unwrap();
    assert_eq!(verify(&s.verifier, &waited), Ok(()));

    // Control: another key under the same id verifies none of them.
    let other = Verifier::new([signer().public_key()]).unwrap();
    for g in [&first, &narrower, &waited] {
        assert_eq!(verify(&other, g), Err(Forged::BadSignature), "{g:?}");
    }
    s.server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_every_grant_is_signed_for_its_key_token_and_owner() {
    every_grant_is_signed_for_its_key_token_and_owner(Kind::Etcd).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_every_grant_is_signed_for_its_key_token_and_owner() {
    every_grant_is_signed_for_its_key_token_and_owner(Kind::Postgres).await;
}

// ---------------------------------------------------------------------------------------------
// Session death, force-revoke

async fn session_death_and_force_revoke(kind: Kind) {
    let s = start(kind).await;
    let a = s.client.open_session("worker-a", TTL).await.unwrap();
    let b = s.client.open_session("worker-b", TTL).await.unwrap();
    let keys = ["payout:k1", "payout:k2", "payout:k3"];
    let mut tokens = Vec::new();
    for k in keys {
        tokens.push(grant(&a, k).await.token());
    }
    // One action releases every lock of the session.
    a.close().await.unwrap();
    assert!(!a.is_alive());
    for (k, t) in keys.iter().zip(&tokens) {
        let g = grant(&b, k).await;
        assert!(g.token() > *t, "{k}: next token above the dead session's");
    }

    // Force-revoke: audited, alerted, and the next token is higher.
    let held = grant(&b, "payout:revoked").await;
    // The operator recorded is the one the certificate carries: another operator's name, or an
    // operator's name from a worker's certificate, is refused, counted, and revokes nothing. (The
    // same call with the certificate's own name, below, is carried out: the name decides.)
    let unauthorised = |text: &str| -> f64 {
        text.lines()
            .filter(|l| {
                l.starts_with("unauthorised_calls_total") && l.contains("operator_not_certified")
            })
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum()
    };
    for (client, name) in [
        (&s.operator, "another-operator"),
        (&s.client, testkit::pki::TEST_OPERATOR),
    ] {
        let e = client
            .force_revoke("payout:revoked", held.token(), name, "not mine to give")
            .await
            .unwrap_err();
        assert!(
            matches!(rejection(&e), Rejection::OperatorNotCertified(o) if o.operator == name),
            "{e:?}"
        );
    }
    assert_eq!(s.server.service.event_count("revoked"), 0);
    assert!(held.is_held(), "a refused revoke takes nothing");
    assert_eq!(unauthorised(&s.server.metrics.render()), 2.0);
    let r = s
        .operator
        .force_revoke(
            "payout:revoked",
            held.token(),
            testkit::pki::TEST_OPERATOR,
            "stuck worker, ticket 42",
        )
        .await
        .unwrap();
    assert_eq!(
        (r.revoked_token, r.revoked_owner.as_str()),
        (held.token().get(), "worker-b")
    );
    assert_eq!(s.server.service.event_count("revoked"), 1);
    let c = s.client.open_session("worker-c", TTL).await.unwrap();
    let next = grant(&c, "payout:revoked").await;
    assert!(
        next.token() > held.token(),
        "force-revoke must make the next token higher"
    );
    // The deposed holder hears of it within one lease while its session lives on (INV-06): its
    // session's next keep-alive round renews the grant and is refused. Before lock-client vouched
    // for each grant, `is_held()` stayed true for as long as the session lived.
    let learned = tokio::time::timeout(TTL, async {
        while held.is_held() {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
    assert!(
        learned.is_ok(),
        "the deposed holder still believes after one lease"
    );
    assert!(b.is_alive(), "the revoke took one key, not the session");
    // The deposed holder can neither renew nor release.
    assert!(matches!(
        rejection(&held.renew().await.unwrap_err()),
        Rejection::NotHolder(_)
    ));
    // Revoking a free key is a typed refusal.
    next.release().await.unwrap();
    let e = s
        .operator
        .force_revoke(
            "payout:revoked",
            next.token(),
            testkit::pki::TEST_OPERATOR,
            "again",
        )
        .await
        .unwrap_err();
    assert!(matches!(rejection(&e), Rejection::NotHeld(_)));
    // The audit record exists in the backend.
    match s.server.service.backend() {
        lock_server::backend::Backend::Etcd(e) => {
            let audit = e.audit_records().await.unwrap();
            assert_eq!(audit.len(), 1);
            assert_eq!(audit[0]["operator"], testkit::pki::TEST_OPERATOR);
            assert_eq!(audit[0]["revoked_token"], held.token().get());
        }
        lock_server::backend::Backend::Postgres(p) => {
            let (operator, token): (String, i64) =
                sqlx::query_as("SELECT operator, revoked_token FROM lock_audit")
                    .fetch_one(p.pool())
                    .await
                    .unwrap();
            assert_eq!(
                (operator.as_str(), token as u64),
                (testkit::pki::TEST_OPERATOR, held.token().get())
            );
        }
    }
    s.server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_session_death_and_force_revoke() {
    session_death_and_force_revoke(Kind::Etcd).await;
}
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_session_death_and_force_revoke() {
    session_death_and_force_revoke(Kind::Postgres).await;
}

/// Negative control of the certified-operator check in `*_session_death_and_force_revoke`: with
/// the check switched off in-process, an operator's certificate naming another operator takes the
/// key, and the audit record names the operator the call could not prove it was: the test above
/// sees what it claims to.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn negative_control_without_operator_certification_another_name_revokes() {
    let s = start_shaped(
        backend(Kind::Postgres, "uncertified").await,
        lock_server::service::WAITERS_MAX,
        lock_server::service::BOUNDS,
        LockServiceImpl::without_operator_certification_for_tests,
    )
    .await;
    let b = s.client.open_session("worker-b", TTL).await.unwrap();
    let held = grant(&b, "payout:revoked").await;
    let r = s
        .operator
        .force_revoke(
            "payout:revoked",
            held.token(),
            "another-operator",
            "not mine to give",
        )
        .await
        .unwrap();
    assert_eq!(r.revoked_token, held.token().get());
    let lock_server::backend::Backend::Postgres(p) = s.server.service.backend() else {
        panic!("a PostgreSQL backend was asked for");
    };
    let operator: String = sqlx::query_scalar("SELECT operator FROM lock_audit")
        .fetch_one(p.pool())
        .await
        .unwrap();
    assert_eq!(operator, "another-operator");
    s.server.stop().await;
}

/// The force-revoke audit records the backend holds (etcd's chain, lockdb's `lock_audit`).
async fn audit_record_count(s: &Server) -> usize {
    match s.server.service.backend() {
        lock_server::backend::Backend::Etcd(e) => e.audit_records().await.unwrap().len(),
        lock_server::backend::Backend::Postgres(p) => {
            let n: i64 = sqlx::query_scalar("SELECT count(*) FROM lock_audit")
                .fetch_one(p.pool())
                .await
                .unwrap();
            n as usize
        }
    }
}

/// `lock_force_revokes_refused_total{reason}` as the server's /metrics renders it (0 if absent).
fn revokes_refused(s: &Server, reason: &str) -> f64 {
    s.server
        .metrics
        .render()
        .lines()
        .filter(|l| {
            l.starts_with("lock_force_revokes_refused_total{")
                && l.contains(&format!(r#"reason="{reason}""#))
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// A force-revoke takes only the grant the caller looked at (issue 35, item 5): the expected
/// token is compared in the backend's transaction with the revoke. A holds the key (t1): a
/// revoke expecting t1 is carried out. B then takes the key (t2): a revoke still expecting t1 is
/// refused as HolderChanged naming both tokens; B keeps its grant (its own renew goes through),
/// nothing is audited, the revoke counter (the LockForceRevoked alert's series) stays, and the
/// refusal is counted on its own. A revoke expecting t2 is carried out. Before the expectation
/// was compared (the server ignored the field), the revoke expecting t1 deposed B.
async fn force_revoke_takes_only_the_grant_it_expects(kind: Kind) {
    let s = start(kind).await;
    let a = s.client.open_session("worker-a", TTL).await.unwrap();
    let b = s.client.open_session("worker-b", TTL).await.unwrap();
    let key = "payout:acct-expected";
    let t1 = grant(&a, key).await;
    let r = s
        .operator
        .force_revoke(key, t1.token(), testkit::pki::TEST_OPERATOR, "A is wedged")
        .await
        .unwrap();
    assert_eq!(
        (r.revoked_token, r.revoked_owner.as_str()),
        (t1.token().get(), "worker-a")
    );
    assert_eq!(s.server.service.event_count("revoked"), 1);
    assert_eq!(audit_record_count(&s).await, 1);

    let t2 = grant(&b, key).await;
    assert!(t2.token() > t1.token());
    let e = s
        .operator
        .force_revoke(
            key,
            t1.token(),
            testkit::pki::TEST_OPERATOR,
            "A is wedged (looked at before B took the key)",
        )
        .await
        .unwrap_err();
    match rejection(&e) {
        Rejection::HolderChanged(h) => assert_eq!(
            (h.key.as_str(), h.expected_token, h.current_token),
            (key, t1.token().get(), t2.token().get())
        ),
        other => panic!("expected HolderChanged, got {other:?} ({e})"),
    }
    assert!(
        e.to_string().contains("holder_changed"),
        "the message names the refusal: {e}"
    );
    assert!(t2.is_held(), "the refused revoke took nothing from B");
    t2.renew()
        .await
        .expect("B is still the holder in the backend");
    let d = s.client.describe(key).await.unwrap();
    assert_eq!((d.held, d.token), (true, t2.token().get()));
    assert_eq!(
        s.server.service.event_count("revoked"),
        1,
        "a refused revoke is not counted as one (LockForceRevoked stays quiet)"
    );
    assert_eq!(
        audit_record_count(&s).await,
        1,
        "a refused revoke is not audited"
    );
    assert_eq!(revokes_refused(&s, "holder_changed"), 1.0);

    let r = s
        .operator
        .force_revoke(key, t2.token(), testkit::pki::TEST_OPERATOR, "B is wedged")
        .await
        .unwrap();
    assert_eq!(
        (r.revoked_token, r.revoked_owner.as_str()),
        (t2.token().get(), "worker-b")
    );
    assert_eq!(s.server.service.event_count("revoked"), 2);
    assert_eq!(audit_record_count(&s).await, 2);

    // On the wire, 0 is never a token; a request without the field (a caller from before it)
    // still revokes whatever holds the key.
    let mut raw = s.operator.rpc();
    let t3 = grant(&a, key).await;
    let status = raw
        .force_revoke(pb::ForceRevokeRequest {
            key: key.into(),
            operator: testkit::pki::TEST_OPERATOR.into(),
            reason: "zero".into(),
            expected_token: Some(0),
        })
        .await
        .unwrap_err();
    assert_eq!(status.code(), tonic::Code::InvalidArgument);
    assert!(t3.is_held());
    let r = raw
        .force_revoke(pb::ForceRevokeRequest {
            key: key.into(),
            operator: testkit::pki::TEST_OPERATOR.into(),
            reason: "an old client".into(),
            expected_token: None,
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(r.revoked_token, t3.token().get());
    assert_eq!(revokes_refused(&s, "holder_changed"), 1.0);
    s.server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_force_revoke_takes_only_the_grant_it_expects() {
    force_revoke_takes_only_the_grant_it_expects(Kind::Etcd).await;
}
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_force_revoke_takes_only_the_grant_it_expects() {
    force_revoke_takes_only_the_grant_it_expects(Kind::Postgres).await;
}

/// `lock_force_revokes_total{by}` as the server's /metrics renders it (0 if absent).
fn force_revokes_by(s: &Server, by: &str) -> f64 {
    rendered_sum(s, "lock_force_revokes_total{", &format!(r#"by="{by}""#))
}

/// The sum of the server's /metrics lines of `series` (a name and its opening brace) that carry
/// `label` (0 if none).
fn rendered_sum(s: &Server, series: &str, label: &str) -> f64 {
    s.server
        .metrics
        .render()
        .lines()
        .filter(|l| l.starts_with(series) && l.contains(label))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// Who force-revoked is in the revoke's series, taken from the caller's verified certificate role
/// (issue 35, on-call): the resolver's takeover (a Reconciler certificate, acting under its
/// role's name) counts under `by="resolver"` (LockTakeoversRepeating, only when takeovers
/// repeat), an operator's break-glass under `by="operator"` (LockForceRevoked pages). An
/// operator's certificate naming the resolver is refused and counts under neither: the request's
/// operator field cannot make a break-glass look like a takeover. Every revoke still counts in
/// `lock_events_total{event="revoked"}` (dashboards). Before, the revoke counter had no `by`:
/// both revokes counted only in `lock_events_total`, which paged for each takeover.
async fn a_takeover_is_counted_apart_from_an_operators_break_glass(kind: Kind) {
    let s = start(kind).await;
    let resolver = LockClient::connect(&s.server.endpoint, &tls(Role::Reconciler))
        .await
        .expect("the resolver connects");
    let a = s.client.open_session("worker-a", TTL).await.unwrap();
    let b = s.client.open_session("worker-b", TTL).await.unwrap();
    let key = "payout:acct-takeover";

    let orphaned = grant(&a, key).await;
    let e = s
        .operator
        .force_revoke(
            key,
            orphaned.token(),
            Role::Reconciler.name(),
            "an operator posing as the resolver",
        )
        .await
        .unwrap_err();
    assert!(
        matches!(rejection(&e), Rejection::OperatorNotCertified(_)),
        "{e:?}"
    );
    assert!(orphaned.is_held(), "a refused revoke takes nothing");
    let r = resolver
        .force_revoke(
            key,
            orphaned.token(),
            Role::Reconciler.name(),
            "takeover: the payout's workflow is not running",
        )
        .await
        .unwrap();
    assert_eq!(r.revoked_token, orphaned.token().get());
    assert_eq!(
        (
            force_revokes_by(&s, "resolver"),
            force_revokes_by(&s, "operator")
        ),
        (1.0, 0.0),
        "the takeover counts under the resolver only"
    );

    let wedged = grant(&b, key).await;
    let r = s
        .operator
        .force_revoke(
            key,
            wedged.token(),
            testkit::pki::TEST_OPERATOR,
            "break-glass: a wedged worker",
        )
        .await
        .unwrap();
    assert_eq!(r.revoked_token, wedged.token().get());
    assert_eq!(
        (
            force_revokes_by(&s, "resolver"),
            force_revokes_by(&s, "operator")
        ),
        (1.0, 1.0),
        "the break-glass counts under the operator only"
    );
    assert_eq!(
        rendered_sum(&s, "lock_events_total{", r#"event="revoked""#),
        2.0,
        "every revoke still counts in the series dashboards read"
    );
    s.server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_a_takeover_is_counted_apart_from_an_operators_break_glass() {
    a_takeover_is_counted_apart_from_an_operators_break_glass(Kind::Etcd).await;
}
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_takeover_is_counted_apart_from_an_operators_break_glass() {
    a_takeover_is_counted_apart_from_an_operators_break_glass(Kind::Postgres).await;
}

// ---------------------------------------------------------------------------------------------
// Expiry: the client gives up before the server; renew after expiry fails

/// Waits until Describe shows `n` callers queued for `key`.
async fn queued(client: &LockClient, key: &str, n: u64) {
    testkit::eventually(
        Duration::from_secs(10),
        &format!("{n} queued for {key}"),
        || {
            let c = client.clone();
            let key = key.to_string();
            async move { c.describe(&key).await.ok().filter(|d| d.waiter_count == n) }
        },
    )
    .await
    .unwrap();
}

/// First come, first served: waiters are granted in the order they asked, a later arrival never
/// passes an earlier one, a caller whose call ended keeps its place for its next call, and the
/// holder asking again for what it holds is answered at once (never queued behind its own grant).
async fn waiters_are_served_in_the_order_they_asked(kind: Kind) {
    let s = start(kind).await;
    let key = "payout:fifo";
    let holder = s.client.open_session("holder", TTL * 5).await.unwrap();
    let held = grant(&holder, key).await;
    let waiters = s.client.open_session("waiters", TTL * 5).await.unwrap();
    let order = Arc::new(Mutex::new(Vec::new()));
    let mut tasks = Vec::new();
    // "w0" first asks with a short wait that ends unanswered, then asks again at once: its place
    // is kept, so it stays ahead of w1.. that queued while its first call was out.
    let first = waiters
        .acquire_as(key, "w0", Duration::from_millis(300))
        .await
        .unwrap();
    assert!(first.granted().is_none(), "the key is held");
    for i in 0..6 {
        let session = waiters.clone();
        let order = order.clone();
        let owner = format!("w{i}");
        tasks.push(tokio::spawn(async move {
            let granted = session
                .acquire_as(key, &owner, Duration::from_secs(30))
                .await
                .unwrap()
                .granted()
                .unwrap_or_else(|| panic!("{owner} granted within its wait"));
            order.lock().unwrap().push(owner);
            // Hold it briefly, as a payout does, then hand it on.
            tokio::time::sleep(Duration::from_millis(50)).await;
            granted.release().await.unwrap();
        }));
        queued(&s.client, key, i as u64 + 1).await;
    }
    // The holder asks again while six wait: the same grant back, at once.
    let again = holder
        .acquire(key, Duration::from_secs(5))
        .await
        .unwrap()
        .granted()
        .expect("the holder's own grant");
    assert_eq!(again.token(), held.token());
    // A caller that will not wait is refused without taking a place.
    let tried = holder
        .acquire_as(key, "impatient", Duration::ZERO)
        .await
        .unwrap();
    assert!(tried.granted().is_none());
    held.release().await.unwrap();
    for t in tasks {
        t.await.unwrap();
    }
    let order = order.lock().unwrap().clone();
    assert_eq!(
        order,
        (0..6).map(|i| format!("w{i}")).collect::<Vec<_>>(),
        "{kind:?}: granted in the order asked"
    );
    assert_eq!(s.client.describe(key).await.unwrap().waiter_count, 0);
    s.server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_waiters_are_served_in_the_order_they_asked() {
    waiters_are_served_in_the_order_they_asked(Kind::Etcd).await;
}
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_waiters_are_served_in_the_order_they_asked() {
    waiters_are_served_in_the_order_they_asked(Kind::Postgres).await;
}

/// A waiter whose caller goes away (its call dropped: a worker cancelled the activity, or died)
/// leaves the line, and the next one is served without waiting for it.
async fn a_waiter_that_goes_away_leaves_the_line(kind: Kind) {
    let s = start(kind).await;
    let key = "payout:fifo-leave";
    let holder = s.client.open_session("holder", TTL * 5).await.unwrap();
    let held = grant(&holder, key).await;
    let waiters = s.client.open_session("waiters", TTL * 5).await.unwrap();
    let gone = {
        let session = waiters.clone();
        tokio::spawn(async move {
            session
                .acquire_as(key, "gone", Duration::from_secs(30))
                .await
        })
    };
    queued(&s.client, key, 1).await;
    let next = {
        let session = waiters.clone();
        tokio::spawn(async move {
            session
                .acquire_as(key, "next", Duration::from_secs(30))
                .await
        })
    };
    queued(&s.client, key, 2).await;
    gone.abort();
    queued(&s.client, key, 1).await;
    let t0 = Instant::now();
    held.release().await.unwrap();
    let granted = next
        .await
        .unwrap()
        .unwrap()
        .granted()
        .expect("next is granted");
    assert_eq!(granted.owner(), "next");
    assert!(t0.elapsed() < Duration::from_secs(5), "{:?}", t0.elapsed());
    s.server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_a_waiter_that_goes_away_leaves_the_line() {
    a_waiter_that_goes_away_leaves_the_line(Kind::Etcd).await;
}
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_waiter_that_goes_away_leaves_the_line() {
    a_waiter_that_goes_away_leaves_the_line(Kind::Postgres).await;
}

// ---------------------------------------------------------------------------------------------
// The waiter bound (`service::WAITERS_MAX`, per service)

/// A bound small enough to fill with a few callers.
const WAITERS_MAX_IN_TEST: usize = 2;
/// Long enough that a parked caller is still waiting when the test looks, and that an answer
/// within [`AT_ONCE`] cannot be its wait running out.
const LONG_WAIT: Duration = Duration::from_secs(30);
/// An answer this quick was not a wait.
const AT_ONCE: Duration = Duration::from_secs(5);

/// `lock_events_total{event="waiters_full"}` as the server's /metrics renders it (0 if absent).
fn waiters_full_rendered(s: &Server) -> u64 {
    s.server
        .metrics
        .render()
        .lines()
        .filter(|l| l.starts_with("lock_events_total{") && l.contains(r#"event="waiters_full""#))
        .map(|l| {
            l.rsplit(' ')
                .next()
                .and_then(|v| v.parse::<u64>().ok())
                .unwrap_or_else(|| panic!("unreadable metric line {l:?}"))
        })
        .sum()
}

/// An Acquire of `key` under `owner` with [`LONG_WAIT`], running on its own.
fn park(
    session: &Session,
    key: &'static str,
    owner: &'static str,
) -> tokio::task::JoinHandle<Result<Acquired, ClientError>> {
    let session = session.clone();
    tokio::spawn(async move { session.acquire_as(key, owner, LONG_WAIT).await })
}

/// The grant a parked call ended with, under `owner`.
async fn granted_to(
    call: tokio::task::JoinHandle<Result<Acquired, ClientError>>,
    owner: &str,
) -> GrantHandle {
    let granted = tokio::time::timeout(AT_ONCE, call)
        .await
        .unwrap_or_else(|_| panic!("{owner} not granted within {AT_ONCE:?} of its turn"))
        .unwrap()
        .unwrap()
        .granted()
        .unwrap_or_else(|| panic!("{owner} not granted"));
    assert_eq!(granted.owner(), owner, "granted out of turn");
    granted
}

/// The scenario both the bound's test and its negative control run: `holder` holds `key` and
/// `other`, two callers ("w1", "w2") park on `key` with a long wait and are seen queued. Then a
/// third caller asks for `key` ("w3", it would queue behind the two) and a fourth for `other`
/// ("w4", nobody waits there, it would start the line): each call is returned running.
struct Parked {
    holder: Session,
    held: GrantHandle,
    held_other: GrantHandle,
    waiters: Session,
    w1: tokio::task::JoinHandle<Result<Acquired, ClientError>>,
    w2: tokio::task::JoinHandle<Result<Acquired, ClientError>>,
    w3: tokio::task::JoinHandle<Result<Acquired, ClientError>>,
    w4: tokio::task::JoinHandle<Result<Acquired, ClientError>>,
}

const BOUNDED_KEY: &str = "payout:bounded";
const BOUNDED_OTHER: &str = "payout:bounded-other";

async fn two_parked_then_two_more_ask(s: &Server) -> Parked {
    let holder = s.client.open_session("holder", TTL * 5).await.unwrap();
    let held = grant(&holder, BOUNDED_KEY).await;
    let held_other = grant(&holder, BOUNDED_OTHER).await;
    let waiters = s.client.open_session("waiters", TTL * 5).await.unwrap();
    let w1 = park(&waiters, BOUNDED_KEY, "w1");
    queued(&s.client, BOUNDED_KEY, 1).await;
    let w2 = park(&waiters, BOUNDED_KEY, "w2");
    queued(&s.client, BOUNDED_KEY, 2).await;
    let w3 = park(&waiters, BOUNDED_KEY, "w3");
    let w4 = park(&waiters, BOUNDED_OTHER, "w4");
    Parked {
        holder,
        held,
        held_other,
        waiters,
        w1,
        w2,
        w3,
        w4,
    }
}

/// The refusal of a call past the bound: RESOURCE_EXHAUSTED at once, saying why.
async fn refused_at_once(call: tokio::task::JoinHandle<Result<Acquired, ClientError>>, who: &str) {
    let answer = tokio::time::timeout(AT_ONCE, call)
        .await
        .unwrap_or_else(|_| panic!("{who} parked past the bound instead of being refused"))
        .unwrap();
    match answer {
        Err(ClientError::Status(status)) => {
            assert_eq!(
                status.code(),
                tonic::Code::ResourceExhausted,
                "{who}: {status:?}"
            );
            assert!(
                status.message().contains(&format!(
                    "{WAITERS_MAX_IN_TEST} callers already wait for locks in this server, its bound is {WAITERS_MAX_IN_TEST}; retry later"
                )),
                "{who}: unclear message {:?}",
                status.message()
            );
        }
        other => panic!("{who} answered {other:?}, not refused RESOURCE_EXHAUSTED"),
    }
}

/// The waiter bound holds: with a bound of two and two callers parked on a held key, a third
/// Acquire that would park behind them, and a fourth that would start the line of another held
/// key (the two places an Acquire starts waiting), are refused at once with RESOURCE_EXHAUSTED
/// and a message naming the bound, each counted as `lock_events_total{event="waiters_full"}`;
/// neither was granted, queued or left a place behind. An Acquire that does not have to wait is
/// answered as ever while the line is full: a free key is granted (though the call would have
/// waited), the holder asking again for what it holds gets its own token back, and a caller that
/// will not wait, for a held key nobody waits for or for the full line's key, is answered
/// NotAcquired. When the holder
/// releases, the first waiter is granted, then the second (first come, first served), and the
/// room the first left lets a new caller park again. Negative control:
/// `negative_control_without_the_waiter_bound_the_third_caller_parks`.
async fn waiters_past_the_bound_are_refused_at_once(kind: Kind) {
    let s = start_bounded(backend(kind, "lock").await, WAITERS_MAX_IN_TEST).await;
    assert_eq!(s.server.service.waiters_max(), WAITERS_MAX_IN_TEST);
    let p = two_parked_then_two_more_ask(&s).await;
    refused_at_once(p.w3, "w3 (behind two waiters)").await;
    refused_at_once(p.w4, "w4 (first for another key)").await;
    assert_eq!(s.server.service.event_count("waiters_full"), 2, "{kind:?}");
    assert_eq!(waiters_full_rendered(&s), 2, "{kind:?}: /metrics");
    // Nothing granted or queued for them: the same holders and tokens, the same lines.
    for (key, held, waiting) in [(BOUNDED_KEY, &p.held, 2), (BOUNDED_OTHER, &p.held_other, 0)] {
        let d = s.client.describe(key).await.unwrap();
        assert!(d.held && d.holder_owner == "holder", "{key}: {d:?}");
        assert_eq!(d.token, held.token().get(), "{key}: {d:?}");
        assert_eq!(d.waiter_count, waiting, "{key}: {d:?}");
    }
    // What need not wait is not refused while the line is full.
    let free = p
        .waiters
        .acquire_as("payout:bounded-free", "w5", LONG_WAIT)
        .await
        .expect("a free key is not refused")
        .granted()
        .expect("a free key is granted");
    let again = grant(&p.holder, BOUNDED_KEY).await;
    assert_eq!(again.token(), p.held.token(), "the holder's own grant back");
    let tried = p
        .waiters
        .acquire_as(BOUNDED_OTHER, "w6", Duration::ZERO)
        .await
        .expect("a caller that will not wait is not refused");
    assert!(tried.granted().is_none(), "{BOUNDED_OTHER} is held");
    // Nor is a caller that will not wait for a key whose line is full: it takes no place, so
    // its answer is NotAcquired, not the bound.
    let behind = p
        .waiters
        .acquire_as(BOUNDED_KEY, "w8", Duration::ZERO)
        .await
        .expect("a caller that will not wait is not refused by the full line");
    assert!(behind.granted().is_none(), "{BOUNDED_KEY} is held");
    assert_eq!(s.server.service.event_count("waiters_full"), 2, "{kind:?}");
    // The holder releases: the first waiter is granted, and its room lets a new caller park.
    p.held.release().await.unwrap();
    let g1 = granted_to(p.w1, "w1").await;
    queued(&s.client, BOUNDED_KEY, 1).await;
    let w7 = park(&p.waiters, BOUNDED_KEY, "w7");
    queued(&s.client, BOUNDED_KEY, 2).await;
    assert_eq!(
        s.server.service.event_count("waiters_full"),
        2,
        "{kind:?}: a caller was refused though room was freed"
    );
    g1.release().await.unwrap();
    let g2 = granted_to(p.w2, "w2").await;
    g2.release().await.unwrap();
    granted_to(w7, "w7").await.release().await.unwrap();
    free.release().await.unwrap();
    assert_eq!(
        s.client.describe(BOUNDED_KEY).await.unwrap().waiter_count,
        0
    );
    s.server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_waiters_past_the_bound_are_refused_at_once() {
    waiters_past_the_bound_are_refused_at_once(Kind::Etcd).await;
}
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_waiters_past_the_bound_are_refused_at_once() {
    waiters_past_the_bound_are_refused_at_once(Kind::Postgres).await;
}

/// Negative control of `waiters_past_the_bound_are_refused_at_once`: the same scenario on a
/// server whose waiter bound is off (`usize::MAX`) parks the third and the fourth caller instead
/// of refusing them (Describe counts three and one waiting, nothing is counted as
/// `waiters_full`), and they are served in turn. So that test fails if the bound is missing.
async fn negative_control_without_the_waiter_bound_the_third_caller_parks(kind: Kind) {
    let s = start_bounded(backend(kind, "lock").await, usize::MAX).await;
    let p = two_parked_then_two_more_ask(&s).await;
    queued(&s.client, BOUNDED_KEY, 3).await;
    queued(&s.client, BOUNDED_OTHER, 1).await;
    assert!(!p.w3.is_finished() && !p.w4.is_finished(), "{kind:?}");
    assert_eq!(s.server.service.event_count("waiters_full"), 0, "{kind:?}");
    assert_eq!(waiters_full_rendered(&s), 0, "{kind:?}: /metrics");
    p.held.release().await.unwrap();
    p.held_other.release().await.unwrap();
    granted_to(p.w4, "w4").await.release().await.unwrap();
    for (call, owner) in [(p.w1, "w1"), (p.w2, "w2"), (p.w3, "w3")] {
        granted_to(call, owner).await.release().await.unwrap();
    }
    s.server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_negative_control_without_the_waiter_bound_the_third_caller_parks() {
    negative_control_without_the_waiter_bound_the_third_caller_parks(Kind::Etcd).await;
}
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_negative_control_without_the_waiter_bound_the_third_caller_parks() {
    negative_control_without_the_waiter_bound_the_third_caller_parks(Kind::Postgres).await;
}

/// Two callers park for 1.5 s on a held key, on a server whose bounds are two requests at once
/// and a 3 s deadline (`grpc::Bounds`; the shipped ones are `WAITERS_MAX` + 512 and
/// `WAIT_MS_MAX` + 30 s). Answers what a third call (Describe) got while they were parked, how
/// long it took, and what an Acquire that asks to wait 6 s got once they were gone, after how long.
async fn calls_beside_two_parked(
    concurrency_max: usize,
    request_timeout_ms: u64,
) -> (
    Result<payout_proto::lock::DescribeResponse, ClientError>,
    Duration,
    Result<Acquired, ClientError>,
    Duration,
) {
    let s = start_with_bounds(
        backend(Kind::Etcd, "lock").await,
        lock_server::service::WAITERS_MAX,
        service_kit::grpc::Bounds {
            concurrency_max,
            request_timeout_ms,
        },
    )
    .await;
    // Sessions long enough for the whole test without keep-alives, which would take a request
    // slot of their own at any moment: only the calls below are in flight.
    let holder = s.client.open_session("holder", TTL * 15).await.unwrap();
    let held = grant(&holder, "payout:server-bounds").await;
    let waiters = s.client.open_session("waiters", TTL * 15).await.unwrap();
    holder.stop_keep_alive();
    waiters.stop_keep_alive();
    // A keep-alive already on its way when they stopped ends well within this.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let mut parked = Vec::new();
    for owner in ["w1", "w2"] {
        let waiters = waiters.clone();
        parked.push(tokio::spawn(async move {
            waiters
                .acquire_as("payout:server-bounds", owner, Duration::from_millis(1_500))
                .await
        }));
        let n = parked.len();
        if testkit::eventually(Duration::from_secs(5), "a caller parked", || {
            let service = s.server.service.clone();
            async move { (service.waiting() == n).then_some(()) }
        })
        .await
        .is_err()
        {
            let waiting = s.server.service.waiting();
            let mut answers = Vec::new();
            for call in parked {
                answers.push(call.await);
            }
            panic!("{waiting} parked; the calls answered {answers:?}");
        }
    }
    let asked = Instant::now();
    let described = s.client.describe("payout:server-bounds").await;
    let described_after = asked.elapsed();
    for call in parked {
        let answer = call.await.unwrap().unwrap();
        assert!(
            matches!(answer, Acquired::NotAcquired { .. }),
            "the key is held: {answer:?}"
        );
    }
    let asked = Instant::now();
    let long = waiters
        .acquire_as("payout:server-bounds", "w3", Duration::from_secs(6))
        .await;
    let long_after = asked.elapsed();
    // Whatever ended the long call, it left the line.
    testkit::eventually(Duration::from_secs(5), "the line empty", || {
        let service = s.server.service.clone();
        async move { (service.waiting() == 0).then_some(()) }
    })
    .await
    .unwrap();
    held.release().await.unwrap();
    s.server.stop().await;
    (described, described_after, long, long_after)
}

/// The server-wide bounds every server is built with (`service_kit::grpc::server`), shown on the
/// lock service, whose parked Acquires hold a request open: with two requests at once allowed
/// and two callers parked, a third call is shed at once with RESOURCE_EXHAUSTED (nothing ran;
/// retryable) instead of queueing behind them; and a request that would outlive the server's deadline is cut there (a
/// cancelled status at about 3 s, though it asked to wait 6 s), and the cut caller leaves the
/// line. Negative control: `negative_control_with_room_and_time_the_same_calls_are_served`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_sheds_calls_past_its_concurrency_bound_and_cuts_them_at_its_deadline() {
    let (described, described_after, long, long_after) = calls_beside_two_parked(2, 3_000).await;
    match described {
        // tonic's load shedding: RESOURCE_EXHAUSTED, "Too many active requests for the
        // connection"; nothing ran, so a caller may retry it.
        Err(ClientError::Status(status)) => {
            assert_eq!(status.code(), tonic::Code::ResourceExhausted, "{status:?}");
            assert!(
                status.message().contains("Too many active requests"),
                "{status:?}"
            );
        }
        other => panic!("Describe past the bound answered {other:?}, not shed"),
    }
    assert!(
        described_after < Duration::from_millis(1_000),
        "shed at once, not queued behind the parked calls: {described_after:?}"
    );
    match long {
        Err(ClientError::Status(status)) => {
            assert_eq!(status.code(), tonic::Code::Cancelled, "{status:?}");
        }
        other => panic!("an Acquire past the deadline answered {other:?}"),
    }
    assert!(
        long_after >= Duration::from_millis(2_500) && long_after < Duration::from_millis(5_500),
        "cut at the server's 3 s deadline, not at its own 6 s: {long_after:?}"
    );
}

/// Negative control of `a_server_sheds_calls_past_its_concurrency_bound_and_cuts_them_at_its_deadline`:
/// the same calls on a server with room (100 requests at once) and time (a 30 s deadline): the
/// third call is served while the two are parked, and the long Acquire waits out its own 6 s and
/// is answered NotAcquired. So that test fails if either bound is missing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn negative_control_with_room_and_time_the_same_calls_are_served() {
    let (described, _, long, long_after) = calls_beside_two_parked(100, 30_000).await;
    let described = described.expect("served beside the parked calls");
    assert_eq!(described.waiter_count, 2, "{described:?}");
    let long = long.expect("answered");
    assert!(matches!(long, Acquired::NotAcquired { .. }), "{long:?}");
    assert!(long_after >= Duration::from_millis(5_500), "{long_after:?}");
}

async fn expiry(kind: Kind) {
    let s = start(kind).await;
    let a = s.client.open_session("worker-a", TTL).await.unwrap();
    let g = grant(&a, "payout:expiring").await;
    let mut lost = g.lost();
    // A partitioned client: no more keep-alives.
    a.stop_keep_alive();
    lost.wait_for(|l| *l).await.unwrap();
    let client_lost_at = Instant::now();
    assert!(!g.is_held());
    // Server expiry: the moment Describe first reports the key free (10 ms polls).
    let c = s.client.clone();
    let server_expired_at = tokio::time::timeout(Duration::from_secs(10), async {
        loop {
            if !c.describe("payout:expiring").await.unwrap().held {
                return Instant::now();
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await
    .expect("the server expires the session");
    let margin = server_expired_at.saturating_duration_since(client_lost_at);
    println!(
        "{kind:?}: client reported loss {} ms before the server expired the session",
        margin.as_millis()
    );
    assert!(
        server_expired_at > client_lost_at,
        "the client must give up before the server"
    );
    // Renew after expiry fails, typed.
    let e = g.renew().await.unwrap_err();
    assert!(
        matches!(
            rejection(&e),
            Rejection::NotHolder(_) | Rejection::SessionNotFound(_)
        ),
        "renew after expiry: {e:?}"
    );
    // Acquire on a lost session fails closed locally.
    assert!(matches!(
        a.acquire("payout:other", Duration::ZERO).await,
        Err(ClientError::SessionLost)
    ));
    s.server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_expiry() {
    expiry(Kind::Etcd).await;
}
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_expiry() {
    expiry(Kind::Postgres).await;
}

// ---------------------------------------------------------------------------------------------
// Contention, checked by the history checker

/// Workers, keys and rounds: enough contention to exercise every transition on a 2-core machine
/// in a few seconds.
const WORKERS: usize = 6;
const KEYS: usize = 3;
const ROUNDS: usize = 12;

async fn contention(
    endpoint: String,
    label: &str,
    during: impl std::future::Future<Output = ()>,
) -> Vec<GrantRecord> {
    let epoch = Instant::now();
    let history = Arc::new(Mutex::new(Vec::new()));
    let ns = move |t: Instant| t.saturating_duration_since(epoch).as_nanos() as u64;
    let mut tasks = Vec::new();
    for w in 0..WORKERS {
        let history = history.clone();
        let client = LockClient::connect(&endpoint, &tls(Role::Worker))
            .await
            .unwrap();
        tasks.push(tokio::spawn(async move {
            let owner = format!("w{w}");
            let mut session: Option<Session> = None;
            let mut expiries_left = 1;
            for _ in 0..ROUNDS {
                let s = match &session {
                    Some(s) if s.is_alive() => s.clone(),
                    _ => match client.open_session(&owner, TTL).await {
                        Ok(s) => {
                            session = Some(s.clone());
                            s
                        }
                        Err(_) => continue,
                    },
                };
                let (key, hold_ms, action) = {
                    let mut rng = rand::rng();
                    (
                        format!("payout:key-{}", rng.random_range(0..KEYS)),
                        rng.random_range(0..40u64),
                        rng.random_range(0..10u32),
                    )
                };
                // Fail closed: an error is simply no grant.
                let Ok(Acquired::Granted(g)) = s.acquire(&key, Duration::from_millis(1500)).await
                else {
                    continue;
                };
                let start = Instant::now();
                let token = g.token().get();
                tokio::time::sleep(Duration::from_millis(hold_ms)).await;
                let end = match action {
                    // Crash: the session is closed without releasing.
                    0 => {
                        let end = Instant::now().min(g.deadline());
                        let _ = s.close().await;
                        session = None;
                        end
                    }
                    // Expiry: the client stops heart-beating and waits to notice the loss.
                    1 if expiries_left > 0 => {
                        expiries_left -= 1;
                        s.stop_keep_alive();
                        let mut lost = g.lost();
                        let _ = lost.wait_for(|l| *l).await;
                        session = None;
                        g.deadline()
                    }
                    _ => {
                        let end = Instant::now().min(g.deadline());
                        let _ = g.release().await;
                        end
                    }
                };
                history.lock().unwrap().push(GrantRecord {
                    key: key.clone(),
                    owner: owner.clone(),
                    token,
                    start_ns: ns(start),
                    end_ns: ns(end),
                });
            }
            if let Some(s) = session {
                let _ = s.close().await;
            }
        }));
    }
    during.await;
    for t in tasks {
        t.await.unwrap();
    }
    let history = history.lock().unwrap().clone();
    println!("{label}: {} grants recorded", history.len());
    history
}

async fn contention_checked(kind: Kind) {
    let s = start(kind).await;
    let history = contention(s.server.endpoint.clone(), &format!("{kind:?}"), async {}).await;
    assert!(
        history.len() >= WORKERS * ROUNDS / 3,
        "too few grants to mean anything: {}",
        history.len()
    );
    if let Err(v) = checker::check(&history) {
        panic!("{kind:?}: mutual exclusion or token order violated: {v:#?}");
    }
    assert_eq!(s.server.service.token_regression_count(), 0);
    s.server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_contention_history_is_linearizable() {
    contention_checked(Kind::Etcd).await;
}
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_contention_history_is_linearizable() {
    contention_checked(Kind::Postgres).await;
}

/// A three-member etcd cluster whose leader is killed mid-run: no two holders, tokens still
/// increase, and sessions are not mass-evicted by the election.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_three_members_leader_killed_mid_run() {
    let (stack, leader, s) = on_three_etcd_members("/leader-kill/").await;
    // A long-lived holder whose session must survive the election, with the deployment's session
    // TTL (the worker's `LOCK_TTL_MS_DEFAULT`, 10 s). A keep-alive in flight to the killed leader
    // can wait out the lock server's etcd request timeout (5 s, `REQUEST_TIMEOUT_MS`) before it is
    // retried on another member, so a session must outlive that: with a 5 s TTL, as this test had,
    // a clean-clone CI run under load lost the survivor ("the survivor's session must not be lost
    // to the election"), the keep-alive's retry landing after the client's own deadline.
    let survivor = s
        .client
        .open_session("survivor", Duration::from_secs(10))
        .await
        .unwrap();
    let kept = grant(&survivor, "payout:kept").await;
    let kill = async {
        tokio::time::sleep(Duration::from_millis(1500)).await;
        stack.etcd.members[leader].process.kill().unwrap();
        println!("killed etcd leader m{leader}");
    };
    let history = contention(s.server.endpoint.clone(), "etcd-3-leader-kill", kill).await;
    assert!(
        history.len() >= WORKERS * ROUNDS / 4,
        "too few grants: {}",
        history.len()
    );
    if let Err(v) = checker::check(&history) {
        panic!("leader kill: violated: {v:#?}");
    }
    // Not mass-evicted: the survivor's session and grant are intact after the election.
    assert!(
        kept.is_held(),
        "the survivor's session must not be lost to the election"
    );
    // Right after an election etcd may still answer an in-flight request "leader changed"
    // (typed BackendUnavailable); a holder's keep-alive retries that, and so does this check,
    // for a bounded time. Anything else, or no success in time, fails the test.
    testkit::eventually(Duration::from_secs(10), "renew after the election", || {
        let kept = &kept;
        async move {
            match kept.renew().await {
                Ok(_) => Some(()),
                Err(e) if matches!(rejection(&e), Rejection::BackendUnavailable(_)) => None,
                Err(e) => panic!("renew after the election: {e:?}"),
            }
        }
    })
    .await
    .unwrap();
    let d = s.client.describe("payout:kept").await.unwrap();
    assert_eq!((d.held, d.token), (true, kept.token().get()));
    s.server.stop().await;
}

// ---------------------------------------------------------------------------------------------
// INV-04: a restore that rewinds the backend is caught; the documented procedure prevents it

fn etcd_spec(
    dir: &Path,
    name: &str,
    data_dir: &Path,
    client_port: u16,
    peer_port: u16,
) -> testkit::ProcessSpec {
    let client = format!("https://127.0.0.1:{client_port}");
    let peer = format!("https://127.0.0.1:{peer_port}");
    testkit::ProcessSpec::new(name, "etcd", dir.join(format!("{name}.log")))
        .args(Stack::shared().etcd.tls.member_args())
        .args(["--name", "m0"])
        .args(["--data-dir".into(), data_dir.as_os_str().to_owned()])
        .args([
            "--listen-client-urls",
            &client,
            "--advertise-client-urls",
            &client,
        ])
        .args([
            "--listen-peer-urls",
            &peer,
            "--initial-advertise-peer-urls",
            &peer,
        ])
        .args([
            "--initial-cluster",
            &format!("m0={peer}"),
            "--initial-cluster-token",
            "restore-test",
        ])
        .args(testkit::etcd::EtcdLimits::default().args())
        .args(["--log-level", "warn", "--logger", "zap"])
}

fn etcdctl(endpoint: &str, args: &[&str]) {
    let out = std::process::Command::new("etcdctl")
        .env("ETCDCTL_API", "3")
        .args(Stack::shared().etcd.tls.etcdctl_args())
        .arg("--endpoints")
        .arg(endpoint)
        .args(args)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "etcdctl {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

fn restore(dir: &Path, snapshot: &Path, data_dir: &Path, peer_port: u16) {
    let peer = format!("https://127.0.0.1:{peer_port}");
    let out = std::process::Command::new("etcdctl")
        .env("ETCDCTL_API", "3")
        .args(["snapshot", "restore"])
        .arg(snapshot)
        .arg("--data-dir")
        .arg(data_dir)
        .args([
            "--name",
            "m0",
            "--initial-cluster",
            &format!("m0={peer}"),
            "--initial-advertise-peer-urls",
            &peer,
        ])
        .args(["--initial-cluster-token", "restore-test"])
        .current_dir(dir)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "restore: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

async fn etcd_ready(endpoint: &str) {
    testkit::eventually(Duration::from_secs(30), "etcd ready", || async {
        let mut c = Stack::shared()
            .etcd
            .tls
            .connect(&[endpoint.to_string()])
            .await
            .ok()?;
        c.status().await.ok().map(|_| ())
    })
    .await
    .unwrap();
}

/// Attempts one grant on `key` through a fresh lock-server using `issued` as its INV-04 record.
async fn grant_via(
    endpoint: &str,
    issued: &Path,
    key: &str,
) -> (Result<FencingToken, ClientError>, u64) {
    let config = Config {
        backend: BackendConfig::Etcd {
            endpoints: vec![endpoint.to_string()],
            // The test's own etcd runs without authentication (it shows a restore, not the
            // roles): any certificate of the authority it trusts will do.
            tls: Stack::shared().etcd_certificate_without_user("lock-server"),
            prefix: "/restore/".into(),
            grant_retention_ms: GRANT_RETENTION_MS_DEFAULT,
        },
        issued_tokens_path: issued.to_path_buf(),
        issued_tokens_limits: Default::default(),
        caller_limits: Default::default(),
        signer: signer(),
    };
    let server = InProcess::start_with_policy(&config, &tls(Role::LockServer), every_role())
        .await
        .unwrap();
    let client = LockClient::connect(&server.endpoint, &tls(Role::Worker))
        .await
        .unwrap();
    let session = client.open_session("restorer", TTL).await.unwrap();
    let result = session.acquire(key, Duration::ZERO).await.map(|a| match a {
        Acquired::Granted(g) => g.token(),
        Acquired::NotAcquired { .. } => panic!("{key} held"),
    });
    let regressions = server.service.token_regression_count();
    let _ = session.close().await;
    server.stop().await;
    (result, regressions)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_restore_from_snapshot_raises_token_regression_unless_revision_advanced() {
    let dir = tempfile::tempdir().unwrap();
    let issued = dir.path().join("issued-tokens.json");
    let (client_port, peer_port) = (testkit::free_port(), testkit::free_port());
    let endpoint = format!("https://127.0.0.1:{client_port}");
    let original = testkit::ManagedProcess::start(etcd_spec(
        dir.path(),
        "etcd-a",
        &dir.path().join("a"),
        client_port,
        peer_port,
    ))
    .unwrap();
    etcd_ready(&endpoint).await;

    let (first, _) = grant_via(&endpoint, &issued, "payout:k").await;
    let first = first.unwrap();
    let snapshot = dir.path().join("snap.db");
    etcdctl(&endpoint, &["snapshot", "save", snapshot.to_str().unwrap()]);
    // Life goes on after the backup: more grants, higher tokens.
    let mut last = first;
    for _ in 0..5 {
        let (t, _) = grant_via(&endpoint, &issued, "payout:k").await;
        last = t.unwrap();
    }
    assert!(last > first);
    original.kill().unwrap();

    // Disaster recovery WITHOUT the procedure: restore the old snapshot and serve.
    restore(dir.path(), &snapshot, &dir.path().join("b"), peer_port);
    let restored = testkit::ManagedProcess::start(etcd_spec(
        dir.path(),
        "etcd-b",
        &dir.path().join("b"),
        client_port,
        peer_port,
    ))
    .unwrap();
    etcd_ready(&endpoint).await;
    let (result, regressions) = grant_via(&endpoint, &issued, "payout:k").await;
    let e = result.expect_err("a rewound etcd must not produce a grant");
    match rejection(&e) {
        Rejection::TokenRegression(r) => {
            println!(
                "token_regression raised: etcd returned {} after {} had been issued",
                r.returned_token, r.highest_issued_token
            );
            assert_eq!(r.highest_issued_token, last.get());
            assert!(r.returned_token <= last.get());
        }
        other => panic!("expected TokenRegression, got {other:?}"),
    }
    assert_eq!(regressions, 1, "the token_regression counter fired");
    restored.kill().unwrap();

    // WITH the procedure (RESTORE.md): restore, then advance the revision past every token issued
    // before, then serve.
    restore(dir.path(), &snapshot, &dir.path().join("c"), peer_port);
    let procedure = testkit::ManagedProcess::start(etcd_spec(
        dir.path(),
        "etcd-c",
        &dir.path().join("c"),
        client_port,
        peer_port,
    ))
    .unwrap();
    etcd_ready(&endpoint).await;
    let mut etcd = etcd(std::slice::from_ref(&endpoint)).await;
    let highest_seen = last.get() as i64;
    loop {
        let r = etcd
            .put("/restore-procedure/scratch", "advance", None)
            .await
            .unwrap();
        if r.header().unwrap().revision() > highest_seen {
            break;
        }
    }
    let (result, regressions) = grant_via(&endpoint, &issued, "payout:k").await;
    let token = result.expect("after the procedure grants are issued again");
    assert!(
        token > last,
        "the first token after the procedure is above every token issued before"
    );
    assert_eq!(regressions, 0);
    procedure.kill().unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_sequence_rewind_raises_token_regression_unless_advanced() {
    let s = start(Kind::Postgres).await;
    let a = s.client.open_session("worker-a", TTL).await.unwrap();
    let mut last = grant(&a, "payout:k").await;
    for _ in 0..3 {
        last.release().await.unwrap();
        last = grant(&a, "payout:k").await;
    }
    let highest = last.token();
    last.release().await.unwrap();
    let lock_server::backend::Backend::Postgres(pg) = s.server.service.backend() else {
        unreachable!()
    };
    // What restoring an older backup does to the sequence (an administrator's act: the
    // server's own role may not set a sequence).
    let database = pg
        .pool()
        .connect_options()
        .get_database()
        .expect("a database name")
        .to_string();
    let admin = sqlx::PgPool::connect(&Stack::shared().pg(PgServer::Main).url(&database))
        .await
        .unwrap();
    sqlx::query("SELECT setval('lock_token_seq', 1)")
        .execute(&admin)
        .await
        .unwrap();
    let e = a
        .acquire("payout:k", Duration::ZERO)
        .await
        .expect_err("a rewound sequence must not produce a grant");
    assert!(
        matches!(rejection(&e), Rejection::TokenRegression(_)),
        "{e:?}"
    );
    assert_eq!(s.server.service.token_regression_count(), 1);
    // The regressed entry belongs to the session; end it, then apply the procedure.
    a.close().await.unwrap();
    sqlx::query("SELECT setval('lock_token_seq', $1)")
        .bind(highest.as_i64() + 1_000)
        .execute(&admin)
        .await
        .unwrap();
    let b = s.client.open_session("worker-b", TTL).await.unwrap();
    let after = grant(&b, "payout:k").await;
    assert!(after.token() > highest);
    assert_eq!(
        s.server.service.token_regression_count(),
        1,
        "no new alarm after the procedure"
    );
    s.server.stop().await;
}

// ---------------------------------------------------------------------------------------------
// A bounded backend: compacted history, grant records kept for a retention window

/// The kit's root client (its calls resent while another test's provisioning makes etcd refuse
/// them: `testkit::etcd::RootClient`).
async fn etcd(endpoints: &[String]) -> testkit::etcd::RootClient {
    testkit::etcd::RootClient::new(Stack::shared().etcd.tls.connect(endpoints).await.unwrap())
}

/// The grant records under `prefix`: (key, create revision), in key order.
async fn records(endpoints: &[String], prefix: &str) -> Vec<(String, u64)> {
    let got = etcd(endpoints)
        .await
        .get(
            format!("{prefix}grants/"),
            Some(
                etcd_client::GetOptions::new()
                    .with_prefix()
                    .with_keys_only(),
            ),
        )
        .await
        .unwrap();
    got.kvs()
        .iter()
        .map(|kv| {
            (
                String::from_utf8_lossy(kv.key()).into_owned(),
                kv.create_revision() as u64,
            )
        })
        .collect()
}

/// The tokens (create revisions) of the grant records under `prefix`, in order.
async fn record_tokens(endpoints: &[String], prefix: &str) -> Vec<u64> {
    let mut tokens: Vec<u64> = records(endpoints, prefix)
        .await
        .into_iter()
        .map(|(_, token)| token)
        .collect();
    tokens.sort_unstable();
    tokens
}

/// The retention leases whose markers are under `prefix`.
async fn retention_leases(endpoints: &[String], prefix: &str) -> Vec<i64> {
    let got = etcd(endpoints)
        .await
        .get(
            format!("{prefix}retention/"),
            Some(etcd_client::GetOptions::new().with_prefix()),
        )
        .await
        .unwrap();
    got.kvs().iter().map(|kv| kv.lease()).collect()
}

async fn lease_alive(endpoints: &[String], lease: i64) -> bool {
    etcd(endpoints)
        .await
        .lease_time_to_live(lease, None)
        .await
        .unwrap()
        .ttl()
        > 0
}

async fn start_retaining(prefix: &str, grant_retention_ms: u64) -> Server {
    start_with(BackendConfig::Etcd {
        endpoints: Stack::shared().etcd_endpoints(),
        tls: Stack::shared().etcd_identity_tls(EtcdRole::LockServer, prefix),
        prefix: prefix.to_string(),
        grant_retention_ms,
    })
    .await
}

/// etcd compacts its history (every test etcd keeps one second of it). A waiter watches the held
/// key from the revision at which it saw it held; when that revision was compacted away before
/// the watch started, the wait must end at once so the service reads the key again, instead of
/// waiting for a deletion event etcd can no longer send. Control: from a revision still in
/// history, the same wait lasts until its deadline while the key stays held.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_waiter_whose_watch_start_was_compacted_reads_the_key_again() {
    use lock_server::backend::{Backend, WaitFrom};
    let endpoints = Stack::shared().etcd_endpoints();
    let s = start(Kind::Etcd).await;
    let holder = s
        .client
        .open_session("holder", Duration::from_secs(10))
        .await
        .unwrap();
    let held = grant(&holder, "payout:compacted").await;
    let Backend::Etcd(backend) = s.server.service.backend() else {
        unreachable!()
    };
    let mut etcd = etcd(&endpoints).await;
    let seen = etcd
        .get("/compaction-probe", None)
        .await
        .unwrap()
        .header()
        .unwrap()
        .revision();

    let wait = Duration::from_millis(1_500);
    let started = Instant::now();
    backend
        .wait_for_release("compacted", &WaitFrom::Revision(seen), started + wait)
        .await
        .unwrap();
    assert!(
        started.elapsed() >= wait - Duration::from_millis(50),
        "control: a watch from a revision in history waits for its deadline ({:?})",
        started.elapsed()
    );

    for _ in 0..3 {
        etcd.put("/compaction-probe", "x", None).await.unwrap();
    }
    let now = etcd
        .get("/compaction-probe", None)
        .await
        .unwrap()
        .header()
        .unwrap()
        .revision();
    // Compacting twice at the same revision is refused; the test etcd's own compactor may have
    // got there first, which is as good.
    let _ = etcd.compact(now, None).await;
    let started = Instant::now();
    backend
        .wait_for_release(
            "compacted",
            &WaitFrom::Revision(seen),
            started + Duration::from_secs(10),
        )
        .await
        .unwrap();
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "a compacted watch start must end the wait at once, not at the deadline ({:?})",
        started.elapsed()
    );
    let d = s.client.describe("payout:compacted").await.unwrap();
    assert_eq!((d.held, d.token), (true, held.token().get()));
    // The service path: another owner waits, the holder releases, the waiter is granted.
    let waiter = s
        .client
        .open_session("waiter", Duration::from_secs(10))
        .await
        .unwrap();
    let release = async {
        tokio::time::sleep(Duration::from_millis(300)).await;
        held.release().await.unwrap();
    };
    let (acquired, ()) = tokio::join!(
        waiter.acquire("payout:compacted", Duration::from_secs(10)),
        release
    );
    assert!(matches!(acquired.unwrap(), Acquired::Granted(_)));
    s.server.stop().await;
}

/// Every grant record is attached to a retention lease: it is there for the whole retention
/// window (the reconciler's INV-07 horizon lies inside it), and etcd deletes it after at most the
/// window plus one rotation period.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_grant_records_are_kept_for_the_retention_window_then_deleted() {
    use lock_server::backend::etcd::{GRANT_RETENTION_MS_MIN, RETENTION_LEASES_PER_WINDOW};
    let endpoints = Stack::shared().etcd_endpoints();
    let prefix = Stack::shared().unique_prefix("retention");
    let window = Duration::from_millis(GRANT_RETENTION_MS_MIN);
    let rotation = window / RETENTION_LEASES_PER_WINDOW as u32;
    let s = start_retaining(&prefix, GRANT_RETENTION_MS_MIN).await;
    let a = s.client.open_session("worker-a", TTL).await.unwrap();
    let g = grant(&a, "payout:k").await;
    let granted_at = Instant::now();
    let token = g.token().get();
    g.release().await.unwrap();
    assert_eq!(record_tokens(&endpoints, &prefix).await, vec![token]);
    assert_eq!(retention_leases(&endpoints, &prefix).await.len(), 1);

    tokio::time::sleep_until((granted_at + window - Duration::from_secs(1)).into()).await;
    assert_eq!(
        record_tokens(&endpoints, &prefix).await,
        vec![token],
        "kept for the whole window"
    );
    // etcd checks lease expiry every 500 ms; a loaded machine gets a few seconds more.
    testkit::eventually(rotation + Duration::from_secs(8), "record deleted", || {
        let (endpoints, prefix) = (endpoints.clone(), prefix.clone());
        async move {
            record_tokens(&endpoints, &prefix)
                .await
                .is_empty()
                .then_some(())
        }
    })
    .await
    .unwrap();
    assert!(
        granted_at.elapsed() >= window,
        "deleted only after the window"
    );
    assert!(retention_leases(&endpoints, &prefix).await.is_empty());
    a.close().await.unwrap();
    s.server.stop().await;
}

/// etcd 3.4 restarts a lease's TTL on every leader change, so the TTL alone does not bound how
/// long records stay. A retention lease whose marker says its window is over is revoked by the
/// next rotation of any lock-server on the prefix, even though etcd still gives it an hour.
/// Control: a lease whose window is not over is left alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_retention_leases_past_their_window_are_revoked_whatever_their_ttl() {
    use lock_server::backend::etcd::GRANT_RETENTION_MS_MIN;
    let endpoints = Stack::shared().etcd_endpoints();
    let prefix = Stack::shared().unique_prefix("sweep");
    let mut etcd = etcd(&endpoints).await;
    let plant = |expires_unix_ms: i64, record: &'static str| {
        let prefix = prefix.clone();
        let mut etcd = etcd.clone();
        async move {
            let lease = etcd.lease_grant(3_600, None).await.unwrap().id();
            let marker = serde_json::json!({
                "lease_id": lease,
                "created_unix_ms": expires_unix_ms - 20_000,
                "expires_unix_ms": expires_unix_ms,
            });
            let with_lease = Some(etcd_client::PutOptions::new().with_lease(lease));
            etcd.put(
                format!("{prefix}retention/{lease}"),
                marker.to_string(),
                with_lease.clone(),
            )
            .await
            .unwrap();
            etcd.put(format!("{prefix}grants/{record}/planted"), "{}", with_lease)
                .await
                .unwrap();
            lease
        }
    };
    let stale = plant(unix_now_ms() - 1, "stale").await;
    let live = plant(unix_now_ms() + 3_600_000, "live").await;
    assert_eq!(record_tokens(&endpoints, &prefix).await.len(), 2);

    let s = start_retaining(&prefix, GRANT_RETENTION_MS_MIN).await;
    let a = s.client.open_session("worker-a", TTL).await.unwrap();
    let g = grant(&a, "payout:k").await;
    assert!(
        !lease_alive(&endpoints, stale).await,
        "past its window: revoked"
    );
    assert!(
        lease_alive(&endpoints, live).await,
        "control: inside its window"
    );
    let keys: Vec<String> = records(&endpoints, &prefix)
        .await
        .into_iter()
        .map(|(key, _)| key)
        .collect();
    assert_eq!(keys.len(), 2, "{keys:?}");
    assert!(
        keys.iter().any(|k| k.contains("grants/payout:k/")),
        "{keys:?}"
    );
    assert!(
        keys.iter().any(|k| k.ends_with("grants/live/planted")),
        "{keys:?}"
    );
    g.release().await.unwrap();
    etcd.lease_revoke(live).await.unwrap();
    a.close().await.unwrap();
    s.server.stop().await;
}

/// An operator (or a restore) revoking the lease grant records are attached to does not stop
/// grants, nor is it mistaken for the session's loss: the lock-server makes a new retention lease.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_grant_after_its_retention_lease_was_revoked_makes_a_new_one() {
    use lock_server::backend::etcd::GRANT_RETENTION_MS_DEFAULT;
    let endpoints = Stack::shared().etcd_endpoints();
    let prefix = Stack::shared().unique_prefix("revoked-retention");
    let s = start_retaining(&prefix, GRANT_RETENTION_MS_DEFAULT).await;
    let a = s.client.open_session("worker-a", TTL).await.unwrap();
    let first = grant(&a, "payout:k").await;
    first.release().await.unwrap();
    let leases = retention_leases(&endpoints, &prefix).await;
    assert_eq!(leases.len(), 1);
    etcd(&endpoints)
        .await
        .lease_revoke(leases[0])
        .await
        .unwrap();
    assert!(
        record_tokens(&endpoints, &prefix).await.is_empty(),
        "the records went with their lease"
    );

    let second = grant(&a, "payout:k").await;
    assert!(second.token() > first.token());
    assert_eq!(
        record_tokens(&endpoints, &prefix).await,
        vec![second.token().get()]
    );
    let now = retention_leases(&endpoints, &prefix).await;
    assert_eq!(now.len(), 1);
    assert_ne!(now[0], leases[0]);
    second.release().await.unwrap();
    a.close().await.unwrap();
    s.server.stop().await;
}

// ---------------------------------------------------------------------------------------------
// The boundary under arbitrary wire values (issue 14, item 4)

use payout_proto::lock as pb;

/// The lockdb tables a call may write.
const LOCKDB_TABLES: [&str; 3] = ["lock_session", "lock_entry", "lock_audit"];
/// The grant seeded before the cases run, so that valid handles and sessions reach deep paths.
const SEEDED_KEY: &str = "payout:acct-w";
const SEEDED_OWNER: &str = "worker-w";

/// The seeded grant's session and token, as the backend issued them.
#[derive(Debug, Clone)]
struct Seeded {
    session_id: String,
    token: u64,
}

/// Where a backend keeps its state, snapshotted around each call.
enum LockStore {
    Postgres(sqlx::PgPool),
    Etcd { prefix: String },
}

impl LockStore {
    async fn snapshot(&self) -> testkit::wire::Snapshot {
        match self {
            Self::Postgres(pool) => testkit::wire::snapshot(pool, &LOCKDB_TABLES).await,
            Self::Etcd { prefix } => testkit::wire::etcd_snapshot(Stack::shared(), prefix).await,
        }
    }
}

/// One call of `lock.v1.LockService`, with whatever field values.
#[derive(Debug, Clone)]
enum LockCall {
    CreateSession(pb::CreateSessionRequest),
    KeepAlive(pb::KeepAliveRequest),
    CloseSession(pb::CloseSessionRequest),
    Acquire(pb::AcquireRequest),
    Renew(pb::RenewRequest),
    Release(pb::ReleaseRequest),
    ForceRevoke(pb::ForceRevokeRequest),
    Describe(pb::DescribeRequest),
}

fn lock_call(seeded: &Seeded) -> impl proptest::strategy::Strategy<Value = LockCall> {
    use lock_server::service::{KEY_LENGTH_MAX, OWNER_LENGTH_MAX};
    use proptest::prelude::*;
    use testkit::wire::{hostile_text, hostile_u64};
    let known = |value: &'static str, length_max: usize| {
        hostile_text(Just(value.to_string()).boxed(), length_max)
    };
    let session_id = || {
        hostile_text(
            prop_oneof![
                3 => Just(seeded.session_id.clone()),
                1 => "[2-6]",
                1 => prop::sample::select(vec!["0", "-1", "9223372036854775807", "99999999999999999999", "0x1", "1.0"])
                    .prop_map(String::from),
            ]
            .boxed(),
            OWNER_LENGTH_MAX,
        )
    };
    let owner = || known(SEEDED_OWNER, OWNER_LENGTH_MAX);
    let text = || hostile_text("[a-z ]{1,12}".boxed(), KEY_LENGTH_MAX);
    let handle = prop::option::weighted(
        0.9,
        (
            known(SEEDED_KEY, KEY_LENGTH_MAX),
            owner(),
            session_id(),
            hostile_u64(Just(seeded.token).boxed()),
        )
            .prop_map(|(key, owner, session_id, token)| pb::Handle {
                key,
                owner,
                session_id,
                token,
            }),
    );
    let create = (owner(), hostile_u64((1_000u64..300_000).boxed())).prop_map(|(owner, ttl_ms)| {
        LockCall::CreateSession(pb::CreateSessionRequest { owner, ttl_ms })
    });
    // A fresh key with any wait (nobody else holds it, so the wait never starts), or an arbitrary
    // key tried once: a key some earlier case holds would make a long wait legitimately long.
    let acquire = (
        prop_oneof![
            ("payout:acct-[a-z0-9]{10}", hostile_u64((0u64..10).boxed())),
            (
                hostile_text(Just(SEEDED_KEY.to_string()).boxed(), KEY_LENGTH_MAX),
                Just(0u64)
            ),
        ],
        owner(),
        session_id(),
    )
        .prop_map(|((key, wait_ms), owner, session_id)| {
            LockCall::Acquire(pb::AcquireRequest {
                key,
                owner,
                session_id,
                wait_ms,
            })
        });
    prop_oneof![
        create,
        session_id().prop_map(|session_id| LockCall::KeepAlive(pb::KeepAliveRequest {
            session_id,
            vouch: Vec::new()
        })),
        session_id()
            .prop_map(|session_id| LockCall::CloseSession(pb::CloseSessionRequest { session_id })),
        acquire,
        handle
            .clone()
            .prop_map(|handle| LockCall::Renew(pb::RenewRequest { handle })),
        handle.prop_map(|handle| LockCall::Release(pb::ReleaseRequest { handle })),
        (
            known(SEEDED_KEY, KEY_LENGTH_MAX),
            known("op-1", OWNER_LENGTH_MAX),
            text(),
            prop::option::of(hostile_u64(Just(seeded.token).boxed())),
        )
            .prop_map(|(key, operator, reason, expected_token)| {
                LockCall::ForceRevoke(pb::ForceRevokeRequest {
                    key,
                    operator,
                    reason,
                    expected_token,
                })
            }),
        known(SEEDED_KEY, KEY_LENGTH_MAX)
            .prop_map(|key| LockCall::Describe(pb::DescribeRequest { key })),
    ]
}

type RawLockClient = pb::lock_service_client::LockServiceClient<tonic::transport::Channel>;

async fn send_lock_call(mut raw: RawLockClient, call: LockCall) -> Result<(), tonic::Status> {
    use LockCall as C;
    match call {
        C::CreateSession(r) => raw.create_session(r).await.map(drop),
        C::KeepAlive(r) => raw.keep_alive(r).await.map(drop),
        C::CloseSession(r) => raw.close_session(r).await.map(drop),
        C::Acquire(r) => raw.acquire(r).await.map(drop),
        C::Renew(r) => raw.renew(r).await.map(drop),
        C::Release(r) => raw.release(r).await.map(drop),
        C::ForceRevoke(r) => raw.force_revoke(r).await.map(drop),
        C::Describe(r) => raw.describe(r).await.map(drop),
    }
}

/// Arbitrary field values through the real client to the real lock-server on `kind`'s backend.
/// For every case: no panic anywhere in the process; the answer is OK or a status carrying a
/// decodable typed `Rejection` (INVALID_ARGUMENT names its field; never BACKEND_UNAVAILABLE or
/// TOKEN_REGRESSION, the backend being up and the tokens honest); an INVALID_ARGUMENT refusal
/// changed nothing in the backend (lockdb's rows, or etcd's keys under the server's prefix, counts
/// and contents); another refusal (session not found, not holder, not held) left every lock,
/// grant and audit record as it was and added no session; and the server still reports SERVING
/// and answers a valid call.
fn wire_values_never_panic_and_refusals_are_typed_and_write_nothing(kind: Kind) {
    use pb::rejection::Kind as Rejected;
    use proptest::prelude::*;
    use testkit::wire;
    const CASES: u32 = 96;
    let runtime = wire::runtime();
    let (server, raw, store, seeded) = runtime.block_on(async {
        let stack = Stack::shared();
        let (backend, store) = match kind {
            Kind::Postgres => {
                let (admin, url) = lockdb(stack).await;
                let pool = sqlx::PgPool::connect(&admin).await.unwrap();
                (
                    BackendConfig::Postgres { database_url: url },
                    LockStore::Postgres(pool),
                )
            }
            Kind::Etcd => {
                let (endpoints, prefix) = (stack.etcd_endpoints(), stack.unique_prefix("wire"));
                let backend = BackendConfig::Etcd {
                    endpoints: endpoints.clone(),
                    tls: stack.etcd_identity_tls(EtcdRole::LockServer, &prefix),
                    prefix: prefix.clone(),
                    grant_retention_ms: GRANT_RETENTION_MS_DEFAULT,
                };
                (backend, LockStore::Etcd { prefix })
            }
        };
        let server = start_with(backend).await;
        let mut raw = RawLockClient::new(
            tls(Role::Worker)
                .connect(&server.server.endpoint, Role::LockServer)
                .await
                .unwrap(),
        );
        let session_id = raw
            .create_session(pb::CreateSessionRequest {
                owner: SEEDED_OWNER.into(),
                ttl_ms: lock_server::service::SESSION_TTL_MS_MAX,
            })
            .await
            .unwrap()
            .into_inner()
            .session_id;
        let granted = raw
            .acquire(pb::AcquireRequest {
                key: SEEDED_KEY.into(),
                owner: SEEDED_OWNER.into(),
                session_id: session_id.clone(),
                wait_ms: 0,
            })
            .await
            .unwrap()
            .into_inner();
        let Some(pb::acquire_response::Result::Grant(grant)) = granted.result else {
            panic!("the seeded grant: {granted:?}");
        };
        (
            server,
            raw,
            store,
            Seeded {
                session_id,
                token: grant.token,
            },
        )
    });
    let endpoint = server.server.endpoint.clone();
    wire::run_cases(&runtime, CASES, lock_call(&seeded), |call| {
        let (raw, store, endpoint) = (raw.clone(), &store, &endpoint);
        async move {
            let wire::Observed {
                answer,
                before,
                after,
            } = wire::observe_with(|| store.snapshot(), send_lock_call(raw.clone(), call)).await?;
            if let Err(status) = answer {
                let kind =
                    service_kit::rejection::decode::<pb::Rejection>(&status).and_then(|r| r.kind);
                match (status.code(), &kind) {
                    // A session id bound to another certificate (the wire values include ids
                    // with a ':'): refused before the backend is asked.
                    (
                        tonic::Code::PermissionDenied,
                        Some(Rejected::SessionNotOwned(_) | Rejected::OperatorNotCertified(_)),
                    ) => {
                        prop_assert_eq!(before.changed(&after), Vec::<String>::new());
                    }
                    (tonic::Code::InvalidArgument, Some(Rejected::InvalidArgument(i))) => {
                        prop_assert!(!i.field.is_empty());
                        prop_assert_eq!(before.changed(&after), Vec::<String>::new());
                    }
                    (
                        tonic::Code::NotFound | tonic::Code::FailedPrecondition,
                        Some(
                            Rejected::SessionNotFound(_)
                            | Rejected::NotHolder(_)
                            | Rejected::NotHeld(_)
                            | Rejected::HolderChanged(_),
                        ),
                    ) => {
                        // lockdb may mark a session it found expired; nothing else may change.
                        let changed = before.changed(&after);
                        prop_assert!(
                            changed.is_empty() || changed == ["lock_session"],
                            "{changed:?}"
                        );
                        prop_assert_eq!(before.rows_added(&after, "lock_session"), 0);
                    }
                    (code, kind) => prop_assert!(
                        false,
                        "untyped or unexpected refusal {code:?} {kind:?}: {}",
                        status.message()
                    ),
                }
            }
            let mut raw = raw.clone();
            let valid = raw.describe(pb::DescribeRequest {
                key: SEEDED_KEY.into(),
            });
            wire::still_serving(
                endpoint,
                lock_server::HEALTH_SERVICE_NAME,
                testkit::pki::Role::LockServer,
                valid,
            )
            .await
        }
    });
    runtime.block_on(server.server.stop());
}

#[test]
fn etcd_wire_values_never_panic_and_refusals_are_typed_and_write_nothing() {
    wire_values_never_panic_and_refusals_are_typed_and_write_nothing(Kind::Etcd);
}

#[test]
fn postgres_wire_values_never_panic_and_refusals_are_typed_and_write_nothing() {
    wire_values_never_panic_and_refusals_are_typed_and_write_nothing(Kind::Postgres);
}

/// A lock session belongs to the certificate that created it: another caller (another worker's
/// certificate) that learnt its id gets PERMISSION_DENIED on KeepAlive, Acquire, Release and
/// CloseSession, and the owner's session and grant are untouched. Describe does not reveal the
/// holder's session id at all.
#[tokio::test]
async fn a_session_is_usable_only_by_the_certificate_that_created_it() {
    let s = start(Kind::Etcd).await;
    let owner = worker_raw(&s.server.endpoint).await;
    let intruder = worker_raw(&s.server.endpoint).await;
    let session_id = new_session(&owner).await;
    let granted = owner
        .clone()
        .acquire(pb::AcquireRequest {
            key: "payout:hijack".into(),
            owner: "w-owner".into(),
            session_id: session_id.clone(),
            wait_ms: 0,
        })
        .await
        .unwrap()
        .into_inner();
    let Some(pb::acquire_response::Result::Grant(grant)) = granted.result else {
        panic!("not granted: {granted:?}");
    };
    let described = owner
        .clone()
        .describe(pb::DescribeRequest {
            key: "payout:hijack".into(),
        })
        .await
        .unwrap()
        .into_inner();
    assert!(described.held);
    assert_eq!(
        described.holder_session_id, "",
        "Describe revealed a session id"
    );

    let handle = pb::Handle {
        key: grant.key.clone(),
        owner: grant.owner.clone(),
        session_id: grant.session_id.clone(),
        token: grant.token,
    };
    let denied = |r: Result<tonic::Response<_>, tonic::Status>, what: &str| {
        let status = r
            .err()
            .unwrap_or_else(|| panic!("{what} on another's session was answered"));
        assert_eq!(
            status.code(),
            tonic::Code::PermissionDenied,
            "{what}: {status:?}"
        );
    };
    let mut i = intruder.clone();
    denied(
        i.keep_alive(pb::KeepAliveRequest {
            session_id: session_id.clone(),
            vouch: vec![],
        })
        .await
        .map(|r| r.map(|_| ())),
        "KeepAlive",
    );
    denied(
        i.acquire(pb::AcquireRequest {
            key: "payout:hijack".into(),
            owner: "w-owner".into(),
            session_id: session_id.clone(),
            wait_ms: 0,
        })
        .await
        .map(|r| r.map(|_| ())),
        "Acquire (the holder's token back)",
    );
    denied(
        i.renew(pb::RenewRequest {
            handle: Some(handle.clone()),
        })
        .await
        .map(|r| r.map(|_| ())),
        "Renew",
    );
    denied(
        i.release(pb::ReleaseRequest {
            handle: Some(handle.clone()),
        })
        .await
        .map(|r| r.map(|_| ())),
        "Release",
    );
    denied(
        i.close_session(pb::CloseSessionRequest {
            session_id: session_id.clone(),
        })
        .await
        .map(|r| r.map(|_| ())),
        "CloseSession",
    );
    // The owner still holds the key with the same token, and its session still answers.
    let after = owner
        .clone()
        .describe(pb::DescribeRequest {
            key: "payout:hijack".into(),
        })
        .await
        .unwrap()
        .into_inner();
    assert!(after.held);
    assert_eq!(after.token, grant.token);
    owner
        .clone()
        .keep_alive(pb::KeepAliveRequest {
            session_id: session_id.clone(),
            vouch: vec![handle.clone()],
        })
        .await
        .unwrap();
    assert!(
        s.server
            .metrics
            .render()
            .contains(r#"event="session_not_owned""#),
        "the refusals are not counted"
    );
}

/// Negative control of the session binding: the same keep-alive and close, made on the service's
/// inner methods (what the gRPC layer guards with the binding), are answered for anyone who knows
/// the backend's session id. The binding in the wire layer is the only thing refusing the intruder
/// in `a_session_is_usable_only_by_the_certificate_that_created_it`.
#[tokio::test]
async fn negative_control_without_the_binding_a_leaked_session_id_is_enough() {
    let s = start(Kind::Etcd).await;
    let owner = worker_raw(&s.server.endpoint).await;
    let wire_id = new_session(&owner).await;
    let (_, backend_id) = wire_id.split_once(':').expect("a bound session id");
    assert!(s.server.service.keep_alive(backend_id).await.is_ok());
    s.server.service.close_session(backend_id).await.unwrap();
    let after = owner
        .clone()
        .keep_alive(pb::KeepAliveRequest {
            session_id: wire_id,
            vouch: vec![],
        })
        .await;
    assert_eq!(
        after.unwrap_err().code(),
        tonic::Code::NotFound,
        "the intruder closed the owner's session"
    );
}

/// A raw client with a fresh worker certificate of its own.
async fn worker_raw(endpoint: &str) -> RawLockClient {
    RawLockClient::new(
        tls(Role::Worker)
            .connect(endpoint, Role::LockServer)
            .await
            .unwrap(),
    )
}

/// A new session of `client`'s certificate: its id as the wire carries it.
async fn new_session(client: &RawLockClient) -> String {
    client
        .clone()
        .create_session(pb::CreateSessionRequest {
            owner: "w-owner".into(),
            ttl_ms: 10_000,
        })
        .await
        .unwrap()
        .into_inner()
        .session_id
}

// ---------------------------------------------------------------------------------------------
// Bounds per caller (issue 34, rows 4a-4d): one certificate cannot take the lock service whole.

/// Small per-caller bounds, so a test reaches each with a handful of calls.
const CALLER_LIMITS_IN_TEST: lock_server::callers::CallerLimits =
    lock_server::callers::CallerLimits {
        sessions: 3,
        held_keys: 3,
        waiters: 2,
        grants_per_s: 1,
        grant_burst: 4,
    };

async fn start_with_caller_limits(
    kind: Kind,
    limits: lock_server::callers::CallerLimits,
    waiters_max: usize,
) -> Server {
    start_shaped(
        backend(kind, "callers").await,
        waiters_max,
        lock_server::service::BOUNDS,
        move |service| service.with_caller_limits(limits),
    )
    .await
}

/// The typed refusal of a call past a per-caller bound: RESOURCE_EXHAUSTED with
/// `CallerLimitReached{limit, max}`.
fn caller_limit(e: &ClientError, limit: &str, max: u64) {
    match e {
        ClientError::Rejected {
            kind: Rejection::CallerLimitReached(c),
            ..
        } => assert_eq!((c.limit.as_str(), c.max), (limit, max), "{e:?}"),
        other => panic!("expected CallerLimitReached{{{limit}}}, got {other:?}"),
    }
}

/// `lock_caller_limit_refusals_total{limit}` as the server's /metrics renders it.
fn caller_limit_refusals(s: &Server, limit: &str) -> u64 {
    let wanted = format!(r#"limit="{limit}""#);
    s.server
        .metrics
        .render()
        .lines()
        .filter(|l| l.starts_with("lock_caller_limit_refusals_total{") && l.contains(&wanted))
        .filter_map(|l| l.rsplit(' ').next().and_then(|v| v.parse::<u64>().ok()))
        .sum()
}

/// A second caller: another certificate of the same role.
async fn another_caller(s: &Server) -> LockClient {
    LockClient::connect(&s.server.endpoint, &tls(Role::Worker))
        .await
        .expect("a second worker certificate connects")
}

/// Rows 4a, 4b, 4d: past its open sessions, its held keys or its rate of new grants, one
/// certificate is refused RESOURCE_EXHAUSTED `CallerLimitReached` (counted by bound), nothing
/// created or granted; another certificate is served throughout; a re-acquire of a held key is
/// free; and the room comes back as the caller's own use ends.
async fn one_caller_is_bounded_and_another_is_served(kind: Kind) {
    let s = start_with_caller_limits(kind, CALLER_LIMITS_IN_TEST, WAITERS_MAX_IN_TEST).await;
    let b = another_caller(&s).await;
    // 4a: sessions.
    let mut sessions = Vec::new();
    for i in 0..3 {
        sessions.push(
            s.client
                .open_session(&format!("a-{i}"), TTL * 5)
                .await
                .unwrap(),
        );
    }
    let e = s
        .client
        .open_session("a-3", TTL * 5)
        .await
        .err()
        .expect("the fourth session refused");
    caller_limit(&e, "sessions", 3);
    assert_eq!(caller_limit_refusals(&s, "sessions"), 1, "{kind:?}");
    let b_session = b
        .open_session("b-0", TTL * 5)
        .await
        .expect("another caller is served");
    sessions.pop().unwrap().close().await.unwrap();
    let a = s
        .client
        .open_session("a-again", TTL * 5)
        .await
        .expect("a closed session's room comes back");

    // 4b: held keys; a re-acquire of a held key is not a new key.
    let mut held = Vec::new();
    for i in 1..=3 {
        held.push(grant(&a, &format!("payout:held-{i}")).await);
    }
    let e = a
        .acquire("payout:held-4", Duration::ZERO)
        .await
        .unwrap_err();
    caller_limit(&e, "held_keys", 3);
    let again = grant(&a, "payout:held-1").await;
    assert_eq!(again.token(), held[0].token(), "a re-acquire is free");
    grant(&b_session, "payout:held-4")
        .await
        .release()
        .await
        .unwrap();
    held.pop().unwrap().release().await.unwrap();

    // 4d: new grants in quick succession, each released at once (so the held-key bound is not
    // what answers): past the burst, the caller is refused until the rate refills; the other
    // caller is not.
    let mut refused = None;
    for i in 0..50 {
        match a.acquire(&format!("payout:rate-{i}"), Duration::ZERO).await {
            Ok(acquired) => acquired
                .granted()
                .expect("a free key")
                .release()
                .await
                .unwrap(),
            Err(e) => {
                refused = Some(e);
                break;
            }
        }
    }
    caller_limit(
        &refused.expect("the grant rate was reached"),
        "grant_rate",
        1,
    );
    assert!(caller_limit_refusals(&s, "grant_rate") >= 1, "{kind:?}");
    grant(&b_session, "payout:rate-b")
        .await
        .release()
        .await
        .unwrap();
    testkit::eventually(Duration::from_secs(10), "the rate refills", || {
        let a = a.clone();
        async move { a.acquire("payout:rate-refilled", Duration::ZERO).await.ok() }
    })
    .await
    .unwrap();
    assert_eq!(caller_limit_refusals(&s, "held_keys"), 1, "{kind:?}");
    s.server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_one_caller_is_bounded_and_another_is_served() {
    one_caller_is_bounded_and_another_is_served(Kind::Etcd).await;
}
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_one_caller_is_bounded_and_another_is_served() {
    one_caller_is_bounded_and_another_is_served(Kind::Postgres).await;
}

/// Row 4c: with a server bound of three waiters, one certificate parks two (its own bound) and
/// its third is refused `CallerLimitReached{waiters}`, while another certificate still parks on
/// the same key and is served in its turn. Negative control: without per-caller bounds the first
/// certificate takes the server's three places whole and the other is refused `Overloaded`
/// (the server's own bound), what the lock service did before.
async fn one_caller_cannot_take_every_waiter_place(kind: Kind, bounded: bool) {
    let limits = if bounded {
        CALLER_LIMITS_IN_TEST
    } else {
        lock_server::callers::CallerLimits::NONE
    };
    let s = start_with_caller_limits(kind, limits, 3).await;
    let holder_client = another_caller(&s).await;
    let holder = holder_client.open_session("holder", TTL * 5).await.unwrap();
    let held = grant(&holder, BOUNDED_KEY).await;
    let a = s.client.open_session("a", TTL * 5).await.unwrap();
    let a1 = park(&a, BOUNDED_KEY, "a1");
    queued(&s.client, BOUNDED_KEY, 1).await;
    let a2 = park(&a, BOUNDED_KEY, "a2");
    queued(&s.client, BOUNDED_KEY, 2).await;
    let a3 = park(&a, BOUNDED_KEY, "a3");
    let b_client = another_caller(&s).await;
    let b = b_client.open_session("b", TTL * 5).await.unwrap();
    if bounded {
        let e = tokio::time::timeout(AT_ONCE, a3)
            .await
            .expect("refused at once")
            .unwrap()
            .unwrap_err();
        caller_limit(&e, "waiters", 2);
        let b1 = park(&b, BOUNDED_KEY, "b1");
        queued(&s.client, BOUNDED_KEY, 3).await;
        held.release().await.unwrap();
        granted_to(a1, "a1").await.release().await.unwrap();
        granted_to(a2, "a2").await.release().await.unwrap();
        granted_to(b1, "b1").await.release().await.unwrap();
        assert_eq!(caller_limit_refusals(&s, "waiters"), 1, "{kind:?}");
    } else {
        // a3 parks: the third place of three is the first caller's too, and the other caller
        // finds the server full.
        queued(&s.client, BOUNDED_KEY, 3).await;
        let refused = tokio::time::timeout(AT_ONCE, b.acquire_as(BOUNDED_KEY, "b1", LONG_WAIT))
            .await
            .expect("refused at once");
        match refused {
            Err(ClientError::Status(status)) => {
                assert_eq!(status.code(), tonic::Code::ResourceExhausted, "{status:?}")
            }
            other => panic!("the other caller should be refused Overloaded, got {other:?}"),
        }
        held.release().await.unwrap();
        granted_to(a1, "a1").await.release().await.unwrap();
        granted_to(a2, "a2").await.release().await.unwrap();
        granted_to(a3, "a3").await.release().await.unwrap();
    }
    s.server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_one_caller_cannot_take_every_waiter_place() {
    one_caller_cannot_take_every_waiter_place(Kind::Etcd, true).await;
}
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_one_caller_cannot_take_every_waiter_place() {
    one_caller_cannot_take_every_waiter_place(Kind::Postgres, true).await;
}
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn negative_control_without_caller_bounds_one_caller_takes_every_waiter_place() {
    one_caller_cannot_take_every_waiter_place(Kind::Postgres, false).await;
}
