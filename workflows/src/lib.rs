//! The payout workflow (spec 2.3, 2.4, 2.6): pure and deterministic. It does no I/O itself;
//! every effect is an activity of `payout-activities`, called with explicit options
//! ([`options`]) and with the grant's token in its input.

pub mod abandon;
pub mod floor;
pub mod options;
pub mod workflow;

pub use options::TASK_QUEUE;
pub use workflow::{
    AbandonAnswer, AbandonDecider, AbandonOutcome, AbandonSignal, PayoutResult, PayoutStatus,
    PayoutWorkflow, ACCOUNT_ID, PAYOUT_STATE,
};

use payout_activities::types::PayoutInput;
use temporalio_client::WorkflowIdReusePolicy;
use temporalio_client::WorkflowStartOptions;
use temporalio_common::search_attributes::SearchAttributes;

pub mod client;

/// How a payout's workflow is started: id `payout-{payout_id}`, on `task_queue` (the workers'
/// queue; [`TASK_QUEUE`] in a deployment, a unique one per test system), refusing
/// a second start for the same payout even after the first has closed, with the search
/// attributes set from the first moment.
pub fn start_options(task_queue: &str, input: &PayoutInput) -> WorkflowStartOptions {
    start_options_with_id(
        task_queue,
        input,
        payout_domain::workflow_id(&input.payout_id),
    )
}

/// The same with another workflow id: only for proving that a second workflow for one payout
/// (an operator mistake) moves no money twice. Production always uses [`start_options`].
pub fn start_options_with_id(
    task_queue: &str,
    input: &PayoutInput,
    workflow_id: String,
) -> WorkflowStartOptions {
    WorkflowStartOptions::new(task_queue, workflow_id)
        .id_reuse_policy(WorkflowIdReusePolicy::RejectDuplicate)
        .search_attributes(SearchAttributes::new([
            PAYOUT_STATE.value_set(payout_domain::PayoutState::Pending.as_str().to_string()),
            ACCOUNT_ID.value_set(input.account_id.to_string()),
        ]))
        .build()
}
