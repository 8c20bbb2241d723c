//! `payoutctl`: what an operator types against a deployment. Errors are reported once, here,
//! with their context chain. The developer harness (stack, main job, benchmarks, fault
//! injection) is `payoutdev`, which this binary does not contain.

use clap::{Parser, Subcommand};
use payoutctl::{keys, migrate, ops::exit, reconcile};

#[derive(Parser)]
#[command(
    name = "payoutctl",
    version,
    about = "Operate the fenced payout system",
    after_help = exit::TABLE
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Check every invariant across paydb, proxydb, gldb, the rail and the lock grants.
    Reconcile(Box<reconcile::Args>),
    /// Apply the forward-only migrations of paydb, proxydb, gldb and lockdb, as the owner role
    /// (the only way the schema changes; services only check its version).
    Migrate(migrate::Args),
    /// Sign an operator decision: `sign abandon` prints the `abandon` signal's input.
    #[command(subcommand)]
    Sign(payoutctl::sign::Command),
    /// Database roles: `db provision` (owner and service logins, databases), `db roles`.
    #[command(subcommand)]
    Db(payoutctl::db::Command),
    /// etcd's users and roles: `etcd provision` (least privilege for the lock service's prefix,
    /// then authentication on).
    #[command(subcommand)]
    Etcd(payoutctl::etcd::Command),
    /// Make a deployment's keys (the lock service's grant signing key).
    #[command(subcommand)]
    Keys(keys::Command),
    /// Certificates for mutual TLS: `pki issue --dir DIR --role ROLE --name NAME`.
    #[command(subcommand)]
    Pki(payoutctl::pki::Command),
    /// After a guard's database (paydb, proxydb) was restored from a backup: `restore rearm`
    /// raises its fences to the lock service's horizon and re-arms it; `restore status` says
    /// whether each guard's database is current.
    #[command(subcommand)]
    Restore(payoutctl::restore::Command),
    /// Payouts: `payout show ID`, `payout list`, `payout create`, `payout abandon ID` (through
    /// the workflow's `abandon` Update).
    #[command(subcommand)]
    Payout(payoutctl::payout::Command),
    /// The lock service: `lock describe KEY`, `lock revoke KEY` (break-glass, audited).
    #[command(subcommand)]
    Lock(payoutctl::lock::Command),
    /// paydb's outbox to the General Ledger: `outbox quarantine list|replay`.
    #[command(subcommand)]
    Outbox(payoutctl::outbox::Command),
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
            Command::Migrate(args) => migrate::run(args).await,
            Command::Db(command) => payoutctl::db::run(command).await,
            Command::Etcd(command) => payoutctl::etcd::run(command).await,
            Command::Sign(command) => payoutctl::sign::run(command),
            Command::Reconcile(args) => reconcile::run(*args).await,
            Command::Keys(command) => keys::run(command),
            Command::Pki(command) => payoutctl::pki::run(command),
            Command::Restore(command) => payoutctl::restore::run(command).await,
            Command::Payout(command) => payoutctl::payout::run(command).await,
            Command::Lock(command) => payoutctl::lock::run(command).await,
            Command::Outbox(command) => payoutctl::outbox::run(command).await,
        }
    });
    match result {
        Ok(code) => code,
        Err(error) => {
            eprintln!("payoutctl: error: {error:#}");
            std::process::ExitCode::from(exit::code_of(&error))
        }
    }
}
