//! `general-ledger`: the GL server, and its operator command to rebuild the balance projection.

use std::net::SocketAddr;

use anyhow::Context;
use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "general-ledger",
    about = "Append-only double-entry General Ledger (gRPC ledger.v1)"
)]
struct Cli {
    #[arg(long, env = "GL_DATABASE_URL")]
    database_url: String,
    #[command(subcommand)]
    command: Command,
    #[arg(long, env = "GL_LISTEN", default_value = "127.0.0.1:50070")]
    listen: SocketAddr,
    #[arg(long, env = "GL_METRICS_LISTEN", default_value = "127.0.0.1:9470")]
    metrics_listen: SocketAddr,
}

#[derive(Subcommand)]
enum Command {
    /// Serve gRPC over mutual TLS.
    Serve {
        #[command(flatten)]
        tls: service_kit::grpc::ServerTlsArgs,
    },
    /// Recompute cached balances from entries; prints the drift found (JSON) and repairs it.
    RebuildBalances,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    service_kit::init_tracing("general-ledger");
    match cli.command {
        Command::Serve { tls } => {
            let tls = tls.load().context("TLS material")?;
            let listener = service_kit::bind(cli.listen).await?;
            let metrics_listener = service_kit::bind(cli.metrics_listen).await?;
            let metrics = service_kit::Metrics::default();
            let shutdown = service_kit::Shutdown::on_signal();
            let metrics_task = tokio::spawn(service_kit::serve_metrics(
                metrics_listener,
                metrics.clone(),
                shutdown.clone().wait(),
            ));
            general_ledger::serve(
                general_ledger::Config::new(cli.database_url, tls),
                listener,
                metrics,
                shutdown.wait(),
            )
            .await
            .context("general ledger")?;
            metrics_task.abort();
        }
        Command::RebuildBalances => {
            let pool = general_ledger::app_pool(&cli.database_url)
                .await
                .context("database")?;
            general_ledger::require_schema(&pool).await?;
            let report = general_ledger::projection::rebuild(&pool)
                .await
                .context("rebuild")?;
            println!("{}", serde_json::to_string_pretty(&report)?);
        }
    }
    Ok(())
}
