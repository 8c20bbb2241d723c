//! The Temporal floor that `payoutdev bench e2e` measures the payout workflow against: one
//! workflow that runs one activity doing nothing, on the same server and the same kind of worker.
//! What it costs is what this machine's Temporal dev server costs per workflow; nothing of the
//! payout system is in it. The payout worker never registers it.

use std::sync::Arc;
use std::time::Duration;

use temporalio_macros::{activities, workflow, workflow_methods};
use temporalio_sdk::activities::{ActivityContext, ActivityError};
use temporalio_sdk::{ActivityOptions, WorkflowContext, WorkflowResult};

/// Registered by the benchmark's own in-process worker only.
#[workflow]
#[derive(Default)]
pub struct FloorWorkflow;

#[workflow_methods]
impl FloorWorkflow {
    #[run(name = "BenchFloorWorkflow")]
    pub async fn run(ctx: &mut WorkflowContext<Self>, input: String) -> WorkflowResult<String> {
        let options = ActivityOptions::with_start_to_close_timeout(Duration::from_secs(10)).build();
        Ok(ctx
            .execute_activity(FloorActivities::noop, input, options)
            .await?)
    }
}

pub struct FloorActivities;

#[activities]
impl FloorActivities {
    #[activity(name = "BenchNoop")]
    pub async fn noop(
        self: Arc<Self>,
        _ctx: ActivityContext,
        input: String,
    ) -> Result<String, ActivityError> {
        Ok(input)
    }
}
