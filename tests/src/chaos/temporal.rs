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

use testkit::pki::Role;

use super::nemesis::{Fault, FaultKind, Outcome};
use super::workload::Workload;
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

/// The lock owner of the harness's hold on an account's key ([`hold_a_line`]): no `/`, so the
/// reconciler never takes it for a payout's grant.
const LINE_OWNER: &str = "chaos-line";
/// The hold's lock session lives this long without a keep-alive.
const LINE_SESSION_TTL: Duration = Duration::from_secs(10);
/// Taking the key waits at most this long for the payout holding it (a bound: a payout holds
/// its account's key for about a second).
const LINE_TAKE_MAX: Duration = Duration::from_secs(60);
/// One acquire's wait in the lock service's line.
const LINE_ACQUIRE_WAIT: Duration = Duration::from_secs(5);
/// The held payout waits at most this long for the reconciler to hand it to a new run (a bound:
/// the keeper re-creates the schedule within a second and a pass runs every few).
const LINE_RESUME_MAX: Duration = Duration::from_secs(180);

/// A payout held in its account's line across an amnesia: its workflow started and waiting for
/// the account's key, which the harness holds, so nothing of it can finish on a worker's local
/// steps while Temporal is gone (a payout in flight does: its run needs Temporal only between
/// steps). Temporal then loses the run, and the payout is the reconciler's to find and resume.
/// Without it, at the workload's paced rate, an amnesia often met no payout waiting and the
/// run's `recovered_after_temporal_amnesia` depended on the machine's speed.
pub struct HeldLine {
    payout: String,
    session: lock_client::Session,
    grant: lock_client::GrantHandle,
}

/// The line's own account opens with this; its one payout is [`LINE_PAYOUT_MINOR`].
const LINE_OPENING_MINOR: i64 = 10_000;
const LINE_PAYOUT_MINOR: i64 = 1_000;

/// Creates a payout of the line's own (an account of its own, opened and funded as the
/// workload's are: the workload's own payouts may all have settled by the time a nemesis behind
/// its schedule reaches an amnesia), takes its account's key, then starts its workflow and
/// records its start as delivered, as the workload does.
async fn hold_a_line(system: &System, work: &Workload, seed: u64) -> anyhow::Result<HeldLine> {
    let template = work
        .inputs
        .first()
        .ok_or_else(|| anyhow::anyhow!("the workload has no payout"))?;
    let name = format!("{}-line-{:08x}", work.run_id, seed as u32);
    let input = payout_activities::types::PayoutInput {
        payout_id: payout_domain::PayoutId::parse(name.clone())?,
        account_id: payout_domain::AccountId::parse(name.clone())?,
        amount_minor: payout_domain::AmountMinor::new(LINE_PAYOUT_MINOR)?,
        beneficiary_ref: payout_domain::BeneficiaryRef::parse("ben-line")?,
        ..template.clone()
    };
    let payments =
        payment_client::PaymentClient::connect(&system.payment_url(), &system.tls(Role::Fixture))
            .await
            .map_err(|e| anyhow::anyhow!("{e}"))?;
    system
        .operator
        .open_account(
            &payments,
            &input.account_id,
            &input.currency,
            LINE_OPENING_MINOR,
        )
        .await
        .map_err(|e| anyhow::anyhow!("opening {name}: {e}"))?;
    payments
        .create_payout(&crate::workload::new_payout(&input))
        .await
        .map_err(|e| anyhow::anyhow!("creating {name}: {e}"))?;
    let paydb = super::one_connection(&system.databases.paydb).await?;
    let (payout, account) = (name.clone(), name);
    let history = lock_client::history::HistoryRecorder::open(&system.dir.join(format!(
        "{}{LINE_OWNER}.jsonl",
        super::checker::LOCK_HISTORY_PREFIX
    )))?;
    let lock = lock_client::LockClient::connect(&system.lock_url(), &system.tls(Role::Worker))
        .await?
        .with_history(std::sync::Arc::new(history));
    let session = lock.open_session(LINE_OWNER, LINE_SESSION_TTL).await?;
    let key = format!("payout:{account}");
    let give_up = Instant::now() + LINE_TAKE_MAX;
    let grant = loop {
        match session
            .acquire_as(&key, LINE_OWNER, LINE_ACQUIRE_WAIT)
            .await?
        {
            lock_client::Acquired::Granted(grant) => break grant,
            lock_client::Acquired::NotAcquired { holder_owner, .. } => anyhow::ensure!(
                Instant::now() < give_up,
                "{key} still held by {holder_owner} after {LINE_TAKE_MAX:?}"
            ),
        }
    };
    let client = payout_workflows::client::connect_configured(
        &payout_workflows::client::TemporalArgs::profile_of(&system.temporal_clients, "operator"),
        "chaos",
    )
    .await
    .map_err(|e| anyhow::anyhow!("{e}"))?;
    match payout_workflows::client::start_payout(&client, &system.task_queue, &input).await {
        Ok(_) | Err(payout_workflows::client::PayoutClientError::AlreadyStarted { .. }) => {}
        Err(e) => anyhow::bail!("starting {payout}: {e}"),
    }
    super::workload::record_start(&paydb, &input).await;
    testkit::util::close_pool(paydb).await;
    Ok(HeldLine {
        payout,
        session,
        grant,
    })
}

/// The line is set up again for at most this long when a step of it fails (a service the
/// previous fault restarted may still be coming up: a mid-sized run met `Unavailable` once).
/// Each step is idempotent: the account opens with the same content, the payout is created with
/// the same content, a lost hold's lease frees the key.
const LINE_SETUP_RETRY_MAX: Duration = Duration::from_secs(30);
const LINE_SETUP_RETRY_PAUSE: Duration = Duration::from_secs(1);

/// [`hold_a_line`], tried again on failure for at most [`LINE_SETUP_RETRY_MAX`]: its last error.
async fn hold_a_line_retried(
    system: &System,
    work: &Workload,
    seed: u64,
) -> anyhow::Result<HeldLine> {
    let give_up = Instant::now() + LINE_SETUP_RETRY_MAX;
    loop {
        match hold_a_line(system, work, seed).await {
            Ok(line) => return Ok(line),
            Err(e) if Instant::now() >= give_up => return Err(e),
            Err(_) => tokio::time::sleep(LINE_SETUP_RETRY_PAUSE).await,
        }
    }
}

impl HeldLine {
    /// Lets the line go once the reconciler has handed a payout back to a new run since
    /// `before` (its count), at most [`LINE_RESUME_MAX`]: what it saw.
    async fn release(self, reconciler: Option<&Reconciler>, before: Option<u64>) -> String {
        let waited = Instant::now();
        let resumed = match reconciler {
            Some(r) => {
                let give_up = Instant::now() + LINE_RESUME_MAX;
                loop {
                    let now = r.recovered().await;
                    if now.is_some_and(|n| before.is_none_or(|b| n > b)) {
                        break true;
                    }
                    if Instant::now() >= give_up {
                        break false;
                    }
                    tokio::time::sleep(Duration::from_millis(500)).await;
                }
            }
            None => false,
        };
        let released = self.grant.release().await;
        let _ = self.session.close().await;
        format!(
            "{} held in line; {} after {:.1} s{}",
            self.payout,
            if resumed {
                "the reconciler resumed a payout"
            } else {
                "nothing resumed"
            },
            waited.elapsed().as_secs_f64(),
            match released {
                Ok(()) => String::new(),
                Err(e) => format!(" (the hold's release: {e}; its lease frees the key)"),
            }
        )
    }
}

/// Injects one Temporal fault (the kinds above).
pub async fn inject(
    stack: &Stack,
    system: &System,
    fault: &Fault,
    reconciler: Option<&Reconciler>,
    work: &Workload,
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
    let in_flight = super::payouts_in_flight(system).await;
    let recovered_before = match reconciler {
        Some(r) => r.recovered().await,
        None => None,
    };
    // A payout waiting in its account's line, started after the old copy was taken.
    let line = hold_a_line_retried(system, work, fault.seed).await;
    let recovered_before = match (reconciler, &line) {
        (Some(r), Ok(_)) => r.recovered().await,
        _ => recovered_before,
    };
    let open = open_payouts(system).await?;
    let replacement = match &copy {
        Some(copy) => Database::RestoredFrom(copy),
        None => Database::Deleted,
    };
    let restarted =
        tokio::task::block_in_place(|| temporal.crash_restart(AMNESIA_DOWN, replacement));
    if let Some(copy) = &copy {
        let _ = std::fs::remove_file(copy);
    }
    let held = match line {
        Ok(line) => line.release(reconciler, recovered_before).await,
        Err(e) => format!("no payout held in line: {e:#}"),
    };
    restarted?;
    outcome.amnesias.push(Amnesia {
        kind: fault.kind.name().to_string(),
        open_payouts: open,
        recovered_before,
    });
    Ok(format!(
        "Temporal killed, {database} ({open} payouts open, {} in flight); {held}",
        in_flight.unwrap_or(0)
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
