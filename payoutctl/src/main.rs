//! `payoutctl`: what an operator types. Errors are reported once, here, with their context chain.

mod bench;
mod chaos;
mod e2e;
mod migrate;
mod reconcile;
mod run;
mod stack;
mod target;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "payoutctl",
    version,
    about = "Operate the fenced payout system"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Start, stop or inspect the local stack (PostgreSQL x2, etcd, Temporal + UI).
    Stack {
        #[command(subcommand)]
        action: stack::Action,
    },
    /// Benchmarks that print figures: our path and the plain path it wraps, in the same run.
    Bench {
        #[command(subcommand)]
        which: bench::Which,
    },
    /// The main job: a batch of payouts through the whole system under rail faults, then the reconciler.
    Run(run::Args),
    /// Check every invariant across paydb, proxydb, gldb, the rail and the lock grants.
    Reconcile(reconcile::Args),
    /// Fault injection: a workload under a seeded nemesis, then an independent checker (exit 1 on a violation).
    Chaos(chaos::Args),
    /// Apply the forward-only migrations of paydb, proxydb, gldb and lockdb.
    Migrate(migrate::Args),
}

fn main() -> std::process::ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    let runtime = tokio::runtime::Runtime::new().expect("tokio runtime");
    let result = runtime.block_on(async {
        match cli.command {
            Command::Stack { action } => stack::run(action).await,
            Command::Migrate(args) => migrate::run(args).await,
            Command::Bench { which } => bench::run(which).await,
            Command::Reconcile(args) => reconcile::run(args).await,
            Command::Run(args) => run::run(args).await,
            Command::Chaos(args) => chaos::run(args).await,
        }
    });
    match result {
        Ok(code) => code,
        Err(error) => {
            eprintln!("payoutctl: error: {error:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
