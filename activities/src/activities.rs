//! The activity definitions the workflow calls. Each one is a thin shell: check the grant where
//! the call is fenced, call the backend, log once with payout_id, account key and token.

use std::sync::Arc;

use temporalio_macros::activities;
use temporalio_sdk::activities::{ActivityContext, ActivityError};

use crate::backend::Backend;
use crate::refusal::ActivityFailure;
use crate::types::*;

/// Registered on the worker with `WorkerOptions::register_activities(PayoutActivities::new(..))`.
pub struct PayoutActivities {
    backend: Arc<dyn Backend>,
}

impl PayoutActivities {
    pub fn new(backend: Arc<dyn Backend>) -> Self {
        Self { backend }
    }

    /// The client-side liveness check before every fenced call (spec 2.4): narrows the window,
    /// the token at the guard is what closes it.
    fn vouch(&self, grant: &Grant) -> Result<(), ActivityFailure> {
        self.backend
            .check_held(grant)
            .map_err(ActivityFailure::from)
    }
}

fn logged<T>(
    step: &'static str,
    payout_id: &payout_domain::PayoutId,
    token: Option<u64>,
    result: Result<T, ActivityFailure>,
) -> Result<T, ActivityError> {
    match &result {
        Ok(_) => tracing::info!(step, payout_id = %payout_id, token, "activity done"),
        Err(ActivityFailure::Refused(refusal)) => {
            tracing::warn!(step, payout_id = %payout_id, token, refusal = refusal.name(), %refusal, "activity refused")
        }
        Err(ActivityFailure::Transient(detail)) => {
            tracing::warn!(step, payout_id = %payout_id, token, detail, "activity failed, retryable")
        }
    }
    result.map_err(ActivityFailure::into_activity_error)
}

#[activities]
impl PayoutActivities {
    #[activity(name = "AcquireGrant")]
    pub async fn acquire_grant(
        self: Arc<Self>,
        _ctx: ActivityContext,
        input: AcquireInput,
    ) -> Result<AcquireOutcome, ActivityError> {
        let payout_id = input.payout_id.clone();
        let result = self.backend.acquire(input).await;
        let token = match &result {
            Ok(AcquireOutcome::Granted(grant)) => Some(grant.token.get()),
            _ => None,
        };
        logged("acquire", &payout_id, token, result)
    }

    #[activity(name = "ReleaseGrant")]
    pub async fn release_grant(
        self: Arc<Self>,
        _ctx: ActivityContext,
        input: FencedInput,
    ) -> Result<(), ActivityError> {
        let token = input.grant.token.get();
        let result = self.backend.release(input.grant).await;
        logged("release", &input.payout_id, Some(token), result)
    }

    #[activity(name = "GetPayout")]
    pub async fn get_payout(
        self: Arc<Self>,
        _ctx: ActivityContext,
        payout_id: payout_domain::PayoutId,
    ) -> Result<PayoutSnapshot, ActivityError> {
        let result = self.backend.get_payout(payout_id.clone()).await;
        logged("get_payout", &payout_id, None, result)
    }

    #[activity(name = "Claim")]
    pub async fn claim(
        self: Arc<Self>,
        _ctx: ActivityContext,
        input: FencedInput,
    ) -> Result<PayoutSnapshot, ActivityError> {
        let token = input.grant.token.get();
        let payout_id = input.payout_id.clone();
        let result = match self.vouch(&input.grant) {
            Ok(()) => self.backend.claim(input).await,
            Err(e) => Err(e),
        };
        logged("claim", &payout_id, Some(token), result)
    }

    #[activity(name = "MarkSubmitted")]
    pub async fn mark_submitted(
        self: Arc<Self>,
        _ctx: ActivityContext,
        input: FencedInput,
    ) -> Result<PayoutSnapshot, ActivityError> {
        let token = input.grant.token.get();
        let payout_id = input.payout_id.clone();
        let result = match self.vouch(&input.grant) {
            Ok(()) => self.backend.mark_submitted(input).await,
            Err(e) => Err(e),
        };
        logged("mark_submitted", &payout_id, Some(token), result)
    }

    /// The one rail submission. Whatever happens in here that is not a clear answer becomes
    /// `SubmitAnswer::Ambiguous`; the workflow calls it with `maximum_attempts(1)`.
    #[activity(name = "SubmitToRail")]
    pub async fn submit_to_rail(
        self: Arc<Self>,
        _ctx: ActivityContext,
        input: SubmitInput,
    ) -> Result<SubmitAnswer, ActivityError> {
        let token = input.grant.token.get();
        let payout_id = input.payout_id.clone();
        let result = match self.vouch(&input.grant) {
            Ok(()) => self.backend.submit(input).await,
            Err(e) => Err(e),
        };
        logged("submit", &payout_id, Some(token), result)
    }

    #[activity(name = "RecordOutcome")]
    pub async fn record_outcome(
        self: Arc<Self>,
        _ctx: ActivityContext,
        input: RecordOutcomeInput,
    ) -> Result<PayoutSnapshot, ActivityError> {
        let token = input.grant.token.get();
        let payout_id = input.payout_id.clone();
        let result = match self.vouch(&input.grant) {
            Ok(()) => self.backend.record_outcome(input).await,
            Err(e) => Err(e),
        };
        logged("record_outcome", &payout_id, Some(token), result)
    }

    #[activity(name = "PostLedger")]
    pub async fn post_ledger(
        self: Arc<Self>,
        _ctx: ActivityContext,
        input: FencedInput,
    ) -> Result<PayoutSnapshot, ActivityError> {
        let token = input.grant.token.get();
        let payout_id = input.payout_id.clone();
        let result = match self.vouch(&input.grant) {
            Ok(()) => self.backend.post(input).await,
            Err(e) => Err(e),
        };
        logged("post", &payout_id, Some(token), result)
    }

    #[activity(name = "InquireRail")]
    pub async fn inquire_rail(
        self: Arc<Self>,
        _ctx: ActivityContext,
        input: InquireInput,
    ) -> Result<Inquiry, ActivityError> {
        let payout_id = input.payout_id.clone();
        let result = self.backend.inquire(input).await;
        logged("inquire", &payout_id, None, result)
    }

    #[activity(name = "ResolveAmbiguity")]
    pub async fn resolve_ambiguity(
        self: Arc<Self>,
        _ctx: ActivityContext,
        input: ResolveInput,
    ) -> Result<PayoutSnapshot, ActivityError> {
        let token = input.grant.token.get();
        let payout_id = input.payout_id.clone();
        let result = match self.vouch(&input.grant) {
            Ok(()) => self.backend.resolve(input).await,
            Err(e) => Err(e),
        };
        logged("resolve", &payout_id, Some(token), result)
    }

    #[activity(name = "Abandon")]
    pub async fn abandon(
        self: Arc<Self>,
        _ctx: ActivityContext,
        input: AbandonInput,
    ) -> Result<PayoutSnapshot, ActivityError> {
        let token = input.grant.token.get();
        let payout_id = input.payout_id.clone();
        let result = match self.vouch(&input.grant) {
            Ok(()) => self.backend.abandon(input).await,
            Err(e) => Err(e),
        };
        logged("abandon", &payout_id, Some(token), result)
    }

    #[activity(name = "RecordOperatorDecision")]
    pub async fn record_operator_decision(
        self: Arc<Self>,
        _ctx: ActivityContext,
        input: OperatorDecisionInput,
    ) -> Result<(), ActivityError> {
        let payout_id = input.payout_id.clone();
        let token = input.token.map(|t| t.get());
        let result = self.backend.record_operator_decision(input).await;
        logged("record_operator_decision", &payout_id, token, result)
    }
}
