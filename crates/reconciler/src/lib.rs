//! The reconciler: the detective controls of spec 2.5, run after the fact.
//!
//! It reads only stored evidence — paydb, proxydb, gldb, the rail's own record of movements and the
//! lock service's grant records in etcd — and checks every invariant again, independently of the
//! code that was supposed to keep it. A primary that has been broken or removed shows up here.
//! It never repairs anything: a finding is for a human (and for the alert on its metric).
//!
//! Read-only by construction: it takes no lock grant (it has no lock client), writes through no
//! guard (it has no payment-resource client; the rail proxy is asked only through its read-only
//! `RailMovements` lookup) and only reads the databases and etcd, so any number of runs may go
//! at once, beside everything else. The corrective part, which does take grants and write, is the
//! `resolver` crate; the process that runs both on a schedule is `reconciler-service`.

use std::collections::{BTreeMap, BTreeSet, HashMap};

pub mod funding;
pub mod lock_audit;
pub mod lost_timeline;
pub mod rail_check;
pub mod row_chains;
pub mod scope;

pub use rail_check::RailOptions;
pub use scope::{Scope, Watermark};

use payout_domain::{Actor, PayoutEvent, PayoutState};
use serde::Serialize;
use sqlx::{PgConnection, PgPool, Row};

#[derive(Debug, thiserror::Error)]
pub enum ReconcileError {
    #[error("reading {store}: {source}")]
    Store {
        store: &'static str,
        source: sqlx::Error,
    },
    #[error("reading the rail's movements: {0}")]
    Rail(String),
    #[error("reading the lock grants from etcd: {0}")]
    Etcd(#[from] etcd_client::Error),
    #[error(transparent)]
    EtcdEndpoint(#[from] mtls::TlsError),
    #[error(
        "etcd answered a read without a response header: no revision to read the horizon from"
    )]
    EtcdNoHeader,
}

/// Where the evidence is. A run holds one connection of each database's pool for the run (its
/// snapshot) and takes one more to confirm a finding, so each pool needs at least two.
pub struct Sources {
    pub paydb: PgPool,
    pub proxydb: PgPool,
    pub gldb: PgPool,
    /// The rail proxy: its read-only per-reference rail lookup (`RailMovements`) is what INV-02
    /// is checked against, as a real rail allows. (The fault suite's checker reads the rail
    /// stub's whole book instead; a production rail has no such book.)
    pub rail_proxy: Option<ProxySource>,
    /// The lock service's grant records in etcd.
    pub lock_grants: Option<LockGrants>,
    /// The registered operators' public keys (`name=hex,...`, the payment resource's
    /// `--operator-keys`): every account opening's funding signature is verified against them
    /// ([`funding`]). None: that check is skipped, never passed.
    pub operators: Option<grant_signing::Verifier>,
}

/// The rail proxy's URL and the reconciler's certificate to call it with (mutual TLS; the proxy
/// lets the reconciler role read `RailMovements`).
#[derive(Debug, Clone)]
pub struct ProxySource {
    pub url: String,
    pub tls: mtls::Tls,
}

/// Where the lock service's grant records are, and how far back they are kept.
#[derive(Debug, Clone)]
pub struct LockGrants {
    /// `https://` only: etcd is reached over mutual TLS.
    pub etcd_endpoints: Vec<String>,
    /// etcd's authority and the reconciler's certificate from it.
    pub tls: mtls::Tls,
    /// The lock-server's key prefix (`{prefix}grants/...`).
    pub prefix: String,
    /// INV-07's horizon: a record is demanded only for tokens first accepted at a guard within
    /// this long before the run. It must stay inside the lock-server's grant-record retention
    /// (`LOCK_GRANT_RETENTION_MS`), after which etcd deletes the records.
    pub horizon_ms: u64,
}

impl LockGrants {
    pub fn new(etcd_endpoints: Vec<String>, tls: mtls::Tls, prefix: String) -> Self {
        Self {
            etcd_endpoints,
            tls,
            prefix,
            horizon_ms: GRANT_HORIZON_MS_DEFAULT,
        }
    }

    /// A client of the lock service's etcd: `https://` endpoints only, mutual TLS with
    /// [`LockGrants::tls`] (the server's certificate must name `etcd`).
    async fn connect(&self) -> Result<etcd_client::Client, ReconcileError> {
        for endpoint in &self.etcd_endpoints {
            mtls::require_https(endpoint)?;
        }
        Ok(etcd_client::Client::connect(
            &self.etcd_endpoints,
            Some(etcd_client::ConnectOptions::new().with_tls(self.tls.etcd_client_config())),
        )
        .await?)
    }

    /// The lock service's horizon on etcd: the cluster's current revision, from the response
    /// header of a linearizable read (of the grant records, counted only; nothing is written).
    /// Every token the lock service has issued is a grant key's create revision, so none is above
    /// it: this is what a guard's database is re-armed to after a restore (`payoutctl restore
    /// rearm`). It is read from etcd itself, never from what an operator types. (A cluster
    /// restored from a snapshot without its procedure is behind the tokens it issued: its restore
    /// procedure advances the revision first, services/lock-server/RESTORE.md.)
    pub async fn horizon(&self) -> Result<i64, ReconcileError> {
        let client = self.connect().await?;
        // Counted over the grant records' range, which the reconciler's etcd role may read
        // (mtls::etcd_access); the header's revision is the cluster's whatever the range.
        let range = format!("{}grants/", self.prefix);
        let got = mtls::etcd_access::resend_on_auth_change(|| {
            let (mut client, range) = (client.clone(), range.clone());
            async move {
                let count = etcd_client::GetOptions::new()
                    .with_prefix()
                    .with_count_only();
                client.get(range, Some(count)).await
            }
        })
        .await?;
        got.header()
            .map(|h| h.revision())
            .ok_or(ReconcileError::EtcdNoHeader)
    }
}

/// INV-07's default horizon: six days, one day inside the lock-server's default retention of a
/// week. The day covers the time between a grant and its first use at a guard (a claim right
/// after the acquire, or a retried one) and clock differences between the lock-server, which
/// starts a record's retention, and the databases, which stamp acceptances.
pub const GRANT_HORIZON_MS_DEFAULT: u64 = 6 * 24 * 3_600_000;
/// Grant records are read from etcd in pages of this many keys: one response stays far below the
/// gRPC message limit (4 MiB) however many records the retention window holds.
pub const GRANT_RECORDS_PAGE: i64 = 5_000;

#[derive(Debug, Clone, Default)]
pub struct Options {
    /// Undelivered outbox rows are a violation (use once the dispatcher has had time to drain).
    pub require_outbox_drained: bool,
    /// The audit chains' heads as an earlier run reported them ([`Report::audit_heads`]): each
    /// chain must still hold that row with that hash. A rewrite of a whole chain (by someone who
    /// can bypass the database's privileges) is consistent in itself; only an anchor kept outside
    /// paydb shows it.
    pub audit_anchor: Option<Vec<AuditHead>>,
    /// The rail cross-check's bound, periods and cursor ([`rail_check`]): pass the last run's
    /// [`Report::rail_cursor`] as `rail.cursor`.
    pub rail: RailOptions,
    /// An incremental pass: examine only the accounts touched since this watermark (an earlier
    /// clean run's [`Report::watermark`]) and the audit anchor of the same run ([`scope`]). None,
    /// or no anchor: the full pass.
    pub since: Option<Watermark>,
    /// How far before the watermark the clock-based sources of an incremental pass look; None:
    /// [`scope::OVERLAP_MS`]. (A test whose writes have all committed before each run may say 0.)
    pub overlap_ms: Option<u64>,
    /// Accounts per batch of the per-payout checks; None: [`ACCOUNTS_PER_BATCH`]. (Tests make it
    /// small to hold a run of many batches to the findings of one.)
    pub accounts_per_batch: Option<usize>,
}

/// A point of one of paydb's audit chains (one per account; "" for rows that name none): its
/// sequence number and row hash (hex).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, serde::Deserialize)]
pub struct AuditHead {
    pub chain: String,
    pub seq: i64,
    pub hash: String,
}

impl AuditHead {
    /// The anchor an earlier run left in `path`, if any (kept outside paydb, by whoever runs the
    /// reconciler: `payoutctl reconcile --audit-anchor-file`, the reconciler service's).
    pub fn load(path: &std::path::Path) -> std::io::Result<Option<Vec<AuditHead>>> {
        match std::fs::read_to_string(path) {
            Ok(text) => serde_json::from_str(&text)
                .map(Some)
                .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e)),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// Keeps `heads` as the next run's anchor (written whole, then renamed).
    pub fn save(heads: &[AuditHead], path: &std::path::Path) -> std::io::Result<()> {
        let tmp = path.with_extension("tmp");
        std::fs::write(&tmp, serde_json::to_vec(heads)?)?;
        std::fs::rename(tmp, path)
    }
}

/// The outcome of one check.
#[derive(Debug, Clone, Serialize)]
pub struct Check {
    pub name: &'static str,
    pub invariant: &'static str,
    /// How many items (payouts, groups, accounts, journals, ...) were examined.
    pub examined: u64,
    pub violations: Vec<String>,
    /// Why the check could not run, if it could not (a missing source). Not a pass.
    pub skipped: Option<String>,
    /// What the check deliberately left out, if anything (INV-07: tokens older than its horizon).
    pub note: Option<String>,
    /// Set when the run did not cover everything the check covers (a cursor mid-round, a
    /// lookup that failed): a fact, counted by the reconciler service, never a pass or a skip.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub partial: Option<Partial>,
}

/// How much of its ground a partial check covered.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Partial {
    /// Items examined this run.
    pub covered: u64,
    /// Items the check covers in all (over its cursor's round).
    pub total: u64,
    /// Runs the check's cursor needs to go round once: a check partial for more runs than this
    /// in a row is not getting round (the alert ReconcilerCheckStaysPartial).
    pub runs_per_round: u64,
    /// Why not everything.
    pub why: String,
}

#[derive(Debug, Clone, Serialize)]
pub struct Report {
    pub checks: Vec<Check>,
    pub violations: usize,
    pub payouts_by_state: BTreeMap<String, u64>,
    pub rail_movements: u64,
    /// Where the rail cross-check's cursor stopped: pass it as the next run's
    /// [`Options::rail`]`.cursor`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub rail_cursor: Option<String>,
    pub outbox_pending: u64,
    pub ambiguous_payouts: Vec<String>,
    /// paydb's audit chains' heads at this run: pass them as the next run's
    /// [`Options::audit_anchor`].
    pub audit_heads: Vec<AuditHead>,
    /// Each database's clock at this run's snapshots: pass it as the next run's
    /// [`Options::since`] (with [`Report::audit_heads`] as its anchor) for an incremental pass.
    pub watermark: Watermark,
    /// How many accounts an incremental pass examined (None: the full pass).
    pub accounts_examined: Option<usize>,
}

impl Report {
    pub fn is_clean(&self) -> bool {
        self.violations == 0
    }

    /// A readable table: [`Report::render_checks`], then [`Report::render_total`].
    pub fn render(&self) -> String {
        let mut out = self.render_checks();
        out.push_str(&self.render_total());
        out
    }

    /// Every check's line and findings, and the summary line; not the closing total (a report
    /// that adds sections of its own puts them between the two).
    pub fn render_checks(&self) -> String {
        let mut out = String::new();
        out.push_str(&format!(
            "{:<34} {:<14} {:>9} {:>10}\n",
            "CHECK", "INVARIANT", "EXAMINED", "VIOLATIONS"
        ));
        for c in &self.checks {
            let v = match &c.skipped {
                Some(_) => "skipped".to_string(),
                None => c.violations.len().to_string(),
            };
            let partial = match &c.partial {
                Some(p) => format!("  PARTIAL {}/{}", p.covered, p.total),
                None => String::new(),
            };
            out.push_str(&format!(
                "{:<34} {:<14} {:>9} {:>10}{partial}\n",
                c.name, c.invariant, c.examined, v
            ));
        }
        for c in &self.checks {
            if let Some(why) = &c.skipped {
                out.push_str(&format!("  {} skipped: {why}\n", c.name));
            }
            if let Some(note) = &c.note {
                out.push_str(&format!("  {}: {note}\n", c.name));
            }
            if let Some(p) = &c.partial {
                out.push_str(&format!(
                    "  {} PARTIAL: {} of {} this run (its round needs {} run(s)): {}\n",
                    c.name, p.covered, p.total, p.runs_per_round, p.why
                ));
            }
            for v in c.violations.iter().take(VIOLATIONS_SHOWN_MAX) {
                out.push_str(&format!("  VIOLATION {}: {v}\n", c.name));
            }
            if c.violations.len() > VIOLATIONS_SHOWN_MAX {
                out.push_str(&format!(
                    "  ... and {} more\n",
                    c.violations.len() - VIOLATIONS_SHOWN_MAX
                ));
            }
        }
        let states: Vec<String> = self
            .payouts_by_state
            .iter()
            .map(|(s, n)| format!("{s}={n}"))
            .collect();
        match self.accounts_examined {
            Some(n) => out.push_str(&format!(
                "incremental pass: {n} account(s) touched since the last clean run\n"
            )),
            None => out.push_str("full pass: every account\n"),
        }
        out.push_str(&format!(
            "payouts: {}; rail movements: {}; outbox pending: {}; ambiguous: {}\n",
            states.join(" "),
            self.rail_movements,
            self.outbox_pending,
            self.ambiguous_payouts.len()
        ));
        out
    }

    /// The closing line: how many violations in all.
    pub fn render_total(&self) -> String {
        format!("violations: {}\n", self.violations)
    }
}

/// A report lists at most this many findings per check in its table (all are in the JSON).
pub const VIOLATIONS_SHOWN_MAX: usize = 10;

fn store(name: &'static str) -> impl Fn(sqlx::Error) -> ReconcileError {
    move |source| ReconcileError::Store {
        store: name,
        source,
    }
}

fn check(name: &'static str, invariant: &'static str) -> Check {
    Check {
        name,
        invariant,
        examined: 0,
        violations: Vec::new(),
        skipped: None,
        note: None,
        partial: None,
    }
}

const IN_FLIGHT: &str = "('CLAIMED','RAIL_SUBMITTED','RAIL_ACKED','RAIL_AMBIGUOUS')";

/// Runs every check, each store read in one snapshot (see [`Snapshots`]).
pub async fn reconcile(sources: &Sources, options: &Options) -> Result<Report, ReconcileError> {
    reconcile_with(sources, options, Reads::OneSnapshotPerStore, None).await
}

/// A write a test makes in the middle of a run (see [`reconcile_with_a_write_between`]).
type Between =
    Box<dyn FnOnce() -> std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>> + Send>;

/// TEST ONLY (feature `negative-controls`): [`reconcile`] (or, `snapshots` false, the
/// negative control's reads) with `write` awaited in the middle of the run, after the first
/// batch's payouts are read and before their recorded histories are: the moment a busy system
/// may commit a transition. With one snapshot per store the run sees none of it (a consistent
/// book); without, it sees the history ahead of the payout's state, a violation that is none.
/// Deterministic, where a loop racing a batch only sometimes lands a write there
/// (`tests/busy.rs`).
#[cfg(feature = "negative-controls")]
pub async fn reconcile_with_a_write_between<F, Fut>(
    sources: &Sources,
    options: &Options,
    snapshots: bool,
    write: F,
) -> Result<Report, ReconcileError>
where
    F: FnOnce() -> Fut + Send + 'static,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    let reads = match snapshots {
        true => Reads::OneSnapshotPerStore,
        false => Reads::EachStatementOnItsOwn,
    };
    let between: Between = Box::new(move || Box::pin(write()));
    reconcile_with(sources, options, reads, Some(between)).await
}

/// How a run reads the databases.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Reads {
    /// One `REPEATABLE READ, READ ONLY` transaction per database for the whole run, taken in the
    /// order the system writes (see [`Snapshots::take`]), and a finding that order cannot make
    /// certain confirmed by a fresh read before it is reported.
    OneSnapshotPerStore,
    /// Each statement on a snapshot of its own, nothing confirmed (the negative control only).
    #[cfg_attr(not(feature = "negative-controls"), allow(dead_code))]
    EachStatementOnItsOwn,
}

/// One connection of a database for the run: a read-only snapshot, or (negative control only) a
/// connection whose every statement reads the newest commit.
enum Reader {
    Snapshot(sqlx::Transaction<'static, sqlx::Postgres>),
    Statements(sqlx::pool::PoolConnection<sqlx::Postgres>),
}

impl Reader {
    async fn open(pool: &PgPool, name: &'static str, reads: Reads) -> Result<Self, ReconcileError> {
        if reads == Reads::EachStatementOnItsOwn {
            return Ok(Reader::Statements(
                pool.acquire().await.map_err(store(name))?,
            ));
        }
        let mut tx = pool.begin().await.map_err(store(name))?;
        sqlx::query("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY")
            .execute(&mut *tx)
            .await
            .map_err(store(name))?;
        // PostgreSQL takes a REPEATABLE READ transaction's snapshot at its first statement, not
        // at BEGIN: this one fixes it now, so the order of [`Snapshots::take`] is the order of
        // the snapshots.
        sqlx::query("SELECT 1")
            .execute(&mut *tx)
            .await
            .map_err(store(name))?;
        Ok(Reader::Snapshot(tx))
    }

    fn conn(&mut self) -> &mut PgConnection {
        match self {
            Reader::Snapshot(tx) => tx,
            Reader::Statements(conn) => conn,
        }
    }

    /// Ends the snapshot (it wrote nothing: a rollback).
    async fn close(self, name: &'static str) -> Result<(), ReconcileError> {
        match self {
            Reader::Snapshot(tx) => tx.rollback().await.map_err(store(name)),
            Reader::Statements(_) => Ok(()),
        }
    }
}

/// A run's three snapshots. A snapshot of one database makes every check within it consistent
/// (a payout's state and its history, its postings, an audit chain and its head, as of one
/// moment). Across databases no snapshot is shared, so they are taken in the order the system
/// writes, the store written later first: a fact seen in an earlier snapshot was caused by
/// writes already in every later one.
/// - gldb before paydb: the payment resource commits a posting and its outbox row in paydb
///   before the dispatcher writes the GL's journal or event, and marks the row delivered only
///   after. So a GL journal or event of the payment resource is in paydb's (later) snapshot.
/// - proxydb before paydb: the payment resource commits MarkSubmitted (the fence at the token)
///   before the proxy records the submission, and a payout exists before anything submits it.
///   So a submission proxydb shows has its payout, at RAIL_SUBMITTED or past it and the fence at
///   least its token, in paydb's snapshot.
/// - The rail after all three (it is looked up live, during the run): the proxy records a
///   submission before it asks the rail, so a payout POSTED in paydb's snapshot already has its
///   movement when the rail is asked.
/// - etcd's grant records after the databases: a token is granted before a guard accepts it.
///
/// Two findings point the other way, and are confirmed by a fresh read before they are reported
/// (the fresh read is later than the evidence that raised them, so what was merely not yet seen
/// is seen): a rail movement whose submission is not in proxydb's snapshot, and an outbox row
/// paydb says was delivered that is not in gldb's snapshot.
struct Snapshots {
    gldb: Reader,
    proxydb: Reader,
    paydb: Reader,
    reads: Reads,
}

impl Snapshots {
    async fn take(sources: &Sources, reads: Reads) -> Result<Self, ReconcileError> {
        let gldb = Reader::open(&sources.gldb, "gldb", reads).await?;
        let proxydb = Reader::open(&sources.proxydb, "proxydb", reads).await?;
        let paydb = Reader::open(&sources.paydb, "paydb", reads).await?;
        Ok(Self {
            gldb,
            proxydb,
            paydb,
            reads,
        })
    }

    /// Whether a finding against the order of the snapshots is confirmed by a fresh read.
    fn confirms(&self) -> bool {
        self.reads == Reads::OneSnapshotPerStore
    }

    async fn close(self) -> Result<(), ReconcileError> {
        self.paydb.close("paydb").await?;
        self.proxydb.close("proxydb").await?;
        self.gldb.close("gldb").await
    }
}

async fn reconcile_with(
    sources: &Sources,
    options: &Options,
    reads: Reads,
    between: Option<Between>,
) -> Result<Report, ReconcileError> {
    let mut checks = Vec::new();
    let mut snap = Snapshots::take(sources, reads).await?;
    let confirm = snap.confirms();
    let Snapshots {
        gldb,
        proxydb,
        paydb,
        ..
    } = &mut snap;
    let (paydb, proxydb, gldb) = (paydb.conn(), proxydb.conn(), gldb.conn());
    let paydb_unix_ms = Watermark::clock(paydb, "paydb").await?;
    let scope = match (&options.since, &options.audit_anchor) {
        (Some(since), Some(anchor)) => {
            let since = since.less(options.overlap_ms);
            scope::touched(paydb, proxydb, gldb, anchor, &since).await?
        }
        _ => Scope::Full,
    };
    let watermark = Watermark {
        paydb_unix_ms,
        proxydb_unix_ms: Watermark::clock(proxydb, "proxydb").await?,
        gldb_unix_ms: Watermark::clock(gldb, "gldb").await?,
        full_pass_unix_ms: match (&scope, &options.since) {
            (Scope::Accounts(_), Some(since)) => since.full_pass_unix_ms,
            _ => paydb_unix_ms,
        },
    };
    let (payouts_by_state, ambiguous_payouts) = payouts_by_state(paydb).await?;

    // The checks that read rows per payout, over the run's accounts in batches (memory: one
    // batch's rows, whatever the book's size); the full pass's accounts are every account any
    // of the three stores names.
    let accounts = match &scope {
        Scope::Accounts(accounts) | Scope::Span(accounts) => accounts.clone(),
        Scope::Full => every_account(paydb, proxydb).await?,
    };
    let recent_gl_since = match &scope {
        Scope::Full | Scope::Span(_) => None,
        Scope::Accounts(_) => options
            .since
            .map(|w| w.less(options.overlap_ms).gldb_unix_ms),
    };
    // A paydb restore's lost timeline (paydb 0014), read once for the run's GL findings.
    let mut lost = lost_timeline::LostTimeline::read(&mut *paydb)
        .await
        .map_err(store("paydb"))?;
    let mut per_payout = PerPayoutChecks {
        between,
        ..PerPayoutChecks::default()
    };
    let batches: Vec<&[String]> = match accounts.is_empty() {
        true => vec![&[]],
        false => accounts
            .chunks(
                options
                    .accounts_per_batch
                    .unwrap_or(ACCOUNTS_PER_BATCH)
                    .max(1),
            )
            .collect(),
    };
    for batch in batches {
        // A full pass's batch is a span of the account order (every account in it is in the
        // batch: the list is every account), an incremental pass's its touched accounts.
        let batch = match &scope {
            Scope::Full => Scope::Span(batch.to_vec()),
            _ => Scope::Accounts(batch.to_vec()),
        };
        per_payout
            .run(
                sources,
                paydb,
                proxydb,
                gldb,
                options,
                &batch,
                confirm,
                recent_gl_since,
                &mut lost,
            )
            .await?;
    }
    if scope == Scope::Full {
        let found = gl_rows_without_outbox_rows(
            paydb,
            gldb,
            per_payout.journals_seen,
            per_payout.events_seen,
            &mut lost,
        )
        .await?;
        per_payout.gl.violations.extend(found);
    }
    per_payout.gl.note = lost.note();
    if let (Some(grants), None) = (&sources.lock_grants, &per_payout.granted.skipped) {
        per_payout.granted.note = Some(grant_horizon_note(
            grants.horizon_ms,
            per_payout.beyond_horizon,
        ));
    }
    let PerPayoutChecks {
        transitions,
        guard1,
        postings,
        submissions,
        guard2,
        instructions,
        gl,
        granted,
        pending: outbox_pending,
        ..
    } = per_payout;
    // The payouts the rail will be asked about, read with the run's payouts (the rail is asked
    // after the other checks, [`Snapshots`]).
    let rail_plan = rail_check::plan(sources, paydb, &options.rail).await?;

    checks.push(one_in_flight_per_account(paydb).await?);
    checks.push(transitions);
    checks.push(guard1);
    checks.push(ledger_balanced(paydb, &scope).await?);
    checks.push(funding::account_funding_authorised(paydb, sources.operators.as_ref()).await?);
    checks.push(postings);
    checks.push(submissions);
    checks.push(guard2);
    checks.push(guard_database_current_in(paydb, proxydb).await?);
    checks.push(fence_not_below_proxy_submissions_in(paydb, proxydb, &scope).await?);
    checks.push(instructions);
    let rail = rail_plan.look_up(sources, proxydb, confirm).await?;
    let (rail_movements, rail_cursor) = (rail.movements, rail.cursor);
    checks.push(rail.check);
    checks.push(gl);
    checks.push(granted);
    let (lock_audit, lock_audit_head) =
        lock_audit::lock_audit_chain_intact(sources, options).await?;
    checks.push(lock_audit);
    let (chain, mut audit_heads) = audit_chain_in(paydb, options, &scope).await?;
    checks.push(chain);
    let (rows, row_heads) = row_chains::row_chains_in(paydb, proxydb, gldb, options).await?;
    checks.push(rows);
    audit_heads.extend(row_heads);
    audit_heads.extend(lock_audit_head);
    snap.close().await?;

    let violations = checks.iter().map(|c| c.violations.len()).sum();
    for c in &checks {
        for v in &c.violations {
            tracing::error!(check = c.name, invariant = c.invariant, violation = %v, "reconciliation violation");
        }
    }
    Ok(Report {
        checks,
        violations,
        payouts_by_state,
        rail_movements,
        rail_cursor,
        outbox_pending,
        audit_heads,
        ambiguous_payouts,
        watermark,
        accounts_examined: scope.accounts(),
    })
}

/// Accounts per batch of the checks that read rows per payout: the run holds one batch's rows
/// (its payouts, transitions, submissions, outbox rows and GL rows) at a time. A thousand accounts
/// at a hundred payouts each is about a hundred thousand payouts' rows, tens of MiB; the queries
/// per batch go through each table's account index.
pub const ACCOUNTS_PER_BATCH: usize = 1_000;

/// Every account any store names: paydb's accounts, audit chains and outbox rows, and proxydb's
/// high-waters and submissions (a submission for an account paydb does not know is a finding, so
/// its account must be examined too). Sorted, deduplicated.
async fn every_account(
    paydb: &mut PgConnection,
    proxydb: &mut PgConnection,
) -> Result<Vec<String>, ReconcileError> {
    let mut accounts: Vec<String> = sqlx::query_scalar(
        "SELECT id FROM account UNION SELECT chain FROM audit_chain_head \
         UNION SELECT DISTINCT account_id FROM ledger_outbox",
    )
    .fetch_all(&mut *paydb)
    .await
    .map_err(store("paydb"))?;
    accounts.extend(
        sqlx::query_scalar::<_, String>(
            "SELECT account_id FROM account_high_water \
             UNION SELECT DISTINCT account_id FROM rail_submission",
        )
        .fetch_all(&mut *proxydb)
        .await
        .map_err(store("proxydb"))?,
    );
    accounts.sort_unstable();
    accounts.dedup();
    Ok(accounts)
}

/// The per-payout checks' findings, added up over a run's batches.
struct PerPayoutChecks {
    transitions: Check,
    guard1: Check,
    postings: Check,
    submissions: Check,
    guard2: Check,
    instructions: Check,
    gl: Check,
    granted: Check,
    pending: u64,
    journals_seen: u64,
    events_seen: u64,
    beyond_horizon: u64,
    /// A test's write, awaited once between the first batch's payouts and their histories.
    between: Option<Between>,
}

impl Default for PerPayoutChecks {
    fn default() -> Self {
        Self {
            transitions: check("transition_history_replays", "INV-01/INV-08"),
            guard1: check("paydb_tokens_never_decrease", "INV-04/INV-05"),
            postings: check("postings_match_payouts", "INV-03"),
            submissions: check("one_submission_per_payout", "INV-02"),
            guard2: check("proxydb_tokens_never_decrease", "INV-04/INV-05"),
            instructions: check("submissions_match_payouts", "INV-02"),
            gl: check("gl_matches_paydb", "outbox/GL"),
            granted: check("guard_tokens_were_granted", "INV-07"),
            pending: 0,
            journals_seen: 0,
            events_seen: 0,
            beyond_horizon: 0,
            between: None,
        }
    }
}

impl PerPayoutChecks {
    /// Runs every per-payout check over one batch of accounts and adds its findings.
    #[allow(clippy::too_many_arguments)]
    async fn run(
        &mut self,
        sources: &Sources,
        paydb: &mut PgConnection,
        proxydb: &mut PgConnection,
        gldb: &mut PgConnection,
        options: &Options,
        batch: &Scope,
        confirm: bool,
        recent_gl_since: Option<i64>,
        lost: &mut lost_timeline::LostTimeline,
    ) -> Result<(), ReconcileError> {
        let payouts = load_payouts(paydb, batch).await?;
        if let Some(write) = self.between.take() {
            write().await;
        }
        add(
            &mut self.transitions,
            transition_history(paydb, &payouts, batch).await?,
        );
        add(&mut self.guard1, guard1_tokens(paydb, batch).await?);
        add(
            &mut self.postings,
            postings_match_payouts(paydb, &payouts, batch).await?,
        );
        add(
            &mut self.submissions,
            one_submission_per_payout(proxydb, paydb, &payouts, batch).await?,
        );
        add(&mut self.guard2, guard2_tokens(proxydb, batch).await?);
        add(
            &mut self.instructions,
            submissions_match_payouts(proxydb, paydb, &payouts, batch).await?,
        );
        let gl = gl_matches_paydb(
            paydb,
            gldb,
            confirm.then_some(&sources.gldb),
            options,
            batch,
            recent_gl_since,
            lost,
        )
        .await?;
        add(&mut self.gl, gl.check);
        self.pending += gl.pending;
        self.journals_seen += gl.journals_seen;
        self.events_seen += gl.events_seen;
        let (granted, beyond_horizon) = tokens_were_granted(sources, paydb, proxydb, batch).await?;
        add(&mut self.granted, granted);
        self.beyond_horizon += beyond_horizon;
        Ok(())
    }
}

/// Adds one batch's findings of a check to the run's.
fn add(total: &mut Check, batch: Check) {
    total.examined += batch.examined;
    total.violations.extend(batch.violations);
    total.skipped = total.skipped.take().or(batch.skipped);
    total.note = batch.note.or(total.note.take());
}

#[derive(Debug, Clone)]
struct PayoutRow {
    id: String,
    account_id: String,
    state: String,
    amount_minor: i64,
    currency: String,
    beneficiary_ref: String,
}

/// The payouts of the run's scope.
async fn load_payouts(
    paydb: &mut PgConnection,
    scope: &Scope,
) -> Result<BTreeMap<String, PayoutRow>, ReconcileError> {
    let sql = format!(
        "SELECT id, account_id, state, amount_minor, currency, beneficiary_ref, client_reference \
         FROM payout WHERE {}",
        scope.on("account_id", 1)
    );
    let rows = scope.rows(&mut *paydb, "paydb", &sql).await?;
    Ok(rows
        .iter()
        .map(|r| {
            let p = payout_row(r);
            (p.id.clone(), p)
        })
        .collect())
}

fn payout_row(r: &sqlx::postgres::PgRow) -> PayoutRow {
    PayoutRow {
        id: r.get("id"),
        account_id: r.get("account_id"),
        state: r.get("state"),
        amount_minor: r.get("amount_minor"),
        currency: r.get("currency"),
        beneficiary_ref: r.get("beneficiary_ref"),
    }
}

/// `payouts` with every payout of `named` that paydb's snapshot holds and `payouts` lacks: a
/// submission of an account the run examines may name a payout of an account it does not (a
/// finding of its own, the instruction not matching the record), which must be judged against
/// its record, not reported as unknown.
async fn with_payouts_named<'a>(
    paydb: &mut PgConnection,
    payouts: &'a BTreeMap<String, PayoutRow>,
    named: &[String],
) -> Result<std::borrow::Cow<'a, BTreeMap<String, PayoutRow>>, ReconcileError> {
    let missing: Vec<&String> = named
        .iter()
        .filter(|id| !payouts.contains_key(*id))
        .collect();
    if missing.is_empty() {
        return Ok(std::borrow::Cow::Borrowed(payouts));
    }
    let rows = sqlx::query(
        "SELECT id, account_id, state, amount_minor, currency, beneficiary_ref, client_reference \
         FROM payout WHERE id = ANY($1)",
    )
    .bind(missing)
    .fetch_all(&mut *paydb)
    .await
    .map_err(store("paydb"))?;
    if rows.is_empty() {
        return Ok(std::borrow::Cow::Borrowed(payouts));
    }
    let mut more = payouts.clone();
    for r in rows {
        let p = payout_row(&r);
        more.insert(p.id.clone(), p);
    }
    Ok(std::borrow::Cow::Owned(more))
}

/// Every payout counted by state, and the ambiguous ones named, whatever the run's scope (the
/// ambiguous ones through paydb 0011's index of the non-terminal payouts).
async fn payouts_by_state(
    paydb: &mut PgConnection,
) -> Result<(BTreeMap<String, u64>, Vec<String>), ReconcileError> {
    let by_state =
        sqlx::query_as::<_, (String, i64)>("SELECT state, count(*) FROM payout GROUP BY state")
            .fetch_all(&mut *paydb)
            .await
            .map_err(store("paydb"))?
            .into_iter()
            .map(|(state, n)| (state, n as u64))
            .collect();
    let ambiguous = sqlx::query_scalar(
        "SELECT id FROM payout WHERE state = 'RAIL_AMBIGUOUS' ORDER BY created_at, id",
    )
    .fetch_all(&mut *paydb)
    .await
    .map_err(store("paydb"))?;
    Ok((by_state, ambiguous))
}

/// INV-01's detective control: at most one payout per account is in flight.
async fn one_in_flight_per_account(paydb: &mut PgConnection) -> Result<Check, ReconcileError> {
    let mut c = check("one_in_flight_payout_per_account", "INV-01");
    c.examined = sqlx::query_scalar::<_, i64>("SELECT count(*) FROM account")
        .fetch_one(&mut *paydb)
        .await
        .map_err(store("paydb"))? as u64;
    let rows = sqlx::query(&format!(
        "SELECT account_id, string_agg(id, ',' ORDER BY id) AS ids FROM payout \
         WHERE state IN {IN_FLIGHT} GROUP BY account_id HAVING count(*) > 1"
    ))
    .fetch_all(&mut *paydb)
    .await
    .map_err(store("paydb"))?;
    for r in rows {
        let account: String = r.get("account_id");
        let ids: String = r.get("ids");
        c.violations.push(format!(
            "account {account} has several payouts in flight: {ids}"
        ));
    }
    Ok(c)
}

/// INV-01 and INV-08: each payout's recorded transitions replay through the 2.3 table from
/// PENDING to its current state, by the listed actor; nothing ever leaves a terminal state.
async fn transition_history(
    paydb: &mut PgConnection,
    payouts: &BTreeMap<String, PayoutRow>,
    scope: &Scope,
) -> Result<Check, ReconcileError> {
    let mut c = check("transition_history_replays", "INV-01/INV-08");
    let sql = format!(
        "SELECT payout_id, from_state, to_state, event, actor FROM audit_event \
         WHERE kind = 'transition' AND payout_id IS NOT NULL AND {} ORDER BY payout_id, id",
        scope.on("chain", 1)
    );
    let rows = scope.rows(&mut *paydb, "paydb", &sql).await?;
    let mut history: HashMap<String, Vec<(String, String, String, String)>> = HashMap::new();
    for r in rows {
        history.entry(r.get("payout_id")).or_default().push((
            r.get::<Option<String>, _>("from_state").unwrap_or_default(),
            r.get::<Option<String>, _>("to_state").unwrap_or_default(),
            r.get::<Option<String>, _>("event").unwrap_or_default(),
            r.get::<String, _>("actor"),
        ));
    }
    for p in payouts.values() {
        c.examined += 1;
        let mut state = PayoutState::Pending;
        for (from, to, event, actor) in history.get(&p.id).map(Vec::as_slice).unwrap_or_default() {
            if from != state.as_str() {
                c.violations.push(format!(
                    "{}: transition recorded from {from} while the history was at {state}",
                    p.id
                ));
                break;
            }
            let (Some(e), Some(a)) = (PayoutEvent::parse(event), parse_actor(actor)) else {
                c.violations.push(format!(
                    "{}: unknown event {event:?} or actor {actor:?}",
                    p.id
                ));
                break;
            };
            match state.apply(e, a) {
                Ok(next) if next.as_str() == to => state = next,
                Ok(next) => {
                    c.violations.push(format!(
                        "{}: {from} --{event}--> {to}, but the table says {next}",
                        p.id
                    ));
                    break;
                }
                Err(refused) => {
                    c.violations.push(format!(
                        "{}: recorded transition is not allowed: {refused}",
                        p.id
                    ));
                    break;
                }
            }
        }
        if state.as_str() != p.state && c.violations.last().is_none_or(|v| !v.starts_with(&p.id)) {
            c.violations.push(format!(
                "{}: state is {} but its recorded history ends at {state}",
                p.id, p.state
            ));
        }
    }
    Ok(c)
}

fn parse_actor(value: &str) -> Option<Actor> {
    [Actor::Holder, Actor::Resolver, Actor::Operator]
        .into_iter()
        .find(|a| a.as_str() == value)
}

/// INV-04/INV-05 at the first guard: per account, the tokens of accepted transitions never go
/// down in commit order, and the stored fence is at least every accepted token.
async fn guard1_tokens(paydb: &mut PgConnection, scope: &Scope) -> Result<Check, ReconcileError> {
    let mut c = check("paydb_tokens_never_decrease", "INV-04/INV-05");
    let sql = format!(
        "SELECT account_id, token, payout_id FROM audit_event \
         WHERE kind = 'transition' AND token IS NOT NULL AND {} ORDER BY account_id, id",
        scope.on("chain", 1)
    );
    let rows = scope.rows(&mut *paydb, "paydb", &sql).await?;
    let mut last: HashMap<String, i64> = HashMap::new();
    for r in &rows {
        c.examined += 1;
        let account: String = r.get("account_id");
        let token: i64 = r.get("token");
        if let Some(prev) = last.get(&account) {
            if token < *prev {
                let payout: Option<String> = r.get("payout_id");
                c.violations.push(format!(
                    "account {account}: token {token} accepted after {prev} (payout {})",
                    payout.unwrap_or_default()
                ));
            }
        }
        last.insert(account, token);
    }
    let sql = format!("SELECT id, fence FROM account WHERE {}", scope.on("id", 1));
    let fences = scope.rows(&mut *paydb, "paydb", &sql).await?;
    for r in fences {
        let account: String = r.get("id");
        let fence: i64 = r.get("fence");
        if let Some(max) = last.get(&account) {
            if fence < *max {
                c.violations.push(format!(
                    "account {account}: fence {fence} is below accepted token {max}"
                ));
            }
        }
    }
    Ok(c)
}

/// INV-03: every transaction group sums to zero; every balance equals the sum of its entries.
/// paydb's audit trail is the chains its trigger wrote (migration 0005, one chain per account):
/// every row still hashes to its `row_hash` (nothing edited), each chain's sequence runs 1, 2, ...
/// without a gap and each row names the hash of the one before (nothing deleted or inserted out of
/// band), each chain's last row is the head the trigger recorded and every chain has its head (no
/// tail removed, no head removed), and the heads of an earlier run are still in the chains (no
/// rewrite).
pub async fn audit_chain_intact(
    paydb: &PgPool,
    options: &Options,
) -> Result<(Check, Vec<AuditHead>), ReconcileError> {
    let mut conn = paydb.acquire().await.map_err(store("paydb"))?;
    audit_chain_in(&mut conn, options, &Scope::Full).await
}

/// [`audit_chain_intact`] on the given connection (a run's snapshot: the chains and their heads
/// as of one moment, so a row appended meanwhile is no false finding).
async fn audit_chain_in(
    paydb: &mut PgConnection,
    options: &Options,
    scope: &Scope,
) -> Result<(Check, Vec<AuditHead>), ReconcileError> {
    let mut c = check("audit_chain_intact", "audit");
    // Which rows are checked, as (chain, the seq after which they are): every row (the full
    // pass), or the rows each touched chain gained since the anchored head, read with that head's
    // row, so that the first new row is checked against it (the anchored row itself is held to
    // the anchor's hash below).
    let (from, from_chains, from_seqs): (&str, Vec<String>, Vec<i64>) = match scope {
        Scope::Full => ("audit_event e", Vec::new(), Vec::new()),
        Scope::Accounts(accounts) | Scope::Span(accounts) => {
            let anchored: HashMap<&str, i64> = options
                .audit_anchor
                .iter()
                .flatten()
                .map(|h| (h.chain.as_str(), h.seq))
                .collect();
            let seqs = accounts
                .iter()
                .map(|a| anchored.get(a.as_str()).copied().unwrap_or(0))
                .collect();
            (
                "unnest($1::text[], $2::bigint[]) AS s(chain, after_seq) \
                 JOIN audit_event e ON e.chain = s.chain AND e.chain_seq >= s.after_seq",
                accounts.clone(),
                seqs,
            )
        }
    };
    let after = match scope {
        Scope::Full => "0",
        Scope::Accounts(_) | Scope::Span(_) => "after_seq",
    };
    let sql = format!(
        "WITH c AS ( \
           SELECT e.id, e.chain, e.chain_seq, e.prev_hash, e.row_hash, {after} AS after_seq, \
                  sha256(e.prev_hash || audit_event_content(e)) AS recomputed, \
                  lag(e.row_hash) OVER w AS before, lag(e.chain_seq) OVER w AS seq_before \
           FROM {from} WINDOW w AS (PARTITION BY e.chain ORDER BY e.chain_seq)) \
         SELECT id, chain, chain_seq, \
                recomputed <> row_hash AS edited, \
                chain_seq <> coalesce(seq_before, 0) + 1 AS gap, \
                prev_hash <> coalesce(before, audit_chain_genesis()) AS unlinked \
         FROM c WHERE chain_seq > after_seq AND (recomputed <> row_hash \
            OR chain_seq <> coalesce(seq_before, 0) + 1 \
            OR prev_hash <> coalesce(before, audit_chain_genesis()))"
    );
    let mut query = sqlx::query(&sql);
    if *scope != Scope::Full {
        query = query.bind(&from_chains).bind(&from_seqs);
    }
    let rows = query.fetch_all(&mut *paydb).await.map_err(store("paydb"))?;
    for r in rows {
        let id: i64 = r.get("id");
        let chain: String = r.get("chain");
        let seq: i64 = r.get("chain_seq");
        c.violations.push(format!(
            "audit row {id} (chain {chain:?}, seq {seq}): {}",
            chain_faults(&r)
        ));
    }
    let sql = format!(
        "SELECT count(*) FROM {from} WHERE e.chain_seq > {}",
        match scope {
            Scope::Full => "0",
            Scope::Accounts(_) | Scope::Span(_) => "s.after_seq",
        }
    );
    let mut query = sqlx::query_as::<_, (i64,)>(&sql);
    if *scope != Scope::Full {
        query = query.bind(&from_chains).bind(&from_seqs);
    }
    c.examined = query
        .fetch_one(&mut *paydb)
        .await
        .map_err(store("paydb"))?
        .0 as u64;
    // Each chain's head against its last row (the touched chains' only, in the incremental
    // pass: an untouched chain's head is still the anchored one, which is checked below); and
    // every head, for the next run's anchor.
    let last_rows = match scope {
        Scope::Full => {
            "SELECT DISTINCT ON (chain) chain, chain_seq AS seq, row_hash AS hash \
             FROM audit_event ORDER BY chain, chain_seq DESC"
        }
        Scope::Accounts(_) | Scope::Span(_) => {
            "SELECT l.* FROM unnest($1::text[]) AS s(chain) CROSS JOIN LATERAL ( \
               SELECT chain, chain_seq AS seq, row_hash AS hash FROM audit_event e \
               WHERE e.chain = s.chain ORDER BY chain_seq DESC LIMIT 1) l"
        }
    };
    let sql = format!(
        "SELECT coalesce(h.chain, t.chain) AS chain, h.seq AS head_seq, h.hash AS head_hash, \
                t.seq AS last_seq, t.hash AS last_hash, \
                t.chain IS NOT NULL OR {} AS judged \
         FROM audit_chain_head h FULL JOIN ({last_rows}) t ON t.chain = h.chain",
        match scope {
            Scope::Full => "TRUE",
            Scope::Accounts(_) | Scope::Span(_) => "h.chain = ANY($1)",
        }
    );
    let mut query = sqlx::query(&sql);
    if *scope != Scope::Full {
        query = query.bind(&from_chains);
    }
    let heads = query.fetch_all(&mut *paydb).await.map_err(store("paydb"))?;
    let mut current = Vec::new();
    for r in heads {
        let chain: String = r.get("chain");
        let head_seq: Option<i64> = r.get("head_seq");
        let head_hash: Option<Vec<u8>> = r.get("head_hash");
        let last_seq: Option<i64> = r.get("last_seq");
        let last_hash: Option<Vec<u8>> = r.get("last_hash");
        let judged: bool = r.get("judged");
        match (head_seq, last_seq) {
            _ if !judged => {}
            (None, Some(last)) => c.violations.push(format!(
                "chain {chain:?} has rows up to seq {last} but no head (the head was removed)"
            )),
            (Some(head), last) if head != last.unwrap_or(0) || (head > 0 && head_hash != last_hash) => {
                c.violations.push(format!(
                    "chain {chain:?}: the head is at seq {head} but the last audit row is seq {} (rows removed from the end, or the head rewritten)",
                    last.unwrap_or(0)
                ))
            }
            _ => {}
        }
        if let (Some(seq), Some(hash)) = (head_seq, head_hash) {
            if seq > 0 {
                current.push(AuditHead {
                    chain,
                    seq,
                    hash: hex(&hash),
                });
            }
        }
    }
    current.sort_by(|a, b| a.chain.cmp(&b.chain));
    if let Some(anchor) = &options.audit_anchor {
        // The tables' row chains in the same anchor are `row_chains`' to check.
        let anchor: Vec<&AuditHead> = anchor
            .iter()
            .filter(|h| !row_chains::is_row_chain(&h.chain))
            .collect();
        let chains: Vec<String> = anchor.iter().map(|h| h.chain.clone()).collect();
        let seqs: Vec<i64> = anchor.iter().map(|h| h.seq).collect();
        let found = sqlx::query(
            "SELECT a.chain, a.seq, e.row_hash FROM unnest($1::text[], $2::bigint[]) AS a(chain, seq) \
             LEFT JOIN audit_event e ON e.chain = a.chain AND e.chain_seq = a.seq",
        )
        .bind(&chains)
        .bind(&seqs)
        .fetch_all(&mut *paydb)
        .await
        .map_err(store("paydb"))?;
        let found: std::collections::HashMap<(String, i64), Option<String>> = found
            .into_iter()
            .map(|r| {
                let hash: Option<Vec<u8>> = r.get("row_hash");
                ((r.get("chain"), r.get("seq")), hash.as_deref().map(hex))
            })
            .collect();
        for h in anchor {
            if found.get(&(h.chain.clone(), h.seq)).cloned().flatten() != Some(h.hash.clone()) {
                c.violations.push(format!(
                    "chain {:?} no longer holds the head reported earlier (seq {}, hash {}): rewritten",
                    h.chain, h.seq, h.hash
                ));
            }
        }
    }
    Ok((c, current))
}

/// What a chained row found by a chain check's query is wrong with, from its `edited`, `gap`
/// and `unlinked` columns (the audit chains' query and the row chains' share them).
fn chain_faults(r: &sqlx::postgres::PgRow) -> String {
    let mut what = Vec::new();
    if r.get::<bool, _>("edited") {
        what.push("its content no longer hashes to its row_hash (edited)");
    }
    if r.get::<bool, _>("gap") {
        what.push("the sequence skips before it (rows deleted)");
    }
    if r.get::<bool, _>("unlinked") {
        what.push("its prev_hash is not the previous row's hash (the chain is broken)");
    }
    what.join("; ")
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

async fn ledger_balanced(paydb: &mut PgConnection, scope: &Scope) -> Result<Check, ReconcileError> {
    let mut c = check("ledger_balanced", "INV-03");
    // The groups with an entry on an account of the scope, each with all its entries.
    let groups_of_scope = match scope {
        Scope::Full => "TRUE".to_string(),
        Scope::Accounts(_) | Scope::Span(_) => format!(
            "transaction_group IN (SELECT transaction_group FROM ledger_entry WHERE {})",
            scope.on("account_id", 1)
        ),
    };
    let sql = format!(
        "SELECT count(DISTINCT transaction_group) FROM ledger_entry WHERE {groups_of_scope}"
    );
    c.examined = scope
        .bind(sqlx::query_as::<_, (i64,)>(&sql))
        .fetch_one(&mut *paydb)
        .await
        .map_err(store("paydb"))?
        .0 as u64;
    let sql = format!(
        "SELECT transaction_group::text AS g, sum(amount_minor)::bigint AS s FROM ledger_entry \
         WHERE {groups_of_scope} GROUP BY transaction_group HAVING sum(amount_minor) <> 0"
    );
    let groups = scope.rows(&mut *paydb, "paydb", &sql).await?;
    for r in groups {
        let g: String = r.get("g");
        let s: i64 = r.get("s");
        c.violations.push(format!("group {g} sums to {s}, not 0"));
    }
    let sql = format!(
        "SELECT a.id, a.balance_minor, coalesce(sum(e.amount_minor), 0)::bigint AS summed \
         FROM account a LEFT JOIN ledger_entry e ON e.account_id = a.id WHERE {} \
         GROUP BY a.id, a.balance_minor HAVING a.balance_minor <> coalesce(sum(e.amount_minor), 0)",
        scope.on("a.id", 1)
    );
    let balances = scope.rows(&mut *paydb, "paydb", &sql).await?;
    for r in balances {
        let id: String = r.get("id");
        let cached: i64 = r.get("balance_minor");
        let summed: i64 = r.get("summed");
        c.violations.push(format!(
            "account {id}: balance {cached} but its entries sum to {summed}"
        ));
    }
    Ok(c)
}

/// A POSTED payout has exactly its two rows (the customer debited by the amount); no other payout
/// has any.
async fn postings_match_payouts(
    paydb: &mut PgConnection,
    payouts: &BTreeMap<String, PayoutRow>,
    scope: &Scope,
) -> Result<Check, ReconcileError> {
    let mut c = check("postings_match_payouts", "INV-03");
    let sql = format!(
        "SELECT e.payout_id, count(*) AS n, \
                coalesce(sum(e.amount_minor) FILTER (WHERE e.account_id = p.account_id), 0)::bigint AS customer \
         FROM ledger_entry e JOIN payout p ON p.id = e.payout_id WHERE {} GROUP BY e.payout_id",
        scope.on("p.account_id", 1)
    );
    let rows = scope.rows(&mut *paydb, "paydb", &sql).await?;
    let mut posted: HashMap<String, (i64, i64)> = HashMap::new();
    for r in rows {
        posted.insert(r.get("payout_id"), (r.get("n"), r.get("customer")));
    }
    for p in payouts.values() {
        c.examined += 1;
        let rows = posted.get(&p.id).copied();
        match (p.state.as_str(), rows) {
            ("POSTED", Some((2, customer))) if customer == -p.amount_minor => {}
            ("POSTED", other) => c.violations.push(format!(
                "{} is POSTED but its ledger rows are {other:?}",
                p.id
            )),
            (_, Some(rows)) => c.violations.push(format!(
                "{} is {} but has ledger rows {rows:?}",
                p.id, p.state
            )),
            (_, None) => {}
        }
    }
    Ok(c)
}

/// INV-02 at the proxy: one submission record per payout, and only for payouts that exist.
async fn one_submission_per_payout(
    proxydb: &mut PgConnection,
    paydb: &mut PgConnection,
    payouts: &BTreeMap<String, PayoutRow>,
    scope: &Scope,
) -> Result<Check, ReconcileError> {
    let mut c = check("one_submission_per_payout", "INV-02");
    let sql = format!(
        "SELECT payout_id, count(*) AS n FROM rail_submission WHERE {} GROUP BY payout_id",
        scope.on("account_id", 1)
    );
    let rows = scope.rows(&mut *proxydb, "proxydb", &sql).await?;
    let named: Vec<String> = rows.iter().map(|r| r.get("payout_id")).collect();
    let payouts = with_payouts_named(paydb, payouts, &named).await?;
    for r in rows {
        c.examined += 1;
        let payout: String = r.get("payout_id");
        let n: i64 = r.get("n");
        if n > 1 {
            c.violations
                .push(format!("payout {payout} has {n} submissions"));
        }
        if !payouts.contains_key(&payout) {
            c.violations
                .push(format!("submission for unknown payout {payout}"));
        }
    }
    Ok(c)
}

/// INV-04/INV-05 at the second guard: per account, submission tokens never go down in insertion
/// order, and the high-water is at least every accepted token.
async fn guard2_tokens(proxydb: &mut PgConnection, scope: &Scope) -> Result<Check, ReconcileError> {
    let mut c = check("proxydb_tokens_never_decrease", "INV-04/INV-05");
    let sql = format!(
        "SELECT account_id, fence_token, payout_id FROM rail_submission WHERE {} \
         ORDER BY account_id, id",
        scope.on("account_id", 1)
    );
    let rows = scope.rows(&mut *proxydb, "proxydb", &sql).await?;
    let mut last: HashMap<String, i64> = HashMap::new();
    for r in &rows {
        c.examined += 1;
        let account: String = r.get("account_id");
        let token: i64 = r.get("fence_token");
        if let Some(prev) = last.get(&account) {
            if token < *prev {
                let payout: String = r.get("payout_id");
                c.violations.push(format!(
                    "account {account}: submission token {token} after {prev} (payout {payout})"
                ));
            }
        }
        last.insert(account, token);
    }
    let sql = format!(
        "SELECT account_id, high_water FROM account_high_water WHERE {}",
        scope.on("account_id", 1)
    );
    let hw = scope.rows(&mut *proxydb, "proxydb", &sql).await?;
    for r in hw {
        let account: String = r.get("account_id");
        let high: i64 = r.get("high_water");
        if let Some(max) = last.get(&account) {
            if high < *max {
                c.violations.push(format!(
                    "account {account}: high-water {high} below submitted token {max}"
                ));
            }
        }
    }
    Ok(c)
}

/// The fence survives a restore (issue 19, section 3): each guard's database knows which database
/// it is (`incarnation`, migrations 0006), and a copy restored from a backup is not the database
/// its row was armed in until the procedure re-arms it (`payoutctl restore rearm`). Until then
/// the guard refuses every fenced call (`incarnation_admits`), so payouts wait; this check is the
/// alarm that says why and what to run.
pub async fn guard_database_current(
    paydb: &PgPool,
    proxydb: &PgPool,
) -> Result<Check, ReconcileError> {
    let mut paydb = paydb.acquire().await.map_err(store("paydb"))?;
    let mut proxydb = proxydb.acquire().await.map_err(store("proxydb"))?;
    guard_database_current_in(&mut paydb, &mut proxydb).await
}

async fn guard_database_current_in(
    paydb: &mut PgConnection,
    proxydb: &mut PgConnection,
) -> Result<Check, ReconcileError> {
    let mut c = check("guard_database_current", "INV-04/INV-05");
    for (name, guarded, conn) in [
        ("paydb", "account", &mut *paydb),
        ("proxydb", "account_high_water", &mut *proxydb),
    ] {
        c.examined += 1;
        let r = sqlx::query(
            "SELECT incarnation_is_current() AS current, \
                    (SELECT database_oid::bigint FROM incarnation) AS armed_database, \
                    (SELECT guarded_table::bigint FROM incarnation) AS armed_table, \
                    (SELECT d.oid::bigint FROM pg_database d WHERE d.datname = current_database()) AS this_database, \
                    to_regclass($1)::oid::bigint AS this_table",
        )
        .bind(guarded)
        .fetch_one(&mut *conn)
        .await
        .map_err(store(name))?;
        if !r.get::<bool, _>("current") {
            let oid = |column: &str| {
                r.get::<Option<i64>, _>(column)
                    .map_or_else(|| "none".to_string(), |oid| oid.to_string())
            };
            c.violations.push(format!(
                "{name}: restored from a backup and not re-armed: run payoutctl restore rearm \
                 --database {name} (its incarnation row was armed for database OID {} and {guarded} \
                 OID {}; this is database OID {} and {guarded} OID {}); until then its guard \
                 refuses every fenced call",
                oid("armed_database"),
                oid("armed_table"),
                oid("this_database"),
                oid("this_table"),
            ));
        }
    }
    Ok(c)
}

/// The witness that paydb was not rewound (a restore the incarnation cannot see: a physical
/// restore of the same cluster keeps its OIDs): every proxy submission follows the payment
/// resource's MarkSubmitted under the same token, and paydb's fence never decreases, so each
/// account's fence is at least the highest token of its submissions. (Sealed rows, NOT_SENT, are
/// written by a fenced inquiry, and the proxy's high-water is advanced by inquiries too: their
/// tokens may never have reached paydb, so neither is a witness.) proxydb is read first: a
/// submission it shows was marked in paydb before it was made, so paydb, read after, shows the
/// fence at least there; a submission made while this runs cannot be a false finding.
pub async fn fence_not_below_proxy_submissions(
    paydb: &PgPool,
    proxydb: &PgPool,
) -> Result<Check, ReconcileError> {
    let mut proxydb = proxydb.acquire().await.map_err(store("proxydb"))?;
    let mut paydb = paydb.acquire().await.map_err(store("paydb"))?;
    fence_not_below_proxy_submissions_in(&mut paydb, &mut proxydb, &Scope::Full).await
}

/// [`fence_not_below_proxy_submissions`] on the given connections: in a run, proxydb's snapshot
/// is older than paydb's ([`Snapshots`]), the direction this check needs.
async fn fence_not_below_proxy_submissions_in(
    paydb: &mut PgConnection,
    proxydb: &mut PgConnection,
    scope: &Scope,
) -> Result<Check, ReconcileError> {
    let mut c = check("fence_not_below_proxy_submissions", "INV-04/INV-05");
    let sql = format!(
        "SELECT DISTINCT ON (account_id) account_id, fence_token, payout_id FROM rail_submission \
         WHERE outcome IS DISTINCT FROM 'NOT_SENT' AND {} ORDER BY account_id, fence_token DESC, id",
        scope.on("account_id", 1)
    );
    let submitted = scope.rows(&mut *proxydb, "proxydb", &sql).await?;
    let sql = format!("SELECT id, fence FROM account WHERE {}", scope.on("id", 1));
    let fences: HashMap<String, i64> = scope
        .rows(&mut *paydb, "paydb", &sql)
        .await?
        .into_iter()
        .map(|r| (r.get("id"), r.get("fence")))
        .collect();
    for r in submitted {
        c.examined += 1;
        let account: String = r.get("account_id");
        let token: i64 = r.get("fence_token");
        let payout: String = r.get("payout_id");
        match fences.get(&account) {
            Some(&fence) if fence >= token => {}
            Some(&fence) => c.violations.push(format!(
                "account {account}: paydb's fence {fence} is below {token}, the token of its proxy \
                 submission of {payout}: paydb was rewound (restored from a backup?); the \
                 procedure is payoutctl restore rearm --database paydb"
            )),
            None => c.violations.push(format!(
                "account {account}: no account in paydb, but the proxy has its submission of \
                 {payout} under token {token}: paydb was rewound (restored from a backup?)"
            )),
        }
    }
    Ok(c)
}

/// The instruction a submission carried is the payout's record: account, amount, currency and
/// beneficiary of every proxy submission equal paydb's (the rail is asked to pay what the books
/// debit, never what a workflow's input said).
async fn submissions_match_payouts(
    proxydb: &mut PgConnection,
    paydb: &mut PgConnection,
    payouts: &BTreeMap<String, PayoutRow>,
    scope: &Scope,
) -> Result<Check, ReconcileError> {
    let mut c = check("submissions_match_payouts", "INV-02");
    let sql = format!(
        "SELECT payout_id, account_id, amount_minor, currency, beneficiary_ref FROM rail_submission \
         WHERE outcome IS DISTINCT FROM 'NOT_SENT' AND {}",
        scope.on("account_id", 1)
    );
    let rows: Vec<(String, String, i64, String, String)> = scope
        .bind(sqlx::query_as(&sql))
        .fetch_all(&mut *proxydb)
        .await
        .map_err(store("proxydb"))?;
    let named: Vec<String> = rows.iter().map(|r| r.0.clone()).collect();
    let payouts = with_payouts_named(paydb, payouts, &named).await?;
    for (payout_id, account_id, amount_minor, currency, beneficiary_ref) in rows {
        c.examined += 1;
        let Some(p) = payouts.get(&payout_id) else {
            c.violations.push(format!(
                "submission for {payout_id}, which is no payout of ours"
            ));
            continue;
        };
        let submitted = (&account_id, amount_minor, &currency, &beneficiary_ref);
        let recorded = (
            &p.account_id,
            p.amount_minor,
            &p.currency,
            &p.beneficiary_ref,
        );
        if submitted != recorded {
            c.violations.push(format!(
                "WRONG INSTRUCTION: {payout_id} was submitted as {submitted:?} (account, amount, currency, beneficiary) but the payout record is {recorded:?}"
            ));
        }
    }
    Ok(c)
}

/// The GL holds exactly what paydb's outbox carried, told apart by the row's kind (paydb 0008):
/// one journal per JOURNAL row, same amounts, and no payment-resource journal without its row;
/// one transaction event per TRANSACTION_EVENT row, at its (payout, event version), of its event
/// type, the one the delivery recorded, and no payment-resource event without its row.
///
/// gldb's snapshot is older than paydb's ([`Snapshots`]): a journal or event the GL holds has its
/// outbox row in paydb's snapshot, so "no posting in paydb" is certain. A row paydb says was
/// delivered may have been delivered after gldb's snapshot, so that finding is confirmed by a
/// fresh read of the GL (`fresh_gldb`, after paydb's snapshot) before it is reported.
async fn gl_matches_paydb(
    paydb: &mut PgConnection,
    gldb: &mut PgConnection,
    fresh_gldb: Option<&PgPool>,
    options: &Options,
    scope: &Scope,
    recent_since_unix_ms: Option<i64>,
    lost: &mut lost_timeline::LostTimeline,
) -> Result<GlFindings, ReconcileError> {
    let mut c = check("gl_matches_paydb", "outbox/GL");
    let sql = format!(
        "SELECT idempotency_key, kind, payload, delivered_at IS NOT NULL AS delivered, journal_id \
         FROM ledger_outbox WHERE {}",
        scope.on("account_id", 1)
    );
    let outbox = scope.rows(&mut *paydb, "paydb", &sql).await?;
    // The GL's rows to hold against them: every row of the payment resource (Scope::Full), or
    // the rows of those outbox rows (by key, and every event of their payouts), and in an
    // incremental pass every row the GL recorded since the watermark too: a recent GL row with
    // no outbox row at all is found among those. (A full pass finds such rows by count:
    // [`gl_rows_without_outbox_rows`].)
    let (journals_of, events_of, keys, payout_ids) = match scope {
        Scope::Full => ("TRUE", "TRUE", Vec::new(), Vec::new()),
        Scope::Accounts(_) | Scope::Span(_) => {
            let keys: Vec<String> = outbox.iter().map(|r| r.get("idempotency_key")).collect();
            let payouts: Vec<String> = outbox
                .iter()
                .filter_map(|r| {
                    r.get::<serde_json::Value, _>("payload")["source_transaction_id"]
                        .as_str()
                        .map(str::to_string)
                })
                .collect();
            match recent_since_unix_ms {
                Some(_) => (
                    "(j.idempotency_key = ANY($1) OR j.recorded_at >= to_timestamp($2 / 1000.0))",
                    "(source_transaction_id = ANY($1) OR recorded_at >= to_timestamp($2 / 1000.0))",
                    keys,
                    payouts,
                ),
                None => (
                    "j.idempotency_key = ANY($1)",
                    "source_transaction_id = ANY($1)",
                    keys,
                    payouts,
                ),
            }
        }
    };
    let sql = format!(
        "SELECT j.idempotency_key, e.line_number, e.amount::text AS amount \
         FROM journals j JOIN entries e ON e.journal_id = j.id \
         WHERE j.source_service = 'payment-resource' AND {journals_of}"
    );
    let journals = gl_rows(gldb, &sql, scope, &keys, recent_since_unix_ms).await?;
    let sql = format!(
        "SELECT id::text AS id, source_transaction_id, event_version, event_type FROM transaction_events \
         WHERE source_service = 'payment-resource' AND {events_of}"
    );
    let events = gl_rows(gldb, &sql, scope, &payout_ids, recent_since_unix_ms).await?;
    let mut gl: HashMap<String, BTreeMap<i32, String>> = HashMap::new();
    for r in journals {
        let amount: String = r.get("amount");
        gl.entry(r.get("idempotency_key"))
            .or_default()
            .insert(r.get("line_number"), normalize_decimal(&amount));
    }
    // (payout, event version) -> (event id, event type)
    let mut gl_events: HashMap<(String, i64), (String, String)> = HashMap::new();
    for r in events {
        let version: i32 = r.get("event_version");
        gl_events.insert(
            (r.get("source_transaction_id"), i64::from(version)),
            (r.get("id"), r.get("event_type")),
        );
    }
    let mut pending = 0;
    let mut keys = BTreeSet::new();
    let mut event_keys = BTreeSet::new();
    // Rows paydb says were delivered that gldb's snapshot lacks: (what is absent, the finding).
    let mut delivered_absent: Vec<(GlRecord, String)> = Vec::new();
    for r in outbox {
        c.examined += 1;
        let key: String = r.get("idempotency_key");
        let kind: String = r.get("kind");
        let payload: serde_json::Value = r.get("payload");
        let delivered: bool = r.get("delivered");
        let recorded: Option<String> = r.get("journal_id");
        let mut undelivered = |c: &mut Check, record: GlRecord, what: String| {
            if delivered {
                delivered_absent.push((
                    record,
                    format!("outbox {what} marked delivered but absent from the GL"),
                ));
            } else {
                pending += 1;
                if options.require_outbox_drained {
                    c.violations.push(format!("outbox {what} not delivered"));
                }
            }
        };
        if kind == "TRANSACTION_EVENT" {
            let identity = payload["source_transaction_id"]
                .as_str()
                .zip(payload["event_version"].as_i64());
            let Some((payout, version)) = identity else {
                c.violations.push(format!(
                    "outbox event {key} names no (source_transaction_id, event_version)"
                ));
                continue;
            };
            let event_type = payload["event_type"].as_str().unwrap_or_default();
            event_keys.insert((payout.to_string(), version));
            match gl_events.get(&(payout.to_string(), version)) {
                Some((id, gl_type)) => {
                    if gl_type != event_type {
                        c.violations.push(format!(
                            "event {key}: the GL holds {gl_type} at {payout} v{version}, paydb {event_type}"
                        ));
                    }
                    if let Some(recorded) = recorded.as_deref().filter(|r| r != id) {
                        c.violations.push(format!(
                            "event {key}: delivery recorded GL event {recorded}, the GL holds {id}"
                        ));
                    }
                }
                None => undelivered(
                    &mut c,
                    GlRecord::Event(payout.to_string(), version),
                    format!("event {key}"),
                ),
            }
            continue;
        }
        keys.insert(key.clone());
        let expected: BTreeMap<i32, String> = payload["entries"]
            .as_array()
            .map(|entries| {
                entries
                    .iter()
                    .map(|e| {
                        (
                            e["line_number"].as_i64().unwrap_or(0) as i32,
                            normalize_decimal(e["amount"].as_str().unwrap_or("")),
                        )
                    })
                    .collect()
            })
            .unwrap_or_default();
        match gl.get(&key) {
            Some(lines) if *lines == expected => {}
            Some(lines) => c.violations.push(format!(
                "journal {key}: GL lines {lines:?} differ from paydb's {expected:?}"
            )),
            None => undelivered(&mut c, GlRecord::Journal(key.clone()), format!("row {key}")),
        }
    }
    for (record, finding) in delivered_absent {
        let seen_now = match fresh_gldb {
            Some(gldb) => record.in_gl(gldb).await?,
            None => false,
        };
        if !seen_now {
            c.violations.push(finding);
        }
    }
    // A paydb restore's aftermath (paydb 0014) explains what the GL holds of a lost timeline:
    // `lost` is the run's, read once, and counts what every batch met for the check's note.
    for key in gl.keys().filter(|k| !keys.contains(*k)) {
        if !lost.explains_journal(key) {
            c.violations
                .push(format!("GL journal {key} has no posting in paydb"));
        }
    }
    for ((payout, version), (_, event_type)) in &gl_events {
        if !event_keys.contains(&(payout.clone(), *version))
            && !lost.explains_event(payout, *version)
        {
            c.violations.push(format!(
                "GL event {event_type} of {payout} v{version} has no outbox row in paydb"
            ));
        }
    }
    Ok(GlFindings {
        journals_seen: gl.len() as u64,
        events_seen: gl_events.len() as u64,
        check: c,
        pending,
    })
}

/// The GL's rows of one of [`gl_matches_paydb`]'s queries: everything (Scope::Full), or those
/// named by `names` (`$1`) and, given, those recorded since (`$2`).
async fn gl_rows(
    gldb: &mut PgConnection,
    sql: &str,
    scope: &Scope,
    names: &[String],
    recent_since_unix_ms: Option<i64>,
) -> Result<Vec<sqlx::postgres::PgRow>, ReconcileError> {
    let mut query = sqlx::query(sql);
    if *scope != Scope::Full {
        query = query.bind(names);
        if let Some(since) = recent_since_unix_ms {
            query = query.bind(since);
        }
    }
    query.fetch_all(&mut *gldb).await.map_err(store("gldb"))
}

/// What [`gl_matches_paydb`] found over its outbox rows.
struct GlFindings {
    check: Check,
    /// Undelivered outbox rows.
    pending: u64,
    /// The GL's journals and events of the payment resource it read (each belongs to one account,
    /// so over a full pass's batches they add up to the GL's own count unless the GL holds a row
    /// no outbox row of any account explains).
    journals_seen: u64,
    events_seen: u64,
}

/// GL rows read per page when a full pass looks for the GL's rows that no outbox row explains.
pub const GL_SWEEP_PAGE: i64 = 10_000;

/// The full pass's last GL finding: a journal or event of the payment resource that no outbox
/// row of any account explains (nor a paydb restore's lost timeline). Counted first: when every
/// GL row was read against its outbox row in some batch (`seen` equals the GL's count), there is
/// none, and nothing more is read; otherwise the GL is read page by page, each page's rows looked
/// up in paydb, so that memory stays one page whatever the ledger's size.
async fn gl_rows_without_outbox_rows(
    paydb: &mut PgConnection,
    gldb: &mut PgConnection,
    journals_seen: u64,
    events_seen: u64,
    lost: &mut lost_timeline::LostTimeline,
) -> Result<Vec<String>, ReconcileError> {
    let mut found = Vec::new();
    let (journals, events): (i64, i64) = sqlx::query_as(
        "SELECT (SELECT count(*) FROM journals WHERE source_service = 'payment-resource'), \
                (SELECT count(*) FROM transaction_events WHERE source_service = 'payment-resource')",
    )
    .fetch_one(&mut *gldb)
    .await
    .map_err(store("gldb"))?;
    if journals as u64 > journals_seen {
        let mut after = String::new();
        loop {
            let page: Vec<String> = sqlx::query_scalar(
                "SELECT idempotency_key FROM journals \
                 WHERE source_service = 'payment-resource' AND idempotency_key > $1 \
                 ORDER BY idempotency_key LIMIT $2",
            )
            .bind(&after)
            .bind(GL_SWEEP_PAGE)
            .fetch_all(&mut *gldb)
            .await
            .map_err(store("gldb"))?;
            let Some(last) = page.last().cloned() else {
                break;
            };
            let known: BTreeSet<String> = sqlx::query_scalar(
                "SELECT idempotency_key FROM ledger_outbox WHERE idempotency_key = ANY($1)",
            )
            .bind(&page)
            .fetch_all(&mut *paydb)
            .await
            .map_err(store("paydb"))?
            .into_iter()
            .collect();
            for key in page.iter().filter(|k| !known.contains(*k)) {
                if !lost.explains_journal(key) {
                    found.push(format!("GL journal {key} has no posting in paydb"));
                }
            }
            after = last;
        }
    }
    if events as u64 > events_seen {
        let (mut after_payout, mut after_version) = (String::new(), 0i32);
        loop {
            let page: Vec<(String, i32, String)> = sqlx::query_as(
                "SELECT source_transaction_id, event_version, event_type FROM transaction_events \
                 WHERE source_service = 'payment-resource' \
                   AND (source_transaction_id, event_version) > ($1, $2) \
                 ORDER BY source_transaction_id, event_version LIMIT $3",
            )
            .bind(&after_payout)
            .bind(after_version)
            .bind(GL_SWEEP_PAGE)
            .fetch_all(&mut *gldb)
            .await
            .map_err(store("gldb"))?;
            let Some((last_payout, last_version, _)) = page.last().cloned() else {
                break;
            };
            let payouts: Vec<&str> = page.iter().map(|(p, _, _)| p.as_str()).collect();
            let known: BTreeSet<(String, i64)> = sqlx::query_as::<_, (String, i64)>(
                "SELECT o.payload->>'source_transaction_id', (o.payload->>'event_version')::bigint \
                 FROM payout p JOIN ledger_outbox o ON o.account_id = p.account_id \
                 WHERE p.id = ANY($1) AND o.kind = 'TRANSACTION_EVENT' \
                   AND o.payload->>'source_transaction_id' = p.id",
            )
            .bind(&payouts)
            .fetch_all(&mut *paydb)
            .await
            .map_err(store("paydb"))?
            .into_iter()
            .collect();
            for (payout, version, event_type) in &page {
                let version = i64::from(*version);
                if !known.contains(&(payout.clone(), version))
                    && !lost.explains_event(payout, version)
                {
                    found.push(format!(
                        "GL event {event_type} of {payout} v{version} has no outbox row in paydb"
                    ));
                }
            }
            (after_payout, after_version) = (last_payout, last_version);
        }
    }
    Ok(found)
}

/// What an outbox row put in the GL, as the GL names it.
enum GlRecord {
    /// A journal, by its idempotency key.
    Journal(String),
    /// A transaction event, by (payout, event version).
    Event(String, i64),
}

impl GlRecord {
    /// Whether the GL holds it now (a fresh read, not the run's snapshot).
    async fn in_gl(&self, gldb: &PgPool) -> Result<bool, ReconcileError> {
        let query = match self {
            GlRecord::Journal(key) => sqlx::query_scalar(
                "SELECT EXISTS (SELECT 1 FROM journals \
                 WHERE source_service = 'payment-resource' AND idempotency_key = $1)",
            )
            .bind(key.clone()),
            GlRecord::Event(payout, version) => sqlx::query_scalar(
                "SELECT EXISTS (SELECT 1 FROM transaction_events \
                 WHERE source_service = 'payment-resource' AND source_transaction_id = $1 \
                   AND event_version = $2)",
            )
            .bind(payout.clone())
            .bind(i32::try_from(*version).unwrap_or(i32::MAX)),
        };
        query.fetch_one(gldb).await.map_err(store("gldb"))
    }
}

/// "12.340000" and "12.34" are the same amount; "-0.50" and "-0.5" too.
fn normalize_decimal(value: &str) -> String {
    if !value.contains('.') {
        return value.to_string();
    }
    value
        .trim_end_matches('0')
        .trim_end_matches('.')
        .to_string()
}

/// INV-07's detective control: every token a guard accepted was minted by the lock service for
/// that account's key (etcd keeps one record per grant, whose create revision is the token). The
/// records are kept for a retention window, so a record is demanded only for tokens first accepted
/// within the horizon; older ones are counted and named in the check's note, never passed as checked.
async fn tokens_were_granted(
    sources: &Sources,
    paydb: &mut PgConnection,
    proxydb: &mut PgConnection,
    scope: &Scope,
) -> Result<(Check, u64), ReconcileError> {
    let mut c = check("guard_tokens_were_granted", "INV-07");
    let Some(grants) = &sources.lock_grants else {
        c.skipped =
            Some("no etcd grant records given (PostgreSQL lock backend, or not configured)".into());
        return Ok((c, 0));
    };
    // The acceptances first (the run's snapshots), then the records: a token accepted while this
    // runs was granted before it was accepted, so its record is already there when the records
    // are read.
    let now_unix_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or_default();
    let horizon_start_unix_ms = now_unix_ms - grants.horizon_ms as i64;
    // (account, token) -> (first acceptance, what accepted it)
    let mut presented: BTreeMap<(String, i64), (i64, String)> = BTreeMap::new();
    let mut accept = |account: String, token: i64, at_unix_ms: i64, what: String| {
        let entry = presented
            .entry((account, token))
            .or_insert((at_unix_ms, what.clone()));
        if at_unix_ms < entry.0 {
            *entry = (at_unix_ms, what);
        }
    };
    let sql = format!(
        "SELECT account_id, fence_token, payout_id, \
           (extract(epoch FROM created_at) * 1000)::bigint AS at_unix_ms FROM rail_submission \
         WHERE {}",
        scope.on("account_id", 1)
    );
    for r in scope.rows(&mut *proxydb, "proxydb", &sql).await? {
        accept(
            r.get("account_id"),
            r.get("fence_token"),
            r.get("at_unix_ms"),
            format!("submission of {}", r.get::<String, _>("payout_id")),
        );
    }
    let sql = format!(
        "SELECT account_id, token, (extract(epoch FROM min(at)) * 1000)::bigint AS at_unix_ms \
         FROM audit_event WHERE kind = 'transition' AND token IS NOT NULL AND {} \
         GROUP BY account_id, token",
        scope.on("chain", 1)
    );
    for r in scope.rows(&mut *paydb, "paydb", &sql).await? {
        accept(
            r.get("account_id"),
            r.get("token"),
            r.get("at_unix_ms"),
            "paydb transition".into(),
        );
    }
    let granted = match scope {
        Scope::Full => grant_records(grants, None).await?,
        Scope::Accounts(_) | Scope::Span(_) => {
            // Only the accounts with a token to demand a record for: an old book asks etcd nothing.
            let mut needed: Vec<String> = presented
                .iter()
                .filter(|(_, (first, _))| *first >= horizon_start_unix_ms)
                .map(|((account, _), _)| account.clone())
                .collect();
            needed.dedup();
            grant_records(grants, Some(&needed)).await?
        }
    };
    let mut beyond_horizon = 0u64;
    for ((account, token), (first_accepted_unix_ms, what)) in presented {
        if first_accepted_unix_ms < horizon_start_unix_ms {
            beyond_horizon += 1;
            continue;
        }
        c.examined += 1;
        let key = payout_domain::lock_key(
            &payout_domain::AccountId::parse(account.clone()).unwrap_or_else(|_| {
                payout_domain::AccountId::parse("invalid").expect("literal id")
            }),
        );
        if !granted
            .get(&key)
            .is_some_and(|tokens| tokens.contains(&token))
        {
            c.violations
                .push(format!("{what}: token {token} for {key} was never granted"));
        }
    }
    Ok((c, beyond_horizon))
}

/// The grant check's note: what it deliberately left out.
fn grant_horizon_note(horizon_ms: u64, beyond_horizon: u64) -> String {
    format!(
        "grant records are kept for a retention window: demanded for tokens first accepted within \
         the last {} (horizon); {beyond_horizon} older token(s) not checked",
        human_duration(horizon_ms)
    )
}

/// Every grant record under the prefix (or, given accounts, under each one's lock key), as lock
/// key -> tokens, read page by page.
async fn grant_records(
    grants: &LockGrants,
    accounts: Option<&[String]>,
) -> Result<HashMap<String, BTreeSet<i64>>, ReconcileError> {
    let mut client = grants.connect().await?;
    let grants_prefix = format!("{}grants/", grants.prefix);
    let mut granted: HashMap<String, BTreeSet<i64>> = HashMap::new();
    let Some(accounts) = accounts else {
        read_grant_records(&mut client, &grants_prefix, &grants_prefix, &mut granted).await?;
        return Ok(granted);
    };
    for account in accounts {
        let Ok(account) = payout_domain::AccountId::parse(account.clone()) else {
            continue;
        };
        let range = format!("{grants_prefix}{}/", payout_domain::lock_key(&account));
        read_grant_records(&mut client, &grants_prefix, &range, &mut granted).await?;
    }
    Ok(granted)
}

/// The grant records under `range` (a prefix within `grants_prefix`) into `granted`.
async fn read_grant_records(
    client: &mut etcd_client::Client,
    grants_prefix: &str,
    range: &str,
    granted: &mut HashMap<String, BTreeSet<i64>>,
) -> Result<(), ReconcileError> {
    let range_end = prefix_end(range.as_bytes());
    let mut from = range.as_bytes().to_vec();
    loop {
        let page = etcd_client::GetOptions::new()
            .with_range(range_end.clone())
            .with_keys_only()
            .with_limit(GRANT_RECORDS_PAGE);
        let got = mtls::etcd_access::resend_on_auth_change(|| {
            let (mut client, from, page) = (client.clone(), from.clone(), page.clone());
            async move { client.get(from, Some(page)).await }
        })
        .await?;
        for kv in got.kvs() {
            let key = String::from_utf8_lossy(kv.key());
            if let Some(rest) = key.strip_prefix(grants_prefix) {
                if let Some((lock_key, _)) = rest.rsplit_once('/') {
                    granted
                        .entry(lock_key.to_string())
                        .or_default()
                        .insert(kv.create_revision());
                }
            }
        }
        match got.kvs().last() {
            Some(last) if got.more() => {
                // The next page starts just after the last key read.
                from = last.key().to_vec();
                from.push(0);
            }
            _ => return Ok(()),
        }
    }
}

/// The first key after every key starting with `prefix` (etcd's range end for a prefix).
fn prefix_end(prefix: &[u8]) -> Vec<u8> {
    let mut end = prefix.to_vec();
    while let Some(last) = end.pop() {
        if last < 0xff {
            end.push(last + 1);
            return end;
        }
    }
    // Every byte 0xff: no upper bound ("\0" is etcd's "to the end of the keyspace").
    vec![0]
}

/// "6d", "36h", "90s": the largest whole unit.
fn human_duration(ms: u64) -> String {
    const UNITS: [(u64, &str); 4] = [
        (86_400_000, "d"),
        (3_600_000, "h"),
        (60_000, "min"),
        (1_000, "s"),
    ];
    for (unit_ms, name) in UNITS {
        if ms >= unit_ms && ms.is_multiple_of(unit_ms) {
            return format!("{}{name}", ms / unit_ms);
        }
    }
    format!("{ms}ms")
}

#[cfg(test)]
mod tests {
    use super::{human_duration, normalize_decimal, prefix_end};

    #[test]
    fn prefix_end_is_the_first_key_after_the_prefix() {
        assert_eq!(prefix_end(b"/p/grants/"), b"/p/grants0".to_vec());
        assert_eq!(prefix_end(b"a\xff"), b"b".to_vec());
        assert_eq!(prefix_end(b"\xff\xff"), vec![0]);
    }

    #[test]
    fn horizons_print_in_their_largest_whole_unit() {
        assert_eq!(human_duration(6 * 86_400_000), "6d");
        assert_eq!(human_duration(36 * 3_600_000), "36h");
        assert_eq!(human_duration(90_000), "90s");
        assert_eq!(human_duration(1_500), "1500ms");
    }

    #[test]
    fn decimals_normalize() {
        assert_eq!(normalize_decimal("12.340000000000000000"), "12.34");
        assert_eq!(normalize_decimal("12.34"), "12.34");
        assert_eq!(normalize_decimal("-1.000"), "-1");
        assert_eq!(normalize_decimal("5"), "5");
    }
}
