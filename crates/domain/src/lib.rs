//! Domain types shared by every process of the payout system.
//!
//! Everything here is parsed once at a boundary and is valid by construction afterwards: an
//! `AccountId` is never empty, an `AmountMinor` of a payout is never zero or negative, and a
//! `FencingToken` is within `1..=i64::MAX` and can only be made from a lock grant's revision or
//! from a value a guard stored.

pub mod ids;
pub mod money;
pub mod state;
pub mod token;

pub use ids::{AccountId, BeneficiaryRef, ClientReference, IdError, PayoutId};
pub use money::{AmountMinor, Currency, MoneyError, SUPPORTED_CURRENCIES};
pub use state::{Actor, PayoutEvent, PayoutState, RefusedTransition, TRANSITIONS};
pub use token::{FencingToken, TokenError};

/// The lock key of an account: the unit of mutual exclusion (spec A-15).
pub fn lock_key(account: &AccountId) -> String {
    format!("payout:{}", account.as_str())
}

/// The payout workflow's registered type name: the only workflow whose activities the worker
/// serves, and the type the resume pass expects on `payout-{payout_id}`.
pub const PAYOUT_WORKFLOW_TYPE: &str = "PayoutWorkflow";

/// The Temporal workflow id of a payout. Fixed by the brief: one workflow id per payout.
pub fn workflow_id(payout: &PayoutId) -> String {
    format!("payout-{}", payout.as_str())
}
