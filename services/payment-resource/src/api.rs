//! The `PaymentResource` service implementation. The proto <-> model conversions are the
//! contract's (`payment_client::wire`), shared with the client; what is the server's own is here:
//! the mapping of its own failures (the database, a broken invariant) to a bare status.

use payment_client::model;
use payment_client::wire::{
    account_to_proto, audit_to_proto, entry_to_proto, parse_account_id, parse_currency,
    parse_evidence, parse_fence, parse_new_payout, parse_outcome, parse_payout_id, parse_token,
    payout_to_proto,
};
use payment_client::InvalidReason;
use payout_proto::payment as pb;
use service_kit::latency::{CallOutcome, CallTimer, GuardCalls};
use tonic::{Code, Request, Response, Status};

use crate::error::ServerError;
use crate::model::LedgerViolation;
use crate::store::Store;

// ----- errors -> status -----

/// A refusal becomes a status with its typed `Rejection` (`payment_client::wire::error_to_status`);
/// the server's own failures become a bare status, logged here.
pub fn error_to_status(err: ServerError) -> Status {
    match err {
        ServerError::Payment(e) => payment_client::wire::error_to_status(e),
        e @ ServerError::InvariantBroken(_) => {
            let message = e.to_string();
            tracing::error!(error = %message, "invariant broken; transaction rolled back");
            Status::internal(message)
        }
        ServerError::Storage(e) => {
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
            Status::new(code, format!("database: {e}"))
        }
    }
}

/// How a call ended, for `guard_call_duration_seconds`: read from the typed error before it
/// becomes a status.
fn outcome_of<T>(result: &Result<T, ServerError>) -> CallOutcome {
    use payment_client::PaymentError as E;
    match result {
        Ok(_) => CallOutcome::Ok,
        Err(ServerError::Payment(E::FencedOut { .. })) => CallOutcome::FencedOut,
        Err(ServerError::Payment(E::InvalidArgument { .. })) => CallOutcome::Invalid,
        Err(ServerError::Payment(E::Transport { .. } | E::MalformedResponse(_))) => {
            CallOutcome::Error
        }
        Err(ServerError::Payment(_)) => CallOutcome::Refused,
        Err(ServerError::InvariantBroken(_) | ServerError::Storage(_)) => CallOutcome::Error,
    }
}

// ----- the service -----

/// Every RPC of the service, as `guard_call_duration_seconds{operation}` names it.
pub const OPERATIONS: &[&str] = &[
    "open_account",
    "get_account",
    "create_payout",
    "get_payout",
    "claim",
    "mark_submitted",
    "record_outcome",
    "post",
    "resolve_ambiguity",
    "abandon",
    "record_operator_decision",
    "check_ledger",
    "replay_quarantined",
];

pub struct PaymentApi {
    store: Store,
    fixture_accounts: bool,
    calls: GuardCalls,
    unauthorised_calls: service_kit::prometheus::IntCounterVec,
}

impl PaymentApi {
    /// `fixture_accounts`: whether OpenAccount (funded accounts from nothing) is served at all.
    /// Off in a deployment; the local stack and the tests turn it on. Even on, only the fixture
    /// role may call it (`authz::POLICY`). Every call is timed on `metrics`.
    pub fn new(store: Store, fixture_accounts: bool, metrics: &service_kit::Metrics) -> Self {
        Self {
            store,
            fixture_accounts,
            calls: GuardCalls::new(metrics, service_kit::Guard::PaymentResource, OPERATIONS),
            unauthorised_calls: metrics.unauthorised_calls(),
        }
    }
}

type Reply<T> = Result<Response<T>, Status>;

fn reply<T, U>(
    timer: CallTimer<'_>,
    result: Result<T, ServerError>,
    convert: impl FnOnce(T) -> U,
) -> Reply<U> {
    timer.finish(outcome_of(&result));
    result
        .map(|v| Response::new(convert(v)))
        .map_err(error_to_status)
}

#[tonic::async_trait]
impl pb::payment_resource_server::PaymentResource for PaymentApi {
    async fn open_account(&self, request: Request<pb::OpenAccountRequest>) -> Reply<pb::Account> {
        let timer = self.calls.start("open_account");
        if !self.fixture_accounts {
            timer.finish(CallOutcome::Refused);
            return Err(Status::failed_precondition(
                "OpenAccount is the fixture path and is off on this server (start it with --fixture-accounts to serve it)",
            ));
        }
        let r = request.into_inner();
        let result = async {
            let account_id = parse_account_id("account_id", &r.account_id)?;
            let currency = parse_currency(&r.currency)?;
            let funding = r
                .funding_signature
                .as_ref()
                .map(|s| payment_client::model::Funding {
                    operator: r.funded_by.clone(),
                    signature: s.signature.clone(),
                    signed_at_unix_ms: s.signed_at_unix_ms,
                });
            self.store
                .open_account(
                    &account_id,
                    &currency,
                    r.opening_balance_minor,
                    funding.as_ref(),
                )
                .await
        }
        .await;
        reply(timer, result, |a| account_to_proto(&a))
    }

    async fn get_account(&self, request: Request<pb::GetAccountRequest>) -> Reply<pb::Account> {
        let timer = self.calls.start("get_account");
        let r = request.into_inner();
        let result = async {
            self.store
                .get_account(&parse_account_id("account_id", &r.account_id)?)
                .await
        }
        .await;
        reply(timer, result, |a| account_to_proto(&a))
    }

    async fn create_payout(&self, request: Request<pb::CreatePayoutRequest>) -> Reply<pb::Payout> {
        let timer = self.calls.start("create_payout");
        let r = request.into_inner();
        let result = async { self.store.create_payout(&parse_new_payout(&r)?).await }.await;
        reply(timer, result, |p| payout_to_proto(&p))
    }

    async fn get_payout(
        &self,
        request: Request<pb::GetPayoutRequest>,
    ) -> Reply<pb::GetPayoutResponse> {
        let timer = self.calls.start("get_payout");
        let r = request.into_inner();
        let result = async { self.store.get_payout(&parse_payout_id(&r.payout_id)?).await }.await;
        reply(timer, result, |(p, history)| pb::GetPayoutResponse {
            payout: Some(payout_to_proto(&p)),
            history: history.iter().map(audit_to_proto).collect(),
        })
    }

    async fn claim(&self, request: Request<pb::ClaimRequest>) -> Reply<pb::Payout> {
        let timer = self.calls.start("claim");
        let r = request.into_inner();
        let result = async {
            let payout_id = parse_payout_id(&r.payout_id)?;
            let fence = parse_fence(r.fence.as_ref())?;
            self.store.claim(&payout_id, &fence).await
        }
        .await;
        reply(timer, result, |p| payout_to_proto(&p))
    }

    async fn mark_submitted(
        &self,
        request: Request<pb::MarkSubmittedRequest>,
    ) -> Reply<pb::Payout> {
        let timer = self.calls.start("mark_submitted");
        let r = request.into_inner();
        let result = async {
            let payout_id = parse_payout_id(&r.payout_id)?;
            let fence = parse_fence(r.fence.as_ref())?;
            self.store.mark_submitted(&payout_id, &fence).await
        }
        .await;
        reply(timer, result, |p| payout_to_proto(&p))
    }

    async fn record_outcome(
        &self,
        request: Request<pb::RecordOutcomeRequest>,
    ) -> Reply<pb::Payout> {
        let timer = self.calls.start("record_outcome");
        let r = request.into_inner();
        let result = async {
            let payout_id = parse_payout_id(&r.payout_id)?;
            let fence = parse_fence(r.fence.as_ref())?;
            let outcome = parse_outcome(&r)?;
            let detail = model::optional_text("detail", &r.detail)?;
            let fact = r
                .rail_fact
                .as_ref()
                .map(payment_client::wire::rail_fact_from_proto)
                .transpose()?;
            self.store
                .record_outcome(&payout_id, &fence, &outcome, &detail, fact.as_ref())
                .await
        }
        .await;
        reply(timer, result, |p| payout_to_proto(&p))
    }

    async fn post(&self, request: Request<pb::PostRequest>) -> Reply<pb::PostResponse> {
        let timer = self.calls.start("post");
        let r = request.into_inner();
        let result = async {
            let payout_id = parse_payout_id(&r.payout_id)?;
            let fence = parse_fence(r.fence.as_ref())?;
            self.store.post(&payout_id, &fence).await
        }
        .await;
        reply(timer, result, |o| pb::PostResponse {
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
        let timer = self.calls.start("resolve_ambiguity");
        let r = request.into_inner();
        let result = async {
            let payout_id = parse_payout_id(&r.payout_id)?;
            let fence = parse_fence(r.fence.as_ref())?;
            let (evidence, source) = parse_evidence(&r)?;
            let proof = r
                .rail_evidence
                .as_ref()
                .map(payment_client::wire::rail_evidence_from_proto)
                .transpose()?;
            self.store
                .resolve_ambiguity(&payout_id, &fence, &evidence, &source, proof.as_ref())
                .await
        }
        .await;
        reply(timer, result, |p| payout_to_proto(&p))
    }

    async fn abandon(&self, request: Request<pb::AbandonRequest>) -> Reply<pb::Payout> {
        let timer = self.calls.start("abandon");
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
                signature: signature_from_proto(r.operator_signature),
            };
            self.store.abandon(&payout_id, &fence, &request).await
        }
        .await;
        reply(timer, result, |p| payout_to_proto(&p))
    }

    async fn record_operator_decision(
        &self,
        request: Request<pb::RecordOperatorDecisionRequest>,
    ) -> Reply<pb::AuditEvent> {
        let timer = self.calls.start("record_operator_decision");
        let caller = service_kit::grpc::caller(&request)?;
        let r = request.into_inner();
        let result = async {
            let mut decision = model::OperatorDecision {
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
                signature: signature_from_proto(r.operator_signature),
            };
            if caller.role == service_kit::grpc::Role::Operator {
                // An operator records only a refusal it met outside the workflow (its workflow
                // has closed): an accepted decision is the workflow's alone, which carries it out.
                if decision.accepted {
                    return Err(payment_client::PaymentError::invalid(
                        "accepted",
                        InvalidReason::AcceptedNotAllowed,
                    )
                    .into());
                }
                // Recorded under the operator the certificate carries, never a typed name.
                if self.store.certifies_operators() {
                    decision.operator = service_kit::grpc::certified_operator(
                        &caller,
                        "/payment.v1.PaymentResource/RecordOperatorDecision",
                        decision.operator.trim(),
                        &self.unauthorised_calls,
                    )
                    .map_err(|_| {
                        payment_client::PaymentError::OperatorNotCertified {
                            operator: decision.operator.clone(),
                        }
                    })?;
                }
            }
            self.store
                .record_operator_decision(&decision, caller.role.name())
                .await
        }
        .await;
        reply(timer, result, |e| audit_to_proto(&e))
    }

    async fn replay_quarantined(
        &self,
        request: Request<pb::ReplayQuarantinedRequest>,
    ) -> Reply<pb::ReplayQuarantinedResponse> {
        let timer = self.calls.start("replay_quarantined");
        let caller = service_kit::grpc::caller(&request)?;
        let r = request.into_inner();
        let result = async {
            if r.outbox_id <= 0 {
                return Err(payment_client::PaymentError::invalid(
                    "outbox_id",
                    InvalidReason::IdInvalid,
                )
                .into());
            }
            let operator =
                model::required_text("operator", &r.operator, InvalidReason::OperatorMissing)?;
            let reason = model::required_text("reason", &r.reason, InvalidReason::ReasonMissing)?;
            // Recorded under the operator the certificate carries, never a typed name.
            let operator = if self.store.certifies_operators() {
                service_kit::grpc::certified_operator(
                    &caller,
                    "/payment.v1.PaymentResource/ReplayQuarantined",
                    operator.trim(),
                    &self.unauthorised_calls,
                )
                .map_err(|_| {
                    payment_client::PaymentError::OperatorNotCertified {
                        operator: operator.clone(),
                    }
                })?
            } else {
                operator.trim().to_string()
            };
            let replay_id = self
                .store
                .replay_quarantined(r.outbox_id, &operator, reason.trim())
                .await?;
            // Alert level: a row refused by the GL goes back to it on an operator's word.
            tracing::warn!(
                alert = true,
                outbox_id = r.outbox_id,
                replay_id,
                operator = %operator,
                reason = %reason.trim(),
                "quarantined outbox row released for delivery by an operator"
            );
            Ok((replay_id, operator))
        }
        .await;
        reply(timer, result, |(replay_id, operator)| {
            pb::ReplayQuarantinedResponse {
                replay_id,
                operator,
            }
        })
    }

    async fn check_ledger(
        &self,
        _request: Request<pb::CheckLedgerRequest>,
    ) -> Reply<pb::CheckLedgerResponse> {
        let timer = self.calls.start("check_ledger");
        reply(timer, self.store.check_ledger().await, |c| {
            pb::CheckLedgerResponse {
                groups_checked: c.groups_checked,
                accounts_checked: c.accounts_checked,
                violations: c
                    .violations
                    .iter()
                    .map(|v| match v {
                        LedgerViolation::GroupUnbalanced {
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
                        LedgerViolation::BalanceMismatch {
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

fn signature_from_proto(s: Option<pb::OperatorSignature>) -> Option<model::OperatorSignature> {
    s.map(|s| model::OperatorSignature {
        signature: s.signature,
        signed_at_unix_ms: s.signed_at_unix_ms,
    })
}
