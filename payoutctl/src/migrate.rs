//! Forward-only migrations, one folder per database, embedded at build time. Services apply the
//! same folders at start; sqlx records each applied version and refuses a changed one.

use clap::Args as ClapArgs;
use sqlx::migrate::Migrator;

pub static PAYDB: Migrator = sqlx::migrate!("../migrations/paydb");
pub static PROXYDB: Migrator = sqlx::migrate!("../migrations/proxydb");
pub static GLDB: Migrator = sqlx::migrate!("../migrations/gldb");
pub static LOCKDB: Migrator = sqlx::migrate!("../migrations/lockdb");

#[derive(ClapArgs)]
pub struct Args {
    /// State directory of the local stack whose databases to migrate.
    #[arg(long, env = "PAYOUT_STATE_DIR", default_value = crate::record::DEFAULT_STATE_DIR)]
    pub state_dir: std::path::PathBuf,
}

pub async fn run(args: Args) -> anyhow::Result<std::process::ExitCode> {
    let record = crate::record::StackRecord::load(&args.state_dir)?;
    for (name, url) in record.database_urls() {
        apply(name, &url).await?;
        println!("migrated {name}");
    }
    Ok(std::process::ExitCode::SUCCESS)
}

pub fn migrator(database: &str) -> &'static Migrator {
    match database {
        "paydb" => &PAYDB,
        "proxydb" => &PROXYDB,
        "gldb" => &GLDB,
        "lockdb" => &LOCKDB,
        other => panic!("no migrations for database {other}"),
    }
}

pub async fn apply(database: &str, url: &str) -> anyhow::Result<()> {
    use anyhow::Context;
    let pool = sqlx::PgPool::connect(url)
        .await
        .with_context(|| format!("connecting to {database}"))?;
    migrator(database)
        .run(&pool)
        .await
        .with_context(|| format!("migrating {database}"))?;
    pool.close().await;
    Ok(())
}
