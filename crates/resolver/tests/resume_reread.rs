//! The resume pass re-reads a payout after seeing its workflow ended (commit 449ced0): a payout
//! read open by the pass's walk that finishes before the pass has described its workflow is
//! not handed to a new run. The finish is placed between the walk's read and the describe by
//! the resolver's test-only hook (`resume::seams`, feature `test-seams`), on a real system (the
//! payment resource, the lock service, Temporal, paydb); the payout is driven by hand under a
//! real grant, as a workflow would, and has no workflow of its own (no worker runs).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use payment_client::model::{Fence, NewPayout, RailFact, RailOutcome};
use payment_client::PaymentClient;
use payout_domain::{AccountId, AmountMinor, BeneficiaryRef, Currency, PayoutId, PayoutState};
use resolver::resume::{
    resume_stranded, seams, ResumeConfig, Temporal, TemporalConfig, WorkflowStatus,
};
use testkit::pki::Role;
use testkit::system::{System, SystemOptions};
use testkit::Stack;

const ACCOUNT: &str = "acct-reread";
const PAYOUT: &str = "po-reread";
/// The holder's lease; the hook holds the key only for its three steps.
const LEASE: Duration = Duration::from_secs(10);
/// How long the hook waits for the account's key (free: nobody else holds it).
const ACQUIRE_WAIT: Duration = Duration::from_secs(5);

fn new_payout() -> NewPayout {
    NewPayout {
        payout_id: PayoutId::parse(PAYOUT).unwrap(),
        account_id: AccountId::parse(ACCOUNT).unwrap(),
        amount_minor: AmountMinor::new(700).unwrap(),
        currency: Currency::parse("EUR").unwrap(),
        beneficiary_ref: BeneficiaryRef::parse("ben-1").unwrap(),
    }
}

/// What a workflow would do with the payout, by hand under a real grant: claim, mark it
/// submitted, record the rail's decline (FAILED, terminal), release the key.
async fn finish(system: &System) {
    let new = new_payout();
    let lock = lock_client::LockClient::connect(&system.lock_url(), &system.tls(Role::Worker))
        .await
        .unwrap();
    let session = lock.open_session("test-finisher", LEASE).await.unwrap();
    let grant = match session
        .acquire(&payout_domain::lock_key(&new.account_id), ACQUIRE_WAIT)
        .await
        .unwrap()
    {
        lock_client::Acquired::Granted(g) => g,
        other => panic!("lock not granted: {other:?}"),
    };
    let fence = Fence::new(grant.owner(), grant.token())
        .unwrap()
        .signed(grant.key(), grant.signature().clone());
    let payments = PaymentClient::connect(&system.payment_url(), &system.tls(Role::Worker))
        .await
        .unwrap();
    payments.claim(&new.payout_id, &fence).await.unwrap();
    payments
        .mark_submitted(&new.payout_id, &fence)
        .await
        .unwrap();
    // The rail's decline as the rail proxy signs it (the payment resource records a DECLINED only
    // on the proxy's signed fact): this test plays the proxy with the system's rail-fact key.
    let outcome = RailOutcome::Declined {
        decline_code: "test-decline".into(),
    };
    let cref = payout_domain::ClientReference::for_payout(&new.payout_id);
    let mut fact = RailFact {
        outcome: "REJECTED".into(),
        rail_ref: String::new(),
        decline_code: "test-decline".into(),
        token: grant.token().get(),
        signed_at_unix_ms: 1,
        signature: grant_signing::Signature {
            key_id: String::new(),
            bytes: Vec::new(),
        },
    };
    fact.signature = system
        .rail_fact_keys
        .signer()
        .unwrap()
        .sign_outcome(&fact.message(
            new.payout_id.as_str(),
            new.account_id.as_str(),
            cref.as_str(),
        ));
    let p = payments
        .record_outcome_proven(&new.payout_id, &fence, &outcome, "test", Some(&fact))
        .await
        .unwrap();
    assert!(p.state.is_terminal(), "declined: {:?}", p.state);
    grant.release().await.unwrap();
}

#[tokio::test(flavor = "multi_thread")]
async fn a_payout_finished_between_the_pass_read_and_its_describe_is_not_resumed() {
    let system = Arc::new(
        System::start(
            Stack::shared(),
            SystemOptions {
                workers: 0,
                ..SystemOptions::default()
            },
        )
        .await
        .unwrap(),
    );
    // The payout, PENDING with no workflow: past its grace (0), the pass's candidate.
    let fixture = PaymentClient::connect(&system.payment_url(), &system.tls(Role::Fixture))
        .await
        .unwrap();
    let new = new_payout();
    system
        .operator
        .open_account(&fixture, &new.account_id, &new.currency, 100_000)
        .await
        .unwrap();
    fixture.create_payout(&new).await.unwrap();

    // Between the walk's read (PENDING) and the describe, the payout finishes.
    let finished = Arc::new(AtomicUsize::new(0));
    let hook: seams::Hook = {
        let system = system.clone();
        let finished = finished.clone();
        Arc::new(move |payout_id: String| {
            let system = system.clone();
            let finished = finished.clone();
            Box::pin(async move {
                if payout_id == PAYOUT {
                    finish(&system).await;
                    finished.fetch_add(1, Ordering::SeqCst);
                }
            })
        })
    };
    seams::set_before_describe(Some(hook));

    let paydb = sqlx::PgPool::connect(&system.databases.paydb)
        .await
        .unwrap();
    let config = ResumeConfig {
        lock_url: system.lock_url(),
        tls: system.tls(Role::Reconciler),
        temporal: TemporalConfig {
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
    let mut cursor = resolver::walk::Cursor::default();
    let pass = resume_stranded(&paydb, &config, &mut cursor).await;
    seams::set_before_describe(None);
    let pass = pass.unwrap();

    assert_eq!(
        finished.load(Ordering::SeqCst),
        1,
        "the hook finished the payout once, between the read and the describe"
    );
    let payments = PaymentClient::connect(&system.payment_url(), &system.tls(Role::Worker))
        .await
        .unwrap();
    let state = payments
        .get_payout(&new.payout_id)
        .await
        .unwrap()
        .payout
        .state;
    assert_eq!(state, PayoutState::Failed);
    assert!(
        pass.done.iter().all(|r| r.payout_id != PAYOUT),
        "a payout that finished before its describe is not stranded: {:?}",
        pass.done
    );
    // No run was started for the terminal payout.
    let temporal = Temporal::connect(&config.temporal).await.unwrap();
    let status = temporal
        .status(&payout_domain::workflow_id(&new.payout_id))
        .await
        .unwrap();
    assert_eq!(
        status,
        WorkflowStatus::NotFound,
        "a run started for {PAYOUT}"
    );
    paydb.close().await;
}
