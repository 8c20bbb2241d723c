//! `outbox-dispatcher`: the delivery process, and the operator's quarantine commands.

use anyhow::Context;
use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "outbox-dispatcher",
    about = "Delivers paydb's ledger_outbox to the General Ledger"
)]
struct Cli {
    /// paydb (where ledger_outbox lives).
    #[arg(long, env = "PAYDB_DATABASE_URL")]
    database_url: String,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Deliver until SIGTERM.
    Run {
        #[arg(long, env = "GL_ENDPOINT", default_value = "https://127.0.0.1:50070")]
        gl_endpoint: String,
        #[command(flatten)]
        tls: mtls::TlsArgs,
        /// Names this instance in claims; defaults to host:pid.
        #[arg(long, env = "DISPATCHER_INSTANCE_ID")]
        instance_id: Option<String>,
        #[arg(
            long,
            env = "DISPATCHER_METRICS_LISTEN",
            default_value = "127.0.0.1:9471"
        )]
        metrics_listen: std::net::SocketAddr,
        #[arg(long, default_value_t = outbox_dispatcher::BATCH_SIZE_MAX)]
        batch_size: i64,
        #[arg(long, default_value_t = outbox_dispatcher::CLAIM_LEASE_MS)]
        claim_lease_ms: u64,
        #[arg(long, default_value_t = outbox_dispatcher::BACKOFF_MAX_MS)]
        backoff_max_ms: u64,
        #[arg(long, default_value_t = outbox_dispatcher::POLL_INTERVAL_MS)]
        poll_interval_ms: u64,
        #[command(flatten)]
        starts: Box<StartArgs>,
    },
    /// Rows the GL refused. Releasing one is the operator's `payoutctl outbox quarantine
    /// replay` (through the payment resource, under the operator's certified name).
    Quarantine {
        #[command(subcommand)]
        action: QuarantineAction,
    },
}

/// The workflow starter: delivers the payout workflow starts CreatePayout staged in paydb.
#[derive(clap::Args)]
struct StartArgs {
    /// Where the staged payout workflow starts are delivered (as every process configures
    /// Temporal: the flags, then TEMPORAL_*, then the config file's profile).
    #[command(flatten)]
    temporal: payout_workflows::client::TemporalArgs,
    /// The payout workers' task queue, where started workflows run.
    #[arg(long, env = "PAYOUT_TASK_QUEUE", default_value = payout_workflows::TASK_QUEUE)]
    payout_task_queue: String,
    /// The rail's settlement window each started workflow waits out before a lookup counts.
    #[arg(long, env = "PAYOUT_SETTLEMENT_WINDOW_MS",
          default_value_t = payout_activities::types::SETTLEMENT_WINDOW_MS_DEFAULT)]
    settlement_window_ms: u64,
    /// How long an ambiguous payout waits for evidence before an operator may abandon it.
    #[arg(long, env = "PAYOUT_RESOLUTION_SLA_MS",
          default_value_t = payout_activities::types::RESOLUTION_SLA_MS_DEFAULT)]
    resolution_sla_ms: u64,
    /// Deliver no workflow starts (staged starts wait): only where another process delivers
    /// them, or a test system whose tests start their own workflows.
    #[arg(long)]
    without_workflow_starts: bool,
}

#[derive(Subcommand)]
enum QuarantineAction {
    /// Lists quarantined rows (JSON), with the rows each one holds back.
    List,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    service_kit::init_tracing("outbox-dispatcher");
    match cli.command {
        Command::Run {
            gl_endpoint,
            tls,
            instance_id,
            metrics_listen,
            batch_size,
            claim_lease_ms,
            backoff_max_ms,
            poll_interval_ms,
            starts,
        } => {
            let instance_id =
                instance_id.unwrap_or_else(|| format!("dispatcher-{}", std::process::id()));
            let tls = tls.load().context("TLS material")?;
            let mut config = outbox_dispatcher::Config::new(
                cli.database_url.clone(),
                gl_endpoint,
                tls,
                instance_id.clone(),
            );
            config.batch_size = batch_size;
            config.claim_lease_ms = claim_lease_ms;
            config.backoff_max_ms = backoff_max_ms;
            config.poll_interval_ms = poll_interval_ms;
            let metrics = service_kit::Metrics::default();
            let shutdown = service_kit::Shutdown::on_signal();
            let metrics_listener = service_kit::bind(metrics_listen).await?;
            let metrics_task = tokio::spawn(service_kit::serve_metrics(
                metrics_listener,
                metrics.clone(),
                shutdown.clone().wait(),
            ));
            let starter = if starts.without_workflow_starts {
                tracing::warn!("--without-workflow-starts: staged payout workflow starts are not delivered by this process");
                None
            } else {
                // A bad Temporal setting is refused here, naming it.
                let temporal = starts
                    .temporal
                    .resolve()
                    .context("the Temporal connection")?;
                tracing::info!(temporal = %temporal.describe(), task_queue = %starts.payout_task_queue,
                    "delivering staged payout workflow starts");
                let config = outbox_dispatcher::starts::StarterConfig::new(
                    temporal,
                    starts.payout_task_queue,
                    payout_activities::types::AmbiguityPolicy {
                        settlement_window_ms: starts.settlement_window_ms,
                        resolution_sla_ms: starts.resolution_sla_ms,
                    },
                    instance_id.clone(),
                );
                let pool = service_kit::connect_pg(&cli.database_url).await?;
                Some(outbox_dispatcher::starts::Starter::new(
                    pool, config, &metrics,
                ))
            };
            let dispatcher = outbox_dispatcher::Dispatcher::new(config, &metrics)
                .await
                .context("starting the dispatcher")?;
            match &starter {
                Some(starter) => {
                    tokio::join!(
                        dispatcher.run(shutdown.clone().wait()),
                        starter.run(shutdown.wait())
                    );
                }
                None => dispatcher.run(shutdown.wait()).await,
            }
            metrics_task.abort();
        }
        Command::Quarantine { action } => {
            let pool = service_kit::connect_pg(&cli.database_url).await?;
            match action {
                QuarantineAction::List => {
                    let rows = outbox_dispatcher::list_quarantined(&pool)
                        .await
                        .context("listing")?;
                    println!("{}", serde_json::to_string_pretty(&rows)?);
                }
            }
        }
    }
    Ok(())
}
