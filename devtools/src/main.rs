//! `payoutdev`: the developer harness. The local stack, the main job, the benchmarks and the
//! fault-injection suite (with its guard-off negative controls). It links the test kit and the
//! fault harness, so it never ships: the image carries `payoutctl`, the operator CLI.

mod bench;
mod chaos;
mod e2e;
mod parts;
mod profile;
mod reconcile_bench;
mod run;
mod stack;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "payoutdev",
    version,
    about = "The fenced payout system's developer harness: local stack, main job, benchmarks, fault injection"
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
    Run(Box<run::Args>),
    /// Fault injection: a workload under a seeded nemesis, then an independent checker (exit 1 on a violation).
    Chaos(chaos::Args),
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
            Command::Bench { which } => bench::run(which).await,
            Command::Run(args) => run::run(*args).await,
            Command::Chaos(args) => chaos::run(args).await,
        }
    });
    match result {
        Ok(code) => code,
        Err(error) => {
            eprintln!("payoutdev: error: {error:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
