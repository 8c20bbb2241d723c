//! `payoutdev run`: the main job. Brings the stack and every service up, loads fixture accounts,
//! submits a batch of payouts through Temporal while the rail stub injects declines, timeouts
//! after acceptance and lost responses, waits until every payout has settled, drains the outbox,
//! runs the reconciler, and prints what happened.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::{Args as ClapArgs, Parser};
use payment_client::PaymentClient;
use payout_activities::types::{AmbiguityPolicy, PayoutInput};
use serde::Serialize;

use crate::stack::UpArgs;

#[derive(ClapArgs)]
pub struct Args {
    /// The local stack (started if it is not up), or an existing deployment by its endpoints.
    #[command(flatten)]
    pub target: payoutctl::target::Target,
    /// Payouts to submit.
    #[arg(long, default_value_t = 300)]
    pub payouts: usize,
    /// Accounts they are spread over (one payout in flight per account at a time).
    #[arg(long, default_value_t = 30)]
    pub accounts: usize,
    /// Share of payouts larger than their account can fund (they end FAILED, no rail call).
    #[arg(long, default_value_t = 0.05)]
    pub insufficient_rate: f64,
    /// The rail declines.
    #[arg(long, default_value_t = 0.05)]
    pub decline_rate: f64,
    /// The rail accepts, then never answers (the proxy times out: ambiguous, money moved).
    #[arg(long, default_value_t = 0.03)]
    pub timeout_after_accept_rate: f64,
    /// The rail accepts, then answers 5xx (ambiguous, money moved).
    #[arg(long, default_value_t = 0.02)]
    pub fail_after_accept_rate: f64,
    /// The response is lost before the rail acts: a 5xx or a reset connection (ambiguous, no money moved).
    #[arg(long, default_value_t = 0.03)]
    pub lost_response_rate: f64,
    /// Seed of the workload and of the rail's faults.
    #[arg(long, default_value_t = 7)]
    pub seed: u64,
    /// Workers, if the stack has to be started.
    #[arg(long, default_value_t = 2)]
    pub workers: usize,
    /// Give up waiting for the batch after this long.
    #[arg(long, default_value_t = 900)]
    pub timeout_s: u64,
    /// One JSON object instead of the readable summary.
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub funding: FundingArgs,
}

/// Who authorises the batch's opening balances: an account opens funded only under a registered
/// operator's signature (`grant_signing::operator::Funding`).
#[derive(ClapArgs, Clone, Debug, Default)]
pub struct FundingArgs {
    /// The operator's registered name (a deployment's; the local stack's is its own operator).
    #[arg(long = "funding-operator", env = "PAYOUT_OPERATOR_NAME")]
    pub operator: Option<String>,
    /// That operator's key file (`payoutctl keys operator`).
    #[arg(long = "funding-key-file", env = "PAYOUT_OPERATOR_KEY_FILE")]
    pub key_file: Option<std::path::PathBuf>,
}

impl FundingArgs {
    /// The operator who signs the fundings: the one given, or the local stack's own (registered
    /// with its payment resource by the stack).
    pub fn operator(
        &self,
        target: &payoutctl::target::Target,
    ) -> anyhow::Result<testkit::grants::OperatorKey> {
        match (&self.operator, &self.key_file) {
            (Some(name), Some(file)) => testkit::grants::OperatorKey::load(name, file),
            (None, None) if !target.is_external() => {
                testkit::grants::OperatorKey::in_dir(&target.state_dir.join("system"))
            }
            _ => anyhow::bail!(
                "a funded account is an operator's decision: give --funding-operator and --funding-key-file \
                 (PAYOUT_OPERATOR_NAME, PAYOUT_OPERATOR_KEY_FILE) of an operator the deployment's payment \
                 resource registers (PAYOUT_OPERATOR_KEYS)"
            ),
        }
    }
}

/// Workflow starts in flight at once: the frontend and the payment resource are local, and more
/// only queues inside the client.
pub(crate) const START_CONCURRENCY_MAX: usize = 32;
/// Opening balance per account, in minor units: enough for its share of the batch.
pub(crate) const OPENING_BALANCE_MINOR: i64 = 10_000_000;
/// The main job's payouts are 1.00 ..< 500.00 (EUR, minor units), to one of a thousand beneficiaries.
pub(crate) const AMOUNT_MAX_MINOR: i64 = 50_000;
pub(crate) const BENEFICIARIES: u32 = 1_000;

#[derive(Serialize)]
struct Summary {
    run_id: String,
    /// The build of the services this run measured (crate::profile).
    services: crate::profile::Services,
    payouts: usize,
    accounts: usize,
    final_states: BTreeMap<String, u64>,
    elapsed_s: f64,
    throughput_payouts_per_s: f64,
    latency_ms_p50: f64,
    latency_ms_p99: f64,
    latency_ms_max: f64,
    rail_movements: u64,
    rail_movements_per_payout_max: u64,
    ambiguous_resolved_by_evidence: u64,
    ledger_balanced: bool,
    gl_matches_paydb: bool,
    reconciliation_violations: usize,
    temporal_ui: String,
    workflow_ids_look_like: String,
    /// The local stack's alerting at the end of the run (none for an external deployment):
    /// whether its path works, and what fires. A dark path fails the run.
    alerting: Option<crate::stack::AlertingReport>,
}

#[derive(Parser)]
struct UpOnly {
    #[command(flatten)]
    up: UpArgs,
}

/// Makes sure the local stack and the services are up (starting them if not), unless the run
/// targets an existing deployment; then resolves every endpoint.
pub(crate) async fn ensure_up(
    target: &payoutctl::target::Target,
    workers: usize,
) -> anyhow::Result<payoutctl::target::Resolved> {
    if target.is_external() {
        return target.resolve();
    }
    // `up` asks each part's health and starts only what does not answer (nothing, when the
    // stack is up).
    let workers = workers.to_string();
    let state = target.state_dir.display().to_string();
    let up = UpOnly::parse_from(["payoutdev", "--workers", &workers, "--state-dir", &state]).up;
    crate::stack::up_quiet(up).await?;
    target.resolve()
}

pub async fn run(args: Args) -> anyhow::Result<std::process::ExitCode> {
    anyhow::ensure!(
        args.payouts > 0 && args.accounts > 0,
        "--payouts and --accounts must be positive"
    );
    let rates = [
        args.decline_rate,
        args.timeout_after_accept_rate,
        args.fail_after_accept_rate,
        args.lost_response_rate,
    ];
    anyhow::ensure!(
        rates.iter().all(|r| (0.0..=1.0).contains(r)),
        "fault rates are probabilities in [0, 1]"
    );
    anyhow::ensure!(
        rates.iter().sum::<f64>() <= 1.0,
        "the rail's fault rates must sum to at most 1"
    );
    let say = |line: String| {
        if !args.json {
            println!("{line}");
        }
    };
    let system = ensure_up(&args.target, args.workers).await?;
    let services = crate::profile::check(&args.target)?;
    say(format!("system up; Temporal UI {}", system.ui_url));

    // The rail misbehaves as asked, reproducibly.
    let stub = rail_admin(&system)?;
    let half = args.lost_response_rate / 2.0;
    stub.set_faults(&rail_stub::FaultConfig {
        seed: args.seed,
        latency_ms_min: 0,
        latency_ms_max: 20,
        decline_rate: args.decline_rate,
        accept_then_hang_rate: args.timeout_after_accept_rate,
        accept_then_fail_rate: args.fail_after_accept_rate,
        fail_before_acting_rate: half,
        reset_before_acting_rate: half,
        ..rail_stub::FaultConfig::default()
    })
    .await
    .map_err(|e| anyhow::anyhow!("configuring the rail stub's faults: {e}"))?;

    // Fixture accounts and the payouts, created in the payment resource before any workflow.
    let run_id = run_id()?;
    let payments = PaymentClient::connect(&system.payment_url, &system.tls(mtls::Role::Fixture)?)
        .await
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    let workload = Workload {
        run_id: run_id.clone(),
        payouts: args.payouts,
        accounts: args.accounts,
        opening_balance_minor: OPENING_BALANCE_MINOR,
        insufficient_rate: args.insufficient_rate,
        amount_max_minor: AMOUNT_MAX_MINOR,
        beneficiaries: BENEFICIARIES,
        seed: args.seed,
        ambiguity: AmbiguityPolicy {
            // A little past the stub's window, so the first lookup after it is authoritative.
            settlement_window_ms: system.settlement_window_ms + 500,
            resolution_sla_ms: 120_000,
        },
        round_robin: false,
    };
    let operator = args.funding.operator(&args.target)?;
    let inputs = open_accounts(&workload, &payments, &operator).await?;
    say(format!(
        "{} accounts opened; submitting {} payouts (run {run_id})",
        args.accounts, args.payouts
    ));

    // Submit every payout (CreatePayout: its workflow starts by itself), then await each
    // result; the latency is submission to final state.
    let client = Arc::new(
        // The address is the target's; the namespace, TLS and API key come from the Temporal
        // environment or profile as for every process (a deployment elsewhere, Temporal Cloud),
        // the namespace `default` when nothing names one (the local stack's).
        payout_workflows::client::connect_configured(&system.temporal_args(), "payoutdev")
            .await
            .map_err(|e| anyhow::anyhow!("{e}"))?,
    );
    let timeout = Duration::from_secs(args.timeout_s);
    let progress = tokio::spawn(progress_lines(
        system.paydb.clone(),
        run_id.clone(),
        args.payouts,
        args.json,
    ));
    let measured = submit_payouts(
        client,
        &payments,
        inputs,
        (
            Starts::Staged {
                paydb: &system.paydb,
            },
            &system.task_queue,
        ),
        timeout,
    )
    .await?;
    progress.abort();
    let failures = &measured.failures;
    for f in failures.iter().take(10) {
        eprintln!("payout did not complete: {f}");
    }

    // Drain the outbox, then reconcile everything (the whole stack, not only this run).
    let paydb = sqlx::PgPool::connect(&system.paydb).await?;
    testkit::eventually(Duration::from_secs(120), "the outbox to drain", || async {
        let pending: i64 =
            sqlx::query_scalar("SELECT count(*) FROM ledger_outbox WHERE delivered_at IS NULL")
                .fetch_one(&paydb)
                .await
                .ok()?;
        (pending == 0).then_some(())
    })
    .await?;
    let sources = payoutctl::reconcile::sources(&system).await?;
    let report = reconciler::reconcile(
        &sources,
        &reconciler::Options {
            require_outbox_drained: true,
            ..Default::default()
        },
    )
    .await?;

    let mut final_states = BTreeMap::new();
    for row in sqlx::query_as::<_, (String, i64)>(
        "SELECT state, count(*) FROM payout WHERE id LIKE $1 GROUP BY state",
    )
    .bind(format!("{run_id}-p-%"))
    .fetch_all(&paydb)
    .await?
    {
        final_states.insert(row.0, row.1 as u64);
    }
    let truth = stub
        .ground_truth()
        .await
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    let prefix = format!("cref-{run_id}-p-");
    let run_counts: Vec<u64> = truth
        .movement_counts
        .iter()
        .filter(|(k, _)| k.starts_with(&prefix))
        .map(|(_, v)| *v)
        .collect();
    let ambiguous_resolved: i64 = sqlx::query_scalar(
        "SELECT count(DISTINCT payout_id) FROM audit_event WHERE kind = 'transition' \
         AND event IN ('EVIDENCE_FOUND', 'EVIDENCE_ABSENT') AND payout_id LIKE $1",
    )
    .bind(format!("{run_id}-p-%"))
    .fetch_one(&paydb)
    .await?;
    let check_clean = |name: &str| {
        report
            .checks
            .iter()
            .find(|c| c.name == name)
            .is_some_and(|c| c.violations.is_empty())
    };
    // The stack's alerting as it stands at the end: a dark path (no rule loaded, a target not
    // scraped) is what once left every alert of the local stack silent while runs passed.
    let alerting = if args.target.is_external() {
        None
    } else {
        Some(crate::stack::settled_alerting_report(&args.target.state_dir).await?)
    };
    let summary = Summary {
        run_id: run_id.clone(),
        services,
        payouts: args.payouts,
        accounts: args.accounts,
        final_states,
        elapsed_s: measured.elapsed.as_secs_f64(),
        throughput_payouts_per_s: measured.throughput(),
        latency_ms_p50: measured.percentile_ms(0.50),
        latency_ms_p99: measured.percentile_ms(0.99),
        latency_ms_max: measured.percentile_ms(1.0),
        rail_movements: run_counts.iter().sum(),
        rail_movements_per_payout_max: run_counts.iter().copied().max().unwrap_or(0),
        ambiguous_resolved_by_evidence: ambiguous_resolved as u64,
        ledger_balanced: check_clean("ledger_balanced") && check_clean("postings_match_payouts"),
        gl_matches_paydb: check_clean("gl_matches_paydb"),
        reconciliation_violations: report.violations,
        temporal_ui: system.ui_url.clone(),
        workflow_ids_look_like: format!("payout-{run_id}-p-00000"),
        alerting,
    };
    if args.json {
        println!("{}", serde_json::to_string(&summary)?);
    } else {
        println!();
        print!("{}", report.render());
        println!();
        println!(
            "run {run_id}: {} payouts over {} accounts in {:.1}s",
            summary.payouts, summary.accounts, summary.elapsed_s
        );
        let states: Vec<String> = summary
            .final_states
            .iter()
            .map(|(s, n)| format!("{s} {n}"))
            .collect();
        println!("final states: {}", states.join(", "));
        println!("{}", summary.services);
        println!(
            "throughput {:.1} payouts/s; latency submission to final state p50 {:.0} ms, p99 {:.0} ms, max {:.0} ms",
            summary.throughput_payouts_per_s, summary.latency_ms_p50, summary.latency_ms_p99, summary.latency_ms_max
        );
        println!(
            "rail movements {} (at most {} per payout); ambiguous payouts resolved by evidence {}",
            summary.rail_movements,
            summary.rail_movements_per_payout_max,
            summary.ambiguous_resolved_by_evidence
        );
        println!(
            "ledger balanced: {}; GL matches paydb: {}; reconciliation violations: {}",
            summary.ledger_balanced, summary.gl_matches_paydb, summary.reconciliation_violations
        );
        match &summary.alerting {
            Some(alerting) => println!("{}", alerting.render()),
            None => println!("alerting: not read (an external deployment's monitoring is its own)"),
        }
        println!(
            "inspect every payout in the Temporal UI: {} (workflow ids like {})",
            summary.temporal_ui, summary.workflow_ids_look_like
        );
    }
    let alerting_works = summary.alerting.as_ref().is_none_or(|a| a.dark.is_empty());
    let ok = failures.is_empty()
        && report.is_clean()
        && summary.rail_movements_per_payout_max <= 1
        && alerting_works;
    Ok(if ok {
        std::process::ExitCode::SUCCESS
    } else {
        std::process::ExitCode::FAILURE
    })
}

/// A line a second: how many of this run's payouts are in each state.
async fn progress_lines(paydb_url: String, run_id: String, total: usize, quiet: bool) {
    let Ok(pool) = sqlx::PgPool::connect(&paydb_url).await else {
        return;
    };
    let started = Instant::now();
    loop {
        tokio::time::sleep(Duration::from_secs(1)).await;
        let Ok(rows) = sqlx::query_as::<_, (String, i64)>(
            "SELECT state, count(*) FROM payout WHERE id LIKE $1 GROUP BY state ORDER BY state",
        )
        .bind(format!("{run_id}-p-%"))
        .fetch_all(&pool)
        .await
        else {
            continue;
        };
        let terminal: i64 = rows
            .iter()
            .filter(|(s, _)| matches!(s.as_str(), "POSTED" | "FAILED" | "ABANDONED"))
            .map(|(_, n)| n)
            .sum();
        if !quiet {
            let states: Vec<String> = rows.iter().map(|(s, n)| format!("{s} {n}")).collect();
            println!(
                "[{:>4}s] {terminal}/{total} settled | {}",
                started.elapsed().as_secs(),
                states.join(", ")
            );
        }
    }
}

/// The run's name: every account and payout id of the run starts with it.
pub(crate) fn run_id() -> anyhow::Result<String> {
    Ok(format!(
        "r{}",
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)?
            .as_millis()
    ))
}

/// The main job's and the benchmarks' batches (the one builder: `system_tests::workload`).
pub(crate) use system_tests::workload::Batch as Workload;

/// A batch's timing: each item's latency from its start to its end, and the batch's wall time.
pub(crate) struct Measured {
    pub latencies: Vec<Duration>,
    pub failures: Vec<String>,
    pub elapsed: Duration,
}

impl Measured {
    /// The `p` quantile of the latencies, in milliseconds (nearest rank).
    pub fn percentile_ms(&self, p: f64) -> f64 {
        let mut sorted = self.latencies.clone();
        sorted.sort();
        if sorted.is_empty() {
            return 0.0;
        }
        let i = ((sorted.len() as f64 * p).ceil() as usize).clamp(1, sorted.len()) - 1;
        sorted[i].as_secs_f64() * 1000.0
    }

    pub fn throughput(&self) -> f64 {
        self.latencies.len() as f64 / self.elapsed.as_secs_f64()
    }
}

/// Runs `one(input)` for every input at once (each starts its workflow and awaits its result)
/// and times each from its start.
pub(crate) async fn measure<I, F, Fut>(inputs: Vec<I>, one: F) -> anyhow::Result<Measured>
where
    F: Fn(I) -> Fut,
    Fut: std::future::Future<Output = anyhow::Result<()>> + Send + 'static,
{
    let started = Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    for input in inputs {
        let work = one(input);
        tasks.spawn(async move {
            let t0 = Instant::now();
            work.await.map(|()| t0.elapsed())
        });
    }
    let mut latencies = Vec::new();
    let mut failures = Vec::new();
    while let Some(joined) = tasks.join_next().await {
        match joined? {
            Ok(latency) => latencies.push(latency),
            Err(e) => failures.push(e.to_string()),
        }
    }
    Ok(Measured {
        latencies,
        failures,
        elapsed: started.elapsed(),
    })
}

/// Starts each payout's workflow (at most [`START_CONCURRENCY_MAX`] starts in flight) and awaits
/// its result.
pub(crate) async fn run_payouts(
    client: Arc<temporalio_client::Client>,
    task_queue: &str,
    inputs: Vec<PayoutInput>,
    timeout: Duration,
) -> anyhow::Result<Measured> {
    let semaphore = Arc::new(tokio::sync::Semaphore::new(START_CONCURRENCY_MAX));
    measure(inputs, |input| {
        let client = client.clone();
        let semaphore = semaphore.clone();
        let queue = task_queue.to_string();
        async move {
            let permit = semaphore.acquire_owned().await.expect("semaphore open");
            let id = match payout_workflows::client::start_payout(&client, &queue, &input).await {
                // Started already (by the dispatcher's starter, or a retry): the same workflow.
                Ok(id)
                | Err(payout_workflows::client::PayoutClientError::AlreadyStarted {
                    workflow_id: id,
                }) => id,
                Err(e) => anyhow::bail!("starting {}: {e}", input.payout_id),
            };
            drop(permit);
            payout_workflows::client::wait_result(&client, &id, timeout)
                .await
                .map_err(|e| anyhow::anyhow!("{id}: {e}"))?;
            Ok(())
        }
    })
    .await
}

/// Opens the batch's fixture accounts; its payouts are not created yet (their submission is
/// what is measured).
pub(crate) async fn open_accounts(
    workload: &Workload,
    payments: &PaymentClient,
    operator: &testkit::grants::OperatorKey,
) -> anyhow::Result<Vec<PayoutInput>> {
    let (accounts, inputs) = workload.build()?;
    let eur = payout_domain::Currency::parse("EUR").expect("supported");
    for id in &accounts {
        operator
            .open_account(payments, id, &eur, workload.opening_balance_minor)
            .await
            .map_err(|e| anyhow::anyhow!("open account {id}: {e}"))?;
    }
    Ok(inputs)
}

/// Who starts a submitted payout's workflow.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Starts<'a> {
    /// CreatePayout alone: the dispatcher's starter delivers the start it staged. The waiter
    /// learns that the workflow exists from paydb (`paydb`, a URL that may read
    /// `workflow_start`), where the starter marks each start once Temporal has answered.
    Staged { paydb: &'a str },
    /// CreatePayout, then the caller starts the workflow itself at once, as integrators did
    /// before the starter ("already started" is success): the before figure.
    Caller,
}

/// Pause between two looks at paydb for the starts the starter has delivered.
const START_WATCH_MS: u64 = 20;
/// Pause before asking Temporal again for a workflow paydb says was started but Temporal did not
/// find (not expected: the row is marked after Temporal's answer).
const START_POLL_MS: u64 = 50;

/// Which submitted payouts' workflows the starter has started, learnt by one query of paydb's
/// `workflow_start` every [`START_WATCH_MS`] for all the payouts still waiting. Before, every
/// waiter asked Temporal for its workflow every 10 ms until it existed: in a burst of 600 whose
/// starts waited seconds, tens of thousands of NotFound lookups (36,882 history polls in one
/// `bench e2e` system run, against 600 for the floor), which loaded the dev server the benchmark
/// was measuring.
struct StartWatch {
    waiting: std::sync::Mutex<std::collections::HashSet<String>>,
    started: std::sync::Mutex<std::collections::HashSet<String>>,
    changed: tokio::sync::Notify,
}

impl StartWatch {
    fn new() -> Arc<Self> {
        Arc::new(Self {
            waiting: Default::default(),
            started: Default::default(),
            changed: tokio::sync::Notify::new(),
        })
    }

    /// Looks at paydb until dropped (the caller aborts the task).
    async fn watch(self: Arc<Self>, paydb: String) {
        let pool = match sqlx::postgres::PgPoolOptions::new()
            .max_connections(1)
            .connect(&paydb)
            .await
        {
            Ok(pool) => pool,
            Err(e) => {
                tracing::warn!(error = %e, "start watch: paydb not reachable; waiters time out");
                return;
            }
        };
        loop {
            let waiting: Vec<String> = self.waiting.lock().unwrap().iter().cloned().collect();
            if !waiting.is_empty() {
                match sqlx::query_scalar::<_, String>(
                    "SELECT payout_id FROM workflow_start WHERE payout_id = ANY($1) AND started_at IS NOT NULL",
                )
                .bind(&waiting)
                .fetch_all(&pool)
                .await
                {
                    Ok(started) if !started.is_empty() => {
                        let mut waiting = self.waiting.lock().unwrap();
                        let mut done = self.started.lock().unwrap();
                        for id in started {
                            waiting.remove(&id);
                            done.insert(id);
                        }
                        drop((waiting, done));
                        self.changed.notify_waiters();
                    }
                    Ok(_) => {}
                    Err(e) => tracing::warn!(error = %e, "start watch: query failed; retrying"),
                }
            }
            tokio::time::sleep(Duration::from_millis(START_WATCH_MS)).await;
        }
    }

    /// Returns once `payout_id`'s start is marked, or false at `deadline`.
    async fn started(&self, payout_id: &str, deadline: Instant) -> bool {
        self.waiting.lock().unwrap().insert(payout_id.to_string());
        loop {
            let changed = self.changed.notified();
            if self.started.lock().unwrap().remove(payout_id) {
                return true;
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if tokio::time::timeout(left, changed).await.is_err() {
                self.waiting.lock().unwrap().remove(payout_id);
                return false;
            }
        }
    }
}

/// Submits each payout (at most [`START_CONCURRENCY_MAX`] submissions in flight): one
/// CreatePayout, then (`Starts::Caller`) the caller's own start; then awaits the workflow's
/// result. Each latency runs from the CreatePayout call to the final state.
pub(crate) async fn submit_payouts(
    client: Arc<temporalio_client::Client>,
    payments: &PaymentClient,
    inputs: Vec<PayoutInput>,
    (starts, task_queue): (Starts<'_>, &str),
    timeout: Duration,
) -> anyhow::Result<Measured> {
    let semaphore = Arc::new(tokio::sync::Semaphore::new(START_CONCURRENCY_MAX));
    let queue = task_queue.to_string();
    let watch = StartWatch::new();
    let watching = match starts {
        Starts::Staged { paydb } => Some(payout_worker::AbortOnDrop(tokio::spawn(
            watch.clone().watch(paydb.to_string()),
        ))),
        Starts::Caller => None,
    };
    let caller_starts = starts == Starts::Caller;
    let measured = measure(inputs, |input| {
        let client = client.clone();
        let payments = payments.clone();
        let semaphore = semaphore.clone();
        let queue = queue.clone();
        let watch = watch.clone();
        async move {
            let deadline = Instant::now() + timeout;
            let permit = semaphore.acquire_owned().await.expect("semaphore open");
            payments
                .create_payout(&system_tests::workload::new_payout(&input))
                .await
                .map_err(|e| anyhow::anyhow!("create payout {}: {e}", input.payout_id))?;
            if caller_starts {
                match payout_workflows::client::start_payout(&client, &queue, &input).await {
                    Ok(_)
                    | Err(payout_workflows::client::PayoutClientError::AlreadyStarted { .. }) => {}
                    Err(e) => anyhow::bail!("starting {}: {e}", input.payout_id),
                }
                drop(permit);
            } else {
                drop(permit);
                if !watch.started(input.payout_id.as_str(), deadline).await {
                    anyhow::bail!(
                        "{}: the starter did not start its workflow within {timeout:?}",
                        input.payout_id
                    );
                }
            }
            let id = payout_domain::workflow_id(&input.payout_id);
            loop {
                let left = deadline.saturating_duration_since(Instant::now());
                match payout_workflows::client::wait_result(&client, &id, left).await {
                    Ok(_) => return Ok(()),
                    Err(payout_workflows::client::PayoutClientError::Result {
                        source: temporalio_client::errors::WorkflowGetResultError::NotFound(_),
                        ..
                    }) if !left.is_zero() => {
                        tokio::time::sleep(Duration::from_millis(START_POLL_MS)).await;
                    }
                    Err(e) => anyhow::bail!("{id}: {e}"),
                }
            }
        }
    })
    .await;
    drop(watching);
    measured
}

/// The harness's client of the rail stub's admin API (ground truth, faults) of `system`.
pub(crate) fn rail_admin(
    system: &payoutctl::target::Resolved,
) -> anyhow::Result<rail_stub::client::StubClient> {
    use anyhow::Context;
    let tls = system
        .rail_tls
        .as_ref()
        .context("the harness's certificate of the rail (--rail-ca, --rail-cert, --rail-key)")?;
    Ok(rail_stub::client::StubClient::admin(
        system.rail_url.clone(),
        tls,
    )?)
}
