//! The rail proxy's contract: everything a process needs to talk to `railproxy.v1.RailProxy`,
//! and nothing of the server behind it.
//!
//! - [`RailProxyClient`], the typed gRPC client, whose every rejection is a named
//!   [`ProxyError`] variant (see [`client`] for how a caller must read each result: an ambiguous
//!   outcome is never a failure and is never resubmitted).
//! - [`model`]: the request and response types that cross the wire ([`SubmitPayout`],
//!   [`InquirePayout`], [`Submission`] and its [`Outcome`], [`Resolution`] and its [`Evidence`],
//!   [`RailLookup`]), valid by construction.
//! - [`wire`]: the one place where those types are converted to and from `railproxy.v1` messages,
//!   in both directions. The proxy server (crate `rail-proxy`) uses these same definitions to
//!   parse its requests and encode its answers, so the two sides cannot drift apart.
//!
//! Callers that only talk to the proxy (the workflow's activities, the reconciler, the system
//! tests, operator tools) depend on this crate alone. It links no database driver, store, HTTP
//! client or rail code: only `payout-domain`, `payout-proto`, `grant-signing` (the signed grant a
//! fenced request carries) and the gRPC stack.

pub mod client;
pub mod model;
pub mod wire;

pub use client::{Inquiry, ProxyError, RailProxyClient, SubmissionRecord};
pub use grant_signing::Signature;
pub use model::{
    Evidence, InquirePayout, InvalidArgument, Outcome, Payment, RailLookup, RailMovement,
    Resolution, Submission, SubmitPayout, KEY_LENGTH_MAX, OWNER_LENGTH_MAX,
};
pub use wire::Malformed;
