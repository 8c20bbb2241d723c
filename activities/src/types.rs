//! The inputs and outputs of every activity: the serializable shapes that cross the process
//! boundary between the workflow (Temporal history) and the activities. Domain newtypes are used
//! where they fit, so a value in history is valid by construction once deserialized.

use payout_domain::{
    AccountId, AmountMinor, BeneficiaryRef, ClientReference, Currency, FencingToken, PayoutId,
    PayoutState,
};
use serde::{Deserialize, Serialize};

/// The workflow's input: one payout, exactly as created in the payment resource.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PayoutInput {
    pub payout_id: PayoutId,
    pub account_id: AccountId,
    pub amount_minor: AmountMinor,
    pub currency: Currency,
    pub beneficiary_ref: BeneficiaryRef,
    /// How long to wait for the rail's evidence; absent means the production defaults.
    #[serde(default)]
    pub ambiguity: AmbiguityPolicy,
}

/// The two clocks of ambiguity resolution (spec 2.3, RAIL_AMBIGUOUS). Neither resolves anything
/// by itself: they only decide when to ask the rail again and when an operator may decide.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct AmbiguityPolicy {
    /// The rail's settlement window: a lookup before it has passed cannot be definitive.
    pub settlement_window_ms: u64,
    /// After this long in RAIL_AMBIGUOUS without evidence, an operator may abandon the payout.
    pub resolution_sla_ms: u64,
}

/// The rail stub settles within seconds; a real rail within minutes.
pub const SETTLEMENT_WINDOW_MS_DEFAULT: u64 = 30_000;
/// Finance's resolution SLA for an ambiguous payout before a human may decide (one hour).
pub const RESOLUTION_SLA_MS_DEFAULT: u64 = 3_600_000;

impl Default for AmbiguityPolicy {
    fn default() -> Self {
        Self {
            settlement_window_ms: SETTLEMENT_WINDOW_MS_DEFAULT,
            resolution_sla_ms: RESOLUTION_SLA_MS_DEFAULT,
        }
    }
}

/// A lock grant on `payout:{account_id}`, as the workflow carries it. The token is the fencing
/// token every mutating activity presents; it is never ambient.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Grant {
    pub key: String,
    pub owner: String,
    pub session_id: String,
    pub token: FencingToken,
    /// The task queue of the worker process whose lock session holds this grant: every fenced
    /// activity under the grant runs there, because only that process keeps the session alive
    /// and can vouch for the grant. Empty means the workflow's own queue (a one-worker setup).
    #[serde(default)]
    pub task_queue: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AcquireInput {
    pub payout_id: PayoutId,
    pub account_id: AccountId,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum AcquireOutcome {
    Granted(Grant),
    /// Another holder has the key (another payout of the account is in flight). Not an error:
    /// the workflow waits on a durable timer and asks again, and stays responsive to signals.
    NotAcquired {
        holder_owner: String,
        holder_token: u64,
    },
}

/// Every fenced call: the payout and the grant under which it is made.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FencedInput {
    pub payout_id: PayoutId,
    pub grant: Grant,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SubmitInput {
    pub payout_id: PayoutId,
    pub account_id: AccountId,
    pub amount_minor: AmountMinor,
    pub currency: Currency,
    pub beneficiary_ref: BeneficiaryRef,
    /// Derived from the payout id (`ClientReference::for_payout`), never regenerated.
    pub client_reference: ClientReference,
    pub grant: Grant,
}

/// The rail proxy's answer to the single submission attempt.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum SubmitAnswer {
    Acked {
        rail_ref: String,
    },
    Declined {
        decline_code: String,
    },
    /// Timeout, connection failure, 5xx or any answer we cannot read: money may have moved.
    Ambiguous {
        detail: String,
    },
}

/// What the workflow records in the payment resource after a submission.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum RailOutcome {
    Acked {
        rail_ref: String,
    },
    Declined {
        decline_code: String,
    },
    Timeout {
        detail: String,
    },
    /// A later holder found the submission without a recorded outcome.
    OutcomeMissing,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RecordOutcomeInput {
    pub payout_id: PayoutId,
    pub grant: Grant,
    pub outcome: RailOutcome,
}

/// The fenced inquiry: the resolver presents the grant it holds while RAIL_AMBIGUOUS, because
/// the proxy advances its high-water with it and may seal the payout (spec 2.6 steps 6-9).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct InquireInput {
    pub payout_id: PayoutId,
    pub account_id: AccountId,
    pub client_reference: ClientReference,
    pub grant: Grant,
}

/// The rail's lookup by client reference, through the proxy.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Inquiry {
    Found {
        rail_ref: String,
    },
    /// Definitively absent (the rail says so after its settlement window, and after the
    /// submission's instruction expired at the rail).
    Absent,
    /// The proxy never sent the payout and has sealed it, so it never will: read like `Absent`.
    NeverSent,
    /// The rail could not say: ask again later. Time is not evidence.
    Unknown {
        detail: String,
    },
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Evidence {
    Found { rail_ref: String },
    Absent,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ResolveInput {
    pub payout_id: PayoutId,
    pub grant: Grant,
    pub evidence: Evidence,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AbandonInput {
    pub payout_id: PayoutId,
    pub grant: Grant,
    pub operator: String,
    pub reason: String,
    /// From RAIL_AMBIGUOUS: the workflow asserts the SLA has passed and says why (`sla_check`).
    pub resolution_sla_passed: bool,
    pub sla_check: String,
}

/// An operator's signal, accepted or refused, written to the payment resource's audit trail
/// before the workflow acts on it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct OperatorDecisionInput {
    pub payout_id: PayoutId,
    pub operator: String,
    pub decision: String,
    pub reason: String,
    pub accepted: bool,
    pub note: String,
    /// The grant the workflow holds at that moment, if any.
    pub token: Option<FencingToken>,
}

/// The payment resource's view of a payout: the state the workflow continues from.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PayoutSnapshot {
    pub payout_id: PayoutId,
    pub state: PayoutState,
    pub claimed_by: String,
    /// Diagnostic only, never a guard.
    pub token_stamp: u64,
    pub rail_ref: String,
    pub rail_outcome: String,
    pub failure_reason: String,
}
