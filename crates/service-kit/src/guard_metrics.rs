//! The refusal counters both guards export, under one name per signal with a `guard` label
//! (`payment_resource` | `rail_proxy`), so one alert rule (deploy/monitoring/alerts.yml) covers
//! both enforcement points: `fenced_out_total`, `forged_grants_total`,
//! `grants_for_another_key_total` and `database_restored_refusals_total`, each by `operation`.
//!
//! Every label set a guard can produce is registered at 0 when the guard starts
//! ([`GuardCounters::register`]), so the first refusal is an increase from 0 that Prometheus sees,
//! not the birth of a series at 1 (the alert rules also catch a series born at 1, and promtool
//! tests both).

use prometheus::IntCounterVec;

/// Which guard a metric is about: the value of its `guard` label.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Guard {
    /// The first guard: the account fence in paydb.
    PaymentResource,
    /// The second guard: the per-account high-water and the unique submission in proxydb.
    RailProxy,
}

impl Guard {
    /// The `guard` label value.
    pub const fn label(self) -> &'static str {
        match self {
            Guard::PaymentResource => "payment_resource",
            Guard::RailProxy => "rail_proxy",
        }
    }
}

/// The reasons a grant is refused as forged (`grant_signing::Forged::reason`), registered at 0.
pub const FORGED_REASONS: [&str; 3] = ["unsigned", "unknown_key_id", "bad_signature"];

/// The four refusal counters of one guard, with its label filled in.
#[derive(Clone)]
pub struct GuardCounters {
    guard: Guard,
    fenced_out: IntCounterVec,
    forged_grants: IntCounterVec,
    grants_for_another_key: IntCounterVec,
    database_restored: IntCounterVec,
}

impl GuardCounters {
    /// Registers the counters on `metrics` and sets every (`operation`, reason) series of this
    /// guard to 0. `operations` are the guard's fenced operations (the `operation` label).
    pub fn register(metrics: &crate::Metrics, guard: Guard, operations: &[&str]) -> Self {
        let counters = Self {
            guard,
            fenced_out: metrics.counter_vec(
                "fenced_out_total",
                "Fenced calls refused because the token is below the guard's stored fence / high-water (INV-05: a stale holder's write). Alert on any.",
                &["guard", "operation"],
            ),
            forged_grants: metrics.counter_vec(
                "forged_grants_total",
                "Fenced calls refused because the lock service did not sign their grant, by reason (unsigned, unknown_key_id, bad_signature). Alert on any.",
                &["guard", "operation", "reason"],
            ),
            grants_for_another_key: metrics.counter_vec(
                "grants_for_another_key_total",
                "Fenced calls refused because their genuine grant is of another lock key than the payout's account's. Alert on any.",
                &["guard", "operation"],
            ),
            database_restored: metrics.counter_vec(
                "database_restored_refusals_total",
                "Fenced calls refused because the guard's database is a copy restored from a backup and not re-armed, or the token is below the re-arming's horizon. Alert on any.",
                &["guard", "operation"],
            ),
        };
        let label = guard.label();
        for operation in operations {
            counters.fenced_out.with_label_values(&[label, operation]);
            counters
                .grants_for_another_key
                .with_label_values(&[label, operation]);
            counters
                .database_restored
                .with_label_values(&[label, operation]);
            for reason in FORGED_REASONS {
                counters
                    .forged_grants
                    .with_label_values(&[label, operation, reason]);
            }
        }
        counters
    }

    pub fn guard(&self) -> Guard {
        self.guard
    }

    /// A stale token refused.
    pub fn fenced_out(&self, operation: &str) {
        self.fenced_out
            .with_label_values(&[self.guard.label(), operation])
            .inc();
    }

    /// A grant the lock service did not sign, by `grant_signing::Forged::reason`.
    pub fn forged_grant(&self, operation: &str, reason: &str) {
        self.forged_grants
            .with_label_values(&[self.guard.label(), operation, reason])
            .inc();
    }

    /// A genuine grant of another lock key.
    pub fn grant_for_another_key(&self, operation: &str) {
        self.grants_for_another_key
            .with_label_values(&[self.guard.label(), operation])
            .inc();
    }

    /// A fenced call refused on a restored, not re-armed database.
    pub fn database_restored(&self, operation: &str) {
        self.database_restored
            .with_label_values(&[self.guard.label(), operation])
            .inc();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_series_is_born_at_zero_and_counts_under_its_guard() {
        let m = crate::Metrics::default();
        let c = GuardCounters::register(&m, Guard::RailProxy, &["submit", "inquire"]);
        let text = m.render();
        for line in [
            "fenced_out_total{guard=\"rail_proxy\",operation=\"submit\"} 0",
            "fenced_out_total{guard=\"rail_proxy\",operation=\"inquire\"} 0",
            "forged_grants_total{guard=\"rail_proxy\",operation=\"inquire\",reason=\"bad_signature\"} 0",
            "grants_for_another_key_total{guard=\"rail_proxy\",operation=\"submit\"} 0",
            "database_restored_refusals_total{guard=\"rail_proxy\",operation=\"inquire\"} 0",
        ] {
            assert!(text.contains(line), "missing {line} in\n{text}");
        }
        c.fenced_out("submit");
        assert!(m
            .render()
            .contains("fenced_out_total{guard=\"rail_proxy\",operation=\"submit\"} 1"));
    }
}
