//! Negative controls: a targeted stale-holder scenario, run with the guards on and off, so the
//! checker's verdict shows each guard is load-bearing and each alone sufficient against a
//! duplicate payment (spec 2.5, "two conclusions").
//!
//! The scenario, per payout, with real grants from the lock-server (etcd tokens), each presented
//! with the lock service's signature (so the guards' signature check passes and the fence and
//! high-water are what decide):
//! 1. holder A acquires the account's lock (token t1) and is paused just after its client-side
//!    lease check passed (the harness simply does not proceed with A);
//! 2. an operator force-revokes the lock; holder B acquires it (t2 > t1) and claims the payout;
//! 3. A wakes up and claims with t1 (the payment resource's fence must refuse it), then submits
//!    to the rail proxy with t1;
//! 4. B submits with t2 (the proxy's uniqueness and high-water must refuse the second one).
//!
//! With both guards off, the rail moves the money twice. With either one on, once.

use std::time::Duration;
use testkit::pki::Role;

use lock_client::{Acquired, GrantHandle, LockClient};
use payment_client::model::{Fence, NewPayout};
use payment_client::PaymentClient;
use payout_domain::{AccountId, AmountMinor, BeneficiaryRef, Currency, PayoutId};
use rail_proxy_client::{RailProxyClient, SubmitPayout};
use serde::Serialize;
use testkit::system::{System, SystemOptions};
use testkit::Stack;

use super::checker::{self, CheckResult, Evidence};
use super::guards::{replace_services, DisableGuard};

/// The scenario's leases outlive it; the operator's revoke is what ends A's.
const SCENARIO_TTL: Duration = Duration::from_secs(30);
const ACQUIRE_WAIT: Duration = Duration::from_secs(5);

#[derive(Debug, Clone, Serialize)]
pub struct StaleStep {
    pub payout: String,
    pub t1: u64,
    pub t2: u64,
    pub stale_claim_accepted: bool,
    pub stale_submit_accepted: bool,
    pub fresh_submit_accepted: bool,
}

#[derive(Debug, Clone, Serialize)]
pub struct NegativeReport {
    pub guards_disabled: String,
    pub steps: Vec<StaleStep>,
    pub rail_movements: usize,
    pub safety_events: std::collections::BTreeMap<String, i64>,
    pub checks: Vec<CheckResult>,
}

impl NegativeReport {
    pub fn violations_of(&self, check: &str) -> usize {
        self.checks
            .iter()
            .filter(|c| c.name == check)
            .map(|c| c.violations.len())
            .sum()
    }
    pub fn duplicate_payments(&self) -> usize {
        self.violations_of("at_most_one_movement_per_payout")
    }
    pub fn stale_writes(&self) -> usize {
        self.violations_of("paydb_tokens_never_decrease")
            + self.violations_of("proxy_tokens_never_decrease")
    }
}

/// The fence of a real grant, as the lock service signed it (key, token, owner).
fn fence(grant: &GrantHandle) -> anyhow::Result<Fence> {
    Ok(Fence::new(grant.owner(), grant.token())
        .map_err(|e| anyhow::anyhow!("{e}"))?
        .signed(grant.key(), grant.signature().clone()))
}

/// Runs the stale-holder scenario on `payouts` payouts (one account each) over a fresh system
/// with `disable` guards replaced by unguarded in-process services.
pub async fn stale_holder(
    stack: &Stack,
    disable: DisableGuard,
    payouts: usize,
) -> anyhow::Result<NegativeReport> {
    let mut system = System::start(
        stack,
        SystemOptions {
            workers: 0,
            ..SystemOptions::default()
        },
    )
    .await?;
    stale_holder_on(&mut system, disable, payouts).await
}

/// The same scenario on a running system of the caller's (no workers needed), e.g. one that
/// Prometheus scrapes (tests/tests/alerting.rs).
pub async fn stale_holder_on(
    system: &mut System,
    disable: DisableGuard,
    payouts: usize,
) -> anyhow::Result<NegativeReport> {
    let _in_process = replace_services(system, disable).await?;
    let payments = PaymentClient::connect(&system.payment_url(), &system.tls(Role::Worker))
        .await
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    let lock = LockClient::connect(&system.lock_url(), &system.tls(Role::Worker)).await?;
    let operator = LockClient::connect(&system.lock_url(), &system.tls(Role::Operator)).await?;
    let fixture = PaymentClient::connect(&system.payment_url(), &system.tls(Role::Fixture)).await?;
    let eur = Currency::parse("EUR").expect("supported");
    let mut steps = Vec::new();
    for i in 0..payouts {
        let account = AccountId::parse(format!("neg-{}-a{i}", disable.name()))?;
        let payout_id = PayoutId::parse(format!("neg-{}-p{i}", disable.name()))?;
        let amount = AmountMinor::new(1_000)?;
        let beneficiary = BeneficiaryRef::parse("ben-neg")?;
        system
            .operator
            .open_account(&fixture, &account, &eur, 100_000)
            .await
            .map_err(|e| anyhow::anyhow!("{e}"))?;
        fixture
            .create_payout(&NewPayout {
                payout_id: payout_id.clone(),
                account_id: account.clone(),
                amount_minor: amount,
                currency: eur.clone(),
                beneficiary_ref: beneficiary.clone(),
            })
            .await
            .map_err(|e| anyhow::anyhow!("{e}"))?;
        let key = payout_domain::lock_key(&account);

        // 1. A holds the lock (t1), then stalls.
        let session_a = lock.open_session("stale-holder-a", SCENARIO_TTL).await?;
        let Acquired::Granted(grant_a) = session_a.acquire(&key, ACQUIRE_WAIT).await? else {
            anyhow::bail!("A could not acquire {key}");
        };
        let t1 = grant_a.token().get();
        // 2. The operator revokes A's grant; B acquires (t2) and claims.
        operator
            .force_revoke(
                &key,
                grant_a.token(),
                testkit::pki::TEST_OPERATOR,
                "A is paused",
            )
            .await?;
        let session_b = lock.open_session("fresh-holder-b", SCENARIO_TTL).await?;
        let Acquired::Granted(grant_b) = session_b.acquire(&key, ACQUIRE_WAIT).await? else {
            anyhow::bail!("B could not acquire {key} after the revoke");
        };
        let t2 = grant_b.token().get();
        anyhow::ensure!(t2 > t1, "tokens must increase: t1 {t1}, t2 {t2}");
        payments
            .claim(&payout_id, &fence(&grant_b)?)
            .await
            .map_err(|e| anyhow::anyhow!("B's claim: {e}"))?;
        // 3. A wakes up and carries on with its stale token.
        let stale_claim_accepted = payments.claim(&payout_id, &fence(&grant_a)?).await.is_ok();
        let instructions = system.instruction_keys.signer()?;
        let submit = |grant: &GrantHandle| {
            SubmitPayout::new(
                payout_id.clone(),
                account.clone(),
                grant.token(),
                grant.owner(),
                amount,
                eur.clone(),
                beneficiary.clone(),
            )
            .signed(grant.key(), grant.signature().clone())
            // The payment resource's instruction for it (the system's own key): the guards must
            // refuse the stale holder on its token, not for want of an instruction.
            .instructed_now(&instructions)
        };
        let mut proxy =
            RailProxyClient::connect(&system.proxy_url(), &system.tls(Role::Worker)).await?;
        let stale_submit_accepted =
            stale_claim_accepted && proxy.submit(&submit(&grant_a)).await.is_ok();
        // 4. B submits.
        let fresh_submit_accepted = proxy.submit(&submit(&grant_b)).await.is_ok();
        steps.push(StaleStep {
            payout: payout_id.to_string(),
            t1,
            t2,
            stale_claim_accepted,
            stale_submit_accepted,
            fresh_submit_accepted,
        });
        let _ = grant_b.release().await;
        let _ = session_a.close().await;
        let _ = session_b.close().await;
    }
    let evidence = Evidence::collect(system).await?;
    let checks = vec![
        checker::at_most_one_movement_per_payout(&evidence),
        checker::paydb_tokens_never_decrease(&evidence),
        checker::proxy_tokens_never_decrease(&evidence),
        checker::ledger_groups_balanced(&evidence),
        checker::balances_equal_entries(&evidence),
    ];
    Ok(NegativeReport {
        guards_disabled: disable.name().to_string(),
        steps,
        rail_movements: evidence.movements.len(),
        safety_events: evidence.safety_events(),
        checks,
    })
}

/// The INV-06 check's negative control on a REAL recorded history: two lock clients record their
/// histories (`lock-client::history`) against the real lock-server and etcd; A holds a key, an
/// operator force-revokes it, B is granted it at once, while A has not yet heard (A's next
/// keep-alive round, a third of the lease later, renews its grant and is refused). A must stop
/// believing within one lease. Checked with the operator's revoke on record, the history is clean
/// (break-glass hands the key on; A learned in time); with the revoke withheld, the checker must
/// see two holders. Returns (violations with the revoke, violations without it). The
/// linearizability check reads the same real history: counted with the revoke, and required to
/// refuse it without (its own negative control on a real history).
pub async fn lock_history_overlap_control(stack: &Stack) -> anyhow::Result<(usize, usize)> {
    let system = System::start(
        stack,
        SystemOptions {
            workers: 0,
            ..SystemOptions::default()
        },
    )
    .await?;
    let recorder = |name: &str| -> anyhow::Result<_> {
        let path = system
            .dir
            .join(format!("{}{name}.jsonl", checker::LOCK_HISTORY_PREFIX));
        Ok(std::sync::Arc::new(
            lock_client::history::HistoryRecorder::open(&path)?,
        ))
    };
    let lock_a = LockClient::connect(&system.lock_url(), &system.tls(Role::Worker))
        .await?
        .with_history(recorder("control-a")?);
    let lock_b = LockClient::connect(&system.lock_url(), &system.tls(Role::Worker))
        .await?
        .with_history(recorder("control-b")?);
    let key = "payout:history-control";
    let session_a = lock_a.open_session("holder-a", SCENARIO_TTL).await?;
    let Acquired::Granted(grant_a) = session_a.acquire(key, ACQUIRE_WAIT).await? else {
        anyhow::bail!("A could not acquire {key}");
    };
    let sent_ns = lock_client::history::monotonic_ns(std::time::Instant::now());
    let operator = LockClient::connect(&system.lock_url(), &system.tls(Role::Operator)).await?;
    let answer = operator
        .force_revoke(
            key,
            grant_a.token(),
            testkit::pki::TEST_OPERATOR,
            "A is stuck",
        )
        .await?;
    let answered_ns = lock_client::history::monotonic_ns(std::time::Instant::now());
    anyhow::ensure!(
        answer.revoked_token == grant_a.token().get(),
        "the revoke took A's grant: {answer:?}"
    );
    let session_b = lock_b.open_session("holder-b", SCENARIO_TTL).await?;
    let Acquired::Granted(grant_b) = session_b.acquire(key, ACQUIRE_WAIT).await? else {
        anyhow::bail!("B could not acquire {key} after the revoke");
    };
    anyhow::ensure!(grant_b.token() > grant_a.token(), "tokens must increase");
    // A's session lives on; its next keep-alive round renews the grant and is refused.
    testkit::eventually(
        SCENARIO_TTL,
        "A stops believing it holds the key",
        || async { (!grant_a.is_held()).then_some(()) },
    )
    .await?;
    anyhow::ensure!(session_a.is_alive(), "A lost its grant, not its session");
    let _ = grant_b.release().await;
    let _ = session_a.close().await;
    let _ = session_b.close().await;
    let mut evidence = Evidence::collect(&system).await?;
    evidence.lock_ttl_ns = SCENARIO_TTL.as_nanos() as u64;
    evidence.revokes = vec![checker::Revoke {
        key: key.to_string(),
        revoked_token: answer.revoked_token,
        sent_ns,
        answered_ns,
    }];
    let linearizable = checker::lock_history_is_linearizable(&evidence);
    anyhow::ensure!(
        linearizable.checked > 0,
        "the linearizability check read no operation of the history"
    );
    let with_revoke = checker::grants_never_overlap(&evidence).violations.len()
        + checker::deposed_holders_stop_within_one_lease(&evidence)
            .violations
            .len()
        + linearizable.violations.len();
    evidence.revokes.clear();
    let without_revoke = checker::grants_never_overlap(&evidence).violations.len();
    let refused = checker::lock_history_is_linearizable(&evidence).violations;
    anyhow::ensure!(
        refused.len() == 1,
        "without the revoke, the linearizability check must refuse the key once: {refused:?}"
    );
    Ok((with_revoke, without_revoke))
}
