//! What a run examines: every account (a full pass), or only the accounts whose evidence changed
//! since the last clean run (an incremental pass), so a scheduled run's cost follows the traffic
//! since the run before, not the size of the ledger.
//!
//! An account is *touched* when, since the watermark:
//! - its paydb audit chain moved past the head the last clean run anchored ([`AuditHead`]): every
//!   transition, creation, refusal and posting of a payout writes a row of its account's chain,
//!   and a chain's rows serialise on its head (paydb 0005), so this is exact, with no clock;
//! - an outbox row of it was created, delivered or quarantined (paydb's clock);
//! - the proxy recorded, resolved or sealed a submission of it, or moved its high-water
//!   (proxydb's clock);
//! - the GL recorded a journal or an event of one of its outbox rows (gldb's clock).
//!
//! The clock-based sources compare each database's own timestamps with the same database's clock
//! at the last run's snapshot, less [`OVERLAP_MS`]: a row's timestamp is taken inside its
//! transaction, which may commit after a snapshot that did not see it, so the window reaches back
//! past any transaction still open at that snapshot. What the incremental pass cannot see (a
//! write behind the services' back that writes no audit row and stamps no time, a database clock
//! stepped back by more than the overlap) the full pass sees: the reconciler service runs one
//! every `--full-every` runs, and `payoutctl reconcile` runs one unless told `--incremental`.

use serde::{Deserialize, Serialize};
use sqlx::{PgConnection, Row};

use crate::{store, AuditHead, ReconcileError};

/// How far before the last run's snapshot the clock-based sources look: twenty times the longest
/// request deadline of the services that write those rows (30 s, `service_kit::grpc::Bounds`), past
/// which no transaction of theirs is still open (a cancelled request's transaction rolls back).
pub const OVERLAP_MS: i64 = 10 * 60_000;

/// Each database's clock at a run's snapshot (unix ms): where the next incremental run starts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Watermark {
    pub paydb_unix_ms: i64,
    pub proxydb_unix_ms: i64,
    pub gldb_unix_ms: i64,
    /// paydb's clock at the last full pass this watermark descends from.
    pub full_pass_unix_ms: i64,
}

impl Watermark {
    /// Whether the run after this watermark's should be a full pass: the last one is `every_ms`
    /// or more behind it (both read on paydb's clock, no other clock enters).
    pub fn full_pass_due(&self, every_ms: u64) -> bool {
        self.paydb_unix_ms.saturating_sub(self.full_pass_unix_ms) >= every_ms as i64
    }

    /// The watermark an earlier clean run left in `path`, if any.
    pub fn load(path: &std::path::Path) -> std::io::Result<Option<Watermark>> {
        match std::fs::read_to_string(path) {
            Ok(text) => serde_json::from_str(&text)
                .map(Some)
                .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e)),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// Keeps this watermark for the next run (written whole, then renamed).
    pub fn save(&self, path: &std::path::Path) -> std::io::Result<()> {
        let tmp = path.with_extension("tmp");
        std::fs::write(&tmp, serde_json::to_vec(self)?)?;
        std::fs::rename(tmp, path)
    }

    /// The watermark moved back by the overlap (None: [`OVERLAP_MS`]) on each clock-based source:
    /// where an incremental pass starts reading them.
    pub fn less(&self, overlap_ms: Option<u64>) -> Watermark {
        let overlap = overlap_ms.map_or(OVERLAP_MS, |ms| ms as i64);
        Watermark {
            paydb_unix_ms: self.paydb_unix_ms - overlap,
            proxydb_unix_ms: self.proxydb_unix_ms - overlap,
            gldb_unix_ms: self.gldb_unix_ms - overlap,
            full_pass_unix_ms: self.full_pass_unix_ms,
        }
    }

    /// Where the watermark is kept beside an audit anchor file: they advance together (both only
    /// after a clean run), and an incremental run needs both.
    pub fn beside(anchor: &std::path::Path) -> std::path::PathBuf {
        anchor.with_extension("watermark.json")
    }

    /// This database's clock now, as a run's snapshot sees it (`now()` is the transaction's start,
    /// a moment before its snapshot: the conservative side).
    pub(crate) async fn clock(
        conn: &mut PgConnection,
        name: &'static str,
    ) -> Result<i64, ReconcileError> {
        sqlx::query_scalar("SELECT (extract(epoch FROM now()) * 1000)::bigint")
            .fetch_one(conn)
            .await
            .map_err(store(name))
    }
}

/// Which accounts a run's per-account checks examine.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Scope {
    /// Every account: the full pass.
    Full,
    /// These accounts only (sorted, deduplicated): the incremental pass.
    Accounts(Vec<String>),
    /// Every account from the first of these to the last (sorted, deduplicated, and every account
    /// of the range among them): one batch of the full pass, read as a range of each table's
    /// account order, which lets the planner scan rather than look each account up.
    Span(Vec<String>),
}

impl Scope {
    /// The SQL condition keeping `column`'s rows of the scope, binding the accounts as `$n`: for
    /// [`Scope::Full`] a condition that keeps every row and binds nothing (the planner then sees
    /// the full pass's own query, not a generic one).
    pub(crate) fn on(&self, column: &str, n: usize) -> String {
        match self {
            Scope::Full => "TRUE".into(),
            Scope::Accounts(_) => format!("{column} = ANY(${n})"),
            Scope::Span(_) => {
                format!("{column} BETWEEN (${n}::text[])[1] AND (${n}::text[])[2]")
            }
        }
    }

    /// What [`Scope::on`]'s `$n` is bound to: the accounts, or a span's first and last.
    fn bound(&self) -> Option<Vec<String>> {
        match self {
            Scope::Full => None,
            Scope::Accounts(accounts) => Some(accounts.clone()),
            Scope::Span(accounts) => Some(vec![
                accounts.first().cloned().unwrap_or_default(),
                accounts.last().cloned().unwrap_or_default(),
            ]),
        }
    }

    /// The accounts of a scope that names them (None: every account).
    pub fn named(&self) -> Option<&[String]> {
        match self {
            Scope::Full => None,
            Scope::Accounts(accounts) | Scope::Span(accounts) => Some(accounts),
        }
    }

    /// Binds the scope's accounts to a query built with [`Scope::on`] (nothing for the full pass).
    pub(crate) fn bind<'q, O>(
        &'q self,
        query: sqlx::query::QueryAs<'q, sqlx::Postgres, O, sqlx::postgres::PgArguments>,
    ) -> sqlx::query::QueryAs<'q, sqlx::Postgres, O, sqlx::postgres::PgArguments> {
        match self.bound() {
            None => query,
            Some(bound) => query.bind(bound),
        }
    }

    /// [`Scope::bind`] for a query of rows.
    pub(crate) fn bind_rows<'q>(
        &'q self,
        query: sqlx::query::Query<'q, sqlx::Postgres, sqlx::postgres::PgArguments>,
    ) -> sqlx::query::Query<'q, sqlx::Postgres, sqlx::postgres::PgArguments> {
        match self.bound() {
            None => query,
            Some(bound) => query.bind(bound),
        }
    }

    /// The rows of `sql` (built with [`Scope::on`] as `$1`) on `conn`, the scope bound; a store
    /// error named after `store_name`.
    pub(crate) async fn rows(
        &self,
        conn: &mut PgConnection,
        store_name: &'static str,
        sql: &str,
    ) -> Result<Vec<sqlx::postgres::PgRow>, ReconcileError> {
        self.bind_rows(sqlx::query(sql))
            .fetch_all(conn)
            .await
            .map_err(store(store_name))
    }

    /// Whether `account` is examined.
    pub fn covers(&self, account: &str) -> bool {
        match self {
            Scope::Full => true,
            Scope::Accounts(accounts) => accounts
                .binary_search_by(|a| a.as_str().cmp(account))
                .is_ok(),
            Scope::Span(accounts) => match (accounts.first(), accounts.last()) {
                (Some(first), Some(last)) => first.as_str() <= account && account <= last.as_str(),
                _ => false,
            },
        }
    }

    /// How many accounts the run examines, when it is incremental.
    pub fn accounts(&self) -> Option<usize> {
        match self {
            Scope::Full | Scope::Span(_) => None,
            Scope::Accounts(accounts) => Some(accounts.len()),
        }
    }
}

/// The accounts touched since `since` (already moved back by the overlap: [`Watermark::less`];
/// see the module's doc), from the run's snapshots.
pub(crate) async fn touched(
    paydb: &mut PgConnection,
    proxydb: &mut PgConnection,
    gldb: &mut PgConnection,
    anchor: &[AuditHead],
    since: &Watermark,
) -> Result<Scope, ReconcileError> {
    // The anchor also holds the evidence tables' and the lock service's chains: not accounts.
    let anchor: Vec<&AuditHead> = anchor
        .iter()
        .filter(|h| !crate::row_chains::is_row_chain(&h.chain))
        .collect();
    let chains: Vec<&str> = anchor.iter().map(|h| h.chain.as_str()).collect();
    let seqs: Vec<i64> = anchor.iter().map(|h| h.seq).collect();
    let mut accounts: Vec<String> = sqlx::query_scalar(
        "SELECT h.chain FROM audit_chain_head h \
         LEFT JOIN unnest($1::text[], $2::bigint[]) AS a(chain, seq) ON a.chain = h.chain \
         WHERE h.seq <> coalesce(a.seq, 0) \
         UNION \
         SELECT a.chain FROM unnest($1::text[]) AS a(chain) \
         WHERE NOT EXISTS (SELECT 1 FROM audit_chain_head h WHERE h.chain = a.chain) \
         UNION \
         SELECT account_id FROM ledger_outbox \
         WHERE created_at >= to_timestamp($3 / 1000.0) OR delivered_at >= to_timestamp($3 / 1000.0) \
            OR quarantined_at >= to_timestamp($3 / 1000.0)",
    )
    .bind(&chains)
    .bind(&seqs)
    .bind(since.paydb_unix_ms)
    .fetch_all(&mut *paydb)
    .await
    .map_err(store("paydb"))?;
    accounts.extend(
        sqlx::query_scalar::<_, String>(
            "SELECT account_id FROM rail_submission \
             WHERE created_at >= to_timestamp($1 / 1000.0) OR resolved_at >= to_timestamp($1 / 1000.0) \
             UNION \
             SELECT account_id FROM account_high_water WHERE updated_at >= to_timestamp($1 / 1000.0)",
        )
        .bind(since.proxydb_unix_ms)
        .fetch_all(&mut *proxydb)
        .await
        .map_err(store("proxydb"))?,
    );
    // The GL names the payment resource's rows by their keys and payouts: their accounts are
    // paydb's to say. A GL row whose key paydb does not know is `gl_matches_paydb`'s finding (it
    // reads the GL's recent rows itself), not an account.
    let (journal_keys, event_payouts): (Vec<String>, Vec<String>) = {
        let rows = sqlx::query(
            "SELECT idempotency_key AS k, NULL::text AS p FROM journals \
             WHERE source_service = 'payment-resource' AND recorded_at >= to_timestamp($1 / 1000.0) \
             UNION ALL \
             SELECT NULL, source_transaction_id FROM transaction_events \
             WHERE source_service = 'payment-resource' AND recorded_at >= to_timestamp($1 / 1000.0)",
        )
        .bind(since.gldb_unix_ms)
        .fetch_all(&mut *gldb)
        .await
        .map_err(store("gldb"))?;
        let keys = rows
            .iter()
            .filter_map(|r| r.get::<Option<String>, _>("k"))
            .collect();
        let payouts = rows
            .iter()
            .filter_map(|r| r.get::<Option<String>, _>("p"))
            .collect();
        (keys, payouts)
    };
    if !journal_keys.is_empty() || !event_payouts.is_empty() {
        accounts.extend(
            sqlx::query_scalar::<_, String>(
                "SELECT account_id FROM ledger_outbox WHERE idempotency_key = ANY($1) \
                 UNION SELECT account_id FROM payout WHERE id = ANY($2)",
            )
            .bind(&journal_keys)
            .bind(&event_payouts)
            .fetch_all(&mut *paydb)
            .await
            .map_err(store("paydb"))?,
        );
    }
    accounts.sort_unstable();
    accounts.dedup();
    Ok(Scope::Accounts(accounts))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_scope_covers_its_accounts_only_and_the_full_pass_covers_all() {
        let scope = Scope::Accounts(vec!["a".into(), "c".into()]);
        assert!(scope.covers("a") && scope.covers("c"));
        assert!(!scope.covers("b"));
        assert!(Scope::Full.covers("b"));
        assert_eq!(scope.on("p.account_id", 2), "p.account_id = ANY($2)");
        assert_eq!(Scope::Full.on("p.account_id", 2), "TRUE");
        let span = Scope::Span(vec!["a".into(), "c".into()]);
        assert!(
            span.covers("b"),
            "a span is every account from its first to its last"
        );
        assert!(!span.covers("d"));
        assert_eq!(span.bound(), Some(vec!["a".to_string(), "c".to_string()]));
    }

    #[test]
    fn a_full_pass_falls_due_a_period_after_the_last_one() {
        let w = Watermark {
            paydb_unix_ms: 10_000,
            proxydb_unix_ms: 0,
            gldb_unix_ms: 0,
            full_pass_unix_ms: 4_000,
        };
        assert!(!w.full_pass_due(6_001));
        assert!(w.full_pass_due(6_000));
    }

    #[test]
    fn the_watermark_sits_beside_the_anchor() {
        assert_eq!(
            Watermark::beside(std::path::Path::new("/s/audit-anchor.json")),
            std::path::PathBuf::from("/s/audit-anchor.watermark.json")
        );
    }
}
