//! The reconciler against a real system (every service a process): a payout driven by hand
//! under a real lock grant reconciles clean; then each primary is broken behind the services'
//! backs, and the check that owns it must report it. A check that stays green here would be
//! decoration.

use std::time::Duration;
use testkit::pki::Role;

use payment_client::model::{Fence, NewPayout, RailOutcome};
use payment_client::PaymentClient;
use payout_domain::{AccountId, AmountMinor, BeneficiaryRef, Currency, PayoutId};
use rail_proxy_client::{Outcome, RailProxyClient, SubmitPayout};
use reconciler::{Options, Report, Sources};
use testkit::system::{System, SystemOptions};

mod common;
use common::{sources, system_without_workers};

fn violations<'a>(report: &'a Report, check: &str) -> &'a [String] {
    &report
        .checks
        .iter()
        .find(|c| c.name == check)
        .unwrap_or_else(|| panic!("no check {check}"))
        .violations
}

/// One payout through claim, submit, outcome and posting, by hand, under a real grant.
async fn pay(system: &System, account: &str, payout: &str, amount: i64) {
    pay_submitting(system, account, payout, amount, amount).await
}

/// The same, but the rail is asked for `submitted` (what a workflow built from a wrong input
/// would have sent, before submissions came from the payout record).
async fn pay_submitting(system: &System, account: &str, payout: &str, amount: i64, submitted: i64) {
    let Claimed {
        _session,
        grant,
        payments,
        fence,
        new,
    } = submitted_by_hand(system, account, payout, amount).await;
    let (payout_id, account_id, eur) = (new.payout_id, new.account_id, new.currency);
    let mut proxy = RailProxyClient::connect(&system.proxy_url(), &system.tls(Role::Worker))
        .await
        .unwrap();
    let submission = proxy
        .submit(
            &SubmitPayout::new(
                payout_id.clone(),
                account_id.clone(),
                grant.token(),
                grant.owner(),
                AmountMinor::new(submitted).unwrap(),
                eur,
                new.beneficiary_ref.clone(),
            )
            .signed(grant.key(), grant.signature().clone())
            .instructed_now(&system.instruction_keys.signer().unwrap()),
        )
        .await
        .unwrap();
    let fact = resolver::facts::outcome(&submission);
    let Outcome::Acked { rail_ref } = submission.outcome else {
        panic!("rail did not ack: {submission:?}")
    };
    payments
        .record_outcome_proven(
            &payout_id,
            &fence,
            &RailOutcome::Acked { rail_ref },
            "",
            fact.as_ref(),
        )
        .await
        .unwrap();
    payments.post(&payout_id, &fence).await.unwrap();
    grant.release().await.unwrap();
}

/// A payout created, claimed and marked submitted by hand under a real grant (still held), the
/// rail not yet asked.
struct Claimed {
    /// The lock session the grant lives in, kept open while the grant is used.
    _session: lock_client::Session,
    grant: lock_client::GrantHandle,
    payments: PaymentClient,
    fence: Fence,
    new: NewPayout,
}

async fn submitted_by_hand(system: &System, account: &str, payout: &str, amount: i64) -> Claimed {
    let lock = lock_client::LockClient::connect(&system.lock_url(), &system.tls(Role::Worker))
        .await
        .unwrap();
    let session = lock
        .open_session("reconciler-test", Duration::from_secs(10))
        .await
        .unwrap();
    let account_id = AccountId::parse(account).unwrap();
    let (grant, fence) = common::granted(&session, &account_id).await;
    let payments = PaymentClient::connect(&system.payment_url(), &system.tls(Role::Worker))
        .await
        .unwrap();
    let fixture = PaymentClient::connect(&system.payment_url(), &system.tls(Role::Fixture))
        .await
        .unwrap();
    let eur = Currency::parse("EUR").unwrap();
    let _ = system
        .operator
        .open_account(&fixture, &account_id, &eur, 100_000)
        .await
        .unwrap();
    let payout_id = PayoutId::parse(payout).unwrap();
    let new = NewPayout {
        payout_id: payout_id.clone(),
        account_id: account_id.clone(),
        amount_minor: AmountMinor::new(amount).unwrap(),
        currency: eur.clone(),
        beneficiary_ref: BeneficiaryRef::parse("ben-1").unwrap(),
    };
    fixture.create_payout(&new).await.unwrap();
    payments.claim(&payout_id, &fence).await.unwrap();
    payments.mark_submitted(&payout_id, &fence).await.unwrap();
    Claimed {
        _session: session,
        grant,
        payments,
        fence,
        new,
    }
}

async fn drained(system: &System) {
    let paydb = sqlx::PgPool::connect(&system.databases.paydb)
        .await
        .unwrap();
    testkit::eventually(Duration::from_secs(30), "outbox drained", || async {
        let pending: i64 =
            sqlx::query_scalar("SELECT count(*) FROM ledger_outbox WHERE delivered_at IS NULL")
                .fetch_one(&paydb)
                .await
                .ok()?;
        (pending == 0).then_some(())
    })
    .await
    .unwrap();
}

/// Runs `sql` on `url` with triggers off (superuser, replication role): a primary bypassed.
async fn behind_the_back(url: &str, sql: &str) {
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(1)
        .connect(url)
        .await
        .unwrap();
    let mut conn = pool.acquire().await.unwrap();
    sqlx::query("SET session_replication_role = replica")
        .execute(&mut *conn)
        .await
        .unwrap();
    sqlx::raw_sql(sql)
        .execute(&mut *conn)
        .await
        .unwrap_or_else(|e| panic!("{sql}: {e}"));
}

#[tokio::test]
async fn clean_run_is_clean_and_every_broken_primary_is_reported() {
    let system = system_without_workers().await;
    pay(&system, "acct-r1", "po-r1", 1_250).await;
    pay(&system, "acct-r2", "po-r2", 700).await;
    drained(&system).await;
    // The rail's lookups are authoritative only after its settlement window.
    tokio::time::sleep(Duration::from_millis(
        SystemOptions::default().settlement_window_ms + 500,
    ))
    .await;
    let src = sources(&system).await;
    let strict = Options {
        require_outbox_drained: true,
        ..Options::default()
    };

    let report = reconciler::reconcile(&src, &strict).await.unwrap();
    assert!(
        report.is_clean(),
        "a clean run must reconcile clean:\n{}",
        report.render()
    );
    assert!(
        report.checks.iter().all(|c| c.skipped.is_none()),
        "{}",
        report.render()
    );
    assert_eq!(report.rail_movements, 2);
    assert_eq!(report.payouts_by_state.get("POSTED"), Some(&2));

    // The rail is asked to pay more than the payout record says (and paydb debits).
    pay_submitting(&system, "acct-r3", "po-r3", 700, 9_999).await;
    // INV-02: the rail is paid a second time for po-r1 behind the proxy's back.
    let stub = rail_stub::client::StubClient::new(system.rail_stub_endpoints())
        .expect("the harness's rail client");
    stub.pay(&rail_stub::PaymentOrder {
        client_reference: "cref-po-r1".into(),
        amount_minor: 1_250,
        currency: "EUR".into(),
        beneficiary_ref: "ben-1".into(),
    })
    .await
    .unwrap();
    // INV-03: an entry that unbalances its group and its account.
    behind_the_back(
        &system.databases.paydb,
        "INSERT INTO ledger_entry (transaction_group, line_number, account_id, currency, amount_minor, counterparty) \
         VALUES (gen_random_uuid(), 1, 'acct-r2', 'EUR', -5, 'sys:payout-clearing:EUR')",
    )
    .await;
    // INV-04/05 and INV-07 at the proxy: a submission under a lower token that nobody granted.
    behind_the_back(
        &system.databases.proxydb,
        "INSERT INTO rail_submission (payout_id, account_id, fence_token, owner, client_reference, amount_minor, currency, beneficiary_ref) \
         VALUES ('po-ghost', 'acct-r1', 1, 'ghost', 'cref-po-ghost', 10, 'EUR', 'ben-1')",
    )
    .await;
    // INV-08: a terminal payout moved back to an in-flight state, beside another in flight (INV-01).
    behind_the_back(
        &system.databases.paydb,
        "DROP INDEX IF EXISTS payout_one_in_flight_per_account",
    )
    .await;
    behind_the_back(
        &system.databases.paydb,
        "UPDATE payout SET state = 'RAIL_ACKED' WHERE id IN ('po-r1', 'po-r2')",
    )
    .await;
    behind_the_back(
        &system.databases.paydb,
        "UPDATE payout SET account_id = 'acct-r1' WHERE id = 'po-r2'",
    )
    .await;
    // The GL: a journal whose posting never existed in paydb.
    behind_the_back(
        &system.databases.gldb,
        "INSERT INTO journals (id, source_service, idempotency_key, payload_hash, source_transaction_id, tracking_code, \
           effect_kind, effect_version, occurred_at, correlation_id, actor_id) \
         VALUES (gen_random_uuid(), 'payment-resource', 'payment-resource:payout:po-ghost:posting:v1', repeat('0', 64), \
           'po-ghost', '', 'PAYOUT_POSTED', 1, now(), 'po-ghost', 'ghost')",
    )
    .await;
    behind_the_back(
        &system.databases.gldb,
        "INSERT INTO entries (journal_id, line_number, account_id, asset_id, amount) \
         SELECT id, 1, (SELECT id FROM ledger_accounts LIMIT 1), 'EUR', 1 FROM journals \
         WHERE idempotency_key = 'payment-resource:payout:po-ghost:posting:v1'",
    )
    .await;
    // The GL: a lifecycle event of a payout paydb never wrote, and one of po-r1 at a version
    // paydb's outbox never carried.
    behind_the_back(
        &system.databases.gldb,
        "INSERT INTO transaction_events (id, source_service, source_transaction_id, event_type, event_version, \
           payload_hash, occurred_at, correlation_id, actor_id) \
         VALUES (gen_random_uuid(), 'payment-resource', 'po-ghost', 'PAYOUT_CREATED', 1, repeat('0', 64), now(), \
           'po-ghost', 'ghost'), \
                (gen_random_uuid(), 'payment-resource', 'po-r1', 'PAYOUT_FAILED', 99, repeat('0', 64), now(), \
           'po-r1', 'ghost')",
    )
    .await;

    // The rail's lookups are authoritative only after its settlement window.
    tokio::time::sleep(Duration::from_millis(
        SystemOptions::default().settlement_window_ms + 500,
    ))
    .await;
    drained(&system).await;
    let report = reconciler::reconcile(&src, &strict).await.unwrap();
    let text = report.render();
    assert!(!report.is_clean(), "{text}");
    let rail = violations(&report, "rail_movements_match_the_books");
    assert!(
        rail.iter()
            .any(|v| v.contains("DUPLICATE PAYMENT") && v.contains("cref-po-r1")),
        "the duplicate, found through the proxy's lookup: {text}"
    );
    assert!(
        rail.iter()
            .any(|v| v.contains("WRONG AMOUNT") && v.contains("po-r3") && v.contains("9999")),
        "the rail paid another amount than the record: {text}"
    );
    assert!(
        violations(&report, "submissions_match_payouts")
            .iter()
            .any(|v| v.contains("WRONG INSTRUCTION") && v.contains("po-r3")),
        "the submission's instruction differs from the record: {text}"
    );
    assert!(
        violations(&report, "ledger_balanced").len() >= 2,
        "group and balance: {text}"
    );
    assert!(
        !violations(&report, "proxydb_tokens_never_decrease").is_empty(),
        "{text}"
    );
    assert!(
        violations(&report, "guard_tokens_were_granted")
            .iter()
            .any(|v| v.contains("po-ghost")),
        "{text}"
    );
    assert!(
        !violations(&report, "transition_history_replays").is_empty(),
        "{text}"
    );
    assert!(
        !violations(&report, "one_in_flight_payout_per_account").is_empty(),
        "{text}"
    );
    assert!(
        violations(&report, "postings_match_payouts")
            .iter()
            .any(|v| v.contains("RAIL_ACKED")),
        "{text}"
    );
    let gl = violations(&report, "gl_matches_paydb");
    assert!(
        gl.iter()
            .any(|v| v.contains("GL journal") && v.contains("po-ghost")),
        "{text}"
    );
    assert!(
        gl.iter()
            .any(|v| v.contains("GL event PAYOUT_CREATED of po-ghost v1 has no outbox row")),
        "{text}"
    );
    assert!(
        gl.iter()
            .any(|v| v.contains("GL event PAYOUT_FAILED of po-r1 v99 has no outbox row")),
        "{text}"
    );
    assert!(
        !violations(&report, "one_submission_per_payout").is_empty(),
        "unknown payout: {text}"
    );
}

/// Waits until the rail proxy's lookup (the one the reconciler uses) answers `movements`
/// movements for `payout`: the rail's lookup is authoritative only after its settlement window.
async fn rail_reports(system: &System, payout: &str, movements: usize) {
    let proxy = RailProxyClient::connect(&system.proxy_url(), &system.tls(Role::Reconciler))
        .await
        .unwrap();
    let id = PayoutId::parse(payout).unwrap();
    testkit::eventually(
        RAIL_SETTLED_WAIT,
        &format!("{movements} movement(s) for {payout}"),
        || {
            let (mut proxy, id) = (proxy.clone(), id.clone());
            async move {
                match proxy.rail_movements(&id).await.ok()? {
                    rail_proxy_client::RailLookup::Found(found) if found.len() == movements => {
                        Some(())
                    }
                    _ => None,
                }
            }
        },
    )
    .await
    .unwrap();
}

/// How long the rail's lookup may take to answer for a movement: ten settlement windows (the stub
/// answers UNKNOWN within one) on a loaded machine.
const RAIL_SETTLED_WAIT: Duration = Duration::from_secs(60);

/// The planted movement for `payout`: the rail is paid behind the proxy's back.
async fn paid_behind_the_proxy(system: &System, payout: &str, amount_minor: i64) {
    rail_stub::client::StubClient::new(system.rail_stub_endpoints())
        .expect("the harness's rail client")
        .pay(&rail_stub::PaymentOrder {
            client_reference: format!("cref-{payout}"),
            amount_minor,
            currency: "EUR".into(),
            beneficiary_ref: "ben-1".into(),
        })
        .await
        .unwrap();
}

/// INV-02's rail cross-check at a bound smaller than the book (issue 35, item 4): each run looks
/// up the next slice after where the last stopped, so a duplicate planted for the payout that
/// sorts last is found within ceil(N / bound) runs, every run before the round's last says it was
/// partial (covered and total), and the run that completes the round is not partial. Negative
/// control, the behaviour before the cursor (every run starting at the first payout id, as the
/// old RAIL_LOOKUPS_PER_RUN_MAX cut did): the duplicate is never found and every run is partial.
#[tokio::test]
async fn the_rail_cursor_finds_a_duplicate_for_the_last_payout_within_its_round() {
    const PAYOUTS: usize = 5;
    const BOUND: usize = 2;
    let system = system_without_workers().await;
    for i in 1..=PAYOUTS {
        pay(&system, &format!("acct-c{i}"), &format!("po-c{i}"), 100).await;
    }
    let last = format!("po-c{PAYOUTS}");
    paid_behind_the_proxy(&system, &last, 100).await;
    rail_reports(&system, &last, 2).await;
    let src = sources(&system).await;
    // recent_ms 0: no payout counts as recently ended, so only the cursor's slice is looked up.
    let options = |cursor: Option<String>| Options {
        rail: reconciler::RailOptions {
            lookups_max: BOUND,
            recent_ms: 0,
            cursor,
            ..Default::default()
        },
        ..Options::default()
    };
    let runs = PAYOUTS.div_ceil(BOUND);
    let found = |report: &Report| {
        violations(report, "rail_movements_match_the_books")
            .iter()
            .any(|v| v.contains("DUPLICATE PAYMENT") && v.contains(&format!("cref-{last}")))
    };

    // Negative control: the cursor not carried from run to run.
    for _ in 0..=runs {
        let report = reconciler::reconcile(&src, &options(None)).await.unwrap();
        assert!(!found(&report), "{}", report.render());
        let partial = check(&report, "rail_movements_match_the_books")
            .partial
            .clone()
            .unwrap_or_else(|| panic!("mid-round is partial:\n{}", report.render()));
        assert_eq!(
            (partial.covered, partial.total),
            (BOUND as u64, PAYOUTS as u64)
        );
    }

    // The cursor carried: found in the round's last run, partial before it, not partial then.
    let mut cursor = None;
    for run in 1..=runs {
        let report = reconciler::reconcile(&src, &options(cursor.take()))
            .await
            .unwrap();
        let text = report.render();
        let c = check(&report, "rail_movements_match_the_books");
        if run < runs {
            assert!(!found(&report), "run {run}: {text}");
            let partial = c
                .partial
                .clone()
                .unwrap_or_else(|| panic!("run {run}: {text}"));
            assert_eq!(
                (partial.covered, partial.total, partial.runs_per_round),
                (BOUND as u64, PAYOUTS as u64, runs as u64),
                "{text}"
            );
            assert!(text.contains("PARTIAL 2/5"), "the table says so: {text}");
        } else {
            assert!(found(&report), "run {run} completes the round: {text}");
            assert!(
                c.partial.is_none(),
                "a completed round is not partial: {text}"
            );
        }
        cursor = report.rail_cursor.clone();
    }
}

/// A payout the proxy sealed NOT_SENT (it refused to send: the inquiry found no submission) and
/// that then ended FAILED is looked up for RailOptions::sealed_recheck_ms after it ended: a
/// movement found for it is a violation (money moved, the books say it never left). Negative
/// control, the behaviour before (sealed payouts never looked up, here with both periods 0): no
/// finding.
#[tokio::test]
async fn a_movement_for_a_payout_the_proxy_sealed_is_a_violation() {
    let system = system_without_workers().await;
    let Claimed {
        _session,
        grant,
        payments,
        fence,
        new,
    } = submitted_by_hand(&system, "acct-s1", "po-s1", 300).await;
    payments
        .record_outcome(&new.payout_id, &fence, &RailOutcome::OutcomeMissing, "")
        .await
        .unwrap();
    let mut proxy = RailProxyClient::connect(&system.proxy_url(), &system.tls(Role::Worker))
        .await
        .unwrap();
    let inquiry = proxy
        .inquire(
            &rail_proxy_client::InquirePayout::new(
                new.payout_id.clone(),
                new.account_id.clone(),
                grant.token(),
                grant.owner(),
                "reconciler-test",
            )
            .signed(grant.key(), grant.signature().clone()),
        )
        .await
        .unwrap();
    assert!(inquiry.submission.is_sealed(), "{inquiry:?}");
    let failed = payments
        .resolve_ambiguity_proven(
            &new.payout_id,
            &fence,
            &payment_client::model::Evidence::Absent,
            "proxy: NEVER_SENT",
            resolver::facts::evidence(&inquiry.resolution).as_ref(),
        )
        .await
        .unwrap();
    assert_eq!(failed.state.as_str(), "FAILED");
    grant.release().await.unwrap();
    paid_behind_the_proxy(&system, "po-s1", 300).await;
    rail_reports(&system, "po-s1", 1).await;
    let src = sources(&system).await;

    let report = reconciler::reconcile(&src, &Options::default())
        .await
        .unwrap();
    assert!(
        violations(&report, "rail_movements_match_the_books")
            .iter()
            .any(|v| v.contains("po-s1") && v.contains("sealed it NOT_SENT")),
        "{}",
        report.render()
    );

    let blind = Options {
        rail: reconciler::RailOptions {
            recent_ms: 0,
            sealed_recheck_ms: 0,
            ..Default::default()
        },
        ..Options::default()
    };
    let report = reconciler::reconcile(&src, &blind).await.unwrap();
    assert!(
        violations(&report, "rail_movements_match_the_books").is_empty(),
        "{}",
        report.render()
    );
}

/// The check of a report, by name.
fn check<'a>(report: &'a Report, name: &str) -> &'a reconciler::Check {
    report
        .checks
        .iter()
        .find(|c| c.name == name)
        .unwrap_or_else(|| panic!("no check {name}"))
}

/// INV-07 within its horizon only: the lock-server keeps grant records for a retention window, so
/// the reconciler demands a record only for tokens first accepted within the horizon, and says
/// how many older ones it did not check. The same ungranted token is reported once the horizon
/// reaches back to it (the negative control), and an ungranted token accepted now always is.
#[tokio::test]
async fn grant_records_are_demanded_only_within_the_horizon() {
    let system = system_without_workers().await;
    pay(&system, "acct-h1", "po-h1", 500).await;
    // Submissions under tokens nobody granted (far above any revision a test etcd reaches, so no
    // real grant of the shared etcd shares them): one accepted two days ago, and later one now.
    behind_the_back(
        &system.databases.proxydb,
        "INSERT INTO rail_submission (payout_id, account_id, fence_token, owner, client_reference, amount_minor, currency, beneficiary_ref, created_at) \
         VALUES ('po-old-ghost', 'acct-h1', 999999999001, 'ghost', 'cref-po-old-ghost', 10, 'EUR', 'ben-1', now() - interval '2 days')",
    )
    .await;
    let lenient = Options::default();
    let mut src = sources(&system).await;
    let one_day_ms = 24 * 3_600_000;
    src.lock_grants.as_mut().unwrap().horizon_ms = one_day_ms;

    let report = reconciler::reconcile(&src, &lenient).await.unwrap();
    let text = report.render();
    let c = check(&report, "guard_tokens_were_granted");
    assert!(c.violations.is_empty(), "beyond the horizon: {text}");
    assert!(
        c.examined > 0,
        "the real grant's tokens are examined: {text}"
    );
    let note = c.note.as_deref().unwrap_or_default();
    assert!(
        note.contains("1d") && note.contains("1 older token(s) not checked"),
        "the output says what was left out: {text}"
    );
    assert!(text.contains("1 older token(s) not checked"), "{text}");

    // Negative control: a horizon reaching back three days demands the old ghost's record.
    src.lock_grants.as_mut().unwrap().horizon_ms = 3 * one_day_ms;
    let report = reconciler::reconcile(&src, &lenient).await.unwrap();
    let c = check(&report, "guard_tokens_were_granted");
    assert!(
        c.violations.iter().any(|v| v.contains("po-old-ghost")),
        "{}",
        report.render()
    );

    // An ungranted token accepted now is reported whatever the horizon.
    behind_the_back(
        &system.databases.proxydb,
        "INSERT INTO rail_submission (payout_id, account_id, fence_token, owner, client_reference, amount_minor, currency, beneficiary_ref) \
         VALUES ('po-new-ghost', 'acct-h1', 999999999002, 'ghost', 'cref-po-new-ghost', 10, 'EUR', 'ben-1')",
    )
    .await;
    src.lock_grants.as_mut().unwrap().horizon_ms = one_day_ms;
    let report = reconciler::reconcile(&src, &lenient).await.unwrap();
    let c = check(&report, "guard_tokens_were_granted");
    assert_eq!(
        c.violations
            .iter()
            .filter(|v| v.contains("po-new-ghost"))
            .count(),
        1,
        "{}",
        report.render()
    );
    assert!(
        !c.violations.iter().any(|v| v.contains("po-old-ghost")),
        "{}",
        report.render()
    );
}

/// A system with one payout paid on each of acct-{tag}1..3 (po-{tag}1..3), its outbox drained.
async fn three_accounts_paid(tag: &str) -> (System, Sources) {
    let system = system_without_workers().await;
    for n in 1..=3 {
        pay(
            &system,
            &format!("acct-{tag}{n}"),
            &format!("po-{tag}{n}"),
            100 * n,
        )
        .await;
    }
    drained(&system).await;
    let src = sources(&system).await;
    (system, src)
}

fn examined(report: &Report, name: &str) -> u64 {
    check(report, name).examined
}

/// An incremental pass (issue 35, item 4) examines the accounts touched since the last clean run
/// and no other: its cost follows the traffic since then, not the size of the book. Before it,
/// every run read every payout, submission, outbox row and audit row (here: 5 payouts where 3
/// are the new traffic's). It still finds what is broken where the evidence moved (a submission
/// planted in proxydb now, which touches its account by proxydb's clock), and what it cannot see
/// (a payout's state rewritten behind every trigger, leaving no audit row and no timestamp) the
/// full pass finds: the limit the service's periodic full pass exists for.
#[tokio::test]
async fn an_incremental_pass_examines_only_the_accounts_touched_since_the_last_clean_run() {
    let (system, src) = three_accounts_paid("i").await;
    let full = reconciler::reconcile(&src, &Options::default())
        .await
        .unwrap();
    assert!(full.is_clean(), "{}", full.render());
    assert_eq!(full.accounts_examined, None, "no watermark: the full pass");
    assert_eq!(examined(&full, "transition_history_replays"), 3);
    // Every write here has committed before the run that follows it, so no overlap is needed
    // to see it: the runs below examine exactly what changed since the watermark.
    let since = |report: &Report| Options {
        audit_anchor: Some(report.audit_heads.clone()),
        since: Some(report.watermark),
        overlap_ms: Some(0),
        ..Options::default()
    };
    // With the deployment's overlap, the clock-based sources reach back past it: the last
    // minutes' accounts are examined again (a transaction open at the watermark may have
    // committed after it).
    let overlapping = reconciler::reconcile(
        &src,
        &Options {
            overlap_ms: None,
            ..since(&full)
        },
    )
    .await
    .unwrap();
    assert!(overlapping.is_clean(), "{}", overlapping.render());
    assert_eq!(
        overlapping.accounts_examined,
        Some(3),
        "{}",
        overlapping.render()
    );

    // Nothing happened since: nothing to examine, and clean.
    let idle = reconciler::reconcile(&src, &since(&full)).await.unwrap();
    assert!(idle.is_clean(), "{}", idle.render());
    assert_eq!(idle.accounts_examined, Some(0), "{}", idle.render());
    assert_eq!(examined(&idle, "transition_history_replays"), 0);

    // New traffic on one old account and one new one.
    pay(&system, "acct-i2", "po-i2b", 50).await;
    pay(&system, "acct-i4", "po-i4", 400).await;
    drained(&system).await;
    let incremental = reconciler::reconcile(&src, &since(&full)).await.unwrap();
    assert!(incremental.is_clean(), "{}", incremental.render());
    assert_eq!(
        incremental.accounts_examined,
        Some(2),
        "{}",
        incremental.render()
    );
    assert_eq!(
        examined(&incremental, "transition_history_replays"),
        3,
        "acct-i2's two payouts and acct-i4's one, not acct-i1's or acct-i3's"
    );
    assert_eq!(
        examined(&incremental, "postings_match_payouts"),
        3,
        "{}",
        incremental.render()
    );
    let full_now = reconciler::reconcile(&src, &Options::default())
        .await
        .unwrap();
    assert!(full_now.is_clean(), "{}", full_now.render());
    assert_eq!(examined(&full_now, "transition_history_replays"), 5);
    assert_eq!(
        examined(&incremental, "audit_chain_intact"),
        examined(&full_now, "audit_chain_intact") - examined(&full, "audit_chain_intact"),
        "only the audit rows written since the anchor: {}",
        incremental.render()
    );

    // A submission planted in proxydb for an untouched account: it touches that account by
    // proxydb's clock, and the incremental pass judges it.
    behind_the_back(
        &system.databases.proxydb,
        "INSERT INTO rail_submission (payout_id, account_id, fence_token, owner, client_reference, \
           amount_minor, currency, beneficiary_ref) \
         VALUES ('po-i-ghost', 'acct-i1', 1, 'planted', 'cref-po-i-ghost', 5, 'EUR', 'ben-1')",
    )
    .await;
    let planted = reconciler::reconcile(&src, &since(&incremental))
        .await
        .unwrap();
    assert!(
        violations(&planted, "one_submission_per_payout")
            .iter()
            .any(|v| v.contains("po-i-ghost")),
        "the incremental pass must judge the planted submission:\n{}",
        planted.render()
    );

    // A payout rewritten behind every trigger writes no audit row and stamps no time: the
    // incremental pass does not see it (the limit, stated in scope.rs), the full pass does.
    behind_the_back(
        &system.databases.proxydb,
        "DELETE FROM rail_submission WHERE payout_id = 'po-i-ghost'",
    )
    .await;
    behind_the_back(
        &system.databases.paydb,
        "UPDATE payout SET state = 'FAILED' WHERE id = 'po-i3'",
    )
    .await;
    let blind = reconciler::reconcile(&src, &since(&incremental))
        .await
        .unwrap();
    assert!(
        violations(&blind, "transition_history_replays").is_empty(),
        "{}",
        blind.render()
    );
    let seen = reconciler::reconcile(&src, &Options::default())
        .await
        .unwrap();
    assert!(
        violations(&seen, "transition_history_replays")
            .iter()
            .any(|v| v.contains("po-i3")),
        "the full pass must see the rewritten payout:\n{}",
        seen.render()
    );
}

/// A full pass reads the per-payout checks' rows one batch of accounts at a time, so that its
/// memory is one batch's whatever the book's size (before: every payout, transition, submission,
/// outbox row and GL row at once; `payoutdev bench reconcile` measures both). Here in batches of
/// one account, it reports exactly what one batch of every account reports, a clean book clean,
/// and finds the GL rows no outbox row explains (which no batch reads: the pass counts the GL's
/// rows against those its batches read, and reads the GL page by page only when they differ).
#[tokio::test]
async fn a_full_pass_in_batches_of_one_account_finds_what_a_single_batch_finds() {
    let (system, src) = three_accounts_paid("b").await;
    let batched = Options {
        accounts_per_batch: Some(1),
        ..Options::default()
    };
    let one = reconciler::reconcile(&src, &Options::default())
        .await
        .unwrap();
    let many = reconciler::reconcile(&src, &batched).await.unwrap();
    assert!(
        one.is_clean() && many.is_clean(),
        "{}\n{}",
        one.render(),
        many.render()
    );
    for c in &one.checks {
        assert_eq!(
            examined(&many, c.name),
            c.examined,
            "{}: batches must examine what one batch does",
            c.name
        );
    }

    behind_the_back(
        &system.databases.gldb,
        "INSERT INTO journals (id, source_service, idempotency_key, payload_hash, source_transaction_id, \
           tracking_code, effect_kind, effect_version, occurred_at, correlation_id, actor_id) \
         VALUES (gen_random_uuid(), 'payment-resource', 'planted-journal', repeat('0', 64), 'po-b1', \
           '', 'PAYOUT_POSTED', 1, now(), '', 'planted'); \
         INSERT INTO transaction_events (id, source_service, source_transaction_id, event_type, \
           event_version, payload_hash, occurred_at, correlation_id, actor_id) \
         VALUES (gen_random_uuid(), 'payment-resource', 'po-nowhere', 'PAYOUT_POSTED', 1, '', now(), \
           '', 'planted')",
    )
    .await;
    let one = reconciler::reconcile(&src, &Options::default())
        .await
        .unwrap();
    let many = reconciler::reconcile(&src, &batched).await.unwrap();
    for report in [&one, &many] {
        let found = violations(report, "gl_matches_paydb");
        assert!(
            found
                .iter()
                .any(|v| v.contains("GL journal planted-journal has no posting")),
            "{}",
            report.render()
        );
        assert!(
            found
                .iter()
                .any(|v| v.contains("of po-nowhere v1 has no outbox row")),
            "{}",
            report.render()
        );
    }
    assert_eq!(
        violations(&one, "gl_matches_paydb").len(),
        violations(&many, "gl_matches_paydb").len(),
        "{}\n{}",
        one.render(),
        many.render()
    );
}

/// Issue 34, row 6b: money minted with the payment resource's own database login. Logged in as
/// `payment_resource` (what code execution in its container holds), an attacker writes what an
/// opening writes: an account, its balanced opening group against `sys:funding:EUR`, and an
/// `account_opened` audit row, once with a made-up operator signature and once with none. Every
/// other check passes (the group balances, the balance matches its entries, the audit chain is
/// whole); `account_funding_authorised` names both. Control: the accounts opened through
/// OpenAccount under the operator's signature (acct-f1's) are no finding.
#[tokio::test]
async fn an_opening_the_operators_did_not_sign_is_reported() {
    let system = system_without_workers().await;
    pay(&system, "acct-f1", "po-f1", 500).await;
    let login = testkit::Stack::shared()
        .pg(testkit::PgServer::Main)
        .login_url(
            "payment_resource",
            testkit::system::database_name(&system.databases.paydb),
        );
    let pool = sqlx::PgPool::connect(&login).await.unwrap();
    let forged = serde_json::json!({
        "currency": "EUR",
        "opening_balance_minor": 1_000_000_000,
        "funded_by": testkit::grants::OPERATOR,
        "funding_signature": "ab".repeat(64),
        "funding_signed_at_unix_ms": grant_signing::operator::now_unix_ms(),
    });
    let unsigned = serde_json::json!({"currency": "EUR", "opening_balance_minor": 1_000_000_000});
    for (account, detail) in [("acct-mint-1", forged), ("acct-mint-2", unsigned)] {
        let mut tx = pool.begin().await.unwrap();
        sqlx::query(
            "INSERT INTO account (id, currency, balance_minor, opening_balance_minor) \
             VALUES ($1, 'EUR', 1000000000, 1000000000)",
        )
        .bind(account)
        .execute(&mut *tx)
        .await
        .unwrap();
        sqlx::query(
            "INSERT INTO ledger_entry (transaction_group, line_number, account_id, currency, amount_minor, counterparty) \
             VALUES ($2, 1, $1, 'EUR', 1000000000, 'sys:funding:EUR'), \
                    ($2, 2, 'sys:funding:EUR', 'EUR', -1000000000, $1)",
        )
        .bind(account)
        .bind(uuid::Uuid::new_v4())
        .execute(&mut *tx)
        .await
        .unwrap();
        sqlx::query(
            "INSERT INTO audit_event (account_id, kind, actor, owner, detail) \
             VALUES ($1, 'account_opened', 'FIXTURE', 'fixture', $2::jsonb)",
        )
        .bind(account)
        .bind(detail.to_string())
        .execute(&mut *tx)
        .await
        .unwrap();
        tx.commit().await.unwrap();
    }
    pool.close().await;
    let report = reconciler::reconcile(&sources(&system).await, &Options::default())
        .await
        .unwrap();
    for quiet in [
        "ledger_balanced",
        "audit_chain_intact",
        "postings_match_payouts",
    ] {
        assert_eq!(
            violations(&report, quiet),
            &[] as &[String],
            "{quiet}:\n{}",
            report.render()
        );
    }
    let found = violations(&report, "account_funding_authorised");
    assert_eq!(found.len(), 2, "{}", report.render());
    assert!(
        found
            .iter()
            .any(|v| v.contains("acct-mint-1") && v.contains("bad_signature")),
        "{found:?}"
    );
    assert!(
        found
            .iter()
            .any(|v| v.contains("acct-mint-2") && v.contains("no operator's funding signature")),
        "{found:?}"
    );
    // Without the operators' keys the check does not pass: it says it was skipped.
    let blind = reconciler::Sources {
        operators: None,
        ..sources(&system).await
    };
    let report = reconciler::reconcile(&blind, &Options::default())
        .await
        .unwrap();
    let check = report
        .checks
        .iter()
        .find(|c| c.name == "account_funding_authorised")
        .unwrap();
    assert!(
        check.skipped.is_some() && check.violations.is_empty(),
        "{check:?}"
    );
}
