//! `payoutctl reconcile`: every detective control, on demand. Exit status 1 on any violation.

use clap::Args as ClapArgs;

use crate::target::{Resolved, Target};

#[derive(ClapArgs)]
pub struct Args {
    #[command(flatten)]
    pub target: Target,
    /// Undelivered outbox rows count as violations.
    #[arg(long)]
    pub require_drained: bool,
    /// One JSON object instead of a table.
    #[arg(long)]
    pub json: bool,
}

pub async fn sources(target: &Resolved) -> anyhow::Result<reconciler::Sources> {
    use anyhow::Context;
    let connect = |url: String| async move {
        sqlx::PgPool::connect(&url)
            .await
            .with_context(|| format!("connecting to {}", db_access::redact(&url)))
    };
    Ok(reconciler::Sources {
        paydb: connect(target.paydb.clone()).await?,
        proxydb: connect(target.proxydb.clone()).await?,
        gldb: connect(target.gldb.clone()).await?,
        rail_proxy: Some(reconciler::ProxySource {
            url: target.proxy_url.clone(),
            tls: target.tls(mtls::Role::Reconciler)?,
        }),
        lock_grants: Some(reconciler::LockGrants::new(
            target.etcd_endpoints.clone(),
            target.lock_prefix.clone(),
        )),
    })
}

pub async fn run(args: Args) -> anyhow::Result<std::process::ExitCode> {
    let target = args.target.resolve()?;
    let sources = sources(&target).await?;
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
