//! The nemesis: a seeded schedule of faults (the same seed gives the same schedule: times, kinds
//! and targets), executed while the payouts run.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};
use testkit::pki::Role;

use rand::{RngExt, SeedableRng};
use serde::Serialize;
use testkit::system::System;
use testkit::{ManagedProcess, Stack};

use super::{say, DisableGuard, WORKER_LOCK_TTL_MS};
use crate::chaos::workload::Workload;

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize)]
pub enum FaultKind {
    /// SIGKILL of a worker, restarted after `down_ms`.
    WorkerKill,
    /// SIGSTOP of a worker for longer than its lease, then SIGCONT.
    WorkerPause,
    LockServerKill,
    PaymentResourceKill,
    RailProxyKill,
    DispatcherKill,
    GeneralLedgerKill,
    /// SIGKILL of etcd's leader, the member restarted after `down_ms`.
    EtcdLeaderKill,
    /// PostgreSQL restart of the main server (paydb, gldb).
    PgMainRestart,
    /// PostgreSQL restart of the proxy's server (proxydb).
    PgProxyRestart,
    /// An operator force-revokes the lock of an account with a payout in flight.
    ForceRevoke,
    /// The rail's fault mix changes (hangs, 5xx, resets, slow lookups), seeded.
    RailFaults,
    /// A worker on its own network host loses its link to the lock-server (packets dropped,
    /// longer than its lease) while its links to the guards and Temporal stay up.
    WorkerPartition,
    /// etcd is restored from a snapshot taken `down_ms` earlier, with the documented procedure
    /// (`services/lock-server/RESTORE.md`): lock-servers stopped, revision advanced past every
    /// token seen, restored leases revoked, every client deadline passed, then lock-servers back.
    EtcdRestore,
    /// The same restore WITHOUT the procedure (lock-server left running, revision not advanced):
    /// the lock-server's INV-04 alarm must refuse the rewound tokens; then the operator applies
    /// the procedure.
    EtcdRestoreWithoutProcedure,
    /// Delivered outbox rows are delivered again (a dispatcher that died after the GL committed
    /// and before it marked the row): the GL must answer with the journal it already has.
    OutboxRedeliver,
    /// A stale holder planted in the running system: the first worker to pass its grant check
    /// for MarkSubmitted or Submit (seeded) waits there (a test-only stall point, armed now) and
    /// is paused past its lease; the payout goes on under a new grant; then the stalled call
    /// reaches its guard with the old token. The guards must refuse it.
    StaleHolder,
    /// The Temporal dev server killed and started again on its database after `down_ms`.
    TemporalKill,
    /// Temporal's database deleted while it is down: it comes back with no workflow and no
    /// schedule; the reconciler must notice and resume every payout (`super::temporal`).
    TemporalAmnesiaDeleted,
    /// Temporal's database backed up, then `down_ms` later replaced by that copy: Temporal lacks
    /// every workflow started since and runs again those that finished since.
    TemporalAmnesiaOldCopy,
    /// The wall clock of a worker, the payment resource, the rail proxy or the lock-server
    /// stepped forward or back by 1..10 minutes for `down_ms`, then set right (`super::clock`).
    ClockJump,
    /// Every service stopped gracefully and started again, one after another, each ready before
    /// the next (`super::rolling`): a release rolled out mid-batch.
    RollingRestart,
    /// The main PostgreSQL server's (paydb, gldb) WAL volume filled, then freed
    /// (`super::disk`).
    DiskFullPgMain,
    /// The proxy's PostgreSQL server's (proxydb) WAL volume filled, then freed.
    DiskFullPgProxy,
    /// One etcd member's data volume filled: it stops; freed, it comes back and catches up.
    DiskFullEtcdMember,
    /// etcd's backend quota reached: `NOSPACE`, every write refused until RESTORE.md's
    /// procedure (delete, compact, defragment, disarm).
    EtcdNospace,
    /// The next worker build started beside the old, made current, the old drained and stopped
    /// (`super::rollout`): a worker-versioning rollout mid-batch.
    UpgradeRollout,
    /// The payment resource's answers to one worker dropped, its requests still arriving
    /// (`super::answer_loss`): a step committed unheard, asked again, answered with the record.
    AnswerLossPaymentResource,
    /// The rail proxy's answers to one worker dropped: a Submit made unheard, the payout
    /// RAIL_AMBIGUOUS, resolved by inquiry after the heal.
    AnswerLossRailProxy,
    /// The rail's answers to the proxy dropped: the rail pays, the proxy times out, the payout is
    /// resolved FOUND.
    AnswerLossRail,
    /// The General Ledger's port cut both ways for `down_ms`: the outbox waits, redelivers.
    DispatcherGlPartition,
}

/// The steps a planted stale holder stalls before, in turn.
const STALE_STEPS: [&str; 2] = ["submit", "mark_submitted"];
/// The planted call waits for its release at most this long (the worker's bound): the harness
/// releases it once a successor's write has reached the guard the call goes to, which takes the
/// workflow's way around the frozen call: MarkSubmitted's start-to-close (10 s) and a retry that
/// finds the grant lost and re-acquires; Submit's start-to-close (30 s), RAIL_AMBIGUOUS and a
/// fenced inquiry that seals the never-sent payout: under a minute unloaded. A bound, not an
/// expectation: a clean clone's CI run beside two other test suites on the two cores saw a
/// Submit's rescue take longer than 150 s (its account's other payouts polling for the key).
const PLANT_STALL_MAX: Duration = Duration::from_secs(420);
/// After its release the planted call reaches its guard and answers within this.
const PLANT_ANSWER_WAIT: Duration = Duration::from_secs(30);
/// A planted stall not taken by any worker within this long is disarmed (nothing reached it).
/// A bound, not an expectation: unloaded, a payout reaches either step within seconds; on a
/// machine whose cores a build shares, the workload's contended accounts can take a minute.
const PLANT_TAKE_TIMEOUT: Duration = Duration::from_secs(90);
/// Beyond the lease, so that the frozen holder's grant is gone at the lock service.
const PLANT_PAUSE_MS: u64 = WORKER_LOCK_TTL_MS + 3_000;

/// How a planted holder is made stale while its call is frozen.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PlantMethod {
    /// An operator force-revokes its grant; the worker runs on (its other payouts too), the
    /// frozen call keeps the revoked grant's signature.
    Revoke,
    /// Its worker is paused past its lease (SIGSTOP): the session and every grant of the worker
    /// are lost. A worker paused so sometimes exits on resuming (`Plant::worker_exited`), taking
    /// the frozen call with it.
    Pause,
}

impl PlantMethod {
    pub fn name(self) -> &'static str {
        match self {
            Self::Revoke => "revoke",
            Self::Pause => "pause",
        }
    }
}

/// The methods in turn, two plants each (one before each step): revoked first, so each guard's
/// fence is met by a holder whose worker does not exit with its call.
const PLANT_METHODS: [PlantMethod; 2] = [PlantMethod::Revoke, PlantMethod::Pause];

/// One planted stale holder that a worker took, and what became of its call.
#[derive(Debug, Clone, Serialize)]
pub struct Plant {
    /// How it was made stale (`PlantMethod::name`).
    pub method: String,
    pub step: String,
    pub worker: String,
    pub payout: String,
    /// The token the frozen holder checked and then presented.
    pub token: i64,
    /// The token a successor's write had left at the guard when the call was released: above
    /// `token` means the call was stale when it reached the guard (by what happened, not by
    /// timing). `None`: no successor wrote before the stall's bound, or the release failed.
    pub successor_token: Option<i64>,
    /// The guard's answer to the planted call (`accepted`, `fenced_out`, `duplicate`,
    /// `refused_transition`, ...); `None`: the call never answered (its worker died).
    pub answer: Option<String>,
    /// Anything that kept the plant from completing.
    pub problem: Option<String>,
    /// The planted worker's process was gone when the answer was awaited: it exited with the
    /// planted call (the supervisor starts a new one). Seen here as the Temporal SDK's own panic
    /// ("Trying to send a new WFT for a run which already has one", temporalio-sdk-core 0.10.1,
    /// `managed_run.rs`) after a worker was paused, which ends the process.
    pub worker_exited: bool,
}

impl Plant {
    /// The call was made after a successor's write landed at its guard.
    pub fn was_stale(&self) -> bool {
        self.successor_token.is_some_and(|t| t > self.token)
    }
    pub fn refused(&self) -> bool {
        matches!(
            self.answer.as_deref(),
            Some("fenced_out" | "duplicate" | "refused_transition")
        )
    }
}

impl FaultKind {
    pub const ALL: [FaultKind; 31] = [
        FaultKind::WorkerKill,
        FaultKind::WorkerPause,
        FaultKind::LockServerKill,
        FaultKind::PaymentResourceKill,
        FaultKind::RailProxyKill,
        FaultKind::DispatcherKill,
        FaultKind::GeneralLedgerKill,
        FaultKind::EtcdLeaderKill,
        FaultKind::PgMainRestart,
        FaultKind::PgProxyRestart,
        FaultKind::ForceRevoke,
        FaultKind::RailFaults,
        FaultKind::WorkerPartition,
        FaultKind::EtcdRestore,
        FaultKind::EtcdRestoreWithoutProcedure,
        FaultKind::OutboxRedeliver,
        FaultKind::StaleHolder,
        FaultKind::TemporalKill,
        FaultKind::TemporalAmnesiaDeleted,
        FaultKind::TemporalAmnesiaOldCopy,
        FaultKind::ClockJump,
        FaultKind::RollingRestart,
        FaultKind::DiskFullPgMain,
        FaultKind::DiskFullPgProxy,
        FaultKind::DiskFullEtcdMember,
        FaultKind::EtcdNospace,
        FaultKind::UpgradeRollout,
        FaultKind::AnswerLossPaymentResource,
        FaultKind::AnswerLossRailProxy,
        FaultKind::AnswerLossRail,
        FaultKind::DispatcherGlPartition,
    ];
    /// The kinds that act on a worker's own network host (a namespace).
    pub const NETWORK_HOST: [FaultKind; 3] = [
        FaultKind::WorkerPartition,
        FaultKind::AnswerLossPaymentResource,
        FaultKind::AnswerLossRailProxy,
    ];
    /// The kinds that need the stack's capped volumes (`testkit::volume`).
    pub const DISK: [FaultKind; 4] = [
        FaultKind::DiskFullPgMain,
        FaultKind::DiskFullPgProxy,
        FaultKind::DiskFullEtcdMember,
        FaultKind::EtcdNospace,
    ];
    pub fn name(self) -> &'static str {
        match self {
            FaultKind::WorkerKill => "worker_kill",
            FaultKind::WorkerPause => "worker_pause_past_lease",
            FaultKind::LockServerKill => "lock_server_kill",
            FaultKind::PaymentResourceKill => "payment_resource_kill",
            FaultKind::RailProxyKill => "rail_proxy_kill",
            FaultKind::DispatcherKill => "dispatcher_kill",
            FaultKind::GeneralLedgerKill => "general_ledger_kill",
            FaultKind::EtcdLeaderKill => "etcd_leader_kill",
            FaultKind::PgMainRestart => "pg_main_restart",
            FaultKind::PgProxyRestart => "pg_proxy_restart",
            FaultKind::ForceRevoke => "lock_force_revoke",
            FaultKind::RailFaults => "rail_fault_mix",
            FaultKind::WorkerPartition => "worker_partition_from_lock_server",
            FaultKind::EtcdRestore => "etcd_restore_with_procedure",
            FaultKind::EtcdRestoreWithoutProcedure => "etcd_restore_without_procedure",
            FaultKind::OutboxRedeliver => "outbox_duplicate_delivery",
            FaultKind::StaleHolder => "stale_holder_planted",
            FaultKind::TemporalKill => "temporal_kill",
            FaultKind::TemporalAmnesiaDeleted => "temporal_amnesia_deleted",
            FaultKind::TemporalAmnesiaOldCopy => "temporal_amnesia_old_copy",
            FaultKind::ClockJump => "clock_jump",
            FaultKind::RollingRestart => "rolling_restart",
            FaultKind::DiskFullPgMain => "disk_full_pg_main",
            FaultKind::DiskFullPgProxy => "disk_full_pg_proxy",
            FaultKind::DiskFullEtcdMember => "disk_full_etcd_member",
            FaultKind::EtcdNospace => "etcd_nospace",
            FaultKind::UpgradeRollout => "upgrade_rollout",
            FaultKind::AnswerLossPaymentResource => "answer_loss_worker_payment_resource",
            FaultKind::AnswerLossRailProxy => "answer_loss_worker_rail_proxy",
            FaultKind::AnswerLossRail => "answer_loss_rail",
            FaultKind::DispatcherGlPartition => "dispatcher_gl_partition",
        }
    }
    pub fn parse(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|k| k.name() == name)
    }
    /// Relative frequency: the worker and lock faults are the ones the guards exist for.
    fn weight(self) -> u32 {
        match self {
            FaultKind::WorkerKill | FaultKind::ForceRevoke => 3,
            FaultKind::WorkerPause
            | FaultKind::RailFaults
            | FaultKind::WorkerPartition
            | FaultKind::StaleHolder => 2,
            _ => 1,
        }
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct Fault {
    /// From the start of the fault phase.
    pub at_ms: u64,
    pub kind: FaultKind,
    /// Worker index, where the kind has one.
    pub worker: usize,
    /// How long the target stays down or paused.
    pub down_ms: u64,
    /// Seed of whatever the fault draws when it runs (the account to revoke, the rail's mix).
    pub seed: u64,
}

#[derive(Debug, Clone, Serialize)]
pub struct Schedule {
    pub seed: u64,
    pub faults: Vec<Fault>,
}

impl Schedule {
    /// `count` faults at uniformly random times within `window`. Services that run in-process
    /// (a disabled guard) are not killed: the harness cannot restart them as processes.
    pub fn generate(
        seed: u64,
        count: usize,
        window: Duration,
        workers: usize,
        disable: DisableGuard,
        partitions: bool,
        only: Option<&[FaultKind]>,
    ) -> Self {
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed ^ 0x6e65_6d65_7369_7321);
        let kinds: Vec<FaultKind> = FaultKind::ALL
            .into_iter()
            .filter(|k| !(disable.fence_off() && *k == FaultKind::PaymentResourceKill))
            .filter(|k| !(disable.proxy_off() && *k == FaultKind::RailProxyKill))
            .filter(|k| {
                workers > 0
                    || !(matches!(k, FaultKind::WorkerKill | FaultKind::WorkerPause)
                        || FaultKind::NETWORK_HOST.contains(k))
            })
            .filter(|k| partitions || !FaultKind::NETWORK_HOST.contains(k))
            .filter(|k| only.is_none_or(|o| o.contains(k)))
            .collect();
        let total: u32 = kinds.iter().map(|k| k.weight()).sum();
        // Every kind once first; the planted stale holder once per step it stalls before, so a
        // run plants before MarkSubmitted and before Submit (each guard's fence is reached).
        let mut first = kinds.clone();
        if kinds.contains(&FaultKind::StaleHolder) {
            first.extend(std::iter::repeat_n(
                FaultKind::StaleHolder,
                STALE_STEPS.len() - 1,
            ));
        }
        let window_ms = window.as_millis().max(1) as u64;
        let mut faults: Vec<Fault> = (0..count)
            .map(|i| {
                let mut pick = rng.random_range(0..total);
                // Every kind once first (when there are enough faults), then by weight.
                let kind = if i < first.len() {
                    first[i]
                } else {
                    *kinds
                        .iter()
                        .find(|k| {
                            if pick < k.weight() {
                                true
                            } else {
                                pick -= k.weight();
                                false
                            }
                        })
                        .expect("pick below the total weight")
                };
                let down_ms = match kind {
                    FaultKind::WorkerPause | FaultKind::WorkerPartition => {
                        WORKER_LOCK_TTL_MS + rng.random_range(1_000..3_000)
                    }
                    // The snapshot's age: tokens are minted between it and the restore.
                    FaultKind::EtcdRestore | FaultKind::EtcdRestoreWithoutProcedure => {
                        rng.random_range(2_000..5_000)
                    }
                    FaultKind::EtcdLeaderKill => rng.random_range(500..2_000),
                    FaultKind::TemporalKill => rng.random_range(1_000..5_000),
                    // The old copy's age: workflows are started and finished between the backup
                    // and the restore.
                    FaultKind::TemporalAmnesiaOldCopy => rng.random_range(2_000..8_000),
                    // How long the clock stays stepped: seconds of payouts at the target.
                    FaultKind::ClockJump => rng.random_range(2_000..5_000),
                    // How long a store stays full once it has refused.
                    FaultKind::DiskFullPgMain
                    | FaultKind::DiskFullPgProxy
                    | FaultKind::DiskFullEtcdMember
                    | FaultKind::EtcdNospace => rng.random_range(1_000..4_000),
                    // How long the ledger stays cut off: past the dispatcher's delivery timeout.
                    FaultKind::DispatcherGlPartition => rng.random_range(2_000..6_000),
                    _ => rng.random_range(100..1_500),
                };
                Fault {
                    // A planted holder needs a payout to reach its step, and a lost answer a call
                    // in flight: in the window's first third, while the paced starts are far from
                    // done, however far a busy machine puts the nemesis behind its schedule later.
                    at_ms: match kind {
                        FaultKind::StaleHolder
                        | FaultKind::AnswerLossPaymentResource
                        | FaultKind::AnswerLossRailProxy
                        | FaultKind::AnswerLossRail => rng.random_range(0..(window_ms / 3).max(1)),
                        _ => rng.random_range(0..window_ms),
                    },
                    kind,
                    worker: rng.random_range(0..workers.max(1)),
                    down_ms,
                    seed: rng.random(),
                }
            })
            .collect();
        faults.sort_by_key(|f| f.at_ms);
        Self { seed, faults }
    }

    pub fn describe(&self) -> Vec<String> {
        self.faults
            .iter()
            .map(|f| {
                let target = match f.kind {
                    FaultKind::WorkerKill | FaultKind::WorkerPause | FaultKind::WorkerPartition => {
                        format!(" worker-{}", f.worker)
                    }
                    _ => String::new(),
                };
                format!(
                    "t+{:>6} ms {}{target} (down {} ms)",
                    f.at_ms,
                    f.kind.name(),
                    f.down_ms
                )
            })
            .collect()
    }
}

/// A force-revoke tries at most this many keys for one that is held at that instant.
const REVOKE_CANDIDATES_MAX: usize = 40;

#[derive(Debug, Default)]
pub struct Outcome {
    pub injected: BTreeMap<String, u64>,
    pub errors: Vec<String>,
    /// The operator's force-revokes, each with the grant the lock service says it took: the
    /// checker pairs each with that grant (break-glass hands the key on at once) and requires its
    /// holder to stop believing within one lease.
    pub revokes: Vec<super::checker::Revoke>,
    /// etcd restores without the procedure whose rewound token the lock-server refused.
    pub regression_alarms_fired: u64,
    /// etcd restores without the procedure where a rewound token was GRANTED: INV-04 broken.
    pub regression_alarms_missed: Vec<String>,
    /// Outbox rows handed back to the dispatcher for a second delivery.
    pub outbox_rows_redelivered: u64,
    /// Stale holders planted and taken, each once its call is over (the fault waits for it).
    pub plants: Vec<Plant>,
    /// Stale holders armed so far (taken or not): they alternate between the two steps.
    pub plant_attempts: usize,
    /// Each time Temporal lost its state, what was open then.
    pub amnesias: Vec<super::temporal::Amnesia>,
    /// The lock backend's rollbacks (etcd restored from a snapshot), for the checker.
    pub restores: Vec<super::checker::Restore>,
    /// Each store's refusals seen on a full disk (`super::disk::STORES`).
    pub disk_full_refusals: BTreeMap<String, u64>,
    /// Each worker-versioning rollout: versions, payouts pinned to the old at the switch, drain.
    pub rollouts: Vec<super::rollout::Rollout>,
    /// Each lost-answer fault: its link, window and what it saw (`super::answer_loss`).
    pub answer_losses: Vec<super::answer_loss::AnswerLoss>,
}

/// What the nemesis acts on besides the stack and the system.
pub struct Targets<'a> {
    pub work: &'a Workload,
    /// Each worker's network namespace, where it has one (partitions need it); a rollout
    /// replaces a slot's with its new worker's.
    pub partitions: &'a mut [Option<testkit::netns::NetNs>],
    /// The workers' `PAYOUT_TEST_STALL_DIR`, where stale holders are armed.
    pub stall_dir: &'a std::path::Path,
    /// Negative control of the INV-04 alarm: a restore without the procedure also loses the
    /// lock-server's issued-token record. Test-only.
    pub lose_issued_tokens: bool,
    /// Which guards run: a planted call is released once a successor's write has landed where
    /// it is recorded (the proxy off keeps no record; the payout's resolution is the sign then).
    pub disable: DisableGuard,
    /// The run's reconciler service (`None`: the control without it).
    pub reconciler: Option<&'a super::temporal::Reconciler>,
    /// The workers' deployment (which build is current).
    pub deployment: &'a super::rollout::Deployment,
    /// TEST ONLY: a rollout stops the old build's workers without draining them (the control).
    pub rollout_without_drain: bool,
}

impl Targets<'_> {
    /// The run's processes besides the system's own: the reconciler and Temporal's server.
    pub fn more_processes<'s>(&'s self, stack: &'s Stack) -> Vec<&'s ManagedProcess> {
        let mut more: Vec<&ManagedProcess> =
            self.reconciler.map(|r| &r.process).into_iter().collect();
        if let Ok(t) = stack.try_temporal() {
            more.push(&t.process);
        }
        more
    }
}

/// The harness plays the supervisor a deployment has (systemd, Kubernetes): a service process
/// that exited (e.g. it could not reach its database while PostgreSQL restarted) is started
/// again. Services replaced by in-process ones (a disabled guard) are left alone. `more` are the
/// run's other processes (the reconciler, Temporal's server).
pub fn supervise(system: &System, more: &[&ManagedProcess], disable: DisableGuard, verbose: bool) {
    for p in system.processes().into_iter().chain(more.iter().copied()) {
        let replaced = (disable.fence_off() && std::ptr::eq(p, &system.payment_resource))
            || (disable.proxy_off() && std::ptr::eq(p, &system.rail_proxy));
        if !replaced && !p.is_running() {
            let result = p.restart();
            say(
                verbose,
                format!(
                    "supervisor: {} had exited; restart {}",
                    p.name(),
                    if result.is_ok() { "ok" } else { "failed" }
                ),
            );
        }
    }
}

/// A blocking step of a fault (a process, a volume, `etcdctl`) run without stalling the runtime.
pub(super) fn blocking<T>(f: impl FnOnce() -> anyhow::Result<T>) -> anyhow::Result<T> {
    tokio::task::block_in_place(f)
}

async fn bounce(process: &ManagedProcess, down_ms: u64) -> anyhow::Result<()> {
    blocking(|| process.kill())?;
    tokio::time::sleep(Duration::from_millis(down_ms)).await;
    blocking(|| process.restart())
}

/// Runs the schedule; every fault is healed before the next one starts (a kill is followed by
/// a restart, a pause by a resume), so at most one component is down at a time.
pub async fn execute(
    stack: &Stack,
    system: &mut System,
    schedule: &Schedule,
    targets: &mut Targets<'_>,
    disable: DisableGuard,
    verbose: bool,
    begun: Option<tokio::sync::watch::Sender<usize>>,
) -> Outcome {
    let start = Instant::now();
    let mut outcome = Outcome::default();
    for (i, fault) in schedule.faults.iter().enumerate() {
        let due = start + Duration::from_millis(fault.at_ms);
        tokio::time::sleep_until(due.into()).await;
        if let Some(begun) = &begun {
            begun.send_replace(i + 1);
        }
        let result = inject(stack, system, fault, targets, &mut outcome).await;
        let line = format!(
            "t+{:>6} ms {} {}",
            start.elapsed().as_millis(),
            fault.kind.name(),
            match &result {
                Ok(what) => what.clone(),
                Err(e) => format!("FAILED: {e:#}"),
            }
        );
        say(verbose, &line);
        supervise(system, &targets.more_processes(stack), disable, verbose);
        match result {
            Ok(_) => {
                *outcome
                    .injected
                    .entry(fault.kind.name().to_string())
                    .or_default() += 1
            }
            Err(_) => outcome.errors.push(line),
        }
    }
    outcome
}

async fn inject(
    stack: &Stack,
    system: &mut System,
    fault: &Fault,
    targets: &mut Targets<'_>,
    outcome: &mut Outcome,
) -> anyhow::Result<String> {
    let work = targets.work;
    let worker = || {
        system
            .workers
            .get(fault.worker)
            .ok_or_else(|| anyhow::anyhow!("no worker {}", fault.worker))
    };
    match fault.kind {
        FaultKind::WorkerKill => {
            let w = worker()?;
            bounce(w, fault.down_ms).await?;
            Ok(format!("{} killed and restarted", w.name()))
        }
        FaultKind::WorkerPause => {
            let w = worker()?;
            w.pause()?;
            tokio::time::sleep(Duration::from_millis(fault.down_ms)).await;
            w.resume()?;
            Ok(format!(
                "{} paused {} ms (lease {} ms)",
                w.name(),
                fault.down_ms,
                WORKER_LOCK_TTL_MS
            ))
        }
        FaultKind::LockServerKill => bounce(&system.lock_server, fault.down_ms)
            .await
            .map(|_| "lock-server bounced".into()),
        FaultKind::PaymentResourceKill => bounce(&system.payment_resource, fault.down_ms)
            .await
            .map(|_| "payment-resource bounced".into()),
        FaultKind::RailProxyKill => bounce(&system.rail_proxy, fault.down_ms)
            .await
            .map(|_| "rail-proxy bounced".into()),
        FaultKind::DispatcherKill => bounce(&system.dispatcher, fault.down_ms)
            .await
            .map(|_| "dispatcher bounced".into()),
        FaultKind::GeneralLedgerKill => bounce(&system.general_ledger, fault.down_ms)
            .await
            .map(|_| "general-ledger bounced".into()),
        FaultKind::EtcdLeaderKill => {
            let leader = stack.etcd.leader().await?;
            let member = &stack.etcd.members[leader];
            blocking(|| member.process.kill())?;
            tokio::time::sleep(Duration::from_millis(fault.down_ms)).await;
            blocking(|| member.restart())?;
            Ok(format!("etcd leader {} killed and restarted", member.name))
        }
        FaultKind::PgMainRestart => pg_restart(&stack.main)
            .await
            .map(|_| "main PostgreSQL restarted".into()),
        FaultKind::PgProxyRestart => pg_restart(&stack.proxy)
            .await
            .map(|_| "proxy PostgreSQL restarted".into()),
        FaultKind::ForceRevoke => force_revoke(system, fault, work, outcome).await,
        FaultKind::WorkerPartition => {
            let ns = network_host(targets, fault)?;
            let port = system.ports.lock_server;
            blocking(|| ns.cut(port))?;
            tokio::time::sleep(Duration::from_millis(fault.down_ms)).await;
            blocking(|| ns.heal(port))?;
            Ok(format!(
                "worker-{} cut from the lock-server for {} ms (lease {} ms); guards reachable",
                fault.worker, fault.down_ms, WORKER_LOCK_TTL_MS
            ))
        }
        FaultKind::EtcdRestore => etcd_restore(stack, system, fault, true, targets, outcome).await,
        FaultKind::EtcdRestoreWithoutProcedure => {
            etcd_restore(stack, system, fault, false, targets, outcome).await
        }
        FaultKind::OutboxRedeliver => outbox_redeliver(system, fault, outcome).await,
        FaultKind::StaleHolder => plant_stale_holder(system, targets, outcome).await,
        FaultKind::TemporalKill
        | FaultKind::TemporalAmnesiaDeleted
        | FaultKind::TemporalAmnesiaOldCopy => {
            let line =
                super::temporal::inject(stack, system, fault, targets.reconciler, work, outcome)
                    .await?;
            // With routing by version, Temporal's lost state is also its routing.
            match targets
                .deployment
                .keep_routing(stack, &system.workers)
                .await?
            {
                Some(repaired) => Ok(format!("{line}; {repaired}")),
                None => Ok(line),
            }
        }
        FaultKind::ClockJump => super::clock::inject(system, fault, targets.disable).await,
        FaultKind::RollingRestart => {
            super::rolling::restart_all(system, targets.reconciler, targets.disable).await
        }
        FaultKind::DiskFullPgMain => {
            super::disk::pg_full(stack, system, testkit::PgServer::Main, fault, outcome).await
        }
        FaultKind::DiskFullPgProxy => {
            super::disk::pg_full(stack, system, testkit::PgServer::Proxy, fault, outcome).await
        }
        FaultKind::DiskFullEtcdMember => super::disk::etcd_member_full(stack, fault, outcome).await,
        FaultKind::EtcdNospace => super::disk::etcd_nospace(stack, system, fault, outcome).await,
        FaultKind::UpgradeRollout => {
            let target = super::rollout::Target {
                deployment: targets.deployment,
                partitions: &mut *targets.partitions,
                stall_dir: targets.stall_dir,
                without_drain: targets.rollout_without_drain,
            };
            super::rollout::inject(stack, system, target, outcome).await
        }
        FaultKind::AnswerLossPaymentResource => {
            super::answer_loss::worker_payment_resource(
                system,
                targets.stall_dir,
                targets.partitions,
                outcome,
            )
            .await
        }
        FaultKind::AnswerLossRailProxy => {
            super::answer_loss::worker_rail_proxy(
                system,
                targets.stall_dir,
                targets.partitions,
                outcome,
            )
            .await
        }
        FaultKind::AnswerLossRail => super::answer_loss::rail(system, outcome).await,
        FaultKind::DispatcherGlPartition => super::answer_loss::dispatcher_gl(system, fault).await,
        FaultKind::RailFaults => {
            let mut rng = rand::rngs::StdRng::seed_from_u64(fault.seed);
            let intensity = rng.random_range(0.5..3.0);
            let config = super::workload::rail_faults(fault.seed, intensity);
            rail_stub::client::StubClient::new(system.rail_stub_endpoints())
                .expect("the harness's rail client")
                .set_faults(&config)
                .await
                .map_err(|e| anyhow::anyhow!("{e}"))?;
            Ok(format!("rail fault intensity {intensity:.2}"))
        }
    }
}

/// The network namespace of the fault's worker slot (a rollout puts its new worker's there).
fn network_host<'t>(
    targets: &'t Targets<'_>,
    fault: &Fault,
) -> anyhow::Result<&'t testkit::netns::NetNs> {
    targets
        .partitions
        .get(fault.worker)
        .and_then(Option::as_ref)
        .ok_or_else(|| anyhow::anyhow!("worker-{} has no network host", fault.worker))
}

/// A fast shutdown lets PostgreSQL stop within this even with clients connected.
const PG_STOP_TIMEOUT: Duration = Duration::from_secs(30);

/// A PostgreSQL restart: fast shutdown (SIGINT: clients are disconnected, in-flight transactions
/// roll back), then the same server on the same data. A smart shutdown would wait for every
/// pooled client to leave, which they never do.
async fn pg_restart(pg: &testkit::postgres::Postgres) -> anyhow::Result<()> {
    let process = &pg.process;
    let pid = process
        .pid()
        .ok_or_else(|| anyhow::anyhow!("{} is not running", process.name()))?;
    let status = std::process::Command::new("kill")
        .args(["-INT", &pid.to_string()])
        .status()?;
    anyhow::ensure!(status.success(), "kill -INT {pid} failed");
    testkit::eventually(
        PG_STOP_TIMEOUT,
        &format!("{} to stop", process.name()),
        || async { (!process.is_running()).then_some(()) },
    )
    .await?;
    blocking(|| pg.restart())
}

/// Revokes the lock of an account that has a payout in flight (a random account if none has).
async fn force_revoke(
    system: &System,
    fault: &Fault,
    work: &Workload,
    outcome: &mut Outcome,
) -> anyhow::Result<String> {
    let paydb = super::one_connection(&system.databases.paydb).await?;
    // Accounts with a payout in flight first (their lock is most likely held), then the rest.
    let mut candidates: Vec<String> = sqlx::query_scalar(
        "SELECT DISTINCT account_id FROM payout WHERE state IN ('CLAIMED', 'RAIL_SUBMITTED') ORDER BY account_id",
    )
    .fetch_all(&paydb)
    .await?;
    testkit::util::close_pool(paydb).await;
    let in_flight = candidates.len();
    let mut rng = rand::rngs::StdRng::seed_from_u64(fault.seed);
    for i in (1..candidates.len()).rev() {
        candidates.swap(i, rng.random_range(0..=i));
    }
    let mut rest: Vec<String> = work
        .accounts
        .iter()
        .map(|a| a.as_str().to_string())
        .collect();
    for i in (1..rest.len()).rev() {
        rest.swap(i, rng.random_range(0..=i));
    }
    candidates.extend(rest);
    let lock =
        lock_client::LockClient::connect(&system.lock_url(), &system.tls(Role::Operator)).await?;
    let mut last = None;
    for account in candidates.iter().take(REVOKE_CANDIDATES_MAX) {
        let key = format!("payout:{account}");
        // As an operator does: look, then revoke the grant looked at (a later one is refused).
        let expected = match lock.describe(&key).await {
            Ok(d) if d.held => match lock_client::FencingToken::new(d.token) {
                Ok(token) => token,
                Err(e) => {
                    last = Some(format!("{key}: {e}"));
                    continue;
                }
            },
            Ok(_) => {
                last = Some(format!("{key} is not held"));
                continue;
            }
            Err(e) => {
                last = Some(e.to_string());
                continue;
            }
        };
        match revoke(
            &lock,
            &key,
            expected,
            "nemesis: operator revokes a lock during a payout",
            outcome,
        )
        .await
        {
            Ok((owner, token)) => {
                return Ok(format!(
                    "{key} revoked from {owner} (token {token}; {in_flight} accounts in flight)"
                ));
            }
            Err(e) => last = Some(e.to_string()),
        }
    }
    Err(last.map_or_else(
        || anyhow::anyhow!("no account to revoke"),
        |e| anyhow::anyhow!("no held lock found: {e}"),
    ))
}

/// An operator's force-revoke of `key` from the grant of `expected`, recorded with its send and
/// answer times so the checker pairs it with the grant it took: the deposed owner and token.
async fn revoke(
    lock: &lock_client::LockClient,
    key: &str,
    expected: lock_client::FencingToken,
    reason: &str,
    outcome: &mut Outcome,
) -> anyhow::Result<(String, u64)> {
    let sent_ns = lock_client::history::monotonic_ns(Instant::now());
    let answer = lock
        .force_revoke(key, expected, testkit::pki::TEST_OPERATOR, reason)
        .await?;
    outcome.revokes.push(super::checker::Revoke {
        key: key.to_string(),
        revoked_token: answer.revoked_token,
        sent_ns,
        answered_ns: lock_client::history::monotonic_ns(Instant::now()),
    });
    Ok((answer.revoked_owner, answer.revoked_token))
}

/// Above the highest token seen when the restore procedure advances the revision: room for
/// tokens minted while the old revision was read (production uses a far larger margin).
const RESTORE_REVISION_MARGIN: i64 = 100;
/// How long a restore's probe may wait for a definite answer while the cluster comes back.
const RESTORE_PROBE_TIMEOUT: Duration = Duration::from_secs(30);
/// Beyond the lease TTL, so that every client's local deadline has passed for sure.
const DEADLINE_SLACK_MS: u64 = 500;

enum Probe {
    Granted(u64),
    /// The lock-server's `token_regression` refusal, as it described it.
    Refused(String),
}

/// Acquires and releases the probe key once: a grant's token, or the lock-server's typed refusal.
/// Transport errors (the cluster or the lock-server coming back) are retried, bounded.
async fn probe(system: &System, key: &str) -> anyhow::Result<Probe> {
    let give_up = Instant::now() + RESTORE_PROBE_TIMEOUT;
    let mut last = String::new();
    while Instant::now() < give_up {
        let attempt = async {
            let lock =
                lock_client::LockClient::connect(&system.lock_url(), &system.tls(Role::Worker))
                    .await?;
            let session = lock
                .open_session("chaos-restore-probe", Duration::from_secs(10))
                .await?;
            let answer = session.acquire(key, Duration::from_secs(3)).await;
            let _ = session.close().await;
            answer
        };
        match attempt.await {
            Ok(lock_client::Acquired::Granted(g)) => return Ok(Probe::Granted(g.token().get())),
            Ok(lock_client::Acquired::NotAcquired { holder_owner, .. }) => {
                last = format!("held by {holder_owner}")
            }
            Err(lock_client::ClientError::Rejected {
                kind: lock_client::Rejection::TokenRegression(t),
                ..
            }) => return Ok(Probe::Refused(format!("{t:?}"))),
            Err(e) => last = e.to_string(),
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    anyhow::bail!("no definite answer for {key} within {RESTORE_PROBE_TIMEOUT:?}: {last}")
}

async fn max_token(url: &str, sql: &str) -> anyhow::Result<i64> {
    let pool = super::one_connection(url).await?;
    let v: Option<i64> = sqlx::query_scalar(sql).fetch_one(&pool).await?;
    testkit::util::close_pool(pool).await;
    Ok(v.unwrap_or(0))
}

/// Steps 2 and 5-7 of the etcd procedure (`services/lock-server/RESTORE.md`), with the
/// lock-server already stopped at `stopped`: the revision advanced past every token seen, the
/// restored leases revoked, every client's local deadline passed, the lock-server started.
async fn restore_procedure(
    stack: &Stack,
    system: &System,
    revision_before: i64,
    stopped: Instant,
) -> anyhow::Result<i64> {
    let fences = max_token(&system.databases.paydb, "SELECT max(fence) FROM account").await?;
    let high_waters = max_token(
        &system.databases.proxydb,
        "SELECT max(high_water) FROM account_high_water",
    )
    .await?;
    let highest_seen = revision_before.max(fences).max(high_waters) + RESTORE_REVISION_MARGIN;
    let reached = stack.etcd.advance_revision_past(highest_seen).await?;
    stack.etcd.revoke_session_leases().await?;
    let all_deadlines_passed =
        stopped + Duration::from_millis(WORKER_LOCK_TTL_MS + DEADLINE_SLACK_MS);
    tokio::time::sleep_until(all_deadlines_passed.into()).await;
    blocking(|| system.lock_server.restart())?;
    testkit::system::wait_grpc(
        system.ports.lock_server,
        &system.lock_server,
        &system.tls(Role::Reconciler),
        Role::LockServer,
    )
    .await?;
    Ok(reached)
}

/// etcd restored from a snapshot `down_ms` old, with or without the procedure. A probe grant
/// minted just before the disaster has the highest token of its key; after the restore the
/// probe asks again: with the procedure it must get a HIGHER token; without it the lock-server
/// must refuse the rewound one (`token_regression`), after which the operator applies the
/// procedure.
async fn etcd_restore(
    stack: &Stack,
    system: &System,
    fault: &Fault,
    procedure: bool,
    targets: &Targets<'_>,
    outcome: &mut Outcome,
) -> anyhow::Result<String> {
    let snapshot = system.dir.join(format!("etcd-snapshot-{}.db", fault.at_ms));
    let snapshot_ns = lock_client::history::monotonic_ns(Instant::now());
    let snapshot_revision = blocking(|| stack.etcd.snapshot(&snapshot))?;
    let rolled_back = |outcome: &mut Outcome| {
        outcome.restores.push(super::checker::Restore {
            snapshot_ns,
            restore_ns: lock_client::history::monotonic_ns(Instant::now()),
        })
    };
    tokio::time::sleep(Duration::from_millis(fault.down_ms)).await;
    let key = format!("payout:chaos-restore-probe-{}", fault.at_ms);
    let Probe::Granted(before) = probe(system, &key).await? else {
        anyhow::bail!("the probe was refused before any restore");
    };
    let revision_before = stack.etcd.revision().await?;
    if procedure {
        blocking(|| system.lock_server.kill())?;
        let stopped = Instant::now();
        rolled_back(outcome);
        blocking(|| stack.etcd.restore_from_snapshot(&snapshot))?;
        let reached = restore_procedure(stack, system, revision_before, stopped).await?;
        match probe(system, &key).await? {
            Probe::Granted(after) if after > before => Ok(format!(
                "snapshot at revision {snapshot_revision}, cluster at {revision_before}: restored, \
                 advanced to {reached}; probe token {before} -> {after}"
            )),
            Probe::Granted(after) => {
                let line =
                    format!("after the procedure the probe got token {after}, not above {before}");
                outcome.regression_alarms_missed.push(line.clone());
                anyhow::bail!(line)
            }
            Probe::Refused(why) => {
                anyhow::bail!("after the procedure the probe was still refused: {why}")
            }
        }
    } else {
        rolled_back(outcome);
        blocking(|| stack.etcd.restore_from_snapshot(&snapshot))?;
        if targets.lose_issued_tokens {
            // The negative control: the lock-server's memory of issued tokens is restored (lost)
            // together with the backend, which RESTORE.md forbids. Nothing is left to notice.
            blocking(|| system.lock_server.kill())?;
            std::fs::remove_file(system.dir.join(testkit::system::ISSUED_TOKENS_FILE))?;
            blocking(|| system.lock_server.restart())?;
            testkit::system::wait_grpc(
                system.ports.lock_server,
                &system.lock_server,
                &system.tls(Role::Reconciler),
                Role::LockServer,
            )
            .await?;
        }
        let verdict = probe(system, &key).await;
        // Whatever the verdict, the operator now applies the procedure so the run can go on.
        blocking(|| system.lock_server.kill())?;
        let stopped = Instant::now();
        let reached = restore_procedure(stack, system, revision_before, stopped).await?;
        match verdict? {
            Probe::Refused(why) => {
                outcome.regression_alarms_fired += 1;
                Ok(format!(
                    "snapshot at revision {snapshot_revision}, cluster at {revision_before}: restored \
                     without the procedure; token_regression refused the rewound grant ({why}); \
                     procedure applied (revision {reached})"
                ))
            }
            Probe::Granted(after) if after <= before => {
                let line = format!(
                    "restore without the procedure: rewound token {after} GRANTED for {key} (issued {before} before)"
                );
                outcome.regression_alarms_missed.push(line.clone());
                anyhow::bail!(line)
            }
            Probe::Granted(after) => anyhow::bail!(
                "inconclusive: the rewound cluster already passed {before} (got {after})"
            ),
        }
    }
}

/// Rows of the outbox handed back for one more delivery at most.
const REDELIVER_ROWS_MAX: i64 = 10;

/// Some delivered outbox rows are marked undelivered again, as if the dispatcher had died after
/// the GL committed and before it recorded the delivery: the next delivery is a duplicate.
async fn outbox_redeliver(
    system: &System,
    fault: &Fault,
    outcome: &mut Outcome,
) -> anyhow::Result<String> {
    let paydb = super::one_connection(&system.databases.paydb).await?;
    let rows = 1 + (fault.seed % REDELIVER_ROWS_MAX as u64) as i64;
    let ids: Vec<i64> = sqlx::query_scalar(
        "UPDATE ledger_outbox SET delivered_at = NULL, journal_id = NULL, next_attempt_at = now(), \
         claimed_by = NULL, claim_expires_at = NULL \
         WHERE id IN (SELECT id FROM ledger_outbox WHERE delivered_at IS NOT NULL \
                      ORDER BY md5(idempotency_key || $1) LIMIT $2) RETURNING id",
    )
    .bind(fault.seed.to_string())
    .bind(rows)
    .fetch_all(&paydb)
    .await?;
    testkit::util::close_pool(paydb).await;
    anyhow::ensure!(!ids.is_empty(), "no delivered outbox row yet");
    outcome.outbox_rows_redelivered += ids.len() as u64;
    Ok(format!("{} delivered outbox rows queued again", ids.len()))
}

/// Arms a stall point for one step, waits for a worker to take it, and pauses that worker past
/// its lease: the grant it checked is gone, and the workflow carries on under a new grant. A task
/// then releases the stalled call once a successor's write has landed at the guard the call goes
/// to, so the call is stale when it arrives whatever the machine's speed, and records the
/// guard's answer.
async fn plant_stale_holder(
    system: &System,
    targets: &Targets<'_>,
    outcome: &mut Outcome,
) -> anyhow::Result<String> {
    let attempt = outcome.plant_attempts;
    let step = STALE_STEPS[attempt % STALE_STEPS.len()];
    let method = PLANT_METHODS[attempt / STALE_STEPS.len() % PLANT_METHODS.len()];
    outcome.plant_attempts += 1;
    let dir = targets.stall_dir;
    let (identity, payout) = take_stall(dir, step, PLANT_STALL_MAX).await?;
    // By identity among whoever runs now (a rollout gives each build's workers their own).
    let worker = system
        .workers
        .iter()
        .find(|w| w.name() == format!("payout-{identity}"))
        .ok_or_else(|| anyhow::anyhow!("stall taken by a worker not running now: {identity}"))?;
    let token_file = dir.join(format!("{step}.token.{payout}"));
    let read_token = || async {
        testkit::eventually(
            Duration::from_secs(5),
            "the planted holder's token",
            || async {
                std::fs::read_to_string(&token_file)
                    .ok()?
                    .trim()
                    .parse::<i64>()
                    .ok()
            },
        )
        .await
    };
    let token = match method {
        PlantMethod::Pause => {
            blocking(|| worker.pause())?;
            tokio::time::sleep(Duration::from_millis(PLANT_PAUSE_MS)).await;
            blocking(|| worker.resume())?;
            read_token().await?
        }
        PlantMethod::Revoke => {
            let token = read_token().await?;
            revoke_planted(system, &payout, token, outcome).await?;
            token
        }
    };
    let watch = PlantWatch {
        method,
        step: step.to_string(),
        worker_pid: worker.pid(),
        worker: identity.clone(),
        payout: payout.clone(),
        token,
        dir: dir.to_path_buf(),
        paydb: system.databases.paydb.clone(),
        proxydb: (!targets.disable.proxy_off()).then(|| system.databases.proxydb.clone()),
    };
    // The plant is healed, as every fault is before the next, once its call has reached the
    // guard and been answered: another fault meanwhile (a worker's exit when Temporal or a guard
    // goes away under it, a restart) could take the frozen call with it and the guard would never
    // see it.
    let plant = watch.run().await;
    let line = format!(
        "{identity} stalled before {step} of {payout} with token {token}, {}; released after a successor's write; the guard answered: {}",
        match method {
            PlantMethod::Pause =>
                format!("paused {PLANT_PAUSE_MS} ms (lease {WORKER_LOCK_TTL_MS} ms)"),
            PlantMethod::Revoke => "its grant force-revoked by an operator".to_string(),
        },
        plant.answer.as_deref().unwrap_or("(no answer)")
    );
    outcome.plants.push(plant);
    Ok(line)
}

/// Arms the stall point before `step` (`super::super::stall`: the first worker whose grant check
/// for `step` passes waits there, at most `stall`, for its release) and waits until a worker has
/// taken it, at most [`PLANT_TAKE_TIMEOUT`]: the taker's identity and the payout. Stalls are taken
/// one at a time (faults run one after another): whatever an earlier one of this step left is
/// cleared first, so the next taken file is this one's.
pub(super) async fn take_stall(
    dir: &std::path::Path,
    step: &str,
    stall: Duration,
) -> anyhow::Result<(String, String)> {
    let taken_prefix = format!("{step}.taken.");
    let taken_files = |dir: &std::path::Path| -> std::io::Result<Vec<String>> {
        Ok(std::fs::read_dir(dir)?
            .filter_map(|e| e.ok()?.file_name().into_string().ok())
            .filter(|n| n.starts_with(&taken_prefix))
            .collect())
    };
    for old in taken_files(dir)? {
        std::fs::remove_file(dir.join(old))?;
    }
    let armed = dir.join(format!("{step}.armed"));
    std::fs::write(&armed, stall.as_millis().to_string())?;
    let give_up = Instant::now() + PLANT_TAKE_TIMEOUT;
    let taken = loop {
        if let Some(name) = taken_files(dir)?.into_iter().next() {
            break name[taken_prefix.len()..].to_string();
        }
        if Instant::now() >= give_up && std::fs::remove_file(&armed).is_ok() {
            anyhow::bail!("no payout reached {step} within {PLANT_TAKE_TIMEOUT:?}");
        }
        // Not removable and not taken: a worker renamed it this instant; the next look finds it.
        anyhow::ensure!(
            Instant::now() < give_up + PLANT_TAKE_TIMEOUT,
            "the armed stall point of {step} vanished without a taker"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let (identity, payout) = taken.split_once('.').expect("checked above");
    Ok((identity.to_string(), payout.to_string()))
}

/// Lets the call stalled before `step` of `payout` go on ([`take_stall`]).
pub(super) fn release_stall(
    dir: &std::path::Path,
    step: &str,
    payout: &str,
) -> std::io::Result<()> {
    std::fs::write(dir.join(format!("{step}.release.{payout}")), b"")
}

/// Whether process `pid` still runs (not gone, not a zombie awaiting its reaping).
fn process_alive(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|stat| {
        // The state follows the command's closing parenthesis: "pid (comm) S ...".
        stat.rsplit_once(')')
            .and_then(|(_, rest)| rest.trim_start().chars().next())
            .is_some_and(|state| state != 'Z' && state != 'X')
    })
}

/// An operator's force-revoke of the planted holder's grant (its account's key, the token it
/// checked): the holder goes on running, frozen in its call, while a successor is granted.
async fn revoke_planted(
    system: &System,
    payout: &str,
    token: i64,
    outcome: &mut Outcome,
) -> anyhow::Result<()> {
    let paydb = super::one_connection(&system.databases.paydb).await?;
    let account: String = sqlx::query_scalar("SELECT account_id FROM payout WHERE id = $1")
        .bind(payout)
        .fetch_one(&paydb)
        .await?;
    testkit::util::close_pool(paydb).await;
    let expected = lock_client::FencingToken::new(u64::try_from(token)?)?;
    let lock =
        lock_client::LockClient::connect(&system.lock_url(), &system.tls(Role::Operator)).await?;
    revoke(
        &lock,
        &format!("payout:{account}"),
        expected,
        "nemesis: operator revokes the grant of a holder frozen in its call",
        outcome,
    )
    .await?;
    Ok(())
}

/// Releases one planted call once it is stale, and collects the guard's answer.
struct PlantWatch {
    method: PlantMethod,
    step: String,
    /// The planted worker's process: whether it still runs when no answer came.
    worker_pid: Option<u32>,
    worker: String,
    payout: String,
    token: i64,
    dir: std::path::PathBuf,
    paydb: String,
    /// Where the proxy records its high-water, when the proxy's guard runs.
    proxydb: Option<String>,
}

impl PlantWatch {
    async fn run(self) -> Plant {
        let mut plant = Plant {
            method: self.method.name().to_string(),
            step: self.step.clone(),
            worker: self.worker.clone(),
            payout: self.payout.clone(),
            token: self.token,
            successor_token: None,
            answer: None,
            problem: None,
            worker_exited: false,
        };
        let deadline = Instant::now() + PLANT_STALL_MAX;
        while Instant::now() < deadline {
            // A database may be restarting (another fault): a failed look is looked again.
            match self.successor_token().await {
                Ok(Some(t)) => {
                    plant.successor_token = Some(t);
                    break;
                }
                Ok(None) | Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
            }
        }
        if plant.successor_token.is_none() {
            plant.problem = Some(format!(
                "no successor wrote at the guard within {PLANT_STALL_MAX:?}; the call went on its own"
            ));
        } else if let Err(e) = release_stall(&self.dir, &self.step, &self.payout) {
            plant.problem = Some(format!("releasing the planted call: {e}"));
        }
        let answer_file = self
            .dir
            .join(format!("{}.answer.{}", self.step, self.payout));
        // Released, or past the worker's own bound: either way the call goes now.
        let give_up = Instant::now() + PLANT_ANSWER_WAIT;
        while Instant::now() < give_up {
            if let Ok(answer) = std::fs::read_to_string(&answer_file) {
                plant.answer = Some(answer);
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        if plant.answer.is_none() {
            plant.worker_exited = self.worker_pid.is_none_or(|pid| !process_alive(pid));
            if plant.worker_exited && plant.problem.is_none() {
                plant.problem = Some(format!(
                    "{} exited with the planted call (restarted by the supervisor)",
                    self.worker
                ));
            }
        }
        plant
    }

    /// The token a later grant left at the guard this call goes to, if it is above the planted
    /// one: MarkSubmitted meets paydb's account fence (advanced by any write, with or without
    /// its predicate); Submit meets the proxy's high-water (advanced by the successor's fenced
    /// inquiry), or, with the proxy's guard off, nothing: then the payout's resolution in paydb
    /// (after the successor's inquiry) is the sign, and its fence is the token.
    async fn successor_token(&self) -> anyhow::Result<Option<i64>> {
        let paydb = super::one_connection(&self.paydb).await?;
        let (account, fence, state): (String, i64, String) = sqlx::query_as(
            "SELECT a.id, a.fence, p.state FROM payout p JOIN account a ON a.id = p.account_id WHERE p.id = $1",
        )
        .bind(&self.payout)
        .fetch_one(&paydb)
        .await?;
        testkit::util::close_pool(paydb).await;
        let seen = match (self.step.as_str(), &self.proxydb) {
            ("submit", Some(proxydb)) => {
                let proxydb = super::one_connection(proxydb).await?;
                let high_water: Option<i64> = sqlx::query_scalar(
                    "SELECT high_water FROM account_high_water WHERE account_id = $1",
                )
                .bind(&account)
                .fetch_optional(&proxydb)
                .await?;
                testkit::util::close_pool(proxydb).await;
                high_water
            }
            ("submit", None) => {
                matches!(state.as_str(), "FAILED" | "POSTED" | "ABANDONED").then_some(fence)
            }
            _ => Some(fence),
        };
        Ok(seen.filter(|t| *t > self.token))
    }
}
