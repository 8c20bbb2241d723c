//! Least privilege in the databases.
//!
//! Every service logs in to PostgreSQL as its own role ([`ROLES`]), never as a superuser and never
//! as the owner of the schema: it cannot run DDL, cannot disable a trigger, cannot set
//! `session_replication_role`, and holds only the table privileges its database's migrations grant
//! it (append-only tables: SELECT and INSERT, nothing else). The schema belongs to [`OWNER`], the
//! role migrations run as (`payoutctl migrate`, the only DDL path); a service checks at start that
//! its database is at the schema version it was built for ([`require_schema`]) and refuses to
//! serve otherwise.
//!
//! [`provision_roles`] and [`provision_database`] are what a cluster administrator runs once per
//! PostgreSQL server (`payoutctl db provision`; the test kit for its own servers): they create the
//! roles with their passwords and the databases owned by [`OWNER`], and take `CONNECT` away from
//! everyone but the roles that use each database. Passwords are never bound into a statement's
//! text that is logged or printed by this crate.

use sqlx::migrate::Migrator;
use sqlx::{Connection, PgConnection, Row};

#[cfg(feature = "migrations")]
pub mod migrations;

/// The role that owns every schema object and runs the migrations. Not a superuser: it cannot
/// create roles or databases, and services never log in as it.
pub const OWNER: &str = "payout_owner";

/// The logical databases of the system (a deployment may name them otherwise).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Database {
    /// Accounts, payouts, the ledger, the outbox, the audit trail (the payment resource's).
    Paydb,
    /// Submissions and high-water (the rail proxy's, on its own server).
    Proxydb,
    /// The General Ledger's journal.
    Gldb,
    /// The lock service's PostgreSQL backend.
    Lockdb,
}

impl Database {
    pub const ALL: [Database; 4] = [
        Database::Paydb,
        Database::Proxydb,
        Database::Gldb,
        Database::Lockdb,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Database::Paydb => "paydb",
            Database::Proxydb => "proxydb",
            Database::Gldb => "gldb",
            Database::Lockdb => "lockdb",
        }
    }

    pub fn parse(name: &str) -> Option<Database> {
        Database::ALL.into_iter().find(|d| d.name() == name)
    }

    /// The roles that may connect to this database (besides [`OWNER`]).
    pub fn roles(self) -> impl Iterator<Item = &'static ServiceRole> {
        ROLES.iter().filter(move |r| r.databases.contains(&self))
    }
}

/// One service's login role.
#[derive(Debug)]
pub struct ServiceRole {
    pub name: &'static str,
    pub databases: &'static [Database],
    /// What it may do, in words (the grants themselves are in each database's migrations).
    pub grants: &'static str,
}

/// Every service's login role. The table privileges are granted by the migrations
/// (`migrations/*/…_service_roles.sql`), which name these roles.
pub const ROLES: &[ServiceRole] = &[
    ServiceRole {
        name: "payment_resource",
        databases: &[Database::Paydb],
        grants: "paydb: SELECT, INSERT on every table; UPDATE only on account and payout \
                 (triggers keep the fence monotonic and terminal payouts frozen); ledger_entry, \
                 audit_event, system_account and ledger_outbox are insert-only",
    },
    ServiceRole {
        name: "outbox_dispatcher",
        databases: &[Database::Paydb],
        grants: "paydb: SELECT on ledger_outbox and UPDATE of its delivery columns only",
    },
    ServiceRole {
        name: "reconciler",
        databases: &[Database::Paydb, Database::Proxydb, Database::Gldb],
        grants: "SELECT on every table of paydb, proxydb and gldb; nothing else",
    },
    ServiceRole {
        name: "rail_proxy",
        databases: &[Database::Proxydb],
        grants: "proxydb: SELECT, INSERT on every table; UPDATE only on account_high_water and \
                 rail_submission (triggers keep the high-water monotonic and an outcome written once)",
    },
    ServiceRole {
        name: "general_ledger",
        databases: &[Database::Gldb],
        grants: "gldb: member of gl_app (SELECT, INSERT on the journal tables; the balance \
                 projection read-write)",
    },
    ServiceRole {
        name: "lock_server",
        databases: &[Database::Lockdb],
        grants: "lockdb: sessions and entries read-write, lock_audit insert-only",
    },
];

pub fn role(name: &str) -> Option<&'static ServiceRole> {
    ROLES.iter().find(|r| r.name == name)
}

/// Every login this crate provisions: the owner, then each service.
pub fn logins() -> impl Iterator<Item = &'static str> {
    std::iter::once(OWNER).chain(ROLES.iter().map(|r| r.name))
}

#[derive(Debug, thiserror::Error)]
pub enum DbError {
    #[error("{0}")]
    Sql(#[from] sqlx::Error),
    #[error("no password given for role {0}")]
    MissingPassword(String),
    #[error("the password of role {0} is empty")]
    EmptyPassword(String),
    #[error(
        "database {database} is not at the schema this build needs: {detail}; apply the migrations \
         as the owner role (`payoutctl migrate`) before starting the service"
    )]
    Schema { database: String, detail: String },
}

/// Group roles (NOLOGIN) a database's schema grants to, and the logins that are members: the
/// GL's migrations grant the journal's privileges to `gl_app`, which `general_ledger` logs in as a
/// member of (and switches to on every connection). Made here, by the administrator, because the
/// owner may not create roles or grant membership.
pub const GROUPS: &[(&str, &[&str])] = &[("gl_app", &["general_ledger"])];

/// Creates (or updates) the owner and every service role with the given passwords: LOGIN, and
/// none of SUPERUSER, CREATEDB, CREATEROLE, REPLICATION or BYPASSRLS. Idempotent; run by a role
/// that may create roles. `password(role)` answers each login's password.
pub async fn provision_roles(
    admin: &mut PgConnection,
    password: impl Fn(&str) -> Option<String>,
) -> Result<(), DbError> {
    for login in logins() {
        let pw = password(login).ok_or_else(|| DbError::MissingPassword(login.into()))?;
        if pw.is_empty() {
            return Err(DbError::EmptyPassword(login.into()));
        }
        let exists: bool =
            sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = $1)")
                .bind(login)
                .fetch_one(&mut *admin)
                .await?;
        let verb = if exists { "ALTER" } else { "CREATE" };
        // A utility statement takes no parameters: format() quotes the name and the literal.
        let statement: String = sqlx::query_scalar(
            "SELECT format('%s ROLE %I WITH LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE \
             NOREPLICATION NOBYPASSRLS PASSWORD %L', $1::text, $2::text, $3::text)",
        )
        .bind(verb)
        .bind(login)
        .bind(&pw)
        .fetch_one(&mut *admin)
        .await?;
        sqlx::raw_sql(&statement).execute(&mut *admin).await?;
    }
    for (group, members) in GROUPS {
        sqlx::raw_sql(&format!(
            "DO $$ BEGIN \
               IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = '{group}') THEN \
                 CREATE ROLE {group} NOLOGIN; \
               END IF; \
             EXCEPTION WHEN duplicate_object OR unique_violation THEN NULL; \
             END $$"
        ))
        .execute(&mut *admin)
        .await?;
        for member in *members {
            sqlx::raw_sql(&format!("GRANT {group} TO {member}"))
                .execute(&mut *admin)
                .await?;
        }
    }
    Ok(())
}

/// Creates `name` (if missing) as a database of kind `kind` owned by [`OWNER`], and lets only the
/// owner and `kind`'s roles connect to it. Idempotent; run after [`provision_roles`].
pub async fn provision_database(
    admin: &mut PgConnection,
    name: &str,
    kind: Database,
) -> Result<(), DbError> {
    let exists: bool =
        sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM pg_database WHERE datname = $1)")
            .bind(name)
            .fetch_one(&mut *admin)
            .await?;
    let quoted: String = sqlx::query_scalar("SELECT quote_ident($1)")
        .bind(name)
        .fetch_one(&mut *admin)
        .await?;
    if exists {
        sqlx::raw_sql(&format!("ALTER DATABASE {quoted} OWNER TO {OWNER}"))
            .execute(&mut *admin)
            .await?;
    } else {
        sqlx::raw_sql(&format!("CREATE DATABASE {quoted} OWNER {OWNER}"))
            .execute(&mut *admin)
            .await?;
    }
    sqlx::raw_sql(&format!("REVOKE ALL ON DATABASE {quoted} FROM PUBLIC"))
        .execute(&mut *admin)
        .await?;
    for role in kind.roles() {
        sqlx::raw_sql(&format!(
            "GRANT CONNECT ON DATABASE {quoted} TO {}",
            role.name
        ))
        .execute(&mut *admin)
        .await?;
    }
    Ok(())
}

/// Checks that the database behind `conn` has exactly `migrator`'s migrations applied, each with
/// the checksum this build embeds. A service calls this at start instead of migrating (it cannot:
/// its role may not run DDL).
pub async fn require_schema(
    pool: &sqlx::PgPool,
    migrator: &Migrator,
    database: &str,
) -> Result<(), DbError> {
    let schema = |detail: String| DbError::Schema {
        database: database.to_string(),
        detail,
    };
    let table: Option<String> = sqlx::query_scalar("SELECT to_regclass('_sqlx_migrations')::text")
        .fetch_one(pool)
        .await?;
    if table.is_none() {
        return Err(schema("no migration has been applied".into()));
    }
    let rows =
        sqlx::query("SELECT version, checksum, success FROM _sqlx_migrations ORDER BY version")
            .fetch_all(pool)
            .await?;
    let mut applied = std::collections::BTreeMap::new();
    for row in rows {
        let version: i64 = row.try_get("version")?;
        let checksum: Vec<u8> = row.try_get("checksum")?;
        let success: bool = row.try_get("success")?;
        if !success {
            return Err(schema(format!("migration {version} failed part-way")));
        }
        applied.insert(version, checksum);
    }
    for m in migrator
        .iter()
        .filter(|m| m.migration_type.is_up_migration())
    {
        match applied.remove(&m.version) {
            None => {
                return Err(schema(format!(
                    "migration {} ({}) is not applied",
                    m.version, m.description
                )))
            }
            Some(sum) if sum != *m.checksum => {
                return Err(schema(format!(
                    "migration {} ({}) was applied with different contents",
                    m.version, m.description
                )))
            }
            Some(_) => {}
        }
    }
    if let Some((version, _)) = applied.into_iter().next() {
        return Err(schema(format!(
            "migration {version} is applied but unknown to this build (a newer schema)"
        )));
    }
    Ok(())
}

/// Connects once (for provisioning); the URL is never part of an error.
pub async fn connect(url: &str) -> Result<PgConnection, DbError> {
    Ok(PgConnection::connect(url).await?)
}

/// The passwords of a PostgreSQL server's logins: its superuser (cluster administration only) and
/// every role of [`logins`]. The local stack and the tests generate them (saved mode 0600 in the
/// stack's directory); a deployment gives its own (compose refuses to start without them).
#[derive(Clone, serde::Serialize, serde::Deserialize)]
pub struct Credentials {
    pub superuser: String,
    pub passwords: std::collections::BTreeMap<String, String>,
}

impl std::fmt::Debug for Credentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Credentials")
            .field("logins", &self.passwords.keys().collect::<Vec<_>>())
            .finish_non_exhaustive()
    }
}

/// The file a local stack or a test stack keeps its generated [`Credentials`] in, in its state
/// directory (mode 0600).
pub const CREDENTIALS_FILE: &str = "db-credentials.json";

/// 24 random bytes, hex: a password nobody has to type.
pub fn generate_password() -> String {
    use ring::rand::SecureRandom;
    let mut bytes = [0u8; 24];
    ring::rand::SystemRandom::new()
        .fill(&mut bytes)
        .expect("the system's random source");
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

impl Credentials {
    pub fn generate() -> Self {
        Self {
            superuser: generate_password(),
            passwords: logins()
                .map(|l| (l.to_string(), generate_password()))
                .collect(),
        }
    }

    pub fn password(&self, login: &str) -> Option<String> {
        self.passwords.get(login).cloned()
    }

    /// The credentials saved at `path`, or new ones saved there (mode 0600) if there are none.
    pub fn load_or_generate(path: &std::path::Path) -> std::io::Result<Self> {
        match Self::load(path) {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                let credentials = Self::generate();
                use std::io::Write;
                use std::os::unix::fs::OpenOptionsExt;
                let mut file = std::fs::OpenOptions::new()
                    .write(true)
                    .create_new(true)
                    .mode(0o600)
                    .open(path)?;
                file.write_all(serde_json::to_string_pretty(&credentials)?.as_bytes())?;
                Ok(credentials)
            }
            other => other,
        }
    }

    pub fn load(path: &std::path::Path) -> std::io::Result<Self> {
        let text = std::fs::read_to_string(path)?;
        serde_json::from_str(&text)
            .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e))
    }
}

/// Where a PostgreSQL server is and how its certificate is checked: every connection is TLS with
/// the server's certificate verified against `ca_file` and its name (`sslmode=verify-full`).
#[derive(Debug, Clone)]
pub struct Server {
    pub host: String,
    pub port: u16,
    pub ca_file: std::path::PathBuf,
}

impl Server {
    /// The URL of `database` for `login` with `password` (percent-encoded). It holds a secret:
    /// give it to a process through its environment, never its command line, and print it only
    /// through [`redact`].
    pub fn url(&self, login: &str, password: &str, database: &str) -> String {
        format!(
            "postgres://{}:{}@{}:{}/{}?{}",
            encode(login),
            encode(password),
            self.host,
            self.port,
            encode(database),
            self.tls_query()
        )
    }

    /// The same without a password (sqlx then reads `PGPASSWORD` or the password file).
    pub fn url_without_password(&self, login: &str, database: &str) -> String {
        format!(
            "postgres://{}@{}:{}/{}?{}",
            encode(login),
            self.host,
            self.port,
            encode(database),
            self.tls_query()
        )
    }

    fn tls_query(&self) -> String {
        format!(
            "sslmode=verify-full&sslrootcert={}",
            encode(&self.ca_file.to_string_lossy())
        )
    }
}

/// Percent-encodes everything but unreserved characters and `/` (paths stay readable).
fn encode(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || b"-._~/".contains(&b) {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// A URL as it may be printed: the password, if any, replaced by `***`.
pub fn redact(url: &str) -> String {
    match (url.find("://"), url.rfind('@')) {
        (Some(scheme), Some(at)) if at > scheme => {
            let creds = &url[scheme + 3..at];
            match creds.find(':') {
                Some(colon) => format!(
                    "{}{}:***{}",
                    &url[..scheme + 3],
                    &creds[..colon],
                    &url[at..]
                ),
                None => url.to_string(),
            }
        }
        _ => url.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_verify_the_server_and_encode_secrets() {
        let server = Server {
            host: "127.0.0.1".into(),
            port: 5432,
            ca_file: "/tmp/a b/ca.pem".into(),
        };
        let url = server.url("rail_proxy", "p@ss:w/rd", "proxydb");
        assert_eq!(
            url,
            "postgres://rail_proxy:p%40ss%3Aw/rd@127.0.0.1:5432/proxydb?sslmode=verify-full&sslrootcert=/tmp/a%20b/ca.pem"
        );
        assert!(!redact(&url).contains("ss%3Aw"), "{}", redact(&url));
        assert_eq!(redact("postgres://u@h/db"), "postgres://u@h/db");
    }

    #[test]
    fn every_role_is_a_login_and_none_is_the_owner() {
        let logins: Vec<_> = logins().collect();
        assert_eq!(logins[0], OWNER);
        for role in ROLES {
            assert_ne!(role.name, OWNER);
            assert!(!role.databases.is_empty(), "{} connects nowhere", role.name);
        }
        for db in Database::ALL {
            assert!(
                db.roles().next().is_some(),
                "{} has no service role",
                db.name()
            );
        }
    }

    #[test]
    fn generated_passwords_differ() {
        let c = Credentials::generate();
        assert_eq!(c.passwords.len(), ROLES.len() + 1);
        assert_ne!(c.superuser, c.password(OWNER).unwrap());
        assert!(format!("{c:?}").contains("payout_owner"));
        assert!(!format!("{c:?}").contains(&c.superuser));
    }
}

#[cfg(test)]
mod row_chain_copies {
    /// The row-chain definitions (`row_chain_head`, `chain_row()`, ...) are written into each
    /// database's migrations (a database's migrations are self-contained and immutable once
    /// applied); the copies are the same word for word, so the reconciler's one check
    /// (`row_chains_intact`) means the same in every database.
    #[test]
    fn the_row_chain_definitions_are_the_same_in_every_database() {
        let section = |sql: &'static str| -> &'static str {
            let start = sql
                .find("CREATE TABLE row_chain_head")
                .expect("the row-chain head table");
            let end_marker = "REVOKE ALL ON FUNCTION row_chain_attach(text, text) FROM PUBLIC;";
            let end = sql.find(end_marker).expect("the end of the definitions") + end_marker.len();
            &sql[start..end]
        };
        let strip_comments = |sql: &str| -> String {
            sql.lines()
                .filter(|l| !l.trim_start().starts_with("--"))
                .collect::<Vec<_>>()
                .join("\n")
        };
        let paydb = strip_comments(section(include_str!(
            "../../../migrations/paydb/0012_verified_replay_and_row_chains.sql"
        )));
        for (name, other) in [
            (
                "gldb",
                include_str!("../../../migrations/gldb/0004_row_chains.sql"),
            ),
            (
                "lockdb",
                include_str!("../../../migrations/lockdb/0004_row_chains.sql"),
            ),
            (
                "proxydb",
                include_str!("../../../migrations/proxydb/0007_row_chains.sql"),
            ),
        ] {
            assert_eq!(
                strip_comments(section(other)),
                paydb,
                "{name}'s row-chain definitions differ from paydb 0012's"
            );
        }
    }
}
