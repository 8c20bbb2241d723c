//! The reconciler as a process: one run on demand (`reconciler once`), or a Temporal worker on
//! its own task queue whose `ReconcileWorkflow` a Temporal schedule starts every N seconds
//! (`reconciler serve`), with the outcome of every run exported as metrics.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::Context;
use payout_workflows::client::TemporalArgs;
use prometheus::{IntCounter, IntCounterVec, IntGauge, IntGaugeVec, Opts};
use serde::{Deserialize, Serialize};
use service_kit::prometheus;
use service_kit::Metrics;
use temporalio_client::schedules::{
    CreateScheduleOptions, ScheduleAction, ScheduleDescription, ScheduleDescriptionAction,
    ScheduleError, ScheduleHandle, ScheduleOverlapPolicy, ScheduleSpec,
};
use temporalio_client::{tonic, Client};
use temporalio_common::RetryPolicy;
use temporalio_macros::{activities, workflow, workflow_methods};
use temporalio_sdk::activities::{ActivityContext, ActivityError};
use temporalio_sdk::{ActivityOptions, Runtime, WorkflowContext, WorkflowResult};
use temporalio_sdk::{Worker, WorkerOptions};

use reconciler::{Options, Sources};
use resolver::resolve::ResolveConfig;
use resolver::resume::{ResumeConfig, TemporalConfig};

use crate::report::{Pass, PassError};
use crate::RunReport;
use resolver::walk::Cursor;

/// The reconciler's own task queue: its runs never compete with payouts for workers.
pub const TASK_QUEUE: &str = "reconciliation";
pub const SCHEDULE_ID: &str = "reconciler";
/// One run reads every table once and resolves a bounded number of orphans (see
/// `resolver::resolve::ORPHANS_PER_RUN_MAX`): minutes at most, even on a large batch.
pub const RECONCILE_START_TO_CLOSE: Duration = Duration::from_secs(600);
/// A run heartbeats every third of this while it works, so a run lost with its process (killed
/// mid-run: a crash, a rolling restart's SIGKILL) is noticed by Temporal within this and tried
/// again on a live worker. Without it the lost run counted as running for the whole
/// start-to-close, and the schedule (overlap: skip) started no run meanwhile: the fault suite
/// saw no pass for five and a half minutes after a reconciler restart mid-run, and a stranded
/// payout wait through all of it.
pub const RECONCILE_HEARTBEAT_TIMEOUT: Duration = Duration::from_secs(30);
/// A failed run (a store unreachable) is retried a few times, then the workflow fails and the
/// schedule's next tick tries again: a reconciler must not hammer a struggling database.
pub const RECONCILE_ATTEMPTS_MAX: u32 = 3;
pub const RECONCILE_RETRY_INITIAL: Duration = Duration::from_secs(5);
/// On SIGTERM an in-flight run may finish for this long before being handed back.
pub const GRACEFUL_SHUTDOWN_PERIOD: Duration = Duration::from_secs(30);
/// Upper bound of one schedule call (create, describe, update) to Temporal.
pub const SCHEDULE_CALL_TIMEOUT: Duration = Duration::from_secs(30);
/// Temporal's schedules fire at a whole second at best; a shorter interval is raised to it.
pub const SCHEDULE_INTERVAL_MIN: Duration = Duration::from_secs(1);
/// The reconciler's workflow type, as the schedule names it (`#[run(name = ...)]` below).
pub const RECONCILE_WORKFLOW_TYPE: &str = "ReconcileWorkflow";
/// Shown on the schedule in the Temporal UI and `temporal schedule describe`.
const SCHEDULE_NOTE: &str = "created by the reconciler (reconciler serve); every replica keeps \
     it: a missing schedule is re-created and a paused one unpaused within seconds (to turn \
     reconciliation off, stop the reconciler)";
/// How often `reconciler serve` looks at its schedule (re-created if missing, unpaused if
/// paused) and frees accounts blocked by a holder whose workflow is gone
/// ([`resolver::resume::resume_blocked_accounts`]). 15 s: a lost schedule (Temporal lost its
/// state, or someone deleted or paused it) is back well inside one 300 s scheduled interval, so
/// no scheduled run is lost to it, and a terminated holder delays the payouts behind it by at
/// most this plus one resumed run; one schedule describe, and a read of the open payouts with a
/// lock describe per busy account, every 15 s costs Temporal, paydb and the lock service nothing
/// they notice.
pub const KEEPER_INTERVAL: Duration = Duration::from_secs(15);
/// Upper bound of one short holder pass: it must not outlive many keeper intervals when a
/// store hangs (the next tick tries again).
pub const HOLDER_PASS_TIMEOUT: Duration = Duration::from_secs(120);

/// The corrective parts of this process (a run's orphan resolver and resume pass, the keeper's
/// short holder pass) take turns: a holder pass that resumed an orphaned ambiguous payout while
/// a run's resolver was resolving it would have the two act on it one after the other, which the
/// guards make safe but which ends in the later one's transition refused (a false
/// RefusedTransition page). The keeper skips its tick while a run holds this; other processes
/// (replicas, an operator's run) are fenced by the guards as before.
static CORRECTIVE: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

#[derive(Debug, Clone, clap::Args)]
pub struct Config {
    #[arg(long, env = "PAYDB_URL")]
    pub paydb_url: String,
    #[arg(long, env = "PROXYDB_URL")]
    pub proxydb_url: String,
    #[arg(long, env = "GLDB_URL")]
    pub gldb_url: String,
    /// Comma-separated etcd endpoints of the lock service; without them the grant check is skipped.
    #[arg(long, env = "ETCD_ENDPOINTS", value_delimiter = ',')]
    pub etcd_endpoints: Vec<String>,
    /// etcd's authority and the reconciler's certificate from it (required with the endpoints).
    #[command(flatten)]
    pub etcd_tls: mtls::EtcdTlsArgs,
    #[arg(long, env = "LOCK_ETCD_PREFIX", default_value = "/payout/lock/")]
    pub lock_prefix: String,
    /// INV-07's horizon: grant records are demanded for tokens first accepted within this long.
    /// Keep it inside the lock-server's `LOCK_GRANT_RETENTION_MS`, after which etcd deletes them.
    #[arg(long, env = "RECONCILE_GRANT_HORIZON_MS", default_value_t = reconciler::GRANT_HORIZON_MS_DEFAULT)]
    pub grant_horizon_ms: u64,
    #[arg(long, env = "LOCK_SERVER_URL")]
    pub lock_server_url: Option<String>,
    #[arg(long, env = "RAIL_PROXY_URL")]
    pub rail_proxy_url: Option<String>,
    /// The registered operators' public keys (`name=hex,...`, the payment resource's
    /// PAYOUT_OPERATOR_KEYS): every account opening's funding signature is checked against them
    /// (`account_funding_authorised`). Empty: that check is reported skipped.
    #[arg(long, env = "PAYOUT_OPERATOR_KEYS", default_value = "")]
    pub operator_keys: String,
    #[arg(long, env = "PAYMENT_RESOURCE_URL")]
    pub payment_resource_url: Option<String>,
    /// The certificate authority, and this reconciler's certificate (role `reconciler`) and key:
    /// required with any service URL above (every call is mutual TLS); the database and etcd
    /// checks need none.
    #[arg(long = "tls-ca", env = "PAYOUT_TLS_CA")]
    pub tls_ca: Option<PathBuf>,
    #[arg(long = "tls-cert", env = "PAYOUT_TLS_CERT")]
    pub tls_cert: Option<PathBuf>,
    #[arg(long = "tls-key", env = "PAYOUT_TLS_KEY")]
    pub tls_key: Option<PathBuf>,
    /// Temporal: configured as the `temporal` CLI is (TEMPORAL_ADDRESS, TEMPORAL_NAMESPACE,
    /// TEMPORAL_TLS_*, TEMPORAL_API_KEY, TEMPORAL_PROFILE and its config file); a flag overrides
    /// the environment.
    #[command(flatten)]
    pub temporal: TemporalArgs,
    /// The payout workers' task queue, where a resumed payout's workflow runs.
    #[arg(long, env = "PAYOUT_TASK_QUEUE", default_value = "payouts")]
    pub payout_task_queue: String,
    /// The rail's settlement window a resumed workflow waits between its inquiries about an
    /// ambiguous payout (it asks at once first).
    #[arg(long, env = "PAYOUT_SETTLEMENT_WINDOW_MS", default_value_t = 30_000)]
    pub settlement_window_ms: u64,
    /// The resolution SLA a resumed workflow reports against (the payment resource enforces its own).
    #[arg(long, env = "PAYOUT_RESOLUTION_SLA_MS", default_value_t = 3_600_000)]
    pub resolution_sla_ms: u64,
    /// Hand stranded payouts (PENDING, CLAIMED, RAIL_SUBMITTED, RAIL_ACKED, RAIL_AMBIGUOUS with
    /// no running workflow) back to a new workflow run, taking their account's key over from any
    /// grant whose workflow is not running; after the orphan resolver, before the checks.
    #[arg(long, env = "RECONCILE_RESUME_STRANDED")]
    pub resume_stranded: bool,
    /// A payout that never had a workflow is left alone this long after its creation.
    #[arg(long, env = "RECONCILE_NOT_STARTED_GRACE_MS", default_value_t = 60_000)]
    pub not_started_grace_ms: u64,
    /// Undelivered outbox rows count as violations.
    #[arg(long, env = "RECONCILE_REQUIRE_DRAINED")]
    pub require_drained: bool,
    /// Where the audit chain's head is kept between runs: each run demands that the chain still
    /// holds the head the run before saw (a rewritten chain is otherwise consistent in itself).
    #[arg(long, env = "RECONCILE_AUDIT_ANCHOR_FILE")]
    pub audit_anchor_file: Option<std::path::PathBuf>,
    /// With an audit anchor file, a run examines only the accounts touched since the last clean
    /// run (the watermark is kept beside the anchor: `reconciler::scope`), and a full pass of
    /// every account runs when the last one is this long behind. The full pass is what sees a
    /// write made behind every service and trigger, which leaves no audit row and no timestamp.
    #[arg(long, env = "RECONCILE_FULL_PASS_EVERY_MS", default_value_t = FULL_PASS_EVERY_MS_DEFAULT)]
    pub full_pass_every_ms: u64,
    /// Resolve orphaned RAIL_AMBIGUOUS payouts (evidence only) before the checks.
    #[arg(long, env = "RECONCILE_RESOLVE_ORPHANS")]
    pub resolve_orphans: bool,
    /// Candidates each corrective pass (the orphan resolver, the resume pass) acts on per run;
    /// payouts whose workflow runs do not count, and the next run goes on from where this one
    /// stopped (`resolver::walk`), so every open payout is examined within ceil(open / this)
    /// runs of one `reconciler serve`.
    #[arg(long, env = "RECONCILE_CORRECTIVE_PER_PASS", default_value_t = resolver::walk::PER_PASS_DEFAULT)]
    pub corrective_per_pass: usize,
    /// Append the resume pass's lock history here (its takeovers' force-revokes,
    /// `lock_client::history`), as a worker's `--lock-history-path` does: the evidence an outside
    /// checker pairs a takeover with the grant it deposed. (The orphan resolver's own grants are
    /// not recorded: its lease is not the workers'.)
    #[arg(long, env = "PAYOUT_LOCK_HISTORY_PATH")]
    pub lock_history_path: Option<std::path::PathBuf>,
}

impl Config {
    /// The reconciler's certificate, needed by every call to a service.
    pub fn tls(&self) -> anyhow::Result<mtls::Tls> {
        match (&self.tls_ca, &self.tls_cert, &self.tls_key) {
            (Some(ca), Some(cert), Some(key)) => {
                mtls::Tls::load(ca, cert, key).context("the reconciler's TLS material")
            }
            _ => anyhow::bail!(
                "calling a service needs --tls-ca, --tls-cert and --tls-key (a certificate of role reconciler)"
            ),
        }
    }

    pub fn resolve_config(&self) -> anyhow::Result<ResolveConfig> {
        Ok(ResolveConfig {
            tls: self.tls()?,
            lock_url: self
                .lock_server_url
                .clone()
                .context("--resolve-orphans needs --lock-server-url")?,
            proxy_url: self
                .rail_proxy_url
                .clone()
                .context("--resolve-orphans needs --rail-proxy-url")?,
            payment_url: self
                .payment_resource_url
                .clone()
                .context("--resolve-orphans needs --payment-resource-url")?,
            temporal: self.temporal_config(),
            bounds: self.bounds(),
        })
    }

    pub fn temporal_config(&self) -> TemporalConfig {
        TemporalConfig {
            connection: self.temporal.clone(),
            payout_task_queue: self.payout_task_queue.clone(),
            settlement_window_ms: self.settlement_window_ms,
            resolution_sla_ms: self.resolution_sla_ms,
        }
    }

    pub fn resume_config(&self) -> anyhow::Result<ResumeConfig> {
        Ok(ResumeConfig {
            tls: self.tls()?,
            lock_url: self
                .lock_server_url
                .clone()
                .context("--resume-stranded needs --lock-server-url")?,
            temporal: self.temporal_config(),
            not_started_grace: Duration::from_millis(self.not_started_grace_ms),
            bounds: self.bounds(),
            lock_history: self.lock_history_path.clone(),
        })
    }

    fn bounds(&self) -> resolver::walk::PassBounds {
        resolver::walk::PassBounds::per_pass(self.corrective_per_pass)
    }

    pub async fn sources(&self) -> anyhow::Result<Sources> {
        Ok(Sources {
            paydb: service_kit::connect_pg(&self.paydb_url).await?,
            proxydb: service_kit::connect_pg(&self.proxydb_url).await?,
            gldb: service_kit::connect_pg(&self.gldb_url).await?,
            rail_proxy: match &self.rail_proxy_url {
                Some(url) => Some(reconciler::ProxySource {
                    url: url.clone(),
                    tls: self.tls()?,
                }),
                None => None,
            },
            lock_grants: match self.etcd_endpoints.is_empty() {
                true => None,
                false => Some(reconciler::LockGrants {
                    etcd_endpoints: self.etcd_endpoints.clone(),
                    tls: self.etcd_tls.load().context("etcd TLS material")?,
                    prefix: self.lock_prefix.clone(),
                    horizon_ms: self.grant_horizon_ms,
                }),
            },
            operators: operators(&self.operator_keys)?,
        })
    }
}

/// `--operator-keys`: none given is None (the check reports itself skipped); a malformed list
/// stops the start.
pub fn operators(spec: &str) -> anyhow::Result<Option<grant_signing::Verifier>> {
    if spec.trim().is_empty() {
        return Ok(None);
    }
    Ok(Some(
        grant_signing::Verifier::parse(spec).context("--operator-keys")?,
    ))
}

/// How often a scheduled run is a full pass (every account) rather than an incremental one: an
/// hour, twelve runs of the default five-minute schedule, bounds how long a write made behind
/// every service (no audit row, no timestamp) stays unseen, at the cost of one full read an hour.
pub const FULL_PASS_EVERY_MS_DEFAULT: u64 = 3_600_000;

/// Where each corrective pass of this process stopped (`resolver::walk`): the next run goes on
/// from there. `reconciler serve` keeps one for all its runs; `reconciler once` begins at the
/// start, as does a restarted process (still within the walk's bound).
#[derive(Debug, Default)]
pub struct Cursors {
    pub orphans: tokio::sync::Mutex<Cursor>,
    pub resume: tokio::sync::Mutex<Cursor>,
}

/// Orphans resolved and stranded payouts handed back to workflows first, by the resolver and
/// only when asked (so the checks see the resolved state), then every check. Each of the three
/// runs whatever the others did: an error of one is reported in the run's report
/// ([`RunReport::errors`]) and the others go on; only a source that cannot even be configured
/// fails the run.
pub async fn run_once(
    config: &Config,
    sources: &Sources,
    cursors: &Cursors,
) -> anyhow::Result<RunReport> {
    let mut errors = Vec::new();
    let corrective = match config.resolve_orphans || config.resume_stranded {
        true => Some(CORRECTIVE.lock().await),
        false => None,
    };
    // Evidence first, then the workflows: the resolver settles with the rail's evidence what it
    // can now, and the resume pass then reads paydb afresh and hands a workflow only what is
    // still open, among it an orphaned ambiguous payout the rail said UNKNOWN about (or whose
    // account's key the resolver found busy), whose resumed run keeps asking. The other order
    // would give every ambiguous orphan a running workflow before the resolver looked, and the
    // resolver leaves a payout with a running workflow alone: it would never act. Either way the
    // two never act on one payout in one pass.
    let resolutions = match config.resolve_orphans {
        true => done_or_reported(
            async {
                let resolve = config.resolve_config()?;
                let mut cursor = cursors.orphans.lock().await;
                Ok(
                    resolver::resolve::resolve_orphans(&sources.paydb, &resolve, &mut cursor)
                        .await?,
                )
            }
            .await,
            Pass::Orphans,
            &mut errors,
        ),
        false => Vec::new(),
    };
    let resumptions = match config.resume_stranded {
        true => done_or_reported(
            async {
                let resume = config.resume_config()?;
                let mut cursor = cursors.resume.lock().await;
                Ok(resolver::resume::resume_stranded(&sources.paydb, &resume, &mut cursor).await?)
            }
            .await,
            Pass::Resume,
            &mut errors,
        ),
        false => Vec::new(),
    };
    drop(corrective);
    let checks = async {
        let (audit_anchor, since) = match &config.audit_anchor_file {
            Some(path) => (
                reconciler::AuditHead::load(path)?,
                reconciler::Watermark::load(&reconciler::Watermark::beside(path))?
                    .filter(|w| !w.full_pass_due(config.full_pass_every_ms)),
            ),
            None => (None, None),
        };
        let checks = reconciler::reconcile(
            sources,
            &Options {
                require_outbox_drained: config.require_drained,
                audit_anchor,
                since,
                rail: reconciler::RailOptions::kept_beside(config.audit_anchor_file.as_deref())?,
                ..Default::default()
            },
        )
        .await?;
        reconciler::RailOptions::keep_beside(
            config.audit_anchor_file.as_deref(),
            checks.rail_cursor.as_deref(),
        )?;
        if let (Some(path), true) = (&config.audit_anchor_file, checks.is_clean()) {
            reconciler::AuditHead::save(&checks.audit_heads, path)?;
            checks
                .watermark
                .save(&reconciler::Watermark::beside(path))?;
        }
        anyhow::Ok(checks)
    };
    let checks = match checks.await {
        Ok(checks) => Some(checks),
        Err(e) => {
            errors.push(PassError::new(Pass::Checks, &e));
            None
        }
    };
    for e in &errors {
        tracing::error!(pass = e.pass.as_str(), error = %e.detail, "a part of the reconciliation run failed; the others ran");
    }
    Ok(RunReport {
        checks,
        resolutions,
        resumptions,
        errors,
    })
}

/// What a corrective pass did, or nothing with its error reported: the run goes on.
fn done_or_reported<T>(
    outcome: anyhow::Result<resolver::resume::Pass<T>>,
    pass: Pass,
    errors: &mut Vec<PassError>,
) -> Vec<T> {
    match outcome {
        Ok(done) => done.done,
        Err(e) => {
            errors.push(PassError::new(pass, &e));
            Vec::new()
        }
    }
}

/// The metrics of the scheduled runs.
#[derive(Clone)]
pub struct ReconcileMetrics {
    pub metrics: Metrics,
    violations: IntGaugeVec,
    partial_checks: crate::partial::PartialChecks,
    runs: IntCounter,
    failed_runs: IntCounter,
    last_run: IntGauge,
    orphans_resolved: IntCounterVec,
    schedule_repairs: IntCounterVec,
    schedule_healthy: IntGauge,
    holder_pass_actions: IntCounterVec,
    resume_pass_actions: IntCounterVec,
    squatters: IntCounter,
    holder_pass_failures: IntCounter,
    pass_errors: IntCounterVec,
    payouts_skipped: IntCounterVec,
}

impl ReconcileMetrics {
    pub fn new() -> Self {
        let metrics = Metrics::default();
        let partial_checks = crate::partial::PartialChecks::new(&metrics);
        let violations = IntGaugeVec::new(
            Opts::new(
                "reconciliation_violations",
                "Violations found by the last run, per check",
            ),
            &["check"],
        )
        .expect("valid metric");
        let runs = IntCounter::new("reconciliation_runs_total", "Completed reconciliation runs")
            .expect("valid metric");
        let failed_runs = IntCounter::new(
            "reconciliation_failed_runs_total",
            "Reconciliation runs that could not read their sources",
        )
        .expect("valid metric");
        let last_run = IntGauge::new(
            "reconciliation_last_run_unix_seconds",
            "When the last run completed",
        )
        .expect("valid metric");
        for m in [
            Box::new(violations.clone()) as Box<dyn prometheus::core::Collector>,
            Box::new(runs.clone()),
            Box::new(failed_runs.clone()),
            Box::new(last_run.clone()),
        ] {
            metrics
                .registry
                .register(m)
                .expect("metric registered once");
        }
        let orphans_resolved = metrics.counter_vec(
            "reconciliation_orphans_resolved_total",
            "Orphaned RAIL_AMBIGUOUS payouts handled, by evidence",
            &["evidence"],
        );
        let schedule_repairs = metrics.counter_vec(
            "reconciler_schedule_repairs_total",
            "Repairs of the reconciler's schedule by its keeper, by what was wrong",
            &["reason"],
        );
        for reason in [
            RepairReason::Missing,
            RepairReason::Paused,
            RepairReason::Altered,
        ] {
            schedule_repairs.with_label_values(&[reason.as_str()]);
        }
        let schedule_healthy = IntGauge::new(
            "reconciler_schedule_healthy",
            "1 when the keeper's last look found the schedule present and unpaused (or repaired \
             it), 0 when it could not see or repair it",
        )
        .expect("valid metric");
        metrics
            .registry
            .register(Box::new(schedule_healthy.clone()))
            .expect("metric registered once");
        let holder_pass_actions = metrics.counter_vec(
            "reconciler_holder_pass_actions_total",
            "What the keeper's short holder pass did (RESUMED, TOOK_OVER, ALREADY_RUNNING, ERROR)",
            &["action"],
        );
        let resume_pass_actions = metrics.counter_vec(
            "reconciler_resume_pass_actions_total",
            "What the scheduled run's resume pass did for stranded payouts (RESUMED, TOOK_OVER, \
             SQUATTER_TERMINATED, ...): after Temporal lost its state, the payouts it handed back \
             to a new workflow",
            &["action"],
        );
        let squatters = IntCounter::new(
            "reconciler_squatters_total",
            "Foreign runs on a payout's workflow id (another type, or another queue than the payout \
             workers') that a pass terminated before resuming the payout (alert PayoutWorkflowSquatted)",
        )
        .expect("valid metric");
        metrics
            .registry
            .register(Box::new(squatters.clone()))
            .expect("metric registered once");
        let holder_pass_failures = IntCounter::new(
            "reconciler_holder_pass_failures_total",
            "Short holder passes that could not read their sources",
        )
        .expect("valid metric");
        metrics
            .registry
            .register(Box::new(holder_pass_failures.clone()))
            .expect("metric registered once");
        let pass_errors = metrics.counter_vec(
            "reconciler_pass_errors_total",
            "Parts of a reconciliation run (orphans, resume, checks) that failed as a whole; the \
             other parts ran",
            &["pass"],
        );
        let payouts_skipped = metrics.counter_vec(
            "reconciler_payouts_skipped_total",
            "Payouts a corrective pass (orphans, resume) skipped because their workflow could not \
             be described; the pass went on",
            &["pass"],
        );
        for pass in Pass::ALL {
            pass_errors.with_label_values(&[pass.as_str()]);
        }
        for pass in [Pass::Orphans, Pass::Resume] {
            payouts_skipped.with_label_values(&[pass.as_str()]);
        }
        Self {
            metrics,
            violations,
            partial_checks,
            runs,
            failed_runs,
            last_run,
            orphans_resolved,
            schedule_repairs,
            schedule_healthy,
            holder_pass_actions,
            resume_pass_actions,
            squatters,
            holder_pass_failures,
            pass_errors,
            payouts_skipped,
        }
    }

    /// The squatters a pass terminated (`SQUATTER_TERMINATED`).
    fn count_squatters(&self, resumptions: &[resolver::resume::Resumption]) {
        let terminated = resumptions
            .iter()
            .filter(|r| r.action == resolver::resume::SQUATTER_TERMINATED)
            .count();
        self.squatters.inc_by(terminated as u64);
    }

    /// A run's outcome: each part's error counted; a run whose checks failed counts as a failed
    /// run (its sources unreadable) and sets neither the violations nor the last run's time.
    pub fn record(&self, report: &RunReport) {
        for e in &report.errors {
            self.pass_errors.with_label_values(&[e.pass.as_str()]).inc();
        }
        for r in &report.resolutions {
            self.orphans_resolved
                .with_label_values(&[r.evidence.as_str()])
                .inc();
        }
        let skipped = |workflows: &mut dyn Iterator<Item = &String>| {
            workflows
                .filter(|w| w.as_str() == resolver::resume::UNDESCRIBED)
                .count() as u64
        };
        self.payouts_skipped
            .with_label_values(&[Pass::Orphans.as_str()])
            .inc_by(skipped(&mut report.resolutions.iter().map(|r| &r.workflow)));
        self.payouts_skipped
            .with_label_values(&[Pass::Resume.as_str()])
            .inc_by(skipped(&mut report.resumptions.iter().map(|r| &r.workflow)));
        self.count_squatters(&report.resumptions);
        for r in &report.resumptions {
            self.resume_pass_actions
                .with_label_values(&[r.action.as_str()])
                .inc();
        }
        let Some(checks) = &report.checks else {
            self.failed_runs.inc();
            return;
        };
        for c in &checks.checks {
            self.violations
                .with_label_values(&[c.name])
                .set(c.violations.len() as i64);
        }
        self.partial_checks.record(&checks.checks);
        self.runs.inc();
        self.last_run.set(unix_seconds());
    }
}

impl Default for ReconcileMetrics {
    fn default() -> Self {
        Self::new()
    }
}

fn unix_seconds() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or(0)
}

/// What one scheduled run returns to its workflow (the full report is in the logs and metrics).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct ReconcileSummary {
    pub violations: usize,
    pub failing_checks: Vec<String>,
    pub skipped_checks: Vec<String>,
    pub orphans_resolved: usize,
    pub orphans_left: usize,
    pub ambiguous_payouts: usize,
    pub completed_at_unix_s: i64,
    /// The parts of the run that failed (the others ran); with `checks` among them the counts
    /// of the checks above are zero because they did not run.
    #[serde(default)]
    pub errors: Vec<PassError>,
}

impl ReconcileSummary {
    pub fn of(report: &RunReport) -> Self {
        let resolved = report.resolutions.iter().filter(|r| r.resolved()).count();
        let checks = report.checks.as_ref();
        let names = |keep: fn(&reconciler::Check) -> bool| -> Vec<String> {
            checks
                .map(|c| {
                    c.checks
                        .iter()
                        .filter(|c| keep(c))
                        .map(|c| c.name.to_string())
                        .collect()
                })
                .unwrap_or_default()
        };
        Self {
            violations: checks.map_or(0, |c| c.violations),
            failing_checks: names(|c| !c.violations.is_empty()),
            skipped_checks: names(|c| c.skipped.is_some()),
            orphans_resolved: resolved,
            orphans_left: report.resolutions.len() - resolved,
            ambiguous_payouts: checks.map_or(0, |c| c.ambiguous_payouts.len()),
            completed_at_unix_s: unix_seconds(),
            errors: report.errors.clone(),
        }
    }
}

/// The reconciler's one activity: a whole run, with the worker's configuration.
pub struct ReconcileActivities {
    config: Config,
    sources: Arc<Sources>,
    metrics: ReconcileMetrics,
    /// Where each corrective pass stopped, kept across this process's runs.
    cursors: Arc<Cursors>,
}

#[activities]
impl ReconcileActivities {
    #[activity(name = "Reconcile")]
    pub async fn reconcile(
        self: Arc<Self>,
        ctx: ActivityContext,
    ) -> Result<ReconcileSummary, ActivityError> {
        // A part that fails is reported in the summary and counted; the activity is not
        // retried for it (the other parts ran): the schedule's next run tries again.
        let run = run_once(&self.config, &self.sources, &self.cursors);
        let mut run = std::pin::pin!(run);
        let beat = RECONCILE_HEARTBEAT_TIMEOUT / 3;
        let ran = loop {
            tokio::select! {
                ran = &mut run => break ran,
                _ = tokio::time::sleep(beat) => {
                    let _ = ctx.record_heartbeat(()).await;
                }
            }
        };
        match ran {
            Ok(report) => {
                self.metrics.record(&report);
                let summary = ReconcileSummary::of(&report);
                tracing::info!(
                    violations = summary.violations,
                    failing_checks = ?summary.failing_checks,
                    orphans_resolved = summary.orphans_resolved,
                    orphans_left = summary.orphans_left,
                    failed_parts = ?summary.errors.iter().map(|e| e.pass.as_str()).collect::<Vec<_>>(),
                    "reconciliation run"
                );
                Ok(summary)
            }
            Err(e) => {
                self.metrics.failed_runs.inc();
                tracing::error!(error = %e, "reconciliation run failed");
                Err(ActivityError::from(e))
            }
        }
    }
}

/// Pure: one `Reconcile` activity with explicit timeouts and a bounded retry policy.
#[workflow]
#[derive(Default)]
pub struct ReconcileWorkflow {
    done: bool,
}

#[workflow_methods]
impl ReconcileWorkflow {
    #[run(name = "ReconcileWorkflow")]
    pub async fn run(ctx: &mut WorkflowContext<Self>) -> WorkflowResult<ReconcileSummary> {
        let summary = ctx
            .execute_activity(ReconcileActivities::reconcile, (), activity_options())
            .await?;
        ctx.state_mut(|s| s.done = true);
        Ok(summary)
    }
}

pub fn activity_options() -> ActivityOptions {
    let mut options = ActivityOptions::with_start_to_close_timeout(RECONCILE_START_TO_CLOSE)
        .retry_policy(
            RetryPolicy::builder()
                .initial_interval(RECONCILE_RETRY_INITIAL)
                .backoff_coefficient(2.0)
                .maximum_attempts(RECONCILE_ATTEMPTS_MAX)
                .build(),
        )
        .build();
    options.heartbeat_timeout = Some(RECONCILE_HEARTBEAT_TIMEOUT);
    options
}

#[derive(Debug, Clone)]
pub struct ServeOptions {
    pub task_queue: String,
    pub schedule_id: String,
    pub interval: Duration,
    pub identity: String,
    /// How often the keeper looks at the schedule (and runs the short holder pass):
    /// [`KEEPER_INTERVAL`] unless a test asks for less.
    pub keeper_interval: Duration,
}

/// What [`ensure_schedule`] found and did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ScheduleOutcome {
    /// There was no schedule of that id: it was created.
    Created,
    /// It existed with this interval, workflow type and task queue: left as it is.
    Unchanged,
    /// It existed with another interval, workflow or task queue (a redeployment changed
    /// `--interval-s`): its spec and action were replaced, its history kept.
    Updated,
}

/// The schedule's spec and action as this process would create them.
fn schedule_spec(serve: &ServeOptions) -> ScheduleSpec {
    ScheduleSpec::from_interval(serve.interval.max(SCHEDULE_INTERVAL_MIN))
}

fn schedule_action(serve: &ServeOptions) -> ScheduleAction {
    ScheduleAction::start_workflow(
        ReconcileWorkflow::run,
        (),
        serve.task_queue.clone(),
        format!("{}-run", serve.schedule_id),
    )
}

/// Makes sure the schedule that starts `ReconcileWorkflow` every `interval` exists, through
/// Temporal's client: created if missing, left alone if it already matches, updated if its
/// interval, workflow type or task queue differ. Every replica calls this at start, so it is
/// idempotent; a race between two creations is read by its gRPC status (`ALREADY_EXISTS`), never
/// by matching error text.
pub async fn ensure_schedule(
    client: &Client,
    serve: &ServeOptions,
) -> anyhow::Result<ScheduleOutcome> {
    let created = tokio::time::timeout(
        SCHEDULE_CALL_TIMEOUT,
        client.create_schedule(
            serve.schedule_id.clone(),
            CreateScheduleOptions::builder()
                .action(schedule_action(serve))
                .spec(schedule_spec(serve))
                // A run still going when the next is due is skipped: two runs never overlap.
                .overlap_policy(ScheduleOverlapPolicy::Skip)
                .note(SCHEDULE_NOTE)
                .build(),
        ),
    )
    .await
    .with_context(|| format!("creating schedule {}: no answer", serve.schedule_id))?;
    match created {
        Ok(_) => {
            tracing::info!(schedule_id = %serve.schedule_id, interval_s = serve.interval.as_secs(), task_queue = %serve.task_queue, "schedule created");
            return Ok(ScheduleOutcome::Created);
        }
        Err(ScheduleError::Rpc(status)) if status.code() == tonic::Code::AlreadyExists => {}
        Err(e) => {
            return Err(e).with_context(|| format!("creating schedule {}", serve.schedule_id))
        }
    }
    let handle = client.get_schedule_handle(serve.schedule_id.clone());
    let described =
        tokio::time::timeout(SCHEDULE_CALL_TIMEOUT, handle.describe(Default::default()))
            .await
            .with_context(|| format!("describing schedule {}: no answer", serve.schedule_id))?
            .with_context(|| format!("describing schedule {}", serve.schedule_id))?;
    if schedule_matches(&described, serve) {
        tracing::info!(schedule_id = %serve.schedule_id, "schedule already exists as configured");
        return Ok(ScheduleOutcome::Unchanged);
    }
    restore_schedule(&handle, serve).await?;
    tracing::info!(schedule_id = %serve.schedule_id, interval_s = serve.interval.as_secs(), task_queue = %serve.task_queue, "schedule updated to this configuration");
    Ok(ScheduleOutcome::Updated)
}

/// Puts the schedule's spec, action and overlap policy back to what this process creates.
async fn restore_schedule(
    handle: &ScheduleHandle<Client>,
    serve: &ServeOptions,
) -> anyhow::Result<()> {
    let (spec, action) = (schedule_spec(serve), schedule_action(serve));
    tokio::time::timeout(
        SCHEDULE_CALL_TIMEOUT,
        handle.update(
            move |update| {
                update
                    .set_spec(spec)
                    .set_action(action)
                    .set_overlap_policy(ScheduleOverlapPolicy::Skip);
            },
            Default::default(),
        ),
    )
    .await
    .with_context(|| format!("updating schedule {}: no answer", serve.schedule_id))?
    .with_context(|| format!("updating schedule {}", serve.schedule_id))?;
    Ok(())
}

/// Whether an existing schedule starts the same workflow on the same queue at the same interval,
/// skipping a run while one is going.
fn schedule_matches(described: &ScheduleDescription, serve: &ServeOptions) -> bool {
    let action = match described.action() {
        ScheduleDescriptionAction::StartWorkflow(action) => action,
        // Another kind of action under our id: replace it with ours.
        _ => return false,
    };
    action.workflow_type() == RECONCILE_WORKFLOW_TYPE
        && action.task_queue() == serve.task_queue
        && schedule_intervals(described) == [serve.interval.max(SCHEDULE_INTERVAL_MIN)]
        && overlap_skips(described)
}

/// Whether the schedule skips a run while one is going (Temporal's default, unspecified, is
/// skip): any other policy lets two runs overlap.
fn overlap_skips(described: &ScheduleDescription) -> bool {
    use temporalio_common::protos::temporal::api::enums::v1::ScheduleOverlapPolicy as Proto;
    let policy = described
        .raw()
        .schedule
        .as_ref()
        .and_then(|s| s.policies.as_ref())
        .map_or(Proto::Unspecified as i32, |p| p.overlap_policy);
    policy == Proto::Skip as i32 || policy == Proto::Unspecified as i32
}

/// The intervals a described schedule fires at.
pub fn schedule_intervals(described: &ScheduleDescription) -> Vec<Duration> {
    described
        .raw()
        .schedule
        .as_ref()
        .and_then(|s| s.spec.as_ref())
        .map(|spec| {
            spec.interval
                .iter()
                .filter_map(|i| i.interval.as_ref())
                .map(|d| {
                    Duration::new(
                        u64::try_from(d.seconds).unwrap_or(0),
                        u32::try_from(d.nanos).unwrap_or(0),
                    )
                })
                .collect()
        })
        .unwrap_or_default()
}

/// What the keeper found wrong with the schedule and put right.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RepairReason {
    /// Temporal had no schedule of that id (its state lost, or the schedule deleted): created
    /// again exactly as at start.
    Missing,
    /// The schedule was paused: unpaused (the reconciliation is turned off by stopping the
    /// reconciler, never by pausing its schedule).
    Paused,
    /// The schedule was changed by hand (interval lengthened, action's workflow type or queue
    /// changed, overlap allowed): its spec, action and policy put back as at start.
    Altered,
}

impl RepairReason {
    pub fn as_str(&self) -> &'static str {
        match self {
            Self::Missing => "missing",
            Self::Paused => "paused",
            Self::Altered => "altered",
        }
    }
}

/// One look of the keeper: `None` when the schedule was there and running, or the repair made.
pub async fn keep_schedule(
    client: &Client,
    serve: &ServeOptions,
) -> anyhow::Result<Option<RepairReason>> {
    let handle = client.get_schedule_handle(serve.schedule_id.clone());
    let described =
        tokio::time::timeout(SCHEDULE_CALL_TIMEOUT, handle.describe(Default::default()))
            .await
            .with_context(|| format!("describing schedule {}: no answer", serve.schedule_id))?;
    let described = match described {
        Ok(d) => d,
        Err(ScheduleError::Rpc(status)) if status.code() == tonic::Code::NotFound => {
            // Created as at start; ALREADY_EXISTS (another replica was quicker) is no repair of ours.
            return Ok(match ensure_schedule(client, serve).await? {
                ScheduleOutcome::Created => {
                    trigger_missed_run(&handle, serve).await;
                    Some(RepairReason::Missing)
                }
                ScheduleOutcome::Unchanged | ScheduleOutcome::Updated => None,
            });
        }
        Err(e) => {
            return Err(e).with_context(|| format!("describing schedule {}", serve.schedule_id))
        }
    };
    if !schedule_matches(&described, serve) {
        // Someone with access to Temporal made the checks rarer or pointed them elsewhere. A
        // pause as well is seen (and undone) on the next look.
        restore_schedule(&handle, serve).await?;
        until_applied(&handle, serve, |d| schedule_matches(d, serve)).await;
        trigger_missed_run(&handle, serve).await;
        return Ok(Some(RepairReason::Altered));
    }
    if !described.paused() {
        return Ok(None);
    }
    tokio::time::timeout(
        SCHEDULE_CALL_TIMEOUT,
        handle.unpause(
            Some("unpaused by the reconciler's keeper: to turn reconciliation off, stop the reconciler"),
            Default::default(),
        ),
    )
    .await
    .with_context(|| format!("unpausing schedule {}: no answer", serve.schedule_id))?
    .with_context(|| format!("unpausing schedule {}", serve.schedule_id))?;
    until_applied(&handle, serve, |d| !d.paused()).await;
    trigger_missed_run(&handle, serve).await;
    Ok(Some(RepairReason::Paused))
}

/// How often [`until_applied`] describes the schedule again.
const APPLIED_POLL: Duration = Duration::from_millis(200);

/// Temporal applies a schedule's patch or update through the schedule's own workflow, after the
/// call has returned: until then a describe still shows the old state. Waits (at most
/// [`SCHEDULE_CALL_TIMEOUT`]) until a describe shows the repair `applied`, so that the keeper's
/// next look does not repair, and count, the same change twice. Past the bound it warns and goes
/// on: the next look sees whatever is true then.
async fn until_applied(
    handle: &ScheduleHandle<Client>,
    serve: &ServeOptions,
    applied: impl Fn(&ScheduleDescription) -> bool,
) {
    let deadline = tokio::time::Instant::now() + SCHEDULE_CALL_TIMEOUT;
    loop {
        let described =
            tokio::time::timeout(SCHEDULE_CALL_TIMEOUT, handle.describe(Default::default())).await;
        if let Ok(Ok(described)) = described {
            if applied(&described) {
                return;
            }
        }
        if tokio::time::Instant::now() >= deadline {
            tracing::warn!(schedule_id = %serve.schedule_id, "the schedule's repair was not visible within the bound; the next look decides");
            return;
        }
        tokio::time::sleep(APPLIED_POLL).await;
    }
}

/// A repaired schedule has missed runs (and after Temporal lost its state, payouts wait for a
/// pass to hand them back): one run now, not at the next interval. Skipped if one is going.
async fn trigger_missed_run(handle: &ScheduleHandle<Client>, serve: &ServeOptions) {
    let triggered = tokio::time::timeout(
        SCHEDULE_CALL_TIMEOUT,
        handle.trigger(ScheduleOverlapPolicy::Skip, Default::default()),
    )
    .await;
    match triggered {
        Ok(Ok(())) => {
            tracing::info!(schedule_id = %serve.schedule_id, "a run triggered now after the repair")
        }
        // The schedule runs at its next interval anyway; the next look does not trigger again.
        Ok(Err(e)) => {
            tracing::warn!(schedule_id = %serve.schedule_id, error = %e, "could not trigger a run after the repair")
        }
        Err(_) => {
            tracing::warn!(schedule_id = %serve.schedule_id, "triggering a run after the repair: no answer")
        }
    }
}

/// The keeper: every `serve.keeper_interval` until `stop`, one look at the schedule
/// ([`keep_schedule`]), each repair counted and logged at warn, the health gauge set; and, when
/// the reconciler resumes stranded payouts, the short holder pass
/// ([`resolver::resume::resume_blocked_accounts`]).
async fn keep(
    client: Client,
    serve: ServeOptions,
    config: Config,
    sources: Arc<Sources>,
    metrics: ReconcileMetrics,
    mut stop: tokio::sync::watch::Receiver<bool>,
) {
    let mut ticks = tokio::time::interval(serve.keeper_interval.max(SCHEDULE_INTERVAL_MIN));
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let resume = match config.resume_stranded {
        true => match config.resume_config() {
            Ok(c) => Some(c),
            Err(e) => {
                tracing::error!(error = %e, "the holder pass cannot run");
                None
            }
        },
        false => None,
    };
    loop {
        tokio::select! {
            _ = ticks.tick() => {}
            _ = stop.wait_for(|stop| *stop) => return,
        }
        match keep_schedule(&client, &serve).await {
            Ok(None) => metrics.schedule_healthy.set(1),
            Ok(Some(reason)) => {
                metrics
                    .schedule_repairs
                    .with_label_values(&[reason.as_str()])
                    .inc();
                metrics.schedule_healthy.set(1);
                match reason {
                    RepairReason::Missing => {
                        tracing::warn!(schedule_id = %serve.schedule_id, reason = reason.as_str(), "the reconciler's schedule was missing (Temporal lost its state, or it was deleted): re-created as at start")
                    }
                    RepairReason::Paused => {
                        tracing::warn!(schedule_id = %serve.schedule_id, reason = reason.as_str(), "the reconciler's schedule was paused: unpaused (stop the reconciler to turn reconciliation off)")
                    }
                    RepairReason::Altered => {
                        tracing::warn!(schedule_id = %serve.schedule_id, reason = reason.as_str(), "the reconciler's schedule was altered (interval, workflow, queue or overlap policy): put back as at start")
                    }
                }
            }
            Err(e) => {
                metrics.schedule_healthy.set(0);
                tracing::warn!(schedule_id = %serve.schedule_id, error = format!("{e:#}"), "could not look at or repair the reconciler's schedule");
            }
        }
        if let Some(resume) = &resume {
            // A run's corrective part is going: it covers these accounts too; the next tick
            // looks again.
            let Ok(_corrective) = CORRECTIVE.try_lock() else {
                tracing::debug!("a reconcile run is resolving and resuming: the holder pass waits for the next tick");
                continue;
            };
            let pass = tokio::time::timeout(
                HOLDER_PASS_TIMEOUT,
                resolver::resume::resume_blocked_accounts(&sources.paydb, resume),
            )
            .await;
            match pass {
                Ok(Ok(done)) => {
                    for r in &done {
                        metrics
                            .holder_pass_actions
                            .with_label_values(&[r.action.as_str()])
                            .inc();
                    }
                    metrics.count_squatters(&done);
                }
                Ok(Err(e)) => {
                    metrics.holder_pass_failures.inc();
                    tracing::warn!(error = %e, "the holder pass failed (the next look tries again)");
                }
                Err(_) => {
                    metrics.holder_pass_failures.inc();
                    tracing::warn!(
                        timeout_s = HOLDER_PASS_TIMEOUT.as_secs(),
                        "the holder pass gave no answer (the next look tries again)"
                    );
                }
            }
        }
    }
}

/// Runs the worker (and ensures the schedule) until `stop` resolves.
pub async fn serve(
    config: Config,
    serve: ServeOptions,
    metrics: ReconcileMetrics,
    stop: impl std::future::Future<Output = ()>,
) -> anyhow::Result<()> {
    // Temporal's settings are checked first: a bad one stops the process at start, naming it.
    let target = config.temporal.resolve()?;
    if config.resolve_orphans {
        config.resolve_config()?;
    }
    let sources = Arc::new(config.sources().await?);
    let runtime = Runtime::from_current_tokio(Default::default())?;
    let client = payout_workflows::client::connect_to(&target, &serve.identity).await?;
    tracing::info!(temporal = %target.describe(), "connected to Temporal");
    ensure_schedule(&client, &serve).await?;
    metrics.schedule_healthy.set(1);
    let (stop_keeper, keeper_stop) = tokio::sync::watch::channel(false);
    let keeper = tokio::spawn(keep(
        client.clone(),
        serve.clone(),
        config.clone(),
        sources.clone(),
        metrics.clone(),
        keeper_stop,
    ));
    let activities = ReconcileActivities {
        config,
        sources,
        metrics,
        cursors: Arc::new(Cursors::default()),
    };
    let mut options = WorkerOptions::new(serve.task_queue.clone())
        .register_workflow::<ReconcileWorkflow>()?
        .register_activities(activities)
        .build();
    options.graceful_shutdown_period = Some(GRACEFUL_SHUTDOWN_PERIOD);
    options.client_identity_override = Some(serve.identity.clone());
    let mut worker = Worker::new(&runtime, client, options)?;
    let shutdown = worker.shutdown_handle();
    tracing::info!(task_queue = %serve.task_queue, schedule_id = %serve.schedule_id, "reconciler worker polling");
    let (result, ()) = tokio::join!(worker.run(), async {
        stop.await;
        tracing::info!("shutdown requested");
        let _ = stop_keeper.send(true);
        shutdown();
    });
    // The keeper ends at the stop (or with the worker, whose error is the one reported).
    let _ = stop_keeper.send(true);
    if let Err(e) = keeper.await {
        tracing::error!(error = %e, "the schedule keeper ended abnormally");
    }
    result.context("reconciler worker stopped with an error")?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use resolver::resume::{Resumption, UNDESCRIBED};

    use super::ReconcileMetrics;
    use crate::report::{Pass, PassError};
    use crate::RunReport;

    fn counter(metrics: &ReconcileMetrics, name: &str, pass: &str) -> f64 {
        metrics
            .metrics
            .registry
            .gather()
            .iter()
            .filter(|f| f.name() == name)
            .flat_map(|f| f.get_metric().iter())
            .find(|m| m.get_label().iter().any(|l| l.value() == pass))
            .map(|m| m.get_counter().get_value())
            .unwrap_or(-1.0)
    }

    /// A run whose resume pass failed and whose orphan resolver skipped a payout: the failure is
    /// counted under its part, the skip under its pass, and a run whose checks did not run is a
    /// failed run that sets no last run.
    #[test]
    fn each_failed_part_and_skipped_payout_is_counted_by_its_pass() {
        let metrics = ReconcileMetrics::new();
        for pass in ["orphans", "resume", "checks"] {
            assert_eq!(counter(&metrics, "reconciler_pass_errors_total", pass), 0.0);
        }
        let skipped = Resumption {
            payout_id: "po-1".into(),
            account_id: "acc-1".into(),
            state: "PENDING".into(),
            workflow: UNDESCRIBED.into(),
            action: "ERROR".into(),
            took_over_from: None,
            detail: "no answer".into(),
        };
        metrics.record(&RunReport {
            checks: None,
            resolutions: Vec::new(),
            resumptions: vec![skipped],
            errors: vec![
                PassError {
                    pass: Pass::Orphans,
                    detail: "connecting to temporal: refused".into(),
                },
                PassError {
                    pass: Pass::Checks,
                    detail: "paydb: refused".into(),
                },
            ],
        });
        assert_eq!(
            counter(&metrics, "reconciler_pass_errors_total", "orphans"),
            1.0
        );
        assert_eq!(
            counter(&metrics, "reconciler_pass_errors_total", "checks"),
            1.0
        );
        assert_eq!(
            counter(&metrics, "reconciler_pass_errors_total", "resume"),
            0.0
        );
        assert_eq!(
            counter(&metrics, "reconciler_payouts_skipped_total", "resume"),
            1.0
        );
        assert_eq!(
            counter(&metrics, "reconciler_payouts_skipped_total", "orphans"),
            0.0
        );
        assert_eq!(metrics.failed_runs.get(), 1);
        assert_eq!(metrics.runs.get(), 0);
        assert_eq!(metrics.last_run.get(), 0);
    }
}
