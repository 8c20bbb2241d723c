//! `guard_call_duration_seconds{guard="rail_proxy",operation,outcome}`: every RPC the proxy
//! serves, timed around the whole call (for Submit: the grant check, the intent, the rail
//! call and the outcome's recording). The label sets are resolved once at start, so a call
//! pays two clock reads and one histogram observation, and allocates nothing.

use payout_proto::railproxy as pb;
use service_kit::latency::{CallOutcome, GuardCalls};
use tonic::{Code, Request, Response, Status};

use crate::service::ProxyService;

/// Every RPC of the service, as the `operation` label names it.
pub const OPERATIONS: &[&str] = &["submit", "lookup", "rail_movements", "inquire"];

pub(crate) struct TimedProxy {
    service: ProxyService,
    calls: GuardCalls,
}

impl TimedProxy {
    pub(crate) fn new(service: ProxyService, metrics: &service_kit::Metrics) -> Self {
        Self {
            service,
            calls: GuardCalls::new(metrics, service_kit::Guard::RailProxy, OPERATIONS),
        }
    }
}

/// How a call ended, read from its status. The proxy answers FAILED_PRECONDITION only for a
/// stale token (`ProxyError::FencedOut`); UNAVAILABLE with a typed rejection is a restored
/// proxydb's refusal (`DatabaseRestored`), without one the proxy's own database failing.
fn outcome_of<T>(result: &Result<T, Status>) -> CallOutcome {
    let Err(status) = result else {
        return CallOutcome::Ok;
    };
    match status.code() {
        Code::FailedPrecondition => CallOutcome::FencedOut,
        Code::InvalidArgument => CallOutcome::Invalid,
        Code::AlreadyExists | Code::NotFound | Code::PermissionDenied => CallOutcome::Refused,
        Code::Unavailable if !status.details().is_empty() => CallOutcome::Refused,
        Code::Cancelled => CallOutcome::Cancelled,
        _ => CallOutcome::Error,
    }
}

type Reply<T> = Result<Response<T>, Status>;

#[tonic::async_trait]
impl pb::rail_proxy_server::RailProxy for TimedProxy {
    async fn submit(&self, request: Request<pb::SubmitRequest>) -> Reply<pb::SubmitResponse> {
        let timer = self.calls.start("submit");
        let result = self.service.submit(request).await;
        timer.finish(outcome_of(&result));
        result
    }

    async fn lookup(&self, request: Request<pb::LookupRequest>) -> Reply<pb::LookupResponse> {
        let timer = self.calls.start("lookup");
        let result = self.service.lookup(request).await;
        timer.finish(outcome_of(&result));
        result
    }

    async fn rail_movements(
        &self,
        request: Request<pb::RailMovementsRequest>,
    ) -> Reply<pb::RailMovementsResponse> {
        let timer = self.calls.start("rail_movements");
        let result = self.service.rail_movements(request).await;
        timer.finish(outcome_of(&result));
        result
    }

    async fn inquire(&self, request: Request<pb::InquireRequest>) -> Reply<pb::InquireResponse> {
        let timer = self.calls.start("inquire");
        let result = self.service.inquire(request).await;
        timer.finish(outcome_of(&result));
        result
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statuses_map_to_their_outcomes() {
        let ok: Result<(), Status> = Ok(());
        assert_eq!(outcome_of(&ok), CallOutcome::Ok);
        for (code, outcome) in [
            (Code::FailedPrecondition, CallOutcome::FencedOut),
            (Code::InvalidArgument, CallOutcome::Invalid),
            (Code::AlreadyExists, CallOutcome::Refused),
            (Code::NotFound, CallOutcome::Refused),
            (Code::PermissionDenied, CallOutcome::Refused),
            (Code::Unavailable, CallOutcome::Error),
            (Code::Internal, CallOutcome::Error),
        ] {
            let result: Result<(), Status> = Err(Status::new(code, "x"));
            assert_eq!(outcome_of(&result), outcome, "{code:?}");
        }
        let restored: Result<(), Status> = Err(Status::with_details(
            Code::Unavailable,
            "restored",
            bytes_of_detail(),
        ));
        assert_eq!(outcome_of(&restored), CallOutcome::Refused);
    }

    fn bytes_of_detail() -> tonic::codegen::Bytes {
        tonic::codegen::Bytes::from_static(b"\x08\x01")
    }
}
