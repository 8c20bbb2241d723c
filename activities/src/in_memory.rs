//! A controllable in-memory world for workflow tests (feature `test-backend`, never enabled by
//! the worker): a lock with tokens, the payment resource's fence and state machine (the domain's
//! `TRANSITIONS`), the proxy's uniqueness and high-water, and a scripted rail with ground truth.
//! Temporal stays real in those tests; only the services behind the activities are replaced.

use std::collections::{BTreeMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use payout_domain::{lock_key, AccountId, Actor, FencingToken, PayoutEvent, PayoutId, PayoutState};

use crate::backend::{Answer, Backend};
use crate::refusal::{ActivityFailure, Refusal};
use crate::types::*;

/// How the scripted rail answers the (single) submission of a payout.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RailScript {
    Ack,
    Decline,
    /// The rail moved the money but the answer was lost: the proxy reports a timeout.
    TimeoutAfterAcceptance,
    /// The request never reached the rail, and the proxy reports a timeout.
    TimeoutBeforeRail,
    /// The activity itself fails (as a lost worker or a crash would), after the rail moved money.
    ActivityFailsAfterRail,
}

/// How often a waiting acquire looks at the in-memory lock again.
const IN_MEMORY_WAIT_STEP: Duration = Duration::from_millis(10);

#[derive(Debug, Clone)]
struct Payout {
    account_id: AccountId,
    amount_minor: i64,
    snapshot: PayoutSnapshot,
}

#[derive(Debug, Default)]
struct World {
    revision: u64,
    locks: BTreeMap<String, Grant>,
    lost_sessions: Vec<String>,
    fences: BTreeMap<AccountId, u64>,
    balances: BTreeMap<AccountId, i64>,
    payouts: BTreeMap<PayoutId, Payout>,
    high_water: BTreeMap<AccountId, u64>,
    submissions: BTreeMap<PayoutId, Option<RailOutcome>>,
    rail_script: BTreeMap<PayoutId, RailScript>,
    inquiries: BTreeMap<PayoutId, VecDeque<Inquiry>>,
    rail_movements: BTreeMap<PayoutId, u32>,
    postings: BTreeMap<PayoutId, u32>,
    submit_calls: BTreeMap<PayoutId, u32>,
    decisions: Vec<OperatorDecisionInput>,
    fenced_out: u32,
    expire_after_submit: bool,
    session: String,
    owner: String,
    /// When each payout first became RAIL_AMBIGUOUS, as the payment resource records it.
    ambiguous_since: BTreeMap<PayoutId, std::time::Instant>,
    /// The resolution SLA the world's payment resource enforces (`None`: its one-hour default).
    resolution_sla: Option<std::time::Duration>,
    /// What each submission asked the rail to pay.
    submitted_amounts: BTreeMap<PayoutId, i64>,
    /// Whether the world's payment resource verifies operators (`refuse_unsigned_operators`).
    operators_verified: bool,
}

/// Shared handle: the test keeps one clone to script and inspect, the worker gets another.
#[derive(Clone)]
pub struct InMemoryBackend {
    world: Arc<Mutex<World>>,
}

impl InMemoryBackend {
    pub fn new(owner: &str) -> Self {
        let world = World {
            session: format!("session-{owner}-1"),
            owner: owner.to_string(),
            ..World::default()
        };
        Self {
            world: Arc::new(Mutex::new(world)),
        }
    }

    fn with<R>(&self, f: impl FnOnce(&mut World) -> R) -> R {
        f(&mut self.world.lock().expect("world lock"))
    }

    pub fn open_account(&self, account: &AccountId, balance_minor: i64) {
        self.with(|w| {
            w.balances.insert(account.clone(), balance_minor);
            w.fences.entry(account.clone()).or_insert(0);
        });
    }

    pub fn create_payout(&self, input: &PayoutInput, rail: RailScript) {
        self.with(|w| {
            w.payouts.insert(
                input.payout_id.clone(),
                Payout {
                    account_id: input.account_id.clone(),
                    amount_minor: input.amount_minor.get(),
                    snapshot: PayoutSnapshot {
                        payout_id: input.payout_id.clone(),
                        state: PayoutState::Pending,
                        claimed_by: String::new(),
                        token_stamp: 0,
                        rail_ref: String::new(),
                        rail_outcome: String::new(),
                        failure_reason: String::new(),
                        ambiguous_since_unix_ms: None,
                        instruction: Some(Instruction {
                            account_id: input.account_id.clone(),
                            amount_minor: input.amount_minor,
                            currency: input.currency.clone(),
                            beneficiary_ref: input.beneficiary_ref.clone(),
                        }),
                        signed_instruction: None,
                    },
                },
            );
            w.rail_script.insert(input.payout_id.clone(), rail);
        });
    }

    /// The resolution SLA this world's payment resource enforces, from its own record of when a
    /// payout became RAIL_AMBIGUOUS (as the real one does).
    pub fn set_resolution_sla(&self, sla: std::time::Duration) {
        self.with(|w| w.resolution_sla = Some(sla));
    }

    /// This world's payment resource verifies operators, as a deployed one does: an accepted
    /// decision that carries no operator signature is recorded as refused, with why, in the words
    /// the real one uses (`store::record_operator_decision`). Checking a signature itself is the
    /// real resource's, tested there; here an unsigned decision stands for every one that does not
    /// verify. Off by default: the other workflow tests send unsigned abandons to be honoured.
    pub fn refuse_unsigned_operators(&self) {
        self.with(|w| w.operators_verified = true);
    }

    /// The amount the submission of `payout` asked the rail to pay, if it was submitted.
    pub fn submitted_amount(&self, payout: &PayoutId) -> Option<i64> {
        self.with(|w| w.submitted_amounts.get(payout).copied())
    }

    /// Queues the rail's answers to lookups; once empty, lookups answer from ground truth.
    pub fn script_inquiries(&self, payout: &PayoutId, answers: Vec<Inquiry>) {
        self.with(|w| {
            w.inquiries.insert(payout.clone(), answers.into());
        });
    }

    /// The worker's session dies (as a SIGSTOP past the lease would): its grants are freed and
    /// the client's deadline check fails from now on. The next session gets a new id.
    pub fn expire_session(&self) {
        self.with(|w| {
            let old = w.session.clone();
            w.locks.retain(|_, g| g.session_id != old);
            w.lost_sessions.push(old.clone());
            w.session = format!("{old}-renewed");
        });
    }

    /// Another holder takes the key with a higher token and writes once (advancing the fence),
    /// then releases: the workflow's grant is now stale at the guard.
    pub fn foreign_holder_advances_fence(&self, account: &AccountId) -> u64 {
        self.with(|w| {
            w.revision += 1;
            let token = w.revision;
            w.fences.insert(account.clone(), token);
            token
        })
    }

    /// Makes the worker's session expire right after the next submission returns, so the
    /// outcome is recorded by a later grant.
    pub fn expire_session_after_submit(&self) {
        self.with(|w| w.expire_after_submit = true);
    }

    /// A concurrent run (another workflow of the same payout) claims it under `grant`, a key it
    /// holds elsewhere: the fence advances to its token and the payout is CLAIMED.
    pub fn claim_elsewhere(&self, payout: &PayoutId, grant: &Grant) {
        self.with(|w| {
            w.fenced_transition(payout, grant, PayoutEvent::Claim, Actor::Holder)
                .expect("the concurrent claim is admitted");
            let p = w.payouts.get_mut(payout).expect("exists");
            p.snapshot.claimed_by = grant.owner.clone();
        });
    }

    /// Another worker's session holds the key (another payout of the account is in flight).
    pub fn hold_lock_elsewhere(&self, account: &AccountId) -> Grant {
        self.with(|w| {
            w.revision += 1;
            let grant = Grant {
                key: lock_key(account),
                owner: "other-worker".into(),
                session_id: "session-other".into(),
                token: FencingToken::new(w.revision).expect("revisions start at 1"),
                task_queue: String::new(),
            };
            w.locks.insert(grant.key.clone(), grant.clone());
            grant
        })
    }

    pub fn release_elsewhere(&self, grant: &Grant) {
        self.with(|w| {
            if w.locks.get(&grant.key) == Some(grant) {
                w.locks.remove(&grant.key);
            }
        });
    }

    pub fn state(&self, payout: &PayoutId) -> PayoutState {
        self.with(|w| w.payouts[payout].snapshot.state)
    }
    pub fn rail_movements(&self, payout: &PayoutId) -> u32 {
        self.with(|w| w.rail_movements.get(payout).copied().unwrap_or(0))
    }
    pub fn postings(&self, payout: &PayoutId) -> u32 {
        self.with(|w| w.postings.get(payout).copied().unwrap_or(0))
    }
    pub fn submit_calls(&self, payout: &PayoutId) -> u32 {
        self.with(|w| w.submit_calls.get(payout).copied().unwrap_or(0))
    }
    pub fn balance(&self, account: &AccountId) -> i64 {
        self.with(|w| w.balances[account])
    }
    /// The decisions as recorded (an accepted one refused by `refuse_unsigned_operators` is here
    /// refused, with the resource's note).
    pub fn decisions(&self) -> Vec<OperatorDecisionInput> {
        self.with(|w| w.decisions.clone())
    }
    pub fn fenced_out_count(&self) -> u32 {
        self.with(|w| w.fenced_out)
    }
    pub fn lock_holder(&self, account: &AccountId) -> Option<Grant> {
        self.with(|w| w.locks.get(&lock_key(account)).cloned())
    }
    pub fn fence(&self, account: &AccountId) -> u64 {
        self.with(|w| w.fences.get(account).copied().unwrap_or(0))
    }
}

fn ready<T: Send + 'static>(value: Result<T, ActivityFailure>) -> Answer<'static, T> {
    Box::pin(futures::future::ready(value))
}

impl World {
    /// The first guard: advance the account fence if the token is not below it, then apply the
    /// transition; a refused transition changes nothing (the fence advance included).
    fn fenced_transition(
        &mut self,
        payout_id: &PayoutId,
        grant: &Grant,
        event: PayoutEvent,
        actor: Actor,
    ) -> Result<(), Refusal> {
        let payout = self
            .payouts
            .get(payout_id)
            .ok_or_else(|| Refusal::InvalidRequest {
                detail: format!("unknown payout {payout_id}"),
            })?;
        let account = payout.account_id.clone();
        let stored = self.fences.get(&account).copied().unwrap_or(0);
        if !grant.token.admitted_by(stored) {
            self.fenced_out += 1;
            return Err(Refusal::FencedOut {
                key: lock_key(&account),
                presented: grant.token.get(),
                stored,
                owner: grant.owner.clone(),
            });
        }
        let from = payout.snapshot.state;
        let to = from
            .apply(event, actor)
            .map_err(|_| Refusal::RefusedTransition {
                payout_id: payout_id.to_string(),
                from: from.as_str().to_string(),
                event: event.as_str().to_string(),
            })?;
        self.fences.insert(account, grant.token.get());
        if to == PayoutState::RailAmbiguous {
            self.ambiguous_since
                .entry(payout_id.clone())
                .or_insert_with(std::time::Instant::now);
        }
        let payout = self.payouts.get_mut(payout_id).expect("checked above");
        payout.snapshot.state = to;
        payout.snapshot.token_stamp = grant.token.get();
        Ok(())
    }

    fn snapshot(&self, payout_id: &PayoutId) -> PayoutSnapshot {
        self.payouts[payout_id].snapshot.clone()
    }
}

impl Backend for InMemoryBackend {
    fn acquire(&self, input: AcquireInput, wait: Duration) -> Answer<'_, AcquireOutcome> {
        let key = lock_key(&input.account_id);
        let deadline = tokio::time::Instant::now() + wait;
        Box::pin(async move {
            loop {
                let outcome = self.with(|w| {
                    if let Some(holder) = w.locks.get(&key) {
                        if holder.session_id == w.session {
                            return AcquireOutcome::Granted(holder.clone());
                        }
                        return AcquireOutcome::NotAcquired {
                            holder_owner: holder.owner.clone(),
                            holder_token: holder.token.get(),
                        };
                    }
                    w.revision += 1;
                    let grant = Grant {
                        key: key.clone(),
                        owner: w.owner.clone(),
                        session_id: w.session.clone(),
                        token: FencingToken::new(w.revision).expect("revisions start at 1"),
                        task_queue: String::new(),
                    };
                    w.locks.insert(key.clone(), grant.clone());
                    AcquireOutcome::Granted(grant)
                });
                // The in-memory world has no release notification: it looks again every few
                // milliseconds until the wait is over.
                if matches!(outcome, AcquireOutcome::Granted(_))
                    || tokio::time::Instant::now() >= deadline
                {
                    return Ok(outcome);
                }
                tokio::time::sleep(IN_MEMORY_WAIT_STEP).await;
            }
        })
    }

    fn check_held(&self, grant: &Grant) -> Result<(), Refusal> {
        self.with(|w| {
            if w.lost_sessions.contains(&grant.session_id) || grant.session_id != w.session {
                return Err(Refusal::GrantLost {
                    key: grant.key.clone(),
                    token: grant.token.get(),
                    reason: "session expired (conservative deadline passed)".into(),
                });
            }
            Ok(())
        })
    }

    fn release(&self, grant: Grant) -> Answer<'_, ()> {
        self.with(|w| {
            if w.locks.get(&grant.key) == Some(&grant) {
                w.locks.remove(&grant.key);
            }
        });
        ready(Ok(()))
    }

    fn get_payout(&self, payout_id: PayoutId) -> Answer<'_, PayoutSnapshot> {
        ready(Ok(self.with(|w| {
            // As the real resource's GetPayout: the record's start of the ambiguity.
            let since = w.ambiguous_since.get(&payout_id).and_then(|since| {
                let at = std::time::SystemTime::now().checked_sub(since.elapsed())?;
                let ms = at.duration_since(std::time::UNIX_EPOCH).ok()?.as_millis();
                u64::try_from(ms).ok()
            });
            PayoutSnapshot {
                ambiguous_since_unix_ms: since,
                ..w.snapshot(&payout_id)
            }
        })))
    }

    fn claim(&self, input: FencedInput) -> Answer<'_, PayoutSnapshot> {
        ready(self.with(|w| {
            let payout = w.payouts[&input.payout_id].clone();
            let funds = w.balances[&payout.account_id];
            let (event, sufficient) =
                if payout.snapshot.state == PayoutState::Pending && funds < payout.amount_minor {
                    (PayoutEvent::FundsInsufficient, false)
                } else {
                    (PayoutEvent::Claim, true)
                };
            w.fenced_transition(&input.payout_id, &input.grant, event, Actor::Holder)?;
            let p = w.payouts.get_mut(&input.payout_id).expect("exists");
            if sufficient {
                p.snapshot.claimed_by = input.grant.owner.clone();
            } else {
                p.snapshot.failure_reason = "FUNDS_INSUFFICIENT".into();
            }
            Ok(w.snapshot(&input.payout_id))
        }))
    }

    fn mark_submitted(&self, input: FencedInput) -> Answer<'_, PayoutSnapshot> {
        ready(self.with(|w| {
            w.fenced_transition(
                &input.payout_id,
                &input.grant,
                PayoutEvent::SubmissionAccepted,
                Actor::Holder,
            )?;
            Ok(w.snapshot(&input.payout_id))
        }))
    }

    fn record_outcome(&self, input: RecordOutcomeInput) -> Answer<'_, PayoutSnapshot> {
        ready(self.with(|w| {
            let (event, name) = match &input.outcome {
                RailOutcome::Acked { .. } => (PayoutEvent::RailAcked, "ACKED"),
                RailOutcome::Declined { .. } => (PayoutEvent::RailDeclined, "DECLINED"),
                RailOutcome::Timeout { .. } => (PayoutEvent::RailTimeout, "TIMEOUT"),
                RailOutcome::OutcomeMissing => (PayoutEvent::OutcomeMissing, "OUTCOME_MISSING"),
            };
            w.fenced_transition(&input.payout_id, &input.grant, event, Actor::Holder)?;
            let p = w.payouts.get_mut(&input.payout_id).expect("exists");
            p.snapshot.rail_outcome = name.into();
            match &input.outcome {
                RailOutcome::Acked { rail_ref, .. } => p.snapshot.rail_ref = rail_ref.clone(),
                RailOutcome::Declined { decline_code, .. } => {
                    p.snapshot.failure_reason = decline_code.clone()
                }
                _ => {}
            }
            Ok(w.snapshot(&input.payout_id))
        }))
    }

    fn post(&self, input: FencedInput) -> Answer<'_, PayoutSnapshot> {
        ready(self.with(|w| {
            if w.payouts[&input.payout_id].snapshot.state == PayoutState::Posted {
                return Ok(w.snapshot(&input.payout_id));
            }
            w.fenced_transition(
                &input.payout_id,
                &input.grant,
                PayoutEvent::Posted,
                Actor::Holder,
            )?;
            let p = w.payouts[&input.payout_id].clone();
            *w.balances.get_mut(&p.account_id).expect("account") -= p.amount_minor;
            *w.postings.entry(input.payout_id.clone()).or_default() += 1;
            Ok(w.snapshot(&input.payout_id))
        }))
    }

    fn resolve(&self, input: ResolveInput) -> Answer<'_, PayoutSnapshot> {
        ready(self.with(|w| {
            let event = match input.evidence {
                Evidence::Found { .. } => PayoutEvent::EvidenceFound,
                Evidence::Absent => PayoutEvent::EvidenceAbsent,
            };
            w.fenced_transition(&input.payout_id, &input.grant, event, Actor::Resolver)?;
            let p = w.payouts.get_mut(&input.payout_id).expect("exists");
            match input.evidence {
                Evidence::Found { rail_ref } => {
                    p.snapshot.rail_ref = rail_ref;
                    p.snapshot.rail_outcome = "EVIDENCE_FOUND".into();
                }
                Evidence::Absent => p.snapshot.rail_outcome = "EVIDENCE_ABSENT".into(),
            }
            Ok(w.snapshot(&input.payout_id))
        }))
    }

    fn abandon(&self, input: AbandonInput) -> Answer<'_, PayoutSnapshot> {
        ready(self.with(|w| {
            let state = w.payouts[&input.payout_id].snapshot.state;
            // The resource decides from its own record; the caller's belief is not consulted.
            let sla = w
                .resolution_sla
                .unwrap_or(std::time::Duration::from_secs(3_600));
            let passed = w
                .ambiguous_since
                .get(&input.payout_id)
                .is_some_and(|since| since.elapsed() >= sla);
            if state == PayoutState::RailAmbiguous && !passed {
                return Err(Refusal::ResolutionSlaNotPassed {
                    payout_id: input.payout_id.to_string(),
                }
                .into());
            }
            w.fenced_transition(
                &input.payout_id,
                &input.grant,
                PayoutEvent::OperatorAbandon,
                Actor::Operator,
            )?;
            let p = w.payouts.get_mut(&input.payout_id).expect("exists");
            p.snapshot.failure_reason =
                format!("abandoned by {}: {}", input.operator, input.reason);
            Ok(w.snapshot(&input.payout_id))
        }))
    }

    fn record_operator_decision(
        &self,
        input: OperatorDecisionInput,
    ) -> Answer<'_, RecordedDecision> {
        // As the payment resource: a decision without an operator or a reason, or with more
        // text than it stores, is refused (and nothing is recorded).
        const TEXT_LENGTH_MAX: usize = 1024;
        for (field, text) in [("operator", &input.operator), ("reason", &input.reason)] {
            if text.trim().is_empty() || text.len() > TEXT_LENGTH_MAX {
                return ready(Err(Refusal::InvalidRequest {
                    detail: format!("{field} is missing or too long"),
                }
                .into()));
            }
        }
        ready(Ok(self.with(|w| {
            let mut input = input;
            if input.accepted && w.operators_verified && input.operator_signature.is_none() {
                input.accepted = false;
                input.note = "refused: operator not verified (unsigned): the decision carries no \
                              operator signature"
                    .to_string();
            }
            let recorded = RecordedDecision {
                accepted: input.accepted,
                note: input.note.clone(),
            };
            w.decisions.push(input);
            recorded
        })))
    }

    fn submit(&self, input: SubmitInput) -> Answer<'_, SubmitAnswer> {
        ready(self.with(|w| {
            *w.submit_calls.entry(input.payout_id.clone()).or_default() += 1;
            w.submitted_amounts
                .insert(input.payout_id.clone(), input.amount_minor.get());
            // Second guard: the per-account high-water, then one submission per payout.
            let high = w.high_water.get(&input.account_id).copied().unwrap_or(0);
            if !input.grant.token.admitted_by(high) {
                w.fenced_out += 1;
                return Err(Refusal::FencedOut {
                    key: lock_key(&input.account_id),
                    presented: input.grant.token.get(),
                    stored: high,
                    owner: input.grant.owner.clone(),
                }
                .into());
            }
            if let Some(existing) = w.submissions.get(&input.payout_id) {
                return Err(Refusal::DuplicateSubmission {
                    payout_id: input.payout_id.to_string(),
                    existing_outcome: existing.clone(),
                }
                .into());
            }
            w.high_water
                .insert(input.account_id.clone(), input.grant.token.get());
            let script = w.rail_script[&input.payout_id];
            let rail_ref = format!("rail-{}", input.client_reference);
            let (moved, outcome, answer) = match script {
                RailScript::Ack => (
                    true,
                    Some(RailOutcome::Acked {
                        rail_ref: rail_ref.clone(),
                        proof: None,
                    }),
                    Ok(SubmitAnswer::Acked {
                        rail_ref,
                        proof: None,
                    }),
                ),
                RailScript::Decline => (
                    false,
                    Some(RailOutcome::Declined {
                        decline_code: "INSUFFICIENT_BENEFICIARY_DETAILS".into(),
                        proof: None,
                    }),
                    Ok(SubmitAnswer::Declined {
                        decline_code: "INSUFFICIENT_BENEFICIARY_DETAILS".into(),
                        proof: None,
                    }),
                ),
                RailScript::TimeoutAfterAcceptance | RailScript::TimeoutBeforeRail => (
                    script == RailScript::TimeoutAfterAcceptance,
                    Some(RailOutcome::Timeout {
                        detail: "rail timed out".into(),
                    }),
                    Ok(SubmitAnswer::Ambiguous {
                        detail: "rail timed out".into(),
                    }),
                ),
                RailScript::ActivityFailsAfterRail => (
                    true,
                    None,
                    Err(ActivityFailure::Transient("connection reset".into())),
                ),
            };
            w.submissions.insert(input.payout_id.clone(), outcome);
            if moved {
                *w.rail_movements.entry(input.payout_id.clone()).or_default() += 1;
            }
            if std::mem::take(&mut w.expire_after_submit) {
                let old = w.session.clone();
                w.locks.retain(|_, g| g.session_id != old);
                w.lost_sessions.push(old.clone());
                w.session = format!("{old}-renewed");
            }
            answer
        }))
    }

    fn inquire(&self, input: InquireInput) -> Answer<'_, Inquiry> {
        ready(Ok(self.with(|w| {
            if let Some(next) = w
                .inquiries
                .get_mut(&input.payout_id)
                .and_then(|q| q.pop_front())
            {
                return next;
            }
            if w.rail_movements.get(&input.payout_id).copied().unwrap_or(0) > 0 {
                Inquiry::Found {
                    rail_ref: format!("rail-{}", input.client_reference),
                }
            } else {
                Inquiry::Absent
            }
        })))
    }
}
