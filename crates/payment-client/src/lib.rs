//! The contract of the payment resource's process boundary (`payment.v1.PaymentResource`, see
//! `crates/proto/proto/payment.proto`), as Rust: what a caller of the payment resource needs and
//! what the server shares with its callers, and nothing else.
//!
//! - [`client`]: [`PaymentClient`], the typed client. Inputs are domain types (a mutating call
//!   without a [`Fence`](model::Fence) does not compile), errors are [`PaymentError`] variants.
//! - [`model`]: the request and response types that cross the wire (`Fence`, `NewPayout`,
//!   `Payout`, `Account`, `AuditEvent`, `PostOutcome`, `RailOutcome`, `Evidence`, ...) and the
//!   bounds on free text (`TEXT_LENGTH_MAX`), valid by construction once parsed.
//! - [`error`]: [`PaymentError`] and [`InvalidReason`], the typed errors a caller matches on. A
//!   refusal travels as the status' typed `Rejection` detail and is decoded back into the same
//!   variant, never parsed from text.
//! - [`wire`]: the conversions between these types and `payout_proto::payment`, in one place for
//!   both sides: the server parses requests and encodes answers and refusals with them, the client
//!   builds requests and decodes answers and refusals with them.
//!
//! **Architecture invariant:** this crate links no server code: no store, no migrations, no sqlx,
//! no service-kit. A caller (the workflow's activities, the reconciler, payoutctl) depends on this
//! crate, not on `payment-resource`; only the binary, its own tests and harnesses that start the
//! server in-process link the server crate. Failures that are the server's own (the database, a
//! broken ledger invariant) are not variants here: they reach a client as a status without a
//! typed rejection, [`PaymentError::Transport`].

// `PaymentError`'s refusals carry every field a caller matches on (`ForgedGrant` is the largest,
// as `payment.v1.ForgedGrant` defines it); an error here is a refused network call, never a hot
// path, and boxing the variants would change how every caller matches them.
#![allow(clippy::result_large_err)]

pub mod client;
pub mod error;
pub mod model;
pub mod wire;

pub use client::{PaymentClient, PayoutWithHistory};
pub use error::{InvalidReason, PaymentError};
