//! Support code of the system tests. [`chaos`] is the fault-injection harness (issue 8): a
//! workload, a seeded nemesis, an independent checker and the negative controls; `payoutdev chaos`
//! and `tests/chaos.rs` both drive it. [`stall`] is the test-only stall points the fault tests'
//! worker (`payout-test-worker`) puts in front of its backend. [`workload`] is the one builder of
//! a batch of payouts, for the main job, the benchmarks, the fault suite and the tests. [`rogue`]
//! is the attack suite's rogue Temporal client (issue 33): a worker of its own whose workflows
//! schedule the genuine activities. [`metrics`] reads a process's `/metrics`.

pub mod chaos;
pub mod metrics;
pub mod rogue;
pub mod stall;
pub mod workload;
