//! The reconciler process (binary `reconciler`): it runs the detective checks (the `reconciler`
//! crate) on demand (`reconciler once`) or on a Temporal schedule (`reconciler serve`, a worker
//! on its own task queue, with `/metrics`), and, only when asked (`--resume-stranded`,
//! `--resolve-orphans`), the corrective `resolver` before them, so the checks see what it did.
//! Without those flags it takes no grant and writes through no guard.
//!
//! A run's outcome is a [`RunReport`]: the checks' report and what the resolver did.

mod partial;
mod report;
pub mod service;
pub mod silences;

pub use report::RunReport;
