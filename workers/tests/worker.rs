//! The worker library against a real Temporal dev server: it runs payouts, and a stop request
//! (what SIGTERM triggers in the binary) returns cleanly.

use std::sync::Arc;
use std::time::Duration;

use payout_activities::in_memory::{InMemoryBackend, RailScript};
use payout_activities::types::{AmbiguityPolicy, PayoutInput};
use payout_domain::{AccountId, AmountMinor, BeneficiaryRef, Currency, PayoutId, PayoutState};
use payout_worker::WorkerConfig;
use payout_workflows::{PayoutResult, PayoutWorkflow};
use temporalio_client::{WorkflowGetResultOptions, WorkflowStartOptions};
use testkit::Stack;

/// Bounds the payout and the graceful stop; both take well under a second here.
const TIMEOUT: Duration = Duration::from_secs(60);

#[tokio::test]
async fn worker_runs_a_payout_and_stops_gracefully() {
    let stack = Stack::shared();
    let temporal = stack.temporal();
    let queue = stack.unique_prefix("worker-q");
    let config = WorkerConfig {
        temporal: payout_workflows::client::TemporalArgs::at(
            temporal.address(),
            testkit::temporal::NAMESPACE,
        ),
        deployment: Default::default(),
        task_queue: queue.clone(),
        identity: Some("worker-test".into()),
        lock_server_url: None,
        payment_resource_url: None,
        rail_proxy_url: None,
        lock_ttl_ms: 10_000,
        lock_history_path: None,
        unclaimed_grant_max_ms: payout_worker::services::UNCLAIMED_GRANT_MAX_MS_DEFAULT,
        // Not loaded: this worker runs on the in-memory backend and calls no service.
        tls: testkit::pki::shared()
            .issue(testkit::pki::Role::Worker, "worker-test")
            .unwrap(),
    };
    let world = InMemoryBackend::new("worker-test");
    let input = PayoutInput {
        payout_id: PayoutId::parse("p-worker-1").unwrap(),
        account_id: AccountId::parse("a-worker-1").unwrap(),
        amount_minor: AmountMinor::new(700).unwrap(),
        currency: Currency::parse("EUR").unwrap(),
        beneficiary_ref: BeneficiaryRef::parse("ben-1").unwrap(),
        ambiguity: AmbiguityPolicy::default(),
    };
    world.open_account(&input.account_id, 1_000);
    world.create_payout(&input, RailScript::Ack);
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let backend: Arc<dyn payout_activities::Backend> = Arc::new(world.clone());
    let worker = payout_worker::run(&config, backend, None, async {
        let _ = stop_rx.await;
    });
    let body = async {
        let client = payout_worker::connect(&config).await.unwrap();
        let id = format!("{queue}payout-p-worker-1").replace('/', "-");
        let handle = client
            .start_workflow(
                PayoutWorkflow::run,
                payout_activities::types::PayoutStartInput::from(&input),
                WorkflowStartOptions::new(queue.clone(), id).build(),
            )
            .await
            .unwrap();
        let done: PayoutResult = tokio::time::timeout(
            TIMEOUT,
            handle.get_result(WorkflowGetResultOptions::default()),
        )
        .await
        .unwrap()
        .unwrap();
        stop_tx.send(()).unwrap();
        done
    };
    let (stopped, done) = tokio::time::timeout(TIMEOUT, async { tokio::join!(worker, body) })
        .await
        .expect("the payout settles and the worker stops within the bound");
    stopped.unwrap();
    assert_eq!(done.state, PayoutState::Posted);
    assert_eq!(world.rail_movements(&input.payout_id), 1);
}
