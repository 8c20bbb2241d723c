//! `payoutctl restore`: the database half of the procedure after a guard's own database (paydb or
//! proxydb) was restored from a backup (docs/design/guard-restore/README.md).
//!
//! A restored copy has lost writes, so its fences (high-waters) went back and a holder those writes
//! had fenced out would pass again. The database knows it is a copy (`incarnation`, migrations
//! 0006): its guard refuses every fenced call until it is re-armed. `restore rearm` re-arms it:
//! it reads the lock service's horizon (the highest token it ever issued) from the lock backend
//! itself, never from what the operator types, and runs `rearm_after_restore(horizon, operator,
//! reason)` as the owner role, which raises every fence (high-water) and the token floor to the
//! horizon, records who and why, and marks the database current; for paydb it first reads from
//! gldb what the General Ledger holds beyond the restored copy ([`gl_beyond_paydb`]) and runs
//! `rearm_paydb_after_restore`, which also carries that lost timeline forward (paydb 0014,
//! [`rearm_paydb`]). `restore status` says, for each guard's database, whether it is current and
//! how its incarnation row was last armed.
//!
//! The local stack is addressed through its state directory (the owner's and the reconciler's
//! logins from its credentials, its etcd with a certificate from its own authority), a deployment
//! through its lock backend (`--etcd-endpoints` and the etcd TLS flags, or `--lock-backend
//! postgres` with lockdb's URL in `PAYOUT_LOCKDB_URL`) and the owner's URL in
//! `PAYOUT_MIGRATE_URL`, as for `payoutctl migrate --database` (the environment only: a password
//! on a command line is visible to every user of the machine).

use anyhow::Context;
use clap::{Args as ClapArgs, Subcommand, ValueEnum};
use serde::Serialize;

use crate::migrate::MIGRATE_URL_ENV;
use crate::record::{StackRecord, LOCK_ETCD_PREFIX};

/// The environment variable holding lockdb's URL (a role that may read `lock_token_seq`: the
/// owner's) when the lock service's backend is PostgreSQL.
pub const LOCKDB_URL_ENV: &str = "PAYOUT_LOCKDB_URL";

/// `restore rearm`'s exit status when the guard refused the horizon: a problem found
/// ([`crate::ops::exit`], the same scheme as every command).
pub const EXIT_REFUSED: u8 = crate::ops::exit::PROBLEM;
/// `restore status`'s exit status when a database is not current (a restored copy not re-armed).
pub const EXIT_NOT_CURRENT: u8 = crate::ops::exit::PROBLEM;
/// `restore status`'s exit status when a database could not be checked (no connection, no
/// incarnation table). It wins over [`EXIT_NOT_CURRENT`]: nothing can be said of that database.
pub const EXIT_UNCHECKED: u8 = crate::ops::exit::UNREACHABLE;

#[derive(Subcommand)]
pub enum Command {
    /// Re-arm a guard's database after it was restored from a backup: every fence (paydb) or
    /// high-water (proxydb) and the token floor raised to the lock service's horizon, read from
    /// the lock backend itself, as the owner role; who and why recorded. The guard's service may
    /// run meanwhile: it refuses every fenced call on the restored copy until this has run
    /// (services/lock-server/RESTORE.md). Exit status 0 when re-armed, 1 when the guard refused
    /// the horizon (a fence above it: the lock backend is behind the guard and must be restored
    /// first) or on any other error, 3 when the database or the lock backend could not be
    /// reached. For paydb it also reads gldb and, in the same transaction, carries forward what
    /// the General Ledger holds beyond the restored copy (its events and postings of the lost
    /// timeline), so no re-run reuses an event version or re-sends a posting (RESTORE.md, "paydb
    /// restored: the outbox and the GL").
    Rearm(RearmArgs),
    /// Whether paydb and proxydb are each the database their incarnation row was armed in, and how
    /// it was last armed. Exit status 0 when both are current, 1 when one is not (restored from a
    /// backup and not re-armed), 3 when one cannot be checked (not reached, or no incarnation).
    Status(StatusArgs),
}

/// Which lock backend issues the tokens.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum LockBackend {
    /// etcd: a token is a grant key's create revision; the horizon is the cluster's revision.
    Etcd,
    /// PostgreSQL (lockdb): a token is a value of `lock_token_seq`; the horizon is its last value.
    Postgres,
}

#[derive(ClapArgs)]
pub struct RearmArgs {
    /// The guard's database that was restored: paydb or proxydb.
    #[arg(long, value_parser = parse_guard_database)]
    pub database: db_access::Database,
    /// Why it is re-armed (the incident or ticket): recorded with the re-arming.
    #[arg(long)]
    pub reason: String,
    /// Who re-arms it: the operator's name (one DNS label, as in their certificate), recorded as
    /// the incarnation's armed_by and in the audit.
    #[arg(long)]
    pub operator: String,
    /// One JSON object instead of a line.
    #[arg(long)]
    pub json: bool,
    /// The lock service's backend, whose horizon the database is re-armed to.
    #[arg(long, value_enum, env = "PAYOUT_LOCK_BACKEND", default_value = "etcd")]
    pub lock_backend: LockBackend,
    /// A deployment's etcd endpoints (comma-separated, `https://`), with the etcd TLS flags below.
    /// With them (or with --lock-backend postgres) the target is a deployment: the owner's URL of
    /// the database is read from PAYOUT_MIGRATE_URL. Without them, the local stack.
    #[arg(long, env = "PAYOUT_ETCD_ENDPOINTS", value_delimiter = ',')]
    pub etcd_endpoints: Vec<String>,
    /// etcd's authority and this operator's certificate from it (a deployment; the local stack's
    /// is issued from the stack's own authority).
    #[command(flatten)]
    pub etcd_tls: mtls::EtcdTlsArgs,
    /// A deployment's gldb URL (a role that reads it: the reconciler's; the password in the
    /// environment), required with --database paydb on a deployment: what the General Ledger
    /// already holds of each payout beyond the restored copy is carried forward (the local stack's
    /// is read as the reconciler).
    #[arg(long, env = "PAYOUT_GLDB_URL")]
    pub gldb_url: Option<String>,
    /// State directory of the local stack (used when no deployment is given).
    #[arg(long, env = "PAYOUT_STATE_DIR", default_value = crate::record::DEFAULT_STATE_DIR,
          value_parser = crate::record::state_dir_arg)]
    pub state_dir: std::path::PathBuf,
}

#[derive(ClapArgs)]
pub struct StatusArgs {
    /// A deployment's paydb URL (the reconciler's or the owner's; give the password in the
    /// environment). With it, --proxydb-url is required; without both, the local stack.
    #[arg(long, env = "PAYOUT_PAYDB_URL")]
    pub paydb_url: Option<String>,
    /// A deployment's proxydb URL (as --paydb-url).
    #[arg(long, env = "PAYOUT_PROXYDB_URL")]
    pub proxydb_url: Option<String>,
    /// One JSON object instead of a table.
    #[arg(long)]
    pub json: bool,
    /// State directory of the local stack (used when no URL is given).
    #[arg(long, env = "PAYOUT_STATE_DIR", default_value = crate::record::DEFAULT_STATE_DIR,
          value_parser = crate::record::state_dir_arg)]
    pub state_dir: std::path::PathBuf,
}

fn parse_guard_database(name: &str) -> Result<db_access::Database, String> {
    match db_access::Database::parse(name) {
        Some(d @ (db_access::Database::Paydb | db_access::Database::Proxydb)) => Ok(d),
        _ => Err(format!(
            "{name:?} is not a guard's database (paydb or proxydb)"
        )),
    }
}

/// The guard refused to be re-armed to the horizon: an account's fence (high-water) is above it,
/// so the lock service's token sequence is behind the guard (the lock backend was restored
/// without its procedure). Nothing was changed. Restore the lock backend first
/// (services/lock-server/RESTORE.md), then re-arm again. Find it with
/// `error.downcast_ref::<Refused>()`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refused {
    pub horizon: i64,
    /// The database's own words.
    pub message: String,
}

impl std::fmt::Display for Refused {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "REFUSED: the guard's database is ahead of the lock service's horizon {}; nothing was \
             changed ({})",
            self.horizon, self.message
        )
    }
}

impl std::error::Error for Refused {}

/// What `rearm_after_restore` says when a fence (high-water) is above the horizon.
const REFUSAL_MARK: &str = "is above the lock service's horizon";

/// The lock service's horizon on etcd: the cluster's current revision, from the response header
/// of a read (`reconciler::LockGrants::horizon`). Every token is a grant key's create revision,
/// so none issued is above it.
pub async fn etcd_horizon(endpoints: Vec<String>, tls: mtls::Tls) -> anyhow::Result<i64> {
    anyhow::ensure!(!endpoints.is_empty(), "no etcd endpoint given");
    let grants = reconciler::LockGrants::new(endpoints, tls, LOCK_ETCD_PREFIX.to_string());
    grants.horizon().await.map_err(|e| {
        crate::ops::exit::unreachable(
            "etcd, to read the lock service's horizon (the current revision)",
            e,
        )
    })
}

/// The lock service's horizon on PostgreSQL: the last value `lock_token_seq` gave out (0 when it
/// never gave one), read at `lockdb_url` (a role that may read the sequence: the owner's).
/// Sequences are never rolled back, so no token issued is above it.
pub async fn lockdb_horizon(lockdb_url: &str) -> anyhow::Result<i64> {
    let mut conn = crate::ops::connect_db(lockdb_url, "lockdb").await?;
    let horizon: i64 = sqlx::query_scalar(
        "SELECT CASE WHEN is_called THEN last_value ELSE 0 END FROM lock_token_seq",
    )
    .fetch_one(&mut conn)
    .await
    .context("reading lock_token_seq from lockdb")?;
    let _ = sqlx::Connection::close(conn).await;
    Ok(horizon)
}

/// The procedure's database half: `rearm_after_restore(horizon, armed_by, reason)` as the owner
/// role (`owner_url`), in one transaction of the database's own. Answers how many accounts' fences
/// (paydb) or high-waters (proxydb) were raised. A horizon below an accepted fence is refused with
/// [`Refused`] (nothing changed).
pub async fn rearm(
    owner_url: &str,
    horizon: i64,
    armed_by: &str,
    reason: &str,
) -> anyhow::Result<u64> {
    let mut conn = crate::ops::connect_db(owner_url, "the guard's database as the owner").await?;
    let answer = sqlx::query_scalar::<_, i64>("SELECT rearm_after_restore($1, $2, $3)")
        .bind(horizon)
        .bind(armed_by)
        .bind(reason)
        .fetch_one(&mut conn)
        .await;
    let _ = sqlx::Connection::close(conn).await;
    answer
        .map(|raised| u64::try_from(raised).unwrap_or_default())
        .map_err(|e| refusal_or(e, horizon, "rearm_after_restore"))
}

/// A guard's refusal of the horizon as [`Refused`], any other error as itself.
fn refusal_or(error: sqlx::Error, horizon: i64, call: &'static str) -> anyhow::Error {
    match error {
        sqlx::Error::Database(e) if e.message().contains(REFUSAL_MARK) => {
            anyhow::Error::new(Refused {
                horizon,
                message: e.message().to_string(),
            })
        }
        e => anyhow::Error::new(e).context(call),
    }
}

/// One record the General Ledger holds of a payout beyond what a restored paydb holds: an event
/// above the payout's version, or any record of a payout paydb does not hold (paydb 0014's
/// `restore_lost_timeline` row, as `rearm_paydb_after_restore` takes it).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct GlRecord {
    pub payout_id: String,
    /// `JOURNAL` (a posting) or `TRANSACTION_EVENT`.
    pub kind: &'static str,
    pub idempotency_key: String,
    /// A TRANSACTION_EVENT's version.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub event_version: Option<i64>,
    /// The GL's id of the journal or event.
    pub gl_record_id: String,
    /// The event type or the journal's effect kind.
    pub gl_type: String,
    /// A journal's lines: `[{"line_number": n, "amount": "..."}]`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub lines: Option<serde_json::Value>,
}

/// What the General Ledger (`gldb_url`, a reader) holds of paydb's payouts (`paydb_url`, any role
/// that reads `payout`) beyond each payout's version: a payout whose latest event in paydb is
/// v(version + 1) and whose highest in the GL is above it, or that paydb does not hold at all,
/// gives every GL event above that and every GL journal of it. Whether paydb's outbox holds one
/// of these keys after all (a row delivered before the backup) is the database's to decide, in
/// the re-arming's transaction. Read after the restore and before the re-arming: the restored
/// copy's guard refuses every transition until it is re-armed, so no payout moves between.
pub async fn gl_beyond_paydb(paydb_url: &str, gldb_url: &str) -> anyhow::Result<Vec<GlRecord>> {
    let mut paydb = crate::ops::connect_db(paydb_url, "paydb").await?;
    let versions: Vec<(String, i64)> = sqlx::query_as("SELECT id, version FROM payout")
        .fetch_all(&mut paydb)
        .await
        .context("reading the payouts' versions from paydb")?;
    let _ = sqlx::Connection::close(paydb).await;
    let versions: std::collections::HashMap<String, i64> = versions.into_iter().collect();
    // The highest event version paydb has written for a payout: its version + 1.
    let beyond = |payout: &str, event_version: i64| {
        versions
            .get(payout)
            .is_none_or(|version| event_version > version + 1)
    };
    let mut gldb = crate::ops::connect_db(gldb_url, "gldb").await?;
    let highest: Vec<(String, i64)> = sqlx::query_as(
        "SELECT source_transaction_id, max(event_version)::bigint FROM transaction_events \
         WHERE source_service = 'payment-resource' GROUP BY source_transaction_id",
    )
    .fetch_all(&mut gldb)
    .await
    .context("reading the highest lifecycle event of each payout from gldb")?;
    let ahead: Vec<String> = highest
        .into_iter()
        .filter(|(payout, highest)| beyond(payout, *highest))
        .map(|(payout, _)| payout)
        .collect();
    let mut records = Vec::new();
    if ahead.is_empty() {
        let _ = sqlx::Connection::close(gldb).await;
        return Ok(records);
    }
    let events: Vec<(String, i64, String, String)> = sqlx::query_as(
        "SELECT source_transaction_id, event_version::bigint, event_type, id::text \
         FROM transaction_events \
         WHERE source_service = 'payment-resource' AND source_transaction_id = ANY($1) \
         ORDER BY source_transaction_id, event_version",
    )
    .bind(&ahead)
    .fetch_all(&mut gldb)
    .await
    .context("reading the lifecycle events of the payouts the GL holds beyond paydb")?;
    for (payout, event_version, event_type, id) in events {
        if !beyond(&payout, event_version) {
            continue;
        }
        let key = payout_domain::PayoutId::parse(payout.clone())
            .with_context(|| format!("the GL's payout id {payout:?}"))?
            .lifecycle_event_key(event_version);
        records.push(GlRecord {
            payout_id: payout,
            kind: "TRANSACTION_EVENT",
            idempotency_key: key,
            event_version: Some(event_version),
            gl_record_id: id,
            gl_type: event_type,
            lines: None,
        });
    }
    let journals: Vec<(String, String, String, String, serde_json::Value)> = sqlx::query_as(
        "SELECT j.source_transaction_id, j.idempotency_key, j.id::text, j.effect_kind, \
                jsonb_agg(jsonb_build_object('line_number', e.line_number, 'amount', e.amount::text) \
                          ORDER BY e.line_number) \
         FROM journals j JOIN entries e ON e.journal_id = j.id \
         WHERE j.source_service = 'payment-resource' AND j.source_transaction_id = ANY($1) \
         GROUP BY j.id ORDER BY j.source_transaction_id, j.idempotency_key",
    )
    .bind(&ahead)
    .fetch_all(&mut gldb)
    .await
    .context("reading the journals of the payouts the GL holds beyond paydb")?;
    let _ = sqlx::Connection::close(gldb).await;
    for (payout, key, id, effect_kind, lines) in journals {
        records.push(GlRecord {
            payout_id: payout,
            kind: "JOURNAL",
            idempotency_key: key,
            event_version: None,
            gl_record_id: id,
            gl_type: effect_kind,
            lines: Some(lines),
        });
    }
    Ok(records)
}

/// What paydb's re-arming did with the General Ledger's records beyond it.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, serde::Deserialize)]
pub struct LostTimeline {
    /// Accounts whose fence was raised to the horizon.
    pub raised: u64,
    /// GL records recorded in `restore_lost_timeline` (a lost timeline's events and postings).
    pub carried: u64,
    /// Non-terminal payouts whose version was lifted past the GL's highest event of theirs.
    pub payouts_lifted: u64,
}

/// paydb's procedure: `rearm_paydb_after_restore(horizon, armed_by, reason, gl_lost)` as the
/// owner (`owner_url`), one transaction: the fences as [`rearm`] raises them, and `gl_lost` (from
/// [`gl_beyond_paydb`]) carried forward so no re-run reuses an event version or re-sends a posting
/// the GL holds. A horizon below an accepted fence is refused with [`Refused`] (nothing changed).
pub async fn rearm_paydb(
    owner_url: &str,
    horizon: i64,
    armed_by: &str,
    reason: &str,
    gl_lost: &[GlRecord],
) -> anyhow::Result<LostTimeline> {
    let gl_lost = serde_json::to_string(gl_lost)?;
    let mut conn = crate::ops::connect_db(owner_url, "paydb as the owner").await?;
    let answer = sqlx::query_scalar::<_, serde_json::Value>(
        "SELECT rearm_paydb_after_restore($1, $2, $3, $4::jsonb)",
    )
    .bind(horizon)
    .bind(armed_by)
    .bind(reason)
    .bind(gl_lost)
    .fetch_one(&mut conn)
    .await;
    let _ = sqlx::Connection::close(conn).await;
    let answer = answer.map_err(|e| refusal_or(e, horizon, "rearm_paydb_after_restore"))?;
    serde_json::from_value(answer).context("rearm_paydb_after_restore's answer")
}

/// A guard database's incarnation: whether it is the database its row was armed in, and the row.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Incarnation {
    /// `incarnation_is_current()`: false for a copy restored from a backup and not re-armed.
    pub current: bool,
    /// No token below it passes the guard (the last re-arming's horizon; 0 before any).
    pub token_floor: i64,
    pub armed_by: String,
    pub reason: String,
    /// When it was armed (UTC, RFC 3339).
    pub armed_at: String,
    /// The database and guarded table the row was armed for (OIDs).
    pub database_oid: i64,
    pub guarded_table_oid: i64,
}

/// Reads the incarnation of the guard's database at `url` (any role that may read `incarnation`:
/// the reconciler's, the service's, the owner's).
pub async fn incarnation(url: &str) -> anyhow::Result<Incarnation> {
    let mut conn = crate::ops::connect_db(url, "the guard's database").await?;
    let row: Option<(bool, i64, String, String, String, i64, i64)> = sqlx::query_as(
        "SELECT incarnation_is_current(), token_floor, armed_by, reason, \
                to_char(armed_at AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS\"Z\"'), \
                database_oid::bigint, guarded_table::bigint \
         FROM incarnation",
    )
    .fetch_optional(&mut conn)
    .await
    .context("reading the incarnation row")?;
    let _ = sqlx::Connection::close(conn).await;
    let (current, token_floor, armed_by, reason, armed_at, database_oid, guarded_table_oid) =
        row.context("the incarnation table has no row (it is written by the migration and only re-written by rearm_after_restore)")?;
    Ok(Incarnation {
        current,
        token_floor,
        armed_by,
        reason,
        armed_at,
        database_oid,
        guarded_table_oid,
    })
}

/// What one `restore rearm` did.
#[derive(Debug, Clone, Serialize)]
pub struct Rearmed {
    pub database: &'static str,
    /// The lock service's horizon the database was re-armed to, and where it was read.
    pub horizon: i64,
    pub horizon_source: String,
    /// Accounts whose fence (paydb) or high-water (proxydb) was raised to the horizon.
    pub raised: u64,
    /// Whether the database was current before (false: a restored copy, as expected).
    pub was_current: bool,
    /// paydb: what the GL held beyond the restored copy, carried forward.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub lost_timeline: Option<LostTimeline>,
    /// The incarnation as re-armed.
    pub incarnation: Incarnation,
}

/// Where `restore rearm` goes: the owner's URL of the database and the lock backend to read.
struct RearmTarget {
    owner_url: String,
    horizon: HorizonSource,
    /// paydb's: the General Ledger, read for what it holds beyond the restored copy.
    gldb_url: Option<String>,
}

enum HorizonSource {
    Etcd {
        endpoints: Vec<String>,
        tls: mtls::Tls,
    },
    Lockdb {
        url: String,
    },
}

impl HorizonSource {
    fn describe(&self) -> String {
        match self {
            HorizonSource::Etcd { endpoints, .. } => {
                format!("etcd's current revision at {}", endpoints.join(","))
            }
            HorizonSource::Lockdb { url } => {
                format!("lock_token_seq at {}", db_access::redact(url))
            }
        }
    }

    async fn read(&self) -> anyhow::Result<i64> {
        match self {
            HorizonSource::Etcd { endpoints, tls } => {
                etcd_horizon(endpoints.clone(), tls.clone()).await
            }
            HorizonSource::Lockdb { url } => lockdb_horizon(url).await,
        }
    }
}

impl RearmArgs {
    /// A deployment when its lock backend is named; the local stack otherwise.
    fn is_deployment(&self) -> bool {
        !self.etcd_endpoints.is_empty() || self.lock_backend == LockBackend::Postgres
    }

    fn target(&self) -> anyhow::Result<RearmTarget> {
        let name = self.database.name();
        if self.is_deployment() {
            let owner_url = std::env::var(MIGRATE_URL_ENV).with_context(|| {
                format!("a deployment's {name}: set {MIGRATE_URL_ENV} to the owner role's URL of {name}")
            })?;
            let horizon = match self.lock_backend {
                LockBackend::Etcd => HorizonSource::Etcd {
                    endpoints: self.etcd_endpoints.clone(),
                    tls: self.etcd_tls.load()?,
                },
                LockBackend::Postgres => HorizonSource::Lockdb {
                    url: std::env::var(LOCKDB_URL_ENV).with_context(|| {
                        format!("--lock-backend postgres: set {LOCKDB_URL_ENV} to lockdb's URL (the owner role's)")
                    })?,
                },
            };
            let gldb_url = match self.database {
                db_access::Database::Paydb => Some(self.gldb_url.clone().context(
                    "a deployment's paydb: give --gldb-url (or PAYOUT_GLDB_URL), a reader of gldb: \
                     what the GL holds beyond the restored copy is carried forward",
                )?),
                _ => None,
            };
            return Ok(RearmTarget {
                owner_url,
                horizon,
                gldb_url,
            });
        }
        // The local stack: never a deployment's database with the stack's lock service.
        anyhow::ensure!(
            std::env::var_os(MIGRATE_URL_ENV).is_none(),
            "{MIGRATE_URL_ENV} is set but no deployment lock backend is given (--etcd-endpoints, \
             or --lock-backend postgres): refusing to re-arm a deployment's database to the local \
             stack's horizon"
        );
        let record = StackRecord::load(&self.state_dir)?;
        let port = record
            .databases()
            .into_iter()
            .find_map(|(d, port)| (d == self.database).then_some(port))
            .with_context(|| format!("the stack has no {name}"))?;
        let gldb_url = match self.database {
            db_access::Database::Paydb => Some(StackRecord::login_url(
                &self.state_dir,
                "reconciler",
                record.ports.pg_main,
                "gldb",
            )?),
            _ => None,
        };
        Ok(RearmTarget {
            owner_url: StackRecord::login_url(&self.state_dir, db_access::OWNER, port, name)?,
            gldb_url,
            horizon: HorizonSource::Etcd {
                endpoints: record.etcd_endpoints(),
                tls: crate::target::local_etcd_tls(&self.state_dir)?,
            },
        })
    }
}

pub async fn run(command: Command) -> anyhow::Result<std::process::ExitCode> {
    match command {
        Command::Rearm(args) => run_rearm(args).await,
        Command::Status(args) => run_status(args).await,
    }
}

async fn run_rearm(args: RearmArgs) -> anyhow::Result<std::process::ExitCode> {
    let reason = args.reason.trim();
    anyhow::ensure!(!reason.is_empty(), "--reason must say why");
    let operator = args.operator.trim();
    anyhow::ensure!(
        mtls::is_operator_name(operator),
        "--operator {operator:?}: an operator's name is one DNS label (letters, digits and '-', at most 63)"
    );
    let name = args.database.name();
    let target = args.target()?;
    let before = incarnation(&target.owner_url)
        .await
        .with_context(|| format!("reading {name}'s incarnation"))?;
    // From the lock backend itself, after the database was reached: the later it is read, the
    // more tokens it covers.
    let horizon = target.horizon.read().await?;
    let horizon_source = target.horizon.describe();
    let done = match &target.gldb_url {
        Some(gldb_url) => {
            let gl_lost = gl_beyond_paydb(&target.owner_url, gldb_url).await?;
            rearm_paydb(&target.owner_url, horizon, operator, reason, &gl_lost)
                .await
                .map(|lost| (lost.raised, Some(lost)))
        }
        None => rearm(&target.owner_url, horizon, operator, reason)
            .await
            .map(|raised| (raised, None)),
    };
    let (raised, lost_timeline) = match done {
        Ok(done) => done,
        Err(error) => match error.downcast_ref::<Refused>() {
            Some(refused) => {
                if args.json {
                    println!(
                        "{}",
                        serde_json::json!({
                            "database": name,
                            "refused": refused.message,
                            "horizon": horizon,
                            "horizon_source": horizon_source,
                        })
                    );
                }
                eprintln!(
                    "payoutctl: {name} NOT re-armed: {refused}\n\
                     payoutctl: the lock service ({horizon_source}) is behind this guard: restore \
                     the lock backend with its procedure first (services/lock-server/RESTORE.md), \
                     then run restore rearm again"
                );
                return Ok(std::process::ExitCode::from(EXIT_REFUSED));
            }
            None => return Err(error.context(format!("re-arming {name}"))),
        },
    };
    let after = incarnation(&target.owner_url)
        .await
        .with_context(|| format!("reading {name}'s incarnation after re-arming"))?;
    let done = Rearmed {
        database: name,
        horizon,
        horizon_source,
        raised,
        was_current: before.current,
        lost_timeline,
        incarnation: after,
    };
    if args.json {
        println!("{}", serde_json::to_string(&done)?);
    } else {
        println!("{}", render_rearmed(&done));
    }
    Ok(std::process::ExitCode::SUCCESS)
}

/// The readable line of a re-arming.
pub fn render_rearmed(done: &Rearmed) -> String {
    let what = if done.database == "proxydb" {
        "high-water(s)"
    } else {
        "account fence(s)"
    };
    format!(
        "re-armed {}: {} {what} raised to {}, the lock service's horizon ({}); token floor {}; \
         armed by {} at {}: {:?}{}{}",
        done.database,
        done.raised,
        done.horizon,
        done.horizon_source,
        done.incarnation.token_floor,
        done.incarnation.armed_by,
        done.incarnation.armed_at,
        done.incarnation.reason,
        if done.was_current {
            " (it was current already: no restore was detected; every fence is at least the horizon now)"
        } else {
            " (it was a restored copy)"
        },
        match &done.lost_timeline {
            Some(lost) => format!(
                "; the GL's lost timeline carried forward: {} record(s) recorded, {} payout(s) \
                 lifted past the GL's highest event",
                lost.carried, lost.payouts_lifted
            ),
            None => String::new(),
        }
    )
}

/// One guard database's status, as `restore status` reports it.
#[derive(Debug, Clone, Serialize)]
pub struct DatabaseStatus {
    pub database: &'static str,
    /// `None` when it could not be checked (see `error`).
    pub incarnation: Option<Incarnation>,
    pub error: Option<String>,
}

/// `restore status`'s exit status for these databases: 3 if one could not be checked, else 1 if
/// one is not current, else 0.
pub fn status_exit_code(statuses: &[DatabaseStatus]) -> u8 {
    if statuses.iter().any(|s| s.incarnation.is_none()) {
        EXIT_UNCHECKED
    } else if statuses
        .iter()
        .any(|s| s.incarnation.as_ref().is_some_and(|i| !i.current))
    {
        EXIT_NOT_CURRENT
    } else {
        0
    }
}

/// The readable table of `restore status`.
pub fn render_status(statuses: &[DatabaseStatus]) -> String {
    let mut out = format!(
        "{:<8} {:<8} {:>12} {:<16} {:<21} REASON\n",
        "DATABASE", "CURRENT", "TOKEN_FLOOR", "ARMED_BY", "ARMED_AT"
    );
    for s in statuses {
        match (&s.incarnation, &s.error) {
            (Some(i), _) => out.push_str(&format!(
                "{:<8} {:<8} {:>12} {:<16} {:<21} {}\n",
                s.database,
                if i.current { "yes" } else { "NO" },
                i.token_floor,
                i.armed_by,
                i.armed_at,
                i.reason
            )),
            (None, error) => out.push_str(&format!(
                "{:<8} {:<8} cannot check: {}\n",
                s.database,
                "?",
                error.as_deref().unwrap_or("unknown error")
            )),
        }
    }
    for s in statuses {
        if s.incarnation.as_ref().is_some_and(|i| !i.current) {
            out.push_str(&format!(
                "  {0}: restored from a backup and not re-armed: its guard refuses every fenced \
                 call; run payoutctl restore rearm --database {0}\n",
                s.database
            ));
        }
    }
    out
}

async fn run_status(args: StatusArgs) -> anyhow::Result<std::process::ExitCode> {
    let urls = match (&args.paydb_url, &args.proxydb_url) {
        (Some(paydb), Some(proxydb)) => [("paydb", paydb.clone()), ("proxydb", proxydb.clone())],
        (None, None) => {
            let record = StackRecord::load(&args.state_dir)?;
            // The reconciler's role: it may read `incarnation` and write nothing.
            let reader = |port, db| StackRecord::login_url(&args.state_dir, "reconciler", port, db);
            [
                ("paydb", reader(record.ports.pg_main, "paydb")?),
                ("proxydb", reader(record.ports.pg_proxy, "proxydb")?),
            ]
        }
        _ => anyhow::bail!("--paydb-url and --proxydb-url go together (a deployment's two guards)"),
    };
    let mut statuses = Vec::new();
    for (database, url) in urls {
        statuses.push(match incarnation(&url).await {
            Ok(i) => DatabaseStatus {
                database,
                incarnation: Some(i),
                error: None,
            },
            Err(e) => DatabaseStatus {
                database,
                incarnation: None,
                error: Some(causes(&e)),
            },
        });
    }
    if args.json {
        println!(
            "{}",
            serde_json::json!({
                "databases": statuses,
                "exit_code": status_exit_code(&statuses),
            })
        );
    } else {
        print!("{}", render_status(&statuses));
    }
    Ok(std::process::ExitCode::from(status_exit_code(&statuses)))
}

/// An error and its causes on one line, each cause once (a wrapper that repeats its source's
/// words is not repeated).
fn causes(error: &anyhow::Error) -> String {
    let mut out = String::new();
    for cause in error.chain().map(|c| c.to_string()) {
        if !out.ends_with(&cause) {
            if !out.is_empty() {
                out.push_str(": ");
            }
            out.push_str(&cause);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(args: &[&str]) -> Result<Command, clap::Error> {
        crate::ops::cli_test::parse(args)
    }

    #[test]
    fn rearm_takes_a_guard_database_a_reason_and_an_operator() {
        let Command::Rearm(args) = parse(&[
            "rearm",
            "--database",
            "proxydb",
            "--reason",
            "INC-7",
            "--operator",
            "alice",
        ])
        .unwrap() else {
            panic!("not rearm")
        };
        assert_eq!(args.database, db_access::Database::Proxydb);
        assert_eq!(args.lock_backend, LockBackend::Etcd);
        for refused in [
            vec![
                "rearm",
                "--database",
                "gldb",
                "--reason",
                "r",
                "--operator",
                "a",
            ],
            vec!["rearm", "--database", "paydb", "--operator", "a"],
            vec!["rearm", "--database", "paydb", "--reason", "r"],
        ] {
            assert!(parse(&refused).is_err(), "{refused:?}");
        }
    }

    #[test]
    fn every_flag_has_help() {
        crate::ops::cli_test::assert_every_flag_has_help::<Command>();
    }

    fn incarnation(current: bool) -> Incarnation {
        Incarnation {
            current,
            token_floor: 42,
            armed_by: "alice".into(),
            reason: "INC-7".into(),
            armed_at: "2025-01-01T00:00:00Z".into(),
            database_oid: 1,
            guarded_table_oid: 2,
        }
    }

    #[test]
    fn status_exits_3_when_a_database_cannot_be_checked_else_1_when_one_is_not_current() {
        let status = |database, incarnation: Option<Incarnation>| DatabaseStatus {
            database,
            error: incarnation
                .is_none()
                .then(|| "connection refused".to_string()),
            incarnation,
        };
        let clean = [
            status("paydb", Some(incarnation(true))),
            status("proxydb", Some(incarnation(true))),
        ];
        assert_eq!(status_exit_code(&clean), 0);
        let restored = [
            status("paydb", Some(incarnation(false))),
            status("proxydb", Some(incarnation(true))),
        ];
        assert_eq!(status_exit_code(&restored), EXIT_NOT_CURRENT);
        let text = render_status(&restored);
        assert!(
            text.contains("paydb    NO")
                && text.contains("run payoutctl restore rearm --database paydb")
                && !text.contains("--database proxydb"),
            "{text}"
        );
        let unreachable = [
            status("paydb", Some(incarnation(false))),
            status("proxydb", None),
        ];
        assert_eq!(status_exit_code(&unreachable), EXIT_UNCHECKED);
        assert!(
            render_status(&unreachable).contains("cannot check: connection refused"),
            "{}",
            render_status(&unreachable)
        );
    }

    #[test]
    fn the_rearming_line_says_what_was_raised_to_which_horizon_from_where() {
        let done = Rearmed {
            database: "paydb",
            horizon: 1234,
            horizon_source: "etcd's current revision at https://etcd:2379".into(),
            raised: 3,
            was_current: false,
            lost_timeline: Some(LostTimeline {
                raised: 3,
                carried: 7,
                payouts_lifted: 2,
            }),
            incarnation: incarnation(true),
        };
        let line = render_rearmed(&done);
        assert!(
            line.starts_with("re-armed paydb: 3 account fence(s) raised to 1234")
                && line.contains("etcd's current revision")
                && line.contains("armed by alice")
                && line.contains("restored copy")
                && line.contains("7 record(s) recorded, 2 payout(s) lifted"),
            "{line}"
        );
        let json = serde_json::to_value(&done).unwrap();
        assert_eq!(json["raised"], 3);
        assert_eq!(json["horizon"], 1234);
        assert_eq!(json["database"], "paydb");
        assert_eq!(json["incarnation"]["current"], true);
    }

    #[test]
    fn an_error_line_names_each_cause_once() {
        let repeated = anyhow::anyhow!("Connection refused")
            .context("error communicating with database: Connection refused")
            .context("connecting to postgres://r:***@h/paydb");
        assert_eq!(
            causes(&repeated),
            "connecting to postgres://r:***@h/paydb: error communicating with database: Connection refused"
        );
    }

    #[test]
    fn a_refusal_is_typed_and_says_nothing_changed() {
        let error = anyhow::Error::new(Refused {
            horizon: 5,
            message: "rearm_after_restore: account fence 9 is above the lock service's horizon 5"
                .into(),
        });
        let refused = error.downcast_ref::<Refused>().unwrap();
        assert!(refused.message.contains(REFUSAL_MARK));
        assert!(
            error.to_string().starts_with("REFUSED")
                && error.to_string().contains("nothing was changed"),
            "{error}"
        );
    }
}
