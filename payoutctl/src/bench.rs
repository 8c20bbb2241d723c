//! `payoutctl bench lock | proxy | ledger`: each benchmark measures our path and the plain path
//! it wraps in the same run, on a private stack of its own (real PostgreSQL and etcd), and prints
//! both with their ratio. Build with `--release` for figures worth comparing across machines.

use clap::{Args as ClapArgs, Subcommand};
use testkit::{PgServer, Stack};

#[derive(Subcommand)]
pub enum Which {
    /// Lock service acquire+release vs. the same etcd transactions done directly.
    Lock(Args),
    /// Rail proxy Submit vs. the zero-latency stub called directly.
    Proxy(Args),
    /// GL AppendJournal (two entries) vs. the same rows by plain SQL transactions.
    Ledger(Args),
}

#[derive(ClapArgs)]
pub struct Args {
    #[arg(long, default_value_t = 2000)]
    pub iterations: usize,
    #[arg(long, default_value_t = 8)]
    pub concurrency: usize,
    /// One JSON object with every figure.
    #[arg(long)]
    pub json: bool,
}

pub async fn run(which: Which) -> anyhow::Result<std::process::ExitCode> {
    // Durable PostgreSQL (fsync on), as in a deployment: both sides of each comparison pay for
    // their commits the way production would.
    let stack = tokio::task::spawn_blocking(|| Stack::builder().durable(true).start()).await??;
    let profile = if cfg!(debug_assertions) {
        "debug"
    } else {
        "release"
    };
    match which {
        Which::Lock(args) => {
            let r =
                lock_server::bench::run(&stack.etcd_endpoints(), args.iterations, args.concurrency)
                    .await
                    .map_err(|e| anyhow::anyhow!("lock bench: {e}"))?;
            if args.json {
                println!(
                    "{}",
                    serde_json::json!({"bench": "lock", "profile": profile, "report": r})
                );
            } else {
                println!(
                    "lock: {} acquire+release, concurrency {}, {profile} build",
                    r.iterations, r.concurrency
                );
                println!(
                    "{:<28} {:>10} {:>10} {:>12}",
                    "path", "p50 (ms)", "p99 (ms)", "ops/s"
                );
                for (name, s) in [
                    ("lock service (gRPC)", &r.service),
                    ("raw etcd transactions", &r.raw_etcd),
                ] {
                    println!(
                        "{:<28} {:>10.2} {:>10.2} {:>12.0}",
                        name,
                        s.p50_us as f64 / 1000.0,
                        s.p99_us as f64 / 1000.0,
                        s.ops_per_s
                    );
                }
                println!(
                    "p99 ratio service/raw: {:.2} (target at most 2)",
                    r.p99_ratio
                );
            }
        }
        Which::Proxy(args) => {
            let url = stack.fresh_db(PgServer::Proxy).await;
            let r = rail_proxy::bench::run(&url, args.iterations, args.concurrency)
                .await
                .map_err(|e| anyhow::anyhow!("proxy bench: {e}"))?;
            if args.json {
                println!(
                    "{}",
                    serde_json::json!({"bench": "proxy", "profile": profile, "report": r})
                );
            } else {
                println!(
                    "proxy: {} payouts, concurrency {}, {profile} build",
                    r.iterations, r.concurrency
                );
                println!(
                    "{:<28} {:>10} {:>10} {:>12}",
                    "path", "p50 (ms)", "p99 (ms)", "per s"
                );
                for (name, f) in [
                    ("rail proxy Submit", &r.proxy),
                    ("stub called directly", &r.direct),
                ] {
                    println!(
                        "{:<28} {:>10.2} {:>10.2} {:>12.0}",
                        name, f.p50_ms, f.p99_ms, f.throughput_per_s
                    );
                }
                println!(
                    "throughput ratio direct/proxy: {:.2}; guard cost per payout at p50: {:.2} ms; stub movements {}",
                    r.throughput_ratio, r.p50_overhead_ms, r.stub_movements
                );
            }
        }
        Which::Ledger(args) => {
            let url = stack.fresh_db(PgServer::Main).await;
            let r = general_ledger::bench::run(&url, args.iterations, args.concurrency)
                .await
                .map_err(|e| anyhow::anyhow!("ledger bench: {e}"))?;
            if args.json {
                println!(
                    "{}",
                    serde_json::json!({"bench": "ledger", "profile": profile, "report": r})
                );
            } else {
                println!(
                    "ledger: {} two-entry journals, concurrency {}, {profile} build",
                    r.iterations, r.concurrency
                );
                println!(
                    "{:<28} {:>10} {:>10} {:>12}",
                    "path", "p50 (ms)", "p99 (ms)", "journals/s"
                );
                for (name, s) in [
                    ("AppendJournal (gRPC)", &r.append_journal_grpc),
                    ("plain SQL transactions", &r.plain_sql),
                ] {
                    println!(
                        "{:<28} {:>10.2} {:>10.2} {:>12.0}",
                        name, s.p50_ms, s.p99_ms, s.journals_per_second
                    );
                }
                println!(
                    "ratio AppendJournal/plain SQL: {:.2} (target at least {:.2})",
                    r.ratio, r.target_ratio
                );
            }
        }
    }
    Ok(std::process::ExitCode::SUCCESS)
}
