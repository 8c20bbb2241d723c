//! `payoutdev stack up | down | status`: the local stack as daemons that outlive the command,
//! under one state directory, with data that persists across `down`/`up`.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::{Args as ClapArgs, Subcommand};
use payoutctl::record::{
    Databases, Part, StackPorts, StackRecord, SystemPorts, SystemRecord, DEFAULT_STATE_DIR,
    LOCK_ETCD_PREFIX, TASK_QUEUE,
};
use serde::Serialize;
use testkit::system::{System, SystemOptions};
use testkit::{Lifetime, Stack};

/// Services listen at `--service-port-base` + 1 ..= this (gRPC, /metrics, the reconciler's).
const SERVICE_PORT_OFFSET_MAX: u16 = 20;
/// Worker i serves `/metrics` and `/healthz` at `--service-port-base` + this + i.
const WORKER_METRICS_PORT_OFFSET: u16 = 21;
/// Prometheus and Alertmanager listen at `--service-port-base` + these (so up to nine workers fit
/// below them).
const PROMETHEUS_PORT_OFFSET: u16 = 30;
const ALERTMANAGER_PORT_OFFSET: u16 = 31;
/// The silence watch's `/metrics` (issue 34), beside them.
const SILENCE_WATCH_PORT_OFFSET: u16 = 32;
/// The most workers whose ports (base + 21 + i) fit below Prometheus's.
const WORKERS_MAX: u16 = PROMETHEUS_PORT_OFFSET - WORKER_METRICS_PORT_OFFSET;
/// The local stack's scrape and rule evaluation interval: alerts within seconds, a light load.
const MONITORING_INTERVAL_MS: u64 = 5_000;

/// The local stack's payouts wait this much past the stub's settlement window before a lookup
/// counts, so the first lookup after the window is authoritative.
pub(crate) const SETTLEMENT_MARGIN_MS: u64 = 500;
/// The local stack's resolution SLA for the workflows it starts: an ambiguous payout may be
/// abandoned after two minutes, not finance's hour.
pub(crate) const LOCAL_RESOLUTION_SLA_MS: u64 = 120_000;

/// How long `down` waits for a part to exit on SIGTERM before SIGKILL.
const STOP_GRACE_MS: u64 = 15_000;

#[derive(Subcommand)]
pub enum Action {
    /// Start every part (or report that it is already up) and wait until each is ready.
    Up(UpArgs),
    /// Stop every part; data stays in the state directory.
    Down(StateArgs),
    /// Each part with its address and health; non-zero exit if any is unhealthy.
    Status(StatusArgs),
}

#[derive(ClapArgs)]
pub struct StateArgs {
    #[arg(long, env = "PAYOUT_STATE_DIR", default_value = DEFAULT_STATE_DIR,
          value_parser = payoutctl::record::state_dir_arg)]
    pub state_dir: PathBuf,
}

#[derive(ClapArgs)]
pub struct StatusArgs {
    #[command(flatten)]
    pub state: StateArgs,
    /// One JSON object instead of a table.
    #[arg(long)]
    pub json: bool,
}

#[derive(ClapArgs)]
pub struct UpArgs {
    #[command(flatten)]
    pub state: StateArgs,
    // Every default port lies below Linux's ephemeral range (32768-60999): a port in it can be
    // held by one of this machine's own outgoing connections (in TIME-WAIT after a `stack down`),
    // and the restarted service then fails to bind it.
    #[arg(long, env = "PAYOUT_PG_MAIN_PORT", default_value_t = 25432)]
    pub pg_main_port: u16,
    #[arg(long, env = "PAYOUT_PG_PROXY_PORT", default_value_t = 25433)]
    pub pg_proxy_port: u16,
    /// Client port of the first etcd member; further members take the next ports.
    #[arg(long, env = "PAYOUT_ETCD_PORT", default_value_t = 2379)]
    pub etcd_port: u16,
    /// 1 by default; 3 for a cluster that survives a member loss.
    #[arg(long, default_value_t = 1)]
    pub etcd_members: usize,
    #[arg(long, env = "PAYOUT_TEMPORAL_PORT", default_value_t = 7233)]
    pub temporal_port: u16,
    #[arg(long, env = "PAYOUT_TEMPORAL_UI_PORT", default_value_t = 8233)]
    pub temporal_ui_port: u16,
    /// Our services listen on base+1.. (lock-server, payment-resource, rail-stub, rail-proxy,
    /// general-ledger; the rail stub's admin API on base+6) and serve /metrics on base+11..base+16; worker i serves /metrics and
    /// /healthz on base+21+i; Prometheus listens on base+30 and Alertmanager on base+31.
    #[arg(long, env = "PAYOUT_SERVICE_PORT_BASE", default_value_t = 20050)]
    pub service_port_base: u16,
    /// Payout workers to run (1 to 9: worker i's port base+21+i stays below Prometheus's).
    #[arg(long, env = "PAYOUT_WORKERS", default_value_t = 2,
          value_parser = clap::builder::TypedValueParser::map(
              clap::value_parser!(u16).range(1..=i64::from(WORKERS_MAX)), usize::from))]
    pub workers: usize,
    /// The rail stub's settlement window: lookups are authoritative after it.
    #[arg(long, default_value_t = 2000)]
    pub settlement_window_ms: u64,
    /// Seconds between the reconciler's scheduled runs (a Temporal schedule).
    #[arg(long, default_value_t = 300)]
    pub reconcile_interval_s: u64,
    /// Infrastructure only (PostgreSQL, etcd, Temporal), none of our services.
    #[arg(long)]
    pub infra_only: bool,
    /// Measurement only: leave the Temporal dev server's raw ports open to every local user
    /// (run by root, they are otherwise closed to all but its front), so that
    /// `payoutdev bench e2e --temporal-raw-address` can set the front's cost beside the raw
    /// frontend. Never for a stack anyone else uses.
    #[arg(long)]
    pub no_temporal_isolation: bool,
}

/// What `up` leaves behind for `down`, `status`, `migrate` and the run.
fn alive(pid: u32) -> bool {
    testkit::util::pid_alive(pid)
}

pub async fn run(action: Action) -> anyhow::Result<std::process::ExitCode> {
    match action {
        Action::Up(args) => up(args).await,
        Action::Down(args) => down(&args.state_dir),
        Action::Status(args) => status(&args.state.state_dir, args.json).await,
    }
}

/// `up` without the status table (for `payoutdev run`).
pub async fn up_quiet(args: UpArgs) -> anyhow::Result<()> {
    start(args).await
}

async fn up(args: UpArgs) -> anyhow::Result<std::process::ExitCode> {
    let dir = args.state.state_dir.clone();
    start(args).await?;
    // Processes that were just started may still be opening their listeners (the reconciler's
    // metrics, the UI): wait for every part to answer, up to a bound, then print the table.
    let deadline = Instant::now() + UP_HEALTH_WAIT;
    while Instant::now() < deadline {
        let record = StackRecord::load(&dir)?;
        if part_rows(&record, &dir).await.iter().all(|r| r.healthy) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let code = status(&dir, false).await?;
    if code != std::process::ExitCode::SUCCESS {
        let record = StackRecord::load(&dir)?;
        for row in part_rows(&record, &dir).await.iter().filter(|r| !r.healthy) {
            print_log_tail(&dir, &row.name);
        }
    }
    Ok(code)
}

/// The last lines of a part's log (`<name>.log` anywhere under the state directory), on stderr:
/// what an unhealthy part said before `up` gave up on it.
fn print_log_tail(dir: &Path, name: &str) {
    let file = format!("{name}.log");
    let mut pending = vec![dir.to_path_buf()];
    while let Some(d) = pending.pop() {
        let Ok(entries) = std::fs::read_dir(&d) else {
            continue;
        };
        for entry in entries.flatten() {
            let path = entry.path();
            if path.is_dir() {
                pending.push(path);
            } else if path.file_name().is_some_and(|f| f == file.as_str()) {
                let text = std::fs::read_to_string(&path).unwrap_or_default();
                let lines: Vec<&str> = text.lines().collect();
                eprintln!("--- {} (last 20 lines)", path.display());
                for line in &lines[lines.len().saturating_sub(20)..] {
                    eprintln!("{line}");
                }
            }
        }
    }
}

/// What the local stack's alerting says at a moment: whether its path works end to end (every rule
/// loaded, every target up) and which alerts fire, in Prometheus and in Alertmanager.
#[derive(Debug, Serialize)]
pub(crate) struct AlertingReport {
    /// Each thing that keeps an alert from firing; empty when the path works.
    pub dark: Vec<String>,
    pub rules_loaded: usize,
    pub targets_up: usize,
    pub targets: usize,
    /// `name{label=value,..}` of each alert Prometheus holds as firing, but the heartbeat.
    pub firing_in_prometheus: Vec<String>,
    /// The same for each alert Alertmanager holds active (what would page), but the heartbeat.
    pub active_in_alertmanager: Vec<String>,
    /// Whether the always-firing `Watchdog` has reached Alertmanager: the pipeline is whole (its
    /// absence is dark: a watcher down, blind or silenced).
    pub heartbeat: bool,
}

impl AlertingReport {
    /// One line for a summary.
    pub fn render(&self) -> String {
        let list = |alerts: &[String]| {
            if alerts.is_empty() {
                "none".to_string()
            } else {
                alerts.join(", ")
            }
        };
        let path = if self.dark.is_empty() {
            format!(
                "{} rules loaded, {} of {} targets up",
                self.rules_loaded, self.targets_up, self.targets
            )
        } else {
            format!("DARK: {}", self.dark.join("; "))
        };
        format!(
            "alerting: {path}; heartbeat {}; firing in Prometheus: {}; active in Alertmanager: {}",
            if self.heartbeat {
                "arriving"
            } else {
                "MISSING"
            },
            list(&self.firing_in_prometheus),
            list(&self.active_in_alertmanager)
        )
    }
}

/// The local stack's [`AlertingReport`], from its record's Prometheus and Alertmanager.
pub(crate) async fn alerting_report(dir: &Path) -> anyhow::Result<AlertingReport> {
    let record = StackRecord::load(dir)?;
    let api = monitoring_api(&record, dir)?;
    let health = api.alerting_health(&dir.join("monitoring")).await?;
    let named = |labels: &std::collections::BTreeMap<String, String>| {
        let name = labels.get("alertname").cloned().unwrap_or_default();
        let rest: Vec<String> = labels
            .iter()
            .filter(|(k, _)| !matches!(k.as_str(), "alertname" | "severity" | "instance"))
            .map(|(k, v)| format!("{k}={v}"))
            .collect();
        format!("{name}{{{}}}", rest.join(","))
    };
    let heartbeat = |labels: &std::collections::BTreeMap<String, String>| {
        labels.get("severity").map(String::as_str) == Some(testkit::monitoring::HEARTBEAT_SEVERITY)
    };
    let mut firing_in_prometheus: Vec<String> = api
        .prometheus_firing_alerts()
        .await?
        .iter()
        .filter(|labels| !heartbeat(labels))
        .map(named)
        .collect();
    firing_in_prometheus.sort();
    let active = api.alertmanager_alerts().await?;
    let heartbeat_arriving = active.iter().any(|a| heartbeat(&a.labels));
    let mut active_in_alertmanager: Vec<String> = active
        .iter()
        .filter(|a| !heartbeat(&a.labels))
        .map(|a| named(&a.labels))
        .collect();
    active_in_alertmanager.sort();
    let mut dark = health.problems();
    if !heartbeat_arriving {
        dark.push(format!(
            "no {} heartbeat in Alertmanager",
            testkit::monitoring::WATCHDOG
        ));
    }
    Ok(AlertingReport {
        heartbeat: heartbeat_arriving,
        dark,
        rules_loaded: health.rules_loaded,
        targets_up: health.targets_expected.len() - health.targets_not_up.len(),
        targets: health.targets_expected.len(),
        firing_in_prometheus,
        active_in_alertmanager,
    })
}

/// How long [`settled_alerting_report`] gives a dark path to come back: a target's health is its
/// last scrape's, and one scrape (every 5 s here, its timeout as long) of a busy process can fail
/// without the path being dark; two intervals and a margin tell a blip from a dark path, and the
/// heartbeat needs a look of the silence watch, a scrape and an evaluation (three intervals).
const ALERTING_SETTLE: Duration = Duration::from_secs(30);

/// The stack's [`AlertingReport`] once its path works, or, if it stays dark for
/// [`ALERTING_SETTLE`], the last report that says why.
pub(crate) async fn settled_alerting_report(dir: &Path) -> anyhow::Result<AlertingReport> {
    let deadline = Instant::now() + ALERTING_SETTLE;
    loop {
        let report = alerting_report(dir).await?;
        if report.dark.is_empty() || Instant::now() >= deadline {
            return Ok(report);
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// Why a recorded stack predates the monitoring's login, the rail stub's own admin listener, the
/// rail's TLS or etcd's authentication (issue 34), if it does.
fn launch_from_before_issue_34(dir: &Path, record: &StackRecord) -> Option<String> {
    // The kit's etcd client is `root` since etcd's authentication: an etcd without it still
    // runs with every certificate all-powerful, and its lock-server's and reconciler's saved
    // launches name certificates that are no user.
    if testkit::etcd::EtcdTls::kit_client_in(dir)
        .cert
        .is_some_and(|cert| !cert.exists())
    {
        return Some("its etcd runs without authentication".into());
    }
    let monitoring = dir.join("monitoring");
    if monitoring.exists()
        && !testkit::monitoring::password_file(&monitoring, testkit::monitoring::OPERATOR_USER)
            .exists()
    {
        return Some("its Prometheus and Alertmanager have no login".into());
    }
    if record
        .system
        .as_ref()
        .is_some_and(|s| s.ports.rail_stub_admin == 0)
    {
        return Some("its rail stub has no admin listener of its own".into());
    }
    if record.system.is_some() && !dir.join("system").join(testkit::rail::DIR).exists() {
        return Some("its rail link is plain HTTP (no rail authority)".into());
    }
    None
}

/// The first saved launch (`<state dir>/parts/*.json`) that names a relative path (its program,
/// log, working directory, or an argument that is a path), and which: such a launch, or the
/// configuration it was rendered with, depends on the folder it is read from.
fn relative_saved_launch(dir: &Path) -> Option<String> {
    let relative_path = |value: &str| {
        let value = value.split_once('=').map_or(value, |(_, v)| v);
        value.contains('/') && !value.starts_with('/') && !value.contains("://")
    };
    let entries = std::fs::read_dir(dir.join("parts")).ok()?;
    for entry in entries.flatten() {
        let path = entry.path();
        if path.extension().is_none_or(|e| e != "json") {
            continue;
        }
        let Ok(launch) =
            serde_json::from_slice::<serde_json::Value>(&std::fs::read(&path).unwrap_or_default())
        else {
            continue;
        };
        let text = |v: &serde_json::Value| v.as_str().unwrap_or_default().to_string();
        let mut values = vec![
            text(&launch["program"]),
            text(&launch["log_path"]),
            text(&launch["cwd"]),
        ];
        values.extend(launch["args"].as_array().into_iter().flatten().map(text));
        if let Some(v) = values
            .iter()
            .find(|v| !v.is_empty() && relative_path(v.as_str()))
        {
            return Some(format!(
                "the saved launch of {} names the relative path {v}",
                text(&launch["name"])
            ));
        }
    }
    None
}

/// How long `up` waits for every part to answer its health probe before it reports.
const UP_HEALTH_WAIT: Duration = Duration::from_secs(30);

async fn start(args: UpArgs) -> anyhow::Result<()> {
    let dir = &args.state.state_dir;
    std::fs::create_dir_all(dir)?;
    if let Ok(record) = StackRecord::load(dir) {
        // Up already, or partly: each part is asked by its own health check, and only the parts
        // that do not answer are started again (crate::parts); the rest keep running.
        let repair = if record.system.is_none() && !args.infra_only {
            crate::parts::Repair::NeedsFullStart {
                why: "the recorded stack runs no services".into(),
            }
        } else if let Some(why) = launch_from_before_issue_34(dir, &record) {
            // Monitoring without its login, a rail stub on one listener: parts restarted from
            // these launches would never answer the health checks of today's.
            crate::parts::Repair::NeedsFullStart { why }
        } else if let Some(why) = relative_saved_launch(dir) {
            // A stack started before every path was made absolute: its Prometheus loads no rule
            // (its configuration names them relative to its own folder), and its parts cannot be
            // restarted from another working directory. A full start renders it all again, from
            // the same data.
            crate::parts::Repair::NeedsFullStart { why }
        } else {
            crate::parts::repair(dir).await?
        };
        match repair {
            crate::parts::Repair::Repaired { restarted } => {
                if restarted.is_empty() {
                    eprintln!("stack already up");
                } else {
                    eprintln!("started again: {}", restarted.join(", "));
                }
                return Ok(());
            }
            crate::parts::Repair::NeedsFullStart { why } => {
                // Stop what is left, then start everything from the same data.
                eprintln!("{why}: restarting the whole stack");
                down(dir)?;
            }
        }
    }
    let ports = StackPorts {
        pg_main: args.pg_main_port,
        pg_proxy: args.pg_proxy_port,
        // Client ports step by 10 so the peer ports chosen beside them never collide.
        etcd_clients: (0..args.etcd_members)
            .map(|i| args.etcd_port + 10 * i as u16)
            .collect(),
        temporal: args.temporal_port,
        temporal_ui: args.temporal_ui_port,
        // The dev server's HTTP API and metrics ports sit beside the UI's.
        temporal_http: args.temporal_ui_port + 1,
        temporal_metrics: args.temporal_ui_port + 2,
    };
    // The services' ports, before any part picks a fresh port of its own (etcd's peers): the
    // parts start in parallel, and a fresh pick must never be a port another part will bind.
    if !args.infra_only {
        let workers = u16::try_from(args.workers).unwrap_or(u16::MAX);
        testkit::util::reserve_ports(
            (1..=SERVICE_PORT_OFFSET_MAX)
                .chain((0..workers).map(|i| WORKER_METRICS_PORT_OFFSET + i))
                .chain([
                    PROMETHEUS_PORT_OFFSET,
                    ALERTMANAGER_PORT_OFFSET,
                    SILENCE_WATCH_PORT_OFFSET,
                ])
                .map(|i| args.service_port_base + i),
        );
    }
    let started = Instant::now();
    eprintln!(
        "starting PostgreSQL x2, etcd ({} member(s)) and Temporal in {}",
        args.etcd_members,
        dir.display()
    );
    let dir_for_thread = dir.clone();
    let ports_for_thread = ports.clone();
    let no_isolation = args.no_temporal_isolation;
    let stack = tokio::task::spawn_blocking(move || {
        Stack::builder()
            .state_dir(dir_for_thread)
            .lifetime(Lifetime::Detached)
            .durable(true)
            .etcd_members(args.etcd_members)
            .ports(testkit_stack_ports(&ports_for_thread))
            .temporal(true)
            .temporal_isolation(!no_isolation)
            .start()
    })
    .await??;
    // Each database as a deployment has it: owned by the owner role, which migrates it; only
    // its services' roles may connect (the roles were provisioned when each server started).
    eprintln!(
        "infrastructure up in {:.1}s; provisioning the databases",
        started.elapsed().as_secs_f64()
    );
    use testkit::db_access::Database;
    for kind in [Database::Paydb, Database::Gldb, Database::Lockdb] {
        stack.main.provision_database(kind.name(), kind).await?;
    }
    stack
        .proxy
        .provision_database("proxydb", Database::Proxydb)
        .await?;
    // payoutctl's local target reads the lock service's grant records and audit chain
    // (`payoutctl reconcile`, `restore rearm`) with a certificate named for it: a user of the
    // stack's etcd with the reconciler's role on the stack's prefix (issue 34).
    stack.etcd.grant(
        payoutctl::target::LOCAL_ETCD_USER,
        testkit::etcd::EtcdRole::Reconciler,
        LOCK_ETCD_PREFIX,
    )?;
    let temporal = stack.temporal();
    let mut parts = vec![
        Part {
            name: "postgres-main".into(),
            pid: stack.main.process.pid().expect("started"),
            address: format!("127.0.0.1:{}", stack.main.port),
        },
        Part {
            name: "postgres-proxy".into(),
            pid: stack.proxy.process.pid().expect("started"),
            address: format!("127.0.0.1:{}", stack.proxy.port),
        },
    ];
    for member in &stack.etcd.members {
        parts.push(Part {
            name: format!("etcd-{}", member.name),
            pid: member.process.pid().expect("started"),
            address: member.endpoint(),
        });
    }
    // The front before the server: a repair starts it first (it needs nothing behind it to
    // listen), and the server's health is then read through it; `down` stops the server first.
    parts.push(Part {
        name: "temporal-front".into(),
        pid: temporal.front.process.pid().expect("started"),
        address: temporal.address(),
    });
    parts.push(Part {
        name: "temporal".into(),
        pid: temporal.process.pid().expect("started"),
        address: temporal.raw_address(),
    });
    let mut record = StackRecord {
        ports,
        parts,
        system: None,
    };
    crate::parts::save(dir, "postgres-main", &stack.main.process)?;
    crate::parts::save(dir, "postgres-proxy", &stack.proxy.process)?;
    for member in &stack.etcd.members {
        crate::parts::save(dir, &format!("etcd-{}", member.name), &member.process)?;
    }
    crate::parts::save(dir, "temporal-front", &temporal.front.process)?;
    crate::parts::save(dir, "temporal", &temporal.process)?;
    record.save(dir)?;
    if !args.infra_only {
        let base = args.service_port_base;
        let system_ports = SystemPorts {
            lock_server: base + 1,
            payment_resource: base + 2,
            rail_stub: base + 3,
            rail_proxy: base + 4,
            general_ledger: base + 5,
            metrics: (11..17).map(|i| base + i).collect(),
            worker_metrics_base: Some(base + WORKER_METRICS_PORT_OFFSET),
            rail_stub_admin: base + 6,
        };
        let databases = Databases {
            paydb: record.pg_url(dir, record.ports.pg_main, "paydb"),
            proxydb: record.pg_url(dir, record.ports.pg_proxy, "proxydb"),
            gldb: record.pg_url(dir, record.ports.pg_main, "gldb"),
        };
        let options = SystemOptions {
            workers: args.workers,
            settlement_window_ms: args.settlement_window_ms,
            lifetime: Lifetime::Detached,
            dir: Some(dir.join("system")),
            ports: Some(testkit_system_ports(&system_ports)),
            databases: Some(testkit_databases(&databases)),
            task_queue: Some(TASK_QUEUE.to_string()),
            etcd_prefix: Some(LOCK_ETCD_PREFIX.to_string()),
            // CreatePayout's staged starts, delivered by the dispatcher with the clocks the main
            // job and the benchmarks use.
            workflow_starts: Some(testkit::system::WorkflowStarts {
                settlement_window_ms: args.settlement_window_ms + SETTLEMENT_MARGIN_MS,
                resolution_sla_ms: LOCAL_RESOLUTION_SLA_MS,
            }),
            ..SystemOptions::default()
        };
        eprintln!("starting the services and {} worker(s)", args.workers);
        let system = System::start(&stack, options).await?;
        // Each worker's address is its health endpoint, which `status` checks.
        let worker_endpoints: std::collections::HashMap<&str, u16> = system
            .workers
            .iter()
            .map(|w| w.name())
            .zip(system.worker_metrics.iter().copied())
            .collect();
        for process in system.processes() {
            let address = match process.name() {
                name if worker_endpoints.contains_key(name) => {
                    format!("http://127.0.0.1:{}/healthz", worker_endpoints[name])
                }
                "lock-server" => SystemRecord::url(system_ports.lock_server),
                "payment-resource" => SystemRecord::url(system_ports.payment_resource),
                // Its health and metrics listener (its payments API is the proxy's alone).
                "rail-stub" => format!("http://127.0.0.1:{}", system_ports.metrics[2]),
                "rail-proxy" => SystemRecord::url(system_ports.rail_proxy),
                "general-ledger" => SystemRecord::url(system_ports.general_ledger),
                _ => "-".to_string(),
            };
            crate::parts::save(dir, process.name(), process)?;
            record.parts.push(Part {
                name: process.name().to_string(),
                pid: process.pid().unwrap_or(0),
                address,
            });
        }
        // The reconciler on its Temporal schedule, with its own /metrics (base + 17).
        let etcd = record.etcd_endpoints().join(",");
        let reconciler = testkit::ManagedProcess::start(
            testkit::ProcessSpec::new(
                "reconciler",
                testkit::workspace_bin("reconciler"),
                dir.join("system").join("reconciler.log"),
            )
            .lifetime(Lifetime::Detached)
            .arg("serve")
            // It reads as its own role (`reconciler`: SELECT only); each URL holds the password,
            // so it goes through the environment, never the command line. (Before, it was given
            // the superuser's URL without a password and exited at start: the local stack ran no
            // reconciler, and every `up` found a dead part and restarted the whole stack.)
            .env(
                "PAYDB_URL",
                stack
                    .pg(testkit::PgServer::Main)
                    .login_url("reconciler", "paydb"),
            )
            .env(
                "PROXYDB_URL",
                stack
                    .pg(testkit::PgServer::Proxy)
                    .login_url("reconciler", "proxydb"),
            )
            .env(
                "GLDB_URL",
                stack
                    .pg(testkit::PgServer::Main)
                    .login_url("reconciler", "gldb"),
            )
            .args(["--etcd-endpoints", &etcd])
            .args(
                stack
                    .etcd_identity(testkit::etcd::EtcdRole::Reconciler, LOCK_ETCD_PREFIX)?
                    .to_args(),
            )
            .args(["--lock-prefix", LOCK_ETCD_PREFIX])
            .args([
                "--lock-server-url".to_string(),
                SystemRecord::url(system_ports.lock_server),
            ])
            .args([
                "--rail-proxy-url".to_string(),
                SystemRecord::url(system_ports.rail_proxy),
            ])
            .args([
                "--payment-resource-url".to_string(),
                SystemRecord::url(system_ports.payment_resource),
            ])
            .args(["--temporal-address".to_string(), record.temporal_address()])
            // Through the Temporal front, with the reconciler's profile.
            .args([
                "--temporal-config-file".to_string(),
                temporal.clients_file().display().to_string(),
                "--temporal-profile".to_string(),
                "reconciler".to_string(),
            ])
            // Its own certificate (role reconciler) from the stack's authority.
            .args(
                system
                    .pki
                    .issue(testkit::pki::Role::Reconciler, "reconciler")?
                    .to_args(),
            )
            .args([
                "--metrics-listen".to_string(),
                format!("127.0.0.1:{}", base + 17),
            ])
            .args([
                "--interval-s".to_string(),
                args.reconcile_interval_s.to_string(),
            ])
            .arg("--resolve-orphans")
            // The stack's registered operator: every account opening's funding is checked.
            .args(["--operator-keys".to_string(), system.operator.registered()])
            // Its audit anchor, watermark and rail cursor, kept between runs as a deployment's
            // are: after a clean run, runs are incremental, with a full pass every hour.
            .arg("--audit-anchor-file")
            .arg(dir.join("system").join("reconciler-anchor.json"))
            // Stranded payouts go back to a workflow on the workers' queue.
            .arg("--resume-stranded")
            .args(["--payout-task-queue", TASK_QUEUE])
            .args([
                "--settlement-window-ms".to_string(),
                args.settlement_window_ms.to_string(),
            ]),
        )?;
        crate::parts::save(dir, "reconciler", &reconciler)?;
        record.parts.push(Part {
            name: "reconciler".into(),
            pid: reconciler.pid().unwrap_or(0),
            address: format!("http://127.0.0.1:{}/metrics", base + 17),
        });
        // Prometheus (base + 30) scraping every part with the project's alert rules, and
        // Alertmanager (base + 31): deploy/monitoring, started as testkit::monitoring does.
        let mut targets = testkit::monitoring::system_targets(&system);
        targets.push(testkit::monitoring::Target::local("reconciler", base + 17));
        targets.extend(testkit::monitoring::stack_targets(&stack));
        let monitoring = testkit::monitoring::Monitoring::start(
            &dir.join("monitoring"),
            &targets,
            testkit::monitoring::MonitoringOptions {
                interval: Duration::from_millis(MONITORING_INTERVAL_MS),
                prometheus_port: Some(base + PROMETHEUS_PORT_OFFSET),
                alertmanager_port: Some(base + ALERTMANAGER_PORT_OFFSET),
                silence_watch_port: Some(base + SILENCE_WATCH_PORT_OFFSET),
                lifetime: Lifetime::Detached,
                ..Default::default()
            },
        )
        .await?;
        let mut monitoring_parts = vec![
            (&monitoring.prometheus, monitoring.prometheus_url("")),
            (&monitoring.alertmanager, monitoring.alertmanager_url("")),
        ];
        // The silence watch (issue 34): its own part, so status shows it and down stops it.
        if let (Some(watch), Some(port)) =
            (&monitoring.silence_watch, monitoring.silence_watch_port)
        {
            monitoring_parts.push((watch, format!("http://127.0.0.1:{port}/metrics")));
        }
        for (process, address) in monitoring_parts {
            crate::parts::save(dir, process.name(), process)?;
            record.parts.push(Part {
                name: process.name().to_string(),
                pid: process.pid().unwrap_or(0),
                address,
            });
        }
        record.system = Some(SystemRecord {
            ports: system_ports,
            databases,
            task_queue: TASK_QUEUE.to_string(),
            settlement_window_ms: args.settlement_window_ms,
        });
        record.save(dir)?;
    }
    // The processes are detached: dropping the handles leaves them running.
    drop(stack);
    eprintln!(
        "stack up in {:.1}s (state in {})",
        started.elapsed().as_secs_f64(),
        dir.display()
    );
    Ok(())
}

fn down(dir: &Path) -> anyhow::Result<std::process::ExitCode> {
    let record = StackRecord::load(dir)?;
    // Reverse order: Temporal first, PostgreSQL last.
    for recorded in record.parts.iter().rev() {
        // A part restarted by hand serves with another pid than the recorded one: that is the
        // process to stop.
        let part = &match serving_pid(recorded, &record) {
            Some(pid) if !alive(recorded.pid) => Part {
                pid,
                ..recorded.clone()
            },
            _ => recorded.clone(),
        };
        if !alive(part.pid) {
            continue;
        }
        // SIGTERM to the part's leader only: it stops its own children in order. SIGKILL to
        // the whole group only if it overstays its grace.
        // SAFETY: signals to processes `up` started (each part leads its own process group).
        // PostgreSQL's fast shutdown is SIGINT (SIGTERM would wait for every client to leave).
        let signal = if part.name.starts_with("postgres") {
            libc::SIGINT
        } else {
            libc::SIGTERM
        };
        unsafe {
            libc::kill(part.pid as i32, signal);
        }
        let deadline = Instant::now() + Duration::from_millis(STOP_GRACE_MS);
        while alive(part.pid) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(50));
        }
        if alive(part.pid) {
            eprintln!(
                "{} did not stop within {STOP_GRACE_MS} ms; killing it",
                part.name
            );
            // SAFETY: as above.
            unsafe {
                libc::kill(-(part.pid as i32), libc::SIGKILL);
            }
            let deadline = Instant::now() + Duration::from_millis(STOP_GRACE_MS);
            while alive(part.pid) && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(50));
            }
            anyhow::ensure!(
                !alive(part.pid),
                "{} (pid {}) survived SIGKILL",
                part.name,
                part.pid
            );
        }
        // Progress, on stderr: a `run --json` or `bench --json` that restarts a part keeps its
        // stdout one JSON object.
        eprintln!("stopped {}", part.name);
    }
    // The Temporal isolation rules share the dev server's life: gone with it, so that no rule
    // refuses whoever binds its raw ports next.
    testkit::temporal_front::Isolation::remove_stale();
    Ok(std::process::ExitCode::SUCCESS)
}

#[derive(Serialize)]
struct PartStatus {
    name: String,
    address: String,
    /// The process that serves the part's port (a part restarted by hand serves with another pid
    /// than the recorded one); the recorded pid when nothing serves it.
    pid: u32,
    /// The pid `up` recorded, when it is not the one that serves.
    #[serde(skip_serializing_if = "Option::is_none")]
    recorded_pid: Option<u32>,
    running: bool,
    healthy: bool,
    /// Why the part is not healthy, when its check can say more than that it did not answer.
    #[serde(skip_serializing_if = "Option::is_none")]
    problem: Option<String>,
}

/// Each part's liveness and health, the UI's last.
async fn part_rows(record: &StackRecord, dir: &Path) -> Vec<PartStatus> {
    let mut rows = Vec::new();
    let look = Look::open(record, dir);
    for part in &record.parts {
        // A part restarted by hand has another pid than the recorded one: its own health check
        // says what it does, and the process on its port is the one that serves.
        let (healthy, problem) = health(part, record, dir, &look).await;
        let pid = serving_pid(part, record);
        let running = healthy || alive(part.pid) || pid.is_some();
        rows.push(PartStatus {
            name: part.name.clone(),
            address: part.address.clone(),
            pid: pid.unwrap_or(part.pid),
            recorded_pid: pid.filter(|p| *p != part.pid).map(|_| part.pid),
            running,
            healthy,
            problem,
        });
    }
    // The UI is behind the front's TLS and login: up when the front listens on its port.
    let ui_ok = testkit::util::listening_pid(record.ports.temporal_ui).is_some();
    rows.push(PartStatus {
        name: "temporal-ui".into(),
        address: record.ui_url(),
        pid: testkit::util::listening_pid(record.ports.temporal_ui)
            .or_else(|| {
                record
                    .parts
                    .iter()
                    .find(|p| p.name == "temporal")
                    .map(|p| p.pid)
            })
            .unwrap_or(0),
        recorded_pid: None,
        running: ui_ok,
        healthy: ui_ok,
        problem: None,
    });
    rows
}

async fn status(dir: &Path, json: bool) -> anyhow::Result<std::process::ExitCode> {
    let record = StackRecord::load(dir)?;
    let rows = part_rows(&record, dir).await;
    let all_ok = rows.iter().all(|r| r.healthy);
    if json {
        println!(
            "{}",
            serde_json::json!({
                "healthy": all_ok,
                "parts": rows,
                "temporal_ui": record.ui_url(),
                "temporal_address": record.temporal_address(),
                "databases": record.database_urls(dir).into_iter().collect::<std::collections::BTreeMap<_, _>>(),
            })
        );
    } else {
        println!("{:<17} {:<28} {:>8}  HEALTH", "PART", "ADDRESS", "PID");
        for r in &rows {
            let health = if r.healthy {
                "healthy"
            } else if r.running {
                "UNHEALTHY"
            } else {
                "DOWN"
            };
            println!("{:<16} {:<28} {:>8}  {}", r.name, r.address, r.pid, health);
            if let Some(problem) = &r.problem {
                println!("{:<16} {problem}", "");
            }
            if let Some(recorded) = r.recorded_pid {
                println!(
                    "{:<16} served by pid {} (recorded {recorded}: restarted by hand?)",
                    "", r.pid
                );
            }
        }
        println!();
        println!(
            "Temporal UI: {} (user operator, password in {})",
            record.ui_url(),
            StackRecord::temporal_ui_password_file(dir).display()
        );
        let monitoring = dir.join("monitoring");
        println!(
            "Prometheus and Alertmanager: TLS and a login (user {}, password in {}, authority {})",
            testkit::monitoring::OPERATOR_USER,
            testkit::monitoring::password_file(&monitoring, testkit::monitoring::OPERATOR_USER)
                .display(),
            testkit::monitoring::ca_file(&monitoring).display()
        );
        println!(
            "Temporal frontend: {} (namespace default), through its mutual-TLS front:",
            record.temporal_address()
        );
        println!(
            "  TEMPORAL_CONFIG_FILE={} TEMPORAL_PROFILE=operator temporal workflow list",
            StackRecord::temporal_clients_file(dir).display()
        );
    }
    Ok(if all_ok {
        std::process::ExitCode::SUCCESS
    } else {
        std::process::ExitCode::FAILURE
    })
}

/// What the health checks of one look at the stack share, read once: the certificate of the
/// stack's own authority its gRPC probes present (the reconciler's, in the system's directory) and
/// the monitoring's API (its authority and the operator's login).
pub(crate) struct Look {
    grpc: anyhow::Result<mtls::Tls>,
    monitoring: anyhow::Result<testkit::monitoring::Api>,
}

impl Look {
    pub(crate) fn open(record: &StackRecord, dir: &Path) -> Self {
        Self {
            grpc: testkit::pki::Pki::in_dir(&dir.join("system"))
                .map(|pki| pki.tls(mtls::Role::Reconciler)),
            monitoring: monitoring_api(record, dir),
        }
    }

    fn monitoring(&self) -> anyhow::Result<&testkit::monitoring::Api> {
        self.monitoring
            .as_ref()
            .map_err(|e| anyhow::anyhow!("{e:#}"))
    }
}

/// The stack's Prometheus and Alertmanager, at their recorded ports, as the operator.
fn monitoring_api(record: &StackRecord, dir: &Path) -> anyhow::Result<testkit::monitoring::Api> {
    let port_of = |name: &str| {
        record
            .parts
            .iter()
            .find(|p| p.name == name)
            .and_then(|p| part_port(p, record))
            .with_context(|| format!("the stack's record has no {name}"))
    };
    testkit::monitoring::Api::open(
        &dir.join("monitoring"),
        port_of("prometheus")?,
        port_of("alertmanager")?,
    )
}

/// The port a part serves (its address's, or for the dispatcher its `/metrics`).
fn part_port(part: &Part, record: &StackRecord) -> Option<u16> {
    if part.name == "outbox-dispatcher" {
        return record.system.as_ref()?.ports.metrics.last().copied();
    }
    part.address
        .trim_end_matches("/healthz")
        .trim_end_matches("/metrics")
        .rsplit(':')
        .next()?
        .parse()
        .ok()
}

/// The process listening on the part's port, if any.
pub(crate) fn serving_pid(part: &Part, record: &StackRecord) -> Option<u32> {
    testkit::util::listening_pid(part_port(part, record)?)
}

/// A part's health with, when it is not healthy and its check can say why, the reason: for
/// Prometheus, which answers its readiness endpoint with no rule and no target loaded, each
/// thing that keeps an alert from firing.
async fn health(
    part: &Part,
    record: &StackRecord,
    dir: &Path,
    look: &Look,
) -> (bool, Option<String>) {
    if !healthy(part, record, dir, look).await {
        return (false, None);
    }
    if part.name != "prometheus" {
        return (true, None);
    }
    let checked = async {
        look.monitoring()?
            .alerting_health(&dir.join("monitoring"))
            .await
    };
    match checked.await {
        Ok(h) if h.problems().is_empty() => (true, None),
        Ok(h) => (false, Some(h.problems().join("; "))),
        Err(e) => (false, Some(format!("{e:#}"))),
    }
}

/// A part's own health check (its port, its health endpoint); a worker without an endpoint and
/// a part of unknown kind are judged by their recorded pid. Prometheus's full check (rules and
/// targets) is [`health`]'s.
pub(crate) async fn healthy(part: &Part, record: &StackRecord, dir: &Path, look: &Look) -> bool {
    let port = |url: &str| {
        url.rsplit(':')
            .next()
            .and_then(|p| p.parse::<u16>().ok())
            .unwrap_or(0)
    };
    match part.name.as_str() {
        "lock-server" | "payment-resource" | "rail-proxy" | "general-ledger" => {
            let (Ok(server), Ok(tls)) = (mtls::Role::parse(&part.name), &look.grpc) else {
                return false;
            };
            return testkit::system::probe_grpc(port(&part.address), tls, server).await;
        }
        "rail-stub" => {
            return testkit::util::http_get(
                port(&part.address),
                "/healthz",
                Duration::from_secs(2),
            )
            .is_ok_and(|(code, _)| code == 200);
        }
        // A worker answers 200 on /healthz while connected to Temporal with its pollers
        // running (a record from before it served one has no address: running is its health).
        name if name.starts_with("payout-worker") => {
            let Some(endpoint) = part.address.strip_suffix("/healthz") else {
                return alive(part.pid);
            };
            return testkit::util::http_get(port(endpoint), "/healthz", Duration::from_secs(2))
                .is_ok_and(|(code, _)| code == 200);
        }
        // The dispatcher (GL delivery and workflow starts) answers on its /metrics, the last of
        // the services' metrics ports.
        "outbox-dispatcher" => {
            let Some(metrics) = record.system.as_ref().and_then(|s| s.ports.metrics.last()) else {
                return alive(part.pid);
            };
            return testkit::util::http_get(*metrics, "/metrics", Duration::from_secs(2))
                .is_ok_and(|(code, _)| code == 200);
        }
        // Both answer 200 on /-/ready once their configuration is loaded (over TLS, to the
        // operator's login: testkit::monitoring).
        "prometheus" | "alertmanager" => {
            let Ok(api) = look.monitoring() else {
                return false;
            };
            let url = if part.name == "prometheus" {
                api.prometheus_url("/-/ready")
            } else {
                api.alertmanager_url("/-/ready")
            };
            return api
                .get(&url)
                .send()
                .await
                .is_ok_and(|r| r.status().is_success());
        }
        // Both serve /metrics (the silence watch is up when it serves, whether or not its last
        // look succeeded: SilenceWatchBlind says that).
        "reconciler" | testkit::monitoring::SILENCE_WATCH_JOB => {
            let metrics = part.address.trim_end_matches("/metrics");
            return testkit::util::http_get(port(metrics), "/metrics", Duration::from_secs(2))
                .is_ok_and(|(code, _)| code == 200);
        }
        _ => {}
    }
    if part.name.starts_with("postgres") {
        let port = part.address.rsplit(':').next().unwrap_or_default();
        let Ok(bin) = testkit::postgres::bin_dir() else {
            return false;
        };
        std::process::Command::new(bin.join("pg_isready"))
            .args(["-h", "127.0.0.1", "-p", port, "-U", "postgres", "-q"])
            .status()
            .is_ok_and(|s| s.success())
    } else if part.name.starts_with("etcd") {
        // etcd is mutual TLS only: a read (which needs a leader) with the test kit's own client
        // certificate from the stack's authority.
        let Ok(tls) = testkit::etcd::EtcdTls::kit_client_in(dir).load() else {
            return false;
        };
        testkit::etcd::read_as(&part.address, Some(&tls), "/")
            .await
            .is_ok()
    } else if part.name == "temporal-front" {
        // Up when it listens; what is behind it is the server's part.
        part.address
            .rsplit_once(':')
            .and_then(|(_, port)| port.parse::<u16>().ok())
            .and_then(testkit::util::listening_pid)
            .is_some()
    } else if part.name == "temporal" {
        // The server answers only through the front, as an operator.
        let Ok(cli) = testkit::temporal::cli_path() else {
            return false;
        };
        std::process::Command::new(cli)
            .args([
                "operator",
                "namespace",
                "describe",
                "--namespace",
                "default",
                "--address",
            ])
            .arg(record.temporal_address())
            .env(
                "TEMPORAL_CONFIG_FILE",
                StackRecord::temporal_clients_file(dir),
            )
            .env("TEMPORAL_PROFILE", "operator")
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    } else {
        false
    }
}

/// The record's plain ports as the test kit's stack builder takes them.
fn testkit_stack_ports(p: &StackPorts) -> testkit::stack::StackPorts {
    testkit::stack::StackPorts {
        pg_main: p.pg_main,
        pg_proxy: p.pg_proxy,
        etcd_clients: p.etcd_clients.clone(),
        temporal: p.temporal,
        temporal_ui: p.temporal_ui,
        temporal_http: p.temporal_http,
        temporal_metrics: p.temporal_metrics,
    }
}

fn testkit_system_ports(p: &SystemPorts) -> testkit::system::SystemPorts {
    testkit::system::SystemPorts {
        lock_server: p.lock_server,
        payment_resource: p.payment_resource,
        rail_stub: p.rail_stub,
        rail_proxy: p.rail_proxy,
        general_ledger: p.general_ledger,
        metrics: p.metrics.clone(),
        worker_metrics_base: p.worker_metrics_base,
        rail_stub_admin: p.rail_stub_admin,
    }
}

fn testkit_databases(d: &Databases) -> testkit::system::Databases {
    testkit::system::Databases {
        paydb: d.paydb.clone(),
        proxydb: d.proxydb.clone(),
        gldb: d.gldb.clone(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A record of a stack with services; `rail_stub_admin` 0 is a record from before the rail
    /// stub had its own admin listener.
    fn record(rail_stub_admin: u16) -> StackRecord {
        serde_json::from_value(serde_json::json!({
            "ports": {
                "pg_main": 1, "pg_proxy": 2, "etcd_clients": [3], "temporal": 4,
                "temporal_ui": 5, "temporal_http": 6, "temporal_metrics": 7,
            },
            "parts": [],
            "system": {
                "ports": {
                    "lock_server": 11, "payment_resource": 12, "rail_stub": 13,
                    "rail_proxy": 14, "general_ledger": 15, "metrics": [21, 22, 23, 24, 25, 26],
                    "rail_stub_admin": rail_stub_admin,
                },
                "databases": {"paydb": "p", "proxydb": "x", "gldb": "g"},
                "task_queue": "q",
                "settlement_window_ms": 2000,
            },
        }))
        .expect("a stack record")
    }

    /// A state directory with everything a stack of today has: etcd's root client certificate,
    /// the monitoring's login, the rail's authority.
    fn today(dir: &Path) {
        let kit = testkit::etcd::EtcdTls::kit_client_in(dir);
        let cert = kit.cert.expect("the kit's client certificate path");
        std::fs::create_dir_all(cert.parent().unwrap()).unwrap();
        std::fs::write(&cert, "").unwrap();
        let monitoring = dir.join("monitoring");
        let password =
            testkit::monitoring::password_file(&monitoring, testkit::monitoring::OPERATOR_USER);
        std::fs::create_dir_all(password.parent().unwrap()).unwrap();
        std::fs::write(&password, "").unwrap();
        std::fs::create_dir_all(dir.join("system").join(testkit::rail::DIR)).unwrap();
    }

    /// Each thing a stack from before issue 34 lacks makes it restart whole (its parts started
    /// again from their old launches would never pass today's health checks), and a stack of
    /// today is repaired part by part (the control).
    #[test]
    fn a_stack_from_before_issue_34_is_started_whole_for_each_thing_it_lacks() {
        let dir = tempfile::tempdir().unwrap();
        today(dir.path());
        assert_eq!(launch_from_before_issue_34(dir.path(), &record(6)), None);
        let why = launch_from_before_issue_34(dir.path(), &record(0));
        assert!(
            why.as_deref().is_some_and(|w| w.contains("admin listener")),
            "{why:?}"
        );

        // What a stack of that time lacked, taken away from one of today.
        type TakeAway = fn(&Path);
        let cases: [(&str, TakeAway); 3] = [
            ("without authentication", |d: &Path| {
                std::fs::remove_file(testkit::etcd::EtcdTls::kit_client_in(d).cert.unwrap())
                    .unwrap()
            }),
            ("no login", |d: &Path| {
                std::fs::remove_file(testkit::monitoring::password_file(
                    &d.join("monitoring"),
                    testkit::monitoring::OPERATOR_USER,
                ))
                .unwrap()
            }),
            ("plain HTTP", |d: &Path| {
                std::fs::remove_dir(d.join("system").join(testkit::rail::DIR)).unwrap()
            }),
        ];
        for (reason, take_away) in cases {
            let dir = tempfile::tempdir().unwrap();
            today(dir.path());
            take_away(dir.path());
            let why = launch_from_before_issue_34(dir.path(), &record(6));
            assert!(
                why.as_deref().is_some_and(|w| w.contains(reason)),
                "{reason}: {why:?}"
            );
        }
    }
}
