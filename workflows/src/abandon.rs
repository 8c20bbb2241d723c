//! The operator's abandon as a Temporal Update: the same request as the `abandon` signal,
//! answered at once (see [`crate::AbandonAnswer`]).
//!
//! ```text
//! let request: AbandonSignal = serde_json::from_str(&signed)?; // `payoutctl sign abandon` output
//! let answer = payout_workflows::abandon::execute(&client, "payout-p-1", request, None).await?;
//! ```

use temporalio_client::errors::WorkflowUpdateError;
use temporalio_client::{Client, WorkflowExecuteUpdateOptions};

use crate::{AbandonAnswer, AbandonSignal, PayoutWorkflow};

#[derive(Debug, thiserror::Error)]
pub enum AbandonError {
    /// Turned down by the workflow's validator before anything was recorded: the request is
    /// unusable, the payout is terminal or in a state where abandon is never allowed, the
    /// resolution SLA has not passed, or another abandon is being carried out.
    #[error("abandon of {workflow_id} rejected: {reason}")]
    Rejected { workflow_id: String, reason: String },
    #[error("no workflow {workflow_id} (or it has closed)")]
    NotFound { workflow_id: String },
    #[error("abandon update on {workflow_id}: {source}")]
    Update {
        workflow_id: String,
        source: WorkflowUpdateError,
    },
}

/// Sends the `abandon` Update to `workflow_id` and waits for its answer. `update_id` makes a
/// repeated call the same Update (the server answers it once); `None` makes a new one.
pub async fn execute(
    client: &Client,
    workflow_id: &str,
    request: AbandonSignal,
    update_id: Option<String>,
) -> Result<AbandonAnswer, AbandonError> {
    let options = WorkflowExecuteUpdateOptions::builder()
        .maybe_update_id(update_id)
        .build();
    client
        .get_workflow_handle::<PayoutWorkflow>(workflow_id)
        .execute_update(PayoutWorkflow::abandon_update, request, options)
        .await
        .map_err(|source| match source {
            WorkflowUpdateError::Failed(failure) => AbandonError::Rejected {
                workflow_id: workflow_id.to_string(),
                reason: failure.message,
            },
            WorkflowUpdateError::NotFound(_) => AbandonError::NotFound {
                workflow_id: workflow_id.to_string(),
            },
            source => AbandonError::Update {
                workflow_id: workflow_id.to_string(),
                source,
            },
        })
}
