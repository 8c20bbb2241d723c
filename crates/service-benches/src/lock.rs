//! `payoutdev bench lock`: acquire+release through the lock service (etcd backend, in this
//! process, over gRPC on loopback) side by side with the same two operations done directly as etcd
//! transactions, in the same run against the same etcd. Each worker uses its own key and session,
//! so the figures are the service's overhead, not contention.

use std::time::{Duration, Instant};

use etcd_client::{Compare, CompareOp, PutOptions, Txn, TxnOp};
use payout_proto::lock as pb;
use serde::Serialize;

use lock_server::{BackendConfig, Config, InProcess, LockError};

/// Workers' sessions outlive any plausible run; they are closed at the end anyway.
pub const BENCH_SESSION_TTL_MS: u64 = 30_000;
/// Concurrency is bounded: more workers than this only measure the scheduler of a small machine.
pub const CONCURRENCY_MAX: usize = 64;
/// Each worker's first operations (connection set-up, lease caches, HTTP/2 windows) are run but
/// not measured, on both paths alike.
pub const WARMUP_ITERATIONS: usize = 5;
/// Iterations are bounded so a typo cannot run for hours.
pub const ITERATIONS_MAX: usize = 1_000_000;

#[derive(Debug, Clone, Serialize)]
pub struct LatencyStats {
    pub operations: usize,
    pub p50_us: u64,
    pub p99_us: u64,
    pub ops_per_s: f64,
}

#[derive(Debug, Clone, Serialize)]
pub struct BenchReport {
    pub iterations: usize,
    pub concurrency: usize,
    /// One acquire + one release through the lock service.
    pub service: LatencyStats,
    /// One put-if-absent transaction with a lease + one compare-and-delete transaction on etcd.
    pub raw_etcd: LatencyStats,
    /// service.p99_us / raw_etcd.p99_us (target: at most 2).
    pub p99_ratio: f64,
}

fn bench_err(e: impl std::fmt::Display) -> LockError {
    LockError::Backend {
        backend: "bench",
        detail: e.to_string(),
    }
}

fn stats(mut samples_us: Vec<u64>, elapsed: Duration) -> LatencyStats {
    samples_us.sort_unstable();
    let at = |q: f64| -> u64 {
        if samples_us.is_empty() {
            return 0;
        }
        let index = ((samples_us.len() as f64 * q).ceil() as usize).clamp(1, samples_us.len()) - 1;
        samples_us[index]
    };
    LatencyStats {
        operations: samples_us.len(),
        p50_us: at(0.50),
        p99_us: at(0.99),
        ops_per_s: samples_us.len() as f64 / elapsed.as_secs_f64().max(f64::EPSILON),
    }
}

/// One grant through the service: acquire without waiting (the key is the caller's own), release.
pub(crate) async fn acquire_and_release(
    client: &mut pb::lock_service_client::LockServiceClient<tonic::transport::Channel>,
    key: &str,
    owner: &str,
    session_id: &str,
) -> Result<(), tonic::Status> {
    let acquired = client
        .acquire(pb::AcquireRequest {
            key: key.to_string(),
            owner: owner.to_string(),
            session_id: session_id.to_string(),
            wait_ms: 0,
        })
        .await?
        .into_inner();
    let Some(pb::acquire_response::Result::Grant(grant)) = acquired.result else {
        return Err(tonic::Status::aborted("benchmark key unexpectedly held"));
    };
    client
        .release(pb::ReleaseRequest {
            handle: Some(pb::Handle {
                key: grant.key,
                owner: grant.owner,
                session_id: grant.session_id,
                token: grant.token,
            }),
        })
        .await?;
    Ok(())
}

/// Both paths under `prefix` (the lock service's under `{prefix}svc/`, the raw client's under
/// `{prefix}raw/`), with `etcd_tls`: an identity that may read and write `prefix` (etcd's
/// lock-server role on it).
pub async fn run(
    etcd_endpoints: &[String],
    etcd_tls: &mtls::Tls,
    prefix: &str,
    iterations: usize,
    concurrency: usize,
) -> Result<BenchReport, LockError> {
    let iterations = iterations.clamp(1, ITERATIONS_MAX);
    let concurrency = concurrency.clamp(1, CONCURRENCY_MAX).min(iterations);
    let per_worker = iterations.div_ceil(concurrency);
    let dir = tempfile::tempdir().map_err(bench_err)?;
    let config = Config {
        backend: BackendConfig::Etcd {
            endpoints: etcd_endpoints.to_vec(),
            tls: etcd_tls.clone(),
            prefix: format!("{prefix}svc/"),
            grant_retention_ms: lock_server::backend::etcd::GRANT_RETENTION_MS_DEFAULT,
        },
        issued_tokens_path: dir.path().join("issued-tokens.json"),
        issued_tokens_limits: Default::default(),
        // One certificate drives a thousand grants a second: past any per-caller bound a
        // deployment enforces, so the bench lifts them (the server's own bounds remain).
        caller_limits: lock_server::callers::CallerLimits::NONE,
        // Every grant is signed, as in deployment: the figures include the signing.
        signer: std::sync::Arc::new(
            grant_signing::Signer::generate("bench-1")
                .map_err(bench_err)?
                .0,
        ),
    };
    use crate::pki::{tls, Role};
    // The real table and mutual TLS, as deployed: a worker's certificate.
    let server = InProcess::start(&config, &tls(Role::LockServer)).await?;

    // Through the service.
    let client = pb::lock_service_client::LockServiceClient::new(
        tls(Role::Worker)
            .connect(&server.endpoint, Role::LockServer)
            .await
            .map_err(bench_err)?,
    );
    let started = Instant::now();
    let mut workers = Vec::new();
    for w in 0..concurrency {
        let mut client = client.clone();
        workers.push(tokio::spawn(async move {
            let owner = format!("bench-{w}");
            let session = client
                .create_session(pb::CreateSessionRequest {
                    owner: owner.clone(),
                    ttl_ms: BENCH_SESSION_TTL_MS,
                })
                .await?
                .into_inner();
            let key = format!("payout:bench-{w}");
            let mut samples = Vec::with_capacity(per_worker);
            for i in 0..per_worker + WARMUP_ITERATIONS {
                let t0 = Instant::now();
                acquire_and_release(&mut client, &key, &owner, &session.session_id).await?;
                if i >= WARMUP_ITERATIONS {
                    samples.push(t0.elapsed().as_micros() as u64);
                }
            }
            client
                .close_session(pb::CloseSessionRequest {
                    session_id: session.session_id,
                })
                .await?;
            Ok::<_, tonic::Status>(samples)
        }));
    }
    let mut service_samples = Vec::new();
    for w in workers {
        service_samples.extend(w.await.map_err(bench_err)?.map_err(bench_err)?);
    }
    let service = stats(service_samples, started.elapsed());
    server.stop().await;

    // Directly on etcd.
    let etcd = etcd_client::Client::connect(
        etcd_endpoints,
        Some(etcd_client::ConnectOptions::new().with_tls(etcd_tls.etcd_client_config())),
    )
    .await
    .map_err(bench_err)?;
    let started = Instant::now();
    let mut workers = Vec::new();
    for w in 0..concurrency {
        let mut etcd = etcd.clone();
        let key = format!("{prefix}raw/bench-key-{w}");
        workers.push(tokio::spawn(async move {
            let lease = etcd
                .lease_grant((BENCH_SESSION_TTL_MS / 1000) as i64, None)
                .await?
                .id();
            let mut samples = Vec::with_capacity(per_worker);
            for i in 0..per_worker + WARMUP_ITERATIONS {
                let t0 = Instant::now();
                let put = Txn::new()
                    .when([Compare::create_revision(key.clone(), CompareOp::Equal, 0)])
                    .and_then([TxnOp::put(
                        key.clone(),
                        "raw",
                        Some(PutOptions::new().with_lease(lease)),
                    )]);
                let resp = etcd.txn(put).await?;
                let token = resp.header().map(|h| h.revision()).unwrap_or_default();
                let delete = Txn::new()
                    .when([Compare::create_revision(
                        key.clone(),
                        CompareOp::Equal,
                        token,
                    )])
                    .and_then([TxnOp::delete(key.clone(), None)]);
                etcd.txn(delete).await?;
                if i >= WARMUP_ITERATIONS {
                    samples.push(t0.elapsed().as_micros() as u64);
                }
            }
            etcd.lease_revoke(lease).await?;
            Ok::<_, etcd_client::Error>(samples)
        }));
    }
    let mut raw_samples = Vec::new();
    for w in workers {
        raw_samples.extend(w.await.map_err(bench_err)?.map_err(bench_err)?);
    }
    let raw_etcd = stats(raw_samples, started.elapsed());
    let p99_ratio = service.p99_us as f64 / raw_etcd.p99_us.max(1) as f64;
    Ok(BenchReport {
        iterations: per_worker * concurrency,
        concurrency,
        service,
        raw_etcd,
        p99_ratio,
    })
}
