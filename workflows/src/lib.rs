//! The payout workflow (spec 2.3, 2.4, 2.6): pure and deterministic. It does no I/O itself;
//! every effect is an activity of `payout-activities`, called with explicit options
//! ([`options`]) and with the grant's token in its input.

pub mod abandon;
pub mod details;
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
        .static_summary(start_summary(input))
        .static_details(start_details(input))
        .build()
}

/// The amount as a person reads it: the currency and the major-unit decimal (`EUR 12.34`).
pub fn display_amount(currency: &payout_domain::Currency, amount_minor: i64) -> String {
    format!(
        "{} {}",
        currency.as_str(),
        currency.major_decimal_string(amount_minor)
    )
}

/// The one line the Temporal UI shows for the payout's workflow (its static summary).
pub fn start_summary(input: &PayoutInput) -> String {
    format!(
        "Payout {}: {} from {} to {}",
        input.payout_id,
        display_amount(&input.currency, input.amount_minor.get()),
        input.account_id,
        input.beneficiary_ref
    )
}

/// The payout's instruction as the Temporal UI shows it (its static details, markdown).
pub fn start_details(input: &PayoutInput) -> String {
    format!(
        "**Payout** `{}`  \n**Account** `{}`  \n**Amount** {}  \n**Beneficiary** `{}`  \n\
         **Client reference** `{}`",
        input.payout_id,
        input.account_id,
        display_amount(&input.currency, input.amount_minor.get()),
        input.beneficiary_ref,
        payout_domain::ClientReference::for_payout(&input.payout_id)
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use payout_domain::{AccountId, AmountMinor, BeneficiaryRef, Currency, PayoutId};

    #[test]
    fn the_summary_and_details_name_the_instruction_in_major_units() {
        let input = PayoutInput {
            payout_id: PayoutId::parse("p-1").unwrap(),
            account_id: AccountId::parse("a-1").unwrap(),
            amount_minor: AmountMinor::new(1_234).unwrap(),
            currency: Currency::parse("EUR").unwrap(),
            beneficiary_ref: BeneficiaryRef::parse("ben-1").unwrap(),
            ambiguity: Default::default(),
        };
        assert_eq!(
            start_summary(&input),
            "Payout p-1: EUR 12.34 from a-1 to ben-1"
        );
        let details = start_details(&input);
        for part in [
            "**Account** `a-1`",
            "**Amount** EUR 12.34",
            "**Beneficiary** `ben-1`",
            "**Client reference** `cref-p-1`",
        ] {
            assert!(details.contains(part), "{details}");
        }
        let options = start_options("payouts", &input);
        assert_eq!(
            options.static_summary.as_deref(),
            Some(start_summary(&input).as_str())
        );
        assert_eq!(options.static_details.as_deref(), Some(details.as_str()));
    }
}
