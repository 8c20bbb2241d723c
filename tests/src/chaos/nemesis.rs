//! The nemesis: a seeded schedule of faults (the same seed gives the same schedule: times, kinds
//! and targets), executed while the payouts run.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

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
}

impl FaultKind {
    pub const ALL: [FaultKind; 12] = [
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
        }
    }
    /// Relative frequency: the worker and lock faults are the ones the guards exist for.
    fn weight(self) -> u32 {
        match self {
            FaultKind::WorkerKill | FaultKind::ForceRevoke => 3,
            FaultKind::WorkerPause | FaultKind::RailFaults => 2,
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
    ) -> Self {
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed ^ 0x6e65_6d65_7369_7321);
        let kinds: Vec<FaultKind> = FaultKind::ALL
            .into_iter()
            .filter(|k| !(disable.fence_off() && *k == FaultKind::PaymentResourceKill))
            .filter(|k| !(disable.proxy_off() && *k == FaultKind::RailProxyKill))
            .filter(|k| workers > 0 || !matches!(k, FaultKind::WorkerKill | FaultKind::WorkerPause))
            .collect();
        let total: u32 = kinds.iter().map(|k| k.weight()).sum();
        let window_ms = window.as_millis().max(1) as u64;
        let mut faults: Vec<Fault> = (0..count)
            .map(|i| {
                let mut pick = rng.random_range(0..total);
                // Every kind once first (when there are enough faults), then by weight.
                let kind = if i < kinds.len() {
                    kinds[i]
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
                    FaultKind::WorkerPause => WORKER_LOCK_TTL_MS + rng.random_range(1_000..3_000),
                    FaultKind::EtcdLeaderKill => rng.random_range(500..2_000),
                    _ => rng.random_range(100..1_500),
                };
                Fault {
                    at_ms: rng.random_range(0..window_ms),
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
                    FaultKind::WorkerKill | FaultKind::WorkerPause => {
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
}

/// The harness plays the supervisor a deployment has (systemd, Kubernetes): a service process
/// that exited (e.g. it could not reach its database while PostgreSQL restarted) is started
/// again. Services replaced by in-process ones (a disabled guard) are left alone.
pub fn supervise(system: &System, disable: DisableGuard, verbose: bool) {
    for p in system.processes() {
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

fn blocking<T>(f: impl FnOnce() -> anyhow::Result<T>) -> anyhow::Result<T> {
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
    system: &System,
    schedule: &Schedule,
    work: &Workload,
    disable: DisableGuard,
    verbose: bool,
) -> Outcome {
    let start = Instant::now();
    let mut outcome = Outcome::default();
    for fault in &schedule.faults {
        let due = start + Duration::from_millis(fault.at_ms);
        tokio::time::sleep_until(due.into()).await;
        let result = inject(stack, system, fault, work).await;
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
        supervise(system, disable, verbose);
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
    system: &System,
    fault: &Fault,
    work: &Workload,
) -> anyhow::Result<String> {
    let worker = || {
        system
            .workers
            .get(fault.worker)
            .ok_or_else(|| anyhow::anyhow!("no worker {}", fault.worker))
    };
    match fault.kind {
        FaultKind::WorkerKill => {
            bounce(worker()?, fault.down_ms).await?;
            Ok(format!("worker-{} killed and restarted", fault.worker))
        }
        FaultKind::WorkerPause => {
            let w = worker()?;
            w.pause()?;
            tokio::time::sleep(Duration::from_millis(fault.down_ms)).await;
            w.resume()?;
            Ok(format!(
                "worker-{} paused {} ms (lease {} ms)",
                fault.worker, fault.down_ms, WORKER_LOCK_TTL_MS
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
        FaultKind::ForceRevoke => force_revoke(system, fault, work).await,
        FaultKind::RailFaults => {
            let mut rng = rand::rngs::StdRng::seed_from_u64(fault.seed);
            let intensity = rng.random_range(0.5..3.0);
            let config = super::workload::rail_faults(fault.seed, intensity);
            rail_stub::client::StubClient::new(system.rail_url())
                .set_faults(&config)
                .await
                .map_err(|e| anyhow::anyhow!("{e}"))?;
            Ok(format!("rail fault intensity {intensity:.2}"))
        }
    }
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
async fn force_revoke(system: &System, fault: &Fault, work: &Workload) -> anyhow::Result<String> {
    let paydb = sqlx::postgres::PgPoolOptions::new()
        .max_connections(1)
        .acquire_timeout(Duration::from_secs(3))
        .connect(&system.databases.paydb)
        .await?;
    // Accounts with a payout in flight first (their lock is most likely held), then the rest.
    let mut candidates: Vec<String> = sqlx::query_scalar(
        "SELECT DISTINCT account_id FROM payout WHERE state IN ('CLAIMED', 'RAIL_SUBMITTED') ORDER BY account_id",
    )
    .fetch_all(&paydb)
    .await?;
    paydb.close().await;
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
    let lock = lock_client::LockClient::connect(system.lock_url()).await?;
    let mut last = None;
    for account in candidates.iter().take(REVOKE_CANDIDATES_MAX) {
        let key = format!("payout:{account}");
        match lock
            .force_revoke(
                &key,
                "chaos-operator",
                "nemesis: operator revokes a lock during a payout",
            )
            .await
        {
            Ok(_) => return Ok(format!("{key} revoked ({in_flight} accounts in flight)")),
            Err(e) => last = Some(e),
        }
    }
    Err(last.map_or_else(
        || anyhow::anyhow!("no account to revoke"),
        |e| anyhow::anyhow!("no held lock found: {e}"),
    ))
}
