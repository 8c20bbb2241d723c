//! The one error type of the lock-server library. Expected refusals are named variants that map
//! one-to-one onto the wire `Rejection` oneof; only `Backend` is an outage.

use payout_proto::lock as pb;

#[derive(Debug, thiserror::Error)]
pub enum LockError {
    #[error("session {session_id} not found (expired, closed or never created)")]
    SessionNotFound { session_id: String },
    #[error("not the holder of {key}: presented token {presented_token} of session {presented_session_id}, current token {current_token}")]
    NotHolder {
        key: String,
        presented_owner: String,
        presented_session_id: String,
        presented_token: u64,
        current_token: u64,
    },
    #[error("{key} is not held")]
    NotHeld { key: String },
    #[error("holder_changed: {key} is no longer held by the grant of token {expected_token} (held now by token {current_token}); nothing was revoked")]
    HolderChanged {
        key: String,
        expected_token: u64,
        current_token: u64,
    },
    #[error("invalid {field}: {problem}")]
    InvalidArgument {
        field: &'static str,
        problem: String,
    },
    #[error("token regression on {key}: backend returned {returned_token}, this server already issued {highest_issued_token}")]
    TokenRegression {
        key: String,
        returned_token: u64,
        highest_issued_token: u64,
    },
    #[error("session {session_id} was created by another certificate; a session is usable only by its creator")]
    SessionNotOwned { session_id: String },
    #[error("operator_not_certified: the caller's certificate does not carry the operator {operator:?} (an operator's certificate carries <name>.operator; the resolver acts only as `reconciler`)")]
    OperatorNotCertified { operator: String },
    #[error(
        "{waiting} callers already wait for locks in this server, its bound is {max}; retry later"
    )]
    Overloaded { waiting: usize, max: usize },
    #[error("caller_limit_reached: this certificate has {in_use} {limit} in use, its bound is {max}; retry once its own use falls")]
    CallerLimitReached {
        limit: &'static str,
        in_use: u64,
        max: u64,
    },
    #[error("{backend} backend unavailable: {detail}")]
    Backend {
        backend: &'static str,
        detail: String,
    },
}

impl LockError {
    pub fn invalid(field: &'static str, problem: impl Into<String>) -> Self {
        Self::InvalidArgument {
            field,
            problem: problem.into(),
        }
    }

    /// The wire form: a status code plus the typed `Rejection` in the details.
    pub fn to_status(&self) -> tonic::Status {
        use pb::rejection::Kind;
        let (code, kind) = match self {
            Self::Overloaded { .. } => return tonic::Status::resource_exhausted(self.to_string()),
            Self::SessionNotFound { session_id } => (
                tonic::Code::NotFound,
                Kind::SessionNotFound(pb::SessionNotFound {
                    session_id: session_id.clone(),
                }),
            ),
            Self::NotHolder {
                key,
                presented_owner,
                presented_session_id,
                presented_token,
                current_token,
            } => (
                tonic::Code::FailedPrecondition,
                Kind::NotHolder(pb::NotHolder {
                    key: key.clone(),
                    presented_owner: presented_owner.clone(),
                    presented_session_id: presented_session_id.clone(),
                    presented_token: *presented_token,
                    current_token: *current_token,
                }),
            ),
            Self::SessionNotOwned { session_id } => (
                tonic::Code::PermissionDenied,
                Kind::SessionNotOwned(pb::SessionNotOwned {
                    session_id: session_id.clone(),
                }),
            ),
            Self::OperatorNotCertified { operator } => (
                tonic::Code::PermissionDenied,
                Kind::OperatorNotCertified(pb::OperatorNotCertified {
                    operator: operator.clone(),
                }),
            ),
            Self::NotHeld { key } => (
                tonic::Code::FailedPrecondition,
                Kind::NotHeld(pb::NotHeld { key: key.clone() }),
            ),
            Self::HolderChanged {
                key,
                expected_token,
                current_token,
            } => (
                tonic::Code::FailedPrecondition,
                Kind::HolderChanged(pb::HolderChanged {
                    key: key.clone(),
                    expected_token: *expected_token,
                    current_token: *current_token,
                }),
            ),
            Self::InvalidArgument { field, problem } => (
                tonic::Code::InvalidArgument,
                Kind::InvalidArgument(pb::InvalidArgument {
                    field: field.to_string(),
                    problem: problem.clone(),
                }),
            ),
            Self::TokenRegression {
                key,
                returned_token,
                highest_issued_token,
            } => (
                tonic::Code::Internal,
                Kind::TokenRegression(pb::TokenRegression {
                    key: key.clone(),
                    returned_token: *returned_token,
                    highest_issued_token: *highest_issued_token,
                }),
            ),
            Self::CallerLimitReached { limit, in_use, max } => (
                tonic::Code::ResourceExhausted,
                Kind::CallerLimitReached(pb::CallerLimitReached {
                    limit: limit.to_string(),
                    in_use: *in_use,
                    max: *max,
                }),
            ),
            Self::Backend { backend, .. } => (
                tonic::Code::Unavailable,
                Kind::BackendUnavailable(pb::BackendUnavailable {
                    backend: backend.to_string(),
                }),
            ),
        };
        service_kit::rejection::status(code, self.to_string(), &pb::Rejection { kind: Some(kind) })
    }
}

impl From<LockError> for tonic::Status {
    fn from(e: LockError) -> Self {
        e.to_status()
    }
}
