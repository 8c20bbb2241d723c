//! The resolver's takeover of an orphaned grant against a real lock service (in process, on the
//! shared test stack's etcd or a fresh lockdb). The holder's workflow is asked of a stand-in for
//! Temporal, which is where another payout can take the key: between the resolver's describe
//! and its revoke (issue 35, item 5).

use std::sync::{Arc, Mutex};
use std::time::Duration;

use grant_signing::Signer;
use lock_client::{Acquired, GrantHandle, LockClient, Session};
use lock_server::backend::etcd::GRANT_RETENTION_MS_DEFAULT;
use lock_server::{BackendConfig, Config, InProcess};
use resolver::resume::{take_over_if_not_running, ResumeError, WorkflowStatus};
use testkit::etcd::EtcdRole;
use testkit::pki::{tls, Role};
use testkit::{PgServer, Stack};

const TTL: Duration = Duration::from_secs(10);
const ACCOUNT: &str = "acct-takeover";
const KEY: &str = "payout:acct-takeover";

#[derive(Clone, Copy, Debug)]
enum Kind {
    Etcd,
    Postgres,
}

struct Server {
    server: InProcess,
    /// A payout worker's certificate: the holders.
    worker: LockClient,
    /// The resolver's certificate (role `reconciler`).
    resolver: LockClient,
    _dir: tempfile::TempDir,
}

async fn start(kind: Kind) -> Server {
    let stack = Stack::shared();
    let backend = match kind {
        Kind::Etcd => {
            let prefix = stack.unique_prefix("resolver-takeover");
            BackendConfig::Etcd {
                endpoints: stack.etcd_endpoints(),
                tls: stack.etcd_identity_tls(EtcdRole::LockServer, &prefix),
                prefix,
                grant_retention_ms: GRANT_RETENTION_MS_DEFAULT,
            }
        }
        Kind::Postgres => {
            let admin = stack
                .provisioned_db(PgServer::Main, testkit::db_access::Database::Lockdb)
                .await;
            BackendConfig::Postgres {
                database_url: stack
                    .pg(PgServer::Main)
                    .login_url("lock_server", testkit::system::database_name(&admin)),
            }
        }
    };
    let dir = tempfile::tempdir().unwrap();
    let config = Config {
        backend,
        issued_tokens_path: dir.path().join("issued-tokens.json"),
        issued_tokens_limits: Default::default(),
        caller_limits: Default::default(),
        signer: Arc::new(Signer::generate("resolver-test-1").unwrap().0),
    };
    let metrics = service_kit::Metrics::default();
    let service = lock_server::build(&config, &metrics).await.unwrap();
    let server = InProcess::serve_for_tests(
        service,
        metrics,
        &tls(Role::LockServer),
        testkit::pki::every_role(&lock_server::authz::POLICY),
        lock_server::service::BOUNDS,
    )
    .await
    .unwrap();
    let worker = LockClient::connect(&server.endpoint, &tls(Role::Worker))
        .await
        .unwrap();
    let resolver = LockClient::connect(&server.endpoint, &tls(Role::Reconciler))
        .await
        .unwrap();
    Server {
        server,
        worker,
        resolver,
        _dir: dir,
    }
}

async fn grant(session: &Session, owner: &str) -> GrantHandle {
    match session
        .acquire_as(KEY, owner, Duration::ZERO)
        .await
        .unwrap()
    {
        Acquired::Granted(g) => g,
        Acquired::NotAcquired { holder_owner, .. } => panic!("{KEY} held by {holder_owner}"),
    }
}

/// The orphan's workflow is gone; while the resolver asks about it, the orphan's session ends
/// and a running payout of the same account takes the key. The resolver's revoke, expecting the
/// orphan's token, is refused by the lock service: the running payout keeps its grant, nothing
/// is revoked (no `revoked` event, so LockForceRevoked stays quiet), and the takeover reports
/// nothing taken. Control: with nobody taking the key in between, the same takeover revokes the
/// orphan's grant. Before the revoke carried the described token, the running payout was
/// deposed and the audit record named the orphan's workflow as the reason.
async fn a_payout_that_took_the_key_after_the_describe_is_not_deposed(kind: Kind) {
    let s = start(kind).await;
    let orphans = s.worker.open_session("worker-0", TTL).await.unwrap();
    let runners = s.worker.open_session("worker-1", TTL).await.unwrap();

    // Control: nobody in between; the orphan's grant is taken.
    let orphan = grant(&orphans, "worker-0/p-orphan-1").await;
    let asked = Arc::new(Mutex::new(Vec::new()));
    let taken = take_over_if_not_running(&s.resolver, ACCOUNT, |workflow_id, _holder_process| {
        let asked = asked.clone();
        async move {
            asked.lock().unwrap().push(workflow_id);
            Ok::<_, ResumeError>(WorkflowStatus::Closed("TERMINATED".into()))
        }
    })
    .await
    .unwrap();
    assert_eq!(taken.as_deref(), Some("worker-0/p-orphan-1"));
    assert_eq!(s.server.service.event_count("revoked"), 1);
    drop(orphan);

    // The race: the orphan lets go and a running payout takes the key while the resolver asks
    // about the orphan's workflow.
    let orphan = grant(&orphans, "worker-0/p-orphan-2").await;
    let running: Arc<Mutex<Option<GrantHandle>>> = Arc::default();
    let taken = take_over_if_not_running(&s.resolver, ACCOUNT, |workflow_id, _holder_process| {
        let (asked, running, runners, orphan) = (asked.clone(), running.clone(), &runners, &orphan);
        async move {
            asked.lock().unwrap().push(workflow_id);
            orphan.release().await.unwrap();
            *running.lock().unwrap() = Some(grant(runners, "worker-1/p-running").await);
            Ok::<_, ResumeError>(WorkflowStatus::Closed("TERMINATED".into()))
        }
    })
    .await
    .unwrap();
    assert_eq!(
        *asked.lock().unwrap(),
        ["payout-p-orphan-1", "payout-p-orphan-2"],
        "the resolver asked about the grants it described"
    );
    assert_eq!(taken, None, "nothing taken: the key changed holder");
    let running = running
        .lock()
        .unwrap()
        .take()
        .expect("the running payout's grant");
    assert!(running.is_held(), "the running payout keeps its grant");
    running
        .renew()
        .await
        .expect("the running payout is still the holder in the backend");
    let d = s.worker.describe(KEY).await.unwrap();
    assert_eq!(
        (d.held, d.holder_owner.as_str(), d.token),
        (true, "worker-1/p-running", running.token().get())
    );
    assert_eq!(
        s.server.service.event_count("revoked"),
        1,
        "nothing revoked: no LockForceRevoked"
    );
    s.server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_a_payout_that_took_the_key_after_the_describe_is_not_deposed() {
    a_payout_that_took_the_key_after_the_describe_is_not_deposed(Kind::Etcd).await;
}
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_payout_that_took_the_key_after_the_describe_is_not_deposed() {
    a_payout_that_took_the_key_after_the_describe_is_not_deposed(Kind::Postgres).await;
}
