//! The gRPC service: validation, the guard (intent transaction), one rail call, the outcome.

use std::sync::Arc;
use std::time::Duration;

use payout_domain::PayoutId;
use payout_proto::railproxy as pb;
use service_kit::prometheus::IntCounterVec;
use service_kit::rejection;
use sqlx::PgPool;
use tonic::{Code, Request, Response, Status};

use crate::api;
use crate::model::{Evidence, InvalidArgument, Outcome, Submission, SubmitPayout};
use crate::rail::{Rail, RailAnswer};
use crate::store::{self, Intent, StoreError};
use crate::{Failpoint, Guards, ProxyConfig};

/// Attempts to store an outcome after the rail answered. Storing is conditional on a NULL
/// outcome, so repeating it is safe (unlike repeating the rail call); a few attempts ride out a
/// connection blip, and beyond them the submission stays NULL, which is reported as ambiguous.
const OUTCOME_RECORD_ATTEMPTS_MAX: u32 = 3;
const OUTCOME_RECORD_BACKOFF_MS: u64 = 200;
/// Longest `asked_by` accepted.
const ASKED_BY_LENGTH_MAX: usize = 256;

pub(crate) struct Counters {
    pub fenced_out: IntCounterVec,
    pub duplicates: IntCounterVec,
    pub outcomes: IntCounterVec,
    pub inquiries: IntCounterVec,
    pub rail_duplicates: IntCounterVec,
}

impl Counters {
    pub fn new(metrics: &service_kit::Metrics) -> Self {
        Self {
            fenced_out: metrics.counter_vec("fenced_out_total", "Stale tokens refused by a guard.", &["guard"]),
            duplicates: metrics.counter_vec(
                "rail_proxy_duplicate_submissions_total",
                "Submits refused because the payout already has a submission (pages).",
                &[],
            ),
            outcomes: metrics.counter_vec("rail_proxy_outcomes_total", "Recorded outcomes of rail calls.", &["outcome"]),
            inquiries: metrics.counter_vec("rail_proxy_inquiries_total", "Inquiries by evidence.", &["evidence"]),
            rail_duplicates: metrics.counter_vec(
                "rail_proxy_rail_duplicate_movements_total",
                "Inquiries that found more than one movement for one client reference (safety event).",
                &[],
            ),
        }
    }
}

pub(crate) struct Inner {
    pub pool: PgPool,
    pub rail: Rail,
    pub config: ProxyConfig,
    pub counters: Counters,
}

#[derive(Clone)]
pub struct ProxyService(pub(crate) Arc<Inner>);

fn invalid(e: InvalidArgument) -> Status {
    let detail = pb::Rejection {
        kind: Some(pb::rejection::Kind::InvalidArgument(pb::InvalidArgument {
            field: e.field.to_string(),
            reason: e.reason.clone(),
        })),
    };
    rejection::status(Code::InvalidArgument, e.to_string(), &detail)
}

fn not_found(payout_id: &PayoutId) -> Status {
    let detail = pb::Rejection {
        kind: Some(pb::rejection::Kind::NotFound(pb::NotFound {
            payout_id: payout_id.to_string(),
        })),
    };
    rejection::status(
        Code::NotFound,
        format!("no submission for payout {payout_id}"),
        &detail,
    )
}

fn store_failure(e: StoreError) -> Status {
    match e {
        StoreError::Invariant(_) => {
            tracing::error!(error = %e, "proxydb invariant broken");
            Status::internal(e.to_string())
        }
        other => {
            tracing::warn!(error = %other, "proxydb unavailable");
            Status::unavailable(other.to_string())
        }
    }
}

impl ProxyService {
    async fn call_rail_and_record(&self, request: SubmitPayout) -> Result<Submission, Status> {
        let inner = self.0.clone();
        // The rail call and the recording run in their own task: a caller that disconnects
        // must not cancel the recording of what the rail did.
        let task = tokio::spawn(tracing::Instrument::in_current_span(async move {
            let answer = inner.rail.pay_once(&request).await;
            let outcome = match answer {
                RailAnswer::Acked { rail_ref } => Outcome::Acked { rail_ref },
                RailAnswer::Rejected { decline_code } => Outcome::Rejected { decline_code },
                RailAnswer::Ambiguous { detail } => Outcome::Timeout { detail },
            };
            inner
                .counters
                .outcomes
                .with_label_values(&[outcome.name()])
                .inc();
            let mut attempt = 1;
            loop {
                match store::record_outcome(&inner.pool, &request.payout_id, &outcome).await {
                    Ok(submission) => {
                        tracing::info!(
                            outcome = outcome.name(),
                            ambiguous = outcome.is_ambiguous(),
                            "rail outcome recorded"
                        );
                        return Ok(submission);
                    }
                    Err(StoreError::Invariant(detail)) => {
                        tracing::error!(%detail, "outcome could not be recorded: invariant broken");
                        return Err((outcome, detail));
                    }
                    Err(e) if attempt >= OUTCOME_RECORD_ATTEMPTS_MAX => {
                        tracing::error!(error = %e, outcome = outcome.name(), "outcome not recorded; the submission stays ambiguous");
                        return Err((outcome, e.to_string()));
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, attempt, "recording the outcome failed; trying again");
                        attempt += 1;
                        tokio::time::sleep(Duration::from_millis(OUTCOME_RECORD_BACKOFF_MS)).await;
                    }
                }
            }
        }));
        match task.await.expect("the rail task does not panic") {
            Ok(submission) => Ok(submission),
            Err((outcome, detail)) => {
                let detail_message = pb::Rejection {
                    kind: Some(pb::rejection::Kind::OutcomeNotRecorded(
                        pb::OutcomeNotRecorded {
                            payout_id: String::new(),
                            rail_outcome: api::outcome_to_proto(&outcome) as i32,
                            detail: detail.clone(),
                        },
                    )),
                };
                Err(rejection::status(
                    Code::Internal,
                    format!("outcome not recorded, submission ambiguous: {detail}"),
                    &detail_message,
                ))
            }
        }
    }

    /// The negative control's path: no high-water, no uniqueness, nothing recorded.
    async fn unguarded(&self, request: SubmitPayout) -> Result<Submission, Status> {
        tracing::error!("rail proxy guards are DISABLED (test-only negative control)");
        let outcome = match self.0.rail.pay_once(&request).await {
            RailAnswer::Acked { rail_ref } => Outcome::Acked { rail_ref },
            RailAnswer::Rejected { decline_code } => Outcome::Rejected { decline_code },
            RailAnswer::Ambiguous { detail } => Outcome::Timeout { detail },
        };
        Ok(Submission {
            payout_id: request.payout_id,
            account_id: request.account_id,
            token: request.token,
            owner: request.owner,
            client_reference: request.client_reference,
            amount_minor: request.amount_minor,
            currency: request.currency,
            beneficiary_ref: request.beneficiary_ref,
            outcome,
            created_at_unix_ms: rail_stub::book::unix_ms_now(),
            resolved_at_unix_ms: Some(rail_stub::book::unix_ms_now()),
        })
    }
}

#[tonic::async_trait]
impl pb::rail_proxy_server::RailProxy for ProxyService {
    async fn submit(
        &self,
        request: Request<pb::SubmitRequest>,
    ) -> Result<Response<pb::SubmitResponse>, Status> {
        let request = api::parse_submit(request.get_ref()).map_err(invalid)?;
        let span = tracing::info_span!("submit", payout_id = %request.payout_id, account_id = %request.account_id, token = request.token.get(), owner = %request.owner);
        let submission = async {
            if self.0.config.guards == Guards::DisabledForNegativeControl {
                return self.unguarded(request).await;
            }
            match store::record_intent(&self.0.pool, &request).await.map_err(store_failure)? {
                Intent::Fenced { stored, stored_owner } => {
                    self.0.counters.fenced_out.with_label_values(&["rail-proxy"]).inc();
                    tracing::error!(
                        event = "fenced_out", alert = true, key = %request.lock_key(), presented = request.token.get(),
                        stored, stored_owner = %stored_owner, "stale token refused at the rail proxy; nothing sent"
                    );
                    let detail = pb::Rejection {
                        kind: Some(pb::rejection::Kind::FencedOut(pb::FencedOut {
                            key: request.lock_key(),
                            presented: request.token.get(),
                            stored,
                            owner: request.owner.clone(),
                            stored_owner,
                            payout_id: request.payout_id.to_string(),
                        })),
                    };
                    Err(rejection::status(
                        Code::FailedPrecondition,
                        format!("fenced out: token {} is below the high-water {stored} of {}", request.token, request.lock_key()),
                        &detail,
                    ))
                }
                Intent::Duplicate { existing } => {
                    self.0.counters.duplicates.with_label_values(&[] as &[&str]).inc();
                    let payload_matches = existing.same_payload(&request);
                    tracing::error!(
                        event = "duplicate_submission", page = true, existing_token = existing.token.get(),
                        existing_outcome = existing.outcome.name(), payload_matches,
                        "a submission for this payout already exists; nothing sent"
                    );
                    let detail = pb::Rejection {
                        kind: Some(pb::rejection::Kind::Duplicate(pb::Duplicate {
                            existing: Some(api::submission_to_proto(&existing)),
                            payload_matches,
                        })),
                    };
                    Err(rejection::status(
                        Code::AlreadyExists,
                        format!("payout {} already has a submission ({})", request.payout_id, existing.outcome.name()),
                        &detail,
                    ))
                }
                Intent::Recorded(_) => {
                    tracing::info!("intent recorded; calling the rail once");
                    if self.0.config.failpoint == Some(Failpoint::AbortAfterIntent) {
                        tracing::error!("failpoint abort-after-intent: aborting between the intent and the rail call");
                        std::process::abort();
                    }
                    self.call_rail_and_record(request).await
                }
            }
        }
        .instrument_in(span)
        .await?;
        Ok(Response::new(pb::SubmitResponse {
            submission: Some(api::submission_to_proto(&submission)),
        }))
    }

    async fn lookup(
        &self,
        request: Request<pb::LookupRequest>,
    ) -> Result<Response<pb::LookupResponse>, Status> {
        let payout_id = PayoutId::parse(request.get_ref().payout_id.as_str())
            .map_err(|e| invalid(InvalidArgument::new("payout_id", e)))?;
        let Some((submission, resolutions)) = store::find(&self.0.pool, &payout_id)
            .await
            .map_err(store_failure)?
        else {
            return Err(not_found(&payout_id));
        };
        Ok(Response::new(pb::LookupResponse {
            submission: Some(api::submission_to_proto(&submission)),
            resolutions: resolutions.iter().map(api::resolution_to_proto).collect(),
        }))
    }

    async fn inquire(
        &self,
        request: Request<pb::InquireRequest>,
    ) -> Result<Response<pb::InquireResponse>, Status> {
        let request = request.into_inner();
        let payout_id = PayoutId::parse(request.payout_id.as_str())
            .map_err(|e| invalid(InvalidArgument::new("payout_id", e)))?;
        if request.asked_by.is_empty() || request.asked_by.len() > ASKED_BY_LENGTH_MAX {
            return Err(invalid(InvalidArgument::new(
                "asked_by",
                format!("must be 1..={ASKED_BY_LENGTH_MAX} bytes"),
            )));
        }
        let Some((submission, _)) = store::find(&self.0.pool, &payout_id)
            .await
            .map_err(store_failure)?
        else {
            return Err(not_found(&payout_id));
        };
        let evidence = self
            .0
            .rail
            .lookup(submission.client_reference.as_str())
            .await;
        self.0
            .counters
            .inquiries
            .with_label_values(&[evidence.name()])
            .inc();
        if let Evidence::Found { rail_refs } = &evidence {
            if rail_refs.len() > 1 {
                self.0
                    .counters
                    .rail_duplicates
                    .with_label_values(&[] as &[&str])
                    .inc();
                tracing::error!(event = "rail_duplicate_movement", page = true, payout_id = %payout_id, ?rail_refs, "the rail moved money more than once for one payout");
            }
            if matches!(submission.outcome, Outcome::Rejected { .. }) {
                tracing::error!(event = "outcome_contradicted", page = true, payout_id = %payout_id, "the rail shows a movement for a declined submission");
            }
        }
        let resolution =
            store::record_resolution(&self.0.pool, &payout_id, &request.asked_by, &evidence)
                .await
                .map_err(store_failure)?;
        tracing::info!(payout_id = %payout_id, asked_by = %request.asked_by, evidence = evidence.name(), outcome = submission.outcome.name(), "inquiry recorded");
        Ok(Response::new(pb::InquireResponse {
            submission: Some(api::submission_to_proto(&submission)),
            resolution: Some(api::resolution_to_proto(&resolution)),
        }))
    }
}

/// `tracing::Instrument` under a name that reads at the call site.
trait InstrumentIn: Sized {
    fn instrument_in(self, span: tracing::Span) -> tracing::instrument::Instrumented<Self>;
}

impl<F: std::future::Future> InstrumentIn for F {
    fn instrument_in(self, span: tracing::Span) -> tracing::instrument::Instrumented<Self> {
        tracing::Instrument::instrument(self, span)
    }
}
