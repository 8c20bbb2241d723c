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
    },
    /// Operator commands for rows the GL refused.
    Quarantine {
        #[command(subcommand)]
        action: QuarantineAction,
    },
}

#[derive(Subcommand)]
enum QuarantineAction {
    /// Lists quarantined rows (JSON), with the rows each one holds back.
    List,
    /// Clears one row's quarantine so it is delivered again (after a fix).
    Replay {
        #[arg(long)]
        id: i64,
        #[arg(long)]
        operator: String,
        #[arg(long)]
        reason: String,
    },
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
        } => {
            let instance_id =
                instance_id.unwrap_or_else(|| format!("dispatcher-{}", std::process::id()));
            let tls = tls.load().context("TLS material")?;
            let mut config =
                outbox_dispatcher::Config::new(cli.database_url, gl_endpoint, tls, instance_id);
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
            let dispatcher = outbox_dispatcher::Dispatcher::new(config, &metrics)
                .await
                .context("starting the dispatcher")?;
            dispatcher.run(shutdown.wait()).await;
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
                QuarantineAction::Replay {
                    id,
                    operator,
                    reason,
                } => {
                    outbox_dispatcher::replay(&pool, id, &operator, &reason)
                        .await
                        .context("replay")?;
                    println!("outbox row {id} released for delivery");
                }
            }
        }
    }
    Ok(())
}
