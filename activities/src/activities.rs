//! The activity definitions the workflow calls. Each one is a thin shell: check the grant where
//! the call is fenced, call the backend, log once with payout_id, account key and token.

use std::sync::Arc;
use std::time::Duration;

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

/// The pre-queue workflow shape: one short wait, then the workflow's own durable timer.
pub const ACQUIRE_WAIT_UNQUEUED: Duration = Duration::from_secs(2);
/// A queued acquire asks the lock server in calls of at most this long (the server keeps the
/// caller's place in line from one call to the next), heartbeating meanwhile.
pub const QUEUED_WAIT_PER_CALL: Duration = Duration::from_secs(30);
/// A queued acquire ends (NotAcquired) this long before its start-to-close deadline, so that it
/// answers instead of timing out; the workflow asks again at once.
const QUEUED_DEADLINE_MARGIN: Duration = Duration::from_secs(5);

impl PayoutActivities {
    /// Waits for the key in the lock server's first-come-first-served queue until it is granted
    /// or the activity's own deadline nears, heartbeating so that a lost worker is noticed within
    /// the heartbeat timeout. The wait costs no workflow task and no history event.
    async fn acquire_queued(
        &self,
        ctx: &ActivityContext,
        input: AcquireInput,
        heartbeat_timeout: Duration,
    ) -> Result<AcquireOutcome, ActivityFailure> {
        let beat = (heartbeat_timeout / 3).max(Duration::from_millis(200));
        let stop_at = ctx
            .info()
            .deadline
            .map(|d| d.checked_sub(QUEUED_DEADLINE_MARGIN).unwrap_or(d));
        loop {
            let wait = match stop_at {
                Some(stop) => {
                    let left = stop
                        .duration_since(std::time::SystemTime::now())
                        .unwrap_or_default();
                    left.min(QUEUED_WAIT_PER_CALL)
                }
                None => QUEUED_WAIT_PER_CALL,
            };
            let mut attempt = std::pin::pin!(self.backend.acquire(input.clone(), wait));
            let outcome = loop {
                tokio::select! {
                    outcome = &mut attempt => break outcome?,
                    _ = tokio::time::sleep(beat) => {
                        let _ = ctx.record_heartbeat(()).await;
                    }
                    _ = ctx.cancelled() => {
                        // Dropping the call leaves the lock server's queue.
                        return Err(ActivityFailure::Transient("acquire cancelled".into()));
                    }
                }
            };
            let _ = ctx.record_heartbeat(()).await;
            match outcome {
                AcquireOutcome::Granted(grant) if ctx.is_cancelled() => {
                    // Nobody will receive this grant (the workflow gave up on this attempt):
                    // hand the key on at once instead of holding it until the session ends.
                    let _ = self.backend.release(grant).await;
                    return Err(ActivityFailure::Transient("acquire cancelled".into()));
                }
                AcquireOutcome::Granted(grant) => return Ok(AcquireOutcome::Granted(grant)),
                not_acquired @ AcquireOutcome::NotAcquired { .. } => {
                    if stop_at.is_some_and(|stop| std::time::SystemTime::now() >= stop) {
                        return Ok(not_acquired);
                    }
                }
            }
        }
    }
}

/// What every fenced activity input carries: the payout and the grant it acts under.
pub trait FencedCall {
    fn payout_id(&self) -> &payout_domain::PayoutId;
    fn grant(&self) -> &Grant;
}

macro_rules! fenced_call {
    ($($input:ty),*) => {$(
        impl FencedCall for $input {
            fn payout_id(&self) -> &payout_domain::PayoutId {
                &self.payout_id
            }
            fn grant(&self) -> &Grant {
                &self.grant
            }
        }
    )*};
}
fenced_call!(
    FencedInput,
    SubmitInput,
    RecordOutcomeInput,
    ResolveInput,
    AbandonInput
);

impl PayoutActivities {
    /// The one shape of a fenced activity: the client-side check of the grant, then the backend
    /// call (which presents the grant's token to its guard), logged once with the payout and the
    /// token. A refused check never reaches the backend.
    async fn fenced<I: FencedCall, T>(
        &self,
        step: &'static str,
        input: I,
        call: impl for<'a> FnOnce(&'a dyn Backend, I) -> crate::backend::Answer<'a, T>,
    ) -> Result<T, ActivityError> {
        let token = input.grant().token.get();
        let payout_id = input.payout_id().clone();
        let result = match self.vouch(input.grant()) {
            Ok(()) => call(self.backend.as_ref(), input).await,
            Err(e) => Err(e),
        };
        logged(step, &payout_id, Some(token), result)
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
        ctx: ActivityContext,
        input: AcquireInput,
    ) -> Result<AcquireOutcome, ActivityError> {
        let payout_id = input.payout_id.clone();
        // A workflow that waits in the queue schedules this with a heartbeat timeout; one from
        // before the queue (its history waits on timers between short attempts) does not.
        let result = match ctx.info().heartbeat_timeout {
            Some(heartbeat_timeout) => self.acquire_queued(&ctx, input, heartbeat_timeout).await,
            None => self.backend.acquire(input, ACQUIRE_WAIT_UNQUEUED).await,
        };
        let token = match &result {
            Ok(AcquireOutcome::Granted(grant)) => Some(grant.token.get()),
            _ => None,
        };
        logged("acquire", &payout_id, token, result)
    }

    /// One try at the key that never waits in line (a later caller that finds others waiting
    /// does not pass them). Run as a local activity: the answer names the worker it ran on.
    #[activity(name = "TryAcquireGrant")]
    pub async fn try_acquire_grant(
        self: Arc<Self>,
        _ctx: ActivityContext,
        input: AcquireInput,
    ) -> Result<TryAcquired, ActivityError> {
        let payout_id = input.payout_id.clone();
        let result = self
            .backend
            .acquire(input, Duration::ZERO)
            .await
            .map(|outcome| TryAcquired {
                outcome,
                worker_queue: self.backend.task_queue(),
            });
        let token = match &result {
            Ok(TryAcquired {
                outcome: AcquireOutcome::Granted(grant),
                ..
            }) => Some(grant.token.get()),
            _ => None,
        };
        logged("try_acquire", &payout_id, token, result)
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

    /// The release as a local step: only the process that made a grant holds its handle, so a
    /// grant made by another worker process is answered `NotHere` (the workflow then routes the
    /// release to that process's queue) instead of a release that frees nothing.
    #[activity(name = "ReleaseGrantHere")]
    pub async fn release_grant_here(
        self: Arc<Self>,
        _ctx: ActivityContext,
        input: FencedInput,
    ) -> Result<Released, ActivityError> {
        let token = input.grant.token.get();
        let payout_id = input.payout_id.clone();
        let result = if input.grant.task_queue == self.backend.task_queue() {
            self.backend
                .release(input.grant)
                .await
                .map(|()| Released::Released)
        } else {
            Ok(Released::NotHere)
        };
        logged("release_here", &payout_id, Some(token), result)
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
        self.fenced("claim", input, |backend, input| backend.claim(input))
            .await
    }

    #[activity(name = "MarkSubmitted")]
    pub async fn mark_submitted(
        self: Arc<Self>,
        _ctx: ActivityContext,
        input: FencedInput,
    ) -> Result<PayoutSnapshot, ActivityError> {
        self.fenced("mark_submitted", input, |backend, input| {
            backend.mark_submitted(input)
        })
        .await
    }

    /// The one rail submission. Whatever happens in here that is not a clear answer becomes
    /// `SubmitAnswer::Ambiguous`; the workflow calls it with `maximum_attempts(1)`.
    #[activity(name = "SubmitToRail")]
    pub async fn submit_to_rail(
        self: Arc<Self>,
        _ctx: ActivityContext,
        input: SubmitInput,
    ) -> Result<SubmitAnswer, ActivityError> {
        self.fenced("submit", input, |backend, input| backend.submit(input))
            .await
    }

    #[activity(name = "RecordOutcome")]
    pub async fn record_outcome(
        self: Arc<Self>,
        _ctx: ActivityContext,
        input: RecordOutcomeInput,
    ) -> Result<PayoutSnapshot, ActivityError> {
        self.fenced("record_outcome", input, |backend, input| {
            backend.record_outcome(input)
        })
        .await
    }

    #[activity(name = "PostLedger")]
    pub async fn post_ledger(
        self: Arc<Self>,
        _ctx: ActivityContext,
        input: FencedInput,
    ) -> Result<PayoutSnapshot, ActivityError> {
        self.fenced("post", input, |backend, input| backend.post(input))
            .await
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
        self.fenced("resolve", input, |backend, input| backend.resolve(input))
            .await
    }

    #[activity(name = "Abandon")]
    pub async fn abandon(
        self: Arc<Self>,
        _ctx: ActivityContext,
        input: AbandonInput,
    ) -> Result<PayoutSnapshot, ActivityError> {
        self.fenced("abandon", input, |backend, input| backend.abandon(input))
            .await
    }

    #[activity(name = "RecordOperatorDecision")]
    pub async fn record_operator_decision(
        self: Arc<Self>,
        _ctx: ActivityContext,
        input: OperatorDecisionInput,
    ) -> Result<Option<RecordedDecision>, ActivityError> {
        let payout_id = input.payout_id.clone();
        let token = input.token.map(|t| t.get());
        // Always `Some`: `None` is only what histories recorded before this answer hold.
        let result = self.backend.record_operator_decision(input).await.map(Some);
        logged("record_operator_decision", &payout_id, token, result)
    }
}
