//! The guard's cost per payout: proxy Submit throughput and latency against a zero-latency stub,
//! and the same number of payments sent to the stub directly, in the same run.

use std::sync::Arc;
use std::time::{Duration, Instant};

use payout_domain::{
    AccountId, AmountMinor, BeneficiaryRef, ClientReference, Currency, FencingToken, PayoutId,
};
use serde::Serialize;

use crate::client::RailProxyClient;
use crate::model::{Outcome, SubmitPayout};
use crate::{ProxyConfig, RunningProxy};

/// Bounds of one run: enough for stable percentiles, small enough for a 2-core machine.
pub const ITERATIONS_MAX: usize = 100_000;
pub const CONCURRENCY_MAX: usize = 256;

#[derive(Debug, Clone, Serialize)]
pub struct Figures {
    pub calls: usize,
    pub elapsed_ms: f64,
    pub throughput_per_s: f64,
    pub p50_ms: f64,
    pub p99_ms: f64,
    pub max_ms: f64,
}

#[derive(Debug, Clone, Serialize)]
pub struct BenchReport {
    pub iterations: usize,
    pub concurrency: usize,
    /// Submits through the proxy (guard transaction + rail call + outcome), each on a fresh account.
    pub proxy: Figures,
    /// The same number of payments sent straight to the stub.
    pub direct: Figures,
    /// direct throughput / proxy throughput: how many times slower the guarded path is.
    pub throughput_ratio: f64,
    /// proxy p50 - direct p50: the guard's added latency per payout.
    pub p50_overhead_ms: f64,
    /// Movements at the stub after the run; must be exactly 2 × iterations (one per call).
    pub stub_movements: usize,
}

#[derive(Debug, thiserror::Error)]
pub enum BenchError {
    #[error("iterations must be 1..={ITERATIONS_MAX} and concurrency 1..={CONCURRENCY_MAX}")]
    OutOfBounds,
    #[error("starting the stub: {0}")]
    Stub(#[from] rail_stub::StubError),
    #[error("starting the proxy: {0}")]
    Proxy(#[from] crate::ProxyServerError),
    #[error("proxydb: {0}")]
    Db(#[from] sqlx::Error),
    #[error("connecting to the proxy: {0}")]
    Connect(#[from] tonic::transport::Error),
    #[error("a call failed: {0}")]
    Call(String),
}

fn figures(mut latencies: Vec<Duration>, elapsed: Duration) -> Figures {
    latencies.sort();
    let ms = |d: Duration| d.as_secs_f64() * 1000.0;
    let at = |q: f64| {
        ms(latencies[((latencies.len() as f64 * q).ceil() as usize).clamp(1, latencies.len()) - 1])
    };
    Figures {
        calls: latencies.len(),
        elapsed_ms: ms(elapsed),
        throughput_per_s: latencies.len() as f64 / elapsed.as_secs_f64(),
        p50_ms: at(0.50),
        p99_ms: at(0.99),
        max_ms: ms(*latencies.last().expect("at least one call")),
    }
}

/// Runs `iterations` calls in `concurrency` parallel lanes, returning each call's latency.
async fn drive<F, Fut>(
    iterations: usize,
    concurrency: usize,
    call: F,
) -> Result<(Vec<Duration>, Duration), BenchError>
where
    F: Fn(usize) -> Fut + Send + Sync + 'static,
    Fut: std::future::Future<Output = Result<(), BenchError>> + Send,
{
    let call = Arc::new(call);
    let next = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let started = Instant::now();
    let mut lanes = Vec::new();
    for _ in 0..concurrency {
        let (call, next) = (call.clone(), next.clone());
        lanes.push(tokio::spawn(async move {
            let mut latencies = Vec::new();
            loop {
                let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                if i >= iterations {
                    return Ok::<_, BenchError>(latencies);
                }
                let t = Instant::now();
                call(i).await?;
                latencies.push(t.elapsed());
            }
        }));
    }
    let mut all = Vec::with_capacity(iterations);
    for lane in lanes {
        all.extend(lane.await.map_err(|e| BenchError::Call(e.to_string()))??);
    }
    Ok((all, started.elapsed()))
}

/// Starts a zero-latency, memory-only stub and a proxy on `proxy_db_url` in this process, and
/// measures both paths. Payout ids carry a per-run prefix, so runs can share a database.
pub async fn run(
    proxy_db_url: &str,
    iterations: usize,
    concurrency: usize,
) -> Result<BenchReport, BenchError> {
    if !(1..=ITERATIONS_MAX).contains(&iterations) || !(1..=CONCURRENCY_MAX).contains(&concurrency)
    {
        return Err(BenchError::OutOfBounds);
    }
    let stub = rail_stub::RunningStub::start(rail_stub::StubConfig::default()).await?;
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(service_kit::pool::CONNECTIONS_MAX)
        .acquire_timeout(Duration::from_millis(service_kit::pool::ACQUIRE_TIMEOUT_MS))
        .connect(proxy_db_url)
        .await?;
    let proxy = RunningProxy::start(pool, ProxyConfig::new(stub.base_url())).await?;
    let client = RailProxyClient::connect(proxy.endpoint()).await?;
    let run_id = uuid::Uuid::new_v4().simple().to_string()[..12].to_string();
    let eur = Currency::parse("EUR").expect("EUR is supported");

    let proxy_run_id = run_id.clone();
    let (proxy_latencies, proxy_elapsed) = drive(iterations, concurrency, move |i| {
        let mut client = client.clone();
        let request = SubmitPayout::new(
            PayoutId::parse(format!("bench-{proxy_run_id}-{i}")).expect("valid id"),
            AccountId::parse(format!("bench-acct-{proxy_run_id}-{i}")).expect("valid id"),
            FencingToken::new(1).expect("positive"),
            "bench",
            AmountMinor::new(100).expect("positive"),
            eur.clone(),
            BeneficiaryRef::parse("bench-beneficiary").expect("valid id"),
        );
        async move {
            match client.submit(&request).await {
                Ok(s) if matches!(s.outcome, Outcome::Acked { .. }) => Ok(()),
                Ok(s) => Err(BenchError::Call(format!(
                    "unexpected outcome {:?}",
                    s.outcome
                ))),
                Err(e) => Err(BenchError::Call(e.to_string())),
            }
        }
    })
    .await?;

    let stub_client = stub.client();
    let (direct_latencies, direct_elapsed) = drive(iterations, concurrency, move |i| {
        let stub_client = stub_client.clone();
        let order = rail_stub::PaymentOrder {
            client_reference: ClientReference::for_payout(
                &PayoutId::parse(format!("direct-{run_id}-{i}")).expect("valid id"),
            )
            .to_string(),
            amount_minor: 100,
            currency: "EUR".into(),
            beneficiary_ref: "bench-beneficiary".into(),
        };
        async move {
            match stub_client.pay(&order).await {
                Ok(rail_stub::client::DirectAnswer::Accepted { .. }) => Ok(()),
                other => Err(BenchError::Call(format!("direct call: {other:?}"))),
            }
        }
    })
    .await?;

    let stub_movements = stub
        .client()
        .ground_truth()
        .await
        .map_err(|e| BenchError::Call(e.to_string()))?
        .movements
        .len();
    proxy.stop().await?;
    stub.stop().await?;
    let proxy = figures(proxy_latencies, proxy_elapsed);
    let direct = figures(direct_latencies, direct_elapsed);
    Ok(BenchReport {
        iterations,
        concurrency,
        throughput_ratio: direct.throughput_per_s / proxy.throughput_per_s,
        p50_overhead_ms: proxy.p50_ms - direct.p50_ms,
        proxy,
        direct,
        stub_movements,
    })
}
