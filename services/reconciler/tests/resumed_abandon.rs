//! The resolution SLA is the payment resource's record in every run (issue 35, item 1, its
//! second half): a run *started* in RAIL_AMBIGUOUS (the resume path) reads when the payout became
//! ambiguous from the payout's snapshot (`ambiguous_since_unix_ms`, GetPayout), so past the SLA
//! its abandon validator accepts an operator's signed abandon at once, before the run has seen an
//! UNKNOWN of its own. Every service is a process; the first run is terminated with the
//! `temporal` CLI and the new run is started by `reconciler once --resume-stranded`, as in
//! production. The new run's rail lookups fail (a transient error, as with the proxy
//! unreachable: the test worker's `inquire.failing`, `system_tests::stall`) until the abandon
//! has been accepted, so the run has no answer of the rail's of its own when its validator
//! decides. (A lookup held instead keeps the run's workflow task open, a local step, and the run
//! then accepts no Update until the lookup answers.)

use std::time::{Duration, Instant};

use payment_client::PaymentClient;
use payout_domain::{ClientReference, PayoutId, PayoutState};
use payout_workflows::client as wf;
use rail_stub::FaultMode;
use testkit::pki::Role;
use testkit::system::{System, SystemOptions};
use testkit::Stack;

mod common;
use common::{
    create_payouts, once_json, payout_input, resumptions, source_args, terminate, wait_state,
    SETTLE_TIMEOUT,
};

/// The resolution SLA (the payment resource's, the runs'): short, so the test passes it.
const SLA_MS: u64 = 3_000;
/// The first run's settlement window, and how long the rail cannot say "absent": far longer
/// than the test, so the first run never asks the rail and every lookup would answer UNKNOWN.
const LONG_WINDOW_MS: u64 = 600_000;

/// A directory of its own for the armed stall points, removed when the test ends.
struct StallDir(std::path::PathBuf);

impl StallDir {
    fn new() -> Self {
        let dir = std::env::temp_dir().join(format!("resumed-abandon-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        Self(dir)
    }

    fn path(&self) -> &std::path::Path {
        &self.0
    }
}

impl Drop for StallDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

#[tokio::test]
async fn a_run_started_in_rail_ambiguous_past_the_sla_accepts_an_abandon_before_its_own_inquiry() {
    // The armed stall points' directory, this test process's own.
    let stall_dir = StallDir::new();
    let system = System::start(
        Stack::shared(),
        SystemOptions {
            workers: 1,
            settlement_window_ms: LONG_WINDOW_MS,
            rail_timeout_ms: 1_000,
            resolution_sla_ms: Some(SLA_MS),
            // The armed stall points are the test worker's.
            test_worker: true,
            worker_env: vec![(
                "PAYOUT_TEST_STALL_DIR".into(),
                stall_dir.path().display().to_string(),
            )],
            ..SystemOptions::default()
        },
    )
    .await
    .unwrap();
    let account = "ra-acct";
    let payout = "ra-payout";
    let workflow_id = payout_domain::workflow_id(&PayoutId::parse(payout).unwrap());
    create_payouts(&system, account, &[payout]).await;
    // The rail fails before acting: the proxy records TIMEOUT, the payout becomes ambiguous.
    rail_stub::client::StubClient::new(system.rail_stub_endpoints())
        .expect("the harness's rail client")
        .force(
            &ClientReference::for_payout(&PayoutId::parse(payout).unwrap()).to_string(),
            Some(FaultMode::FailBeforeActing),
        )
        .await
        .unwrap();
    let temporal = wf::connect_configured(
        &wf::TemporalArgs::profile_of(&system.temporal_clients, "operator"),
        "resumed-abandon-test",
    )
    .await
    .unwrap();
    let input = payout_input(account, payout, LONG_WINDOW_MS, SLA_MS);
    wf::start_payout(&temporal, &system.task_queue, &input)
        .await
        .unwrap();
    let payments = PaymentClient::connect(&system.payment_url(), &system.tls(Role::Worker))
        .await
        .unwrap();
    wait_state(&payments, payout, PayoutState::RailAmbiguous).await;
    // The record's start of the ambiguity is before this instant: once SLA_MS have passed from
    // here, the record says the SLA has passed.
    let seen_ambiguous = Instant::now();

    // The first run waits its (long) window: it never asks the rail. It is terminated; the new
    // run's rail lookups will fail until the test releases them.
    std::fs::write(stall_dir.path().join("inquire.failing"), "").unwrap();
    testkit::eventually(
        SETTLE_TIMEOUT,
        "the record's resolution SLA passed",
        || async { (seen_ambiguous.elapsed() >= Duration::from_millis(SLA_MS)).then_some(()) },
    )
    .await
    .unwrap();
    terminate(&workflow_id);

    // The resume path: one pass hands the payout to a new run (the resolved SLA is SLA_MS).
    let mut args = source_args(&system, &system.temporal_address);
    args.extend(
        [
            "--not-started-grace-ms",
            "0",
            "--resume-stranded",
            "--resolution-sla-ms",
            &SLA_MS.to_string(),
        ]
        .map(String::from),
    );
    let done = resumptions(&once_json(&args, &[]).0);
    assert_eq!(
        done.get(payout).and_then(|r| r["action"].as_str()),
        Some("RESUMED"),
        "{done:?}"
    );

    // The new run has reached its first lookup, which failed: it has no answer of the rail's.
    let failed_file = stall_dir.path().join(format!("inquire.failed.{payout}"));
    testkit::eventually(SETTLE_TIMEOUT, "the new run's first lookup", || async {
        failed_file.exists().then_some(())
    })
    .await
    .unwrap();

    let signal: payout_workflows::AbandonSignal = serde_json::from_value(
        system
            .operator
            .abandon_signal(payout, "finance ticket 35: ambiguous past its SLA"),
    )
    .unwrap();
    // Accepted (the validator's decision) while every lookup fails, so before any answer of
    // the rail's in this run; then the Update's answer (the decision on record).
    let update = temporal
        .get_workflow_handle::<payout_workflows::PayoutWorkflow>(&workflow_id)
        .start_update(
            payout_workflows::PayoutWorkflow::abandon_update,
            signal,
            temporalio_client::WorkflowStartUpdateOptions::builder().build(),
        )
        .await;
    let update = update.unwrap_or_else(|e| panic!("the new run refused the abandon: {e}"));

    // Released, the lookup answers (UNKNOWN) and the run carries the abandon out.
    std::fs::write(
        stall_dir.path().join(format!("inquire.release.{payout}")),
        "",
    )
    .unwrap();
    let answer = update
        .get_result(Default::default())
        .await
        .unwrap_or_else(|e| panic!("the abandon's answer: {e}"));
    assert!(answer.accepted, "{answer:?}");
    wait_state(&payments, payout, PayoutState::Abandoned).await;
}
