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

async fn insert(pool: &PgPool, account: &str, (key, payload): (String, serde_json::Value)) -> i64 {
    sqlx::query_scalar("INSERT INTO ledger_outbox (account_id, idempotency_key, payload) VALUES ($1, $2, $3) RETURNING id")
        .bind(account)
        .bind(key)
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

    let gl = general_ledger::spawn(
        general_ledger::Config::new(&gl_url, tls(Role::GeneralLedger)),
        format!("127.0.0.1:{port}").parse().unwrap(),
    )
    .await
    .unwrap();
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
    let mut client = GeneralLedgerServiceClient::new(
        tls(Role::Operator)
            .connect(&gl.endpoint(), Role::GeneralLedger)
            .await
            .unwrap(),
    );
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn poison_rows_are_quarantined_with_an_alert_the_rest_flow_and_replay_works_after_a_fix() {
    let (paydb_url, paydb) = paydb().await;
    let gl_url = Stack::shared().fresh_db(PgServer::Main).await;
    let gl = general_ledger::spawn(
        general_ledger::Config::new(&gl_url, tls(Role::GeneralLedger)),
        "127.0.0.1:0".parse().unwrap(),
    )
    .await
    .unwrap();
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
    let mut got = [alerts.try_recv().unwrap(), alerts.try_recv().unwrap()];
    got.sort_by_key(|a| a.outbox_id);
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
    outbox_dispatcher::replay(&paydb, unbalanced, "op-1", "retry")
        .await
        .unwrap();
    dispatcher.run_once().await.unwrap();
    assert_eq!(alerts.try_recv().unwrap().outbox_id, unbalanced);
    // The fix: the operator opens the missing account in the GL; then replay delivers both rows in order.
    let mut client = GeneralLedgerServiceClient::new(
        tls(Role::Operator)
            .connect(&gl.endpoint(), Role::GeneralLedger)
            .await
            .unwrap(),
    );
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
        outbox_dispatcher::replay(&paydb, held, "op-1", "not quarantined").await,
        Err(outbox_dispatcher::DispatchError::NotQuarantined { .. })
    ));
    outbox_dispatcher::replay(&paydb, unknown, "op-1", "account opened in GL")
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
    let gl_url = Stack::shared().fresh_db(PgServer::Main).await;
    let gl = general_ledger::spawn(
        general_ledger::Config::new(&gl_url, tls(Role::GeneralLedger)),
        "127.0.0.1:0".parse().unwrap(),
    )
    .await
    .unwrap();
    let rows = fill(&paydb, "k", 12, 2).await;
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
                >= 6)
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
