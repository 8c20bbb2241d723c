//! The checker. Independent of the code under test: it reads only external evidence (the rail
//! stub's book over HTTP, and the rows of paydb, proxydb and gldb through plain SQL) and applies
//! the invariants as stated in the spec, not as any service implements them.

use std::collections::{BTreeMap, BTreeSet};

use serde::Serialize;
use testkit::system::System;

const TERMINAL: [&str; 3] = ["POSTED", "FAILED", "ABANDONED"];

/// Each worker's lock history is `{system dir}/{LOCK_HISTORY_PREFIX}{identity}.jsonl`.
pub const LOCK_HISTORY_PREFIX: &str = "lock-history-";

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

/// [`Evidence::reached`]'s cases, by the name the report prints.
pub const REACHED_FENCED_OUT_PAYMENT_RESOURCE: &str = "fenced_out@payment_resource";
pub const REACHED_FENCED_OUT_RAIL_PROXY: &str = "fenced_out@rail_proxy";
pub const REACHED_RESOLVED_FOUND: &str = "ambiguous_resolved_found";
pub const REACHED_RESOLVED_ABSENT: &str = "ambiguous_resolved_absent";
/// The harness's own: a rewound token refused by the lock-server's INV-04 alarm.
pub const REACHED_TOKEN_REGRESSION: &str = "token_regression_refused";
/// Payouts the reconciler handed back to a new workflow after Temporal lost its state (read from
/// the reconciler's counters, `super::temporal`).
pub const REACHED_RECOVERED_AFTER_AMNESIA: &str = "recovered_after_temporal_amnesia";

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
    /// paydb ledger_outbox idempotency keys of the JOURNAL rows (every posting is written with
    /// one; the TRANSACTION_EVENT rows are [`Evidence::outbox_events`]).
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
    /// paydb ledger_outbox JOURNAL rows: (idempotency key, the journal id the delivery recorded).
    pub outbox_journals: Vec<(String, Option<String>)>,
    /// gldb journals: (idempotency key, journal id).
    pub gl_journal_ids: Vec<(String, String)>,
    /// paydb ledger_outbox TRANSACTION_EVENT rows (a payout's lifecycle): (payout, event version,
    /// the GL event id the delivery recorded).
    pub outbox_events: Vec<(String, i64, Option<String>)>,
    /// gldb transaction_events of the payment resource: (payout, event version, event id).
    pub gl_events: Vec<(String, i64, String)>,
    /// Every line of every worker's lock history (JSON objects, parsed here, not by the client).
    pub lock_history: Vec<serde_json::Value>,
    /// Lock history lines that did not parse (a torn last line of a killed writer is skipped).
    pub lock_history_malformed: Vec<String>,
    /// The force-revokes: the operator's (the harness's log) and those recorded in a lock
    /// history (the reconciler's takeovers of grants whose workflow is gone).
    pub revokes: Vec<Revoke>,
    /// The lock backend's rollbacks by the nemesis (etcd restored from a snapshot).
    pub restores: Vec<Restore>,
    /// The workers' lock lease (their sessions' TTL): a deposed holder must stop believing within
    /// this of the revoke. Zero: not checked.
    pub lock_ttl_ns: u64,
}

/// One operator force-revoke as the harness saw it: the lock service's answer names the grant it
/// took (key and token), so the revoke is paired with that grant by what happened, never by
/// comparing the harness's clock with the holder's.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Revoke {
    pub key: String,
    pub revoked_token: u64,
    /// CLOCK_MONOTONIC ns when the request was sent (the server acted after this).
    pub sent_ns: u64,
    /// CLOCK_MONOTONIC ns when the answer arrived (the server had acted before this).
    pub answered_ns: u64,
}

async fn pool(url: &str) -> anyhow::Result<sqlx::PgPool> {
    Ok(sqlx::postgres::PgPoolOptions::new()
        .max_connections(2)
        .connect(url)
        .await?)
}

impl Evidence {
    pub async fn collect(system: &System) -> anyhow::Result<Self> {
        let truth = rail_stub::client::StubClient::new(system.rail_stub_endpoints())
            .expect("the harness's rail client")
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
        let outbox_keys =
            sqlx::query_scalar("SELECT idempotency_key FROM ledger_outbox WHERE kind = 'JOURNAL'")
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
        let outbox_journals = sqlx::query_as(
            "SELECT idempotency_key, journal_id FROM ledger_outbox WHERE kind = 'JOURNAL'",
        )
        .fetch_all(&paydb)
        .await?;
        let gl_journal_ids = sqlx::query_as("SELECT idempotency_key, id::text FROM journals")
            .fetch_all(&gldb)
            .await?;
        let outbox_events = sqlx::query_as(
            "SELECT payload->>'source_transaction_id', (payload->>'event_version')::bigint, journal_id \
             FROM ledger_outbox WHERE kind = 'TRANSACTION_EVENT'",
        )
        .fetch_all(&paydb)
        .await?;
        let gl_events = sqlx::query_as(
            "SELECT source_transaction_id, event_version::bigint, id::text FROM transaction_events \
             WHERE source_service = 'payment-resource'",
        )
        .fetch_all(&gldb)
        .await?;
        let (lock_history, lock_history_malformed) = read_lock_histories(&system.dir)?;
        let revokes = recorded_revokes(&lock_history);
        Ok(Self {
            outbox_journals,
            gl_journal_ids,
            outbox_events,
            gl_events,
            lock_history,
            revokes,
            restores: Vec::new(),
            lock_history_malformed,
            lock_ttl_ns: 0,
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

    /// The hard cases this run's evidence shows it reached, each with its count ("sometimes"
    /// coverage, issue 36): a run whose faults met none of a case passes every check of it
    /// vacuously. Read from the stores, as every check is: a stale call refused by each guard's
    /// fence, and an ambiguous payout the evidence resolved each way (RAIL_AMBIGUOUS followed by
    /// RAIL_ACKED: found at the rail; by FAILED: absent). The harness adds what only it sees
    /// (the INV-04 alarm's refusals, `Report::reached`).
    pub fn reached(&self) -> BTreeMap<String, u64> {
        let mut out = BTreeMap::new();
        out.insert(
            REACHED_FENCED_OUT_PAYMENT_RESOURCE.to_string(),
            self.fenced_out_paydb.max(0) as u64,
        );
        out.insert(
            REACHED_FENCED_OUT_RAIL_PROXY.to_string(),
            self.guard_events.get("FENCED").copied().unwrap_or(0).max(0) as u64,
        );
        let (mut found, mut absent) = (0, 0);
        let mut last: BTreeMap<&str, &str> = BTreeMap::new();
        for t in &self.transitions {
            let (Some(payout), Some(to)) = (t.payout_id.as_deref(), t.to_state.as_deref()) else {
                continue;
            };
            if last.get(payout) == Some(&"RAIL_AMBIGUOUS") {
                match to {
                    "RAIL_ACKED" => found += 1,
                    "FAILED" => absent += 1,
                    _ => {}
                }
            }
            last.insert(payout, to);
        }
        out.insert(REACHED_RESOLVED_FOUND.to_string(), found);
        out.insert(REACHED_RESOLVED_ABSENT.to_string(), absent);
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

/// Reads every `lock-history-*.jsonl` in `dir`. A torn last line (its writer was killed in the
/// middle of a write) is skipped; any other unparsable line is reported.
pub(crate) fn read_lock_histories(
    dir: &std::path::Path,
) -> anyhow::Result<(Vec<serde_json::Value>, Vec<String>)> {
    let mut events = Vec::new();
    let mut malformed = Vec::new();
    for entry in std::fs::read_dir(dir)? {
        let path = entry?.path();
        let name = path
            .file_name()
            .and_then(|n| n.to_str())
            .unwrap_or_default();
        if !(name.starts_with(LOCK_HISTORY_PREFIX) && name.ends_with(".jsonl")) {
            continue;
        }
        let text = std::fs::read_to_string(&path)?;
        let lines: Vec<&str> = text.lines().collect();
        for (i, line) in lines.iter().enumerate() {
            match serde_json::from_str::<serde_json::Value>(line) {
                Ok(v) => events.push(v),
                Err(_) if i + 1 == lines.len() && !text.ends_with('\n') => {}
                Err(e) => malformed.push(format!("{name}:{}: {e}", i + 1)),
            }
        }
    }
    Ok((events, malformed))
}

/// The force-revokes a lock history recorded (`revoke` lines: the reconciler's takeovers).
fn recorded_revokes(history: &[serde_json::Value]) -> Vec<Revoke> {
    history
        .iter()
        .filter(|v| v["kind"] == "revoke")
        .filter_map(|v| {
            Some(Revoke {
                key: v["key"].as_str()?.to_string(),
                revoked_token: v["token"].as_u64()?,
                sent_ns: v["sent_ns"].as_u64()?,
                answered_ns: v["answered_ns"].as_u64()?,
            })
        })
        .collect()
}

pub fn result(name: &'static str, checked: usize, details: Vec<String>) -> CheckResult {
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
        gl_lifecycle_matches_paydb(e),
        paydb_tokens_never_decrease(e),
        proxy_tokens_never_decrease(e),
        every_payout_settled(e),
        terminal_states_never_change(e),
        grants_never_overlap(e),
        lock_history_is_linearizable(e),
        deposed_holders_stop_within_one_lease(e),
    ]
}

/// One grant as its holder believed it: from the answer's arrival to the first of its release
/// being sent, its session found lost, its session's last local deadline, its own last vouched
/// deadline, and the lock service's answer that it no longer holds the key. Each end is one the
/// holder could not have relied on it past, so an overlap of two of these is two holders at once
/// for real, never an artefact of delays.
#[derive(Debug, Clone)]
struct Belief {
    key: String,
    owner: String,
    token: u64,
    start_ns: u64,
    end_ns: u64,
    /// An operator's force-revoke took this very grant (paired by key and token): from when it
    /// was sent, a successor is break-glass, not a violation; the holder must still stop
    /// believing within one lease ([`deposed_holders_stop_within_one_lease`]).
    revoke: Option<Revoke>,
}

impl Belief {
    /// The end that counts against a successor: an operator's revoke hands the key on at once
    /// (spec 2.4: "Advancing is what fences the deposed holder").
    fn exclusive_end_ns(&self) -> u64 {
        match &self.revoke {
            Some(r) => self.end_ns.min(r.sent_ns.max(self.start_ns)),
            None => self.end_ns,
        }
    }
}

type GrantId = (String, String, u64);

fn beliefs(e: &Evidence) -> (Vec<Belief>, Vec<String>) {
    let mut problems = e.lock_history_malformed.clone();
    let mut session_end: BTreeMap<String, (Option<u64>, Option<u64>)> = BTreeMap::new();
    let mut releases: BTreeMap<GrantId, Vec<u64>> = BTreeMap::new();
    let mut grant_deadlines: BTreeMap<GrantId, u64> = BTreeMap::new();
    let mut grant_lost: BTreeMap<GrantId, u64> = BTreeMap::new();
    let mut grants = Vec::new();
    let text = |v: &serde_json::Value, f: &str| v[f].as_str().map(str::to_string);
    let num = |v: &serde_json::Value, f: &str| v[f].as_u64();
    let grant_id = |v: &serde_json::Value| -> Option<GrantId> {
        Some((text(v, "key")?, text(v, "owner")?, num(v, "token")?))
    };
    for v in &e.lock_history {
        match v["kind"].as_str() {
            Some("deadline") => {
                if let (Some(s), Some(d)) = (text(v, "session"), num(v, "deadline_ns")) {
                    let entry = session_end.entry(s).or_default();
                    entry.0 = Some(entry.0.map_or(d, |x| x.max(d)));
                    continue;
                }
            }
            Some("lost") => {
                if let (Some(s), Some(at)) = (text(v, "session"), num(v, "at_ns")) {
                    let entry = session_end.entry(s).or_default();
                    entry.1 = Some(entry.1.map_or(at, |x| x.min(at)));
                    continue;
                }
            }
            Some("release") => {
                if let (Some(id), Some(at)) = (grant_id(v), num(v, "at_ns")) {
                    releases.entry(id).or_default().push(at);
                    continue;
                }
            }
            // The release's answer: a belief ends when its release is sent, so only
            // `lock_history_is_linearizable` reads it.
            Some("released") if grant_id(v).is_some() && num(v, "at_ns").is_some() => continue,
            // A force-revoke this history's client made: read into `Evidence::revokes`.
            Some("revoke") if num(v, "sent_ns").is_some() && num(v, "answered_ns").is_some() => {
                continue
            }
            Some("grant_deadline") => {
                if let (Some(id), Some(d)) = (grant_id(v), num(v, "deadline_ns")) {
                    let entry = grant_deadlines.entry(id).or_insert(d);
                    *entry = (*entry).max(d);
                    continue;
                }
            }
            Some("grant_lost") => {
                if let (Some(id), Some(at)) = (grant_id(v), num(v, "at_ns")) {
                    let entry = grant_lost.entry(id).or_insert(at);
                    *entry = (*entry).min(at);
                    continue;
                }
            }
            Some("grant") => {
                if let (Some(id), Some(s), Some(at)) =
                    (grant_id(v), text(v, "session"), num(v, "at_ns"))
                {
                    grants.push((id, s, at));
                    continue;
                }
            }
            _ => {}
        }
        problems.push(format!("unreadable lock history line: {v}"));
    }
    let out = grants
        .into_iter()
        .filter_map(|(id, session, start_ns)| {
            let (key, owner, token) = id.clone();
            let Some((deadline, lost)) = session_end.get(&session).copied() else {
                problems.push(format!(
                    "grant {key} token {token}: session {session} has no recorded deadline"
                ));
                return None;
            };
            let mut end_ns = deadline.unwrap_or(u64::MAX).min(lost.unwrap_or(u64::MAX));
            if let Some(at) = releases
                .get(&id)
                .and_then(|r| r.iter().copied().filter(|at| *at >= start_ns).min())
            {
                end_ns = end_ns.min(at);
            }
            if let Some(d) = grant_deadlines.get(&id) {
                end_ns = end_ns.min(*d);
            }
            if let Some(at) = grant_lost.get(&id) {
                end_ns = end_ns.min(*at);
            }
            let revoke = e
                .revokes
                .iter()
                .find(|r| r.key == key && r.revoked_token == token)
                .cloned();
            Some(Belief {
                key,
                owner,
                token,
                start_ns,
                end_ns: end_ns.max(start_ns),
                revoke,
            })
        })
        .collect();
    (out, problems)
}

/// INV-06 from the workers' recorded lock history: no two grants of one key were believed held
/// at the same time, and one token never belonged to two owners.
pub fn grants_never_overlap(e: &Evidence) -> CheckResult {
    let (beliefs, mut details) = beliefs(e);
    let mut by_key: BTreeMap<&str, Vec<&Belief>> = BTreeMap::new();
    for b in &beliefs {
        by_key.entry(b.key.as_str()).or_default().push(b);
    }
    for (key, mut grants) in by_key {
        grants.sort_by_key(|b| (b.start_ns, b.token));
        let mut owners: BTreeMap<u64, &str> = BTreeMap::new();
        // The grant believed longest among those started so far, per token.
        let mut open: Option<&Belief> = None;
        for g in grants {
            if let Some(o) = owners.insert(g.token, g.owner.as_str()) {
                if o != g.owner {
                    details.push(format!(
                        "TOKEN REPEATED: {key} token {} granted to {o} and to {}",
                        g.token, g.owner
                    ));
                }
            }
            if let Some(o) = open {
                if o.token != g.token && g.start_ns < o.exclusive_end_ns() {
                    details.push(format!(
                        "TWO HOLDERS: {key} token {} ({}) still believed held {} ms after token {} ({}) was granted \
                         (held from {} to {} ns; successor from {} ns; revoke of this grant: {:?})",
                        o.token,
                        o.owner,
                        (o.exclusive_end_ns() - g.start_ns) / 1_000_000,
                        g.token,
                        g.owner,
                        o.start_ns,
                        o.end_ns,
                        g.start_ns,
                        o.revoke,
                    ));
                }
            }
            if open.is_none_or(|o| g.exclusive_end_ns() > o.exclusive_end_ns()) {
                open = Some(g);
            }
        }
    }
    result("grants_never_overlap", beliefs.len(), details)
}

/// A lock backend restored from a snapshot (the nemesis's etcd restores): the lock state went
/// back to what it was at `snapshot_ns`, from `restore_ns` on (monotonic ns).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Restore {
    pub snapshot_ns: u64,
    pub restore_ns: u64,
}

/// A revoke of a grant whose release the lock service had confirmed after a snapshot, sent after
/// that snapshot was restored: the restore brought the released grant back (the fault's own
/// rollback of the lock's state, which the guards and the INV-04 alarm answer for), and the
/// reconciler took the resurrected grant over. It changes nothing a recorded client believes, and
/// is left out of the linearizability check: with no restore in between, the same revoke is
/// still checked (and refused) there.
fn revokes_a_resurrected_grant(e: &Evidence, r: &Revoke) -> bool {
    let released_at = e.lock_history.iter().filter_map(|v| {
        (v["kind"] == "released" && v["key"] == r.key.as_str() && v["token"] == r.revoked_token)
            .then(|| v["at_ns"].as_u64())
            .flatten()
    });
    released_at.into_iter().any(|at| {
        e.restores
            .iter()
            .any(|x| x.snapshot_ns < at && x.restore_ns < r.sent_ns)
    })
}

/// INV-06 as linearizability (issue 36): each key's recorded operations, with the operator's
/// revokes and the lock service's own ends of grants, fit one order that a fenced lock could have
/// produced within their times (`super::linearizable`, whose module doc states the model). Finds
/// what [`grants_never_overlap`] cannot: a token that goes back between grants that do not
/// overlap, a release the service confirmed to a client that did not hold the key.
pub fn lock_history_is_linearizable(e: &Evidence) -> CheckResult {
    let revokes: Vec<Revoke> = e
        .revokes
        .iter()
        .filter(|r| !revokes_a_resurrected_grant(e, r))
        .cloned()
        .collect();
    let report = super::linearizable::check(&e.lock_history, &revokes);
    result("lock_history_is_linearizable", report.ops, report.findings)
}

/// The other half of a force-revoke (spec 2.4: the deposed holder is fenced; INV-06: it must
/// not go on believing): a holder whose grant an operator revoked stops relying on it within one
/// lease of the revoke's answer (its next renewal is refused, or its deadline runs out).
pub fn deposed_holders_stop_within_one_lease(e: &Evidence) -> CheckResult {
    let (beliefs, _) = beliefs(e);
    let mut details = Vec::new();
    let mut checked = 0;
    for b in &beliefs {
        let Some(r) = &b.revoke else { continue };
        checked += 1;
        let bound = r.answered_ns.max(b.start_ns) + e.lock_ttl_ns;
        if e.lock_ttl_ns > 0 && b.end_ns > bound {
            details.push(format!(
                "DEPOSED HOLDER KEPT BELIEVING: {} token {} ({}) believed held {} ms after its revoke was answered (lease {} ms)",
                b.key,
                b.token,
                b.owner,
                (b.end_ns - r.answered_ns.max(b.start_ns)) / 1_000_000,
                e.lock_ttl_ns / 1_000_000
            ));
        }
    }
    result("deposed_holders_stop_within_one_lease", checked, details)
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
    let gl_ids: BTreeMap<&str, &str> = e
        .gl_journal_ids
        .iter()
        .map(|(k, id)| (k.as_str(), id.as_str()))
        .collect();
    for (k, recorded) in &e.outbox_journals {
        match (recorded.as_deref(), gl_ids.get(k.as_str())) {
            (Some(r), Some(id)) if r != *id => details.push(format!(
                "posting {k} recorded journal {r}, the GL holds {id}: a second delivery made a second journal"
            )),
            (None, _) => details.push(format!("posting {k} was never recorded delivered")),
            _ => {}
        }
    }
    for (k, sum) in &e.journal_sums {
        if sum.parse::<f64>().ok() != Some(0.0) {
            details.push(format!("GL journal {k} sums to {sum}"));
        }
    }
    result("gl_matches_paydb", outbox.len().max(gl.len()), details)
}

/// Issue 19: every payout's lifecycle reached the GL through the outbox, and nothing else did.
/// In paydb, a payout's TRANSACTION_EVENT rows are versions 1..=n, n = 1 (its creation) + its
/// accepted transitions (each transition and its event are one transaction); each is in the GL
/// once at its (payout, version), and its delivery recorded the GL's own event id (a redelivery
/// made no second event); the GL holds no payment-resource event without its outbox row.
pub fn gl_lifecycle_matches_paydb(e: &Evidence) -> CheckResult {
    let mut details = Vec::new();
    let mut versions: BTreeMap<&str, BTreeSet<i64>> = BTreeMap::new();
    for (payout, version, _) in &e.outbox_events {
        if !versions
            .entry(payout.as_str())
            .or_default()
            .insert(*version)
        {
            details.push(format!(
                "payout {payout}: event v{version} twice in the outbox"
            ));
        }
    }
    let mut transitions: BTreeMap<&str, i64> = BTreeMap::new();
    for t in &e.transitions {
        if let Some(p) = t.payout_id.as_deref() {
            *transitions.entry(p).or_default() += 1;
        }
    }
    for p in &e.payouts {
        let expected: BTreeSet<i64> =
            (1..=1 + transitions.get(p.id.as_str()).copied().unwrap_or(0)).collect();
        let found = versions.get(p.id.as_str()).cloned().unwrap_or_default();
        if found != expected {
            details.push(format!(
                "payout {}: lifecycle events {found:?} in the outbox, its creation and transitions make {expected:?}",
                p.id
            ));
        }
    }
    let mut gl: BTreeMap<(&str, i64), Vec<&str>> = BTreeMap::new();
    for (payout, version, id) in &e.gl_events {
        gl.entry((payout.as_str(), *version))
            .or_default()
            .push(id.as_str());
    }
    for (payout, version, recorded) in &e.outbox_events {
        match (recorded.as_deref(), gl.get(&(payout.as_str(), *version)).map(Vec::as_slice)) {
            (_, None) => details.push(format!("event {payout} v{version} has no GL event")),
            (_, Some(ids)) if ids.len() > 1 => {
                details.push(format!("event {payout} v{version}: {} GL events", ids.len()))
            }
            (Some(r), Some([id])) if r != *id => details.push(format!(
                "event {payout} v{version} recorded GL event {r}, the GL holds {id}: a second delivery made a second event"
            )),
            (None, _) => details.push(format!("event {payout} v{version} was never recorded delivered")),
            _ => {}
        }
    }
    let outbox: BTreeSet<(&str, i64)> = e
        .outbox_events
        .iter()
        .map(|(p, v, _)| (p.as_str(), *v))
        .collect();
    for (payout, version) in gl.keys().filter(|k| !outbox.contains(*k)) {
        details.push(format!(
            "GL event {payout} v{version} has no paydb outbox row"
        ));
    }
    result(
        "gl_lifecycle_matches_paydb",
        e.outbox_events.len().max(e.gl_events.len()),
        details,
    )
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

#[cfg(test)]
mod tests {
    //! The new checks on hand-made evidence: each must fire on the history it exists to catch
    //! (its negative control) and stay quiet on the correct one.
    use super::*;
    use serde_json::json;

    const MS: u64 = 1_000_000;

    fn grant(key: &str, owner: &str, token: u64, session: &str, at_ms: u64) -> serde_json::Value {
        json!({"kind": "grant", "key": key, "owner": owner, "token": token, "session": session, "at_ns": at_ms * MS})
    }
    fn deadline(session: &str, at_ms: u64) -> serde_json::Value {
        json!({"kind": "deadline", "session": session, "deadline_ns": at_ms * MS})
    }
    fn release(key: &str, owner: &str, token: u64, at_ms: u64) -> serde_json::Value {
        json!({"kind": "release", "key": key, "owner": owner, "token": token, "at_ns": at_ms * MS})
    }
    fn lost(session: &str, at_ms: u64) -> serde_json::Value {
        json!({"kind": "lost", "session": session, "at_ns": at_ms * MS})
    }

    fn grant_deadline(key: &str, owner: &str, token: u64, at_ms: u64) -> serde_json::Value {
        json!({"kind": "grant_deadline", "key": key, "owner": owner, "token": token, "deadline_ns": at_ms * MS})
    }
    fn grant_lost(key: &str, owner: &str, token: u64, at_ms: u64) -> serde_json::Value {
        json!({"kind": "grant_lost", "key": key, "owner": owner, "token": token, "at_ns": at_ms * MS})
    }
    fn revoke(key: &str, token: u64, sent_ms: u64) -> Revoke {
        Revoke {
            key: key.into(),
            revoked_token: token,
            sent_ns: sent_ms * MS,
            answered_ns: (sent_ms + 10) * MS,
        }
    }

    fn to(payout: &str, state: &str) -> Transition {
        Transition {
            payout_id: Some(payout.into()),
            account_id: Some("a".into()),
            token: Some(1),
            to_state: Some(state.into()),
            actor: "worker".into(),
        }
    }

    /// Each case counts only what reached it: an ambiguous payout resolved each way (interleaved
    /// with another payout's transitions), not a payout that failed or was acknowledged without
    /// being ambiguous first; the fences' refusals as the stores recorded them.
    #[test]
    fn reached_counts_each_hard_case_from_the_evidence() {
        let e = Evidence {
            transitions: vec![
                to("found", "CLAIMED"),
                to("absent", "CLAIMED"),
                to("found", "RAIL_SUBMITTED"),
                to("absent", "RAIL_SUBMITTED"),
                to("found", "RAIL_AMBIGUOUS"),
                to("absent", "RAIL_AMBIGUOUS"),
                to("plain", "CLAIMED"),
                to("absent", "FAILED"),
                to("plain", "RAIL_SUBMITTED"),
                to("found", "RAIL_ACKED"),
                to("plain", "RAIL_ACKED"),
                to("refused", "FAILED"),
                to("found", "POSTED"),
            ],
            fenced_out_paydb: 3,
            guard_events: [("FENCED".to_string(), 2), ("DUPLICATE".to_string(), 5)].into(),
            ..Evidence::default()
        };
        let reached = e.reached();
        assert_eq!(reached[REACHED_RESOLVED_FOUND], 1, "{reached:?}");
        assert_eq!(reached[REACHED_RESOLVED_ABSENT], 1, "{reached:?}");
        assert_eq!(reached[REACHED_FENCED_OUT_PAYMENT_RESOURCE], 3);
        assert_eq!(reached[REACHED_FENCED_OUT_RAIL_PROXY], 2);
        // A run whose faults met nothing reaches nothing: every count is zero.
        let idle = Evidence {
            transitions: vec![to("p", "CLAIMED"), to("p", "RAIL_ACKED"), to("p", "POSTED")],
            ..Evidence::default()
        };
        assert!(
            idle.reached().values().all(|n| *n == 0),
            "{:?}",
            idle.reached()
        );
    }

    /// The run this was found in: a grant released (confirmed) after an etcd snapshot, the
    /// snapshot restored, and the reconciler taking the resurrected grant over. The rollback is the
    /// fault's; the revoke is left out of the linearizability check only when a restore lies
    /// between the release and the revoke, and refused there otherwise.
    #[test]
    fn a_revoke_of_a_grant_a_restore_brought_back_is_the_restores_not_a_violation() {
        let history = vec![
            deadline("s1", 100_000),
            grant("payout:a", "w1", 24, "s1", 100),
            release("payout:a", "w1", 24, 200),
            json!({"kind": "released", "key": "payout:a", "owner": "w1", "token": 24, "at_ns": 210 * MS}),
        ];
        let restore = Restore {
            snapshot_ns: 150 * MS,
            restore_ns: 1_000 * MS,
        };
        let violations = |restores: Vec<Restore>| {
            let e = Evidence {
                lock_history: history.clone(),
                revokes: vec![revoke("payout:a", 24, 1_500)],
                restores,
                ..Evidence::default()
            };
            lock_history_is_linearizable(&e).violations
        };
        assert!(violations(vec![restore.clone()]).is_empty());
        assert_eq!(
            violations(vec![]).len(),
            1,
            "no restore: the revoke is checked"
        );
        // A restore of a snapshot taken after the release brings nothing back.
        let later = Restore {
            snapshot_ns: 300 * MS,
            ..restore
        };
        assert_eq!(violations(vec![later]).len(), 1);
    }

    fn overlaps(history: Vec<serde_json::Value>, revokes: Vec<Revoke>) -> Vec<String> {
        let e = Evidence {
            lock_history: history,
            revokes,
            ..Evidence::default()
        };
        grants_never_overlap(&e)
            .violations
            .into_iter()
            .map(|v| v.detail)
            .collect()
    }

    #[test]
    fn a_release_before_the_next_grant_is_no_overlap() {
        let v = overlaps(
            vec![
                deadline("s1", 10_000),
                deadline("s2", 10_000),
                grant("k", "a", 5, "s1", 100),
                release("k", "a", 5, 200),
                grant("k", "b", 9, "s2", 300),
            ],
            vec![],
        );
        assert!(v.is_empty(), "{v:?}");
    }

    #[test]
    fn a_second_grant_inside_the_first_holders_deadline_is_two_holders() {
        let v = overlaps(
            vec![
                deadline("s1", 1_000),
                deadline("s2", 10_000),
                grant("k", "a", 5, "s1", 100),
                grant("k", "b", 9, "s2", 500),
            ],
            vec![],
        );
        assert_eq!(v.len(), 1, "{v:?}");
        assert!(v[0].contains("TWO HOLDERS"), "{v:?}");
    }

    #[test]
    fn a_lost_session_or_a_force_revoke_ends_the_belief() {
        let history = vec![
            deadline("s1", 5_000),
            deadline("s2", 10_000),
            grant("k", "a", 5, "s1", 100),
            grant("k", "b", 9, "s2", 500),
        ];
        let mut with_loss = history.clone();
        with_loss.push(lost("s1", 400));
        assert!(overlaps(with_loss, vec![]).is_empty());
        assert!(overlaps(history.clone(), vec![revoke("k", 5, 450)]).is_empty());
        // A revoke of another key, or of another grant of this key, ends nothing.
        assert_eq!(
            overlaps(history.clone(), vec![revoke("other", 5, 450)]).len(),
            1
        );
        assert_eq!(overlaps(history, vec![revoke("k", 4, 450)]).len(), 1);
    }

    /// Issue 13's first failure, on its evidence's shape: the operator's revoke was SENT before
    /// the holder's grant answer arrived (the answer was in flight when the lock service took the
    /// key), and a successor was granted at once. Paired by time (revoke after the grant's
    /// arrival), the revoke ended nothing and the successor looked like a second holder; paired
    /// by the token the lock service says it revoked, it is the operator's break-glass.
    #[test]
    fn a_revoke_sent_before_the_grant_answer_arrived_is_paired_by_its_token() {
        let history = vec![
            deadline("s1", 20_000),
            deadline("s2", 20_000),
            grant("k", "a", 147, "s1", 100),
            grant_lost("k", "a", 147, 1_100),
            grant("k", "b", 150, "s2", 120),
        ];
        assert!(overlaps(history, vec![revoke("k", 147, 90)]).is_empty());
    }

    #[test]
    fn a_grant_ends_at_its_own_deadline_or_loss_while_its_session_lives() {
        let base = vec![
            deadline("s1", 20_000),
            deadline("s2", 20_000),
            grant("k", "a", 5, "s1", 100),
            grant("k", "b", 9, "s2", 5_000),
        ];
        assert_eq!(overlaps(base.clone(), vec![]).len(), 1, "session alone");
        let mut vouched = base.clone();
        vouched.push(grant_deadline("k", "a", 5, 2_000));
        vouched.push(grant_deadline("k", "a", 5, 4_000));
        assert!(overlaps(vouched, vec![]).is_empty());
        let mut lost_grant = base;
        lost_grant.push(grant_lost("k", "a", 5, 3_000));
        assert!(overlaps(lost_grant, vec![]).is_empty());
    }

    #[test]
    fn a_deposed_holder_that_keeps_believing_past_one_lease_is_reported() {
        let history = vec![
            deadline("s1", 20_000),
            deadline("s2", 20_000),
            grant("k", "a", 5, "s1", 100),
            grant("k", "b", 9, "s2", 500),
        ];
        let check = |history: Vec<serde_json::Value>| {
            deposed_holders_stop_within_one_lease(&Evidence {
                lock_history: history,
                revokes: vec![revoke("k", 5, 450)],
                lock_ttl_ns: 3_000 * MS,
                ..Evidence::default()
            })
        };
        let kept = check(history.clone());
        assert_eq!(kept.checked, 1);
        assert_eq!(kept.violations.len(), 1, "{:?}", kept.violations);
        assert!(kept.violations[0].detail.contains("DEPOSED HOLDER"));
        let mut learned = history;
        learned.push(grant_lost("k", "a", 5, 1_500));
        assert!(check(learned).violations.is_empty());
    }

    #[test]
    fn one_token_for_two_owners_is_a_repeat_and_a_missing_deadline_is_reported() {
        let v = overlaps(
            vec![
                deadline("s1", 1_000),
                deadline("s2", 1_000),
                grant("k", "a", 5, "s1", 100),
                release("k", "a", 5, 150),
                grant("k", "b", 5, "s2", 200),
            ],
            vec![],
        );
        assert!(v.iter().any(|d| d.contains("TOKEN REPEATED")), "{v:?}");
        let v = overlaps(vec![grant("k", "a", 5, "nosession", 100)], vec![]);
        assert!(v[0].contains("no recorded deadline"), "{v:?}");
    }

    #[test]
    fn a_redelivery_that_made_a_second_journal_is_caught() {
        let mut e = Evidence {
            outbox_keys: vec!["p1".into()],
            journal_keys: vec!["p1".into()],
            ledger_groups: vec![("g1".into(), 0, 2)],
            outbox_journals: vec![("p1".into(), Some("j-1".into()))],
            gl_journal_ids: vec![("p1".into(), "j-1".into())],
            ..Evidence::default()
        };
        assert!(gl_matches_paydb(&e).violations.is_empty());
        e.outbox_journals = vec![("p1".into(), Some("j-2".into()))];
        assert_eq!(gl_matches_paydb(&e).violations.len(), 1);
        e.outbox_journals = vec![("p1".into(), None)];
        assert_eq!(gl_matches_paydb(&e).violations.len(), 1);
    }

    #[test]
    fn a_lifecycle_out_of_step_with_the_transitions_or_the_gl_is_caught() {
        let transition = |p: &str| Transition {
            payout_id: Some(p.into()),
            account_id: Some("a".into()),
            token: Some(1),
            to_state: Some("CLAIMED".into()),
            actor: "HOLDER".into(),
        };
        let mut e = Evidence {
            payouts: vec![PayoutRow {
                id: "p1".into(),
                account_id: "a".into(),
                state: "CLAIMED".into(),
                amount_minor: 1,
                client_reference: "cref-p1".into(),
            }],
            transitions: vec![transition("p1")],
            outbox_events: vec![
                ("p1".into(), 1, Some("e-1".into())),
                ("p1".into(), 2, Some("e-2".into())),
            ],
            gl_events: vec![
                ("p1".into(), 1, "e-1".into()),
                ("p1".into(), 2, "e-2".into()),
            ],
            ..Evidence::default()
        };
        let clean = gl_lifecycle_matches_paydb(&e);
        assert!(clean.violations.is_empty(), "{:?}", clean.violations);
        assert_eq!(clean.checked, 2);
        // A transition without its event.
        e.transitions.push(transition("p1"));
        assert_eq!(gl_lifecycle_matches_paydb(&e).violations.len(), 1);
        e.transitions.pop();
        // A redelivery recorded another event id; an event never delivered; a GL event alone.
        e.outbox_events[1].2 = Some("e-9".into());
        assert_eq!(gl_lifecycle_matches_paydb(&e).violations.len(), 1);
        e.outbox_events[1].2 = None;
        assert_eq!(gl_lifecycle_matches_paydb(&e).violations.len(), 1);
        e.outbox_events[1].2 = Some("e-2".into());
        e.gl_events.push(("p9".into(), 1, "e-3".into()));
        let stray = gl_lifecycle_matches_paydb(&e);
        assert_eq!(stray.violations.len(), 1);
        assert!(stray.violations[0].detail.contains("p9"));
    }
}
