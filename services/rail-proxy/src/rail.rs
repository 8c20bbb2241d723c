//! The proxy's client of the rail's HTTP/JSON API. It sends a payment **once**: no retry layer,
//! no pooled connection that the HTTP stack could transparently resend on, an explicit timeout.
//!
//! It believes only answers the rail signed (`grant_signing::rail_answer`): every call carries a
//! fresh `Rail-Request-Id`, and the answer's `Rail-Signature` must be one of the rail's keys
//! (`--rail-answer-verify-keys`) over exactly that request and that answer. An answer that fails
//! is **ambiguous** (a payment) or **unknown** (a lookup), never an accept, a decline, FOUND or
//! ABSENT: an impostor on the rail's address cannot make a payout POSTED without a movement, or
//! FAILED after one. Each is counted in `rail_answers_unauthenticated_total{operation,reason}`
//! and logged `event="rail_answer_unauthenticated"`, `alert=true`.
//!
//! It reaches the rail over HTTPS only ([`RailLink`]: an `https://` URL, refused at start
//! otherwise): the rail's certificate must chain to the rail's own authority (pinned, no built-in
//! roots), and the proxy presents its client certificate of that authority (a rail authenticates
//! its merchant). A handshake that fails is a transport failure: the payment is ambiguous.

use std::time::{Duration, Instant};

use grant_signing::rail_answer::{self, Unauthenticated};
use grant_signing::Verifier;
use serde::{Deserialize, Serialize};
use service_kit::latency::{LabelGrid, RAIL_CALL_BUCKETS_SECONDS};

use rail_proxy_client::model::{RailLookup, RailMovement};

use crate::model::{Evidence, SubmitPayout};

/// How long one payment call may take before its outcome is recorded as TIMEOUT. Long enough for
/// a slow rail's normal tail (seconds), short enough that a worker's activity timeout (which
/// must exceed it) stays small. Deployments may lower it, never disable it.
pub const RAIL_CALL_TIMEOUT_MS_DEFAULT: u64 = 5_000;
/// Upper bound of the configurable timeout: beyond it a hung rail would hold worker slots.
pub const RAIL_CALL_TIMEOUT_MS_MAX: u64 = 60_000;
/// Bound of one lookup by client reference (an inquiry; safe to repeat, unlike a payment).
pub const RAIL_LOOKUP_TIMEOUT_MS: u64 = 10_000;
/// Connecting is part of the call; a rail that cannot be reached in this long is reported as
/// ambiguous like any other transport failure.
pub const RAIL_CONNECT_TIMEOUT_MS: u64 = 2_000;
/// Longest part of a rail's error body kept in `failure_detail`.
const DETAIL_BYTES_MAX: usize = 512;

/// What one payment call produced.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RailAnswer {
    Acked {
        rail_ref: String,
    },
    Rejected {
        decline_code: String,
    },
    /// Anything that is not a clear accept or a clear decline: may have moved money.
    Ambiguous {
        detail: String,
    },
}

#[derive(Serialize)]
struct PaymentOrder<'a> {
    client_reference: &'a str,
    amount_minor: i64,
    currency: &'a str,
    beneficiary_ref: &'a str,
    /// The instruction's expiry: the rail refuses (declines `EXPIRED`, moves nothing) a payment
    /// that reaches it after this instant.
    #[serde(skip_serializing_if = "Option::is_none")]
    valid_until_unix_ms: Option<i64>,
}

#[derive(Deserialize)]
struct PaymentAnswer {
    status: String,
    rail_ref: Option<String>,
    code: Option<String>,
}

#[derive(Deserialize)]
struct LookupAnswer {
    state: String,
    #[serde(default)]
    movements: Vec<LookupMovement>,
}

#[derive(Deserialize)]
struct LookupMovement {
    rail_ref: String,
    #[serde(default)]
    amount_minor: i64,
    #[serde(default)]
    currency: String,
    #[serde(default)]
    beneficiary_ref: String,
}

/// `rail_call_duration_seconds{operation,outcome}`: each operation with the outcomes it can
/// have, resolved once at start (the payment call is on Submit's hot path).
const RAIL_CALLS: &[(&str, &[&str])] = &[
    ("pay", &["acked", "rejected", "ambiguous"]),
    ("lookup", &["found", "absent", "unknown"]),
];

/// Where the rail is, how the proxy is known to it and how its answers are authenticated.
#[derive(Debug, Clone)]
pub struct RailLink {
    /// The rail's base URL (`https://host:port`).
    pub url: String,
    /// The rail's answer keys (several during the rail's key rotation).
    pub answer_keys: Verifier,
    /// The HTTPS client of this link ([`http_client`]), built once from the rail's authority
    /// and the proxy's client certificate: what every call to the rail goes through.
    http: reqwest::Client,
}

/// Why a rail link was refused at start.
#[derive(Debug, thiserror::Error)]
pub enum RailLinkError {
    #[error("the rail's URL {0:?} is not https:// (the rail link is TLS only)")]
    NotHttps(String),
    #[error("the rail's authority (--rail-ca): {0}")]
    Authority(reqwest::Error),
    #[error(
        "the proxy's rail client certificate or key (--rail-client-cert, --rail-client-key): {0}"
    )]
    Identity(reqwest::Error),
    #[error("the rail link's TLS files: {0}")]
    Files(#[from] service_kit::grpc::TlsError),
}

impl RailLink {
    /// The rail at `url` (which must be `https://`), its answers checked with `answer_keys`, its
    /// certificate with `tls`'s authority, the proxy presenting `tls`'s certificate.
    pub fn new(
        url: impl Into<String>,
        answer_keys: Verifier,
        tls: &service_kit::grpc::Tls,
    ) -> Result<Self, RailLinkError> {
        let url = url.into();
        if !url.starts_with("https://") {
            return Err(RailLinkError::NotHttps(url));
        }
        let authority =
            reqwest::Certificate::from_pem(tls.ca_pem()).map_err(RailLinkError::Authority)?;
        let identity =
            reqwest::Identity::from_pem(&tls.identity_pem()).map_err(RailLinkError::Identity)?;
        // Built here, so what reqwest checks only when a client is built refuses the start, not
        // every payment.
        let http = build_http_client(authority, identity).map_err(RailLinkError::Identity)?;
        Ok(Self {
            url,
            answer_keys,
            http,
        })
    }
}

/// The binaries' flags for [`RailLink`] (the shipped proxy and the test failpoint proxy).
#[derive(Debug, clap::Args)]
pub struct RailLinkArgs {
    /// The rail's payments API, `https://host:port`.
    #[arg(long, env = "RAIL_PROXY_RAIL_URL")]
    pub rail_url: String,
    /// The rail's certificate authority (PEM): the rail's certificate must chain to it, and to
    /// nothing else.
    #[arg(long, env = "RAIL_PROXY_RAIL_CA")]
    pub rail_ca: std::path::PathBuf,
    /// The proxy's client certificate of the rail's authority (PEM), what the rail knows the
    /// proxy by.
    #[arg(long, env = "RAIL_PROXY_RAIL_CLIENT_CERT")]
    pub rail_client_cert: std::path::PathBuf,
    /// Its private key (PEM).
    #[arg(long, env = "RAIL_PROXY_RAIL_CLIENT_KEY")]
    pub rail_client_key: std::path::PathBuf,
    /// The rail's answer public keys, `key_id=<64 hex digits>[,...]` (as the provider publishes
    /// them; several during its rotation). Required: an answer none of them signed is never
    /// believed.
    #[arg(long, env = "RAIL_ANSWER_VERIFY_KEYS", value_parser = Verifier::parse)]
    pub rail_answer_verify_keys: Verifier,
}

impl TryFrom<RailLinkArgs> for RailLink {
    type Error = RailLinkError;
    fn try_from(args: RailLinkArgs) -> Result<Self, RailLinkError> {
        let tls = service_kit::grpc::Tls::load(
            &args.rail_ca,
            &args.rail_client_cert,
            &args.rail_client_key,
        )?;
        Self::new(args.rail_url, args.rail_answer_verify_keys, &tls)
    }
}

#[derive(Clone)]
pub struct Rail {
    base_url: String,
    http: reqwest::Client,
    timeout: Duration,
    latency: LabelGrid,
    answer_keys: Verifier,
    /// Off only in a `negative-controls` build's test (`Protections::rail_answer`).
    verify_answers: bool,
    unauthenticated: service_kit::prometheus::IntCounterVec,
}

/// The two operations whose answers are verified, as the counter labels them.
const OPERATIONS: [&str; 2] = ["pay", "lookup"];

impl RailAnswer {
    fn label(&self) -> &'static str {
        match self {
            RailAnswer::Acked { .. } => "acked",
            RailAnswer::Rejected { .. } => "rejected",
            RailAnswer::Ambiguous { .. } => "ambiguous",
        }
    }
}

fn lookup_label(lookup: &RailLookup) -> &'static str {
    match lookup {
        RailLookup::Found(_) => "found",
        RailLookup::Absent => "absent",
        RailLookup::Unknown { .. } => "unknown",
    }
}

fn truncate(text: &str) -> &str {
    let mut end = text.len().min(DETAIL_BYTES_MAX);
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    &text[..end]
}

/// The HTTPS client the proxy calls a rail with: the rail's authority pinned (no built-in root),
/// the proxy's certificate presented, HTTPS only; no retry of any kind (reqwest's default policy
/// resends on protocol NACKs), and no idle connection reused, so the HTTP stack can never resend
/// a request that failed on a stale pooled connection: every payment has its own connection (and
/// handshake). The proxy benchmark's floor calls the stub with it too, so that the floor does the
/// same rail work.
pub fn http_client(link: &RailLink) -> reqwest::Client {
    link.http.clone()
}

/// [`http_client`]'s making, once per link.
fn build_http_client(
    authority: reqwest::Certificate,
    identity: reqwest::Identity,
) -> Result<reqwest::Client, reqwest::Error> {
    reqwest::Client::builder()
        .connect_timeout(Duration::from_millis(RAIL_CONNECT_TIMEOUT_MS))
        .retry(reqwest::retry::never())
        // A redirect would resend the payment elsewhere: a 3xx is an answer (ambiguous).
        .redirect(reqwest::redirect::Policy::none())
        .pool_max_idle_per_host(0)
        .http1_only()
        .https_only(true)
        .tls_built_in_root_certs(false)
        .add_root_certificate(authority)
        .identity(identity)
        .build()
}

impl Rail {
    /// A client of the rail at `link`; every call is timed in `metrics`'
    /// `rail_call_duration_seconds`, and every answer verified with the link's answer keys
    /// (unless `verify_answers` is off: a negative control's test only).
    pub fn new(
        link: &RailLink,
        timeout: Duration,
        metrics: &service_kit::Metrics,
        verify_answers: bool,
    ) -> Self {
        let unauthenticated = metrics.counter_vec(
            "rail_answers_unauthenticated_total",
            "Rail answers the proxy did not believe (no, a malformed, a foreign, a wrong or a stale Rail-Signature), by operation (pay, lookup) and reason. Each made a payment ambiguous or a lookup unknown. Anything above zero: something other than the rail answered, or the rail's key changed.",
            &["operation", "reason"],
        );
        for operation in OPERATIONS {
            for reason in rail_answer::REASONS {
                unauthenticated.with_label_values(&[operation, reason]);
            }
        }
        Self {
            base_url: link.url.trim_end_matches('/').to_string(),
            http: http_client(link),
            timeout,
            answer_keys: link.answer_keys.clone(),
            verify_answers,
            unauthenticated,
            latency: LabelGrid::new(
                metrics,
                "rail_call_duration_seconds",
                "Latency of the proxy's calls to the rail, by operation (pay: the one payment call; lookup: by client reference) and outcome (acked, rejected, ambiguous; found, absent, unknown). An ambiguous payment near the rail timeout is a timeout.",
                RAIL_CALL_BUCKETS_SECONDS,
                RAIL_CALLS,
            ),
        }
    }

    /// Sends the payment once, valid at the rail until `valid_until_unix_ms`, and classifies
    /// the answer. Never retries.
    pub async fn pay_once(
        &self,
        request: &SubmitPayout,
        valid_until_unix_ms: Option<i64>,
    ) -> RailAnswer {
        let started = Instant::now();
        let answer = self.pay_once_untimed(request, valid_until_unix_ms).await;
        self.latency
            .observe("pay", answer.label(), started.elapsed().as_secs_f64());
        answer
    }

    async fn pay_once_untimed(
        &self,
        request: &SubmitPayout,
        valid_until_unix_ms: Option<i64>,
    ) -> RailAnswer {
        let order = PaymentOrder {
            client_reference: request.client_reference.as_str(),
            amount_minor: request.amount_minor.get(),
            currency: request.currency.as_str(),
            beneficiary_ref: request.beneficiary_ref.as_str(),
            valid_until_unix_ms,
        };
        let order = match serde_json::to_vec(&order) {
            Ok(order) => order,
            // Nothing was sent: a payment order of strings and integers always serialises.
            Err(e) => {
                return RailAnswer::Ambiguous {
                    detail: format!("encoding the payment order: {e}"),
                }
            }
        };
        let request = self
            .http
            .post(format!("{}/v1/payments", self.base_url))
            .timeout(self.timeout)
            .header(reqwest::header::CONTENT_TYPE, "application/json")
            .body(order.clone());
        let (status, body) = match self.exchange("pay", "POST", request, &order).await {
            Ok(answered) => answered,
            Err(Unanswered::Transport(e)) => {
                return RailAnswer::Ambiguous {
                    detail: transport_detail(&e),
                }
            }
            Err(Unanswered::Body { status, error }) => {
                return RailAnswer::Ambiguous {
                    detail: format!(
                        "reading the answer of status {status}: {}",
                        transport_detail(&error)
                    ),
                }
            }
            Err(Unanswered::Unauthenticated {
                status,
                refused,
                body,
            }) => {
                return RailAnswer::Ambiguous {
                    detail: format!(
                        "unauthenticated rail answer ({}: {refused}); it answered {status}: {}",
                        refused.reason(),
                        truncate(&String::from_utf8_lossy(&body))
                    ),
                }
            }
        };
        let body = String::from_utf8_lossy(&body);
        match serde_json::from_str::<PaymentAnswer>(&body) {
            Ok(PaymentAnswer {
                status: s,
                rail_ref: Some(rail_ref),
                ..
            }) if status == 200 && s == "accepted" && !rail_ref.is_empty() => {
                RailAnswer::Acked { rail_ref }
            }
            Ok(PaymentAnswer {
                status: s,
                code: Some(code),
                ..
            }) if (status == 200 || status == 422) && s == "declined" && !code.is_empty() => {
                RailAnswer::Rejected { decline_code: code }
            }
            _ => RailAnswer::Ambiguous {
                detail: format!("rail answered {status}: {}", truncate(&body)),
            },
        }
    }

    /// Asks the rail what it settled for a client reference.
    /// The evidence an inquiry keeps: the lookup, movements reduced to their references.
    pub async fn lookup(&self, client_reference: &str) -> Evidence {
        match self.movements(client_reference).await {
            RailLookup::Found(movements) => Evidence::Found {
                rail_refs: movements.into_iter().map(|m| m.rail_ref).collect(),
            },
            RailLookup::Absent => Evidence::Absent,
            RailLookup::Unknown { detail } => Evidence::Unknown { detail },
        }
    }

    /// The rail's lookup by client reference, movements with their amounts, currencies and
    /// beneficiaries: what a detective control compares with the books.
    pub async fn movements(&self, client_reference: &str) -> RailLookup {
        let started = Instant::now();
        let lookup = self.movements_untimed(client_reference).await;
        self.latency.observe(
            "lookup",
            lookup_label(&lookup),
            started.elapsed().as_secs_f64(),
        );
        lookup
    }

    async fn movements_untimed(&self, client_reference: &str) -> RailLookup {
        let request = self
            .http
            .get(format!("{}/v1/payments", self.base_url))
            .query(&[("client_reference", client_reference)])
            .timeout(Duration::from_millis(RAIL_LOOKUP_TIMEOUT_MS));
        let (status, body) = match self.exchange("lookup", "GET", request, b"").await {
            Ok(answered) => answered,
            Err(Unanswered::Transport(error) | Unanswered::Body { error, .. }) => {
                return RailLookup::Unknown {
                    detail: format!("rail lookup failed: {}", transport_detail(&error)),
                }
            }
            Err(Unanswered::Unauthenticated { refused, .. }) => {
                return RailLookup::Unknown {
                    detail: format!(
                        "unauthenticated rail lookup answer ({}: {refused})",
                        refused.reason()
                    ),
                }
            }
        };
        if !(200..300).contains(&status) {
            return RailLookup::Unknown {
                detail: format!("rail lookup answered {status}"),
            };
        }
        match serde_json::from_slice::<LookupAnswer>(&body) {
            Ok(answer) if answer.state == "found" && !answer.movements.is_empty() => {
                RailLookup::Found(
                    answer
                        .movements
                        .into_iter()
                        .map(|m| {
                            RailMovement::from((
                                m.rail_ref,
                                m.amount_minor,
                                m.currency,
                                m.beneficiary_ref,
                            ))
                        })
                        .collect(),
                )
            }
            Ok(answer) if answer.state == "absent" => RailLookup::Absent,
            Ok(answer) if answer.state == "unknown" => RailLookup::Unknown {
                detail: "inside the rail's settlement window".into(),
            },
            Ok(answer) => RailLookup::Unknown {
                detail: format!("unrecognised lookup state {:?}", answer.state),
            },
            Err(e) => RailLookup::Unknown {
                detail: format!("unreadable lookup answer: {e}"),
            },
        }
    }

    /// Sends `request` (its `method`, carrying `request_body`) once with a fresh request id, and
    /// reads the answer: its status and body only if the rail signed them for exactly this
    /// request ([`Rail::authenticate`]).
    async fn exchange(
        &self,
        operation: &'static str,
        method: &'static str,
        request: reqwest::RequestBuilder,
        request_body: &[u8],
    ) -> Result<(u16, Vec<u8>), Unanswered> {
        let request_id = rail_answer::request_id();
        let response = request
            .header(rail_answer::REQUEST_ID_HEADER, &request_id)
            .send()
            .await
            .map_err(Unanswered::Transport)?;
        let status = response.status().as_u16();
        let path_and_query = path_and_query(response.url());
        let signature = signature_header(&response);
        let body: Vec<u8> = response
            .bytes()
            .await
            .map_err(|error| Unanswered::Body { status, error })?
            .into();
        let answer = rail_answer::Answer {
            request_id: &request_id,
            method,
            path_and_query: &path_and_query,
            request_body,
            status,
            signed_at_unix_ms: 0,
            body: &body,
        };
        match self.authenticate(operation, &answer, signature.as_deref()) {
            Ok(()) => Ok((status, body)),
            Err(refused) => Err(Unanswered::Unauthenticated {
                status,
                refused,
                body,
            }),
        }
    }

    /// Whether `answer` carries the rail's signature (`header`) over exactly itself; a refusal
    /// is counted and logged as an alert.
    fn authenticate(
        &self,
        operation: &'static str,
        answer: &rail_answer::Answer<'_>,
        header: Option<&str>,
    ) -> Result<(), Unauthenticated> {
        if !self.verify_answers {
            return Ok(());
        }
        let now = grant_signing::operator::now_unix_ms() as i64;
        self.answer_keys
            .verify_rail_answer(answer, header, now)
            .inspect_err(|refused| {
                self.unauthenticated
                    .with_label_values(&[operation, refused.reason()])
                    .inc();
                tracing::error!(
                    event = "rail_answer_unauthenticated", alert = true, operation,
                    reason = refused.reason(), status = answer.status,
                    request_id = answer.request_id, error = %refused,
                    "the rail's answer is not signed by the rail: not believed"
                );
            })
    }
}

/// Why one exchange with the rail gave nothing to believe.
enum Unanswered {
    /// Sending, or waiting for the status: nothing was heard.
    Transport(reqwest::Error),
    /// The status came, the body did not.
    Body { status: u16, error: reqwest::Error },
    /// An answer came that the rail did not sign for this request.
    Unauthenticated {
        status: u16,
        refused: Unauthenticated,
        body: Vec<u8>,
    },
}

/// The request's path and query as the rail received it (what its signature covers).
fn path_and_query(url: &reqwest::Url) -> String {
    match url.query() {
        Some(query) => format!("{}?{query}", url.path()),
        None => url.path().to_string(),
    }
}

/// The answer's `Rail-Signature`, if it has one that is text.
fn signature_header(response: &reqwest::Response) -> Option<String> {
    response
        .headers()
        .get(rail_answer::SIGNATURE_HEADER)
        .map(|v| v.to_str().unwrap_or("").to_string())
}

fn transport_detail(e: &reqwest::Error) -> String {
    let kind = if e.is_timeout() {
        "timeout"
    } else if e.is_connect() {
        "connection failure"
    } else if e.is_body() || e.is_decode() {
        "broken answer"
    } else {
        "transport failure"
    };
    let mut detail = format!("{kind}: {e}");
    let mut source = std::error::Error::source(e);
    while let Some(inner) = source {
        detail.push_str(&format!(": {inner}"));
        source = inner.source();
    }
    truncate(&detail).to_string()
}
