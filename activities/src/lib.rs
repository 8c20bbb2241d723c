//! Every I/O of the payout workflow, as Temporal activities.
//!
//! - [`types`]: the activity inputs and outputs (what Temporal's history holds).
//! - [`refusal`]: business refusals with stable names, non-retryable, matched by name.
//! - [`backend`]: the services behind one trait; [`activities::PayoutActivities`] registers them.
//!
//! Architecture invariant: a mutating activity takes a [`types::Grant`] (and so a
//! `FencingToken`) in its input; there is no ambient token anywhere in this crate.

pub mod activities;
pub mod backend;
#[cfg(feature = "test-backend")]
pub mod in_memory;
pub mod refusal;
pub mod services;
pub mod types;

pub use activities::PayoutActivities;
pub use backend::Backend;
pub use refusal::{ActivityFailure, Refusal};
