//! `payoutctl reconcile`: every detective control, on demand. Exit status 1 on any violation.

use clap::Args as ClapArgs;

use crate::stack::{StackRecord, LOCK_ETCD_PREFIX};

#[derive(ClapArgs)]
pub struct Args {
    #[arg(long, env = "PAYOUT_STATE_DIR", default_value = crate::stack::DEFAULT_STATE_DIR)]
    pub state_dir: std::path::PathBuf,
    /// Undelivered outbox rows count as violations.
    #[arg(long)]
    pub require_drained: bool,
    /// One JSON object instead of a table.
    #[arg(long)]
    pub json: bool,
}

pub async fn sources(record: &StackRecord) -> anyhow::Result<reconciler::Sources> {
    use anyhow::Context;
    let system = record
        .system
        .as_ref()
        .context("the stack runs no services (it was started with --infra-only)")?;
    let connect = |url: String| async move {
        sqlx::PgPool::connect(&url)
            .await
            .with_context(|| format!("connecting {url}"))
    };
    Ok(reconciler::Sources {
        paydb: connect(system.databases.paydb.clone()).await?,
        proxydb: connect(system.databases.proxydb.clone()).await?,
        gldb: connect(system.databases.gldb.clone()).await?,
        rail_url: Some(system.rail_url()),
        lock_grants: Some((record.etcd_endpoints(), LOCK_ETCD_PREFIX.to_string())),
    })
}

pub async fn run(args: Args) -> anyhow::Result<std::process::ExitCode> {
    let record = StackRecord::load(&args.state_dir)?;
    let sources = sources(&record).await?;
    let report = reconciler::reconcile(
        &sources,
        &reconciler::Options {
            require_outbox_drained: args.require_drained,
        },
    )
    .await?;
    if args.json {
        println!("{}", serde_json::to_string(&report)?);
    } else {
        print!("{}", report.render());
    }
    Ok(if report.is_clean() {
        std::process::ExitCode::SUCCESS
    } else {
        std::process::ExitCode::FAILURE
    })
}
