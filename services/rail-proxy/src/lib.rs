//! The rail proxy: the second, independent guard in front of the rail (spec 2.2, 2.3, 2.5, 2.6).
//!
//! Architecture invariant: the proxy knows nothing of etcd, paydb or Temporal. The only thing it
//! shares with the rest of the system is the fencing token, which it validates against its own
//! per-account high-water in its own database (proxydb), together with a unique submission per
//! payout, **before** the rail is contacted. It then calls the rail exactly once and records the
//! outcome exactly once; nothing, under any token or after any delay, calls the rail again for
//! that payout.
//!
//! gRPC (`railproxy.v1.RailProxy`): `Submit`, `Lookup`, `Inquire`. Rust callers use
//! [`client::RailProxyClient`], which turns rejections into typed [`client::ProxyError`]s.

pub mod api;
pub mod bench;
pub mod client;
pub mod model;
pub mod rail;
mod service;
pub mod store;

use std::sync::Arc;
use std::time::Duration;

use payout_proto::railproxy::rail_proxy_server::RailProxyServer;
use service_kit::Shutdown;

pub use model::{
    DuplicateClass, Evidence, InquirePayout, InvalidArgument, Outcome, Payment, Resolution,
    Submission, SubmitPayout,
};
pub use rail::{RAIL_CALL_TIMEOUT_MS_DEFAULT, RAIL_CALL_TIMEOUT_MS_MAX};
pub use store::MIGRATOR;

/// The gRPC service name, also the name its health status is reported under.
pub const SERVICE_NAME: &str = "railproxy.v1.RailProxy";

/// Whether the guard runs. Only [`ProxyConfig::disable_guards_for_negative_control`] turns it
/// off, and no binary calls that.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Guards {
    Enforced,
    DisabledForNegativeControl,
}

/// Test-only crash and stall points.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Failpoint {
    /// `std::process::abort()` right after the intent commits, before the rail is called: the
    /// "proxy died between intent and answer" case, which must leave a NULL outcome.
    AbortAfterIntent,
    /// Stall this long right after the intent commits, before the rail is called: the "proxy
    /// paused between intent and send" case, which the instruction's expiry must make harmless.
    PauseAfterIntent { ms: u64 },
}

/// The two protections a test may switch off, each only through a hidden setter that no binary
/// calls, to show what it prevents.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Protections {
    /// A fenced inquiry that finds no submission seals the payout (NOT_SENT).
    pub seal: bool,
    /// Every payment instruction carries `valid_until`, and ABSENT waits for it to pass.
    pub expiry: bool,
}

#[derive(Debug, Clone)]
pub struct ProxyConfig {
    pub rail_base_url: String,
    /// Timeout of the single payment call; bounded by [`RAIL_CALL_TIMEOUT_MS_MAX`].
    pub rail_timeout: Duration,
    guards: Guards,
    pub(crate) protections: Protections,
    failpoint: Option<Failpoint>,
}

#[derive(Debug, thiserror::Error)]
pub enum ProxyServerError {
    #[error("rail timeout of {0} ms is zero or above the bound of {RAIL_CALL_TIMEOUT_MS_MAX} ms")]
    RailTimeoutOutOfBounds(u128),
    #[error(transparent)]
    Store(#[from] store::StoreError),
    #[error("serving gRPC: {0}")]
    Serve(#[from] tonic::transport::Error),
}

impl ProxyConfig {
    pub fn new(rail_base_url: impl Into<String>) -> Self {
        Self {
            rail_base_url: rail_base_url.into(),
            rail_timeout: Duration::from_millis(RAIL_CALL_TIMEOUT_MS_DEFAULT),
            guards: Guards::Enforced,
            protections: Protections {
                seal: true,
                expiry: true,
            },
            failpoint: None,
        }
    }

    pub fn with_rail_timeout(mut self, timeout: Duration) -> Self {
        self.rail_timeout = timeout;
        self
    }

    /// TEST ONLY: the negative control. Skips the high-water and the uniqueness check and
    /// records nothing, so a test can show the duplicate payment the guard prevents. The
    /// binaries never call this; it is not reachable from any flag or environment variable.
    #[doc(hidden)]
    pub fn disable_guards_for_negative_control(mut self) -> Self {
        self.guards = Guards::DisabledForNegativeControl;
        self
    }

    /// TEST ONLY: the negative control of the seal. A fenced inquiry still advances the
    /// high-water but never seals an unsubmitted payout, so a late Submit with a token at or
    /// above the inquirer's is accepted and sent. No binary calls this.
    #[doc(hidden)]
    pub fn disable_seal_for_negative_control(mut self) -> Self {
        self.protections.seal = false;
        self
    }

    /// TEST ONLY: the negative control of the expiry. Payment instructions carry no
    /// `valid_until`, and an inquiry takes the rail's ABSENT at its word. No binary calls this.
    #[doc(hidden)]
    pub fn disable_instruction_expiry_for_negative_control(mut self) -> Self {
        self.protections.expiry = false;
        self
    }

    /// TEST ONLY: a crash point (the binary exposes it through a hidden, test-only flag; it can
    /// only crash the process, which is a failure the design already tolerates).
    #[doc(hidden)]
    pub fn with_failpoint(mut self, failpoint: Option<Failpoint>) -> Self {
        self.failpoint = failpoint;
        self
    }

    fn validate(&self) -> Result<(), ProxyServerError> {
        let ms = self.rail_timeout.as_millis();
        if ms == 0 || ms > u128::from(RAIL_CALL_TIMEOUT_MS_MAX) {
            return Err(ProxyServerError::RailTimeoutOutOfBounds(ms));
        }
        Ok(())
    }
}

/// Applies proxydb's migrations.
pub async fn migrate(pool: &sqlx::PgPool) -> Result<(), store::StoreError> {
    MIGRATOR.run(pool).await?;
    Ok(())
}

/// Serves `railproxy.v1.RailProxy` and `grpc.health.v1` on `listener` until `shutdown` fires.
/// The caller has applied the migrations (see [`migrate`]).
pub async fn run(
    listener: tokio::net::TcpListener,
    pool: sqlx::PgPool,
    config: ProxyConfig,
    metrics: service_kit::Metrics,
    shutdown: Shutdown,
) -> Result<(), ProxyServerError> {
    config.validate()?;
    let (reporter, health) = tonic_health::server::health_reporter();
    let health_task = tokio::spawn(service_kit::health_from_db(
        reporter,
        SERVICE_NAME,
        pool.clone(),
        Duration::from_millis(service_kit::HEALTH_PERIOD_MS),
    ));
    let rail = rail::Rail::new(config.rail_base_url.clone(), config.rail_timeout);
    let counters = service::Counters::new(&metrics);
    tracing::info!(addr = ?listener.local_addr().ok(), rail = %config.rail_base_url, rail_timeout_ms = config.rail_timeout.as_millis() as u64, "rail proxy listening");
    let service = service::ProxyService(Arc::new(service::Inner {
        pool,
        rail,
        config,
        counters,
    }));
    let result = tonic::transport::Server::builder()
        .add_service(health)
        .add_service(RailProxyServer::new(service))
        .serve_with_incoming_shutdown(service_kit::incoming(listener), shutdown.wait())
        .await;
    health_task.abort();
    Ok(result?)
}

/// A proxy running in this process (tests, the benchmark).
pub struct RunningProxy {
    pub addr: std::net::SocketAddr,
    pub metrics: service_kit::Metrics,
    stop: tokio::sync::watch::Sender<bool>,
    task: tokio::task::JoinHandle<Result<(), ProxyServerError>>,
}

impl RunningProxy {
    /// Migrates `pool`'s database and serves `config` on a free 127.0.0.1 port.
    pub async fn start(pool: sqlx::PgPool, config: ProxyConfig) -> Result<Self, ProxyServerError> {
        config.validate()?;
        migrate(&pool).await?;
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .map_err(|e| store::StoreError::Db(sqlx::Error::Io(e)))?;
        let addr = listener
            .local_addr()
            .map_err(|e| store::StoreError::Db(sqlx::Error::Io(e)))?;
        let metrics = service_kit::Metrics::default();
        let (shutdown, stop) = Shutdown::new();
        let task = tokio::spawn(run(listener, pool, config, metrics.clone(), shutdown));
        Ok(Self {
            addr,
            metrics,
            stop,
            task,
        })
    }

    pub fn endpoint(&self) -> String {
        format!("http://{}", self.addr)
    }

    pub async fn stop(self) -> Result<(), ProxyServerError> {
        let _ = self.stop.send(true);
        self.task.await.expect("proxy task does not panic")
    }
}
