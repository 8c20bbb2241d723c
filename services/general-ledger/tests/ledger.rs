//! The GL against a real PostgreSQL, over real gRPC (server in-process on a free port).

use std::time::Duration;

use general_ledger::{projection, Spawned};
use payout_proto::ledger as pb;
use payout_proto::ledger::general_ledger_service_client::GeneralLedgerServiceClient;
use payout_proto::ledger::RejectionReason as R;
use proptest::prelude::*;
use rust_decimal::Decimal;
use testkit::pki::{tls, Role};
use testkit::{PgServer, Stack};
use tonic::transport::Channel;

type Client = GeneralLedgerServiceClient<Channel>;

async fn start() -> (Spawned, Client, String) {
    start_with(|c| c).await
}

async fn start_with(
    configure: impl FnOnce(general_ledger::Config) -> general_ledger::Config,
) -> (Spawned, Client, String) {
    let url = Stack::shared().fresh_db(PgServer::Main).await;
    // The suite calls as dispatcher and as operator from one client, an operator's certificate
    // (the permissive table lets it append; a mode change must name the operator it carries,
    // `testkit::pki::TEST_OPERATOR`); the binary's real table is exercised by the dispatcher's
    // suite and the system and attack suites.
    let config = configure(
        general_ledger::Config::new(&url, tls(Role::GeneralLedger))
            .with_policy_for_tests(testkit::pki::every_role(&general_ledger::authz::POLICY)),
    );
    let server = general_ledger::spawn(config, "127.0.0.1:0".parse().unwrap())
        .await
        .expect("GL starts");
    let client = GeneralLedgerServiceClient::new(
        tls(Role::Operator)
            .connect(&server.endpoint(), Role::GeneralLedger)
            .await
            .expect("connect"),
    );
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
        ..Default::default()
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

/// `n` identical appends sent at once, each on a clone of `client`: how many answered that they
/// created it, and how many distinct ids (journal or event) they answered with. Every append must
/// succeed; `every_succeeds` is what a failure says.
async fn identical_at_once<Append, Answer>(
    client: &Client,
    n: usize,
    every_succeeds: &str,
    append: Append,
) -> (usize, usize)
where
    Append: Fn(Client) -> Answer,
    Answer: std::future::Future<Output = Result<(bool, String), tonic::Status>> + Send + 'static,
{
    let tasks: Vec<_> = (0..n)
        .map(|_| tokio::spawn(append(client.clone())))
        .collect();
    let mut ids = std::collections::HashSet::new();
    let mut created = 0;
    for t in tasks {
        let (was_created, id) = t.await.unwrap().expect(every_succeeds);
        created += was_created as usize;
        ids.insert(id);
    }
    (created, ids.len())
}

/// The journal the GL answers `request` with (created, or the original of an identical retry).
async fn append(client: &mut Client, request: pb::AppendJournalRequest) -> pb::Journal {
    client
        .append_journal(request)
        .await
        .unwrap()
        .into_inner()
        .journal
        .unwrap()
}

/// What a posting's journal carries beside its content: the source's position, the rail's
/// settlement reference and the client's reference.
fn source_and_references(journal: &pb::Journal) -> (u64, &str, &str) {
    (
        journal.source_sequence,
        journal.settlement_reference.as_str(),
        journal.client_reference.as_str(),
    )
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
        // Found by the wire property test: each of these failed as UNAVAILABLE (a storage
        // error) instead of naming its field.
        (
            "NUL in text",
            mutate(&|r| r.source_service = "payment\0resource".into()),
            R::InvalidField,
        ),
        (
            "NUL in metadata",
            mutate(&|r| r.metadata_json = r#"{"a":"\u0000"}"#.into()),
            R::InvalidField,
        ),
        (
            "NUL in an account",
            mutate(&|r| r.entries[0].account = Some(customer("a1\0"))),
            R::InvalidField,
        ),
        (
            "effect version above int32",
            mutate(&|r| r.effect_version = i32::MAX as u32 + 1),
            R::InvalidField,
        ),
        (
            "line number above int32",
            mutate(&|r| r.entries[1].line_number = u32::MAX),
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

/// Every amount fits numeric(38,18), but a balance that would leave it is refused, typed
/// (AMOUNT_OUT_OF_RANGE, FAILED_PRECONDITION), with nothing written; before, the projection's
/// numeric overflow surfaced as UNAVAILABLE. Control: a journal that keeps the balance in range
/// is accepted.
#[tokio::test]
async fn a_balance_beyond_numeric_38_18_is_refused_typed_and_writes_nothing() {
    const AMOUNT_MAX: &str = "99999999999999999999";
    let (server, mut client, url) = start().await;
    open(&mut client, customer("big"), "EUR").await;
    open(&mut client, clearing(), "EUR").await;
    client
        .append_journal(payout("big-1", "big", AMOUNT_MAX))
        .await
        .expect("one maximal amount fits");
    let before = journal_count(&url).await;
    let status = client
        .append_journal(payout("big-2", "big", AMOUNT_MAX))
        .await
        .expect_err("the clearing balance would be 2 x 10^20 - 2");
    assert_eq!(reason(&status), R::AmountOutOfRange, "{status:?}");
    assert_eq!(status.code(), tonic::Code::FailedPrecondition);
    assert_eq!(journal_count(&url).await, before, "nothing written");
    let back = client
        .append_journal(journal(
            "big-3",
            vec![
                entry(1, customer("big"), "EUR", AMOUNT_MAX),
                entry(2, clearing(), "EUR", &format!("-{AMOUNT_MAX}")),
            ],
        ))
        .await
        .expect("a journal that brings the balance back is accepted");
    assert!(back.into_inner().created);
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
    let (created, ids) = identical_at_once(
        &client,
        16,
        "every identical request succeeds",
        |mut c| async move {
            c.append_journal(payout("k2", "a1", "1.00"))
                .await
                .map(|r| r.into_inner())
                .map(|r| (r.created, r.journal.unwrap().journal_id))
        },
    )
    .await;
    assert_eq!((created, ids), (1, 1));
    let pool = sqlx::PgPool::connect(&url).await.unwrap();
    let n: i64 = sqlx::query_scalar("SELECT count(*) FROM journals WHERE idempotency_key = 'k2'")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(n, 1);
    server.stop().await.unwrap();
}

fn event(payout: &str, event_type: &str, version: u32) -> pb::AppendTransactionEventRequest {
    pb::AppendTransactionEventRequest {
        source_service: "payment-resource".into(),
        source_transaction_id: payout.into(),
        event_type: event_type.into(),
        event_version: version,
        occurred_at: "2026-03-01T10:00:00.123456Z".into(),
        correlation_id: payout.into(),
        actor_id: "worker-a".into(),
        metadata_json: r#"{"from_state":"PENDING","to_state":"CLAIMED","fencing_token":7}"#.into(),
        source_sequence: u64::from(version) + 40,
    }
}

/// Lifecycle events (spec 002 `transaction_events`): idempotent on (source service, source
/// transaction, event version). An identical retry answers the original event, even from another
/// source position (delivery metadata: the first one stays); the same key with other content is
/// IDEMPOTENCY_CONFLICT naming the original and writes nothing; concurrent identical appends make
/// one event; an event creates no journal and no entry; its source order is stored; a version 0,
/// a position beyond `bigint` and a missing identity are refused typed.
#[tokio::test]
async fn transaction_events_are_idempotent_by_source_and_version_and_a_changed_event_conflicts() {
    let (server, mut client, url) = start().await;
    let first = client
        .append_transaction_event(event("p-1", "PAYOUT_CLAIMED", 2))
        .await
        .unwrap()
        .into_inner();
    assert!(first.created);
    assert!(!first.recorded_at.is_empty());
    // The same event again, delivered from another position: the original, unchanged.
    let mut redelivered = event("p-1", "PAYOUT_CLAIMED", 2);
    redelivered.source_sequence = 99;
    // Another spelling of the same metadata and time is the same content.
    redelivered.metadata_json =
        r#"{"fencing_token":7,"to_state":"CLAIMED","from_state":"PENDING"}"#.into();
    redelivered.occurred_at = "2026-03-01T11:00:00.123456+01:00".into();
    let again = client
        .append_transaction_event(redelivered)
        .await
        .unwrap()
        .into_inner();
    assert!(!again.created);
    assert_eq!(
        (again.event_id.as_str(), again.recorded_at.as_str()),
        (first.event_id.as_str(), first.recorded_at.as_str())
    );
    // The same key with other content: a conflict naming the original, nothing written.
    let pool = sqlx::PgPool::connect(&url).await.unwrap();
    let events = |pool: sqlx::PgPool| async move {
        sqlx::query_as::<_, (String, String, i32, Option<i64>)>(
            "SELECT id::text, event_type, event_version, source_sequence FROM transaction_events \
             WHERE source_service = 'payment-resource' AND source_transaction_id = 'p-1' ORDER BY event_version",
        )
        .fetch_all(&pool)
        .await
        .unwrap()
    };
    let before = events(pool.clone()).await;
    for changed in [
        event("p-1", "PAYOUT_FAILED", 2),
        pb::AppendTransactionEventRequest {
            actor_id: "worker-b".into(),
            ..event("p-1", "PAYOUT_CLAIMED", 2)
        },
        pb::AppendTransactionEventRequest {
            metadata_json: r#"{"fencing_token":8}"#.into(),
            ..event("p-1", "PAYOUT_CLAIMED", 2)
        },
        pb::AppendTransactionEventRequest {
            occurred_at: "2026-03-01T10:00:01Z".into(),
            ..event("p-1", "PAYOUT_CLAIMED", 2)
        },
    ] {
        let status = client.append_transaction_event(changed).await.unwrap_err();
        assert_eq!(reason(&status), R::IdempotencyConflict);
        let detail: pb::Rejection = service_kit::rejection::decode(&status).unwrap();
        assert_eq!(detail.existing_journal_id, first.event_id);
    }
    assert_eq!(
        events(pool.clone()).await,
        before,
        "a conflict wrote nothing"
    );
    assert_eq!(
        before,
        [(first.event_id.clone(), "PAYOUT_CLAIMED".into(), 2, Some(42))],
        "the first delivery's source position stays"
    );

    // Concurrent identical appends of a new version: one event.
    let (created, ids) = identical_at_once(
        &client,
        12,
        "every identical append succeeds",
        |mut c| async move {
            c.append_transaction_event(event("p-1", "PAYOUT_SUBMITTED", 3))
                .await
                .map(|r| r.into_inner())
                .map(|r| (r.created, r.event_id))
        },
    )
    .await;
    assert_eq!((created, ids), (1, 1));
    // The same version of another payout is another event.
    assert!(
        client
            .append_transaction_event(event("p-2", "PAYOUT_CLAIMED", 2))
            .await
            .unwrap()
            .into_inner()
            .created
    );
    assert_eq!(
        events(pool.clone())
            .await
            .iter()
            .map(|(_, t, v, s)| (t.as_str(), *v, *s))
            .collect::<Vec<_>>(),
        [
            ("PAYOUT_CLAIMED", 2, Some(42)),
            ("PAYOUT_SUBMITTED", 3, Some(43))
        ]
    );
    // Non-monetary: no journal, no entry.
    assert_eq!(journal_count(&url).await, 0);

    // Refused, typed, naming the field, writing nothing.
    let count = |pool: sqlx::PgPool| async move {
        sqlx::query_scalar::<_, i64>("SELECT count(*) FROM transaction_events")
            .fetch_one(&pool)
            .await
            .unwrap()
    };
    let stored = count(pool.clone()).await;
    for (bad, want, field) in [
        (
            event("p-3", "PAYOUT_CLAIMED", 0),
            R::MissingSourceIdentity,
            "event_version",
        ),
        (
            pb::AppendTransactionEventRequest {
                source_sequence: i64::MAX as u64 + 1,
                ..event("p-3", "PAYOUT_CLAIMED", 1)
            },
            R::InvalidField,
            "source_sequence",
        ),
        (
            event("", "PAYOUT_CLAIMED", 1),
            R::MissingSourceIdentity,
            "source_transaction_id",
        ),
        (event("p-3", "", 1), R::MissingSourceIdentity, "event_type"),
        (
            pb::AppendTransactionEventRequest {
                occurred_at: String::new(),
                ..event("p-3", "PAYOUT_CLAIMED", 1)
            },
            R::InvalidField,
            "occurred_at",
        ),
    ] {
        let status = client.append_transaction_event(bad).await.unwrap_err();
        let detail: pb::Rejection = service_kit::rejection::decode(&status).unwrap();
        assert_eq!((reason(&status), detail.field.as_str()), (want, field));
    }
    assert_eq!(count(pool.clone()).await, stored);
    server.stop().await.unwrap();
}

/// A posted payout's journal carries its settlement references as fields (the rail's reference,
/// the client reference) and the source's order beside the receipt order, and GetJournal (by id
/// and by idempotency key) returns them as appended. A retry from another source position is the
/// same journal with its first position; a retry with another settlement reference is a
/// conflict. A journal without the new fields (the shape before them) reads back empty and zero,
/// and its retry with a source position is the same journal (the position is outside the hash).
#[tokio::test]
async fn get_journal_returns_the_settlement_references_and_the_source_order() {
    let (server, mut client, _url) = start().await;
    open(&mut client, customer("a1"), "EUR").await;
    let settled = pb::AppendJournalRequest {
        source_sequence: 41,
        settlement_reference: "rail-ref-7".into(),
        client_reference: "cref-p-7".into(),
        ..payout("payment-resource:payout:p-7:posting:v1", "a1", "10.00")
    };
    let appended = append(&mut client, settled.clone()).await;
    assert_eq!(
        source_and_references(&appended),
        (41, "rail-ref-7", "cref-p-7")
    );
    assert!(appended.receipt_sequence > 0);
    for key in [
        pb::get_journal_request::Key::JournalId(appended.journal_id.clone()),
        pb::get_journal_request::Key::IdempotencyKey(settled.idempotency_key.clone()),
    ] {
        let read = client
            .get_journal(pb::GetJournalRequest { key: Some(key) })
            .await
            .unwrap()
            .into_inner();
        assert_eq!(read, appended, "GetJournal answers the journal as appended");
    }
    // Redelivered from another position: the same journal, the first position.
    let again = client
        .append_journal(pb::AppendJournalRequest {
            source_sequence: 77,
            ..settled.clone()
        })
        .await
        .unwrap()
        .into_inner();
    assert!(!again.created);
    assert_eq!(again.journal.as_ref(), Some(&appended));
    // Another settlement reference under the key: a conflict.
    let status = client
        .append_journal(pb::AppendJournalRequest {
            settlement_reference: "rail-ref-8".into(),
            ..settled.clone()
        })
        .await
        .unwrap_err();
    assert_eq!(reason(&status), R::IdempotencyConflict);
    // Without the references: another content too (they are in the hash once given).
    let status = client
        .append_journal(pb::AppendJournalRequest {
            settlement_reference: String::new(),
            client_reference: String::new(),
            ..settled.clone()
        })
        .await
        .unwrap_err();
    assert_eq!(reason(&status), R::IdempotencyConflict);

    // The shape before the new fields: empty, zero, and its hash is the one it always had
    // (`validate::tests::a_journal_without_the_new_fields_keeps_the_hash_it_always_had`).
    let old_shape = payout("k-old", "a1", "1.00");
    let old = append(&mut client, old_shape.clone()).await;
    assert_eq!(source_and_references(&old), (0, "", ""));
    assert_eq!(
        old.payload_hash,
        general_ledger::validate::validate(&old_shape)
            .unwrap()
            .payload_hash
    );
    let positioned = client
        .append_journal(pb::AppendJournalRequest {
            source_sequence: 5,
            ..old_shape
        })
        .await
        .unwrap()
        .into_inner();
    assert!(!positioned.created, "the source position is not content");
    assert_eq!(positioned.journal.unwrap().source_sequence, 0);
    let missing = client
        .get_journal(pb::GetJournalRequest {
            key: Some(pb::get_journal_request::Key::IdempotencyKey(
                "no-such-key".into(),
            )),
        })
        .await
        .unwrap_err();
    assert_eq!(reason(&missing), R::NotFound);
    server.stop().await.unwrap();
}

#[tokio::test]
async fn journals_are_append_only_for_the_service_role_and_the_owner() {
    let (server, mut client, url) = start().await;
    open(&mut client, customer("a1"), "EUR").await;
    let j = append(&mut client, payout("k1", "a1", "5.00")).await;
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
    let original = append(&mut client, payout("p1", "a1", "7.50")).await;
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
    let first = append(&mut client, reversal("r1", "7.5")).await;
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
        operator_id: testkit::pki::TEST_OPERATOR.into(),
        reason: "drill".into(),
    };
    let state = client
        .set_operating_mode(set(pb::OperatingMode::Reconcile))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        (state.mode, state.changed_by.as_str()),
        (
            pb::OperatingMode::Reconcile as i32,
            testkit::pki::TEST_OPERATOR
        )
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
    // The operator recorded is the one the certificate carries: another name is refused and the
    // mode stays (the same call under the certificate's own name, below, is carried out).
    let mut someone_else = set(pb::OperatingMode::Mirror);
    someone_else.operator_id = "another-operator".into();
    let status = client.set_operating_mode(someone_else).await.unwrap_err();
    assert_eq!(status.code(), tonic::Code::PermissionDenied, "{status:?}");
    assert!(
        status.message().contains("operator_not_certified"),
        "{status:?}"
    );
    assert_eq!(
        client
            .get_operating_mode(pb::GetOperatingModeRequest {})
            .await
            .unwrap()
            .into_inner()
            .mode,
        pb::OperatingMode::Reconcile as i32
    );
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

/// Negative control of the certified-operator check in `reversals_must_mirror_exactly_once_and_modes_are_audited`:
/// with the check switched off in-process, the same operator certificate naming another operator
/// changes the mode, and the audit records the name it could not prove: the test above sees what
/// it claims to.
#[tokio::test]
async fn negative_control_without_operator_certification_another_name_changes_the_mode() {
    let (_server, mut client, url) =
        start_with(general_ledger::Config::without_operator_certification_for_tests).await;
    let state = client
        .set_operating_mode(pb::SetOperatingModeRequest {
            mode: pb::OperatingMode::Reconcile as i32,
            operator_id: "another-operator".into(),
            reason: "drill".into(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        (state.mode, state.changed_by.as_str()),
        (pb::OperatingMode::Reconcile as i32, "another-operator")
    );
    let pool = sqlx::PgPool::connect(&url).await.unwrap();
    let recorded: String = sqlx::query_scalar(
        "SELECT operator_id FROM operating_mode_changes ORDER BY change_sequence DESC LIMIT 1",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(recorded, "another-operator");
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

// ---------------------------------------------------------------------------------------------
// The boundary under arbitrary wire values (issue 14, item 4)

/// The gldb tables a call may write.
const GLDB_TABLES: [&str; 7] = [
    "ledger_accounts",
    "journals",
    "entries",
    "account_balances",
    "transaction_events",
    "operating_mode_changes",
    "operating_mode_refusals",
];

/// One call of `ledger.v1.GeneralLedgerService`, with whatever field values.
#[derive(Debug, Clone)]
enum LedgerCall {
    AppendJournal(pb::AppendJournalRequest),
    AppendTransactionEvent(pb::AppendTransactionEventRequest),
    OpenAccount(pb::OpenAccountRequest),
    GetJournal(pb::GetJournalRequest),
    ListEntries(pb::ListEntriesRequest),
    GetBalance(pb::GetBalanceRequest),
    SetOperatingMode(pb::SetOperatingModeRequest),
    GetOperatingMode,
}

mod ledger_values {
    use super::{clearing, customer, pb};
    use proptest::prelude::*;
    use rust_decimal::Decimal;
    use testkit::wire::{hostile_text, hostile_u32};

    const TEXT_LENGTH_MAX: usize = general_ledger::validate::TEXT_LENGTH_MAX;

    pub fn text(valid: &'static str) -> BoxedStrategy<String> {
        hostile_text(valid.boxed(), TEXT_LENGTH_MAX)
    }
    pub fn asset() -> BoxedStrategy<String> {
        hostile_text(
            prop::sample::select(vec!["EUR", "EUR", "USD", "BTC1", "eur"])
                .prop_map(String::from)
                .boxed(),
            12,
        )
    }
    /// The accounts opened before the cases run, or a reference with arbitrary parts, or none.
    pub fn account() -> BoxedStrategy<Option<pb::AccountRef>> {
        let known = prop::sample::select(vec![customer("w1"), customer("w2"), clearing()]);
        let arbitrary = (
            hostile_text(
                prop::sample::select(general_ledger::validate::ACCOUNT_CLASSES.to_vec())
                    .prop_map(String::from)
                    .boxed(),
                TEXT_LENGTH_MAX,
            ),
            text("[A-Z]{1,8}"),
            text("[a-z0-9]{1,8}"),
        )
            .prop_map(|(class, owner_type, owner_id)| pb::AccountRef {
                class,
                owner_type,
                owner_id,
            });
        prop_oneof![6 => known.prop_map(Some), 3 => arbitrary.prop_map(Some), 1 => Just(None)]
            .boxed()
    }
    /// A canonical decimal, or one of the spellings and magnitudes the GL must refuse.
    pub fn amount() -> BoxedStrategy<String> {
        prop_oneof![
            6 => (1i64..10_000_000, 0u32..4).prop_map(|(m, s)| Decimal::new(m, s).to_string()),
            2 => prop::sample::select(vec![
                "99999999999999999999", "-99999999999999999999", "100000000000000000000",
                "0.000000000000000001", "0.0000000000000000001", "12345678901234567890.123456789",
                "0", "-0.00", "", "1e5", "+1", "01", "NaN", "inf", "1.5 ", "-", ".5", "5.",
            ])
            .prop_map(String::from),
            1 => "[-+0-9.eE ]{0,30}",
        ]
        .boxed()
    }
    pub fn time() -> BoxedStrategy<String> {
        hostile_text(
            prop::sample::select(vec![
                "2026-03-01T10:00:00.123456Z",
                "2026-03-01T11:00:00+01:00",
                "0000-01-01T00:00:00Z",
                "9999-12-31T23:59:59.999999999Z",
                "2026-06-30T23:59:60Z",
                "2026-02-30T00:00:00Z",
                "2026-03-01",
            ])
            .prop_map(String::from)
            .boxed(),
            64,
        )
    }
    pub fn entries() -> BoxedStrategy<Vec<pb::EntryInput>> {
        let entry = (
            hostile_u32((1u32..6).boxed()),
            account(),
            asset(),
            amount(),
            text("[a-z ]{0,12}"),
        )
            .prop_map(|(line_number, account, asset, amount, description)| {
                pb::EntryInput {
                    line_number,
                    account,
                    asset,
                    amount,
                    description,
                }
            });
        // Balanced pairs (each amount debited from one known account and credited to another,
        // maybe the same one): journals the GL accepts, including sums of huge amounts.
        let pair = (account(), account(), amount());
        let balanced = prop::collection::vec(pair, 1..4).prop_map(|pairs| {
            let mut entries = Vec::new();
            for (debit, credit, amount) in pairs {
                let line = entries.len() as u32 + 1;
                let negated = amount
                    .strip_prefix('-')
                    .map(String::from)
                    .unwrap_or(format!("-{amount}"));
                for (n, account, amount) in [(line, debit, negated), (line + 1, credit, amount)] {
                    entries.push(pb::EntryInput {
                        line_number: n,
                        account,
                        asset: "EUR".into(),
                        amount,
                        description: String::new(),
                    });
                }
            }
            entries
        });
        prop_oneof![prop::collection::vec(entry, 0..5), balanced].boxed()
    }
    pub fn correction() -> BoxedStrategy<Option<pb::CorrectionApproval>> {
        prop::option::weighted(
            0.2,
            (text("op-[a-z]{1,4}"), text("ref-[0-9]{1,4}")).prop_map(
                |(approved_by, approval_reference)| pb::CorrectionApproval {
                    approved_by,
                    approval_reference,
                },
            ),
        )
        .boxed()
    }
    pub fn metadata() -> BoxedStrategy<String> {
        hostile_text(
            prop::sample::select(vec![
                "",
                r#"{"fencing_token":7}"#,
                "{}",
                "[1]",
                "null",
                r#"{"a":"\u0000"}"#,
                r#"{"\u0000":1}"#,
                "{",
                r#"{"a":1e999}"#,
            ])
            .prop_map(String::from)
            .boxed(),
            general_ledger::validate::METADATA_LENGTH_MAX,
        )
    }
}

fn ledger_call() -> impl proptest::strategy::Strategy<Value = LedgerCall> {
    use ledger_values::*;
    use proptest::prelude::*;
    use testkit::wire::{hostile_enum, hostile_text, hostile_u32, hostile_u64};
    let version = || hostile_u32((1u32..4).boxed());
    let journal = (
        (
            text("payment-resource"),
            text("k-[a-z0-9]{1,10}"),
            text("tx-[a-z0-9]{1,6}"),
            text("[a-z]{0,6}"),
        ),
        (
            text("PAYOUT_POSTED"),
            version(),
            time(),
            text("corr-[a-z]{1,4}"),
            text("worker-[a-z]{1,4}"),
        ),
        (metadata(), entries(), hostile_text_or_uuid(), correction()),
        (
            hostile_u64((1u64..1_000).boxed()),
            prop_oneof![Just(String::new()), text("rail-[a-z0-9]{1,8}")],
            prop_oneof![Just(String::new()), text("cref-[a-z0-9]{1,8}")],
        ),
    )
        .prop_map(
            |(
                (source_service, idempotency_key, source_transaction_id, tracking_code),
                (effect_kind, effect_version, occurred_at, correlation_id, actor_id),
                (metadata_json, entries, reversal_of, correction),
                (source_sequence, settlement_reference, client_reference),
            )| {
                LedgerCall::AppendJournal(pb::AppendJournalRequest {
                    source_service,
                    idempotency_key,
                    source_transaction_id,
                    tracking_code,
                    effect_kind,
                    effect_version,
                    occurred_at,
                    correlation_id,
                    actor_id,
                    metadata_json,
                    entries,
                    reversal_of,
                    correction,
                    source_sequence,
                    settlement_reference,
                    client_reference,
                })
            },
        );
    let event = (
        (
            text("payment-resource"),
            text("tx-[a-z0-9]{1,6}"),
            text("PAYOUT_[A-Z]{1,6}"),
            version(),
        ),
        (
            time(),
            text("corr-[a-z]{1,4}"),
            text("worker-[a-z]{1,4}"),
            metadata(),
            hostile_u64((1u64..1_000).boxed()),
        ),
    )
        .prop_map(
            |(
                (source_service, source_transaction_id, event_type, event_version),
                (occurred_at, correlation_id, actor_id, metadata_json, source_sequence),
            )| {
                LedgerCall::AppendTransactionEvent(pb::AppendTransactionEventRequest {
                    source_service,
                    source_transaction_id,
                    event_type,
                    event_version,
                    occurred_at,
                    correlation_id,
                    actor_id,
                    metadata_json,
                    source_sequence,
                })
            },
        );
    let open = (account(), asset()).prop_map(|(account, asset)| {
        LedgerCall::OpenAccount(pb::OpenAccountRequest { account, asset })
    });
    let get = prop_oneof![
        Just(None),
        hostile_text_or_uuid().prop_map(|id| Some(pb::get_journal_request::Key::JournalId(id))),
        text("k-[a-z0-9]{1,10}")
            .prop_map(|k| Some(pb::get_journal_request::Key::IdempotencyKey(k))),
    ]
    .prop_map(|key| LedgerCall::GetJournal(pb::GetJournalRequest { key }));
    let page_token = hostile_text(
        prop::sample::select(vec![
            "",
            "1:1",
            "0:0",
            "a:b",
            ":",
            "99999999999999999999:1",
            "1:99999999999",
        ])
        .prop_map(String::from)
        .boxed(),
        64,
    );
    let list = (
        (account(), asset(), text("tx-[a-z0-9]{1,6}")),
        (time(), time(), hostile_u32((0u32..600).boxed()), page_token),
    )
        .prop_map(
            |(
                (account, asset, source_transaction_id),
                (recorded_from, recorded_to, page_size, page_token),
            )| {
                LedgerCall::ListEntries(pb::ListEntriesRequest {
                    account,
                    asset,
                    source_transaction_id,
                    recorded_from,
                    recorded_to,
                    page_size,
                    page_token,
                })
            },
        );
    let balance = (account(), asset()).prop_map(|(account, asset)| {
        LedgerCall::GetBalance(pb::GetBalanceRequest { account, asset })
    });
    // RECONCILE is left out: it would refuse every later journal, hiding the deep paths.
    let mode = (hostile_enum(&[1, 3]), text("[a-z ]{1,12}")).prop_map(|(mode, reason)| {
        // The certificate's own operator: another name is refused before the request is
        // read (`reversals_must_mirror_exactly_once_and_modes_are_audited`).
        LedgerCall::SetOperatingMode(pb::SetOperatingModeRequest {
            mode,
            operator_id: testkit::pki::TEST_OPERATOR.into(),
            reason,
        })
    });
    prop_oneof![
        6 => journal,
        2 => event,
        1 => open,
        1 => get,
        1 => list,
        1 => balance,
        1 => mode,
        1 => Just(LedgerCall::GetOperatingMode),
    ]
}

fn hostile_text_or_uuid() -> proptest::strategy::BoxedStrategy<String> {
    use proptest::prelude::*;
    prop_oneof![
        3 => Just(String::new()),
        1 => any::<u128>().prop_map(|n| uuid::Uuid::from_u128(n).to_string()),
        1 => testkit::wire::hostile_text("[0-9a-f-]{1,36}".boxed(), 36),
    ]
    .boxed()
}

async fn send_ledger_call(mut client: Client, call: LedgerCall) -> Result<(), tonic::Status> {
    use LedgerCall as C;
    match call {
        C::AppendJournal(r) => client.append_journal(r).await.map(drop),
        C::AppendTransactionEvent(r) => client.append_transaction_event(r).await.map(drop),
        C::OpenAccount(r) => client.open_account(r).await.map(drop),
        C::GetJournal(r) => client.get_journal(r).await.map(drop),
        C::ListEntries(r) => client.list_entries(r).await.map(drop),
        C::GetBalance(r) => client.get_balance(r).await.map(drop),
        C::SetOperatingMode(r) => client.set_operating_mode(r).await.map(drop),
        C::GetOperatingMode => client
            .get_operating_mode(pb::GetOperatingModeRequest {})
            .await
            .map(drop),
    }
}

/// Arbitrary field values through the real client to the real GL on gldb. For every case: no
/// panic anywhere in the process; the answer is OK or a status carrying a decodable typed
/// `Rejection` with a reason (INVALID_FIELD and MISSING_SOURCE_IDENTITY name their field); a
/// refusal changed no row of any table (counts and contents), except that a refused
/// DEGRADED_LEDGER request leaves its one audited `operating_mode_refusals` row; and the GL still
/// reports SERVING and answers a valid call.
#[test]
fn wire_values_never_panic_and_refusals_are_typed_and_write_nothing() {
    use testkit::wire;
    const CASES: u32 = 128;
    let runtime = wire::runtime();
    let (server, client, pool) = runtime.block_on(async {
        let (server, mut client, url) = start().await;
        for account in [customer("w1"), customer("w2"), clearing()] {
            open(&mut client, account, "EUR").await;
        }
        let pool = sqlx::PgPool::connect(&url).await.unwrap();
        (server, client, pool)
    });
    wire::run_cases(&runtime, CASES, ledger_call(), |call| {
        let (client, pool, endpoint) = (client.clone(), &pool, server.endpoint());
        async move {
            let wire::Observed {
                answer,
                before,
                after,
            } = wire::observe(pool, &GLDB_TABLES, send_ledger_call(client.clone(), call)).await?;
            if let Err(status) = answer {
                let rejection = service_kit::rejection::decode::<pb::Rejection>(&status);
                let reason = rejection.as_ref().and_then(|r| R::try_from(r.reason).ok());
                prop_assert!(
                    reason.is_some_and(|r| r != R::Unspecified),
                    "untyped refusal {:?}: {}",
                    status.code(),
                    status.message()
                );
                prop_assert!(
                    matches!(
                        status.code(),
                        tonic::Code::InvalidArgument
                            | tonic::Code::FailedPrecondition
                            | tonic::Code::NotFound
                            | tonic::Code::AlreadyExists
                    ),
                    "{:?}: {}",
                    status.code(),
                    status.message()
                );
                if matches!(reason, Some(R::InvalidField | R::MissingSourceIdentity)) {
                    prop_assert!(
                        rejection.as_ref().is_some_and(|r| !r.field.is_empty()),
                        "{rejection:?}"
                    );
                }
                let changed = before.changed(&after);
                if reason == Some(R::ModeNotActivated) {
                    prop_assert_eq!(changed, vec!["operating_mode_refusals".to_string()]);
                } else {
                    prop_assert_eq!(changed, Vec::<String>::new(), "{}", status.message());
                }
            }
            let mut client = client.clone();
            let valid = client.get_operating_mode(pb::GetOperatingModeRequest {});
            wire::still_serving(
                &endpoint,
                general_ledger::SERVICE_NAME,
                testkit::pki::Role::GeneralLedger,
                valid,
            )
            .await
        }
    });
    runtime.block_on(server.stop()).unwrap();
}

/// Pages of the whole listing from `token` on, as a follower of the ledger reads it: the
/// idempotency key of every journal whose lines it was given, in the order given, and the cursor
/// it ends on.
async fn follow(
    client: &mut Client,
    pool: &sqlx::PgPool,
    mut token: String,
) -> (Vec<String>, String) {
    let mut keys = Vec::new();
    loop {
        let page = client
            .list_entries(pb::ListEntriesRequest {
                page_size: 100,
                page_token: token.clone(),
                ..Default::default()
            })
            .await
            .unwrap()
            .into_inner();
        for e in &page.entries {
            let key: String =
                sqlx::query_scalar("SELECT idempotency_key FROM journals WHERE id = $1::uuid")
                    .bind(&e.journal_id)
                    .fetch_one(pool)
                    .await
                    .unwrap();
            if keys.last() != Some(&key) {
                keys.push(key);
            }
            token = format!("{}:{}", e.receipt_sequence, e.line_number);
        }
        if page.next_page_token.is_empty() {
            return (keys, token);
        }
    }
}

/// A post that takes its receipt sequence and then commits late, behind a later post that has
/// already committed, as the GL's own posts do (the sequence is taken at INSERT): the GL's
/// protocol by hand (the append lock shared, the journal and its lines, held open).
async fn post_slowly(url: &str, key: &str) -> sqlx::Transaction<'static, sqlx::Postgres> {
    let pool = sqlx::PgPool::connect(url).await.unwrap();
    let mut tx = pool.begin().await.unwrap();
    sqlx::query("SELECT pg_advisory_xact_lock_shared($1)")
        .bind(general_ledger::store::MODE_LOCK_KEY)
        .execute(&mut *tx)
        .await
        .unwrap();
    let id: uuid::Uuid = sqlx::query_scalar(
        "INSERT INTO journals (id, source_service, idempotency_key, payload_hash, source_transaction_id,
             tracking_code, effect_kind, effect_version, occurred_at, correlation_id, actor_id)
         VALUES (gen_random_uuid(), 'payment-resource', $1, repeat('0', 64), 'tx-' || $1, 'trk',
             'PAYOUT_POSTED', 1, now(), 'corr', 'worker')
         RETURNING id",
    )
    .bind(key)
    .fetch_one(&mut *tx)
    .await
    .unwrap();
    sqlx::query(
        "INSERT INTO entries (journal_id, line_number, account_id, asset_id, amount)
         SELECT $1, 1, id, 'EUR', -1 FROM ledger_accounts
          WHERE class = 'CUSTOMER_AVAILABLE' AND owner_id = 'w1' AND asset_id = 'EUR'
         UNION ALL
         SELECT $1, 2, id, 'EUR', 1 FROM ledger_accounts
          WHERE class = 'PAYOUT_CLEARING' AND owner_id = 'rail' AND asset_id = 'EUR'",
    )
    .bind(id)
    .execute(&mut *tx)
    .await
    .unwrap();
    tx
}

/// Receipt order is final for a reader (issue 19): a journal that took its receipt sequence
/// before a later one but commits after it is never paged past. The listing ends at the receipt
/// watermark: a page asked while the earlier journal is still in flight waits for it, and then
/// holds both, in sequence order; the follower's next page from there is empty. Its negative
/// control (the same with the watermark switched off) pages past the later journal at once and
/// never sees the earlier one.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_journal_committing_behind_a_higher_receipt_sequence_is_never_paged_past() {
    for watermark in [true, false] {
        let (server, mut client, url) = start_with(|c| {
            if watermark {
                c
            } else {
                c.without_receipt_watermark_for_tests()
            }
        })
        .await;
        let pool = sqlx::PgPool::connect(&url).await.unwrap();
        open(&mut client, customer("w1"), "EUR").await;
        let slow = post_slowly(&url, "slow").await;
        assert!(
            client
                .append_journal(payout("fast", "w1", "2.00"))
                .await
                .unwrap()
                .into_inner()
                .created
        );
        let page = tokio::spawn({
            let (mut client, pool) = (client.clone(), pool.clone());
            async move { follow(&mut client, &pool, String::new()).await }
        });
        let (first, cursor) = if watermark {
            tokio::time::sleep(Duration::from_millis(300)).await;
            assert!(
                !page.is_finished(),
                "the page waits for the journal in flight below the watermark"
            );
            slow.commit().await.unwrap();
            page.await.unwrap()
        } else {
            let seen = page.await.unwrap();
            slow.commit().await.unwrap();
            seen
        };
        let (rest, _) = follow(&mut client, &pool, cursor).await;
        let seen: Vec<String> = first.into_iter().chain(rest).collect();
        if watermark {
            assert_eq!(
                seen,
                ["slow", "fast"],
                "every journal once, in receipt order"
            );
        } else {
            assert_eq!(
                seen,
                ["fast"],
                "without the watermark the follower pages past the journal still in flight and never sees it"
            );
        }
        server.stop().await.unwrap();
    }
}

/// Writers posting concurrently while a follower pages behind them: when they are done, the
/// follower has been given every journal exactly once, in ascending receipt order.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_follower_paging_behind_concurrent_writers_sees_every_journal_once() {
    const WRITERS: usize = 6;
    const JOURNALS_EACH: usize = 20;
    let (server, mut client, url) = start().await;
    let pool = sqlx::PgPool::connect(&url).await.unwrap();
    for w in 0..WRITERS {
        open(&mut client, customer(&format!("f{w}")), "EUR").await;
    }
    let writers: Vec<_> = (0..WRITERS)
        .map(|w| {
            let mut client = client.clone();
            tokio::spawn(async move {
                for i in 0..JOURNALS_EACH {
                    client
                        .append_journal(payout(&format!("f{w}-{i}"), &format!("f{w}"), "1.00"))
                        .await
                        .unwrap();
                }
            })
        })
        .collect();
    let mut seen = Vec::new();
    let mut cursor = String::new();
    while !writers.iter().all(|w| w.is_finished()) {
        let (keys, next) = follow(&mut client, &pool, cursor).await;
        seen.extend(keys);
        cursor = next;
    }
    for w in writers {
        w.await.unwrap();
    }
    let (keys, _) = follow(&mut client, &pool, cursor).await;
    seen.extend(keys);
    let mut unique = seen.clone();
    unique.sort();
    unique.dedup();
    assert_eq!(unique.len(), seen.len(), "no journal given twice");
    assert_eq!(seen.len(), WRITERS * JOURNALS_EACH, "every journal given");
    server.stop().await.unwrap();
}
