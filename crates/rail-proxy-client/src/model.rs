//! The proxy's domain as it crosses the process boundary: a validated submit request, a fenced
//! inquiry, the submission record and its outcome, the rail's evidence and movements. The server
//! and every caller use these same types; [`crate::wire`] converts them to and from
//! `railproxy.v1`.

use grant_signing::instruction::SignedInstruction;
use grant_signing::{rail_fact, Signature};
use payout_domain::{
    AccountId, AmountMinor, BeneficiaryRef, ClientReference, Currency, FencingToken, PayoutId,
};

/// Longest holder identity accepted; it is diagnostics, and bounded like every other input.
pub const OWNER_LENGTH_MAX: usize = 256;
/// Longest signed lock key accepted (`payout:{account_id}` is far shorter); bounded like every
/// other input, since a refused grant's key is kept in its guard event.
pub const KEY_LENGTH_MAX: usize = 256;

/// A submit request, valid by construction. The client reference is derived, never passed in.
///
/// The grant it presents is (`key`, `token`, `owner`) with the lock service's `signature` over
/// them: the proxy refuses an unsigned or forged grant (`ProxyError::ForgedGrant`) and a genuine
/// grant of another key than `payout:{account_id}` (`ProxyError::GrantForAnotherKey`) before its
/// high-water statement. [`SubmitPayout::new`] makes an unsigned request for the account's own
/// key; [`SubmitPayout::signed`] attaches the grant's key and signature.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SubmitPayout {
    pub payout_id: PayoutId,
    pub account_id: AccountId,
    pub token: FencingToken,
    pub owner: String,
    pub client_reference: ClientReference,
    pub amount_minor: AmountMinor,
    pub currency: Currency,
    pub beneficiary_ref: BeneficiaryRef,
    /// The lock key the grant was signed for (as the lock service signed it).
    pub key: String,
    /// The lock service's signature over (`key`, `token`, `owner`); unsigned by default.
    pub signature: Signature,
    /// The payment resource's signed instruction for exactly this payment (its MarkSubmitted
    /// answer); the proxy refuses a submit without one (`ProxyError::InstructionRefused`).
    pub instruction: Option<SignedInstruction>,
}

impl SubmitPayout {
    pub fn new(
        payout_id: PayoutId,
        account_id: AccountId,
        token: FencingToken,
        owner: impl Into<String>,
        amount_minor: AmountMinor,
        currency: Currency,
        beneficiary_ref: BeneficiaryRef,
    ) -> Self {
        let client_reference = ClientReference::for_payout(&payout_id);
        let key = payout_domain::lock_key(&account_id);
        Self {
            payout_id,
            account_id,
            token,
            owner: owner.into(),
            client_reference,
            amount_minor,
            currency,
            beneficiary_ref,
            key,
            signature: Signature::default(),
            instruction: None,
        }
    }

    /// The grant's signed lock key and the lock service's signature (`GrantHandle::signature`).
    pub fn signed(mut self, key: impl Into<String>, signature: Signature) -> Self {
        self.key = key.into();
        self.signature = signature;
        self
    }

    /// The payment resource's signed instruction, as the worker got it (never made here).
    pub fn instructed(mut self, instruction: Option<SignedInstruction>) -> Self {
        self.instruction = instruction;
        self
    }

    /// This request with an instruction for exactly it, signed by `signer` at `issued_at_unix_ms`
    /// for the default TTL: what the payment resource's MarkSubmitted answers for a payout whose
    /// record says what this request says. For test rigs and benches that drive the proxy by
    /// hand, holding the instruction key as the payment resource would; a caller without that
    /// key cannot make one.
    pub fn instructed_by(self, signer: &grant_signing::Signer, issued_at_unix_ms: i64) -> Self {
        let p = self.presented();
        let instruction = grant_signing::instruction::Instruction {
            payout_id: p.payout_id.into(),
            account_id: p.account_id.into(),
            currency: p.currency.into(),
            beneficiary_ref: p.beneficiary_ref.into(),
            client_reference: p.client_reference.into(),
            lock_key: p.lock_key.into(),
            amount_minor: p.amount_minor,
            token: p.token,
            issued_at_unix_ms,
            expires_at_unix_ms: issued_at_unix_ms
                .saturating_add(grant_signing::instruction::TTL_DEFAULT_MS as i64),
        };
        self.instructed(Some(signer.sign_instruction(instruction)))
    }

    /// [`SubmitPayout::instructed_by`] issued now, on this host's clock.
    pub fn instructed_now(self, signer: &grant_signing::Signer) -> Self {
        let now = i64::try_from(grant_signing::operator::now_unix_ms()).unwrap_or(i64::MAX);
        self.instructed_by(signer, now)
    }

    /// What the request asks, as the instruction's verifier compares it field by field.
    pub fn presented(&self) -> grant_signing::instruction::Presented<'_> {
        grant_signing::instruction::Presented {
            payout_id: self.payout_id.as_str(),
            account_id: self.account_id.as_str(),
            amount_minor: self.amount_minor.get(),
            currency: self.currency.as_str(),
            beneficiary_ref: self.beneficiary_ref.as_str(),
            client_reference: self.client_reference.as_str(),
            lock_key: &self.key,
            token: self.token.get(),
        }
    }

    /// The lock key whose token sequence this request's token must belong to: the account's.
    /// The proxy refuses a grant signed for any other key.
    pub fn lock_key(&self) -> String {
        payout_domain::lock_key(&self.account_id)
    }
}

/// A fenced inquiry: the resolver presents its grant like a submitter does (spec 2.6 steps 6-9),
/// signed key and signature included ([`InquirePayout::signed`]), verified the same way.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InquirePayout {
    pub payout_id: PayoutId,
    pub account_id: AccountId,
    pub token: FencingToken,
    /// The holder presenting the token.
    pub owner: String,
    /// Who asked, kept with the evidence (and as the sealer of a NOT_SENT record).
    pub asked_by: String,
    /// The lock key the grant was signed for.
    pub key: String,
    /// The lock service's signature over (`key`, `token`, `owner`); unsigned by default.
    pub signature: Signature,
}

impl InquirePayout {
    pub fn new(
        payout_id: PayoutId,
        account_id: AccountId,
        token: FencingToken,
        owner: impl Into<String>,
        asked_by: impl Into<String>,
    ) -> Self {
        let key = payout_domain::lock_key(&account_id);
        Self {
            payout_id,
            account_id,
            token,
            owner: owner.into(),
            asked_by: asked_by.into(),
            key,
            signature: Signature::default(),
        }
    }

    /// The grant's signed lock key and the lock service's signature (`GrantHandle::signature`).
    pub fn signed(mut self, key: impl Into<String>, signature: Signature) -> Self {
        self.key = key.into();
        self.signature = signature;
        self
    }

    /// The lock key whose token sequence this request's token must belong to: the account's.
    pub fn lock_key(&self) -> String {
        payout_domain::lock_key(&self.account_id)
    }
}

/// What the proxy recorded about the rail call.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// Intent recorded, no outcome: the proxy died between the intent and the rail's answer.
    /// May have moved money.
    Pending,
    /// The rail accepted. Money has left.
    Acked { rail_ref: String },
    /// The rail declined. No money moved.
    Rejected { decline_code: String },
    /// Timeout, connection failure, reset or 5xx. May have moved money. Never retried.
    Timeout { detail: String },
    /// Sealed by a fenced inquiry before any intent existed: the rail was never called for this
    /// payout and never will be (the record is born final; every later Submit is a DUPLICATE).
    NotSent { sealed_by: String },
}

impl Outcome {
    /// "We may have moved money": the ambiguous outcomes, which are never failures and are
    /// resolved only by external evidence.
    pub fn is_ambiguous(&self) -> bool {
        matches!(self, Self::Pending | Self::Timeout { .. })
    }
    pub fn name(&self) -> &'static str {
        match self {
            Self::Pending => "PENDING",
            Self::Acked { .. } => "ACKED",
            Self::Rejected { .. } => "REJECTED",
            Self::Timeout { .. } => "TIMEOUT",
            Self::NotSent { .. } => "NOT_SENT",
        }
    }
}

/// The payment a submission carries (and the rail was, or may have been, sent).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Payment {
    pub amount_minor: AmountMinor,
    pub currency: Currency,
    pub beneficiary_ref: BeneficiaryRef,
}

/// The durable record of one submission, or of a payout sealed unsent.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Submission {
    pub payout_id: PayoutId,
    pub account_id: AccountId,
    /// The submitter's token, or the sealer's for a NOT_SENT record.
    pub token: FencingToken,
    pub owner: String,
    pub client_reference: ClientReference,
    /// `None` exactly for a sealed (NOT_SENT) record, which never carried a payment.
    pub payment: Option<Payment>,
    pub outcome: Outcome,
    pub created_at_unix_ms: i64,
    pub resolved_at_unix_ms: Option<i64>,
    /// The instruction's expiry at the rail; `None` for sealed records and records written
    /// before expiry existed (migration 0002).
    pub valid_until_unix_ms: Option<i64>,
    /// The proxy's signature over the final outcome ([`Submission::outcome_fact`]); `None` while
    /// PENDING and from a proxy that does not sign.
    pub outcome_signature: Option<FactSignature>,
}

/// The proxy's signature over one rail fact, and the time the fact's message names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FactSignature {
    pub signature: Signature,
    pub signed_at_unix_ms: i64,
}

impl Submission {
    /// The signed message of this submission's final outcome, or `None` while PENDING (no fact
    /// yet). Signed at the outcome's time (`resolved_at`, or `created_at` for a record born
    /// final).
    pub fn outcome_fact(&self) -> Option<rail_fact::Outcome<'_>> {
        let (rail_ref, decline_code) = match &self.outcome {
            Outcome::Pending => return None,
            Outcome::Acked { rail_ref } => (rail_ref.as_str(), ""),
            Outcome::Rejected { decline_code } => ("", decline_code.as_str()),
            Outcome::Timeout { .. } | Outcome::NotSent { .. } => ("", ""),
        };
        Some(rail_fact::Outcome {
            payout_id: self.payout_id.as_str(),
            account_id: self.account_id.as_str(),
            client_reference: self.client_reference.as_str(),
            outcome: self.outcome.name(),
            rail_ref,
            decline_code,
            token: self.token.get(),
            signed_at_unix_ms: self.resolved_at_unix_ms.unwrap_or(self.created_at_unix_ms),
        })
    }

    /// Whether `request` carries the same payment as this record (a retry rather than a conflict).
    pub fn same_payload(&self, request: &SubmitPayout) -> bool {
        self.account_id == request.account_id
            && self.payment.as_ref().is_some_and(|p| {
                p.amount_minor == request.amount_minor
                    && p.currency == request.currency
                    && p.beneficiary_ref == request.beneficiary_ref
            })
    }

    /// Sealed unsent: the rail was never called for this payout and never will be.
    pub fn is_sealed(&self) -> bool {
        matches!(self.outcome, Outcome::NotSent { .. })
    }
}

/// What the rail said when asked by client reference.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Evidence {
    /// Settled movement(s) exist; more than one reference is a duplicate payment.
    Found { rail_refs: Vec<String> },
    /// Authoritatively nothing (the rail's settlement window has passed).
    Absent,
    /// The rail cannot say yet, or could not be asked, or the submission's instruction is still
    /// valid at the rail (`detail` says which).
    Unknown { detail: String },
    /// The payout is sealed at the proxy: never sent, never will be. Read exactly like `Absent`.
    NeverSent,
}

impl Evidence {
    pub fn name(&self) -> &'static str {
        match self {
            Self::Found { .. } => "FOUND",
            Self::Absent => "ABSENT",
            Self::Unknown { .. } => "UNKNOWN",
            Self::NeverSent => "NEVER_SENT",
        }
    }
}

/// One movement as the rail reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RailMovement {
    pub rail_ref: String,
    pub amount_minor: i64,
    pub currency: String,
    pub beneficiary_ref: String,
}

/// (rail reference, amount, currency, beneficiary), as every wire form carries them.
impl From<(String, i64, String, String)> for RailMovement {
    fn from(
        (rail_ref, amount_minor, currency, beneficiary_ref): (String, i64, String, String),
    ) -> Self {
        Self {
            rail_ref,
            amount_minor,
            currency,
            beneficiary_ref,
        }
    }
}

/// The rail's per-reference lookup, with every movement's particulars.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RailLookup {
    Found(Vec<RailMovement>),
    Absent,
    Unknown { detail: String },
}

/// One inquiry's evidence, kept beside the submission.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Resolution {
    pub payout_id: PayoutId,
    pub asked_by: String,
    pub asked_at_unix_ms: i64,
    pub evidence: Evidence,
    /// The submission's account, which the evidence's signed message names (`None` from a proxy
    /// that does not sign).
    pub account_id: Option<AccountId>,
    /// The proxy's signature over [`Resolution::evidence_fact`].
    pub signature: Option<FactSignature>,
}

impl Resolution {
    /// The signed message of this evidence for the payout's `account_id`. UNKNOWN's detail is not
    /// part of it (UNKNOWN decides nothing).
    pub fn evidence_fact<'a>(
        &'a self,
        account_id: &'a AccountId,
        client_reference: &'a ClientReference,
    ) -> rail_fact::Evidence<'a> {
        rail_fact::Evidence {
            payout_id: self.payout_id.as_str(),
            account_id: account_id.as_str(),
            client_reference: client_reference.as_str(),
            evidence: self.evidence.name(),
            rail_refs: match &self.evidence {
                Evidence::Found { rail_refs } => rail_refs,
                _ => &[],
            },
            asked_by: &self.asked_by,
            signed_at_unix_ms: self.asked_at_unix_ms,
        }
    }
}

/// A rejected field of a submit request: which field, and why. Nothing was written.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid {field}: {reason}")]
pub struct InvalidArgument {
    pub field: &'static str,
    pub reason: String,
}

impl InvalidArgument {
    pub fn new(field: &'static str, reason: impl std::fmt::Display) -> Self {
        Self {
            field,
            reason: reason.to_string(),
        }
    }
}
