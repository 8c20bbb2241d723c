//! What every service process shares, so that each service's `main` only wires its own parts:
//! structured tracing, a Prometheus `/metrics` endpoint, `grpc.health.v1` backed by a real
//! dependency check, graceful shutdown on SIGTERM, bounded PostgreSQL pools, and typed rejection
//! details carried in gRPC statuses.

use std::net::SocketAddr;
use std::time::Duration;

use anyhow::Context;
use prometheus::{Encoder, IntCounterVec, Opts, Registry, TextEncoder};

pub use prometheus;
pub use tonic_health;

pub mod latency;

pub mod guard_metrics;
pub use guard_metrics::{Guard, GuardCounters};

/// Installs the global subscriber. `RUST_LOG` filters (default `info`); `LOG_FORMAT=json` emits one
/// JSON object per event, which is what a deployment ships to its log pipeline.
pub fn init_tracing(service: &str) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let json = std::env::var("LOG_FORMAT").is_ok_and(|v| v == "json");
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_target(false);
    let result = if json {
        builder.json().flatten_event(true).try_init()
    } else {
        builder.try_init()
    };
    // A second init (tests running a service in-process) keeps the first subscriber.
    let _ = result;
    tracing::info!(service, "starting");
}

/// A registry per process, with helpers that panic only on programmer error (a duplicate name).
#[derive(Clone, Default)]
pub struct Metrics {
    pub registry: Registry,
    unauthorised: std::sync::Arc<std::sync::OnceLock<IntCounterVec>>,
    database_restored: std::sync::Arc<std::sync::OnceLock<prometheus::IntGaugeVec>>,
    denylist: std::sync::Arc<std::sync::OnceLock<(prometheus::IntGauge, prometheus::IntCounter)>>,
    /// Histograms by name ([`Metrics::histogram_vec`]): registered once per registry.
    histograms: std::sync::Arc<
        std::sync::Mutex<std::collections::HashMap<String, prometheus::HistogramVec>>,
    >,
}

impl Metrics {
    pub fn counter_vec(&self, name: &str, help: &str, labels: &[&str]) -> IntCounterVec {
        let counter =
            IntCounterVec::new(Opts::new(name, help), labels).expect("valid metric definition");
        self.registry
            .register(Box::new(counter.clone()))
            .expect("metric registered once");
        counter
    }

    /// `unauthorised_calls_total{method,reason,role}`, registered on first use: a process may
    /// build its server more than once on one registry (a restart in a test).
    pub fn unauthorised_calls(&self) -> IntCounterVec {
        self.unauthorised
            .get_or_init(|| {
                self.counter_vec(
                    "unauthorised_calls_total",
                    "calls refused by the authorisation table (role not allowed, unknown method, no role)",
                    &["method", "reason", "role"],
                )
            })
            .clone()
    }

    /// `tls_denylist_entries` (certificates a server refuses) and
    /// `tls_denylist_reload_failures_total` (a changed denylist that could not be read: the last
    /// good one stays in force), registered on first use.
    pub fn denylist(&self) -> (prometheus::IntGauge, prometheus::IntCounter) {
        self.denylist
            .get_or_init(|| {
                let entries = prometheus::IntGauge::new(
                    "tls_denylist_entries",
                    "Client certificates this server refuses (its --tls-denylist)",
                )
                .expect("valid metric definition");
                let failures = prometheus::IntCounter::new(
                    "tls_denylist_reload_failures_total",
                    "Changes of the denylist file that could not be read (the last good list stays in force). Alert on any.",
                )
                .expect("valid metric definition");
                self.registry
                    .register(Box::new(entries.clone()))
                    .expect("metric registered once");
                self.registry
                    .register(Box::new(failures.clone()))
                    .expect("metric registered once");
                (entries, failures)
            })
            .clone()
    }

    /// `guard_database_restored{guard}`, registered on first use: 1 while the guard's database is
    /// a copy restored from a backup that the restore procedure has not re-armed
    /// ([`watch_incarnation`]), 0 otherwise.
    pub fn database_restored(&self) -> prometheus::IntGaugeVec {
        self.database_restored
            .get_or_init(|| {
                let gauge = prometheus::IntGaugeVec::new(
                    Opts::new(
                        "guard_database_restored",
                        "1 while the guard's database is a copy restored from a backup and not re-armed (every fenced call is refused until `payoutctl restore rearm`). Alert on any.",
                    ),
                    &["guard"],
                )
                .expect("valid metric definition");
                self.registry
                    .register(Box::new(gauge.clone()))
                    .expect("metric registered once");
                gauge
            })
            .clone()
    }

    pub fn render(&self) -> String {
        let mut buffer = Vec::new();
        TextEncoder::new()
            .encode(&self.registry.gather(), &mut buffer)
            .expect("text encoding cannot fail");
        String::from_utf8(buffer).expect("prometheus text format is UTF-8")
    }
}

/// Serves `GET /metrics` on its own listener until `shutdown` resolves.
pub async fn serve_metrics(
    listener: tokio::net::TcpListener,
    metrics: Metrics,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    let app = axum::Router::new().route(
        "/metrics",
        axum::routing::get(move || {
            let metrics = metrics.clone();
            async move { metrics.render() }
        }),
    );
    axum::serve(listener, app)
        .with_graceful_shutdown(shutdown)
        .await
        .context("metrics endpoint")
}

/// Resolves on SIGTERM or SIGINT: the signal a container runtime or an operator sends.
pub async fn shutdown_signal() {
    use tokio::signal::unix::{signal, SignalKind};
    let mut term = signal(SignalKind::terminate()).expect("SIGTERM handler");
    let mut int = signal(SignalKind::interrupt()).expect("SIGINT handler");
    tokio::select! {
        _ = term.recv() => tracing::info!("SIGTERM received, shutting down"),
        _ = int.recv() => tracing::info!("SIGINT received, shutting down"),
    }
}

/// A shutdown trigger that can be cloned into every task that must stop together.
#[derive(Clone)]
pub struct Shutdown(tokio::sync::watch::Receiver<bool>);

impl Shutdown {
    /// Returns the handle and the trigger; dropping or sending on the trigger stops everything.
    pub fn new() -> (Self, tokio::sync::watch::Sender<bool>) {
        let (tx, rx) = tokio::sync::watch::channel(false);
        (Self(rx), tx)
    }
    /// Stops on SIGTERM/SIGINT.
    pub fn on_signal() -> Self {
        let (me, tx) = Self::new();
        tokio::spawn(async move {
            shutdown_signal().await;
            let _ = tx.send(true);
        });
        me
    }
    pub async fn wait(mut self) {
        let _ = self.0.wait_for(|stop| *stop).await;
    }
}

/// Bounds of every service's PostgreSQL pool.
pub mod pool {
    /// Enough for the two cores of a node and a few concurrent slow transactions; a bigger pool
    /// only moves the queue from the service into PostgreSQL.
    pub const CONNECTIONS_MAX: u32 = 16;
    /// A request waits at most this long for a connection before failing fast (UNAVAILABLE).
    pub const ACQUIRE_TIMEOUT_MS: u64 = 5_000;
    /// At start-up, a database restart (seconds) is waited out; a database gone for a minute is an
    /// outage the supervisor must see.
    pub const CONNECT_ATTEMPTS_MAX: u32 = 60;
    pub const CONNECT_RETRY_MS: u64 = 1_000;
}

/// Connects a bounded pool. A database that is down at start-up (restarting, failing over) is
/// retried for a bounded time instead of the process exiting at once; past the bound the error
/// stands and the process's supervisor decides. Later outages surface as per-request errors and in
/// the health status.
pub async fn connect_pg(url: &str) -> anyhow::Result<sqlx::PgPool> {
    let mut attempt = 1;
    loop {
        let connected = sqlx::postgres::PgPoolOptions::new()
            .max_connections(pool::CONNECTIONS_MAX)
            .acquire_timeout(Duration::from_millis(pool::ACQUIRE_TIMEOUT_MS))
            .connect(url)
            .await;
        match connected {
            Ok(pool) => return Ok(pool),
            Err(error) if attempt < pool::CONNECT_ATTEMPTS_MAX => {
                tracing::warn!(database = %redact(url), attempt, %error, "database not reachable yet; retrying");
                tokio::time::sleep(Duration::from_millis(pool::CONNECT_RETRY_MS)).await;
                attempt += 1;
            }
            Err(error) => {
                return Err(error).with_context(|| format!("connecting to {}", redact(url)))
            }
        }
    }
}

/// Keeps the `grpc.health.v1` status of `service_name` (and of the empty name, which is what
/// generic probes ask) in step with a database ping, every `period`.
pub async fn health_from_db(
    reporter: tonic_health::server::HealthReporter,
    service_name: &'static str,
    pool: sqlx::PgPool,
    period: Duration,
) {
    use tonic_health::ServingStatus;
    loop {
        let ok = sqlx::query("SELECT 1").execute(&pool).await.is_ok();
        let status = if ok {
            ServingStatus::Serving
        } else {
            ServingStatus::NotServing
        };
        reporter.set_service_status(service_name, status).await;
        reporter.set_service_status("", status).await;
        tokio::time::sleep(period).await;
    }
}

/// Watches whether a guard's database (paydb, proxydb) is the one its incarnation row was armed
/// in (`incarnation_is_current()`, migration 0006), from the start and every `period`: a copy
/// restored from a backup has rewound fences, so the guard refuses every fenced call on it (in the
/// fence statement itself) until the restore procedure has run. This is the alarm: the gauge
/// `guard_database_restored{guard}` and an alert-level log line when it is found, and again when
/// it is re-armed.
pub async fn watch_incarnation(
    pool: sqlx::PgPool,
    guard: &'static str,
    gauge: prometheus::IntGaugeVec,
    period: Duration,
) {
    let mut last: Option<bool> = None;
    loop {
        match sqlx::query_scalar::<_, bool>("SELECT incarnation_is_current()")
            .fetch_one(&pool)
            .await
        {
            Ok(current) => {
                gauge.with_label_values(&[guard]).set(i64::from(!current));
                if !current && last != Some(false) {
                    tracing::error!(
                        event = "database_restored", alert = true, guard,
                        "the guard's database is a copy restored from a backup and not re-armed: every fenced call is refused until `payoutctl restore rearm` (RESTORE.md: A guard's database restored)"
                    );
                } else if current && last == Some(false) {
                    tracing::warn!(event = "database_rearmed", guard, "the guard's database was re-armed after a restore; fenced calls are admitted again");
                }
                last = Some(current);
            }
            Err(e) => {
                tracing::warn!(guard, error = %e, "could not ask whether the database was restored")
            }
        }
        tokio::time::sleep(period).await;
    }
}

/// How often a guard asks whether its database is a restored copy.
pub const INCARNATION_PERIOD_MS: u64 = 5_000;

/// How often health probes the database.
pub const HEALTH_PERIOD_MS: u64 = 1_000;

/// Hides the password of a `postgres://user:password@host/db` URL before it is logged.
pub use db_access::redact;

/// Binds a listener, with the address in the error.
pub async fn bind(addr: SocketAddr) -> anyhow::Result<tokio::net::TcpListener> {
    tokio::net::TcpListener::bind(addr)
        .await
        .with_context(|| format!("binding {addr}"))
}

/// The typed rejection helpers, defined beside the wire messages (`payout_proto::rejection`).
pub use payout_proto::rejection;

/// The connections a gRPC server accepts on `listener`, with `TCP_NODELAY` set on each. Without
/// it Nagle's algorithm meets the client's delayed ACK and a small response waits ~40 ms: that
/// was the whole p99 of the lock service. tonic sets it only on listeners it binds itself.
pub fn incoming(
    listener: tokio::net::TcpListener,
) -> impl tokio_stream::Stream<Item = std::io::Result<tokio::net::TcpStream>> {
    tokio_stream::StreamExt::map(
        tokio_stream::wrappers::TcpListenerStream::new(listener),
        |stream| stream.and_then(|s| s.set_nodelay(true).map(|()| s)),
    )
}

/// Every gRPC server's front door: mutual TLS, the service's authorisation table, and bounds.
pub mod grpc {
    use std::sync::Arc;
    use std::time::Duration;

    use tonic::transport::Server;
    use tower::layer::util::{Identity, Stack};
    use tower::limit::GlobalConcurrencyLimitLayer;

    pub use mtls::authz::{Policy, Refusal, Rule};
    pub use mtls::{Caller, Role, Tls, TlsArgs, TlsError};

    /// A gRPC server's TLS material: [`TlsArgs`] and the certificate denylist it refuses
    /// (`mtls::denylist`). The denylist is required: a misspelt path must not mean "nothing
    /// denied", so a server does not start without a readable file (which may be empty).
    #[derive(Debug, Clone, clap::Args)]
    pub struct ServerTlsArgs {
        #[command(flatten)]
        pub tls: TlsArgs,
        /// The client certificates this server refuses (`payoutctl pki deny` appends one; read
        /// again within seconds of a change).
        #[arg(
            long = "tls-denylist",
            env = "PAYOUT_TLS_DENYLIST",
            value_name = "FILE"
        )]
        pub denylist: std::path::PathBuf,
    }

    impl ServerTlsArgs {
        pub fn load(&self) -> anyhow::Result<Tls> {
            let denylist = mtls::denylist::Denylist::load(&self.denylist)?;
            Ok(self.tls.load()?.with_denylist(denylist))
        }
    }

    /// Reads the denylist again whenever its file changes, for as long as a server holds it.
    async fn watch_denylist(
        denylist: std::sync::Weak<mtls::denylist::Denylist>,
        entries: prometheus::IntGauge,
        failures: prometheus::IntCounter,
    ) {
        loop {
            tokio::time::sleep(Duration::from_millis(mtls::denylist::RELOAD_MS)).await;
            let Some(list) = denylist.upgrade() else {
                return;
            };
            match list.reload_if_changed() {
                Ok(true) => {
                    entries.set(list.len() as i64);
                    tracing::warn!(entries = list.len(), path = ?list.path(), "certificate denylist reloaded");
                }
                Ok(false) => {}
                Err(error) => {
                    failures.inc();
                    tracing::error!(alert = true, %error, "certificate denylist not reloaded; the last good list stays in force");
                }
            }
        }
    }

    /// A server's bounds: requests handled at once (past it a call is shed at once, tonic's
    /// RESOURCE_EXHAUSTED "Too many active requests for the connection", nothing run, instead of
    /// queueing without bound; callers treat it as transient and retry with backoff), and how
    /// long one request may take (then the request is cut, CANCELLED "Timeout expired"; its
    /// transaction rolls back). Both shown by the lock service's
    /// `a_server_sheds_calls_past_its_concurrency_bound_and_cuts_them_at_its_deadline`.
    #[derive(Debug, Clone, Copy)]
    pub struct Bounds {
        pub concurrency_max: usize,
        pub request_timeout_ms: u64,
    }

    /// The guards' and the GL's bounds: every call is one short transaction.
    pub const BOUNDS: Bounds = Bounds {
        concurrency_max: 256,
        request_timeout_ms: 30_000,
    };
    /// The largest request any service decodes. Every request of this system is a few hundred
    /// bytes; a bigger one is refused (RESOURCE_EXHAUSTED, by [`OversizeIsResourceExhausted`])
    /// before it is parsed.
    pub const REQUEST_BYTES_MAX: usize = 64 * 1024;

    /// The server builder every service uses, with its layers' types.
    pub type SecureServer = Server<
        Stack<
            GlobalConcurrencyLimitLayer,
            Stack<mtls::authz::Authorize, Stack<OversizeIsResourceExhausted, Identity>>,
        >,
    >;

    /// tonic refuses a request above `max_decoding_message_size` with OUT_OF_RANGE ("decoded
    /// message length too large"); gRPC's convention for a message larger than the server
    /// accepts is RESOURCE_EXHAUSTED, which is what a client's retry and alerting logic expect.
    /// This layer rewrites that one answer (its status travels in the response's headers, as
    /// tonic answers a request it could not decode) and nothing else.
    #[derive(Debug, Clone, Copy, Default)]
    pub struct OversizeIsResourceExhausted;

    impl<S> tower::Layer<S> for OversizeIsResourceExhausted {
        type Service = OversizeIsResourceExhaustedService<S>;
        fn layer(&self, inner: S) -> Self::Service {
            OversizeIsResourceExhaustedService { inner }
        }
    }

    #[derive(Debug, Clone)]
    pub struct OversizeIsResourceExhaustedService<S> {
        inner: S,
    }

    /// tonic's words for a request over the decoding bound (tonic::codec::decode).
    const TONIC_OVERSIZE_MESSAGE: &str = "message length too large";

    /// `response` with an oversize request's OUT_OF_RANGE made RESOURCE_EXHAUSTED.
    pub fn oversize_as_resource_exhausted<B>(
        mut response: tonic::codegen::http::Response<B>,
    ) -> tonic::codegen::http::Response<B> {
        let headers = response.headers_mut();
        let out_of_range = (tonic::Code::OutOfRange as i32).to_string();
        let is_oversize = headers
            .get("grpc-status")
            .is_some_and(|v| v.as_bytes() == out_of_range.as_bytes())
            && headers.get("grpc-message").is_some_and(|m| {
                String::from_utf8_lossy(m.as_bytes())
                    .replace("%20", " ")
                    .contains(TONIC_OVERSIZE_MESSAGE)
            });
        if is_oversize {
            headers.insert(
                "grpc-status",
                tonic::codegen::http::HeaderValue::from(tonic::Code::ResourceExhausted as i32),
            );
        }
        response
    }

    impl<S, Req, B> tower::Service<Req> for OversizeIsResourceExhaustedService<S>
    where
        S: tower::Service<Req, Response = tonic::codegen::http::Response<B>>,
        S::Future: Send + 'static,
    {
        type Response = S::Response;
        type Error = S::Error;
        type Future = std::pin::Pin<
            Box<dyn std::future::Future<Output = Result<S::Response, S::Error>> + Send>,
        >;

        fn poll_ready(
            &mut self,
            cx: &mut std::task::Context<'_>,
        ) -> std::task::Poll<Result<(), Self::Error>> {
            self.inner.poll_ready(cx)
        }

        fn call(&mut self, request: Req) -> Self::Future {
            let answer = self.inner.call(request);
            Box::pin(async move { answer.await.map(oversize_as_resource_exhausted) })
        }
    }

    /// A server that requires a client certificate from the authority, refuses every call whose
    /// verified role is not in `policy`'s row for the method (counted in
    /// `unauthorised_calls_total{method,reason,role}` and logged), and holds the bounds above.
    pub fn server(
        tls: &Tls,
        policy: &'static Policy,
        bounds: Bounds,
        metrics: &crate::Metrics,
    ) -> Result<SecureServer, tonic::transport::Error> {
        let refused = metrics.unauthorised_calls();
        let record: mtls::authz::Recorder = Arc::new(move |refusal: &Refusal| {
            let role = refusal.role.map_or("none", Role::name);
            refused
                .with_label_values(&[refusal.path.as_str(), refusal.reason.as_str(), role])
                .inc();
            if refusal.reason == mtls::authz::RefusalReason::CertificateDenied {
                tracing::error!(
                    alert = true,
                    method = %refusal.path,
                    role,
                    "call refused: a denied (revoked) certificate was used"
                );
            } else {
                tracing::warn!(
                    method = %refusal.path,
                    reason = refusal.reason.as_str(),
                    role,
                    "call refused by the authorisation table"
                );
            }
        });
        let denylist = tls.denylist().clone();
        let (entries, failures) = metrics.denylist();
        entries.set(denylist.len() as i64);
        if denylist.path().is_some() {
            if let Ok(runtime) = tokio::runtime::Handle::try_current() {
                runtime.spawn(watch_denylist(Arc::downgrade(&denylist), entries, failures));
            }
        }
        Ok(Server::builder()
            .tls_config(tls.server_config())?
            .timeout(Duration::from_millis(bounds.request_timeout_ms))
            .load_shed(true)
            .layer(OversizeIsResourceExhausted)
            .layer(mtls::authz::Authorize::new(policy, record).denying(denylist))
            .layer(GlobalConcurrencyLimitLayer::new(bounds.concurrency_max)))
    }

    /// How a server serves its routes: as deployed ([`Serving::secure`]: [`server`]'s mutual TLS,
    /// authorisation table and bounds), or, only in a build with the test-only feature
    /// `negative-controls` (the benchmarks' "security off" control; no shipped binary has it),
    /// without TLS or the table. One place for both, so a service has one serving path.
    pub enum Serving {
        Secure(Box<SecureServer>),
        /// TEST ONLY: plaintext, every caller taken as `every_caller` (there is no certificate
        /// to verify; a handler that needs a caller finds this one).
        #[cfg(feature = "negative-controls")]
        #[doc(hidden)]
        PlaintextForBenches {
            service: &'static str,
            every_caller: Caller,
        },
    }

    impl Serving {
        /// As deployed: see [`server`].
        pub fn secure(
            tls: &Tls,
            policy: &'static Policy,
            bounds: Bounds,
            metrics: &crate::Metrics,
        ) -> Result<Self, tonic::transport::Error> {
            Ok(Self::Secure(Box::new(server(
                tls, policy, bounds, metrics,
            )?)))
        }

        /// TEST ONLY (feature `negative-controls`): `service` served without TLS or its
        /// authorisation table, every caller taken as one worker.
        #[cfg(feature = "negative-controls")]
        #[doc(hidden)]
        pub fn plaintext_for_benches(service: &'static str) -> Self {
            Self::PlaintextForBenches {
                service,
                every_caller: Caller {
                    role: Role::Worker,
                    fingerprint: [0; 32],
                    certificate: Vec::<u8>::new().into(),
                },
            }
        }

        /// Serves `routes` on `listener` until `signal`.
        pub async fn serve(
            self,
            routes: tonic::service::Routes,
            listener: tokio::net::TcpListener,
            signal: impl std::future::Future<Output = ()>,
        ) -> Result<(), tonic::transport::Error> {
            let incoming = crate::incoming(listener);
            match self {
                Self::Secure(mut server) => {
                    server
                        .add_routes(routes)
                        .serve_with_incoming_shutdown(incoming, signal)
                        .await
                }
                #[cfg(feature = "negative-controls")]
                Self::PlaintextForBenches {
                    service,
                    every_caller,
                } => {
                    tracing::error!(
                        service,
                        "serving WITHOUT TLS or authorisation (test-only bench control)"
                    );
                    Server::builder()
                        .layer(tonic::service::InterceptorLayer::new(
                            move |mut request: tonic::Request<()>| {
                                request.extensions_mut().insert(every_caller.clone());
                                Ok(request)
                            },
                        ))
                        .add_routes(routes)
                        .serve_with_incoming_shutdown(incoming, signal)
                        .await
                }
            }
        }
    }

    /// The operator a break-glass call is recorded under: the name the request claims, proven
    /// by the caller's certificate ([`mtls::authz::certified_actor`]); otherwise the refusal
    /// (each service answers it in its own typed way, PERMISSION_DENIED), counted in
    /// `unauthorised_calls` (the server's [`crate::Metrics::unauthorised_calls`],
    /// `reason="operator_not_certified"`) and logged at alert level with the certificate's
    /// fingerprint.
    pub fn certified_operator(
        caller: &Caller,
        method: &str,
        claimed: &str,
        unauthorised_calls: &prometheus::IntCounterVec,
    ) -> Result<String, Refusal> {
        mtls::authz::certified_actor(caller, claimed, method).inspect_err(|refusal| {
            unauthorised_calls
                .with_label_values(&[method, refusal.reason.as_str(), caller.role.name()])
                .inc();
            tracing::warn!(
                method,
                reason = refusal.reason.as_str(),
                role = caller.role.name(),
                claimed_operator = claimed,
                certificate = %caller.fingerprint_hex(),
                alert = true,
                "operator action refused: the certificate does not carry the operator it names"
            );
        })
    }

    /// The verified caller of a request (set by the authorisation layer), or INTERNAL if a
    /// handler was reached without it, which only a server built without [`server`] can do.
    #[allow(clippy::result_large_err)]
    pub fn caller<T>(request: &tonic::Request<T>) -> Result<Caller, tonic::Status> {
        Caller::of(request)
            .cloned()
            .ok_or_else(|| tonic::Status::internal("no verified caller on the request"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn redacts_passwords() {
        assert_eq!(
            redact("postgres://u:secret@h:5/db"),
            "postgres://u:***@h:5/db"
        );
        assert_eq!(redact("postgres://u@h/db"), "postgres://u@h/db");
        assert_eq!(redact("postgres://h/db"), "postgres://h/db");
    }

    #[test]
    fn only_an_oversize_requests_out_of_range_becomes_resource_exhausted() {
        let answer =
            |status: tonic::Status| grpc::oversize_as_resource_exhausted(status.into_http::<()>());
        let code = |r: &tonic::codegen::http::Response<()>| {
            tonic::Status::from_header_map(r.headers()).map(|s| s.code())
        };
        // tonic's own words for a request over max_decoding_message_size.
        let oversize = answer(tonic::Status::out_of_range(
            "Error, decoded message length too large: found 1048600 bytes, the limit is: 65536 bytes",
        ));
        assert_eq!(code(&oversize), Some(tonic::Code::ResourceExhausted));
        let other = answer(tonic::Status::out_of_range("a page past the end"));
        assert_eq!(code(&other), Some(tonic::Code::OutOfRange));
        let invalid = answer(tonic::Status::invalid_argument("message length too large"));
        assert_eq!(code(&invalid), Some(tonic::Code::InvalidArgument));
    }

    #[test]
    fn metrics_render_registered_counters() {
        let m = Metrics::default();
        let c = m.counter_vec("example_refusals_total", "rejections", &["guard"]);
        c.with_label_values(&["paydb"]).inc();
        assert!(m
            .render()
            .contains("example_refusals_total{guard=\"paydb\"} 1"));
    }
}
