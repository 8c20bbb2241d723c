//! The typed errors of the boundary: every expected failure is a named variant with the fields a
//! caller needs, on the server (before it becomes a gRPC status) and on the client (decoded back
//! from the status' typed `Rejection` detail). The server's own failures (the database, a broken
//! invariant) are the server's type; a client sees them as [`PaymentError::Transport`].

use payout_domain::{Actor, PayoutEvent, PayoutState};
pub use payout_proto::payment::InvalidReason;

#[derive(Debug, thiserror::Error)]
pub enum PaymentError {
    /// The presented token is below the account's fence: a stale holder. Nothing changed.
    #[error("fenced out on {key}: presented token {presented} is below the stored fence {stored} (owner {owner})")]
    FencedOut {
        key: String,
        presented: u64,
        stored: u64,
        owner: String,
        account_id: String,
        payout_id: String,
    },
    /// The fence's grant is not one the lock service signed: no signature (`unsigned`), a signing
    /// key this guard does not know (`unknown_key_id`), or a signature that does not match the
    /// key, token and owner (`bad_signature`). Checked before the fence statement: nothing changed
    /// but the refusal's audit row and a counter. PERMISSION_DENIED.
    #[error("forged grant on payout {payout_id}: key {key:?}, token {presented}, owner {owner}, signing key {signing_key_id:?}: {reason}")]
    ForgedGrant {
        key: String,
        presented: u64,
        owner: String,
        signing_key_id: String,
        /// `unsigned` | `unknown_key_id` | `bad_signature`
        reason: String,
        payout_id: String,
    },
    /// A genuine grant, signed for another lock key than the key of the payout's account
    /// (`payout:{account_id}`): tokens are global across keys, so another account's higher token
    /// must not pass this account's fence. Nothing changed but the refusal's audit row and a
    /// counter. PERMISSION_DENIED.
    #[error("grant for another key on payout {payout_id}: signed for {presented_key:?}, the payout needs {required_key} (token {presented}, owner {owner})")]
    GrantForAnotherKey {
        presented_key: String,
        required_key: String,
        presented: u64,
        owner: String,
        payout_id: String,
    },
    /// paydb is a copy restored from a backup that the restore procedure has not re-armed, or the
    /// token is below the last re-arming's horizon: a restore rewinds every fence, so the guard
    /// refuses every fenced write until the procedure (`payoutctl restore rearm`) has raised every
    /// fence past every token the lock service has issued. Nothing changed but the refusal's audit
    /// row and a counter. UNAVAILABLE: a retry after the procedure meets the raised fence.
    #[error("paydb refused the fenced call on payout {payout_id} (token {presented}): {}",
        if *incarnation_current { format!("the token is below the horizon {token_floor} of the last restore's re-arming") }
        else { "the database was restored from a backup and not re-armed (payoutctl restore rearm)".to_string() })]
    DatabaseRestored {
        payout_id: String,
        presented: u64,
        incarnation_current: bool,
        token_floor: u64,
    },
    /// The (state, event) pair is not in the 2.3 table, or needs another actor. Nothing changed.
    #[error("payout {payout_id}: transition {event} from {from} refused (actor {actor}{})",
        required.as_ref().map(|r| format!(", requires {r}")).unwrap_or_default())]
    RefusedTransition {
        payout_id: String,
        from: String,
        event: String,
        actor: String,
        required: Option<String>,
    },
    /// Another payout of the account is in flight; the database's partial unique index refused.
    #[error("account {account_id} already has payout {in_flight_payout_id} in flight")]
    AccountBusy {
        account_id: String,
        in_flight_payout_id: String,
    },
    /// Abandoning a RAIL_AMBIGUOUS payout needs the caller to assert the resolution SLA passed.
    #[error("payout {payout_id} is RAIL_AMBIGUOUS and its resolution SLA has not passed")]
    ResolutionSlaNotPassed { payout_id: String },
    /// An operator action whose signature is missing, by an operator with no registered key,
    /// does not match the request, or is stale (`grant_signing::operator`). Nothing changed but
    /// the refusal's audit row and a counter. PERMISSION_DENIED.
    #[error("operator {operator:?} not verified on payout {payout_id}: {reason}")]
    OperatorNotVerified {
        payout_id: String,
        operator: String,
        /// `unsigned` | `unknown_operator` | `bad_signature` | `stale`
        reason: String,
    },
    /// A RecordOutcome (ACKED, DECLINED) or ResolveAmbiguity without the rail proxy's signed fact
    /// saying the same thing: unsigned, by a key the payment resource does not know, a bad
    /// signature, or a genuine fact that contradicts the request (`reason`:
    /// `grant_signing::rail_fact::REASONS`). Nothing changed but the refusal's audit row and a
    /// counter. PERMISSION_DENIED.
    #[error("rail fact refused on payout {payout_id} ({operation}: {reason}): {detail}; nothing was changed")]
    RailFactRefused {
        payout_id: String,
        /// `record_outcome` | `resolve_ambiguity`
        operation: String,
        reason: String,
        detail: String,
        signing_key_id: String,
    },
    /// An OpenAccount with a positive opening balance whose operator signature is missing, by an
    /// operator with no registered key, does not match the account, currency and amount, or is
    /// stale (`grant_signing::operator::Funding`). Nothing written; counted. PERMISSION_DENIED.
    #[error("funding of account {account_id} not authorised (operator {operator:?}): {reason}; nothing was written")]
    FundingNotAuthorised {
        account_id: String,
        operator: String,
        /// `unsigned` | `unknown_operator` | `bad_signature` | `stale`
        reason: String,
    },
    /// A break-glass call naming an operator the caller's certificate does not carry
    /// (`service_kit::grpc::certified_operator`). Nothing changed; counted and logged at alert
    /// level. PERMISSION_DENIED.
    #[error("operator {operator:?} is not the operator the caller's certificate carries: nothing was changed")]
    OperatorNotCertified { operator: String },
    /// A quarantine replay of an outbox row that is not quarantined (no such row, already
    /// delivered, or waiting for delivery). Nothing changed. FAILED_PRECONDITION.
    #[error("outbox row {outbox_id} is not quarantined (no such row, already delivered, or waiting for delivery): nothing was replayed")]
    NotQuarantined { outbox_id: i64 },
    #[error("invalid argument {field}: {}", reason.as_str_name())]
    InvalidArgument {
        field: String,
        reason: InvalidReason,
    },
    #[error("account {account_id} not found")]
    AccountNotFound { account_id: String },
    #[error("payout {payout_id} not found")]
    PayoutNotFound { payout_id: String },
    #[error("payout {payout_id} exists with different content")]
    PayoutExistsWithDifferentContent { payout_id: String },
    #[error("account {account_id} exists with different content")]
    AccountExistsWithDifferentContent { account_id: String },
    /// Client side: a status without a typed rejection (unavailable, deadline, internal).
    #[error("transport: {code:?}: {message}")]
    Transport { code: tonic::Code, message: String },
    /// Client side: the server answered something this client cannot read.
    #[error("malformed response: {0}")]
    MalformedResponse(String),
}

impl PaymentError {
    pub fn invalid(field: &str, reason: InvalidReason) -> Self {
        PaymentError::InvalidArgument {
            field: field.to_string(),
            reason,
        }
    }

    /// The refusal of a transition by the 2.3 table, as the server reports it.
    pub fn refused(
        payout_id: &str,
        refusal: payout_domain::RefusedTransition,
        caller: Actor,
    ) -> Self {
        use payout_domain::RefusedTransition as R;
        let (from, event, actor, required): (PayoutState, PayoutEvent, Actor, Option<Actor>) =
            match refusal {
                R::NotInTable { from, event } => (from, event, caller, None),
                R::WrongActor {
                    from,
                    event,
                    actor,
                    required,
                } => (from, event, actor, Some(required)),
            };
        PaymentError::RefusedTransition {
            payout_id: payout_id.to_string(),
            from: from.as_str().to_string(),
            event: event.as_str().to_string(),
            actor: actor.as_str().to_string(),
            required: required.map(|a| a.as_str().to_string()),
        }
    }
}
