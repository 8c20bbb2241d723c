//! Worker Versioning on the real stack: payouts in flight on version 1 (held on a rail that has
//! not answered yet), version 2 deployed and made current with the operator's own command
//! (`temporal worker deployment set-current-version`), the old worker drained and stopped. Every
//! in-flight payout finishes on version 1, which owns it (every workflow task of its history was
//! completed by build v1, including those after v2 became current), new payouts run on v2, and
//! nothing is paid twice: one rail movement per payout, the reconciler clean.
//!
//! What makes the checks discriminate: v2's worker polls the same task queue from before the v1
//! payouts start, so which build runs a task is decided by Temporal's routing (the current
//! version, then the pin), not by which worker happens to poll first; and the v1 payouts are
//! shown still running and unpaid when v2 becomes current. The negative control
//! (`without_routing_an_in_flight_payout_is_finished_by_the_new_build`) runs the same rollout
//! with routing off: the same history check then sees an in-flight v1 payout finished by v2.
//!
//! Run: `cargo build --bins -p lock-server -p payment-resource -p rail-stub -p rail-proxy
//! -p general-ledger -p outbox-dispatcher -p payout-worker -p reconciler-service && cargo test
//! -p system-tests --test versioning`.

use std::time::Duration;

use payment_client::PaymentClient;
use payout_activities::types::{AmbiguityPolicy, PayoutInput};
use payout_domain::PayoutState;
use payout_domain::{AccountId, AmountMinor, BeneficiaryRef, ClientReference, Currency, PayoutId};
use payout_workflows::client as wf;
use rail_stub::client::StubClient;
use rail_stub::FaultConfig;
use testkit::pki::Role;
use testkit::system::{System, SystemOptions};
use testkit::{ManagedProcess, Stack};

/// A payout settles in seconds once the rail answers; this bounds a test that went wrong.
const SETTLE_TIMEOUT: Duration = Duration::from_secs(120);
/// How long the rail sits on version 1's submissions: long enough for them to be pinned (a
/// workflow task's heartbeat, 8 s) and for version 2 to be deployed and made current while they
/// are in flight, short of the submission's 30 s start-to-close.
const RAIL_HOLD_MS: u64 = 20_000;
/// The proxy waits this long for the rail before recording a timeout: above the hold, so the
/// held submissions are answered, not made ambiguous.
const RAIL_TIMEOUT_MS: u64 = 25_000;
/// A started payout's first workflow task completes (and pins it) within its heartbeat.
const PINNED_TIMEOUT: Duration = Duration::from_secs(15);
/// A new version becomes visible to the deployment API once its worker has polled.
const VERSION_VISIBLE_TIMEOUT: Duration = Duration::from_secs(60);
/// Payouts per version.
const PAYOUTS_PER_VERSION: usize = 3;

fn temporal_cli(args: &[&str]) -> anyhow::Result<String> {
    let mut all = args.to_vec();
    all.extend(["--namespace", testkit::temporal::NAMESPACE]);
    Stack::shared().temporal().cli(&all)
}

fn json(text: &str) -> serde_json::Value {
    serde_json::from_str(text).unwrap_or_else(|e| panic!("not JSON ({e}): {text}"))
}

/// A worker of `build_id` that reports its version but is not routed by it (versioning off).
fn start_unrouted_worker(system: &System, build_id: &str) -> anyhow::Result<ManagedProcess> {
    ManagedProcess::start(
        system
            .worker_spec(&format!("worker-{build_id}"))
            .env("PAYOUT_WORKER_BUILD_ID", build_id),
    )
}

/// A worker of `build_id`, routed by version (what a deployment runs).
fn start_versioned_worker(
    system: &System,
    deployment: &str,
    build_id: &str,
) -> anyhow::Result<ManagedProcess> {
    ManagedProcess::start(
        system
            .worker_spec(&format!("worker-{build_id}"))
            .env("PAYOUT_WORKER_VERSIONING", "true")
            .env("PAYOUT_WORKER_DEPLOYMENT_NAME", deployment)
            .env("PAYOUT_WORKER_BUILD_ID", build_id),
    )
}

/// Waits until the version's worker has polled: the server then knows the version.
async fn wait_registered(deployment: &str, build_id: &str, worker: &ManagedProcess) {
    testkit::eventually(
        VERSION_VISIBLE_TIMEOUT,
        "the version is registered",
        || async {
            temporal_cli(&[
                "worker",
                "deployment",
                "describe-version",
                "--deployment-name",
                deployment,
                "--build-id",
                build_id,
            ])
            .ok()
            .map(|_| ())
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}\n{}", worker.log_tail(40)));
}

/// Makes the version the deployment's current one, as an operator does.
fn set_current(deployment: &str, build_id: &str) {
    temporal_cli(&[
        "worker",
        "deployment",
        "set-current-version",
        "--deployment-name",
        deployment,
        "--build-id",
        build_id,
        "--yes",
    ])
    .unwrap();
    let described = temporal_cli(&[
        "worker",
        "deployment",
        "describe",
        "--name",
        deployment,
        "--output",
        "json",
    ])
    .unwrap();
    let current = json(&described)["routingConfig"]["currentVersionBuildID"]
        .as_str()
        .map(str::to_string);
    assert_eq!(
        current.as_deref(),
        Some(build_id),
        "{deployment} after set-current-version {build_id}: {described}"
    );
}

/// The first `buildId` anywhere inside `value` (the field sits at different depths in the
/// history's and describe's JSON depending on the server's API version).
fn build_id_in(value: &serde_json::Value) -> Option<String> {
    match value {
        serde_json::Value::Object(map) => map
            .get("buildId")
            .and_then(|b| b.as_str().map(str::to_string))
            .or_else(|| map.values().find_map(build_id_in)),
        serde_json::Value::Array(items) => items.iter().find_map(build_id_in),
        _ => None,
    }
}

/// The build id that completed each workflow task of the workflow's history, in order.
fn workflow_task_builds(workflow_id: &str) -> Vec<String> {
    let history = json(
        &temporal_cli(&[
            "workflow",
            "show",
            "--workflow-id",
            workflow_id,
            "--output",
            "json",
        ])
        .unwrap(),
    );
    history["events"]
        .as_array()
        .unwrap_or_else(|| panic!("no events: {history}"))
        .iter()
        .filter(|e| e["eventType"] == "EVENT_TYPE_WORKFLOW_TASK_COMPLETED")
        .map(|e| {
            build_id_in(&e["workflowTaskCompletedEventAttributes"])
                .unwrap_or_else(|| panic!("a workflow task without its build: {e}"))
        })
        .collect()
}

/// Whether the workflow is pinned, the build it runs on, and whether it is still running, as
/// `temporal workflow describe` shows them.
fn versioning_of(workflow_id: &str) -> (bool, Option<String>, bool) {
    let described = json(
        &temporal_cli(&[
            "workflow",
            "describe",
            "--workflow-id",
            workflow_id,
            "--output",
            "json",
        ])
        .unwrap(),
    );
    let execution = &described["workflowExecutionInfo"];
    let info = &execution["versioningInfo"];
    let pinned = info["behavior"]
        .as_str()
        .is_some_and(|b| b.contains("PINNED"));
    let build = info
        .get("deploymentVersion")
        .and_then(build_id_in)
        .or_else(|| info.get("versionTransition").and_then(build_id_in));
    let running = execution["status"]
        .as_str()
        .is_some_and(|s| s.contains("RUNNING"));
    (pinned, build, running)
}

/// Open workflows on a version: the operator's drain query (README, "Worker deployment").
fn open_on(deployment: &str, build_id: &str) -> usize {
    let listed = temporal_cli(&[
        "workflow",
        "list",
        "--query",
        &format!(
            "TemporalWorkerDeploymentVersion='{deployment}:{build_id}' AND ExecutionStatus='Running'"
        ),
        "--output",
        "json",
    ])
    .unwrap();
    if listed.trim().is_empty() {
        return 0;
    }
    json(&listed)
        .as_array()
        .unwrap_or_else(|| panic!("not a list: {listed}"))
        .len()
}

struct Ctx<'a> {
    system: &'a System,
    temporal: temporalio_client::Client,
    payment: PaymentClient,
    stub: StubClient,
}

/// A system of its own with no worker (each test starts the builds it needs), a rail timeout
/// above the hold.
async fn start_system() -> System {
    System::start(
        Stack::shared(),
        SystemOptions {
            workers: 0,
            rail_timeout_ms: RAIL_TIMEOUT_MS,
            settlement_window_ms: 1_000,
            ..SystemOptions::default()
        },
    )
    .await
    .unwrap()
}

impl<'a> Ctx<'a> {
    async fn new(system: &'a System, identity: &str) -> Self {
        Self {
            system,
            temporal: wf::connect_configured(
                &wf::TemporalArgs::profile_of(&system.temporal_clients, "operator"),
                identity,
            )
            .await
            .unwrap(),
            payment: PaymentClient::connect(&system.payment_url(), &system.tls(Role::Fixture))
                .await
                .unwrap(),
            stub: rail_stub::client::StubClient::new(system.rail_stub_endpoints())
                .expect("the harness's rail client"),
        }
    }

    /// From now on the rail sits on every payment request for [`RAIL_HOLD_MS`].
    async fn hold_rail(&self) {
        self.stub
            .set_faults(&FaultConfig {
                latency_ms_min: RAIL_HOLD_MS,
                latency_ms_max: RAIL_HOLD_MS,
                ..FaultConfig::default()
            })
            .await
            .unwrap();
    }

    async fn start_payout(&self, name: &str) -> (PayoutInput, String) {
        let unique = Stack::shared()
            .unique_prefix(name)
            .replace(['/', ':'], "-")
            .trim_matches('-')
            .to_string();
        let currency = Currency::parse("EUR").unwrap();
        let input = PayoutInput {
            payout_id: PayoutId::parse(format!("p-{unique}")).unwrap(),
            account_id: AccountId::parse(format!("a-{unique}")).unwrap(),
            amount_minor: AmountMinor::new(1_500).unwrap(),
            currency: currency.clone(),
            beneficiary_ref: BeneficiaryRef::parse("ben-versioning").unwrap(),
            ambiguity: AmbiguityPolicy {
                settlement_window_ms: 1_000,
                resolution_sla_ms: 600_000,
            },
        };
        self.system
            .operator
            .open_account(&self.payment, &input.account_id, &currency, 100_000)
            .await
            .unwrap();
        self.payment
            .create_payout(&system_tests::workload::new_payout(&input))
            .await
            .unwrap();
        let id = wf::start_payout(&self.temporal, &self.system.task_queue, &input)
            .await
            .unwrap();
        (input, id)
    }

    /// (movements, payment requests) the rail has for the payout.
    async fn rail(&self, input: &PayoutInput) -> (u64, u64) {
        let cref = ClientReference::for_payout(&input.payout_id);
        let truth = self.stub.ground_truth().await.unwrap();
        let get = |m: &std::collections::BTreeMap<String, u64>| {
            m.get(cref.as_str()).copied().unwrap_or(0)
        };
        (
            get(&truth.movement_counts),
            get(&truth.submit_request_counts),
        )
    }
}

#[tokio::test]
async fn in_flight_payouts_finish_on_their_version_and_new_ones_start_on_the_next() {
    let system = start_system().await;
    // Its own deployment name (no dots: Temporal joins name and build id with one).
    let deployment = system.task_queue.replace(['.', '/', ':'], "-");
    let ctx = Ctx::new(&system, "versioning-test").await;

    // Version 1 deployed and current; version 2 deployed too but not current yet.
    let v1 = start_versioned_worker(&system, &deployment, "v1").unwrap();
    wait_registered(&deployment, "v1", &v1).await;
    set_current(&deployment, "v1");
    let v2 = start_versioned_worker(&system, &deployment, "v2").unwrap();
    wait_registered(&deployment, "v2", &v2).await;

    // Payouts started now run on v1 although v2 polls the same queue: routing follows the
    // current version, not whichever worker asks first. They are held mid-flight: the rail sits
    // on their submissions.
    ctx.hold_rail().await;
    let mut on_v1 = Vec::new();
    for i in 0..PAYOUTS_PER_VERSION {
        on_v1.push(ctx.start_payout(&format!("v1-{i}")).await);
    }
    for (input, _) in &on_v1 {
        testkit::eventually(
            SETTLE_TIMEOUT,
            "the rail holds the v1 submission",
            || async { (ctx.rail(input).await.1 == 1).then_some(()) },
        )
        .await
        .unwrap_or_else(|e| panic!("{e}\n{}", v1.log_tail(40)));
    }
    // Each is pinned to v1 once its first workflow task completes (its local steps report
    // within a workflow task's heartbeat, well inside the rail's hold).
    for (_, id) in &on_v1 {
        testkit::eventually(PINNED_TIMEOUT, "the payout pinned to v1", || async {
            (versioning_of(id) == (true, Some("v1".to_string()), true)).then_some(())
        })
        .await
        .unwrap_or_else(|e| panic!("{id}: {e}: {:?}", versioning_of(id)));
    }

    // Version 2 made current while they are in flight; the rail answers at once from now on
    // (the held submissions keep their wait).
    set_current(&deployment, "v2");
    ctx.stub.set_faults(&FaultConfig::default()).await.unwrap();
    // The switch happened mid-flight: every v1 payout is still running, none paid yet, and
    // the operator's drain query sees them on v1.
    for (input, id) in &on_v1 {
        assert!(
            versioning_of(id).2,
            "{id} already closed before v2 became current"
        );
        assert_eq!(
            ctx.rail(input).await.0,
            0,
            "{id} already paid before v2 became current"
        );
    }
    assert_eq!(open_on(&deployment, "v1"), on_v1.len());

    let mut on_v2 = Vec::new();
    for i in 0..PAYOUTS_PER_VERSION {
        on_v2.push(ctx.start_payout(&format!("v2-{i}")).await);
    }

    // Everything finishes, and is paid once.
    for (input, id) in on_v1.iter().chain(&on_v2) {
        let done = wf::wait_result(&ctx.temporal, id, SETTLE_TIMEOUT)
            .await
            .unwrap_or_else(|e| panic!("{id}: {e}\n{}", v1.log_tail(40)));
        assert_eq!(done.state, PayoutState::Posted, "{id}: {done:?}");
        assert_eq!(
            ctx.rail(input).await,
            (1, 1),
            "{id}: one request, one movement"
        );
    }

    // Who ran what: every workflow task of a v1 payout was completed by v1, even those after v2
    // became current; every task of a v2 payout by v2.
    for (_, id) in &on_v1 {
        let builds = workflow_task_builds(id);
        assert!(builds.len() >= 2, "{id}: {builds:?}");
        assert!(builds.iter().all(|b| b == "v1"), "{id} ran on {builds:?}");
    }
    for (_, id) in &on_v2 {
        assert_eq!(
            versioning_of(id).1.as_deref(),
            Some("v2"),
            "{id} starts on the current version"
        );
        let builds = workflow_task_builds(id);
        assert!(builds.iter().all(|b| b == "v2"), "{id} ran on {builds:?}");
    }
    // v1 drained: no open workflow is on it; its worker then stops cleanly.
    assert_eq!(open_on(&deployment, "v1"), 0, "open workflows still on v1");
    v1.terminate().unwrap();

    // After the drain, a new payout runs on v2 alone.
    let (input, id) = ctx.start_payout("after-drain").await;
    let done = wf::wait_result(&ctx.temporal, &id, SETTLE_TIMEOUT)
        .await
        .unwrap_or_else(|e| panic!("{id}: {e}\n{}", v2.log_tail(40)));
    assert_eq!(done.state, PayoutState::Posted);
    assert_eq!(ctx.rail(&input).await, (1, 1));
    assert!(workflow_task_builds(&id).iter().all(|b| b == "v2"));

    // The reconciler finds nothing wrong (exit status 0 = clean).
    let out = std::process::Command::new(testkit::workspace_bin("reconciler"))
        .args(["once", "--json"])
        .args(["--paydb-url", &system.databases.paydb])
        .args(["--proxydb-url", &system.databases.proxydb])
        .args(["--gldb-url", &system.databases.gldb])
        .args(["--rail-proxy-url", &system.proxy_url()])
        .args(
            system
                .pki
                .issue(Role::Reconciler, "reconciler")
                .unwrap()
                .to_args(),
        )
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "reconciler: {}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The negative control: the same rollout with routing off (the workers only report their
/// build). v2 joins while payouts are held mid-flight on v1 and v1 goes away (killed: an
/// unrouted old worker is the only one that could finish them); the same history check then sees
/// those payouts finished by build v2, i.e. by code that did not start them, which is what pinning
/// prevents. Paying once still holds: the guards, not the versioning, make that safe.
#[tokio::test]
async fn without_routing_an_in_flight_payout_is_finished_by_the_new_build() {
    let system = start_system().await;
    let ctx = Ctx::new(&system, "versioning-control").await;
    let v1 = start_unrouted_worker(&system, "v1").unwrap();
    ctx.hold_rail().await;
    let (input, id) = ctx.start_payout("unrouted").await;
    testkit::eventually(
        SETTLE_TIMEOUT,
        "the rail holds the v1 submission",
        || async { (ctx.rail(&input).await.1 == 1).then_some(()) },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}\n{}", v1.log_tail(40)));
    let v2 = start_unrouted_worker(&system, "v2").unwrap();
    ctx.stub.set_faults(&FaultConfig::default()).await.unwrap();
    v1.kill().unwrap();

    let done = wf::wait_result(&ctx.temporal, &id, SETTLE_TIMEOUT)
        .await
        .unwrap_or_else(|e| panic!("{id}: {e}\n{}", v2.log_tail(40)));
    assert_eq!(done.state, PayoutState::Posted, "{done:?}");
    assert_eq!(ctx.rail(&input).await.0, 1, "paid once all the same");
    let builds = workflow_task_builds(&id);
    assert!(
        builds.iter().any(|b| b == "v2"),
        "without routing the in-flight payout still ran only on v1: {builds:?}"
    );
}
