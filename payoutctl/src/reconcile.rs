//! `payoutctl reconcile`: every detective control, on demand. Exit status 1 on any violation, 3
//! when a database does not answer (`crate::ops::exit`).

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
    /// Where the audit chain's head is kept between runs (the check fails if a later run no
    /// longer finds it: the chain was rewritten). The local stack's default is
    /// `<state dir>/audit-anchor.json`; keep a deployment's somewhere paydb's administrators
    /// cannot write.
    #[arg(long, env = "PAYOUT_AUDIT_ANCHOR_FILE")]
    pub audit_anchor_file: Option<std::path::PathBuf>,
    /// Examine only the accounts touched since the last clean run (the watermark kept beside the
    /// audit anchor), not every account: what the scheduled reconciler runs between its full
    /// passes. Without a watermark (no clean run yet) the run is a full pass.
    #[arg(long)]
    pub incremental: bool,
}

/// A database that has not let us log in within this does not answer (a login here takes well
/// under a second even on a loaded two-core machine; sqlx's own default would wait 30 s).
pub const DB_CONNECT_TIMEOUT_MS: u64 = 10_000;

pub async fn sources(target: &Resolved) -> anyhow::Result<reconciler::Sources> {
    // A database that does not answer is "could not connect" (exit status 3).
    let connect = |url: String| async move {
        sqlx::postgres::PgPoolOptions::new()
            .acquire_timeout(std::time::Duration::from_millis(DB_CONNECT_TIMEOUT_MS))
            .connect(&url)
            .await
            .map_err(|e| crate::ops::exit::unreachable(db_access::redact(&url), e))
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
            target.etcd_tls.clone(),
            target.lock_prefix.clone(),
        )),
        operators: target.operators.clone(),
    })
}

pub async fn run(args: Args) -> anyhow::Result<std::process::ExitCode> {
    use anyhow::Context;
    let target = args.target.resolve()?;
    let sources = sources(&target).await?;
    let anchor_file = args.audit_anchor_file.clone().or_else(|| {
        (!args.target.is_external()).then(|| args.target.state_dir.join("audit-anchor.json"))
    });
    let audit_anchor = match &anchor_file {
        Some(path) => reconciler::AuditHead::load(path)
            .with_context(|| format!("reading the audit anchor {}", path.display()))?,
        None => None,
    };
    let watermark_file = anchor_file.as_deref().map(reconciler::Watermark::beside);
    let since = match (&watermark_file, args.incremental) {
        (Some(path), true) => reconciler::Watermark::load(path)
            .with_context(|| format!("reading the watermark {}", path.display()))?,
        (None, true) => anyhow::bail!(
            "--incremental needs the watermark kept beside an audit anchor: give --audit-anchor-file"
        ),
        (_, false) => None,
    };
    let report = reconciler::reconcile(
        &sources,
        &reconciler::Options {
            require_outbox_drained: args.require_drained,
            audit_anchor,
            since,
            rail: reconciler::RailOptions::kept_beside(anchor_file.as_deref())
                .context("reading the rail cross-check's cursor beside the audit anchor")?,
            ..Default::default()
        },
    )
    .await?;
    // The rail cross-check's cursor advances every run (RailOptions::keep_beside says why).
    reconciler::RailOptions::keep_beside(anchor_file.as_deref(), report.rail_cursor.as_deref())
        .context("writing the rail cross-check's cursor beside the audit anchor")?;
    // A run that found the chain broken keeps the old anchor and watermark: the evidence stays,
    // and the next incremental run examines everything touched since the last clean one.
    if let (Some(path), Some(watermark_file), true) =
        (&anchor_file, &watermark_file, report.is_clean())
    {
        reconciler::AuditHead::save(&report.audit_heads, path)
            .with_context(|| format!("writing the audit anchor {}", path.display()))?;
        report
            .watermark
            .save(watermark_file)
            .with_context(|| format!("writing the watermark {}", watermark_file.display()))?;
    }
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
