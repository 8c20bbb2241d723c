//! What the lock-server suites start from, stated once: an in-process lock-server on either
//! backend (its lockdb as a deployment has it), a three-member etcd cluster that puts the leader
//! first, and a grant the test needs to be given.

// Every suite compiles this module into its own test binary and uses only part of it.
#![allow(dead_code)]

use std::sync::Arc;
use std::time::Duration;

use grant_signing::{Signer, Verifier};
use lock_client::{Acquired, GrantHandle, LockClient, Session};
use lock_server::backend::etcd::GRANT_RETENTION_MS_DEFAULT;
use lock_server::service::LockServiceImpl;
use lock_server::{BackendConfig, Config, InProcess};
use testkit::etcd::EtcdRole;
use testkit::pki::{tls, Role};
use testkit::{PgServer, Stack};

#[derive(Clone, Copy, Debug)]
pub enum Kind {
    Etcd,
    Postgres,
}

pub struct Server {
    pub server: InProcess,
    pub client: LockClient,
    /// The same server as the operator [`testkit::pki::TEST_OPERATOR`]: break-glass calls.
    pub operator: LockClient,
    /// The guards' side of this server's signing key.
    pub verifier: Verifier,
    _dir: tempfile::TempDir,
}

/// The suites call as a worker and as an operator from one client; the in-process server lets
/// every role call every method (the real table is the binary's: the system and attack suites).
/// Session ownership is not part of the table and holds here as everywhere.
pub fn every_role() -> &'static service_kit::grpc::Policy {
    testkit::pki::every_role(&lock_server::authz::POLICY)
}

/// The key id the test servers sign under.
pub const SIGNING_KEY_ID: &str = "lock-test-1";

/// A fresh signing key for an in-process lock-server (every server signs: there is no unsigned
/// mode).
pub fn signer() -> Arc<Signer> {
    Arc::new(Signer::generate(SIGNING_KEY_ID).expect("a key").0)
}

/// A backend of `kind` on the shared stack: etcd under a prefix of its own (`name` says whose),
/// or a fresh lockdb.
pub async fn backend(kind: Kind, name: &str) -> BackendConfig {
    let stack = Stack::shared();
    match kind {
        Kind::Etcd => {
            let prefix = stack.unique_prefix(name);
            BackendConfig::Etcd {
                endpoints: stack.etcd_endpoints(),
                tls: stack.etcd_identity_tls(EtcdRole::LockServer, &prefix),
                prefix,
                grant_retention_ms: GRANT_RETENTION_MS_DEFAULT,
            }
        }
        Kind::Postgres => BackendConfig::Postgres {
            database_url: lockdb(stack).await.1,
        },
    }
}

/// A lockdb of `stack` as a deployment has it (owned and migrated by the owner role): the
/// superuser's URL (for the test's own reads) and the `lock_server` role's, which the server logs
/// in as.
pub async fn lockdb(stack: &Stack) -> (String, String) {
    let admin = stack
        .provisioned_db(PgServer::Main, testkit::db_access::Database::Lockdb)
        .await;
    let login = stack
        .pg(PgServer::Main)
        .login_url("lock_server", testkit::system::database_name(&admin));
    (admin, login)
}

pub async fn start_with(backend: BackendConfig) -> Server {
    start_bounded(backend, lock_server::service::WAITERS_MAX).await
}

/// [`start_with`], the server letting at most `waiters_max` Acquire calls wait at once.
pub async fn start_bounded(backend: BackendConfig, waiters_max: usize) -> Server {
    start_with_bounds(backend, waiters_max, lock_server::service::BOUNDS).await
}

/// [`start_bounded`] with other server bounds (requests at once, a request's deadline).
pub async fn start_with_bounds(
    backend: BackendConfig,
    waiters_max: usize,
    bounds: service_kit::grpc::Bounds,
) -> Server {
    start_shaped(backend, waiters_max, bounds, |service| service).await
}

/// [`start_with_bounds`], the service shaped by `shape` before it serves (a negative control's
/// switch, e.g. `LockServiceImpl::without_operator_certification_for_tests`).
pub async fn start_shaped(
    backend: BackendConfig,
    waiters_max: usize,
    bounds: service_kit::grpc::Bounds,
    shape: impl FnOnce(LockServiceImpl) -> LockServiceImpl,
) -> Server {
    let dir = tempfile::tempdir().unwrap();
    let signer = signer();
    let verifier = Verifier::new([signer.public_key()]).unwrap();
    let config = Config {
        backend,
        issued_tokens_path: dir.path().join("issued-tokens.json"),
        issued_tokens_limits: Default::default(),
        caller_limits: Default::default(),
        signer,
    };
    let metrics = service_kit::Metrics::default();
    let service = lock_server::build(&config, &metrics)
        .await
        .expect("lock-server builds")
        .with_waiters_max(waiters_max);
    let server = InProcess::serve_for_tests(
        shape(service),
        metrics,
        &tls(Role::LockServer),
        every_role(),
        bounds,
    )
    .await
    .expect("lock-server starts");
    let client = LockClient::connect(&server.endpoint, &tls(Role::Worker))
        .await
        .expect("client connects");
    let operator = LockClient::connect(&server.endpoint, &tls(Role::Operator))
        .await
        .expect("operator connects");
    Server {
        server,
        client,
        operator,
        verifier,
        _dir: dir,
    }
}

/// A stack of its own with a three-member etcd cluster, its leader's index, and a lock-server on
/// the cluster under `prefix`. The leader is the lock-server's first endpoint, so killing it also
/// forces the lock-server's fail-over.
pub async fn on_three_etcd_members(prefix: &str) -> (Stack, usize, Server) {
    let stack = Stack::builder()
        .etcd_members(3)
        .start()
        .expect("3-member stack");
    let leader = stack.etcd.leader().await.unwrap();
    let mut endpoints = stack.etcd_endpoints();
    endpoints.swap(0, leader);
    let server = start_with(BackendConfig::Etcd {
        endpoints,
        tls: stack.etcd_identity_tls(EtcdRole::LockServer, prefix),
        prefix: prefix.into(),
        grant_retention_ms: GRANT_RETENTION_MS_DEFAULT,
    })
    .await;
    (stack, leader, server)
}

/// `key` granted to `session` at once; anything else fails the test.
pub async fn grant(session: &Session, key: &str) -> GrantHandle {
    match session
        .acquire(key, Duration::ZERO)
        .await
        .expect("acquire answers")
    {
        Acquired::Granted(g) => g,
        Acquired::NotAcquired { holder_owner, .. } => {
            panic!("{key} unexpectedly held by {holder_owner}")
        }
    }
}

pub fn unix_now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as i64
}
