//! The outbox dispatcher: delivers the payment resource's `ledger_outbox` rows (written in the
//! same transaction as its ledger rows, or as the payout transition they record) to the General
//! Ledger, each according to its kind (paydb 0008): a JOURNAL (a monetary effect) to
//! `AppendJournal`, a TRANSACTION_EVENT (a step of a payout's lifecycle, no money) to
//! `AppendTransactionEvent`. Either carries the row's id as its `source_sequence`, the source's
//! own order, which the GL records beside its receipt order.
//!
//! * At least once: a row is marked delivered only after the GL answered with its journal (or
//!   event), whose id the row records in `journal_id`; the GL's idempotency makes a repeated
//!   delivery return the same journal (event).
//! * In order per account: only the oldest undelivered row of an account is ever claimable, so
//!   row N+1 never reaches the GL before row N (a quarantined row holds its account's later rows).
//! * Several instances: rows are claimed with `FOR UPDATE SKIP LOCKED` and a lease; a crashed
//!   instance's claims expire and another instance takes them.
//! * Never drops a row: transport failures and GL downtime only delay (exponential backoff with
//!   jitter); a rejection of the content quarantines the row with an alert, for an operator to
//!   replay after a fix.
//!
//! Architecture invariant: the dispatcher writes only the delivery columns of `ledger_outbox`
//! (attempts, next_attempt_at, last_error, delivered_at, journal_id, quarantined_at, claimed_by,
//! claim_expires_at); id, account_id, idempotency_key, kind, payload and created_at are never
//! written.

pub mod backlog;
pub mod starts;

use std::hash::{BuildHasher, Hasher};
use std::time::Duration;

use futures::StreamExt;
use payout_proto::ledger as pb;
use payout_proto::ledger::general_ledger_service_client::GeneralLedgerServiceClient;
use serde::Serialize;
use sqlx::{PgPool, Row};
use tonic::transport::Channel;

/// Rows claimed per round: a lease must cover delivering a whole batch, and a small batch keeps
/// the work a crashed instance strands small.
pub const BATCH_SIZE_MAX: i64 = 32;
/// Deliveries in flight at once within a batch (each to a different account).
pub const DELIVERY_CONCURRENCY_MAX: usize = 8;
/// How long a claim stays exclusive. Far above a healthy batch's delivery time (milliseconds), so a
/// live instance never loses its claim; a crashed instance's rows wait at most this long.
pub const CLAIM_LEASE_MS: u64 = 30_000;
/// First retry delay after a transient failure; doubles per attempt.
pub const BACKOFF_BASE_MS: u64 = 200;
/// Retry delay cap: a GL outage is noticed within this long of its end.
pub const BACKOFF_MAX_MS: u64 = 30_000;
/// Idle wait between polls when there is nothing to deliver.
pub const POLL_INTERVAL_MS: u64 = 250;
/// Per-call deadline towards the GL: a hung call counts as a transport failure.
pub const GL_CALL_TIMEOUT_MS: u64 = 10_000;
/// Bounded list size of the operator's quarantine listing.
pub const QUARANTINE_LIST_MAX: i64 = 1_000;
/// Stored error text is cut here: last_error is for operators, not a log sink.
const ERROR_TEXT_MAX: usize = 1_000;

#[derive(Debug, thiserror::Error)]
pub enum DispatchError {
    #[error("database: {0}")]
    Database(#[from] sqlx::Error),
    #[error("invalid GL endpoint {endpoint}: {detail}")]
    Endpoint { endpoint: String, detail: String },
}

#[derive(Debug, Clone)]
pub struct Config {
    /// paydb, where `ledger_outbox` lives.
    pub database_url: String,
    /// The GL's `https://` URL.
    pub gl_endpoint: String,
    /// This dispatcher's certificate (role `outbox-dispatcher`, the only role the GL takes
    /// postings from).
    pub tls: mtls::Tls,
    /// Names this instance in `claimed_by`.
    pub instance_id: String,
    pub batch_size: i64,
    pub claim_lease_ms: u64,
    pub backoff_base_ms: u64,
    pub backoff_max_ms: u64,
    pub poll_interval_ms: u64,
}

impl Config {
    pub fn new(
        database_url: impl Into<String>,
        gl_endpoint: impl Into<String>,
        tls: mtls::Tls,
        instance_id: impl Into<String>,
    ) -> Self {
        Self {
            database_url: database_url.into(),
            gl_endpoint: gl_endpoint.into(),
            tls,
            instance_id: instance_id.into(),
            batch_size: BATCH_SIZE_MAX,
            claim_lease_ms: CLAIM_LEASE_MS,
            backoff_base_ms: BACKOFF_BASE_MS,
            backoff_max_ms: BACKOFF_MAX_MS,
            poll_interval_ms: POLL_INTERVAL_MS,
        }
    }
}

/// An error-level event: a row the GL refused, held for an operator.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Alert {
    pub outbox_id: i64,
    pub account_id: String,
    pub idempotency_key: String,
    /// The GL's `RejectionReason` name, or `MALFORMED_PAYLOAD` when the row could not even be read.
    pub reason: String,
    pub detail: String,
}

#[derive(Debug, Clone)]
struct Claimed {
    id: i64,
    account_id: String,
    idempotency_key: String,
    /// JOURNAL or TRANSACTION_EVENT: which GL call delivers the row.
    kind: String,
    payload: serde_json::Value,
    attempts: i32,
}

/// `ledger_outbox.kind` of a monetary effect, delivered by `AppendJournal`.
pub const KIND_JOURNAL: &str = "JOURNAL";
/// `ledger_outbox.kind` of a lifecycle step, delivered by `AppendTransactionEvent`.
pub const KIND_TRANSACTION_EVENT: &str = "TRANSACTION_EVENT";

/// What one delivery attempt decided.
#[derive(Debug, Clone, PartialEq)]
pub enum Delivery {
    Delivered {
        /// The GL's id of what it recorded: the journal's, or the transaction event's.
        journal_id: String,
        created: bool,
    },
    /// Transport failure, GL down, or a mode that refuses for now: try again later.
    Retry {
        error: String,
    },
    Quarantine {
        reason: String,
        detail: String,
    },
}

#[derive(Debug, Default, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct BatchOutcome {
    pub claimed: usize,
    pub delivered: usize,
    pub retried: usize,
    pub quarantined: usize,
}

#[derive(Clone)]
pub struct DispatchMetrics {
    pub delivered: service_kit::prometheus::IntCounterVec,
    pub retried: service_kit::prometheus::IntCounterVec,
    pub quarantined: service_kit::prometheus::IntCounterVec,
    /// The backlog's gauges (`backlog`), measured while the dispatcher runs.
    pub backlog: backlog::BacklogGauges,
}

impl DispatchMetrics {
    pub fn new(metrics: &service_kit::Metrics) -> Self {
        Self {
            delivered: metrics.counter_vec(
                "outbox_delivered_total",
                "Rows delivered to the GL",
                &["created"],
            ),
            retried: metrics.counter_vec(
                "outbox_retries_total",
                "Transient delivery failures (delayed rows)",
                &["kind"],
            ),
            quarantined: metrics.counter_vec(
                "outbox_quarantined_total",
                "Rows quarantined (alerts)",
                &["reason"],
            ),
            backlog: backlog::BacklogGauges::register(metrics),
        }
    }
}

pub struct Dispatcher {
    pool: PgPool,
    client: GeneralLedgerServiceClient<Channel>,
    config: Config,
    metrics: DispatchMetrics,
    alerts: tokio::sync::broadcast::Sender<Alert>,
}

/// Alerts buffered for slow subscribers; the log and the counter carry every one regardless.
const ALERT_CHANNEL_CAPACITY: usize = 256;

impl Dispatcher {
    /// Connects lazily to the GL: a GL that is down at start only delays delivery.
    pub async fn new(
        config: Config,
        metrics: &service_kit::Metrics,
    ) -> Result<Self, DispatchError> {
        let pool = service_kit::connect_pg(&config.database_url)
            .await
            .map_err(|e| {
                DispatchError::Database(sqlx::Error::Configuration(format!("{e:#}").into()))
            })?;
        let endpoint = config
            .tls
            .endpoint(&config.gl_endpoint, mtls::Role::GeneralLedger)
            .map_err(|e| DispatchError::Endpoint {
                endpoint: config.gl_endpoint.clone(),
                detail: e.to_string(),
            })?
            .connect_timeout(Duration::from_millis(GL_CALL_TIMEOUT_MS))
            .timeout(Duration::from_millis(GL_CALL_TIMEOUT_MS));
        let client = GeneralLedgerServiceClient::new(endpoint.connect_lazy());
        let (alerts, _) = tokio::sync::broadcast::channel(ALERT_CHANNEL_CAPACITY);
        Ok(Self {
            pool,
            client,
            config,
            metrics: DispatchMetrics::new(metrics),
            alerts,
        })
    }

    pub fn subscribe_alerts(&self) -> tokio::sync::broadcast::Receiver<Alert> {
        self.alerts.subscribe()
    }

    pub fn metrics(&self) -> &DispatchMetrics {
        &self.metrics
    }

    /// Delivers until `shutdown` resolves. A round in progress finishes its deliveries first
    /// (each is bounded by the GL call deadline).
    pub async fn run(&self, shutdown: impl std::future::Future<Output = ()>) {
        tokio::pin!(shutdown);
        let backlog = tokio::spawn(backlog::watch(
            self.pool.clone(),
            self.metrics.backlog.clone(),
            Duration::from_millis(backlog::BACKLOG_PERIOD_MS),
        ));
        loop {
            let idle = match self.run_once().await {
                Ok(outcome) => outcome.claimed == 0,
                Err(e) => {
                    tracing::warn!(error = %e, "outbox round failed; retrying");
                    true
                }
            };
            if idle {
                tokio::select! {
                    _ = &mut shutdown => break,
                    _ = tokio::time::sleep(Duration::from_millis(self.config.poll_interval_ms)) => {}
                }
            } else if futures::FutureExt::now_or_never(&mut shutdown).is_some() {
                break;
            }
        }
        backlog.abort();
        tracing::info!(instance = %self.config.instance_id, "outbox dispatcher stopped");
    }

    /// Measures the outbox's backlog now and sets its gauges (`run` does so every
    /// `backlog::BACKLOG_PERIOD_MS`).
    pub async fn measure_backlog(&self) -> Result<backlog::Backlog, DispatchError> {
        Ok(backlog::measure(&self.pool, &self.metrics.backlog).await?)
    }

    /// One round: claim a batch, deliver it, record the outcome of each row.
    pub async fn run_once(&self) -> Result<BatchOutcome, DispatchError> {
        let batch = self.claim().await?;
        let mut outcome = BatchOutcome {
            claimed: batch.len(),
            ..Default::default()
        };
        let results: Vec<(Claimed, Delivery)> = futures::stream::iter(batch)
            .map(|row| async move {
                let delivery = self.deliver(&row).await;
                (row, delivery)
            })
            .buffer_unordered(DELIVERY_CONCURRENCY_MAX)
            .collect()
            .await;
        // The batch's deliveries are recorded in one statement (one commit, where each row had its
        // own): if it fails, none is marked and each is delivered again after its claim expires,
        // which the GL's idempotency answers with the same journal. A retry or a quarantine (rare)
        // is recorded row by row, after them.
        let mut delivered = Vec::with_capacity(results.len());
        let mut others = Vec::new();
        for (row, delivery) in results {
            match delivery {
                Delivery::Delivered {
                    journal_id,
                    created,
                } => delivered.push((row, journal_id, created)),
                other => others.push((row, other)),
            }
        }
        outcome.delivered = delivered.len();
        self.record_delivered(&delivered).await?;
        for (row, delivery) in others {
            match &delivery {
                Delivery::Delivered { .. } => outcome.delivered += 1,
                Delivery::Retry { .. } => outcome.retried += 1,
                Delivery::Quarantine { .. } => outcome.quarantined += 1,
            }
            self.record(&row, delivery).await?;
        }
        Ok(outcome)
    }

    /// Marks a batch's delivered rows delivered, each with the id the GL answered it with, in one
    /// statement. Unconditional on the claim: the journal exists whoever delivered it.
    async fn record_delivered(
        &self,
        delivered: &[(Claimed, String, bool)],
    ) -> Result<(), DispatchError> {
        if delivered.is_empty() {
            return Ok(());
        }
        let ids: Vec<i64> = delivered.iter().map(|(row, _, _)| row.id).collect();
        let journal_ids: Vec<&str> = delivered.iter().map(|(_, id, _)| id.as_str()).collect();
        sqlx::query(
            "UPDATE ledger_outbox o SET delivered_at = now(), journal_id = d.journal_id, last_error = NULL,
                    claimed_by = NULL, claim_expires_at = NULL
               FROM unnest($1::bigint[], $2::text[]) AS d(id, journal_id)
              WHERE o.id = d.id AND o.delivered_at IS NULL",
        )
        .bind(&ids)
        .bind(&journal_ids)
        .execute(&self.pool)
        .await?;
        for (row, journal_id, created) in delivered {
            self.metrics
                .delivered
                .with_label_values(&[if *created { "true" } else { "false" }])
                .inc();
            tracing::info!(outbox_id = row.id, account_id = %row.account_id, idempotency_key = %row.idempotency_key,
                kind = %row.kind, journal_id = %journal_id, created, "outbox row delivered");
        }
        Ok(())
    }

    async fn claim(&self) -> Result<Vec<Claimed>, DispatchError> {
        let rows = sqlx::query(
            "WITH candidates AS (
                SELECT o.id FROM ledger_outbox o
                WHERE o.delivered_at IS NULL AND o.quarantined_at IS NULL
                  AND o.next_attempt_at <= now()
                  AND (o.claim_expires_at IS NULL OR o.claim_expires_at < now())
                  AND NOT EXISTS (SELECT 1 FROM ledger_outbox p
                                  WHERE p.account_id = o.account_id AND p.id < o.id AND p.delivered_at IS NULL)
                ORDER BY o.id
                LIMIT $1
                FOR UPDATE OF o SKIP LOCKED)
             UPDATE ledger_outbox t
                SET claimed_by = $2, claim_expires_at = now() + make_interval(secs => $3), attempts = t.attempts + 1
               FROM candidates c WHERE t.id = c.id
             RETURNING t.id, t.account_id, t.idempotency_key, t.kind, t.payload, t.attempts",
        )
        .bind(self.config.batch_size.clamp(1, BATCH_SIZE_MAX))
        .bind(&self.config.instance_id)
        .bind(self.config.claim_lease_ms as f64 / 1000.0)
        .fetch_all(&self.pool)
        .await?;
        let mut claimed: Vec<Claimed> = rows
            .iter()
            .map(|r| Claimed {
                id: r.get("id"),
                account_id: r.get("account_id"),
                idempotency_key: r.get("idempotency_key"),
                kind: r.get("kind"),
                payload: r.get("payload"),
                attempts: r.get("attempts"),
            })
            .collect();
        claimed.sort_by_key(|c| c.id);
        // Only heads of accounts are claimable, so a batch holds at most one row per account: the
        // concurrent deliveries below can never reorder an account's rows.
        let mut accounts: Vec<&str> = claimed.iter().map(|c| c.account_id.as_str()).collect();
        accounts.sort_unstable();
        accounts.dedup();
        assert_eq!(accounts.len(), claimed.len(), "one claimed row per account");
        Ok(claimed)
    }

    async fn deliver(&self, row: &Claimed) -> Delivery {
        match row.kind.as_str() {
            KIND_JOURNAL => self.deliver_journal(row).await,
            KIND_TRANSACTION_EVENT => self.deliver_event(row).await,
            other => Delivery::Quarantine {
                reason: "MALFORMED_PAYLOAD".into(),
                detail: format!("unknown outbox row kind {other:?}"),
            },
        }
    }

    /// A lifecycle step: non-monetary history, idempotent in the GL on (source service, source
    /// transaction, event version). A refusal is classified as a journal's is.
    async fn deliver_event(&self, row: &Claimed) -> Delivery {
        let request = match to_event_request(row) {
            Ok(r) => r,
            Err(detail) => {
                return Delivery::Quarantine {
                    reason: "MALFORMED_PAYLOAD".into(),
                    detail,
                }
            }
        };
        match self.client.clone().append_transaction_event(request).await {
            Ok(response) => {
                let response = response.into_inner();
                assert!(
                    !response.event_id.is_empty(),
                    "the GL answers AppendTransactionEvent with its event"
                );
                Delivery::Delivered {
                    journal_id: response.event_id,
                    created: response.created,
                }
            }
            Err(status) => classify(status),
        }
    }

    async fn deliver_journal(&self, row: &Claimed) -> Delivery {
        let request = match to_request(row) {
            Ok(r) => r,
            Err(detail) => {
                return Delivery::Quarantine {
                    reason: "MALFORMED_PAYLOAD".into(),
                    detail,
                }
            }
        };
        let mut client = self.client.clone();
        // An opening is the moment the customer's ledger account comes to exist in the GL.
        if request.effect_kind == "ACCOUNT_OPENED" {
            for entry in request.entries.iter().filter(|e| {
                e.account
                    .as_ref()
                    .is_some_and(|a| a.owner_type == "ACCOUNT")
            }) {
                let open = pb::OpenAccountRequest {
                    account: entry.account.clone(),
                    asset: entry.asset.clone(),
                };
                if let Err(status) = client.open_account(open).await {
                    return classify(status);
                }
            }
        }
        match client.append_journal(request).await {
            Ok(response) => {
                let response = response.into_inner();
                let journal_id = response.journal.map(|j| j.journal_id).unwrap_or_default();
                assert!(
                    !journal_id.is_empty(),
                    "the GL answers AppendJournal with its journal"
                );
                Delivery::Delivered {
                    journal_id,
                    created: response.created,
                }
            }
            Err(status) => classify(status),
        }
    }

    /// Records one row's delivery: a retry's delay or a quarantine (a delivered row, which
    /// `run_once` records with its batch, is recorded alone here).
    async fn record(&self, row: &Claimed, delivery: Delivery) -> Result<(), DispatchError> {
        match delivery {
            Delivery::Delivered {
                journal_id,
                created,
            } => {
                self.record_delivered(&[(row.clone(), journal_id, created)])
                    .await?;
            }
            Delivery::Retry { error } => {
                let delay_ms = backoff_ms(
                    row.attempts,
                    self.config.backoff_base_ms,
                    self.config.backoff_max_ms,
                    row.id,
                );
                sqlx::query(
                    "UPDATE ledger_outbox SET next_attempt_at = now() + make_interval(secs => $2), last_error = $3,
                            claimed_by = NULL, claim_expires_at = NULL
                     WHERE id = $1 AND delivered_at IS NULL AND claimed_by = $4",
                )
                .bind(row.id)
                .bind(delay_ms as f64 / 1000.0)
                .bind(truncate(&error))
                .bind(&self.config.instance_id)
                .execute(&self.pool)
                .await?;
                self.metrics.retried.with_label_values(&["transient"]).inc();
                tracing::warn!(outbox_id = row.id, account_id = %row.account_id, attempts = row.attempts, delay_ms,
                    error = %error, "outbox delivery delayed");
            }
            Delivery::Quarantine { reason, detail } => {
                sqlx::query(
                    "UPDATE ledger_outbox SET quarantined_at = now(), last_error = $2, claimed_by = NULL, claim_expires_at = NULL
                     WHERE id = $1 AND delivered_at IS NULL AND claimed_by = $3",
                )
                .bind(row.id)
                .bind(truncate(&format!("{reason}: {detail}")))
                .bind(&self.config.instance_id)
                .execute(&self.pool)
                .await?;
                self.metrics
                    .quarantined
                    .with_label_values(&[reason.as_str()])
                    .inc();
                tracing::error!(alert = "ledger_outbox_quarantined", outbox_id = row.id, account_id = %row.account_id,
                    idempotency_key = %row.idempotency_key, reason = %reason, detail = %detail,
                    "outbox row quarantined: the GL refused its content; later rows of this account are held");
                let _ = self.alerts.send(Alert {
                    outbox_id: row.id,
                    account_id: row.account_id.clone(),
                    idempotency_key: row.idempotency_key.clone(),
                    reason,
                    detail,
                });
            }
        }
        Ok(())
    }
}

fn truncate(text: &str) -> String {
    let mut end = text.len().min(ERROR_TEXT_MAX);
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    text[..end].to_string()
}

/// A typed GL rejection of the content quarantines; anything else (no rejection detail:
/// transport, UNAVAILABLE, deadline) and a mode that refuses for now only delay.
pub fn classify(status: tonic::Status) -> Delivery {
    match service_kit::rejection::decode::<pb::Rejection>(&status) {
        Some(rejection) => {
            let reason = pb::RejectionReason::try_from(rejection.reason)
                .unwrap_or(pb::RejectionReason::Unspecified);
            match reason {
                pb::RejectionReason::ModeRefused | pb::RejectionReason::Unspecified => {
                    Delivery::Retry {
                        error: format!("{}: {}", reason.as_str_name(), rejection.detail),
                    }
                }
                _ => {
                    let mut detail = rejection.detail;
                    if !rejection.existing_journal_id.is_empty() {
                        detail = format!(
                            "{detail} (existing journal {})",
                            rejection.existing_journal_id
                        );
                    }
                    Delivery::Quarantine {
                        reason: reason.as_str_name().to_string(),
                        detail,
                    }
                }
            }
        }
        None => Delivery::Retry {
            error: format!("{:?}: {}", status.code(), status.message()),
        },
    }
}

/// Exponential backoff with jitter: uniformly in [d/2, d] where d = base * 2^(attempts-1), capped.
pub fn backoff_ms(attempts: i32, base_ms: u64, max_ms: u64, salt: i64) -> u64 {
    let exponent = attempts.saturating_sub(1).clamp(0, 20) as u32;
    let ceiling = base_ms.saturating_mul(1u64 << exponent).min(max_ms).max(1);
    let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
    hasher.write_i64(salt);
    hasher.write_i32(attempts);
    let half = ceiling / 2;
    half + hasher.finish() % (ceiling - half + 1)
}

/// The row's payload as an object, with its string fields read one way: a missing or null field
/// is empty, any other non-string is malformed. The payload's idempotency key must be the row's.
struct Payload<'a> {
    fields: &'a serde_json::Map<String, serde_json::Value>,
}

impl<'a> Payload<'a> {
    fn of(row: &'a Claimed) -> Result<Self, String> {
        let fields = row
            .payload
            .as_object()
            .ok_or("payload is not a JSON object")?;
        let payload = Self { fields };
        let idempotency_key = payload.text("idempotency_key")?;
        if idempotency_key != row.idempotency_key {
            return Err(format!(
                "payload idempotency_key {idempotency_key:?} differs from the row's {:?}",
                row.idempotency_key
            ));
        }
        Ok(payload)
    }

    fn text(&self, field: &str) -> Result<String, String> {
        match self.fields.get(field) {
            None | Some(serde_json::Value::Null) => Ok(String::new()),
            Some(serde_json::Value::String(s)) => Ok(s.clone()),
            Some(other) => Err(format!("{field} is not a string: {other}")),
        }
    }

    /// A version (missing = 0, which the GL refuses as a missing identity).
    fn version(&self, field: &str) -> Result<u32, String> {
        match self.fields.get(field) {
            Some(v) => v
                .as_u64()
                .and_then(|v| u32::try_from(v).ok())
                .ok_or(format!("{field} is not a small unsigned integer")),
            None => Ok(0),
        }
    }

    fn metadata_json(&self) -> Result<String, String> {
        match self.fields.get("metadata") {
            None | Some(serde_json::Value::Null) => Ok(String::new()),
            Some(m @ serde_json::Value::Object(_)) => Ok(m.to_string()),
            Some(_) => Err("metadata is not a JSON object".into()),
        }
    }
}

/// The row's id as the source's order: outbox ids are positive (`bigserial`).
fn source_sequence(row: &Claimed) -> u64 {
    u64::try_from(row.id).expect("outbox row ids are positive")
}

/// A TRANSACTION_EVENT row's payload as an `AppendTransactionEventRequest`. Structure only, as
/// for a journal: the content is the GL's to judge.
fn to_event_request(row: &Claimed) -> Result<pb::AppendTransactionEventRequest, String> {
    let p = Payload::of(row)?;
    Ok(pb::AppendTransactionEventRequest {
        source_service: p.text("source_service")?,
        source_transaction_id: p.text("source_transaction_id")?,
        event_type: p.text("event_type")?,
        event_version: p.version("event_version")?,
        occurred_at: p.text("occurred_at")?,
        correlation_id: p.text("correlation_id")?,
        actor_id: p.text("actor_id")?,
        metadata_json: p.metadata_json()?,
        source_sequence: source_sequence(row),
    })
}

/// The payload as the payment resource wrote it, as an `AppendJournalRequest`. Only structure is
/// checked here; content is the GL's to judge (and to reject with a typed reason).
fn to_request(row: &Claimed) -> Result<pb::AppendJournalRequest, String> {
    let payload = Payload::of(row)?;
    let p = payload.fields;
    let text = |field: &str| payload.text(field);
    let idempotency_key = row.idempotency_key.clone();
    let effect_version = payload.version("effect_version")?;
    let metadata_json = payload.metadata_json()?;
    let entries = p
        .get("entries")
        .and_then(|e| e.as_array())
        .ok_or("entries is not an array")?;
    let mut wire_entries = Vec::with_capacity(entries.len());
    for (index, e) in entries.iter().enumerate() {
        let e = e
            .as_object()
            .ok_or(format!("entry {index} is not an object"))?;
        let s = |v: Option<&serde_json::Value>, what: &str| -> Result<String, String> {
            match v {
                None | Some(serde_json::Value::Null) => Ok(String::new()),
                Some(serde_json::Value::String(s)) => Ok(s.clone()),
                // A JSON number for an amount is a float on the wire: never converted.
                Some(other) => Err(format!("entry {index}: {what} is not a string: {other}")),
            }
        };
        let account = e
            .get("account")
            .and_then(|a| a.as_object())
            .ok_or(format!("entry {index}: account is not an object"))?;
        let line_number = e
            .get("line_number")
            .and_then(|l| l.as_u64())
            .and_then(|l| u32::try_from(l).ok())
            .ok_or(format!(
                "entry {index}: line_number is not a small unsigned integer"
            ))?;
        wire_entries.push(pb::EntryInput {
            line_number,
            account: Some(pb::AccountRef {
                class: s(account.get("class"), "account.class")?,
                owner_type: s(account.get("owner_type"), "account.owner_type")?,
                owner_id: s(account.get("owner_id"), "account.owner_id")?,
            }),
            asset: s(e.get("asset"), "asset")?,
            amount: s(e.get("amount"), "amount")?,
            description: s(e.get("description"), "description")?,
        });
    }
    Ok(pb::AppendJournalRequest {
        source_service: text("source_service")?,
        idempotency_key,
        source_transaction_id: text("source_transaction_id")?,
        tracking_code: text("tracking_code")?,
        effect_kind: text("effect_kind")?,
        effect_version,
        occurred_at: text("occurred_at")?,
        correlation_id: text("correlation_id")?,
        actor_id: text("actor_id")?,
        metadata_json,
        entries: wire_entries,
        reversal_of: text("reversal_of")?,
        correction: None,
        source_sequence: source_sequence(row),
        settlement_reference: text("settlement_reference")?,
        client_reference: text("client_reference")?,
    })
}

/// A quarantined row, for the operator.
#[derive(Debug, Clone, Serialize)]
pub struct QuarantinedRow {
    pub id: i64,
    pub account_id: String,
    pub idempotency_key: String,
    pub attempts: i32,
    pub last_error: Option<String>,
    pub quarantined_at: chrono::DateTime<chrono::Utc>,
    /// Later rows of the same account held behind this one (per-account order).
    pub held_rows: i64,
}

pub async fn list_quarantined(pool: &PgPool) -> Result<Vec<QuarantinedRow>, DispatchError> {
    let rows = sqlx::query(
        "SELECT q.id, q.account_id, q.idempotency_key, q.attempts, q.last_error, q.quarantined_at,
                (SELECT count(*) FROM ledger_outbox h WHERE h.account_id = q.account_id AND h.id > q.id
                    AND h.delivered_at IS NULL) AS held_rows
         FROM ledger_outbox q WHERE q.quarantined_at IS NOT NULL AND q.delivered_at IS NULL
         ORDER BY q.id LIMIT $1",
    )
    .bind(QUARANTINE_LIST_MAX)
    .fetch_all(pool)
    .await?;
    Ok(rows
        .iter()
        .map(|r| QuarantinedRow {
            id: r.get("id"),
            account_id: r.get("account_id"),
            idempotency_key: r.get("idempotency_key"),
            attempts: r.get("attempts"),
            last_error: r.get("last_error"),
            quarantined_at: r.get("quarantined_at"),
            held_rows: r.get("held_rows"),
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_grows_within_bounds() {
        for attempts in 1..30 {
            let d = backoff_ms(attempts, 200, 30_000, 7);
            let ceiling = (200u64 << (attempts - 1).min(20)).min(30_000);
            assert!(d >= ceiling / 2 && d <= ceiling, "attempt {attempts}: {d}");
        }
    }

    #[test]
    fn classify_separates_content_from_transport() {
        let rejection = |reason: pb::RejectionReason| {
            service_kit::rejection::status(
                tonic::Code::InvalidArgument,
                "x",
                &pb::Rejection {
                    reason: reason as i32,
                    ..Default::default()
                },
            )
        };
        assert!(matches!(
            classify(rejection(pb::RejectionReason::Unbalanced)),
            Delivery::Quarantine { .. }
        ));
        assert!(matches!(
            classify(rejection(pb::RejectionReason::IdempotencyConflict)),
            Delivery::Quarantine { .. }
        ));
        assert!(matches!(
            classify(rejection(pb::RejectionReason::ModeRefused)),
            Delivery::Retry { .. }
        ));
        assert!(matches!(
            classify(tonic::Status::unavailable("down")),
            Delivery::Retry { .. }
        ));
    }
}
