//! The outbox's backlog as gauges, for the alerts `OutboxBacklogOld` and
//! `OutboxQuarantineNotEmpty` (deploy/monitoring/alerts.yml): the dispatcher owns the outbox, so
//! it measures it, with one bounded statement over the undelivered rows only (the partial index
//! `ledger_outbox_undelivered_by_account`), every [`BACKLOG_PERIOD_MS`].

use std::time::Duration;

use service_kit::prometheus::{Gauge, IntGauge};
use sqlx::PgPool;

/// How often the backlog is measured. The alerts' thresholds are minutes; five seconds keeps the
/// gauges fresh at a 5 s scrape for the price of one index scan of the undelivered rows.
pub const BACKLOG_PERIOD_MS: u64 = 5_000;

/// What the last measurement found.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Backlog {
    /// Undelivered rows waiting for delivery (not quarantined).
    pub pending_rows: i64,
    /// Age of the oldest of them, seconds (0 when there is none).
    pub oldest_pending_age_seconds: f64,
    /// Rows the GL refused, waiting for an operator's replay.
    pub quarantined_rows: i64,
}

#[derive(Clone)]
pub struct BacklogGauges {
    pending_rows: IntGauge,
    oldest_pending_age_seconds: Gauge,
    quarantined_rows: IntGauge,
}

impl BacklogGauges {
    pub fn register(metrics: &service_kit::Metrics) -> Self {
        let gauges = Self {
            pending_rows: IntGauge::new(
                "outbox_pending_rows",
                "Undelivered ledger outbox rows waiting for delivery (quarantined rows not included).",
            )
            .expect("valid metric"),
            oldest_pending_age_seconds: Gauge::new(
                "outbox_oldest_pending_age_seconds",
                "Age of the oldest undelivered, not quarantined ledger outbox row (0 when none): how far the GL is behind paydb.",
            )
            .expect("valid metric"),
            quarantined_rows: IntGauge::new(
                "outbox_quarantined_rows",
                "Ledger outbox rows quarantined (refused by the GL) and not yet replayed.",
            )
            .expect("valid metric"),
        };
        for g in [
            Box::new(gauges.pending_rows.clone())
                as Box<dyn service_kit::prometheus::core::Collector>,
            Box::new(gauges.oldest_pending_age_seconds.clone()),
            Box::new(gauges.quarantined_rows.clone()),
        ] {
            metrics
                .registry
                .register(g)
                .expect("metric registered once");
        }
        gauges
    }

    fn set(&self, backlog: &Backlog) {
        self.pending_rows.set(backlog.pending_rows);
        self.oldest_pending_age_seconds
            .set(backlog.oldest_pending_age_seconds);
        self.quarantined_rows.set(backlog.quarantined_rows);
    }
}

/// Measures the backlog once (on the database's clock) and sets the gauges.
pub async fn measure(pool: &PgPool, gauges: &BacklogGauges) -> Result<Backlog, sqlx::Error> {
    let (pending_rows, quarantined_rows, oldest_pending_age_seconds): (i64, i64, f64) =
        sqlx::query_as(
            "SELECT count(*) FILTER (WHERE quarantined_at IS NULL), \
                    count(*) FILTER (WHERE quarantined_at IS NOT NULL), \
                    coalesce(extract(epoch FROM now() - min(created_at) FILTER (WHERE quarantined_at IS NULL)), 0)::float8 \
             FROM ledger_outbox WHERE delivered_at IS NULL",
        )
        .fetch_one(pool)
        .await?;
    let backlog = Backlog {
        pending_rows,
        oldest_pending_age_seconds,
        quarantined_rows,
    };
    gauges.set(&backlog);
    Ok(backlog)
}

/// Measures every `period` until the task is dropped; a failed measurement keeps the last values
/// and is logged (the scrape's `up` and the database's own alerts cover an outage).
pub async fn watch(pool: PgPool, gauges: BacklogGauges, period: Duration) {
    loop {
        if let Err(e) = measure(&pool, &gauges).await {
            tracing::warn!(error = %e, "could not measure the outbox backlog");
        }
        tokio::time::sleep(period).await;
    }
}
