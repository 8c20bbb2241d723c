//! `PayoutWorkflow`: one durable workflow per payout (id `payout-{payout_id}`).
//!
//! The workflow is a loop driven by the state the payment resource reports: each step is one
//! fenced activity whose answer is the payout's new state. Losing the grant (the client's
//! deadline passed, or a guard fenced us out) means: acquire a new grant (a higher token), read
//! the payout, continue from there (the recovery re-claim of spec 2.3). Temporal's history is
//! diagnostic only: the guards and the proxy's uniqueness make a replayed or duplicated step
//! harmless.

use std::cell::Cell;
use std::collections::{BTreeMap, VecDeque};
use std::time::{Duration, SystemTime};

use payout_activities::refusal::Refusal;
use payout_activities::types::*;
use payout_activities::PayoutActivities;
use payout_domain::{ClientReference, FencingToken, PayoutId, PayoutState};
use serde::{Deserialize, Serialize};
use temporalio_common::data_converters::TemporalDeserializable;
use temporalio_common::error::TimeoutType;
use temporalio_common::search_attributes::SearchAttributeKey;
use temporalio_common::ActivityDefinition;
use temporalio_macros::{workflow, workflow_methods};
use temporalio_sdk::{
    ActivityExecutionError, ActivityOptions, ApplicationFailure, SyncWorkflowContext, TimerOptions,
    WorkflowContext, WorkflowContextView, WorkflowResult,
};

use crate::details::{self, step_summary, utc};
use crate::options;

/// Keyword search attributes registered at server start (temporal/search-attributes).
pub const PAYOUT_STATE: SearchAttributeKey<String> = SearchAttributeKey::keyword("PayoutState");
pub const ACCOUNT_ID: SearchAttributeKey<String> = SearchAttributeKey::keyword("AccountId");

/// Histories from before the queued acquire: while the key was held by another payout of the
/// account, the workflow asked again after this long.
pub const LOCK_RETRY_INTERVAL: Duration = Duration::from_secs(2);
/// While another payout of the account is in flight (AccountBusy at claim), ask again after this
/// long, holding no grant meanwhile. Longer than the lock retry: the other payout first has to
/// get its own grant back.
pub const ACCOUNT_BUSY_RETRY_INTERVAL: Duration = Duration::from_secs(3);
/// A refused transition means another step got there first; we re-read and continue. More than
/// this many in a row means the workflow and the resource disagree: stop loudly.
pub const CONSECUTIVE_REFUSALS_MAX: u32 = 3;
/// Each lost grant produces a higher token and a re-read; this many in one run is a livelock
/// (or a lock service in trouble), which an operator must look at.
pub const GRANT_LOSSES_MAX: u32 = 20;
/// After the resolution SLA, the rail is still asked, at a doubling interval up to this ceiling,
/// so that a workflow waiting for an operator does not grow its history without bound.
pub const POST_SLA_INQUIRY_INTERVAL_MAX: Duration = Duration::from_secs(3_600);

/// The operator's `abandon` signal: `temporal workflow signal --name abandon --input "$(payoutctl
/// sign abandon --payout-id ID --reason '...' --operator alice --key-file alice.key)"`, which is
/// `{"operator":"alice","reason":"...","signed_at_unix_ms":...,"signature":"<hex>"}`. A missing
/// field decodes as empty and is refused (and recorded as refused) by the workflow: operator
/// input never fails a payout. The signature is verified by the payment resource against the
/// registered operator keys, not here: an unsigned or badly signed abandon is recorded as refused
/// and never carried out.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AbandonSignal {
    #[serde(default)]
    pub operator: String,
    #[serde(default)]
    pub reason: String,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub signature: String,
    #[serde(default, skip_serializing_if = "is_zero")]
    pub signed_at_unix_ms: u64,
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

impl AbandonSignal {
    /// The signature as the activities carry it, if the signal had one.
    pub fn operator_signature(&self) -> Option<OperatorSignatureInput> {
        (!self.signature.is_empty()).then(|| OperatorSignatureInput {
            signature: self.signature.clone(),
            signed_at_unix_ms: self.signed_at_unix_ms,
        })
    }
}

/// The answer of the `abandon` Update (`temporal workflow update execute --name abandon
/// --workflow-id payout-ID --input "$(payoutctl sign abandon ...)"`), given once the request has
/// been decided and that decision written to the payment resource's audit trail. A request the
/// workflow can turn down without asking anyone (it does not parse, has no operator or reason, the
/// payout is terminal or in a state where the spec never allows an abandon, another abandon is
/// being carried out) is not answered with this: the Update is rejected by its validator, with
/// the reason as the failure message, and nothing is recorded.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AbandonAnswer {
    pub payout_id: String,
    /// What became of the request.
    pub outcome: AbandonOutcome,
    /// `outcome` is not `refused`: the decision stands in the payment resource's audit trail as
    /// accepted.
    pub accepted: bool,
    /// Who had the last word: the workflow (its own checks, e.g. the resolution SLA by its
    /// clock) or the payment resource (operator signature, its own SLA record, the payout's
    /// state under the fence).
    pub decided_by: AbandonDecider,
    /// Why, in words: the rule applied, or the payment resource's refusal as it gave it.
    pub reason: String,
    /// The payout's state when the answer was given.
    pub state: PayoutState,
}

/// What became of an `abandon` Update.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AbandonOutcome {
    /// Carried out: the payment resource moved the payout to ABANDONED.
    Abandoned,
    /// Accepted and on record, to be carried out as soon as the payout holds its account's key
    /// (it waits behind another payout of the account). The `status` query and the audit trail
    /// show what became of it; if the payout has moved on by then it is withdrawn on record.
    AcceptedWaitingForLock,
    /// Not carried out, on record with `reason`; the payout goes on.
    Refused,
}

/// Who decided an `abandon` Update.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AbandonDecider {
    Workflow,
    PaymentResource,
}

/// An operator name longer than this is refused: it is an identity, not a message.
pub const OPERATOR_LENGTH_MAX: usize = 200;
/// A reason longer than this is refused; the payment resource stores at most 1024 bytes of text.
pub const REASON_LENGTH_MAX: usize = 1_000;
/// Recorded in place of a missing operator or reason, so that the refusal itself is on record.
const MISSING: &str = "(missing)";

impl AbandonSignal {
    /// Why the request cannot be decided on its merits, if it cannot.
    pub fn problem(&self) -> Option<String> {
        let (operator, reason) = (self.operator.trim(), self.reason.trim());
        if operator.is_empty() {
            Some("refused: the operator is missing".into())
        } else if reason.is_empty() {
            Some("refused: the reason is missing".into())
        } else if operator.chars().count() > OPERATOR_LENGTH_MAX {
            Some(format!(
                "refused: the operator is longer than {OPERATOR_LENGTH_MAX} characters"
            ))
        } else if reason.chars().count() > REASON_LENGTH_MAX {
            Some(format!(
                "refused: the reason is longer than {REASON_LENGTH_MAX} characters"
            ))
        } else {
            None
        }
    }
}

/// `text` as it can be recorded: trimmed, cut to `max` characters, or [`MISSING`].
fn recordable(text: &str, max: usize) -> String {
    let text = text.trim();
    if text.is_empty() {
        return MISSING.to_string();
    }
    text.chars().take(max).collect()
}

/// The `status` query's answer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PayoutStatus {
    pub payout_id: String,
    pub state: PayoutState,
    pub token: Option<FencingToken>,
    pub claimer: String,
    pub last_event: String,
    pub resolution_sla_passed: bool,
}

/// The workflow's result.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PayoutResult {
    pub payout_id: PayoutId,
    pub state: PayoutState,
    pub token: Option<FencingToken>,
    pub rail_ref: String,
    pub failure_reason: String,
}

#[workflow]
#[derive(Default)]
pub struct PayoutWorkflow {
    payout_id: String,
    state: Option<PayoutState>,
    token: Option<FencingToken>,
    claimer: String,
    last_event: String,
    resolution_sla_passed: bool,
    abandon_requests: VecDeque<AbandonRequest>,
    /// An accepted abandon and the state it was accepted in: it is carried out only in that
    /// state, and withdrawn (on record) the moment the payout is seen elsewhere.
    abandon_accepted: Option<AcceptedAbandon>,
    /// The last ticket handed to an `abandon` Update.
    abandon_tickets_issued: u64,
    /// The open `abandon` Updates by ticket, with their answer once there is one (each removed
    /// by its handler as it answers).
    abandon_answers: BTreeMap<u64, Option<AbandonAnswer>>,
    /// The run waits in its account's line for the key (nothing else can happen meanwhile).
    waiting_for_lock: bool,
    /// What the run waits for, when it is more than its state says (the UI's current details).
    waiting_for: Option<String>,
    /// Who held the account's key when the run last found it taken.
    lock_holder: Option<String>,
    /// The recorded instruction in a line (amount, account, beneficiary, client reference).
    pays: String,
}

/// An operator's abandon as queued for the run loop: from the signal, or from the Update with
/// the ticket its handler waits on.
#[derive(Debug, Clone)]
struct AbandonRequest {
    signal: AbandonSignal,
    ticket: Option<u64>,
}

/// An abandon accepted on record, to be carried out in `state`.
#[derive(Debug, Clone)]
struct AcceptedAbandon {
    request: AbandonRequest,
    state: PayoutState,
    /// Why it was accepted (the rule that allowed it).
    note: String,
}

/// What a run works from: the payout and its recorded instruction (never the start input's
/// description of it), and the ambiguity clocks.
struct PayoutRun {
    payout_id: PayoutId,
    instruction: Instruction,
    ambiguity: AmbiguityPolicy,
    /// Steps run as local activities ([`LOCAL_STEPS_PATCH`]) while this holds; a local step that
    /// gives up for want of a service turns it off for the rest of the run (see [`call`]).
    local: Cell<bool>,
    /// The run began with local steps: the rule that it submits only a payout it marked under
    /// its own grant holds for the whole run, whatever shape its later steps take.
    started_local: bool,
}

/// How a step ended when it did not produce a new snapshot.
enum StepError {
    /// Our grant can no longer be vouched for, or a guard holds a later token.
    GrantLost(Refusal),
    /// Another step got there first; re-read the payout.
    Refused(Refusal),
    /// Another payout of the account is in flight (its holder lost the grant and this payout
    /// took the key in between): give the key back so that payout can finish first.
    AccountBusy(Refusal),
    /// The payment resource refused to carry out an accepted abandon (the payout moved on, or
    /// its resolution SLA has not passed by the resource's own record): the abandon is
    /// withdrawn and the payout goes on. An answer, not a failure.
    AbandonRefused(Refusal),
    /// Anything else: the workflow stops (the activity already retried by its policy).
    Fatal(Box<ActivityExecutionError>),
}

/// A fenced activity that timed out waiting in its grant's worker queue: that worker is gone or
/// frozen, so nobody can vouch for the grant any more. Nothing ran under it.
fn never_started(error: &ActivityExecutionError) -> bool {
    error
        .as_timeout()
        .is_some_and(|t| t.timeout_type() == TimeoutType::ScheduleToStart)
}

fn worker_gone(grant: &Grant) -> Refusal {
    Refusal::GrantLost {
        key: grant.key.clone(),
        token: grant.token.get(),
        reason: format!("no worker picked the task up from {}", grant.task_queue),
    }
}

fn classify(error: ActivityExecutionError, grant: &Grant) -> StepError {
    if never_started(&error) {
        return StepError::GrantLost(worker_gone(grant));
    }
    match Refusal::from_failure(&error) {
        Some(r @ (Refusal::GrantLost { .. } | Refusal::FencedOut { .. })) => {
            StepError::GrantLost(r)
        }
        Some(r @ Refusal::RefusedTransition { .. }) => StepError::Refused(r),
        Some(r @ Refusal::AccountBusy { .. }) => StepError::AccountBusy(r),
        _ => StepError::Fatal(Box::new(error)),
    }
}

/// Per-run local facts that are not the payout's state.
#[derive(Default)]
struct RunFacts {
    grant: Option<Grant>,
    /// Set before the submission activity is scheduled: from then on, this run never submits.
    proxy_called: bool,
    /// The token under which this run's own MarkSubmitted was answered. With local steps, a run
    /// submits only a payout it marked under the grant it holds: a local step re-run after its
    /// workflow task was lost with its worker leaves no trace in the history, so a payout found
    /// RAIL_SUBMITTED any other way (a lost workflow task, an earlier run, a grant lost since) is
    /// "maybe sent" (spec 2.3: a later holder finds no recorded outcome) and resolved by inquiry.
    marked_under: Option<FencingToken>,
    /// The payment resource's signed instruction from this run's MarkSubmitted answer, for the
    /// submission (issue 33): the rail proxy sends nothing without it.
    signed_instruction: Option<SignedInstruction>,
    /// What the single submission answered (or the existing record, on DUPLICATE).
    known_outcome: Option<RailOutcome>,
    ambiguous_since: Option<SystemTime>,
    inquiry_interval: Option<Duration>,
    /// The token of the last grant a fenced step of this run used: the worker that made a grant
    /// hands it back if no fenced call uses it within a minute ([`INQUIRE_FIRST_PATCH`]).
    used_under: Option<FencingToken>,
}

#[workflow_methods]
impl PayoutWorkflow {
    #[run(name = "PayoutWorkflow")]
    pub async fn run(
        ctx: &mut WorkflowContext<Self>,
        input: PayoutStartInput,
    ) -> WorkflowResult<PayoutResult> {
        let start = match PayoutStart::parse(&input) {
            Ok(start) => start,
            Err(e) => {
                ctx.state_mut(|s| s.last_event = format!("INVALID_INPUT: {e}"));
                return Err(fatal("InvalidInput", e.to_string()).into());
            }
        };
        ctx.state_mut(|s| s.payout_id = start.payout_id.to_string());
        let started_local = ctx.patched(LOCAL_STEPS_PATCH);
        let local = Cell::new(started_local);
        let mut facts = RunFacts::default();
        let mut snapshot = call(
            ctx,
            &local,
            || PayoutActivities::get_payout,
            start.payout_id.clone(),
            options::guard_call(),
        )
        .await?;
        // What is paid is what the payment resource recorded; a history from before snapshots
        // carried the record replays with the input's own (then complete) description.
        let Some(instruction) = snapshot
            .instruction
            .clone()
            .or_else(|| start.believed.complete())
        else {
            return Err(fatal(
                "NoInstruction",
                format!(
                    "the payment resource returned no instruction for payout {}",
                    start.payout_id
                ),
            )
            .into());
        };
        if let Some(difference) = start.believed.disagreement(&instruction) {
            ctx.state_mut(|s| s.last_event = format!("INPUT_DISAGREES_WITH_RECORD: {difference}"));
            return Err(fatal(
                "InputDisagreesWithRecord",
                format!(
                    "payout {}: {difference}; nothing was claimed or sent",
                    start.payout_id
                ),
            )
            .into());
        }
        let input = PayoutRun {
            payout_id: start.payout_id.clone(),
            instruction,
            ambiguity: start.ambiguity,
            local,
            started_local,
        };
        observe(ctx, &input, &snapshot, "STARTED");
        if start.resume && snapshot.state == PayoutState::RailSubmitted {
            // A later holder that finds no recorded outcome (spec 2.3): maybe sent. This run
            // never submits it; it records the ambiguity and asks the rail.
            facts.proxy_called = true;
            ctx.state_mut(|s| {
                s.last_event = "RESUMED in RAIL_SUBMITTED: maybe sent, resolved by inquiry".into()
            });
        }
        let mut refusals_in_a_row = 0;
        let mut grant_losses = 0;

        loop {
            process_signals(ctx, &input, &facts).await;
            withdraw_stale_abandon(ctx, &input, &facts, &snapshot).await;
            if snapshot.state.is_terminal() {
                break;
            }
            let grant = match facts.grant.clone() {
                Some(grant) => grant,
                None => {
                    let grant = acquire(ctx, &input, &facts).await?;
                    ctx.state_mut(|s| s.token = Some(grant.token));
                    facts.grant = Some(grant.clone());
                    if grant_losses > 0 {
                        // Continue from the state the resource reports, under the new token.
                        snapshot = read(ctx, &input).await?;
                        observe(ctx, &input, &snapshot, "REACQUIRED");
                        continue;
                    }
                    grant
                }
            };
            let step = step(ctx, &input, &grant, &snapshot, &mut facts).await;
            match step {
                Ok((next, event)) => {
                    if !matches!(event, "SIGNAL_RECEIVED" | "TERMINAL") {
                        // A guard answered a fenced call under the grant: the worker keeps it.
                        facts.used_under = Some(grant.token);
                    }
                    refusals_in_a_row = 0;
                    snapshot = next;
                    observe(ctx, &input, &snapshot, event);
                }
                Err(StepError::GrantLost(refusal)) => {
                    grant_losses += 1;
                    if grant_losses > GRANT_LOSSES_MAX {
                        return Err(fatal("GrantLostTooOften", refusal.to_string()).into());
                    }
                    ctx.state_mut(|s| s.last_event = format!("GRANT_LOST: {refusal}"));
                    if let Some(grant) = facts.grant.take() {
                        if input.local.get() {
                            // The workflow task may have moved away from the process that holds
                            // the grant (its steps now run here): hand it back there, or the new
                            // acquire would wait behind it. Harmless if it is already gone.
                            release_best_effort(ctx, &input, &grant).await;
                        }
                    }
                }
                Err(StepError::Refused(refusal)) => {
                    refusals_in_a_row += 1;
                    if refusals_in_a_row > CONSECUTIVE_REFUSALS_MAX {
                        return Err(
                            fatal("TransitionsKeepBeingRefused", refusal.to_string()).into()
                        );
                    }
                    snapshot = read(ctx, &input).await?;
                    observe(ctx, &input, &snapshot, "REREAD_AFTER_REFUSAL");
                }
                Err(StepError::AbandonRefused(refusal)) => {
                    withdraw_abandon(
                        ctx,
                        &input,
                        &facts,
                        format!("the payment resource refused to carry it out: {refusal}"),
                    )
                    .await;
                    snapshot = read(ctx, &input).await?;
                    observe(ctx, &input, &snapshot, "REREAD_AFTER_ABANDON_REFUSED");
                }
                Err(StepError::AccountBusy(refusal)) => {
                    // Not a failure of this payout: it waits, PENDING and unclaimed, holding
                    // nothing. Releasing lets the in-flight payout's own workflow take the key
                    // back; this one asks again after a durable pause, deciding signals meanwhile.
                    ctx.state_mut(|s| s.last_event = format!("WAITING_FOR_ACCOUNT: {refusal}"));
                    let at = ctx.workflow_time().unwrap_or(SystemTime::UNIX_EPOCH)
                        + ACCOUNT_BUSY_RETRY_INTERVAL;
                    waiting_for(
                        ctx,
                        format!(
                            "another payout of the account to finish (it is in flight); asks \
                             again at {}",
                            utc(at)
                        ),
                    );
                    if let Some(grant) = facts.grant.take() {
                        // A release that cannot run (its worker is gone) is harmless: the
                        // session's lease frees the key.
                        release_best_effort(ctx, &input, &grant).await;
                    }
                    temporalio_sdk::workflows::select! {
                        _ = ctx.timer(timer_for(
                            ACCOUNT_BUSY_RETRY_INTERVAL,
                            "another payout of the account is in flight: ask again",
                        )) => {},
                        _ = ctx.wait_condition(|s| !s.abandon_requests.is_empty()) => {},
                    };
                    snapshot = read(ctx, &input).await?;
                }
                Err(StepError::Fatal(error)) => return Err((*error).into()),
            }
        }

        if let Some(grant) = facts.grant.take() {
            if input.local.get() {
                release_best_effort(ctx, &input, &grant).await;
            } else {
                ctx.execute_activity(
                    PayoutActivities::release_grant,
                    FencedInput {
                        payout_id: input.payout_id.clone(),
                        grant: grant.clone(),
                    },
                    summarised(
                        options::fenced(options::guard_call(), &grant),
                        "ReleaseGrant",
                    ),
                )
                .await?;
            }
        }
        ctx.state_mut(|s| s.last_event = format!("RELEASED in {}", snapshot.state));
        show(ctx);
        Ok(PayoutResult {
            payout_id: input.payout_id.clone(),
            state: snapshot.state,
            token: ctx.state(|s| s.token),
            rail_ref: snapshot.rail_ref,
            failure_reason: snapshot.failure_reason,
        })
    }

    /// Queued here; decided (and recorded in the resource's audit trail) by the run loop before
    /// anything acts on it.
    #[signal(name = "abandon")]
    pub fn abandon(&mut self, _ctx: &mut SyncWorkflowContext<Self>, request: AbandonSignal) {
        self.abandon_requests.push_back(AbandonRequest {
            signal: request,
            ticket: None,
        });
    }

    /// The same request as the `abandon` signal, answered: queued for the run loop exactly as
    /// the signal is (decided, recorded in the resource's audit trail, then acted on), and
    /// answered once that is done, or once it is accepted on record and waits for the account's
    /// key.
    #[update(name = "abandon")]
    pub async fn abandon_update(
        ctx: &mut WorkflowContext<Self>,
        request: AbandonSignal,
    ) -> AbandonAnswer {
        let ticket = ctx.state_mut(|s| {
            s.abandon_tickets_issued += 1;
            let ticket = s.abandon_tickets_issued;
            s.abandon_answers.insert(ticket, None);
            s.abandon_requests.push_back(AbandonRequest {
                signal: request,
                ticket: Some(ticket),
            });
            ticket
        });
        let waited = ctx
            .wait_condition(|s| {
                matches!(s.abandon_answers.get(&ticket), Some(Some(_)))
                    || s.accepted_waiting_for_lock(ticket)
            })
            .await;
        ctx.state_mut(|s| {
            let state = s.state.unwrap_or(PayoutState::Pending);
            if let Some(Some(answer)) = s.abandon_answers.remove(&ticket) {
                return answer;
            }
            let (outcome, decided_by, reason) = match waited {
                Ok(()) => (
                    AbandonOutcome::AcceptedWaitingForLock,
                    AbandonDecider::Workflow,
                    s.abandon_accepted
                        .as_ref()
                        .map(|a| a.note.clone())
                        .unwrap_or_default(),
                ),
                Err(cancelled) => (
                    AbandonOutcome::Refused,
                    AbandonDecider::Workflow,
                    format!("the workflow was cancelled before it decided: {cancelled}"),
                ),
            };
            AbandonAnswer {
                payout_id: s.payout_id.clone(),
                outcome,
                accepted: outcome != AbandonOutcome::Refused,
                decided_by,
                reason,
                state,
            }
        })
    }

    /// Turns down at once, recording nothing, what the run loop could only refuse: input it
    /// cannot use, a payout that is terminal or in a state where the spec never allows an
    /// abandon, a RAIL_AMBIGUOUS payout before its resolution SLA, a second abandon while one is
    /// being carried out. (Unparsable input never gets here: the SDK rejects it while decoding.)
    #[update_validator(abandon_update)]
    pub fn validate_abandon(
        &self,
        _ctx: &WorkflowContextView,
        request: &AbandonSignal,
    ) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
        match self.abandon_rejection(request) {
            Some(why) => Err(why.into()),
            None => Ok(()),
        }
    }

    #[query(name = "status")]
    pub fn status(&self, _ctx: &WorkflowContextView) -> PayoutStatus {
        PayoutStatus {
            payout_id: self.payout_id.clone(),
            state: self.state.unwrap_or(PayoutState::Pending),
            token: self.token,
            claimer: self.claimer.clone(),
            last_event: self.last_event.clone(),
            resolution_sla_passed: self.resolution_sla_passed,
        }
    }
}

impl PayoutWorkflow {
    /// Why an `abandon` Update is turned down before it is queued, if it is.
    fn abandon_rejection(&self, request: &AbandonSignal) -> Option<String> {
        if let Some(problem) = request.problem() {
            return Some(problem);
        }
        let state = self.state.unwrap_or(PayoutState::Pending);
        if state.is_terminal() {
            return Some(format!(
                "refused: payout {} is already {state}: there is nothing to abandon",
                self.payout_id
            ));
        }
        if self.abandon_accepted.is_some() {
            return Some("refused: an abandon is already being carried out".into());
        }
        match state {
            PayoutState::Pending => None,
            PayoutState::RailAmbiguous if self.resolution_sla_passed => None,
            PayoutState::RailAmbiguous => Some(
                "refused: RAIL_AMBIGUOUS but the resolution SLA has not passed; the rail is still \
                 being asked"
                    .into(),
            ),
            other => Some(format!(
                "refused: state {other} does not allow abandon (only PENDING, or RAIL_AMBIGUOUS \
                 past the resolution SLA)"
            )),
        }
    }

    /// The Update holding `ticket` was accepted on record and the run now waits for the key.
    fn accepted_waiting_for_lock(&self, ticket: u64) -> bool {
        self.waiting_for_lock
            && self
                .abandon_accepted
                .as_ref()
                .is_some_and(|a| a.request.ticket == Some(ticket))
    }

    /// Gives the Update holding `ticket` (if any) its answer.
    fn answer_abandon(
        &mut self,
        ticket: Option<u64>,
        outcome: AbandonOutcome,
        decided_by: AbandonDecider,
        reason: String,
    ) {
        // An Update already answered (it was accepted and waits for the key) has no slot left.
        let Some(slot) = ticket.and_then(|t| self.abandon_answers.get_mut(&t)) else {
            return;
        };
        *slot = Some(AbandonAnswer {
            payout_id: self.payout_id.clone(),
            outcome,
            accepted: outcome != AbandonOutcome::Refused,
            decided_by,
            reason,
            state: self.state.unwrap_or(PayoutState::Pending),
        });
    }
}

fn fatal(name: &str, detail: String) -> ApplicationFailure {
    ApplicationFailure::builder(detail)
        .type_name(name.to_string())
        .non_retryable(true)
        .build()
}

/// Keeps the query state and the search attributes current.
fn observe(
    ctx: &WorkflowContext<PayoutWorkflow>,
    input: &PayoutRun,
    snapshot: &PayoutSnapshot,
    event: &str,
) {
    let changed = ctx.state_mut(|s| {
        let changed = s.state != Some(snapshot.state);
        s.state = Some(snapshot.state);
        s.claimer = snapshot.claimed_by.clone();
        s.last_event = format!("{event} -> {}", snapshot.state);
        s.waiting_for = None;
        if s.pays.is_empty() {
            let i = &input.instruction;
            s.pays = format!(
                "{} from `{}` to `{}` (client reference `{}`)",
                crate::display_amount(&i.currency, i.amount_minor.get()),
                i.account_id,
                i.beneficiary_ref,
                ClientReference::for_payout(&input.payout_id)
            );
        }
        changed
    });
    if changed {
        ctx.upsert_search_attributes([
            PAYOUT_STATE.value_set(snapshot.state.as_str().to_string()),
            ACCOUNT_ID.value_set(input.instruction.account_id.to_string()),
        ]);
    }
    show(ctx);
}

/// Shows the run's current details in the Temporal UI (the workflow metadata query's
/// `currentDetails`): what it waits for, the operator's decision in progress, the last event,
/// what it pays.
fn show(ctx: &WorkflowContext<PayoutWorkflow>) {
    let shown = ctx.state(|s| {
        let operator = s.abandon_accepted.as_ref().map(|a| {
            format!(
                "abandon by `{}` accepted and on record ({}); carried out {}",
                recordable(&a.request.signal.operator, OPERATOR_LENGTH_MAX),
                a.note,
                if s.waiting_for_lock {
                    "once the run holds the account's lock"
                } else {
                    "next"
                }
            )
        });
        details::render(&details::Facts {
            state: s.state.unwrap_or(PayoutState::Pending),
            token: s.token.map(|t| t.get()),
            claimer: &s.claimer,
            waiting_for: s.waiting_for.as_deref(),
            operator: operator.as_deref(),
            last_event: &s.last_event,
            pays: &s.pays,
        })
    });
    ctx.set_current_details(shown);
}

/// Notes what the run waits for now, and shows it.
fn waiting_for(ctx: &WorkflowContext<PayoutWorkflow>, what: String) {
    ctx.state_mut(|s| s.waiting_for = Some(what));
    show(ctx);
}

/// `options` with the summary the UI shows for `activity`'s call, unless it has one.
fn summarised(mut options: ActivityOptions, activity: &str) -> ActivityOptions {
    if options.summary.is_none() {
        options.summary = Some(step_summary(activity).to_string());
    }
    options
}

/// A durable timer whose purpose the UI shows.
fn timer_for(duration: Duration, summary: &str) -> TimerOptions {
    TimerOptions::builder(duration)
        .summary(summary.to_string())
        .build()
}

async fn read(
    ctx: &WorkflowContext<PayoutWorkflow>,
    input: &PayoutRun,
) -> Result<PayoutSnapshot, ActivityExecutionError> {
    call(
        ctx,
        &input.local,
        || PayoutActivities::get_payout,
        input.payout_id.clone(),
        options::guard_call(),
    )
    .await
}

/// The workflow change that asks the rail at once under a grant it has not yet used, before it
/// waits out the settlement window: a worker hands back a grant no fenced call has used within a
/// minute (its acquire's answer may have reached nobody), so a run that re-acquired (or started
/// in RAIL_AMBIGUOUS) and then waited a window of a minute or more lost its grant mid-wait, lost
/// the next one the same way, and failed with the payout still ambiguous. The inquiry uses the
/// grant (an answer inside the window is UNKNOWN and changes nothing; one after it is evidence).
/// Histories recorded before it replay with the wait first.
pub const INQUIRE_FIRST_PATCH: &str = "inquire-first";

/// The workflow change that runs every step as a local activity on the worker that runs the
/// payout's workflow task (the grant is made there too), instead of one activity task (and one
/// more workflow task) per step. Histories recorded before it replay on the activity path.
pub const LOCAL_STEPS_PATCH: &str = "local-steps";

/// One step's call: a local activity while `local` holds ([`LOCAL_STEPS_PATCH`]), with the
/// timeouts and retry policy of `options` (its routing is not needed: the grant is held by this
/// process, and a step run elsewhere is refused by the grant check as GrantLost); an activity task
/// otherwise, routed by `options`.
///
/// A local step that is safe to repeat tries for [`options::LOCAL_STEP_BUDGET`] at most. If it
/// gives up for want of a service (any failure that is not a refusal), this worker cannot serve the
/// payout now (cut off from the lock service or a guard, while it still polls Temporal and keeps
/// the run's workflow tasks): the same call is made again as an activity task, which any worker
/// (or the grant's own worker) takes, and the rest of the run is on the activity shape. The switch
/// is decided from the local activity's recorded failure, so a replay takes the same path. The
/// submission (one attempt, never repeated) is never switched: its failure is an ambiguous outcome.
async fn call<AD>(
    ctx: &WorkflowContext<PayoutWorkflow>,
    local: &Cell<bool>,
    activity: impl Fn() -> AD,
    arguments: impl Into<AD::Input>,
    options: ActivityOptions,
) -> Result<AD::Output, ActivityExecutionError>
where
    AD: ActivityDefinition,
    AD::Input: Clone,
    AD::Output: TemporalDeserializable,
{
    let options = summarised(options, activity().name());
    if !local.get() {
        return ctx.execute_activity(activity(), arguments, options).await;
    }
    let arguments: AD::Input = arguments.into();
    let repeatable = options::repeatable(&options);
    let answer = ctx
        .execute_local_activity(
            activity(),
            arguments.clone(),
            options::local(options.clone()),
        )
        .await;
    match answer {
        Err(error) if repeatable && Refusal::from_failure(&error).is_none() => {
            give_up_local_steps(ctx, local, activity().name(), "this worker", &error);
            ctx.execute_activity(activity(), arguments, options).await
        }
        answer => answer,
    }
}

/// The run leaves local steps for good: `step` gave up on `place` for want of a service, and
/// every later step is an activity task (see [`call`]). Noted for the `status` query.
fn give_up_local_steps(
    ctx: &WorkflowContext<PayoutWorkflow>,
    local: &Cell<bool>,
    step: &str,
    place: &str,
    error: &ActivityExecutionError,
) {
    local.set(false);
    ctx.state_mut(|s| {
        s.last_event = format!(
            "LOCAL_STEP_GAVE_UP {step} on {place} ({error}): the run's steps are activity tasks \
             from now"
        )
    });
}

/// One fenced step: [`call`] under `grant` (routed to the grant's worker when it runs as an
/// activity task), its failure classified for the run loop (GrantLost, Refused, AccountBusy or
/// Fatal).
async fn fenced_step<AD>(
    ctx: &WorkflowContext<PayoutWorkflow>,
    input: &PayoutRun,
    grant: &Grant,
    activity: impl Fn() -> AD,
    arguments: impl Into<AD::Input>,
    options: ActivityOptions,
) -> Result<AD::Output, StepError>
where
    AD: ActivityDefinition,
    AD::Input: Clone,
    AD::Output: TemporalDeserializable,
{
    call(
        ctx,
        &input.local,
        activity,
        arguments,
        options::fenced(options, grant),
    )
    .await
    .map_err(|e| classify(e, grant))
}

/// Hands a grant back, never failing the workflow: where it was made when that is this process
/// (a local step), otherwise through the task queue of the process that holds it. A release that
/// cannot run (that worker is gone) is harmless: its session's lease frees the key.
async fn release_best_effort(
    ctx: &WorkflowContext<PayoutWorkflow>,
    input: &PayoutRun,
    grant: &Grant,
) {
    let fenced = FencedInput {
        payout_id: input.payout_id.clone(),
        grant: grant.clone(),
    };
    if input.local.get() {
        let here = ctx
            .execute_local_activity(
                PayoutActivities::release_grant_here,
                fenced.clone(),
                options::local(summarised(options::guard_call(), "ReleaseGrantHere")),
            )
            .await;
        if matches!(here, Ok(Released::Released)) {
            return;
        }
    }
    let _ = ctx
        .execute_activity(
            PayoutActivities::release_grant,
            fenced,
            summarised(
                options::fenced(options::release_best_effort(), grant),
                "ReleaseGrant",
            ),
        )
        .await;
}

/// The workflow change that put waiting for the account's key into the lock server's queue
/// (one heartbeating activity) instead of short attempts between durable timers. Histories
/// recorded before it replay on the old path.
pub const QUEUED_ACQUIRE_PATCH: &str = "queued-acquire";

/// Acquires `payout:{account}`, deciding any operator signal that arrives while it waits.
async fn acquire(
    ctx: &WorkflowContext<PayoutWorkflow>,
    input: &PayoutRun,
    facts: &RunFacts,
) -> Result<Grant, temporalio_sdk::WorkflowTermination> {
    if input.local.get() {
        return acquire_here(ctx, input, facts).await;
    }
    if !ctx.patched(QUEUED_ACQUIRE_PATCH) {
        return acquire_between_timers(ctx, input, facts).await;
    }
    acquire_in_line(ctx, input, facts).await
}

/// Waits in the account's line on the workflow's task queue (any worker takes the wait).
async fn acquire_in_line(
    ctx: &WorkflowContext<PayoutWorkflow>,
    input: &PayoutRun,
    facts: &RunFacts,
) -> Result<Grant, temporalio_sdk::WorkflowTermination> {
    loop {
        // One activity waits in the queue until granted: the wait costs no workflow task and
        // no history event. It answers NotAcquired only near its own deadline (an hour).
        let outcome = wait_in_line(ctx, input, facts, options::acquire_queued()).await?;
        if let Some(grant) = granted_or_note(ctx, outcome) {
            return Ok(grant);
        }
    }
}

/// One `AcquireGrant` activity that waits in the account's line until it is granted (or its own
/// deadline nears), deciding any operator signal that arrives meanwhile: the payout keeps its
/// place in the queue while the decision is recorded.
async fn wait_in_line(
    ctx: &WorkflowContext<PayoutWorkflow>,
    input: &PayoutRun,
    facts: &RunFacts,
    options: ActivityOptions,
) -> Result<AcquireOutcome, ActivityExecutionError> {
    let mut acquiring = std::pin::pin!(ctx.execute_activity(
        PayoutActivities::acquire_grant,
        request(input),
        summarised(options, "AcquireGrant"),
    ));
    let holder = ctx.state_mut(|s| {
        s.last_event = "WAITING_FOR_LOCK in the account's queue".into();
        s.waiting_for_lock = true;
        s.lock_holder.clone()
    });
    waiting_for(
        ctx,
        format!(
            "the account's lock `payout:{}`{}, in the account's line",
            input.instruction.account_id,
            holder
                .map(|h| format!(" (held by {h})"))
                .unwrap_or_default()
        ),
    );
    loop {
        temporalio_sdk::workflows::select! {
            outcome = &mut acquiring => {
                ctx.state_mut(|s| s.waiting_for_lock = false);
                return outcome;
            },
            _ = ctx.wait_condition(|s| !s.abandon_requests.is_empty()) => {
                process_signals(ctx, input, facts).await;
                show(ctx);
            }
        };
    }
}

/// With local steps: one try on this worker (a local activity); if the key is held, the wait in
/// the account's line runs as one heartbeating activity on this same worker's own queue, so the
/// grant is made in the process that runs the payout's steps. If this worker cannot get through to
/// the lock service (the try gave up, or the wait failed on its queue), the run moves to the
/// activity shape and waits in line on the shared queue, where a worker that can serves it.
async fn acquire_here(
    ctx: &WorkflowContext<PayoutWorkflow>,
    input: &PayoutRun,
    facts: &RunFacts,
) -> Result<Grant, temporalio_sdk::WorkflowTermination> {
    loop {
        let tried = call(
            ctx,
            &input.local,
            || PayoutActivities::try_acquire_grant,
            request(input),
            options::guard_call(),
        )
        .await?;
        if let Some(grant) = granted_or_note(ctx, tried.outcome) {
            return Ok(grant);
        }
        if !input.local.get() {
            return acquire_in_line(ctx, input, facts).await;
        }
        let queued = options::acquire_queued_on(&tried.worker_queue);
        match wait_in_line(ctx, input, facts, queued).await {
            Ok(outcome) => {
                if let Some(grant) = granted_or_note(ctx, outcome) {
                    return Ok(grant);
                }
            }
            // That worker is gone before it took the wait up: try again where this runs now.
            Err(error) if never_started(&error) => {}
            Err(error) => {
                give_up_local_steps(
                    ctx,
                    &input.local,
                    "AcquireGrant",
                    &tried.worker_queue,
                    &error,
                );
                return acquire_in_line(ctx, input, facts).await;
            }
        }
    }
}

/// The grant, or `None` after noting who holds the key (for the `status` query).
fn granted_or_note(
    ctx: &WorkflowContext<PayoutWorkflow>,
    outcome: AcquireOutcome,
) -> Option<Grant> {
    match outcome {
        AcquireOutcome::Granted(grant) => {
            ctx.state_mut(|s| s.lock_holder = None);
            Some(grant)
        }
        AcquireOutcome::NotAcquired {
            holder_owner,
            holder_token,
        } => {
            ctx.state_mut(|s| {
                s.last_event =
                    format!("WAITING_FOR_LOCK held by {holder_owner} (token {holder_token})");
                s.lock_holder = Some(format!("`{holder_owner}`, token {holder_token}"));
            });
            show(ctx);
            None
        }
    }
}

fn request(input: &PayoutRun) -> AcquireInput {
    AcquireInput {
        payout_id: input.payout_id.clone(),
        account_id: input.instruction.account_id.clone(),
    }
}

/// The pre-queue path, for histories recorded before [`QUEUED_ACQUIRE_PATCH`]: short attempts,
/// and a durable timer between them.
async fn acquire_between_timers(
    ctx: &WorkflowContext<PayoutWorkflow>,
    input: &PayoutRun,
    facts: &RunFacts,
) -> Result<Grant, temporalio_sdk::WorkflowTermination> {
    loop {
        let outcome = ctx
            .execute_activity(
                PayoutActivities::acquire_grant,
                request(input),
                summarised(options::acquire(), "AcquireGrant"),
            )
            .await?;
        if let Some(grant) = granted_or_note(ctx, outcome) {
            return Ok(grant);
        }
        temporalio_sdk::workflows::select! {
            _ = ctx.timer(timer_for(LOCK_RETRY_INTERVAL, "the account's lock is held: try again")) => {},
            _ = ctx.wait_condition(|s| !s.abandon_requests.is_empty()) => {},
        };
        process_signals(ctx, input, facts).await;
    }
}

/// Decides every queued `abandon`: honoured for PENDING, and for RAIL_AMBIGUOUS past the SLA;
/// refused otherwise, and refused whatever the state when the request itself is unusable (no
/// operator, no reason, oversize). Each decision is written to the payment resource's audit trail
/// first; a decision the audit trail does not take is not acted on, and what stands is what the
/// trail recorded (an abandon the resource recorded as refused, its operator not verified, is
/// refused, decided by the payment resource). Never fails the workflow.
async fn process_signals(
    ctx: &WorkflowContext<PayoutWorkflow>,
    input: &PayoutRun,
    facts: &RunFacts,
) {
    while let Some(queued) = ctx.state_mut(|s| s.abandon_requests.pop_front()) {
        let request = &queued.signal;
        let (state, sla_passed, already) = ctx.state(|s| {
            (
                s.state.unwrap_or(PayoutState::Pending),
                s.resolution_sla_passed,
                s.abandon_accepted.is_some(),
            )
        });
        let (accepted, note) = if let Some(problem) = request.problem() {
            (false, problem)
        } else if already {
            (false, "an abandon is already being carried out".to_string())
        } else {
            match state {
                PayoutState::Pending => (true, "PENDING: operator cancel".to_string()),
                PayoutState::RailAmbiguous if sla_passed => {
                    (true, "RAIL_AMBIGUOUS past the resolution SLA".to_string())
                }
                PayoutState::RailAmbiguous => (
                    false,
                    "RAIL_AMBIGUOUS but the resolution SLA has not passed".to_string(),
                ),
                other => (false, format!("state {other} does not allow abandon")),
            }
        };
        let recorded = record_decision(ctx, input, facts, request, accepted, &note).await;
        // What stands is what the payment resource recorded: it refuses, on record, an accepted
        // abandon whose operator signature does not verify, and then it is refused here too.
        let (accepted, note, decided_by) = match recorded {
            Ok(Some(recorded)) if accepted && !recorded.accepted => {
                (false, recorded.note, AbandonDecider::PaymentResource)
            }
            // Recorded as decided. (A record that says accepted what the workflow refused would
            // break the resource's contract: the workflow's refusal stands.)
            Ok(Some(_)) => (accepted, note, AbandonDecider::Workflow),
            // A history recorded before the activity answered the record: the workflow's own
            // decision stands, as it did when that history was written.
            Ok(None) => (accepted, note, AbandonDecider::Workflow),
            Err(e) => (
                false,
                format!("{note}; NOT RECORDED ({e}), so not acted on"),
                AbandonDecider::Workflow,
            ),
        };
        ctx.state_mut(|s| {
            let operator = recordable(&request.operator, OPERATOR_LENGTH_MAX);
            s.last_event = match (accepted, decided_by) {
                (true, _) => format!("ABANDON ACCEPTED by {operator}: {note}"),
                (false, AbandonDecider::Workflow) => {
                    format!("ABANDON REFUSED by {operator}: {note}")
                }
                (false, AbandonDecider::PaymentResource) => {
                    format!("ABANDON REFUSED by the payment resource (asked by {operator}): {note}")
                }
            };
            if accepted {
                s.abandon_accepted = Some(AcceptedAbandon {
                    request: queued.clone(),
                    state,
                    note,
                });
            } else {
                s.answer_abandon(queued.ticket, AbandonOutcome::Refused, decided_by, note);
            }
        });
        show(ctx);
    }
}

/// One operator decision into the payment resource's audit trail: the decision as the resource
/// recorded it (`None` in histories recorded before the activity answered it, see
/// [`RecordedDecision`]).
async fn record_decision(
    ctx: &WorkflowContext<PayoutWorkflow>,
    input: &PayoutRun,
    facts: &RunFacts,
    request: &AbandonSignal,
    accepted: bool,
    note: &str,
) -> Result<Option<RecordedDecision>, ActivityExecutionError> {
    call(
        ctx,
        &input.local,
        || PayoutActivities::record_operator_decision,
        OperatorDecisionInput {
            payout_id: input.payout_id.clone(),
            operator: recordable(&request.operator, OPERATOR_LENGTH_MAX),
            decision: "abandon".into(),
            reason: recordable(&request.reason, REASON_LENGTH_MAX),
            accepted,
            note: note.to_string(),
            token: facts.grant.as_ref().map(|g| g.token),
            operator_signature: request.operator_signature(),
        },
        options::guard_call(),
    )
    .await
}

/// An accepted abandon is for the state it was accepted in: once the payout is seen in another
/// (a concurrent run claimed it, a resolution came first), it is withdrawn on record.
async fn withdraw_stale_abandon(
    ctx: &WorkflowContext<PayoutWorkflow>,
    input: &PayoutRun,
    facts: &RunFacts,
    snapshot: &PayoutSnapshot,
) {
    let Some(accepted_in) = ctx.state(|s| s.abandon_accepted.as_ref().map(|a| a.state)) else {
        return;
    };
    if accepted_in != snapshot.state {
        withdraw_abandon(
            ctx,
            input,
            facts,
            format!(
                "the payout moved from {accepted_in} to {} before it was carried out",
                snapshot.state
            ),
        )
        .await;
    }
}

/// Clears the accepted abandon and records why it was not carried out (best effort: the
/// withdrawal is also in the workflow's status and history).
async fn withdraw_abandon(
    ctx: &WorkflowContext<PayoutWorkflow>,
    input: &PayoutRun,
    facts: &RunFacts,
    why: String,
) {
    let Some(accepted) = ctx.state_mut(|s| s.abandon_accepted.take()) else {
        return;
    };
    let request = &accepted.request.signal;
    let note = format!("withdrawn: {why}");
    let recorded = record_decision(ctx, input, facts, request, false, &note).await;
    ctx.state_mut(|s| {
        s.last_event = format!(
            "ABANDON WITHDRAWN (by {}): {why}{}",
            recordable(&request.operator, OPERATOR_LENGTH_MAX),
            if recorded.is_ok() {
                ""
            } else {
                " [not recorded]"
            }
        );
        // Withdrawn on what the payment resource answered or reported: the payout moved on,
        // or it refused to carry the abandon out.
        s.answer_abandon(
            accepted.request.ticket,
            AbandonOutcome::Refused,
            AbandonDecider::PaymentResource,
            format!("accepted ({}), then {note}", accepted.note),
        );
    });
    show(ctx);
}

/// One step from the reported state, under `grant`.
async fn step(
    ctx: &WorkflowContext<PayoutWorkflow>,
    input: &PayoutRun,
    grant: &Grant,
    snapshot: &PayoutSnapshot,
    facts: &mut RunFacts,
) -> Result<(PayoutSnapshot, &'static str), StepError> {
    let fenced = FencedInput {
        payout_id: input.payout_id.clone(),
        grant: grant.clone(),
    };
    let abandon = ctx.state(|s| s.abandon_accepted.clone());
    match snapshot.state {
        PayoutState::Pending
            if abandon
                .as_ref()
                .is_some_and(|a| a.state == PayoutState::Pending) =>
        {
            let accepted = abandon.expect("checked");
            abandon_payout(ctx, input, grant, accepted, false, String::new()).await
        }
        PayoutState::Pending => {
            let claimed = fenced_step(
                ctx,
                input,
                grant,
                || PayoutActivities::claim,
                fenced,
                options::guard_call(),
            )
            .await?;
            Ok((claimed, "CLAIM"))
        }
        PayoutState::Claimed if snapshot.token_stamp < grant.token.get() => {
            // The recovery re-claim under a later token (CLAIMED -> CLAIMED, claimer replaced).
            let claimed = fenced_step(
                ctx,
                input,
                grant,
                || PayoutActivities::claim,
                fenced,
                options::guard_call(),
            )
            .await?;
            Ok((claimed, "RECLAIM"))
        }
        PayoutState::Claimed => {
            // Marked before the proxy is called: a crash in between leaves RAIL_SUBMITTED, which
            // every later holder treats as "maybe sent" and asks the proxy about.
            let marked = fenced_step(
                ctx,
                input,
                grant,
                || PayoutActivities::mark_submitted,
                fenced,
                options::guard_call(),
            )
            .await?;
            facts.marked_under = Some(grant.token);
            facts.signed_instruction = marked.signed_instruction.clone();
            Ok((marked, "MARK_SUBMITTED"))
        }
        PayoutState::RailSubmitted => {
            let ours = !input.started_local || facts.marked_under == Some(grant.token);
            if ours && !facts.proxy_called && facts.known_outcome.is_none() {
                // This run has not called the proxy. If an earlier run (or a crash) did, the
                // proxy refuses the new submission as DUPLICATE and its record resolves it; it
                // never sends a second one.
                facts.proxy_called = true;
                facts.known_outcome = Some(submit(ctx, input, grant, snapshot, facts).await?);
            }
            let outcome = facts
                .known_outcome
                .clone()
                .unwrap_or(RailOutcome::OutcomeMissing);
            let recorded = fenced_step(
                ctx,
                input,
                grant,
                || PayoutActivities::record_outcome,
                RecordOutcomeInput {
                    payout_id: input.payout_id.clone(),
                    grant: grant.clone(),
                    outcome,
                },
                options::guard_call(),
            )
            .await?;
            Ok((recorded, "RECORD_OUTCOME"))
        }
        PayoutState::RailAcked => {
            let posted = fenced_step(
                ctx,
                input,
                grant,
                || PayoutActivities::post_ledger,
                fenced,
                options::guard_call(),
            )
            .await?;
            Ok((posted, "POST"))
        }
        PayoutState::RailAmbiguous => ambiguity_step(ctx, input, grant, snapshot, facts).await,
        PayoutState::Posted | PayoutState::Failed | PayoutState::Abandoned => {
            Ok((snapshot.clone(), "TERMINAL"))
        }
    }
}

/// The single submission. Its answer becomes the outcome to record; a DUPLICATE is resolved
/// from the proxy's existing record; anything unclear is TIMEOUT (RAIL_AMBIGUOUS). Never retried.
async fn submit(
    ctx: &WorkflowContext<PayoutWorkflow>,
    input: &PayoutRun,
    grant: &Grant,
    snapshot: &PayoutSnapshot,
    facts: &mut RunFacts,
) -> Result<RailOutcome, StepError> {
    // The instruction the payment resource returned under this grant (MarkSubmitted's answer),
    // or the record read when this run started: the same immutable row.
    let instruction = snapshot
        .instruction
        .clone()
        .unwrap_or_else(|| input.instruction.clone());
    waiting_for(
        ctx,
        "the rail's answer to the submission (sent once, never retried)".into(),
    );
    let answer = call(
        ctx,
        &input.local,
        || PayoutActivities::submit_to_rail,
        SubmitInput {
            payout_id: input.payout_id.clone(),
            account_id: instruction.account_id,
            amount_minor: instruction.amount_minor,
            currency: instruction.currency,
            beneficiary_ref: instruction.beneficiary_ref,
            client_reference: ClientReference::for_payout(&input.payout_id),
            grant: grant.clone(),
            // Carried as MarkSubmitted answered it; no branch on its presence (the proxy judges).
            signed_instruction: facts.signed_instruction.clone(),
        },
        options::fenced(options::submit(), grant),
    )
    .await;
    Ok(match answer {
        // The proxy's signed outcome goes on to RecordOutcome as it came (issue 33).
        Ok(SubmitAnswer::Acked { rail_ref, proof }) => RailOutcome::Acked { rail_ref, proof },
        Ok(SubmitAnswer::Declined {
            decline_code,
            proof,
        }) => RailOutcome::Declined {
            decline_code,
            proof,
        },
        Ok(SubmitAnswer::Ambiguous { detail }) => RailOutcome::Timeout { detail },
        Err(error) if never_started(&error) => {
            // The grant's worker never picked the submission up: nothing was sent under it.
            facts.proxy_called = false;
            return Err(StepError::GrantLost(worker_gone(grant)));
        }
        Err(error) => match Refusal::from_failure(&error) {
            Some(Refusal::DuplicateSubmission {
                existing_outcome, ..
            }) => existing_outcome.unwrap_or(RailOutcome::OutcomeMissing),
            Some(r @ (Refusal::GrantLost { .. } | Refusal::FencedOut { .. })) => {
                // Refused before the rail was contacted: nothing was sent under this grant.
                facts.proxy_called = false;
                return Err(StepError::GrantLost(r));
            }
            // A timeout, a lost worker, a transport error: we may have moved money.
            _ => RailOutcome::Timeout {
                detail: error.to_string(),
            },
        },
    })
}

/// RAIL_AMBIGUOUS: wait the settlement window on a durable timer (deciding signals meanwhile),
/// then ask the rail. Found -> RAIL_ACKED; absent -> FAILED; unknown -> ask again later.
async fn ambiguity_step(
    ctx: &WorkflowContext<PayoutWorkflow>,
    input: &PayoutRun,
    grant: &Grant,
    snapshot: &PayoutSnapshot,
    facts: &mut RunFacts,
) -> Result<(PayoutSnapshot, &'static str), StepError> {
    let now = ctx.workflow_time().unwrap_or(SystemTime::UNIX_EPOCH);
    // The SLA runs from the payment resource's record of the ambiguity's start (GetPayout's
    // answer), whichever run saw it begin; else from when this run first saw it.
    let recorded = snapshot
        .ambiguous_since_unix_ms
        .map(|ms| SystemTime::UNIX_EPOCH + Duration::from_millis(ms));
    let since = match (recorded, facts.ambiguous_since) {
        (Some(r), Some(seen)) => r.min(seen),
        (Some(r), None) => r,
        (None, Some(seen)) => seen,
        (None, None) => now,
    };
    facts.ambiguous_since = Some(since);
    let sla = Duration::from_millis(input.ambiguity.resolution_sla_ms);
    let elapsed = now.duration_since(since).unwrap_or_default();
    if recorded.is_some() && elapsed >= sla {
        // Past the SLA by the record: an operator may abandon now, in this run too (before,
        // only an UNKNOWN answer in the same run set it).
        ctx.state_mut(|s| s.resolution_sla_passed = true);
    }
    let accepted = ctx.state(|s| s.abandon_accepted.clone());
    if let Some(accepted) = accepted.filter(|a| a.state == PayoutState::RailAmbiguous) {
        let sla_check = format!(
            "ambiguous for {} ms in this run, resolution SLA {} ms",
            elapsed.as_millis(),
            sla.as_millis()
        );
        return abandon_payout(ctx, input, grant, accepted, true, sla_check).await;
    }
    let interval = *facts
        .inquiry_interval
        .get_or_insert(Duration::from_millis(input.ambiguity.settlement_window_ms));
    let sla_passed = ctx.state(|s| s.resolution_sla_passed);
    // Under a grant no fenced step of this run has used yet (re-acquired, or a run started in
    // RAIL_AMBIGUOUS), ask first, then wait (INQUIRE_FIRST_PATCH).
    let ask_first = facts.used_under != Some(grant.token) && ctx.patched(INQUIRE_FIRST_PATCH);
    let ask_at = utc(if ask_first { now } else { now + interval });
    waiting_for(
        ctx,
        if sla_passed {
            format!(
                "an operator decision (the resolution SLA has passed: abandon is allowed); \
                 the rail is asked again at {ask_at}"
            )
        } else {
            format!(
                "the settlement window, until {ask_at}; then the rail is asked for evidence \
                 (resolution SLA ends {})",
                utc(since + sla)
            )
        },
    );
    let timer_summary = if sla_passed {
        "past the resolution SLA: ask the rail again"
    } else {
        "settlement window: then ask the rail for evidence"
    };
    let signalled = if ask_first {
        false
    } else {
        temporalio_sdk::workflows::select! {
            _ = ctx.timer(timer_for(interval, timer_summary)) => false,
            _ = ctx.wait_condition(|s| !s.abandon_requests.is_empty()) => true,
        }
    };
    if signalled {
        // The run loop decides the signal first; nothing else changed.
        return Ok((snapshot.clone(), "SIGNAL_RECEIVED"));
    }
    // Fenced: it runs where the grant lives, and a FENCED answer means re-acquire.
    let inquiry = fenced_step(
        ctx,
        input,
        grant,
        || PayoutActivities::inquire_rail,
        InquireInput {
            payout_id: input.payout_id.clone(),
            account_id: input.instruction.account_id.clone(),
            client_reference: ClientReference::for_payout(&input.payout_id),
            grant: grant.clone(),
        },
        options::inquire(),
    )
    .await?;
    facts.used_under = Some(grant.token);
    let evidence = match inquiry {
        Inquiry::Found { rail_ref } => Evidence::Found { rail_ref },
        // Sealed at the proxy: never sent and never will be, definitive absence.
        Inquiry::Absent | Inquiry::NeverSent => Evidence::Absent,
        Inquiry::Unknown { .. } => {
            let now = ctx.workflow_time().unwrap_or(SystemTime::UNIX_EPOCH);
            if now.duration_since(since).unwrap_or_default() >= sla {
                ctx.state_mut(|s| s.resolution_sla_passed = true);
                facts.inquiry_interval = Some((interval * 2).min(POST_SLA_INQUIRY_INTERVAL_MAX));
            }
            return Ok((snapshot.clone(), "INQUIRY_UNKNOWN"));
        }
    };
    let resolved = fenced_step(
        ctx,
        input,
        grant,
        || PayoutActivities::resolve_ambiguity,
        ResolveInput {
            payout_id: input.payout_id.clone(),
            grant: grant.clone(),
            evidence,
        },
        options::guard_call(),
    )
    .await?;
    Ok((resolved, "RESOLVE_AMBIGUITY"))
}

async fn abandon_payout(
    ctx: &WorkflowContext<PayoutWorkflow>,
    input: &PayoutRun,
    grant: &Grant,
    accepted: AcceptedAbandon,
    resolution_sla_passed: bool,
    sla_check: String,
) -> Result<(PayoutSnapshot, &'static str), StepError> {
    let request = accepted.request.signal;
    let abandoned = call(
        ctx,
        &input.local,
        || PayoutActivities::abandon,
        AbandonInput {
            payout_id: input.payout_id.clone(),
            grant: grant.clone(),
            operator_signature: request.operator_signature(),
            operator: request.operator,
            reason: request.reason,
            resolution_sla_passed,
            sla_check,
        },
        options::fenced(options::guard_call(), grant),
    )
    .await
    .map_err(|e| match Refusal::from_failure(&e) {
        // Not carried out, and nothing changed: the payout goes on.
        Some(
            r @ (Refusal::RefusedTransition { .. }
            | Refusal::ResolutionSlaNotPassed { .. }
            | Refusal::InvalidRequest { .. }),
        ) => StepError::AbandonRefused(r),
        _ => classify(e, grant),
    })?;
    // Carried out: nothing is left to withdraw.
    ctx.state_mut(|s| {
        s.abandon_accepted = None;
        s.answer_abandon(
            accepted.request.ticket,
            AbandonOutcome::Abandoned,
            AbandonDecider::PaymentResource,
            format!(
                "carried out ({}): the payment resource moved the payout to {}",
                accepted.note, abandoned.state
            ),
        );
        // Answered with the state the resource reported (the run loop observes it next).
        if let Some(Some(answer)) = accepted
            .request
            .ticket
            .and_then(|t| s.abandon_answers.get_mut(&t))
        {
            answer.state = abandoned.state;
        }
    });
    Ok((abandoned, "OPERATOR_ABANDON"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request(operator: &str, reason: &str) -> AbandonSignal {
        AbandonSignal {
            operator: operator.into(),
            reason: reason.into(),
            signature: String::new(),
            signed_at_unix_ms: 0,
        }
    }

    fn in_state(state: PayoutState, sla_passed: bool) -> PayoutWorkflow {
        PayoutWorkflow {
            payout_id: "p-1".into(),
            state: Some(state),
            resolution_sla_passed: sla_passed,
            ..Default::default()
        }
    }

    /// The validator accepts exactly what the run loop would accept, and says why it does not.
    #[test]
    fn the_abandon_validator_turns_down_what_needs_no_one_else() {
        let ok = request("alice", "customer withdrew");
        assert_eq!(PayoutWorkflow::default().abandon_rejection(&ok), None);
        assert_eq!(
            in_state(PayoutState::Pending, false).abandon_rejection(&ok),
            None
        );
        assert_eq!(
            in_state(PayoutState::RailAmbiguous, true).abandon_rejection(&ok),
            None
        );
        let why = |w: PayoutWorkflow, r: &AbandonSignal| w.abandon_rejection(r).unwrap();
        for terminal in [
            PayoutState::Posted,
            PayoutState::Failed,
            PayoutState::Abandoned,
        ] {
            let said = why(in_state(terminal, true), &ok);
            assert!(said.contains(&format!("already {terminal}")), "{said}");
        }
        for never in [
            PayoutState::Claimed,
            PayoutState::RailSubmitted,
            PayoutState::RailAcked,
        ] {
            let said = why(in_state(never, true), &ok);
            assert!(said.contains("does not allow abandon"), "{said}");
        }
        let said = why(in_state(PayoutState::RailAmbiguous, false), &ok);
        assert!(said.contains("resolution SLA has not passed"), "{said}");
        let said = why(in_state(PayoutState::Pending, false), &request("", "x"));
        assert!(said.contains("operator is missing"), "{said}");
        let said = why(in_state(PayoutState::Pending, false), &request("a", " "));
        assert!(said.contains("reason is missing"), "{said}");
        let mut busy = in_state(PayoutState::Pending, false);
        busy.abandon_accepted = Some(AcceptedAbandon {
            request: AbandonRequest {
                signal: ok.clone(),
                ticket: None,
            },
            state: PayoutState::Pending,
            note: "PENDING: operator cancel".into(),
        });
        assert!(why(busy, &ok).contains("already being carried out"));
    }

    /// An answer goes only to an Update still waiting for it: one already answered (accepted,
    /// waiting for the key) or a signal (no ticket) leaves nothing behind.
    #[test]
    fn answers_go_only_to_waiting_updates() {
        let mut w = in_state(PayoutState::Pending, false);
        w.abandon_answers.insert(1, None);
        w.answer_abandon(
            Some(1),
            AbandonOutcome::Refused,
            AbandonDecider::Workflow,
            "x".into(),
        );
        w.answer_abandon(
            Some(2),
            AbandonOutcome::Abandoned,
            AbandonDecider::PaymentResource,
            "y".into(),
        );
        w.answer_abandon(
            None,
            AbandonOutcome::Refused,
            AbandonDecider::Workflow,
            "z".into(),
        );
        assert_eq!(w.abandon_answers.len(), 1);
        let answer = w.abandon_answers[&1].clone().unwrap();
        assert!(!answer.accepted);
        assert_eq!(answer.payout_id, "p-1");
    }
}
