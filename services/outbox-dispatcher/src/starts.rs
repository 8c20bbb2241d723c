//! The workflow starter: delivers the payout workflow starts that CreatePayout staged in paydb's
//! `workflow_start` (paydb 0009), in the same transaction as the payout, to Temporal. It is the
//! second delivery loop of the dispatcher process, beside the GL's, and shares its shape:
//!
//! * At least once: a row is marked started (`started_at`, `start_outcome`) only after Temporal
//!   answered; the start is idempotent by its workflow id `payout-{id}` (the standard options:
//!   `payout_workflows::start_options`, a second start of the id refused even after the first
//!   closed), so "already started" is a delivery too (`ALREADY_STARTED`), never an error.
//! * Prompt: paydb NOTIFYs `workflow_start_staged` at the commit of a staged start; the starter
//!   LISTENs and delivers at once, and polls every [`START_POLL_INTERVAL_MS`] as a backstop.
//! * Several instances: rows are claimed with `FOR UPDATE SKIP LOCKED` and a lease, at most
//!   [`START_BATCH_SIZE_MAX`] per round.
//! * Never drops a row: a failed start (Temporal down, a timeout) is retried with exponential
//!   backoff and jitter, for ever; a row is never deleted (paydb refuses it). A start still
//!   failing [`START_OVERDUE_MS`] after it was staged is an alert: a log line at error level
//!   (`alert = "workflow_start_failing"`) and `workflow_start_failing_total`; the age of the
//!   oldest undelivered start is `workflow_start_pending_oldest_age_seconds`.
//!
//! Architecture invariant: the starter writes only the delivery columns of `workflow_start`
//! (by privilege, and paydb's trigger keeps the staged columns immutable and a delivery final).

use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use payout_activities::types::{AmbiguityPolicy, PayoutInput};
use payout_workflows::client::{PayoutClientError, TemporalTarget};
use sqlx::{PgPool, Row};
use tokio::sync::Notify;

/// Starts claimed per round: a lease must cover a whole batch's starts, and a small batch keeps
/// what a crashed instance strands (until its lease ends) small.
pub const START_BATCH_SIZE_MAX: i64 = 64;
/// Starts in flight at once within a batch. An idle frontend answers a start in milliseconds; in a
/// burst (the dev server busy with the workers too) a start takes a few hundred, and the starter's
/// throughput is this over that: 32 against 16 took a 200-payout burst's staged-to-started p50
/// from 3.7 s to 2.1 s (bench e2e, debug build), as many as the bench's own starts in flight.
pub const START_CONCURRENCY_MAX: usize = 32;
/// How long a claim stays exclusive: far above a batch's starts (each bounded by
/// [`START_CALL_TIMEOUT_MS`]), so a live instance never loses its claim.
pub const START_CLAIM_LEASE_MS: u64 = 60_000;
/// One start call to Temporal, connection included: a hung frontend counts as a failure.
pub const START_CALL_TIMEOUT_MS: u64 = 10_000;
/// First retry delay after a failed start; doubles per attempt.
pub const START_BACKOFF_BASE_MS: u64 = 200;
/// Retry delay cap: a Temporal outage is noticed within this long of its end.
pub const START_BACKOFF_MAX_MS: u64 = 10_000;
/// The backstop poll when no notification arrives (a notification missed while the listener
/// reconnects, a retry coming due).
pub const START_POLL_INTERVAL_MS: u64 = 1_000;
/// A start still undelivered this long after it was staged is an alert: a healthy start takes
/// milliseconds, and the reconciler's stranded-payout pass only looks after minutes.
pub const START_OVERDUE_MS: u64 = 60_000;
/// The listener's pause before it reconnects after losing its connection.
const LISTENER_RECONNECT_MS: u64 = 1_000;
/// The channel paydb 0009's trigger notifies at the commit of a staged start.
pub const STAGED_CHANNEL: &str = "workflow_start_staged";
/// `start_outcome` of a start Temporal took.
pub const OUTCOME_STARTED: &str = "STARTED";
/// `start_outcome` of a workflow id that already had a run (by this starter, another instance,
/// a caller that still starts its own, or the reconciler).
pub const OUTCOME_ALREADY_STARTED: &str = "ALREADY_STARTED";

/// Where Temporal is and what the payout workflow is started with.
#[derive(Debug, Clone)]
pub struct StarterConfig {
    /// Temporal, resolved as every process resolves it (`payout_workflows::client::TemporalArgs`:
    /// flags, TEMPORAL_* and the config file's profile; TLS and an API key included).
    pub temporal: TemporalTarget,
    /// The payout workers' task queue.
    pub task_queue: String,
    /// The ambiguity clocks every started workflow gets (the deployment's rail's).
    pub ambiguity: AmbiguityPolicy,
    /// Names this instance in `claimed_by` and to Temporal.
    pub instance_id: String,
    pub batch_size: i64,
    pub claim_lease_ms: u64,
    pub backoff_base_ms: u64,
    pub backoff_max_ms: u64,
    pub poll_interval_ms: u64,
    pub overdue_ms: u64,
}

impl StarterConfig {
    pub fn new(
        temporal: TemporalTarget,
        task_queue: impl Into<String>,
        ambiguity: AmbiguityPolicy,
        instance_id: impl Into<String>,
    ) -> Self {
        Self {
            temporal,
            task_queue: task_queue.into(),
            ambiguity,
            instance_id: instance_id.into(),
            batch_size: START_BATCH_SIZE_MAX,
            claim_lease_ms: START_CLAIM_LEASE_MS,
            backoff_base_ms: START_BACKOFF_BASE_MS,
            backoff_max_ms: START_BACKOFF_MAX_MS,
            poll_interval_ms: START_POLL_INTERVAL_MS,
            overdue_ms: START_OVERDUE_MS,
        }
    }
}

#[derive(Clone)]
pub struct StartMetrics {
    /// Deliveries, by outcome (`started`, `already_started`).
    pub delivered: service_kit::prometheus::IntCounterVec,
    /// Failed start attempts (each is retried).
    pub retried: service_kit::prometheus::IntCounter,
    /// Failed attempts of starts past [`START_OVERDUE_MS`]: an alert on any.
    pub failing: service_kit::prometheus::IntCounter,
    /// Age of the oldest undelivered start (0 when none).
    pub oldest_pending_age: service_kit::prometheus::Gauge,
}

impl StartMetrics {
    pub fn new(metrics: &service_kit::Metrics) -> Self {
        use service_kit::prometheus::{Gauge, IntCounter};
        Self {
            delivered: metrics.counter_vec(
                "workflow_starts_total",
                "Staged payout workflow starts delivered to Temporal, by outcome (started, already_started).",
                &["outcome"],
            ),
            retried: registered(metrics, IntCounter::new(
                "workflow_start_retries_total",
                "Failed attempts to start a payout workflow (retried with backoff).",
            )),
            failing: registered(metrics, IntCounter::new(
                "workflow_start_failing_total",
                "Failed attempts to start a payout workflow staged longer than the overdue bound. Alert on any.",
            )),
            oldest_pending_age: registered(metrics, Gauge::new(
                "workflow_start_pending_oldest_age_seconds",
                "Age of the oldest staged payout workflow start not yet delivered to Temporal (0: none).",
            )),
        }
    }
}

/// A metric of this file's definitions, registered on the process's registry (exported at 0 from
/// the start, so an alert sees its first increase).
fn registered<C>(metrics: &service_kit::Metrics, made: service_kit::prometheus::Result<C>) -> C
where
    C: service_kit::prometheus::core::Collector + Clone + 'static,
{
    let metric = made.expect("a valid metric definition");
    metrics
        .registry
        .register(Box::new(metric.clone()))
        .expect("metric registered once");
    metric
}

#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error("database: {0}")]
    Database(#[from] sqlx::Error),
}

/// What one round did.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct StartRound {
    pub claimed: usize,
    pub started: usize,
    pub already_started: usize,
    pub retried: usize,
}

#[derive(Debug, Clone)]
struct Staged {
    payout_id: String,
    workflow_id: String,
    input: serde_json::Value,
    attempts: i32,
    overdue: bool,
}

enum Outcome {
    Delivered(&'static str),
    Retry(String),
}

pub struct Starter {
    pool: PgPool,
    config: StarterConfig,
    metrics: StartMetrics,
    /// Connected on first use and kept: a Temporal that is down at start only delays starts.
    client: tokio::sync::Mutex<Option<Arc<temporalio_client::Client>>>,
    wake: Arc<Notify>,
}

impl Starter {
    pub fn new(pool: PgPool, config: StarterConfig, metrics: &service_kit::Metrics) -> Self {
        Self {
            pool,
            config,
            metrics: StartMetrics::new(metrics),
            client: tokio::sync::Mutex::new(None),
            wake: Arc::new(Notify::new()),
        }
    }

    pub fn metrics(&self) -> &StartMetrics {
        &self.metrics
    }

    /// Delivers until `shutdown` resolves, woken by paydb's notification of each staged start.
    pub async fn run(&self, shutdown: impl std::future::Future<Output = ()>) {
        let listener = tokio::spawn(listen(self.pool.clone(), self.wake.clone()));
        tokio::pin!(shutdown);
        loop {
            let idle = match self.run_once().await {
                Ok(round) => round.claimed == 0 || round.retried == round.claimed,
                Err(e) => {
                    tracing::warn!(error = %e, "workflow start round failed; retrying");
                    true
                }
            };
            if idle {
                tokio::select! {
                    _ = &mut shutdown => break,
                    _ = self.wake.notified() => {}
                    _ = tokio::time::sleep(Duration::from_millis(self.config.poll_interval_ms)) => {}
                }
            } else if futures::FutureExt::now_or_never(&mut shutdown).is_some() {
                break;
            }
        }
        listener.abort();
        tracing::info!(instance = %self.config.instance_id, "workflow starter stopped");
    }

    /// One round: claim the due starts, start each workflow, record each outcome.
    pub async fn run_once(&self) -> Result<StartRound, StartError> {
        self.observe_backlog().await?;
        let batch = self.claim().await?;
        let mut round = StartRound {
            claimed: batch.len(),
            ..Default::default()
        };
        if batch.is_empty() {
            return Ok(round);
        }
        let client = self.client().await;
        // Each row is recorded as soon as its own start answers, not after the whole batch: a
        // delivery is marked (and a failure's backoff begins) at once.
        let recorded: Vec<Result<&'static str, StartError>> = futures::stream::iter(batch)
            .map(|row| {
                let client = client.clone();
                async move {
                    let outcome = match client {
                        Ok(client) => self.start(&client, &row).await,
                        Err(e) => Outcome::Retry(e),
                    };
                    let kind = match &outcome {
                        Outcome::Delivered(how) => *how,
                        Outcome::Retry(_) => "retry",
                    };
                    self.record(&row, outcome).await.map(|()| kind)
                }
            })
            .buffer_unordered(START_CONCURRENCY_MAX)
            .collect()
            .await;
        for kind in recorded {
            match kind? {
                OUTCOME_STARTED => round.started += 1,
                OUTCOME_ALREADY_STARTED => round.already_started += 1,
                _ => round.retried += 1,
            }
        }
        Ok(round)
    }

    /// The Temporal client, connecting (bounded) if there is none yet.
    async fn client(&self) -> Result<Arc<temporalio_client::Client>, String> {
        let mut guard = self.client.lock().await;
        if let Some(client) = guard.as_ref() {
            return Ok(client.clone());
        }
        let connect =
            payout_workflows::client::connect_to(&self.config.temporal, &self.config.instance_id);
        match tokio::time::timeout(Duration::from_millis(START_CALL_TIMEOUT_MS), connect).await {
            Ok(Ok(client)) => {
                let client = Arc::new(client);
                *guard = Some(client.clone());
                Ok(client)
            }
            Ok(Err(e)) => Err(e.to_string()),
            Err(_) => Err(format!(
                "connecting to Temporal at {}: no answer within {START_CALL_TIMEOUT_MS} ms",
                self.config.temporal.describe()
            )),
        }
    }

    async fn start(&self, client: &temporalio_client::Client, row: &Staged) -> Outcome {
        let mut input: PayoutInput = match serde_json::from_value(row.input.clone()) {
            Ok(input) => input,
            // paydb's check and CreatePayout's parsing make this unreachable; if it happens it
            // stays undelivered and alerts, never silently dropped.
            Err(e) => return Outcome::Retry(format!("staged input does not parse: {e}")),
        };
        input.ambiguity = self.config.ambiguity;
        let started = tokio::time::timeout(
            Duration::from_millis(START_CALL_TIMEOUT_MS),
            payout_workflows::client::start_payout(client, &self.config.task_queue, &input),
        )
        .await;
        match started {
            Ok(Ok(workflow_id)) if workflow_id == row.workflow_id => {
                Outcome::Delivered(OUTCOME_STARTED)
            }
            Ok(Ok(other)) => Outcome::Retry(format!(
                "started {other}, but the staged workflow id is {}",
                row.workflow_id
            )),
            Ok(Err(PayoutClientError::AlreadyStarted { .. })) => {
                Outcome::Delivered(OUTCOME_ALREADY_STARTED)
            }
            Ok(Err(e)) => Outcome::Retry(e.to_string()),
            Err(_) => Outcome::Retry(format!(
                "starting {}: no answer within {START_CALL_TIMEOUT_MS} ms",
                row.workflow_id
            )),
        }
    }

    async fn claim(&self) -> Result<Vec<Staged>, StartError> {
        let rows = sqlx::query(
            "WITH due AS (
                SELECT payout_id FROM workflow_start
                WHERE started_at IS NULL AND next_attempt_at <= now()
                  AND (claim_expires_at IS NULL OR claim_expires_at < now())
                ORDER BY next_attempt_at, payout_id
                LIMIT $1
                FOR UPDATE SKIP LOCKED)
             UPDATE workflow_start w
                SET claimed_by = $2, claim_expires_at = now() + make_interval(secs => $3),
                    attempts = w.attempts + 1
               FROM due WHERE w.payout_id = due.payout_id
             RETURNING w.payout_id, w.workflow_id, w.input, w.attempts,
                       w.staged_at < now() - make_interval(secs => $4) AS overdue",
        )
        .bind(self.config.batch_size.clamp(1, START_BATCH_SIZE_MAX))
        .bind(&self.config.instance_id)
        .bind(self.config.claim_lease_ms as f64 / 1000.0)
        .bind(self.config.overdue_ms as f64 / 1000.0)
        .fetch_all(&self.pool)
        .await?;
        Ok(rows
            .iter()
            .map(|r| Staged {
                payout_id: r.get("payout_id"),
                workflow_id: r.get("workflow_id"),
                input: r.get("input"),
                attempts: r.get("attempts"),
                overdue: r.get("overdue"),
            })
            .collect())
    }

    async fn record(&self, row: &Staged, outcome: Outcome) -> Result<(), StartError> {
        match outcome {
            Outcome::Delivered(how) => {
                sqlx::query(
                    "UPDATE workflow_start SET started_at = now(), start_outcome = $2, last_error = NULL,
                            claimed_by = NULL, claim_expires_at = NULL
                     WHERE payout_id = $1 AND started_at IS NULL AND claimed_by = $3",
                )
                .bind(&row.payout_id)
                .bind(how)
                .bind(&self.config.instance_id)
                .execute(&self.pool)
                .await?;
                self.metrics
                    .delivered
                    .with_label_values(&[&how.to_ascii_lowercase()])
                    .inc();
                tracing::info!(payout_id = %row.payout_id, workflow_id = %row.workflow_id, outcome = how,
                    attempts = row.attempts, "payout workflow start delivered");
            }
            Outcome::Retry(error) => {
                let delay_ms = crate::backoff_ms(
                    row.attempts,
                    self.config.backoff_base_ms,
                    self.config.backoff_max_ms,
                    row.attempts as i64,
                );
                sqlx::query(
                    "UPDATE workflow_start SET next_attempt_at = now() + make_interval(secs => $2), last_error = $3,
                            claimed_by = NULL, claim_expires_at = NULL
                     WHERE payout_id = $1 AND started_at IS NULL AND claimed_by = $4",
                )
                .bind(&row.payout_id)
                .bind(delay_ms as f64 / 1000.0)
                .bind(crate::truncate(&error))
                .bind(&self.config.instance_id)
                .execute(&self.pool)
                .await?;
                self.metrics.retried.inc();
                if row.overdue {
                    self.metrics.failing.inc();
                    tracing::error!(alert = "workflow_start_failing", payout_id = %row.payout_id,
                        workflow_id = %row.workflow_id, attempts = row.attempts, delay_ms, error = %error,
                        "a payout's workflow still does not start: the payout waits for nobody until it does");
                } else {
                    tracing::warn!(payout_id = %row.payout_id, workflow_id = %row.workflow_id,
                        attempts = row.attempts, delay_ms, error = %error, "payout workflow start delayed");
                }
            }
        }
        Ok(())
    }

    /// Sets the oldest-undelivered-start gauge.
    async fn observe_backlog(&self) -> Result<(), StartError> {
        let age: f64 = sqlx::query_scalar(
            "SELECT COALESCE(EXTRACT(EPOCH FROM now() - min(staged_at))::float8, 0)
             FROM workflow_start WHERE started_at IS NULL",
        )
        .fetch_one(&self.pool)
        .await?;
        self.metrics.oldest_pending_age.set(age);
        Ok(())
    }
}

/// Wakes the starter on each `NOTIFY workflow_start_staged`, reconnecting on loss (the poll
/// covers what is missed meanwhile).
async fn listen(pool: PgPool, wake: Arc<Notify>) {
    loop {
        match sqlx::postgres::PgListener::connect_with(&pool).await {
            Ok(mut listener) => match listener.listen(STAGED_CHANNEL).await {
                Ok(()) => {
                    // Whatever was staged before the subscription is the next round's.
                    wake.notify_one();
                    loop {
                        match listener.recv().await {
                            Ok(_) => wake.notify_one(),
                            Err(e) => {
                                tracing::warn!(error = %e, "workflow start listener lost its connection");
                                break;
                            }
                        }
                    }
                }
                Err(e) => tracing::warn!(error = %e, "workflow start listener could not subscribe"),
            },
            Err(e) => tracing::warn!(error = %e, "workflow start listener could not connect"),
        }
        tokio::time::sleep(Duration::from_millis(LISTENER_RECONNECT_MS)).await;
    }
}
