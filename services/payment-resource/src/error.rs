//! What the server can fail with: a typed refusal of the contract ([`PaymentError`], which
//! crosses the wire as the status' `Rejection` detail), or a failure of its own (the database, a
//! broken invariant), which crosses as a bare status and reaches a client as
//! `PaymentError::Transport`.

use payment_client::PaymentError;

#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    /// A refusal the caller can match on (fenced out, refused transition, invalid argument, ...).
    #[error(transparent)]
    Payment(#[from] PaymentError),
    /// A ledger invariant (INV-03) failed inside a transaction, which was rolled back. A bug.
    #[error("ledger invariant broken: {0}")]
    InvariantBroken(String),
    /// The database failed (unreachable, connection killed, ...). Nothing committed.
    #[error("database: {0}")]
    Storage(#[from] sqlx::Error),
}
