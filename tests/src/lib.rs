//! Support code of the system tests. [`chaos`] is the fault-injection harness (issue 8): a
//! workload, a seeded nemesis, an independent checker and the negative controls; `payoutctl chaos`
//! and `tests/chaos.rs` both drive it.

pub mod chaos;
