//! The process boundary: `railproxy.v1` messages to and from the proxy's domain, in this one
//! place. The server parses requests with [`parse_submit`] and [`parse_inquire`] and answers with
//! the `*_to_proto` functions; the client builds requests with [`submit_request`] and
//! [`inquire_request`] and reads answers with the `*_from_proto` functions.

use grant_signing::instruction::{Instruction, SignedInstruction};
use grant_signing::{Signature, KEY_ID_LENGTH_MAX};
use payout_domain::{
    AccountId, AmountMinor, BeneficiaryRef, ClientReference, Currency, FencingToken, PayoutId,
};
use payout_proto::railproxy as pb;
use tonic::{Code, Status};

use crate::client::ProxyError;
use crate::model::{
    Evidence, FactSignature, InquirePayout, InvalidArgument, Outcome, Payment, Resolution,
    Submission, SubmitPayout, KEY_LENGTH_MAX, OWNER_LENGTH_MAX,
};

/// Longest `asked_by` accepted; diagnostics, bounded like every other input.
pub const ASKED_BY_LENGTH_MAX: usize = 256;

/// A holder identity (`owner`, `asked_by`): 1 to `length_max` bytes, without NUL, which
/// PostgreSQL text cannot hold (the intent transaction would fail after the guard ran).
fn check_holder(
    field: &'static str,
    value: &str,
    length_max: usize,
) -> Result<(), InvalidArgument> {
    if value.is_empty() {
        return Err(InvalidArgument::new(field, format!("{field} is empty")));
    }
    if value.len() > length_max {
        return Err(InvalidArgument::new(
            field,
            format!("{field} is longer than {length_max} bytes"),
        ));
    }
    if value.contains('\0') {
        return Err(InvalidArgument::new(
            field,
            format!("{field} contains a NUL character"),
        ));
    }
    Ok(())
}

fn check_owner(owner: &str) -> Result<(), InvalidArgument> {
    check_holder("owner", owner, OWNER_LENGTH_MAX)
}

/// A text the guard keeps in a refusal's guard event (`key`, `signing_key_id`): at most
/// `length_max` bytes, without NUL. Empty is allowed: an unsigned grant is refused as forged, not
/// as bad input.
fn check_kept_text(
    field: &'static str,
    value: &str,
    length_max: usize,
) -> Result<(), InvalidArgument> {
    if value.len() > length_max {
        return Err(InvalidArgument::new(
            field,
            format!("{field} is longer than {length_max} bytes"),
        ));
    }
    if value.contains('\0') {
        return Err(InvalidArgument::new(
            field,
            format!("{field} contains a NUL character"),
        ));
    }
    Ok(())
}

/// The grant a fenced request presents beyond its token and owner: the signed lock key and the
/// lock service's signature. Only their form is checked here; the signature itself is verified
/// by the proxy before its high-water statement.
fn parse_grant(
    key: &str,
    signing_key_id: &str,
    signature: &[u8],
) -> Result<(String, Signature), InvalidArgument> {
    check_kept_text("key", key, KEY_LENGTH_MAX)?;
    check_kept_text("signing_key_id", signing_key_id, KEY_ID_LENGTH_MAX)?;
    Ok((
        key.to_string(),
        Signature {
            key_id: signing_key_id.to_string(),
            bytes: signature.to_vec(),
        },
    ))
}

/// Parses a fenced inquiry: the payout, the resolver's fence, who asks.
pub fn parse_inquire(request: &pb::InquireRequest) -> Result<InquirePayout, InvalidArgument> {
    let payout_id = PayoutId::parse(request.payout_id.as_str())
        .map_err(|e| InvalidArgument::new("payout_id", e))?;
    check_holder("asked_by", &request.asked_by, ASKED_BY_LENGTH_MAX)?;
    let account_id = AccountId::parse(request.account_id.as_str())
        .map_err(|e| InvalidArgument::new("account_id", e))?;
    let token = FencingToken::new(request.token).map_err(|e| InvalidArgument::new("token", e))?;
    check_owner(&request.owner)?;
    let (key, signature) = parse_grant(&request.key, &request.signing_key_id, &request.signature)?;
    Ok(InquirePayout {
        payout_id,
        account_id,
        token,
        owner: request.owner.clone(),
        asked_by: request.asked_by.clone(),
        key,
        signature,
    })
}

pub fn inquire_request(request: &InquirePayout) -> pb::InquireRequest {
    pb::InquireRequest {
        payout_id: request.payout_id.to_string(),
        asked_by: request.asked_by.clone(),
        account_id: request.account_id.to_string(),
        token: request.token.get(),
        owner: request.owner.clone(),
        key: request.key.clone(),
        signing_key_id: request.signature.key_id.clone(),
        signature: request.signature.bytes.clone(),
    }
}

/// Parses a submit request. Every check is specific; the first failing field is reported.
pub fn parse_submit(request: &pb::SubmitRequest) -> Result<SubmitPayout, InvalidArgument> {
    let payout_id = PayoutId::parse(request.payout_id.as_str())
        .map_err(|e| InvalidArgument::new("payout_id", e))?;
    let account_id = AccountId::parse(request.account_id.as_str())
        .map_err(|e| InvalidArgument::new("account_id", e))?;
    let token = FencingToken::new(request.token).map_err(|e| InvalidArgument::new("token", e))?;
    check_owner(&request.owner)?;
    if request.client_reference.is_empty() {
        return Err(InvalidArgument::new(
            "client_reference",
            "client reference is empty",
        ));
    }
    let derived = ClientReference::for_payout(&payout_id);
    if request.client_reference != derived.as_str() {
        return Err(InvalidArgument::new(
            "client_reference",
            format!(
                "must be {derived}, derived from the payout id (it is never chosen by the caller)"
            ),
        ));
    }
    let amount_minor = AmountMinor::new(request.amount_minor)
        .map_err(|e| InvalidArgument::new("amount_minor", e))?;
    let currency =
        Currency::parse(&request.currency).map_err(|e| InvalidArgument::new("currency", e))?;
    let beneficiary_ref = BeneficiaryRef::parse(request.beneficiary_ref.as_str())
        .map_err(|e| InvalidArgument::new("beneficiary_ref", e))?;
    let (key, signature) = parse_grant(&request.key, &request.signing_key_id, &request.signature)?;
    let instruction = request
        .instruction
        .as_ref()
        .map(instruction_from_proto)
        .transpose()?;
    Ok(SubmitPayout {
        payout_id,
        account_id,
        token,
        owner: request.owner.clone(),
        client_reference: derived,
        amount_minor,
        currency,
        beneficiary_ref,
        key,
        signature,
        instruction,
    })
}

/// The instruction as it travels. Its fields are kept as sent (bounded), not parsed as domain
/// values: the proxy compares them with the request's and verifies the signature over them, and
/// an altered field must reach that check to be named (`mismatch{field}`), not be lost as an
/// invalid argument.
fn instruction_from_proto(
    i: &pb::PaymentInstruction,
) -> Result<SignedInstruction, InvalidArgument> {
    for (field, text) in [
        ("instruction.payout_id", &i.payout_id),
        ("instruction.account_id", &i.account_id),
        ("instruction.currency", &i.currency),
        ("instruction.beneficiary_ref", &i.beneficiary_ref),
        ("instruction.client_reference", &i.client_reference),
        ("instruction.lock_key", &i.lock_key),
    ] {
        check_kept_text(field, text, KEY_LENGTH_MAX)?;
    }
    check_kept_text(
        "instruction.signing_key_id",
        &i.signing_key_id,
        KEY_ID_LENGTH_MAX,
    )?;
    Ok(SignedInstruction {
        instruction: Instruction {
            payout_id: i.payout_id.clone(),
            account_id: i.account_id.clone(),
            currency: i.currency.clone(),
            beneficiary_ref: i.beneficiary_ref.clone(),
            client_reference: i.client_reference.clone(),
            lock_key: i.lock_key.clone(),
            amount_minor: i.amount_minor,
            token: i.token,
            issued_at_unix_ms: i.issued_at_unix_ms,
            expires_at_unix_ms: i.expires_at_unix_ms,
        },
        signature: Signature {
            key_id: i.signing_key_id.clone(),
            bytes: i.signature.clone(),
        },
    })
}

fn instruction_to_proto(s: &SignedInstruction) -> pb::PaymentInstruction {
    let i = &s.instruction;
    pb::PaymentInstruction {
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

fn fact_signature_to_proto(f: &FactSignature) -> pb::FactSignature {
    pb::FactSignature {
        signing_key_id: f.signature.key_id.clone(),
        signature: f.signature.bytes.clone(),
        signed_at_unix_ms: f.signed_at_unix_ms,
    }
}

fn fact_signature_from_proto(f: &pb::FactSignature) -> FactSignature {
    FactSignature {
        signature: Signature {
            key_id: f.signing_key_id.clone(),
            bytes: f.signature.clone(),
        },
        signed_at_unix_ms: f.signed_at_unix_ms,
    }
}

pub fn submit_request(request: &SubmitPayout) -> pb::SubmitRequest {
    pb::SubmitRequest {
        payout_id: request.payout_id.to_string(),
        account_id: request.account_id.to_string(),
        token: request.token.get(),
        owner: request.owner.clone(),
        client_reference: request.client_reference.to_string(),
        amount_minor: request.amount_minor.get(),
        currency: request.currency.to_string(),
        beneficiary_ref: request.beneficiary_ref.to_string(),
        key: request.key.clone(),
        signing_key_id: request.signature.key_id.clone(),
        signature: request.signature.bytes.clone(),
        instruction: request.instruction.as_ref().map(instruction_to_proto),
    }
}

pub fn outcome_to_proto(outcome: &Outcome) -> pb::Outcome {
    match outcome {
        Outcome::Pending => pb::Outcome::Pending,
        Outcome::Acked { .. } => pb::Outcome::Acked,
        Outcome::Rejected { .. } => pb::Outcome::Rejected,
        Outcome::Timeout { .. } => pb::Outcome::Timeout,
        Outcome::NotSent { .. } => pb::Outcome::NotSent,
    }
}

pub fn submission_to_proto(s: &Submission) -> pb::Submission {
    let (rail_ref, decline_code, failure_detail, sealed_by) = match &s.outcome {
        Outcome::Pending => (String::new(), String::new(), String::new(), String::new()),
        Outcome::Acked { rail_ref } => (
            rail_ref.clone(),
            String::new(),
            String::new(),
            String::new(),
        ),
        Outcome::Rejected { decline_code } => (
            String::new(),
            decline_code.clone(),
            String::new(),
            String::new(),
        ),
        Outcome::Timeout { detail } => {
            (String::new(), String::new(), detail.clone(), String::new())
        }
        Outcome::NotSent { sealed_by } => (
            String::new(),
            String::new(),
            String::new(),
            sealed_by.clone(),
        ),
    };
    let (amount_minor, currency, beneficiary_ref) = match &s.payment {
        Some(p) => (
            p.amount_minor.get(),
            p.currency.to_string(),
            p.beneficiary_ref.to_string(),
        ),
        None => (0, String::new(), String::new()),
    };
    pb::Submission {
        payout_id: s.payout_id.to_string(),
        account_id: s.account_id.to_string(),
        token: s.token.get(),
        owner: s.owner.clone(),
        client_reference: s.client_reference.to_string(),
        amount_minor,
        currency,
        beneficiary_ref,
        outcome: outcome_to_proto(&s.outcome) as i32,
        ambiguous: s.outcome.is_ambiguous(),
        rail_ref,
        decline_code,
        failure_detail,
        created_at_unix_ms: s.created_at_unix_ms,
        resolved_at_unix_ms: s.resolved_at_unix_ms.unwrap_or(0),
        valid_until_unix_ms: s.valid_until_unix_ms.unwrap_or(0),
        sealed_by,
        outcome_signature: s.outcome_signature.as_ref().map(fact_signature_to_proto),
    }
}

/// A malformed message from the server: a bug on one side of the boundary.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("malformed {what} from the rail proxy: {detail}")]
pub struct Malformed {
    pub what: &'static str,
    pub detail: String,
}

fn malformed(what: &'static str, detail: impl std::fmt::Display) -> Malformed {
    Malformed {
        what,
        detail: detail.to_string(),
    }
}

pub fn submission_from_proto(s: &pb::Submission) -> Result<Submission, Malformed> {
    let what = "submission";
    let outcome = match pb::Outcome::try_from(s.outcome).map_err(|e| malformed(what, e))? {
        pb::Outcome::Pending => Outcome::Pending,
        pb::Outcome::Acked => Outcome::Acked {
            rail_ref: s.rail_ref.clone(),
        },
        pb::Outcome::Rejected => Outcome::Rejected {
            decline_code: s.decline_code.clone(),
        },
        pb::Outcome::Timeout => Outcome::Timeout {
            detail: s.failure_detail.clone(),
        },
        pb::Outcome::NotSent => Outcome::NotSent {
            sealed_by: s.sealed_by.clone(),
        },
        pb::Outcome::Unspecified => return Err(malformed(what, "outcome unspecified")),
    };
    if s.ambiguous != outcome.is_ambiguous() {
        return Err(malformed(what, "ambiguous flag disagrees with the outcome"));
    }
    let payment = if matches!(outcome, Outcome::NotSent { .. }) {
        if s.sealed_by.is_empty() || s.amount_minor != 0 || s.valid_until_unix_ms != 0 {
            return Err(malformed(
                what,
                "a sealed record names its sealer and carries no payment",
            ));
        }
        None
    } else {
        Some(Payment {
            amount_minor: AmountMinor::new(s.amount_minor).map_err(|e| malformed(what, e))?,
            currency: Currency::parse(&s.currency).map_err(|e| malformed(what, e))?,
            beneficiary_ref: BeneficiaryRef::parse(s.beneficiary_ref.as_str())
                .map_err(|e| malformed(what, e))?,
        })
    };
    Ok(Submission {
        payout_id: PayoutId::parse(s.payout_id.as_str()).map_err(|e| malformed(what, e))?,
        account_id: AccountId::parse(s.account_id.as_str()).map_err(|e| malformed(what, e))?,
        token: FencingToken::new(s.token).map_err(|e| malformed(what, e))?,
        owner: s.owner.clone(),
        client_reference: ClientReference::parse(&s.client_reference)
            .map_err(|e| malformed(what, e))?,
        payment,
        outcome,
        created_at_unix_ms: s.created_at_unix_ms,
        resolved_at_unix_ms: (s.resolved_at_unix_ms != 0).then_some(s.resolved_at_unix_ms),
        valid_until_unix_ms: (s.valid_until_unix_ms != 0).then_some(s.valid_until_unix_ms),
        outcome_signature: s.outcome_signature.as_ref().map(fact_signature_from_proto),
    })
}

pub fn resolution_to_proto(r: &Resolution) -> pb::Resolution {
    let (evidence, rail_refs, detail) = match &r.evidence {
        Evidence::Found { rail_refs } => (pb::Evidence::Found, rail_refs.clone(), String::new()),
        Evidence::Absent => (pb::Evidence::Absent, vec![], String::new()),
        Evidence::Unknown { detail } => (pb::Evidence::Unknown, vec![], detail.clone()),
        Evidence::NeverSent => (pb::Evidence::NeverSent, vec![], String::new()),
    };
    pb::Resolution {
        payout_id: r.payout_id.to_string(),
        asked_by: r.asked_by.clone(),
        asked_at_unix_ms: r.asked_at_unix_ms,
        evidence: evidence as i32,
        rail_refs,
        detail,
        account_id: r
            .account_id
            .as_ref()
            .map(ToString::to_string)
            .unwrap_or_default(),
        evidence_signature: r.signature.as_ref().map(fact_signature_to_proto),
    }
}

pub fn resolution_from_proto(r: &pb::Resolution) -> Result<Resolution, Malformed> {
    let what = "resolution";
    let evidence = match pb::Evidence::try_from(r.evidence).map_err(|e| malformed(what, e))? {
        pb::Evidence::Found => Evidence::Found {
            rail_refs: r.rail_refs.clone(),
        },
        pb::Evidence::Absent => Evidence::Absent,
        pb::Evidence::Unknown => Evidence::Unknown {
            detail: r.detail.clone(),
        },
        pb::Evidence::NeverSent => Evidence::NeverSent,
        pb::Evidence::Unspecified => return Err(malformed(what, "evidence unspecified")),
    };
    Ok(Resolution {
        payout_id: PayoutId::parse(r.payout_id.as_str()).map_err(|e| malformed(what, e))?,
        asked_by: r.asked_by.clone(),
        asked_at_unix_ms: r.asked_at_unix_ms,
        evidence,
        account_id: if r.account_id.is_empty() {
            None
        } else {
            Some(AccountId::parse(r.account_id.as_str()).map_err(|e| malformed(what, e))?)
        },
        signature: r.evidence_signature.as_ref().map(fact_signature_from_proto),
    })
}

/// A typed refusal as the proxy answers it: the status code, a message, and the encoded
/// `Rejection` in the details. [`status_to_error`] reads it back. (`Malformed` and `Rpc` carry no
/// typed rejection: they become a bare INTERNAL status and the status itself.)
pub fn error_to_status(error: &ProxyError) -> Status {
    use pb::rejection::Kind;
    let (code, kind) = match error {
        ProxyError::FencedOut {
            key,
            presented,
            stored,
            owner,
            stored_owner,
            payout_id,
        } => (
            Code::FailedPrecondition,
            Kind::FencedOut(pb::FencedOut {
                key: key.clone(),
                presented: *presented,
                stored: *stored,
                owner: owner.clone(),
                stored_owner: stored_owner.clone(),
                payout_id: payout_id.clone(),
            }),
        ),
        ProxyError::Duplicate {
            existing,
            payload_matches,
        } => (
            Code::AlreadyExists,
            Kind::Duplicate(pb::Duplicate {
                existing: Some(submission_to_proto(existing)),
                payload_matches: *payload_matches,
            }),
        ),
        ProxyError::InvalidArgument { field, reason } => (
            Code::InvalidArgument,
            Kind::InvalidArgument(pb::InvalidArgument {
                field: field.clone(),
                reason: reason.clone(),
            }),
        ),
        ProxyError::NotFound { payout_id } => (
            Code::NotFound,
            Kind::NotFound(pb::NotFound {
                payout_id: payout_id.clone(),
            }),
        ),
        ProxyError::OutcomeNotRecorded {
            rail_outcome,
            detail,
        } => (
            Code::Internal,
            Kind::OutcomeNotRecorded(pb::OutcomeNotRecorded {
                payout_id: String::new(),
                rail_outcome: rail_outcome
                    .as_ref()
                    .map_or(pb::Outcome::Unspecified, outcome_to_proto)
                    as i32,
                detail: detail.clone(),
            }),
        ),
        ProxyError::ForgedGrant {
            key,
            presented,
            owner,
            signing_key_id,
            reason,
            payout_id,
        } => (
            Code::PermissionDenied,
            Kind::ForgedGrant(pb::ForgedGrant {
                key: key.clone(),
                presented: *presented,
                owner: owner.clone(),
                signing_key_id: signing_key_id.clone(),
                reason: reason.clone(),
                payout_id: payout_id.clone(),
            }),
        ),
        ProxyError::GrantForAnotherKey {
            presented_key,
            required_key,
            presented,
            owner,
            payout_id,
        } => (
            Code::PermissionDenied,
            Kind::GrantForAnotherKey(pb::GrantForAnotherKey {
                presented_key: presented_key.clone(),
                required_key: required_key.clone(),
                presented: *presented,
                owner: owner.clone(),
                payout_id: payout_id.clone(),
            }),
        ),
        ProxyError::DatabaseRestored {
            payout_id,
            presented,
            incarnation_current,
            token_floor,
        } => (
            Code::Unavailable,
            Kind::DatabaseRestored(pb::DatabaseRestored {
                payout_id: payout_id.clone(),
                presented: *presented,
                incarnation_current: *incarnation_current,
                token_floor: *token_floor,
            }),
        ),
        ProxyError::InstructionRefused {
            payout_id,
            reason,
            field,
            signing_key_id,
            detail,
        } => (
            Code::PermissionDenied,
            Kind::InstructionRefused(pb::InstructionRefused {
                payout_id: payout_id.clone(),
                reason: reason.clone(),
                field: field.clone(),
                signing_key_id: signing_key_id.clone(),
                detail: detail.clone(),
            }),
        ),
        ProxyError::Malformed(m) => return Status::internal(m.to_string()),
        ProxyError::Rpc(status) => return status.clone(),
    };
    payout_proto::rejection::status(code, error.to_string(), &pb::Rejection { kind: Some(kind) })
}

/// The typed refusal a status carries; [`ProxyError::Rpc`] if it carries none.
pub fn status_to_error(status: Status) -> ProxyError {
    use pb::rejection::Kind;
    let Some(pb::Rejection { kind: Some(kind) }) = payout_proto::rejection::decode(&status) else {
        return ProxyError::Rpc(status);
    };
    match kind {
        Kind::FencedOut(f) => ProxyError::FencedOut {
            key: f.key,
            presented: f.presented,
            stored: f.stored,
            owner: f.owner,
            stored_owner: f.stored_owner,
            payout_id: f.payout_id,
        },
        Kind::Duplicate(d) => match d.existing.as_ref().map(submission_from_proto) {
            Some(Ok(existing)) => ProxyError::Duplicate {
                existing: Box::new(existing),
                payload_matches: d.payload_matches,
            },
            Some(Err(e)) => ProxyError::Malformed(e),
            None => ProxyError::Malformed(malformed("duplicate", "no existing submission")),
        },
        Kind::InvalidArgument(i) => ProxyError::InvalidArgument {
            field: i.field,
            reason: i.reason,
        },
        Kind::NotFound(n) => ProxyError::NotFound {
            payout_id: n.payout_id,
        },
        Kind::OutcomeNotRecorded(o) => {
            let rail_outcome = match pb::Outcome::try_from(o.rail_outcome) {
                Ok(pb::Outcome::Acked) => Some(Outcome::Acked {
                    rail_ref: String::new(),
                }),
                Ok(pb::Outcome::Rejected) => Some(Outcome::Rejected {
                    decline_code: String::new(),
                }),
                Ok(pb::Outcome::Timeout) => Some(Outcome::Timeout {
                    detail: String::new(),
                }),
                _ => None,
            };
            ProxyError::OutcomeNotRecorded {
                rail_outcome,
                detail: o.detail,
            }
        }
        Kind::ForgedGrant(f) => ProxyError::ForgedGrant {
            key: f.key,
            presented: f.presented,
            owner: f.owner,
            signing_key_id: f.signing_key_id,
            reason: f.reason,
            payout_id: f.payout_id,
        },
        Kind::GrantForAnotherKey(g) => ProxyError::GrantForAnotherKey {
            presented_key: g.presented_key,
            required_key: g.required_key,
            presented: g.presented,
            owner: g.owner,
            payout_id: g.payout_id,
        },
        Kind::DatabaseRestored(d) => ProxyError::DatabaseRestored {
            payout_id: d.payout_id,
            presented: d.presented,
            incarnation_current: d.incarnation_current,
            token_floor: d.token_floor,
        },
        Kind::InstructionRefused(i) => ProxyError::InstructionRefused {
            payout_id: i.payout_id,
            reason: i.reason,
            field: i.field,
            signing_key_id: i.signing_key_id,
            detail: i.detail,
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use grant_signing::Forged;

    fn good() -> pb::SubmitRequest {
        pb::SubmitRequest {
            payout_id: "p-1".into(),
            account_id: "a-1".into(),
            token: 5,
            owner: "worker-1".into(),
            client_reference: "cref-p-1".into(),
            amount_minor: 100,
            currency: "EUR".into(),
            beneficiary_ref: "ben-1".into(),
            key: "payout:a-1".into(),
            signing_key_id: "k1".into(),
            signature: vec![7; grant_signing::SIGNATURE_LEN],
            instruction: None,
        }
    }

    type Mutation = Box<dyn Fn(&mut pb::SubmitRequest)>;

    #[test]
    fn bad_inputs_name_their_field() {
        let cases: Vec<(&str, Mutation)> = vec![
            ("payout_id", Box::new(|r| r.payout_id.clear())),
            ("account_id", Box::new(|r| r.account_id.clear())),
            ("token", Box::new(|r| r.token = 0)),
            ("owner", Box::new(|r| r.owner.clear())),
            ("owner", Box::new(|r| r.owner = "worker\0".into())),
            (
                "owner",
                Box::new(|r| r.owner = "w".repeat(OWNER_LENGTH_MAX + 1)),
            ),
            ("client_reference", Box::new(|r| r.client_reference.clear())),
            (
                "client_reference",
                Box::new(|r| r.client_reference = "cref-p-2".into()),
            ),
            ("amount_minor", Box::new(|r| r.amount_minor = 0)),
            ("amount_minor", Box::new(|r| r.amount_minor = -1)),
            ("currency", Box::new(|r| r.currency = "XXX".into())),
            ("currency", Box::new(|r| r.currency = "eur".into())),
            ("beneficiary_ref", Box::new(|r| r.beneficiary_ref.clear())),
            ("key", Box::new(|r| r.key = "payout:\0".into())),
            ("key", Box::new(|r| r.key = "k".repeat(KEY_LENGTH_MAX + 1))),
            (
                "signing_key_id",
                Box::new(|r| r.signing_key_id = "k\0".into()),
            ),
            (
                "signing_key_id",
                Box::new(|r| r.signing_key_id = "k".repeat(KEY_ID_LENGTH_MAX + 1)),
            ),
        ];
        for (field, mutate) in cases {
            let mut request = good();
            mutate(&mut request);
            assert_eq!(
                parse_submit(&request).unwrap_err().field,
                field,
                "{request:?}"
            );
        }
        assert!(parse_submit(&good()).is_ok());
    }

    #[test]
    fn an_inquiry_must_present_a_fence() {
        let good = pb::InquireRequest {
            payout_id: "p-1".into(),
            asked_by: "worker-2".into(),
            account_id: "a-1".into(),
            token: 7,
            owner: "worker-2".into(),
            key: "payout:a-1".into(),
            signing_key_id: "k1".into(),
            signature: vec![9; grant_signing::SIGNATURE_LEN],
        };
        let parsed = parse_inquire(&good).unwrap();
        assert_eq!(inquire_request(&parsed), good);
        type InquireMutation = Box<dyn Fn(&mut pb::InquireRequest)>;
        let cases: Vec<(&str, InquireMutation)> = vec![
            ("payout_id", Box::new(|r| r.payout_id.clear())),
            ("asked_by", Box::new(|r| r.asked_by.clear())),
            ("asked_by", Box::new(|r| r.asked_by = "\0".into())),
            ("account_id", Box::new(|r| r.account_id.clear())),
            ("token", Box::new(|r| r.token = 0)),
            ("owner", Box::new(|r| r.owner.clear())),
            ("key", Box::new(|r| r.key = "\0".into())),
            (
                "signing_key_id",
                Box::new(|r| r.signing_key_id = "\0".into()),
            ),
        ];
        for (field, mutate) in cases {
            let mut request = good.clone();
            mutate(&mut request);
            assert_eq!(parse_inquire(&request).unwrap_err().field, field);
        }
    }

    #[test]
    fn submissions_round_trip() {
        let request = parse_submit(&good()).unwrap();
        for outcome in [
            Outcome::Pending,
            Outcome::Acked {
                rail_ref: "rr-1".into(),
            },
            Outcome::Rejected {
                decline_code: "NO".into(),
            },
            Outcome::Timeout {
                detail: "timed out".into(),
            },
            Outcome::NotSent {
                sealed_by: "worker-2".into(),
            },
        ] {
            let sealed = matches!(outcome, Outcome::NotSent { .. });
            let s = Submission {
                payout_id: request.payout_id.clone(),
                account_id: request.account_id.clone(),
                token: request.token,
                owner: request.owner.clone(),
                client_reference: request.client_reference.clone(),
                payment: (!sealed).then(|| Payment {
                    amount_minor: request.amount_minor,
                    currency: request.currency.clone(),
                    beneficiary_ref: request.beneficiary_ref.clone(),
                }),
                outcome,
                created_at_unix_ms: 1,
                resolved_at_unix_ms: Some(2),
                valid_until_unix_ms: (!sealed).then_some(3),
                outcome_signature: None,
            };
            assert_eq!(submission_from_proto(&submission_to_proto(&s)).unwrap(), s);
            // With the proxy's signature over its outcome.
            let (signer, _) = grant_signing::Signer::generate("proxy-1").unwrap();
            let signed = s.outcome_fact().map(|fact| FactSignature {
                signature: signer.sign_outcome(&fact),
                signed_at_unix_ms: fact.signed_at_unix_ms,
            });
            assert_eq!(signed.is_none(), s.outcome == Outcome::Pending);
            let s = Submission {
                outcome_signature: signed,
                ..s
            };
            assert_eq!(submission_from_proto(&submission_to_proto(&s)).unwrap(), s);
        }
    }

    /// A resolution crosses with its account and the proxy's signature over its evidence; the
    /// signed instruction crosses a submit unchanged, and an instruction altered in transit still
    /// parses (the proxy must see it to name the altered field).
    #[test]
    fn signed_facts_cross_the_wire_both_ways() {
        let (signer, verifier) = {
            let (s, _) = grant_signing::Signer::generate("k1").unwrap();
            let v = grant_signing::Verifier::new([s.public_key()]).unwrap();
            (s, v)
        };
        let request = parse_submit(&good()).unwrap();
        let resolution = Resolution {
            payout_id: request.payout_id.clone(),
            asked_by: "resolver".into(),
            asked_at_unix_ms: 7,
            evidence: Evidence::Found {
                rail_refs: vec!["rr-1".into()],
            },
            account_id: None,
            signature: None,
        };
        let fact = resolution.evidence_fact(&request.account_id, &request.client_reference);
        let signed = Resolution {
            account_id: Some(request.account_id.clone()),
            signature: Some(FactSignature {
                signature: signer.sign_evidence(&fact),
                signed_at_unix_ms: 7,
            }),
            ..resolution.clone()
        };
        for r in [resolution, signed.clone()] {
            assert_eq!(resolution_from_proto(&resolution_to_proto(&r)).unwrap(), r);
        }
        let back = resolution_from_proto(&resolution_to_proto(&signed)).unwrap();
        let signature = back.signature.clone().unwrap().signature;
        assert_eq!(
            verifier.verify_evidence(
                &back.evidence_fact(&request.account_id, &request.client_reference),
                &signature
            ),
            Ok(())
        );

        let instructed = request.clone().instructed_by(&signer, 1);
        let wire = submit_request(&instructed);
        assert_eq!(parse_submit(&wire).unwrap(), instructed);
        let mut altered = wire.clone();
        if let Some(i) = altered.instruction.as_mut() {
            i.amount_minor += 1;
            i.currency = "not a currency".into();
        }
        let parsed = parse_submit(&altered).unwrap();
        assert_eq!(
            parsed.instruction.map(|i| i.instruction.currency),
            Some("not a currency".to_string())
        );
        let mut nul = wire;
        if let Some(i) = nul.instruction.as_mut() {
            i.beneficiary_ref = "a\0b".into();
        }
        assert_eq!(
            parse_submit(&nul).unwrap_err().field,
            "instruction.beneficiary_ref"
        );
    }

    /// The signed grant crosses the wire both ways, for Submit and Inquire; an unsigned request
    /// (the default) is still well-formed (the proxy refuses it as a forged grant, not as bad
    /// input), and its key defaults to the account's.
    #[test]
    fn the_signed_grant_crosses_the_wire_both_ways() {
        let (signer, _) = grant_signing::Signer::generate("k1").unwrap();
        let unsigned = parse_submit(&pb::SubmitRequest {
            key: String::new(),
            signing_key_id: String::new(),
            signature: vec![],
            ..good()
        })
        .unwrap();
        assert_eq!(unsigned.signature, Signature::default());
        let request = SubmitPayout::new(
            unsigned.payout_id.clone(),
            unsigned.account_id.clone(),
            unsigned.token,
            unsigned.owner.clone(),
            unsigned.amount_minor,
            unsigned.currency.clone(),
            unsigned.beneficiary_ref.clone(),
        );
        assert_eq!(
            request.key, "payout:a-1",
            "the key defaults to the account's"
        );
        assert_eq!(request.signature, Signature::default());
        let signature = signer.sign("payout:a-2", 5, "worker-1");
        let signed = request.signed("payout:a-2", signature.clone());
        let wire = submit_request(&signed);
        assert_eq!(
            (
                wire.key.as_str(),
                wire.signing_key_id.as_str(),
                &wire.signature
            ),
            ("payout:a-2", "k1", &signature.bytes)
        );
        assert_eq!(parse_submit(&wire).unwrap(), signed);
        assert_eq!(
            signed.lock_key(),
            "payout:a-1",
            "the required key is the account's"
        );

        let inquiry = InquirePayout::new(
            signed.payout_id.clone(),
            signed.account_id.clone(),
            signed.token,
            "worker-1",
            "reconciler-1",
        );
        assert_eq!(
            (inquiry.key.as_str(), &inquiry.signature),
            ("payout:a-1", &Signature::default())
        );
        let inquiry = inquiry.signed("payout:a-1", signer.sign("payout:a-1", 5, "worker-1"));
        assert_eq!(parse_inquire(&inquire_request(&inquiry)).unwrap(), inquiry);
    }

    /// Every typed refusal goes to a status and back unchanged; the two grant refusals are
    /// PERMISSION_DENIED.
    #[test]
    fn refusals_round_trip_through_their_status() {
        let forged = ProxyError::ForgedGrant {
            key: "payout:a-1".into(),
            presented: i64::MAX as u64,
            owner: "mallory".into(),
            signing_key_id: "k9".into(),
            reason: Forged::UnknownKeyId("k9".into()).reason().into(),
            payout_id: "p-1".into(),
        };
        let another = ProxyError::GrantForAnotherKey {
            presented_key: "payout:a-1".into(),
            required_key: "payout:a-2".into(),
            presented: 9,
            owner: "worker-1".into(),
            payout_id: "p-2".into(),
        };
        let refused = ProxyError::InstructionRefused {
            payout_id: "p-5".into(),
            reason: "mismatch".into(),
            field: "amount_minor".into(),
            signing_key_id: "pr-1".into(),
            detail: "the request's amount_minor (2) is not the instruction's (1)".into(),
        };
        for error in [&forged, &another, &refused] {
            let status = error_to_status(error);
            assert_eq!(status.code(), Code::PermissionDenied, "{error:?}");
            assert_eq!(status.message(), error.to_string());
            assert_eq!(
                format!("{:?}", status_to_error(status)),
                format!("{error:?}")
            );
        }
        let fenced = ProxyError::FencedOut {
            key: "payout:a-1".into(),
            presented: 4,
            stored: 5,
            owner: "w-old".into(),
            stored_owner: "w-new".into(),
            payout_id: "p-3".into(),
        };
        let status = error_to_status(&fenced);
        assert_eq!(status.code(), Code::FailedPrecondition);
        assert_eq!(
            format!("{:?}", status_to_error(status)),
            format!("{fenced:?}")
        );
        for restored in [
            ProxyError::DatabaseRestored {
                payout_id: "p-4".into(),
                presented: 15,
                incarnation_current: false,
                token_floor: 0,
            },
            ProxyError::DatabaseRestored {
                payout_id: "p-4".into(),
                presented: 15,
                incarnation_current: true,
                token_floor: 25,
            },
        ] {
            let status = error_to_status(&restored);
            assert_eq!(status.code(), Code::Unavailable);
            assert_eq!(
                format!("{:?}", status_to_error(status)),
                format!("{restored:?}")
            );
        }
        let invalid = ProxyError::InvalidArgument {
            field: "key".into(),
            reason: "too long".into(),
        };
        let status = error_to_status(&invalid);
        assert_eq!(status.code(), Code::InvalidArgument);
        assert!(
            matches!(status_to_error(status), ProxyError::InvalidArgument { field, .. } if field == "key")
        );
        // A status without a typed rejection is an Rpc error.
        assert!(matches!(
            status_to_error(Status::unavailable("down")),
            ProxyError::Rpc(_)
        ));
        assert_eq!(
            [
                Forged::Unsigned,
                Forged::UnknownKeyId("x".into()),
                Forged::BadSignature
            ]
            .iter()
            .map(Forged::reason)
            .collect::<Vec<_>>(),
            ["unsigned", "unknown_key_id", "bad_signature"]
        );
    }
}
