//! The types that cross the boundary: parsed once ([`crate::wire`] on the server, [`crate::client`]
//! on the client), valid by construction afterwards.

use chrono::{DateTime, Utc};
pub use grant_signing::Signature;
use payout_domain::{AccountId, Currency, FencingToken, PayoutId, PayoutState};
use uuid::Uuid;

use crate::error::{InvalidReason, PaymentError};

/// Longest free text accepted (reasons, notes, evidence sources, operator names): audit rows and
/// log lines stay small, and a runaway caller cannot fill the database through one field.
pub const TEXT_LENGTH_MAX: usize = 1024;

/// The caller's lock grant. A mutating call without one does not compile (INV-07).
///
/// A grant is the lock service's signature over (lock key, token, owner): [`Fence::new`] builds
/// the unsigned part, [`Fence::signed`] attaches the key and the signature the lock service
/// returned with the grant (`lock_client::GrantHandle::signature`). The payment resource verifies
/// the signature before its fence statement and binds the write to the signed key's account: an
/// unsigned fence reaches the server and is refused as [`PaymentError::ForgedGrant`], a grant for
/// another account's key as [`PaymentError::GrantForAnotherKey`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fence {
    owner: String,
    token: FencingToken,
    /// The lock key the grant was signed for (`payout:{account_id}`); empty until signed.
    key: String,
    /// The lock service's signature; [`Signature::default`] (unsigned) until signed.
    signature: Signature,
}

impl Fence {
    pub fn new(owner: impl Into<String>, token: FencingToken) -> Result<Self, PaymentError> {
        let owner = owner.into();
        if owner.trim().is_empty() {
            return Err(PaymentError::invalid(
                "fence.owner",
                InvalidReason::OwnerMissing,
            ));
        }
        check_text("fence.owner", &owner)?;
        Ok(Self {
            owner,
            token,
            key: String::new(),
            signature: Signature::default(),
        })
    }
    /// The grant's lock key and the lock service's signature over (key, token, owner).
    pub fn signed(self, key: impl Into<String>, signature: Signature) -> Fence {
        Fence {
            key: key.into(),
            signature,
            ..self
        }
    }
    pub fn owner(&self) -> &str {
        &self.owner
    }
    pub fn token(&self) -> FencingToken {
        self.token
    }
    /// The lock key the grant was signed for; empty for an unsigned fence.
    pub fn key(&self) -> &str {
        &self.key
    }
    /// The lock service's signature; unsigned (`Signature::default()`) unless [`Fence::signed`].
    pub fn signature(&self) -> &Signature {
        &self.signature
    }
}

/// Required, bounded free text.
pub fn required_text(
    field: &str,
    value: &str,
    missing: InvalidReason,
) -> Result<String, PaymentError> {
    if value.trim().is_empty() {
        return Err(PaymentError::invalid(field, missing));
    }
    optional_text(field, value)
}

/// Optional, bounded free text.
pub fn optional_text(field: &str, value: &str) -> Result<String, PaymentError> {
    check_text(field, value)?;
    Ok(value.to_string())
}

/// What every stored text must be: at most [`TEXT_LENGTH_MAX`] bytes, and without NUL, which
/// PostgreSQL's text and jsonb cannot hold (the statement would fail after the guard ran).
fn check_text(field: &str, value: &str) -> Result<(), PaymentError> {
    if value.len() > TEXT_LENGTH_MAX {
        return Err(PaymentError::invalid(field, InvalidReason::TextTooLong));
    }
    if value.contains('\0') {
        return Err(PaymentError::invalid(field, InvalidReason::TextHasNul));
    }
    Ok(())
}

/// An operator's authorisation of an account's opening balance (`grant_signing::operator::
/// Funding`, `payoutctl sign fund`): who signed, the signature, when.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Funding {
    pub operator: String,
    pub signature: Vec<u8>,
    pub signed_at_unix_ms: u64,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Account {
    pub account_id: AccountId,
    pub currency: Currency,
    pub balance_minor: i64,
    pub opening_balance_minor: i64,
    pub fence: u64,
    pub version: i64,
    pub created_at: DateTime<Utc>,
    pub updated_at: DateTime<Utc>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NewPayout {
    pub payout_id: PayoutId,
    pub account_id: AccountId,
    pub amount_minor: payout_domain::AmountMinor,
    pub currency: Currency,
    pub beneficiary_ref: payout_domain::BeneficiaryRef,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Payout {
    pub payout_id: PayoutId,
    pub account_id: AccountId,
    pub amount_minor: i64,
    pub currency: Currency,
    pub beneficiary_ref: String,
    pub state: PayoutState,
    pub client_reference: String,
    pub claimed_by: Option<String>,
    pub token_stamp: Option<u64>,
    pub failure_reason: Option<String>,
    pub rail_ref: Option<String>,
    pub rail_outcome: Option<String>,
    pub transaction_group: Option<Uuid>,
    pub created_at: DateTime<Utc>,
    pub claimed_at: Option<DateTime<Utc>>,
    pub submitted_at: Option<DateTime<Utc>>,
    pub settled_at: Option<DateTime<Utc>>,
    pub updated_at: DateTime<Utc>,
    /// The signed instruction the rail proxy requires to send this payout: set only in
    /// MarkSubmitted's answer (issue 33), `None` everywhere else.
    pub instruction: Option<grant_signing::instruction::SignedInstruction>,
}

#[derive(Debug, Clone, PartialEq)]
pub struct AuditEvent {
    pub id: i64,
    pub payout_id: Option<String>,
    pub account_id: Option<String>,
    pub kind: String,
    pub actor: String,
    pub owner: Option<String>,
    pub token: Option<u64>,
    pub from_state: Option<String>,
    pub to_state: Option<String>,
    pub event: Option<String>,
    pub detail: serde_json::Value,
    pub at: DateTime<Utc>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LedgerEntry {
    pub id: i64,
    pub transaction_group: Uuid,
    pub line_number: i16,
    pub account_id: String,
    pub currency: String,
    pub amount_minor: i64,
    pub counterparty: String,
    pub payout_id: Option<String>,
    pub token: Option<u64>,
    pub created_at: DateTime<Utc>,
}

#[derive(Debug, Clone, PartialEq)]
pub struct PostOutcome {
    pub payout: Payout,
    pub transaction_group: Uuid,
    pub entries: Vec<LedgerEntry>,
    pub outbox_idempotency_key: String,
    /// The payout was already POSTED: nothing changed; this is the first posting's answer.
    pub already_posted: bool,
}

/// What the rail said (or did not say) about a submission.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RailOutcome {
    Acked { rail_ref: String },
    Declined { decline_code: String },
    Timeout,
    OutcomeMissing,
}

/// The rail proxy's signed final outcome of a submission, as a RecordOutcome carries it
/// (`grant_signing::rail_fact::Outcome`; the payout's own id, account and client reference
/// complete the signed message).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RailFact {
    /// `ACKED`, `REJECTED`, `TIMEOUT` or `NOT_SENT`.
    pub outcome: String,
    pub rail_ref: String,
    pub decline_code: String,
    pub token: u64,
    pub signed_at_unix_ms: i64,
    pub signature: Signature,
}

impl RailFact {
    /// The signed message this fact stands for, on `payout`.
    pub fn message<'a>(
        &'a self,
        payout_id: &'a str,
        account_id: &'a str,
        client_reference: &'a str,
    ) -> grant_signing::rail_fact::Outcome<'a> {
        grant_signing::rail_fact::Outcome {
            payout_id,
            account_id,
            client_reference,
            outcome: &self.outcome,
            rail_ref: &self.rail_ref,
            decline_code: &self.decline_code,
            token: self.token,
            signed_at_unix_ms: self.signed_at_unix_ms,
        }
    }
}

/// The rail proxy's signed evidence of an inquiry, as a ResolveAmbiguity carries it
/// (`grant_signing::rail_fact::Evidence`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RailEvidence {
    /// `FOUND`, `ABSENT`, `NEVER_SENT` or `UNKNOWN`.
    pub evidence: String,
    pub rail_refs: Vec<String>,
    pub asked_by: String,
    pub asked_at_unix_ms: i64,
    pub signature: Signature,
}

impl RailEvidence {
    /// The signed message this evidence stands for, on `payout`.
    pub fn message<'a>(
        &'a self,
        payout_id: &'a str,
        account_id: &'a str,
        client_reference: &'a str,
    ) -> grant_signing::rail_fact::Evidence<'a> {
        grant_signing::rail_fact::Evidence {
            payout_id,
            account_id,
            client_reference,
            evidence: &self.evidence,
            rail_refs: &self.rail_refs,
            asked_by: &self.asked_by,
            signed_at_unix_ms: self.asked_at_unix_ms,
        }
    }
}

/// External evidence about an ambiguous payout. Time is not evidence.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Evidence {
    Found { rail_ref: String },
    Absent,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AbandonRequest {
    pub operator: String,
    pub reason: String,
    pub resolution_sla_passed: bool,
    /// The input of the caller's SLA check, stored with the decision.
    pub sla_check: String,
    /// The operator's signature of (operator, "abandon", payout, reason, time); required.
    pub signature: Option<OperatorSignature>,
}

/// An operator's signature of a decision (`grant_signing::operator`): the operator is the
/// request's `operator`, the name its key is registered under.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OperatorSignature {
    pub signature: Vec<u8>,
    pub signed_at_unix_ms: u64,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OperatorDecision {
    pub payout_id: PayoutId,
    pub operator: String,
    pub decision: String,
    pub reason: String,
    pub accepted: bool,
    pub note: String,
    pub token: Option<FencingToken>,
    pub signature: Option<OperatorSignature>,
}
