//! The services the activities talk to, behind one trait. The worker wires the real clients
//! (`services::ServiceBackend`); workflow tests wire a controllable in-memory world
//! (`in_memory::InMemoryBackend`, behind the `test-backend` feature). Temporal is real in both.

use futures::future::BoxFuture;

use crate::refusal::{ActivityFailure, Refusal};
use crate::types::*;
use payout_domain::PayoutId;

pub type Answer<'a, T> = BoxFuture<'a, Result<T, ActivityFailure>>;

pub trait Backend: Send + Sync + 'static {
    /// Lock service: acquire `payout:{account}` on this worker's session, waiting at most `wait`
    /// for the holder's release (first come, first served among the waiters).
    fn acquire(&self, input: AcquireInput, wait: std::time::Duration)
        -> Answer<'_, AcquireOutcome>;
    /// The lock client's conservative local deadline: `Err(GrantLost)` once it has passed, or if
    /// the grant's session is not this worker's (then nobody here keeps it alive).
    fn check_held(&self, grant: &Grant) -> Result<(), Refusal>;
    /// This worker process's own task queue, where fenced work under its grants is routed
    /// (`Grant::task_queue`). Empty: the workflow's own queue (a one-worker setup).
    fn task_queue(&self) -> String {
        String::new()
    }
    /// Compare-and-delete on the handle. Releasing a grant that is already gone is success.
    fn release(&self, grant: Grant) -> Answer<'_, ()>;

    /// Payment resource (first guard). Reads are unfenced; every mutation presents the grant.
    fn get_payout(&self, payout_id: PayoutId) -> Answer<'_, PayoutSnapshot>;
    fn claim(&self, input: FencedInput) -> Answer<'_, PayoutSnapshot>;
    fn mark_submitted(&self, input: FencedInput) -> Answer<'_, PayoutSnapshot>;
    fn record_outcome(&self, input: RecordOutcomeInput) -> Answer<'_, PayoutSnapshot>;
    fn post(&self, input: FencedInput) -> Answer<'_, PayoutSnapshot>;
    fn resolve(&self, input: ResolveInput) -> Answer<'_, PayoutSnapshot>;
    fn abandon(&self, input: AbandonInput) -> Answer<'_, PayoutSnapshot>;
    /// The decision as the resource recorded it (an accepted one may be recorded as refused).
    fn record_operator_decision(
        &self,
        input: OperatorDecisionInput,
    ) -> Answer<'_, RecordedDecision>;

    /// Rail proxy (second guard): the one submission, and the lookup by client reference.
    fn submit(&self, input: SubmitInput) -> Answer<'_, SubmitAnswer>;
    fn inquire(&self, input: InquireInput) -> Answer<'_, Inquiry>;
}
