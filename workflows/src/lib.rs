//! The payout workflow (spec 2.3, 2.4, 2.6): pure and deterministic. It does no I/O itself;
//! every effect is an activity of `payout-activities`, called with explicit options
//! ([`options`]) and with the grant's token in its input.

pub mod options;
pub mod workflow;

pub use options::TASK_QUEUE;
pub use workflow::{
    AbandonSignal, PayoutResult, PayoutStatus, PayoutWorkflow, ACCOUNT_ID, PAYOUT_STATE,
};

use payout_activities::types::PayoutInput;
use temporalio_client::WorkflowIdReusePolicy;
use temporalio_client::WorkflowStartOptions;
use temporalio_common::search_attributes::SearchAttributes;

/// How a payout's workflow is started: id `payout-{payout_id}`, on the `payouts` queue, refusing
/// a second start for the same payout even after the first has closed, with the search
/// attributes set from the first moment.
pub fn start_options(input: &PayoutInput) -> WorkflowStartOptions {
    WorkflowStartOptions::new(TASK_QUEUE, payout_domain::workflow_id(&input.payout_id))
        .id_reuse_policy(WorkflowIdReusePolicy::RejectDuplicate)
        .search_attributes(SearchAttributes::new([
            PAYOUT_STATE.value_set(payout_domain::PayoutState::Pending.as_str().to_string()),
            ACCOUNT_ID.value_set(input.account_id.to_string()),
        ]))
        .build()
}
