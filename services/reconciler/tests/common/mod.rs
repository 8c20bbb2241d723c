//! What the reconciler's system tests share (each test binary uses a part of it): payouts made
//! and driven by hand against a real system, the `reconciler` binary run once, Temporal's CLI,
//! the rail's ground truth and `/metrics`.
#![allow(dead_code)]

use std::collections::HashMap;
use std::time::Duration;

use payment_client::model::{Fence, NewPayout, RailOutcome};
use payment_client::PaymentClient;
use payout_domain::{
    AccountId, AmountMinor, BeneficiaryRef, ClientReference, Currency, PayoutId, PayoutState,
};
use rail_proxy_client::{Outcome, RailProxyClient, SubmitPayout};
use rail_stub::FaultMode;
use testkit::pki::Role;
use testkit::system::{System, SystemOptions};
use testkit::Stack;

/// A payout through every service settles in seconds; this bounds a test that went wrong.
pub const SETTLE_TIMEOUT: Duration = Duration::from_secs(120);

pub fn new_payout(account: &str, payout: &str) -> NewPayout {
    NewPayout {
        payout_id: PayoutId::parse(payout).unwrap(),
        account_id: AccountId::parse(account).unwrap(),
        amount_minor: AmountMinor::new(700).unwrap(),
        currency: Currency::parse("EUR").unwrap(),
        beneficiary_ref: BeneficiaryRef::parse("ben-1").unwrap(),
    }
}

/// The workflow input of [`new_payout`] with these ambiguity clocks (a run's settlement window
/// and resolution SLA).
pub fn payout_input(
    account: &str,
    payout: &str,
    settlement_window_ms: u64,
    resolution_sla_ms: u64,
) -> payout_activities::types::PayoutInput {
    let new = new_payout(account, payout);
    payout_activities::types::PayoutInput {
        payout_id: new.payout_id,
        account_id: new.account_id,
        amount_minor: new.amount_minor,
        currency: new.currency,
        beneficiary_ref: new.beneficiary_ref,
        ambiguity: payout_activities::types::AmbiguityPolicy {
            settlement_window_ms,
            resolution_sla_ms,
        },
    }
}

/// Opens the account (the fixture path) and creates each payout on it, PENDING.
pub async fn create_payouts(system: &System, account: &str, payouts: &[&str]) {
    let fixture = PaymentClient::connect(&system.payment_url(), &system.tls(Role::Fixture))
        .await
        .unwrap();
    let first = new_payout(account, payouts[0]);
    system
        .operator
        .open_account(&fixture, &first.account_id, &first.currency, 100_000)
        .await
        .unwrap();
    for payout in payouts {
        fixture
            .create_payout(&new_payout(account, payout))
            .await
            .unwrap();
    }
}

pub async fn state_of(payments: &PaymentClient, payout: &str) -> PayoutState {
    payments
        .get_payout(&PayoutId::parse(payout).unwrap())
        .await
        .unwrap()
        .payout
        .state
}

/// The payout's state, through a client of its own.
pub async fn state_in(system: &System, payout: &str) -> PayoutState {
    let payments = PaymentClient::connect(&system.payment_url(), &system.tls(Role::Worker))
        .await
        .unwrap();
    state_of(&payments, payout).await
}

pub async fn wait_state(payments: &PaymentClient, payout: &str, state: PayoutState) {
    testkit::eventually(SETTLE_TIMEOUT, &format!("{payout} {state}"), || async {
        (state_of(payments, payout).await == state).then_some(())
    })
    .await
    .unwrap();
}

/// Money moved at the rail for the payout (the stub's ground truth).
pub async fn movements(system: &System, payout: &str) -> u64 {
    let truth = rail_stub::client::StubClient::new(system.rail_stub_endpoints())
        .expect("the harness's rail client")
        .ground_truth()
        .await
        .unwrap();
    let reference = ClientReference::for_payout(&PayoutId::parse(payout).unwrap()).to_string();
    truth.movement_counts.get(&reference).copied().unwrap_or(0)
}

pub fn temporal_cli(args: &[&str]) -> anyhow::Result<String> {
    Stack::shared().temporal().cli(args)
}

pub fn terminate(workflow_id: &str) {
    temporal_cli(&[
        "workflow",
        "terminate",
        "--namespace",
        testkit::temporal::NAMESPACE,
        "--workflow-id",
        workflow_id,
        "--reason",
        "operator terminates the workflow mid-payout (test)",
    ])
    .unwrap();
}

/// Starts `payout-{payout}`, a payout workflow on the payout queue, in a system without
/// workers: nobody polls it, so it stays RUNNING for the test, and a pass takes it for the
/// payout's own workflow (not a squatter: its type and queue are the payout workflow's).
pub fn start_unpolled_workflow(system: &System, payout: &str) {
    start_workflow_as(payout, "PayoutWorkflow", &system.task_queue);
}

/// Starts a workflow of `workflow_type` on `task_queue` under `payout-{payout}`, without input.
pub fn start_workflow_as(payout: &str, workflow_type: &str, task_queue: &str) {
    temporal_cli(&[
        "workflow",
        "start",
        "--namespace",
        testkit::temporal::NAMESPACE,
        "--workflow-id",
        &format!("payout-{payout}"),
        "--type",
        workflow_type,
        "--task-queue",
        task_queue,
    ])
    .unwrap();
}

/// The reconciler's own certificate (role reconciler) from the system's authority.
pub fn reconciler_tls(system: &System) -> Vec<String> {
    system
        .pki
        .issue(Role::Reconciler, "reconciler")
        .unwrap()
        .to_args()
        .into_iter()
        .map(|a| a.to_string_lossy().into_owned())
        .collect()
}

/// The reconciler's certificate and every source, Temporal at `temporal_address` (through the
/// front as the reconciler: its profile), and a resumed run's settlement window of 500 ms, as
/// `payoutdev stack up` passes them.
pub fn source_args(system: &System, temporal_address: &str) -> Vec<String> {
    system
        .reconciler_args(temporal_address, RESUMED_SETTLEMENT_WINDOW_MS)
        .unwrap()
}

/// A resumed run's settlement window in these tests.
const RESUMED_SETTLEMENT_WINDOW_MS: u64 = 500;

/// A system with no worker whose rail cannot say "absent" for ten minutes, far longer than any
/// test: a payout it failed to act on stays UNKNOWN to every inquiry.
pub async fn system_with_an_undecided_rail() -> System {
    System::start(
        Stack::shared(),
        SystemOptions {
            workers: 0,
            settlement_window_ms: 600_000,
            rail_timeout_ms: 1_000,
            ..SystemOptions::default()
        },
    )
    .await
    .unwrap()
}

/// `reconciler once --json` with `args` (its certificate among them) and `env`, the binary as
/// an operator runs it: its report and whether it exited 0 (clean).
pub fn once_json(args: &[String], env: &[(&str, &str)]) -> (serde_json::Value, bool) {
    let out = std::process::Command::new(testkit::workspace_bin("reconciler"))
        .args(["once", "--json"])
        .args(args)
        .envs(env.iter().copied())
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let report = serde_json::from_str(stdout.trim()).unwrap_or_else(|e| {
        panic!(
            "no JSON report ({e}): {stdout}\nstderr: {}",
            String::from_utf8_lossy(&out.stderr)
        )
    });
    (report, out.status.success())
}

/// A report's resumptions by payout (by account for an account's takeover).
pub fn resumptions(report: &serde_json::Value) -> HashMap<String, serde_json::Value> {
    report["resumptions"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| {
            let id = r["payout_id"].as_str().unwrap();
            let id = if id.is_empty() {
                r["account_id"].as_str().unwrap()
            } else {
                id
            };
            (id.to_string(), r.clone())
        })
        .collect()
}

/// How a payout is driven to RAIL_AMBIGUOUS.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Ambiguity {
    /// The rail moved the money and never answered: the proxy recorded TIMEOUT.
    AcceptedThenHung,
    /// The rail answered 503 without acting: TIMEOUT at the proxy; the rail cannot say yet.
    FailedBeforeActing,
    /// The holder never reached the proxy (OUTCOME_MISSING): no proxy record at all.
    NeverSubmitted,
}

pub async fn grant(system: &System, account: &AccountId, owner: &str) -> lock_client::GrantHandle {
    let lock = lock_client::LockClient::connect(&system.lock_url(), &system.tls(Role::Worker))
        .await
        .unwrap();
    let session = lock
        .open_session(owner, Duration::from_secs(10))
        .await
        .unwrap();
    match session
        .acquire(&payout_domain::lock_key(account), Duration::from_secs(5))
        .await
        .unwrap()
    {
        lock_client::Acquired::Granted(g) => g,
        other => panic!("lock not granted: {other:?}"),
    }
}

/// The submit a holder of `grant` makes for `new`, with the payment resource's instruction for it
/// (signed with `system`'s instruction key, as MarkSubmitted would answer it).
pub fn submit_request(
    system: &System,
    new: &NewPayout,
    grant: &lock_client::GrantHandle,
) -> SubmitPayout {
    SubmitPayout::new(
        new.payout_id.clone(),
        new.account_id.clone(),
        grant.token(),
        grant.owner(),
        new.amount_minor,
        new.currency.clone(),
        new.beneficiary_ref.clone(),
    )
    .signed(grant.key(), grant.signature().clone())
    .instructed_now(&system.instruction_keys.signer().unwrap())
}

/// Claim, mark submitted and an ambiguous outcome, by hand under a real grant, then the holder
/// goes away (grant released): nobody is left to resolve the payout.
pub async fn drive_to_ambiguous(system: &System, account: &str, payout: &str, how: Ambiguity) {
    let new = new_payout(account, payout);
    let grant = grant(system, &new.account_id, "test-holder").await;
    let payments = PaymentClient::connect(&system.payment_url(), &system.tls(Role::Worker))
        .await
        .unwrap();
    create_payouts(system, account, &[payout]).await;
    let fence = Fence::new(grant.owner(), grant.token())
        .unwrap()
        .signed(grant.key(), grant.signature().clone());
    payments.claim(&new.payout_id, &fence).await.unwrap();
    payments
        .mark_submitted(&new.payout_id, &fence)
        .await
        .unwrap();
    let outcome = match how {
        Ambiguity::NeverSubmitted => RailOutcome::OutcomeMissing,
        Ambiguity::AcceptedThenHung | Ambiguity::FailedBeforeActing => {
            let mode = if how == Ambiguity::AcceptedThenHung {
                FaultMode::AcceptThenHang
            } else {
                FaultMode::FailBeforeActing
            };
            let reference = ClientReference::for_payout(&new.payout_id).to_string();
            rail_stub::client::StubClient::new(system.rail_stub_endpoints())
                .expect("the harness's rail client")
                .force(&reference, Some(mode))
                .await
                .unwrap();
            let mut proxy =
                RailProxyClient::connect(&system.proxy_url(), &system.tls(Role::Worker))
                    .await
                    .unwrap();
            let submission = proxy
                .submit(&submit_request(system, &new, &grant))
                .await
                .unwrap();
            assert!(
                matches!(submission.outcome, Outcome::Timeout { .. }),
                "{how:?} must leave the proxy's record ambiguous: {submission:?}"
            );
            RailOutcome::Timeout
        }
    };
    let p = payments
        .record_outcome(&new.payout_id, &fence, &outcome, "test")
        .await
        .unwrap();
    assert_eq!(p.state, PayoutState::RailAmbiguous);
    grant.release().await.unwrap();
}

pub async fn metrics_text(port: u16) -> Option<String> {
    reqwest::get(format!("http://127.0.0.1:{port}/metrics"))
        .await
        .ok()?
        .text()
        .await
        .ok()
}

/// The value of the series `series` (name and labels, as exported) in a `/metrics` text.
pub fn metric(text: &str, series: &str) -> Option<f64> {
    text.lines()
        .find(|l| l.starts_with(series) && l[series.len()..].starts_with(' '))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
}

/// One value read from paydb with `psql` (the test reads what paydb recorded, as an operator
/// would; this package links no database driver).
pub fn paydb_scalar(system: &System, sql: &str) -> Option<String> {
    let out = std::process::Command::new("psql")
        .args([system.databases.paydb.as_str(), "-tAXc", sql])
        .output()
        .ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).trim().to_string())
}
