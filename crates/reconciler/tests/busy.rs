//! The reconciler on a busy system (issue 35, item 10): runs made while a batch of payouts moves
//! through the payment resource's real transitions, the proxy and the rail, with the outbox
//! draining into the GL, find nothing, because each store is read in one snapshot, the stores in
//! the order the system writes them. The negative control reads as the reconciler did before
//! (every statement on its own snapshot) with a transition committed mid-run, where a busy system
//! may commit one, and reports a violation that is none.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use payment_client::model::{Fence, NewPayout, RailOutcome};
use payment_client::PaymentClient;
use payout_domain::{AccountId, AmountMinor, BeneficiaryRef, Currency, PayoutId};
use rail_proxy_client::{Outcome, RailProxyClient, SubmitPayout};
use reconciler::{Options, Report, Sources};
use testkit::pki::Role;
use testkit::system::System;

mod common;
use common::{sources, system_without_workers};

/// Accounts paid at once: one writer each (one payout in flight per account).
const ACCOUNTS: usize = 6;
/// Payouts per account, one after the other. Each waits for one more reconciler run to start, so
/// the loop runs at least this many times while the batch moves.
const PAYOUTS_PER_ACCOUNT: usize = 6;

/// One account's payouts, created PENDING, then each driven through claim, submit, outcome and
/// posting under a real grant, the next only once `runs` has counted one more reconciler run.
async fn pay_account(
    system: &System,
    account: String,
    payouts: Vec<PayoutId>,
    mut runs: tokio::sync::watch::Receiver<usize>,
) {
    let lock = lock_client::LockClient::connect(&system.lock_url(), &system.tls(Role::Worker))
        .await
        .unwrap();
    let session = lock
        .open_session("reconciler-busy-test", Duration::from_secs(10))
        .await
        .unwrap();
    let payments = PaymentClient::connect(&system.payment_url(), &system.tls(Role::Worker))
        .await
        .unwrap();
    let mut proxy = RailProxyClient::connect(&system.proxy_url(), &system.tls(Role::Worker))
        .await
        .unwrap();
    let account_id = AccountId::parse(account).unwrap();
    let eur = Currency::parse("EUR").unwrap();
    let beneficiary = BeneficiaryRef::parse("ben-1").unwrap();
    for (n, payout_id) in payouts.iter().enumerate() {
        runs.wait_for(|started| *started > n).await.unwrap();
        let (grant, fence) = common::granted(&session, &account_id).await;
        payments.claim(payout_id, &fence).await.unwrap();
        payments.mark_submitted(payout_id, &fence).await.unwrap();
        let submission = proxy
            .submit(
                &SubmitPayout::new(
                    payout_id.clone(),
                    account_id.clone(),
                    grant.token(),
                    grant.owner(),
                    AmountMinor::new(100).unwrap(),
                    eur.clone(),
                    beneficiary.clone(),
                )
                .signed(grant.key(), grant.signature().clone())
                .instructed_now(&system.instruction_keys.signer().unwrap()),
            )
            .await
            .unwrap();
        let fact = resolver::facts::outcome(&submission);
        let Outcome::Acked { rail_ref } = submission.outcome else {
            panic!("rail did not ack: {submission:?}")
        };
        payments
            .record_outcome_proven(
                payout_id,
                &fence,
                &RailOutcome::Acked { rail_ref },
                "",
                fact.as_ref(),
            )
            .await
            .unwrap();
        payments.post(payout_id, &fence).await.unwrap();
        grant.release().await.unwrap();
    }
}

async fn run(src: &Sources) -> Report {
    reconciler::reconcile(src, &Options::default())
        .await
        .unwrap()
}

/// Settles a batch of `ACCOUNTS` x `PAYOUTS_PER_ACCOUNT` payouts while the reconciler runs in a
/// loop; answers how many runs started while the batch moved and every finding of theirs.
async fn reconcile_while_a_batch_settles(prefix: &str) -> (usize, Vec<String>) {
    let system = Arc::new(system_without_workers().await);
    let src = sources(&system).await;
    let fixture = PaymentClient::connect(&system.payment_url(), &system.tls(Role::Fixture))
        .await
        .unwrap();
    let eur = Currency::parse("EUR").unwrap();
    let mut batch = Vec::new();
    for a in 0..ACCOUNTS {
        let account_id = AccountId::parse(format!("acct-{prefix}{a}")).unwrap();
        system
            .operator
            .open_account(&fixture, &account_id, &eur, 100_000)
            .await
            .unwrap();
        let mut payouts = Vec::new();
        for p in 0..PAYOUTS_PER_ACCOUNT {
            let payout_id = PayoutId::parse(format!("po-{prefix}{a}-{p}")).unwrap();
            fixture
                .create_payout(&NewPayout {
                    payout_id: payout_id.clone(),
                    account_id: account_id.clone(),
                    amount_minor: AmountMinor::new(100).unwrap(),
                    currency: eur.clone(),
                    beneficiary_ref: BeneficiaryRef::parse("ben-1").unwrap(),
                })
                .await
                .unwrap();
            payouts.push(payout_id);
        }
        batch.push((account_id.as_str().to_string(), payouts));
    }

    let (runs_started, runs) = tokio::sync::watch::channel(0usize);
    let settled = Arc::new(AtomicBool::new(false));
    let writers = {
        let (system, settled) = (system.clone(), settled.clone());
        tokio::spawn(async move {
            let mut writers = tokio::task::JoinSet::new();
            for (account, payouts) in batch {
                let (system, runs) = (system.clone(), runs.clone());
                writers.spawn(async move { pay_account(&system, account, payouts, runs).await });
            }
            while let Some(done) = writers.join_next().await {
                done.unwrap();
            }
            settled.store(true, Ordering::SeqCst);
        })
    };

    let (mut during, mut findings) = (0usize, Vec::new());
    while !settled.load(Ordering::SeqCst) {
        during += 1;
        runs_started.send_replace(during);
        let report = run(&src).await;
        findings.extend(
            report
                .checks
                .iter()
                .flat_map(|c| c.violations.iter().map(move |v| format!("{}: {v}", c.name))),
        );
    }
    writers.await.unwrap();

    // The batch is terminal: every payout POSTED, and a run now finds nothing either way.
    let report = run(&src).await;
    assert_eq!(
        report.payouts_by_state.get("POSTED").copied(),
        Some((ACCOUNTS * PAYOUTS_PER_ACCOUNT) as u64),
        "{}",
        report.render()
    );
    assert!(report.is_clean(), "after the batch: {}", report.render());
    (during, findings)
}

#[tokio::test]
async fn a_reconciler_running_while_a_batch_settles_reports_nothing() {
    let (runs, findings) = reconcile_while_a_batch_settles("busy").await;
    assert!(
        runs >= PAYOUTS_PER_ACCOUNT,
        "only {runs} run(s) while the batch moved"
    );
    assert!(
        findings.is_empty(),
        "{} false finding(s) in {runs} runs on a busy system:\n{}",
        findings.len(),
        findings.join("\n")
    );
}

/// What the snapshots buy, placed where a busy system may place it (deterministic, where the
/// loop above only sometimes lands a write between two reads): a transition committed in the
/// middle of a run, after the run read the payout and before it read the payout's history. Read
/// in one snapshot per store, the run sees none of it and finds nothing; the negative control,
/// each statement on its own snapshot as the reconciler read before, sees the history ahead of
/// the state and reports a violation that the settled book does not have.
#[tokio::test]
async fn a_transition_committed_mid_run_is_no_finding_in_one_snapshot_and_a_false_one_without() {
    let system = system_without_workers().await;
    let src = sources(&system).await;
    let fixture = PaymentClient::connect(&system.payment_url(), &system.tls(Role::Fixture))
        .await
        .unwrap();
    let payments = PaymentClient::connect(&system.payment_url(), &system.tls(Role::Worker))
        .await
        .unwrap();
    let lock = lock_client::LockClient::connect(&system.lock_url(), &system.tls(Role::Worker))
        .await
        .unwrap();
    let session = lock
        .open_session("reconciler-mid-run-test", Duration::from_secs(30))
        .await
        .unwrap();
    let eur = Currency::parse("EUR").unwrap();
    // Two payouts claimed, on two accounts: one for each run.
    let mut claimed = Vec::new();
    for n in 1..=2 {
        let account_id = AccountId::parse(format!("acct-mid{n}")).unwrap();
        system
            .operator
            .open_account(&fixture, &account_id, &eur, 100_000)
            .await
            .unwrap();
        let payout_id = PayoutId::parse(format!("po-mid{n}")).unwrap();
        fixture
            .create_payout(&NewPayout {
                payout_id: payout_id.clone(),
                account_id: account_id.clone(),
                amount_minor: AmountMinor::new(100).unwrap(),
                currency: eur.clone(),
                beneficiary_ref: BeneficiaryRef::parse("ben-1").unwrap(),
            })
            .await
            .unwrap();
        let (grant, fence) = common::granted(&session, &account_id).await;
        payments.claim(&payout_id, &fence).await.unwrap();
        claimed.push((payout_id, fence, grant));
    }
    let submit_mid_run = |payout_id: PayoutId, fence: Fence| {
        let payments = payments.clone();
        move || async move {
            payments.mark_submitted(&payout_id, &fence).await.unwrap();
        }
    };
    let history_ahead = |report: &Report, payout: &str| {
        report
            .checks
            .iter()
            .find(|c| c.name == "transition_history_replays")
            .unwrap()
            .violations
            .iter()
            .any(|v| v.contains(payout) && v.contains("recorded history ends at RAIL_SUBMITTED"))
    };

    let (first, first_fence, _first_grant) = &claimed[0];
    let snapshot = reconciler::reconcile_with_a_write_between(
        &src,
        &Options::default(),
        true,
        submit_mid_run(first.clone(), first_fence.clone()),
    )
    .await
    .unwrap();
    assert!(
        snapshot.is_clean(),
        "one snapshot per store must see a consistent book:\n{}",
        snapshot.render()
    );
    assert_eq!(
        snapshot.payouts_by_state.get("CLAIMED").copied(),
        Some(2),
        "the run's snapshot predates the write: {}",
        snapshot.render()
    );

    let (second, second_fence, _second_grant) = &claimed[1];
    let unsnapshotted = reconciler::reconcile_with_a_write_between(
        &src,
        &Options::default(),
        false,
        submit_mid_run(second.clone(), second_fence.clone()),
    )
    .await
    .unwrap();
    assert!(
        history_ahead(&unsnapshotted, second.as_str()),
        "without one snapshot the run must see the history ahead of the state:\n{}",
        unsnapshotted.render()
    );

    // The book itself is consistent: a run now finds nothing either way.
    let settled = reconciler::reconcile(&src, &Options::default())
        .await
        .unwrap();
    assert!(settled.is_clean(), "{}", settled.render());
}
