//! Lost answers and a partitioned ledger (issue 36, docs/design/fault-suite section 5): the
//! one-way and partial partitions.
//!
//! - `answer_loss_worker_payment_resource`, `answer_loss_worker_rail_proxy`: in one worker's
//!   network namespace the guard's answers are dropped ([`NetNs::drop_answers`]: the packets
//!   that carry data; the requests and the TCP handshake still pass). The guard commits what it
//!   is asked and the worker never hears. At the payment resource the worker's retry is answered
//!   with the record ("a step repeated under the grant that made it"); at the proxy a Submit is
//!   never retried: the worker's call runs out, the payout is RAIL_AMBIGUOUS, and the inquiry
//!   after the heal finds what the proxy had heard.
//! - `answer_loss_rail`: the rail's answers to the proxy are dropped on this host's loopback
//!   ([`HostDrop::answers_of`]): the rail pays, the proxy's bounded wait runs out (TIMEOUT), and
//!   the payout is resolved FOUND by inquiry after the heal.
//! - `dispatcher_gl_partition`: the General Ledger's port cut both ways on this host
//!   ([`HostDrop::partition`]) for `down_ms`: the dispatcher's deliveries hang, the outbox keeps
//!   its rows, and redelivery after the heal is answered with the GL's journal (the checker's
//!   outbox and GL rules). The reconciler's reads of the GL are cut as well.
//!
//! A worker's lost answer is of a call known before it is made: the fault arms the test worker's
//! stall point before MarkSubmitted or Submit (as the planted holders do), takes the worker that
//! reaches it, drops that worker's answers, and releases the call into the drop. Each fault holds
//! its drop until the event it exists for has happened (the retry answered with the record, the
//! Submit run out and the payout RAIL_AMBIGUOUS, a submission paid by the rail and timed out at
//! the proxy), bounded, never for a time that happened to suffice. What it reached is counted from evidence: the payment resource's
//! log for a repeated step, proxydb's submissions and paydb's transitions for the others
//! ([`reached`]).

use std::collections::BTreeMap;
use std::time::Duration;

use serde::Serialize;
use testkit::netns::{HostDrop, NetNs};
use testkit::system::System;

use super::checker::Evidence;
use super::nemesis::{Fault, Outcome};

/// The "sometimes" names: `answer_lost_recovered@<link>`.
pub const REACHED_PREFIX: &str = "answer_lost_recovered@";
/// The links whose lost answers a run must see recovered.
pub const LINKS: [&str; 3] = [LINK_PAYMENT_RESOURCE, LINK_RAIL_PROXY, LINK_RAIL];
pub const LINK_PAYMENT_RESOURCE: &str = "payment_resource";
pub const LINK_RAIL_PROXY: &str = "rail_proxy";
pub const LINK_RAIL: &str = "rail";

/// The payment resource's log line for a step asked again under the grant that made it.
const REPEAT_LINE: &str = "a step repeated under the grant that made it";

/// The rail's drop waits at most this long for a submission (a bound: in a run's fault window
/// payouts reach the rail within seconds; after the workload has settled, none will).
const STEP_WAIT: Duration = Duration::from_secs(60);
/// A fault waits at most this long for the lost answer's consequence (a retry answered with the
/// record; a Submit whose call ran out, `SUBMIT_START_TO_CLOSE` being 30 s; the proxy's rail
/// timeout).
const CONSEQUENCE_WAIT: Duration = Duration::from_secs(90);
/// After the heal, a payment resource's repeat not yet seen during the drop is awaited this long.
const AFTER_HEAL_WAIT: Duration = Duration::from_secs(30);

/// One lost-answer fault: which link, whose answers, the window (the database's clock, epoch
/// µs), and what it saw.
#[derive(Debug, Clone, Serialize)]
pub struct AnswerLoss {
    pub link: String,
    /// The worker identity whose answers were dropped (the worker <-> guard links).
    pub worker: Option<String>,
    pub from_us: i64,
    pub to_us: i64,
    /// Packets the drop's rules took.
    pub dropped_packets: u64,
    /// Repeated steps answered with the record (the payment resource's link; the others are
    /// counted from the stores by [`reached`]).
    pub repeats: u64,
    /// The payouts the fault saw meet the drop.
    pub payouts: Vec<String>,
}

/// The epoch µs of `pool`'s server clock: windows are compared with `created_at`/`at` columns.
async fn db_now_us(pool: &sqlx::PgPool) -> anyhow::Result<i64> {
    Ok(
        sqlx::query_scalar("SELECT (extract(epoch FROM clock_timestamp()) * 1000000)::bigint")
            .fetch_one(pool)
            .await?,
    )
}

/// The payment resource's repeat lines for `worker`'s grants in its log past `offset` bytes (the
/// whole log when it is shorter: restarted since), with their payouts.
fn repeats_in_log(log: &std::path::Path, offset: u64, worker: &str) -> Vec<String> {
    let Ok(text) = std::fs::read(log) else {
        return Vec::new();
    };
    let start = if (text.len() as u64) < offset {
        0
    } else {
        offset as usize
    };
    let owner = format!("{worker}/");
    without_ansi(&String::from_utf8_lossy(&text[start..]))
        .lines()
        .filter(|l| l.contains(REPEAT_LINE) && l.contains(&owner))
        .map(|l| {
            l.split(|c: char| c.is_whitespace() || c == '"' || c == ',')
                .find_map(|w| w.strip_prefix("payout_id=").map(str::to_string))
                .unwrap_or_default()
        })
        .collect()
}

/// `text` without its terminal colour sequences (`ESC [ ... m`: a service's text log may
/// carry them around field names).
fn without_ansi(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut chars = text.chars();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            for c in chars.by_ref() {
                if c.is_ascii_alphabetic() {
                    break;
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}

/// A worker's call stalled before its guard (the test worker's stall point, armed as the planted
/// holders' are) waits this long at most for its release; the fault releases it at once, into
/// the drop.
const STALL_MAX: Duration = Duration::from_secs(60);

/// Arms the stall point before `step` and waits for a worker to take it: the call whose answer
/// the fault will lose is then known (its worker, its payout) before it is made. The worker's
/// slot, for its network host.
async fn stall_a_call(
    system: &System,
    stall_dir: &std::path::Path,
    step: &str,
) -> anyhow::Result<(String, String, usize)> {
    let (worker, payout) = super::nemesis::take_stall(stall_dir, step, STALL_MAX).await?;
    match system
        .workers
        .iter()
        .position(|w| w.name() == format!("payout-{worker}"))
    {
        Some(slot) => Ok((worker, payout, slot)),
        None => {
            super::nemesis::release_stall(stall_dir, step, &payout)?;
            anyhow::bail!("the stall before {step} was taken by a worker not running now: {worker}")
        }
    }
}

/// The network host of the worker in `slot`; the stalled call is released (to go on unharmed)
/// when it has none.
fn host_of<'n>(
    partitions: &'n [Option<NetNs>],
    slot: usize,
    stall: (&std::path::Path, &str, &str),
) -> anyhow::Result<&'n NetNs> {
    match partitions.get(slot).and_then(Option::as_ref) {
        Some(ns) => Ok(ns),
        None => {
            let (dir, step, payout) = stall;
            super::nemesis::release_stall(dir, step, payout)?;
            anyhow::bail!("worker slot {slot} has no network host")
        }
    }
}

/// `answer_loss_worker_payment_resource`: a worker's MarkSubmitted, stalled before the call,
/// released into a drop of the payment resource's answers to that worker; held until the guard
/// answered the worker's retry with the record (its answer lost too), then healed.
pub async fn worker_payment_resource(
    system: &System,
    stall_dir: &std::path::Path,
    partitions: &[Option<NetNs>],
    outcome: &mut Outcome,
) -> anyhow::Result<String> {
    const STEP: &str = "mark_submitted";
    let (worker, payout, slot) = stall_a_call(system, stall_dir, STEP).await?;
    let ns = host_of(partitions, slot, (stall_dir, STEP, &payout))?;
    let port = system.ports.payment_resource;
    let log = system.payment_resource.log_path().to_path_buf();
    let offset = std::fs::metadata(&log).map(|m| m.len()).unwrap_or(0);
    let paydb = super::one_connection(&system.databases.paydb).await?;
    let from_us = db_now_us(&paydb).await?;
    tokio::task::block_in_place(|| ns.drop_answers(port))?;
    super::nemesis::release_stall(stall_dir, STEP, &payout)?;
    // The call commits unheard; the worker's retry (its local step's timeout, 10 s) reaches the
    // guard (only answers are dropped) and is answered with the record, unheard too.
    let asked_again = |payout: &str| {
        repeats_in_log(&log, offset, &worker)
            .iter()
            .any(|p| p == payout)
    };
    let during = testkit::eventually(
        CONSEQUENCE_WAIT,
        "the step asked again during the drop",
        || async { asked_again(&payout).then_some(()) },
    )
    .await
    .is_ok();
    let dropped = tokio::task::block_in_place(|| ns.answers_dropped(port)).unwrap_or(0);
    let healed = tokio::task::block_in_place(|| ns.heal_answers(port));
    let to_us = db_now_us(&paydb).await.unwrap_or(from_us);
    testkit::util::close_pool(paydb).await;
    healed?;
    if !during {
        let _ = testkit::eventually(
            AFTER_HEAL_WAIT,
            "the step asked again after the heal",
            || async { asked_again(&payout).then_some(()) },
        )
        .await;
    }
    let repeated = repeats_in_log(&log, offset, &worker);
    let line = format!(
        "{worker}'s MarkSubmitted of {payout} released into a drop of the payment resource's answers ({dropped} packets): {} step(s) asked again and answered with the record{}",
        repeated.len(),
        if during { "" } else { " (not during the drop)" }
    );
    outcome.answer_losses.push(AnswerLoss {
        link: LINK_PAYMENT_RESOURCE.into(),
        worker: Some(worker),
        from_us,
        to_us,
        dropped_packets: dropped,
        repeats: repeated.len() as u64,
        payouts: repeated,
    });
    Ok(line)
}

/// `answer_loss_worker_rail_proxy`: a worker's Submit, stalled before the call, released into a
/// drop of the rail proxy's answers to that worker; held until the Submit ran out unheard (one
/// attempt, ever) and the worker recorded the payout RAIL_AMBIGUOUS, then healed: the inquiry
/// settles it by what the proxy heard.
pub async fn worker_rail_proxy(
    system: &System,
    stall_dir: &std::path::Path,
    partitions: &[Option<NetNs>],
    outcome: &mut Outcome,
) -> anyhow::Result<String> {
    const STEP: &str = "submit";
    let (worker, payout, slot) = stall_a_call(system, stall_dir, STEP).await?;
    let ns = host_of(partitions, slot, (stall_dir, STEP, &payout))?;
    let port = system.ports.rail_proxy;
    let proxydb = super::one_connection(&system.databases.proxydb).await?;
    let paydb = super::one_connection(&system.databases.paydb).await?;
    let from_us = db_now_us(&proxydb).await?;
    tokio::task::block_in_place(|| ns.drop_answers(port))?;
    super::nemesis::release_stall(stall_dir, STEP, &payout)?;
    let ambiguous = testkit::eventually(
        CONSEQUENCE_WAIT,
        "the Submit run out, RAIL_AMBIGUOUS",
        || async {
            let n: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM audit_event WHERE kind = 'transition' AND payout_id = $1 \
             AND to_state = 'RAIL_AMBIGUOUS'",
            )
            .bind(&payout)
            .fetch_one(&paydb)
            .await
            .ok()?;
            (n > 0).then_some(())
        },
    )
    .await
    .is_ok();
    let dropped = tokio::task::block_in_place(|| ns.answers_dropped(port)).unwrap_or(0);
    let healed = tokio::task::block_in_place(|| ns.heal_answers(port));
    let to_us = db_now_us(&proxydb).await.unwrap_or(from_us);
    healed?;
    testkit::util::close_pool(proxydb).await;
    testkit::util::close_pool(paydb).await;
    let line = format!(
        "{worker}'s Submit of {payout} released into a drop of the rail proxy's answers ({dropped} packets): {}",
        if ambiguous {
            "it ran out unheard; RAIL_AMBIGUOUS"
        } else {
            "not ambiguous within the bound"
        }
    );
    outcome.answer_losses.push(AnswerLoss {
        link: LINK_RAIL_PROXY.into(),
        worker: Some(worker),
        from_us,
        to_us,
        dropped_packets: dropped,
        repeats: 0,
        payouts: vec![payout],
    });
    Ok(line)
}

/// `answer_loss_rail`: the rail's answers to the proxy dropped until a submission made meanwhile
/// was paid by the rail and given up on by the proxy (TIMEOUT): the answer the issue names, lost.
pub async fn rail(system: &System, outcome: &mut Outcome) -> anyhow::Result<String> {
    let proxydb = super::one_connection(&system.databases.proxydb).await?;
    let stub = rail_stub::client::StubClient::new(system.rail_stub_endpoints())
        .map_err(|e| anyhow::anyhow!("the harness's rail client: {e}"))?;
    let from_us = db_now_us(&proxydb).await?;
    let drop = tokio::task::block_in_place(|| HostDrop::answers_of(system.ports.rail_stub))?;
    let give_up = tokio::time::Instant::now() + STEP_WAIT + CONSEQUENCE_WAIT;
    let mut timed_out: Vec<(String, String)> = Vec::new();
    let paid_unheard = loop {
        timed_out = sqlx::query_as(
            "SELECT payout_id, client_reference FROM rail_submission WHERE outcome = 'TIMEOUT' \
             AND created_at >= to_timestamp($1 / 1000000.0) ORDER BY id",
        )
        .bind(from_us)
        .fetch_all(&proxydb)
        .await
        .unwrap_or(timed_out);
        if !timed_out.is_empty() {
            if let Ok(book) = stub.ground_truth().await {
                let paid = timed_out.iter().find(|(_, reference)| {
                    book.movements
                        .iter()
                        .any(|m| &m.client_reference == reference)
                });
                if let Some((payout, _)) = paid {
                    break Some(payout.clone());
                }
            }
        }
        if tokio::time::Instant::now() >= give_up {
            break None;
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    };
    let dropped = tokio::task::block_in_place(|| drop.dropped()).unwrap_or(0);
    tokio::task::block_in_place(move || std::mem::drop(drop));
    let to_us = db_now_us(&proxydb).await.unwrap_or(from_us);
    testkit::util::close_pool(proxydb).await;
    outcome.answer_losses.push(AnswerLoss {
        link: LINK_RAIL.into(),
        worker: None,
        from_us,
        to_us,
        dropped_packets: dropped,
        repeats: 0,
        payouts: timed_out.iter().map(|(p, _)| p.clone()).collect(),
    });
    Ok(format!(
        "the rail's answers to the proxy dropped ({dropped} packets): {}",
        match paid_unheard {
            Some(p) => format!(
                "{p} paid by the rail, timed out at the proxy ({} timed out in all)",
                timed_out.len()
            ),
            None => format!(
                "no submission paid unheard meanwhile ({} timed out)",
                timed_out.len()
            ),
        }
    ))
}

/// `dispatcher_gl_partition`: the General Ledger's port cut both ways for `down_ms`.
pub async fn dispatcher_gl(system: &System, fault: &Fault) -> anyhow::Result<String> {
    let pending = |paydb: sqlx::PgPool| async move {
        let n: Option<i64> = sqlx::query_scalar(
            "SELECT count(*) FROM ledger_outbox WHERE delivered_at IS NULL AND quarantined_at IS NULL",
        )
        .fetch_one(&paydb)
        .await
        .ok();
        testkit::util::close_pool(paydb).await;
        n
    };
    let drop = tokio::task::block_in_place(|| HostDrop::partition(system.ports.general_ledger))?;
    tokio::time::sleep(Duration::from_millis(fault.down_ms)).await;
    let waiting = match super::one_connection(&system.databases.paydb).await {
        Ok(paydb) => pending(paydb).await,
        Err(_) => None,
    };
    let dropped = tokio::task::block_in_place(|| drop.dropped()).unwrap_or(0);
    tokio::task::block_in_place(move || std::mem::drop(drop));
    Ok(format!(
        "the General Ledger partitioned {} ms ({dropped} packets dropped; {} outbox rows waiting)",
        fault.down_ms,
        waiting.map_or("?".to_string(), |n| n.to_string())
    ))
}

/// A submission made in a lost-answer window and how the proxy recorded it.
struct Submission {
    payout: String,
    client_reference: String,
    outcome: Option<String>,
}

/// The lost answers the run saw recovered, by link, from the evidence:
/// - payment resource: the steps asked again and answered with the record (its log);
/// - rail proxy: a submission of the cut worker in the window that the proxy heard the rail
///   answer (ACKED, REJECTED) while its payout went RAIL_AMBIGUOUS, then resolved to that answer
///   (RAIL_ACKED, FAILED) by inquiry;
/// - rail: a submission in the window that the proxy recorded as TIMEOUT, that the rail's book
///   shows paid, and whose payout was resolved FOUND (RAIL_AMBIGUOUS, then RAIL_ACKED).
pub async fn reached(
    system: &System,
    evidence: &Evidence,
    losses: &[AnswerLoss],
) -> BTreeMap<String, u64> {
    let mut out: BTreeMap<String, u64> = LINKS
        .iter()
        .map(|l| (format!("{REACHED_PREFIX}{l}"), 0))
        .collect();
    let resolved = resolutions(evidence);
    let paid: std::collections::BTreeSet<&str> = evidence
        .movements
        .iter()
        .map(|m| m.client_reference.as_str())
        .collect();
    let proxydb = super::one_connection(&system.databases.proxydb).await.ok();
    for loss in losses {
        let n = match loss.link.as_str() {
            LINK_PAYMENT_RESOURCE => loss.repeats,
            LINK_RAIL_PROXY | LINK_RAIL => {
                let Some(db) = &proxydb else { continue };
                let owner = loss
                    .worker
                    .as_ref()
                    .map_or("%".to_string(), |w| format!("{w}/%"));
                let rows: Vec<(String, String, Option<String>)> = sqlx::query_as(
                    "SELECT payout_id, client_reference, outcome FROM rail_submission \
                     WHERE owner LIKE $1 AND created_at >= to_timestamp($2 / 1000000.0) \
                     AND created_at <= to_timestamp($3 / 1000000.0)",
                )
                .bind(&owner)
                .bind(loss.from_us)
                .bind(loss.to_us)
                .fetch_all(db)
                .await
                .unwrap_or_default();
                rows.into_iter()
                    .map(|(payout, client_reference, outcome)| Submission {
                        payout,
                        client_reference,
                        outcome,
                    })
                    .filter(|s| {
                        let resolution = resolved.get(s.payout.as_str()).copied();
                        if loss.link == LINK_RAIL {
                            s.outcome.as_deref() == Some("TIMEOUT")
                                && paid.contains(s.client_reference.as_str())
                                && resolution == Some("RAIL_ACKED")
                        } else {
                            matches!(
                                (s.outcome.as_deref(), resolution),
                                (Some("ACKED"), Some("RAIL_ACKED"))
                                    | (Some("REJECTED"), Some("FAILED"))
                            )
                        }
                    })
                    .count() as u64
            }
            _ => 0,
        };
        *out.entry(format!("{REACHED_PREFIX}{}", loss.link))
            .or_default() += n;
    }
    if let Some(db) = proxydb {
        testkit::util::close_pool(db).await;
    }
    out
}

/// Each payout that was RAIL_AMBIGUOUS, and the state it left it for.
fn resolutions(evidence: &Evidence) -> BTreeMap<&str, &str> {
    let mut last: BTreeMap<&str, &str> = BTreeMap::new();
    let mut out = BTreeMap::new();
    for t in &evidence.transitions {
        let (Some(payout), Some(to)) = (t.payout_id.as_deref(), t.to_state.as_deref()) else {
            continue;
        };
        if last.get(payout) == Some(&"RAIL_AMBIGUOUS") && to != "RAIL_AMBIGUOUS" {
            out.insert(payout, to);
        }
        last.insert(payout, to);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_repeat_line_is_found_for_its_worker_with_or_without_colours() {
        let dir = std::env::temp_dir().join(format!("answer-loss-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let log = dir.join("payment-resource.log");
        let text = "2026-12-07T10:00:00Z  INFO starting service=\"payment-resource\"\n\
            2026-12-07T10:00:01Z  INFO a step repeated under the grant that made it: answered with the record \
            \u{1b}[3mpayout_id\u{1b}[0m\u{1b}[2m=\u{1b}[0mpo-7 \u{1b}[3mowner\u{1b}[0m\u{1b}[2m=\u{1b}[0m\"worker-1/po-7\"\n\
            2026-12-07T10:00:02Z  INFO a step repeated under the grant that made it: answered with the record \
            payout_id=po-9 owner=\"worker-10/po-9\"\n";
        std::fs::write(&log, text).unwrap();
        assert_eq!(
            repeats_in_log(&log, 0, "worker-1"),
            vec!["po-7".to_string()]
        );
        assert_eq!(
            repeats_in_log(&log, 0, "worker-10"),
            vec!["po-9".to_string()]
        );
        assert!(repeats_in_log(&log, 0, "worker-2").is_empty());
        // Past the end (the log started again since): read from the start.
        assert_eq!(repeats_in_log(&log, 1 << 20, "worker-1").len(), 1);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
