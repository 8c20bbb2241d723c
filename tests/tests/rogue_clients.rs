//! Part of the attack suite (issue 33; `attacks.rs` is the rest): rogue Temporal clients. Each
//! case is someone who can reach Temporal and runs a worker of their own
//! (`system_tests::rogue`): a workflow of another type, or an impostor registered as
//! `PayoutWorkflow`, scheduling the genuine activities on the system's queues with inputs of
//! their choosing. Each asserts what the genuine workers and the guards did with it: the refusal,
//! that nothing was written or paid, and that the refusal was counted where an operator sees it.

use payout_activities::types::PayoutInput;
use serde_json::json;
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
    Rogue::start(&system.temporal_address).await.unwrap()
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
