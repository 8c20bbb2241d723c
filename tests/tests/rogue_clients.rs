//! Part of the attack suite (issue 33; `attacks.rs` is the rest): rogue Temporal clients. Each
//! case is someone who can reach Temporal and runs a worker of their own
//! (`system_tests::rogue`): a workflow of another type, or an impostor registered as
//! `PayoutWorkflow`, scheduling the genuine activities on the system's queues with inputs of
//! their choosing. Each asserts what the genuine workers and the guards did with it: the refusal,
//! that nothing was written or paid, and that the refusal was counted where an operator sees it.

use payout_activities::types::PayoutInput;
use payout_domain::ClientReference;
use rail_stub::client::StubClient;
use serde_json::json;
use std::time::Duration;
use system_tests::rogue::{Activity, Outcome, Rogue, Script, Step};
use testkit::pki::Role;
use testkit::system::{System, SystemOptions};
use testkit::Stack;
use tokio::sync::OnceCell;

static SYSTEM: OnceCell<System> = OnceCell::const_new();

/// One system for the file: one genuine worker (so that its metrics are the ones to read), no
/// workflow starts of its own (each case starts what it needs, or nothing).
async fn system() -> &'static System {
    SYSTEM
        .get_or_init(|| async {
            System::start(
                Stack::shared(),
                SystemOptions {
                    workers: 1,
                    ..SystemOptions::default()
                },
            )
            .await
            .expect("the system starts")
        })
        .await
}

/// Opens an account with `balance_minor` and creates a PENDING payout of `amount_minor` on it,
/// paid to `ben-e2e`.
async fn pending_payout(
    system: &System,
    name: &str,
    balance_minor: i64,
    amount_minor: i64,
) -> PayoutInput {
    let input =
        system_tests::workload::unique_payout(name, amount_minor, Default::default()).unwrap();
    let payment =
        payment_client::PaymentClient::connect(&system.payment_url(), &system.tls(Role::Fixture))
            .await
            .unwrap();
    payment
        .open_account(&input.account_id, &input.currency, balance_minor)
        .await
        .unwrap();
    payment
        .create_payout(&system_tests::workload::new_payout(&input))
        .await
        .unwrap();
    input
}

async fn rogue(system: &System) -> Rogue {
    Rogue::start(payout_workflows::client::TemporalArgs::profile_of(
        &system.temporal_clients,
        "operator",
    ))
    .await
    .unwrap()
}

/// The harness itself: an impostor started as a real payout's workflow id reaches the genuine
/// worker on the system's queue and gets the payout's record back. Every case below rests on
/// this: the genuine workers serve what a rogue schedules on their queues.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_impostor_on_a_payouts_own_id_is_served_by_the_genuine_worker() {
    let system = system().await;
    let input = pending_payout(system, "impostor-reads", 10_000, 1_000).await;
    let rogue = rogue(system).await;
    let id = payout_domain::workflow_id(&input.payout_id);
    rogue
        .start_impostor(
            &id,
            Script {
                payout_queue: system.task_queue.clone(),
                steps: vec![Step::new(Activity::GetPayout, json!(input.payout_id))],
                abandon_answer: None,
            },
        )
        .await
        .unwrap();
    let report = rogue.report(&id).await.unwrap();
    let Some(Outcome::Answered(snapshot)) = report.outcome(Activity::GetPayout) else {
        panic!("the genuine worker answered the impostor's read: {report:?}");
    };
    assert_eq!(snapshot["payout_id"], json!(input.payout_id), "{snapshot}");
    assert_eq!(report.steps[0].task_queue, system.task_queue);
}

/// Row 1a: a workflow of another type drives the genuine worker through TryAcquireGrant and
/// SubmitToRail for a real payout, with its own beneficiary and amount. The genuine worker
/// refuses the first activity (`ForeignCaller`): no grant is made, nothing reaches the proxy or
/// the rail, and the refusal is counted on the worker's `/metrics`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rogue_workflow_type_cannot_drive_the_genuine_worker_to_pay() {
    let system = system().await;
    let input = pending_payout(system, "rogue-type", 10_000, 1_000).await;
    let rogue = rogue(system).await;
    let cref = ClientReference::for_payout(&input.payout_id);
    let report = rogue
        .rogue(Script {
            payout_queue: system.task_queue.clone(),
            steps: vec![
                Step::new(
                    Activity::TryAcquireGrant,
                    json!({"payout_id": input.payout_id, "account_id": input.account_id}),
                ),
                Step::new(
                    Activity::SubmitToRail,
                    json!({
                        "payout_id": input.payout_id,
                        "account_id": input.account_id,
                        "amount_minor": 90_000,
                        "currency": "EUR",
                        "beneficiary_ref": "ben-rogue",
                        "client_reference": cref,
                    }),
                ),
            ],
            abandon_answer: None,
        })
        .await
        .unwrap();
    let truth = StubClient::new(system.rail_url())
        .ground_truth()
        .await
        .unwrap();
    let paid: Vec<(i64, String)> = truth
        .movements
        .iter()
        .filter(|m| m.client_reference == cref.as_str())
        .map(|m| (m.amount_minor, m.beneficiary_ref.clone()))
        .collect();
    assert_eq!(paid, [], "the rail paid the rogue: {report:?}");
    assert_eq!(
        report.refusal(Activity::TryAcquireGrant),
        Some("ForeignCaller"),
        "{report:?}"
    );
    assert_eq!(
        report.steps.len(),
        1,
        "nothing ran after the refusal: {report:?}"
    );
    let proxydb = sqlx::PgPool::connect(&system.databases.proxydb)
        .await
        .unwrap();
    let rows: i64 = sqlx::query_scalar("SELECT count(*) FROM rail_submission WHERE payout_id = $1")
        .bind(input.payout_id.as_str())
        .fetch_one(&proxydb)
        .await
        .unwrap();
    testkit::util::close_pool(proxydb).await;
    assert_eq!(rows, 0, "no proxydb row");
    // No grant was made: the account's key is free at once.
    let lock = lock_client::LockClient::connect(&system.lock_url(), &system.tls(Role::Worker))
        .await
        .unwrap();
    let session = lock
        .open_session("rogue-clients-test", Duration::from_secs(10))
        .await
        .unwrap();
    let free = session
        .acquire(&payout_domain::lock_key(&input.account_id), Duration::ZERO)
        .await
        .unwrap();
    assert!(
        matches!(free, lock_client::Acquired::Granted(_)),
        "the key was free"
    );
    let counted = system_tests::metrics::sample(
        &system_tests::metrics::scrape(system.worker_metrics[0]).await,
        "payout_activity_foreign_callers_total",
        &["activity=\"TryAcquireGrant\""],
    );
    assert!(
        counted >= 1.0,
        "the worker counted the foreign caller: {counted}"
    );
}
