//! The services' benchmarks, out of the service libraries: developer tooling, never shipped.
//!
//! Each benchmark measures our path and the plain path it wraps in the same run, starting the
//! service it measures in this process (on a loopback port, against the database or etcd it is
//! given), and returns a serialisable report; `payoutdev bench lock | proxy | ledger | etcd-soak`
//! prints them.
//!
//! - [`lock`]: acquire + release through the lock service beside the same etcd transactions done
//!   directly.
//! - [`soak`]: many grants through the lock service on a real etcd, with etcd's database size and
//!   revision as the run goes (grant-record retention and compaction keep it bounded).
//! - [`proxy`]: rail proxy `Submit` beside its floor (the same two commits by plain SQL around the
//!   same stub call) and the zero-latency rail stub called directly.
//! - [`ledger`]: `AppendJournal` through the general ledger's gRPC server beside the same rows
//!   inserted by plain SQL transactions.
//! - [`hosted`]: the lock service, the payment resource and the rail proxy in this process, as
//!   deployed or with their security switched off, for `payoutdev bench e2e`'s security pair.
//!
//! The services use only their public APIs here; nothing in a service crate depends on this one.

pub mod hosted;
pub mod ledger;
pub mod lock;
mod pki;
pub mod proxy;
pub mod soak;
