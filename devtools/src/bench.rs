//! `payoutdev bench lock | proxy | ledger`: each benchmark measures our path and the plain path
//! it wraps in the same run, on a private stack of its own (real PostgreSQL and etcd), and prints
//! both with their ratio. `bench etcd-soak` mints many grants on a private etcd and prints its
//! database size as the run goes. Build with `--release` for figures worth comparing across machines.
//! The services measured here are hosted in this `payoutdev`, so their build is its own (each
//! prints it); `bench e2e` measures the local stack's, and checks them (crate::profile).

use clap::{Args as ClapArgs, Subcommand};
use service_benches::soak::{EtcdStatus, SoakReport};
use testkit::etcd::{EtcdCluster, EtcdLimits};
use testkit::{Lifetime, PgServer, Stack};

use crate::profile::Services;

#[derive(Subcommand)]
pub enum Which {
    /// Lock service acquire+release vs. the same etcd transactions done directly.
    Lock(Args),
    /// Rail proxy Submit vs. the zero-latency stub called directly.
    Proxy(Args),
    /// GL AppendJournal (two entries) vs. the same rows by plain SQL transactions.
    Ledger(Args),
    /// Many grants (acquire+release) on a private etcd: its database size and revision as they go.
    EtcdSoak(SoakArgs),
    /// The whole system beside our workflow's floor and the Temporal floor, on the local stack.
    E2e(Box<crate::e2e::Args>),
    /// The reconciler's full and incremental passes over a seeded book (a million payouts by
    /// default), beside a scan of every table, on a private stack.
    Reconcile(crate::reconcile_bench::Args),
    /// One pass of `bench reconcile`, in a process of its own (its memory figure is that pass's).
    #[command(hide = true)]
    ReconcilePass(crate::reconcile_bench::PassArgs),
}

#[derive(ClapArgs)]
pub struct SoakArgs {
    #[arg(long, default_value_t = 100_000)]
    pub grants: usize,
    #[arg(long, default_value_t = 16)]
    pub concurrency: usize,
    /// How long the soak's lock-server keeps grant records: scaled down from the deployment's
    /// week so the window fills early in the run and the plateau shows.
    #[arg(long, default_value_t = service_benches::soak::SOAK_GRANT_RETENTION_MS_DEFAULT)]
    pub grant_retention_ms: u64,
    /// One JSON object with every figure.
    #[arg(long)]
    pub json: bool,
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
    let which = match which {
        Which::EtcdSoak(args) => return soak(args).await,
        Which::E2e(args) => return crate::e2e::run(*args).await,
        Which::Reconcile(args) => return crate::reconcile_bench::run(args).await,
        Which::ReconcilePass(args) => return crate::reconcile_bench::one_pass_here(args).await,
        other => other,
    };
    // Durable PostgreSQL (fsync on), as in a deployment: both sides of each comparison pay for
    // their commits the way production would.
    let stack = tokio::task::spawn_blocking(|| Stack::builder().durable(true).start()).await??;
    let profile = profile();
    match which {
        Which::Lock(args) => {
            let services = Services::in_process(&["lock-server"]);
            let prefix = stack.unique_prefix("bench");
            let r = service_benches::lock::run(
                &stack.etcd_endpoints(),
                &stack.etcd_identity_tls(testkit::etcd::EtcdRole::LockServer, &prefix),
                &prefix,
                args.iterations,
                args.concurrency,
            )
            .await
            .map_err(|e| anyhow::anyhow!("lock bench: {e}"))?;
            if args.json {
                println!(
                    "{}",
                    serde_json::json!({"bench": "lock", "profile": profile, "services": services, "report": r})
                );
            } else {
                println!(
                    "lock: {} acquire+release, concurrency {}, {profile} build",
                    r.iterations, r.concurrency
                );
                println!("{services}");
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
            let services = Services::in_process(&["rail-proxy", "rail-stub"]);
            let url = stack.fresh_db(PgServer::Proxy).await;
            let r = service_benches::proxy::run(&url, args.iterations, args.concurrency)
                .await
                .map_err(|e| anyhow::anyhow!("proxy bench: {e}"))?;
            if args.json {
                println!(
                    "{}",
                    serde_json::json!({"bench": "proxy", "profile": profile, "services": services, "report": r})
                );
            } else {
                println!(
                    "proxy: {} payouts, concurrency {}, {profile} build",
                    r.iterations, r.concurrency
                );
                println!("{services}");
                println!(
                    "{:<28} {:>10} {:>10} {:>12}",
                    "path", "p50 (ms)", "p99 (ms)", "per s"
                );
                for (name, f) in [
                    ("rail proxy Submit", &r.proxy),
                    ("  security off", &r.proxy_insecure),
                    ("floor: 2 commits + stub", &r.floor),
                    ("  stub on pooled conns", &r.floor_pooled),
                    ("stub called directly", &r.direct),
                ] {
                    println!(
                        "{:<28} {:>10.2} {:>10.2} {:>12.0}",
                        name, f.p50_ms, f.p99_ms, f.throughput_per_s
                    );
                }
                println!(
                    "ratio proxy/floor: {:.2} (target at least {:.2}; against the floor on pooled stub connections, which the proxy may not use: {:.2}); direct/proxy {:.2}; stub movements {}",
                    r.proxy_over_floor,
                    service_benches::proxy::PROXY_OVER_FLOOR_TARGET,
                    r.proxy_over_floor_pooled,
                    r.throughput_ratio,
                    r.stub_movements
                );
                println!(
                    "ratio secured/insecure proxy: {:.2} (mutual TLS, the authorisation table and the grant signature check; target at least 0.95)",
                    r.secured_over_insecure
                );
            }
        }
        Which::Ledger(args) => {
            let services = Services::in_process(&["general-ledger"]);
            let url = stack.fresh_db(PgServer::Main).await;
            let r = service_benches::ledger::run(&url, args.iterations, args.concurrency)
                .await
                .map_err(|e| anyhow::anyhow!("ledger bench: {e}"))?;
            if args.json {
                println!(
                    "{}",
                    serde_json::json!({"bench": "ledger", "profile": profile, "services": services, "report": r})
                );
            } else {
                println!(
                    "ledger: {} two-entry journals, concurrency {}, {profile} build",
                    r.iterations, r.concurrency
                );
                println!("{services}");
                println!(
                    "{:<28} {:>10} {:>10} {:>12}",
                    "path", "p50 (ms)", "p99 (ms)", "journals/s"
                );
                for (name, s) in [
                    ("AppendJournal (gRPC)", &r.append_journal_grpc),
                    ("GL store, no gRPC hop", &r.store_direct),
                    ("plain SQL transactions", &r.plain_sql),
                    ("plain SQL + balance rows", &r.plain_sql_with_projection),
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
                println!(
                    "of which: AppendJournal/GL store {:.2} (the gRPC hop), GL store/plain SQL {:.2} (the ledger's statements)",
                    r.grpc_over_store, r.store_over_plain_sql
                );
                println!(
                    "GL store/plain SQL with the same balance rows: {:.2} (what is left is the ledger's logic: mode lock, ordered row locks, idempotency probe)",
                    r.store_over_plain_sql_with_projection
                );
            }
        }
        Which::EtcdSoak(_) | Which::E2e(_) | Which::Reconcile(_) | Which::ReconcilePass(_) => {
            unreachable!("handled above: they bring their own stack")
        }
    }
    Ok(std::process::ExitCode::SUCCESS)
}

pub(crate) fn profile() -> &'static str {
    if cfg!(debug_assertions) {
        "debug"
    } else {
        "release"
    }
}

/// The soak runs on one etcd member of its own with the testkit's limits (the same flags as
/// every test and the local stack), so nothing else writes to it.
async fn soak(args: SoakArgs) -> anyhow::Result<std::process::ExitCode> {
    let dir = tempfile::Builder::new().prefix("etcd-soak-").tempdir()?;
    let limits = EtcdLimits::default();
    let etcd = {
        let (path, limits) = (dir.path().to_path_buf(), limits.clone());
        tokio::task::spawn_blocking(move || {
            EtcdCluster::start_with_limits(
                &path,
                1,
                None,
                Lifetime::Attached,
                &limits,
                testkit::etcd::EtcdTls::with_own_authority(&path)?,
            )
        })
        .await??
    };
    let r = service_benches::soak::run(
        &etcd.endpoints(),
        &etcd.tls.client.load()?,
        args.grants,
        args.concurrency,
        args.grant_retention_ms,
    )
    .await
    .map_err(|e| anyhow::anyhow!("etcd soak: {e}"))?;
    let profile = profile();
    if args.json {
        println!(
            "{}",
            serde_json::json!({
                "bench": "etcd-soak",
                "profile": profile,
                "etcd": {
                    "auto_compaction_mode": "periodic",
                    "auto_compaction_retention": limits.compaction_retention(),
                    "quota_backend_bytes": limits.quota_backend_bytes(),
                },
                "report": r,
            })
        );
    } else {
        print_soak(&r, &limits, profile);
    }
    Ok(std::process::ExitCode::SUCCESS)
}

fn print_soak(r: &SoakReport, limits: &EtcdLimits, profile: &str) {
    const MIB: f64 = 1024.0 * 1024.0;
    println!(
        "etcd-soak: {} grants (acquire+release), concurrency {}, {profile} build",
        r.grants, r.concurrency
    );
    println!(
        "etcd: auto-compaction periodic {}, quota {:.0} MiB; grant records kept {} ms",
        limits.compaction_retention().unwrap_or("off"),
        limits.quota_backend_bytes() as f64 / MIB,
        r.grant_retention_ms
    );
    println!(
        "{:<8} {:>9} {:>9} {:>12} {:>14} {:>10} {:>9} {:>7}",
        "point", "grants", "elapsed s", "dbSize MiB", "inUse MiB", "revision", "records", "leases"
    );
    let row = |point: &str, grants: usize, elapsed_ms: u64, s: &EtcdStatus| {
        println!(
            "{:<8} {:>9} {:>9.1} {:>12.2} {:>14.2} {:>10} {:>9} {:>7}",
            point,
            grants,
            elapsed_ms as f64 / 1000.0,
            s.db_size_bytes as f64 / MIB,
            s.db_size_in_use_bytes as f64 / MIB,
            s.revision,
            s.grant_records,
            s.leases
        );
    };
    row("before", 0, 0, &r.before);
    let quarters = r.checkpoints.len().saturating_sub(1);
    for (i, c) in r.checkpoints.iter().take(quarters).enumerate() {
        row(
            &format!("{}%", (i + 1) * 100 / (quarters + 1)),
            c.grants,
            c.elapsed_ms,
            &c.status,
        );
    }
    row("after", r.grants, r.elapsed_ms, &r.after);
    println!(
        "{:.0} grants/s; dbSize grew {:.2} MiB ({:.2} % of the quota); revision +{}",
        r.grants_per_s,
        r.db_size_growth_bytes() as f64 / MIB,
        100.0 * r.db_size_growth_bytes() as f64 / limits.quota_backend_bytes() as f64,
        r.after.revision - r.before.revision
    );
}
