//! The compose deployment's health probe, [`probe`]: the checks `payout-probe` runs inside the
//! containers. The suite that drives the deployment is tests/compose.rs (through testcontainers,
//! tests/support), a test only: nothing of it ships in the image.

pub mod probe;
