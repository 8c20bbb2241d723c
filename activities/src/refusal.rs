//! Business refusals: expected answers with stable names, carried to the workflow as
//! non-retryable activity failures whose type name is the variant's name and whose details are
//! the variant itself. The workflow matches on them by name (`Refusal::from_failure`).

use serde::{Deserialize, Serialize};
use temporalio_common::error::ApplicationFailure;
use temporalio_common::error::IncomingError;
use temporalio_common::protos::temporal::api::failure::v1::failure::FailureInfo;
use temporalio_sdk::activities::ActivityError;
use temporalio_sdk::error::ActivityExecutionError;

use crate::types::RailOutcome;

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
pub enum Refusal {
    /// A guard holds a higher token than the one presented: a later grant exists.
    #[error("fenced out on {key}: presented {presented}, stored {stored} (owner {owner})")]
    FencedOut {
        key: String,
        presented: u64,
        stored: u64,
        owner: String,
    },
    /// The lock client's conservative deadline has passed, or the session is not this worker's:
    /// the grant can no longer be vouched for, so no fenced call is made under it.
    #[error("grant {token} on {key} is lost: {reason}")]
    GrantLost {
        key: String,
        token: u64,
        reason: String,
    },
    /// The proxy already holds a submission for this payout: no second one is sent. The existing
    /// record's outcome, when it has one, resolves the payout.
    #[error("a submission already exists for payout {payout_id}")]
    DuplicateSubmission {
        payout_id: String,
        existing_outcome: Option<RailOutcome>,
    },
    /// The (state, event) pair is not in the spec 2.3 table: another step got there first.
    #[error("transition {event} from {from} refused for payout {payout_id}")]
    RefusedTransition {
        payout_id: String,
        from: String,
        event: String,
    },
    /// Another payout of the account is in flight in the payment resource.
    #[error("account {account_id} is busy with payout {in_flight_payout_id}")]
    AccountBusy {
        account_id: String,
        in_flight_payout_id: String,
    },
    /// Abandoning a RAIL_AMBIGUOUS payout before its resolution SLA.
    #[error("the resolution SLA of payout {payout_id} has not passed")]
    ResolutionSlaNotPassed { payout_id: String },
    /// A request a service refused as malformed: a bug, never retried.
    #[error("invalid request: {detail}")]
    InvalidRequest { detail: String },
    /// The activity was scheduled by a workflow that is not this system's payout workflow for
    /// the payout it names (another workflow type, or another workflow id): the worker serves
    /// no one else, and nothing reached a service.
    #[error(
        "{activity} refused: called by workflow {workflow_id} of type {workflow_type}, \
         not the payout workflow of payout {payout_id}"
    )]
    ForeignCaller {
        activity: String,
        workflow_type: String,
        workflow_id: String,
        payout_id: String,
    },
}

impl Refusal {
    /// The stable name, used as the Temporal failure's type name.
    pub fn name(&self) -> &'static str {
        match self {
            Refusal::FencedOut { .. } => "FencedOut",
            Refusal::GrantLost { .. } => "GrantLost",
            Refusal::DuplicateSubmission { .. } => "DuplicateSubmission",
            Refusal::RefusedTransition { .. } => "RefusedTransition",
            Refusal::AccountBusy { .. } => "AccountBusy",
            Refusal::ResolutionSlaNotPassed { .. } => "ResolutionSlaNotPassed",
            Refusal::InvalidRequest { .. } => "InvalidRequest",
            Refusal::ForeignCaller { .. } => "ForeignCaller",
        }
    }

    /// Reads a refusal back from an activity failure, if that is what it was. Anything else
    /// (a timeout, a lost worker, a retryable error that ran out of attempts) is `None`.
    pub fn from_failure(error: &ActivityExecutionError) -> Option<Refusal> {
        if let Some(IncomingError::Application(failure)) = error.reason() {
            failure.type_name()?;
            return failure.details::<Refusal>().ok().flatten();
        }
        // A local activity's failure arrives unwrapped: the application failure is the
        // top-level one, its details the refusal as JSON.
        let failure = error.failure()?;
        let Some(FailureInfo::ApplicationFailureInfo(info)) = &failure.failure_info else {
            return None;
        };
        if info.r#type.is_empty() {
            return None;
        }
        let payload = info.details.as_ref()?.payloads.first()?;
        serde_json::from_slice(&payload.data).ok()
    }
}

/// How an activity fails: a refusal (never retried) or a transient fault (retried by policy).
#[derive(Debug, thiserror::Error)]
pub enum ActivityFailure {
    #[error(transparent)]
    Refused(#[from] Refusal),
    /// A fault that a retry may cure: the service is unreachable, a database is restarting.
    #[error("transient: {0}")]
    Transient(String),
}

impl ActivityFailure {
    /// The Temporal failure: a refusal is non-retryable and named; a transient fault is not.
    pub fn into_activity_error(self) -> ActivityError {
        match self {
            ActivityFailure::Refused(refusal) => {
                let name = refusal.name();
                ActivityError::application(
                    ApplicationFailure::builder(refusal.to_string())
                        .type_name(name.to_string())
                        .non_retryable(true)
                        .details(refusal)
                        .build(),
                )
            }
            ActivityFailure::Transient(detail) => ActivityError::application(
                ApplicationFailure::builder(detail)
                    .type_name("Transient".to_string())
                    .build(),
            ),
        }
    }
}
