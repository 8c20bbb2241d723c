//! The General Ledger service (spec 002): an append-only, idempotent, double-entry journal with
//! its own PostgreSQL (`gldb`) behind `ledger.v1.GeneralLedgerService`.
//!
//! Architecture invariants: the GL never writes another service's database, and nothing but this
//! crate writes gldb. Journal tables are append-only twice over: the service's connections run as
//! role `gl_app` (SELECT/INSERT only) and triggers refuse UPDATE/DELETE/TRUNCATE to everyone.

pub mod amount;
pub mod api;
pub mod authz;
pub mod error;
pub mod projection;
pub mod store;
pub mod validate;

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use payout_proto::ledger::general_ledger_service_server::GeneralLedgerServiceServer;
use sqlx::postgres::PgPoolOptions;
use sqlx::{Executor, PgPool};

pub use error::LedgerError;

/// The name `grpc.health.v1` reports for this service.
pub const SERVICE_NAME: &str = "ledger.v1.GeneralLedgerService";
/// The database role every service connection switches to (created by the migrations).
pub const APP_ROLE: &str = "gl_app";

#[derive(Clone)]
pub struct Config {
    pub database_url: String,
    /// The server's certificate; every caller must present one from the same authority, and
    /// `authz::POLICY` decides what its role may call.
    pub tls: service_kit::grpc::Tls,
    policy: &'static service_kit::grpc::Policy,
    receipt_watermark: bool,
    /// SetOperatingMode records only the operator the caller's certificate carries.
    operator_certification: bool,
}

impl Config {
    /// Serves `authz::POLICY`.
    pub fn new(database_url: impl Into<String>, tls: service_kit::grpc::Tls) -> Self {
        Self {
            database_url: database_url.into(),
            tls,
            policy: &authz::POLICY,
            receipt_watermark: true,
            operator_certification: true,
        }
    }

    /// NEGATIVE CONTROL ONLY: SetOperatingMode records the operator the request names without
    /// asking whether the caller's certificate carries that name. Tests use it to show that the
    /// certified-operator tests detect what they claim to. The binary has no way to call it.
    #[doc(hidden)]
    pub fn without_operator_certification_for_tests(mut self) -> Self {
        self.operator_certification = false;
        self
    }

    /// NEGATIVE CONTROL ONLY: listings read past the receipt watermark
    /// (`Store::without_receipt_watermark_for_tests`). The binary has no way to call it.
    #[doc(hidden)]
    pub fn without_receipt_watermark_for_tests(mut self) -> Self {
        self.receipt_watermark = false;
        self
    }

    /// TEST ONLY: serve with another table (this crate's own suite calls as dispatcher and as
    /// operator from one client: `testkit::pki::every_role(&authz::POLICY)`). The
    /// binary has no way to call it.
    #[doc(hidden)]
    pub fn with_policy_for_tests(mut self, policy: &'static service_kit::grpc::Policy) -> Self {
        self.policy = policy;
        self
    }
}

/// gldb's migrations.
pub static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("../../migrations/gldb");

/// Applies the migrations as the database owner (tests and in-process harnesses; a deployment
/// runs `payoutctl migrate`).
pub async fn migrate(database_url: &str) -> Result<(), LedgerError> {
    let owner = PgPoolOptions::new()
        .max_connections(1)
        .connect(database_url)
        .await
        .map_err(|e| {
            LedgerError::Startup(format!(
                "connecting to {}: {e}",
                service_kit::redact(database_url)
            ))
        })?;
    MIGRATOR
        .run(&owner)
        .await
        .map_err(|e| LedgerError::Startup(format!("gldb migrations: {e}")))?;
    owner.close().await;
    Ok(())
}

/// A bounded pool whose every connection runs as `gl_app`, so the service itself cannot update or
/// delete journal rows whatever its code does.
pub async fn app_pool(database_url: &str) -> Result<PgPool, LedgerError> {
    PgPoolOptions::new()
        .max_connections(service_kit::pool::CONNECTIONS_MAX)
        .acquire_timeout(Duration::from_millis(service_kit::pool::ACQUIRE_TIMEOUT_MS))
        .after_connect(|conn, _| {
            Box::pin(async move {
                conn.execute("SET ROLE gl_app").await?;
                Ok(())
            })
        })
        .connect(database_url)
        .await
        .map_err(|e| {
            LedgerError::Startup(format!(
                "connecting to {}: {e}",
                service_kit::redact(database_url)
            ))
        })
}

/// The system accounts every supported currency needs: where payouts clear, and where customer
/// funding comes from. Idempotent.
pub async fn seed_system_accounts(store: &store::Store) -> Result<(), LedgerError> {
    for (code, _) in payout_domain::SUPPORTED_CURRENCIES {
        for (class, owner_id) in [("PAYOUT_CLEARING", "rail"), ("FUNDING", "treasury")] {
            let key = validate::AccountKey {
                class: class.into(),
                owner_type: "SYSTEM".into(),
                owner_id: owner_id.into(),
                asset: code.into(),
            };
            store.open_account(&key).await?;
        }
    }
    Ok(())
}

/// Refuses a gldb whose schema is not this build's (the service's role may not run DDL:
/// `payoutctl migrate` applies the migrations as the owner).
pub async fn require_schema(pool: &PgPool) -> Result<(), LedgerError> {
    db_access::require_schema(pool, &MIGRATOR, "gldb")
        .await
        .map_err(|e| LedgerError::Startup(e.to_string()))
}

/// Checks the schema, seeds and serves until `shutdown` resolves.
pub async fn serve(
    config: Config,
    listener: tokio::net::TcpListener,
    metrics: service_kit::Metrics,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), LedgerError> {
    let pool = app_pool(&config.database_url).await?;
    require_schema(&pool).await?;
    let mut store = store::Store::new(pool.clone());
    if !config.receipt_watermark {
        store = store.without_receipt_watermark_for_tests();
    }
    let store = Arc::new(store);
    seed_system_accounts(&store).await?;

    let (reporter, health_service) = tonic_health::server::health_reporter();
    let health = tokio::spawn(service_kit::health_from_db(
        reporter,
        SERVICE_NAME,
        pool.clone(),
        Duration::from_millis(service_kit::HEALTH_PERIOD_MS),
    ));
    let api = api::LedgerApi {
        store,
        metrics: api::LedgerMetrics::new(&metrics),
        certifies_operators: config.operator_certification,
    };
    let service = GeneralLedgerServiceServer::new(api)
        .max_decoding_message_size(service_kit::grpc::REQUEST_BYTES_MAX);
    let address = listener.local_addr().ok();
    tracing::info!(?address, "general ledger serving");
    let incoming = service_kit::incoming(listener);
    let mut server = service_kit::grpc::server(
        &config.tls,
        config.policy,
        service_kit::grpc::BOUNDS,
        &metrics,
    )
    .map_err(|e| LedgerError::Startup(format!("TLS: {e}")))?;
    let result = server
        .add_service(health_service)
        .add_service(service)
        .serve_with_incoming_shutdown(incoming, shutdown)
        .await
        .map_err(|e| LedgerError::Startup(format!("gRPC server: {e}")));
    health.abort();
    pool.close().await;
    result
}

/// A ledger server running in this process (tests, the benchmark).
pub struct Spawned {
    pub address: SocketAddr,
    stop: tokio::sync::oneshot::Sender<()>,
    task: tokio::task::JoinHandle<Result<(), LedgerError>>,
}

impl Spawned {
    pub fn endpoint(&self) -> String {
        format!("https://{}", self.address)
    }
    /// Stops the server and waits for it.
    pub async fn stop(self) -> Result<(), LedgerError> {
        let _ = self.stop.send(());
        self.task
            .await
            .map_err(|e| LedgerError::Startup(format!("server task: {e}")))?
    }
}

/// Binds `listen` (port 0 for any), then serves `config` in a task. Returns once the gRPC port
/// answers a TLS handshake.
pub async fn spawn(config: Config, listen: SocketAddr) -> Result<Spawned, LedgerError> {
    let tls = config.tls.clone();
    migrate(&config.database_url).await?;
    let listener = tokio::net::TcpListener::bind(listen)
        .await
        .map_err(|e| LedgerError::Startup(format!("bind {listen}: {e}")))?;
    let address = listener
        .local_addr()
        .map_err(|e| LedgerError::Startup(e.to_string()))?;
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(serve(
        config,
        listener,
        service_kit::Metrics::default(),
        async move {
            let _ = stopped.await;
        },
    ));
    // Seeding precedes serving, so the first answer means the server is fully ready.
    let endpoint = format!("https://{address}");
    let deadline = tokio::time::Instant::now() + Duration::from_millis(SPAWN_READY_TIMEOUT_MS);
    loop {
        if task.is_finished() {
            return Err(task
                .await
                .map_err(|e| LedgerError::Startup(e.to_string()))?
                .err()
                .unwrap_or(LedgerError::Startup("server exited".into())));
        }
        // Any certificate of the authority completes the handshake; the server's own is at hand.
        if tls
            .connect(&endpoint, service_kit::grpc::Role::GeneralLedger)
            .await
            .is_ok()
        {
            return Ok(Spawned {
                address,
                stop,
                task,
            });
        }
        if tokio::time::Instant::now() > deadline {
            return Err(LedgerError::Startup(format!(
                "server not ready within {SPAWN_READY_TIMEOUT_MS} ms"
            )));
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Migrations and seeding of a fresh database take well under this on the slowest machine we use.
const SPAWN_READY_TIMEOUT_MS: u64 = 30_000;
