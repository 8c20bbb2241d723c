//! Forward-only migrations, one folder per database, embedded at build time
//! (`db_access::migrations`). Applied here as the owner role; services only check that their
//! database is at the version they were built for; sqlx records each applied version and refuses a
//! changed one.

use clap::Args as ClapArgs;

/// The only way the schema changes: as the owner role (`payout_owner`), never as a service's
/// role (which may not run DDL) and never as the superuser. Services only check the version.
#[derive(ClapArgs)]
pub struct Args {
    /// State directory of the local stack whose databases to migrate.
    #[arg(long, env = "PAYOUT_STATE_DIR", default_value = crate::record::DEFAULT_STATE_DIR,
          value_parser = crate::record::state_dir_arg)]
    pub state_dir: std::path::PathBuf,
    /// A deployment's database instead (paydb, proxydb, gldb or lockdb), migrated at the URL in
    /// PAYOUT_MIGRATE_URL: the owner role's, with its password (the environment only; a password
    /// on a command line is visible to every user of the machine).
    #[arg(long, value_parser = parse_database)]
    pub database: Option<db_access::Database>,
}

fn parse_database(name: &str) -> Result<db_access::Database, String> {
    db_access::Database::parse(name)
        .ok_or_else(|| format!("{name:?} is not one of paydb, proxydb, gldb, lockdb"))
}

/// The environment variable holding a deployment's owner URL for `payoutctl migrate --database`.
pub const MIGRATE_URL_ENV: &str = "PAYOUT_MIGRATE_URL";

pub async fn run(args: Args) -> anyhow::Result<std::process::ExitCode> {
    use anyhow::Context;
    if let Some(database) = args.database {
        let url = std::env::var(MIGRATE_URL_ENV).with_context(|| {
            format!(
                "--database {}: set {MIGRATE_URL_ENV} to the owner role's URL",
                database.name()
            )
        })?;
        apply(database, &url).await?;
        println!("migrated {}", database.name());
        return Ok(std::process::ExitCode::SUCCESS);
    }
    let record = crate::record::StackRecord::load(&args.state_dir)?;
    for (database, port) in record.databases() {
        let url = crate::record::StackRecord::login_url(
            &args.state_dir,
            db_access::OWNER,
            port,
            database.name(),
        )?;
        apply(database, &url).await?;
        println!("migrated {}", database.name());
    }
    Ok(std::process::ExitCode::SUCCESS)
}

pub async fn apply(database: db_access::Database, url: &str) -> anyhow::Result<()> {
    use anyhow::Context;
    let pool = sqlx::PgPool::connect(url).await.with_context(|| {
        format!(
            "connecting to {} at {}",
            database.name(),
            db_access::redact(url)
        )
    })?;
    db_access::migrations::migrator(database)
        .run(&pool)
        .await
        .with_context(|| format!("migrating {}", database.name()))?;
    pool.close().await;
    Ok(())
}
