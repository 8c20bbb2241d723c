//! The gRPC service: validation, the guard (intent transaction), one rail call, the outcome.

use std::sync::Arc;
use std::time::Duration;

use payout_domain::PayoutId;
use payout_proto::railproxy as pb;
use service_kit::prometheus::IntCounterVec;
use service_kit::rejection;
use sqlx::PgPool;
use tonic::{Code, Request, Response, Status};

use grant_signing::Forged;
use rail_proxy_client::model::{FactSignature, RailLookup};
use rail_proxy_client::{wire, ProxyError};

use crate::model::{
    DuplicateClass, Evidence, InvalidArgument, Outcome, Resolution, Submission, SubmitPayout,
};
use crate::rail::{Rail, RailAnswer};
use crate::store::{self, GrantRefusal, InquiryGuard, Intent, Presented, StoreError};
use crate::ProxyConfig;
#[cfg(feature = "negative-controls")]
use crate::{Failpoint, Guards};

/// Attempts to store an outcome after the rail answered. Storing is conditional on a NULL
/// outcome, so repeating it is safe (unlike repeating the rail call); a few attempts ride out a
/// connection blip, and beyond them the submission stays NULL, which is reported as ambiguous.
const OUTCOME_RECORD_ATTEMPTS_MAX: u32 = 3;
const OUTCOME_RECORD_BACKOFF_MS: u64 = 200;
/// The rail's clock and proxydb's (which computed `valid_until`) may disagree: the rail's ABSENT
/// is taken as definitive only this long after `valid_until` on proxydb's clock. One second is
/// far above the skew of NTP-disciplined hosts and small against a settlement window.
pub const RAIL_CLOCK_SKEW_MARGIN_MS: i64 = 1_000;

pub(crate) struct Counters {
    /// `fenced_out_total`, `forged_grants_total`, `grants_for_another_key_total` and
    /// `database_restored_refusals_total` under `guard="rail_proxy"`.
    pub guard: service_kit::GuardCounters,
    pub duplicates: IntCounterVec,
    pub outcomes: IntCounterVec,
    pub inquiries: IntCounterVec,
    pub seals: IntCounterVec,
    pub rail_duplicates: IntCounterVec,
    /// `instructions_refused_total{guard="rail_proxy",reason}` (issue 33).
    pub instructions_refused: IntCounterVec,
}

/// The fenced operations (the `operation` label of the guard's refusal counters, registered at 0).
pub const FENCED_OPERATIONS: [&str; 2] = ["submit", "inquire"];

impl Counters {
    pub fn new(metrics: &service_kit::Metrics) -> Self {
        let counters = Self {
            guard: service_kit::GuardCounters::register(
                metrics,
                service_kit::Guard::RailProxy,
                &FENCED_OPERATIONS,
            ),
            duplicates: metrics.counter_vec(
                "rail_proxy_duplicate_submissions_total",
                "Submits refused because the payout already has a submission, by kind: retry (the recorded grant asking again) or second_submitter (pages). The sum is every duplicate.",
                &["kind"],
            ),
            outcomes: metrics.counter_vec("rail_proxy_outcomes_total", "Recorded outcomes of rail calls.", &["outcome"]),
            inquiries: metrics.counter_vec("rail_proxy_inquiries_total", "Inquiries by evidence.", &["evidence"]),
            seals: metrics.counter_vec(
                "rail_proxy_seals_total",
                "Payouts sealed unsent (NOT_SENT) by a fenced inquiry.",
                &[],
            ),
            instructions_refused: metrics.counter_vec(
                "instructions_refused_total",
                "Submits refused because they do not carry the payment resource's signed instruction for exactly their payment, by reason (unsigned, unknown_key_id, bad_signature, mismatch, expired, not_yet_valid, ttl_too_long). Nothing sent. Alert on any.",
                &["guard", "reason"],
            ),
            rail_duplicates: metrics.counter_vec(
                "rail_proxy_rail_duplicate_movements_total",
                "Inquiries that found more than one movement for one client reference (safety event).",
                &[],
            ),
        };
        // The alerted series exist at 0 from the start: the first occurrence is an increase.
        for kind in [DuplicateClass::Retry, DuplicateClass::SecondSubmitter] {
            counters.duplicates.with_label_values(&[kind.label()]);
        }
        counters.rail_duplicates.with_label_values(&[] as &[&str]);
        for reason in grant_signing::instruction::REASONS {
            counters
                .instructions_refused
                .with_label_values(&[service_kit::Guard::RailProxy.label(), reason]);
        }
        counters
    }
}

pub(crate) struct Inner {
    pub pool: PgPool,
    pub rail: Rail,
    pub config: ProxyConfig,
    pub counters: Counters,
}

#[derive(Clone)]
pub struct ProxyService(pub(crate) Arc<Inner>);

fn invalid(e: InvalidArgument) -> Status {
    let detail = pb::Rejection {
        kind: Some(pb::rejection::Kind::InvalidArgument(pb::InvalidArgument {
            field: e.field.to_string(),
            reason: e.reason.clone(),
        })),
    };
    rejection::status(Code::InvalidArgument, e.to_string(), &detail)
}

fn not_found(payout_id: &PayoutId) -> Status {
    let detail = pb::Rejection {
        kind: Some(pb::rejection::Kind::NotFound(pb::NotFound {
            payout_id: payout_id.to_string(),
        })),
    };
    rejection::status(
        Code::NotFound,
        format!("no submission for payout {payout_id}"),
        &detail,
    )
}

/// A token this proxydb does not admit (a restored copy not re-armed, or a token below the
/// re-arming's horizon), at Submit or Inquire: the typed rejection, the alert, the counter.
fn database_restored(
    counters: &Counters,
    operation: &str,
    presented: u64,
    owner: &str,
    payout_id: &PayoutId,
    restored: store::Restored,
) -> Status {
    counters.guard.database_restored(operation);
    tracing::error!(
        event = "database_restored", alert = true, operation, presented, owner,
        payout_id = %payout_id, incarnation_current = restored.incarnation_current,
        token_floor = restored.token_floor,
        "fenced call refused: proxydb is a restored copy that was not re-armed, or the token is below the re-arming's horizon (RESTORE.md: A guard's database restored); nothing sent"
    );
    wire::error_to_status(&ProxyError::DatabaseRestored {
        payout_id: payout_id.to_string(),
        presented,
        incarnation_current: restored.incarnation_current,
        token_floor: restored.token_floor,
    })
}

/// A stale token at the proxy (Submit or Inquire): the typed rejection, the alert, the counter.
#[allow(clippy::too_many_arguments)]
fn fenced_out(
    counters: &Counters,
    operation: &str,
    key: String,
    presented: u64,
    stored: u64,
    owner: &str,
    stored_owner: String,
    payout_id: &PayoutId,
) -> Status {
    counters.guard.fenced_out(operation);
    tracing::error!(
        event = "fenced_out", alert = true, operation, key = %key, presented, stored,
        owner, stored_owner = %stored_owner, payout_id = %payout_id,
        "stale token refused at the rail proxy; nothing sent, nothing sealed"
    );
    let detail = pb::Rejection {
        kind: Some(pb::rejection::Kind::FencedOut(pb::FencedOut {
            key: key.clone(),
            presented,
            stored,
            owner: owner.to_string(),
            stored_owner,
            payout_id: payout_id.to_string(),
        })),
    };
    rejection::status(
        Code::FailedPrecondition,
        format!("fenced out: token {presented} is below the high-water {stored} of {key}"),
        &detail,
    )
}

/// The metrics' `operation` of a `guard_event.operation` (`SUBMIT`, `INQUIRE`).
fn metric_operation(operation: &str) -> &'static str {
    match operation {
        "SUBMIT" => FENCED_OPERATIONS[0],
        _ => FENCED_OPERATIONS[1],
    }
}

/// The `guard_event.forged_reason` of a forged grant.
fn forged_column(forged: &Forged) -> &'static str {
    match forged {
        Forged::Unsigned => "UNSIGNED",
        Forged::UnknownKeyId(_) => "UNKNOWN_KEY_ID",
        Forged::BadSignature => "BAD_SIGNATURE",
    }
}

fn store_failure(e: StoreError) -> Status {
    match e {
        StoreError::Invariant(_) => {
            tracing::error!(error = %e, "proxydb invariant broken");
            Status::internal(e.to_string())
        }
        other => {
            tracing::warn!(error = %other, "proxydb unavailable");
            Status::unavailable(other.to_string())
        }
    }
}

impl ProxyService {
    /// The grant check, before the high-water statement of Submit and Inquire: the lock
    /// service's signature over (signed key, token, owner), else `forged_grant`; then the signed
    /// key must be the account's, else `grant_for_another_key`. A refusal writes its guard event
    /// (and nothing else), counts, logs once, and sends nothing. If the guard event cannot be
    /// written the call is refused all the same (the refusal is what keeps the money safe; the
    /// lost evidence is logged).
    async fn check_grant(&self, presented: &Presented<'_>) -> Result<(), Status> {
        let inner = &self.0;
        let token = presented.token.get();
        let payout_id = presented.payout_id.to_string();
        if inner.config.protections.grant_signature {
            if let Err(forged) = inner.config.verifier().verify(
                presented.signed_key,
                token,
                presented.owner,
                presented.signature,
            ) {
                let reason = forged.reason();
                inner
                    .counters
                    .guard
                    .forged_grant(metric_operation(presented.operation), reason);
                tracing::warn!(
                    event = "forged_grant", operation = presented.operation, reason,
                    key = presented.signed_key, presented = token, owner = presented.owner,
                    signing_key_id = %presented.signature.key_id, payout_id = %payout_id,
                    "grant not signed by the lock service refused at the rail proxy ({forged}); nothing sent"
                );
                let refusal = GrantRefusal::Forged {
                    reason: forged_column(&forged),
                };
                self.record_grant_refusal(presented, refusal).await;
                return Err(wire::error_to_status(&ProxyError::ForgedGrant {
                    key: presented.signed_key.to_string(),
                    presented: token,
                    owner: presented.owner.to_string(),
                    signing_key_id: presented.signature.key_id.clone(),
                    reason: reason.to_string(),
                    payout_id,
                }));
            }
        }
        if inner.config.protections.grant_key_binding && presented.signed_key != presented.lock_key
        {
            inner
                .counters
                .guard
                .grant_for_another_key(metric_operation(presented.operation));
            tracing::warn!(
                event = "grant_for_another_key", operation = presented.operation,
                presented_key = presented.signed_key, required_key = %presented.lock_key,
                presented = token, owner = presented.owner, payout_id = %payout_id,
                "a grant of another lock key refused at the rail proxy; nothing sent"
            );
            self.record_grant_refusal(presented, GrantRefusal::ForAnotherKey)
                .await;
            return Err(wire::error_to_status(&ProxyError::GrantForAnotherKey {
                presented_key: presented.signed_key.to_string(),
                required_key: presented.lock_key.clone(),
                presented: token,
                owner: presented.owner.to_string(),
                payout_id,
            }));
        }
        Ok(())
    }

    /// The instruction check, right after the grant's and before anything else of a Submit
    /// (the negative control's unguarded path included): the payment resource's signature over
    /// the instruction, then each of its fields against the request's, then its validity on this
    /// host's clock (`grant_signing::instruction::Verifier::verify_instruction`). A refusal writes
    /// its `instruction_refusal` row (and nothing else), counts, logs once at alert level, and
    /// sends nothing. If the row cannot be written the submit is refused all the same.
    async fn check_instruction(&self, request: &SubmitPayout) -> Result<(), Status> {
        let inner = &self.0;
        if !inner.config.protections.instruction {
            return Ok(());
        }
        let verdict = match &request.instruction {
            None => Err(grant_signing::instruction::Refused::Unsigned),
            Some(signed) => inner.config.instructions().verify_instruction(
                signed,
                &request.presented(),
                unix_ms_now(),
            ),
        };
        let Err(refused) = verdict else {
            return Ok(());
        };
        let reason = refused.reason();
        inner
            .counters
            .instructions_refused
            .with_label_values(&[service_kit::Guard::RailProxy.label(), reason])
            .inc();
        let signing_key_id = request
            .instruction
            .as_ref()
            .map(|i| i.signature.key_id.clone())
            .unwrap_or_default();
        tracing::error!(
            event = "instruction_refused", alert = true, reason, field = refused.field(),
            signing_key_id = %signing_key_id, payout_id = %request.payout_id,
            account_id = %request.account_id, token = request.token.get(), owner = %request.owner,
            "a submit without the payment resource's instruction for exactly this payment refused ({refused}); nothing sent"
        );
        if let Err(e) = store::record_instruction_refusal(&inner.pool, request, &refused).await {
            tracing::error!(error = %e, reason, "the instruction refusal's row could not be written; refused all the same");
        }
        Err(wire::error_to_status(&ProxyError::InstructionRefused {
            payout_id: request.payout_id.to_string(),
            reason: reason.to_string(),
            field: refused.field().to_string(),
            signing_key_id,
            detail: refused.to_string(),
        }))
    }

    async fn record_grant_refusal(&self, presented: &Presented<'_>, refusal: GrantRefusal) {
        if let Err(e) = store::record_grant_refusal(&self.0.pool, presented, refusal).await {
            tracing::error!(error = %e, ?refusal, "the grant refusal's guard event could not be written; refused all the same");
        }
    }

    async fn call_rail_and_record(
        &self,
        request: SubmitPayout,
        valid_until_unix_ms: Option<i64>,
    ) -> Result<Submission, Status> {
        let inner = self.0.clone();
        // The rail call and the recording run in their own task: a caller that disconnects
        // must not cancel the recording of what the rail did.
        let task = tokio::spawn(tracing::Instrument::in_current_span(async move {
            #[cfg(feature = "negative-controls")]
            if let Some(Failpoint::PauseAfterIntent { ms }) = inner.config.failpoint {
                tracing::error!(
                    ms,
                    "failpoint pause-after-intent: stalling between the intent and the rail call"
                );
                tokio::time::sleep(Duration::from_millis(ms)).await;
            }
            let answer = inner.rail.pay_once(&request, valid_until_unix_ms).await;
            let outcome = match answer {
                RailAnswer::Acked { rail_ref } => Outcome::Acked { rail_ref },
                RailAnswer::Rejected { decline_code } => Outcome::Rejected { decline_code },
                RailAnswer::Ambiguous { detail } => Outcome::Timeout { detail },
            };
            inner
                .counters
                .outcomes
                .with_label_values(&[outcome.name()])
                .inc();
            let mut attempt = 1;
            loop {
                match store::record_outcome(&inner.pool, &request.payout_id, &outcome).await {
                    Ok(submission) => {
                        tracing::info!(
                            outcome = outcome.name(),
                            ambiguous = outcome.is_ambiguous(),
                            "rail outcome recorded"
                        );
                        return Ok(submission);
                    }
                    Err(StoreError::Invariant(detail)) => {
                        tracing::error!(%detail, "outcome could not be recorded: invariant broken");
                        return Err((outcome, detail));
                    }
                    Err(e) if attempt >= OUTCOME_RECORD_ATTEMPTS_MAX => {
                        tracing::error!(error = %e, outcome = outcome.name(), "outcome not recorded; the submission stays ambiguous");
                        return Err((outcome, e.to_string()));
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, attempt, "recording the outcome failed; trying again");
                        attempt += 1;
                        tokio::time::sleep(Duration::from_millis(OUTCOME_RECORD_BACKOFF_MS)).await;
                    }
                }
            }
        }));
        match task.await.expect("the rail task does not panic") {
            Ok(submission) => Ok(submission),
            Err((outcome, detail)) => {
                let detail_message = pb::Rejection {
                    kind: Some(pb::rejection::Kind::OutcomeNotRecorded(
                        pb::OutcomeNotRecorded {
                            payout_id: String::new(),
                            rail_outcome: wire::outcome_to_proto(&outcome) as i32,
                            detail: detail.clone(),
                        },
                    )),
                };
                Err(rejection::status(
                    Code::Internal,
                    format!("outcome not recorded, submission ambiguous: {detail}"),
                    &detail_message,
                ))
            }
        }
    }

    /// The negative control's path: no high-water, no uniqueness, nothing recorded.
    #[cfg(feature = "negative-controls")]
    async fn unguarded(&self, request: SubmitPayout) -> Result<Submission, Status> {
        tracing::error!("rail proxy guards are DISABLED (test-only negative control)");
        let outcome = match self.0.rail.pay_once(&request, None).await {
            RailAnswer::Acked { rail_ref } => Outcome::Acked { rail_ref },
            RailAnswer::Rejected { decline_code } => Outcome::Rejected { decline_code },
            RailAnswer::Ambiguous { detail } => Outcome::Timeout { detail },
        };
        Ok(Submission {
            payout_id: request.payout_id,
            account_id: request.account_id,
            token: request.token,
            owner: request.owner,
            client_reference: request.client_reference,
            payment: Some(crate::model::Payment {
                amount_minor: request.amount_minor,
                currency: request.currency,
                beneficiary_ref: request.beneficiary_ref,
            }),
            outcome,
            created_at_unix_ms: unix_ms_now(),
            resolved_at_unix_ms: Some(unix_ms_now()),
            valid_until_unix_ms: None,
            outcome_signature: None,
        })
    }
}

/// The proxy's signed rail facts (issue 33): every final outcome and every evidence it answers
/// carries its signature, made on the fly from the stored row (Ed25519 is deterministic: the same
/// row always gives the same signature, so nothing new is stored).
impl ProxyService {
    /// `s` as answered: with the signature over its final outcome (none while PENDING).
    fn signed_submission(&self, s: &Submission) -> pb::Submission {
        let signer = self.0.config.fact_signer();
        let outcome_signature = s.outcome_fact().map(|fact| FactSignature {
            signature: signer.sign_outcome(&fact),
            signed_at_unix_ms: fact.signed_at_unix_ms,
        });
        wire::submission_to_proto(&Submission {
            outcome_signature,
            ..s.clone()
        })
    }

    /// `r`, evidence on `submission`'s payout, as answered: with its account and signature.
    fn signed_resolution(&self, r: &Resolution, submission: &Submission) -> pb::Resolution {
        let fact = r.evidence_fact(&submission.account_id, &submission.client_reference);
        let signature = FactSignature {
            signature: self.0.config.fact_signer().sign_evidence(&fact),
            signed_at_unix_ms: fact.signed_at_unix_ms,
        };
        wire::resolution_to_proto(&Resolution {
            account_id: Some(submission.account_id.clone()),
            signature: Some(signature),
            ..r.clone()
        })
    }
}

/// The RPCs' bodies; `timed::TimedProxy` serves them as `RailProxy`, timing each call.
impl ProxyService {
    pub(crate) async fn submit(
        &self,
        request: Request<pb::SubmitRequest>,
    ) -> Result<Response<pb::SubmitResponse>, Status> {
        let request = wire::parse_submit(request.get_ref()).map_err(invalid)?;
        let span = tracing::info_span!("submit", payout_id = %request.payout_id, account_id = %request.account_id, token = request.token.get(), owner = %request.owner);
        let submission = async {
            self.check_grant(&Presented::submit(&request)).await?;
            self.check_instruction(&request).await?;
            #[cfg(feature = "negative-controls")]
            if self.0.config.guards == Guards::DisabledForNegativeControl {
                return self.unguarded(request).await;
            }
            // The instruction is valid at the rail for as long as the proxy waits for it, counted
            // from the intent: a send delayed beyond that is refused by the rail, not executed.
            let valid_for_ms = self
                .0
                .config
                .protections
                .expiry
                .then(|| self.0.config.rail_timeout.as_millis() as u64);
            let restore_check = self.0.config.protections.restore_check;
            match store::record_intent(&self.0.pool, &request, valid_for_ms, restore_check).await.map_err(store_failure)? {
                Intent::Restored(restored) => Err(database_restored(
                    &self.0.counters,
                    "submit",
                    request.token.get(),
                    &request.owner,
                    &request.payout_id,
                    restored,
                )),
                Intent::Fenced { stored, stored_owner } => Err(fenced_out(
                    &self.0.counters,
                    "submit",
                    request.lock_key(),
                    request.token.get(),
                    stored,
                    &request.owner,
                    stored_owner,
                    &request.payout_id,
                )),
                Intent::Duplicate { existing, class } => {
                    self.0.counters.duplicates.with_label_values(&[class.label()]).inc();
                    let payload_matches = existing.same_payload(&request);
                    match class {
                        DuplicateClass::Retry => tracing::warn!(
                            event = "duplicate_submission", duplicate = class.label(), page = false,
                            existing_outcome = existing.outcome.name(),
                            "the recorded grant submitted this payout again (a retry); nothing sent"
                        ),
                        DuplicateClass::SecondSubmitter => tracing::error!(
                            event = "duplicate_submission", duplicate = class.label(), page = true,
                            existing_token = existing.token.get(), existing_owner = %existing.owner,
                            existing_outcome = existing.outcome.name(), payload_matches,
                            "a second submitter for a payout that already has a submission; nothing sent"
                        ),
                    }
                    let detail = pb::Rejection {
                        kind: Some(pb::rejection::Kind::Duplicate(pb::Duplicate {
                            existing: Some(self.signed_submission(&existing)),
                            payload_matches,
                        })),
                    };
                    Err(rejection::status(
                        Code::AlreadyExists,
                        format!("payout {} already has a submission ({})", request.payout_id, existing.outcome.name()),
                        &detail,
                    ))
                }
                Intent::Recorded(submission) => {
                    tracing::info!(valid_until_unix_ms = submission.valid_until_unix_ms, "intent recorded; calling the rail once");
                    #[cfg(feature = "negative-controls")]
                    if self.0.config.failpoint == Some(Failpoint::AbortAfterIntent) {
                        tracing::error!("failpoint abort-after-intent: aborting between the intent and the rail call");
                        std::process::abort();
                    }
                    if self.0.config.protections.expiry && submission.valid_until_unix_ms.is_none() {
                        return Err(store_failure(StoreError::Invariant(
                            "an intent was recorded without valid_until".into(),
                        )));
                    }
                    self.call_rail_and_record(request, submission.valid_until_unix_ms).await
                }
            }
        }
        .instrument_in(span)
        .await?;
        Ok(Response::new(pb::SubmitResponse {
            submission: Some(self.signed_submission(&submission)),
        }))
    }

    pub(crate) async fn lookup(
        &self,
        request: Request<pb::LookupRequest>,
    ) -> Result<Response<pb::LookupResponse>, Status> {
        let payout_id = PayoutId::parse(request.get_ref().payout_id.as_str())
            .map_err(|e| invalid(InvalidArgument::new("payout_id", e)))?;
        let Some((submission, resolutions)) = store::find(&self.0.pool, &payout_id)
            .await
            .map_err(store_failure)?
        else {
            return Err(not_found(&payout_id));
        };
        Ok(Response::new(pb::LookupResponse {
            submission: Some(self.signed_submission(&submission)),
            resolutions: resolutions
                .iter()
                .map(|r| self.signed_resolution(r, &submission))
                .collect(),
        }))
    }

    pub(crate) async fn rail_movements(
        &self,
        request: Request<pb::RailMovementsRequest>,
    ) -> Result<Response<pb::RailMovementsResponse>, Status> {
        let payout_id = PayoutId::parse(request.get_ref().payout_id.as_str())
            .map_err(|e| invalid(InvalidArgument::new("payout_id", e)))?;
        let reference = payout_domain::ClientReference::for_payout(&payout_id);
        let (state, movements, detail) = match self.0.rail.movements(reference.as_str()).await {
            RailLookup::Found(movements) => (
                pb::RailLookupState::RailLookupFound,
                movements
                    .into_iter()
                    .map(|m| pb::RailMovement {
                        rail_ref: m.rail_ref,
                        amount_minor: m.amount_minor,
                        currency: m.currency,
                        beneficiary_ref: m.beneficiary_ref,
                    })
                    .collect(),
                String::new(),
            ),
            RailLookup::Absent => (
                pb::RailLookupState::RailLookupAbsent,
                Vec::new(),
                String::new(),
            ),
            RailLookup::Unknown { detail } => {
                (pb::RailLookupState::RailLookupUnknown, Vec::new(), detail)
            }
        };
        Ok(Response::new(pb::RailMovementsResponse {
            client_reference: reference.to_string(),
            state: state as i32,
            movements,
            detail,
        }))
    }

    pub(crate) async fn inquire(
        &self,
        request: Request<pb::InquireRequest>,
    ) -> Result<Response<pb::InquireResponse>, Status> {
        let request = wire::parse_inquire(request.get_ref()).map_err(invalid)?;
        let span = tracing::info_span!("inquire", payout_id = %request.payout_id, account_id = %request.account_id, token = request.token.get(), owner = %request.owner, asked_by = %request.asked_by);
        async {
            self.check_grant(&Presented::inquire(&request)).await?;
            let payout_id = &request.payout_id;
            let protections = self.0.config.protections;
            let guard = store::guard_inquiry(&self.0.pool, &request, protections.seal, protections.restore_check)
                .await
                .map_err(store_failure)?;
            let (submission, evidence) = match guard {
                InquiryGuard::Restored(restored) => {
                    return Err(database_restored(
                        &self.0.counters,
                        "inquire",
                        request.token.get(),
                        &request.owner,
                        payout_id,
                        restored,
                    ));
                }
                InquiryGuard::Fenced { stored, stored_owner } => {
                    return Err(fenced_out(
                        &self.0.counters,
                        "inquire",
                        request.lock_key(),
                        request.token.get(),
                        stored,
                        &request.owner,
                        stored_owner,
                        payout_id,
                    ));
                }
                // Only the negative control gets here: no record, as before the seal existed.
                InquiryGuard::Unsealed => return Err(not_found(payout_id)),
                InquiryGuard::OtherAccount { recorded } => {
                    return Err(invalid(InvalidArgument::new(
                        "account_id",
                        format!("payout {payout_id} is recorded for account {recorded}, not {}", request.account_id),
                    )));
                }
                InquiryGuard::Sealed { submission, by_this_inquiry } => {
                    if by_this_inquiry {
                        self.0.counters.seals.with_label_values(&[] as &[&str]).inc();
                    }
                    tracing::warn!(
                        event = "payout_sealed", by_this_inquiry, sealed_token = submission.token.get(), sealed_owner = %submission.owner,
                        "no submission for this payout: sealed unsent; every later Submit is a DUPLICATE"
                    );
                    // Evidence still wins over our own record: a movement for a sealed payout
                    // can only come from a path around the proxy, which must page.
                    let evidence = match self.0.rail.lookup(submission.client_reference.as_str()).await {
                        found @ Evidence::Found { .. } => {
                            tracing::error!(event = "sealed_payout_moved", page = true, "the rail shows a movement for a payout the proxy never sent");
                            found
                        }
                        _ => Evidence::NeverSent,
                    };
                    (submission, evidence)
                }
                InquiryGuard::Submitted { submission, now_unix_ms } => {
                    let evidence = self.0.rail.lookup(submission.client_reference.as_str()).await;
                    let evidence = match (evidence, submission.valid_until_unix_ms) {
                        // The instruction may still reach the rail and be executed: the rail's
                        // "absent" is not definitive until it has expired there.
                        (Evidence::Absent, Some(valid_until)) if self.0.config.protections.expiry
                            && now_unix_ms <= valid_until.saturating_add(RAIL_CLOCK_SKEW_MARGIN_MS) =>
                        {
                            Evidence::Unknown {
                                detail: format!(
                                    "the payment instruction is valid at the rail until {valid_until} (unix ms, plus a {RAIL_CLOCK_SKEW_MARGIN_MS} ms clock margin); absence is not definitive before"
                                ),
                            }
                        }
                        (evidence, _) => evidence,
                    };
                    (submission, evidence)
                }
            };
            self.0
                .counters
                .inquiries
                .with_label_values(&[evidence.name()])
                .inc();
            if let Evidence::Found { rail_refs } = &evidence {
                if rail_refs.len() > 1 {
                    self.0
                        .counters
                        .rail_duplicates
                        .with_label_values(&[] as &[&str])
                        .inc();
                    tracing::error!(event = "rail_duplicate_movement", page = true, ?rail_refs, "the rail moved money more than once for one payout");
                }
                if matches!(submission.outcome, Outcome::Rejected { .. } | Outcome::NotSent { .. }) {
                    tracing::error!(event = "outcome_contradicted", page = true, outcome = submission.outcome.name(), "the rail shows a movement for a submission that moved nothing");
                }
            }
            let resolution =
                store::record_resolution(&self.0.pool, payout_id, &request.asked_by, &evidence)
                    .await
                    .map_err(store_failure)?;
            tracing::info!(evidence = evidence.name(), outcome = submission.outcome.name(), "inquiry recorded");
            Ok(Response::new(pb::InquireResponse {
                submission: Some(self.signed_submission(&submission)),
                resolution: Some(self.signed_resolution(&resolution, &submission)),
            }))
        }
        .instrument_in(span)
        .await
    }
}

/// Milliseconds since the Unix epoch on this host's clock (0 if the clock is before it): what an
/// instruction's validity is judged at. The unguarded path also stamps its records with it; every
/// guarded record is stamped by proxydb.
fn unix_ms_now() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0)
}

/// `tracing::Instrument` under a name that reads at the call site.
trait InstrumentIn: Sized {
    fn instrument_in(self, span: tracing::Span) -> tracing::instrument::Instrumented<Self>;
}

impl<F: std::future::Future> InstrumentIn for F {
    fn instrument_in(self, span: tracing::Span) -> tracing::instrument::Instrumented<Self> {
        tracing::Instrument::instrument(self, span)
    }
}
