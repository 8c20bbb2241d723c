//! The worker's own endpoint (`--metrics-listen`): `GET /metrics` (this process's histograms
//! and the Temporal SDK's metrics, in one scrape) and `GET /healthz` (200 only while the worker
//! is connected to Temporal and its pollers run; 503 with the reason otherwise).
//!
//! The SDK's Prometheus exporter serves its own registry on a listener of its own and nothing
//! else (no health, no way to add our series): it is bound to an ephemeral loopback port and
//! `/metrics` here appends its text to ours, so an operator scrapes one address.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use anyhow::Context;
use service_kit::latency::ACTIVITY_BUCKETS_SECONDS;
use service_kit::prometheus::{HistogramVec, IntCounterVec};
use temporalio_client::Client;
use temporalio_common::telemetry::{
    start_prometheus_metric_exporter, PrometheusExporterOptions, TelemetryOptions,
};
use temporalio_sdk::activities::ActivityError;
use temporalio_sdk::interceptors::{
    ActivityInboundInterceptor, ExecuteActivityInput, ExecuteActivityOutput, Next,
};
use temporalio_sdk::runtime::RuntimeOptions;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// How often the worker asks Temporal's frontend whether it serves (`grpc.health.v1`).
pub const TEMPORAL_PROBE_PERIOD_MS: u64 = 1_000;
/// One probe's bound: a frontend that takes longer is as good as gone for a health check.
pub const TEMPORAL_PROBE_TIMEOUT_MS: u64 = 2_000;
/// A probe result older than this (the probe task itself stalled) no longer vouches for the
/// connection: a few periods plus one timeout.
pub const TEMPORAL_ANSWER_STALE_MS: u64 = 3 * TEMPORAL_PROBE_PERIOD_MS + TEMPORAL_PROBE_TIMEOUT_MS;
/// Bound of reading the SDK exporter's text over loopback during a scrape.
const SDK_SCRAPE_TIMEOUT_MS: u64 = 2_000;
/// The SDK exporter's text is a few hundred series; anything far larger is not its answer.
const SDK_SCRAPE_BYTES_MAX: usize = 8 * 1024 * 1024;
/// The frontend's service name in `grpc.health.v1`.
const TEMPORAL_HEALTH_SERVICE: &str = "temporal.api.workflowservice.v1.WorkflowService";

/// The worker's telemetry: its registry, the activity histogram, the SDK exporter's address
/// and the health state. Cheap to clone.
#[derive(Clone)]
pub struct Telemetry {
    metrics: service_kit::Metrics,
    activities: HistogramVec,
    foreign_callers: IntCounterVec,
    sdk_exporter: Arc<OnceLock<SocketAddr>>,
    health: Arc<Health>,
}

impl Default for Telemetry {
    fn default() -> Self {
        Self::new()
    }
}

impl Telemetry {
    pub fn new() -> Self {
        let metrics = service_kit::Metrics::default();
        let activities = metrics.histogram_vec(
            "payout_activity_duration_seconds",
            "Latency of each workflow step (activity) as this worker ran it, by activity type and outcome (ok, fenced_out, foreign_caller, refused, error, cancelled).",
            &["activity", "outcome"],
            ACTIVITY_BUCKETS_SECONDS,
        );
        let foreign_callers = metrics.counter_vec(
            "payout_activity_foreign_callers_total",
            "Activities refused because the workflow that scheduled them is not the payout's own (another workflow type, or another workflow id): someone else drives this worker (alert ForeignWorkflowCalledActivity).",
            &["activity"],
        );
        // Every series exists from the start, so that the alert's increase() sees the first one.
        for activity in payout_activities::ACTIVITY_TYPES {
            foreign_callers.with_label_values(&[activity]);
        }
        Self {
            metrics,
            activities,
            foreign_callers,
            sdk_exporter: Arc::new(OnceLock::new()),
            health: Arc::new(Health::default()),
        }
    }

    /// This process's own registry (the SDK's metrics are not in it; see [`Telemetry::render`]).
    pub fn metrics(&self) -> &service_kit::Metrics {
        &self.metrics
    }

    pub fn health(&self) -> &Health {
        &self.health
    }

    /// The SDK runtime's options: its Prometheus exporter on an ephemeral loopback port, with
    /// durations in seconds and counters ending in `_total` as Prometheus names them. Started
    /// once per process; a second call reuses it.
    pub fn runtime_options(&self) -> anyhow::Result<RuntimeOptions> {
        if self.sdk_exporter.get().is_some() {
            // The SDK's meter belongs to the runtime that was built with it; a later runtime
            // in this process records nothing more to it.
            return Ok(RuntimeOptions::default());
        }
        let exporter = start_prometheus_metric_exporter(
            PrometheusExporterOptions::builder()
                .socket_addr(SocketAddr::from(([127, 0, 0, 1], 0)))
                .counters_total_suffix(true)
                .use_seconds_for_durations(true)
                .build(),
        )
        .context("starting the Temporal SDK's Prometheus exporter")?;
        let _ = self.sdk_exporter.set(exporter.bound_addr);
        let telemetry = TelemetryOptions::builder()
            .metrics(exporter.meter as Arc<dyn temporalio_common::telemetry::metrics::CoreMeter>)
            .build();
        RuntimeOptions::builder()
            .telemetry_options(telemetry)
            .build()
            .map_err(anyhow::Error::msg)
    }

    /// The interceptor that times every activity this worker runs.
    pub fn activity_timing(&self) -> ActivityTiming {
        ActivityTiming {
            histograms: self.activities.clone(),
            foreign_callers: self.foreign_callers.clone(),
        }
    }

    /// `/metrics`: this process's series, then the SDK's. If the SDK's exporter does not answer,
    /// ours are served all the same, with a comment saying what is missing.
    pub async fn render(&self) -> String {
        let mut text = self.metrics.render();
        if let Some(addr) = self.sdk_exporter.get() {
            match scrape(*addr).await {
                Ok(sdk) => text.push_str(&sdk),
                Err(e) => {
                    tracing::warn!(error = %e, "the Temporal SDK's metrics could not be read");
                    text.push_str(&format!("# Temporal SDK metrics unavailable: {e}\n"));
                }
            }
        }
        text
    }

    /// Serves `/metrics` and `/healthz` on `listener` until `shutdown` resolves.
    pub async fn serve(
        self,
        listener: tokio::net::TcpListener,
        shutdown: impl std::future::Future<Output = ()> + Send + 'static,
    ) -> anyhow::Result<()> {
        use axum::http::StatusCode;
        let for_metrics = self.clone();
        let app = axum::Router::new()
            .route(
                "/metrics",
                axum::routing::get(move || {
                    let telemetry = for_metrics.clone();
                    async move { telemetry.render().await }
                }),
            )
            .route(
                "/healthz",
                axum::routing::get(move || {
                    let health = self.health.clone();
                    async move {
                        match health.check() {
                            Ok(detail) => (StatusCode::OK, detail),
                            Err(reason) => (StatusCode::SERVICE_UNAVAILABLE, reason),
                        }
                    }
                }),
            );
        axum::serve(listener, app)
            .with_graceful_shutdown(shutdown)
            .await
            .context("the worker's metrics and health endpoint")
    }
}

/// The SDK exporter's text, over loopback HTTP/1.0 (it closes the connection after answering).
async fn scrape(addr: SocketAddr) -> anyhow::Result<String> {
    let fetch = async {
        let mut stream = tokio::net::TcpStream::connect(addr).await?;
        stream
            .write_all(b"GET /metrics HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n")
            .await?;
        let mut response = Vec::new();
        (&mut stream)
            .take(SDK_SCRAPE_BYTES_MAX as u64)
            .read_to_end(&mut response)
            .await?;
        anyhow::Ok(response)
    };
    let response = tokio::time::timeout(Duration::from_millis(SDK_SCRAPE_TIMEOUT_MS), fetch)
        .await
        .context("no answer within the bound")??;
    let response = String::from_utf8(response).context("not UTF-8")?;
    let (head, body) = response
        .split_once("\r\n\r\n")
        .context("no end of the answer's head")?;
    anyhow::ensure!(
        head.split_whitespace().nth(1) == Some("200"),
        "answered {:?}",
        head.lines().next()
    );
    Ok(body.to_string())
}

/// Times each activity around its whole execution on this worker:
/// `payout_activity_duration_seconds{activity,outcome}`, and counts the ones refused for their
/// caller: `payout_activity_foreign_callers_total{activity}`.
pub struct ActivityTiming {
    histograms: HistogramVec,
    foreign_callers: IntCounterVec,
}

/// The outcome label of an activity refused by the caller check (`Refusal::ForeignCaller`).
const FOREIGN_CALLER: &str = "foreign_caller";

/// The outcome label of an activity's result. Refusals carry their stable name as the failure
/// type (`payout_activities::Refusal::name`); `Transient` is a retryable fault.
fn activity_outcome<T>(result: &Result<T, ActivityError>) -> &'static str {
    match result {
        Ok(_) => "ok",
        Err(ActivityError::Application(failure)) => match failure.type_name() {
            Some("FencedOut") => "fenced_out",
            Some("ForeignCaller") => FOREIGN_CALLER,
            Some("Transient") | None => "error",
            Some(_) => "refused",
        },
        Err(ActivityError::Cancelled { .. }) => "cancelled",
        Err(_) => "error",
    }
}

impl ActivityInboundInterceptor for ActivityTiming {
    fn execute_activity<'a>(
        &'a self,
        input: ExecuteActivityInput,
        next: Next<'a, ExecuteActivityInput, ExecuteActivityOutput<'a>>,
    ) -> ExecuteActivityOutput<'a> {
        // The activity types are the few this worker registers: the label stays bounded.
        let activity = input.activity_info().activity_type.clone();
        let started = Instant::now();
        Box::pin(async move {
            let result = next.run(input).await;
            let outcome = activity_outcome(&result);
            self.histograms
                .with_label_values(&[activity.as_str(), outcome])
                .observe(started.elapsed().as_secs_f64());
            if outcome == FOREIGN_CALLER {
                self.foreign_callers
                    .with_label_values(&[activity.as_str()])
                    .inc();
            }
            result
        })
    }
}

/// What `/healthz` answers from.
#[derive(Default)]
pub struct Health {
    state: Mutex<HealthState>,
}

#[derive(Default)]
struct HealthState {
    phase: Phase,
    pollers_expected: usize,
    pollers_running: usize,
    /// The last probe of Temporal's frontend: when it ended and what it found.
    temporal: Option<(Instant, Result<(), String>)>,
}

#[derive(Default, Clone, Copy, PartialEq, Eq, Debug)]
enum Phase {
    /// Before the worker's services (lock server, guards) have answered.
    #[default]
    WaitingForServices,
    Polling,
    Stopping,
}

impl Health {
    fn with<T>(&self, f: impl FnOnce(&mut HealthState) -> T) -> T {
        f(&mut self.state.lock().unwrap_or_else(|p| p.into_inner()))
    }

    /// `count` pollers (one per task queue) are about to run.
    pub fn polling(&self, count: usize) {
        self.with(|s| {
            s.phase = Phase::Polling;
            s.pollers_expected = count;
            s.pollers_running = count;
        });
    }

    /// A poller's run ended (shutdown, or a fatal error).
    pub fn poller_stopped(&self) {
        self.with(|s| s.pollers_running = s.pollers_running.saturating_sub(1));
    }

    /// Shutdown was requested: the worker is draining and takes no new work.
    pub fn stopping(&self) {
        self.with(|s| s.phase = Phase::Stopping);
    }

    fn temporal_probed(&self, result: Result<(), String>) {
        self.with(|s| s.temporal = Some((Instant::now(), result)));
    }

    /// `Ok(detail)` when the worker polls and Temporal answers, else `Err(reason)`.
    pub fn check(&self) -> Result<String, String> {
        self.with(|s| {
            match s.phase {
                Phase::WaitingForServices => {
                    return Err("waiting for the worker's services (lock server, payment resource, rail proxy) to answer; not polling yet\n".into())
                }
                Phase::Stopping => return Err("shutting down: finishing in-flight tasks, not polling\n".into()),
                Phase::Polling => {}
            }
            if s.pollers_running < s.pollers_expected {
                return Err(format!(
                    "{} of {} pollers stopped\n",
                    s.pollers_expected - s.pollers_running,
                    s.pollers_expected
                ));
            }
            match &s.temporal {
                None => Err("Temporal not probed yet\n".into()),
                Some((_, Err(e))) => Err(format!("Temporal unreachable: {e}\n")),
                Some((at, Ok(()))) if at.elapsed() > Duration::from_millis(TEMPORAL_ANSWER_STALE_MS) => {
                    Err(format!(
                        "Temporal's last answer is {} ms old\n",
                        at.elapsed().as_millis()
                    ))
                }
                Some((at, Ok(()))) => Ok(format!(
                    "ok: {} pollers running, Temporal answered {} ms ago\n",
                    s.pollers_running,
                    at.elapsed().as_millis()
                )),
            }
        })
    }
}

/// Asks Temporal's frontend (`grpc.health.v1`, over the worker's own connection) whether it
/// serves, every [`TEMPORAL_PROBE_PERIOD_MS`], until aborted.
pub async fn watch_temporal(client: Client, health: Arc<Health>) {
    use temporalio_client::grpc::HealthService;
    use temporalio_common::protos::grpc::health::v1::{
        health_check_response::ServingStatus, HealthCheckRequest,
    };
    loop {
        let mut probe = client.clone();
        let answer = tokio::time::timeout(
            Duration::from_millis(TEMPORAL_PROBE_TIMEOUT_MS),
            probe.check(tonic::Request::new(HealthCheckRequest {
                service: TEMPORAL_HEALTH_SERVICE.to_string(),
            })),
        )
        .await;
        let result = match answer {
            Err(_) => Err(format!("no answer within {TEMPORAL_PROBE_TIMEOUT_MS} ms")),
            Ok(Err(status)) => Err(format!("{}: {}", status.code(), status.message())),
            Ok(Ok(response)) => {
                let status = response.into_inner().status;
                if status == ServingStatus::Serving as i32 {
                    Ok(())
                } else {
                    Err(format!(
                        "the frontend answers {:?}",
                        ServingStatus::try_from(status)
                    ))
                }
            }
        };
        health.temporal_probed(result);
        tokio::time::sleep(Duration::from_millis(TEMPORAL_PROBE_PERIOD_MS)).await;
    }
}

impl Telemetry {
    /// The health state, shared with [`watch_temporal`].
    pub fn health_handle(&self) -> Arc<Health> {
        self.health.clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use temporalio_common::error::ApplicationFailure;

    #[test]
    fn activity_results_map_to_their_outcomes() {
        let ok: Result<(), ActivityError> = Ok(());
        assert_eq!(activity_outcome(&ok), "ok");
        let named = |name: &str| -> Result<(), ActivityError> {
            Err(ActivityError::application(
                ApplicationFailure::builder("x".to_string())
                    .type_name(name.to_string())
                    .build(),
            ))
        };
        assert_eq!(activity_outcome(&named("FencedOut")), "fenced_out");
        assert_eq!(activity_outcome(&named("ForeignCaller")), "foreign_caller");
        assert_eq!(activity_outcome(&named("RefusedTransition")), "refused");
        assert_eq!(activity_outcome(&named("Transient")), "error");
        assert_eq!(
            activity_outcome::<()>(&Err(ActivityError::cancelled())),
            "cancelled"
        );
    }

    #[test]
    fn health_says_why_it_is_not_ok() {
        let health = Health::default();
        assert!(health
            .check()
            .unwrap_err()
            .contains("waiting for the worker's services"));
        health.polling(2);
        assert!(health.check().unwrap_err().contains("not probed"));
        health.temporal_probed(Ok(()));
        assert!(health.check().unwrap().starts_with("ok: 2 pollers"));
        health.temporal_probed(Err("Unavailable: connection refused".into()));
        assert!(health.check().unwrap_err().contains("Temporal unreachable"));
        health.temporal_probed(Ok(()));
        health.poller_stopped();
        assert!(health
            .check()
            .unwrap_err()
            .contains("1 of 2 pollers stopped"));
        health.stopping();
        assert!(health.check().unwrap_err().contains("shutting down"));
    }
}
