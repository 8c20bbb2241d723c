//! `payoutctl db provision`: a PostgreSQL server made ready for the system by its administrator,
//! once (and again after a password rotation): the owner role that migrations run as, one login
//! role per service (crates/db-access: `ROLES`), none of them a superuser, each with its own
//! password; the databases owned by the owner, which only the owner and their services may
//! connect to. Then `payoutctl migrate` applies the schema as the owner; the migrations grant each
//! role its table privileges.

use anyhow::Context;
use clap::{Args as ClapArgs, Subcommand};

/// The administrator's URL (a role that may create roles and databases), from the environment.
pub const ADMIN_URL_ENV: &str = "PAYOUT_DB_ADMIN_URL";

/// `PAYOUT_DB_PASSWORD_<LOGIN>`: each login's password (upper case), from the environment.
pub fn password_env(login: &str) -> String {
    format!("PAYOUT_DB_PASSWORD_{}", login.to_ascii_uppercase())
}

#[derive(Subcommand)]
pub enum Command {
    /// Create (or update) the owner and every service role and the named databases, as the
    /// server's administrator (PAYOUT_DB_ADMIN_URL). Each login's password comes from
    /// PAYOUT_DB_PASSWORD_<LOGIN> (PAYOUT_DB_PASSWORD_PAYOUT_OWNER, ..._PAYMENT_RESOURCE,
    /// ..._OUTBOX_DISPATCHER, ..._RECONCILER, ..._RAIL_PROXY, ..._GENERAL_LEDGER, ..._LOCK_SERVER):
    /// every one is required, none may be empty.
    Provision(ProvisionArgs),
    /// Print each login and its role's grants.
    Roles,
}

#[derive(ClapArgs)]
pub struct ProvisionArgs {
    /// The databases this server holds, comma-separated: NAME or NAME=KIND, where KIND is one of
    /// paydb, proxydb, gldb, lockdb (NAME alone: the name is the kind).
    #[arg(long, value_delimiter = ',', required = true)]
    pub databases: Vec<String>,
}

pub async fn run(command: Command) -> anyhow::Result<std::process::ExitCode> {
    match command {
        Command::Roles => {
            println!("{:<18} {:<24} GRANTS", "LOGIN", "DATABASES");
            println!(
                "{:<18} {:<24} owns every schema object; runs the migrations",
                db_access::OWNER,
                "(all)"
            );
            for role in db_access::ROLES {
                let dbs: Vec<&str> = role.databases.iter().map(|d| d.name()).collect();
                println!("{:<18} {:<24} {}", role.name, dbs.join(","), role.grants);
            }
        }
        Command::Provision(args) => {
            let mut databases = Vec::new();
            for spec in &args.databases {
                let (name, kind) = spec.split_once('=').unwrap_or((spec, spec));
                let kind = db_access::Database::parse(kind).with_context(|| {
                    format!(
                        "--databases {spec}: {kind:?} is not one of paydb, proxydb, gldb, lockdb"
                    )
                })?;
                databases.push((name.to_string(), kind));
            }
            let url = std::env::var(ADMIN_URL_ENV).with_context(|| {
                format!("set {ADMIN_URL_ENV} to the server administrator's URL")
            })?;
            let mut missing = Vec::new();
            let mut passwords = std::collections::BTreeMap::new();
            for login in db_access::logins() {
                match std::env::var(password_env(login)) {
                    Ok(p) if !p.is_empty() => {
                        passwords.insert(login, p);
                    }
                    _ => missing.push(password_env(login)),
                }
            }
            anyhow::ensure!(
                missing.is_empty(),
                "no password given for {} (each login has its own; none is generated or defaulted here)",
                missing.join(", ")
            );
            let mut admin = db_access::connect(&url)
                .await
                .with_context(|| format!("connecting to {}", db_access::redact(&url)))?;
            db_access::provision_roles(&mut admin, |login| passwords.get(login).cloned()).await?;
            for (name, kind) in &databases {
                db_access::provision_database(&mut admin, name, *kind)
                    .await
                    .with_context(|| format!("database {name}"))?;
                println!(
                    "provisioned {name} ({}) owned by {}",
                    kind.name(),
                    db_access::OWNER
                );
            }
        }
    }
    Ok(std::process::ExitCode::SUCCESS)
}
