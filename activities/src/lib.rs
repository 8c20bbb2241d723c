//! The activity contract of the payout workflow: every I/O it does, declared as Temporal
//! activities, and nothing that does it. `payout-workflows` depends on this crate alone (beside the
//! domain and the Temporal SDK); the worker (`payout-worker`, `src/services.rs`) implements
//! [`Backend`] with the services' clients, and workflow tests implement it in memory
//! ([`in_memory`], behind the `test-backend` feature, which no shipped binary enables).
//!
//! - [`types`]: the activity inputs and outputs (what Temporal's history holds).
//! - [`refusal`]: business refusals with stable names, non-retryable, matched by name.
//! - [`backend`]: the services behind one trait; [`activities::PayoutActivities`] registers them
//!   as thin shells (one shape for every fenced call: `PayoutActivities::fenced`).
//!
//! Architecture invariant: a mutating activity takes a [`types::Grant`] (and so a
//! `FencingToken`) in its input; there is no ambient token anywhere in this crate.

pub mod activities;
pub mod backend;
#[cfg(feature = "test-backend")]
pub mod in_memory;
pub mod refusal;
pub mod types;

pub use activities::{check_caller, PayoutActivities, ACTIVITY_TYPES};
pub use backend::Backend;
pub use refusal::{ActivityFailure, Refusal};
