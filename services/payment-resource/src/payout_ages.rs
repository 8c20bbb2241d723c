//! How long the payouts in flight have been waiting, as gauges, for the alerts
//! `AmbiguousPastResolutionSla`, `PayoutStuckInState` and `PayoutNonTerminalTooLong`
//! (deploy/monitoring/alerts.yml). The payment resource owns the payouts, so it measures them:
//! one statement over the non-terminal payouts (paydb 0011's partial index), every
//! [`PAYOUT_AGES_PERIOD_MS`], on the database's clock. The thresholds live in the rules; the
//! resolution SLA is this service's own (`--resolution-sla-ms`), the one abandon enforces.

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
        };
        for g in [
            Box::new(gauges.count.clone()) as Box<dyn service_kit::prometheus::core::Collector>,
            Box::new(gauges.oldest_age.clone()),
            Box::new(gauges.oldest_in_state.clone()),
            Box::new(gauges.ambiguous_past_sla.clone()),
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
}

/// Measures once and sets the gauges; returns (per state, ambiguous past the SLA).
pub async fn measure(
    pool: &PgPool,
    gauges: &PayoutAgeGauges,
    resolution_sla: Duration,
) -> Result<(Vec<StateAges>, i64), sqlx::Error> {
    let states: Vec<&str> = NON_TERMINAL.iter().map(|s| s.as_str()).collect();
    let sla_ms = i64::try_from(resolution_sla.as_millis()).unwrap_or(i64::MAX);
    let rows: Vec<(String, i64, f64, f64, i64)> = sqlx::query_as(
        "SELECT state, count(*), \
                extract(epoch FROM now() - min(created_at))::float8, \
                extract(epoch FROM now() - min(updated_at))::float8, \
                count(*) FILTER (WHERE state = 'RAIL_AMBIGUOUS' \
                                 AND updated_at + $2 * interval '1 millisecond' <= now()) \
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
