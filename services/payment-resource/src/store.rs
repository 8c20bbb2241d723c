//! paydb access: the fence predicate (the first guard), the transitions of the 2.3 table, the
//! ledger postings and their outbox rows. Every mutation of a payout runs in one transaction that
//! begins with the conditional fence advance; nothing here reads the fence and then writes it.
//!
//! Before that statement, every fenced call's grant is verified: the lock service's signature over
//! (key, token, owner) (else `forged_grant`, and no statement runs), then the fence statement
//! itself is bound to the account of the signed key, so a genuine grant for another key advances
//! nothing (`grant_for_another_key`).

use chrono::{DateTime, Utc};
use grant_signing::{Forged, Verifier};
use payout_domain::{lock_key, AccountId, Actor, Currency, PayoutEvent, PayoutId, PayoutState};
use serde_json::{json, Value};
use service_kit::prometheus::IntCounterVec;
use sqlx::{PgPool, Postgres, Transaction};
use uuid::Uuid;

use payment_client::model::{
    AbandonRequest, Account, AuditEvent, Evidence, Fence, LedgerEntry, NewPayout, OperatorDecision,
    Payout, PostOutcome, RailEvidence, RailFact, RailOutcome,
};
use payment_client::{InvalidReason, PaymentError};

use crate::error::ServerError;
use crate::model::{LedgerCheck, LedgerViolation};
use crate::outbox;

/// Most audit events returned with a payout: a payout has a handful of transitions; a long tail
/// means a storm of refused or fenced-out attempts, and the first thousand tell the story.
pub const HISTORY_EVENTS_MAX: i64 = 1_000;
/// Most violations one CheckLedger returns: one is already an incident; the reply stays small.
pub const LEDGER_VIOLATIONS_MAX: i64 = 1_000;

/// The name of the partial unique index that refuses a second in-flight payout per account.
const ONE_IN_FLIGHT_INDEX: &str = "payout_one_in_flight_per_account";
const IN_FLIGHT_STATES_SQL: &str = "('CLAIMED', 'RAIL_SUBMITTED', 'RAIL_ACKED', 'RAIL_AMBIGUOUS')";

/// `incarnation_admits($2)` (migration 0006) written out in the statement: a SQL function whose
/// body has a sub-select is never inlined and re-plans its body on every call, which cost the
/// guard statement about 40% of its throughput (pgbench of the proxy's equivalent statement:
/// 5.3k/s with the function against 9.3k/s without the condition; 8.4k/s written out). The
/// function stays the definition the diagnostics, the reconciler and `rearm_after_restore` use;
/// the restore tests exercise this form.
macro_rules! admits_token_2 {
    () => {
        "EXISTS (SELECT 1 FROM incarnation i \
           WHERE i.database_oid = (SELECT d.oid FROM pg_database d WHERE d.datname = current_database()) \
             AND i.guarded_table = 'account'::regclass AND i.token_floor <= $2)"
    };
}

/// The guard, as one statement: advance the fence of the payout's account to the presented token
/// if the token is not below it, the account is the one the grant was signed for ($3, the account
/// id of the signed key `payout:{account_id}`; NULL for a key of another shape, which matches no
/// account), and this database admits the token (`incarnation_admits`, migration 0006: the
/// database is the one its incarnation row was armed in, not a copy restored from a backup whose
/// fences are rewound, and the token is not below the last re-arming's horizon); and return the
/// row (locked until commit). No row: fenced out, a grant for another key, a restored database,
/// or no such payout. The account id comes from the payout, whose account never changes.
const FENCE_ADVANCE_SQL: &str = concat!(
    "UPDATE account SET fence = $2, updated_at = now() \
     WHERE id = (SELECT account_id FROM payout WHERE id = $1) AND id = $3 AND fence <= $2 AND ",
    admits_token_2!(),
    " RETURNING id, fence, balance_minor, now()"
);

/// The guard statement with some of its checks dropped: used only by the negative-control tests
/// (`StoreOptions::without_*_for_tests`), to show that the write they guard against then lands.
/// Without the predicate, `GREATEST` keeps the fence non-decreasing, which the database enforces
/// independently; without the key binding there is no $3.
fn fence_advance_sql(
    predicate: bool,
    key_binding: bool,
    restore_check: bool,
) -> std::borrow::Cow<'static, str> {
    if predicate && key_binding && restore_check {
        // The shipped statement: no allocation on the fenced path.
        return FENCE_ADVANCE_SQL.into();
    }
    let set = if predicate {
        "fence = $2"
    } else {
        "fence = GREATEST(fence, $2)"
    };
    let mut conditions = vec!["id = (SELECT account_id FROM payout WHERE id = $1)"];
    if key_binding {
        conditions.push("id = $3");
    }
    if predicate {
        conditions.push("fence <= $2");
    }
    if restore_check {
        conditions.push(admits_token_2!());
    }
    format!(
        "UPDATE account SET {set}, updated_at = now() WHERE {} RETURNING id, fence, balance_minor, now()",
        conditions.join(" AND ")
    )
    .into()
}

/// The prefix of a payout account's lock key (`payout_domain::lock_key`).
const LOCK_KEY_PREFIX: &str = "payout:";

/// The account a signed lock key names: `payout:{account_id}` with a valid account id, else `None`
/// (a key of another shape is a grant for another key: it names no payout account).
fn account_of_lock_key(key: &str) -> Option<AccountId> {
    let account = AccountId::parse(key.strip_prefix(LOCK_KEY_PREFIX)?.to_string()).ok()?;
    (lock_key(&account) == key).then_some(account)
}

const PAYOUT_COLUMNS: &str = "id, account_id, amount_minor, currency, beneficiary_ref, state, client_reference, \
     claimed_by, token_stamp, failure_reason, rail_ref, rail_outcome, transaction_group, created_at, claimed_at, \
     submitted_at, settled_at, updated_at, version";
const ACCOUNT_COLUMNS: &str =
    "id, currency, balance_minor, opening_balance_minor, fence, version, created_at, updated_at";
const ENTRY_COLUMNS: &str =
    "id, transaction_group, line_number, account_id, currency, amount_minor, counterparty, payout_id, token, created_at";
const AUDIT_COLUMNS: &str =
    "id, payout_id, account_id, kind, actor, owner, token, from_state, to_state, event, detail::text AS detail, at";

/// Options of the store: the lock service's public keys (required: there is no unsigned mode),
/// the resolution SLA, and the test-only switches that disable a check (the fence predicate, the
/// grant's signature, the grant's key binding), which the binary's configuration cannot reach.
#[derive(Debug, Clone)]
pub struct StoreOptions {
    /// `None` only for a store that takes no fenced call (the fixture command): it knows no
    /// signing key, so every grant is refused as `forged_grant`.
    verifier: Verifier,
    fence_predicate: bool,
    grant_verification: bool,
    key_binding: bool,
    resolution_sla: std::time::Duration,
    /// The registered operators' public keys (`--operator-keys`); none: every operator decision
    /// is refused as `unknown_operator` or `unsigned`, and recorded as refused.
    operators: Verifier,
    operator_verification: bool,
    /// A break-glass gRPC call (ReplayQuarantined) is recorded only under the operator the
    /// caller's certificate carries.
    operator_certification: bool,
    restore_check: bool,
    /// CreatePayout stages the workflow's start in its own transaction (paydb 0009).
    start_staging: bool,
    /// The instruction signer and the rail proxy's fact keys (issue 33). `None` only for the
    /// fixture command's store, which refuses every fenced call before any would be signed.
    facts: Option<SignedFacts>,
    /// RecordOutcome ACKED/DECLINED and ResolveAmbiguity need the rail proxy's signed fact.
    rail_fact_verification: bool,
}

/// The signed facts this service makes and checks: it signs each payout's instruction (the rail
/// proxy sends nothing without one) and verifies the rail proxy's signed outcomes and evidence.
#[derive(Debug, Clone)]
pub struct SignedFacts {
    instruction_signer: std::sync::Arc<grant_signing::Signer>,
    instruction_ttl_ms: u64,
    rail_facts: Verifier,
}

/// Why the signed facts' keys could not be loaded: the service does not start.
#[derive(Debug, thiserror::Error)]
pub enum FactKeyError {
    #[error("reading the instruction signing key {path}: {source}")]
    Read {
        path: String,
        source: std::io::Error,
    },
    #[error(transparent)]
    Key(#[from] grant_signing::KeyError),
    #[error("instruction TTL {0} ms is zero or above the bound of {max} ms", max = grant_signing::instruction::TTL_MAX_MS)]
    TtlOutOfBounds(u64),
}

impl SignedFacts {
    /// `instruction_signer` signs instructions valid `instruction_ttl_ms` (1 ..= TTL_MAX_MS);
    /// `rail_facts` are the rail proxy's public keys.
    pub fn new(
        instruction_signer: std::sync::Arc<grant_signing::Signer>,
        instruction_ttl_ms: u64,
        rail_facts: Verifier,
    ) -> Result<Self, FactKeyError> {
        if instruction_ttl_ms == 0 || instruction_ttl_ms > grant_signing::instruction::TTL_MAX_MS {
            return Err(FactKeyError::TtlOutOfBounds(instruction_ttl_ms));
        }
        Ok(Self {
            instruction_signer,
            instruction_ttl_ms,
            rail_facts,
        })
    }

    /// The binary's form: the signing key from its file.
    pub fn load(
        key_id: &str,
        key_file: &std::path::Path,
        instruction_ttl_ms: u64,
        rail_facts: Verifier,
    ) -> Result<Self, FactKeyError> {
        let text = std::fs::read_to_string(key_file).map_err(|source| FactKeyError::Read {
            path: key_file.display().to_string(),
            source,
        })?;
        let signer = grant_signing::Signer::from_hex(key_id, &text)?;
        Self::new(std::sync::Arc::new(signer), instruction_ttl_ms, rail_facts)
    }

    pub fn rail_fact_key_ids(&self) -> Vec<String> {
        self.rail_facts.key_ids().map(str::to_string).collect()
    }

    /// The instruction for `payout`, marked submitted under `fence`: every payment field from the
    /// payout row, never from a request; issued at paydb's submission time.
    fn instruction(
        &self,
        payout: &Payout,
        fence: &Fence,
    ) -> Option<grant_signing::instruction::SignedInstruction> {
        let issued_at_unix_ms = payout.submitted_at?.timestamp_millis();
        Some(
            self.instruction_signer
                .sign_instruction(grant_signing::instruction::Instruction {
                    payout_id: payout.payout_id.to_string(),
                    account_id: payout.account_id.to_string(),
                    currency: payout.currency.to_string(),
                    beneficiary_ref: payout.beneficiary_ref.clone(),
                    client_reference: payout.client_reference.clone(),
                    lock_key: fence.key().to_string(),
                    amount_minor: payout.amount_minor,
                    token: fence.token().get(),
                    issued_at_unix_ms,
                    expires_at_unix_ms: issued_at_unix_ms
                        .saturating_add(self.instruction_ttl_ms as i64),
                }),
        )
    }
}

/// A rail fact the payment resource does not record on: why (`grant_signing::rail_fact::REASONS`),
/// in words, and the key it named (empty when unsigned).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct FactRefusal {
    pub reason: &'static str,
    pub detail: String,
    pub signing_key_id: String,
}

impl FactRefusal {
    fn unsigned(what: &str) -> Self {
        Self {
            reason: "unsigned",
            detail: format!("{what} carries no signed fact of the rail proxy"),
            signing_key_id: String::new(),
        }
    }

    fn forged(forged: &Forged, key_id: &str) -> Self {
        Self {
            reason: forged.reason(),
            detail: match forged {
                Forged::Unsigned => "the fact carries no signature".to_string(),
                Forged::UnknownKeyId(id) => {
                    format!("the fact is signed by key {id:?}, which this resource does not know")
                }
                Forged::BadSignature => {
                    "the signature does not match the fact on this payout".to_string()
                }
            },
            signing_key_id: key_id.to_string(),
        }
    }

    fn contradicts(key_id: &str, detail: String) -> Self {
        Self {
            reason: "contradicts",
            detail,
            signing_key_id: key_id.to_string(),
        }
    }
}

impl SignedFacts {
    /// Whether `fact` is the rail proxy's signed outcome of `payout`'s submission saying what
    /// `outcome` asks: ACKED with that rail reference, or REJECTED with that decline code. TIMEOUT
    /// and OUTCOME_MISSING need none (both only lead to RAIL_AMBIGUOUS, which leaves only on
    /// signed evidence or a signed abandon: a forged one delays, never decides). The verified
    /// fact, for the transition's audit detail (`Null` when none was needed).
    pub(crate) fn check_outcome(
        &self,
        payout: &Payout,
        outcome: &RailOutcome,
        fact: Option<&RailFact>,
    ) -> Result<Value, FactRefusal> {
        let (name, fact_outcome, value) = match outcome {
            RailOutcome::Acked { rail_ref } => ("ACKED", "ACKED", rail_ref.as_str()),
            RailOutcome::Declined { decline_code } => {
                ("DECLINED", "REJECTED", decline_code.as_str())
            }
            RailOutcome::Timeout | RailOutcome::OutcomeMissing => return Ok(Value::Null),
        };
        let Some(fact) = fact else {
            return Err(FactRefusal::unsigned(&format!("RecordOutcome {name}")));
        };
        let key_id = fact.signature.key_id.as_str();
        self.rail_facts
            .verify_outcome(
                &fact.message(
                    payout.payout_id.as_str(),
                    payout.account_id.as_str(),
                    &payout.client_reference,
                ),
                &fact.signature,
            )
            .map_err(|forged| FactRefusal::forged(&forged, key_id))?;
        let recorded = if fact_outcome == "ACKED" {
            &fact.rail_ref
        } else {
            &fact.decline_code
        };
        if fact.outcome != fact_outcome || recorded.as_str() != value {
            return Err(FactRefusal::contradicts(
                key_id,
                format!(
                    "RecordOutcome {name} {value:?}, but the rail proxy recorded {} (rail_ref {:?}, decline_code {:?})",
                    fact.outcome, fact.rail_ref, fact.decline_code
                ),
            ));
        }
        Ok(
            json!({"outcome": fact.outcome, "rail_ref": fact.rail_ref, "decline_code": fact.decline_code,
                  "token": fact.token, "signed_at_unix_ms": fact.signed_at_unix_ms,
                  "signing_key_id": key_id, "signature": grant_signing::to_hex(&fact.signature.bytes)}),
        )
    }

    /// Whether `proof` is the rail proxy's signed evidence of an inquiry about `payout` saying
    /// what `evidence` asks: FOUND listing that rail reference, or ABSENT / NEVER_SENT for
    /// ABSENT. The verified evidence, for the transition's audit detail.
    pub(crate) fn check_evidence(
        &self,
        payout: &Payout,
        evidence: &Evidence,
        proof: Option<&RailEvidence>,
    ) -> Result<Value, FactRefusal> {
        let name = match evidence {
            Evidence::Found { .. } => "FOUND",
            Evidence::Absent => "ABSENT",
        };
        let Some(proof) = proof else {
            return Err(FactRefusal::unsigned(&format!("ResolveAmbiguity {name}")));
        };
        let key_id = proof.signature.key_id.as_str();
        self.rail_facts
            .verify_evidence(
                &proof.message(
                    payout.payout_id.as_str(),
                    payout.account_id.as_str(),
                    &payout.client_reference,
                ),
                &proof.signature,
            )
            .map_err(|forged| FactRefusal::forged(&forged, key_id))?;
        let agrees = match evidence {
            Evidence::Found { rail_ref } => {
                proof.evidence == "FOUND" && proof.rail_refs.iter().any(|r| r == rail_ref)
            }
            Evidence::Absent => matches!(proof.evidence.as_str(), "ABSENT" | "NEVER_SENT"),
        };
        if !agrees {
            let asked = match evidence {
                Evidence::Found { rail_ref } => format!("FOUND {rail_ref:?}"),
                Evidence::Absent => "ABSENT".to_string(),
            };
            return Err(FactRefusal::contradicts(
                key_id,
                format!(
                    "ResolveAmbiguity {asked}, but the rail proxy's evidence is {} {:?}",
                    proof.evidence, proof.rail_refs
                ),
            ));
        }
        Ok(
            json!({"evidence": proof.evidence, "rail_refs": proof.rail_refs, "asked_by": proof.asked_by,
                  "asked_at_unix_ms": proof.asked_at_unix_ms, "signing_key_id": key_id,
                  "signature": grant_signing::to_hex(&proof.signature.bytes)}),
        )
    }
}

/// Finance's resolution SLA for an ambiguous payout before an operator may abandon it (spec 2.3,
/// RAIL_AMBIGUOUS -> ABANDONED): one hour unless the deployment says otherwise.
pub const RESOLUTION_SLA_DEFAULT: std::time::Duration = std::time::Duration::from_secs(3_600);

impl StoreOptions {
    /// A serving store: every fenced call's grant must carry the signature of one of `verifier`'s
    /// keys (the binary's `--grant-verify-keys`), and it signs instructions and checks rail facts
    /// with `facts` (required: there is no unsigned mode).
    pub fn new(verifier: Verifier, facts: SignedFacts) -> Self {
        Self {
            verifier,
            facts: Some(facts),
            ..Self::without_grant_keys()
        }
    }
    /// A store that knows no grant signing key, for a caller that makes no fenced call (the
    /// fixture command opens accounts only): fail closed, every fenced call is refused as
    /// `forged_grant` (`unsigned`, or `unknown_key_id`).
    pub fn without_grant_keys() -> Self {
        Self {
            verifier: Verifier::refusing_all(),
            fence_predicate: true,
            grant_verification: true,
            key_binding: true,
            resolution_sla: RESOLUTION_SLA_DEFAULT,
            operators: Verifier::refusing_all(),
            operator_verification: true,
            operator_certification: true,
            restore_check: true,
            start_staging: true,
            facts: None,
            rail_fact_verification: true,
        }
    }
    /// The registered operators (`name=hex,...`, `payoutctl keys operator`): an abandon is carried
    /// out, and an accepted decision recorded as accepted, only under one of their signatures.
    pub fn with_operator_keys(mut self, operators: Verifier) -> Self {
        self.operators = operators;
        self
    }
    /// NEGATIVE CONTROL ONLY: the guard's predicate is dropped, so a stale token's write lands.
    /// Tests use it to show that the guarded tests detect what they claim to.
    #[doc(hidden)]
    pub fn without_fence_predicate_for_tests(mut self) -> Self {
        self.fence_predicate = false;
        self
    }
    /// NEGATIVE CONTROL ONLY: the grant's signature is not verified, so a fabricated token (any
    /// integer with any key) reaches the fence statement. Tests use it to show that the
    /// forged-grant tests detect what they claim to.
    #[doc(hidden)]
    pub fn without_grant_verification_for_tests(mut self) -> Self {
        self.grant_verification = false;
        self
    }
    /// NEGATIVE CONTROL ONLY: the fence statement is not bound to the signed key's account, so a
    /// genuine grant for another account's key advances this account's fence. Tests use it to show
    /// that the grant-for-another-key tests detect what they claim to.
    #[doc(hidden)]
    pub fn without_key_binding_for_tests(mut self) -> Self {
        self.key_binding = false;
        self
    }
    /// NEGATIVE CONTROL ONLY: operator signatures are not verified, so an unsigned abandon is
    /// carried out. Tests use it to show that the operator-signature tests detect what they claim.
    #[doc(hidden)]
    pub fn without_operator_verification_for_tests(mut self) -> Self {
        self.operator_verification = false;
        self
    }
    /// NEGATIVE CONTROL ONLY: ReplayQuarantined records the operator the request names without
    /// asking whether the caller's certificate carries that name, so an operator's certificate
    /// can release a row under another operator's name. Tests use it to show that the
    /// certified-operator tests detect what they claim to.
    #[doc(hidden)]
    pub fn without_operator_certification_for_tests(mut self) -> Self {
        self.operator_certification = false;
        self
    }
    /// NEGATIVE CONTROL ONLY: the fence statement does not ask whether this database is a copy
    /// restored from a backup (`incarnation_admits`), so a stale token passes a rewound fence.
    /// Tests use it to show that the restore tests detect what they claim to.
    #[doc(hidden)]
    pub fn without_restore_check_for_tests(mut self) -> Self {
        self.restore_check = false;
        self
    }
    /// NEGATIVE CONTROL ONLY: CreatePayout commits the payout row without staging its workflow's
    /// start, as before paydb 0009, so nobody starts a workflow for it. Tests use it to show that
    /// the intake tests detect a stranded payout.
    #[doc(hidden)]
    pub fn without_start_staging_for_tests(mut self) -> Self {
        self.start_staging = false;
        self
    }
    /// NEGATIVE CONTROL ONLY (feature `negative-controls`, which no shipped binary has):
    /// RecordOutcome and ResolveAmbiguity record what the caller says about the rail without the
    /// rail proxy's signed fact, as before issue 33. Tests use it to show that the rail-fact tests
    /// detect what they claim to.
    #[cfg(feature = "negative-controls")]
    #[doc(hidden)]
    pub fn without_rail_fact_verification_for_tests(mut self) -> Self {
        self.rail_fact_verification = false;
        self
    }
    /// The resolution SLA this resource enforces: it decides from its own record when a
    /// payout became RAIL_AMBIGUOUS, on the database's clock, never from what a caller asserts.
    pub fn with_resolution_sla(mut self, sla: std::time::Duration) -> Self {
        self.resolution_sla = sla;
        self
    }
    pub fn fence_predicate_enabled(&self) -> bool {
        self.fence_predicate
    }
    pub fn grant_verification_enabled(&self) -> bool {
        self.grant_verification
    }
    pub fn key_binding_enabled(&self) -> bool {
        self.key_binding
    }
    pub fn restore_check_enabled(&self) -> bool {
        self.restore_check
    }
    pub fn operator_certification_enabled(&self) -> bool {
        self.operator_certification
    }
}

/// The `operation` of every fenced call (`begin_fenced`): the guard's refusal counters are
/// registered at 0 for each, so the first refusal is an increase Prometheus sees.
const FENCED_OPERATIONS: [&str; 6] = [
    "claim",
    "mark_submitted",
    "record_outcome",
    "resolve_ambiguity",
    "abandon",
    "post",
];

#[derive(Clone)]
struct Counters {
    /// `fenced_out_total`, `forged_grants_total`, `grants_for_another_key_total` and
    /// `database_restored_refusals_total` under `guard="payment_resource"`.
    guard: service_kit::GuardCounters,
    refused_transitions: IntCounterVec,
    account_busy: IntCounterVec,
    transitions: IntCounterVec,
    operator_not_verified: IntCounterVec,
    funding_refused: IntCounterVec,
    rail_facts_refused: IntCounterVec,
    /// `payout_duration_seconds{final_state}`: creation to the terminal transition's commit.
    payout_duration: service_kit::prometheus::HistogramVec,
}

#[derive(Clone)]
pub struct Store {
    pool: PgPool,
    options: StoreOptions,
    counters: Counters,
    /// Registered with the counters (once per registry); `serve` measures into them.
    payout_ages: crate::payout_ages::PayoutAgeGauges,
}

#[derive(sqlx::FromRow)]
struct PayoutRow {
    id: String,
    account_id: String,
    amount_minor: i64,
    currency: String,
    beneficiary_ref: String,
    state: String,
    client_reference: String,
    claimed_by: Option<String>,
    token_stamp: Option<i64>,
    failure_reason: Option<String>,
    rail_ref: Option<String>,
    rail_outcome: Option<String>,
    transaction_group: Option<Uuid>,
    created_at: DateTime<Utc>,
    claimed_at: Option<DateTime<Utc>>,
    submitted_at: Option<DateTime<Utc>>,
    settled_at: Option<DateTime<Utc>>,
    updated_at: DateTime<Utc>,
    /// 0 at creation, +1 per transition: the payout's lifecycle event of this row is
    /// `version + 1` (`outbox::payout_event_key`).
    version: i64,
}

fn stored<T, E: std::fmt::Display>(what: &str, r: Result<T, E>) -> Result<T, ServerError> {
    r.map_err(|e| ServerError::InvariantBroken(format!("stored {what} is invalid: {e}")))
}

fn token_of(value: Option<i64>) -> Option<u64> {
    value.and_then(|t| u64::try_from(t).ok())
}

impl PayoutRow {
    fn into_model(self) -> Result<Payout, ServerError> {
        Ok(Payout {
            payout_id: stored("payout id", PayoutId::parse(self.id))?,
            account_id: stored("account id", AccountId::parse(self.account_id))?,
            amount_minor: self.amount_minor,
            currency: stored("currency", Currency::parse(&self.currency))?,
            beneficiary_ref: self.beneficiary_ref,
            state: PayoutState::parse(&self.state).ok_or_else(|| {
                ServerError::InvariantBroken(format!("stored state {:?} is unknown", self.state))
            })?,
            client_reference: self.client_reference,
            claimed_by: self.claimed_by,
            token_stamp: token_of(self.token_stamp),
            failure_reason: self.failure_reason,
            rail_ref: self.rail_ref,
            rail_outcome: self.rail_outcome,
            transaction_group: self.transaction_group,
            created_at: self.created_at,
            claimed_at: self.claimed_at,
            submitted_at: self.submitted_at,
            settled_at: self.settled_at,
            updated_at: self.updated_at,
            instruction: None,
        })
    }
}

#[derive(sqlx::FromRow)]
struct AccountRow {
    id: String,
    currency: String,
    balance_minor: i64,
    opening_balance_minor: i64,
    fence: i64,
    version: i64,
    created_at: DateTime<Utc>,
    updated_at: DateTime<Utc>,
}

impl AccountRow {
    fn into_model(self) -> Result<Account, ServerError> {
        Ok(Account {
            account_id: stored("account id", AccountId::parse(self.id))?,
            currency: stored("currency", Currency::parse(&self.currency))?,
            balance_minor: self.balance_minor,
            opening_balance_minor: self.opening_balance_minor,
            fence: stored("fence", u64::try_from(self.fence))?,
            version: self.version,
            created_at: self.created_at,
            updated_at: self.updated_at,
        })
    }
}

#[derive(sqlx::FromRow)]
struct EntryRow {
    id: i64,
    transaction_group: Uuid,
    line_number: i16,
    account_id: String,
    currency: String,
    amount_minor: i64,
    counterparty: String,
    payout_id: Option<String>,
    token: Option<i64>,
    created_at: DateTime<Utc>,
}

impl From<EntryRow> for LedgerEntry {
    fn from(r: EntryRow) -> Self {
        LedgerEntry {
            id: r.id,
            transaction_group: r.transaction_group,
            line_number: r.line_number,
            account_id: r.account_id,
            currency: r.currency,
            amount_minor: r.amount_minor,
            counterparty: r.counterparty,
            payout_id: r.payout_id,
            token: token_of(r.token),
            created_at: r.created_at,
        }
    }
}

#[derive(sqlx::FromRow)]
struct AuditRow {
    id: i64,
    payout_id: Option<String>,
    account_id: Option<String>,
    kind: String,
    actor: String,
    owner: Option<String>,
    token: Option<i64>,
    from_state: Option<String>,
    to_state: Option<String>,
    event: Option<String>,
    detail: String,
    at: DateTime<Utc>,
}

impl AuditRow {
    fn into_model(self) -> AuditEvent {
        AuditEvent {
            id: self.id,
            payout_id: self.payout_id,
            account_id: self.account_id,
            kind: self.kind,
            actor: self.actor,
            owner: self.owner,
            token: token_of(self.token),
            from_state: self.from_state,
            to_state: self.to_state,
            event: self.event,
            detail: serde_json::from_str(&self.detail).unwrap_or(Value::Null),
            at: self.at,
        }
    }
}

/// One audit row to append.
struct Audit<'a> {
    payout_id: Option<&'a str>,
    account_id: Option<&'a str>,
    kind: &'static str,
    actor: &'a str,
    owner: Option<&'a str>,
    token: Option<i64>,
    from_state: Option<&'a str>,
    to_state: Option<&'a str>,
    event: Option<&'a str>,
    detail: Value,
}

/// An opening balance is never negative.
fn not_negative(opening_balance_minor: i64) -> Result<(), ServerError> {
    if opening_balance_minor < 0 {
        return Err(PaymentError::invalid(
            "opening_balance_minor",
            InvalidReason::OpeningBalanceNegative,
        )
        .into());
    }
    Ok(())
}

async fn insert_audit<'e, E: sqlx::PgExecutor<'e>>(
    executor: E,
    a: &Audit<'_>,
) -> Result<AuditEvent, sqlx::Error> {
    let row: AuditRow = sqlx::query_as(&format!(
        "INSERT INTO audit_event (payout_id, account_id, kind, actor, owner, token, from_state, to_state, event, detail) \
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10::jsonb) RETURNING {AUDIT_COLUMNS}"
    ))
    .bind(a.payout_id)
    .bind(a.account_id)
    .bind(a.kind)
    .bind(a.actor)
    .bind(a.owner)
    .bind(a.token)
    .bind(a.from_state)
    .bind(a.to_state)
    .bind(a.event)
    .bind(a.detail.to_string())
    .fetch_one(executor)
    .await?;
    Ok(row.into_model())
}

/// A transaction that has passed the guard: the account row is locked and its fence advanced,
/// the payout row is locked.
struct Fenced {
    tx: Transaction<'static, Postgres>,
    payout: Payout,
    balance_minor: i64,
    now: DateTime<Utc>,
}

/// The events that answer a repeat of `event` under the grant that made it: a claim is recorded
/// as CLAIM or, short of funds, FUNDS_INSUFFICIENT; every other step as itself.
fn recorded_as(event: PayoutEvent) -> &'static [PayoutEvent] {
    match event {
        PayoutEvent::Claim | PayoutEvent::FundsInsufficient => {
            &[PayoutEvent::Claim, PayoutEvent::FundsInsufficient]
        }
        PayoutEvent::SubmissionAccepted => &[PayoutEvent::SubmissionAccepted],
        PayoutEvent::RailAcked => &[PayoutEvent::RailAcked],
        PayoutEvent::RailDeclined => &[PayoutEvent::RailDeclined],
        PayoutEvent::RailTimeout => &[PayoutEvent::RailTimeout],
        PayoutEvent::OutcomeMissing => &[PayoutEvent::OutcomeMissing],
        PayoutEvent::Posted => &[PayoutEvent::Posted],
        PayoutEvent::EvidenceFound => &[PayoutEvent::EvidenceFound],
        PayoutEvent::EvidenceAbsent => &[PayoutEvent::EvidenceAbsent],
        PayoutEvent::OperatorAbandon => &[PayoutEvent::OperatorAbandon],
    }
}

/// Whether the payout's audit trail holds `event`'s transition made under `fence`'s grant (its
/// token and owner), read in the fenced transaction (which holds the payout's row lock).
async fn made_under_this_grant(
    fenced: &mut Fenced,
    event: PayoutEvent,
    fence: &Fence,
) -> Result<bool, ServerError> {
    let events: Vec<&str> = recorded_as(event).iter().map(|e| e.as_str()).collect();
    let made: bool = sqlx::query_scalar(
        "SELECT EXISTS (SELECT 1 FROM audit_event WHERE payout_id = $1 AND kind = 'transition' \
         AND event = ANY($2) AND token = $3 AND owner = $4)",
    )
    .bind(fenced.payout.payout_id.as_str())
    .bind(&events)
    .bind(fence.token().as_i64())
    .bind(fence.owner())
    .fetch_one(&mut *fenced.tx)
    .await?;
    Ok(made)
}

/// The columns a transition sets besides its state and token stamp.
#[derive(Default)]
struct Changes {
    claimed_by: Option<String>,
    claimed_now: bool,
    submitted_now: bool,
    settled_now: bool,
    failure_reason: Option<String>,
    rail_ref: Option<String>,
    rail_outcome: Option<&'static str>,
    transaction_group: Option<Uuid>,
}

fn is_constraint(err: &sqlx::Error, name: &str) -> bool {
    err.as_database_error().and_then(|e| e.constraint()) == Some(name)
}

/// A create's `INSERT ... ON CONFLICT (id) DO NOTHING` answers "no row" when the id exists. A
/// concurrent create of the same id can instead fail on the table's other unique key (the payout's
/// client reference, the account's (id, currency)): PostgreSQL arbitrates only the conflict target
/// and checks the other unique indexes normally, so the loser of the race waits for the winner's
/// commit and gets a unique violation. That is the same answer as "the id exists": the caller
/// re-reads the winner's row and compares.
fn lost_create_race<T>(err: sqlx::Error) -> Result<Option<T>, sqlx::Error> {
    match err.as_database_error().and_then(|e| e.code()) {
        Some(code) if code == "23505" => Ok(None),
        _ => Err(err),
    }
}

impl Store {
    pub fn new(pool: PgPool, options: StoreOptions, metrics: &service_kit::Metrics) -> Self {
        let counters = Counters {
            guard: service_kit::GuardCounters::register(
                metrics,
                service_kit::Guard::PaymentResource,
                &FENCED_OPERATIONS,
            ),
            refused_transitions: metrics.counter_vec(
                "payment_refused_transitions_total",
                "Transitions refused by the 2.3 table (INV-08 defect signal). Alert on any.",
                &["from", "event"],
            ),
            account_busy: metrics.counter_vec(
                "payment_account_busy_total",
                "Claims refused because another payout of the account is in flight.",
                &["operation"],
            ),
            transitions: metrics.counter_vec(
                "payment_transitions_total",
                "Payout transitions performed.",
                &["from", "to"],
            ),
            operator_not_verified: metrics.counter_vec(
                "payment_operator_not_verified_total",
                "Operator decisions whose signature was missing, unknown, wrong or stale (refused and audited). Alert on any.",
                &["decision", "reason"],
            ),
            funding_refused: {
                let refused = metrics.counter_vec(
                    "payment_funding_refused_total",
                    "OpenAccount with a positive balance refused: the operator's funding signature was missing, unknown, wrong or stale (nothing written). Alert on any.",
                    &["reason"],
                );
                for reason in ["unsigned", "unknown_operator", "bad_signature", "stale"] {
                    refused.with_label_values(&[reason]).inc_by(0);
                }
                refused
            },
            rail_facts_refused: metrics.counter_vec(
                "payment_rail_facts_refused_total",
                "RecordOutcome (ACKED, DECLINED) and ResolveAmbiguity calls without the rail proxy's signed fact saying the same thing (refused and audited): a caller's word about the rail. Alert on any.",
                &["operation", "reason"],
            ),
            payout_duration: metrics.histogram_vec(
                "payout_duration_seconds",
                "A payout's end-to-end latency: from its creation in paydb to the commit of its terminal transition, by final state (POSTED, FAILED, ABANDONED).",
                &["final_state"],
                service_kit::latency::PAYOUT_BUCKETS_SECONDS,
            ),
        };
        Self {
            pool,
            options,
            counters,
            payout_ages: crate::payout_ages::PayoutAgeGauges::register(metrics),
        }
    }

    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// Whether break-glass calls are recorded only under the operator the caller's certificate
    /// carries: always, except in a negative control
    /// (`StoreOptions::without_operator_certification_for_tests`).
    pub fn certifies_operators(&self) -> bool {
        self.options.operator_certification
    }

    /// The resolution SLA this resource enforces (`StoreOptions::with_resolution_sla`).
    pub fn resolution_sla(&self) -> std::time::Duration {
        self.options.resolution_sla
    }

    /// The gauges of the payouts in flight (`payout_ages`).
    pub fn payout_age_gauges(&self) -> &crate::payout_ages::PayoutAgeGauges {
        &self.payout_ages
    }

    /// The account of a payout, outside any transaction (`None`: no such payout): what a
    /// refusal's audit row and an operator's decision name.
    async fn account_of(&self, payout_id: &PayoutId) -> Result<Option<String>, sqlx::Error> {
        sqlx::query_scalar("SELECT account_id FROM payout WHERE id = $1")
            .bind(payout_id.as_str())
            .fetch_optional(&self.pool)
            .await
    }

    // ----- the guard -----

    async fn begin_fenced(
        &self,
        payout_id: &PayoutId,
        fence: &Fence,
        operation: &str,
    ) -> Result<Fenced, ServerError> {
        // The signature first: a grant the lock service did not sign reaches no statement.
        if let Err(forged) = self.verify_grant(fence) {
            return Err(self.forged_grant(payout_id, fence, operation, forged).await);
        }
        // Then the fence statement, bound to the account the grant was signed for.
        let signed_account = account_of_lock_key(fence.key());
        let mut tx = self.pool.begin().await?;
        let sql = fence_advance_sql(
            self.options.fence_predicate,
            self.options.key_binding,
            self.options.restore_check,
        );
        let mut statement = sqlx::query_as(&sql)
            .bind(payout_id.as_str())
            .bind(fence.token().as_i64());
        if self.options.key_binding {
            statement = statement.bind(signed_account.as_ref().map(AccountId::as_str));
        }
        let advanced: Option<(String, i64, i64, DateTime<Utc>)> =
            statement.fetch_optional(&mut *tx).await?;
        let Some((_account, _fence, balance_minor, now)) = advanced else {
            tx.rollback().await?;
            return Err(self
                .fenced_out_or_unknown(payout_id, fence, operation)
                .await);
        };
        let row: PayoutRow = sqlx::query_as(&format!(
            "SELECT {PAYOUT_COLUMNS} FROM payout WHERE id = $1 FOR UPDATE"
        ))
        .bind(payout_id.as_str())
        .fetch_one(&mut *tx)
        .await?;
        Ok(Fenced {
            tx,
            payout: row.into_model()?,
            balance_minor,
            now,
        })
    }

    /// Whether the fence's grant is the lock service's: its signature over (key, token, owner)
    /// by one of the configured keys.
    fn verify_grant(&self, fence: &Fence) -> Result<(), Forged> {
        if !self.options.grant_verification {
            return Ok(());
        }
        self.options.verifier.verify(
            fence.key(),
            fence.token().get(),
            fence.owner(),
            fence.signature(),
        )
    }

    /// The verdict of `check` on the configured rail-fact keys. A store without them (the
    /// fixture command's) refuses every fact as signed by an unknown key.
    fn verify_rail_fact(
        &self,
        check: impl FnOnce(&SignedFacts) -> Result<Value, FactRefusal>,
    ) -> Result<Value, FactRefusal> {
        if !self.options.rail_fact_verification {
            return Ok(Value::Null);
        }
        match &self.options.facts {
            Some(facts) => check(facts),
            None => Err(FactRefusal {
                reason: "unknown_key_id",
                detail: "this store knows no rail proxy key".to_string(),
                signing_key_id: String::new(),
            }),
        }
    }

    /// A RecordOutcome or ResolveAmbiguity without the rail proxy's signed fact saying the same:
    /// the transaction (and the fence's advance) rolled back, the refusal's audit row in its own
    /// statement, counted, logged.
    async fn rail_fact_refused(
        &self,
        fenced: Fenced,
        fence: &Fence,
        operation: &str,
        refusal: FactRefusal,
    ) -> ServerError {
        let payout = fenced.payout;
        if let Err(e) = fenced.tx.rollback().await {
            return e.into();
        }
        self.counters
            .rail_facts_refused
            .with_label_values(&[operation, refusal.reason])
            .inc();
        tracing::warn!(
            event = "rail_fact_refused", payout_id = %payout.payout_id, operation, reason = refusal.reason,
            signing_key_id = refusal.signing_key_id, owner = fence.owner(), token = fence.token().get(),
            detail = refusal.detail, "rail fact refused: the caller's word about the rail is not recorded"
        );
        let audit = Audit {
            payout_id: Some(payout.payout_id.as_str()),
            account_id: Some(payout.account_id.as_str()),
            kind: "rail_fact_refused",
            actor: Actor::Holder.as_str(),
            owner: Some(fence.owner()),
            token: Some(fence.token().as_i64()),
            from_state: Some(payout.state.as_str()),
            to_state: None,
            event: Some(operation),
            detail: json!({"operation": operation, "reason": refusal.reason, "detail": refusal.detail,
                           "signing_key_id": refusal.signing_key_id}),
        };
        if let Err(e) = insert_audit(&self.pool, &audit).await {
            // The refusal stands (nothing was written); only its evidence row is missing.
            tracing::error!(error = %e, payout_id = %payout.payout_id, "could not record the rail_fact_refused audit event");
        }
        PaymentError::RailFactRefused {
            payout_id: payout.payout_id.to_string(),
            operation: operation.to_string(),
            reason: refusal.reason.to_string(),
            detail: refusal.detail,
            signing_key_id: refusal.signing_key_id,
        }
        .into()
    }

    /// A grant the lock service did not sign: nothing ran but this refusal's audit row (in its own
    /// statement, as every refusal's) and a counter.
    async fn forged_grant(
        &self,
        payout_id: &PayoutId,
        fence: &Fence,
        operation: &str,
        forged: Forged,
    ) -> ServerError {
        let reason = forged.reason();
        let key = fence.key();
        let signing_key_id = fence.signature().key_id.as_str();
        let presented = fence.token().get();
        self.counters.guard.forged_grant(operation, reason);
        tracing::warn!(
            event = "forged_grant", payout_id = %payout_id, key, token = presented, owner = fence.owner(),
            signing_key_id, reason, operation, "grant refused: not signed by the lock service"
        );
        // The payout's account, for the audit trail only (NULL if there is no such payout: the
        // forger learns nothing of it, the refusal is the same).
        let account_id = match self.account_of(payout_id).await {
            Ok(found) => found,
            Err(e) => {
                tracing::error!(error = %e, payout_id = %payout_id, "could not read the payout's account for the forged_grant audit event");
                None
            }
        };
        let audit = Audit {
            payout_id: Some(payout_id.as_str()),
            account_id: account_id.as_deref(),
            kind: "forged_grant",
            actor: Actor::Holder.as_str(),
            owner: Some(fence.owner()),
            token: Some(fence.token().as_i64()),
            from_state: None,
            to_state: None,
            event: Some(operation),
            detail: json!({"key": key, "presented": presented, "owner": fence.owner(),
                           "signing_key_id": signing_key_id, "reason": reason, "operation": operation}),
        };
        if let Err(e) = insert_audit(&self.pool, &audit).await {
            // The rejection stands (nothing was written); only its evidence row is missing.
            tracing::error!(error = %e, payout_id = %payout_id, "could not record the forged_grant audit event");
        }
        PaymentError::ForgedGrant {
            key: key.to_string(),
            presented,
            owner: fence.owner().to_string(),
            signing_key_id: signing_key_id.to_string(),
            reason: reason.to_string(),
            payout_id: payout_id.to_string(),
        }
        .into()
    }

    /// A genuine grant for another key than the payout's account's: the bound fence statement
    /// advanced nothing; recorded like every refusal.
    async fn grant_for_another_key(
        &self,
        payout_id: &PayoutId,
        account_id: &str,
        required_key: String,
        fence: &Fence,
        operation: &str,
    ) -> ServerError {
        let presented = fence.token().get();
        self.counters.guard.grant_for_another_key(operation);
        tracing::warn!(
            event = "grant_for_another_key", payout_id = %payout_id, key = fence.key(), required_key,
            token = presented, owner = fence.owner(), account_id, operation,
            "grant refused: signed for another lock key than the payout's account's"
        );
        let audit = Audit {
            payout_id: Some(payout_id.as_str()),
            account_id: Some(account_id),
            kind: "grant_for_another_key",
            actor: Actor::Holder.as_str(),
            owner: Some(fence.owner()),
            token: Some(fence.token().as_i64()),
            from_state: None,
            to_state: None,
            event: Some(operation),
            detail: json!({"presented_key": fence.key(), "required_key": required_key, "presented": presented,
                           "owner": fence.owner(), "operation": operation}),
        };
        if let Err(e) = insert_audit(&self.pool, &audit).await {
            tracing::error!(error = %e, payout_id = %payout_id, "could not record the grant_for_another_key audit event");
        }
        PaymentError::GrantForAnotherKey {
            presented_key: fence.key().to_string(),
            required_key,
            presented,
            owner: fence.owner().to_string(),
            payout_id: payout_id.to_string(),
        }
        .into()
    }

    /// After the guard found no row: the payout does not exist, or the grant is for another key
    /// than its account's, or the token is stale. The rejection is recorded in its own statement
    /// (the rejected transaction was rolled back whole).
    async fn fenced_out_or_unknown(
        &self,
        payout_id: &PayoutId,
        fence: &Fence,
        operation: &str,
    ) -> ServerError {
        // A token below the last re-arming's horizon is stale like one below the fence: every
        // fence was raised to that horizon, and the holder re-acquires.
        let mut token_floor = 0i64;
        if self.options.restore_check {
            match self.restore_refusal(payout_id, fence, operation).await {
                Ok(Err(refusal)) => return refusal,
                Ok(Ok(floor)) => token_floor = floor,
                Err(e) => return e.into(),
            }
        }
        let found: Result<Option<(String, i64)>, sqlx::Error> = sqlx::query_as(
            "SELECT p.account_id, a.fence FROM payout p JOIN account a ON a.id = p.account_id WHERE p.id = $1",
        )
        .bind(payout_id.as_str())
        .fetch_optional(&self.pool)
        .await;
        let (account_id, stored_fence) = match found {
            Ok(Some(found)) => found,
            Ok(None) => {
                return PaymentError::PayoutNotFound {
                    payout_id: payout_id.to_string(),
                }
                .into()
            }
            Err(e) => return e.into(),
        };
        let key = lock_key(
            &AccountId::parse(account_id.clone()).unwrap_or_else(|_| unreachable_account()),
        );
        if self.options.key_binding && fence.key() != key {
            return self
                .grant_for_another_key(payout_id, &account_id, key, fence, operation)
                .await;
        }
        let presented = fence.token().get();
        let stored = u64::try_from(stored_fence.max(token_floor)).unwrap_or(0);
        self.counters.guard.fenced_out(operation);
        tracing::warn!(
            event = "fenced_out", key, presented, stored, owner = fence.owner(), payout_id = %payout_id,
            account_id, operation, "stale token rejected by the account fence"
        );
        let audit = Audit {
            payout_id: Some(payout_id.as_str()),
            account_id: Some(&account_id),
            kind: "fenced_out",
            actor: Actor::Holder.as_str(),
            owner: Some(fence.owner()),
            token: Some(fence.token().as_i64()),
            from_state: None,
            to_state: None,
            event: Some(operation),
            detail: json!({"key": key, "presented": presented, "stored": stored, "owner": fence.owner(), "operation": operation}),
        };
        if let Err(e) = insert_audit(&self.pool, &audit).await {
            // The rejection stands (nothing was written); only its evidence row is missing.
            tracing::error!(error = %e, payout_id = %payout_id, "could not record the fenced_out audit event");
        }
        PaymentError::FencedOut {
            key,
            presented,
            stored,
            owner: fence.owner().to_string(),
            account_id,
            payout_id: payout_id.to_string(),
        }
        .into()
    }

    /// After the guard found no row: whether it is because this database is a copy restored from
    /// a backup and not re-armed (`Err`, the refusal, recorded like every refusal), else the token
    /// floor of its last re-arming (`Ok`; a token below it is fenced out by the caller). Asked
    /// before anything else, since every other answer read from a restored copy (the payout, its
    /// fence) may be rewound.
    async fn restore_refusal(
        &self,
        payout_id: &PayoutId,
        fence: &Fence,
        operation: &str,
    ) -> Result<Result<i64, ServerError>, sqlx::Error> {
        let (current, token_floor): (bool, i64) = sqlx::query_as(
            "SELECT incarnation_is_current(), coalesce((SELECT token_floor FROM incarnation), 0)",
        )
        .fetch_one(&self.pool)
        .await?;
        if current {
            return Ok(Ok(token_floor));
        }
        let presented = fence.token().get();
        let token_floor = u64::try_from(token_floor).unwrap_or(0);
        self.counters.guard.database_restored(operation);
        tracing::error!(
            event = "database_restored", alert = true, payout_id = %payout_id, key = fence.key(),
            presented, owner = fence.owner(), incarnation_current = current, token_floor, operation,
            "fenced call refused: paydb is a restored copy that was not re-armed, or the token is below the re-arming's horizon (RESTORE.md: A guard's database restored)"
        );
        let account_id = self.account_of(payout_id).await.unwrap_or(None);
        let audit = Audit {
            payout_id: account_id.as_ref().map(|_| payout_id.as_str()),
            account_id: account_id.as_deref(),
            kind: "database_restored",
            actor: Actor::Holder.as_str(),
            owner: Some(fence.owner()),
            token: Some(fence.token().as_i64()),
            from_state: None,
            to_state: None,
            event: Some(operation),
            detail: json!({"key": fence.key(), "presented": presented, "owner": fence.owner(),
                           "incarnation_current": current, "token_floor": token_floor,
                           "operation": operation}),
        };
        if let Err(e) = insert_audit(&self.pool, &audit).await {
            tracing::error!(error = %e, payout_id = %payout_id, "could not record the database_restored audit event");
        }
        Ok(Err(PaymentError::DatabaseRestored {
            payout_id: payout_id.to_string(),
            presented,
            incarnation_current: current,
            token_floor,
        }
        .into()))
    }

    /// A transition the table does not allow: nothing changes but the audit trail and a counter.
    async fn refuse(
        &self,
        fenced: Fenced,
        refusal: payout_domain::RefusedTransition,
        actor: Actor,
        fence: Option<&Fence>,
    ) -> ServerError {
        let payout = fenced.payout.clone();
        if let Err(e) = fenced.tx.rollback().await {
            return e.into();
        }
        self.refuse_outside_transaction(&payout, refusal, actor, fence)
            .await
    }

    async fn refuse_outside_transaction(
        &self,
        payout: &Payout,
        refusal: payout_domain::RefusedTransition,
        actor: Actor,
        fence: Option<&Fence>,
    ) -> ServerError {
        let error = PaymentError::refused(payout.payout_id.as_str(), refusal, actor);
        let PaymentError::RefusedTransition {
            from,
            event,
            required,
            ..
        } = &error
        else {
            return error.into();
        };
        self.counters
            .refused_transitions
            .with_label_values(&[from.as_str(), event.as_str()])
            .inc();
        tracing::warn!(
            event = "refused_transition", payout_id = %payout.payout_id, account_id = %payout.account_id,
            from, transition_event = event, actor = actor.as_str(), token = fence.map(|f| f.token().get()),
            "transition refused by the payout state table"
        );
        let audit = Audit {
            payout_id: Some(payout.payout_id.as_str()),
            account_id: Some(payout.account_id.as_str()),
            kind: "refused_transition",
            actor: actor.as_str(),
            owner: fence.map(|f| f.owner()),
            token: fence.map(|f| f.token().as_i64()),
            from_state: Some(from),
            to_state: None,
            event: Some(event),
            detail: json!({"required_actor": required}),
        };
        if let Err(e) = insert_audit(&self.pool, &audit).await {
            tracing::error!(error = %e, payout_id = %payout.payout_id, "could not record the refused_transition audit event");
        }
        error.into()
    }

    /// Writes the transition, its audit row and its lifecycle event's outbox row (kind
    /// TRANSACTION_EVENT, on the payout's account, version = the payout's version + 1), then
    /// commits: all or nothing. `operator` is the verified operator of an operator's step, who is
    /// the event's actor; otherwise the grant's owner is.
    #[allow(clippy::too_many_arguments)]
    async fn commit_transition(
        &self,
        mut fenced: Fenced,
        event: PayoutEvent,
        actor: Actor,
        operator: Option<&str>,
        fence: &Fence,
        to: PayoutState,
        changes: Changes,
        detail: Value,
    ) -> Result<Payout, ServerError> {
        let from = fenced.payout.state;
        let updated: Result<Option<PayoutRow>, sqlx::Error> = sqlx::query_as(&format!(
            "UPDATE payout SET state = $2, token_stamp = $3, version = version + 1, updated_at = now(), \
               claimed_by = COALESCE($4, claimed_by), \
               claimed_at = CASE WHEN $5 THEN now() ELSE claimed_at END, \
               submitted_at = CASE WHEN $6 THEN now() ELSE submitted_at END, \
               settled_at = CASE WHEN $7 THEN now() ELSE settled_at END, \
               failure_reason = COALESCE($8, failure_reason), \
               rail_ref = COALESCE($9, rail_ref), \
               rail_outcome = COALESCE($10, rail_outcome), \
               transaction_group = COALESCE($11, transaction_group) \
             WHERE id = $1 AND state = $12 RETURNING {PAYOUT_COLUMNS}"
        ))
        .bind(fenced.payout.payout_id.as_str())
        .bind(to.as_str())
        .bind(fence.token().as_i64())
        .bind(changes.claimed_by.as_deref())
        .bind(changes.claimed_now)
        .bind(changes.submitted_now)
        .bind(changes.settled_now)
        .bind(changes.failure_reason.as_deref())
        .bind(changes.rail_ref.as_deref())
        .bind(changes.rail_outcome)
        .bind(changes.transaction_group)
        .bind(from.as_str())
        .fetch_optional(&mut *fenced.tx)
        .await;
        let (updated, version) = match updated {
            Ok(Some(row)) => {
                let version = row.version;
                (row.into_model()?, version)
            }
            Ok(None) => {
                // The row is locked FOR UPDATE by this transaction: its state cannot have moved.
                return Err(ServerError::InvariantBroken(format!(
                    "payout {} left state {from} under its row lock",
                    fenced.payout.payout_id
                )));
            }
            Err(e) if is_constraint(&e, ONE_IN_FLIGHT_INDEX) => {
                let payout = fenced.payout.clone();
                fenced.tx.rollback().await?;
                return Err(self.account_busy(&payout, fence).await);
            }
            Err(e) => return Err(e.into()),
        };
        insert_audit(
            &mut *fenced.tx,
            &Audit {
                payout_id: Some(updated.payout_id.as_str()),
                account_id: Some(updated.account_id.as_str()),
                kind: "transition",
                actor: actor.as_str(),
                owner: Some(fence.owner()),
                token: Some(fence.token().as_i64()),
                from_state: Some(from.as_str()),
                to_state: Some(to.as_str()),
                event: Some(event.as_str()),
                detail,
            },
        )
        .await?;
        let lifecycle = outbox::PayoutLifecycle {
            payout: &updated,
            transition: Some((from, event)),
            event_version: version + 1,
            actor_id: operator.unwrap_or(fence.owner()),
            actor_role: actor.as_str(),
            owner: Some(fence.owner()),
            token: Some(fence.token()),
            occurred_at: updated.updated_at,
        };
        insert_lifecycle_event(&mut fenced.tx, &lifecycle).await?;
        fenced.tx.commit().await?;
        self.counters
            .transitions
            .with_label_values(&[from.as_str(), to.as_str()])
            .inc();
        // Once per payout: the row left a non-terminal state under its lock in this transaction.
        if to.is_terminal() {
            let end_to_end = (updated.updated_at - updated.created_at)
                .to_std()
                .unwrap_or_default();
            self.counters
                .payout_duration
                .with_label_values(&[to.as_str()])
                .observe(end_to_end.as_secs_f64());
        }
        tracing::info!(
            payout_id = %updated.payout_id, account_id = %updated.account_id, token = fence.token().get(),
            owner = fence.owner(), from = from.as_str(), to = to.as_str(), transition_event = event.as_str(),
            "payout transition"
        );
        Ok(updated)
    }

    async fn account_busy(&self, payout: &Payout, fence: &Fence) -> ServerError {
        let in_flight: Result<Option<String>, sqlx::Error> = sqlx::query_scalar(&format!(
            "SELECT id FROM payout WHERE account_id = $1 AND state IN {IN_FLIGHT_STATES_SQL} LIMIT 1"
        ))
        .bind(payout.account_id.as_str())
        .fetch_optional(&self.pool)
        .await;
        let in_flight = match in_flight {
            Ok(found) => found.unwrap_or_default(),
            Err(e) => return e.into(),
        };
        self.counters
            .account_busy
            .with_label_values(&["claim"])
            .inc();
        tracing::warn!(
            event = "account_busy", payout_id = %payout.payout_id, account_id = %payout.account_id,
            in_flight_payout_id = in_flight, token = fence.token().get(), "claim refused: another payout is in flight"
        );
        let audit = Audit {
            payout_id: Some(payout.payout_id.as_str()),
            account_id: Some(payout.account_id.as_str()),
            kind: "account_busy",
            actor: Actor::Holder.as_str(),
            owner: Some(fence.owner()),
            token: Some(fence.token().as_i64()),
            from_state: Some(payout.state.as_str()),
            to_state: None,
            event: Some(PayoutEvent::Claim.as_str()),
            detail: json!({"in_flight_payout_id": in_flight}),
        };
        if let Err(e) = insert_audit(&self.pool, &audit).await {
            tracing::error!(error = %e, "could not record the account_busy audit event");
        }
        PaymentError::AccountBusy {
            account_id: payout.account_id.to_string(),
            in_flight_payout_id: in_flight,
        }
        .into()
    }

    /// Applies `event` as `actor` to a fenced payout: refused (and recorded) if the table says so.
    async fn transition(
        &self,
        fenced: Fenced,
        event: PayoutEvent,
        actor: Actor,
        fence: &Fence,
        changes: Changes,
        detail: Value,
    ) -> Result<Payout, ServerError> {
        match fenced.payout.state.apply(event, actor) {
            Ok(to) => {
                self.commit_transition(fenced, event, actor, None, fence, to, changes, detail)
                    .await
            }
            Err(refusal) => {
                self.repeat_or_refuse(fenced, event, refusal, actor, fence)
                    .await
            }
        }
    }

    /// A transition the table refuses from the payout's state: answered with the record as it
    /// stands when it is a repeat of a step this same grant already made (its answer was lost:
    /// a restart after COMMIT, a reset connection, a local-activity timeout), refused and
    /// signalled otherwise. A repeat changes nothing and is neither a refusal nor a defect
    /// signal; the same step under another grant still is both.
    async fn repeat_or_refuse(
        &self,
        mut fenced: Fenced,
        event: PayoutEvent,
        refusal: payout_domain::RefusedTransition,
        actor: Actor,
        fence: &Fence,
    ) -> Result<Payout, ServerError> {
        if made_under_this_grant(&mut fenced, event, fence).await? {
            let payout = fenced.payout.clone();
            fenced.tx.rollback().await?;
            tracing::info!(payout_id = %payout.payout_id, account_id = %payout.account_id,
                transition_event = event.as_str(), state = payout.state.as_str(), token = fence.token().get(),
                owner = fence.owner(), "a step repeated under the grant that made it: answered with the record");
            return Ok(payout);
        }
        Err(self.refuse(fenced, refusal, actor, Some(fence)).await)
    }

    // ----- accounts -----

    /// Opens an account with an opening balance: its own balanced ledger group against the
    /// currency's FUNDING account, plus its outbox row, in one transaction. Idempotent for the
    /// same content. Fixture data: accounts are created out of band, without a grant.
    /// Opens an account. A positive opening balance is money from outside the ledger: it is
    /// written only under `funding`, an operator's signature over exactly this account, currency
    /// and amount, fresh, by a registered operator (`grant_signing::operator::Funding`);
    /// otherwise PERMISSION_DENIED `FundingNotAuthorised`, nothing written, counted. The verified
    /// operator and the signature go into the `account_opened` audit row, in the same
    /// transaction, for the reconciler's `account_funding_authorised` check.
    pub async fn open_account(
        &self,
        account_id: &AccountId,
        currency: &Currency,
        opening_balance_minor: i64,
        funding: Option<&payment_client::model::Funding>,
    ) -> Result<Account, ServerError> {
        not_negative(opening_balance_minor)?;
        let funded_by = if opening_balance_minor > 0 {
            Some(self.verify_funding(account_id, currency, opening_balance_minor, funding)?)
        } else {
            None
        };
        self.insert_account(account_id, currency, opening_balance_minor, funded_by)
            .await
    }

    /// TEST BUILDS ONLY (feature `fixture-command`): opens an account funded with no operator's
    /// signature, for `payment-resource fixture`. The reconciler reports every such opening
    /// (`account_funding_authorised`).
    #[cfg(feature = "fixture-command")]
    pub async fn open_account_unsigned_for_fixture(
        &self,
        account_id: &AccountId,
        currency: &Currency,
        opening_balance_minor: i64,
    ) -> Result<Account, ServerError> {
        not_negative(opening_balance_minor)?;
        self.insert_account(account_id, currency, opening_balance_minor, None)
            .await
    }

    /// The verified operator of `funding`, or the refusal (counted, logged).
    fn verify_funding(
        &self,
        account_id: &AccountId,
        currency: &Currency,
        amount_minor: i64,
        funding: Option<&payment_client::model::Funding>,
    ) -> Result<(String, Vec<u8>, u64), ServerError> {
        use grant_signing::operator::{Funding, Refused};
        let verdict = match funding {
            None => Err(Refused::Unsigned),
            Some(f) => self
                .options
                .operators
                .verify_funding(
                    &Funding {
                        operator: &f.operator,
                        account_id: account_id.as_str(),
                        currency: currency.as_str(),
                        amount_minor,
                        signed_at_unix_ms: f.signed_at_unix_ms,
                    },
                    &grant_signing::Signature {
                        key_id: f.operator.clone(),
                        bytes: f.signature.clone(),
                    },
                    Some(grant_signing::operator::now_unix_ms()),
                )
                .map(|operator| (operator, f.signature.clone(), f.signed_at_unix_ms)),
        };
        verdict.map_err(|refused| {
            let operator = funding.map(|f| f.operator.clone()).unwrap_or_default();
            self.counters
                .funding_refused
                .with_label_values(&[refused.reason()])
                .inc();
            tracing::warn!(%account_id, operator, amount_minor, reason = refused.reason(), %refused,
                alert = true, "account funding not authorised: nothing written");
            PaymentError::FundingNotAuthorised {
                account_id: account_id.to_string(),
                operator,
                reason: refused.reason().to_string(),
            }
            .into()
        })
    }

    async fn insert_account(
        &self,
        account_id: &AccountId,
        currency: &Currency,
        opening_balance_minor: i64,
        funded_by: Option<(String, Vec<u8>, u64)>,
    ) -> Result<Account, ServerError> {
        let mut tx = self.pool.begin().await?;
        let inserted: Option<AccountRow> = sqlx::query_as(&format!(
            "INSERT INTO account (id, currency, balance_minor, opening_balance_minor) VALUES ($1, $2, $3, $3) \
             ON CONFLICT (id) DO NOTHING RETURNING {ACCOUNT_COLUMNS}"
        ))
        .bind(account_id.as_str())
        .bind(currency.as_str())
        .bind(opening_balance_minor)
        .fetch_optional(&mut *tx)
        .await
        .or_else(lost_create_race)?;
        let Some(inserted) = inserted else {
            tx.rollback().await?;
            let existing = self.get_account(account_id).await?;
            if existing.currency == *currency
                && existing.opening_balance_minor == opening_balance_minor
            {
                return Ok(existing);
            }
            return Err(PaymentError::AccountExistsWithDifferentContent {
                account_id: account_id.to_string(),
            }
            .into());
        };
        ensure_system_accounts(&mut tx, currency).await?;
        if opening_balance_minor > 0 {
            let key = outbox::account_opening_key(account_id);
            let group = outbox::transaction_group(&key);
            let funding = outbox::funding_account(currency);
            insert_entry(
                &mut tx,
                group,
                1,
                account_id.as_str(),
                currency,
                opening_balance_minor,
                &funding,
                None,
                None,
            )
            .await?;
            insert_entry(
                &mut tx,
                group,
                2,
                &funding,
                currency,
                -opening_balance_minor,
                account_id.as_str(),
                None,
                None,
            )
            .await?;
            assert_group_balanced(&mut tx, group).await?;
            let payload = outbox::account_opening_payload(
                account_id,
                currency,
                opening_balance_minor,
                group,
                inserted.created_at,
            );
            insert_outbox(
                &mut tx,
                account_id.as_str(),
                &key,
                outbox::OutboxKind::Journal,
                &payload,
            )
            .await?;
        }
        insert_audit(
            &mut *tx,
            &Audit {
                payout_id: None,
                account_id: Some(account_id.as_str()),
                kind: "account_opened",
                actor: "FIXTURE",
                owner: Some(outbox::FIXTURE_ACTOR),
                token: None,
                from_state: None,
                to_state: None,
                event: None,
                detail: match &funded_by {
                    None => json!({"currency": currency.as_str(), "opening_balance_minor": opening_balance_minor}),
                    Some((operator, signature, signed_at)) => json!({
                        "currency": currency.as_str(),
                        "opening_balance_minor": opening_balance_minor,
                        "funded_by": operator,
                        "funding_signature": grant_signing::operator::to_hex(signature),
                        "funding_signed_at_unix_ms": signed_at,
                    }),
                },
            },
        )
        .await?;
        tx.commit().await?;
        tracing::info!(account_id = %account_id, currency = %currency, opening_balance_minor, "account opened");
        inserted.into_model()
    }

    pub async fn get_account(&self, account_id: &AccountId) -> Result<Account, ServerError> {
        let row: Option<AccountRow> = sqlx::query_as(&format!(
            "SELECT {ACCOUNT_COLUMNS} FROM account WHERE id = $1"
        ))
        .bind(account_id.as_str())
        .fetch_optional(&self.pool)
        .await?;
        row.ok_or_else(|| PaymentError::AccountNotFound {
            account_id: account_id.to_string(),
        })?
        .into_model()
    }

    // ----- payouts -----

    /// Creates a PENDING payout. The same id with the same content returns the existing payout;
    /// with different content it is refused. Nothing is written on bad input.
    pub async fn create_payout(&self, new: &NewPayout) -> Result<Payout, ServerError> {
        let mut tx = self.pool.begin().await?;
        let currency: Option<String> =
            sqlx::query_scalar("SELECT currency FROM account WHERE id = $1")
                .bind(new.account_id.as_str())
                .fetch_optional(&mut *tx)
                .await?;
        let Some(currency) = currency else {
            return Err(PaymentError::AccountNotFound {
                account_id: new.account_id.to_string(),
            }
            .into());
        };
        if currency != new.currency.as_str() {
            return Err(PaymentError::invalid("currency", InvalidReason::CurrencyMismatch).into());
        }
        let client_reference = payout_domain::ClientReference::for_payout(&new.payout_id);
        let inserted: Option<PayoutRow> = sqlx::query_as(&format!(
            "INSERT INTO payout (id, account_id, amount_minor, currency, beneficiary_ref, client_reference) \
             VALUES ($1, $2, $3, $4, $5, $6) ON CONFLICT (id) DO NOTHING RETURNING {PAYOUT_COLUMNS}"
        ))
        .bind(new.payout_id.as_str())
        .bind(new.account_id.as_str())
        .bind(new.amount_minor.get())
        .bind(new.currency.as_str())
        .bind(new.beneficiary_ref.as_str())
        .bind(client_reference.as_str())
        .fetch_optional(&mut *tx)
        .await
        .or_else(lost_create_race)?;
        let Some(inserted) = inserted else {
            tx.rollback().await?;
            let (existing, _) = self.get_payout(&new.payout_id).await?;
            let same = existing.account_id == new.account_id
                && existing.amount_minor == new.amount_minor.get()
                && existing.currency == new.currency
                && existing.beneficiary_ref == new.beneficiary_ref.as_str();
            if same {
                return Ok(existing);
            }
            return Err(PaymentError::PayoutExistsWithDifferentContent {
                payout_id: new.payout_id.to_string(),
            }
            .into());
        };
        let version = inserted.version;
        let payout = inserted.into_model()?;
        insert_audit(
            &mut *tx,
            &Audit {
                payout_id: Some(payout.payout_id.as_str()),
                account_id: Some(payout.account_id.as_str()),
                kind: "payout_created",
                actor: outbox::CREATOR_ACTOR,
                owner: None,
                token: None,
                from_state: None,
                to_state: Some(PayoutState::Pending.as_str()),
                event: None,
                detail: json!({"amount_minor": payout.amount_minor, "currency": payout.currency.as_str(),
                               "client_reference": payout.client_reference}),
            },
        )
        .await?;
        // The lifecycle's first event (version 1: the payout's version 0, plus one).
        insert_lifecycle_event(
            &mut tx,
            &outbox::PayoutLifecycle {
                payout: &payout,
                transition: None,
                event_version: version + 1,
                actor_id: outbox::CREATOR_ACTOR,
                actor_role: outbox::CREATOR_ACTOR,
                owner: None,
                token: None,
                occurred_at: payout.created_at,
            },
        )
        .await?;
        // The workflow's start, staged in the same transaction: the payout and the promise that
        // its workflow starts commit together (the starter delivers it). A repeated create finds
        // the payout above and stages nothing.
        if self.options.start_staging {
            stage_workflow_start(&mut tx, &payout).await?;
        }
        tx.commit().await?;
        tracing::info!(payout_id = %payout.payout_id, account_id = %payout.account_id, amount_minor = payout.amount_minor, "payout created");
        Ok(payout)
    }

    pub async fn get_payout(
        &self,
        payout_id: &PayoutId,
    ) -> Result<(Payout, Vec<AuditEvent>), ServerError> {
        let row: Option<PayoutRow> = sqlx::query_as(&format!(
            "SELECT {PAYOUT_COLUMNS} FROM payout WHERE id = $1"
        ))
        .bind(payout_id.as_str())
        .fetch_optional(&self.pool)
        .await?;
        let payout = row
            .ok_or_else(|| PaymentError::PayoutNotFound {
                payout_id: payout_id.to_string(),
            })?
            .into_model()?;
        let history: Vec<AuditRow> = sqlx::query_as(&format!(
            "SELECT {AUDIT_COLUMNS} FROM audit_event WHERE payout_id = $1 ORDER BY id LIMIT $2"
        ))
        .bind(payout_id.as_str())
        .bind(HISTORY_EVENTS_MAX)
        .fetch_all(&self.pool)
        .await?;
        Ok((
            payout,
            history.into_iter().map(AuditRow::into_model).collect(),
        ))
    }

    /// PENDING -> CLAIMED (funds sufficient) or FAILED (insufficient, with the reason: an answer,
    /// not an error); CLAIMED -> CLAIMED, a re-claim by a later holder replacing the claimer.
    pub async fn claim(&self, payout_id: &PayoutId, fence: &Fence) -> Result<Payout, ServerError> {
        let fenced = self.begin_fenced(payout_id, fence, "claim").await?;
        let payout = &fenced.payout;
        // This grant's own claim, repeated (its answer was lost): the record as it stands, not a
        // second CLAIMED -> CLAIMED transition (which is a later holder's recovery re-claim).
        if payout.state == PayoutState::Claimed
            && payout.token_stamp == Some(fence.token().get())
            && payout.claimed_by.as_deref() == Some(fence.owner())
        {
            let payout = payout.clone();
            fenced.tx.rollback().await?;
            tracing::info!(payout_id = %payout.payout_id, token = fence.token().get(),
                "a claim repeated under the grant that made it: answered with the record");
            return Ok(payout);
        }
        let insufficient =
            payout.state == PayoutState::Pending && fenced.balance_minor < payout.amount_minor;
        let detail = json!({"balance_minor": fenced.balance_minor, "amount_minor": payout.amount_minor,
                            "previous_claimer": payout.claimed_by});
        let (event, changes) = if insufficient {
            let reason = format!(
                "INSUFFICIENT_FUNDS: balance_minor {} < amount_minor {}",
                fenced.balance_minor, payout.amount_minor
            );
            (
                PayoutEvent::FundsInsufficient,
                Changes {
                    failure_reason: Some(reason),
                    ..Changes::default()
                },
            )
        } else {
            (
                PayoutEvent::Claim,
                Changes {
                    claimed_by: Some(fence.owner().to_string()),
                    claimed_now: true,
                    ..Changes::default()
                },
            )
        };
        self.transition(fenced, event, Actor::Holder, fence, changes, detail)
            .await
    }

    /// CLAIMED -> RAIL_SUBMITTED: the proxy recorded the submission intent.
    pub async fn mark_submitted(
        &self,
        payout_id: &PayoutId,
        fence: &Fence,
    ) -> Result<Payout, ServerError> {
        let fenced = self
            .begin_fenced(payout_id, fence, "mark_submitted")
            .await?;
        let changes = Changes {
            submitted_now: true,
            ..Changes::default()
        };
        let mut payout = self
            .transition(
                fenced,
                PayoutEvent::SubmissionAccepted,
                Actor::Holder,
                fence,
                changes,
                json!({}),
            )
            .await?;
        // Signed only for the payout this grant marked submitted (the transition, or its
        // idempotent repeat under the same grant: same row, same bytes, same signature). A later
        // holder finding RAIL_SUBMITTED never submits, so it is never given one.
        if payout.state == PayoutState::RailSubmitted
            && payout.token_stamp == Some(fence.token().get())
        {
            payout.instruction = self
                .options
                .facts
                .as_ref()
                .and_then(|facts| facts.instruction(&payout, fence));
        }
        Ok(payout)
    }

    /// RAIL_SUBMITTED -> RAIL_ACKED (acked), FAILED (declined) or RAIL_AMBIGUOUS (timeout, or no
    /// recorded outcome). Ambiguity is reached, never skipped.
    pub async fn record_outcome(
        &self,
        payout_id: &PayoutId,
        fence: &Fence,
        outcome: &RailOutcome,
        detail_text: &str,
        fact: Option<&RailFact>,
    ) -> Result<Payout, ServerError> {
        let fenced = self
            .begin_fenced(payout_id, fence, "record_outcome")
            .await?;
        // The rail proxy's word, not the caller's: checked on the locked row, before anything
        // is written (a refusal rolls the fence's advance back too).
        let verified = match self
            .verify_rail_fact(|facts| facts.check_outcome(&fenced.payout, outcome, fact))
        {
            Ok(verified) => verified,
            Err(refusal) => {
                return Err(self
                    .rail_fact_refused(fenced, fence, "record_outcome", refusal)
                    .await)
            }
        };
        let (event, changes, name) = match outcome {
            RailOutcome::Acked { rail_ref } => (
                PayoutEvent::RailAcked,
                Changes {
                    rail_ref: Some(rail_ref.clone()),
                    rail_outcome: Some("ACKED"),
                    ..Changes::default()
                },
                "ACKED",
            ),
            RailOutcome::Declined { decline_code } => (
                PayoutEvent::RailDeclined,
                Changes {
                    failure_reason: Some(format!("RAIL_DECLINED: {decline_code}")),
                    rail_outcome: Some("DECLINED"),
                    ..Changes::default()
                },
                "DECLINED",
            ),
            RailOutcome::Timeout => (
                PayoutEvent::RailTimeout,
                Changes {
                    rail_outcome: Some("TIMEOUT"),
                    ..Changes::default()
                },
                "TIMEOUT",
            ),
            RailOutcome::OutcomeMissing => (
                PayoutEvent::OutcomeMissing,
                Changes {
                    rail_outcome: Some("OUTCOME_MISSING"),
                    ..Changes::default()
                },
                "OUTCOME_MISSING",
            ),
        };
        let detail = json!({"outcome": name, "rail_ref": changes.rail_ref, "failure_reason": changes.failure_reason,
                            "detail": detail_text, "rail_fact": verified});
        self.transition(fenced, event, Actor::Holder, fence, changes, detail)
            .await
    }

    /// RAIL_AMBIGUOUS -> RAIL_ACKED (the rail has the movement) or FAILED (definitively absent).
    /// Actor: resolver. Evidence and its source are recorded.
    pub async fn resolve_ambiguity(
        &self,
        payout_id: &PayoutId,
        fence: &Fence,
        evidence: &Evidence,
        evidence_source: &str,
        proof: Option<&RailEvidence>,
    ) -> Result<Payout, ServerError> {
        let fenced = self
            .begin_fenced(payout_id, fence, "resolve_ambiguity")
            .await?;
        let verified = match self
            .verify_rail_fact(|facts| facts.check_evidence(&fenced.payout, evidence, proof))
        {
            Ok(verified) => verified,
            Err(refusal) => {
                return Err(self
                    .rail_fact_refused(fenced, fence, "resolve_ambiguity", refusal)
                    .await)
            }
        };
        let (event, changes, name) = match evidence {
            Evidence::Found { rail_ref } => (
                PayoutEvent::EvidenceFound,
                Changes {
                    rail_ref: Some(rail_ref.clone()),
                    rail_outcome: Some("EVIDENCE_FOUND"),
                    ..Changes::default()
                },
                "FOUND",
            ),
            Evidence::Absent => (
                PayoutEvent::EvidenceAbsent,
                Changes {
                    failure_reason: Some(format!("RAIL_ABSENT: evidence from {evidence_source}")),
                    rail_outcome: Some("EVIDENCE_ABSENT"),
                    ..Changes::default()
                },
                "ABSENT",
            ),
        };
        let detail = json!({"evidence": name, "evidence_source": evidence_source, "rail_ref": changes.rail_ref,
                            "rail_evidence": verified});
        self.transition(fenced, event, Actor::Resolver, fence, changes, detail)
            .await
    }

    /// PENDING -> ABANDONED, or RAIL_AMBIGUOUS -> ABANDONED once the resolution SLA has passed
    /// by this resource's own record: the payout's first transition into RAIL_AMBIGUOUS, on the
    /// database's clock (a workflow reset or a second workflow does not restart it). What the
    /// caller believes (`resolution_sla_passed`) is stored with the decision, never trusted.
    /// Actor: operator, under a grant like every mutation (INV-07).
    /// The verified operator of a signed decision, or why not (counted).
    fn verify_operator(
        &self,
        decision: &str,
        payout_id: &PayoutId,
        operator: &str,
        reason: &str,
        signature: Option<&payment_client::model::OperatorSignature>,
    ) -> Result<String, grant_signing::operator::Refused> {
        if !self.options.operator_verification {
            return Ok(operator.to_string());
        }
        let verdict = match signature {
            None => Err(grant_signing::operator::Refused::Unsigned),
            Some(s) => self.options.operators.verify_decision(
                &grant_signing::operator::Decision {
                    operator,
                    decision,
                    payout_id: payout_id.as_str(),
                    reason,
                    signed_at_unix_ms: s.signed_at_unix_ms,
                },
                &grant_signing::Signature {
                    key_id: operator.to_string(),
                    bytes: s.signature.clone(),
                },
                grant_signing::operator::now_unix_ms(),
            ),
        };
        if let Err(refused) = &verdict {
            self.counters
                .operator_not_verified
                .with_label_values(&[decision, refused.reason()])
                .inc();
            tracing::warn!(%payout_id, operator, decision, reason = refused.reason(), %refused,
                "operator decision not verified");
        }
        verdict
    }

    pub async fn abandon(
        &self,
        payout_id: &PayoutId,
        fence: &Fence,
        request: &AbandonRequest,
    ) -> Result<Payout, ServerError> {
        // The operator first: nothing is read under the fence, nothing changes, for an
        // unverified decision; the refusal is audited.
        if let Err(refused) = self.verify_operator(
            "abandon",
            payout_id,
            &request.operator,
            &request.reason,
            request.signature.as_ref(),
        ) {
            let account_id = self.account_of(payout_id).await?;
            insert_audit(
                &self.pool,
                &Audit {
                    payout_id: account_id.as_ref().map(|_| payout_id.as_str()),
                    account_id: account_id.as_deref(),
                    kind: "operator_not_verified",
                    actor: Actor::Operator.as_str(),
                    owner: Some(fence.owner()),
                    token: Some(fence.token().as_i64()),
                    from_state: None,
                    to_state: None,
                    event: Some(PayoutEvent::OperatorAbandon.as_str()),
                    detail: json!({"claimed_operator": request.operator, "reason": request.reason,
                                   "refusal": refused.reason(), "detail": refused.to_string()}),
                },
            )
            .await?;
            return Err(PaymentError::OperatorNotVerified {
                payout_id: payout_id.to_string(),
                operator: request.operator.clone(),
                reason: refused.reason().to_string(),
            }
            .into());
        }
        let mut fenced = self.begin_fenced(payout_id, fence, "abandon").await?;
        let from = fenced.payout.state;
        let to = match from.apply(PayoutEvent::OperatorAbandon, Actor::Operator) {
            Ok(to) => to,
            Err(refusal) => {
                return self
                    .repeat_or_refuse(
                        fenced,
                        PayoutEvent::OperatorAbandon,
                        refusal,
                        Actor::Operator,
                        fence,
                    )
                    .await
            }
        };
        let mut detail = json!({"operator": request.operator, "reason": request.reason,
                            "caller_says_sla_passed": request.resolution_sla_passed, "sla_check": request.sla_check});
        let sla_passed = if from == PayoutState::RailAmbiguous {
            let sla_ms = i64::try_from(self.options.resolution_sla.as_millis()).unwrap_or(i64::MAX);
            // Fail closed: no recorded entry into RAIL_AMBIGUOUS means the SLA has not passed.
            let (since, passed): (Option<DateTime<Utc>>, Option<bool>) = sqlx::query_as(
                "SELECT min(at), min(at) + $2 * interval '1 millisecond' <= clock_timestamp() \
                 FROM audit_event WHERE payout_id = $1 AND kind = 'transition' AND to_state = 'RAIL_AMBIGUOUS'",
            )
            .bind(payout_id.as_str())
            .bind(sla_ms)
            .fetch_one(&mut *fenced.tx)
            .await?;
            detail["ambiguous_since"] = json!(since);
            detail["resolution_sla_ms"] = json!(sla_ms);
            passed.unwrap_or(false)
        } else {
            true
        };
        if !sla_passed {
            let payout = fenced.payout.clone();
            fenced.tx.rollback().await?;
            tracing::warn!(payout_id = %payout.payout_id, operator = request.operator, "abandon refused: resolution SLA not passed");
            insert_audit(
                &self.pool,
                &Audit {
                    payout_id: Some(payout.payout_id.as_str()),
                    account_id: Some(payout.account_id.as_str()),
                    kind: "resolution_sla_not_passed",
                    actor: Actor::Operator.as_str(),
                    owner: Some(fence.owner()),
                    token: Some(fence.token().as_i64()),
                    from_state: Some(from.as_str()),
                    to_state: None,
                    event: Some(PayoutEvent::OperatorAbandon.as_str()),
                    detail,
                },
            )
            .await?;
            return Err(PaymentError::ResolutionSlaNotPassed {
                payout_id: payout_id.to_string(),
            }
            .into());
        }
        let changes = Changes {
            failure_reason: Some(format!(
                "ABANDONED by {}: {}",
                request.operator, request.reason
            )),
            ..Changes::default()
        };
        self.commit_transition(
            fenced,
            PayoutEvent::OperatorAbandon,
            Actor::Operator,
            Some(&request.operator),
            fence,
            to,
            changes,
            detail,
        )
        .await
    }

    /// RAIL_ACKED -> POSTED in one transaction: two ledger rows summing to zero (customer debit,
    /// payout-clearing credit, one group, the token stamped), the balance, the payout, one outbox
    /// row. On a POSTED payout it answers as the first posting did and changes nothing. Asked
    /// again by the grant that posted it (its answer was lost) that is all; asked by another
    /// grant the table still refuses the pair (POSTED is terminal): it is counted and audited
    /// like every refused transition, because a terminal payout asked to post again by someone
    /// else is a defect signal (spec 2.3), even when the answer can be the idempotent one.
    pub async fn post(
        &self,
        payout_id: &PayoutId,
        fence: &Fence,
    ) -> Result<PostOutcome, ServerError> {
        let mut fenced = self.begin_fenced(payout_id, fence, "post").await?;
        // This grant's own posting, repeated (its answer was lost): the first posting's answer,
        // with no refusal recorded.
        if fenced.payout.state == PayoutState::Posted
            && made_under_this_grant(&mut fenced, PayoutEvent::Posted, fence).await?
        {
            let payout = fenced.payout.clone();
            fenced.tx.rollback().await?;
            tracing::info!(payout_id = %payout.payout_id, token = fence.token().get(),
                "a posting repeated under the grant that made it: answered with the first");
            return self.posted_answer(payout).await;
        }
        let to = match fenced
            .payout
            .state
            .apply(PayoutEvent::Posted, Actor::Holder)
        {
            Ok(to) => to,
            Err(refusal) if fenced.payout.state == PayoutState::Posted => {
                let payout = fenced.payout.clone();
                // Only the audit row is written, outside the rolled-back transaction, as for
                // every refusal; the answer is the first posting's.
                match self
                    .refuse(fenced, refusal, Actor::Holder, Some(fence))
                    .await
                {
                    ServerError::Payment(PaymentError::RefusedTransition { .. }) => {}
                    failed => return Err(failed),
                }
                tracing::info!(payout_id = %payout.payout_id, "post of a POSTED payout answered with the first posting");
                return self.posted_answer(payout).await;
            }
            Err(refusal) => {
                return Err(self
                    .refuse(fenced, refusal, Actor::Holder, Some(fence))
                    .await)
            }
        };
        let payout = fenced.payout.clone();
        let key = outbox::payout_posting_key(&payout.payout_id);
        let group = outbox::transaction_group(&key);
        let clearing = outbox::payout_clearing_account(&payout.currency);
        let token = Some(fence.token().as_i64());
        let tx = &mut fenced.tx;
        ensure_system_accounts(tx, &payout.currency).await?;
        let mut entries = Vec::with_capacity(2);
        entries.push(
            insert_entry(
                tx,
                group,
                1,
                payout.account_id.as_str(),
                &payout.currency,
                -payout.amount_minor,
                &clearing,
                Some(payout.payout_id.as_str()),
                token,
            )
            .await?,
        );
        entries.push(
            insert_entry(
                tx,
                group,
                2,
                &clearing,
                &payout.currency,
                payout.amount_minor,
                payout.account_id.as_str(),
                Some(payout.payout_id.as_str()),
                token,
            )
            .await?,
        );
        // The account's entries' sum as the database keeps it (paydb 0013: moved by each entry's
        // insert, never written by a statement), so this costs the same for an account's first
        // payout and its millionth.
        let (balance_minor, entries_sum_minor): (i64, i64) = sqlx::query_as(
            "UPDATE account SET balance_minor = balance_minor - $2, version = version + 1, updated_at = now() \
             WHERE id = $1 RETURNING balance_minor, entries_sum_minor",
        )
        .bind(payout.account_id.as_str())
        .bind(payout.amount_minor)
        .fetch_one(&mut **tx)
        .await?;
        // INV-03, stated where it is written (the database asserts it again at commit).
        assert_group_balanced(tx, group).await?;
        if entries_sum_minor != balance_minor {
            tracing::error!(payout_id = %payout.payout_id, balance_minor, entries_sum_minor, "INV-03 broken: balance differs from entries");
            return Err(ServerError::InvariantBroken(format!(
                "account {} balance {balance_minor} differs from the sum of its entries {entries_sum_minor}",
                payout.account_id
            )));
        }
        let payload = outbox::payout_posting_payload(&outbox::PayoutPosting {
            payout_id: &payout.payout_id,
            account_id: &payout.account_id,
            beneficiary_ref: &payout.beneficiary_ref,
            currency: &payout.currency,
            amount_minor: payout.amount_minor,
            owner: fence.owner(),
            token: fence.token(),
            transaction_group: group,
            occurred_at: fenced.now,
            rail_ref: payout.rail_ref.as_deref(),
        });
        // After a paydb restore the GL may already hold this payout's posting from the lost
        // timeline (paydb 0014): the movement is posted there once, so this row is written as
        // delivered to that journal (same key, same lines); only paydb's own rows above are new.
        let carried = carried_lost_posting(tx, &key, &payload).await?;
        match carried.as_deref() {
            Some(journal_id) => {
                insert_carried_outbox(tx, payout.account_id.as_str(), &key, &payload, journal_id)
                    .await?;
                tracing::warn!(payout_id = %payout.payout_id, journal_id, key,
                    "posting carried by the GL's journal of a timeline lost in a paydb restore: not delivered again");
            }
            None => {
                insert_outbox(
                    tx,
                    payout.account_id.as_str(),
                    &key,
                    outbox::OutboxKind::Journal,
                    &payload,
                )
                .await?
            }
        }
        let changes = Changes {
            settled_now: true,
            transaction_group: Some(group),
            ..Changes::default()
        };
        let detail = json!({"transaction_group": group.to_string(), "outbox_idempotency_key": key,
                            "balance_minor": balance_minor});
        let posted = self
            .commit_transition(
                fenced,
                PayoutEvent::Posted,
                Actor::Holder,
                None,
                fence,
                to,
                changes,
                detail,
            )
            .await?;
        Ok(PostOutcome {
            payout: posted,
            transaction_group: group,
            entries,
            outbox_idempotency_key: key,
            already_posted: false,
        })
    }

    async fn posted_answer(&self, payout: Payout) -> Result<PostOutcome, ServerError> {
        let group = payout.transaction_group.ok_or_else(|| {
            ServerError::InvariantBroken(format!(
                "POSTED payout {} has no transaction group",
                payout.payout_id
            ))
        })?;
        let rows: Vec<EntryRow> = sqlx::query_as(&format!(
            "SELECT {ENTRY_COLUMNS} FROM ledger_entry WHERE transaction_group = $1 ORDER BY line_number"
        ))
        .bind(group)
        .fetch_all(&self.pool)
        .await?;
        Ok(PostOutcome {
            outbox_idempotency_key: outbox::payout_posting_key(&payout.payout_id),
            payout,
            transaction_group: group,
            entries: rows.into_iter().map(LedgerEntry::from).collect(),
            already_posted: true,
        })
    }

    /// Appends an operator's signal (accepted or refused) to the payout's audit trail, so that a
    /// decision is on record before it is acted on; `recorded_by` is the caller's certified role
    /// (the workflow's `worker`, or an `operator` recording a refusal met outside the workflow).
    /// Answers the event as recorded: its detail's `accepted` and `note` are what stands.
    pub async fn record_operator_decision(
        &self,
        decision: &OperatorDecision,
        recorded_by: &str,
    ) -> Result<AuditEvent, ServerError> {
        let account_id = self.account_of(&decision.payout_id).await?;
        let Some(account_id) = account_id else {
            return Err(PaymentError::PayoutNotFound {
                payout_id: decision.payout_id.to_string(),
            }
            .into());
        };
        // A decision the workflow accepted stands as accepted only under a verified operator
        // signature; otherwise it is recorded as refused, with why (the workflow's later Abandon
        // is refused the same way). A decision the workflow refused is recorded as it is.
        let verified = if decision.accepted {
            Some(self.verify_operator(
                &decision.decision,
                &decision.payout_id,
                &decision.operator,
                &decision.reason,
                decision.signature.as_ref(),
            ))
        } else {
            None
        };
        let (accepted, note) = match &verified {
            Some(Err(refused)) => (
                false,
                format!(
                    "refused: operator not verified ({}): {refused}",
                    refused.reason()
                ),
            ),
            _ => (decision.accepted, decision.note.clone()),
        };
        let event = insert_audit(
            &self.pool,
            &Audit {
                payout_id: Some(decision.payout_id.as_str()),
                account_id: Some(&account_id),
                kind: "operator_decision",
                actor: Actor::Operator.as_str(),
                owner: Some(&decision.operator),
                token: decision.token.map(|t| t.as_i64()),
                from_state: None,
                to_state: None,
                event: None,
                detail: json!({"decision": decision.decision, "reason": decision.reason, "accepted": accepted,
                               "note": note, "operator_verified": matches!(verified, Some(Ok(_))),
                               "signed_at_unix_ms": decision.signature.as_ref().map(|s| s.signed_at_unix_ms),
                               "recorded_by": recorded_by}),
            },
        )
        .await?;
        tracing::info!(payout_id = %decision.payout_id, operator = decision.operator, decision = decision.decision,
            accepted, recorded_by, "operator decision recorded");
        Ok(event)
    }

    /// Releases quarantined outbox row `outbox_id` for delivery again, recorded under `operator`
    /// (already certified by the caller) with `reason`: paydb's `replay_quarantined` (migrations
    /// 0010, 0012), the release and its chained `outbox_replay` row in one statement. A row that
    /// is not quarantined is [`PaymentError::NotQuarantined`] and changes nothing.
    pub async fn replay_quarantined(
        &self,
        outbox_id: i64,
        operator: &str,
        reason: &str,
    ) -> Result<i64, ServerError> {
        match sqlx::query_scalar::<_, i64>("SELECT replay_quarantined($1, $2, $3)")
            .bind(outbox_id)
            .bind(operator)
            .bind(reason)
            .fetch_one(&self.pool)
            .await
        {
            Ok(replay_id) => Ok(replay_id),
            // The function's refusal of a row that is not quarantined (SQLSTATE no_data_found).
            Err(sqlx::Error::Database(e)) if e.code().as_deref() == Some("P0002") => {
                Err(PaymentError::NotQuarantined { outbox_id }.into())
            }
            Err(e) => Err(e.into()),
        }
    }

    /// INV-03 over everything: each group sums to zero per currency, each customer balance equals
    /// the sum of its entries. What the reconciler calls.
    pub async fn check_ledger(&self) -> Result<LedgerCheck, ServerError> {
        let mut tx = self.pool.begin().await?;
        // One snapshot for all the queries, so that a posting committing meanwhile is either
        // entirely in or entirely out.
        sqlx::query("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ READ ONLY")
            .execute(&mut *tx)
            .await?;
        let groups_checked: i64 =
            sqlx::query_scalar("SELECT count(DISTINCT transaction_group) FROM ledger_entry")
                .fetch_one(&mut *tx)
                .await?;
        let accounts_checked: i64 = sqlx::query_scalar("SELECT count(*) FROM account")
            .fetch_one(&mut *tx)
            .await?;
        let unbalanced: Vec<(Uuid, String, i64)> = sqlx::query_as(
            "SELECT transaction_group, currency, sum(amount_minor)::bigint FROM ledger_entry \
             GROUP BY transaction_group, currency HAVING sum(amount_minor) <> 0 LIMIT $1",
        )
        .bind(LEDGER_VIOLATIONS_MAX)
        .fetch_all(&mut *tx)
        .await?;
        let mismatched: Vec<(String, i64, i64)> = sqlx::query_as(
            "SELECT a.id, a.balance_minor, coalesce(s.total, 0)::bigint FROM account a \
             LEFT JOIN (SELECT account_id, sum(amount_minor) AS total FROM ledger_entry GROUP BY account_id) s \
               ON s.account_id = a.id \
             WHERE a.balance_minor <> coalesce(s.total, 0) LIMIT $1",
        )
        .bind(LEDGER_VIOLATIONS_MAX)
        .fetch_all(&mut *tx)
        .await?;
        tx.commit().await?;
        let mut violations: Vec<LedgerViolation> = unbalanced
            .into_iter()
            .map(
                |(transaction_group, currency, sum_minor)| LedgerViolation::GroupUnbalanced {
                    transaction_group,
                    currency,
                    sum_minor,
                },
            )
            .collect();
        violations.extend(mismatched.into_iter().map(
            |(account_id, balance_minor, entries_sum_minor)| LedgerViolation::BalanceMismatch {
                account_id,
                balance_minor,
                entries_sum_minor,
            },
        ));
        if !violations.is_empty() {
            tracing::error!(
                count = violations.len(),
                "INV-03 violations found in the ledger"
            );
        }
        Ok(LedgerCheck {
            groups_checked,
            accounts_checked,
            violations,
        })
    }
}

fn unreachable_account() -> AccountId {
    // account ids in paydb satisfy the same CHECK as AccountId::parse; this is never reached.
    AccountId::parse("invalid-stored-account").expect("a valid literal")
}

async fn ensure_system_accounts(
    tx: &mut Transaction<'static, Postgres>,
    currency: &Currency,
) -> Result<(), sqlx::Error> {
    sqlx::query(
        "INSERT INTO system_account (id, class, currency) VALUES ($1, 'PAYOUT_CLEARING', $3), ($2, 'FUNDING', $3) \
         ON CONFLICT DO NOTHING",
    )
    .bind(outbox::payout_clearing_account(currency))
    .bind(outbox::funding_account(currency))
    .bind(currency.as_str())
    .execute(&mut **tx)
    .await?;
    Ok(())
}

#[allow(clippy::too_many_arguments)]
async fn insert_entry(
    tx: &mut Transaction<'static, Postgres>,
    group: Uuid,
    line_number: i16,
    account_id: &str,
    currency: &Currency,
    amount_minor: i64,
    counterparty: &str,
    payout_id: Option<&str>,
    token: Option<i64>,
) -> Result<LedgerEntry, sqlx::Error> {
    let row: EntryRow = sqlx::query_as(&format!(
        "INSERT INTO ledger_entry (transaction_group, line_number, account_id, currency, amount_minor, counterparty, \
         payout_id, token) VALUES ($1, $2, $3, $4, $5, $6, $7, $8) RETURNING {ENTRY_COLUMNS}"
    ))
    .bind(group)
    .bind(line_number)
    .bind(account_id)
    .bind(currency.as_str())
    .bind(amount_minor)
    .bind(counterparty)
    .bind(payout_id)
    .bind(token)
    .fetch_one(&mut **tx)
    .await?;
    Ok(row.into())
}

async fn assert_group_balanced(
    tx: &mut Transaction<'static, Postgres>,
    group: Uuid,
) -> Result<(), ServerError> {
    let sum_minor: i64 =
        sqlx::query_scalar("SELECT coalesce(sum(amount_minor), 0)::bigint FROM ledger_entry WHERE transaction_group = $1")
            .bind(group)
            .fetch_one(&mut **tx)
            .await?;
    if sum_minor != 0 {
        tracing::error!(%group, sum_minor, "INV-03 broken: ledger group does not sum to zero");
        return Err(ServerError::InvariantBroken(format!(
            "ledger group {group} sums to {sum_minor}"
        )));
    }
    Ok(())
}

async fn insert_outbox(
    tx: &mut Transaction<'static, Postgres>,
    account_id: &str,
    key: &str,
    kind: outbox::OutboxKind,
    payload: &Value,
) -> Result<(), sqlx::Error> {
    sqlx::query(
        "INSERT INTO ledger_outbox (account_id, idempotency_key, kind, payload) VALUES ($1, $2, $3, $4::jsonb)",
    )
    .bind(account_id)
    .bind(key)
    .bind(kind.as_str())
    .bind(payload.to_string())
    .execute(&mut **tx)
    .await?;
    Ok(())
}

/// The GL's journal id when the GL holds the posting `key` from a timeline lost in a paydb
/// restore with `payload`'s lines (paydb 0014's `lost_posting_carried`), else `None`.
async fn carried_lost_posting(
    tx: &mut Transaction<'static, Postgres>,
    key: &str,
    payload: &Value,
) -> Result<Option<String>, sqlx::Error> {
    sqlx::query_scalar("SELECT lost_posting_carried($1, $2::jsonb)")
        .bind(key)
        .bind(payload.to_string())
        .fetch_one(&mut **tx)
        .await
}

/// A posting's outbox row written as already delivered to `journal_id`: the GL's journal of the
/// lost timeline that carries it ([`carried_lost_posting`]). The dispatcher never sends it.
async fn insert_carried_outbox(
    tx: &mut Transaction<'static, Postgres>,
    account_id: &str,
    key: &str,
    payload: &Value,
    journal_id: &str,
) -> Result<(), sqlx::Error> {
    sqlx::query(
        "INSERT INTO ledger_outbox (account_id, idempotency_key, kind, payload, delivered_at, journal_id, last_error) \
         VALUES ($1, $2, $3, $4::jsonb, now(), $5, $6)",
    )
    .bind(account_id)
    .bind(key)
    .bind(outbox::OutboxKind::Journal.as_str())
    .bind(payload.to_string())
    .bind(journal_id)
    .bind(CARRIED_POSTING_NOTE)
    .execute(&mut **tx)
    .await?;
    Ok(())
}

/// What a carried posting's outbox row says of itself (its `last_error` column, the only free
/// text a row has): why it was never sent.
const CARRIED_POSTING_NOTE: &str =
    "not sent: the GL holds this posting from a timeline lost in a paydb restore (restore_lost_timeline)";

/// Stages `payout-{id}`'s start (paydb 0009's `workflow_start`) in the creating transaction,
/// with the payout's instruction as the start input's fields.
async fn stage_workflow_start(
    tx: &mut Transaction<'static, Postgres>,
    payout: &Payout,
) -> Result<(), sqlx::Error> {
    let input = json!({
        "payout_id": payout.payout_id.as_str(),
        "account_id": payout.account_id.as_str(),
        "amount_minor": payout.amount_minor,
        "currency": payout.currency.as_str(),
        "beneficiary_ref": payout.beneficiary_ref.as_str(),
    });
    sqlx::query(
        "INSERT INTO workflow_start (payout_id, workflow_id, input) VALUES ($1, $2, $3::jsonb)",
    )
    .bind(payout.payout_id.as_str())
    .bind(payout_domain::workflow_id(&payout.payout_id))
    .bind(input.to_string())
    .execute(&mut **tx)
    .await?;
    Ok(())
}

/// A payout's lifecycle step as its outbox row (kind TRANSACTION_EVENT), on the payout's account,
/// so that the dispatcher delivers it in the account's source order with the account's journals.
/// In the caller's transaction: the step and its event commit together or not at all.
async fn insert_lifecycle_event(
    tx: &mut Transaction<'static, Postgres>,
    step: &outbox::PayoutLifecycle<'_>,
) -> Result<(), ServerError> {
    let payload = outbox::payout_event_payload(step).map_err(ServerError::InvariantBroken)?;
    insert_outbox(
        tx,
        step.payout.account_id.as_str(),
        &outbox::payout_event_key(&step.payout.payout_id, step.event_version),
        outbox::OutboxKind::TransactionEvent,
        &payload,
    )
    .await?;
    Ok(())
}
