//! `reconciler once [--json] [--resolve-orphans] [--resume-stranded]`: one run, exit status 1 on
//! any violation.
//! `reconciler serve`: a Temporal worker on the `reconciliation` task queue, the schedule that
//! starts `ReconcileWorkflow` every `--interval-s` (kept: re-created if missing, unpaused if
//! paused, every `--keeper-interval-s`), and `/metrics`.
//! `reconciler watch-silences`: the silence watch (`reconciler_service::silences`), its own
//! process so that a reconciler outage does not blind it, with `/metrics`.

use std::process::ExitCode;
use std::time::Duration;

use clap::{Parser, Subcommand};
use reconciler_service::service::{self, Config, ReconcileMetrics, ServeOptions};

#[derive(Parser)]
#[command(name = "reconciler", about = "Detective controls of the payout system")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// One run now: resolve orphans (if asked), check every invariant, print the report.
    Once {
        #[command(flatten)]
        config: Config,
        /// One JSON object instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Scheduled runs: a Temporal worker plus the schedule, and `/metrics`.
    Serve {
        #[command(flatten)]
        config: Config,
        #[arg(long, env = "RECONCILE_TASK_QUEUE", default_value = service::TASK_QUEUE)]
        task_queue: String,
        #[arg(long, env = "RECONCILE_SCHEDULE_ID", default_value = service::SCHEDULE_ID)]
        schedule_id: String,
        /// Seconds between scheduled runs.
        #[arg(long, env = "RECONCILE_INTERVAL_S", default_value_t = 300)]
        interval_s: u64,
        #[arg(long, env = "METRICS_LISTEN", default_value = "127.0.0.1:9109")]
        metrics_listen: std::net::SocketAddr,
        #[arg(long, env = "RECONCILER_IDENTITY")]
        identity: Option<String>,
        /// Seconds between the keeper's looks at the schedule (a missing one re-created, a
        /// paused one unpaused) and its short pass over blocked accounts; the default is
        /// `KEEPER_INTERVAL` (tests ask for less).
        #[arg(long, env = "RECONCILE_KEEPER_INTERVAL_S", default_value_t = service::KEEPER_INTERVAL.as_secs())]
        keeper_interval_s: u64,
    },
    /// The silence watch: every page (and heartbeat) alert rule Prometheus evaluates, against
    /// Alertmanager's active silences; exports `monitoring_page_alerts_silenced{rule}`.
    WatchSilences {
        /// Prometheus's base URL (its `/api/v1/rules`).
        #[arg(long, env = "SILENCE_WATCH_PROMETHEUS_URL")]
        prometheus_url: String,
        /// Alertmanager's base URL (its `/api/v2/silences`).
        #[arg(long, env = "SILENCE_WATCH_ALERTMANAGER_URL")]
        alertmanager_url: String,
        #[command(flatten)]
        access: MonitoringAccess,
        #[arg(long, env = "METRICS_LISTEN", default_value = "127.0.0.1:9110")]
        metrics_listen: std::net::SocketAddr,
        /// Milliseconds between looks.
        #[arg(long, env = "SILENCE_WATCH_INTERVAL_MS", default_value_t = reconciler_service::silences::INTERVAL_MS)]
        interval_ms: u64,
    },
}

/// How the silence watch reaches Prometheus and Alertmanager behind their TLS and login
/// (deploy/monitoring: both serve `--web.config.file`).
#[derive(clap::Args)]
struct MonitoringAccess {
    /// The authority that signed both APIs' certificates (PEM); needed for https:// URLs.
    #[arg(long, env = "SILENCE_WATCH_CA_FILE")]
    ca_file: Option<std::path::PathBuf>,
    /// The user both APIs know the watch by.
    #[arg(long, env = "SILENCE_WATCH_USERNAME", requires = "password_file")]
    username: Option<String>,
    /// A file holding that user's password (its first line).
    #[arg(long, env = "SILENCE_WATCH_PASSWORD_FILE", requires = "username")]
    password_file: Option<std::path::PathBuf>,
}

impl MonitoringAccess {
    fn read(&self) -> anyhow::Result<reconciler_service::silences::Access> {
        use anyhow::Context;
        let ca_pem = match &self.ca_file {
            Some(path) => {
                Some(std::fs::read(path).with_context(|| format!("reading {}", path.display()))?)
            }
            None => None,
        };
        let login = match (&self.username, &self.password_file) {
            (Some(user), Some(path)) => {
                let text = std::fs::read_to_string(path)
                    .with_context(|| format!("reading {}", path.display()))?;
                let password = text.lines().next().unwrap_or_default().to_string();
                anyhow::ensure!(!password.is_empty(), "{} holds no password", path.display());
                Some((user.clone(), password))
            }
            _ => None,
        };
        Ok(reconciler_service::silences::Access { ca_pem, login })
    }
}

#[tokio::main]
async fn main() -> anyhow::Result<ExitCode> {
    let cli = Cli::parse();
    match cli.command {
        Command::Once { config, json } => {
            init_tracing_to_stderr();
            let sources = config.sources().await?;
            // One run: its corrective passes begin at the oldest open payout.
            let report = service::run_once(&config, &sources, &service::Cursors::default()).await?;
            if json {
                println!("{}", serde_json::to_string(&report)?);
            } else {
                print!("{}", report.render());
            }
            Ok(if report.is_clean() {
                ExitCode::SUCCESS
            } else {
                ExitCode::FAILURE
            })
        }
        Command::Serve {
            config,
            task_queue,
            schedule_id,
            interval_s,
            metrics_listen,
            identity,
            keeper_interval_s,
        } => {
            service_kit::init_tracing("reconciler");
            let metrics = ReconcileMetrics::new();
            let shutdown = service_kit::Shutdown::on_signal();
            let listener = service_kit::bind(metrics_listen).await?;
            let metrics_task = tokio::spawn(service_kit::serve_metrics(
                listener,
                metrics.metrics.clone(),
                shutdown.clone().wait(),
            ));
            let serve = ServeOptions {
                task_queue,
                schedule_id,
                interval: Duration::from_secs(interval_s),
                identity: identity.unwrap_or_else(|| format!("reconciler-{}", std::process::id())),
                keeper_interval: Duration::from_secs(keeper_interval_s),
            };
            service::serve(config, serve, metrics, shutdown.wait()).await?;
            metrics_task.await??;
            Ok(ExitCode::SUCCESS)
        }
        Command::WatchSilences {
            prometheus_url,
            alertmanager_url,
            access,
            metrics_listen,
            interval_ms,
        } => {
            service_kit::init_tracing("silence-watch");
            anyhow::ensure!(interval_ms > 0, "--interval-ms must be positive");
            let metrics = service_kit::Metrics::default();
            let watch = reconciler_service::silences::SilenceWatch::new(
                &prometheus_url,
                &alertmanager_url,
                access.read()?,
                &metrics,
            )?;
            let shutdown = service_kit::Shutdown::on_signal();
            let listener = service_kit::bind(metrics_listen).await?;
            let metrics_task = tokio::spawn(service_kit::serve_metrics(
                listener,
                metrics,
                shutdown.clone().wait(),
            ));
            watch
                .run(Duration::from_millis(interval_ms), shutdown.wait())
                .await;
            metrics_task.await??;
            Ok(ExitCode::SUCCESS)
        }
    }
}

/// `once` prints its report on stdout (`--json` is one object, for a pipe), so its events go to
/// stderr; otherwise the same settings as every service (`RUST_LOG`, `LOG_FORMAT=json`).
fn init_tracing_to_stderr() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_target(false)
        .with_writer(std::io::stderr);
    let _ = if std::env::var("LOG_FORMAT").is_ok_and(|v| v == "json") {
        builder.json().flatten_event(true).try_init()
    } else {
        builder.try_init()
    };
}
