//! Temporal losing its state (issue 36, docs/design/fault-suite section 3), and the reconciler
//! service that must recover from it with no operator.
//!
//! The specification keeps Temporal's history diagnostic only: every payout must still end
//! through the guards, the outbox and the resolver. The faults:
//! - `temporal_kill`: the dev server killed and started again on the same database;
//! - `temporal_amnesia_deleted`: killed, its database deleted, started again empty (no workflow,
//!   no schedule);
//! - `temporal_amnesia_old_copy`: a backup taken (SQLite's online backup), payouts go on, then
//!   the server killed and started on the backup: it lacks every workflow started since and holds
//!   runs that have since finished.
//!
//! Recovery is the product's: `reconciler serve` runs beside the system as it does in a
//! deployment; its keeper re-creates the lost schedule (`reconciler_schedule_repairs_total`,
//! alert `ReconcilerScheduleRepaired`) and its passes resume every payout without a workflow.
//! What the run reaches is read from the reconciler's own counters of the payouts it resumed or
//! settled by evidence ([`Reconciler::recovered`]).

use std::time::{Duration, Instant};

use testkit::system::System;
use testkit::temporal::Database;
use testkit::{ManagedProcess, ProcessSpec, Stack};

use super::nemesis::{Fault, FaultKind, Outcome};
use crate::metrics::{sample, scrape};

/// The reconciler's keeper looks at its schedule (and at blocked accounts) this often in a run.
const KEEPER_INTERVAL_S: u64 = 1;
/// Its scheduled full pass (checks, orphans, resume of stranded payouts) runs this often.
const PASS_INTERVAL_S: u64 = 5;
/// A PENDING payout the harness has not started yet is the harness's for the start spread plus
/// this: the reconciler starts a payout with no workflow only once its start is overdue, and the
/// harness starts its payouts at a paced rate over the spread, held back further by a nemesis
/// behind its schedule (so the faults land on work in flight; a loaded machine had it 93 s
/// behind); a shorter grace would have the reconciler start them at once, and count those starts
/// as payouts it recovered. (A payout whose run Temporal lost before it claimed waits this long
/// for its resume: the harness starts runs itself, so paydb has no record that it did.)
const NOT_STARTED_SLACK: Duration = Duration::from_secs(120);
/// A resumed run's settlement window (the run's own, `super::SETTLEMENT_WINDOW_MS`).
const RESUMED_SETTLEMENT_WINDOW_MS: u64 = super::SETTLEMENT_WINDOW_MS;

/// The reconciler service of a run and its `/metrics` port.
pub struct Reconciler {
    pub process: ManagedProcess,
    pub metrics_port: u16,
    /// What earlier incarnations of the process had counted ([`Reconciler::carry`]): a restart
    /// starts its counters from zero.
    carried: std::sync::atomic::AtomicU64,
}

impl Reconciler {
    /// `reconciler serve` over `system`, resuming stranded payouts and resolving orphaned
    /// ambiguous ones, with a keeper every second and a pass every few seconds.
    pub fn start(system: &System, start_spread: Duration) -> anyhow::Result<Self> {
        let metrics_port = testkit::free_port();
        // The harness's starts follow the nemesis's progress as well as the clock
        // (`workload::Pace`): on a loaded machine they run past the spread.
        let grace = start_spread + NOT_STARTED_SLACK;
        let spec = ProcessSpec::new(
            "reconciler",
            testkit::workspace_bin("reconciler"),
            system.dir.join("reconciler.log"),
        )
        .env("RECONCILE_KEEPER_INTERVAL_S", KEEPER_INTERVAL_S.to_string())
        .env(
            "RECONCILE_NOT_STARTED_GRACE_MS",
            grace.as_millis().to_string(),
        )
        // Its takeovers' force-revokes (and its resolver's grants) join the workers' histories:
        // the checker pairs a takeover with the grant it deposed, as an operator's revoke.
        .env(
            "PAYOUT_LOCK_HISTORY_PATH",
            system
                .dir
                .join(format!(
                    "{}reconciler.jsonl",
                    super::checker::LOCK_HISTORY_PREFIX
                ))
                .display()
                .to_string(),
        )
        .arg("serve")
        .args(system.reconciler_args(&system.temporal_address, RESUMED_SETTLEMENT_WINDOW_MS)?)
        .args([
            "--task-queue".to_string(),
            format!("{}-reconciliation", system.task_queue),
            "--schedule-id".to_string(),
            format!("reconciler-{}", system.task_queue),
            "--interval-s".to_string(),
            PASS_INTERVAL_S.to_string(),
            "--metrics-listen".to_string(),
            format!("127.0.0.1:{metrics_port}"),
            "--resume-stranded".to_string(),
            "--resolve-orphans".to_string(),
        ]);
        let process = tokio::task::block_in_place(|| ManagedProcess::start(spec))?;
        Ok(Self {
            process,
            metrics_port,
            carried: Default::default(),
        })
    }

    /// Payouts the reconciler finished or handed back to a new workflow so far, from its
    /// `/metrics`: resumed by its scheduled resume pass or its keeper's holder pass, and orphaned
    /// ambiguous payouts its resolver settled by the rail's evidence (FOUND, ABSENT, NEVER_SENT:
    /// the orphan resolver goes first, so an ambiguous payout whose workflow Temporal lost is
    /// settled there, not resumed), across the harness's own restarts of it. `None` if it does not
    /// answer.
    pub async fn recovered(&self) -> Option<u64> {
        let now = self.recovered_of(&scrape(self.metrics_port).await)?;
        Some(self.carried.load(std::sync::atomic::Ordering::SeqCst) + now)
    }

    /// What this incarnation of the process counted, from its `/metrics` text.
    fn recovered_of(&self, text: &str) -> Option<u64> {
        if text.is_empty() {
            return None;
        }
        let resumed = |name| sample(text, name, &["action=\"RESUMED\""]);
        let resolved = |evidence: &str| {
            sample(
                text,
                "reconciliation_orphans_resolved_total",
                &[&format!("evidence=\"{evidence}\"")],
            )
        };
        let total = resumed("reconciler_resume_pass_actions_total")
            + resumed("reconciler_holder_pass_actions_total")
            + ["FOUND", "ABSENT", "NEVER_SENT"]
                .map(resolved)
                .iter()
                .sum::<f64>();
        Some(total as u64)
    }

    /// Keeps what this incarnation counted before the harness restarts the process (the rolling
    /// restart), so [`Reconciler::recovered`] counts across it.
    pub async fn carry(&self) {
        let text = scrape(self.metrics_port).await;
        if let Some(now) = self.recovered_of(&text) {
            self.carried
                .fetch_add(now, std::sync::atomic::Ordering::SeqCst);
        }
    }
}

/// One amnesia of the run: what was in flight when Temporal lost its state, and the reconciler's
/// count of recovered payouts just before.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Amnesia {
    pub kind: String,
    /// Payouts not yet terminal in paydb at the fault (each needs a workflow to finish).
    pub open_payouts: i64,
    /// The reconciler's recovered count before the fault (`None`: no reconciler, or no answer).
    pub recovered_before: Option<u64>,
}

/// Payouts neither terminal nor RAIL_AMBIGUOUS-at-rest in paydb now: each needs a workflow.
async fn open_payouts(system: &System) -> anyhow::Result<i64> {
    let paydb = super::one_connection(&system.databases.paydb).await?;
    let n = sqlx::query_scalar(
        "SELECT count(*) FROM payout WHERE state NOT IN ('POSTED', 'FAILED', 'ABANDONED')",
    )
    .fetch_one(&paydb)
    .await;
    testkit::util::close_pool(paydb).await;
    Ok(n?)
}

/// An amnesia's server is down this long (its database replaced meanwhile).
const AMNESIA_DOWN: Duration = Duration::from_millis(500);

/// Injects one Temporal fault (the kinds above).
pub async fn inject(
    stack: &Stack,
    system: &System,
    fault: &Fault,
    reconciler: Option<&Reconciler>,
    outcome: &mut Outcome,
) -> anyhow::Result<String> {
    let temporal = stack.try_temporal()?;
    let down = Duration::from_millis(fault.down_ms);
    let (database, copy) = match fault.kind {
        FaultKind::TemporalKill => {
            tokio::task::block_in_place(|| temporal.crash_restart(down, Database::Kept))?;
            return Ok(format!(
                "Temporal killed, back on its database after {} ms",
                fault.down_ms
            ));
        }
        FaultKind::TemporalAmnesiaDeleted => {
            ("its database deleted, started empty".to_string(), None)
        }
        FaultKind::TemporalAmnesiaOldCopy => {
            let copy = system
                .dir
                .join(format!("temporal-backup-{}.db", fault.seed));
            tokio::task::block_in_place(|| temporal.back_up(&copy))?;
            let taken = Instant::now();
            tokio::time::sleep(down).await;
            (
                format!("started on a copy {} ms old", taken.elapsed().as_millis()),
                Some(copy),
            )
        }
        other => anyhow::bail!("{} is not a Temporal fault", other.name()),
    };
    // Once a payout is in flight: what is open then, and what the reconciler had recovered.
    let in_flight = super::payouts_in_flight(system).await.is_some();
    let recovered_before = match reconciler {
        Some(r) => r.recovered().await,
        None => None,
    };
    let open = open_payouts(system).await?;
    let replacement = match &copy {
        Some(copy) => Database::RestoredFrom(copy),
        None => Database::Deleted,
    };
    tokio::task::block_in_place(|| temporal.crash_restart(AMNESIA_DOWN, replacement))?;
    if let Some(copy) = &copy {
        let _ = std::fs::remove_file(copy);
    }
    outcome.amnesias.push(Amnesia {
        kind: fault.kind.name().to_string(),
        open_payouts: open,
        recovered_before,
    });
    Ok(format!(
        "Temporal killed, {database} ({open} payouts open{})",
        if in_flight {
            ""
        } else {
            "; none was in flight"
        }
    ))
}

/// Payouts the reconciler recovered since the run's first amnesia (its count at the end minus its
/// count before that fault; a reconciler restarted since counts from zero): 0 when there was no
/// amnesia or no reconciler.
pub async fn recovered_after_amnesia(reconciler: Option<&Reconciler>, amnesias: &[Amnesia]) -> u64 {
    let (Some(r), Some(first)) = (reconciler, amnesias.first()) else {
        return 0;
    };
    let Some(now) = r.recovered().await else {
        return 0;
    };
    match first.recovered_before {
        Some(before) if before <= now => now - before,
        _ => now,
    }
}
