//! The lock service (spec 2.2, 2.4, 2.5 INV-04/INV-06, 2.6 steps 1-2). It owns only mutual
//! exclusion of grants and knows nothing of payouts or money: the guards downstream enforce
//! everything else with the token it mints.
//!
//! Architecture invariant: no timer in this process decides expiry. etcd's lease (replicated) or
//! PostgreSQL's clock does; the only timers here bound how long a caller waits, and the session
//! view's sweep (`session`) only reads. The grace period after lockdb's outage is one statement by
//! the database's clock, run when lockdb answers again, not when a timer fires.

pub mod authz;
pub mod backend;
pub mod callers;
pub mod checker;
pub mod error;
pub mod issued;
pub mod key;
pub mod queue;
pub mod service;
pub mod session;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

pub use error::LockError;
pub use service::LockServiceImpl;

use backend::{etcd::EtcdBackend, postgres::PgBackend, Backend};
use payout_proto::lock::lock_service_server::LockServiceServer;

/// The name under which grpc.health.v1 reports this service.
pub const HEALTH_SERVICE_NAME: &str = "lock.v1.LockService";

#[derive(Debug, Clone)]
pub enum BackendConfig {
    Etcd {
        endpoints: Vec<String>,
        /// etcd's authority and this server's certificate from it (mutual TLS, `https://` only).
        tls: mtls::Tls,
        prefix: String,
        /// How long grant records (INV-07 evidence) are kept; see
        /// [`backend::etcd::GRANT_RETENTION_MS_DEFAULT`].
        grant_retention_ms: u64,
    },
    Postgres {
        database_url: String,
    },
}

#[derive(Debug, Clone)]
pub struct Config {
    pub backend: BackendConfig,
    /// Where this server remembers the highest token it issued per key (INV-04), outside the backend.
    pub issued_tokens_path: PathBuf,
    /// How long that record keeps a key, and how many keys at most ([`issued::Limits`]).
    pub issued_tokens_limits: issued::Limits,
    /// What one client certificate may take of this server ([`callers::CallerLimits::SHIPPED`]
    /// in a deployment).
    pub caller_limits: callers::CallerLimits,
    /// The key every grant is signed with; the guards hold its public half.
    pub signer: Arc<grant_signing::Signer>,
}

/// Connects the backend (applying lockdb's migrations for PostgreSQL), opens the issued-token
/// record and registers the metrics.
pub async fn build(
    config: &Config,
    metrics: &service_kit::Metrics,
) -> Result<LockServiceImpl, LockError> {
    let lock_metrics = service::LockMetrics::register(metrics);
    let backend = match &config.backend {
        BackendConfig::Etcd {
            endpoints,
            tls,
            prefix,
            grant_retention_ms,
        } => Backend::Etcd(Box::new(
            EtcdBackend::connect(
                endpoints,
                tls,
                prefix,
                *grant_retention_ms,
                lock_metrics.sessions.clone(),
            )
            .await?,
        )),
        BackendConfig::Postgres { database_url } => Backend::Postgres(
            PgBackend::connect(database_url, lock_metrics.sessions.clone()).await?,
        ),
    };
    let issued =
        issued::IssuedTokens::open_with(&config.issued_tokens_path, config.issued_tokens_limits)?;
    Ok(
        LockServiceImpl::new(backend, issued, lock_metrics, Arc::clone(&config.signer))
            .with_caller_limits(config.caller_limits),
    )
}

/// Serves the lock service and grpc.health.v1 on `listener` until `shutdown`, over mutual TLS,
/// behind `authz::POLICY`.
pub async fn serve(
    service: LockServiceImpl,
    listener: tokio::net::TcpListener,
    tls: &service_kit::grpc::Tls,
    policy: &'static service_kit::grpc::Policy,
    metrics: &service_kit::Metrics,
    shutdown: service_kit::Shutdown,
) -> Result<(), LockError> {
    serve_bounded(
        service,
        listener,
        tls,
        policy,
        service::BOUNDS,
        metrics,
        shutdown,
    )
    .await
}

/// [`serve`] with `bounds` instead of [`service::BOUNDS`] (the tests' small bounds).
async fn serve_bounded(
    service: LockServiceImpl,
    listener: tokio::net::TcpListener,
    tls: &service_kit::grpc::Tls,
    policy: &'static service_kit::grpc::Policy,
    bounds: service_kit::grpc::Bounds,
    metrics: &service_kit::Metrics,
    shutdown: service_kit::Shutdown,
) -> Result<(), LockError> {
    let serving =
        service_kit::grpc::Serving::secure(tls, policy, bounds, metrics).map_err(grpc_error)?;
    serve_as(service, listener, serving, shutdown).await
}

/// TEST ONLY (feature `negative-controls`): [`serve`] without TLS and without the authorisation
/// table (every caller is taken as one worker: sessions belong to their creator's certificate,
/// and here all share that one), so `payoutdev bench e2e` can print what the security costs a
/// payout beside the same payout with it. The shipped binary is never built with the feature.
#[cfg(feature = "negative-controls")]
#[doc(hidden)]
pub async fn serve_plaintext_for_benches(
    service: LockServiceImpl,
    listener: tokio::net::TcpListener,
    shutdown: service_kit::Shutdown,
) -> Result<(), LockError> {
    let serving = service_kit::grpc::Serving::plaintext_for_benches("lock server");
    serve_as(service, listener, serving, shutdown).await
}

/// The one serving path: the lock service (with its request size bound) and its health, the
/// background tasks beside them.
async fn serve_as(
    service: LockServiceImpl,
    listener: tokio::net::TcpListener,
    serving: service_kit::grpc::Serving,
    shutdown: service_kit::Shutdown,
) -> Result<(), LockError> {
    let (health, tasks) = background_tasks(&service);
    let routes = tonic::service::Routes::new(health).add_service(
        LockServiceServer::new(service)
            .max_decoding_message_size(service_kit::grpc::REQUEST_BYTES_MAX),
    );
    let result = serving
        .serve(routes, listener, shutdown.wait())
        .await
        .map_err(grpc_error);
    drop(tasks);
    result
}

fn grpc_error(e: tonic::transport::Error) -> LockError {
    LockError::Backend {
        backend: "grpc-server",
        detail: e.to_string(),
    }
}

/// What runs beside the gRPC service while it serves: the health reporter's probe and the
/// session sweep. Both stop when this is dropped.
struct BackgroundTasks {
    health_task: tokio::task::JoinHandle<()>,
    sweep_task: tokio::task::JoinHandle<()>,
}

impl Drop for BackgroundTasks {
    fn drop(&mut self) {
        self.health_task.abort();
        self.sweep_task.abort();
    }
}

fn background_tasks(
    service: &LockServiceImpl,
) -> (
    tonic_health::pb::health_server::HealthServer<tonic_health::server::HealthService>,
    BackgroundTasks,
) {
    let reporter = tonic_health::server::HealthReporter::new();
    let health = tonic_health::pb::health_server::HealthServer::new(
        tonic_health::server::HealthService::from_health_reporter(reporter.clone()),
    );
    let probe = service.clone();
    let health_task = tokio::spawn(async move {
        use tonic_health::ServingStatus;
        loop {
            let status = if probe.backend().ping().await {
                ServingStatus::Serving
            } else {
                ServingStatus::NotServing
            };
            reporter
                .set_service_status(HEALTH_SERVICE_NAME, status)
                .await;
            reporter.set_service_status("", status).await;
            tokio::time::sleep(Duration::from_millis(service::HEALTH_PERIOD_MS)).await;
        }
    });
    // The session view (spec 2.4): states, transitions, and the backend's failovers noticed.
    let sweep_task = tokio::spawn({
        let service = service.clone();
        async move {
            loop {
                service.sweep_sessions().await;
                tokio::time::sleep(Duration::from_millis(session::SWEEP_MS)).await;
            }
        }
    });
    (
        health,
        BackgroundTasks {
            health_task,
            sweep_task,
        },
    )
}

/// A lock-server running in this process on a loopback port: for tests and the benchmark.
pub struct InProcess {
    pub endpoint: String,
    pub service: LockServiceImpl,
    pub metrics: service_kit::Metrics,
    stop: tokio::sync::watch::Sender<bool>,
    task: tokio::task::JoinHandle<Result<(), LockError>>,
}

impl InProcess {
    /// Serves with `tls` (a lock-server certificate) behind `authz::POLICY`; `endpoint` is its
    /// `https://` URL.
    pub async fn start(config: &Config, tls: &service_kit::grpc::Tls) -> Result<Self, LockError> {
        Self::start_with_policy(config, tls, &authz::POLICY).await
    }

    /// TEST ONLY: serves with another table (a suite that calls as several roles from one
    /// client serves with `testkit::pki::every_role(&authz::POLICY)`).
    #[doc(hidden)]
    pub async fn start_with_policy(
        config: &Config,
        tls: &service_kit::grpc::Tls,
        policy: &'static service_kit::grpc::Policy,
    ) -> Result<Self, LockError> {
        Self::start_with_waiters_max(config, tls, policy, service::WAITERS_MAX).await
    }

    /// TEST ONLY: [`Self::start_with_policy`] with another waiter bound than
    /// [`service::WAITERS_MAX`] ([`LockServiceImpl::with_waiters_max`]).
    #[doc(hidden)]
    pub async fn start_with_waiters_max(
        config: &Config,
        tls: &service_kit::grpc::Tls,
        policy: &'static service_kit::grpc::Policy,
        waiters_max: usize,
    ) -> Result<Self, LockError> {
        Self::start_with_bounds(config, tls, policy, waiters_max, service::BOUNDS).await
    }

    /// TEST ONLY: [`Self::start_with_waiters_max`] with other server bounds than
    /// [`service::BOUNDS`] (requests at once, a request's deadline).
    #[doc(hidden)]
    pub async fn start_with_bounds(
        config: &Config,
        tls: &service_kit::grpc::Tls,
        policy: &'static service_kit::grpc::Policy,
        waiters_max: usize,
        bounds: service_kit::grpc::Bounds,
    ) -> Result<Self, LockError> {
        let metrics = service_kit::Metrics::default();
        let service = build(config, &metrics).await?.with_waiters_max(waiters_max);
        Self::serve_for_tests(service, metrics, tls, policy, bounds).await
    }

    /// TEST ONLY: serves `service` (built by [`build`] on `metrics`, then shaped by a test, e.g.
    /// [`LockServiceImpl::without_operator_certification_for_tests`]) as [`Self::start_with_bounds`]
    /// does. The binary has no way to call it.
    #[doc(hidden)]
    pub async fn serve_for_tests(
        service: LockServiceImpl,
        metrics: service_kit::Metrics,
        tls: &service_kit::grpc::Tls,
        policy: &'static service_kit::grpc::Policy,
        bounds: service_kit::grpc::Bounds,
    ) -> Result<Self, LockError> {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .map_err(|e| LockError::Backend {
                backend: "grpc-server",
                detail: e.to_string(),
            })?;
        let endpoint = format!(
            "https://{}",
            listener
                .local_addr()
                .expect("bound listener has an address")
        );
        let (shutdown, stop) = service_kit::Shutdown::new();
        let task = tokio::spawn({
            let (service, tls, metrics) = (service.clone(), tls.clone(), metrics.clone());
            async move {
                serve_bounded(service, listener, &tls, policy, bounds, &metrics, shutdown).await
            }
        });
        Ok(Self {
            endpoint,
            service,
            metrics,
            stop,
            task,
        })
    }

    pub async fn stop(self) {
        let _ = self.stop.send(true);
        let _ = self.task.await;
    }
}
