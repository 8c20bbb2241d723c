//! The checker. Independent of the code under test: it reads only external evidence (the rail
//! stub's book over HTTP, and the rows of paydb, proxydb and gldb through plain SQL) and applies
//! the invariants as stated in the spec, not as any service implements them.

use std::collections::{BTreeMap, BTreeSet};

use serde::Serialize;
use testkit::system::System;

const TERMINAL: [&str; 3] = ["POSTED", "FAILED", "ABANDONED"];

#[derive(Debug, Clone, Serialize)]
pub struct Violation {
    pub check: &'static str,
    pub detail: String,
}

#[derive(Debug, Clone, Serialize)]
pub struct CheckResult {
    pub name: &'static str,
    /// How many things the check looked at (so a vacuous pass shows as 0).
    pub checked: usize,
    pub violations: Vec<Violation>,
}

#[derive(Debug, Clone)]
pub struct Movement {
    pub client_reference: String,
    pub amount_minor: i64,
}

#[derive(Debug, Clone)]
pub struct PayoutRow {
    pub id: String,
    pub account_id: String,
    pub state: String,
    pub amount_minor: i64,
    pub client_reference: String,
}

#[derive(Debug, Clone)]
pub struct Transition {
    pub payout_id: Option<String>,
    pub account_id: Option<String>,
    pub token: Option<i64>,
    pub to_state: Option<String>,
    pub actor: String,
}

/// Everything the checker reads, collected once.
#[derive(Debug, Clone, Default)]
pub struct Evidence {
    pub movements: Vec<Movement>,
    pub payouts: Vec<PayoutRow>,
    /// paydb audit_event kind='transition', in id order.
    pub transitions: Vec<Transition>,
    /// (group, sum of amounts, lines)
    pub ledger_groups: Vec<(String, i64, i64)>,
    /// (account, cached balance, sum of its entries)
    pub balances: Vec<(String, i64, i64)>,
    /// paydb ledger_outbox idempotency keys (every posting is written with one).
    pub outbox_keys: Vec<String>,
    /// gldb journals' idempotency keys.
    pub journal_keys: Vec<String>,
    /// (journal idempotency key, sum of its entries' signed amounts)
    pub journal_sums: Vec<(String, String)>,
    /// proxydb rail_submission in id order: (payout, account, token).
    pub submissions: Vec<(String, String, i64)>,
    pub fenced_out_paydb: i64,
    /// proxydb guard_event counts by kind.
    pub guard_events: BTreeMap<String, i64>,
}

async fn pool(url: &str) -> anyhow::Result<sqlx::PgPool> {
    Ok(sqlx::postgres::PgPoolOptions::new()
        .max_connections(2)
        .connect(url)
        .await?)
}

impl Evidence {
    pub async fn collect(system: &System) -> anyhow::Result<Self> {
        let truth = rail_stub::client::StubClient::new(system.rail_url())
            .ground_truth()
            .await
            .map_err(|e| anyhow::anyhow!("the rail's book: {e}"))?;
        let movements = truth
            .movements
            .iter()
            .map(|m| Movement {
                client_reference: m.client_reference.clone(),
                amount_minor: m.amount_minor,
            })
            .collect();
        let paydb = pool(&system.databases.paydb).await?;
        let proxydb = pool(&system.databases.proxydb).await?;
        let gldb = pool(&system.databases.gldb).await?;
        let payouts = sqlx::query_as::<_, (String, String, String, i64, String)>(
            "SELECT id, account_id, state, amount_minor, client_reference FROM payout ORDER BY id",
        )
        .fetch_all(&paydb)
        .await?
        .into_iter()
        .map(
            |(id, account_id, state, amount_minor, client_reference)| PayoutRow {
                id,
                account_id,
                state,
                amount_minor,
                client_reference,
            },
        )
        .collect();
        let transitions = sqlx::query_as::<_, (Option<String>, Option<String>, Option<i64>, Option<String>, String)>(
            "SELECT payout_id, account_id, token, to_state, actor FROM audit_event WHERE kind = 'transition' ORDER BY id",
        )
        .fetch_all(&paydb)
        .await?
        .into_iter()
        .map(|(payout_id, account_id, token, to_state, actor)| Transition { payout_id, account_id, token, to_state, actor })
        .collect();
        let ledger_groups = sqlx::query_as(
            "SELECT transaction_group::text, sum(amount_minor)::bigint, count(*) FROM ledger_entry GROUP BY 1",
        )
        .fetch_all(&paydb)
        .await?;
        let balances = sqlx::query_as(
            "SELECT a.id, a.balance_minor, COALESCE(sum(e.amount_minor), 0)::bigint \
             FROM account a LEFT JOIN ledger_entry e ON e.account_id = a.id GROUP BY a.id, a.balance_minor",
        )
        .fetch_all(&paydb)
        .await?;
        let outbox_keys = sqlx::query_scalar("SELECT idempotency_key FROM ledger_outbox")
            .fetch_all(&paydb)
            .await?;
        let journal_keys = sqlx::query_scalar("SELECT idempotency_key FROM journals")
            .fetch_all(&gldb)
            .await?;
        let journal_sums = sqlx::query_as(
            "SELECT j.idempotency_key, COALESCE(sum(e.amount), 0)::text FROM journals j \
             LEFT JOIN entries e ON e.journal_id = j.id GROUP BY j.idempotency_key",
        )
        .fetch_all(&gldb)
        .await
        .unwrap_or_default();
        let submissions = sqlx::query_as(
            "SELECT payout_id, account_id, fence_token FROM rail_submission ORDER BY id",
        )
        .fetch_all(&proxydb)
        .await?;
        let fenced_out_paydb =
            sqlx::query_scalar("SELECT count(*) FROM audit_event WHERE kind = 'fenced_out'")
                .fetch_one(&paydb)
                .await?;
        let guard_events = sqlx::query_as::<_, (String, i64)>(
            "SELECT kind, count(*) FROM guard_event GROUP BY kind",
        )
        .fetch_all(&proxydb)
        .await?
        .into_iter()
        .collect();
        Ok(Self {
            movements,
            payouts,
            transitions,
            ledger_groups,
            balances,
            outbox_keys,
            journal_keys,
            journal_sums,
            submissions,
            fenced_out_paydb,
            guard_events,
        })
    }

    pub fn final_states(&self) -> BTreeMap<String, u64> {
        let mut out = BTreeMap::new();
        for p in &self.payouts {
            *out.entry(p.state.clone()).or_default() += 1;
        }
        out
    }

    pub fn safety_events(&self) -> BTreeMap<String, i64> {
        let mut out = BTreeMap::new();
        out.insert("paydb_fenced_out".to_string(), self.fenced_out_paydb);
        for kind in ["FENCED", "DUPLICATE"] {
            out.insert(
                format!("proxy_{}", kind.to_lowercase()),
                self.guard_events.get(kind).copied().unwrap_or(0),
            );
        }
        out
    }

    fn movements_by_reference(&self) -> BTreeMap<&str, Vec<&Movement>> {
        let mut by: BTreeMap<&str, Vec<&Movement>> = BTreeMap::new();
        for m in &self.movements {
            by.entry(m.client_reference.as_str()).or_default().push(m);
        }
        by
    }
}

fn result(name: &'static str, checked: usize, details: Vec<String>) -> CheckResult {
    CheckResult {
        name,
        checked,
        violations: details
            .into_iter()
            .map(|detail| Violation {
                check: name,
                detail,
            })
            .collect(),
    }
}

/// Every check, in a fixed order.
pub fn check(e: &Evidence) -> Vec<CheckResult> {
    vec![
        at_most_one_movement_per_payout(e),
        movements_belong_to_live_payouts(e),
        posted_has_exactly_one_movement(e),
        ledger_groups_balanced(e),
        balances_equal_entries(e),
        gl_matches_paydb(e),
        paydb_tokens_never_decrease(e),
        proxy_tokens_never_decrease(e),
        every_payout_settled(e),
        terminal_states_never_change(e),
    ]
}

/// INV-02: at most one rail movement per payout (client reference).
pub fn at_most_one_movement_per_payout(e: &Evidence) -> CheckResult {
    let by = e.movements_by_reference();
    let details = by
        .iter()
        .filter(|(_, ms)| ms.len() > 1)
        .map(|(r, ms)| format!("DUPLICATE PAYMENT: {r} moved money {} times", ms.len()))
        .collect();
    result("at_most_one_movement_per_payout", by.len(), details)
}

/// Every movement belongs to a payout that is POSTED, RAIL_ACKED or RAIL_AMBIGUOUS, for its amount.
pub fn movements_belong_to_live_payouts(e: &Evidence) -> CheckResult {
    let payouts: BTreeMap<&str, &PayoutRow> = e
        .payouts
        .iter()
        .map(|p| (p.client_reference.as_str(), p))
        .collect();
    let mut details = Vec::new();
    for m in &e.movements {
        match payouts.get(m.client_reference.as_str()) {
            None => details.push(format!("movement {} matches no payout", m.client_reference)),
            Some(p) if !["POSTED", "RAIL_ACKED", "RAIL_AMBIGUOUS"].contains(&p.state.as_str()) => {
                details.push(format!(
                    "movement {} but payout {} is {}",
                    m.client_reference, p.id, p.state
                ))
            }
            Some(p) if p.amount_minor != m.amount_minor => details.push(format!(
                "movement {} of {} but payout {} is for {}",
                m.client_reference, m.amount_minor, p.id, p.amount_minor
            )),
            Some(_) => {}
        }
    }
    result(
        "movements_belong_to_live_payouts",
        e.movements.len(),
        details,
    )
}

/// Every POSTED payout has exactly one movement.
pub fn posted_has_exactly_one_movement(e: &Evidence) -> CheckResult {
    let by = e.movements_by_reference();
    let posted: Vec<&PayoutRow> = e.payouts.iter().filter(|p| p.state == "POSTED").collect();
    let details = posted
        .iter()
        .filter_map(|p| {
            let n = by.get(p.client_reference.as_str()).map_or(0, Vec::len);
            (n != 1).then(|| format!("payout {} is POSTED with {n} rail movements", p.id))
        })
        .collect();
    result("posted_has_exactly_one_movement", posted.len(), details)
}

/// INV-03: every ledger group sums to zero.
pub fn ledger_groups_balanced(e: &Evidence) -> CheckResult {
    let details = e
        .ledger_groups
        .iter()
        .filter(|(_, sum, lines)| *sum != 0 || *lines < 2)
        .map(|(g, sum, lines)| format!("ledger group {g}: {lines} lines summing to {sum}"))
        .collect();
    result("ledger_groups_balanced", e.ledger_groups.len(), details)
}

/// INV-03: every account's cached balance equals the sum of its entries.
pub fn balances_equal_entries(e: &Evidence) -> CheckResult {
    let details = e
        .balances
        .iter()
        .filter(|(_, cached, summed)| cached != summed)
        .map(|(a, cached, summed)| {
            format!("account {a}: balance {cached} but entries sum to {summed}")
        })
        .collect();
    result("balances_equal_entries", e.balances.len(), details)
}

/// GL journals equal paydb's postings one to one (by idempotency key), each journal balanced.
pub fn gl_matches_paydb(e: &Evidence) -> CheckResult {
    let outbox: BTreeSet<&str> = e.outbox_keys.iter().map(String::as_str).collect();
    let gl: BTreeSet<&str> = e.journal_keys.iter().map(String::as_str).collect();
    let mut details = Vec::new();
    for k in outbox.difference(&gl) {
        details.push(format!("posting {k} has no GL journal"));
    }
    for k in gl.difference(&outbox) {
        details.push(format!("GL journal {k} has no paydb posting"));
    }
    if e.journal_keys.len() != gl.len() {
        details.push(format!(
            "{} journals for {} keys",
            e.journal_keys.len(),
            gl.len()
        ));
    }
    if outbox.len() != e.ledger_groups.len() {
        details.push(format!(
            "{} postings in the outbox for {} ledger groups",
            outbox.len(),
            e.ledger_groups.len()
        ));
    }
    for (k, sum) in &e.journal_sums {
        if sum.parse::<f64>().ok() != Some(0.0) {
            details.push(format!("GL journal {k} sums to {sum}"));
        }
    }
    result("gl_matches_paydb", outbox.len().max(gl.len()), details)
}

fn never_decrease<'a>(
    rows: impl Iterator<Item = (&'a str, &'a str, i64)>,
    guard: &str,
) -> (usize, Vec<String>) {
    let mut high: BTreeMap<&str, (i64, &str)> = BTreeMap::new();
    let mut checked = 0;
    let mut details = Vec::new();
    for (account, payout, token) in rows {
        checked += 1;
        match high.get(account) {
            Some((h, by)) if token < *h => details.push(format!(
                "STALE WRITE at {guard}: account {account} accepted token {token} for {payout} after {h} (for {by})"
            )),
            _ => {
                high.insert(account, (token, payout));
            }
        }
    }
    (checked, details)
}

/// INV-04/05 at the payment resource: the tokens of accepted holder writes never decrease per account.
pub fn paydb_tokens_never_decrease(e: &Evidence) -> CheckResult {
    let rows = e.transitions.iter().filter_map(|t| {
        Some((
            t.account_id.as_deref()?,
            t.payout_id.as_deref().unwrap_or("-"),
            t.token?,
        ))
    });
    let (checked, details) = never_decrease(rows, "payment resource");
    result("paydb_tokens_never_decrease", checked, details)
}

/// INV-04/05 at the rail proxy: submission tokens never decrease per account.
pub fn proxy_tokens_never_decrease(e: &Evidence) -> CheckResult {
    let rows = e
        .submissions
        .iter()
        .map(|(p, a, t)| (a.as_str(), p.as_str(), *t));
    let (checked, details) = never_decrease(rows, "rail proxy");
    result("proxy_tokens_never_decrease", checked, details)
}

/// No payout stuck silently: terminal, or RAIL_AMBIGUOUS with the proxy's record as evidence.
pub fn every_payout_settled(e: &Evidence) -> CheckResult {
    let submitted: BTreeSet<&str> = e.submissions.iter().map(|(p, _, _)| p.as_str()).collect();
    let details = e
        .payouts
        .iter()
        .filter(|p| {
            let terminal = TERMINAL.contains(&p.state.as_str());
            let ambiguous_with_evidence =
                p.state == "RAIL_AMBIGUOUS" && submitted.contains(p.id.as_str());
            !(terminal || ambiguous_with_evidence)
        })
        .map(|p| format!("payout {} stuck in {}", p.id, p.state))
        .collect();
    result("every_payout_settled", e.payouts.len(), details)
}

/// INV-08: once a payout's history reaches a terminal state, no transition follows.
pub fn terminal_states_never_change(e: &Evidence) -> CheckResult {
    let mut terminal: BTreeMap<&str, &str> = BTreeMap::new();
    let mut details = Vec::new();
    for t in &e.transitions {
        let (Some(p), Some(to)) = (t.payout_id.as_deref(), t.to_state.as_deref()) else {
            continue;
        };
        if let Some(was) = terminal.get(p) {
            details.push(format!("payout {p} went {was} -> {to} (by {})", t.actor));
        } else if TERMINAL.contains(&to) {
            terminal.insert(p, to);
        }
    }
    result("terminal_states_never_change", e.transitions.len(), details)
}
