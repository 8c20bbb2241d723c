//! The rail stub: a stand-in for a third-party payment network, speaking HTTP/JSON.
//!
//! It behaves like the rail the design fears: **non-idempotent** (the same request twice moves
//! money twice), slow, occasionally ambiguous, and it settles an accepted payment whatever the
//! caller saw. Its `GET /admin/movements` is the ground truth every test uses to answer "did we
//! ever pay twice?".
//!
//! | endpoint | answers |
//! |---|---|
//! | `POST /v1/payments` `{client_reference, amount_minor, currency, beneficiary_ref, valid_until_unix_ms?}` | 200 `{status:"accepted", rail_ref}`, 422 `{status:"declined", code}` (`code: "EXPIRED"` when the request is acted on after its `valid_until_unix_ms`: nothing moves), 400 `{status:"invalid"}`, 5xx, a reset connection, or nothing |
//! | `GET /v1/payments?client_reference=X` | `{state:"found", movements}`, `{state:"absent"}` (authoritative), `{state:"unknown"}` (inside the settlement window) |
//! | `POST /admin/payments` (admin listener) | as `POST /v1/payments`, unsigned: a payment outside the proxy (the harness's controls) |
//! | `GET /admin/movements` | [`GroundTruth`] |
//! | `GET`/`POST /admin/faults` | [`FaultConfig`] |
//! | `POST /admin/forced` `{client_reference, mode}` | forces (or with `mode: null` clears) one reference's mode |
//! | `GET /healthz`, `GET /metrics` (metrics listener) | liveness, Prometheus counters |
//!
//! Each group is served on its own listener ([`StubListeners`]: payments, admin, metrics). As a
//! rail's, the payments and admin APIs are HTTPS only, with a client certificate of the rail's
//! authority required (a rail authenticates its merchant); the admin API serves the harness's
//! certificate alone ([`tls`]). The metrics listener is plain HTTP and holds counts only.
//!
//! Like a real provider, it signs every answer of its payments API (`/v1/payments`, both
//! methods, every status) with its answer key (`grant_signing::rail_answer`: Ed25519 over the
//! caller's `Rail-Request-Id`, the request and the exact answer, in `Rail-Signature`); the rail
//! proxy verifies each before believing it. The admin endpoints are the test harness's and are
//! not signed.

pub mod book;
pub mod client;
mod conn;
pub mod faults;
#[cfg(feature = "in-process")]
mod in_process;
pub mod tls;

#[cfg(feature = "in-process")]
pub use in_process::RunningStub;

use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::{ConnectInfo, Query, Request, State};
use axum::http::{HeaderValue, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use grant_signing::rail_answer;
use grant_signing::Signer;
use serde::{Deserialize, Serialize};
use service_kit::Shutdown;

pub use book::{GroundTruth, Lookup, Movement, PaymentOrder, PaymentRequest, EXPIRED_DECLINE_CODE};
pub use faults::{FaultConfig, FaultMode};

use book::Book;
pub use conn::ConnectionHandle;
use conn::ResettableListener;
use faults::SplitMix64;

/// How long an accept-then-hang response is held at most before the connection is reset. Far
/// above any sane client timeout (the proxy's is seconds), and bounded so that a forgotten
/// connection does not stay open for the life of the process.
pub const HANG_HOLD_MS_MAX: u64 = 600_000;

/// Largest payment request body accepted; a payment order is a few hundred bytes.
pub const REQUEST_BODY_BYTES_MAX: usize = 16 * 1024;

/// The names the stub's certificate carries: what its clients connect to (compose's service name,
/// the loopback address of tests and the local stack).
/// Default settlement window: how long after the last attempt a lookup may still say "unknown".
pub const SETTLEMENT_WINDOW_MS_DEFAULT: u64 = 2_000;

#[derive(Debug, Clone)]
pub struct StubConfig {
    /// Until this long after the last payment attempt for a reference, an empty lookup answers
    /// `unknown`; after it, `absent` is authoritative.
    pub settlement_window: Duration,
    /// The durable movements file; `None` keeps movements in memory only (benchmarks).
    pub movements_file: Option<PathBuf>,
    pub faults: FaultConfig,
    /// The key every answer of the payments API is signed with (the provider's; the proxy holds
    /// its public half).
    pub answer_signer: Arc<Signer>,
}

/// The key id of [`StubConfig::default`]'s answer key (a fresh key each time).
pub const TEST_ANSWER_KEY_ID: &str = "rail-stub-test";

impl Default for StubConfig {
    /// An in-memory stub with no fault, signing with a fresh answer key.
    fn default() -> Self {
        Self {
            settlement_window: Duration::from_millis(SETTLEMENT_WINDOW_MS_DEFAULT),
            movements_file: None,
            faults: FaultConfig::default(),
            answer_signer: Arc::new(
                Signer::generate(TEST_ANSWER_KEY_ID)
                    .expect("a fresh Ed25519 key")
                    .0,
            ),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum StubError {
    #[error(transparent)]
    Book(#[from] book::BookError),
    #[error("invalid fault configuration: {0}")]
    Faults(#[from] faults::FaultConfigError),
    #[error("serving HTTP: {0}")]
    Serve(std::io::Error),
    #[error("the stub's TLS: {0}")]
    Tls(#[from] tls::RailTlsError),
    #[error("the stub's authority: {0}")]
    Authority(#[from] mtls::TlsError),
}

struct Faults {
    config: FaultConfig,
    rng: SplitMix64,
}

struct AppState {
    book: Book,
    faults: Mutex<Faults>,
    shutdown: Shutdown,
    metrics: service_kit::Metrics,
    submits: service_kit::prometheus::IntCounterVec,
}

type Shared = Arc<AppState>;

/// The stub's three listeners, each with its own API: the rail's **payments** API
/// (`/v1/payments`, signed answers: what the rail proxy calls), the harness's **admin** API
/// (`/admin/*`: ground truth, faults, a payment outside the proxy), and **metrics**
/// (`/healthz`, `/metrics`: counts only, what Prometheus and a health check read). Apart, so a
/// deployment publishes or reaches each alone (compose publishes the admin API to the harness and
/// keeps the payments API on its own network).
pub struct StubListeners {
    pub payments: tokio::net::TcpListener,
    pub admin: tokio::net::TcpListener,
    pub metrics: tokio::net::TcpListener,
}

impl StubListeners {
    /// Three listeners on free ports of 127.0.0.1.
    pub async fn local() -> std::io::Result<Self> {
        let bind = || tokio::net::TcpListener::bind("127.0.0.1:0");
        Ok(Self {
            payments: bind().await?,
            admin: bind().await?,
            metrics: bind().await?,
        })
    }
}

/// Serves the stub on its three listeners until `shutdown` fires, the payments and admin APIs
/// over TLS with `tls` (the rail's authority, the stub's certificate and key). Opens (and repairs
/// a torn tail of) the movements file first.
pub async fn run(
    listeners: StubListeners,
    tls: &mtls::Tls,
    config: StubConfig,
    shutdown: Shutdown,
) -> Result<(), StubError> {
    config.faults.validate()?;
    let server_config = tls::server_config(tls)?;
    let book = Book::open(config.movements_file.as_deref(), config.settlement_window)?;
    let metrics = service_kit::Metrics::default();
    let submits = metrics.counter_vec(
        "rail_stub_payment_requests_total",
        "Payment requests by fault mode.",
        &["mode"],
    );
    let rng = SplitMix64::new(config.faults.seed);
    let signer = config.answer_signer.clone();
    let state = Arc::new(AppState {
        book,
        faults: Mutex::new(Faults {
            config: config.faults,
            rng,
        }),
        shutdown: shutdown.clone(),
        metrics,
        submits,
    });
    let payments = Router::new()
        .route("/v1/payments", post(submit).get(lookup))
        .route_layer(axum::middleware::from_fn_with_state(signer, sign_answer))
        .with_state(state.clone());
    let admin = Router::new()
        .route("/admin/movements", get(movements))
        .route("/admin/faults", get(get_faults).post(set_faults))
        .route("/admin/forced", post(set_forced))
        // A payment the harness makes itself, outside the proxy (the same path as the rail's
        // payments API, unsigned): the controls of "only the proxy pays".
        .route("/admin/payments", post(submit))
        .with_state(state.clone());
    let metrics = Router::new()
        .route("/healthz", get(|| async { "ok" }))
        .route("/metrics", get(render_metrics))
        .with_state(state);
    tracing::info!(
        payments = ?listeners.payments.local_addr().ok(),
        admin = ?listeners.admin.local_addr().ok(),
        metrics = ?listeners.metrics.local_addr().ok(),
        "rail stub listening"
    );
    let over_tls = |listener, clients| {
        tls::TlsListener::new(listener, server_config.clone(), clients).map_err(StubError::Serve)
    };
    let (payments_listener, admin_listener) = (
        over_tls(listeners.payments, tls::Clients::Authority)?,
        over_tls(listeners.admin, tls::Clients::HarnessOnly)?,
    );
    let serve_tls = |listener: tls::TlsListener, app: Router| {
        axum::serve(
            listener,
            app.into_make_service_with_connect_info::<ConnectionHandle>(),
        )
        .with_graceful_shutdown(shutdown.clone().wait())
    };
    tokio::try_join!(
        serve_tls(payments_listener, payments),
        serve_tls(admin_listener, admin),
        axum::serve(
            ResettableListener(listeners.metrics),
            metrics.into_make_service_with_connect_info::<ConnectionHandle>(),
        )
        .with_graceful_shutdown(shutdown.clone().wait()),
    )
    .map(|_| ())
    .map_err(StubError::Serve)
}

/// The names the stub's certificate carries: what its clients connect to (compose's service name,
/// the loopback address of tests and the local stack).
pub const SERVER_NAMES: [&str; 3] = ["rail-stub", "127.0.0.1", "localhost"];

/// Signs the answer of a payments API call: reads the request's body (bounded) and the caller's
/// request id, lets the handler answer, then signs the request and the exact answer into
/// `Rail-Signature`. A held or reset answer is signed too if it is ever completed; nobody reads it.
async fn sign_answer(State(signer): State<Arc<Signer>>, request: Request, next: Next) -> Response {
    let (parts, body) = request.into_parts();
    let request_id = parts
        .headers
        .get(rail_answer::REQUEST_ID_HEADER)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_string();
    let method = parts.method.as_str().to_string();
    let path_and_query = parts
        .uri
        .path_and_query()
        .map(|p| p.as_str().to_string())
        .unwrap_or_else(|| "/".into());
    let (request_body, response) = match axum::body::to_bytes(body, REQUEST_BODY_BYTES_MAX).await {
        Err(_) => (
            Bytes::new(),
            invalid("request body too large or unreadable"),
        ),
        Ok(_) if request_id.len() > rail_answer::REQUEST_ID_LENGTH_MAX => (
            Bytes::new(),
            invalid(format!(
                "{} longer than {} characters",
                rail_answer::REQUEST_ID_HEADER,
                rail_answer::REQUEST_ID_LENGTH_MAX
            )),
        ),
        Ok(bytes) => {
            let request = Request::from_parts(parts, Body::from(bytes.clone()));
            (bytes, next.run(request).await)
        }
    };
    let (mut answer_parts, answer_body) = response.into_parts();
    let answer_body = match axum::body::to_bytes(answer_body, usize::MAX).await {
        Ok(bytes) => bytes,
        Err(e) => {
            tracing::error!(error = %e, "could not read its own answer; sent unsigned");
            return Response::from_parts(answer_parts, Body::empty());
        }
    };
    let header = signer.sign_rail_answer(&rail_answer::Answer {
        request_id: &request_id,
        method: &method,
        path_and_query: &path_and_query,
        request_body: &request_body,
        status: answer_parts.status.as_u16(),
        signed_at_unix_ms: book::unix_ms_now(),
        body: &answer_body,
    });
    match HeaderValue::from_str(&header) {
        Ok(value) => {
            answer_parts
                .headers
                .insert(rail_answer::SIGNATURE_HEADER, value);
        }
        Err(e) => tracing::error!(error = %e, "signature header is not a header value"),
    }
    Response::from_parts(answer_parts, Body::from(answer_body))
}

#[derive(Serialize, Deserialize)]
struct Answer {
    status: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    rail_ref: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    code: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    message: Option<String>,
}

fn answer(
    status: StatusCode,
    kind: &'static str,
    rail_ref: Option<String>,
    code: Option<String>,
    message: Option<String>,
) -> Response {
    (
        status,
        Json(Answer {
            status: kind,
            rail_ref,
            code,
            message,
        }),
    )
        .into_response()
}

fn invalid(message: impl Into<String>) -> Response {
    answer(
        StatusCode::BAD_REQUEST,
        "invalid",
        None,
        None,
        Some(message.into()),
    )
}

async fn submit(
    State(state): State<Shared>,
    ConnectInfo(connection): ConnectInfo<ConnectionHandle>,
    body: Bytes,
) -> Response {
    if body.len() > REQUEST_BODY_BYTES_MAX {
        return invalid("request body too large");
    }
    let PaymentRequest {
        order,
        valid_until_unix_ms,
    } = match serde_json::from_slice(&body) {
        Ok(request) => request,
        Err(e) => return invalid(format!("not a payment order: {e}")),
    };
    if order.client_reference.is_empty()
        || order.beneficiary_ref.is_empty()
        || order.currency.len() != 3
    {
        return invalid(
            "client_reference, beneficiary_ref and a three-letter currency are required",
        );
    }
    if order.amount_minor <= 0 {
        return invalid("amount_minor must be positive");
    }
    let _attempt = state.book.begin_attempt(&order.client_reference);
    let (mode, latency_ms, decline_code) = {
        let mut faults = state.faults.lock().unwrap_or_else(|p| p.into_inner());
        let Faults { config, rng } = &mut *faults;
        (
            config.choose(&order.client_reference, rng),
            config.latency_ms(rng),
            config.decline_code.clone(),
        )
    };
    state
        .submits
        .with_label_values(&[&format!("{mode:?}")])
        .inc();
    tracing::info!(client_reference = %order.client_reference, amount_minor = order.amount_minor, ?mode, latency_ms, "payment request");
    if latency_ms > 0 {
        tokio::time::sleep(Duration::from_millis(latency_ms)).await;
    }
    // Checked at the moment the rail would act, after its own latency: an instruction that
    // reaches this point after its expiry is refused, whatever fault mode was chosen.
    if let Some(valid_until) = valid_until_unix_ms {
        let now = book::unix_ms_now();
        if now > valid_until {
            state.book.record_expired(&order.client_reference);
            tracing::warn!(client_reference = %order.client_reference, valid_until, now, "payment instruction expired; refused, nothing moved");
            return answer(
                StatusCode::UNPROCESSABLE_ENTITY,
                "declined",
                None,
                Some(EXPIRED_DECLINE_CODE.to_string()),
                Some(format!(
                    "the instruction expired at {valid_until} (unix ms)"
                )),
            );
        }
    }
    let movement = if mode.moves_money() {
        let settle_state = state.clone();
        let settle_order = order.clone();
        match tokio::task::spawn_blocking(move || settle_state.book.settle(&settle_order)).await {
            Ok(Ok(movement)) => Some(movement),
            Ok(Err(e)) => {
                tracing::error!(error = %e, "could not record a movement; answering 500 without acting");
                return answer(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "error",
                    None,
                    None,
                    Some("storage failure".into()),
                );
            }
            Err(e) => panic!("settling task failed: {e}"),
        }
    } else {
        None
    };
    match mode {
        FaultMode::Accept => {
            let rail_ref = movement.map(|m| m.rail_ref);
            answer(StatusCode::OK, "accepted", rail_ref, None, None)
        }
        FaultMode::Decline => answer(
            StatusCode::UNPROCESSABLE_ENTITY,
            "declined",
            None,
            Some(decline_code),
            None,
        ),
        FaultMode::FailBeforeActing => answer(
            StatusCode::SERVICE_UNAVAILABLE,
            "error",
            None,
            None,
            Some("temporarily unavailable".into()),
        ),
        FaultMode::AcceptThenFail => answer(
            StatusCode::INTERNAL_SERVER_ERROR,
            "error",
            None,
            None,
            Some("internal error".into()),
        ),
        FaultMode::AcceptThenHang => {
            tokio::select! {
                _ = state.shutdown.clone().wait() => {}
                _ = tokio::time::sleep(Duration::from_millis(HANG_HOLD_MS_MAX)) => {}
            }
            connection.reset();
            answer(StatusCode::INTERNAL_SERVER_ERROR, "error", None, None, None)
        }
        FaultMode::ResetBeforeActing | FaultMode::AcceptThenReset => {
            connection.reset();
            answer(StatusCode::INTERNAL_SERVER_ERROR, "error", None, None, None)
        }
    }
}

#[derive(Deserialize)]
struct LookupQuery {
    client_reference: Option<String>,
}

/// The lookup answer on the wire.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LookupAnswer {
    /// `found`, `absent` or `unknown`.
    pub state: String,
    #[serde(default)]
    pub movements: Vec<Movement>,
}

async fn lookup(State(state): State<Shared>, Query(query): Query<LookupQuery>) -> Response {
    let Some(reference) = query.client_reference.filter(|r| !r.is_empty()) else {
        return invalid("client_reference is required");
    };
    let delay_ms = state
        .faults
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .config
        .lookup_latency_ms;
    if delay_ms > 0 {
        tokio::time::sleep(Duration::from_millis(delay_ms)).await;
    }
    let answer = match state.book.lookup(&reference) {
        Lookup::Found(movements) => LookupAnswer {
            state: "found".into(),
            movements,
        },
        Lookup::Absent => LookupAnswer {
            state: "absent".into(),
            movements: vec![],
        },
        Lookup::Unknown => LookupAnswer {
            state: "unknown".into(),
            movements: vec![],
        },
    };
    Json(answer).into_response()
}

async fn movements(State(state): State<Shared>) -> Json<GroundTruth> {
    Json(state.book.ground_truth())
}

async fn get_faults(State(state): State<Shared>) -> Json<FaultConfig> {
    Json(
        state
            .faults
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .config
            .clone(),
    )
}

async fn set_faults(State(state): State<Shared>, body: Bytes) -> Response {
    let config: FaultConfig = match serde_json::from_slice(&body) {
        Ok(config) => config,
        Err(e) => return invalid(format!("not a fault configuration: {e}")),
    };
    if let Err(e) = config.validate() {
        return invalid(e.to_string());
    }
    tracing::info!(?config, "fault configuration replaced");
    let mut faults = state.faults.lock().unwrap_or_else(|p| p.into_inner());
    faults.rng = SplitMix64::new(config.seed);
    faults.config = config;
    StatusCode::NO_CONTENT.into_response()
}

/// `POST /admin/forced`: one reference's forced mode; `mode: null` clears it.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ForcedMode {
    pub client_reference: String,
    pub mode: Option<FaultMode>,
}

async fn set_forced(State(state): State<Shared>, body: Bytes) -> Response {
    let forced: ForcedMode = match serde_json::from_slice(&body) {
        Ok(forced) => forced,
        Err(e) => return invalid(format!("not a forced mode: {e}")),
    };
    let mut faults = state.faults.lock().unwrap_or_else(|p| p.into_inner());
    match forced.mode {
        Some(mode) => faults.config.forced.insert(forced.client_reference, mode),
        None => faults.config.forced.remove(&forced.client_reference),
    };
    StatusCode::NO_CONTENT.into_response()
}

async fn render_metrics(State(state): State<Shared>) -> String {
    state.metrics.render()
}
