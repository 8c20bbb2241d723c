//! The activity definitions the workflow calls. Each one is a thin shell: check that the caller
//! is the payout's own workflow, check the grant where the call is fenced, call the backend, log
//! once with payout_id, account key and token.

use std::sync::Arc;
use std::time::Duration;

use temporalio_macros::activities;
use temporalio_sdk::activities::{ActivityContext, ActivityError};

use crate::backend::Backend;
use crate::refusal::{ActivityFailure, Refusal};
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

/// The caller check (issue 33, design section 2): an activity that names a payout serves only
/// that payout's own workflow, `PayoutWorkflow` under `payout-{payout_id}`. Anything else (a
/// workflow of another type, a payout workflow under another id, a standalone activity) is
/// refused before any service is called, logged for an alert and counted by the worker's
/// telemetry (the refusal's name, `ForeignCaller`). This narrows who can drive the worker; it is
/// not what keeps money safe (an impostor registering its own `PayoutWorkflow` under a payout's
/// id passes it): the guards' signed facts are.
pub fn check_caller(
    ctx: &ActivityContext,
    payout_id: &payout_domain::PayoutId,
) -> Result<(), ActivityFailure> {
    let info = ctx.info();
    let own_id = payout_domain::workflow_id(payout_id);
    let workflow_type = info.workflow_type.as_deref();
    let workflow_id = info.workflow_id.as_deref();
    if workflow_type == Some(payout_domain::PAYOUT_WORKFLOW_TYPE)
        && workflow_id == Some(own_id.as_str())
    {
        return Ok(());
    }
    let refusal = Refusal::ForeignCaller {
        activity: info.activity_type.clone(),
        workflow_type: workflow_type.unwrap_or(NO_WORKFLOW).to_string(),
        workflow_id: workflow_id.unwrap_or(NO_WORKFLOW).to_string(),
        payout_id: payout_id.to_string(),
    };
    tracing::error!(
        event = "foreign_caller",
        alert = true,
        activity = %info.activity_type,
        workflow_type = workflow_type.unwrap_or(NO_WORKFLOW),
        workflow_id = workflow_id.unwrap_or(NO_WORKFLOW),
        run_id = info.workflow_run_id.as_deref().unwrap_or(NO_WORKFLOW),
        task_queue = %info.task_queue,
        payout_id = %payout_id,
        "an activity was scheduled by a workflow that is not the payout's own: refused, no service called"
    );
    Err(refusal.into())
}

/// What the refusal names as the caller of a standalone activity (no workflow scheduled it).
const NO_WORKFLOW: &str = "(none)";

/// The registered type name of every activity above: the worker's telemetry keeps one
/// `payout_activity_foreign_callers_total` series per name from the start.
pub const ACTIVITY_TYPES: [&str; 14] = [
    "AcquireGrant",
    "TryAcquireGrant",
    "ReleaseGrant",
    "ReleaseGrantHere",
    "GetPayout",
    "Claim",
    "MarkSubmitted",
    "SubmitToRail",
    "RecordOutcome",
    "PostLedger",
    "InquireRail",
    "ResolveAmbiguity",
    "Abandon",
    "RecordOperatorDecision",
];

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
    /// The one shape of a fenced activity: the caller check, the client-side check of the grant,
    /// then the backend
    /// call (which presents the grant's token to its guard), logged once with the payout and the
    /// token. A refused check never reaches the backend.
    async fn fenced<I: FencedCall, T>(
        &self,
        ctx: &ActivityContext,
        step: &'static str,
        input: I,
        call: impl for<'a> FnOnce(&'a dyn Backend, I) -> crate::backend::Answer<'a, T>,
    ) -> Result<T, ActivityError> {
        let token = input.grant().token.get();
        let payout_id = input.payout_id().clone();
        let result = match check_caller(ctx, &payout_id).and_then(|()| self.vouch(input.grant())) {
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
        let result = match (check_caller(&ctx, &payout_id), ctx.info().heartbeat_timeout) {
            (Err(e), _) => Err(e),
            (Ok(()), Some(heartbeat_timeout)) => {
                self.acquire_queued(&ctx, input, heartbeat_timeout).await
            }
            (Ok(()), None) => self.backend.acquire(input, ACQUIRE_WAIT_UNQUEUED).await,
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
        ctx: ActivityContext,
        input: AcquireInput,
    ) -> Result<TryAcquired, ActivityError> {
        let payout_id = input.payout_id.clone();
        let result = match check_caller(&ctx, &payout_id) {
            Ok(()) => self
                .backend
                .acquire(input, Duration::ZERO)
                .await
                .map(|outcome| TryAcquired {
                    outcome,
                    worker_queue: self.backend.task_queue(),
                }),
            Err(e) => Err(e),
        };
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
        ctx: ActivityContext,
        input: FencedInput,
    ) -> Result<(), ActivityError> {
        let token = input.grant.token.get();
        let result = match check_caller(&ctx, &input.payout_id) {
            Ok(()) => self.backend.release(input.grant).await,
            Err(e) => Err(e),
        };
        logged("release", &input.payout_id, Some(token), result)
    }

    /// The release as a local step: only the process that made a grant holds its handle, so a
    /// grant made by another worker process is answered `NotHere` (the workflow then routes the
    /// release to that process's queue) instead of a release that frees nothing.
    #[activity(name = "ReleaseGrantHere")]
    pub async fn release_grant_here(
        self: Arc<Self>,
        ctx: ActivityContext,
        input: FencedInput,
    ) -> Result<Released, ActivityError> {
        let token = input.grant.token.get();
        let payout_id = input.payout_id.clone();
        let result = if let Err(e) = check_caller(&ctx, &payout_id) {
            Err(e)
        } else if input.grant.task_queue == self.backend.task_queue() {
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
        ctx: ActivityContext,
        payout_id: payout_domain::PayoutId,
    ) -> Result<PayoutSnapshot, ActivityError> {
        let result = match check_caller(&ctx, &payout_id) {
            Ok(()) => self.backend.get_payout(payout_id.clone()).await,
            Err(e) => Err(e),
        };
        logged("get_payout", &payout_id, None, result)
    }

    #[activity(name = "Claim")]
    pub async fn claim(
        self: Arc<Self>,
        ctx: ActivityContext,
        input: FencedInput,
    ) -> Result<PayoutSnapshot, ActivityError> {
        self.fenced(&ctx, "claim", input, |backend, input| backend.claim(input))
            .await
    }

    #[activity(name = "MarkSubmitted")]
    pub async fn mark_submitted(
        self: Arc<Self>,
        ctx: ActivityContext,
        input: FencedInput,
    ) -> Result<PayoutSnapshot, ActivityError> {
        self.fenced(&ctx, "mark_submitted", input, |backend, input| {
            backend.mark_submitted(input)
        })
        .await
    }

    /// The one rail submission. Whatever happens in here that is not a clear answer becomes
    /// `SubmitAnswer::Ambiguous`; the workflow calls it with `maximum_attempts(1)`.
    #[activity(name = "SubmitToRail")]
    pub async fn submit_to_rail(
        self: Arc<Self>,
        ctx: ActivityContext,
        input: SubmitInput,
    ) -> Result<SubmitAnswer, ActivityError> {
        self.fenced(&ctx, "submit", input, |backend, input| {
            backend.submit(input)
        })
        .await
    }

    #[activity(name = "RecordOutcome")]
    pub async fn record_outcome(
        self: Arc<Self>,
        ctx: ActivityContext,
        input: RecordOutcomeInput,
    ) -> Result<PayoutSnapshot, ActivityError> {
        self.fenced(&ctx, "record_outcome", input, |backend, input| {
            backend.record_outcome(input)
        })
        .await
    }

    #[activity(name = "PostLedger")]
    pub async fn post_ledger(
        self: Arc<Self>,
        ctx: ActivityContext,
        input: FencedInput,
    ) -> Result<PayoutSnapshot, ActivityError> {
        self.fenced(&ctx, "post", input, |backend, input| backend.post(input))
            .await
    }

    #[activity(name = "InquireRail")]
    pub async fn inquire_rail(
        self: Arc<Self>,
        ctx: ActivityContext,
        input: InquireInput,
    ) -> Result<Inquiry, ActivityError> {
        let payout_id = input.payout_id.clone();
        let result = match check_caller(&ctx, &payout_id) {
            Ok(()) => self.backend.inquire(input).await,
            Err(e) => Err(e),
        };
        logged("inquire", &payout_id, None, result)
    }

    #[activity(name = "ResolveAmbiguity")]
    pub async fn resolve_ambiguity(
        self: Arc<Self>,
        ctx: ActivityContext,
        input: ResolveInput,
    ) -> Result<PayoutSnapshot, ActivityError> {
        self.fenced(&ctx, "resolve", input, |backend, input| {
            backend.resolve(input)
        })
        .await
    }

    #[activity(name = "Abandon")]
    pub async fn abandon(
        self: Arc<Self>,
        ctx: ActivityContext,
        input: AbandonInput,
    ) -> Result<PayoutSnapshot, ActivityError> {
        self.fenced(&ctx, "abandon", input, |backend, input| {
            backend.abandon(input)
        })
        .await
    }

    #[activity(name = "RecordOperatorDecision")]
    pub async fn record_operator_decision(
        self: Arc<Self>,
        ctx: ActivityContext,
        input: OperatorDecisionInput,
    ) -> Result<Option<RecordedDecision>, ActivityError> {
        let payout_id = input.payout_id.clone();
        let token = input.token.map(|t| t.get());
        // Always `Some`: `None` is only what histories recorded before this answer hold.
        let result = match check_caller(&ctx, &payout_id) {
            Ok(()) => self.backend.record_operator_decision(input).await.map(Some),
            Err(e) => Err(e),
        };
        logged("record_operator_decision", &payout_id, token, result)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The telemetry's list is the registered names, each once.
    #[test]
    fn activity_types_are_the_registered_names() {
        let mut registered = vec![
            PayoutActivities::acquire_grant.name(),
            PayoutActivities::try_acquire_grant.name(),
            PayoutActivities::release_grant.name(),
            PayoutActivities::release_grant_here.name(),
            PayoutActivities::get_payout.name(),
            PayoutActivities::claim.name(),
            PayoutActivities::mark_submitted.name(),
            PayoutActivities::submit_to_rail.name(),
            PayoutActivities::record_outcome.name(),
            PayoutActivities::post_ledger.name(),
            PayoutActivities::inquire_rail.name(),
            PayoutActivities::resolve_ambiguity.name(),
            PayoutActivities::abandon.name(),
            PayoutActivities::record_operator_decision.name(),
        ];
        let mut listed = ACTIVITY_TYPES.to_vec();
        registered.sort_unstable();
        listed.sort_unstable();
        listed.dedup();
        assert_eq!(listed, registered);
    }
}
