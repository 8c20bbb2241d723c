//! The conversions between the boundary's types and `payout_proto::payment`, in this one place
//! for both sides: requests parsed into domain types (server side), answers built from them
//! (server side) and read back (client side), refusals encoded as a status with a typed
//! `Rejection` detail (server side) and decoded back into the same [`PaymentError`] variant
//! (client side).

use payout_domain::{
    AccountId, AmountMinor, BeneficiaryRef, Currency, FencingToken, PayoutId, PayoutState,
    TokenError,
};
use payout_proto::payment as pb;
use tonic::{Code, Status};

use crate::error::{InvalidReason, PaymentError};
use crate::model::{self, Fence};

/// The wire's time format: RFC 3339, microseconds, `Z`.
pub fn rfc3339(at: chrono::DateTime<chrono::Utc>) -> String {
    at.to_rfc3339_opts(chrono::SecondsFormat::Micros, true)
}

// ----- parsing requests (server side) -----

pub fn parse_account_id(field: &str, value: &str) -> Result<AccountId, PaymentError> {
    AccountId::parse(value).map_err(|_| PaymentError::invalid(field, InvalidReason::IdInvalid))
}

pub fn parse_payout_id(value: &str) -> Result<PayoutId, PaymentError> {
    PayoutId::parse(value).map_err(|_| PaymentError::invalid("payout_id", InvalidReason::IdInvalid))
}

pub fn parse_currency(value: &str) -> Result<Currency, PaymentError> {
    Currency::parse(value)
        .map_err(|_| PaymentError::invalid("currency", InvalidReason::CurrencyInvalid))
}

/// A token from the wire: zero is a missing token, above `i64::MAX` is out of range.
pub fn parse_token(field: &str, value: u64) -> Result<FencingToken, PaymentError> {
    FencingToken::new(value).map_err(|e| {
        let reason = match e {
            TokenError::Zero => InvalidReason::TokenMissing,
            TokenError::AboveMax { .. } => InvalidReason::TokenOutOfRange,
        };
        PaymentError::invalid(field, reason)
    })
}

/// A fence from the wire. The grant's key and signature are only bounded here (they are stored
/// in the refusal's audit row); whether they are the lock service's is the server's check
/// (`forged_grant`, `grant_for_another_key`), which an unsigned fence reaches and fails.
pub fn parse_fence(fence: Option<&pb::Fence>) -> Result<Fence, PaymentError> {
    let fence = fence.ok_or_else(|| PaymentError::invalid("fence", InvalidReason::FenceMissing))?;
    let token = parse_token("fence.token", fence.token)?;
    let key = model::optional_text("fence.key", &fence.key)?;
    let key_id = model::optional_text("fence.signing_key_id", &fence.signing_key_id)?;
    Ok(Fence::new(fence.owner.clone(), token)?.signed(
        key,
        model::Signature {
            key_id,
            bytes: fence.signature.clone(),
        },
    ))
}

pub fn parse_new_payout(r: &pb::CreatePayoutRequest) -> Result<model::NewPayout, PaymentError> {
    Ok(model::NewPayout {
        payout_id: parse_payout_id(&r.payout_id)?,
        account_id: parse_account_id("account_id", &r.account_id)?,
        amount_minor: AmountMinor::new(r.amount_minor)
            .map_err(|_| PaymentError::invalid("amount_minor", InvalidReason::AmountNotPositive))?,
        currency: parse_currency(&r.currency)?,
        beneficiary_ref: BeneficiaryRef::parse(r.beneficiary_ref.clone()).map_err(|_| {
            PaymentError::invalid("beneficiary_ref", InvalidReason::BeneficiaryInvalid)
        })?,
    })
}

pub fn parse_outcome(r: &pb::RecordOutcomeRequest) -> Result<model::RailOutcome, PaymentError> {
    match pb::RailOutcome::try_from(r.outcome).unwrap_or(pb::RailOutcome::Unspecified) {
        pb::RailOutcome::Unspecified => Err(PaymentError::invalid(
            "outcome",
            InvalidReason::OutcomeMissingValue,
        )),
        pb::RailOutcome::Acked => Ok(model::RailOutcome::Acked {
            rail_ref: model::required_text("rail_ref", &r.rail_ref, InvalidReason::RailRefMissing)?,
        }),
        pb::RailOutcome::Declined => Ok(model::RailOutcome::Declined {
            decline_code: model::required_text(
                "decline_code",
                &r.decline_code,
                InvalidReason::DeclineCodeMissing,
            )?,
        }),
        pb::RailOutcome::Timeout => Ok(model::RailOutcome::Timeout),
        pb::RailOutcome::OutcomeMissing => Ok(model::RailOutcome::OutcomeMissing),
    }
}

pub fn parse_evidence(
    r: &pb::ResolveAmbiguityRequest,
) -> Result<(model::Evidence, String), PaymentError> {
    let evidence = match pb::Evidence::try_from(r.evidence).unwrap_or(pb::Evidence::Unspecified) {
        pb::Evidence::Unspecified => {
            return Err(PaymentError::invalid(
                "evidence",
                InvalidReason::EvidenceMissingValue,
            ))
        }
        pb::Evidence::Found => model::Evidence::Found {
            rail_ref: model::required_text("rail_ref", &r.rail_ref, InvalidReason::RailRefMissing)?,
        },
        pb::Evidence::Absent => model::Evidence::Absent,
    };
    let source = model::required_text(
        "evidence_source",
        &r.evidence_source,
        InvalidReason::EvidenceSourceMissing,
    )?;
    Ok((evidence, source))
}

// ----- model -> proto (server side) -----

fn opt_time(t: Option<chrono::DateTime<chrono::Utc>>) -> String {
    t.map(rfc3339).unwrap_or_default()
}

pub fn state_to_proto(s: PayoutState) -> pb::PayoutState {
    match s {
        PayoutState::Pending => pb::PayoutState::Pending,
        PayoutState::Claimed => pb::PayoutState::Claimed,
        PayoutState::RailSubmitted => pb::PayoutState::RailSubmitted,
        PayoutState::RailAcked => pb::PayoutState::RailAcked,
        PayoutState::RailAmbiguous => pb::PayoutState::RailAmbiguous,
        PayoutState::Posted => pb::PayoutState::Posted,
        PayoutState::Failed => pb::PayoutState::Failed,
        PayoutState::Abandoned => pb::PayoutState::Abandoned,
    }
}

pub fn state_from_proto(s: i32) -> Option<PayoutState> {
    Some(match pb::PayoutState::try_from(s).ok()? {
        pb::PayoutState::Unspecified => return None,
        pb::PayoutState::Pending => PayoutState::Pending,
        pb::PayoutState::Claimed => PayoutState::Claimed,
        pb::PayoutState::RailSubmitted => PayoutState::RailSubmitted,
        pb::PayoutState::RailAcked => PayoutState::RailAcked,
        pb::PayoutState::RailAmbiguous => PayoutState::RailAmbiguous,
        pb::PayoutState::Posted => PayoutState::Posted,
        pb::PayoutState::Failed => PayoutState::Failed,
        pb::PayoutState::Abandoned => PayoutState::Abandoned,
    })
}

pub fn payout_to_proto(p: &model::Payout) -> pb::Payout {
    pb::Payout {
        payout_id: p.payout_id.to_string(),
        account_id: p.account_id.to_string(),
        amount_minor: p.amount_minor,
        currency: p.currency.to_string(),
        beneficiary_ref: p.beneficiary_ref.clone(),
        state: state_to_proto(p.state) as i32,
        client_reference: p.client_reference.clone(),
        claimed_by: p.claimed_by.clone().unwrap_or_default(),
        token_stamp: p.token_stamp.unwrap_or(0),
        failure_reason: p.failure_reason.clone().unwrap_or_default(),
        rail_ref: p.rail_ref.clone().unwrap_or_default(),
        rail_outcome: p.rail_outcome.clone().unwrap_or_default(),
        transaction_group: p
            .transaction_group
            .map(|g| g.to_string())
            .unwrap_or_default(),
        created_at: rfc3339(p.created_at),
        claimed_at: opt_time(p.claimed_at),
        submitted_at: opt_time(p.submitted_at),
        settled_at: opt_time(p.settled_at),
        updated_at: rfc3339(p.updated_at),
        instruction: p.instruction.as_ref().map(instruction_to_proto),
    }
}

fn signature_of(key_id: &str, bytes: &[u8]) -> grant_signing::Signature {
    grant_signing::Signature {
        key_id: key_id.to_string(),
        bytes: bytes.to_vec(),
    }
}

pub fn instruction_to_proto(
    s: &grant_signing::instruction::SignedInstruction,
) -> pb::SignedInstruction {
    let i = &s.instruction;
    pb::SignedInstruction {
        payout_id: i.payout_id.clone(),
        account_id: i.account_id.clone(),
        amount_minor: i.amount_minor,
        currency: i.currency.clone(),
        beneficiary_ref: i.beneficiary_ref.clone(),
        client_reference: i.client_reference.clone(),
        lock_key: i.lock_key.clone(),
        token: i.token,
        issued_at_unix_ms: i.issued_at_unix_ms,
        expires_at_unix_ms: i.expires_at_unix_ms,
        signing_key_id: s.signature.key_id.clone(),
        signature: s.signature.bytes.clone(),
    }
}

pub fn instruction_from_proto(
    i: pb::SignedInstruction,
) -> grant_signing::instruction::SignedInstruction {
    grant_signing::instruction::SignedInstruction {
        signature: signature_of(&i.signing_key_id, &i.signature),
        instruction: grant_signing::instruction::Instruction {
            payout_id: i.payout_id,
            account_id: i.account_id,
            currency: i.currency,
            beneficiary_ref: i.beneficiary_ref,
            client_reference: i.client_reference,
            lock_key: i.lock_key,
            amount_minor: i.amount_minor,
            token: i.token,
            issued_at_unix_ms: i.issued_at_unix_ms,
            expires_at_unix_ms: i.expires_at_unix_ms,
        },
    }
}

pub fn rail_fact_to_proto(f: &model::RailFact) -> pb::RailFact {
    pb::RailFact {
        outcome: f.outcome.clone(),
        rail_ref: f.rail_ref.clone(),
        decline_code: f.decline_code.clone(),
        token: f.token,
        signed_at_unix_ms: f.signed_at_unix_ms,
        signing_key_id: f.signature.key_id.clone(),
        signature: f.signature.bytes.clone(),
    }
}

/// The fact as sent: its texts are only bounded here (they are compared with the payout's record
/// and verified against the signature by the store, which names a refusal precisely).
pub fn rail_fact_from_proto(f: &pb::RailFact) -> Result<model::RailFact, PaymentError> {
    for (field, text) in [
        ("rail_fact.outcome", &f.outcome),
        ("rail_fact.rail_ref", &f.rail_ref),
        ("rail_fact.decline_code", &f.decline_code),
        ("rail_fact.signing_key_id", &f.signing_key_id),
    ] {
        check_fact_text(field, text)?;
    }
    Ok(model::RailFact {
        outcome: f.outcome.clone(),
        rail_ref: f.rail_ref.clone(),
        decline_code: f.decline_code.clone(),
        token: f.token,
        signed_at_unix_ms: f.signed_at_unix_ms,
        signature: signature_of(&f.signing_key_id, &f.signature),
    })
}

pub fn rail_evidence_to_proto(e: &model::RailEvidence) -> pb::RailEvidence {
    pb::RailEvidence {
        evidence: e.evidence.clone(),
        rail_refs: e.rail_refs.clone(),
        asked_by: e.asked_by.clone(),
        asked_at_unix_ms: e.asked_at_unix_ms,
        signing_key_id: e.signature.key_id.clone(),
        signature: e.signature.bytes.clone(),
    }
}

/// Most rail references one evidence may carry: more than one is already a duplicate payment;
/// a bound keeps a forged one from being large.
pub const EVIDENCE_RAIL_REFS_MAX: usize = 64;

pub fn rail_evidence_from_proto(e: &pb::RailEvidence) -> Result<model::RailEvidence, PaymentError> {
    for (field, text) in [
        ("rail_evidence.evidence", &e.evidence),
        ("rail_evidence.asked_by", &e.asked_by),
        ("rail_evidence.signing_key_id", &e.signing_key_id),
    ] {
        check_fact_text(field, text)?;
    }
    if e.rail_refs.len() > EVIDENCE_RAIL_REFS_MAX {
        return Err(PaymentError::invalid(
            "rail_evidence.rail_refs",
            InvalidReason::TextTooLong,
        ));
    }
    for r in &e.rail_refs {
        check_fact_text("rail_evidence.rail_refs", r)?;
    }
    Ok(model::RailEvidence {
        evidence: e.evidence.clone(),
        rail_refs: e.rail_refs.clone(),
        asked_by: e.asked_by.clone(),
        asked_at_unix_ms: e.asked_at_unix_ms,
        signature: signature_of(&e.signing_key_id, &e.signature),
    })
}

fn check_fact_text(field: &str, text: &str) -> Result<(), PaymentError> {
    if text.len() > model::TEXT_LENGTH_MAX {
        return Err(PaymentError::invalid(field, InvalidReason::TextTooLong));
    }
    if text.contains('\0') {
        return Err(PaymentError::invalid(field, InvalidReason::TextHasNul));
    }
    Ok(())
}

pub fn account_to_proto(a: &model::Account) -> pb::Account {
    pb::Account {
        account_id: a.account_id.to_string(),
        currency: a.currency.to_string(),
        balance_minor: a.balance_minor,
        opening_balance_minor: a.opening_balance_minor,
        fence: a.fence,
        version: a.version,
        created_at: rfc3339(a.created_at),
        updated_at: rfc3339(a.updated_at),
    }
}

pub fn audit_to_proto(e: &model::AuditEvent) -> pb::AuditEvent {
    pb::AuditEvent {
        id: e.id,
        payout_id: e.payout_id.clone().unwrap_or_default(),
        account_id: e.account_id.clone().unwrap_or_default(),
        kind: e.kind.clone(),
        actor: e.actor.clone(),
        owner: e.owner.clone().unwrap_or_default(),
        token: e.token.unwrap_or(0),
        from_state: e.from_state.clone().unwrap_or_default(),
        to_state: e.to_state.clone().unwrap_or_default(),
        event: e.event.clone().unwrap_or_default(),
        detail_json: e.detail.to_string(),
        at: rfc3339(e.at),
    }
}

pub fn entry_to_proto(e: &model::LedgerEntry) -> pb::LedgerEntry {
    pb::LedgerEntry {
        id: e.id,
        transaction_group: e.transaction_group.to_string(),
        line_number: i32::from(e.line_number),
        account_id: e.account_id.clone(),
        currency: e.currency.clone(),
        amount_minor: e.amount_minor,
        counterparty: e.counterparty.clone(),
        payout_id: e.payout_id.clone().unwrap_or_default(),
        token: e.token.unwrap_or(0),
        created_at: rfc3339(e.created_at),
    }
}

// ----- errors -> status (server side) and back (client side) -----

/// A refusal as a status: the code, the error's text, and the typed `Rejection` in the details
/// (the encoded message, as `service_kit::rejection` writes it). The server's own failures are
/// not [`PaymentError`]s; the server maps them to a bare status itself.
pub fn error_to_status(err: PaymentError) -> Status {
    use pb::rejection::Kind;
    let message = err.to_string();
    let (code, kind) = match err {
        PaymentError::FencedOut {
            key,
            presented,
            stored,
            owner,
            account_id,
            payout_id,
        } => (
            Code::FailedPrecondition,
            Kind::FencedOut(pb::FencedOut {
                key,
                presented,
                stored,
                owner,
                account_id,
                payout_id,
            }),
        ),
        PaymentError::ForgedGrant {
            key,
            presented,
            owner,
            signing_key_id,
            reason,
            payout_id,
        } => (
            Code::PermissionDenied,
            Kind::ForgedGrant(pb::ForgedGrant {
                key,
                presented,
                owner,
                signing_key_id,
                reason,
                payout_id,
            }),
        ),
        PaymentError::GrantForAnotherKey {
            presented_key,
            required_key,
            presented,
            owner,
            payout_id,
        } => (
            Code::PermissionDenied,
            Kind::GrantForAnotherKey(pb::GrantForAnotherKey {
                presented_key,
                required_key,
                presented,
                owner,
                payout_id,
            }),
        ),
        PaymentError::DatabaseRestored {
            payout_id,
            presented,
            incarnation_current,
            token_floor,
        } => (
            Code::Unavailable,
            Kind::DatabaseRestored(pb::DatabaseRestored {
                payout_id,
                presented,
                incarnation_current,
                token_floor,
            }),
        ),
        PaymentError::RefusedTransition {
            payout_id,
            from,
            event,
            actor,
            required,
        } => (
            Code::FailedPrecondition,
            Kind::RefusedTransition(pb::RefusedTransition {
                from,
                event,
                actor,
                required_actor: required.unwrap_or_default(),
                payout_id,
            }),
        ),
        PaymentError::AccountBusy {
            account_id,
            in_flight_payout_id,
        } => (
            Code::FailedPrecondition,
            Kind::AccountBusy(pb::AccountBusy {
                account_id,
                in_flight_payout_id,
            }),
        ),
        PaymentError::ResolutionSlaNotPassed { payout_id } => (
            Code::FailedPrecondition,
            Kind::ResolutionSlaNotPassed(pb::ResolutionSlaNotPassed { payout_id }),
        ),
        PaymentError::OperatorNotVerified {
            payout_id,
            operator,
            reason,
        } => (
            Code::PermissionDenied,
            Kind::OperatorNotVerified(pb::OperatorNotVerified {
                payout_id,
                operator,
                reason,
            }),
        ),
        PaymentError::RailFactRefused {
            payout_id,
            operation,
            reason,
            detail,
            signing_key_id,
        } => (
            Code::PermissionDenied,
            Kind::RailFactRefused(pb::RailFactRefused {
                payout_id,
                operation,
                reason,
                detail,
                signing_key_id,
            }),
        ),
        PaymentError::FundingNotAuthorised {
            account_id,
            operator,
            reason,
        } => (
            Code::PermissionDenied,
            Kind::FundingNotAuthorised(pb::FundingNotAuthorised {
                account_id,
                operator,
                reason,
            }),
        ),
        PaymentError::OperatorNotCertified { operator } => (
            Code::PermissionDenied,
            Kind::OperatorNotCertified(pb::OperatorNotCertified { operator }),
        ),
        PaymentError::NotQuarantined { outbox_id } => (
            Code::FailedPrecondition,
            Kind::NotQuarantined(pb::NotQuarantined { outbox_id }),
        ),
        PaymentError::InvalidArgument { field, reason } => (
            Code::InvalidArgument,
            Kind::InvalidArgument(pb::InvalidArgument {
                field,
                reason: reason as i32,
            }),
        ),
        PaymentError::AccountNotFound { account_id } => (
            Code::NotFound,
            Kind::AccountNotFound(pb::AccountNotFound { account_id }),
        ),
        PaymentError::PayoutNotFound { payout_id } => (
            Code::NotFound,
            Kind::PayoutNotFound(pb::PayoutNotFound { payout_id }),
        ),
        PaymentError::PayoutExistsWithDifferentContent { payout_id } => (
            Code::AlreadyExists,
            Kind::PayoutExistsWithDifferentContent(pb::PayoutExistsWithDifferentContent {
                payout_id,
            }),
        ),
        PaymentError::AccountExistsWithDifferentContent { account_id } => (
            Code::AlreadyExists,
            Kind::AccountExistsWithDifferentContent(pb::AccountExistsWithDifferentContent {
                account_id,
            }),
        ),
        PaymentError::Transport { code, message } => return Status::new(code, message),
        PaymentError::MalformedResponse(m) => return Status::internal(m),
    };
    payout_proto::rejection::status(code, message, &pb::Rejection { kind: Some(kind) })
}

/// The typed rejection of a status; `None` if it carries no details or they are not one.
fn rejection_of(status: &Status) -> Option<pb::Rejection> {
    payout_proto::rejection::decode(status)
}

/// A status back into the [`PaymentError`] it was made from; a status without a typed rejection
/// (unavailable, deadline, internal) is [`PaymentError::Transport`].
pub fn status_to_error(status: Status) -> PaymentError {
    use pb::rejection::Kind;
    let Some(kind) = rejection_of(&status).and_then(|r| r.kind) else {
        return PaymentError::Transport {
            code: status.code(),
            message: status.message().to_string(),
        };
    };
    match kind {
        Kind::FencedOut(f) => PaymentError::FencedOut {
            key: f.key,
            presented: f.presented,
            stored: f.stored,
            owner: f.owner,
            account_id: f.account_id,
            payout_id: f.payout_id,
        },
        Kind::ForgedGrant(f) => PaymentError::ForgedGrant {
            key: f.key,
            presented: f.presented,
            owner: f.owner,
            signing_key_id: f.signing_key_id,
            reason: f.reason,
            payout_id: f.payout_id,
        },
        Kind::GrantForAnotherKey(g) => PaymentError::GrantForAnotherKey {
            presented_key: g.presented_key,
            required_key: g.required_key,
            presented: g.presented,
            owner: g.owner,
            payout_id: g.payout_id,
        },
        Kind::DatabaseRestored(d) => PaymentError::DatabaseRestored {
            payout_id: d.payout_id,
            presented: d.presented,
            incarnation_current: d.incarnation_current,
            token_floor: d.token_floor,
        },
        Kind::RefusedTransition(r) => PaymentError::RefusedTransition {
            payout_id: r.payout_id,
            from: r.from,
            event: r.event,
            actor: r.actor,
            required: (!r.required_actor.is_empty()).then_some(r.required_actor),
        },
        Kind::AccountBusy(b) => PaymentError::AccountBusy {
            account_id: b.account_id,
            in_flight_payout_id: b.in_flight_payout_id,
        },
        Kind::InvalidArgument(i) => PaymentError::InvalidArgument {
            field: i.field,
            reason: InvalidReason::try_from(i.reason).unwrap_or(InvalidReason::Unspecified),
        },
        Kind::AccountNotFound(a) => PaymentError::AccountNotFound {
            account_id: a.account_id,
        },
        Kind::PayoutNotFound(p) => PaymentError::PayoutNotFound {
            payout_id: p.payout_id,
        },
        Kind::PayoutExistsWithDifferentContent(p) => {
            PaymentError::PayoutExistsWithDifferentContent {
                payout_id: p.payout_id,
            }
        }
        Kind::AccountExistsWithDifferentContent(a) => {
            PaymentError::AccountExistsWithDifferentContent {
                account_id: a.account_id,
            }
        }
        Kind::ResolutionSlaNotPassed(r) => PaymentError::ResolutionSlaNotPassed {
            payout_id: r.payout_id,
        },
        Kind::OperatorNotVerified(r) => PaymentError::OperatorNotVerified {
            payout_id: r.payout_id,
            operator: r.operator,
            reason: r.reason,
        },
        Kind::RailFactRefused(r) => PaymentError::RailFactRefused {
            payout_id: r.payout_id,
            operation: r.operation,
            reason: r.reason,
            detail: r.detail,
            signing_key_id: r.signing_key_id,
        },
        Kind::FundingNotAuthorised(r) => PaymentError::FundingNotAuthorised {
            account_id: r.account_id,
            operator: r.operator,
            reason: r.reason,
        },
        Kind::OperatorNotCertified(r) => PaymentError::OperatorNotCertified {
            operator: r.operator,
        },
        Kind::NotQuarantined(r) => PaymentError::NotQuarantined {
            outbox_id: r.outbox_id,
        },
    }
}

// ----- proto -> model (client side) -----

fn malformed(what: &str, e: impl std::fmt::Display) -> PaymentError {
    PaymentError::MalformedResponse(format!("{what}: {e}"))
}

fn time(what: &str, v: &str) -> Result<chrono::DateTime<chrono::Utc>, PaymentError> {
    chrono::DateTime::parse_from_rfc3339(v)
        .map(|t| t.with_timezone(&chrono::Utc))
        .map_err(|e| malformed(what, e))
}

fn opt_time_from(
    what: &str,
    v: &str,
) -> Result<Option<chrono::DateTime<chrono::Utc>>, PaymentError> {
    if v.is_empty() {
        return Ok(None);
    }
    time(what, v).map(Some)
}

fn non_empty(v: String) -> Option<String> {
    (!v.is_empty()).then_some(v)
}

fn non_zero(v: u64) -> Option<u64> {
    (v != 0).then_some(v)
}

pub fn payout_from_proto(p: pb::Payout) -> Result<model::Payout, PaymentError> {
    Ok(model::Payout {
        payout_id: PayoutId::parse(p.payout_id).map_err(|e| malformed("payout_id", e))?,
        account_id: AccountId::parse(p.account_id).map_err(|e| malformed("account_id", e))?,
        amount_minor: p.amount_minor,
        currency: Currency::parse(&p.currency).map_err(|e| malformed("currency", e))?,
        beneficiary_ref: p.beneficiary_ref,
        state: state_from_proto(p.state).ok_or_else(|| malformed("state", p.state))?,
        client_reference: p.client_reference,
        claimed_by: non_empty(p.claimed_by),
        token_stamp: non_zero(p.token_stamp),
        failure_reason: non_empty(p.failure_reason),
        rail_ref: non_empty(p.rail_ref),
        rail_outcome: non_empty(p.rail_outcome),
        transaction_group: match p.transaction_group.as_str() {
            "" => None,
            g => Some(g.parse().map_err(|e| malformed("transaction_group", e))?),
        },
        created_at: time("created_at", &p.created_at)?,
        claimed_at: opt_time_from("claimed_at", &p.claimed_at)?,
        submitted_at: opt_time_from("submitted_at", &p.submitted_at)?,
        settled_at: opt_time_from("settled_at", &p.settled_at)?,
        updated_at: time("updated_at", &p.updated_at)?,
        instruction: p.instruction.map(instruction_from_proto),
    })
}

pub fn account_from_proto(a: pb::Account) -> Result<model::Account, PaymentError> {
    Ok(model::Account {
        account_id: AccountId::parse(a.account_id).map_err(|e| malformed("account_id", e))?,
        currency: Currency::parse(&a.currency).map_err(|e| malformed("currency", e))?,
        balance_minor: a.balance_minor,
        opening_balance_minor: a.opening_balance_minor,
        fence: a.fence,
        version: a.version,
        created_at: time("created_at", &a.created_at)?,
        updated_at: time("updated_at", &a.updated_at)?,
    })
}

pub fn audit_from_proto(e: pb::AuditEvent) -> Result<model::AuditEvent, PaymentError> {
    Ok(model::AuditEvent {
        id: e.id,
        payout_id: non_empty(e.payout_id),
        account_id: non_empty(e.account_id),
        kind: e.kind,
        actor: e.actor,
        owner: non_empty(e.owner),
        token: non_zero(e.token),
        from_state: non_empty(e.from_state),
        to_state: non_empty(e.to_state),
        event: non_empty(e.event),
        detail: serde_json::from_str(&e.detail_json)
            .map_err(|err| malformed("detail_json", err))?,
        at: time("at", &e.at)?,
    })
}

pub fn entry_from_proto(e: pb::LedgerEntry) -> Result<model::LedgerEntry, PaymentError> {
    Ok(model::LedgerEntry {
        id: e.id,
        transaction_group: e
            .transaction_group
            .parse()
            .map_err(|err| malformed("transaction_group", err))?,
        line_number: i16::try_from(e.line_number).map_err(|err| malformed("line_number", err))?,
        account_id: e.account_id,
        currency: e.currency,
        amount_minor: e.amount_minor,
        counterparty: e.counterparty,
        payout_id: non_empty(e.payout_id),
        token: non_zero(e.token),
        created_at: time("created_at", &e.created_at)?,
    })
}

pub fn fence_to_proto(f: &Fence) -> pb::Fence {
    pb::Fence {
        owner: f.owner().to_string(),
        token: f.token().get(),
        key: f.key().to_string(),
        signing_key_id: f.signature().key_id.clone(),
        signature: f.signature().bytes.clone(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn same(a: &PaymentError, b: &PaymentError) -> bool {
        format!("{a:?}") == format!("{b:?}")
    }

    fn refusals() -> Vec<PaymentError> {
        vec![
            PaymentError::FencedOut {
                key: "account/acct-1".into(),
                presented: 3,
                stored: 7,
                owner: "worker-a".into(),
                account_id: "acct-1".into(),
                payout_id: "p-1".into(),
            },
            PaymentError::ForgedGrant {
                key: "payout:acct-1".into(),
                presented: i64::MAX as u64,
                owner: "mallory".into(),
                signing_key_id: "rogue-1".into(),
                reason: "unknown_key_id".into(),
                payout_id: "p-1".into(),
            },
            PaymentError::GrantForAnotherKey {
                presented_key: "payout:acct-2".into(),
                required_key: "payout:acct-1".into(),
                presented: 31,
                owner: "worker-a".into(),
                payout_id: "p-1".into(),
            },
            PaymentError::RefusedTransition {
                payout_id: "p-1".into(),
                from: "POSTED".into(),
                event: "CLAIM".into(),
                actor: "WORKER".into(),
                required: None,
            },
            PaymentError::RefusedTransition {
                payout_id: "p-1".into(),
                from: "RAIL_AMBIGUOUS".into(),
                event: "ABANDON".into(),
                actor: "WORKER".into(),
                required: Some("OPERATOR".into()),
            },
            PaymentError::AccountBusy {
                account_id: "acct-1".into(),
                in_flight_payout_id: "p-2".into(),
            },
            PaymentError::DatabaseRestored {
                payout_id: "p-1".into(),
                presented: 15,
                incarnation_current: false,
                token_floor: 0,
            },
            PaymentError::DatabaseRestored {
                payout_id: "p-1".into(),
                presented: 15,
                incarnation_current: true,
                token_floor: 25,
            },
            PaymentError::ResolutionSlaNotPassed {
                payout_id: "p-1".into(),
            },
            PaymentError::invalid("fence.token", InvalidReason::TokenOutOfRange),
            PaymentError::AccountNotFound {
                account_id: "acct-9".into(),
            },
            PaymentError::PayoutNotFound {
                payout_id: "p-9".into(),
            },
            PaymentError::PayoutExistsWithDifferentContent {
                payout_id: "p-1".into(),
            },
            PaymentError::AccountExistsWithDifferentContent {
                account_id: "acct-1".into(),
            },
            PaymentError::OperatorNotCertified {
                operator: "mallory".into(),
            },
            PaymentError::NotQuarantined { outbox_id: 42 },
            PaymentError::FundingNotAuthorised {
                account_id: "acct-1".into(),
                operator: "mallory".into(),
                reason: "unknown_operator".into(),
            },
            PaymentError::RailFactRefused {
                payout_id: "p-1".into(),
                operation: "record_outcome".into(),
                reason: "unsigned".into(),
                detail: "DECLINED needs the proxy's signed REJECTED outcome".into(),
                signing_key_id: String::new(),
            },
        ]
    }

    /// Every typed refusal the server encodes comes back as the same variant, fields and all.
    #[test]
    fn refusals_survive_the_status() {
        for (refusal, sent) in refusals().into_iter().zip(refusals()) {
            let status = error_to_status(sent);
            assert!(!status.details().is_empty(), "{refusal:?}: no typed detail");
            let back = status_to_error(status);
            assert!(same(&back, &refusal), "sent {refusal:?}, got {back:?}");
        }
    }

    /// A status without a typed rejection is a transport failure, with its code and text.
    #[test]
    fn a_bare_status_is_transport() {
        let back = status_to_error(Status::unavailable("database: connection refused"));
        assert!(
            matches!(
                &back,
                PaymentError::Transport { code: Code::Unavailable, message }
                    if message == "database: connection refused"
            ),
            "{back:?}"
        );
    }

    #[test]
    fn a_payout_survives_the_wire() {
        let at = chrono::DateTime::parse_from_rfc3339("2024-05-01T12:00:00.123456Z")
            .unwrap()
            .with_timezone(&chrono::Utc);
        let payout = model::Payout {
            payout_id: PayoutId::parse("p-1").unwrap(),
            account_id: AccountId::parse("acct-1").unwrap(),
            amount_minor: 1_000,
            currency: Currency::parse("EUR").unwrap(),
            beneficiary_ref: "ben-1".into(),
            state: PayoutState::RailAcked,
            client_reference: "ref-1".into(),
            claimed_by: Some("worker-a".into()),
            token_stamp: Some(7),
            failure_reason: None,
            rail_ref: Some("rail-1".into()),
            rail_outcome: Some("ACKED".into()),
            transaction_group: None,
            created_at: at,
            claimed_at: Some(at),
            submitted_at: Some(at),
            settled_at: None,
            updated_at: at,
            instruction: None,
        };
        assert_eq!(payout_from_proto(payout_to_proto(&payout)).unwrap(), payout);
        // MarkSubmitted's answer carries the signed instruction.
        let (signer, _) = grant_signing::Signer::generate("pr-1").unwrap();
        let instructed = model::Payout {
            instruction: Some(
                signer.sign_instruction(grant_signing::instruction::Instruction {
                    payout_id: "p-1".into(),
                    account_id: "acct-1".into(),
                    currency: "EUR".into(),
                    beneficiary_ref: "ben-1".into(),
                    client_reference: "ref-1".into(),
                    lock_key: "payout:acct-1".into(),
                    amount_minor: 1_000,
                    token: 7,
                    issued_at_unix_ms: 1,
                    expires_at_unix_ms: 2,
                }),
            ),
            ..payout
        };
        assert_eq!(
            payout_from_proto(payout_to_proto(&instructed)).unwrap(),
            instructed
        );
    }

    /// The rail facts cross as sent; a NUL or an oversized text is a specific invalid argument.
    #[test]
    fn rail_facts_survive_the_wire_and_bad_text_names_its_field() {
        let (signer, _) = grant_signing::Signer::generate("proxy-1").unwrap();
        let fact = model::RailFact {
            outcome: "ACKED".into(),
            rail_ref: "rr-1".into(),
            decline_code: String::new(),
            token: 7,
            signed_at_unix_ms: 5,
            signature: signer.sign("x", 1, "y"),
        };
        assert_eq!(
            rail_fact_from_proto(&rail_fact_to_proto(&fact)).unwrap(),
            fact
        );
        let evidence = model::RailEvidence {
            evidence: "FOUND".into(),
            rail_refs: vec!["rr-1".into()],
            asked_by: "resolver".into(),
            asked_at_unix_ms: 5,
            signature: signer.sign("x", 1, "y"),
        };
        assert_eq!(
            rail_evidence_from_proto(&rail_evidence_to_proto(&evidence)).unwrap(),
            evidence
        );
        let mut nul = rail_fact_to_proto(&fact);
        nul.rail_ref = "a\0".into();
        assert!(matches!(
            rail_fact_from_proto(&nul),
            Err(PaymentError::InvalidArgument { field, reason: InvalidReason::TextHasNul })
                if field == "rail_fact.rail_ref"
        ));
        let mut many = rail_evidence_to_proto(&evidence);
        many.rail_refs = vec!["r".into(); EVIDENCE_RAIL_REFS_MAX + 1];
        assert!(matches!(
            rail_evidence_from_proto(&many),
            Err(PaymentError::InvalidArgument { field, .. }) if field == "rail_evidence.rail_refs"
        ));
    }

    /// Both grant refusals and the uncertified operator travel as PERMISSION_DENIED, the others
    /// keep their codes.
    #[test]
    fn grant_refusals_are_permission_denied() {
        for refusal in refusals() {
            let grant = matches!(
                refusal,
                PaymentError::ForgedGrant { .. }
                    | PaymentError::GrantForAnotherKey { .. }
                    | PaymentError::OperatorNotCertified { .. }
                    | PaymentError::RailFactRefused { .. }
                    | PaymentError::FundingNotAuthorised { .. }
            );
            let code = error_to_status(refusal).code();
            assert_eq!(code == Code::PermissionDenied, grant, "{code:?}");
        }
    }

    #[test]
    fn a_fence_survives_the_wire() {
        let fence = Fence::new("worker-a", FencingToken::new(42).unwrap()).unwrap();
        assert_eq!(parse_fence(Some(&fence_to_proto(&fence))).unwrap(), fence);
        assert_eq!(fence.signature(), &model::Signature::default(), "unsigned");
        let signed = fence.signed(
            "payout:acct-1",
            model::Signature {
                key_id: "k1".into(),
                bytes: vec![7; 64],
            },
        );
        let wire = fence_to_proto(&signed);
        assert_eq!(
            (
                wire.key.as_str(),
                wire.signing_key_id.as_str(),
                wire.signature.len()
            ),
            ("payout:acct-1", "k1", 64)
        );
        let back = parse_fence(Some(&wire)).unwrap();
        assert_eq!(back, signed);
        assert_eq!(
            (back.key(), back.signature().key_id.as_str()),
            ("payout:acct-1", "k1")
        );
        for (field, edit) in [
            (
                "fence.key",
                (&|f: &mut pb::Fence| f.key = "payout:\0".into()) as &dyn Fn(&mut pb::Fence),
            ),
            ("fence.signing_key_id", &|f: &mut pb::Fence| {
                f.signing_key_id = "k".repeat(2000)
            }),
        ] {
            let mut bad = wire.clone();
            edit(&mut bad);
            assert!(
                matches!(parse_fence(Some(&bad)), Err(PaymentError::InvalidArgument { field: f, .. }) if f == field),
                "{field}"
            );
        }
        assert!(matches!(
            parse_fence(None),
            Err(PaymentError::InvalidArgument {
                reason: InvalidReason::FenceMissing,
                ..
            })
        ));
    }
}
