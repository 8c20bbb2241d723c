//! The rogue Temporal client of the attack suite (issue 33, design section 4): someone who can
//! reach Temporal and runs an SDK worker of their own, on their own task queue `rogue-{uuid}`,
//! whose workflows schedule the genuine activities by their registered names with inputs the test
//! chooses. The genuine workers poll the system's queues and execute whatever is scheduled there:
//! what a rogue can make them do is what the caller check and the guards must refuse.
//!
//! Two workflow types, both running the same [`Script`]:
//! - `RogueWorkflow` (a type of its own): nothing about it resembles a payout workflow.
//! - the impostor, registered under the name `PayoutWorkflow` (the genuine type's name), started
//!   as `payout-{id}` to squat a real payout: it passes a check on the caller's type and id and
//!   only the signed facts stop it. It also answers the `abandon` Update as a genuine run would
//!   (with the answer the test chose), without recording anything: a rogue poller.
//!
//! The acquire runs on the system's payout queue (where the genuine workflow's acquire runs) and
//! every later step on the grant's `task_queue` (the private queue of the worker process whose
//! session holds the grant), as the genuine workflow routes them.

use payout_workflows::client::TemporalArgs;
use std::time::Duration;

use payout_activities::refusal::Refusal;
use payout_activities::types::{AcquireOutcome, Grant, TryAcquired};
use payout_activities::PayoutActivities;
use serde::{Deserialize, Serialize};
use temporalio_client::{
    Client, WorkflowGetResultOptions, WorkflowIdReusePolicy, WorkflowStartOptions,
};
use temporalio_common::{ActivityDefinition, RetryPolicy};
use temporalio_macros::{workflow, workflow_methods};
use temporalio_sdk::{
    ActivityExecutionError, ActivityOptions, SyncWorkflowContext, WorkflowContext, WorkflowResult,
};
use temporalio_sdk::{Runtime, Worker, WorkerOptions};

/// Each scheduled step's start-to-close: the genuine guard calls' own bound (a step that runs
/// longer has hung, and the test wants its answer, not a wait).
const STEP_START_TO_CLOSE: Duration = Duration::from_secs(10);
/// How long a step may wait for a genuine worker to pick it up: a worker polls its queues
/// continuously, so a step still unstarted after this was not going to be served.
const STEP_SCHEDULE_TO_START: Duration = Duration::from_secs(30);
/// How long the harness waits for a script's report: every step is bounded above, and a script
/// has a handful of steps.
pub const SCRIPT_TIMEOUT: Duration = Duration::from_secs(180);

/// A genuine activity the rogue schedules.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Activity {
    /// On the system's payout queue; its grant is kept for the later steps.
    TryAcquireGrant,
    GetPayout,
    Claim,
    MarkSubmitted,
    SubmitToRail,
    RecordOutcome,
    ResolveAmbiguity,
    ReleaseGrant,
}

impl Activity {
    /// Whether the step acts under the grant (its input gets the script's grant and it runs on
    /// the grant's queue).
    fn fenced(self) -> bool {
        !matches!(self, Activity::TryAcquireGrant | Activity::GetPayout)
    }
}

/// One step: the activity and its input as JSON. A fenced step's input without a `grant` gets
/// the grant the script's last `TryAcquireGrant` obtained, and a `signed_instruction` of
/// [`FROM_MARK_SUBMITTED`] gets the one the script's last `MarkSubmitted` was answered with (what
/// the genuine workflow carries from that answer to SubmitToRail).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Step {
    pub activity: Activity,
    pub input: serde_json::Value,
}

impl Step {
    pub fn new(activity: Activity, input: serde_json::Value) -> Self {
        Self { activity, input }
    }
}

/// A step input's `signed_instruction` value that stands for MarkSubmitted's answer's.
pub const FROM_MARK_SUBMITTED: &str = "from MarkSubmitted's answer";

/// What the rogue does, in order; it stops at the first step that is not answered.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Script {
    /// The system's payout queue (where the genuine acquire and reads run).
    pub payout_queue: String,
    pub steps: Vec<Step>,
    /// The impostor's answer to an `abandon` Update (ignored by `RogueWorkflow`). The impostor
    /// waits for one such Update after its steps when this is set.
    #[serde(default)]
    pub abandon_answer: Option<serde_json::Value>,
}

/// How a step ended.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum Outcome {
    /// The activity's answer.
    Answered(serde_json::Value),
    /// A named refusal (the activity's non-retryable failure).
    Refused(Refusal),
    /// Anything else: a timeout, an unknown failure, an input the harness could not build.
    Failed(String),
}

/// A step and how it ended, with the queue it was scheduled on.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct StepReport {
    pub activity: Activity,
    pub task_queue: String,
    pub outcome: Outcome,
}

/// The script's report: one entry per step that ran.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Report {
    pub steps: Vec<StepReport>,
}

impl Report {
    /// The outcome of the first step of `activity`, if it ran.
    pub fn outcome(&self, activity: Activity) -> Option<&Outcome> {
        self.steps
            .iter()
            .find(|s| s.activity == activity)
            .map(|s| &s.outcome)
    }

    /// The name of the refusal `activity` got, if it got one.
    pub fn refusal(&self, activity: Activity) -> Option<&'static str> {
        match self.outcome(activity)? {
            Outcome::Refused(r) => Some(r.name()),
            _ => None,
        }
    }
}

/// A workflow type of the rogue's own, nothing like the payout workflow.
#[workflow]
#[derive(Default)]
pub struct RogueWorkflow {}

#[workflow_methods]
impl RogueWorkflow {
    #[run(name = "RogueWorkflow")]
    pub async fn run(ctx: &mut WorkflowContext<Self>, script: Script) -> WorkflowResult<Report> {
        Ok(run_script(ctx, &script).await)
    }
}

/// The impostor: registered under the genuine workflow's type name, `PayoutWorkflow`.
#[workflow]
#[derive(Default)]
pub struct ImpostorWorkflow {
    abandon_answer: Option<serde_json::Value>,
    answered: bool,
}

#[workflow_methods]
impl ImpostorWorkflow {
    #[run(name = "PayoutWorkflow")]
    pub async fn run(ctx: &mut WorkflowContext<Self>, script: Script) -> WorkflowResult<Report> {
        let report = run_script(ctx, &script).await;
        if script.abandon_answer.is_some() {
            ctx.state_mut(|s| s.abandon_answer = script.abandon_answer.clone());
            ctx.wait_condition(|s| s.answered).await?;
        }
        Ok(report)
    }

    /// Answers the genuine `abandon` Update with the script's answer, recording nothing.
    #[update(name = "abandon")]
    pub fn abandon(
        &mut self,
        _ctx: &mut SyncWorkflowContext<Self>,
        _request: serde_json::Value,
    ) -> serde_json::Value {
        self.answered = true;
        self.abandon_answer.clone().unwrap_or_default()
    }
}

async fn run_script<W>(ctx: &WorkflowContext<W>, script: &Script) -> Report {
    let mut report = Report::default();
    let mut grant: Option<Grant> = None;
    let mut instruction = serde_json::Value::Null;
    for step in &script.steps {
        let task_queue = match (&grant, step.activity.fenced()) {
            (Some(g), true) if !g.task_queue.is_empty() => g.task_queue.clone(),
            _ => script.payout_queue.clone(),
        };
        let mut input = step.input.clone();
        if input["signed_instruction"] == FROM_MARK_SUBMITTED {
            input["signed_instruction"] = instruction.clone();
        }
        if step.activity.fenced() {
            if let (Some(g), Some(fields)) = (&grant, input.as_object_mut()) {
                if !fields.contains_key("grant") {
                    fields.insert("grant".into(), serde_json::to_value(g).unwrap_or_default());
                }
            }
        }
        let mut options = ActivityOptions::with_start_to_close_timeout(STEP_START_TO_CLOSE)
            .retry_policy(RetryPolicy::builder().maximum_attempts(1).build())
            .build();
        options.task_queue = Some(task_queue.clone());
        options.schedule_to_start_timeout = Some(STEP_SCHEDULE_TO_START);
        // Each arm is one genuine activity definition, its input decoded into that type.
        macro_rules! run {
            ($definition:expr) => {
                schedule(ctx, $definition, input, options).await
            };
        }
        let outcome = match step.activity {
            Activity::TryAcquireGrant => {
                let answer = run!(PayoutActivities::try_acquire_grant);
                if let Outcome::Answered(value) = &answer {
                    if let Ok(TryAcquired {
                        outcome: AcquireOutcome::Granted(g),
                        ..
                    }) = serde_json::from_value::<TryAcquired>(value.clone())
                    {
                        grant = Some(g);
                    }
                }
                answer
            }
            Activity::GetPayout => run!(PayoutActivities::get_payout),
            Activity::Claim => run!(PayoutActivities::claim),
            Activity::MarkSubmitted => {
                let answer = run!(PayoutActivities::mark_submitted);
                if let Outcome::Answered(value) = &answer {
                    instruction = value["signed_instruction"].clone();
                }
                answer
            }
            Activity::SubmitToRail => run!(PayoutActivities::submit_to_rail),
            Activity::RecordOutcome => run!(PayoutActivities::record_outcome),
            Activity::ResolveAmbiguity => run!(PayoutActivities::resolve_ambiguity),
            Activity::ReleaseGrant => run!(PayoutActivities::release_grant),
        };
        let answered = matches!(outcome, Outcome::Answered(_));
        report.steps.push(StepReport {
            activity: step.activity,
            task_queue,
            outcome,
        });
        if !answered {
            break;
        }
    }
    report
}

/// Schedules the genuine activity `activity` with `input` decoded into its input type.
async fn schedule<AD, I>(
    ctx: &WorkflowContext<impl Sized>,
    activity: AD,
    input: serde_json::Value,
    options: ActivityOptions,
) -> Outcome
where
    AD: ActivityDefinition<Input = I>,
    I: serde::de::DeserializeOwned,
    AD::Output: Serialize + temporalio_common::data_converters::TemporalDeserializable,
{
    let input: I = match serde_json::from_value(input) {
        Ok(input) => input,
        Err(e) => return Outcome::Failed(format!("the harness could not build the input: {e}")),
    };
    match ctx.execute_activity(activity, input, options).await {
        Ok(answer) => Outcome::Answered(serde_json::to_value(&answer).unwrap_or_default()),
        Err(error) => failed(&error),
    }
}

fn failed(error: &ActivityExecutionError) -> Outcome {
    match Refusal::from_failure(error) {
        Some(refusal) => Outcome::Refused(refusal),
        None => Outcome::Failed(format!("{error:?}")),
    }
}

/// The rogue's worker, polling `rogue-{uuid}` until dropped, and a client that starts its
/// workflows.
pub struct Rogue {
    pub client: Client,
    pub task_queue: String,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
}

impl Rogue {
    /// Connects to Temporal with `temporal` (through its front, as an operator: what is tested
    /// is the worker and the guards, not the front) as any admitted client can, and starts
    /// polling a queue of its own. The SDK's worker future is not `Send`, so it runs on a thread
    /// of its own with its own runtime.
    pub async fn start(temporal: TemporalArgs) -> anyhow::Result<Self> {
        let task_queue = format!("rogue-{}", uuid::Uuid::new_v4());
        let client = connect(&temporal).await?;
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let (polling, started) = tokio::sync::oneshot::channel::<anyhow::Result<()>>();
        let address = temporal;
        let queue = task_queue.clone();
        std::thread::Builder::new()
            .name("rogue-worker".into())
            .spawn(move || {
                let runtime = match tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                {
                    Ok(runtime) => runtime,
                    Err(e) => {
                        let _ = polling.send(Err(e.into()));
                        return;
                    }
                };
                runtime.block_on(poll(address, queue, polling, stopped));
            })?;
        started.await??;
        Ok(Self {
            client,
            task_queue,
            stop: Some(stop),
        })
    }

    /// Runs `script` as a `RogueWorkflow` under a fresh id and returns its report.
    pub async fn rogue(&self, script: Script) -> anyhow::Result<Report> {
        let id = format!("rogue-run-{}", uuid::Uuid::new_v4());
        let options = WorkflowStartOptions::new(&self.task_queue, id.clone()).build();
        self.client
            .start_workflow(RogueWorkflow::run, script, options)
            .await?;
        self.report(&id).await
    }

    /// Starts `script` as the impostor `PayoutWorkflow` under `workflow_id` (a payout's own id
    /// to squat it); refused by Temporal if that id is already running.
    pub async fn start_impostor(&self, workflow_id: &str, script: Script) -> anyhow::Result<()> {
        let options = WorkflowStartOptions::new(&self.task_queue, workflow_id.to_string())
            .id_reuse_policy(WorkflowIdReusePolicy::AllowDuplicate)
            .build();
        self.client
            .start_workflow(ImpostorWorkflow::run, script, options)
            .await?;
        Ok(())
    }

    /// The report of the script run as `workflow_id` (either type: both answer a [`Report`]),
    /// once it is done (for the impostor, with its `abandon` answer, if any, given).
    pub async fn report(&self, workflow_id: &str) -> anyhow::Result<Report> {
        let handle = self
            .client
            .get_workflow_handle::<ImpostorWorkflow>(workflow_id);
        let result = tokio::time::timeout(
            SCRIPT_TIMEOUT,
            handle.get_result(WorkflowGetResultOptions::default()),
        )
        .await
        .map_err(|_| anyhow::anyhow!("no report from {workflow_id} within {SCRIPT_TIMEOUT:?}"))??;
        Ok(result)
    }
}

impl Drop for Rogue {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
    }
}

async fn connect(temporal: &TemporalArgs) -> anyhow::Result<Client> {
    Ok(payout_workflows::client::connect_configured(temporal, "rogue").await?)
}

/// The worker's thread: polls until `stopped`, having said on `polling` whether it started.
async fn poll(
    address: TemporalArgs,
    task_queue: String,
    polling: tokio::sync::oneshot::Sender<anyhow::Result<()>>,
    stopped: tokio::sync::oneshot::Receiver<()>,
) {
    let worker = async {
        let client = connect(&address).await?;
        let runtime = Runtime::from_current_tokio(Default::default())?;
        let options = WorkerOptions::new(task_queue)
            .register_workflow::<RogueWorkflow>()?
            .register_workflow::<ImpostorWorkflow>()?
            .build();
        let worker = Worker::new(&runtime, client, options)?;
        anyhow::Ok((runtime, worker))
    };
    let (_runtime, mut worker) = match worker.await {
        Ok(started) => started,
        Err(e) => {
            let _ = polling.send(Err(e));
            return;
        }
    };
    let _ = polling.send(Ok(()));
    let shutdown = worker.shutdown_handle();
    let (ran, ()) = tokio::join!(worker.run(), async {
        let _ = stopped.await;
        shutdown();
    });
    if let Err(e) = ran {
        tracing::warn!(error = %e, "the rogue worker stopped");
    }
}
