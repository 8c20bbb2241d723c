//! The GL against a real PostgreSQL, over real gRPC (server in-process on a free port).

use std::time::Duration;

use general_ledger::{projection, Spawned};
use payout_proto::ledger as pb;
use payout_proto::ledger::general_ledger_service_client::GeneralLedgerServiceClient;
use payout_proto::ledger::RejectionReason as R;
use proptest::prelude::*;
use rust_decimal::Decimal;
use testkit::{PgServer, Stack};
use tonic::transport::Channel;

type Client = GeneralLedgerServiceClient<Channel>;

async fn start() -> (Spawned, Client, String) {
    let url = Stack::shared().fresh_db(PgServer::Main).await;
    let server = general_ledger::spawn(&url, "127.0.0.1:0".parse().unwrap())
        .await
        .expect("GL starts");
    let client = GeneralLedgerServiceClient::connect(server.endpoint())
        .await
        .expect("connect");
    (server, client, url)
}

fn acct(class: &str, owner_type: &str, owner_id: &str) -> pb::AccountRef {
    pb::AccountRef {
        class: class.into(),
        owner_type: owner_type.into(),
        owner_id: owner_id.into(),
    }
}

fn customer(id: &str) -> pb::AccountRef {
    acct("CUSTOMER_AVAILABLE", "ACCOUNT", id)
}

fn clearing() -> pb::AccountRef {
    acct("PAYOUT_CLEARING", "SYSTEM", "rail")
}

fn entry(line: u32, account: pb::AccountRef, asset: &str, amount: &str) -> pb::EntryInput {
    pb::EntryInput {
        line_number: line,
        account: Some(account),
        asset: asset.into(),
        amount: amount.into(),
        description: String::new(),
    }
}

fn journal(key: &str, entries: Vec<pb::EntryInput>) -> pb::AppendJournalRequest {
    pb::AppendJournalRequest {
        source_service: "payment-resource".into(),
        idempotency_key: key.into(),
        source_transaction_id: format!("tx-{key}"),
        tracking_code: "trk".into(),
        effect_kind: "PAYOUT_POSTED".into(),
        effect_version: 1,
        occurred_at: "2026-03-01T10:00:00.123456Z".into(),
        correlation_id: "corr".into(),
        actor_id: "worker".into(),
        metadata_json: r#"{"fencing_token":7}"#.into(),
        entries,
        reversal_of: String::new(),
        correction: None,
    }
}

fn payout(key: &str, account: &str, amount: &str) -> pb::AppendJournalRequest {
    journal(
        key,
        vec![
            entry(1, customer(account), "EUR", &format!("-{amount}")),
            entry(2, clearing(), "EUR", amount),
        ],
    )
}

async fn open(client: &mut Client, account: pb::AccountRef, asset: &str) {
    client
        .open_account(pb::OpenAccountRequest {
            account: Some(account),
            asset: asset.into(),
        })
        .await
        .expect("open account");
}

fn reason(status: &tonic::Status) -> R {
    let r: pb::Rejection = service_kit::rejection::decode(status)
        .unwrap_or_else(|| panic!("typed rejection in {status:?}"));
    R::try_from(r.reason).unwrap()
}

async fn journal_count(url: &str) -> i64 {
    let pool = sqlx::PgPool::connect(url).await.unwrap();
    let n: i64 = sqlx::query_scalar(
        "SELECT (SELECT count(*) FROM journals) + (SELECT count(*) FROM entries)",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    pool.close().await;
    n
}

async fn balance(
    client: &mut Client,
    account: pb::AccountRef,
    asset: &str,
) -> pb::GetBalanceResponse {
    client
        .get_balance(pb::GetBalanceRequest {
            account: Some(account),
            asset: asset.into(),
        })
        .await
        .unwrap()
        .into_inner()
}

#[tokio::test]
async fn bad_inputs_each_get_their_own_rejection_and_write_nothing() {
    let (server, mut client, url) = start().await;
    open(&mut client, customer("a1"), "EUR").await;
    open(&mut client, customer("usd-only"), "USD").await;
    let mutate = |f: &dyn Fn(&mut pb::AppendJournalRequest)| {
        let mut r = payout("bad", "a1", "12.34");
        f(&mut r);
        r
    };
    let cases: Vec<(&str, pb::AppendJournalRequest, R)> = vec![
        (
            "unbalanced",
            mutate(&|r| r.entries[1].amount = "12.33".into()),
            R::Unbalanced,
        ),
        (
            "unbalanced per asset",
            mutate(&|r| {
                r.entries[1].asset = "USD".into();
            }),
            R::Unbalanced,
        ),
        (
            "zero entry",
            mutate(&|r| r.entries.push(entry(3, clearing(), "EUR", "0.00"))),
            R::ZeroAmount,
        ),
        (
            "19 fractional digits",
            mutate(&|r| {
                r.entries[0].amount = "-0.0000000000000000001".into();
                r.entries[1].amount = "0.0000000000000000001".into();
            }),
            R::PrecisionExceeded,
        ),
        (
            "out of range",
            mutate(&|r| {
                r.entries[0].amount = "-123456789012345678901".into();
                r.entries[1].amount = "123456789012345678901".into();
            }),
            R::AmountOutOfRange,
        ),
        (
            "float exponent",
            mutate(&|r| r.entries[0].amount = "-1.234e1".into()),
            R::NonCanonicalAmount,
        ),
        (
            "locale format",
            mutate(&|r| r.entries[0].amount = "-12,34".into()),
            R::NonCanonicalAmount,
        ),
        (
            "leading plus",
            mutate(&|r| r.entries[1].amount = "+12.34".into()),
            R::NonCanonicalAmount,
        ),
        (
            "leading zero",
            mutate(&|r| r.entries[1].amount = "012.34".into()),
            R::NonCanonicalAmount,
        ),
        (
            "unknown account",
            mutate(&|r| {
                r.entries[0].account = Some(customer("nobody"));
            }),
            R::UnknownAccount,
        ),
        (
            "unknown class",
            mutate(&|r| r.entries[0].account = Some(acct("PETTY_CASH", "ACCOUNT", "a1"))),
            R::UnknownAccount,
        ),
        (
            "account of another asset",
            mutate(&|r| r.entries[0].account = Some(customer("usd-only"))),
            R::AccountAssetMismatch,
        ),
        (
            "duplicate line numbers",
            mutate(&|r| r.entries[1].line_number = 1),
            R::DuplicateLineNumber,
        ),
        (
            "missing source service",
            mutate(&|r| r.source_service.clear()),
            R::MissingSourceIdentity,
        ),
        (
            "missing idempotency key",
            mutate(&|r| r.idempotency_key.clear()),
            R::MissingSourceIdentity,
        ),
        (
            "missing source transaction",
            mutate(&|r| r.source_transaction_id.clear()),
            R::MissingSourceIdentity,
        ),
        (
            "no entries",
            mutate(&|r| r.entries.clear()),
            R::EmptyJournal,
        ),
        (
            "unknown reversal target",
            mutate(&|r| r.reversal_of = uuid::Uuid::new_v4().to_string()),
            R::ReversalTargetUnknown,
        ),
        (
            "bad time",
            mutate(&|r| r.occurred_at = "yesterday".into()),
            R::InvalidField,
        ),
    ];
    let before = journal_count(&url).await;
    for (name, request, expected) in cases {
        let status = client.append_journal(request).await.expect_err(name);
        assert_eq!(reason(&status), expected, "{name}: {status:?}");
    }
    assert_eq!(journal_count(&url).await, before, "nothing written");
    // The control: the same request without the defect is accepted.
    assert!(
        client
            .append_journal(payout("good", "a1", "12.34"))
            .await
            .unwrap()
            .into_inner()
            .created
    );
    server.stop().await.unwrap();
}

#[tokio::test]
async fn idempotency_same_payload_same_journal_changed_payload_conflicts_concurrent_creates_one() {
    let (server, mut client, url) = start().await;
    open(&mut client, customer("a1"), "EUR").await;
    let first = client
        .append_journal(payout("k1", "a1", "10.00"))
        .await
        .unwrap()
        .into_inner();
    assert!(first.created);
    // Same content, other spelling of the amount: the identical retry returns the original.
    let again = client
        .append_journal(payout("k1", "a1", "10"))
        .await
        .unwrap()
        .into_inner();
    assert!(!again.created);
    assert_eq!(again.journal, first.journal);
    // Changed payload: conflict naming the original.
    let status = client
        .append_journal(payout("k1", "a1", "10.01"))
        .await
        .unwrap_err();
    assert_eq!(reason(&status), R::IdempotencyConflict);
    let detail: pb::Rejection = service_kit::rejection::decode(&status).unwrap();
    assert_eq!(
        detail.existing_journal_id,
        first.journal.as_ref().unwrap().journal_id
    );

    // Concurrent identical requests: exactly one journal.
    let mut tasks = Vec::new();
    for _ in 0..16 {
        let mut c = client.clone();
        tasks.push(tokio::spawn(async move {
            c.append_journal(payout("k2", "a1", "1.00"))
                .await
                .map(|r| r.into_inner())
        }));
    }
    let mut ids = std::collections::HashSet::new();
    let mut created = 0;
    for t in tasks {
        let r = t.await.unwrap().expect("every identical request succeeds");
        created += r.created as usize;
        ids.insert(r.journal.unwrap().journal_id);
    }
    assert_eq!((created, ids.len()), (1, 1));
    let pool = sqlx::PgPool::connect(&url).await.unwrap();
    let n: i64 = sqlx::query_scalar("SELECT count(*) FROM journals WHERE idempotency_key = 'k2'")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(n, 1);
    server.stop().await.unwrap();
}

#[tokio::test]
async fn journals_are_append_only_for_the_service_role_and_the_owner() {
    let (server, mut client, url) = start().await;
    open(&mut client, customer("a1"), "EUR").await;
    let j = client
        .append_journal(payout("k1", "a1", "5.00"))
        .await
        .unwrap()
        .into_inner()
        .journal
        .unwrap();
    let owner = sqlx::PgPool::connect(&url).await.unwrap();
    let app = general_ledger::app_pool(&url).await.unwrap();
    for statement in [
        "UPDATE entries SET amount = 1 WHERE line_number = 1",
        "DELETE FROM entries",
        "UPDATE journals SET actor_id = 'x'",
        "DELETE FROM journals",
        "TRUNCATE entries",
        "UPDATE ledger_accounts SET owner_id = 'x'",
        "DELETE FROM operating_mode_changes",
    ] {
        let as_owner = sqlx::query(statement)
            .execute(&owner)
            .await
            .expect_err(statement)
            .to_string();
        assert!(
            as_owner.contains("append-only"),
            "{statement} as owner: {as_owner}"
        );
        let as_app = sqlx::query(statement)
            .execute(&app)
            .await
            .expect_err(statement)
            .to_string();
        assert!(
            as_app.contains("permission denied") || as_app.contains("append-only"),
            "{statement} as gl_app: {as_app}"
        );
    }
    // Direct SQL cannot add an unbalanced line or a line to an existing journal either.
    let add = format!(
        "INSERT INTO entries (journal_id, line_number, account_id, asset_id, amount) SELECT '{}', 9, account_id, asset_id, 1 FROM entries LIMIT 1",
        j.journal_id
    );
    assert!(sqlx::query(&add)
        .execute(&owner)
        .await
        .unwrap_err()
        .to_string()
        .contains("unbalanced"));
    // Control: the projection is the one mutable table, so the same statement kinds work there...
    sqlx::query("UPDATE account_balances SET balance = balance + 1")
        .execute(&owner)
        .await
        .unwrap();
    // ...and the rebuild finds and repairs exactly that drift.
    let report = projection::rebuild(&app).await.unwrap();
    assert!(!report.drift.is_empty(), "corrupted projection is reported");
    assert!(
        projection::rebuild(&app).await.unwrap().drift.is_empty(),
        "repaired"
    );
    let b = balance(&mut client, customer("a1"), "EUR").await;
    assert_eq!(
        (b.balance.as_str(), b.projected_balance.as_str()),
        ("-5", "-5")
    );
    server.stop().await.unwrap();
}

#[tokio::test]
async fn reversals_must_mirror_exactly_once_and_modes_are_audited() {
    let (server, mut client, url) = start().await;
    open(&mut client, customer("a1"), "EUR").await;
    let original = client
        .append_journal(payout("p1", "a1", "7.50"))
        .await
        .unwrap()
        .into_inner()
        .journal
        .unwrap();
    let reversal = |key: &str, amount: &str| {
        let mut r = journal(
            key,
            vec![
                entry(1, customer("a1"), "EUR", amount),
                entry(2, clearing(), "EUR", &format!("-{amount}")),
            ],
        );
        r.reversal_of = original.journal_id.clone();
        r.effect_kind = "PAYOUT_REVERSED".into();
        r
    };
    let status = client
        .append_journal(reversal("r0", "7.49"))
        .await
        .unwrap_err();
    assert_eq!(reason(&status), R::ReversalNotMirror);
    let first = client
        .append_journal(reversal("r1", "7.5"))
        .await
        .unwrap()
        .into_inner()
        .journal
        .unwrap();
    assert_eq!(first.reversal_of, original.journal_id);
    let status = client
        .append_journal(reversal("r2", "7.50"))
        .await
        .unwrap_err();
    assert_eq!(reason(&status), R::AlreadyReversed);
    assert_eq!(
        balance(&mut client, customer("a1"), "EUR").await.balance,
        "0"
    );

    // Modes: RECONCILE accepts only approved corrections; DEGRADED_LEDGER is refused and audited.
    let set = |mode: pb::OperatingMode| pb::SetOperatingModeRequest {
        mode: mode as i32,
        operator_id: "op-1".into(),
        reason: "drill".into(),
    };
    let state = client
        .set_operating_mode(set(pb::OperatingMode::Reconcile))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        (state.mode, state.changed_by.as_str()),
        (pb::OperatingMode::Reconcile as i32, "op-1")
    );
    let status = client
        .append_journal(payout("p2", "a1", "1.00"))
        .await
        .unwrap_err();
    assert_eq!(reason(&status), R::ModeRefused);
    let mut correction = payout("c1", "a1", "1.00");
    correction.correction = Some(pb::CorrectionApproval {
        approved_by: "controller".into(),
        approval_reference: "CHG-1".into(),
    });
    assert!(
        client
            .append_journal(correction)
            .await
            .unwrap()
            .into_inner()
            .created
    );
    let status = client
        .set_operating_mode(set(pb::OperatingMode::DegradedLedger))
        .await
        .unwrap_err();
    assert_eq!(reason(&status), R::ModeNotActivated);
    let mut no_operator = set(pb::OperatingMode::Mirror);
    no_operator.operator_id.clear();
    assert_eq!(
        reason(&client.set_operating_mode(no_operator).await.unwrap_err()),
        R::InvalidField
    );
    client
        .set_operating_mode(set(pb::OperatingMode::Mirror))
        .await
        .unwrap();
    assert!(
        client
            .append_journal(payout("p2", "a1", "1.00"))
            .await
            .unwrap()
            .into_inner()
            .created
    );
    let pool = sqlx::PgPool::connect(&url).await.unwrap();
    let audit: Vec<(String, String)> = sqlx::query_as(
        "SELECT mode, operator_id FROM operating_mode_changes ORDER BY change_sequence",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    assert_eq!(
        audit.iter().map(|a| a.0.as_str()).collect::<Vec<_>>(),
        ["MIRROR", "RECONCILE", "MIRROR"]
    );
    let refusals: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM operating_mode_refusals WHERE requested = 'DEGRADED_LEDGER'",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(refusals, 1);

    // Listing: paged, receipt order, filtered.
    let mut seen = Vec::new();
    let mut token = String::new();
    loop {
        let page = client
            .list_entries(pb::ListEntriesRequest {
                account: Some(customer("a1")),
                asset: "EUR".into(),
                page_size: 2,
                page_token: token,
                ..Default::default()
            })
            .await
            .unwrap()
            .into_inner();
        seen.extend(
            page.entries
                .iter()
                .map(|e| (e.receipt_sequence, e.amount.clone())),
        );
        if page.next_page_token.is_empty() {
            break;
        }
        token = page.next_page_token;
    }
    assert_eq!(
        seen.iter().map(|s| s.1.as_str()).collect::<Vec<_>>(),
        ["-7.5", "7.5", "-1", "-1"]
    );
    assert!(seen.windows(2).all(|w| w[0].0 < w[1].0));
    server.stop().await.unwrap();
}

/// Writers posting concurrently between overlapping accounts, in both directions and with the
/// lines in different orders: no deadlock (every request succeeds), exact balances.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn overlapping_concurrent_writers_do_not_deadlock_and_balances_are_exact() {
    let (server, mut client, url) = start().await;
    const ACCOUNTS: usize = 4;
    const WRITERS: usize = 8;
    const JOURNALS_PER_WRITER: usize = 15;
    for i in 0..ACCOUNTS {
        open(&mut client, customer(&format!("c{i}")), "EUR").await;
    }
    let mut tasks = Vec::new();
    for w in 0..WRITERS {
        let mut c = client.clone();
        tasks.push(tokio::spawn(async move {
            for n in 0..JOURNALS_PER_WRITER {
                let from = (w + n) % ACCOUNTS;
                let to = (w + n + 1 + w % 2) % ACCOUNTS;
                // Three lines touching three accounts, listed in writer-dependent order.
                let mut lines = vec![
                    (customer(&format!("c{from}")), "-3.00"),
                    (customer(&format!("c{to}")), "2.00"),
                    (clearing(), "1.00"),
                ];
                if w % 2 == 1 {
                    lines.reverse();
                }
                let entries = lines
                    .into_iter()
                    .enumerate()
                    .map(|(i, (a, amt))| entry(i as u32 + 1, a, "EUR", amt))
                    .collect();
                c.append_journal(journal(&format!("w{w}-n{n}"), entries))
                    .await
                    .expect("no deadlock, no failure");
            }
        }));
    }
    tokio::time::timeout(Duration::from_secs(120), futures::future::join_all(tasks))
        .await
        .expect("writers finish");
    let mut expected = [Decimal::ZERO; ACCOUNTS];
    for w in 0..WRITERS {
        for n in 0..JOURNALS_PER_WRITER {
            expected[(w + n) % ACCOUNTS] -= Decimal::new(3, 0);
            expected[(w + n + 1 + w % 2) % ACCOUNTS] += Decimal::new(2, 0);
        }
    }
    for (i, want) in expected.iter().enumerate() {
        let b = balance(&mut client, customer(&format!("c{i}")), "EUR").await;
        assert_eq!(b.balance.parse::<Decimal>().unwrap(), *want, "c{i}");
        assert_eq!(b.projected_balance, b.balance, "projection in step");
    }
    let b = balance(&mut client, clearing(), "EUR").await;
    assert_eq!(
        b.balance.parse::<Decimal>().unwrap(),
        Decimal::from((WRITERS * JOURNALS_PER_WRITER) as i64)
    );
    let app = general_ledger::app_pool(&url).await.unwrap();
    assert!(projection::rebuild(&app).await.unwrap().drift.is_empty());
    server.stop().await.unwrap();
}

#[derive(Debug, Clone)]
struct Leg {
    account: usize,
    asset: usize,
    /// In units of 10^-scale.
    mantissa: i64,
    scale: u32,
}

const PROP_ASSETS: [&str; 3] = ["EUR", "USD", "BTC"];
const PROP_ACCOUNTS: usize = 3;

fn journals_strategy() -> impl Strategy<Value = Vec<(Vec<Leg>, bool)>> {
    let leg = (
        0..PROP_ACCOUNTS,
        0..PROP_ASSETS.len(),
        1i64..1_000_000_000,
        0u32..=18,
    )
        .prop_map(|(account, asset, mantissa, scale)| Leg {
            account,
            asset,
            mantissa,
            scale,
        });
    prop::collection::vec((prop::collection::vec(leg, 1..4), any::<bool>()), 1..6)
}

/// Random multi-asset journals (each leg balanced by a counter-leg on the clearing account of its
/// asset) and reversals of some of them.
#[test]
fn property_random_balanced_journals_and_reversals() {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let (server, client, url) = runtime.block_on(async {
        let (server, mut client, url) = start().await;
        for asset in PROP_ASSETS {
            for i in 0..PROP_ACCOUNTS {
                open(&mut client, customer(&format!("p{i}")), asset).await;
            }
            open(&mut client, clearing(), asset).await;
        }
        (server, client, url)
    });
    let app = runtime.block_on(general_ledger::app_pool(&url)).unwrap();
    let case = std::sync::atomic::AtomicU32::new(0);
    let config = ProptestConfig {
        cases: 12,
        failure_persistence: None,
        ..ProptestConfig::default()
    };
    proptest!(config, |(journals in journals_strategy())| {
        let case = case.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        runtime.block_on(async {
            let mut client = client.clone();
            for (n, (legs, reverse)) in journals.iter().enumerate() {
                let mut entries = Vec::new();
                for leg in legs {
                    let amount = Decimal::new(leg.mantissa, leg.scale);
                    let asset = PROP_ASSETS[leg.asset];
                    let line = entries.len() as u32 + 1;
                    entries.push(entry(line, customer(&format!("p{}", leg.account)), asset, &(-amount).to_string()));
                    entries.push(entry(line + 1, clearing(), asset, &amount.to_string()));
                }
                let key = format!("prop-{case}-{n}");
                let j = client.append_journal(journal(&key, entries.clone())).await.expect("balanced journal accepted").into_inner();
                if *reverse {
                    let mirrored = entries.iter().map(|e| {
                        let a: Decimal = e.amount.parse().unwrap();
                        entry(e.line_number, e.account.clone().unwrap(), &e.asset, &(-a).to_string())
                    }).collect();
                    let mut r = journal(&format!("{key}-rev"), mirrored);
                    r.reversal_of = j.journal.unwrap().journal_id;
                    client.append_journal(r).await.expect("exact mirror accepted");
                }
            }
            let pool = sqlx::PgPool::connect(&url).await.unwrap();
            // Every journal balances per asset.
            let unbalanced: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM (SELECT journal_id, asset_id FROM entries GROUP BY 1, 2 HAVING sum(amount) <> 0) u",
            ).fetch_one(&pool).await.unwrap();
            assert_eq!(unbalanced, 0);
            // Every balance equals the sum of its entries (computed here independently).
            for asset in PROP_ASSETS {
                for account in (0..PROP_ACCOUNTS).map(|i| customer(&format!("p{i}"))).chain([clearing()]) {
                    let b = balance(&mut client, account.clone(), asset).await;
                    let listed = client.list_entries(pb::ListEntriesRequest {
                        account: Some(account.clone()), asset: asset.into(), ..Default::default()
                    }).await.unwrap().into_inner();
                    assert!(listed.next_page_token.is_empty(), "small enough for one page");
                    let sum: Decimal = listed.entries.iter().map(|e| e.amount.parse::<Decimal>().unwrap()).sum();
                    assert_eq!(b.balance.parse::<Decimal>().unwrap(), sum);
                    assert_eq!(b.projected_balance, b.balance);
                }
            }
            // Rebuilding the projection changes nothing.
            let report = projection::rebuild(&app).await.unwrap();
            assert!(report.drift.is_empty(), "{report:?}");
            pool.close().await;
        });
    });
    runtime.block_on(server.stop()).unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn benchmark_reports_both_sides() {
    let url = Stack::shared().fresh_db(PgServer::Main).await;
    let report = general_ledger::bench::run(&url, 200, 4)
        .await
        .expect("bench runs");
    println!("{}", serde_json::to_string_pretty(&report).unwrap());
    assert_eq!(report.append_journal_grpc.journals, 200);
    assert_eq!(report.plain_sql.journals, 200);
    assert!(report.ratio > 0.0);
}
