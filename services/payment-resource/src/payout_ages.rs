//! How long the payouts in flight have been waiting, as gauges, for the alerts
//! `AmbiguousPastResolutionSla`, `PayoutStuckInState` and `PayoutNonTerminalTooLong`
//! (deploy/monitoring/alerts.yml). The payment resource owns the payouts, so it measures them:
//! one statement over the non-terminal payouts (paydb 0011's partial index), every
//! [`PAYOUT_AGES_PERIOD_MS`], on the database's clock. The thresholds live in the rules; the
//! resolution SLA is this service's own (`--resolution-sla-ms`), the one abandon enforces.
//!
//! The alerts name the payout to look at: `payout_oldest_stuck_seconds{state, payout_id}` (the
//! payout longest in its state, and how long) and `payout_oldest_created_seconds{state,
//! payout_id}` (the oldest payout of the state, and its age) carry its id, which the rules'
//! annotations join in for `payoutctl payout show`. Their cardinality is bounded: at most one
//! series per non-terminal state each; when the oldest payout of a state changes (or the state
//! empties) the previous series is removed, so a finished payout's id does not linger.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use payout_domain::PayoutState;
use service_kit::prometheus::{GaugeVec, IntGauge, IntGaugeVec, Opts};
use sqlx::PgPool;

/// How often the payouts are measured: the alerts' thresholds are many minutes.
pub const PAYOUT_AGES_PERIOD_MS: u64 = 10_000;

/// The states a payout waits in (every state but the terminal ones), each exported, 0 if empty.
pub const NON_TERMINAL: [PayoutState; 5] = [
    PayoutState::Pending,
    PayoutState::Claimed,
    PayoutState::RailSubmitted,
    PayoutState::RailAcked,
    PayoutState::RailAmbiguous,
];

#[derive(Clone)]
pub struct PayoutAgeGauges {
    count: IntGaugeVec,
    oldest_age: GaugeVec,
    oldest_in_state: GaugeVec,
    ambiguous_past_sla: IntGauge,
    oldest_stuck: NamedOldest,
    oldest_created: NamedOldest,
}

/// A gauge with one series per state naming its payout (`{state, payout_id}`), and the payout
/// each state's series names now, so the previous one is removed when it changes.
#[derive(Clone)]
struct NamedOldest {
    gauge: GaugeVec,
    named: Arc<Mutex<HashMap<String, String>>>,
}

impl NamedOldest {
    fn new(name: &str, help: &str) -> Self {
        Self {
            gauge: GaugeVec::new(Opts::new(name, help), &["state", "payout_id"])
                .expect("valid metric"),
            named: Arc::default(),
        }
    }

    /// Names `payout` (with `seconds`) for `state`, or nothing when the state is empty; the
    /// series of the payout named before, if another, is removed.
    fn set(&self, state: &str, payout: Option<(&str, f64)>) {
        // A poisoned lock only means a measurement panicked midway: the map is still whole.
        let mut named = self.named.lock().unwrap_or_else(|p| p.into_inner());
        let before = named.get(state).cloned();
        if let Some(old) = before
            .as_deref()
            .filter(|old| payout.is_none_or(|(id, _)| id != *old))
        {
            let _ = self.gauge.remove_label_values(&[state, old]);
            named.remove(state);
        }
        if let Some((id, seconds)) = payout {
            self.gauge.with_label_values(&[state, id]).set(seconds);
            named.insert(state.to_string(), id.to_string());
        }
    }
}

impl PayoutAgeGauges {
    pub fn register(metrics: &service_kit::Metrics) -> Self {
        let gauges = Self {
            count: IntGaugeVec::new(
                Opts::new("payouts_non_terminal", "Payouts in each non-terminal state."),
                &["state"],
            )
            .expect("valid metric"),
            oldest_age: GaugeVec::new(
                Opts::new(
                    "payout_oldest_age_seconds",
                    "Seconds since the oldest payout in the state was created (0 when none).",
                ),
                &["state"],
            )
            .expect("valid metric"),
            oldest_in_state: GaugeVec::new(
                Opts::new(
                    "payout_oldest_in_state_seconds",
                    "Seconds the longest-waiting payout of the state has been in it (0 when none).",
                ),
                &["state"],
            )
            .expect("valid metric"),
            ambiguous_past_sla: IntGauge::new(
                "payouts_ambiguous_past_sla",
                "RAIL_AMBIGUOUS payouts that entered the state longer ago than the resolution SLA (an operator may abandon them).",
            )
            .expect("valid metric"),
            oldest_stuck: NamedOldest::new(
                "payout_oldest_stuck_seconds",
                "The payout longest in the state (its id), and seconds it has been in it; no series when none.",
            ),
            oldest_created: NamedOldest::new(
                "payout_oldest_created_seconds",
                "The oldest payout in the state (its id), and seconds since it was created; no series when none.",
            ),
        };
        for g in [
            Box::new(gauges.count.clone()) as Box<dyn service_kit::prometheus::core::Collector>,
            Box::new(gauges.oldest_age.clone()),
            Box::new(gauges.oldest_in_state.clone()),
            Box::new(gauges.ambiguous_past_sla.clone()),
            Box::new(gauges.oldest_stuck.gauge.clone()),
            Box::new(gauges.oldest_created.gauge.clone()),
        ] {
            metrics
                .registry
                .register(g)
                .expect("metric registered once");
        }
        for state in NON_TERMINAL {
            gauges.count.with_label_values(&[state.as_str()]);
            gauges.oldest_age.with_label_values(&[state.as_str()]);
            gauges.oldest_in_state.with_label_values(&[state.as_str()]);
        }
        gauges
    }
}

/// One state's measurement.
#[derive(Debug, Clone, PartialEq)]
pub struct StateAges {
    pub state: String,
    pub count: i64,
    pub oldest_age_seconds: f64,
    pub oldest_in_state_seconds: f64,
    /// The payout longest in the state (`None` when the state is empty).
    pub oldest_stuck_payout: Option<String>,
    /// The oldest payout of the state by creation.
    pub oldest_created_payout: Option<String>,
}

/// Measures once and sets the gauges; returns (per state, ambiguous past the SLA).
pub async fn measure(
    pool: &PgPool,
    gauges: &PayoutAgeGauges,
    resolution_sla: Duration,
) -> Result<(Vec<StateAges>, i64), sqlx::Error> {
    let states: Vec<&str> = NON_TERMINAL.iter().map(|s| s.as_str()).collect();
    let sla_ms = i64::try_from(resolution_sla.as_millis()).unwrap_or(i64::MAX);
    type Row = (String, i64, f64, f64, i64, String, String);
    let rows: Vec<Row> = sqlx::query_as(
        "SELECT state, count(*), \
                extract(epoch FROM now() - min(created_at))::float8, \
                extract(epoch FROM now() - min(updated_at))::float8, \
                count(*) FILTER (WHERE state = 'RAIL_AMBIGUOUS' \
                                 AND updated_at + $2 * interval '1 millisecond' <= now()), \
                (array_agg(id ORDER BY updated_at, id))[1], \
                (array_agg(id ORDER BY created_at, id))[1] \
         FROM payout WHERE state = ANY($1) GROUP BY state",
    )
    .bind(&states)
    .bind(sla_ms)
    .fetch_all(pool)
    .await?;
    let mut measured = Vec::new();
    let mut past_sla = 0;
    for state in &states {
        let found = rows.iter().find(|r| r.0 == *state);
        let ages = StateAges {
            state: state.to_string(),
            count: found.map_or(0, |r| r.1),
            oldest_age_seconds: found.map_or(0.0, |r| r.2),
            oldest_in_state_seconds: found.map_or(0.0, |r| r.3),
            oldest_stuck_payout: found.map(|r| r.5.clone()),
            oldest_created_payout: found.map(|r| r.6.clone()),
        };
        past_sla += found.map_or(0, |r| r.4);
        gauges.count.with_label_values(&[state]).set(ages.count);
        gauges
            .oldest_age
            .with_label_values(&[state])
            .set(ages.oldest_age_seconds);
        gauges
            .oldest_in_state
            .with_label_values(&[state])
            .set(ages.oldest_in_state_seconds);
        gauges.oldest_stuck.set(
            state,
            ages.oldest_stuck_payout
                .as_deref()
                .map(|id| (id, ages.oldest_in_state_seconds)),
        );
        gauges.oldest_created.set(
            state,
            ages.oldest_created_payout
                .as_deref()
                .map(|id| (id, ages.oldest_age_seconds)),
        );
        measured.push(ages);
    }
    gauges.ambiguous_past_sla.set(past_sla);
    Ok((measured, past_sla))
}

/// Measures every `period` until the task is dropped; a failed measurement keeps the last values
/// and is logged.
pub async fn watch(
    pool: PgPool,
    gauges: PayoutAgeGauges,
    resolution_sla: Duration,
    period: Duration,
) {
    loop {
        if let Err(e) = measure(&pool, &gauges, resolution_sla).await {
            tracing::warn!(error = %e, "could not measure the payouts in flight");
        }
        tokio::time::sleep(period).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rendered(named: &NamedOldest) -> Vec<String> {
        let registry = service_kit::prometheus::Registry::new();
        registry
            .register(Box::new(named.gauge.clone()))
            .expect("registered");
        let mut out = Vec::new();
        for family in registry.gather() {
            for m in family.get_metric() {
                let labels: Vec<String> = m
                    .get_label()
                    .iter()
                    .map(|l| format!("{}={}", l.name(), l.value()))
                    .collect();
                out.push(format!(
                    "{} {}",
                    labels.join(","),
                    m.get_gauge().get_value()
                ));
            }
        }
        out.sort();
        out
    }

    /// One series per state: a new oldest payout replaces the one named before, an emptied
    /// state leaves no series, another state's series is untouched.
    #[test]
    fn the_named_oldest_keeps_one_series_per_state() {
        let named = NamedOldest::new("t_oldest", "test");
        named.set("PENDING", Some(("p-1", 10.0)));
        named.set("CLAIMED", Some(("p-9", 5.0)));
        named.set("PENDING", Some(("p-1", 20.0)));
        assert_eq!(
            rendered(&named),
            [
                "payout_id=p-1,state=PENDING 20",
                "payout_id=p-9,state=CLAIMED 5"
            ]
        );
        named.set("PENDING", Some(("p-2", 3.0)));
        assert_eq!(
            rendered(&named),
            [
                "payout_id=p-2,state=PENDING 3",
                "payout_id=p-9,state=CLAIMED 5"
            ]
        );
        named.set("PENDING", None);
        assert_eq!(rendered(&named), ["payout_id=p-9,state=CLAIMED 5"]);
    }
}
