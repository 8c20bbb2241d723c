//! The dispatcher between a real paydb (the payment resource's own migrations) and a real GL
//! (gRPC server in-process, its own database), in-process and as a killed process.

use std::time::Duration;
use testkit::pki::{tls, Role};

use outbox_dispatcher::{Config, Dispatcher};
use payout_proto::ledger as pb;
use payout_proto::ledger::general_ledger_service_client::GeneralLedgerServiceClient;
use sqlx::PgPool;
use testkit::{eventually, PgServer, Stack};

const WAIT: Duration = Duration::from_secs(60);

async fn paydb() -> (String, PgPool) {
    let url = Stack::shared().fresh_db(PgServer::Main).await;
    let pool = PgPool::connect(&url).await.unwrap();
    // The single DDL source of ledger_outbox: the payment resource's migrations.
    sqlx::migrate!("../../migrations/paydb")
        .run(&pool)
        .await
        .expect("paydb migrations");
    (url, pool)
}

fn payload(kind: &str, account: &str, key: &str, entries: serde_json::Value) -> serde_json::Value {
    serde_json::json!({
        "source_service": "payment-resource", "idempotency_key": key, "source_transaction_id": format!("tx-{key}"),
        "tracking_code": "trk", "effect_kind": kind, "effect_version": 1, "occurred_at": "2026-03-01T10:00:00Z",
        "correlation_id": "corr", "actor_id": "worker",
        "metadata": {"fencing_token": null, "transaction_group": "00000000-0000-0000-0000-000000000001", "account_id": account, "payout_id": null},
        "entries": entries,
    })
}

fn opening(account: &str, amount: &str) -> (String, serde_json::Value) {
    let key = format!("payment-resource:account:{account}:opening:v1");
    let entries = serde_json::json!([
        {"line_number": 1, "account": {"class": "CUSTOMER_AVAILABLE", "owner_type": "ACCOUNT", "owner_id": account}, "asset": "EUR", "amount": amount, "description": "opening"},
        {"line_number": 2, "account": {"class": "FUNDING", "owner_type": "SYSTEM", "owner_id": "treasury"}, "asset": "EUR", "amount": format!("-{amount}")},
    ]);
    (
        key.clone(),
        payload("ACCOUNT_OPENED", account, &key, entries),
    )
}

fn payout(
    account: &str,
    payout_id: &str,
    debit: &str,
    credit: &str,
) -> (String, serde_json::Value) {
    let key = format!("payment-resource:payout:{payout_id}:posting:v1");
    let entries = serde_json::json!([
        {"line_number": 1, "account": {"class": "CUSTOMER_AVAILABLE", "owner_type": "ACCOUNT", "owner_id": account}, "asset": "EUR", "amount": format!("-{debit}")},
        {"line_number": 2, "account": {"class": "PAYOUT_CLEARING", "owner_type": "SYSTEM", "owner_id": "rail"}, "asset": "EUR", "amount": credit},
    ]);
    (
        key.clone(),
        payload("PAYOUT_POSTED", account, &key, entries),
    )
}

/// A journal row (kind JOURNAL), as the payment resource writes it.
async fn insert(pool: &PgPool, account: &str, row: (String, serde_json::Value)) -> i64 {
    insert_of_kind(pool, account, "JOURNAL", row).await
}

async fn insert_of_kind(
    pool: &PgPool,
    account: &str,
    kind: &str,
    (key, payload): (String, serde_json::Value),
) -> i64 {
    sqlx::query_scalar(
        "INSERT INTO ledger_outbox (account_id, idempotency_key, kind, payload) \
         VALUES ($1, $2, $3, $4) RETURNING id",
    )
    .bind(account)
    .bind(key)
    .bind(kind)
    .bind(payload)
    .fetch_one(pool)
    .await
    .unwrap()
}

/// `accounts` accounts, each with an opening of 100.00 and `payouts` payouts of 1.25.
async fn fill(pool: &PgPool, prefix: &str, accounts: usize, payouts: usize) -> usize {
    for a in 0..accounts {
        let account = format!("{prefix}{a}");
        insert(pool, &account, opening(&account, "100.00")).await;
        for p in 0..payouts {
            insert(
                pool,
                &account,
                payout(&account, &format!("{account}-p{p}"), "1.25", "1.25"),
            )
            .await;
        }
    }
    accounts * (1 + payouts)
}

fn fast(paydb_url: &str, gl: &str, instance: &str) -> Config {
    let mut c = Config::new(paydb_url, gl, tls(Role::OutboxDispatcher), instance);
    c.backoff_base_ms = 50;
    c.backoff_max_ms = 400;
    c.poll_interval_ms = 50;
    c.claim_lease_ms = 2_000;
    c
}

/// A GL of its own (a fresh database) on a free port: its database URL and the running server.
async fn gl() -> (String, general_ledger::Spawned) {
    let gl_url = Stack::shared().fresh_db(PgServer::Main).await;
    let gl = spawn_gl(&gl_url, "127.0.0.1:0".parse().unwrap()).await;
    (gl_url, gl)
}

async fn spawn_gl(gl_url: &str, listen: std::net::SocketAddr) -> general_ledger::Spawned {
    general_ledger::spawn(
        general_ledger::Config::new(gl_url, tls(Role::GeneralLedger)),
        listen,
    )
    .await
    .unwrap()
}

/// The GL as an operator calls it: to read back what arrived, or to repair what was refused.
async fn gl_operator(endpoint: &str) -> GeneralLedgerServiceClient<tonic::transport::Channel> {
    GeneralLedgerServiceClient::new(
        tls(Role::Operator)
            .connect(endpoint, Role::GeneralLedger)
            .await
            .unwrap(),
    )
}

/// The next two alerts, already sent, in outbox order (not the order they were sent in).
fn two_alerts_in_outbox_order(
    alerts: &mut tokio::sync::broadcast::Receiver<outbox_dispatcher::Alert>,
) -> [outbox_dispatcher::Alert; 2] {
    let mut got = [alerts.try_recv().unwrap(), alerts.try_recv().unwrap()];
    got.sort_by_key(|a| a.outbox_id);
    got
}

/// What each outbox row of `account` recorded of the GL, in outbox order: (row, kind, the GL's
/// event or journal id).
async fn recorded_gl_ids(pool: &PgPool, account: &str) -> Vec<(i64, String, Option<String>)> {
    sqlx::query_as(
        "SELECT id, kind, journal_id FROM ledger_outbox WHERE account_id = $1 ORDER BY id",
    )
    .bind(account)
    .fetch_all(pool)
    .await
    .unwrap()
}

async fn count(pool: &PgPool, sql: &str) -> i64 {
    sqlx::query_scalar(sql).fetch_one(pool).await.unwrap()
}

/// Payload columns snapshot: the dispatcher must never change them.
async fn financial_columns(
    pool: &PgPool,
) -> Vec<(
    i64,
    String,
    String,
    serde_json::Value,
    chrono::DateTime<chrono::Utc>,
)> {
    sqlx::query_as("SELECT id, account_id, idempotency_key, payload, created_at FROM ledger_outbox ORDER BY id").fetch_all(pool).await.unwrap()
}

/// Every outbox row's journal is the GL's journal for its key, exactly one per key, and the GL
/// received each account's rows in outbox order.
async fn assert_exactly_once_in_order(paydb: &PgPool, gl_url: &str, rows: usize) {
    let gl = PgPool::connect(gl_url).await.unwrap();
    let journals: Vec<(String, String, i64)> =
        sqlx::query_as("SELECT idempotency_key, id::text, receipt_sequence FROM journals")
            .fetch_all(&gl)
            .await
            .unwrap();
    assert_eq!(journals.len(), rows, "one journal per row, no duplicate");
    let by_key: std::collections::HashMap<String, (String, i64)> = journals
        .into_iter()
        .map(|(k, id, s)| (k, (id, s)))
        .collect();
    let outbox: Vec<(i64, String, String, Option<String>)> = sqlx::query_as(
        "SELECT id, account_id, idempotency_key, journal_id FROM ledger_outbox ORDER BY id",
    )
    .fetch_all(paydb)
    .await
    .unwrap();
    let mut last_sequence: std::collections::HashMap<String, i64> = Default::default();
    for (id, account, key, journal_id) in outbox {
        let (gl_id, sequence) = by_key
            .get(&key)
            .unwrap_or_else(|| panic!("row {id} reached the GL"));
        assert_eq!(
            journal_id.as_deref(),
            Some(gl_id.as_str()),
            "row {id} records the GL's journal"
        );
        let previous = last_sequence
            .insert(account.clone(), *sequence)
            .unwrap_or(0);
        assert!(
            *sequence > previous,
            "account {account}: row {id} arrived after its predecessor"
        );
    }
    gl.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gl_down_for_a_while_then_up_every_row_arrives_exactly_once() {
    let (paydb_url, paydb) = paydb().await;
    let gl_url = Stack::shared().fresh_db(PgServer::Main).await;
    let port = testkit::free_port();
    let rows = fill(&paydb, "acc", 5, 3).await;
    let before = financial_columns(&paydb).await;

    let dispatcher = Dispatcher::new(
        fast(&paydb_url, &format!("https://127.0.0.1:{port}"), "d1"),
        &service_kit::Metrics::default(),
    )
    .await
    .unwrap();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let run = tokio::spawn(async move {
        dispatcher
            .run(async {
                let _ = stopped.await;
            })
            .await;
    });
    // The GL is down: the heads are retried with growing delays, nothing is delivered or dropped.
    eventually(WAIT, "retries while the GL is down", || {
        let paydb = paydb.clone();
        async move {
            let retried = count(
                &paydb,
                "SELECT count(*) FROM ledger_outbox WHERE attempts >= 3 AND last_error IS NOT NULL",
            )
            .await;
            (retried >= 5).then_some(())
        }
    })
    .await
    .unwrap();
    assert_eq!(count(&paydb, "SELECT count(*) FROM ledger_outbox WHERE delivered_at IS NOT NULL OR quarantined_at IS NOT NULL").await, 0);

    let gl = spawn_gl(&gl_url, format!("127.0.0.1:{port}").parse().unwrap()).await;
    eventually(WAIT, "every row delivered", || {
        let paydb = paydb.clone();
        async move {
            (count(
                &paydb,
                "SELECT count(*) FROM ledger_outbox WHERE delivered_at IS NULL",
            )
            .await
                == 0)
                .then_some(())
        }
    })
    .await
    .unwrap();
    assert_exactly_once_in_order(&paydb, &gl_url, rows).await;
    assert_eq!(
        financial_columns(&paydb).await,
        before,
        "payload columns untouched"
    );
    let mut client = gl_operator(&gl.endpoint()).await;
    let balance = client
        .get_balance(pb::GetBalanceRequest {
            account: Some(pb::AccountRef {
                class: "CUSTOMER_AVAILABLE".into(),
                owner_type: "ACCOUNT".into(),
                owner_id: "acc0".into(),
            }),
            asset: "EUR".into(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(balance.balance, "96.25");
    let _ = stop.send(());
    run.await.unwrap();
    gl.stop().await.unwrap();
}

/// A lifecycle event row of payout `payout_id` (kind TRANSACTION_EVENT), as the payment resource
/// writes it.
fn lifecycle(
    account: &str,
    payout_id: &str,
    event_type: &str,
    version: u32,
) -> (String, serde_json::Value) {
    let key = format!("payment-resource:payout:{payout_id}:event:v{version}");
    let payload = serde_json::json!({
        "source_service": "payment-resource", "idempotency_key": key, "source_transaction_id": payout_id,
        "event_type": event_type, "event_version": version,
        "occurred_at": format!("2026-03-01T10:00:{:02}Z", version), "correlation_id": payout_id,
        "actor_id": "worker-a",
        "metadata": {"account_id": account, "payout_id": payout_id, "to_state": event_type},
    });
    (key, payload)
}

async fn insert_event(pool: &PgPool, account: &str, row: (String, serde_json::Value)) -> i64 {
    insert_of_kind(pool, account, "TRANSACTION_EVENT", row).await
}

/// Rounds until nothing is left to deliver (quarantined rows and the rows they hold aside).
async fn drain(dispatcher: &Dispatcher) {
    for _ in 0..100 {
        if dispatcher.run_once().await.unwrap().claimed == 0 {
            return;
        }
    }
    panic!("the outbox did not drain in 100 rounds");
}

/// Issue 19: a payout's lifecycle reaches the GL through the same outbox as its journal. The
/// TRANSACTION_EVENT rows are delivered by AppendTransactionEvent and the JOURNAL rows by
/// AppendJournal, in one per-account order (each row after its predecessor committed in the GL),
/// each with its outbox id as the source sequence; a delivered row records the GL's event or
/// journal id; the posting's journal carries its settlement references as fields. Every row
/// delivered again (the dispatcher died before recording) comes back as the same event or
/// journal: nothing new in the GL. An event the GL refuses for its content (no version; another
/// payload under a recorded version) is quarantined with an alert and holds its account's later
/// rows, as a journal does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_payouts_lifecycle_events_reach_the_gl_in_order_with_versions_and_source_order() {
    let (paydb_url, paydb) = paydb().await;
    let (gl_url, gl) = gl().await;
    let mut ids = vec![insert(&paydb, "acc", opening("acc", "100.00")).await];
    let steps = [
        "PAYOUT_CREATED",
        "PAYOUT_CLAIMED",
        "PAYOUT_SUBMITTED",
        "PAYOUT_ACKNOWLEDGED",
    ];
    for (n, step) in steps.iter().enumerate() {
        ids.push(insert_event(&paydb, "acc", lifecycle("acc", "p-1", step, n as u32 + 1)).await);
        // Another account's rows interleave in the outbox: they have their own order.
        insert_event(
            &paydb,
            "other",
            lifecycle("other", "q-1", step, n as u32 + 1),
        )
        .await;
    }
    let (key, mut posting) = payout("acc", "p-1", "1.25", "1.25");
    posting["settlement_reference"] = "rail-ref-1".into();
    posting["client_reference"] = "cref-p-1".into();
    posting["source_transaction_id"] = "p-1".into();
    let posting_id = insert(&paydb, "acc", (key.clone(), posting)).await;
    ids.push(posting_id);
    ids.push(insert_event(&paydb, "acc", lifecycle("acc", "p-1", "PAYOUT_POSTED", 5)).await);
    let before = financial_columns(&paydb).await;

    let metrics = service_kit::Metrics::default();
    let dispatcher = Dispatcher::new(fast(&paydb_url, &gl.endpoint(), "d1"), &metrics)
        .await
        .unwrap();
    drain(&dispatcher).await;
    assert_eq!(
        count(
            &paydb,
            "SELECT count(*) FROM ledger_outbox WHERE delivered_at IS NULL"
        )
        .await,
        0
    );
    let gl_db = PgPool::connect(&gl_url).await.unwrap();
    let events = |payout: &'static str| {
        let gl_db = gl_db.clone();
        async move {
            sqlx::query_as::<_, (String, String, i32, Option<i64>)>(
                "SELECT id::text, event_type, event_version, source_sequence FROM transaction_events \
                 WHERE source_service = 'payment-resource' AND source_transaction_id = $1 ORDER BY event_version",
            )
            .bind(payout)
            .fetch_all(&gl_db)
            .await
            .unwrap()
        }
    };
    let p1 = events("p-1").await;
    let event_rows: Vec<i64> = ids
        .iter()
        .copied()
        .filter(|id| *id != ids[0] && *id != posting_id)
        .collect();
    assert_eq!(
        p1.iter()
            .map(|(_, t, v, s)| (t.as_str(), *v, *s))
            .collect::<Vec<_>>(),
        [
            ("PAYOUT_CREATED", 1, Some(event_rows[0])),
            ("PAYOUT_CLAIMED", 2, Some(event_rows[1])),
            ("PAYOUT_SUBMITTED", 3, Some(event_rows[2])),
            ("PAYOUT_ACKNOWLEDGED", 4, Some(event_rows[3])),
            ("PAYOUT_POSTED", 5, Some(event_rows[4])),
        ],
        "every step, its version, its outbox row as the source order"
    );
    assert_eq!(events("q-1").await.len(), 4);
    // Each delivered row records what the GL recorded: the event's id, or the journal's.
    let recorded = recorded_gl_ids(&paydb, "acc").await;
    let event_ids: Vec<&str> = p1.iter().map(|(id, ..)| id.as_str()).collect();
    let recorded_events: Vec<&str> = recorded
        .iter()
        .filter(|(_, kind, _)| kind == "TRANSACTION_EVENT")
        .map(|(_, _, j)| j.as_deref().unwrap())
        .collect();
    assert_eq!(recorded_events, event_ids);
    // The account's rows reached the GL in outbox order, journals and events alike.
    let receipt: Vec<(String, chrono::DateTime<chrono::Utc>)> = sqlx::query_as(
        "SELECT id::text, recorded_at FROM journals \
         UNION ALL SELECT id::text, recorded_at FROM transaction_events",
    )
    .fetch_all(&gl_db)
    .await
    .unwrap();
    let at: std::collections::HashMap<String, chrono::DateTime<chrono::Utc>> =
        receipt.into_iter().collect();
    let times: Vec<chrono::DateTime<chrono::Utc>> = recorded
        .iter()
        .map(|(id, _, j)| {
            *at.get(j.as_deref().unwrap())
                .unwrap_or_else(|| panic!("row {id} in the GL"))
        })
        .collect();
    assert!(
        times.windows(2).all(|w| w[0] < w[1]),
        "in outbox order: {times:?}"
    );
    // Events are no money: the GL holds the two journals of the account, no more.
    assert_eq!(count(&gl_db, "SELECT count(*) FROM journals").await, 2);
    // The posting's journal, read back: the references and the source order as fields.
    let mut client = gl_operator(&gl.endpoint()).await;
    let journal = client
        .get_journal(pb::GetJournalRequest {
            key: Some(pb::get_journal_request::Key::IdempotencyKey(key.clone())),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        (
            journal.source_sequence,
            journal.settlement_reference.as_str(),
            journal.client_reference.as_str()
        ),
        (posting_id as u64, "rail-ref-1", "cref-p-1")
    );

    // Delivered again, every row (as after a dispatcher that died before recording): the same
    // events and journals, nothing new.
    let gl_rows =
        "SELECT (SELECT count(*) FROM journals) + (SELECT count(*) FROM transaction_events)";
    let gl_before = count(&gl_db, gl_rows).await;
    let redelivered = sqlx::query(
        "UPDATE ledger_outbox SET delivered_at = NULL, journal_id = NULL, next_attempt_at = now()",
    )
    .execute(&paydb)
    .await
    .unwrap()
    .rows_affected();
    drain(&dispatcher).await;
    assert_eq!(
        count(&gl_db, gl_rows).await,
        gl_before,
        "no second event or journal"
    );
    let again = recorded_gl_ids(&paydb, "acc").await;
    assert_eq!(again, recorded, "the same GL ids recorded again");
    assert!(
        metrics.render().contains(&format!(
            "outbox_delivered_total{{created=\"false\"}} {redelivered}"
        )),
        "{}",
        metrics.render()
    );
    assert_eq!(events("p-1").await, p1, "the first source order stays");

    // Refused for its content: quarantined, alerted, holding the account's later rows.
    let mut alerts = dispatcher.subscribe_alerts();
    let (key, mut no_version) = lifecycle("bad", "r-1", "PAYOUT_CREATED", 1);
    no_version["event_version"] = 0.into();
    let unversioned = insert_event(&paydb, "bad", (key, no_version)).await;
    let held = insert_event(&paydb, "bad", lifecycle("bad", "r-1", "PAYOUT_CLAIMED", 2)).await;
    // p-1's version 2 again under another key, saying something else: a conflict in the GL.
    let (_, mut conflicting) = lifecycle("acc", "p-1", "PAYOUT_FAILED", 2);
    conflicting["idempotency_key"] = "payment-resource:payout:p-1:event:v2-again".into();
    let conflict = insert_event(
        &paydb,
        "acc",
        (
            "payment-resource:payout:p-1:event:v2-again".into(),
            conflicting,
        ),
    )
    .await;
    drain(&dispatcher).await;
    let got = two_alerts_in_outbox_order(&mut alerts);
    assert_eq!(
        got.iter()
            .map(|a| (a.outbox_id, a.reason.as_str()))
            .collect::<Vec<_>>(),
        [
            (unversioned, "MISSING_SOURCE_IDENTITY"),
            (conflict, "IDEMPOTENCY_CONFLICT")
        ]
    );
    assert!(
        got[1].detail.contains(event_ids[1]),
        "names the original event: {}",
        got[1].detail
    );
    let held_state: (
        Option<chrono::DateTime<chrono::Utc>>,
        Option<chrono::DateTime<chrono::Utc>>,
    ) = sqlx::query_as("SELECT delivered_at, quarantined_at FROM ledger_outbox WHERE id = $1")
        .bind(held)
        .fetch_one(&paydb)
        .await
        .unwrap();
    assert_eq!(
        held_state,
        (None, None),
        "held behind the quarantined event"
    );
    assert_eq!(
        events("p-1").await,
        p1,
        "the conflicting event wrote nothing"
    );
    assert_eq!(
        &financial_columns(&paydb).await[..before.len()],
        &before[..],
        "payload columns untouched"
    );
    gl.stop().await.unwrap();
}

/// A release of a quarantined row, as the payment resource's ReplayQuarantined makes it (paydb's
/// `replay_quarantined`; here as the test's superuser, the operator already certified).
async fn replay(paydb: &PgPool, id: i64, operator: &str, reason: &str) -> Result<i64, sqlx::Error> {
    sqlx::query_scalar("SELECT replay_quarantined($1, $2, $3)")
        .bind(id)
        .bind(operator)
        .bind(reason)
        .fetch_one(paydb)
        .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn poison_rows_are_quarantined_with_an_alert_the_rest_flow_and_replay_works_after_a_fix() {
    let (paydb_url, paydb) = paydb().await;
    let (_, gl) = gl().await;
    let healthy = fill(&paydb, "ok", 3, 2).await;
    // Poison 1: a payout of an account the GL has never seen (its opening never came): fixable.
    let unknown = insert(&paydb, "ghost", payout("ghost", "ghost-p0", "2.00", "2.00")).await;
    let held = insert(&paydb, "ghost", payout("ghost", "ghost-p1", "3.00", "3.00")).await;
    // Poison 2: unbalanced content: never fixable, stays quarantined.
    let unbalanced = insert(&paydb, "bad", payout("bad", "bad-p0", "2.00", "1.99")).await;
    let before = financial_columns(&paydb).await;

    let metrics = service_kit::Metrics::default();
    let dispatcher = Dispatcher::new(fast(&paydb_url, &gl.endpoint(), "d1"), &metrics)
        .await
        .unwrap();
    let mut alerts = dispatcher.subscribe_alerts();
    for _ in 0..20 {
        dispatcher.run_once().await.unwrap();
    }
    let got = two_alerts_in_outbox_order(&mut alerts);
    assert_eq!(
        (got[0].outbox_id, got[0].reason.as_str()),
        (unknown, "UNKNOWN_ACCOUNT")
    );
    assert_eq!(
        (got[1].outbox_id, got[1].reason.as_str()),
        (unbalanced, "UNBALANCED")
    );
    assert!(metrics
        .render()
        .contains("outbox_quarantined_total{reason=\"UNKNOWN_ACCOUNT\"} 1"));
    // The backlog's gauges (the alerts OutboxQuarantineNotEmpty and OutboxBacklogOld): two rows
    // quarantined, the one held behind the first still pending, as old as its insert.
    let backlog = dispatcher.measure_backlog().await.unwrap();
    assert_eq!((backlog.quarantined_rows, backlog.pending_rows), (2, 1));
    assert!(backlog.oldest_pending_age_seconds > 0.0, "{backlog:?}");
    let rendered = metrics.render();
    assert!(rendered.contains("outbox_quarantined_rows 2"), "{rendered}");
    assert!(rendered.contains("outbox_pending_rows 1"), "{rendered}");
    // The rest flowed; the row behind the poison waits (per-account order), it is not quarantined.
    assert_eq!(
        count(
            &paydb,
            "SELECT count(*) FROM ledger_outbox WHERE delivered_at IS NOT NULL"
        )
        .await,
        healthy as i64
    );
    let listed = outbox_dispatcher::list_quarantined(&paydb).await.unwrap();
    assert_eq!(
        listed
            .iter()
            .map(|q| (q.id, q.held_rows))
            .collect::<Vec<_>>(),
        [(unknown, 1), (unbalanced, 0)]
    );
    let held_state: (Option<chrono::DateTime<chrono::Utc>>, i32) =
        sqlx::query_as("SELECT quarantined_at, attempts FROM ledger_outbox WHERE id = $1")
            .bind(held)
            .fetch_one(&paydb)
            .await
            .unwrap();
    assert_eq!(held_state, (None, 0), "never sent ahead of its predecessor");

    // Replay without a fix: quarantined again, with another alert.
    replay(&paydb, unbalanced, "op-1", "retry").await.unwrap();
    dispatcher.run_once().await.unwrap();
    assert_eq!(alerts.try_recv().unwrap().outbox_id, unbalanced);
    // The fix: the operator opens the missing account in the GL; then replay delivers both rows in order.
    let mut client = gl_operator(&gl.endpoint()).await;
    client
        .open_account(pb::OpenAccountRequest {
            account: Some(pb::AccountRef {
                class: "CUSTOMER_AVAILABLE".into(),
                owner_type: "ACCOUNT".into(),
                owner_id: "ghost".into(),
            }),
            asset: "EUR".into(),
        })
        .await
        .unwrap();
    assert!(matches!(
        replay(&paydb, held, "op-1", "not quarantined").await,
        Err(sqlx::Error::Database(e)) if e.code().as_deref() == Some("P0002")
    ));
    replay(&paydb, unknown, "op-1", "account opened in GL")
        .await
        .unwrap();
    // Each replay left its durable record (who, why, and the error it was quarantined with); the
    // refused one (not quarantined) none.
    let replays: Vec<(i64, String, String, bool)> = sqlx::query_as(
        "SELECT outbox_id, operator_id, reason, last_error IS NOT NULL FROM outbox_replay ORDER BY id",
    )
    .fetch_all(&paydb)
    .await
    .unwrap();
    assert_eq!(
        replays,
        [
            (unbalanced, "op-1".into(), "retry".into(), true),
            (unknown, "op-1".into(), "account opened in GL".into(), true),
        ]
    );
    let tampered = sqlx::query("DELETE FROM outbox_replay")
        .execute(&paydb)
        .await;
    assert!(tampered.is_err(), "the replay record is append-only");
    for _ in 0..5 {
        dispatcher.run_once().await.unwrap();
    }
    let delivered: Vec<i64> = sqlx::query_scalar("SELECT id FROM ledger_outbox WHERE account_id = 'ghost' AND delivered_at IS NOT NULL ORDER BY delivered_at")
        .fetch_all(&paydb)
        .await
        .unwrap();
    assert_eq!(delivered, [unknown, held]);
    assert_eq!(
        outbox_dispatcher::list_quarantined(&paydb)
            .await
            .unwrap()
            .len(),
        1,
        "only the unfixable row remains"
    );
    assert_eq!(
        financial_columns(&paydb).await,
        before,
        "payload columns untouched"
    );
    gl.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dispatcher_killed_mid_batch_loses_nothing_and_duplicates_nothing() {
    let (paydb_url, paydb) = paydb().await;
    let (gl_url, gl) = gl().await;
    // The accounts' openings first, delivered before the GL is held; their payouts are written
    // once it is held, so a batch of payout journals is surely in flight (before, all 36 rows were
    // written at once and the test relied on the dispatcher being too slow to deliver them all
    // before the hold: recording a batch in one statement made it fast enough to lose that race).
    let first_rows = fill(&paydb, "k", 12, 0).await;
    let dir = tempfile::tempdir().unwrap();
    let spawn = |instance: &str, metrics_port: u16| {
        let spec = testkit::ProcessSpec::new(
            instance,
            env!("CARGO_BIN_EXE_outbox-dispatcher"),
            dir.path().join(format!("{instance}.log")),
        )
        .args([
            "--database-url",
            &paydb_url,
            "run",
            "--gl-endpoint",
            &gl.endpoint(),
            "--instance-id",
            instance,
        ])
        .args([
            "--metrics-listen",
            &format!("127.0.0.1:{metrics_port}"),
            "--batch-size",
            "6",
            "--claim-lease-ms",
            "1500",
        ])
        .args(["--backoff-max-ms", "400", "--poll-interval-ms", "50"])
        // The GL delivery alone: this suite starts no payout workflow.
        .arg("--without-workflow-starts")
        .args(
            testkit::pki::shared()
                .issue(Role::OutboxDispatcher, instance)
                .unwrap()
                .to_args(),
        );
        testkit::ManagedProcess::start(spec).unwrap()
    };
    let first = spawn("d1", testkit::free_port());
    eventually(WAIT, "first deliveries", || {
        let paydb = paydb.clone();
        async move {
            (count(
                &paydb,
                "SELECT count(*) FROM ledger_outbox WHERE delivered_at IS NOT NULL",
            )
            .await
                == first_rows as i64)
                .then_some(())
        }
    })
    .await
    .unwrap();
    // Hold every GL post at its first lock (as a mode change in progress would), so the next batch
    // is claimed and in flight inside the GL when the dispatcher dies.
    let gl_owner = PgPool::connect(&gl_url).await.unwrap();
    let mut blocker = gl_owner.begin().await.unwrap();
    sqlx::query("SELECT pg_advisory_xact_lock($1)")
        .bind(general_ledger::store::MODE_LOCK_KEY)
        .execute(&mut *blocker)
        .await
        .unwrap();
    for a in 0..12 {
        let account = format!("k{a}");
        for p in 0..2 {
            let id = format!("{account}-p{p}");
            insert(&paydb, &account, payout(&account, &id, "1.25", "1.25")).await;
        }
    }
    let rows = first_rows + 24;
    eventually(WAIT, "a batch in flight inside the GL", || {
        let gl_owner = gl_owner.clone();
        let paydb = paydb.clone();
        async move {
            let waiting = count(&gl_owner, "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted").await;
            let claimed = count(&paydb, "SELECT count(*) FROM ledger_outbox WHERE claimed_by = 'd1' AND delivered_at IS NULL").await;
            (waiting >= 1 && claimed >= 1).then_some(())
        }
    })
    .await
    .unwrap();
    // Freeze the dispatcher with its calls open, let the GL finish them, then kill it before it
    // can record anything: the GL holds journals that paydb does not know were delivered.
    first.pause().unwrap();
    let stranded = count(
        &paydb,
        "SELECT count(*) FROM ledger_outbox WHERE claimed_by = 'd1' AND delivered_at IS NULL",
    )
    .await;
    let recorded = count(
        &paydb,
        "SELECT count(*) FROM ledger_outbox WHERE delivered_at IS NOT NULL",
    )
    .await;
    assert!(stranded >= 1, "a claimed, unrecorded batch");
    blocker.commit().await.unwrap();
    eventually(WAIT, "the GL commits the frozen dispatcher's posts", || {
        let gl_owner = gl_owner.clone();
        async move {
            (count(&gl_owner, "SELECT count(*) FROM journals").await >= recorded + stranded)
                .then_some(())
        }
    })
    .await
    .unwrap();
    first.kill().unwrap();
    assert_eq!(
        count(
            &paydb,
            "SELECT count(*) FROM ledger_outbox WHERE claimed_by = 'd1' AND delivered_at IS NULL"
        )
        .await,
        stranded,
        "the dead dispatcher recorded nothing more"
    );

    let metrics_port = testkit::free_port();
    let second = spawn("d2", metrics_port);
    eventually(WAIT, "every row delivered after the restart", || {
        let paydb = paydb.clone();
        async move {
            (count(
                &paydb,
                "SELECT count(*) FROM ledger_outbox WHERE delivered_at IS NULL",
            )
            .await
                == 0)
                .then_some(())
        }
    })
    .await
    .unwrap();
    assert_exactly_once_in_order(&paydb, &gl_url, rows).await;
    // The re-delivered rows whose journals the GL had already written came back as identical retries.
    let (_, metrics) =
        testkit::util::http_get(metrics_port, "/metrics", Duration::from_secs(5)).unwrap();
    assert!(
        metrics.contains("outbox_delivered_total{created=\"false\"}"),
        "{metrics}"
    );
    second.terminate().unwrap();
    gl.stop().await.unwrap();
}
