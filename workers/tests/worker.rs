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
        temporal: payout_workflows::client::TemporalArgs::profile_of(
            temporal.clients_file(),
            "worker",
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
        metrics_listen: None,
    };
    let world = InMemoryBackend::new("worker-test");
    let input = PayoutInput {
        // Unique per run (the shared Temporal keeps earlier runs' workflows): the workflow is
        // `payout-{payout_id}`, the only id whose activities the worker serves.
        payout_id: PayoutId::parse(format!("p-{}", queue.replace('/', "-").trim_matches('-')))
            .unwrap(),
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
        let id = payout_domain::workflow_id(&input.payout_id);
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

/// The health endpoint follows Temporal: `/healthz` is 200 while the worker polls a Temporal
/// that answers, 503 saying why within a bounded poll once Temporal is stopped, and 200 again
/// after it is back. `/metrics` carries the SDK's families beside the worker's own histogram.
/// The worker runs against a Temporal dev server of its own, which the test stops.
#[tokio::test]
async fn healthz_follows_temporal_and_metrics_carry_the_sdks_families() {
    let stack = Stack::shared();
    let dir = stack.state_dir().join(
        stack
            .unique_prefix("worker-health")
            .replace(['/', ':'], "-"),
    );
    let temporal = tokio::task::spawn_blocking(move || {
        testkit::temporal::TemporalDev::start(
            &dir,
            testkit::temporal::TemporalPorts::free(false),
            testkit::Lifetime::Attached,
            Stack::shared().pki(),
        )
    })
    .await
    .unwrap()
    .unwrap();
    let config = WorkerConfig {
        temporal: payout_workflows::client::TemporalArgs::profile_of(
            temporal.clients_file(),
            "worker",
        ),
        deployment: Default::default(),
        task_queue: "health-q".into(),
        identity: Some("worker-health".into()),
        lock_server_url: None,
        payment_resource_url: None,
        rail_proxy_url: None,
        lock_ttl_ms: 10_000,
        lock_history_path: None,
        unclaimed_grant_max_ms: payout_worker::services::UNCLAIMED_GRANT_MAX_MS_DEFAULT,
        tls: testkit::pki::shared()
            .issue(testkit::pki::Role::Worker, "worker-health")
            .unwrap(),
        metrics_listen: None,
    };
    let telemetry = payout_worker::Telemetry::new();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    tokio::spawn(
        telemetry
            .clone()
            .serve(listener, std::future::pending::<()>()),
    );
    let healthz = move || async move {
        tokio::task::spawn_blocking(move || {
            testkit::util::http_get(port, "/healthz", Duration::from_secs(2))
        })
        .await
        .unwrap()
        .ok()
    };
    // Before the worker runs, it is not healthy, and says so.
    let (code, body) = healthz().await.unwrap();
    assert_eq!(code, 503, "{body}");
    assert!(body.contains("not polling"), "{body}");

    let backend: Arc<dyn payout_activities::Backend> =
        Arc::new(InMemoryBackend::new("worker-health"));
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let worker = payout_worker::run_with(&config, backend, None, &telemetry, async {
        let _ = stop_rx.await;
    });
    let status_is = |want: u16, what: &'static str| async move {
        testkit::eventually(TIMEOUT, what, || async {
            healthz()
                .await
                .filter(|(code, _)| *code == want)
                .map(|(_, body)| body)
        })
        .await
        .unwrap()
    };
    let body = async {
        let body = status_is(200, "/healthz 200 while polling").await;
        assert!(body.starts_with("ok: 1 pollers running"), "{body}");

        let metrics = reqwest_free_get(port, "/metrics").await;
        for family in [
            "temporal_num_pollers",
            "temporal_worker_task_slots_available",
            "temporal_worker_start_total",
        ] {
            assert!(
                metrics.lines().any(|l| l.starts_with(family)),
                "/metrics lacks {family}:\n{metrics}"
            );
        }

        temporal.process.kill().unwrap();
        let body = status_is(503, "/healthz 503 once Temporal is stopped").await;
        assert!(body.contains("Temporal unreachable"), "{body}");

        temporal.process.restart().unwrap();
        status_is(200, "/healthz 200 again once Temporal is back").await;
        stop_tx.send(()).unwrap();
    };
    let (stopped, ()) = tokio::time::timeout(4 * TIMEOUT, async { tokio::join!(worker, body) })
        .await
        .expect("the checks end and the worker stops within the bound");
    stopped.unwrap();
    let (code, body) = healthz().await.unwrap();
    assert_eq!(code, 503, "{body}");
}

/// `GET path` on the loopback port, body of a 200.
async fn reqwest_free_get(port: u16, path: &'static str) -> String {
    let (code, body) = tokio::task::spawn_blocking(move || {
        testkit::util::http_get(port, path, Duration::from_secs(5))
    })
    .await
    .unwrap()
    .unwrap();
    assert_eq!(code, 200, "{body}");
    body
}
