//! The typed client the workflow's activities use. Every rejection is a named variant; nothing
//! is a string to parse.
//!
//! How a caller must read the results (spec 2.3):
//! - `Ok(s)` with `s.outcome.is_ambiguous()` (TIMEOUT or PENDING): money **may** have moved. Go to
//!   RAIL_AMBIGUOUS; never resubmit; resolve with [`RailProxyClient::inquire`] or a human.
//! - `Err(ProxyError::FencedOut{..})`: this holder is stale; abort, a valid holder recovers later.
//! - `Err(ProxyError::ForgedGrant{..})` / `Err(ProxyError::GrantForAnotherKey{..})`: the grant
//!   presented is not the lock service's for this account's key; nothing was sent. A defect (or an
//!   attack), never retried with the same grant.
//! - `Err(ProxyError::Duplicate{existing, ..})`: nothing was sent; continue from `existing`.
//! - `Err(ProxyError::Rpc(_))` (deadline, connection lost): unknown whether the intent was written;
//!   calling `submit` again is safe (it can only answer DUPLICATE with the record) and so is
//!   `lookup`.
//! - `inquire` is fenced like `submit` (`FencedOut` for a stale resolver). `Evidence::NeverSent`
//!   (the payout is sealed: never sent, never will be) is read exactly like `Evidence::Absent`.

use payout_domain::PayoutId;
use payout_proto::railproxy as pb;
use pb::rail_proxy_client::RailProxyClient as Grpc;
use tonic::transport::Channel;

use crate::model::{
    InquirePayout, Outcome, RailLookup, RailMovement, Resolution, Submission, SubmitPayout,
};
use crate::wire::{self, Malformed};

#[derive(Debug, Clone, thiserror::Error)]
pub enum ProxyError {
    #[error("fenced out at the rail proxy: token {presented} is below the high-water {stored} of {key} (set by {stored_owner})")]
    FencedOut {
        key: String,
        presented: u64,
        stored: u64,
        owner: String,
        stored_owner: String,
        payout_id: String,
    },
    #[error("payout {} already has a submission; nothing was sent", existing.payout_id)]
    Duplicate {
        existing: Box<Submission>,
        payload_matches: bool,
    },
    #[error("invalid {field}: {reason}")]
    InvalidArgument { field: String, reason: String },
    #[error("no submission for payout {payout_id}")]
    NotFound { payout_id: String },
    /// The rail was called, but the proxy could not store the outcome: the record stays PENDING,
    /// which is ambiguous. `rail_outcome` is what the rail said, for diagnostics only.
    #[error("the rail proxy could not record the outcome ({detail}); the submission is ambiguous")]
    OutcomeNotRecorded {
        rail_outcome: Option<Outcome>,
        detail: String,
    },
    /// PERMISSION_DENIED: the grant presented is not one the lock service signed (unsigned, an
    /// unknown signing key, or a signature that does not match its key, token and owner: a
    /// fabricated token). Nothing was sent and nothing written but the refusal's guard event.
    /// `reason` is `unsigned`, `unknown_key_id` or `bad_signature`.
    #[error("forged grant refused at the rail proxy ({reason}): token {presented} of {key} presented by {owner}, signing key {signing_key_id:?}; nothing sent")]
    ForgedGrant {
        key: String,
        presented: u64,
        owner: String,
        signing_key_id: String,
        reason: String,
        payout_id: String,
    },
    /// PERMISSION_DENIED: a genuine grant, signed for another lock key than the account's
    /// (`payout:{account_id}`): tokens are global across keys, so it fences nothing here. Nothing
    /// was sent and nothing written but the refusal's guard event.
    #[error("grant for another key refused at the rail proxy: token {presented} of {presented_key} presented by {owner} where {required_key} is required; nothing sent")]
    GrantForAnotherKey {
        presented_key: String,
        required_key: String,
        presented: u64,
        owner: String,
        payout_id: String,
    },
    /// UNAVAILABLE: proxydb is a copy restored from a backup that was not re-armed, or the token
    /// is below the last re-arming's horizon. Refused before the intent: nothing was sent and
    /// nothing written but the refusal's guard event. Retry after `payoutctl restore rearm`.
    #[error("rail proxy refused token {presented} on payout {payout_id}: {}; nothing sent",
        if *incarnation_current { format!("the token is below the horizon {token_floor} of the last restore's re-arming") }
        else { "proxydb was restored from a backup and not re-armed (payoutctl restore rearm)".to_string() })]
    DatabaseRestored {
        payout_id: String,
        presented: u64,
        incarnation_current: bool,
        token_floor: u64,
    },
    /// PERMISSION_DENIED: the submit's instruction is missing, not signed by a payment resource
    /// key the proxy knows, or not for exactly this payment (`reason`:
    /// `grant_signing::instruction::REASONS`; `field` names a mismatched field). Nothing was sent
    /// and nothing written but the refusal's guard event.
    #[error("instruction refused at the rail proxy ({reason}{}) for payout {payout_id}: {detail}; nothing sent",
        if field.is_empty() { String::new() } else { format!(": {field}") })]
    InstructionRefused {
        payout_id: String,
        reason: String,
        field: String,
        signing_key_id: String,
        detail: String,
    },
    #[error(transparent)]
    Malformed(#[from] Malformed),
    /// Transport or server failure without a typed rejection.
    #[error("rail proxy call failed: {0}")]
    Rpc(tonic::Status),
}

impl ProxyError {
    fn from_status(status: tonic::Status) -> Self {
        wire::status_to_error(status)
    }
}

/// A submission with the evidence kept beside it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SubmissionRecord {
    pub submission: Submission,
    pub resolutions: Vec<Resolution>,
}

/// One inquiry's answer: the unchanged submission and the new evidence.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Inquiry {
    pub submission: Submission,
    pub resolution: Resolution,
}

#[derive(Clone)]
pub struct RailProxyClient {
    inner: Grpc<Channel>,
}

impl RailProxyClient {
    /// Connects to `endpoint` (`https://...`) over mutual TLS, presenting `tls`'s certificate
    /// and accepting only a rail-proxy certificate.
    pub async fn connect(endpoint: &str, tls: &mtls::Tls) -> Result<Self, mtls::ConnectError> {
        Ok(Self::from_channel(
            tls.connect(endpoint, mtls::Role::RailProxy).await?,
        ))
    }

    pub fn from_channel(channel: Channel) -> Self {
        Self {
            inner: Grpc::new(channel),
        }
    }

    /// Fenced, at-most-once submission. See the module documentation for how to read the result.
    pub async fn submit(&mut self, request: &SubmitPayout) -> Result<Submission, ProxyError> {
        let response = self
            .inner
            .submit(wire::submit_request(request))
            .await
            .map_err(ProxyError::from_status)?;
        let submission = response.into_inner().submission.ok_or_else(|| Malformed {
            what: "submit response",
            detail: "no submission".into(),
        })?;
        Ok(wire::submission_from_proto(&submission)?)
    }

    /// The submission of a payout, or `None` if it was never submitted.
    pub async fn lookup(
        &mut self,
        payout_id: &PayoutId,
    ) -> Result<Option<SubmissionRecord>, ProxyError> {
        let request = pb::LookupRequest {
            payout_id: payout_id.to_string(),
        };
        let response = match self
            .inner
            .lookup(request)
            .await
            .map_err(ProxyError::from_status)
        {
            Ok(response) => response.into_inner(),
            Err(ProxyError::NotFound { .. }) => return Ok(None),
            Err(e) => return Err(e),
        };
        let submission = response.submission.ok_or_else(|| Malformed {
            what: "lookup response",
            detail: "no submission".into(),
        })?;
        Ok(Some(SubmissionRecord {
            submission: wire::submission_from_proto(&submission)?,
            resolutions: response
                .resolutions
                .iter()
                .map(wire::resolution_from_proto)
                .collect::<Result<_, _>>()?,
        }))
    }

    /// The fenced inquiry: advances the account's high-water with the resolver's token, seals a
    /// payout that has no submission (answer `NeverSent`), otherwise asks the rail by client
    /// reference (`Absent` only once the instruction has expired there). The evidence is
    /// recorded; an existing outcome is kept.
    pub async fn inquire(&mut self, request: &InquirePayout) -> Result<Inquiry, ProxyError> {
        let response = self
            .inner
            .inquire(wire::inquire_request(request))
            .await
            .map_err(ProxyError::from_status)?
            .into_inner();
        let submission = response.submission.ok_or_else(|| Malformed {
            what: "inquire response",
            detail: "no submission".into(),
        })?;
        let resolution = response.resolution.ok_or_else(|| Malformed {
            what: "inquire response",
            detail: "no resolution".into(),
        })?;
        Ok(Inquiry {
            submission: wire::submission_from_proto(&submission)?,
            resolution: wire::resolution_from_proto(&resolution)?,
        })
    }

    /// What the rail reports for the payout's client reference (read-only, unfenced).
    pub async fn rail_movements(&mut self, payout_id: &PayoutId) -> Result<RailLookup, ProxyError> {
        let r = self
            .inner
            .rail_movements(pb::RailMovementsRequest {
                payout_id: payout_id.to_string(),
            })
            .await
            .map_err(ProxyError::from_status)?
            .into_inner();
        Ok(match pb::RailLookupState::try_from(r.state) {
            Ok(pb::RailLookupState::RailLookupFound) => RailLookup::Found(
                r.movements
                    .into_iter()
                    .map(|m| {
                        RailMovement::from((
                            m.rail_ref,
                            m.amount_minor,
                            m.currency,
                            m.beneficiary_ref,
                        ))
                    })
                    .collect(),
            ),
            Ok(pb::RailLookupState::RailLookupAbsent) => RailLookup::Absent,
            Ok(pb::RailLookupState::RailLookupUnknown) => RailLookup::Unknown { detail: r.detail },
            _ => {
                return Err(Malformed {
                    what: "rail movements response",
                    detail: format!("state {}", r.state),
                }
                .into())
            }
        })
    }

    /// The raw generated client, for tests that send deliberately malformed requests.
    pub fn raw(&mut self) -> &mut Grpc<Channel> {
        &mut self.inner
    }
}
