//! `upgrade_rollout` (issue 36, docs/design/fault-suite section 4): a worker-versioning rollout
//! mid-batch, as an operator does it (README, "Worker deployment"). The run's workers are
//! versioned from the start ([`Deployment`]: a deployment of the run's own, build `b1` current,
//! payout workflows pinned to the build that started them). The fault starts the next build's
//! workers beside the old ones, in the same shape (each on its own network host, its own lock
//! history, the shared stall dir), waits until Temporal knows the new version, makes it current
//! with the operator's command, waits (bounded) until no open workflow is left on the old version
//! (the operator's drain query), then stops the old workers with SIGTERM and puts the new ones in
//! their places in `system.workers`, so later faults act on them.
//!
//! The same binary serves every build: what is tested is the rollout (routing, pinning, the
//! drain), not a code change. Each build's workers have identities of their own
//! (`worker-<generation * workers + slot>`): a lock history file per process lifetime line, a
//! lock-session owner that the old build's still-open sessions do not share, and a stale-holder
//! plant finds its worker by that identity among whoever runs now.

use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use serde::Serialize;
use testkit::netns::NetNs;
use testkit::system::System;
use testkit::{ManagedProcess, Stack};

use super::nemesis::Outcome;

/// A started worker's version is known to Temporal once the worker has polled: within this on
/// a loaded machine (a worker starts, opens its lock session and polls in seconds).
const VERSION_VISIBLE_TIMEOUT: Duration = Duration::from_secs(60);
/// How long the old build may take to drain. A bound, not an expectation: a pinned payout
/// finishes in seconds unloaded, but one on a contended account waits for its key behind the
/// account's other payouts (polling), and on a machine whose two cores a build shares that has
/// been seen to take minutes (the planted holders' `PLANT_STALL_MAX` is 420 s for the same
/// reason).
pub const DRAIN_TIMEOUT: Duration = Duration::from_secs(600);
/// The drain query is asked again after this (one CLI call: cheap beside the drain itself).
const DRAIN_POLL: Duration = Duration::from_secs(1);
/// An empty drain query counts only once it is still empty this long after: Temporal's
/// visibility is written after the fact, so a workflow whose first task a build completed just
/// before the switch can be missing from the query for a moment. A CI-sized run saw it: the
/// query came back empty 0.1 s after the switch, the old workers were stopped, and a payout
/// pinned to the old build (its run started a moment before) had no worker left.
const DRAIN_CONFIRM: Duration = Duration::from_secs(5);
/// At most this many pinned payouts are named in a fault's error line.
const NAMED_MAX: usize = 10;

/// The run's worker deployment: its name, and which build is current.
pub struct Deployment {
    /// The run's own deployment name (no dots: Temporal joins name and build id with one).
    pub name: String,
    /// Workers per build.
    slots: usize,
    /// The current build's generation (0: the run's first build, `b1`).
    generation: AtomicUsize,
    /// Old builds' workers a rollout could not drain within [`DRAIN_TIMEOUT`]: left running (a
    /// payout pinned to them has nowhere else to go) until the run ends.
    undrained: Mutex<Vec<(ManagedProcess, Option<NetNs>)>>,
}

/// One rollout as it happened.
#[derive(Debug, Clone, Serialize)]
pub struct Rollout {
    /// `<deployment>.<build>` before and after.
    pub from: String,
    pub to: String,
    /// Payouts whose open workflow was on the old build when the new one became current.
    pub pinned_at_switch: Vec<String>,
    /// From the switch until the old build had no open workflow; `None`: not drained (the
    /// control, or the bound passed).
    pub drain_s: Option<f64>,
    /// The old build's workers were stopped (SIGTERM) after the drain, or without one (the
    /// control).
    pub old_stopped: bool,
}

impl Rollout {
    pub fn describe(&self) -> String {
        format!(
            "{} -> {}: {} payouts pinned to the old build at the switch; {}",
            self.from,
            self.to,
            self.pinned_at_switch.len(),
            match (self.drain_s, self.old_stopped) {
                (Some(s), _) => format!("drained in {s:.1}s, old workers stopped"),
                (None, true) => "old workers stopped WITHOUT a drain".to_string(),
                (None, false) => "NOT drained; old workers left running".to_string(),
            }
        )
    }
}

impl Deployment {
    /// The deployment of `system`'s run, `slots` workers per build, the first build current.
    pub fn new(system: &System, slots: usize) -> Self {
        Self {
            name: format!("chaos-{}", system.task_queue.replace(['.', '/', ':'], "-")),
            slots,
            generation: AtomicUsize::new(0),
            undrained: Mutex::new(Vec::new()),
        }
    }

    pub fn build_id(generation: usize) -> String {
        format!("b{}", generation + 1)
    }

    fn version(&self, generation: usize) -> String {
        format!("{}.{}", self.name, Self::build_id(generation))
    }

    /// The worker identity of `slot` in build `generation`.
    pub fn identity(&self, generation: usize, slot: usize) -> String {
        format!("worker-{}", generation * self.slots + slot)
    }

    pub fn current_generation(&self) -> usize {
        self.generation.load(Ordering::SeqCst)
    }

    /// Starts the worker of `slot` in build `generation`: versioned (routed by version), with
    /// its lock history under the checker's prefix and the run's stall dir, on a network host
    /// of its own when `network_host`.
    pub fn start_worker(
        &self,
        system: &System,
        generation: usize,
        slot: usize,
        stall_dir: &Path,
        network_host: bool,
    ) -> anyhow::Result<(ManagedProcess, Option<NetNs>)> {
        let identity = self.identity(generation, slot);
        let spec = system
            .worker_spec(&identity)
            .env(
                "PAYOUT_LOCK_HISTORY_PATH",
                system
                    .dir
                    .join(format!(
                        "{}{identity}.jsonl",
                        super::checker::LOCK_HISTORY_PREFIX
                    ))
                    .to_string_lossy(),
            )
            .env(crate::stall::STALL_DIR_ENV, stall_dir.to_string_lossy())
            .env("PAYOUT_WORKER_VERSIONING", "true")
            .env("PAYOUT_WORKER_DEPLOYMENT_NAME", self.name.clone())
            .env("PAYOUT_WORKER_BUILD_ID", Self::build_id(generation));
        let (spec, ns) = if network_host {
            let ns = tokio::task::block_in_place(NetNs::create)?;
            (ns.wrap(spec), Some(ns))
        } else {
            (spec, None)
        };
        let worker = tokio::task::block_in_place(|| ManagedProcess::start(spec))?;
        Ok((worker, ns))
    }

    /// The first build made current once its workers have polled (before any payout starts).
    pub async fn make_first_current(
        &self,
        stack: &Stack,
        workers: &[ManagedProcess],
    ) -> anyhow::Result<()> {
        let build = Self::build_id(self.current_generation());
        let workers: Vec<&ManagedProcess> = workers.iter().collect();
        wait_registered(stack, &self.name, &build, &workers).await?;
        set_current(stack, &self.name, &build)
    }

    /// After a Temporal fault: the current build is made current again if Temporal lost its
    /// routing with its state (a deleted database knows no deployment; its workers' next polls
    /// register the version again, but no version is current and new workflows would reach no
    /// versioned worker). The operator's step in RESTORE.md, "Temporal's state lost". `None`:
    /// the routing was intact.
    pub async fn keep_routing(
        &self,
        stack: &Stack,
        workers: &[ManagedProcess],
    ) -> anyhow::Result<Option<String>> {
        let build = Self::build_id(self.current_generation());
        let workers: Vec<&ManagedProcess> = workers.iter().collect();
        wait_registered(stack, &self.name, &build, &workers).await?;
        if current_build(stack, &self.name)?.as_deref() == Some(build.as_str()) {
            return Ok(None);
        }
        set_current(stack, &self.name, &build)?;
        Ok(Some(format!(
            "routing lost with Temporal's state: {} made current again",
            self.version(self.current_generation())
        )))
    }
}

fn temporal_cli(stack: &Stack, args: &[&str]) -> anyhow::Result<String> {
    let mut all = args.to_vec();
    all.extend(["--namespace", testkit::temporal::NAMESPACE]);
    let temporal = stack.try_temporal()?;
    tokio::task::block_in_place(|| temporal.cli(&all))
}

fn json(text: &str) -> anyhow::Result<serde_json::Value> {
    serde_json::from_str(text).map_err(|e| anyhow::anyhow!("not JSON ({e}): {text}"))
}

/// Waits until Temporal knows the version (its workers have polled).
async fn wait_registered(
    stack: &Stack,
    deployment: &str,
    build: &str,
    workers: &[&ManagedProcess],
) -> anyhow::Result<()> {
    testkit::eventually(
        VERSION_VISIBLE_TIMEOUT,
        &format!("Temporal knows {deployment}.{build}"),
        || async {
            temporal_cli(
                stack,
                &[
                    "worker",
                    "deployment",
                    "describe-version",
                    "--deployment-name",
                    deployment,
                    "--build-id",
                    build,
                ],
            )
            .ok()
            .map(|_| ())
        },
    )
    .await
    .map_err(|e| {
        let tails: Vec<String> = workers
            .iter()
            .map(|w| format!("{}:\n{}", w.name(), w.log_tail(10)))
            .collect();
        anyhow::anyhow!("{e}\n{}", tails.join("\n"))
    })
}

/// The deployment's current build as Temporal describes it.
fn current_build(stack: &Stack, deployment: &str) -> anyhow::Result<Option<String>> {
    let described = temporal_cli(
        stack,
        &[
            "worker",
            "deployment",
            "describe",
            "--name",
            deployment,
            "--output",
            "json",
        ],
    )?;
    Ok(json(&described)?["routingConfig"]["currentVersionBuildID"]
        .as_str()
        .map(str::to_string))
}

/// The operator's `set-current-version`, then checked in the deployment's description.
fn set_current(stack: &Stack, deployment: &str, build: &str) -> anyhow::Result<()> {
    temporal_cli(
        stack,
        &[
            "worker",
            "deployment",
            "set-current-version",
            "--deployment-name",
            deployment,
            "--build-id",
            build,
            "--yes",
        ],
    )?;
    let current = current_build(stack, deployment)?;
    anyhow::ensure!(
        current.as_deref() == Some(build),
        "{deployment} after set-current-version {build}: current is {current:?}"
    );
    Ok(())
}

/// The payouts whose workflow is open on the version: the operator's drain query (README,
/// "Worker deployment"), by Temporal's visibility.
fn open_on(stack: &Stack, deployment: &str, build: &str) -> anyhow::Result<Vec<String>> {
    let listed = temporal_cli(
        stack,
        &[
            "workflow",
            "list",
            "--query",
            &format!(
                "TemporalWorkerDeploymentVersion='{deployment}:{build}' AND ExecutionStatus='Running'"
            ),
            "--output",
            "json",
        ],
    )?;
    if listed.trim().is_empty() {
        return Ok(Vec::new());
    }
    let listed = json(&listed)?;
    let rows = listed
        .as_array()
        .ok_or_else(|| anyhow::anyhow!("the drain query gave no list: {listed}"))?;
    rows.iter()
        .map(|row| {
            let id = row["execution"]["workflowId"]
                .as_str()
                .ok_or_else(|| anyhow::anyhow!("a listed workflow without its id: {row}"))?;
            // Payout workflows are `payout-<payout id>` (payout_domain::workflow_id).
            Ok(id.strip_prefix("payout-").unwrap_or(id).to_string())
        })
        .collect()
}

/// A worker of either build that exited while the rollout waits is started again, as a
/// deployment's supervisor does (the nemesis's own supervisor only runs between faults).
fn supervise<'p>(workers: impl IntoIterator<Item = &'p ManagedProcess>) {
    for w in workers {
        if !w.is_running() {
            let _ = w.restart();
        }
    }
}

/// What the rollout acts on.
pub struct Target<'a> {
    pub deployment: &'a Deployment,
    /// Each worker slot's network host (replaced with the slot's worker).
    pub partitions: &'a mut [Option<NetNs>],
    pub stall_dir: &'a Path,
    /// TEST ONLY (the negative control): stop the old build's workers as soon as the new build
    /// is current, without waiting for the drain.
    pub without_drain: bool,
}

/// One rollout to the next build (see the module documentation).
pub async fn inject(
    stack: &Stack,
    system: &mut System,
    target: Target<'_>,
    outcome: &mut Outcome,
) -> anyhow::Result<String> {
    let deployment = target.deployment;
    let slots = system.workers.len();
    anyhow::ensure!(
        slots == deployment.slots && slots == target.partitions.len(),
        "{slots} workers for {} slots and {} network hosts",
        deployment.slots,
        target.partitions.len()
    );
    // Mid-batch: once a payout is in flight (bounded; the rollout goes on regardless).
    let in_flight = super::payouts_in_flight(system).await.unwrap_or(0);
    let old = deployment.current_generation();
    let new = old + 1;
    let (old_build, new_build) = (Deployment::build_id(old), Deployment::build_id(new));
    let mut fresh = Vec::with_capacity(slots);
    for slot in 0..slots {
        let network_host = target.partitions[slot].is_some();
        fresh.push(deployment.start_worker(system, new, slot, target.stall_dir, network_host)?);
    }
    let fresh_workers: Vec<&ManagedProcess> = fresh.iter().map(|(w, _)| w).collect();
    // Until the switch an error leaves the old build running alone (the new workers are dropped,
    // killed, with their hosts).
    wait_registered(stack, &deployment.name, &new_build, &fresh_workers).await?;
    if let Err(e) = set_current(stack, &deployment.name, &new_build) {
        // Whatever the command did, the old build is current again before the new workers go.
        let back = set_current(stack, &deployment.name, &old_build)
            .err()
            .map_or(String::new(), |b| {
                format!("; making {old_build} current again failed too: {b:#}")
            });
        anyhow::bail!("making {new_build} current: {e:#}{back}");
    }
    // From the switch on, payouts start on the new build: its workers are kept whatever happens.
    let switched = Instant::now();
    // A failed query is asked again by the drain below; the report then lacks the count at the
    // switch.
    let pinned = open_on(stack, &deployment.name, &old_build).unwrap_or_default();
    let mut left = pinned.clone();
    let drained = if target.without_drain {
        None
    } else {
        let give_up = switched + DRAIN_TIMEOUT;
        let mut empty_since: Option<Instant> = None;
        loop {
            // Temporal may answer slowly on a loaded machine: a failed query is asked again.
            if let Ok(open) = open_on(stack, &deployment.name, &old_build) {
                left = open;
                if !left.is_empty() {
                    empty_since = None;
                } else if empty_since.get_or_insert_with(Instant::now).elapsed() >= DRAIN_CONFIRM {
                    break Some(switched.elapsed());
                }
            }
            if Instant::now() >= give_up {
                break None;
            }
            supervise(system.workers.iter().chain(fresh_workers.iter().copied()));
            tokio::time::sleep(DRAIN_POLL).await;
        }
    };
    drop(fresh_workers);
    let (old_version, new_version) = (deployment.version(old), deployment.version(new));
    let old_identities: Vec<String> = system
        .workers
        .iter()
        .map(|w| w.name().to_string())
        .collect();
    let stop_old = drained.is_some() || target.without_drain;
    let rollout = Rollout {
        from: old_version.clone(),
        to: new_version.clone(),
        pinned_at_switch: pinned.clone(),
        drain_s: drained.map(|d| d.as_secs_f64()),
        old_stopped: stop_old,
    };
    // The new build takes the old one's places, so later faults act on it.
    let mut stop_failures = Vec::new();
    for (slot, (worker, ns)) in fresh.into_iter().enumerate() {
        let old_worker = std::mem::replace(&mut system.workers[slot], worker);
        let old_ns = std::mem::replace(&mut target.partitions[slot], ns);
        if stop_old {
            // SIGTERM, then SIGKILL after the kit's grace: a failure is reported after every
            // slot has its new worker.
            if let Err(e) = tokio::task::block_in_place(|| old_worker.terminate()) {
                stop_failures.push(format!("{}: {e:#}", old_worker.name()));
            }
            // The host goes after its worker (dropping the worker kills what is left of it).
            drop(old_worker);
            drop(old_ns);
        } else {
            deployment
                .undrained
                .lock()
                .expect("undrained lock")
                .push((old_worker, old_ns));
        }
    }
    deployment.generation.store(new, Ordering::SeqCst);
    let new_identities: Vec<&str> = system.workers.iter().map(|w| w.name()).collect();
    let line = format!(
        "{in_flight} payouts in flight; {}; {} {}; {} run {new_build}",
        rollout.describe(),
        old_identities.join(", "),
        if stop_old {
            "stopped (SIGTERM)"
        } else {
            "left running"
        },
        new_identities.join(", "),
    );
    outcome.rollouts.push(rollout);
    anyhow::ensure!(
        stop_failures.is_empty(),
        "{line}; stopping the old workers: {}",
        stop_failures.join("; ")
    );
    if !stop_old {
        let named: Vec<&str> = left.iter().map(String::as_str).take(NAMED_MAX).collect();
        anyhow::bail!(
            "{old_version} not drained within {DRAIN_TIMEOUT:?} of the switch to {new_version}: \
             its workers are left running; {} payouts still on it (first {NAMED_MAX}): {}",
            left.len(),
            named.join(", ")
        );
    }
    Ok(line)
}
