//! Stranded payouts (issue 14, item 2): a payout whose workflow ended in PENDING, CLAIMED,
//! RAIL_SUBMITTED or RAIL_ACKED, or that never had one, is finished by one reconcile pass
//! (`reconciler once --resume-stranded`, the binary, as an operator runs it): its account's key
//! is taken over from the grant the dead workflow left held, and a new workflow run continues
//! from the state the payment resource reports, with evidence only. Every service is a process;
//! the workflows are terminated with the `temporal` CLI, as an operator would.

use std::collections::HashMap;
use std::time::Duration;
use testkit::pki::Role;

use payment_client::PaymentClient;
use payout_domain::{ClientReference, PayoutId, PayoutState};
use payout_workflows::client as wf;
use testkit::system::{System, SystemOptions};
use testkit::Stack;

mod common;
use common::{
    create_payouts, new_payout, once_json, payout_input, resumptions, source_args, state_of,
    terminate, wait_state, SETTLE_TIMEOUT,
};

/// The stall points hold a step far longer than the test: the terminated workflow's activity
/// never reaches its guard while the test looks.
const STALL_MS: u64 = 600_000;

/// `reconciler once --json --resume-stranded`: the report's resumptions, by payout (or account).
fn reconcile_once(system: &System) -> HashMap<String, serde_json::Value> {
    let mut args = source_args(system, &system.temporal_address);
    args.extend(["--not-started-grace-ms", "0", "--resume-stranded"].map(String::from));
    resumptions(&once_json(&args, &[]).0)
}

#[tokio::test]
async fn stranded_payouts_in_every_state_are_finished_by_one_reconcile_pass() {
    let stack = Stack::shared();
    // One worker, so the stall points (keyed by the worker's identity) are its own: the
    // workflow of each payout freezes right before the step that would take it further.
    let stall = |step: &str, payout: &str| format!("worker-0:{step}:{payout}:{STALL_MS}");
    let claimed = "s-claimed";
    let submitted = "s-submitted";
    let acked = "s-acked";
    let waiting = "s-waiting";
    let never_started = "s-never";
    let system = System::start(
        stack,
        SystemOptions {
            workers: 1,
            settlement_window_ms: 500,
            rail_timeout_ms: 2_000,
            worker_env: vec![
                ("PAYOUT_LOCK_TTL_MS".into(), "3000".into()),
                (
                    "PAYOUT_TEST_STALL_AFTER_CHECK".into(),
                    [
                        stall("mark_submitted", claimed),
                        stall("submit", submitted),
                        stall("post", acked),
                    ]
                    .join(","),
                ),
            ],
            // The stall points are the test worker's (system_tests::stall).
            test_worker: true,
            ..SystemOptions::default()
        },
    )
    .await
    .unwrap();
    let payments = PaymentClient::connect(&system.payment_url(), &system.tls(Role::Worker))
        .await
        .unwrap();
    let temporal = wf::connect_configured(
        &wf::TemporalArgs::profile_of(&system.temporal_clients, "operator"),
        "stranded-test",
    )
    .await
    .unwrap();
    // Account A: the CLAIMED payout, and a second one waiting for A's key behind it.
    let accounts = [
        ("s-acct-a", vec![claimed, waiting]),
        ("s-acct-b", vec![submitted]),
        ("s-acct-c", vec![acked]),
        ("s-acct-d", vec![never_started]),
    ];
    for (account, payouts) in &accounts {
        create_payouts(&system, account, payouts).await;
    }
    let start = |account: &str, payout: &str| payout_input(account, payout, 500, 600_000);
    let mut started = Vec::new();
    for (account, payout) in [
        ("s-acct-a", claimed),
        ("s-acct-b", submitted),
        ("s-acct-c", acked),
    ] {
        started.push(
            wf::start_payout(&temporal, &system.task_queue, &start(account, payout))
                .await
                .unwrap(),
        );
    }
    wait_state(&payments, claimed, PayoutState::Claimed).await;
    wait_state(&payments, submitted, PayoutState::RailSubmitted).await;
    wait_state(&payments, acked, PayoutState::RailAcked).await;
    // The second payout of A waits for A's key, PENDING.
    let waiting_id = wf::start_payout(&temporal, &system.task_queue, &start("s-acct-a", waiting))
        .await
        .unwrap();
    testkit::eventually(
        SETTLE_TIMEOUT,
        "the second payout waits for the key",
        || async {
            wf::status(&temporal, &waiting_id)
                .await
                .ok()?
                .last_event
                .starts_with("WAITING_FOR_LOCK")
                .then_some(())
        },
    )
    .await
    .unwrap();
    started.push(waiting_id);
    for id in &started {
        terminate(id);
    }

    // Before the pass: nothing finishes them. The terminated CLAIMED payout's grant stays held
    // by the worker's live session for well past its lease.
    tokio::time::sleep(Duration::from_secs(7)).await;
    for (payout, state) in [
        (claimed, PayoutState::Claimed),
        (submitted, PayoutState::RailSubmitted),
        (acked, PayoutState::RailAcked),
        (waiting, PayoutState::Pending),
        (never_started, PayoutState::Pending),
    ] {
        assert_eq!(
            state_of(&payments, payout).await,
            state,
            "{payout} stranded"
        );
    }
    let lock = lock_client::LockClient::connect(&system.lock_url(), &system.tls(Role::Worker))
        .await
        .unwrap();
    let held = lock.describe("payout:s-acct-a").await.unwrap();
    assert!(
        held.held && held.holder_owner.ends_with(claimed),
        "the dead workflow's grant is still held: {held:?}"
    );

    // One pass.
    let resumed = reconcile_once(&system);
    for payout in [claimed, submitted, acked, waiting, never_started] {
        let r = &resumed
            .get(payout)
            .unwrap_or_else(|| panic!("{payout} resumed: {resumed:?}"));
        assert_eq!(r["action"], "RESUMED", "{r}");
    }
    assert_eq!(
        resumed[claimed]["took_over_from"],
        format!("worker-0/{claimed}"),
        "{resumed:?}"
    );
    assert_eq!(resumed[submitted]["workflow"], "TERMINATED");
    assert_eq!(resumed[never_started]["workflow"], "NOT_FOUND");
    // The resumed run explains itself in the Temporal UI (its static summary says it was resumed).
    let described = Stack::shared()
        .temporal()
        .cli(&[
            "workflow",
            "describe",
            "--namespace",
            testkit::temporal::NAMESPACE,
            "--workflow-id",
            &format!("payout-{never_started}"),
        ])
        .unwrap();
    assert!(
        described.contains(&format!(
            "Payout {never_started}: resumed by the reconciler's stranded-payout pass (account s-acct-"
        )),
        "the resumed run's summary: {described}"
    );

    // Each ends terminal, paid at most once, its books right; A's second payout runs too.
    for (payout, state) in [
        (claimed, PayoutState::Posted),
        (acked, PayoutState::Posted),
        (waiting, PayoutState::Posted),
        (never_started, PayoutState::Posted),
        // Maybe sent, resolved by inquiry: never sent (its submission is still frozen), sealed.
        (submitted, PayoutState::Failed),
    ] {
        wait_state(&payments, payout, state).await;
    }
    let truth = rail_stub::client::StubClient::new(system.rail_stub_endpoints())
        .expect("the harness's rail client")
        .ground_truth()
        .await
        .unwrap();
    for (payout, expected) in [
        (claimed, 1),
        (acked, 1),
        (waiting, 1),
        (never_started, 1),
        (submitted, 0),
    ] {
        let reference = ClientReference::for_payout(&PayoutId::parse(payout).unwrap());
        let moved = truth
            .movement_counts
            .get(reference.as_str())
            .copied()
            .unwrap_or(0);
        assert_eq!(moved, expected, "{payout}: rail movements");
    }
    let sources = reconciler::Sources {
        paydb: service_kit::connect_pg(&system.databases.paydb)
            .await
            .unwrap(),
        proxydb: service_kit::connect_pg(&system.databases.proxydb)
            .await
            .unwrap(),
        gldb: service_kit::connect_pg(&system.databases.gldb)
            .await
            .unwrap(),
        rail_proxy: Some(reconciler::ProxySource {
            url: system.proxy_url(),
            tls: system.tls(Role::Reconciler),
        }),
        lock_grants: None,
        operators: Some(system.operator.verifier()),
    };
    // The outbox drains into the GL; then every detective control is clean.
    let report = testkit::eventually(SETTLE_TIMEOUT, "the books reconcile", || async {
        let report = reconciler::reconcile(
            &sources,
            &reconciler::Options {
                require_outbox_drained: true,
                ..Default::default()
            },
        )
        .await
        .ok()?;
        report.is_clean().then_some(report)
    })
    .await
    .unwrap();
    assert_eq!(
        report.payouts_by_state.get("POSTED"),
        Some(&4),
        "{}",
        report.render()
    );
}

/// The rail's settlement window in the ambiguous-orphan test until the test changes it: its
/// lookup says UNKNOWN this long after the failed attempt. It is longer than every bounded wait
/// of the test up to the resumed run's first inquiry put together (three of [`SETTLE_TIMEOUT`]),
/// so that inquiry finds the rail unable to say however slow the machine; the evidence (ABSENT)
/// comes only when the test restarts the rail with no window, after it has seen that inquiry.
const AMBIGUOUS_RAIL_WINDOW_MS: u64 = 600_000;

/// Issue 35, item 3: a RAIL_AMBIGUOUS payout whose workflow was terminated has nobody left to ask
/// the rail, and the payouts behind it on its account wait for ever. One pass hands it to a new
/// run, which asks the rail at once (never submits), is told UNKNOWN, asks again until the rail
/// has evidence, resolves it (ABSENT: FAILED); the next payout of the account then goes through.
#[tokio::test]
async fn an_orphaned_ambiguous_payout_is_resumed_by_one_pass_inquires_and_frees_its_account() {
    let stack = Stack::shared();
    let ambiguous = "s-amb";
    let behind = "s-amb-next";
    let account = "s-acct-amb";
    let system = System::start(
        stack,
        SystemOptions {
            workers: 1,
            settlement_window_ms: AMBIGUOUS_RAIL_WINDOW_MS,
            rail_timeout_ms: 2_000,
            ..SystemOptions::default()
        },
    )
    .await
    .unwrap();
    let payments = PaymentClient::connect(&system.payment_url(), &system.tls(Role::Worker))
        .await
        .unwrap();
    let fixture = PaymentClient::connect(&system.payment_url(), &system.tls(Role::Fixture))
        .await
        .unwrap();
    let temporal = wf::connect_configured(
        &wf::TemporalArgs::profile_of(&system.temporal_clients, "operator"),
        "stranded-test",
    )
    .await
    .unwrap();
    let rail = rail_stub::client::StubClient::new(system.rail_stub_endpoints())
        .expect("the harness's rail client");
    let reference =
        |payout: &str| ClientReference::for_payout(&PayoutId::parse(payout).unwrap()).to_string();
    let first = new_payout(account, ambiguous);
    system
        .operator
        .open_account(&fixture, &first.account_id, &first.currency, 100_000)
        .await
        .unwrap();
    for payout in [ambiguous, behind] {
        fixture
            .create_payout(&new_payout(account, payout))
            .await
            .unwrap();
    }
    // The rail answers 503 without acting: the proxy records TIMEOUT, the payout is ambiguous.
    rail.force(
        &reference(ambiguous),
        Some(rail_stub::FaultMode::FailBeforeActing),
    )
    .await
    .unwrap();
    let start = |payout: &str, settlement_window_ms: u64| {
        payout_input(account, payout, settlement_window_ms, 600_000)
    };
    // Its first run waits a window far longer than the test before it would ask the rail: it is
    // terminated while it waits, holding the account's key.
    let ambiguous_id = wf::start_payout(&temporal, &system.task_queue, &start(ambiguous, STALL_MS))
        .await
        .unwrap();
    wait_state(&payments, ambiguous, PayoutState::RailAmbiguous).await;
    let behind_id = wf::start_payout(&temporal, &system.task_queue, &start(behind, 500))
        .await
        .unwrap();
    testkit::eventually(
        SETTLE_TIMEOUT,
        "the next payout waits for the key",
        || async {
            wf::status(&temporal, &behind_id)
                .await
                .ok()?
                .last_event
                .starts_with("WAITING_FOR_LOCK")
                .then_some(())
        },
    )
    .await
    .unwrap();
    terminate(&ambiguous_id);

    // Before the pass: ambiguous, asked by nobody, sent once; its dead run's grant still held,
    // the next payout PENDING behind it; and the rail cannot say yet.
    assert_eq!(
        state_of(&payments, ambiguous).await,
        PayoutState::RailAmbiguous
    );
    assert_eq!(state_of(&payments, behind).await, PayoutState::Pending);
    let mut proxy =
        rail_proxy_client::RailProxyClient::connect(&system.proxy_url(), &system.tls(Role::Worker))
            .await
            .unwrap();
    let ambiguous_payout = PayoutId::parse(ambiguous).unwrap();
    let record = proxy.lookup(&ambiguous_payout).await.unwrap().unwrap();
    assert!(
        record.resolutions.is_empty(),
        "nobody asked the rail before the pass: {record:?}"
    );
    let lock = lock_client::LockClient::connect(&system.lock_url(), &system.tls(Role::Worker))
        .await
        .unwrap();
    let key = format!("payout:{account}");
    let held = lock.describe(&key).await.unwrap();
    assert!(
        held.held && held.holder_owner.ends_with(ambiguous),
        "the dead workflow's grant is still held: {held:?}"
    );
    let submit_requests = |truth: &rail_stub::GroundTruth, payout: &str| {
        truth
            .submit_request_counts
            .get(&reference(payout))
            .copied()
            .unwrap_or(0)
    };
    assert_eq!(
        submit_requests(&rail.ground_truth().await.unwrap(), ambiguous),
        1
    );
    assert_eq!(
        rail.lookup(&reference(ambiguous)).await.unwrap().state,
        "unknown",
        "the rail can say nothing yet"
    );
    let pass_started_unix_ms = rail_stub::book::unix_ms_now();

    // One pass.
    let resumed = reconcile_once(&system);
    let r = resumed
        .get(ambiguous)
        .unwrap_or_else(|| panic!("{ambiguous} resumed: {resumed:?}"));
    assert_eq!(
        (&r["action"], &r["state"], &r["workflow"]),
        (
            &serde_json::json!("RESUMED"),
            &serde_json::json!("RAIL_AMBIGUOUS"),
            &serde_json::json!("TERMINATED")
        ),
        "{r}"
    );
    assert_eq!(r["took_over_from"], format!("worker-0/{ambiguous}"), "{r}");
    assert!(
        !resumed.contains_key(behind),
        "a payout whose workflow runs is not resumed: {resumed:?}"
    );

    // The resumed run asks at once, under its new grant, and the rail cannot say yet.
    let asked = testkit::eventually(SETTLE_TIMEOUT, "the resumed run asks the rail", || {
        let mut proxy = proxy.clone();
        let payout = ambiguous_payout.clone();
        async move {
            let record = proxy.lookup(&payout).await.ok()??;
            record.resolutions.first().cloned()
        }
    })
    .await
    .unwrap();
    assert!(
        asked.asked_at_unix_ms >= pass_started_unix_ms,
        "asked after the pass: {asked:?}"
    );
    assert!(
        matches!(asked.evidence, rail_proxy_client::Evidence::Unknown { .. }),
        "the resumed run asked inside the rail's window ({AMBIGUOUS_RAIL_WINDOW_MS} ms): {asked:?}"
    );

    // Now the rail has its evidence: restarted with no settlement window, its lookup of the
    // payout (never moved) is ABSENT. The resumed run's next inquiry finds it.
    let mut spec = system.rail_stub.spec().clone();
    let window = spec
        .args
        .iter()
        .position(|a| a == "--settlement-window-ms")
        .expect("the stub is started with its window");
    spec.args[window + 1] = "0".into();
    system.rail_stub.terminate().unwrap();
    let _rail = testkit::ManagedProcess::start(spec).unwrap();
    testkit::eventually(SETTLE_TIMEOUT, "the rail back with no window", || async {
        (rail.lookup(&reference(ambiguous)).await.ok()?.state == "absent").then_some(())
    })
    .await
    .unwrap();

    // The evidence comes later: ABSENT, and the payout FAILED; never sent again. Then the
    // account is free and the payout behind it is paid.
    wait_state(&payments, ambiguous, PayoutState::Failed).await;
    wait_state(&payments, behind, PayoutState::Posted).await;
    let record = proxy.lookup(&ambiguous_payout).await.unwrap().unwrap();
    assert!(
        matches!(
            record.resolutions.last().map(|r| &r.evidence),
            Some(rail_proxy_client::Evidence::Absent)
        ),
        "resolved by the rail's evidence: {record:?}"
    );
    // The restarted rail counts requests from its restart: none for the ambiguous payout, whose
    // resumed run only asked; its one request (the first run's) was counted before.
    let truth = rail.ground_truth().await.unwrap();
    assert_eq!(
        submit_requests(&truth, ambiguous),
        0,
        "the resumed run never submits"
    );
    assert_eq!(truth.movement_counts.get(&reference(ambiguous)), None);
    assert_eq!(truth.movement_counts.get(&reference(behind)), Some(&1));
    assert_eq!(submit_requests(&truth, behind), 1);
}

/// Issue 33 (design section 2, "Squatters"): someone starts a workflow of their own on a payout's
/// id, `payout-{id}`, before the starter delivers (the starter then finds the id taken, counts
/// the start as delivered and never starts the payout's workflow): an impostor registered as
/// `PayoutWorkflow` on a queue of its own, and a workflow of another type on the payout queue.
/// While they run, nothing pays either payout. One pass terminates each squatter's run
/// (SQUATTER_TERMINATED) and resumes the payout (RESUMED); both end POSTED, paid once. The
/// negative control runs the same pass in this process with the squatter check switched off
/// (`seams::set_squat_detection`, feature `test-seams`): it takes the squatters for the
/// payouts' workflows and leaves both PENDING.
#[tokio::test]
async fn a_foreign_workflow_squatting_a_payout_is_terminated_and_the_payout_finishes() {
    let system = System::start(
        Stack::shared(),
        SystemOptions {
            workers: 1,
            workflow_starts: Some(testkit::system::WorkflowStarts {
                settlement_window_ms: 500,
                resolution_sla_ms: 600_000,
            }),
            ..SystemOptions::default()
        },
    )
    .await
    .unwrap();
    let payments = PaymentClient::connect(&system.payment_url(), &system.tls(Role::Worker))
        .await
        .unwrap();
    let impostor = "sq-impostor";
    let foreign = "sq-foreign";
    // The starter is held while the payouts are created and the squatters start.
    system.dispatcher.pause().unwrap();
    create_payouts(&system, "sq-acct-a", &[impostor]).await;
    create_payouts(&system, "sq-acct-b", &[foreign]).await;
    let rogue_queue = format!("{}-rogue", system.task_queue);
    for (payout, workflow_type, queue) in [
        (impostor, "PayoutWorkflow", rogue_queue.as_str()),
        (foreign, "SquatterWorkflow", system.task_queue.as_str()),
    ] {
        common::start_workflow_as(payout, workflow_type, queue);
    }
    system.dispatcher.resume().unwrap();
    for payout in [impostor, foreign] {
        let delivered = format!(
            "SELECT started_at IS NOT NULL FROM workflow_start WHERE payout_id = '{payout}'"
        );
        testkit::eventually(SETTLE_TIMEOUT, "the start counted as delivered", || {
            let answer = common::paydb_scalar(&system, &delivered);
            async move { (answer.as_deref() == Some("t")).then_some(()) }
        })
        .await
        .unwrap();
    }

    // The control: without the check a pass sees two running workflows and does nothing.
    let paydb = sqlx::PgPool::connect(&system.databases.paydb)
        .await
        .unwrap();
    let config = resolver::resume::ResumeConfig {
        lock_url: system.lock_url(),
        tls: system.tls(Role::Reconciler),
        temporal: resolver::resume::TemporalConfig {
            connection: payout_workflows::client::TemporalArgs::profile_of(
                &system.temporal_clients,
                "reconciler",
            ),
            payout_task_queue: system.task_queue.clone(),
            settlement_window_ms: 500,
            resolution_sla_ms: 600_000,
        },
        not_started_grace: Duration::ZERO,
        bounds: resolver::walk::PassBounds::default(),
        lock_history: None,
    };
    resolver::resume::seams::set_squat_detection(false);
    let blind =
        resolver::resume::resume_stranded(&paydb, &config, &mut resolver::walk::Cursor::default())
            .await;
    resolver::resume::seams::set_squat_detection(true);
    paydb.close().await;
    let blind = blind.unwrap();
    assert!(
        blind
            .done
            .iter()
            .all(|r| r.payout_id != impostor && r.payout_id != foreign),
        "without the check the squatters pass for the payouts' workflows: {:?}",
        blind.done
    );
    for payout in [impostor, foreign] {
        assert_eq!(state_of(&payments, payout).await, PayoutState::Pending);
    }

    // One pass of the binary: each squatter terminated, then the payout resumed.
    let mut args = source_args(&system, &system.temporal_address);
    args.extend(["--not-started-grace-ms", "0", "--resume-stranded"].map(String::from));
    let report = once_json(&args, &[]).0;
    for payout in [impostor, foreign] {
        let actions: Vec<&str> = report["resumptions"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|r| r["payout_id"] == payout)
            .map(|r| r["action"].as_str().unwrap())
            .collect();
        assert_eq!(
            actions,
            ["SQUATTER_TERMINATED", "RESUMED"],
            "{payout}: {report}"
        );
    }
    let truth = rail_stub::client::StubClient::new(system.rail_stub_endpoints())
        .expect("the harness's rail client");
    for payout in [impostor, foreign] {
        wait_state(&payments, payout, PayoutState::Posted).await;
        let reference = ClientReference::for_payout(&PayoutId::parse(payout).unwrap());
        let moved = truth
            .ground_truth()
            .await
            .unwrap()
            .movement_counts
            .get(reference.as_str())
            .copied()
            .unwrap_or(0);
        assert_eq!(moved, 1, "{payout}: paid once");
    }
}
