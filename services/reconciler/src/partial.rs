//! A partial check is counted, not skipped (issue 35, item 4): for every check of a run,
//! - `reconciler_partial_checks_total{check}`: runs in which the check was partial;
//! - `reconciler_check_partial_runs{check}`: how many runs in a row it has been partial (0 after
//!   a run that covered everything, which for a check with a cursor is the run that completes
//!   its round with every lookup answered);
//! - `reconciler_check_round_runs{check}`: how many runs the check's cursor needs to go round
//!   once, as its last partial run said (1 for a check that covers everything in every run).
//!
//! The alert ReconcilerCheckStaysPartial (deploy/monitoring/alerts.yml) fires when the first
//! exceeds the second: the check is not getting round (a cursor that is not kept between runs,
//! lookups failing run after run, more recent work than its bound).
//!
//! The streak is the process's own count: a restarted reconciler starts it at 0, so the alert
//! can come up to one round later than it would have, never falsely.

use prometheus::{IntCounterVec, IntGaugeVec, Opts};
use service_kit::prometheus;
use service_kit::Metrics;

/// The three series above, on the reconciler's registry.
#[derive(Clone)]
pub struct PartialChecks {
    partial: IntCounterVec,
    partial_runs: IntGaugeVec,
    round_runs: IntGaugeVec,
}

impl PartialChecks {
    pub fn new(metrics: &Metrics) -> Self {
        let partial = metrics.counter_vec(
            "reconciler_partial_checks_total",
            "Runs in which the check did not cover everything it covers (see its report's PARTIAL line)",
            &["check"],
        );
        let gauge = |name: &str, help: &str| {
            let g = IntGaugeVec::new(Opts::new(name, help), &["check"]).expect("valid metric");
            metrics
                .registry
                .register(Box::new(g.clone()))
                .expect("metric registered once");
            g
        };
        Self {
            partial,
            partial_runs: gauge(
                "reconciler_check_partial_runs",
                "Runs in a row in which the check was partial (0 after one that covered everything)",
            ),
            round_runs: gauge(
                "reconciler_check_round_runs",
                "Runs the check's cursor needs to go round once, as its last partial run said",
            ),
        }
    }

    /// One run's checks.
    pub fn record(&self, checks: &[reconciler::Check]) {
        for c in checks {
            let streak = self.partial_runs.with_label_values(&[c.name]);
            match &c.partial {
                Some(p) => {
                    self.partial.with_label_values(&[c.name]).inc();
                    streak.inc();
                    self.round_runs
                        .with_label_values(&[c.name])
                        .set(i64::try_from(p.runs_per_round).unwrap_or(i64::MAX));
                }
                None => {
                    self.partial.with_label_values(&[c.name]);
                    streak.set(0);
                    self.round_runs.with_label_values(&[c.name]).set(1);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::PartialChecks;
    use reconciler::{Check, Partial};
    use service_kit::Metrics;

    fn rail_check(partial: bool) -> Check {
        Check {
            name: "rail_movements_match_the_books",
            invariant: "INV-02",
            examined: 2,
            violations: Vec::new(),
            skipped: None,
            note: None,
            partial: partial.then(|| Partial {
                covered: 2,
                total: 5,
                runs_per_round: 3,
                why: "mid-round".into(),
            }),
        }
    }

    fn series(metrics: &Metrics, name: &str) -> String {
        let prefix = format!("{name}{{check=\"rail_movements_match_the_books\"}} ");
        metrics
            .render()
            .lines()
            .find_map(|l| l.strip_prefix(&prefix).map(str::to_string))
            .unwrap_or_else(|| panic!("no {prefix}in {}", metrics.render()))
    }

    /// Partial runs are counted; the streak is reset by a run that covered everything and
    /// exceeds the round's runs only when the check stays partial past its round (the alert's
    /// condition, ReconcilerCheckStaysPartial).
    #[test]
    fn partial_runs_are_counted_and_their_streak_set_against_the_round() {
        let metrics = Metrics::default();
        let partial = PartialChecks::new(&metrics);
        for p in [true, true, false] {
            partial.record(&[rail_check(p)]);
        }
        assert_eq!(series(&metrics, "reconciler_check_partial_runs"), "0");
        assert_eq!(series(&metrics, "reconciler_partial_checks_total"), "2");
        for _ in 0..4 {
            partial.record(&[rail_check(true)]);
        }
        assert_eq!(series(&metrics, "reconciler_check_partial_runs"), "4");
        assert_eq!(series(&metrics, "reconciler_check_round_runs"), "3");
        assert_eq!(series(&metrics, "reconciler_partial_checks_total"), "6");
    }
}
