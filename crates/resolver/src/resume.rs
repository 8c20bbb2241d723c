//! Stranded payouts: a payout in PENDING, CLAIMED, RAIL_SUBMITTED, RAIL_ACKED or RAIL_AMBIGUOUS
//! whose workflow has ended (a fatal refusal, too many lost grants, an operator's `temporal workflow terminate`,
//! a bug) or never started has nobody left to finish it: money may have left with no ledger row,
//! and the one-in-flight rule then blocks every later payout of the account. This is the
//! resolver's second CORRECTIVE part: it does nothing itself to the payout; it hands the payout back
//! to the workflow, which continues from the state the payment resource reports, under a new
//! grant, with evidence only:
//!
//! | state          | the resumed workflow                                                 |
//! |----------------|----------------------------------------------------------------------|
//! | PENDING        | claims and pays it, as any run would                                 |
//! | CLAIMED        | re-claims it under a higher token and continues                      |
//! | RAIL_SUBMITTED | treats it as maybe sent (`resume`): RAIL_AMBIGUOUS, then inquiry     |
//! | RAIL_ACKED     | posts it (money has left; the books follow)                          |
//! | RAIL_AMBIGUOUS | asks the rail at once, then every window; never submits (below)      |
//!
//! A resumed run never submits a RAIL_AMBIGUOUS payout (read in `workflows/src/workflow.rs`):
//! its step for RAIL_AMBIGUOUS is the ambiguity step, whose only rail call is the fenced
//! inquiry, and no transition leads from RAIL_AMBIGUOUS back to RAIL_SUBMITTED, the one state
//! whose step submits (and `resume` marks even that one maybe sent). Its grant is fresh and no
//! fenced step of the run has used it, so the ambiguity step asks the rail first and waits the
//! window only after an UNKNOWN (patch `inquire-first`); the SLA runs from the payment
//! resource's record of when the payout became ambiguous, so once the run exists an operator's
//! abandon past the SLA goes through its abandon Update (`payoutctl payout abandon`). Without
//! this, an orphaned ambiguous payout the rail keeps answering UNKNOWN about would stay
//! ambiguous for good and hold its account (issue 35, item 3).
//!
//! A grant held by a payout whose workflow is not running is never released by that workflow:
//! the key is taken over (an audited force-revoke by the resolver; the next grant's token is
//! higher, so the guards fence out anything the old holder still sends) before the resume.
//!
//! Two passes: the full one ([`resume_stranded`], every scheduled reconciliation) walks the open
//! payouts from where the last pass stopped (`crate::walk`: candidates only, a cursor that wraps,
//! every open payout examined within `ceil(N / per_pass)` passes); the short one ([`resume_blocked_accounts`], `reconciler serve`'s keeper, every
//! few seconds) only at the accounts where someone waits or a payout is in flight, so a holder
//! whose workflow was terminated blocks its account for seconds, not until the next full pass.
//!
//! Whether a payout "has not started yet" is paydb's record, never when a pass first saw it: a
//! PENDING payout whose workflow start paydb records as delivered had a workflow, so after
//! Temporal lost its state the first pass resumes it; one whose start is still staged is the
//! starter's for the not-started grace, from the staging (the payout's creation).
//!
//! Temporal is asked through its own client (describe, start), never by parsing CLI output.

use std::time::Duration;

use lock_client::LockClient;
use payout_domain::{PayoutId, PayoutState};
use serde::Serialize;
use sqlx::PgPool;
use temporalio_client::errors::{WorkflowInteractionError, WorkflowStartError};
use temporalio_client::{
    Client, UntypedWorkflow, WorkflowDescribeOptions, WorkflowExecutionStatus,
    WorkflowIdReusePolicy, WorkflowStartOptions, WorkflowTerminateOptions,
};
use temporalio_common::data_converters::RawValue;
use temporalio_common::protos::temporal::api::common::v1::Payload;
use temporalio_common::protos::temporal::api::enums::v1::PendingActivityState;
use temporalio_common::search_attributes::{SearchAttributeKey, SearchAttributes};

/// Upper bound of one call to Temporal (describe, start).
pub const TEMPORAL_CALL_TIMEOUT: Duration = Duration::from_secs(20);
/// Recorded as the operator of a takeover's force-revoke.
pub const RECOVERER: &str = "reconciler";
/// Reported as the workflow of a payout whose workflow could not be described (the payout was
/// skipped this pass).
pub const UNDESCRIBED: &str = "UNDESCRIBED";
/// The payout workflow's type name (workflows/src/workflow.rs).
pub use payout_domain::PAYOUT_WORKFLOW_TYPE;
/// The action reported for a squatter's run terminated by a pass (before the payout's RESUMED).
pub const SQUATTER_TERMINATED: &str = "SQUATTER_TERMINATED";

#[derive(Debug, thiserror::Error)]
pub enum ResumeError {
    #[error("reading paydb: {0}")]
    Paydb(#[from] sqlx::Error),
    #[error("connecting to {service}: {detail}")]
    Connect {
        service: &'static str,
        detail: String,
    },
    #[error("asking Temporal about {workflow_id}: {detail}")]
    Temporal { workflow_id: String, detail: String },
}

/// What Temporal says about the payout's workflow.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub enum WorkflowStatus {
    NotFound,
    Running,
    /// Closed, with Temporal's status name (COMPLETED, FAILED, TERMINATED, ...).
    Closed(String),
    /// Running, but as the holder of a grant it is not: its running run waits for its
    /// account's key on another worker than the one holding the grant ([`Temporal::holder_status`]),
    /// so the grant is an earlier run's (one Temporal lost, whose worker's session lives on) or
    /// an earlier attempt's whose answer reached nobody. Nobody will use or release it.
    RunningWithoutTheGrant,
}

impl WorkflowStatus {
    pub fn name(&self) -> String {
        match self {
            Self::NotFound => "NOT_FOUND".into(),
            Self::Running => "RUNNING".into(),
            Self::Closed(s) => s.clone(),
            Self::RunningWithoutTheGrant => "RUNNING_WITHOUT_THE_GRANT".into(),
        }
    }
}

/// The activities a run waits for its account's key in (`workflows/src/workflow.rs`).
const ACQUIRE_ACTIVITIES: [&str; 2] = ["AcquireGrant", "TryAcquireGrant"];

/// Temporal, through its own client, for one namespace.
#[derive(Clone)]
pub struct Temporal {
    client: Client,
    /// The payout workers' task queue, where a resumed workflow runs.
    payout_task_queue: String,
    /// The ambiguity clocks a resumed workflow is started with (`settlement_window_ms`,
    /// `resolution_sla_ms`), as the workflow's input names them.
    settlement_window_ms: u64,
    resolution_sla_ms: u64,
    /// Who resumes, as the run's summary in the Temporal UI says.
    resumed_by: String,
}

/// Where Temporal is and how resumed workflows are started.
#[derive(Debug, Clone)]
pub struct TemporalConfig {
    /// The connection, configured as every process's is (flags, `TEMPORAL_*`, the config file).
    pub connection: payout_workflows::client::TemporalArgs,
    pub payout_task_queue: String,
    pub settlement_window_ms: u64,
    pub resolution_sla_ms: u64,
}

impl Temporal {
    pub async fn connect(config: &TemporalConfig) -> Result<Self, ResumeError> {
        let err = |detail: String| ResumeError::Connect {
            service: "temporal",
            detail,
        };
        let target = config
            .connection
            .resolve()
            .map_err(|e| err(e.to_string()))?;
        let client = tokio::time::timeout(
            TEMPORAL_CALL_TIMEOUT,
            payout_workflows::client::connect_to(&target, RECOVERER),
        )
        .await
        .map_err(|_| {
            err(format!(
                "{} gave no answer within {TEMPORAL_CALL_TIMEOUT:?}",
                target.describe()
            ))
        })?
        .map_err(|e| err(e.to_string()))?;
        Ok(Self {
            client,
            payout_task_queue: config.payout_task_queue.clone(),
            settlement_window_ms: config.settlement_window_ms,
            resolution_sla_ms: config.resolution_sla_ms,
            resumed_by: "the reconciler's stranded-payout pass".into(),
        })
    }

    /// The same start path over a client already connected under another identity (an
    /// operator's `payoutctl payout abandon` of a payout whose workflow is not running);
    /// `resumed_by` names it in the run's summary.
    pub fn from_client(
        client: Client,
        payout_task_queue: String,
        settlement_window_ms: u64,
        resolution_sla_ms: u64,
        resumed_by: String,
    ) -> Self {
        Self {
            client,
            payout_task_queue,
            settlement_window_ms,
            resolution_sla_ms,
            resumed_by,
        }
    }

    /// The status of the workflow `workflow_id` (its latest run).
    pub async fn status(&self, workflow_id: &str) -> Result<WorkflowStatus, ResumeError> {
        Ok(self.execution(workflow_id).await?.0)
    }

    /// The status of `workflow_id` as the holder of a grant made on `holder_process`'s session
    /// (the owner `{holder_process}/{payout}`): [`WorkflowStatus::RunningWithoutTheGrant`] when its
    /// running run waits for the key in an attempt started on another process. That attempt's
    /// own grant would be on its process's session (and an attempt on the holder's own session
    /// is answered at once with the grant it holds: acquire is idempotent per owner and
    /// session), so the grant described is not the running run's.
    pub async fn holder_status(
        &self,
        workflow_id: &str,
        holder_process: &str,
    ) -> Result<WorkflowStatus, ResumeError> {
        Ok(match self.execution(workflow_id).await? {
            (WorkflowStatus::Running, Some(run))
                if !run.acquiring_on.is_empty()
                    && run.acquiring_on.iter().all(|w| w != holder_process) =>
            {
                WorkflowStatus::RunningWithoutTheGrant
            }
            (status, _) => status,
        })
    }

    /// The status of the workflow `workflow_id` (its latest run) and, while it runs, which run
    /// it is: its type, task queue and run id, to tell the payout's own workflow from a
    /// squatter.
    pub async fn execution(
        &self,
        workflow_id: &str,
    ) -> Result<(WorkflowStatus, Option<RunningExecution>), ResumeError> {
        let err = |detail: String| ResumeError::Temporal {
            workflow_id: workflow_id.to_string(),
            detail,
        };
        let handle = self
            .client
            .get_workflow_handle::<UntypedWorkflow>(workflow_id);
        let described = tokio::time::timeout(
            TEMPORAL_CALL_TIMEOUT,
            handle.describe(WorkflowDescribeOptions::default()),
        )
        .await
        .map_err(|_| err(format!("no answer within {TEMPORAL_CALL_TIMEOUT:?}")))?;
        match described {
            Ok(d) => Ok(match d.status() {
                WorkflowExecutionStatus::Running => (
                    WorkflowStatus::Running,
                    Some(RunningExecution {
                        workflow_type: d.workflow_type().to_string(),
                        task_queue: d.task_queue().to_string(),
                        run_id: d.run_id().to_string(),
                        acquiring_on: d
                            .raw_description
                            .pending_activities
                            .iter()
                            .filter(|a| {
                                a.state == PendingActivityState::Started as i32
                                    && a.activity_type.as_ref().is_some_and(|t| {
                                        ACQUIRE_ACTIVITIES.contains(&t.name.as_str())
                                    })
                            })
                            .map(|a| a.last_worker_identity.clone())
                            .collect(),
                    }),
                ),
                other => (
                    WorkflowStatus::Closed(format!("{other:?}").to_ascii_uppercase()),
                    None,
                ),
            }),
            Err(WorkflowInteractionError::NotFound(_)) => Ok((WorkflowStatus::NotFound, None)),
            Err(e) => Err(err(e.to_string())),
        }
    }

    /// Why the running `execution` on a payout's workflow id is not the payout's own workflow
    /// (another type, or another task queue than the payout workers'), or `None` if it is.
    pub fn squatter(&self, execution: &RunningExecution) -> Option<String> {
        if execution.workflow_type == PAYOUT_WORKFLOW_TYPE
            && execution.task_queue == self.payout_task_queue
        {
            return None;
        }
        Some(format!(
            "type {} on queue {} (the payout workflow is {PAYOUT_WORKFLOW_TYPE} on {})",
            execution.workflow_type, execution.task_queue, self.payout_task_queue
        ))
    }

    /// Terminates that one run (never a later one that took the id meanwhile).
    pub async fn terminate_run(
        &self,
        workflow_id: &str,
        run_id: &str,
        reason: String,
    ) -> Result<(), ResumeError> {
        let err = |detail: String| ResumeError::Temporal {
            workflow_id: workflow_id.to_string(),
            detail,
        };
        let handle = temporalio_client::WorkflowExecutionInfo::builder()
            .namespace(self.client.options().namespace.clone())
            .workflow_id(workflow_id)
            .run_id(run_id)
            .build()
            .bind_untyped(self.client.clone());
        let terminated = tokio::time::timeout(
            TEMPORAL_CALL_TIMEOUT,
            handle.terminate(WorkflowTerminateOptions::builder().reason(reason).build()),
        )
        .await
        .map_err(|_| err(format!("no answer within {TEMPORAL_CALL_TIMEOUT:?}")))?;
        match terminated {
            // Closed meanwhile: nothing squats the id any more.
            Ok(()) | Err(WorkflowInteractionError::NotFound(_)) => Ok(()),
            Err(e) => Err(err(e.to_string())),
        }
    }

    /// Starts the payout's workflow again (a new run under the same id) with a resume input:
    /// only the payout id (what is paid comes from the payment resource's record), the
    /// ambiguity clocks and `resume`. A run that is already going makes this a no-op.
    pub async fn resume(
        &self,
        payout_id: &PayoutId,
        account_id: &str,
    ) -> Result<bool, ResumeError> {
        let workflow_id = payout_domain::workflow_id(payout_id);
        let err = |detail: String| ResumeError::Temporal {
            workflow_id: workflow_id.clone(),
            detail,
        };
        let input = serde_json::json!({
            "payout_id": payout_id.as_str(),
            "resume": true,
            "ambiguity": {
                "settlement_window_ms": self.settlement_window_ms,
                "resolution_sla_ms": self.resolution_sla_ms,
            },
        });
        let payload = Payload {
            metadata: [("encoding".to_string(), b"json/plain".to_vec())].into(),
            data: serde_json::to_vec(&input).expect("JSON serializes"),
            ..Default::default()
        };
        let options =
            WorkflowStartOptions::new(self.payout_task_queue.clone(), workflow_id.clone())
                // The previous run is closed; this one continues it. A running one refuses the start.
                .id_reuse_policy(WorkflowIdReusePolicy::AllowDuplicate)
                .search_attributes(SearchAttributes::new([
                    SearchAttributeKey::<String>::keyword("AccountId")
                        .value_set(account_id.to_string()),
                ]))
                // The Temporal UI's line for the run: a resumed run carries only the payout id, so
                // it says so; what it pays is the payment resource's record, which the run's
                // current details show once it has read it.
                .static_summary(format!(
                    "Payout {payout_id}: resumed by {} (account {account_id})",
                    self.resumed_by
                ))
                .static_details(format!(
                    "**Payout** `{payout_id}`  \n**Account** `{account_id}`  \n\
                     **Resumed** by {}: the previous run \
                     closed (or never started) while the payout was open",
                    self.resumed_by
                ))
                .build();
        let started = tokio::time::timeout(
            TEMPORAL_CALL_TIMEOUT,
            self.client.start_workflow(
                UntypedWorkflow::new(PAYOUT_WORKFLOW_TYPE),
                RawValue::new(vec![payload]),
                options,
            ),
        )
        .await
        .map_err(|_| err(format!("no answer within {TEMPORAL_CALL_TIMEOUT:?}")))?;
        match started {
            Ok(_) => Ok(true),
            Err(WorkflowStartError::AlreadyStarted { .. }) => Ok(false),
            Err(e) => Err(err(e.to_string())),
        }
    }
}

/// The run on a payout's workflow id while it runs.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct RunningExecution {
    pub workflow_type: String,
    pub task_queue: String,
    pub run_id: String,
    /// The worker identities of the run's started attempts to take its account's key.
    pub acquiring_on: Vec<String>,
}

/// One stranded payout handled (or deliberately left alone).
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct Resumption {
    pub payout_id: String,
    pub account_id: String,
    pub state: String,
    /// What Temporal said about `payout-{id}` before.
    pub workflow: String,
    /// RESUMED, ALREADY_RUNNING (a start raced ours), SQUATTER_TERMINATED (a foreign run on
    /// the payout's id, terminated; the payout's RESUMED follows), or ERROR.
    pub action: String,
    /// The account's key, if it was taken over from a grant whose workflow is not running.
    pub took_over_from: Option<String>,
    pub detail: String,
}

/// Where the corrective part's collaborators are.
#[derive(Debug, Clone)]
pub struct ResumeConfig {
    pub lock_url: String,
    /// The resolver's certificate (role `reconciler`, which may force-revoke a key whose
    /// workflow is gone).
    pub tls: mtls::Tls,
    pub temporal: TemporalConfig,
    /// A PENDING payout whose workflow start paydb has not yet recorded as delivered is left
    /// alone this long after the start was staged (with the payout, in one commit): the starter
    /// is about to deliver it. A start paydb records as delivered gets no grace: the workflow
    /// existed, so Temporal not knowing it means Temporal lost it.
    pub not_started_grace: Duration,
    /// How much one full pass may do (`crate::walk`): the keeper's short pass has its own bound.
    pub bounds: crate::walk::PassBounds,
    /// Where its lock client appends its history (`lock_client::history`: the takeovers'
    /// force-revokes), if anywhere.
    pub lock_history: Option<std::path::PathBuf>,
}

/// The full pass's candidates, a page at a time from the walk's cursor (`crate::walk`): every
/// open payout, oldest first. Whether its not-started grace has passed is decided by paydb's own
/// record, never by when a pass first saw the payout, so one pass after Temporal lost its state
/// resumes them all: passed once the payout's workflow start is delivered
/// (`workflow_start.started_at`), otherwise once the start was staged (or, for a payout without
/// a staged start, created) longer than the grace ago, by paydb's clock (the row carries that
/// age; the grace is compared in [`StrandedRow::candidate`]).
const STRANDED_SQL: &str = concat!(
    "SELECT p.created_at, p.id, p.account_id, p.state, s.started_at IS NOT NULL, \
            (EXTRACT(EPOCH FROM (now() - COALESCE(s.staged_at, p.created_at))) * 1000)::bigint \
     FROM payout p LEFT JOIN workflow_start s ON s.payout_id = p.id \
     WHERE p.state IN ('PENDING', 'CLAIMED', 'RAIL_SUBMITTED', 'RAIL_ACKED', 'RAIL_AMBIGUOUS')",
    crate::walk::keyset!()
);

/// Accounts a payout of which waits behind another (two or more open payouts) or which have a
/// payout in flight (it holds the account by the one-in-flight rule), oldest first: where a
/// holder whose workflow is gone blocks someone. Read through the non-terminal payouts' partial
/// index, bounded by the payouts open, never every payout ever made.
const BLOCKING_ACCOUNTS_SQL: &str = "\
    SELECT account_id FROM payout \
    WHERE state IN ('PENDING', 'CLAIMED', 'RAIL_SUBMITTED', 'RAIL_ACKED', 'RAIL_AMBIGUOUS') \
    GROUP BY account_id HAVING count(*) > 1 OR bool_or(state <> 'PENDING') \
    ORDER BY min(created_at), account_id LIMIT $1";

/// The payouts in flight of those accounts (at most one each, by paydb's unique index): each
/// was claimed under a grant, so it had a workflow and needs no grace.
const IN_FLIGHT_OF_SQL: &str = "\
    SELECT id, account_id, state, true FROM payout \
    WHERE account_id = ANY($1) \
      AND state IN ('CLAIMED', 'RAIL_SUBMITTED', 'RAIL_ACKED', 'RAIL_AMBIGUOUS') \
    ORDER BY account_id, created_at, id";

/// Accounts the short holder pass looks at, per pass: a lock describe each (and a Temporal
/// describe per held key and per payout in flight), every keeper interval; accounts beyond it
/// wait for the full pass, which sees every stranded payout anyway.
pub const BLOCKING_ACCOUNTS_PER_PASS_MAX: i64 = 200;

/// Describe errors in a row after which a pass ends with an error: one payout's failed describe
/// is skipped (reported, counted), but five in a row is Temporal failing, and each further one
/// could cost [`TEMPORAL_CALL_TIMEOUT`], so the pass stops rather than outlive its run.
pub const CONSECUTIVE_DESCRIBE_ERRORS_MAX: usize = 5;

/// A candidate payout: id, account, state, and whether its not-started grace has passed.
type Candidate = (String, String, String, bool);

/// One row of [`STRANDED_SQL`]: created_at, id, account, state, whether its workflow start was
/// delivered, and how long ago its start was staged (ms, paydb's clock).
#[derive(sqlx::FromRow)]
struct StrandedRow(
    sqlx::types::chrono::DateTime<sqlx::types::chrono::Utc>,
    String,
    String,
    String,
    bool,
    i64,
);

impl crate::walk::Positioned for StrandedRow {
    fn position(&self) -> crate::walk::Position {
        (self.0, self.1.clone())
    }
}

impl StrandedRow {
    fn candidate(self, grace: Duration) -> Candidate {
        let grace_ms = i64::try_from(grace.as_millis()).unwrap_or(i64::MAX);
        let past_grace = self.4 || self.5 > grace_ms;
        (self.1, self.2, self.3, past_grace)
    }
}

/// Test-only (feature `test-seams`, which no shipped package enables): a hook a pass awaits
/// between its read of a payout in flight and the describe of that payout's workflow, where a
/// test finishes the payout so that the pass must re-read it (`tests/resume_reread.rs`).
#[cfg(feature = "test-seams")]
pub mod seams {
    use std::future::Future;
    use std::pin::Pin;
    use std::sync::{Arc, Mutex};

    /// Called with the payout's id; the pass waits for its future.
    pub type Hook = Arc<dyn Fn(String) -> Pin<Box<dyn Future<Output = ()> + Send>> + Send + Sync>;

    static BEFORE_DESCRIBE: Mutex<Option<Hook>> = Mutex::new(None);

    /// Sets (or, with `None`, clears) the hook for every pass of this process.
    pub fn set_before_describe(hook: Option<Hook>) {
        *BEFORE_DESCRIBE.lock().unwrap_or_else(|e| e.into_inner()) = hook;
    }

    static SQUAT_DETECTION_OFF: std::sync::atomic::AtomicBool =
        std::sync::atomic::AtomicBool::new(false);

    /// The negative control of the squatter check: `false` makes every pass of this process
    /// take any running execution on a payout's id for the payout's own workflow (as before the
    /// check), `true` restores the check.
    pub fn set_squat_detection(on: bool) {
        SQUAT_DETECTION_OFF.store(!on, std::sync::atomic::Ordering::SeqCst);
    }

    pub(crate) fn squat_detection() -> bool {
        !SQUAT_DETECTION_OFF.load(std::sync::atomic::Ordering::SeqCst)
    }

    pub(crate) async fn before_describe(payout_id: &str) {
        let hook = BEFORE_DESCRIBE
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        if let Some(hook) = hook {
            hook(payout_id.to_string()).await;
        }
    }
}

/// What one pass did, and how far its walk went.
#[derive(Debug, Clone, Default)]
pub struct Pass<T> {
    pub done: Vec<T>,
    pub progress: crate::walk::Progress,
}

/// The full pass: from where the last pass of this process stopped (`cursor`, moved on here),
/// the open payouts are examined oldest first, wrapping once (`crate::walk`), until
/// `config.bounds.per_pass` candidates were handled or `examine_max` payouts examined. For each,
/// its account's key is first taken over from any grant whose payout's workflow is not running
/// (nobody would ever release it; the account's running payouts wait on it for ever
/// otherwise); then a payout in PENDING, CLAIMED, RAIL_SUBMITTED, RAIL_ACKED or RAIL_AMBIGUOUS
/// whose workflow is not running is handed back to a new workflow run. A payout whose workflow
/// runs is examined and skipped: it takes no place in the bound. A payout whose workflow cannot
/// be described is skipped (reported as ERROR, logged) and the pass goes on. When the orphan
/// resolver runs in the same pass, it runs first (`reconciler-service`'s `run_once`): what it
/// resolves with evidence is no longer a candidate here, and what it could not (UNKNOWN, its
/// account's key busy) is resumed, so the run keeps asking; a payout resumed earlier has a
/// running workflow, which the resolver leaves alone.
pub async fn resume_stranded(
    paydb: &PgPool,
    config: &ResumeConfig,
    cursor: &mut crate::walk::Cursor,
) -> Result<Pass<Resumption>, ResumeError> {
    let mut walk = crate::walk::Walk::<StrandedRow>::new(paydb, STRANDED_SQL, cursor);
    let mut resumer: Option<Resumer> = None;
    let mut handled = 0;
    let outcome = async {
        while handled < config.bounds.per_pass && walk.examined() < config.bounds.examine_max {
            let Some(row) = walk.next().await? else {
                break;
            };
            // Connected at the first open payout: a pass with none asks nobody.
            if resumer.is_none() {
                resumer = Some(Resumer::connect(paydb, config).await?);
            }
            let Some(resumer) = resumer.as_mut() else {
                continue;
            };
            let (id, account, state, past_grace) = row.candidate(config.not_started_grace);
            resumer.account(&account).await;
            if resumer.payout((id, account, state, past_grace)).await? {
                handled += 1;
            }
        }
        Ok::<_, ResumeError>(())
    }
    .await;
    let progress = walk.stop(cursor);
    outcome?;
    tracing::info!(
        examined = progress.examined,
        handled,
        wrapped = progress.wrapped,
        complete = progress.complete,
        "resume pass walked the open payouts"
    );
    Ok(Pass {
        done: resumer.map(Resumer::finish).unwrap_or_default(),
        progress,
    })
}

/// The short pass against a holder whose workflow is gone (an operator's `temporal workflow
/// terminate` of a payout holding its account's key): on every account where someone waits or
/// a payout is in flight, the key is taken over from a grant whose workflow is not running, and
/// the account's payout in flight is handed back to a new workflow run if its workflow is not
/// running; so the payouts behind it go on within one keeper interval, not at the next full
/// pass. It reads only open payouts and describes only those accounts' keys, so it is cheap
/// enough to run every few seconds; PENDING payouts are left to the full pass (a PENDING holder
/// whose grant is taken over blocks nobody).
pub async fn resume_blocked_accounts(
    paydb: &PgPool,
    config: &ResumeConfig,
) -> Result<Vec<Resumption>, ResumeError> {
    let accounts: Vec<String> = sqlx::query_scalar(BLOCKING_ACCOUNTS_SQL)
        .bind(BLOCKING_ACCOUNTS_PER_PASS_MAX)
        .fetch_all(paydb)
        .await?;
    if accounts.is_empty() {
        return Ok(Vec::new());
    }
    let rows: Vec<Candidate> = sqlx::query_as(IN_FLIGHT_OF_SQL)
        .bind(&accounts)
        .fetch_all(paydb)
        .await?;
    let mut resumer = Resumer::connect(paydb, config).await?;
    for account in &accounts {
        resumer.account(account).await;
    }
    for row in rows {
        resumer.payout(row).await?;
    }
    Ok(resumer.finish())
}

/// Whether passes tell squatters apart: always, but in a test that switched it off
/// (`seams::set_squat_detection`, feature `test-seams`).
fn squat_detection() -> bool {
    #[cfg(feature = "test-seams")]
    return seams::squat_detection();
    #[cfg(not(feature = "test-seams"))]
    true
}

/// One pass's work on the payouts it examines: each account's key taken over (once per pass)
/// from a grant whose workflow is not running, each payout whose workflow is not running (or,
/// past its grace, never existed) handed to a new run.
struct Resumer<'a> {
    paydb: &'a PgPool,
    temporal: Temporal,
    lock: LockClient,
    /// Accounts whose key this pass looked at.
    looked_at: std::collections::BTreeSet<String>,
    /// Takeovers not yet reported with a stranded payout of their account (reported at the end).
    unreported: std::collections::BTreeMap<String, Option<String>>,
    /// Accounts whose takeover failed: their stranded payouts are not resumed this pass (they
    /// would only queue behind a grant nobody releases).
    failed: std::collections::BTreeMap<String, String>,
    consecutive_describe_errors: usize,
    out: Vec<Resumption>,
}

impl<'a> Resumer<'a> {
    async fn connect(paydb: &'a PgPool, config: &ResumeConfig) -> Result<Self, ResumeError> {
        let temporal = Temporal::connect(&config.temporal).await?;
        let lock = LockClient::connect(&config.lock_url, &config.tls)
            .await
            .map_err(|e| ResumeError::Connect {
                service: "lock-server",
                detail: e.to_string(),
            })?;
        let lock = crate::with_lock_history(lock, config.lock_history.as_deref());
        Ok(Self {
            paydb,
            temporal,
            lock,
            looked_at: Default::default(),
            unreported: Default::default(),
            failed: Default::default(),
            consecutive_describe_errors: 0,
            out: Vec::new(),
        })
    }

    /// Takes the account's key over from a grant whose workflow is not running, once per pass.
    async fn account(&mut self, account: &str) {
        if !self.looked_at.insert(account.to_string()) {
            return;
        }
        match take_over_orphaned_grant(&self.lock, &self.temporal, account).await {
            Ok(from) => {
                self.unreported.insert(account.to_string(), from);
            }
            Err(detail) => {
                self.failed.insert(account.to_string(), detail);
            }
        }
    }

    /// Hands the payout to a new run if its workflow is not running. Whether it was a candidate
    /// (its workflow not running, or not describable): what a pass's bound counts.
    async fn payout(&mut self, row: Candidate) -> Result<bool, ResumeError> {
        let (id, account, state, past_grace) = row;
        // RAIL_AMBIGUOUS too: the resumed run only asks the rail (see the module's table). It
        // and the orphan resolver never act at once: each acts only under the account's key,
        // so they take turns, and the guards fence whichever of them holds an older token; the
        // resolver acts only on a payout whose workflow is not running, and re-reads the state
        // under its grant, so it leaves alone what a resumed run has already resolved.
        let Ok(payout_id) = PayoutId::parse(id.clone()) else {
            tracing::error!(payout_id = %id, "unparseable payout id in paydb; skipped");
            return Ok(false);
        };
        let mut r = Resumption {
            payout_id: payout_id.to_string(),
            account_id: account.clone(),
            state,
            workflow: String::new(),
            action: String::new(),
            took_over_from: None,
            detail: String::new(),
        };
        #[cfg(feature = "test-seams")]
        seams::before_describe(payout_id.as_str()).await;
        let workflow_id = payout_domain::workflow_id(&payout_id);
        let (status, running) = match self.temporal.execution(&workflow_id).await {
            Ok(described) => {
                self.consecutive_describe_errors = 0;
                described
            }
            Err(e) => {
                // This payout is skipped, reported and counted; the pass goes on, unless
                // Temporal keeps failing.
                self.consecutive_describe_errors += 1;
                if self.consecutive_describe_errors >= CONSECUTIVE_DESCRIBE_ERRORS_MAX {
                    return Err(e);
                }
                tracing::warn!(payout_id = %r.payout_id, error = %e, "could not describe the payout's workflow: skipped this pass");
                r.workflow = UNDESCRIBED.into();
                r.action = "ERROR".into();
                r.detail = e.to_string();
                self.out.push(r);
                return Ok(true);
            }
        };
        r.workflow = status.name();
        let squatter = running
            .as_ref()
            .filter(|_| squat_detection())
            .and_then(|run| Some((run, self.temporal.squatter(run)?)));
        let stranded = match (&status, &squatter) {
            (WorkflowStatus::Running, None) => false,
            (WorkflowStatus::Running, Some(_)) => true,
            (WorkflowStatus::NotFound, _) => past_grace,
            (WorkflowStatus::Closed(_), _) => true,
            // Only `holder_status` says this; a payout's own run is judged by `execution`.
            (WorkflowStatus::RunningWithoutTheGrant, _) => false,
        };
        if !stranded {
            return Ok(false);
        }
        if let Some((run, why)) = squatter {
            // Someone else's workflow holds the payout's id (started before the starter
            // delivered, which then found the id taken, or after a run closed): while it runs,
            // no payout workflow can start there and the payout waits for ever. That run, and
            // only that run, is terminated; the payout is then resumed like a closed run's.
            let reason = format!("foreign workflow squatting {workflow_id} ({why})");
            let terminated = self
                .temporal
                .terminate_run(&workflow_id, &run.run_id, reason.clone())
                .await;
            let mut squat = r.clone();
            squat.action = SQUATTER_TERMINATED.into();
            squat.detail = match &terminated {
                Ok(()) => format!("run {}: {reason}", run.run_id),
                Err(e) => e.to_string(),
            };
            tracing::error!(
                event = "payout_workflow_squatted",
                alert = true,
                payout_id = %r.payout_id,
                account_id = %r.account_id,
                workflow_id = %workflow_id,
                run_id = %run.run_id,
                workflow_type = %run.workflow_type,
                task_queue = %run.task_queue,
                terminated = terminated.is_ok(),
                "a foreign workflow squatted the payout's workflow id: terminated, the payout is resumed"
            );
            self.out.push(squat);
            if let Err(e) = terminated {
                r.action = "ERROR".into();
                r.detail = e.to_string();
                self.out.push(r);
                return Ok(true);
            }
        }
        // The payout was read in flight before its workflow was described: on a busy system it
        // may have finished in between (its workflow completes after its last transition). Only
        // a payout still in flight now, after the workflow was seen ended, is stranded; read
        // before, a batch's finishing payouts were "resumed" by the dozen (a new run that found
        // them terminal), each logged as stranded.
        let now: Option<String> = sqlx::query_scalar("SELECT state FROM payout WHERE id = $1")
            .bind(payout_id.as_str())
            .fetch_optional(self.paydb)
            .await?;
        if now
            .as_deref()
            .is_none_or(|s| PayoutState::parse(s).is_some_and(|state| state.is_terminal()))
        {
            return Ok(false);
        }
        // The account's takeover is reported with its first stranded payout.
        if let Some(detail) = self.failed.get(&account) {
            // The key may still be held by a grant nobody releases: resuming now would only
            // queue behind it. The next pass tries again.
            r.action = "ERROR".into();
            r.detail = detail.clone();
            self.out.push(r);
            return Ok(true);
        }
        if let Some(from) = self.unreported.remove(&account) {
            r.took_over_from = from;
        }
        match self.temporal.resume(&payout_id, &account).await {
            Ok(true) => r.action = "RESUMED".into(),
            Ok(false) => r.action = "ALREADY_RUNNING".into(),
            Err(e) => {
                r.action = "ERROR".into();
                r.detail = e.to_string();
            }
        }
        tracing::warn!(
            payout_id = %r.payout_id,
            account_id = %r.account_id,
            state = %r.state,
            workflow = %r.workflow,
            action = %r.action,
            took_over_from = ?r.took_over_from,
            detail = %r.detail,
            "stranded payout handed back to a workflow"
        );
        self.out.push(r);
        Ok(true)
    }

    /// What the pass did: its payouts, then the keys taken over on accounts with no stranded
    /// payout (their payouts' workflows run and were waiting on the orphaned grant), and the
    /// takeovers that failed on accounts with none.
    fn finish(mut self) -> Vec<Resumption> {
        let reported: std::collections::BTreeSet<String> = self
            .out
            .iter()
            .filter(|r| r.action == "ERROR")
            .map(|r| r.account_id.clone())
            .collect();
        let took_over = self
            .unreported
            .into_iter()
            .filter_map(|(account, from)| Some((account, "TOOK_OVER", Some(from?), String::new())));
        let failed = self
            .failed
            .into_iter()
            .filter(|(account, _)| !reported.contains(account))
            .map(|(account, detail)| (account, "ERROR", None, detail));
        let mut rest: Vec<_> = took_over.chain(failed).collect();
        rest.sort_by(|a, b| a.0.cmp(&b.0));
        for (account, action, took_over_from, detail) in rest {
            self.out.push(Resumption {
                payout_id: String::new(),
                account_id: account,
                state: String::new(),
                workflow: String::new(),
                action: action.into(),
                took_over_from,
                detail,
            });
        }
        self.out
    }
}

/// Frees `payout:{account}` if it is held by a grant whose payout's workflow is not running
/// (its owner is `{process}/{payout_id}`): nobody will ever release it. Returns the owner it was
/// taken from. A grant of a running workflow, or of an owner this cannot read, is left alone.
async fn take_over_orphaned_grant(
    lock: &LockClient,
    temporal: &Temporal,
    account: &str,
) -> Result<Option<String>, String> {
    take_over_if_not_running(lock, account, |workflow_id, holder_process| async move {
        temporal.holder_status(&workflow_id, &holder_process).await
    })
    .await
}

/// [`take_over_orphaned_grant`] with the holder's workflow asked of `workflow_status` (given
/// the workflow id and the process whose session holds the grant): Temporal in production; a test's stand-in that lets another payout take
/// the key between the describe and the revoke. Only the grant described is revoked (its token
/// is the revoke's expectation); a key that changed holder meanwhile is left alone.
pub async fn take_over_if_not_running<F, Fut>(
    lock: &LockClient,
    account: &str,
    workflow_status: F,
) -> Result<Option<String>, String>
where
    F: FnOnce(String, String) -> Fut,
    Fut: std::future::Future<Output = Result<WorkflowStatus, ResumeError>>,
{
    take_over_if_not_running_as(lock, account, RECOVERER, workflow_status).await
}

/// [`take_over_if_not_running`], the force-revoke recorded under `revoker` (the name the
/// caller's certificate carries: an operator's `payoutctl payout abandon` of a payout whose
/// workflow is not running takes the key over as itself).
pub async fn take_over_if_not_running_as<F, Fut>(
    lock: &LockClient,
    account: &str,
    revoker: &str,
    workflow_status: F,
) -> Result<Option<String>, String>
where
    F: FnOnce(String, String) -> Fut,
    Fut: std::future::Future<Output = Result<WorkflowStatus, ResumeError>>,
{
    let key = format!("payout:{account}");
    let held = lock
        .describe(&key)
        .await
        .map_err(|e| format!("describing {key}: {e}"))?;
    if !held.held {
        return Ok(None);
    }
    // Only a payout workflow's grant (`worker-N/{payout}`); the reconciler's own resolver
    // (`reconciler/{payout}`) holds its grants for one bounded resolution and releases them.
    let Some((holder_process, holder_payout)) = held
        .holder_owner
        .rsplit_once('/')
        .filter(|(process, _)| *process != crate::resolve::RESOLVER)
        .and_then(|(process, p)| Some((process.to_string(), PayoutId::parse(p.to_string()).ok()?)))
    else {
        return Ok(None);
    };
    let status = workflow_status(payout_domain::workflow_id(&holder_payout), holder_process)
        .await
        .map_err(|e| e.to_string())?;
    if status == WorkflowStatus::Running {
        return Ok(None);
    }
    let reason = format!(
        "the grant's workflow payout-{holder_payout} is {}: nobody will release it; taken over to resume the account's payouts",
        status.name()
    );
    // Only the grant described and checked above is taken: the lock service compares its token
    // in the backend's transaction with the revoke, so a payout that took the key since is
    // never deposed.
    let described = lock_client::FencingToken::new(held.token)
        .map_err(|e| format!("describing {key}: the holder's token: {e}"))?;
    match lock.force_revoke(&key, described, revoker, &reason).await {
        Ok(r) => {
            tracing::warn!(key, revoked_owner = %r.revoked_owner, revoked_token = r.revoked_token, reason, "orphaned grant taken over");
            Ok(Some(r.revoked_owner))
        }
        Err(e) => match e.rejection() {
            // Released or expired meanwhile: nothing to take over.
            Some(lock_client::Rejection::NotHeld(_)) => Ok(None),
            // Another grant took the key after it was described: it is not the one whose
            // workflow was checked, so nothing is taken this pass (the next pass describes it
            // afresh). Expected, so not an error and nothing pages.
            Some(lock_client::Rejection::HolderChanged(changed)) => {
                tracing::info!(
                    key,
                    holder_owner = %held.holder_owner,
                    expected_token = changed.expected_token,
                    current_token = changed.current_token,
                    "the key changed holder after it was described: nothing taken over this pass"
                );
                Ok(None)
            }
            _ => Err(format!("taking over {key}: {e}")),
        },
    }
}
