//! Latency histograms (`*_duration_seconds`) with their label sets registered up front: a call
//! on the hot path takes a pre-resolved [`Histogram`] handle and observes one number. Nothing is
//! allocated or hashed per call (a `with_label_values` lookup would do both), so the proxy's
//! benchmarked Submit pays two clock reads and one atomic add for its timing.

use std::time::Instant;

use prometheus::{Histogram, HistogramOpts, HistogramVec};

use crate::{Guard, Metrics};

/// A guard call is one short PostgreSQL transaction: a few milliseconds on a healthy database.
/// Fine buckets from 1 ms resolve its p50 and p99; the top bound is the servers' request
/// deadline (`grpc::BOUNDS.request_timeout_ms`, 30 s), past which a call cannot last.
pub const GUARD_CALL_BUCKETS_SECONDS: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
];

/// A rail call is a third-party HTTP call: tens to hundreds of milliseconds when healthy,
/// seconds when slow. The top bound is the longest timeout a payment call may be configured
/// with (the proxy's `RAIL_CALL_TIMEOUT_MS_MAX`, 60 s).
pub const RAIL_CALL_BUCKETS_SECONDS: &[f64] = &[
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
];

/// A workflow step (activity) spans a guard call (milliseconds), the rail submission (up to
/// the rail timeout) and a queued lock acquisition (up to its start-to-close, minutes while
/// another payout of the account holds the key). The top bound is five minutes.
pub const ACTIVITY_BUCKETS_SECONDS: &[f64] = &[
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0,
];

/// A payout from creation to its final state: about a second on the happy path, the
/// settlement window and the resolution SLA (hours) when the rail's answer was ambiguous, a
/// day for one that waited for an operator.
pub const PAYOUT_BUCKETS_SECONDS: &[f64] = &[
    0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0, 900.0, 3_600.0, 14_400.0, 86_400.0,
];

/// How a guard call ended: a small closed set, so the label never grows with the traffic.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CallOutcome {
    /// Answered with what was asked.
    Ok,
    /// A stale token refused by the fence or the high-water.
    FencedOut,
    /// Another typed refusal: a refused transition, a duplicate submission, a forged grant, a
    /// restored database, a busy account, not found...
    Refused,
    /// The request itself was malformed (INVALID_ARGUMENT): a caller's bug.
    Invalid,
    /// The guard's own failure: its database unavailable, a broken invariant.
    Error,
    /// The caller went away (its future was dropped) before the call ended.
    Cancelled,
}

impl CallOutcome {
    pub const ALL: [CallOutcome; 6] = [
        CallOutcome::Ok,
        CallOutcome::FencedOut,
        CallOutcome::Refused,
        CallOutcome::Invalid,
        CallOutcome::Error,
        CallOutcome::Cancelled,
    ];

    pub fn label(self) -> &'static str {
        match self {
            CallOutcome::Ok => "ok",
            CallOutcome::FencedOut => "fenced_out",
            CallOutcome::Refused => "refused",
            CallOutcome::Invalid => "invalid",
            CallOutcome::Error => "error",
            CallOutcome::Cancelled => "cancelled",
        }
    }

    fn index(self) -> usize {
        self as usize
    }
}

/// `guard_call_duration_seconds{guard,operation,outcome}`: every call a guard serves, one
/// name at both guards. The operations are the guard's RPCs, registered with every outcome at
/// construction, so that a dashboard sees a zero rather than nothing before the first call.
#[derive(Clone)]
pub struct GuardCalls {
    operations: &'static [&'static str],
    /// `operations.len() * CallOutcome::ALL.len()` handles, operation-major.
    cells: std::sync::Arc<[Histogram]>,
}

/// The metric name of [`GuardCalls`].
pub const GUARD_CALL_DURATION: &str = "guard_call_duration_seconds";

impl GuardCalls {
    /// Registers the histogram for `guard` and `operations` on `metrics`' registry, once per
    /// registry (a second call on the same registry, a server rebuilt in a test, shares the
    /// first one's histogram).
    pub fn new(metrics: &Metrics, guard: Guard, operations: &'static [&'static str]) -> Self {
        let guard = guard.label();
        let vec = metrics.histogram_vec(
            GUARD_CALL_DURATION,
            "Latency of every call a guard serves, by guard, operation (the RPC) and outcome (ok, fenced_out, refused, invalid, error, cancelled).",
            &["guard", "operation", "outcome"],
            GUARD_CALL_BUCKETS_SECONDS,
        );
        let cells = operations
            .iter()
            .flat_map(|operation| {
                let vec = vec.clone();
                CallOutcome::ALL
                    .iter()
                    .map(move |outcome| vec.with_label_values(&[guard, operation, outcome.label()]))
            })
            .collect();
        Self { operations, cells }
    }

    /// Starts timing one call of `operation` (one of the names given at construction; any
    /// other is a programmer error, caught by the guard's tests, and is not recorded).
    pub fn start(&self, operation: &'static str) -> CallTimer<'_> {
        let position = self.operations.iter().position(|o| *o == operation);
        debug_assert!(
            position.is_some(),
            "operation {operation} was not registered"
        );
        let outcomes = CallOutcome::ALL.len();
        CallTimer {
            cells: position.map(|i| &self.cells[i * outcomes..(i + 1) * outcomes]),
            started: Instant::now(),
            finished: false,
        }
    }
}

/// One call being timed. [`CallTimer::finish`] records it under its outcome; dropped
/// unfinished (the caller disconnected and the handler's future was dropped), it records
/// `cancelled`.
pub struct CallTimer<'a> {
    cells: Option<&'a [Histogram]>,
    started: Instant,
    finished: bool,
}

impl CallTimer<'_> {
    pub fn finish(mut self, outcome: CallOutcome) {
        self.record(outcome);
    }

    fn record(&mut self, outcome: CallOutcome) {
        self.finished = true;
        if let Some(cells) = self.cells {
            cells[outcome.index()].observe(self.started.elapsed().as_secs_f64());
        }
    }
}

impl Drop for CallTimer<'_> {
    fn drop(&mut self) {
        if !self.finished {
            self.record(CallOutcome::Cancelled);
        }
    }
}

/// A histogram over a fixed grid of (operation, outcome) labels, each resolved once: the rail
/// call's `rail_call_duration_seconds{operation,outcome}`, where each operation has its own
/// outcomes (a payment is acked, rejected or ambiguous; a lookup found, absent or unknown).
#[derive(Clone)]
pub struct LabelGrid {
    rows: &'static [(&'static str, &'static [&'static str])],
    cells: std::sync::Arc<[Histogram]>,
}

impl LabelGrid {
    /// Registers `name` with labels `operation` and `outcome` over `rows` (each operation with
    /// its outcomes).
    pub fn new(
        metrics: &Metrics,
        name: &str,
        help: &str,
        buckets: &[f64],
        rows: &'static [(&'static str, &'static [&'static str])],
    ) -> Self {
        let vec = metrics.histogram_vec(name, help, &["operation", "outcome"], buckets);
        let cells = rows
            .iter()
            .flat_map(|(operation, outcomes)| {
                let vec = vec.clone();
                outcomes
                    .iter()
                    .map(move |outcome| vec.with_label_values(&[operation, outcome]))
            })
            .collect();
        Self { rows, cells }
    }

    /// Records `seconds` under (`operation`, `outcome`); a pair not in the grid is a programmer
    /// error and is not recorded.
    pub fn observe(&self, operation: &str, outcome: &str, seconds: f64) {
        let mut offset = 0;
        for (op, outcomes) in self.rows {
            if *op == operation {
                let found = outcomes.iter().position(|o| *o == outcome);
                debug_assert!(
                    found.is_some(),
                    "outcome {outcome} of {operation} not registered"
                );
                if let Some(i) = found {
                    self.cells[offset + i].observe(seconds);
                }
                return;
            }
            offset += outcomes.len();
        }
        debug_assert!(false, "operation {operation} not registered");
    }
}

impl Metrics {
    /// A histogram vector registered once per registry under `name`: a second call returns the
    /// first one's handle, so a server rebuilt on one registry (a restart in a test) keeps
    /// counting in the same series.
    pub fn histogram_vec(
        &self,
        name: &str,
        help: &str,
        labels: &[&str],
        buckets: &[f64],
    ) -> HistogramVec {
        let mut known = self
            .histograms
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        if let Some(vec) = known.get(name) {
            return vec.clone();
        }
        let vec = HistogramVec::new(
            HistogramOpts::new(name, help).buckets(buckets.to_vec()),
            labels,
        )
        .expect("valid histogram definition");
        self.registry
            .register(Box::new(vec.clone()))
            .expect("metric registered once");
        known.insert(name.to_string(), vec.clone());
        vec
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn guard_calls_record_each_outcome_under_its_labels() {
        let metrics = Metrics::default();
        let calls = GuardCalls::new(&metrics, Guard::RailProxy, &["submit", "lookup"]);
        calls.start("submit").finish(CallOutcome::Ok);
        calls.start("submit").finish(CallOutcome::FencedOut);
        drop(calls.start("lookup"));
        let text = metrics.render();
        for series in [
            r#"guard_call_duration_seconds_count{guard="rail_proxy",operation="submit",outcome="ok"} 1"#,
            r#"guard_call_duration_seconds_count{guard="rail_proxy",operation="submit",outcome="fenced_out"} 1"#,
            r#"guard_call_duration_seconds_count{guard="rail_proxy",operation="lookup",outcome="cancelled"} 1"#,
            // Registered up front: present at zero before any call.
            r#"guard_call_duration_seconds_count{guard="rail_proxy",operation="lookup",outcome="ok"} 0"#,
        ] {
            assert!(text.contains(series), "{series} missing from\n{text}");
        }
        // A second registration on the same registry shares the histogram.
        let again = GuardCalls::new(&metrics, Guard::RailProxy, &["submit", "lookup"]);
        again.start("submit").finish(CallOutcome::Ok);
        assert!(metrics.render().contains(
            r#"guard_call_duration_seconds_count{guard="rail_proxy",operation="submit",outcome="ok"} 2"#
        ));
    }

    #[test]
    fn label_grid_records_its_pairs() {
        let metrics = Metrics::default();
        let grid = LabelGrid::new(
            &metrics,
            "rail_call_duration_seconds",
            "rail calls",
            RAIL_CALL_BUCKETS_SECONDS,
            &[("pay", &["acked", "rejected"]), ("lookup", &["found"])],
        );
        grid.observe("pay", "rejected", 0.2);
        grid.observe("lookup", "found", 0.01);
        let text = metrics.render();
        assert!(text
            .contains(r#"rail_call_duration_seconds_count{operation="pay",outcome="rejected"} 1"#));
        assert!(text.contains(
            r#"rail_call_duration_seconds_bucket{operation="pay",outcome="rejected",le="0.25"} 1"#
        ));
        assert!(text.contains(
            r#"rail_call_duration_seconds_bucket{operation="pay",outcome="rejected",le="0.1"} 0"#
        ));
        assert!(text
            .contains(r#"rail_call_duration_seconds_count{operation="lookup",outcome="found"} 1"#));
    }

    #[test]
    fn bucket_bounds_increase() {
        for buckets in [
            GUARD_CALL_BUCKETS_SECONDS,
            RAIL_CALL_BUCKETS_SECONDS,
            ACTIVITY_BUCKETS_SECONDS,
            PAYOUT_BUCKETS_SECONDS,
        ] {
            assert!(buckets.windows(2).all(|w| w[0] < w[1]));
        }
    }
}
