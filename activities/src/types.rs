//! The inputs and outputs of every activity: the serializable shapes that cross the process
//! boundary between the workflow (Temporal history) and the activities. Domain newtypes are used
//! where they fit, so a value in history is valid by construction once deserialized.

use payout_domain::{
    AccountId, AmountMinor, BeneficiaryRef, ClientReference, Currency, FencingToken, PayoutId,
    PayoutState,
};
use serde::{Deserialize, Serialize};

/// One payout as its creator describes it (what `payoutctl` creates in the payment resource and
/// then starts a workflow for). The workflow is started with a [`PayoutStartInput`]; only the
/// payout id is needed there: what the rail is asked to pay always comes from the payment
/// resource's record ([`Instruction`]), never from the workflow's input.
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

/// The workflow's input as it arrives from whoever started it (`payoutctl`, an integrator, the
/// reconciler, an operator's `temporal workflow start --input '...'`): JSON, parsed by the
/// workflow itself into a [`PayoutStart`], so that a missing, malformed, unknown or out-of-range
/// field fails the workflow at once with an error naming it (a typed input would fail the first
/// workflow task to decode, and Temporal retries that for ever while the workflow sits RUNNING).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(transparent)]
pub struct PayoutStartInput(pub serde_json::Value);

impl From<&PayoutInput> for PayoutStartInput {
    fn from(input: &PayoutInput) -> Self {
        Self(serde_json::to_value(input).expect("a PayoutInput always serializes"))
    }
}

impl From<&PayoutStart> for PayoutStartInput {
    fn from(start: &PayoutStart) -> Self {
        let mut fields = serde_json::Map::new();
        fields.insert("payout_id".into(), start.payout_id.as_str().into());
        fields.insert(
            "ambiguity".into(),
            serde_json::to_value(start.ambiguity).expect("the policy serializes"),
        );
        if start.resume {
            fields.insert("resume".into(), true.into());
        }
        Self(serde_json::Value::Object(fields))
    }
}

/// The upper bound of either ambiguity clock: a month. A longer one is a typo (seconds read as
/// milliseconds the other way round), and would park a payout beyond any finance process.
pub const AMBIGUITY_CLOCK_MS_MAX: u64 = 30 * 24 * 3_600_000;

/// A started workflow's parsed input.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PayoutStart {
    pub payout_id: PayoutId,
    /// What the starter believes the payout is: compared with the payment resource's record
    /// (a disagreement stops the workflow before anything is claimed), never used to pay.
    pub believed: BelievedInstruction,
    pub ambiguity: AmbiguityPolicy,
    /// Started by the reconciler for a payout whose workflow ended early: a payout found
    /// RAIL_SUBMITTED is "maybe sent" (spec 2.3: a later holder finds no recorded outcome ->
    /// RAIL_AMBIGUOUS), resolved by inquiry, never submitted by this run.
    pub resume: bool,
}

/// The optional fields of a start input that describe the payout.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct BelievedInstruction {
    pub account_id: Option<AccountId>,
    pub amount_minor: Option<AmountMinor>,
    pub currency: Option<Currency>,
    pub beneficiary_ref: Option<BeneficiaryRef>,
}

impl BelievedInstruction {
    /// The first field the starter got wrong, with both values: `None` if every field it gave
    /// matches the record.
    pub fn disagreement(&self, recorded: &Instruction) -> Option<String> {
        fn differs<T: PartialEq + std::fmt::Display>(
            field: &str,
            believed: &Option<T>,
            recorded: &T,
        ) -> Option<String> {
            believed
                .as_ref()
                .filter(|b| *b != recorded)
                .map(|b| format!("{field}: the input says {b}, the payout record says {recorded}"))
        }
        differs("account_id", &self.account_id, &recorded.account_id)
            .or_else(|| differs("amount_minor", &self.amount_minor, &recorded.amount_minor))
            .or_else(|| differs("currency", &self.currency, &recorded.currency))
            .or_else(|| {
                differs(
                    "beneficiary_ref",
                    &self.beneficiary_ref,
                    &recorded.beneficiary_ref,
                )
            })
    }

    /// The instruction these fields describe, if all are present (a history recorded before the
    /// payment resource's snapshots carried the record: its input had every field).
    pub fn complete(&self) -> Option<Instruction> {
        Some(Instruction {
            account_id: self.account_id.clone()?,
            amount_minor: self.amount_minor?,
            currency: self.currency.clone()?,
            beneficiary_ref: self.beneficiary_ref.clone()?,
        })
    }
}

/// A start input the workflow cannot use: the field and what is wrong with it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid workflow input: {field}: {problem}")]
pub struct InputError {
    pub field: String,
    pub problem: String,
}

impl PayoutStart {
    /// Parses a start input. Unknown fields are refused: a misspelt field (say `amount` for
    /// `amount_minor`) must not be silently ignored in a payment instruction's neighbourhood.
    pub fn parse(input: &PayoutStartInput) -> Result<Self, InputError> {
        fn error(field: &str, problem: impl Into<String>) -> InputError {
            InputError {
                field: field.to_string(),
                problem: problem.into(),
            }
        }
        fn field<T: serde::de::DeserializeOwned>(
            fields: &serde_json::Map<String, serde_json::Value>,
            name: &str,
        ) -> Result<Option<T>, InputError> {
            match fields.get(name) {
                None | Some(serde_json::Value::Null) => Ok(None),
                Some(v) => serde_json::from_value(v.clone())
                    .map(Some)
                    .map_err(|e| error(name, e.to_string())),
            }
        }
        const KNOWN: [&str; 7] = [
            "payout_id",
            "account_id",
            "amount_minor",
            "currency",
            "beneficiary_ref",
            "ambiguity",
            "resume",
        ];
        let fields = input
            .0
            .as_object()
            .ok_or_else(|| error("(input)", "must be a JSON object"))?;
        if let Some(unknown) = fields.keys().find(|k| !KNOWN.contains(&k.as_str())) {
            return Err(error(unknown, "unknown field"));
        }
        let payout_id: PayoutId =
            field(fields, "payout_id")?.ok_or_else(|| error("payout_id", "missing"))?;
        let ambiguity = match fields.get("ambiguity") {
            None | Some(serde_json::Value::Null) => AmbiguityPolicy::default(),
            Some(serde_json::Value::Object(a)) => {
                if let Some(unknown) = a
                    .keys()
                    .find(|k| !["settlement_window_ms", "resolution_sla_ms"].contains(&k.as_str()))
                {
                    return Err(error(&format!("ambiguity.{unknown}"), "unknown field"));
                }
                let clock = |name: &str| -> Result<u64, InputError> {
                    let full = format!("ambiguity.{name}");
                    let value: u64 = field(a, name)
                        .map_err(|e| error(&full, e.problem))?
                        .ok_or_else(|| error(&full, "missing"))?;
                    if value == 0 || value > AMBIGUITY_CLOCK_MS_MAX {
                        return Err(error(
                            &full,
                            format!("{value} is outside 1..={AMBIGUITY_CLOCK_MS_MAX} ms"),
                        ));
                    }
                    Ok(value)
                };
                AmbiguityPolicy {
                    settlement_window_ms: clock("settlement_window_ms")?,
                    resolution_sla_ms: clock("resolution_sla_ms")?,
                }
            }
            Some(_) => return Err(error("ambiguity", "must be an object")),
        };
        Ok(Self {
            payout_id,
            believed: BelievedInstruction {
                account_id: field(fields, "account_id")?,
                amount_minor: field(fields, "amount_minor")?,
                currency: field(fields, "currency")?,
                beneficiary_ref: field(fields, "beneficiary_ref")?,
            },
            ambiguity,
            resume: field(fields, "resume")?.unwrap_or(false),
        })
    }
}

/// What the rail is asked to pay, as the payment resource recorded the payout: the only source
/// of a submission's account, amount, currency and beneficiary.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Instruction {
    pub account_id: AccountId,
    pub amount_minor: AmountMinor,
    pub currency: Currency,
    pub beneficiary_ref: BeneficiaryRef,
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

/// The answer of a try at the key that never waits (`TryAcquireGrant`), run as a local activity
/// by the worker that runs the payout's workflow task: a grant made there is held by the process
/// that runs the payout's next steps. When the key is held, `worker_queue` names that worker's own
/// task queue, where the workflow then waits in the account's line, so that the grant is made in
/// the same process. Empty means the workflow's own queue (a one-worker setup).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TryAcquired {
    pub outcome: AcquireOutcome,
    pub worker_queue: String,
}

/// The answer of `ReleaseGrantHere`: released by this process, or the grant was made by another
/// worker process (its `task_queue` is not this one's), which alone can release it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Released {
    Released,
    NotHere,
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
    /// The payment resource's signed instruction (MarkSubmitted's answer), carried to the rail
    /// proxy as it came: the worker and Temporal cannot make one (issue 33). Absent in histories
    /// recorded before it was carried; the proxy then refuses the submit (`unsigned`).
    #[serde(default)]
    pub signed_instruction: Option<SignedInstruction>,
}

/// The payment resource's signed instruction as it crosses Temporal's history: the signed fields
/// as the payment resource wrote them (texts, not parsed: the proxy compares and verifies them),
/// the key id and the signature in hex (`grant_signing::instruction`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SignedInstruction {
    pub payout_id: String,
    pub account_id: String,
    pub currency: String,
    pub beneficiary_ref: String,
    pub client_reference: String,
    pub lock_key: String,
    pub amount_minor: i64,
    pub token: u64,
    pub issued_at_unix_ms: i64,
    pub expires_at_unix_ms: i64,
    pub signing_key_id: String,
    /// The Ed25519 signature, hex.
    pub signature: String,
}

/// The rail proxy's signature over a final outcome (`grant_signing::rail_fact::Outcome`): the
/// payment resource records ACKED or DECLINED only on it (issue 33). The outcome's other signed
/// fields are the payout's own and the outcome itself.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RailProof {
    pub key_id: String,
    /// The Ed25519 signature, hex.
    pub signature: String,
    /// The submission's token, as signed.
    pub token: u64,
    pub signed_at_unix_ms: i64,
}

/// The rail proxy's answer to the single submission attempt.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum SubmitAnswer {
    Acked {
        rail_ref: String,
        /// The proxy's signed outcome; absent in histories recorded before it was carried.
        #[serde(default)]
        proof: Option<RailProof>,
    },
    Declined {
        decline_code: String,
        #[serde(default)]
        proof: Option<RailProof>,
    },
    /// Timeout, connection failure, 5xx or any answer we cannot read: money may have moved.
    Ambiguous { detail: String },
}

/// What the workflow records in the payment resource after a submission.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum RailOutcome {
    Acked {
        rail_ref: String,
        /// The proxy's signed outcome; absent in histories recorded before it was carried (the
        /// worker then asks the proxy's Lookup for it).
        #[serde(default)]
        proof: Option<RailProof>,
    },
    Declined {
        decline_code: String,
        #[serde(default)]
        proof: Option<RailProof>,
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
    /// The operator's signature, as the signal carried it (histories from before have none).
    #[serde(default)]
    pub operator_signature: Option<OperatorSignatureInput>,
}

/// An operator's signature of a decision, as the `abandon` signal carries it (`payoutctl sign
/// abandon`): the payment resource verifies it; the workflow only passes it on.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct OperatorSignatureInput {
    /// The Ed25519 signature, hex.
    pub signature: String,
    pub signed_at_unix_ms: u64,
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
    /// The operator's signature, as the signal carried it (histories from before have none).
    #[serde(default)]
    pub operator_signature: Option<OperatorSignatureInput>,
}

/// An operator decision as the payment resource recorded it (the `accepted` and `note` of the
/// audit event `RecordOperatorDecision` answers), which is not always as it was asked: the resource
/// records an accepted decision whose operator signature does not verify as refused, with why.
/// Never the other way: a decision asked as refused is recorded as refused.
///
/// The `RecordOperatorDecision` activity answers `Option<RecordedDecision>`: histories recorded
/// before it answered anything hold a null result, read as `None` (the workflow's own decision
/// stands, as it did when they were recorded); the worker always answers `Some`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RecordedDecision {
    pub accepted: bool,
    /// Why, as recorded: the workflow's note, or the resource's reason for refusing.
    pub note: String,
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
    /// The payout's recorded instruction (absent in histories recorded before it was carried).
    #[serde(default)]
    pub instruction: Option<Instruction>,
    /// The payment resource's signed instruction: only in MarkSubmitted's answer (issue 33).
    #[serde(default)]
    pub signed_instruction: Option<SignedInstruction>,
    /// When the payment resource's record first shows the payout RAIL_AMBIGUOUS (its audit
    /// trail's first transition into it, on the resource's clock), in Unix milliseconds: the
    /// start of the resolution SLA in every run, whichever run saw the ambiguity begin. Only
    /// GetPayout's answer carries it (the others answer a write, not the history); absent in
    /// histories recorded before it was carried.
    #[serde(default)]
    pub ambiguous_since_unix_ms: Option<u64>,
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Activity inputs and results recorded before the signed facts were carried (issue 33)
    /// decode with none: every new field is defaulted, and only struct variants gained one.
    #[test]
    fn shapes_recorded_before_the_signed_facts_still_decode() {
        let old: RailOutcome = serde_json::from_str(r#"{"Acked":{"rail_ref":"r-1"}}"#).unwrap();
        assert_eq!(
            old,
            RailOutcome::Acked {
                rail_ref: "r-1".into(),
                proof: None
            }
        );
        let old: SubmitAnswer =
            serde_json::from_str(r#"{"Declined":{"decline_code":"NO"}}"#).unwrap();
        assert_eq!(
            old,
            SubmitAnswer::Declined {
                decline_code: "NO".into(),
                proof: None
            }
        );
        let unit: RailOutcome = serde_json::from_str(r#""OutcomeMissing""#).unwrap();
        assert_eq!(unit, RailOutcome::OutcomeMissing);
        let old: SubmitInput = serde_json::from_value(serde_json::json!({
            "payout_id": "p-1", "account_id": "acct-1", "amount_minor": 1000, "currency": "EUR",
            "beneficiary_ref": "ben-1", "client_reference": "cref-p-1",
            "grant": {"key": "payout:acct-1", "owner": "w", "session_id": "s", "token": 7},
        }))
        .unwrap();
        assert_eq!(old.signed_instruction, None);
    }
}
