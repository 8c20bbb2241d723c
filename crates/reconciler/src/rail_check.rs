//! INV-02 against the rail itself (`rail_movements_match_the_books`), through the rail proxy's
//! read-only lookup by client reference (all a real rail offers), at any size.
//!
//! A run cannot ask the rail about every payout ever made, so the check walks paydb's payouts in
//! id order with a cursor that survives runs ([`RailOptions::cursor`] in, [`Report::rail_cursor`]
//! out): each run takes the next [`RailOptions::lookups_max`] payouts after where the last run
//! stopped, and the run whose slice reaches the last id ends the round (the next starts again at
//! the first). Every payout is therefore looked up within `ceil(N / lookups_max)` runs. Ahead of
//! the slice, every run looks up the payouts that changed recently: those not yet terminal and
//! those that ended within [`RailOptions::recent_ms`] (where a late or duplicate movement shows
//! first).
//!
//! Which payouts of a slice are looked up: every payout that went through the proxy (a sent
//! submission), every POSTED one, and for [`RailOptions::sealed_recheck_ms`] after they ended, the
//! payouts the books say never paid: sealed at the proxy (NOT_SENT: it refused to send) and
//! FAILED or ABANDONED ones. A movement for one of those is a violation (money moved, the books
//! say it did not), as are a duplicate, a wrong amount, currency or beneficiary, and a POSTED
//! payout the rail has nothing for. An UNKNOWN answer (inside the settlement window) is counted,
//! not judged.
//!
//! A partial check is a fact, not a skip: a run that did not cover everything its round needs
//! (mid-round, a lookup that failed in the round, more recent payouts than the bound) says so in
//! [`Check::partial`] with what it covered; the reconciler service counts it and an alert fires
//! when a check stays partial for more runs than its round needs. A lookup error for one payout
//! is reported for that payout and the check goes on; an unreachable proxy makes the run partial,
//! it does not abort the other checks.
//!
//! Snapshots: the payouts and their states are read in the run's paydb snapshot, the submissions
//! in proxydb's, and the rail is asked after both ([`super::Snapshots`]): a submission in
//! proxydb's snapshot has its payout at RAIL_SUBMITTED or past it in paydb's, and a payout POSTED
//! there has its movement already. A movement whose submission proxydb's snapshot does not hold
//! may have been submitted after it, so that finding is confirmed by a fresh read of proxydb
//! before it is reported.
//!
//! [`Report::rail_cursor`]: super::Report::rail_cursor

use std::collections::{BTreeSet, HashMap};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use sqlx::{PgConnection, Row};

use super::{check, store, Check, Partial, ReconcileError, Sources};

/// Rail lookups of one cursor slice, and at most as many again of recently changed payouts: bounds
/// a run on a large book (a lookup is one proxy call and one rail call; 20,000 take minutes at the
/// rail's pace, inside the schedule's 5-minute interval). A book of N payouts goes round in
/// `ceil(N / 20,000)` runs.
pub const RAIL_LOOKUPS_PER_RUN_MAX: usize = 20_000;

/// A payout that ended within this long before the run is looked up in every run, ahead of the
/// cursor: one hour covers the rail's settlement window (minutes, within which its lookup
/// answers UNKNOWN) with room, so a duplicate or late movement of a payout that just ended is
/// seen in the first runs after it, not a round later.
pub const RAIL_RECENT_MS_DEFAULT: u64 = 3_600_000;

/// How long after they ended the payouts the books say never paid (sealed NOT_SENT at the proxy,
/// FAILED, ABANDONED) are still looked up: seven days is longer than any rail's settlement and
/// return window that could still show a movement for an instruction (the proxy's instruction
/// validity is minutes; a bank's late settlement, days), and keeps the looked-up set bounded by
/// a week of failures rather than growing with the ledger.
pub const RAIL_SEALED_RECHECK_MS_DEFAULT: u64 = 7 * 24 * 3_600_000;

/// A partial check's reason names at most this many failed lookups (all are in the log).
const LOOKUP_ERRORS_NAMED_MAX: usize = 5;

/// The rail check's part of [`super::Options`].
#[derive(Debug, Clone)]
pub struct RailOptions {
    /// Payouts per cursor slice, and recent payouts per run, at most
    /// ([`RAIL_LOOKUPS_PER_RUN_MAX`] by default).
    pub lookups_max: usize,
    /// Payouts that ended within this long are looked up every run ([`RAIL_RECENT_MS_DEFAULT`]).
    pub recent_ms: u64,
    /// Payouts the books say never paid are looked up for this long after they ended
    /// ([`RAIL_SEALED_RECHECK_MS_DEFAULT`]).
    pub sealed_recheck_ms: u64,
    /// Where the last run's slice stopped: its [`super::Report::rail_cursor`], kept by whoever
    /// runs the reconciler (opaque text). None, or text this version cannot read: the round
    /// starts at the first payout.
    pub cursor: Option<String>,
}

impl Default for RailOptions {
    fn default() -> Self {
        Self {
            lookups_max: RAIL_LOOKUPS_PER_RUN_MAX,
            recent_ms: RAIL_RECENT_MS_DEFAULT,
            sealed_recheck_ms: RAIL_SEALED_RECHECK_MS_DEFAULT,
            cursor: None,
        }
    }
}

impl RailOptions {
    /// Where the cursor is kept beside an audit anchor file (`payoutctl reconcile
    /// --audit-anchor-file`, the reconciler service's `RECONCILE_AUDIT_ANCHOR_FILE`).
    pub fn cursor_file(anchor: &Path) -> PathBuf {
        anchor.with_extension("rail-cursor.json")
    }

    /// The defaults, with the cursor an earlier run kept beside `anchor`, if any (none kept, or
    /// no anchor file: the round starts at the first payout).
    pub fn kept_beside(anchor: Option<&Path>) -> std::io::Result<Self> {
        let cursor = match anchor.map(Self::cursor_file) {
            Some(path) => match std::fs::read_to_string(&path) {
                Ok(text) => Some(text),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
                Err(e) => return Err(e),
            },
            None => None,
        };
        Ok(Self {
            cursor,
            ..Self::default()
        })
    }

    /// Keeps a run's [`super::Report::rail_cursor`] beside `anchor` for the next run (written
    /// whole, then renamed). Every run's, violations or not: a rail finding (a duplicate stays
    /// on the rail's record for good) must not hold the cursor, or the rest of the book would
    /// never be looked up again; the finding was reported by the run that saw it, and is seen
    /// again each round.
    pub fn keep_beside(anchor: Option<&Path>, cursor: Option<&str>) -> std::io::Result<()> {
        let (Some(anchor), Some(cursor)) = (anchor, cursor) else {
            return Ok(());
        };
        let path = Self::cursor_file(anchor);
        let tmp = path.with_extension("tmp");
        std::fs::write(&tmp, cursor)?;
        std::fs::rename(tmp, path)
    }
}

/// The cursor as it travels between runs (JSON in [`RailOptions::cursor`]).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
struct Cursor {
    /// The last payout id of the last slice; "" at the start of a round.
    after: String,
    /// Lookups of this round that failed so far: a round with any is not a full one.
    missed: u64,
}

impl Cursor {
    fn parse(text: Option<&str>) -> Self {
        match text.map(serde_json::from_str::<Cursor>) {
            Some(Ok(c)) => c,
            Some(Err(e)) => {
                tracing::warn!(error = %e, "unreadable rail cursor: the round starts again");
                Cursor::default()
            }
            None => Cursor::default(),
        }
    }

    fn text(&self) -> String {
        // A struct of two plain fields always serializes.
        serde_json::to_string(self).unwrap_or_default()
    }
}

/// One payout as the check needs it, from paydb's snapshot.
struct Payout {
    id: String,
    state: String,
    amount_minor: i64,
    currency: String,
    beneficiary_ref: String,
    client_reference: String,
    /// Ended within [`RailOptions::sealed_recheck_ms`].
    within_recheck: bool,
}

/// What proxydb's snapshot says of a payout's submission.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Submitted {
    /// A sent submission (any outcome but NOT_SENT).
    Sent,
    /// Sealed NOT_SENT; `recent`: within the re-check period.
    Sealed { recent: bool },
}

/// What the check answers to the run.
pub(crate) struct RailRun {
    pub check: Check,
    pub movements: u64,
    /// The next run's [`RailOptions::cursor`].
    pub cursor: Option<String>,
}

const PAYOUT_COLUMNS: &str =
    "id, state, amount_minor, currency, beneficiary_ref, client_reference, \
     (updated_at > now() - $1 * interval '1 millisecond') AS within_recheck";

fn payout_of(r: &sqlx::postgres::PgRow) -> Payout {
    Payout {
        id: r.get("id"),
        state: r.get("state"),
        amount_minor: r.get("amount_minor"),
        currency: r.get("currency"),
        beneficiary_ref: r.get("beneficiary_ref"),
        client_reference: r.get("client_reference"),
        within_recheck: r.get("within_recheck"),
    }
}

/// The recently changed payouts (not terminal, or ended within `recent_ms`), at most
/// `lookups_max + 1` (one more says the bound was reached).
async fn recent_payouts(
    paydb: &mut PgConnection,
    options: &RailOptions,
) -> Result<Vec<Payout>, ReconcileError> {
    let filter = "state NOT IN ('POSTED','FAILED','ABANDONED') \
                  OR updated_at > now() - $2 * interval '1 millisecond'";
    payouts_where(paydb, options, filter, options.recent_ms as f64).await
}

/// The cursor's next slice: up to `lookups_max + 1` payouts after `after`, in id order.
async fn slice(
    paydb: &mut PgConnection,
    options: &RailOptions,
    after: &str,
) -> Result<Vec<Payout>, ReconcileError> {
    payouts_where(paydb, options, "id > $2", after.to_string()).await
}

/// Up to `lookups_max + 1` payouts matching `filter` (over its one argument `$2`), in id order.
async fn payouts_where<T>(
    paydb: &mut PgConnection,
    options: &RailOptions,
    filter: &str,
    arg: T,
) -> Result<Vec<Payout>, ReconcileError>
where
    T: for<'q> sqlx::Encode<'q, sqlx::Postgres> + sqlx::Type<sqlx::Postgres> + Send,
{
    let sql = format!("SELECT {PAYOUT_COLUMNS} FROM payout WHERE {filter} ORDER BY id LIMIT $3");
    Ok(sqlx::query(&sql)
        .bind(options.sealed_recheck_ms as f64)
        .bind(arg)
        .bind(options.lookups_max.max(1) as i64 + 1)
        .fetch_all(&mut *paydb)
        .await
        .map_err(store("paydb"))?
        .iter()
        .map(payout_of)
        .collect())
}

/// proxydb's submissions of `ids`, in its snapshot.
async fn submissions(
    proxydb: &mut PgConnection,
    sealed_recheck_ms: u64,
    ids: &[&str],
) -> Result<HashMap<String, Submitted>, ReconcileError> {
    let rows = sqlx::query(
        "SELECT payout_id, outcome IS NOT DISTINCT FROM 'NOT_SENT' AS sealed, \
           (resolved_at > now() - $2 * interval '1 millisecond') IS TRUE AS recent \
         FROM rail_submission WHERE payout_id = ANY($1)",
    )
    .bind(ids)
    .bind(sealed_recheck_ms as f64)
    .fetch_all(&mut *proxydb)
    .await
    .map_err(store("proxydb"))?;
    Ok(rows
        .into_iter()
        .map(|r| {
            let s = match r.get::<bool, _>("sealed") {
                true => Submitted::Sealed {
                    recent: r.get("recent"),
                },
                false => Submitted::Sent,
            };
            (r.get("payout_id"), s)
        })
        .collect())
}

/// Whether the rail is asked about `p` at all.
fn to_look_up(p: &Payout, submitted: Option<Submitted>) -> bool {
    match submitted {
        Some(Submitted::Sent) => true,
        Some(Submitted::Sealed { recent }) => recent || p.within_recheck,
        None => {
            p.state == "POSTED"
                || (matches!(p.state.as_str(), "FAILED" | "ABANDONED") && p.within_recheck)
        }
    }
}

/// The payouts a run will ask the rail about, read from paydb's snapshot with the run's other
/// paydb reads (proxydb's submissions are read and the rail asked later, [`RailPlan::look_up`]:
/// the order the check has always read in).
pub(crate) struct RailPlan {
    /// None when no rail proxy is configured (the check is skipped).
    cursor: Option<Cursor>,
    /// The cursor as it came in, handed back unchanged when the check is skipped.
    cursor_text: Option<String>,
    lookups_max: usize,
    total: u64,
    runs_per_round: u64,
    recent_cut: bool,
    round_ends: bool,
    next_after: String,
    /// The recent ones first, then the slice's others, each once.
    payouts: Vec<Payout>,
    sealed_recheck_ms: u64,
}

/// Reads the run's plan (see the module's documentation).
pub(crate) async fn plan(
    sources: &Sources,
    paydb: &mut PgConnection,
    options: &RailOptions,
) -> Result<RailPlan, ReconcileError> {
    let lookups_max = options.lookups_max.max(1);
    let mut plan = RailPlan {
        cursor: None,
        cursor_text: options.cursor.clone(),
        lookups_max,
        total: 0,
        runs_per_round: 1,
        recent_cut: false,
        round_ends: true,
        next_after: String::new(),
        payouts: Vec::new(),
        sealed_recheck_ms: options.sealed_recheck_ms,
    };
    if sources.rail_proxy.is_none() {
        return Ok(plan);
    }
    let cursor = Cursor::parse(options.cursor.as_deref());
    plan.total = sqlx::query_scalar::<_, i64>("SELECT count(*) FROM payout")
        .fetch_one(&mut *paydb)
        .await
        .map_err(store("paydb"))? as u64;
    plan.runs_per_round = plan.total.div_ceil(lookups_max as u64).max(1);
    let mut recent = recent_payouts(paydb, options).await?;
    plan.recent_cut = recent.len() > lookups_max;
    recent.truncate(lookups_max);
    let mut slice = slice(paydb, options, &cursor.after).await?;
    plan.round_ends = slice.len() <= lookups_max;
    slice.truncate(lookups_max);
    if let (false, Some(last)) = (plan.round_ends, slice.last()) {
        plan.next_after = last.id.clone();
    }
    let mut seen = BTreeSet::new();
    plan.payouts = recent
        .into_iter()
        .chain(slice)
        .filter(|p| seen.insert(p.id.clone()))
        .collect();
    plan.cursor = Some(cursor);
    Ok(plan)
}

impl RailPlan {
    /// Asks the rail about the plan's payouts and judges the answers: the check, the movements
    /// seen, and the next run's cursor.
    pub(crate) async fn look_up(
        self,
        sources: &Sources,
        proxydb: &mut PgConnection,
        confirm: bool,
    ) -> Result<RailRun, ReconcileError> {
        let mut c = check("rail_movements_match_the_books", "INV-02");
        let (Some(source), Some(cursor)) = (&sources.rail_proxy, self.cursor) else {
            c.skipped = Some("no rail proxy URL given".into());
            return Ok(RailRun {
                check: c,
                movements: 0,
                cursor: self.cursor_text,
            });
        };
        let ids: Vec<&str> = self.payouts.iter().map(|p| p.id.as_str()).collect();
        let submitted = submissions(proxydb, self.sealed_recheck_ms, &ids).await?;
        let mut run = Lookups {
            check: c,
            movements: 0,
            unknown: 0,
            errors: Vec::new(),
            covered: 0,
        };
        let connected =
            match rail_proxy_client::RailProxyClient::connect(&source.url, &source.tls).await {
                Ok(mut proxy) => {
                    for p in &self.payouts {
                        let s = submitted.get(&p.id).copied();
                        if to_look_up(p, s) {
                            run.look_up(&mut proxy, sources, p, s, confirm).await?;
                        } else {
                            run.covered += 1;
                        }
                    }
                    true
                }
                Err(e) => {
                    run.errors
                        .push(format!("connecting to the rail proxy {}: {e}", source.url));
                    false
                }
            };
        let Lookups {
            check: mut c,
            movements,
            unknown,
            errors,
            covered,
        } = run;
        if unknown > 0 {
            tracing::info!(
                unknown,
                "rail lookups inside the settlement window: not judged this run"
            );
        }
        let (lookups_max, runs_per_round) = (self.lookups_max, self.runs_per_round);
        let missed = cursor.missed + errors.len() as u64;
        let mut why = Vec::new();
        if !self.round_ends {
            why.push(format!(
                "mid-round: the cursor's slice stopped at {} (the round needs {runs_per_round} \
                 run(s) of {lookups_max})",
                self.next_after
            ));
        } else if missed > 0 {
            why.push(format!("{missed} lookup(s) of this round failed"));
        }
        if self.recent_cut {
            why.push(format!(
                "more recently changed payouts than {lookups_max}: the rest wait for the cursor"
            ));
        }
        if !errors.is_empty() {
            let named: Vec<&str> = errors
                .iter()
                .take(LOOKUP_ERRORS_NAMED_MAX)
                .map(String::as_str)
                .collect();
            why.push(format!(
                "{} lookup(s) failed: {}",
                errors.len(),
                named.join("; ")
            ));
        }
        c.examined = covered;
        if !why.is_empty() {
            c.partial = Some(Partial {
                covered,
                total: self.total,
                runs_per_round,
                why: why.join("; "),
            });
        }
        let next = match (connected, self.round_ends) {
            // The proxy unreachable: the same slice again next run.
            (false, _) => cursor,
            (true, true) => Cursor::default(),
            (true, false) => Cursor {
                after: self.next_after,
                missed,
            },
        };
        Ok(RailRun {
            check: c,
            movements,
            cursor: Some(next.text()),
        })
    }
}

/// One run's lookups as they go.
struct Lookups {
    check: Check,
    movements: u64,
    unknown: u64,
    /// One line per failed lookup.
    errors: Vec<String>,
    /// Payouts whose lookup answered (or that need none).
    covered: u64,
}

impl Lookups {
    async fn look_up(
        &mut self,
        proxy: &mut rail_proxy_client::RailProxyClient,
        sources: &Sources,
        p: &Payout,
        submitted: Option<Submitted>,
        confirm: bool,
    ) -> Result<(), ReconcileError> {
        let c = &mut self.check;
        let Ok(payout_id) = payout_domain::PayoutId::parse(p.id.clone()) else {
            self.errors
                .push(format!("{}: not a payout id the proxy accepts", p.id));
            return Ok(());
        };
        let found = match proxy.rail_movements(&payout_id).await {
            Ok(rail_proxy_client::RailLookup::Found(found)) => found,
            Ok(rail_proxy_client::RailLookup::Absent) => {
                self.covered += 1;
                if p.state == "POSTED" {
                    c.violations.push(format!(
                        "{} is POSTED but the rail reports no movement for {}",
                        p.id, p.client_reference
                    ));
                }
                return Ok(());
            }
            Ok(rail_proxy_client::RailLookup::Unknown { .. }) => {
                self.covered += 1;
                self.unknown += 1;
                return Ok(());
            }
            Err(e) => {
                tracing::warn!(payout = %p.id, error = %e, "rail lookup failed");
                self.errors.push(format!("{}: {e}", p.id));
                return Ok(());
            }
        };
        self.covered += 1;
        self.movements += found.len() as u64;
        if found.len() > 1 {
            c.violations.push(format!(
                "DUPLICATE PAYMENT: {} rail movements for {} ({:?})",
                found.len(),
                p.client_reference,
                found.iter().map(|m| &m.rail_ref).collect::<Vec<_>>()
            ));
        }
        if let Some(Submitted::Sealed { .. }) = submitted {
            c.violations.push(format!(
                "money moved for {} ({}) but the proxy sealed it NOT_SENT and the payout is {} \
                 (books say it never left)",
                p.id, p.client_reference, p.state
            ));
        } else {
            let has_submission = submitted == Some(Submitted::Sent)
                || (confirm && submitted_now(sources, &p.id).await?);
            if !has_submission {
                c.violations.push(format!(
                    "rail movement for {} without a proxy submission record",
                    p.client_reference
                ));
            }
            if !matches!(
                p.state.as_str(),
                "POSTED" | "RAIL_ACKED" | "RAIL_AMBIGUOUS" | "RAIL_SUBMITTED"
            ) {
                c.violations.push(format!(
                    "money moved for {} but the payout is {} (books say it did not)",
                    p.id, p.state
                ));
            }
        }
        for m in &found {
            if (
                m.amount_minor,
                m.currency.as_str(),
                m.beneficiary_ref.as_str(),
            ) != (
                p.amount_minor,
                p.currency.as_str(),
                p.beneficiary_ref.as_str(),
            ) {
                c.violations.push(format!(
                    "WRONG AMOUNT: the rail paid {} {} to {} for {} ({}) but the payout record is {} {} to {}",
                    m.amount_minor, m.currency, m.beneficiary_ref, p.id, m.rail_ref,
                    p.amount_minor, p.currency, p.beneficiary_ref
                ));
            }
        }
        Ok(())
    }
}

/// Whether proxydb holds a sent submission of `payout` now (a fresh read, after the rail's answer
/// that raised the question: the proxy records a submission before it asks the rail).
async fn submitted_now(sources: &Sources, payout: &str) -> Result<bool, ReconcileError> {
    sqlx::query_scalar(
        "SELECT EXISTS (SELECT 1 FROM rail_submission \
         WHERE payout_id = $1 AND outcome IS DISTINCT FROM 'NOT_SENT')",
    )
    .bind(payout)
    .fetch_one(&sources.proxydb)
    .await
    .map_err(store("proxydb"))
}

#[cfg(test)]
mod tests {
    use super::RailOptions;

    /// The cursor kept beside an anchor file is the next run's; none kept (or no anchor file)
    /// starts the round at the first payout.
    #[test]
    fn the_cursor_kept_beside_the_anchor_is_the_next_runs() {
        let dir = tempfile::tempdir().unwrap();
        let anchor = dir.path().join("anchor.json");
        assert_eq!(
            RailOptions::kept_beside(Some(&anchor)).unwrap().cursor,
            None
        );
        let cursor = r#"{"after":"po-2","missed":0}"#;
        RailOptions::keep_beside(Some(&anchor), Some(cursor)).unwrap();
        let next = RailOptions::kept_beside(Some(&anchor)).unwrap();
        assert_eq!(next.cursor.as_deref(), Some(cursor));
        assert_eq!(next.lookups_max, super::RAIL_LOOKUPS_PER_RUN_MAX);
        assert_eq!(RailOptions::kept_beside(None).unwrap().cursor, None);
        RailOptions::keep_beside(None, Some(cursor)).unwrap();
    }
}
