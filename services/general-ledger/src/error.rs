//! The one error type of the GL, and its single conversion to a gRPC status with a typed
//! `Rejection` detail (the process boundary).

use payout_proto::ledger::{Rejection, RejectionReason};
use tonic::Code;

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum LedgerError {
    #[error("journal unbalanced in {asset}: entries sum to {sum}")]
    Unbalanced { asset: String, sum: String },
    #[error("line {line_number}: zero amount")]
    ZeroAmount { line_number: u32 },
    #[error("line {line_number}: more than 18 fractional digits")]
    PrecisionExceeded { line_number: u32 },
    #[error("line {line_number}: amount out of range")]
    AmountOutOfRange { line_number: u32 },
    /// Every amount fits, but an account's balance would leave numeric(38,18). Nothing written.
    #[error("a balance would leave numeric(38,18): {detail}")]
    BalanceOutOfRange { detail: String },
    #[error("line {line_number}: {amount:?} is not a canonical decimal string")]
    NonCanonicalAmount { line_number: u32, amount: String },
    #[error("line {line_number}: unknown account {account}")]
    UnknownAccount { line_number: u32, account: String },
    #[error("line {line_number}: account {account} does not hold {asset}")]
    AccountAssetMismatch {
        line_number: u32,
        account: String,
        asset: String,
    },
    #[error("line number {line_number} used twice")]
    DuplicateLineNumber { line_number: u32 },
    #[error("missing source identity: {field}")]
    MissingSourceIdentity { field: &'static str },
    #[error(
        "idempotency key reused with a different payload (original journal {existing_journal_id})"
    )]
    IdempotencyConflict { existing_journal_id: String },
    #[error("reversal target {target} does not exist")]
    ReversalTargetUnknown { target: String },
    #[error("journal {target} is already reversed by {existing_reversal}")]
    AlreadyReversed {
        target: String,
        existing_reversal: String,
    },
    #[error("not an exact mirror of journal {target}: {detail}")]
    ReversalNotMirror { target: String, detail: String },
    #[error("operating mode {mode} does not accept this journal")]
    ModeRefused { mode: String },
    #[error("operating mode {mode} is not activated by this implementation")]
    ModeNotActivated { mode: String },
    #[error("a journal needs entries")]
    EmptyJournal,
    #[error("invalid {field}: {detail}")]
    InvalidField { field: &'static str, detail: String },
    #[error("not found: {what}")]
    NotFound { what: String },
    /// The database failed or is unreachable: the caller retries; nothing was decided.
    #[error("storage: {0}")]
    Storage(String),
    /// Startup failed: migrations, the listener, the server.
    #[error("startup: {0}")]
    Startup(String),
}

impl From<sqlx::Error> for LedgerError {
    fn from(e: sqlx::Error) -> Self {
        LedgerError::Storage(e.to_string())
    }
}

impl LedgerError {
    pub fn reason(&self) -> RejectionReason {
        use LedgerError::*;
        match self {
            Unbalanced { .. } => RejectionReason::Unbalanced,
            ZeroAmount { .. } => RejectionReason::ZeroAmount,
            PrecisionExceeded { .. } => RejectionReason::PrecisionExceeded,
            AmountOutOfRange { .. } | BalanceOutOfRange { .. } => RejectionReason::AmountOutOfRange,
            NonCanonicalAmount { .. } => RejectionReason::NonCanonicalAmount,
            UnknownAccount { .. } => RejectionReason::UnknownAccount,
            AccountAssetMismatch { .. } => RejectionReason::AccountAssetMismatch,
            DuplicateLineNumber { .. } => RejectionReason::DuplicateLineNumber,
            MissingSourceIdentity { .. } => RejectionReason::MissingSourceIdentity,
            IdempotencyConflict { .. } => RejectionReason::IdempotencyConflict,
            ReversalTargetUnknown { .. } => RejectionReason::ReversalTargetUnknown,
            AlreadyReversed { .. } => RejectionReason::AlreadyReversed,
            ReversalNotMirror { .. } => RejectionReason::ReversalNotMirror,
            ModeRefused { .. } => RejectionReason::ModeRefused,
            ModeNotActivated { .. } => RejectionReason::ModeNotActivated,
            EmptyJournal => RejectionReason::EmptyJournal,
            InvalidField { .. } => RejectionReason::InvalidField,
            NotFound { .. } => RejectionReason::NotFound,
            Storage(_) | Startup(_) => RejectionReason::Unspecified,
        }
    }

    /// The only place a `LedgerError` becomes a wire status.
    pub fn into_status(self) -> tonic::Status {
        use LedgerError::*;
        let code = match &self {
            Storage(_) => return tonic::Status::unavailable(self.to_string()),
            Startup(_) => return tonic::Status::internal(self.to_string()),
            IdempotencyConflict { .. } | AlreadyReversed { .. } => Code::AlreadyExists,
            ModeRefused { .. }
            | ModeNotActivated { .. }
            | BalanceOutOfRange { .. }
            | UnknownAccount { .. }
            | AccountAssetMismatch { .. } => Code::FailedPrecondition,
            ReversalTargetUnknown { .. } | NotFound { .. } => Code::NotFound,
            _ => Code::InvalidArgument,
        };
        let mut detail = Rejection {
            reason: self.reason() as i32,
            detail: self.to_string(),
            ..Default::default()
        };
        match &self {
            IdempotencyConflict {
                existing_journal_id,
            } => detail.existing_journal_id = existing_journal_id.clone(),
            AlreadyReversed {
                existing_reversal, ..
            } => detail.existing_journal_id = existing_reversal.clone(),
            Unbalanced { asset, .. } => detail.asset = asset.clone(),
            AccountAssetMismatch {
                line_number, asset, ..
            } => {
                detail.line_number = *line_number;
                detail.asset = asset.clone();
            }
            ZeroAmount { line_number }
            | PrecisionExceeded { line_number }
            | AmountOutOfRange { line_number }
            | NonCanonicalAmount { line_number, .. }
            | UnknownAccount { line_number, .. }
            | DuplicateLineNumber { line_number } => detail.line_number = *line_number,
            MissingSourceIdentity { field } | InvalidField { field, .. } => {
                detail.field = field.to_string()
            }
            _ => {}
        }
        service_kit::rejection::status(code, self.to_string(), &detail)
    }
}
