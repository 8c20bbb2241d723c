//! The workload: accounts with contention (several payouts per account, a few larger than the
//! account can fund), every payout started through Temporal, the rail misbehaving.

use std::sync::Arc;
use std::time::{Duration, Instant};
use testkit::pki::Role;

use payment_client::PaymentClient;
use payout_activities::types::{AmbiguityPolicy, PayoutInput};
use payout_domain::AccountId;
use rail_stub::FaultConfig;
use testkit::system::System;

use super::{say, ChaosConfig};

/// Opening balance per account: enough for a few payouts, so a few of the larger ones fail.
pub const OPENING_BALANCE_MINOR: i64 = 200_000;
/// Share of payouts larger than any account can fund.
pub const INSUFFICIENT_RATE: f64 = 0.06;
/// The other payouts are 1.00 ..< 200.00, to one of a hundred beneficiaries.
const AMOUNT_MAX_MINOR: i64 = 20_000;
const BENEFICIARIES: u32 = 100;
/// Workflow starts in flight at once.
const START_CONCURRENCY_MAX: usize = 16;
/// Payouts wait at most this long for their account's lock; contention queues behind it.
const RESOLUTION_SLA_MS: u64 = 600_000;

pub struct Workload {
    pub run_id: String,
    pub inputs: Vec<PayoutInput>,
    pub accounts: Vec<AccountId>,
    pub seed: u64,
}

/// Records `input`'s workflow start as delivered in paydb's `workflow_start`, as the starter
/// does when it delivers a staged start: the harness starts its payouts itself (to pace them),
/// and without the record the reconciler would take a payout whose run Temporal lost for one
/// never started, and leave it for the not-started grace. Best effort, tried again as a start
/// is (paydb may be restarting: a fault); without it the payout is resumed after the grace
/// instead.
pub(super) async fn record_start(paydb: &sqlx::PgPool, input: &PayoutInput) {
    let give_up = Instant::now() + START_RETRY_MAX;
    while Instant::now() < give_up {
        // CreatePayout staged the row (the starter's delivery columns empty: this run's
        // dispatcher starts nothing); marked delivered as the starter marks it. Before, an
        // INSERT that did nothing on the staged row left every start unrecorded.
        let recorded = sqlx::query(
            "INSERT INTO workflow_start (payout_id, workflow_id, input, started_at, start_outcome) \
             VALUES ($1, 'payout-' || $1, '{}'::jsonb, now(), 'STARTED') \
             ON CONFLICT (payout_id) DO UPDATE SET started_at = now(), start_outcome = 'STARTED' \
             WHERE workflow_start.started_at IS NULL",
        )
        .bind(input.payout_id.as_str())
        .execute(paydb)
        .await;
        if recorded.is_ok() {
            return;
        }
        tokio::time::sleep(START_RETRY_PAUSE).await;
    }
}

/// The rail's misbehaviour during the fault phase: every fault mode the stub has, seeded.
pub fn rail_faults(seed: u64, intensity: f64) -> FaultConfig {
    FaultConfig {
        seed,
        latency_ms_min: 0,
        latency_ms_max: 30,
        latency_tail_rate: 0.05 * intensity,
        latency_tail_ms: 1_500,
        decline_rate: 0.04,
        fail_before_acting_rate: 0.03 * intensity,
        accept_then_fail_rate: 0.03 * intensity,
        accept_then_hang_rate: 0.03 * intensity,
        reset_before_acting_rate: 0.03 * intensity,
        accept_then_reset_rate: 0.02 * intensity,
        lookup_latency_ms: (300.0 * intensity) as u64,
        ..FaultConfig::default()
    }
}

/// The nemesis's progress, which the workload's starts follow: payout `i` of `n` starts once
/// the nemesis has begun `i * faults / n` of its faults. Paced by the clock alone, a machine
/// slowed by other work had the nemesis a minute and a half behind its schedule, every payout
/// settled, and its last faults (a Temporal amnesia among them) met an idle system: the run
/// then reached nothing they exist to reach. Paced by the nemesis too, work is in flight until its
/// last fault, whatever the machine's speed.
pub struct Pace {
    /// Faults begun so far (the nemesis sends; a closed channel means it has finished).
    pub begun: tokio::sync::watch::Receiver<usize>,
    pub faults: usize,
}

impl Pace {
    async fn wait(&mut self, started: usize, payouts: usize) {
        let needed = started * self.faults / payouts.max(1);
        // An error is the nemesis gone: every fault has begun.
        let _ = self.begun.wait_for(|begun| *begun >= needed).await;
    }
}

impl Workload {
    pub async fn create(system: &System, config: &ChaosConfig) -> anyhow::Result<Self> {
        let stub = rail_stub::client::StubClient::new(system.rail_stub_endpoints())
            .expect("the harness's rail client");
        let faults = if config.rail_faults {
            rail_faults(config.seed, 1.0)
        } else {
            FaultConfig {
                seed: config.seed,
                ..FaultConfig::default()
            }
        };
        stub.set_faults(&faults)
            .await
            .map_err(|e| anyhow::anyhow!("rail faults: {e}"))?;
        // Seed and system: two runs of one seed on one Temporal server (the negative controls'
        // configurations) must not share workflow ids.
        let run_id = format!("c{}s{}", config.seed, system.ports.lock_server);
        let payments = PaymentClient::connect(&system.payment_url(), &system.tls(Role::Fixture))
            .await
            .map_err(|e| anyhow::anyhow!("{e}"))?;
        let batch = crate::workload::Batch {
            run_id: run_id.clone(),
            payouts: config.payouts,
            accounts: config.accounts,
            opening_balance_minor: OPENING_BALANCE_MINOR,
            insufficient_rate: INSUFFICIENT_RATE,
            amount_max_minor: AMOUNT_MAX_MINOR,
            beneficiaries: BENEFICIARIES,
            seed: config.seed,
            ambiguity: AmbiguityPolicy {
                settlement_window_ms: super::SETTLEMENT_WINDOW_MS + 500,
                resolution_sla_ms: RESOLUTION_SLA_MS,
            },
            round_robin: false,
        };
        let (accounts, inputs) = batch.create(&payments, &system.operator).await?;
        Ok(Self {
            run_id,
            inputs,
            accounts,
            seed: config.seed,
        })
    }

    /// Starts every payout's workflow (starts only: settling is observed in the databases), with
    /// at most `open_max` of them not yet settled at a time, as an upstream batcher would: every
    /// open payout of a busy account polls for its lock, and thousands of them at once only
    /// measure the churn.
    pub async fn start_all(
        &self,
        system: &Starts,
        open_max: usize,
        spread: Duration,
        mut pace: Option<Pace>,
    ) -> anyhow::Result<()> {
        let paydb = super::one_connection(&system.paydb).await?;
        let client = Arc::new(
            payout_workflows::client::connect_configured(
                &payout_workflows::client::TemporalArgs::profile_of(
                    &system.temporal_clients,
                    "operator",
                ),
                "chaos",
            )
            .await
            .map_err(|e| anyhow::anyhow!("{e}"))?,
        );
        let semaphore = Arc::new(tokio::sync::Semaphore::new(START_CONCURRENCY_MAX));
        let mut tasks = tokio::task::JoinSet::new();
        let mut settled: i64 = 0;
        let first = Instant::now();
        let n = self.inputs.len().max(1) as u32;
        for (started, input) in self.inputs.clone().into_iter().enumerate() {
            // Payout i starts no earlier than spread * i / n after the first, and not before
            // the nemesis has begun as large a share of its faults.
            tokio::time::sleep_until((first + spread * started as u32 / n).into()).await;
            if let Some(pace) = pace.as_mut() {
                pace.wait(started, self.inputs.len()).await;
            }
            while started as i64 - settled >= open_max as i64 {
                tokio::time::sleep(Duration::from_millis(500)).await;
                // paydb may be restarting (a fault): the count is asked again.
                if let Ok(n) = sqlx::query_scalar::<_, i64>(
                    "SELECT count(*) FROM payout WHERE state IN ('POSTED', 'FAILED', 'ABANDONED', 'RAIL_AMBIGUOUS')",
                )
                .fetch_one(&paydb)
                .await
                {
                    settled = n;
                }
            }
            let client = client.clone();
            let semaphore = semaphore.clone();
            let queue = system.task_queue.clone();
            let paydb = paydb.clone();
            tasks.spawn(async move {
                let _permit = semaphore.acquire_owned().await.expect("semaphore open");
                // Already started: the reconciler found the payout's start overdue (the pacing
                // held it back) and resumed it, which is the same start. Temporal may be down
                // (a fault): the start is tried again, bounded.
                let give_up = Instant::now() + START_RETRY_MAX;
                loop {
                    match payout_workflows::client::start_payout(&client, &queue, &input).await {
                        Ok(_)
                        | Err(payout_workflows::client::PayoutClientError::AlreadyStarted {
                            ..
                        }) => {
                            record_start(&paydb, &input).await;
                            return Ok(());
                        }
                        Err(e) if Instant::now() >= give_up => {
                            return Err(anyhow::anyhow!("starting {}: {e}", input.payout_id))
                        }
                        Err(_) => tokio::time::sleep(START_RETRY_PAUSE).await,
                    }
                }
            });
        }
        while let Some(joined) = tasks.join_next().await {
            joined??;
        }
        Ok(())
    }

    /// The faults stop: the rail answers promptly and truthfully again.
    pub async fn calm_rail(&self, system: &System) {
        let stub = rail_stub::client::StubClient::new(system.rail_stub_endpoints())
            .expect("the harness's rail client");
        let _ = stub
            .set_faults(&FaultConfig {
                seed: self.seed,
                ..FaultConfig::default()
            })
            .await;
    }
}

/// What [`Workload::start_all`] needs of the system, apart from it: the nemesis holds the
/// system meanwhile and may replace its workers (a rollout).
pub struct Starts {
    pub paydb: String,
    pub temporal_clients: std::path::PathBuf,
    pub task_queue: String,
}

impl Starts {
    pub fn of(system: &System) -> Self {
        Self {
            paydb: system.databases.paydb.clone(),
            temporal_clients: system.temporal_clients.clone(),
            task_queue: system.task_queue.clone(),
        }
    }
}

/// A start that Temporal refuses (it is down: a fault) is tried again for this long at most: a
/// bound, not an expectation (a Temporal restart takes seconds).
const START_RETRY_MAX: Duration = Duration::from_secs(120);
const START_RETRY_PAUSE: Duration = Duration::from_millis(500);

/// Polls paydb until every payout is terminal or RAIL_AMBIGUOUS with evidence at the proxy, and
/// the outbox has drained; false if `timeout` passed first.
pub async fn wait_settled(system: &System, timeout: Duration, verbose: bool) -> bool {
    let started = Instant::now();
    let mut last_report = Instant::now();
    let (Ok(paydb), Ok(proxydb)) = (
        sqlx::postgres::PgPoolOptions::new()
            .max_connections(2)
            .connect(&system.databases.paydb)
            .await,
        sqlx::postgres::PgPoolOptions::new()
            .max_connections(2)
            .connect(&system.databases.proxydb)
            .await,
    ) else {
        return false;
    };
    loop {
        let counts = unsettled(&paydb, &proxydb).await;
        let unsettled = counts.map(|(open, ambiguous)| open + ambiguous);
        let pending: Option<i64> = sqlx::query_scalar(
            "SELECT count(*) FROM ledger_outbox WHERE delivered_at IS NULL AND quarantined_at IS NULL",
        )
        .fetch_one(&paydb)
        .await
        .ok();
        if let (Some(0), Some(0)) = (unsettled, pending) {
            return true;
        }
        if started.elapsed() >= timeout {
            // RAIL_AMBIGUOUS with evidence is an accepted end state once the time is up.
            if let (Some((0, _)), Some(0)) = (counts, pending) {
                return true;
            }
            say(verbose, format!("not settled after {timeout:?}: {unsettled:?} payouts open, {pending:?} outbox rows pending"));
            return false;
        }
        if last_report.elapsed() >= Duration::from_secs(10) {
            last_report = Instant::now();
            say(
                verbose,
                format!("settling: {unsettled:?} payouts open, {pending:?} outbox rows pending"),
            );
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// (payouts neither terminal nor RAIL_AMBIGUOUS with a submission the proxy recorded,
/// RAIL_AMBIGUOUS payouts with that evidence).
async fn unsettled(paydb: &sqlx::PgPool, proxydb: &sqlx::PgPool) -> Option<(i64, i64)> {
    let rows: Vec<(String, String)> = sqlx::query_as(
        "SELECT id, state FROM payout WHERE state NOT IN ('POSTED', 'FAILED', 'ABANDONED')",
    )
    .fetch_all(paydb)
    .await
    .ok()?;
    let mut open = 0;
    let mut ambiguous = 0;
    for (id, state) in rows {
        if state == "RAIL_AMBIGUOUS" {
            let evidence: i64 =
                sqlx::query_scalar("SELECT count(*) FROM rail_submission WHERE payout_id = $1")
                    .bind(&id)
                    .fetch_one(proxydb)
                    .await
                    .ok()?;
            if evidence > 0 {
                ambiguous += 1;
                continue;
            }
        }
        open += 1;
    }
    Some((open, ambiguous))
}

/// An open payout's record: id, account, state, claimed by, token stamp, rail outcome.
type OpenPayout = (
    String,
    String,
    String,
    Option<String>,
    Option<i64>,
    Option<String>,
);

/// Prints what a run that did not settle left open, so a failed run says why (CI keeps no logs):
/// each open payout's record, its workflow's status and pending work, the end of its history, and
/// every line the system's processes logged about it. Diagnosis only: it decides nothing.
pub async fn describe_unsettled(stack: &testkit::Stack, system: &System) {
    const PAYOUTS_SHOWN_MAX: usize = 8;
    let Ok(paydb) = super::one_connection(&system.databases.paydb).await else {
        eprintln!("[chaos] unsettled: paydb unreachable");
        return;
    };
    let rows: Vec<OpenPayout> = match sqlx::query_as(
        "SELECT id, account_id, state, claimed_by, token_stamp, rail_outcome FROM payout \
             WHERE state NOT IN ('POSTED', 'FAILED', 'ABANDONED') ORDER BY id",
    )
    .fetch_all(&paydb)
    .await
    {
        Ok(rows) => rows,
        Err(e) => {
            eprintln!("[chaos] unsettled: reading paydb: {e}");
            return;
        }
    };
    eprintln!("[chaos] unsettled: {} payouts open", rows.len());
    let logs: Vec<std::path::PathBuf> = std::fs::read_dir(&system.dir)
        .map(|dir| {
            dir.filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| p.extension().is_some_and(|x| x == "log"))
                .collect()
        })
        .unwrap_or_default();
    for (id, account, state, claimed_by, token, outcome) in rows.into_iter().take(PAYOUTS_SHOWN_MAX)
    {
        eprintln!(
            "[chaos] unsettled {id}: account {account}, {state}, claimed by {claimed_by:?}, \
             token {token:?}, rail outcome {outcome:?}"
        );
        let workflow = format!("payout-{id}");
        let temporal = stack.temporal();
        match tokio::task::block_in_place(|| {
            temporal.cli(&["workflow", "describe", "--workflow-id", &workflow])
        }) {
            Ok(out) => eprintln!("[chaos]   describe:\n{out}"),
            Err(e) => eprintln!("[chaos]   describe failed: {e}"),
        }
        match tokio::task::block_in_place(|| {
            temporal.cli(&["workflow", "show", "--workflow-id", &workflow])
        }) {
            Ok(out) => {
                let lines: Vec<&str> = out.lines().collect();
                let tail = &lines[lines.len().saturating_sub(30)..];
                eprintln!(
                    "[chaos]   history (last {} lines):\n{}",
                    tail.len(),
                    tail.join("\n")
                );
            }
            Err(e) => eprintln!("[chaos]   history failed: {e}"),
        }
        for log in &logs {
            let Ok(text) = std::fs::read_to_string(log) else {
                continue;
            };
            let lines: Vec<&str> = text.lines().filter(|l| l.contains(id.as_str())).collect();
            if lines.is_empty() {
                continue;
            }
            let tail = &lines[lines.len().saturating_sub(12)..];
            eprintln!(
                "[chaos]   {} ({} lines, last {}):\n{}",
                log.display(),
                lines.len(),
                tail.len(),
                tail.join("\n")
            );
        }
    }
}
