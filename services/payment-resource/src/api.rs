//! The gRPC boundary: proto <-> model conversions (in this one place, for the server and the
//! client) and the `PaymentResource` service implementation.

use payout_domain::{
    AccountId, AmountMinor, BeneficiaryRef, Currency, FencingToken, PayoutId, PayoutState,
    TokenError,
};
use payout_proto::payment as pb;
use service_kit::rejection;
use tonic::{Code, Request, Response, Status};

use crate::error::{InvalidReason, PaymentError};
use crate::model::{self, Fence};
use crate::outbox::rfc3339;
use crate::store::Store;

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

pub fn parse_fence(fence: Option<&pb::Fence>) -> Result<Fence, PaymentError> {
    let fence = fence.ok_or_else(|| PaymentError::invalid("fence", InvalidReason::FenceMissing))?;
    let token = parse_token("fence.token", fence.token)?;
    Fence::new(fence.owner.clone(), token)
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
    }
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
        PaymentError::InvariantBroken(_) => {
            tracing::error!(error = %message, "invariant broken; transaction rolled back");
            return Status::internal(message);
        }
        PaymentError::Storage(e) => {
            tracing::error!(error = %e, "database failure; nothing committed");
            // Connection exceptions (08) and operator intervention (57: a killed backend, a
            // shutting-down server) are worth retrying; a constraint or syntax error is a bug.
            let transient = match e.as_database_error() {
                None => true,
                Some(db) => db
                    .code()
                    .is_some_and(|c| c.starts_with("08") || c.starts_with("57")),
            };
            let code = if transient {
                Code::Unavailable
            } else {
                Code::Internal
            };
            return Status::new(code, format!("database: {e}"));
        }
        PaymentError::Transport { code, message } => return Status::new(code, message),
        PaymentError::MalformedResponse(m) => return Status::internal(m),
    };
    rejection::status(code, message, &pb::Rejection { kind: Some(kind) })
}

pub fn status_to_error(status: Status) -> PaymentError {
    use pb::rejection::Kind;
    let Some(kind) = rejection::decode::<pb::Rejection>(&status).and_then(|r| r.kind) else {
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
    }
}

// ----- the service -----

pub struct PaymentApi {
    store: Store,
}

impl PaymentApi {
    pub fn new(store: Store) -> Self {
        Self { store }
    }
}

type Reply<T> = Result<Response<T>, Status>;

fn reply<T, U>(result: Result<T, PaymentError>, convert: impl FnOnce(T) -> U) -> Reply<U> {
    result
        .map(|v| Response::new(convert(v)))
        .map_err(error_to_status)
}

#[tonic::async_trait]
impl pb::payment_resource_server::PaymentResource for PaymentApi {
    async fn open_account(&self, request: Request<pb::OpenAccountRequest>) -> Reply<pb::Account> {
        let r = request.into_inner();
        let result = async {
            let account_id = parse_account_id("account_id", &r.account_id)?;
            let currency = parse_currency(&r.currency)?;
            self.store
                .open_account(&account_id, &currency, r.opening_balance_minor)
                .await
        }
        .await;
        reply(result, |a| account_to_proto(&a))
    }

    async fn get_account(&self, request: Request<pb::GetAccountRequest>) -> Reply<pb::Account> {
        let r = request.into_inner();
        let result = async {
            self.store
                .get_account(&parse_account_id("account_id", &r.account_id)?)
                .await
        }
        .await;
        reply(result, |a| account_to_proto(&a))
    }

    async fn create_payout(&self, request: Request<pb::CreatePayoutRequest>) -> Reply<pb::Payout> {
        let r = request.into_inner();
        let result = async { self.store.create_payout(&parse_new_payout(&r)?).await }.await;
        reply(result, |p| payout_to_proto(&p))
    }

    async fn get_payout(
        &self,
        request: Request<pb::GetPayoutRequest>,
    ) -> Reply<pb::GetPayoutResponse> {
        let r = request.into_inner();
        let result = async { self.store.get_payout(&parse_payout_id(&r.payout_id)?).await }.await;
        reply(result, |(p, history)| pb::GetPayoutResponse {
            payout: Some(payout_to_proto(&p)),
            history: history.iter().map(audit_to_proto).collect(),
        })
    }

    async fn claim(&self, request: Request<pb::ClaimRequest>) -> Reply<pb::Payout> {
        let r = request.into_inner();
        let result = async {
            let payout_id = parse_payout_id(&r.payout_id)?;
            let fence = parse_fence(r.fence.as_ref())?;
            self.store.claim(&payout_id, &fence).await
        }
        .await;
        reply(result, |p| payout_to_proto(&p))
    }

    async fn mark_submitted(
        &self,
        request: Request<pb::MarkSubmittedRequest>,
    ) -> Reply<pb::Payout> {
        let r = request.into_inner();
        let result = async {
            let payout_id = parse_payout_id(&r.payout_id)?;
            let fence = parse_fence(r.fence.as_ref())?;
            self.store.mark_submitted(&payout_id, &fence).await
        }
        .await;
        reply(result, |p| payout_to_proto(&p))
    }

    async fn record_outcome(
        &self,
        request: Request<pb::RecordOutcomeRequest>,
    ) -> Reply<pb::Payout> {
        let r = request.into_inner();
        let result = async {
            let payout_id = parse_payout_id(&r.payout_id)?;
            let fence = parse_fence(r.fence.as_ref())?;
            let outcome = parse_outcome(&r)?;
            let detail = model::optional_text("detail", &r.detail)?;
            self.store
                .record_outcome(&payout_id, &fence, &outcome, &detail)
                .await
        }
        .await;
        reply(result, |p| payout_to_proto(&p))
    }

    async fn post(&self, request: Request<pb::PostRequest>) -> Reply<pb::PostResponse> {
        let r = request.into_inner();
        let result = async {
            let payout_id = parse_payout_id(&r.payout_id)?;
            let fence = parse_fence(r.fence.as_ref())?;
            self.store.post(&payout_id, &fence).await
        }
        .await;
        reply(result, |o| pb::PostResponse {
            payout: Some(payout_to_proto(&o.payout)),
            transaction_group: o.transaction_group.to_string(),
            entries: o.entries.iter().map(entry_to_proto).collect(),
            outbox_idempotency_key: o.outbox_idempotency_key,
            already_posted: o.already_posted,
        })
    }

    async fn resolve_ambiguity(
        &self,
        request: Request<pb::ResolveAmbiguityRequest>,
    ) -> Reply<pb::Payout> {
        let r = request.into_inner();
        let result = async {
            let payout_id = parse_payout_id(&r.payout_id)?;
            let fence = parse_fence(r.fence.as_ref())?;
            let (evidence, source) = parse_evidence(&r)?;
            self.store
                .resolve_ambiguity(&payout_id, &fence, &evidence, &source)
                .await
        }
        .await;
        reply(result, |p| payout_to_proto(&p))
    }

    async fn abandon(&self, request: Request<pb::AbandonRequest>) -> Reply<pb::Payout> {
        let r = request.into_inner();
        let result = async {
            let payout_id = parse_payout_id(&r.payout_id)?;
            let fence = parse_fence(r.fence.as_ref())?;
            let request = model::AbandonRequest {
                operator: model::required_text(
                    "operator",
                    &r.operator,
                    InvalidReason::OperatorMissing,
                )?,
                reason: model::required_text("reason", &r.reason, InvalidReason::ReasonMissing)?,
                resolution_sla_passed: r.resolution_sla_passed,
                sla_check: model::optional_text("sla_check", &r.sla_check)?,
            };
            self.store.abandon(&payout_id, &fence, &request).await
        }
        .await;
        reply(result, |p| payout_to_proto(&p))
    }

    async fn record_operator_decision(
        &self,
        request: Request<pb::RecordOperatorDecisionRequest>,
    ) -> Reply<pb::AuditEvent> {
        let r = request.into_inner();
        let result = async {
            let decision = model::OperatorDecision {
                payout_id: parse_payout_id(&r.payout_id)?,
                operator: model::required_text(
                    "operator",
                    &r.operator,
                    InvalidReason::OperatorMissing,
                )?,
                decision: model::required_text(
                    "decision",
                    &r.decision,
                    InvalidReason::DecisionMissing,
                )?,
                reason: model::optional_text("reason", &r.reason)?,
                accepted: r.accepted,
                note: model::optional_text("note", &r.note)?,
                // Optional here: 0 records the decision without a grant.
                token: match r.token {
                    0 => None,
                    token => Some(parse_token("token", token)?),
                },
            };
            self.store.record_operator_decision(&decision).await
        }
        .await;
        reply(result, |e| audit_to_proto(&e))
    }

    async fn check_ledger(
        &self,
        _request: Request<pb::CheckLedgerRequest>,
    ) -> Reply<pb::CheckLedgerResponse> {
        reply(self.store.check_ledger().await, |c| {
            pb::CheckLedgerResponse {
                groups_checked: c.groups_checked,
                accounts_checked: c.accounts_checked,
                violations: c
                    .violations
                    .iter()
                    .map(|v| match v {
                        model::LedgerViolation::GroupUnbalanced {
                            transaction_group,
                            sum_minor,
                            ..
                        } => pb::LedgerViolation {
                            kind: "GROUP_UNBALANCED".into(),
                            transaction_group: transaction_group.to_string(),
                            account_id: String::new(),
                            actual_minor: *sum_minor,
                            expected_minor: 0,
                        },
                        model::LedgerViolation::BalanceMismatch {
                            account_id,
                            balance_minor,
                            entries_sum_minor,
                        } => pb::LedgerViolation {
                            kind: "BALANCE_MISMATCH".into(),
                            transaction_group: String::new(),
                            account_id: account_id.clone(),
                            actual_minor: *balance_minor,
                            expected_minor: *entries_sum_minor,
                        },
                    })
                    .collect(),
            }
        })
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
    }
}
