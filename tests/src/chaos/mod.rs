//! The chaos harness: the whole system under a nemesis, then an independent checker.
//!
//! [`run`] starts every service over a stack (3-member etcd, two PostgreSQL servers, Temporal),
//! creates a contended workload, starts the payouts through Temporal while the [`nemesis`]
//! injects its seeded schedule, waits (bounded) for every payout to settle and the outbox to
//! drain, and hands the databases and the rail's book to the [`checker`], which knows nothing of
//! the code under test. [`negative`] holds the negative controls.

pub mod answer_loss;
pub mod checker;
pub mod clock;
pub mod disk;
pub mod guards;
pub mod linearizable;
pub mod negative;
pub mod nemesis;
pub mod rolling;
pub mod rollout;
pub mod temporal;
pub mod workload;

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use serde::Serialize;
use testkit::system::{System, SystemOptions};
use testkit::Stack;

pub use checker::{CheckResult, Evidence, Revoke, Violation};
pub use guards::DisableGuard;

/// Workers hold leases this long, so a SIGSTOP of a few seconds outlives the lease.
pub const WORKER_LOCK_TTL_MS: u64 = 3_000;
/// The proxy gives up on the rail after this: long enough for the slow tail, short enough that
/// accept-then-hang turns ambiguous quickly.
pub const RAIL_TIMEOUT_MS: u64 = 2_000;
/// Payouts open at once by default: the CI-sized runs start everything at once; a long run is
/// paced, as a batch upstream would be (two workers settle a few payouts a second).
pub const OPEN_PAYOUTS_MAX: usize = 400;
/// How long a run waits for every payout to settle after the faults stopped (see
/// `ChaosConfig::new`).
pub const SETTLE_TIMEOUT_S: u64 = 600;
/// The fault window's length per fault (`ChaosConfig::new`).
pub const FAULT_SPACING_MS: u64 = 3_000;
/// After this the rail's lookups are authoritative.
pub const SETTLEMENT_WINDOW_MS: u64 = 1_000;

#[derive(Debug, Clone)]
pub struct ChaosConfig {
    pub seed: u64,
    pub payouts: usize,
    /// Accounts; several payouts per account give contention on each lock key.
    pub accounts: usize,
    pub faults: usize,
    pub workers: usize,
    pub disable: DisableGuard,
    /// The faults are spread over this long (starting when the payouts start).
    pub fault_window: Duration,
    /// After the faults stop, give the system this long to settle.
    pub settle_timeout: Duration,
    /// Print progress (the schedule, fault by fault) on stderr.
    pub verbose: bool,
    /// Run each worker on its own network host (a network namespace) so the nemesis can cut it
    /// off from the lock-server alone. Where this machine does not allow namespaces the run goes
    /// on without partitions and the report says why.
    pub partitions: bool,
    /// Only these fault kinds (all when `None`): a targeted run, e.g. stale holders alone for
    /// the negative controls.
    pub kinds: Option<Vec<nemesis::FaultKind>>,
    /// Negative control of INV-04's alarm: restores without the procedure also lose the
    /// lock-server's issued-token record (as RESTORE.md forbids), so nothing refuses the rewound
    /// tokens. Test-only: the checker must then report the missed alarm.
    pub lose_issued_tokens_on_restore: bool,
    /// At most this many payouts started and not yet settled at a time.
    pub open_payouts_max: usize,
    /// The payouts' starts are spread evenly over this long (`None`: the fault window), so the
    /// faults land on work in flight: started all at once, a CI-sized batch had settled after
    /// 37 s of an 80 s window, and every later fault (the planted stale holders among them, which
    /// need a payout to reach its step) met an idle system.
    pub start_spread: Option<Duration>,
    /// The rail misbehaves from the start (its seeded fault mix: declines, failures, resets,
    /// hangs). Test-only `false`: a control whose claim is about the guards alone (the planted
    /// holders' per-guard answers) keeps the rail honest, so a stale Submit the unguarded proxy
    /// passes is paid, never declined or lost by the rail's own dice.
    pub rail_faults: bool,
    /// Run the reconciler service beside the system, as a deployment does (`reconciler serve`:
    /// its keeper and its resume of stranded payouts). Test-only `false`: the control that shows
    /// a run after Temporal's amnesia does not settle without it.
    pub reconciler: bool,
    /// Negative control of `upgrade_rollout`: the old build's workers are stopped as soon as the
    /// new build is current, without the drain. Test-only: payouts pinned to the old build are
    /// then left on a build no worker runs, and the run must not settle.
    pub rollout_without_drain: bool,
}

impl ChaosConfig {
    /// A run of `payouts` payouts and `faults` faults with defaults derived from them.
    pub fn new(seed: u64, payouts: usize, faults: usize) -> Self {
        Self {
            seed,
            payouts,
            accounts: (payouts / 4).max(2),
            faults,
            workers: 2,
            disable: DisableGuard::None,
            // About three seconds per fault: each fault takes one to several seconds to inject
            // and heal (Temporal's restarts and its old copy's age the longest), and the faults
            // run one after another; a shorter window had the nemesis fall behind the schedule
            // and its last faults meet a system whose payouts had all settled.
            fault_window: Duration::from_millis((faults as u64 * FAULT_SPACING_MS).max(10_000)),
            // A bound, not an expectation: unloaded, a CI-sized run settles in under a minute;
            // with a build sharing the two cores, contended accounts (whose waiting payouts
            // poll for the key) take several times as long. Nothing is judged before settling.
            settle_timeout: Duration::from_secs(SETTLE_TIMEOUT_S),
            verbose: false,
            partitions: true,
            kinds: None,
            lose_issued_tokens_on_restore: false,
            open_payouts_max: OPEN_PAYOUTS_MAX,
            start_spread: None,
            rail_faults: true,
            reconciler: true,
            rollout_without_drain: false,
        }
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct Report {
    pub seed: u64,
    pub payouts: usize,
    pub accounts: usize,
    pub guards_disabled: String,
    pub final_states: BTreeMap<String, u64>,
    pub faults_scheduled: usize,
    pub faults_injected_by_kind: BTreeMap<String, u64>,
    pub fault_errors: Vec<String>,
    pub schedule: Vec<String>,
    /// Why there were no network partitions, if there were none.
    pub partitions_unavailable: Option<String>,
    /// Why there were no clock jumps (no libfaketime here), if there were none.
    pub clocks_unavailable: Option<String>,
    /// Why there were no full disks (no capped volumes on this stack), if there were none.
    pub disks_unavailable: Option<String>,
    pub safety_events: BTreeMap<String, i64>,
    /// The hard cases the run reached, each with its count (`Evidence::reached` and the INV-04
    /// alarm's refusals): a zero is a case every check passed vacuously.
    pub reached: BTreeMap<String, u64>,
    /// Stale holders planted in the running system (which worker, which payout, which step).
    pub stale_holders: Vec<nemesis::Plant>,
    /// Each time Temporal lost its state: what was open then.
    pub amnesias: Vec<temporal::Amnesia>,
    /// Each worker-versioning rollout (`upgrade_rollout`).
    pub rollouts: Vec<rollout::Rollout>,
    /// Each lost-answer fault (`answer_loss`).
    pub answer_losses: Vec<answer_loss::AnswerLoss>,
    pub rail_movements: u64,
    pub checks: Vec<CheckResult>,
    pub violations: usize,
    pub settled: bool,
    pub settle_time_s: f64,
    pub fault_phase_s: f64,
    pub wall_time_s: f64,
}

impl Report {
    pub fn is_clean(&self) -> bool {
        self.violations == 0
    }

    pub fn render(&self) -> String {
        use std::fmt::Write;
        let mut s = String::new();
        let _ = writeln!(
            s,
            "chaos run: seed {} | {} payouts over {} accounts | guards disabled: {}",
            self.seed, self.payouts, self.accounts, self.guards_disabled
        );
        let _ = writeln!(s, "final states: {}", counts(&self.final_states));
        let injected: u64 = self.faults_injected_by_kind.values().sum();
        let _ = writeln!(
            s,
            "faults injected {injected}/{}: {}",
            self.faults_scheduled,
            counts(&self.faults_injected_by_kind)
        );
        for e in &self.fault_errors {
            let _ = writeln!(s, "  fault error: {e}");
        }
        if let Some(why) = &self.partitions_unavailable {
            let _ = writeln!(s, "  no network partitions on this machine: {why}");
        }
        if let Some(why) = &self.clocks_unavailable {
            let _ = writeln!(s, "  no clock jumps on this machine: {why}");
        }
        if let Some(why) = &self.disks_unavailable {
            let _ = writeln!(s, "  no full disks on this stack: {why}");
        }
        let _ = writeln!(s, "safety events: {}", counts(&self.safety_events));
        let _ = writeln!(s, "reached: {}", counts(&self.reached));
        for p in &self.stale_holders {
            let _ = writeln!(
                s,
                "  stale holder: {} froze before {} of {} with token {} (made stale by {}); released after a successor's token {}; the guard answered: {}{}",
                p.worker,
                p.step,
                p.payout,
                p.token,
                p.method,
                p.successor_token.map_or("(none)".to_string(), |t| t.to_string()),
                p.answer.as_deref().unwrap_or("(no answer)"),
                p.problem.as_deref().map_or(String::new(), |e| format!(" [{e}]")),
            );
        }
        for a in &self.amnesias {
            let _ = writeln!(
                s,
                "  Temporal lost its state ({}): {} payouts open then",
                a.kind, a.open_payouts
            );
        }
        for r in &self.rollouts {
            let _ = writeln!(s, "  rollout: {}", r.describe());
        }
        for a in &self.answer_losses {
            let _ = writeln!(
                s,
                "  answers lost ({}{}): {} packets dropped, payouts {:?}",
                a.link,
                a.worker
                    .as_deref()
                    .map_or(String::new(), |w| format!(", {w}")),
                a.dropped_packets,
                a.payouts
            );
        }
        let _ = writeln!(s, "rail movements: {}", self.rail_movements);
        for c in &self.checks {
            let _ = writeln!(
                s,
                "  [{}] {} ({} checked){}",
                if c.violations.is_empty() {
                    "ok"
                } else {
                    "VIOLATED"
                },
                c.name,
                c.checked,
                if c.violations.is_empty() {
                    String::new()
                } else {
                    format!(": {} violations", c.violations.len())
                }
            );
            for v in c.violations.iter().take(5) {
                let _ = writeln!(s, "      {}", v.detail);
            }
        }
        let _ = writeln!(
            s,
            "violations: {} | settled: {} in {:.1}s after faults stopped | fault phase {:.1}s | wall {:.1}s",
            self.violations, self.settled, self.settle_time_s, self.fault_phase_s, self.wall_time_s
        );
        s
    }
}

/// `name count, name count, ...` in the map's order.
fn counts<V: std::fmt::Display>(map: &BTreeMap<String, V>) -> String {
    map.iter()
        .map(|(k, v)| format!("{k} {v}"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// A database the harness reads or pokes may be restarting (a fault); a step gives up on it
/// after this.
const HARNESS_DB_TIMEOUT: Duration = Duration::from_secs(10);

/// One connection for one step's SQL (a fault, the pacing of the workload), bounded by
/// [`HARNESS_DB_TIMEOUT`].
pub(crate) async fn one_connection(url: &str) -> anyhow::Result<sqlx::PgPool> {
    Ok(sqlx::postgres::PgPoolOptions::new()
        .max_connections(1)
        .acquire_timeout(HARNESS_DB_TIMEOUT)
        .connect(url)
        .await?)
}

/// A fault that needs payouts in flight waits at most this long for one (a bound: in a run's
/// fault window payouts are in flight nearly always; after the workload has settled, none will
/// come).
const IN_FLIGHT_WAIT: Duration = Duration::from_secs(15);

/// Waits until paydb shows a payout claimed and not finished (a workflow is driving it now, so
/// a fault lands on work that matters), at most [`IN_FLIGHT_WAIT`]: how many there were then,
/// `None` if none came.
pub(crate) async fn payouts_in_flight(system: &System) -> Option<i64> {
    let paydb = one_connection(&system.databases.paydb).await.ok()?;
    let seen = testkit::eventually(IN_FLIGHT_WAIT, "a payout in flight", || async {
        let n: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM payout WHERE state IN ('CLAIMED', 'RAIL_SUBMITTED', 'RAIL_ACKED')",
        )
        .fetch_one(&paydb)
        .await
        .ok()?;
        (n > 0).then_some(n)
    })
    .await
    .ok();
    testkit::util::close_pool(paydb).await;
    seen
}

pub(crate) fn say(verbose: bool, line: impl AsRef<str>) {
    if verbose {
        eprintln!("[chaos] {}", line.as_ref());
    }
}

/// One whole run over `stack` (which should have a 3-member etcd cluster and be this run's
/// alone: the nemesis restarts its PostgreSQL servers and etcd members).
pub async fn run(stack: &Stack, config: &ChaosConfig) -> anyhow::Result<Report> {
    anyhow::ensure!(
        config.payouts > 0 && config.accounts > 0,
        "payouts and accounts must be positive"
    );
    let wall = Instant::now();
    let mut system = System::start(
        stack,
        SystemOptions {
            workers: 0,
            settlement_window_ms: SETTLEMENT_WINDOW_MS,
            rail_timeout_ms: RAIL_TIMEOUT_MS,
            worker_env: vec![("PAYOUT_LOCK_TTL_MS".into(), WORKER_LOCK_TTL_MS.to_string())],
            // The nemesis plants stale holders through the test worker's stall points.
            test_worker: true,
            // The nemesis steps the wall clocks of the workers and the three fenced services.
            movable_clocks: true,
            ..SystemOptions::default()
        },
    )
    .await?;
    let partitions_unavailable = if config.partitions {
        tokio::task::block_in_place(testkit::netns::NetNs::available).err()
    } else {
        Some("disabled for this run".to_string())
    };
    // Before the workers start: they connect to the guards once at start-up.
    let in_process = guards::replace_services(&mut system, config.disable).await?;
    let stall_dir = system.dir.join("stall-points");
    std::fs::create_dir_all(&stall_dir)?;
    // The workers are versioned from the start (routing on, the first build current), as a
    // deployment that rolls out by worker versioning runs them (`rollout`).
    let deployment = rollout::Deployment::new(&system, config.workers);
    let mut partitions = Vec::new();
    for slot in 0..config.workers {
        let (worker, ns) = deployment.start_worker(
            &system,
            deployment.current_generation(),
            slot,
            &stall_dir,
            partitions_unavailable.is_none(),
        )?;
        system.workers.push(worker);
        partitions.push(ns);
    }
    if config.workers > 0 {
        deployment
            .make_first_current(stack, &system.workers)
            .await?;
    }
    let start_spread = config.start_spread.unwrap_or(config.fault_window);
    let reconciler = if config.reconciler {
        Some(temporal::Reconciler::start(&system, start_spread)?)
    } else {
        None
    };
    say(
        config.verbose,
        format!(
            "system up in {:.1}s (logs in {})",
            wall.elapsed().as_secs_f64(),
            system.dir.display()
        ),
    );

    let clocks_unavailable = system.clocks_unmovable().map(str::to_string);
    let disks_unavailable = stack.volumes_unavailable.clone();
    // Without libfaketime the clock jumps are left out of the schedule, as partitions are; and
    // without capped volumes, the full disks.
    let kinds: Option<Vec<nemesis::FaultKind>> = if clocks_unavailable.is_none()
        && disks_unavailable.is_none()
    {
        config.kinds.clone()
    } else {
        Some(
            config
                .kinds
                .clone()
                .unwrap_or_else(|| nemesis::FaultKind::ALL.to_vec())
                .into_iter()
                .filter(|k| !(clocks_unavailable.is_some() && *k == nemesis::FaultKind::ClockJump))
                .filter(|k| !(disks_unavailable.is_some() && nemesis::FaultKind::DISK.contains(k)))
                .collect(),
        )
    };
    if let Some(kinds) = &kinds {
        anyhow::ensure!(
            !kinds.is_empty(),
            "no fault kind left to run: clocks: {clocks_unavailable:?}; disks: {disks_unavailable:?}"
        );
    }
    let schedule = nemesis::Schedule::generate(
        config.seed,
        config.faults,
        config.fault_window,
        config.workers,
        config.disable,
        partitions_unavailable.is_none(),
        kinds.as_deref(),
    );
    for line in schedule.describe() {
        say(config.verbose, format!("schedule: {line}"));
    }
    let work = workload::Workload::create(&system, config).await?;
    say(
        config.verbose,
        format!(
            "{} payouts created over {} accounts",
            work.inputs.len(),
            config.accounts
        ),
    );

    let mut targets = nemesis::Targets {
        work: &work,
        partitions: &mut partitions,
        stall_dir: &stall_dir,
        lose_issued_tokens: config.lose_issued_tokens_on_restore,
        disable: config.disable,
        reconciler: reconciler.as_ref(),
        deployment: &deployment,
        rollout_without_drain: config.rollout_without_drain,
    };
    let fault_start = Instant::now();
    let (begun, pace) = tokio::sync::watch::channel(0usize);
    let pace = workload::Pace {
        begun: pace,
        faults: schedule.faults.len(),
    };
    // The nemesis may replace the workers (a rollout); the starts need only these.
    let starts = workload::Starts::of(&system);
    let (started, outcome) = tokio::join!(
        work.start_all(&starts, config.open_payouts_max, start_spread, Some(pace)),
        nemesis::execute(
            stack,
            &mut system,
            &schedule,
            &mut targets,
            config.disable,
            config.verbose,
            Some(begun),
        ),
    );
    started?;
    // Whatever the nemesis left paused resumes; the rail behaves from now on.
    for w in &system.workers {
        let _ = w.resume();
    }
    work.calm_rail(&system).await;
    let fault_phase = fault_start.elapsed();
    say(
        config.verbose,
        format!(
            "faults stopped after {:.1}s; waiting for the system to settle",
            fault_phase.as_secs_f64()
        ),
    );

    let settle_start = Instant::now();
    let settled = {
        let supervisor = async {
            loop {
                tokio::task::block_in_place(|| {
                    nemesis::supervise(
                        &system,
                        &targets.more_processes(stack),
                        config.disable,
                        config.verbose,
                    )
                });
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
        };
        tokio::select! {
            settled = workload::wait_settled(&system, config.settle_timeout, config.verbose) => settled,
            () = supervisor => unreachable!("the supervisor loops forever"),
        }
    };
    let settle_time = settle_start.elapsed();
    if !settled {
        workload::describe_unsettled(stack, &system).await;
    }

    let mut evidence = Evidence::collect(&system).await?;
    evidence.revokes.extend(outcome.revokes.iter().cloned());
    evidence.restores = outcome.restores.clone();
    evidence.lock_ttl_ns = WORKER_LOCK_TTL_MS * 1_000_000;
    let mut checks = checker::check(&evidence);
    let mut safety_events = evidence.safety_events();
    safety_events.insert(
        "lock_token_regression_alarms".into(),
        outcome.regression_alarms_fired as i64,
    );
    safety_events.insert(
        "outbox_rows_delivered_twice".into(),
        outcome.outbox_rows_redelivered as i64,
    );
    safety_events.insert(
        "operator_force_revokes".into(),
        outcome.revokes.len() as i64,
    );
    checks.push(checker::result(
        "restore_without_procedure_alarm_fires",
        outcome.regression_alarms_fired as usize + outcome.regression_alarms_missed.len(),
        outcome.regression_alarms_missed.clone(),
    ));
    let mut reached = evidence.reached();
    reached.insert(
        checker::REACHED_TOKEN_REGRESSION.to_string(),
        outcome.regression_alarms_fired,
    );
    reached.insert(
        checker::REACHED_RECOVERED_AFTER_AMNESIA.to_string(),
        temporal::recovered_after_amnesia(reconciler.as_ref(), &outcome.amnesias).await,
    );
    for store in disk::STORES {
        reached.insert(
            format!("{}{store}", disk::REACHED_PREFIX),
            outcome.disk_full_refusals.get(store).copied().unwrap_or(0),
        );
    }
    reached.extend(answer_loss::reached(&system, &evidence, &outcome.answer_losses).await);
    let violations = checks.iter().map(|c| c.violations.len()).sum();
    let report = Report {
        seed: config.seed,
        payouts: config.payouts,
        accounts: config.accounts,
        guards_disabled: config.disable.name().to_string(),
        final_states: evidence.final_states(),
        faults_scheduled: schedule.faults.len(),
        faults_injected_by_kind: outcome.injected,
        fault_errors: outcome.errors,
        schedule: schedule.describe(),
        partitions_unavailable,
        clocks_unavailable,
        disks_unavailable,
        safety_events,
        reached,
        stale_holders: outcome.plants.clone(),
        amnesias: outcome.amnesias.clone(),
        rollouts: outcome.rollouts.clone(),
        answer_losses: outcome.answer_losses.clone(),
        rail_movements: evidence.movements.len() as u64,
        checks,
        violations,
        settled,
        settle_time_s: settle_time.as_secs_f64(),
        fault_phase_s: fault_phase.as_secs_f64(),
        wall_time_s: wall.elapsed().as_secs_f64(),
    };
    drop(in_process);
    // The workers go before their network hosts.
    system.workers.clear();
    drop(partitions);
    Ok(report)
}
