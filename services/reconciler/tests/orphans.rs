//! Orphan resolution and the scheduled reconciler against a real system (every service a
//! process, the testkit's Temporal). Payouts are driven by hand to RAIL_AMBIGUOUS under real
//! grants, with no workflow (an orphan) or with one running; then `reconciler once
//! --resolve-orphans` (the binary) must resolve exactly what the evidence allows, and `reconciler
//! serve` must register its schedule and run on it.

use std::collections::HashMap;
use std::time::Duration;
use testkit::pki::Role;

use payout_domain::{PayoutId, PayoutState};
use rail_proxy_client::{ProxyError, RailProxyClient};
use resolver::resolve::Resolution;
use testkit::etcd::EtcdRole;
use testkit::system::System;
use testkit::{ManagedProcess, ProcessSpec, Stack};

mod common;
use common::{
    drive_to_ambiguous, grant, metric, metrics_text, movements, new_payout, once_json, source_args,
    state_in, submit_request, system_with_an_undecided_rail, Ambiguity,
};

fn config_args(system: &System) -> Vec<String> {
    let s = |v: &str| v.to_string();
    source_args(system, &system.temporal_address)
        .into_iter()
        .chain(
            Stack::shared()
                .etcd_identity(EtcdRole::Reconciler, &system.etcd_prefix)
                .unwrap()
                .to_args()
                .into_iter()
                .map(|a| a.into_string().unwrap()),
        )
        .chain([
            s("--etcd-endpoints"),
            Stack::shared().etcd_endpoints().join(","),
            s("--lock-prefix"),
            system.etcd_prefix.clone(),
            s("--resolve-orphans"),
        ])
        .collect()
}

/// `reconciler once --json --resolve-orphans`, the binary, as an operator runs it.
fn reconcile_once(system: &System) -> (serde_json::Value, Vec<Resolution>, bool) {
    let (report, clean) = once_json(&config_args(system), &[]);
    let resolutions = report["resolutions"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| Resolution {
            payout_id: r["payout_id"].as_str().unwrap().into(),
            account_id: r["account_id"].as_str().unwrap().into(),
            workflow: r["workflow"].as_str().unwrap().into(),
            evidence: r["evidence"].as_str().unwrap().into(),
            new_state: r["new_state"].as_str().unwrap().into(),
            token: r["token"].as_u64(),
            detail: r["detail"].as_str().unwrap().into(),
        })
        .collect();
    (report, resolutions, clean)
}

fn by_payout(resolutions: &[Resolution]) -> HashMap<String, Resolution> {
    resolutions
        .iter()
        .map(|r| (r.payout_id.clone(), r.clone()))
        .collect()
}

#[tokio::test]
async fn orphans_are_resolved_with_evidence_only_and_the_schedule_runs() {
    let temporal = Stack::shared().temporal();
    // The rail cannot say "absent" for a long time: UNKNOWN stays UNKNOWN in this test.
    let system = system_with_an_undecided_rail().await;

    drive_to_ambiguous(&system, "acct-o1", "po-found", Ambiguity::AcceptedThenHung).await;
    drive_to_ambiguous(&system, "acct-o2", "po-unsent", Ambiguity::NeverSubmitted).await;
    drive_to_ambiguous(
        &system,
        "acct-o3",
        "po-unknown",
        Ambiguity::FailedBeforeActing,
    )
    .await;
    drive_to_ambiguous(&system, "acct-o4", "po-running", Ambiguity::NeverSubmitted).await;
    assert_eq!(movements(&system, "po-found").await, 1, "the rail accepted");
    // po-running's workflow is alive (on a queue nobody polls, so it stays RUNNING).
    temporal
        .cli(&[
            "workflow",
            "start",
            "--workflow-id",
            "payout-po-running",
            "--type",
            "PayoutWorkflow",
            "--task-queue",
            &format!("{}-nobody", system.task_queue),
        ])
        .unwrap();

    let (report, resolutions, clean) = reconcile_once(&system);
    let r = by_payout(&resolutions);
    assert!(clean, "the report must be clean: {report:#}");
    assert!(
        !r.contains_key("po-running"),
        "a payout whose workflow runs is not touched: {resolutions:?}"
    );
    assert_eq!(r.len(), 3, "{resolutions:?}");

    // FOUND: the movement is evidence; the reconciler completes the posting. One movement.
    let found = &r["po-found"];
    assert_eq!(found.workflow, "NOT_FOUND");
    assert_eq!(
        (found.evidence.as_str(), found.new_state.as_str()),
        ("FOUND", "POSTED"),
        "{found:?}"
    );
    assert_eq!(state_in(&system, "po-found").await, PayoutState::Posted);
    assert_eq!(movements(&system, "po-found").await, 1);

    // NEVER_SENT: the inquiry sealed it at the proxy, and it failed.
    let unsent = &r["po-unsent"];
    assert_eq!(
        (unsent.evidence.as_str(), unsent.new_state.as_str()),
        ("NEVER_SENT", "FAILED"),
        "{unsent:?}"
    );
    assert_eq!(state_in(&system, "po-unsent").await, PayoutState::Failed);
    // Sealed: a later Submit, even under a newer grant, is a DUPLICATE and sends nothing.
    let late = new_payout("acct-o2", "po-unsent");
    let late_grant = grant(&system, &late.account_id, "late-holder").await;
    let mut proxy = RailProxyClient::connect(&system.proxy_url(), &system.tls(Role::Worker))
        .await
        .unwrap();
    match proxy
        .submit(&submit_request(&system, &late, &late_grant))
        .await
    {
        Err(ProxyError::Duplicate { existing, .. }) => {
            assert!(existing.is_sealed(), "{existing:?}")
        }
        other => panic!("a sealed payout must refuse a later Submit: {other:?}"),
    }
    late_grant.release().await.unwrap();
    assert_eq!(movements(&system, "po-unsent").await, 0);

    // UNKNOWN: inside the settlement window nothing is decided; left alone and reported.
    let unknown = &r["po-unknown"];
    assert_eq!(
        (unknown.evidence.as_str(), unknown.new_state.as_str()),
        ("UNKNOWN", "RAIL_AMBIGUOUS"),
        "{unknown:?}"
    );
    assert!(!unknown.resolved());
    assert_eq!(
        state_in(&system, "po-unknown").await,
        PayoutState::RailAmbiguous
    );

    // The running workflow's payout: untouched, and no inquiry sealed it at the proxy.
    assert_eq!(
        state_in(&system, "po-running").await,
        PayoutState::RailAmbiguous
    );
    assert!(proxy
        .lookup(&PayoutId::parse("po-running").unwrap())
        .await
        .unwrap()
        .is_none());

    // A second run: only the undecidable one is left; nothing moves twice.
    let (_, again, _) = reconcile_once(&system);
    assert_eq!(
        again
            .iter()
            .map(|r| (r.payout_id.as_str(), r.evidence.as_str()))
            .collect::<Vec<_>>(),
        vec![("po-unknown", "UNKNOWN")]
    );
    assert_eq!(movements(&system, "po-found").await, 1);

    // Control for the running-workflow case: once that workflow is gone (terminated), the same
    // payout is an orphan and is resolved (never sent: sealed, FAILED). The workflow's status,
    // not luck, is what kept it untouched above.
    temporal
        .cli(&[
            "workflow",
            "terminate",
            "--workflow-id",
            "payout-po-running",
            "--reason",
            "test: the workflow is gone",
        ])
        .unwrap();
    let (_, after, _) = reconcile_once(&system);
    let after = by_payout(&after);
    let was_running = &after["po-running"];
    assert_eq!(
        (
            was_running.workflow.as_str(),
            was_running.evidence.as_str(),
            was_running.new_state.as_str()
        ),
        ("TERMINATED", "NEVER_SENT", "FAILED"),
        "{was_running:?}"
    );
    assert_eq!(after["po-unknown"].evidence, "UNKNOWN");

    // `reconciler serve`: registers the schedule (every 2 s) and runs on it.
    let metrics_port = testkit::free_port();
    let schedule_id = format!("reconciler-{}", system.task_queue);
    let queue = format!("{}-reconciliation", system.task_queue);
    let serve = ManagedProcess::start(
        ProcessSpec::new(
            "reconciler",
            testkit::workspace_bin("reconciler"),
            system.dir.join("reconciler.log"),
        )
        .arg("serve")
        .args(config_args(&system))
        .args(["--task-queue", &queue, "--schedule-id", &schedule_id])
        .args(["--interval-s", "2"])
        .args([
            "--metrics-listen".to_string(),
            format!("127.0.0.1:{metrics_port}"),
        ]),
    )
    .unwrap();
    let text = testkit::eventually(Duration::from_secs(90), "a scheduled run", || async {
        let text = metrics_text(metrics_port).await?;
        (metric(&text, "reconciliation_runs_total")? >= 1.0).then_some(text)
    })
    .await
    .unwrap_or_else(|e| panic!("{e}\n{}", serve.log_tail(40)));
    assert!(
        metric(&text, "reconciliation_last_run_unix_seconds").unwrap() > 0.0,
        "{text}"
    );
    assert!(
        text.contains("reconciliation_violations{check=\"rail_movements_match_the_books\"} 0"),
        "{text}"
    );
    assert!(
        text.contains("reconciliation_orphans_resolved_total{evidence=\"UNKNOWN\"}"),
        "the scheduled run asked about the undecidable orphan again: {text}"
    );
    let described = temporal
        .cli(&[
            "schedule",
            "describe",
            "--schedule-id",
            &schedule_id,
            "--output",
            "json",
        ])
        .unwrap();
    assert!(described.contains("ReconcileWorkflow"), "{described}");
    // The scheduled workflow completed (the run went through Temporal, not around it).
    let query = format!(
        "WorkflowType = 'ReconcileWorkflow' AND TaskQueue = '{queue}' AND ExecutionStatus = 'Completed'"
    );
    testkit::eventually(
        Duration::from_secs(60),
        "a completed ReconcileWorkflow",
        || {
            let listed = temporal
                .cli(&["workflow", "list", "--query", &query, "--output", "json"])
                .unwrap_or_default();
            async move { listed.contains("ReconcileWorkflow").then_some(()) }
        },
    )
    .await
    .unwrap();
    // Creating the schedule again (a restarted replica) is success.
    serve.terminate().unwrap();
    serve.restart().unwrap();
    testkit::eventually(Duration::from_secs(60), "restarted serve", || {
        let log = std::fs::read_to_string(system.dir.join("reconciler.log")).unwrap_or_default();
        async move { log.contains("schedule already exists").then_some(()) }
    })
    .await
    .unwrap_or_else(|e| panic!("{e}\n{}", serve.log_tail(40)));
    assert!(serve.is_running(), "{}", serve.log_tail(40));
    serve.terminate().unwrap();
    let _ = temporal.cli(&["schedule", "delete", "--schedule-id", &schedule_id]);
    assert_eq!(movements(&system, "po-found").await, 1);
}
