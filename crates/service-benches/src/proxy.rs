//! The guard's cost per payout, in one run against one zero-latency stub: proxy Submit (gRPC, the
//! guard transaction, the rail call, the outcome); its floor, the same two durable commits done by
//! plain SQL on the same PostgreSQL server around the same direct stub call (what any guard that
//! records intent before the call and outcome after must pay); and the stub called directly, with
//! no commit at all.
//!
//! The floor calls the stub as the proxy must call a rail, on a connection of its own per payment
//! (the proxy's HTTP stack keeps no idle connection, so it can never resend a payment that failed
//! on a stale one: `rail_proxy::rail::Rail`); a second floor, `floor_pooled`, reuses pooled
//! connections, which the proxy may not, and is printed beside it so that the difference is seen.
//!
//! Every proxy Submit presents a signed grant, as a worker's does: the bench signs with a key
//! generated in-process for the run (the proxy is given its public half), and signs before the
//! clock starts, so the proxy's figures include its signature check and nothing the lock
//! service, not the caller, pays for. It calls over mutual TLS with a worker's certificate,
//! through the real authorisation table, as deployed. A fourth path sends the same Submits to a
//! second proxy with that security switched off (plaintext, no table, no signature check: test-only
//! switches), so the run prints what the security costs beside the floor.

use crate::pki::{tls, Role};
use std::sync::Arc;
use std::time::{Duration, Instant};

use payout_domain::{
    AccountId, AmountMinor, BeneficiaryRef, ClientReference, Currency, FencingToken, PayoutId,
};
use serde::Serialize;

use grant_signing::Signer;
use rail_proxy::{ProxyConfig, RunningProxy, Verifier};
use rail_proxy_client::{Outcome, RailProxyClient, SubmitPayout};

/// Bounds of one run: enough for stable percentiles, small enough for a 2-core machine.
pub const ITERATIONS_MAX: usize = 100_000;
pub const CONCURRENCY_MAX: usize = 256;
/// The proxy's throughput should be at least this share of its plain-SQL floor's.
pub const PROXY_OVER_FLOOR_TARGET: f64 = 0.7;

/// The floor's own tables, shaped like the proxy's (a high-water per account, one submission row
/// per payout with its outcome), without its audit, triggers or classification.
const FLOOR_SCHEMA: &str = "CREATE TABLE IF NOT EXISTS bench_floor_high_water (
        account_id text PRIMARY KEY, high_water bigint NOT NULL, owner text NOT NULL);
    CREATE TABLE IF NOT EXISTS bench_floor_submission (
        payout_id text PRIMARY KEY, account_id text NOT NULL, fence_token bigint NOT NULL,
        owner text NOT NULL, client_reference text NOT NULL, amount_minor bigint NOT NULL,
        currency text NOT NULL, beneficiary_ref text NOT NULL, outcome text, rail_ref text,
        created_at timestamptz NOT NULL DEFAULT now())";

/// One payment on the floor path: intent and high-water in one commit, the stub, the outcome in
/// a second commit.
async fn floor_payment(
    pool: &sqlx::PgPool,
    stub: &rail_stub::client::StubClient,
    payout: &str,
    account: &str,
    order: &rail_stub::PaymentOrder,
) -> Result<(), BenchError> {
    let mut tx = pool.begin().await?;
    let advanced: Option<i64> = sqlx::query_scalar(
        "INSERT INTO bench_floor_high_water (account_id, high_water, owner) VALUES ($1, 1, 'bench') \
         ON CONFLICT (account_id) DO UPDATE SET high_water = EXCLUDED.high_water \
           WHERE bench_floor_high_water.high_water <= EXCLUDED.high_water \
         RETURNING high_water",
    )
    .bind(account)
    .fetch_optional(&mut *tx)
    .await?;
    if advanced.is_none() {
        return Err(BenchError::Call(format!("floor: {account} fenced")));
    }
    sqlx::query(
        "INSERT INTO bench_floor_submission (payout_id, account_id, fence_token, owner, \
         client_reference, amount_minor, currency, beneficiary_ref) \
         VALUES ($1, $2, 1, 'bench', $3, $4, $5, $6)",
    )
    .bind(payout)
    .bind(account)
    .bind(&order.client_reference)
    .bind(order.amount_minor)
    .bind(&order.currency)
    .bind(&order.beneficiary_ref)
    .execute(&mut *tx)
    .await?;
    tx.commit().await?;
    let rail_ref = match stub.pay(order).await {
        Ok(rail_stub::client::DirectAnswer::Accepted { rail_ref }) => rail_ref,
        other => return Err(BenchError::Call(format!("floor call: {other:?}"))),
    };
    sqlx::query(
        "UPDATE bench_floor_submission SET outcome = 'ACKED', rail_ref = $2 \
         WHERE payout_id = $1 AND outcome IS NULL",
    )
    .bind(payout)
    .bind(rail_ref)
    .execute(pool)
    .await?;
    Ok(())
}

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
    /// The floor: per payment, one transaction that advances a high-water and inserts the intent,
    /// the direct stub call, one transaction that writes the outcome; plain SQL, no gRPC.
    pub floor: Figures,
    /// proxy throughput / floor throughput (the goal: at least [`PROXY_OVER_FLOOR_TARGET`]).
    pub proxy_over_floor: f64,
    /// The floor with its stub calls on pooled, reused connections: less rail work than the proxy
    /// is allowed to do (one TCP connection per payment).
    pub floor_pooled: Figures,
    /// proxy throughput / pooled floor throughput.
    pub proxy_over_floor_pooled: f64,
    /// The same Submits through a second proxy with its security switched off (the test-only
    /// switches, which this bench, never shipped, may use): no TLS, no authorisation table, no
    /// grant signature check. What the security the system cannot run without costs the guard.
    pub proxy_insecure: Figures,
    /// proxy throughput / insecure proxy throughput (issue 17: at least 0.95).
    pub secured_over_insecure: f64,
    /// The same number of payments sent straight to the stub.
    pub direct: Figures,
    /// direct throughput / proxy throughput: how many times slower the guarded path is.
    pub throughput_ratio: f64,
    /// proxy p50 - direct p50: the guard's added latency per payout.
    pub p50_overhead_ms: f64,
    /// Movements at the stub after the run; must be exactly 5 × (iterations + the warm-up calls):
    /// one per call.
    pub stub_movements: usize,
}

#[derive(Debug, thiserror::Error)]
pub enum BenchError {
    #[error("iterations must be 1..={ITERATIONS_MAX} and concurrency 1..={CONCURRENCY_MAX}")]
    OutOfBounds,
    #[error("starting the stub: {0}")]
    Stub(#[from] rail_stub::StubError),
    #[error("starting the proxy: {0}")]
    Proxy(#[from] rail_proxy::ProxyServerError),
    #[error("proxydb: {0}")]
    Db(#[from] sqlx::Error),
    #[error("connecting to the proxy: {0}")]
    Connect(#[from] mtls::ConnectError),
    #[error("a call failed: {0}")]
    Call(String),
    #[error("the bench's grant key: {0}")]
    GrantKey(#[from] grant_signing::KeyError),
    #[error("the rail link: {0}")]
    RailLink(#[from] rail_proxy::RailLinkError),
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
    // Untimed first: calls [0, warm-up) open the path's connections (the pools' TLS and SCRAM
    // logins, the gRPC channel) and prepare its statements, so that no path pays for another's
    // warm-up by running first.
    let warm_up = warm_up_calls(concurrency);
    let lanes = |from: usize, to: usize| {
        let next = Arc::new(std::sync::atomic::AtomicUsize::new(from));
        (0..concurrency)
            .map(|_| {
                let (call, next) = (call.clone(), next.clone());
                tokio::spawn(async move {
                    let mut latencies = Vec::new();
                    loop {
                        let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        if i >= to {
                            return Ok::<_, BenchError>(latencies);
                        }
                        let t = Instant::now();
                        call(i).await?;
                        latencies.push(t.elapsed());
                    }
                })
            })
            .collect::<Vec<_>>()
    };
    for lane in lanes(0, warm_up) {
        lane.await.map_err(|e| BenchError::Call(e.to_string()))??;
    }
    let started = Instant::now();
    let mut all = Vec::with_capacity(iterations);
    for lane in lanes(warm_up, warm_up + iterations) {
        all.extend(lane.await.map_err(|e| BenchError::Call(e.to_string()))??);
    }
    Ok((all, started.elapsed()))
}

/// Untimed calls each path makes before it is timed: two per lane.
pub fn warm_up_calls(concurrency: usize) -> usize {
    2 * concurrency
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
    sqlx::raw_sql(FLOOR_SCHEMA).execute(&pool).await?;
    let floor_pool = pool.clone();
    let (signer, _) = Signer::generate("bench")?;
    let verifier = Verifier::new([signer.public_key()])?;
    let (instruction_signer, _) = Signer::generate("bench-instruction")?;
    let (fact_signer, _) = Signer::generate("bench-rail-fact")?;
    let keys = rail_proxy::GuardKeys {
        grants: verifier,
        instructions: Verifier::new([instruction_signer.public_key()])?,
        fact_signer: std::sync::Arc::new(fact_signer),
    };
    let rail = rail_proxy::RailLink::new(
        stub.base_url(),
        stub.answer_verifier(),
        &stub.identity("rail-proxy"),
    )?;
    let insecure = RunningProxy::start(
        pool.clone(),
        ProxyConfig::new(rail.clone(), keys.clone(), tls(Role::RailProxy))
            .disable_grant_verification_for_negative_control()
            .plaintext_for_benches(),
    )
    .await?;
    // The real table and mutual TLS, as deployed: a worker's certificate submits.
    let proxy = RunningProxy::start(
        pool,
        ProxyConfig::new(rail.clone(), keys, tls(Role::RailProxy)),
    )
    .await?;
    let client = RailProxyClient::connect(&proxy.endpoint(), &tls(Role::Worker)).await?;
    let insecure_client = RailProxyClient::from_channel(
        tonic::transport::Endpoint::from_shared(format!("http://{}", insecure.addr))
            .map_err(|e| BenchError::Call(e.to_string()))?
            .connect()
            .await
            .map_err(|e| BenchError::Call(e.to_string()))?,
    );
    let run_id = uuid::Uuid::new_v4().simple().to_string()[..12].to_string();
    let eur = Currency::parse("EUR").expect("EUR is supported");

    // Each payout on a fresh account, under that account's grant (token 1), signed up front
    // (the insecure path gets the same signed requests, for other payouts).
    let requests = |path: &str| -> Arc<Vec<SubmitPayout>> {
        Arc::new(
            (0..iterations + warm_up_calls(concurrency))
                .map(|i| {
                    let request = SubmitPayout::new(
                        PayoutId::parse(format!("bench-{path}{run_id}-{i}")).expect("valid id"),
                        AccountId::parse(format!("bench-acct-{path}{run_id}-{i}"))
                            .expect("valid id"),
                        FencingToken::new(1).expect("positive"),
                        "bench",
                        AmountMinor::new(100).expect("positive"),
                        eur.clone(),
                        BeneficiaryRef::parse("bench-beneficiary").expect("valid id"),
                    );
                    let key = request.lock_key();
                    let signature = signer.sign(&key, request.token.get(), &request.owner);
                    // Instructed up front too (the payment resource's part, not the proxy's).
                    request
                        .signed(key, signature)
                        .instructed_now(&instruction_signer)
                })
                .collect(),
        )
    };
    let (proxy_latencies, proxy_elapsed) =
        submit_all(iterations, concurrency, client, requests("")).await?;
    let (insecure_latencies, insecure_elapsed) =
        submit_all(iterations, concurrency, insecure_client, requests("u")).await?;

    let floor = |stub: rail_stub::client::StubClient, tag: &'static str| {
        let (pool, run_id) = (floor_pool.clone(), run_id.clone());
        drive(iterations, concurrency, move |i| {
            let (pool, stub) = (pool.clone(), stub.clone());
            let payout = format!("floor{tag}-{run_id}-{i}");
            let account = format!("floor{tag}-acct-{run_id}-{i}");
            let order = rail_stub::PaymentOrder {
                client_reference: ClientReference::for_payout(
                    &PayoutId::parse(payout.clone()).expect("valid id"),
                )
                .to_string(),
                amount_minor: 100,
                currency: "EUR".into(),
                beneficiary_ref: "bench-beneficiary".into(),
            };
            async move { floor_payment(&pool, &stub, &payout, &account, &order).await }
        })
    };
    let (floor_latencies, floor_elapsed) = floor(
        rail_stub::client::StubClient::with_http(
            stub.endpoints(),
            rail_proxy::rail::http_client(&rail),
        ),
        "",
    )
    .await?;
    let (pooled_latencies, pooled_elapsed) = floor(stub.client(), "p").await?;

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
    insecure.stop().await?;
    stub.stop().await?;
    let proxy = figures(proxy_latencies, proxy_elapsed);
    let proxy_insecure = figures(insecure_latencies, insecure_elapsed);
    let floor = figures(floor_latencies, floor_elapsed);
    let floor_pooled = figures(pooled_latencies, pooled_elapsed);
    let direct = figures(direct_latencies, direct_elapsed);
    Ok(BenchReport {
        iterations,
        concurrency,
        throughput_ratio: direct.throughput_per_s / proxy.throughput_per_s,
        p50_overhead_ms: proxy.p50_ms - direct.p50_ms,
        proxy_over_floor: proxy.throughput_per_s / floor.throughput_per_s,
        proxy_over_floor_pooled: proxy.throughput_per_s / floor_pooled.throughput_per_s,
        secured_over_insecure: proxy.throughput_per_s / proxy_insecure.throughput_per_s,
        proxy_insecure,
        floor,
        floor_pooled,
        proxy,
        direct,
        stub_movements,
    })
}

/// Every request of `requests` through one proxy, `concurrency` at a time: each must be ACKED.
async fn submit_all(
    iterations: usize,
    concurrency: usize,
    client: RailProxyClient,
    requests: Arc<Vec<SubmitPayout>>,
) -> Result<(Vec<Duration>, Duration), BenchError> {
    drive(iterations, concurrency, move |i| {
        let mut client = client.clone();
        let requests = requests.clone();
        async move {
            let request = &requests[i];
            match client.submit(request).await {
                Ok(s) if matches!(s.outcome, Outcome::Acked { .. }) => Ok(()),
                Ok(s) => Err(BenchError::Call(format!(
                    "unexpected outcome {:?}",
                    s.outcome
                ))),
                Err(e) => Err(BenchError::Call(e.to_string())),
            }
        }
    })
    .await
}
