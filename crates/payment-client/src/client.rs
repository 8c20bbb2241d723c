//! A typed client of the payment resource, for the workflow's activities, the reconciler,
//! payoutctl and the tests: inputs are domain types (a mutating call without a `Fence` does not
//! compile), errors are [`PaymentError`] variants decoded from the status' typed `Rejection`,
//! never text.

use payout_domain::{AccountId, Currency, PayoutId};
use payout_proto::payment as pb;
use pb::payment_resource_client::PaymentResourceClient;
use tonic::transport::Channel;

use crate::error::PaymentError;
use crate::model::{self, Fence};
use crate::wire::{self, fence_to_proto, status_to_error};

#[derive(Clone)]
pub struct PaymentClient {
    inner: PaymentResourceClient<Channel>,
}

/// The answer to `GetPayout`.
#[derive(Debug, Clone, PartialEq)]
pub struct PayoutWithHistory {
    pub payout: model::Payout,
    pub history: Vec<model::AuditEvent>,
}

fn payout_of(p: Option<pb::Payout>) -> Result<model::Payout, PaymentError> {
    wire::payout_from_proto(
        p.ok_or_else(|| PaymentError::MalformedResponse("payout missing".into()))?,
    )
}

impl PaymentClient {
    /// Connects to `endpoint` (e.g. `https://127.0.0.1:50052`) over mutual TLS, presenting
    /// `tls`'s certificate and accepting only a payment-resource certificate. Callers that set
    /// their own channel options use [`mtls::Tls::endpoint`] and [`PaymentClient::from_channel`].
    pub async fn connect(endpoint: &str, tls: &mtls::Tls) -> Result<Self, PaymentError> {
        let channel = tls
            .endpoint(endpoint, mtls::Role::PaymentResource)
            .map_err(|e| PaymentError::Transport {
                code: tonic::Code::InvalidArgument,
                message: e.to_string(),
            })?
            .connect()
            .await
            .map_err(|e| PaymentError::Transport {
                code: tonic::Code::Unavailable,
                message: format!("{endpoint}: {e}"),
            })?;
        Ok(Self::from_channel(channel))
    }

    pub fn from_channel(channel: Channel) -> Self {
        Self {
            inner: PaymentResourceClient::new(channel),
        }
    }

    /// The generated client, for requests the typed API cannot express (e.g. bad input tests).
    pub fn raw(&self) -> PaymentResourceClient<Channel> {
        self.inner.clone()
    }

    /// Opens an account with no money (a positive balance needs an operator's signature:
    /// [`PaymentClient::open_funded_account`]).
    pub async fn open_account(
        &self,
        account_id: &AccountId,
        currency: &Currency,
        opening_balance_minor: i64,
    ) -> Result<model::Account, PaymentError> {
        self.open_account_with(account_id, currency, opening_balance_minor, None)
            .await
    }

    /// Opens an account with `opening_balance_minor`, authorised by an operator's `funding`
    /// signature over exactly this account, currency and amount.
    pub async fn open_funded_account(
        &self,
        account_id: &AccountId,
        currency: &Currency,
        opening_balance_minor: i64,
        funding: &model::Funding,
    ) -> Result<model::Account, PaymentError> {
        self.open_account_with(account_id, currency, opening_balance_minor, Some(funding))
            .await
    }

    async fn open_account_with(
        &self,
        account_id: &AccountId,
        currency: &Currency,
        opening_balance_minor: i64,
        funding: Option<&model::Funding>,
    ) -> Result<model::Account, PaymentError> {
        let r = pb::OpenAccountRequest {
            account_id: account_id.to_string(),
            currency: currency.to_string(),
            opening_balance_minor,
            funded_by: funding.map(|f| f.operator.clone()).unwrap_or_default(),
            funding_signature: funding.map(|f| pb::OperatorSignature {
                signature: f.signature.clone(),
                signed_at_unix_ms: f.signed_at_unix_ms,
            }),
        };
        let a = self
            .raw()
            .open_account(r)
            .await
            .map_err(status_to_error)?
            .into_inner();
        wire::account_from_proto(a)
    }

    pub async fn get_account(
        &self,
        account_id: &AccountId,
    ) -> Result<model::Account, PaymentError> {
        let r = pb::GetAccountRequest {
            account_id: account_id.to_string(),
        };
        let a = self
            .raw()
            .get_account(r)
            .await
            .map_err(status_to_error)?
            .into_inner();
        wire::account_from_proto(a)
    }

    pub async fn create_payout(
        &self,
        new: &model::NewPayout,
    ) -> Result<model::Payout, PaymentError> {
        let r = pb::CreatePayoutRequest {
            payout_id: new.payout_id.to_string(),
            account_id: new.account_id.to_string(),
            amount_minor: new.amount_minor.get(),
            currency: new.currency.to_string(),
            beneficiary_ref: new.beneficiary_ref.to_string(),
        };
        let p = self
            .raw()
            .create_payout(r)
            .await
            .map_err(status_to_error)?
            .into_inner();
        wire::payout_from_proto(p)
    }

    pub async fn get_payout(
        &self,
        payout_id: &PayoutId,
    ) -> Result<PayoutWithHistory, PaymentError> {
        let r = pb::GetPayoutRequest {
            payout_id: payout_id.to_string(),
        };
        let g = self
            .raw()
            .get_payout(r)
            .await
            .map_err(status_to_error)?
            .into_inner();
        Ok(PayoutWithHistory {
            payout: payout_of(g.payout)?,
            history: g
                .history
                .into_iter()
                .map(wire::audit_from_proto)
                .collect::<Result<_, _>>()?,
        })
    }

    pub async fn claim(
        &self,
        payout_id: &PayoutId,
        fence: &Fence,
    ) -> Result<model::Payout, PaymentError> {
        let r = pb::ClaimRequest {
            payout_id: payout_id.to_string(),
            fence: Some(fence_to_proto(fence)),
        };
        let p = self
            .raw()
            .claim(r)
            .await
            .map_err(status_to_error)?
            .into_inner();
        wire::payout_from_proto(p)
    }

    pub async fn mark_submitted(
        &self,
        payout_id: &PayoutId,
        fence: &Fence,
    ) -> Result<model::Payout, PaymentError> {
        let r = pb::MarkSubmittedRequest {
            payout_id: payout_id.to_string(),
            fence: Some(fence_to_proto(fence)),
        };
        let p = self
            .raw()
            .mark_submitted(r)
            .await
            .map_err(status_to_error)?
            .into_inner();
        wire::payout_from_proto(p)
    }

    /// RecordOutcome without a rail fact: enough for TIMEOUT and OUTCOME_MISSING, refused for
    /// ACKED and DECLINED once the payment resource requires the proxy's signed outcome
    /// ([`PaymentClient::record_outcome_proven`]).
    pub async fn record_outcome(
        &self,
        payout_id: &PayoutId,
        fence: &Fence,
        outcome: &model::RailOutcome,
        detail: &str,
    ) -> Result<model::Payout, PaymentError> {
        self.record_outcome_proven(payout_id, fence, outcome, detail, None)
            .await
    }

    /// RecordOutcome with the rail proxy's signed outcome `fact` (as the proxy answered it).
    pub async fn record_outcome_proven(
        &self,
        payout_id: &PayoutId,
        fence: &Fence,
        outcome: &model::RailOutcome,
        detail: &str,
        fact: Option<&model::RailFact>,
    ) -> Result<model::Payout, PaymentError> {
        let (kind, rail_ref, decline_code) = match outcome {
            model::RailOutcome::Acked { rail_ref } => {
                (pb::RailOutcome::Acked, rail_ref.clone(), String::new())
            }
            model::RailOutcome::Declined { decline_code } => (
                pb::RailOutcome::Declined,
                String::new(),
                decline_code.clone(),
            ),
            model::RailOutcome::Timeout => (pb::RailOutcome::Timeout, String::new(), String::new()),
            model::RailOutcome::OutcomeMissing => (
                pb::RailOutcome::OutcomeMissing,
                String::new(),
                String::new(),
            ),
        };
        let r = pb::RecordOutcomeRequest {
            payout_id: payout_id.to_string(),
            fence: Some(fence_to_proto(fence)),
            outcome: kind as i32,
            rail_ref,
            decline_code,
            detail: detail.to_string(),
            rail_fact: fact.map(wire::rail_fact_to_proto),
        };
        let p = self
            .raw()
            .record_outcome(r)
            .await
            .map_err(status_to_error)?
            .into_inner();
        wire::payout_from_proto(p)
    }

    pub async fn post(
        &self,
        payout_id: &PayoutId,
        fence: &Fence,
    ) -> Result<model::PostOutcome, PaymentError> {
        let r = pb::PostRequest {
            payout_id: payout_id.to_string(),
            fence: Some(fence_to_proto(fence)),
        };
        let o = self
            .raw()
            .post(r)
            .await
            .map_err(status_to_error)?
            .into_inner();
        Ok(model::PostOutcome {
            payout: payout_of(o.payout)?,
            transaction_group: o
                .transaction_group
                .parse()
                .map_err(|e| PaymentError::MalformedResponse(format!("transaction_group: {e}")))?,
            entries: o
                .entries
                .into_iter()
                .map(wire::entry_from_proto)
                .collect::<Result<_, _>>()?,
            outbox_idempotency_key: o.outbox_idempotency_key,
            already_posted: o.already_posted,
        })
    }

    /// ResolveAmbiguity without the proxy's signed evidence: refused once the payment resource
    /// requires it ([`PaymentClient::resolve_ambiguity_proven`]).
    pub async fn resolve_ambiguity(
        &self,
        payout_id: &PayoutId,
        fence: &Fence,
        evidence: &model::Evidence,
        evidence_source: &str,
    ) -> Result<model::Payout, PaymentError> {
        self.resolve_ambiguity_proven(payout_id, fence, evidence, evidence_source, None)
            .await
    }

    /// ResolveAmbiguity with the rail proxy's signed evidence `proof` (an inquiry's resolution).
    pub async fn resolve_ambiguity_proven(
        &self,
        payout_id: &PayoutId,
        fence: &Fence,
        evidence: &model::Evidence,
        evidence_source: &str,
        proof: Option<&model::RailEvidence>,
    ) -> Result<model::Payout, PaymentError> {
        let (kind, rail_ref) = match evidence {
            model::Evidence::Found { rail_ref } => (pb::Evidence::Found, rail_ref.clone()),
            model::Evidence::Absent => (pb::Evidence::Absent, String::new()),
        };
        let r = pb::ResolveAmbiguityRequest {
            payout_id: payout_id.to_string(),
            fence: Some(fence_to_proto(fence)),
            evidence: kind as i32,
            rail_ref,
            evidence_source: evidence_source.to_string(),
            rail_evidence: proof.map(wire::rail_evidence_to_proto),
        };
        let p = self
            .raw()
            .resolve_ambiguity(r)
            .await
            .map_err(status_to_error)?
            .into_inner();
        wire::payout_from_proto(p)
    }

    pub async fn abandon(
        &self,
        payout_id: &PayoutId,
        fence: &Fence,
        request: &model::AbandonRequest,
    ) -> Result<model::Payout, PaymentError> {
        let r = pb::AbandonRequest {
            payout_id: payout_id.to_string(),
            fence: Some(fence_to_proto(fence)),
            operator: request.operator.clone(),
            reason: request.reason.clone(),
            resolution_sla_passed: request.resolution_sla_passed,
            sla_check: request.sla_check.clone(),
            operator_signature: request.signature.as_ref().map(signature_to_proto),
        };
        let p = self
            .raw()
            .abandon(r)
            .await
            .map_err(status_to_error)?
            .into_inner();
        wire::payout_from_proto(p)
    }

    pub async fn record_operator_decision(
        &self,
        decision: &model::OperatorDecision,
    ) -> Result<model::AuditEvent, PaymentError> {
        let r = pb::RecordOperatorDecisionRequest {
            payout_id: decision.payout_id.to_string(),
            operator: decision.operator.clone(),
            decision: decision.decision.clone(),
            reason: decision.reason.clone(),
            accepted: decision.accepted,
            note: decision.note.clone(),
            token: decision.token.map(|t| t.get()).unwrap_or(0),
            operator_signature: decision.signature.as_ref().map(signature_to_proto),
        };
        let e = self
            .raw()
            .record_operator_decision(r)
            .await
            .map_err(status_to_error)?
            .into_inner();
        wire::audit_from_proto(e)
    }

    /// Releases quarantined outbox row `outbox_id` for delivery again, recorded under
    /// `operator`, which must be the operator this client's certificate carries. Answers the
    /// replay record's id and the operator recorded.
    pub async fn replay_quarantined(
        &self,
        outbox_id: i64,
        operator: &str,
        reason: &str,
    ) -> Result<pb::ReplayQuarantinedResponse, PaymentError> {
        Ok(self
            .raw()
            .replay_quarantined(pb::ReplayQuarantinedRequest {
                outbox_id,
                operator: operator.to_string(),
                reason: reason.to_string(),
            })
            .await
            .map_err(status_to_error)?
            .into_inner())
    }

    /// The raw reply, violations included (the reconciler reads them as they are).
    pub async fn check_ledger(&self) -> Result<pb::CheckLedgerResponse, PaymentError> {
        Ok(self
            .raw()
            .check_ledger(pb::CheckLedgerRequest {})
            .await
            .map_err(status_to_error)?
            .into_inner())
    }
}

fn signature_to_proto(s: &model::OperatorSignature) -> pb::OperatorSignature {
    pb::OperatorSignature {
        signature: s.signature.clone(),
        signed_at_unix_ms: s.signed_at_unix_ms,
    }
}
