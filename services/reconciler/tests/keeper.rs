//! The reconciler keeps its own schedule and nothing is left behind when Temporal loses its state
//! (issue 35, items 7 and 8; issue 33: a paused or missing schedule is an alert). Against a real
//! system (every service a process, the testkit's Temporal):
//!
//! - `reconciler serve` re-creates its schedule when it is deleted, unpauses it when it is
//!   paused and puts it back when it is altered (interval lengthened, another workflow type),
//!   while it runs, within its keeper interval, and counts each repair;
//! - a PENDING payout whose workflow start paydb records as delivered but whose workflow Temporal
//!   no longer knows (Temporal's amnesia, here one workflow deleted) is resumed by one pass, with
//!   the default not-started grace, and paid once;
//! - a payout in flight whose workflow was terminated while it held its account's key is resumed,
//!   and the payout behind it paid, by `reconciler serve` within its keeper interval, long before
//!   the next scheduled pass.

use std::collections::HashMap;
use std::time::Duration;

use payment_client::PaymentClient;
use payout_domain::PayoutState;
use resolver::resume::{Temporal, TemporalConfig, WorkflowStatus};
use testkit::pki::Role;
use testkit::system::{System, SystemOptions, WorkflowStarts};
use testkit::{ManagedProcess, ProcessSpec, Stack};

mod common;
use common::{
    metric, metrics_text, movements, new_payout, once_json, paydb_scalar, payout_input,
    resumptions, state_of, temporal_cli, SETTLE_TIMEOUT,
};

/// The keeper's interval in these tests (`RECONCILE_KEEPER_INTERVAL_S`).
const KEEPER_INTERVAL_S: u64 = 1;
/// How long a repair may take here at most: it comes within a few keeper intervals, but a loaded
/// 2-core machine once took longer than 30 s to see a paused schedule unpaused; still below the
/// schedule's own interval (300 s), so only the keeper can have made it.
const REPAIR_TIMEOUT: Duration = Duration::from_secs(120);
/// The schedule's interval where a test must see no scheduled run: a day (its actions fall on
/// the epoch's day boundaries), so whatever the test sees is the keeper's doing.
const SCHEDULED_NEVER_S: u64 = 86_400;

/// The reconciler's own certificate (role reconciler) and every source, as `payoutdev stack up`
/// passes them.
fn config_args(system: &System) -> Vec<String> {
    let mut args = common::source_args(system, &system.temporal_address);
    args.push("--resume-stranded".to_string());
    args
}

/// `reconciler serve` with its schedule every `interval_s` and its keeper every second (by the
/// environment, so the same test runs against a build without the keeper and fails on what it
/// checks, not on a flag).
fn start_serve(system: &System, interval_s: u64) -> (ManagedProcess, String, u16) {
    let metrics_port = testkit::free_port();
    let schedule_id = format!("reconciler-{}", system.task_queue);
    let queue = format!("{}-reconciliation", system.task_queue);
    let serve = ManagedProcess::start(
        ProcessSpec::new(
            "reconciler",
            testkit::workspace_bin("reconciler"),
            system.dir.join("reconciler.log"),
        )
        .env("RECONCILE_KEEPER_INTERVAL_S", KEEPER_INTERVAL_S.to_string())
        .arg("serve")
        .args(config_args(system))
        .args(["--task-queue", &queue, "--schedule-id", &schedule_id])
        .args(["--interval-s".to_string(), interval_s.to_string()])
        .args([
            "--metrics-listen".to_string(),
            format!("127.0.0.1:{metrics_port}"),
        ]),
    )
    .unwrap();
    (serve, schedule_id, metrics_port)
}

/// The schedule as `temporal schedule describe` shows it, or `None` if Temporal has none.
fn describe_schedule(schedule_id: &str) -> Option<serde_json::Value> {
    let out = temporal_cli(&[
        "schedule",
        "describe",
        "--namespace",
        testkit::temporal::NAMESPACE,
        "--schedule-id",
        schedule_id,
        "--output",
        "json",
    ])
    .ok()?;
    serde_json::from_str(&out).ok()
}

/// A system on the shared stack with no payout worker: what these tests look at is the
/// reconciler's own schedule and runs.
async fn system_without_workers() -> System {
    System::start(
        Stack::shared(),
        SystemOptions {
            workers: 0,
            ..SystemOptions::default()
        },
    )
    .await
    .unwrap()
}

fn paused(described: &serde_json::Value) -> bool {
    described["schedule"]["state"]["paused"].as_bool() == Some(true)
}

#[tokio::test]
async fn serve_recreates_a_deleted_schedule_unpauses_a_paused_one_and_restores_an_altered_one() {
    let system = system_without_workers().await;
    let (serve, schedule_id, port) = start_serve(&system, SCHEDULED_NEVER_S);
    testkit::eventually(REPAIR_TIMEOUT, "the schedule created at start", || async {
        describe_schedule(&schedule_id).map(|_| ())
    })
    .await
    .unwrap_or_else(|e| panic!("{e}\n{}", serve.log_tail(40)));

    // Deleted while serve runs (as when Temporal loses its database): re-created, counted.
    temporal_cli(&[
        "schedule",
        "delete",
        "--namespace",
        testkit::temporal::NAMESPACE,
        "--schedule-id",
        &schedule_id,
    ])
    .unwrap();
    let missing = "reconciler_schedule_repairs_total{reason=\"missing\"}";
    testkit::eventually(
        REPAIR_TIMEOUT,
        "the deleted schedule re-created",
        || async {
            let described = describe_schedule(&schedule_id)?;
            let text = metrics_text(port).await?;
            (metric(&text, missing)? == 1.0 && !paused(&described)).then_some(())
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}\n{}", serve.log_tail(40)));
    let described = describe_schedule(&schedule_id).unwrap();
    assert!(
        described.to_string().contains("ReconcileWorkflow"),
        "re-created as at start: {described}"
    );

    // Paused while serve runs (someone with access to Temporal): unpaused, counted.
    temporal_cli(&[
        "schedule",
        "toggle",
        "--namespace",
        testkit::temporal::NAMESPACE,
        "--schedule-id",
        &schedule_id,
        "--pause",
        "--reason",
        "test: reconciliation paused by hand",
    ])
    .unwrap();
    let by_hand = "reconciler_schedule_repairs_total{reason=\"paused\"}";
    testkit::eventually(REPAIR_TIMEOUT, "the paused schedule unpaused", || async {
        let described = describe_schedule(&schedule_id)?;
        let text = metrics_text(port).await?;
        // Exactly once: the keeper waits until Temporal shows its repair applied (a schedule's
        // patch is applied asynchronously) before its next look.
        (metric(&text, by_hand)? == 1.0 && !paused(&described)).then_some(())
    })
    .await
    .unwrap_or_else(|e| panic!("{e}\n{}", serve.log_tail(40)));
    // The negative control of the altered case: two repairs (re-created, unpaused) and every
    // look since found the schedule as configured, so nothing was counted as altered.
    let altered = "reconciler_schedule_repairs_total{reason=\"altered\"}";
    let text = metrics_text(port).await.unwrap();
    assert_eq!(metric(&text, altered), Some(0.0), "{text}");

    // Altered while serve runs: the interval lengthened to two days (the checks made rarer),
    // then the action pointed at another workflow type: each put back, counted.
    let queue = format!("{}-reconciliation", system.task_queue);
    let alter = |interval: &str, workflow_type: &str| {
        temporal_cli(&[
            "schedule",
            "update",
            "--namespace",
            testkit::temporal::NAMESPACE,
            "--schedule-id",
            &schedule_id,
            "--interval",
            interval,
            "--type",
            workflow_type,
            "--task-queue",
            &queue,
            "--workflow-id",
            &format!("{schedule_id}-run"),
        ])
        .unwrap();
    };
    let as_configured = |described: &serde_json::Value| {
        let text = described.to_string();
        text.contains("ReconcileWorkflow") && text.contains("86400s")
    };
    for (round, (interval, workflow_type)) in [
        ("172800s", "ReconcileWorkflow"),
        ("86400s", "NotTheReconciler"),
    ]
    .into_iter()
    .enumerate()
    {
        alter(interval, workflow_type);
        let repairs = f64::from(u8::try_from(round + 1).unwrap());
        testkit::eventually(REPAIR_TIMEOUT, "the altered schedule put back", || async {
            let described = describe_schedule(&schedule_id)?;
            let text = metrics_text(port).await?;
            (metric(&text, altered)? == repairs && as_configured(&described)).then_some(())
        })
        .await
        .unwrap_or_else(|e| panic!("{e}\n{}", serve.log_tail(40)));
    }
    let text = metrics_text(port).await.unwrap();
    // Each change repaired once: none counted again by a look before Temporal applied the repair.
    assert_eq!(metric(&text, missing), Some(1.0), "{text}");
    assert_eq!(metric(&text, by_hand), Some(1.0), "{text}");
    assert_eq!(metric(&text, altered), Some(2.0), "{text}");
    assert_eq!(
        metric(&text, "reconciler_schedule_healthy"),
        Some(1.0),
        "{text}"
    );
    let log = std::fs::read_to_string(system.dir.join("reconciler.log")).unwrap_or_default();
    assert!(
        log.contains("WARN") && log.contains("schedule was missing"),
        "each repair is logged at warn: {}",
        serve.log_tail(40)
    );
    stop_serve(serve, &schedule_id);
}

fn temporal_config(system: &System) -> TemporalConfig {
    TemporalConfig {
        connection: payout_workflows::client::TemporalArgs::profile_of(
            &system.temporal_clients,
            "reconciler",
        ),
        payout_task_queue: system.task_queue.clone(),
        settlement_window_ms: 500,
        resolution_sla_ms: 600_000,
    }
}

/// `reconciler once --json --resume-stranded` with the default not-started grace (60 s): the
/// report's resumptions by payout.
fn resume_once(system: &System) -> HashMap<String, serde_json::Value> {
    resumptions(&once_json(&config_args(system), &[]).0)
}

#[tokio::test]
async fn a_payout_whose_delivered_workflow_temporal_lost_is_resumed_by_one_pass() {
    let stack = Stack::shared();
    // No worker yet: the starter's workflow stays RUNNING, unpicked, until the test deletes it.
    let mut system = System::start(
        stack,
        SystemOptions {
            workers: 0,
            settlement_window_ms: 500,
            workflow_starts: Some(WorkflowStarts {
                settlement_window_ms: 500,
                resolution_sla_ms: 600_000,
            }),
            ..SystemOptions::default()
        },
    )
    .await
    .unwrap();
    let fixture = PaymentClient::connect(&system.payment_url(), &system.tls(Role::Fixture))
        .await
        .unwrap();
    let payments = PaymentClient::connect(&system.payment_url(), &system.tls(Role::Worker))
        .await
        .unwrap();
    let lost = "k-lost";
    let new = new_payout("k-acct-lost", lost);
    system
        .operator
        .open_account(&fixture, &new.account_id, &new.currency, 100_000)
        .await
        .unwrap();
    fixture.create_payout(&new).await.unwrap();

    // The starter delivers the start, and paydb records it so.
    let delivered =
        format!("SELECT started_at IS NOT NULL FROM workflow_start WHERE payout_id = '{lost}'");
    testkit::eventually(SETTLE_TIMEOUT, "the start delivered", || {
        let answer = paydb_scalar(&system, &delivered);
        async move { (answer.as_deref() == Some("t")).then_some(()) }
    })
    .await
    .unwrap();

    // Temporal loses it (as when its database is deleted): the workflow is gone.
    let workflow_id = format!("payout-{lost}");
    temporal_cli(&[
        "workflow",
        "delete",
        "--namespace",
        testkit::temporal::NAMESPACE,
        "--workflow-id",
        &workflow_id,
        "--yes",
    ])
    .unwrap();
    let temporal = Temporal::connect(&temporal_config(&system)).await.unwrap();
    testkit::eventually(SETTLE_TIMEOUT, "the workflow gone", || async {
        (temporal.status(&workflow_id).await.ok()? == WorkflowStatus::NotFound).then_some(())
    })
    .await
    .unwrap();
    let young = paydb_scalar(
        &system,
        &format!(
            "SELECT created_at > now() - interval '60 seconds' FROM payout WHERE id = '{lost}'"
        ),
    )
    .as_deref()
        == Some("t");
    assert!(
        young,
        "the payout is younger than the grace: only its delivered start tells the pass it had a workflow"
    );
    assert_eq!(state_of(&payments, lost).await, PayoutState::Pending);
    system.add_worker().unwrap();

    // One pass, with the default grace: resumed.
    let resumed = resume_once(&system);
    let r = resumed
        .get(lost)
        .unwrap_or_else(|| panic!("{lost} resumed by one pass: {resumed:?}"));
    assert_eq!(
        (r["workflow"].as_str(), r["action"].as_str()),
        (Some("NOT_FOUND"), Some("RESUMED")),
        "{r}"
    );
    testkit::eventually(SETTLE_TIMEOUT, "the lost payout posted", || async {
        (state_of(&payments, lost).await == PayoutState::Posted).then_some(())
    })
    .await
    .unwrap();
    assert_eq!(movements(&system, lost).await, 1, "paid once");
}

/// A one-worker system whose account `account` holds `first` and `behind` (both PENDING, funded),
/// with the fixture's and a worker's payment clients and the operator's Temporal client.
struct HeldAccount {
    system: System,
    payments: PaymentClient,
    client: temporalio_client::Client,
}

async fn held_account(
    account: &str,
    first: &str,
    behind: &str,
    worker_env: Vec<(String, String)>,
) -> HeldAccount {
    let system = System::start(
        Stack::shared(),
        SystemOptions {
            workers: 1,
            settlement_window_ms: 500,
            test_worker: !worker_env.is_empty(),
            worker_env,
            ..SystemOptions::default()
        },
    )
    .await
    .unwrap();
    let fixture = PaymentClient::connect(&system.payment_url(), &system.tls(Role::Fixture))
        .await
        .unwrap();
    let payments = PaymentClient::connect(&system.payment_url(), &system.tls(Role::Worker))
        .await
        .unwrap();
    let created = new_payout(account, first);
    system
        .operator
        .open_account(&fixture, &created.account_id, &created.currency, 100_000)
        .await
        .unwrap();
    fixture.create_payout(&created).await.unwrap();
    fixture
        .create_payout(&new_payout(account, behind))
        .await
        .unwrap();
    let client = payout_workflows::client::connect_configured(
        &payout_workflows::client::TemporalArgs::profile_of(&system.temporal_clients, "operator"),
        "keeper-test",
    )
    .await
    .unwrap();
    HeldAccount {
        system,
        payments,
        client,
    }
}

/// Stops `reconciler serve` and deletes the schedule it made on the shared Temporal.
fn stop_serve(serve: ManagedProcess, schedule_id: &str) {
    serve.terminate().unwrap();
    let _ = temporal_cli(&[
        "schedule",
        "delete",
        "--namespace",
        testkit::temporal::NAMESPACE,
        "--schedule-id",
        schedule_id,
    ]);
}

#[tokio::test]
async fn a_terminated_holder_is_taken_over_and_resumed_within_the_keeper_interval() {
    let holder = "k-holder";
    let behind = "k-behind";
    let account = "k-acct-held";
    // The holder's workflow freezes right after its claim (before MarkSubmitted), holding the
    // account's key: then it is terminated, as an operator would.
    let stall_ms = 600_000;
    let HeldAccount {
        system,
        payments,
        client,
    } = held_account(
        account,
        holder,
        behind,
        vec![(
            "PAYOUT_TEST_STALL_AFTER_CHECK".into(),
            format!("worker-0:mark_submitted:{holder}:{stall_ms}"),
        )],
    )
    .await;
    let input = |payout: &str| payout_input(account, payout, 500, 600_000);
    let holder_id =
        payout_workflows::client::start_payout(&client, &system.task_queue, &input(holder))
            .await
            .unwrap();
    testkit::eventually(SETTLE_TIMEOUT, "the holder claimed", || async {
        (state_of(&payments, holder).await == PayoutState::Claimed).then_some(())
    })
    .await
    .unwrap();
    payout_workflows::client::start_payout(&client, &system.task_queue, &input(behind))
        .await
        .unwrap();
    common::terminate(&holder_id);
    // No scheduled pass while the test looks: only the keeper's short pass can free the account
    // within the bound below (the deployed schedule's 300 s would be the wait otherwise).
    let (serve, schedule_id, port) = start_serve(&system, SCHEDULED_NEVER_S);
    let bound = Duration::from_secs(60);
    testkit::eventually(bound, "both payouts posted", || async {
        (state_of(&payments, holder).await == PayoutState::Posted
            && state_of(&payments, behind).await == PayoutState::Posted)
            .then_some(())
    })
    .await
    .unwrap_or_else(|e| panic!("{e}\n{}", serve.log_tail(60)));
    let text = metrics_text(port).await.unwrap_or_default();
    assert_eq!(
        metric(&text, "reconciliation_runs_total"),
        Some(0.0),
        "no scheduled run did it: {text}"
    );
    assert_eq!(movements(&system, holder).await, 1, "the holder paid once");
    assert_eq!(
        movements(&system, behind).await,
        1,
        "the payout behind paid once"
    );
    stop_serve(serve, &schedule_id);
}

/// Temporal lost a payout's run while the worker session that holds the run's grant lives on
/// (issue 36, found by the fault suite: a RAIL_AMBIGUOUS payout resumed after Temporal's
/// database was deleted waited 600 s behind its own earlier run's grant, which the other worker's
/// live session kept). The resumed run waits for the key on a worker other than the grant's, so
/// the grant is no run's: the keeper's holder pass takes it over (`RUNNING_WITHOUT_THE_GRANT`)
/// and the payout is paid once. Before, the holder's workflow id had a running run, the grant was
/// left alone, and the payout waited for as long as that session lived (this test timed out).
#[tokio::test]
async fn a_grant_of_a_lost_run_whose_payout_runs_again_is_taken_over() {
    let payout = "k-rerun";
    let account = "k-acct-rerun";
    // A payout behind it (never started here): the account is one where someone waits, which
    // the keeper's holder pass looks at every interval.
    let HeldAccount {
        system,
        payments,
        client,
    } = held_account(account, payout, "k-rerun-behind", Vec::new()).await;
    // The lost run's grant: made for this payout on another worker's session ("worker-9"), which
    // stays alive (kept alive by its client) for the whole test.
    let lock = lock_client::LockClient::connect(&system.lock_url(), &system.tls(Role::Worker))
        .await
        .unwrap();
    let other_worker = lock
        .open_session("worker-9", Duration::from_secs(10))
        .await
        .unwrap();
    let key = format!("payout:{account}");
    let lost_runs_grant = match other_worker
        .acquire_as(&key, &format!("worker-9/{payout}"), Duration::ZERO)
        .await
        .unwrap()
    {
        lock_client::Acquired::Granted(g) => g,
        other => panic!("{key} not granted: {other:?}"),
    };
    // The payout's run again (as the reconciler's resume starts it): it waits for the key on
    // worker-0.
    payout_workflows::client::start_payout(
        &client,
        &system.task_queue,
        &payout_input(account, payout, 500, 600_000),
    )
    .await
    .unwrap();
    let temporal = Temporal::connect(&temporal_config(&system)).await.unwrap();
    let workflow_id = payout_domain::workflow_id(&payout_domain::PayoutId::parse(payout).unwrap());
    testkit::eventually(SETTLE_TIMEOUT, "the run waiting for its key", || async {
        (temporal
            .holder_status(&workflow_id, "worker-9")
            .await
            .ok()?
            == WorkflowStatus::RunningWithoutTheGrant)
            .then_some(())
    })
    .await
    .unwrap();
    assert_eq!(
        temporal
            .holder_status(&workflow_id, "worker-0")
            .await
            .unwrap(),
        WorkflowStatus::Running,
        "a grant on the waiting attempt's own worker may be its answer: left alone"
    );
    let (serve, schedule_id, _port) = start_serve(&system, SCHEDULED_NEVER_S);
    let bound = Duration::from_secs(60);
    testkit::eventually(bound, "the payout posted", || async {
        (state_of(&payments, payout).await == PayoutState::Posted).then_some(())
    })
    .await
    .unwrap_or_else(|e| panic!("{e}\n{}", serve.log_tail(60)));
    assert_eq!(movements(&system, payout).await, 1, "paid once");
    let described = lock.describe(&key).await.unwrap();
    assert!(
        !(described.held && described.holder_owner == format!("worker-9/{payout}")),
        "the lost run's grant (token {}) was taken over: {described:?}",
        lost_runs_grant.token().get()
    );
    assert!(
        std::fs::read_to_string(system.dir.join("reconciler.log"))
            .unwrap_or_default()
            .contains("RUNNING_WITHOUT_THE_GRANT"),
        "the takeover says why"
    );
    stop_serve(serve, &schedule_id);
}

/// A run lost with its reconciler waits this long at most for its retry to complete one: well
/// past the run's heartbeat timeout (30 s) and its retry's backoff on a loaded machine, well short
/// of the run's start-to-close (600 s), until which a lost run without heartbeats held the
/// schedule (overlap: skip).
const LOST_RUN_RETRIED_WITHIN: Duration = Duration::from_secs(240);

/// Whether a scheduled run's `Reconcile` activity has started on a worker (Temporal's pending
/// activity state), from `temporal workflow describe`.
fn run_activity_started(schedule_id: &str) -> Option<()> {
    let query = format!(
        "WorkflowType='ReconcileWorkflow' AND ExecutionStatus='Running' AND WorkflowId STARTS_WITH '{schedule_id}-run'"
    );
    let listed = temporal_cli(&[
        "workflow",
        "list",
        "--namespace",
        testkit::temporal::NAMESPACE,
        "--query",
        &query,
        "--output",
        "json",
    ])
    .ok()?;
    let runs: Vec<serde_json::Value> = serde_json::from_str(&listed).ok()?;
    runs.iter().find_map(|run| {
        let id = run["execution"]["workflowId"].as_str()?;
        let described = temporal_cli(&[
            "workflow",
            "describe",
            "--namespace",
            testkit::temporal::NAMESPACE,
            "--workflow-id",
            id,
            "--output",
            "json",
        ])
        .ok()?;
        described
            .contains("PENDING_ACTIVITY_STATE_STARTED")
            .then_some(())
    })
}

#[tokio::test]
async fn a_run_lost_with_its_reconciler_is_tried_again_within_its_heartbeat_timeout() {
    let system = system_without_workers().await;
    // Every run reads the payouts: with the table locked, a run that starts waits on the lock.
    let paydb = service_kit::connect_pg(&system.databases.paydb)
        .await
        .unwrap();
    let mut blocker = paydb.begin().await.unwrap();
    sqlx::query("LOCK TABLE payout IN ACCESS EXCLUSIVE MODE")
        .execute(&mut *blocker)
        .await
        .unwrap();
    let (serve, schedule_id, port) = start_serve(&system, 5);
    testkit::eventually(
        REPAIR_TIMEOUT,
        "a scheduled run's activity started (and waiting on the locked table)",
        || async { run_activity_started(&schedule_id) },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}\n{}", serve.log_tail(40)));

    // The reconciler dies mid-run (SIGKILL: a crash, a rolling restart's last resort), the
    // table is free again, and the process is started again.
    serve.kill().unwrap();
    blocker.rollback().await.unwrap();
    serve.restart().unwrap();
    // Its schedule skips while a run is open: only the lost run's retry, or the lost run's end,
    // lets one complete. With heartbeats, Temporal gives the lost attempt up within 30 s.
    testkit::eventually(
        LOST_RUN_RETRIED_WITHIN,
        "a run completed by the restarted reconciler",
        || async {
            let text = metrics_text(port).await?;
            (metric(&text, "reconciliation_runs_total")? >= 1.0).then_some(())
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}\n{}", serve.log_tail(40)));
    testkit::util::close_pool(paydb).await;
    stop_serve(serve, &schedule_id);
}
