//! Starting a payout workflow and awaiting its result, for `payoutdev run` and the system tests.
//!
//! ```text
//! let client = payout_workflows::client::connect("127.0.0.1:7233", "default", "payoutctl").await?;
//! let id = payout_workflows::client::start_payout(&client, "payouts", &input).await?;
//! let result = payout_workflows::client::wait_result(&client, &id, Duration::from_secs(120)).await?;
//! ```

use std::time::Duration;

use payout_activities::types::{PayoutInput, PayoutStartInput};
use temporalio_client::errors::{
    ClientConnectError, WorkflowGetResultError, WorkflowQueryError, WorkflowStartError,
};
use temporalio_client::{
    Client, ClientOptions, ConnectionOptions, Url, WorkflowGetResultOptions, WorkflowQueryOptions,
};

use crate::{PayoutResult, PayoutStatus, PayoutWorkflow};

#[derive(Debug, thiserror::Error)]
pub enum PayoutClientError {
    #[error("TEMPORAL_ADDRESS must be host:port, got {0}")]
    BadAddress(String),
    #[error("connecting to Temporal: {0}")]
    Connect(#[from] ClientConnectError),
    /// A workflow for this payout exists (running or closed): the start is refused, by design.
    #[error("a workflow already exists for {workflow_id}")]
    AlreadyStarted { workflow_id: String },
    #[error("starting {workflow_id}: {source}")]
    Start {
        workflow_id: String,
        source: WorkflowStartError,
    },
    #[error("the workflow {workflow_id} failed: {source}")]
    Result {
        workflow_id: String,
        source: WorkflowGetResultError,
    },
    #[error("no result for {workflow_id} within {timeout:?}")]
    Timeout {
        workflow_id: String,
        timeout: Duration,
    },
    #[error("query on {workflow_id}: {source}")]
    Query {
        workflow_id: String,
        source: WorkflowQueryError,
    },
}

/// Connects to the Temporal frontend at `address` (`host:port`) in `namespace`.
pub async fn connect(
    address: &str,
    namespace: &str,
    identity: &str,
) -> Result<Client, PayoutClientError> {
    let url = Url::parse(&format!("http://{address}"))
        .map_err(|_| PayoutClientError::BadAddress(address.to_string()))?;
    Ok(Client::connect(
        ConnectionOptions::new(url)
            .identity(identity.to_string())
            .build(),
        ClientOptions::new(namespace.to_string()).build(),
    )
    .await?)
}

/// Starts the payout's workflow (id `payout-{payout_id}`) on `task_queue` and returns its id.
/// The payout must exist in the payment resource (CreatePayout) first.
pub async fn start_payout(
    client: &Client,
    task_queue: &str,
    input: &PayoutInput,
) -> Result<String, PayoutClientError> {
    start_with(client, crate::start_options(task_queue, input), input).await
}

/// The same under another workflow id (see [`crate::start_options_with_id`]): tests only.
pub async fn start_payout_with_id(
    client: &Client,
    task_queue: &str,
    input: &PayoutInput,
    workflow_id: &str,
) -> Result<String, PayoutClientError> {
    let options = crate::start_options_with_id(task_queue, input, workflow_id.to_string());
    start_with(client, options, input).await
}

async fn start_with(
    client: &Client,
    options: temporalio_client::WorkflowStartOptions,
    input: &PayoutInput,
) -> Result<String, PayoutClientError> {
    let workflow_id = options.workflow_id.clone();
    match client
        .start_workflow(PayoutWorkflow::run, PayoutStartInput::from(input), options)
        .await
    {
        Ok(_) => Ok(workflow_id),
        Err(WorkflowStartError::AlreadyStarted { .. }) => {
            Err(PayoutClientError::AlreadyStarted { workflow_id })
        }
        Err(source) => Err(PayoutClientError::Start {
            workflow_id,
            source,
        }),
    }
}

/// Waits for the workflow's result, at most `timeout`.
pub async fn wait_result(
    client: &Client,
    workflow_id: &str,
    timeout: Duration,
) -> Result<PayoutResult, PayoutClientError> {
    let handle = client.get_workflow_handle::<PayoutWorkflow>(workflow_id);
    match tokio::time::timeout(
        timeout,
        handle.get_result(WorkflowGetResultOptions::default()),
    )
    .await
    {
        Ok(Ok(result)) => Ok(result),
        Ok(Err(source)) => Err(PayoutClientError::Result {
            workflow_id: workflow_id.to_string(),
            source,
        }),
        Err(_) => Err(PayoutClientError::Timeout {
            workflow_id: workflow_id.to_string(),
            timeout,
        }),
    }
}

/// The `status` query: state, token, claimer, last event, whether the SLA has passed.
pub async fn status(client: &Client, workflow_id: &str) -> Result<PayoutStatus, PayoutClientError> {
    client
        .get_workflow_handle::<PayoutWorkflow>(workflow_id)
        .query(PayoutWorkflow::status, (), WorkflowQueryOptions::default())
        .await
        .map_err(|source| PayoutClientError::Query {
            workflow_id: workflow_id.to_string(),
            source,
        })
}
