//! `payoutdev bench etcd-soak`: mints many grants (acquire + release through the lock service, in
//! this process, over gRPC on loopback) against a real etcd and reports etcd's database size and
//! revision before, at each quarter of the run, and after. What it shows: with compaction and
//! grant-record retention the database stops growing once the retention window is full, while
//! the revision (every token) keeps rising. This crate's tests (`tests/benches.rs`) run a
//! short version with and without compaction.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use etcd_client::GetOptions;
use payout_proto::lock as pb;
use serde::Serialize;

use crate::lock::acquire_and_release;
pub use crate::lock::CONCURRENCY_MAX;
use lock_server::{BackendConfig, Config, InProcess, LockError};

/// Grants are bounded so a typo cannot fill a disk.
pub const GRANTS_MAX: usize = 10_000_000;
/// Each worker's session outlives a few seconds of a stalled machine; it is kept alive below.
pub const SESSION_TTL_MS: u64 = 30_000;
/// A worker renews its session after this long, a third of the TTL: two renewals may be lost.
pub const KEEP_ALIVE_EVERY_MS: u64 = SESSION_TTL_MS / 3;
/// The size is sampled at each quarter of the run (25k, 50k and 75k of 100k grants).
pub const CHECKPOINTS: usize = 4;
/// The bench's record window: at a release build's rate it holds tens of thousands of records, and
/// it fills within the first tenth of a 100,000-grant run, so the rest of the run shows the level
/// the database keeps. A deployment keeps a week (`GRANT_RETENTION_MS_DEFAULT`).
pub const SOAK_GRANT_RETENTION_MS_DEFAULT: u64 = 10_000;
/// How often the sampler looks at the progress counter: fine enough that a checkpoint is taken
/// within a few grants of its mark.
pub const SAMPLE_PERIOD_MS: u64 = 10;

/// etcd's own view of its database, as `etcdctl endpoint status -w json` prints it.
#[derive(Debug, Clone, Serialize)]
pub struct EtcdStatus {
    /// `dbSize`: the backend file's used extent (freed pages are reused, never returned without a
    /// defragmentation). The quota applies to this.
    pub db_size_bytes: i64,
    /// `dbSizeInUse`: the part holding live data and retained history.
    pub db_size_in_use_bytes: i64,
    /// The cluster revision (the last token or write).
    pub revision: i64,
    /// Grant records under the soak's prefix still in etcd.
    pub grant_records: i64,
    /// Leases etcd holds (sessions and retention leases).
    pub leases: usize,
}

#[derive(Debug, Clone, Serialize)]
pub struct Checkpoint {
    /// Grants completed when the status was read.
    pub grants: usize,
    pub elapsed_ms: u64,
    pub status: EtcdStatus,
}

#[derive(Debug, Clone, Serialize)]
pub struct SoakReport {
    pub grants: usize,
    pub concurrency: usize,
    pub grant_retention_ms: u64,
    pub before: EtcdStatus,
    /// At each quarter of the run, then at the end.
    pub checkpoints: Vec<Checkpoint>,
    pub after: EtcdStatus,
    pub elapsed_ms: u64,
    pub grants_per_s: f64,
}

impl SoakReport {
    /// Growth of `dbSize` over the run.
    pub fn db_size_growth_bytes(&self) -> i64 {
        self.after.db_size_bytes - self.before.db_size_bytes
    }
}

fn soak_err(e: impl std::fmt::Display) -> LockError {
    LockError::Backend {
        backend: "soak",
        detail: e.to_string(),
    }
}

/// Reads etcd's status from every endpoint and keeps the largest figures (members of one cluster
/// hold the same data; their files may differ by a compaction in flight).
pub async fn etcd_status(
    endpoints: &[String],
    tls: &mtls::Tls,
    prefix: &str,
) -> Result<EtcdStatus, LockError> {
    let mut status = EtcdStatus {
        db_size_bytes: 0,
        db_size_in_use_bytes: 0,
        revision: 0,
        grant_records: 0,
        leases: 0,
    };
    for endpoint in endpoints {
        let mut c = etcd_client::Client::connect(
            [endpoint],
            Some(etcd_client::ConnectOptions::new().with_tls(tls.etcd_client_config())),
        )
        .await
        .map_err(soak_err)?;
        let s = c.status().await.map_err(soak_err)?;
        status.db_size_bytes = status.db_size_bytes.max(s.db_size());
        status.db_size_in_use_bytes = status.db_size_in_use_bytes.max(s.raft_used_db_size());
        let records = c
            .get(
                format!("{prefix}grants/"),
                Some(GetOptions::new().with_prefix().with_count_only()),
            )
            .await
            .map_err(soak_err)?;
        status.grant_records = status.grant_records.max(records.count());
        status.revision = status
            .revision
            .max(records.header().map(|h| h.revision()).unwrap_or_default());
        status.leases = status
            .leases
            .max(c.leases().await.map_err(soak_err)?.leases().len());
    }
    Ok(status)
}

/// Mints `grants` grants with `concurrency` workers (each its own session and key: the figures
/// are etcd's, not contention's), grant records kept `grant_retention_ms`.
pub async fn run(
    etcd_endpoints: &[String],
    etcd_tls: &mtls::Tls,
    grants: usize,
    concurrency: usize,
    grant_retention_ms: u64,
) -> Result<SoakReport, LockError> {
    let grants = grants.clamp(1, GRANTS_MAX);
    let concurrency = concurrency.clamp(1, CONCURRENCY_MAX).min(grants);
    let prefix = format!("/soak/{}/", uuid::Uuid::new_v4());
    let dir = tempfile::tempdir().map_err(soak_err)?;
    let config = Config {
        backend: BackendConfig::Etcd {
            endpoints: etcd_endpoints.to_vec(),
            tls: etcd_tls.clone(),
            prefix: prefix.clone(),
            grant_retention_ms,
        },
        issued_tokens_path: dir.path().join("issued-tokens.json"),
        issued_tokens_limits: Default::default(),
        // One certificate drives a thousand grants a second: past any per-caller bound a
        // deployment enforces, so the bench lifts them (the server's own bounds remain).
        caller_limits: lock_server::callers::CallerLimits::NONE,
        // Every grant is signed, as in deployment: the figures include the signing.
        signer: std::sync::Arc::new(
            grant_signing::Signer::generate("bench-1")
                .map_err(soak_err)?
                .0,
        ),
    };
    use crate::pki::{tls, Role};
    let server = InProcess::start(&config, &tls(Role::LockServer)).await?;
    let client = pb::lock_service_client::LockServiceClient::new(
        tls(Role::Worker)
            .connect(&server.endpoint, Role::LockServer)
            .await
            .map_err(soak_err)?,
    );

    let before = etcd_status(etcd_endpoints, etcd_tls, &prefix).await?;
    let started = Instant::now();
    let next = Arc::new(AtomicUsize::new(0));
    let done = Arc::new(AtomicUsize::new(0));
    let mut workers = Vec::new();
    for w in 0..concurrency {
        let mut client = client.clone();
        let (next, done) = (next.clone(), done.clone());
        workers.push(tokio::spawn(async move {
            let owner = format!("soak-{w}");
            let session = client
                .create_session(pb::CreateSessionRequest {
                    owner: owner.clone(),
                    ttl_ms: SESSION_TTL_MS,
                })
                .await?
                .into_inner();
            let key = format!("payout:soak-{w}");
            let mut kept_alive = Instant::now();
            while next.fetch_add(1, Ordering::Relaxed) < grants {
                if kept_alive.elapsed() >= Duration::from_millis(KEEP_ALIVE_EVERY_MS) {
                    client
                        .keep_alive(pb::KeepAliveRequest {
                            session_id: session.session_id.clone(),
                            vouch: Vec::new(),
                        })
                        .await?;
                    kept_alive = Instant::now();
                }
                acquire_and_release(&mut client, &key, &owner, &session.session_id).await?;
                done.fetch_add(1, Ordering::Relaxed);
            }
            client
                .close_session(pb::CloseSessionRequest {
                    session_id: session.session_id,
                })
                .await?;
            Ok::<_, tonic::Status>(())
        }));
    }

    // The sampler: etcd's status as each quarter of the grants completes.
    let mut checkpoints = Vec::new();
    let mut marks = (1..CHECKPOINTS)
        .map(|q| grants * q / CHECKPOINTS)
        .peekable();
    while !workers.iter().all(|w| w.is_finished()) {
        let completed = done.load(Ordering::Relaxed);
        if marks.peek().is_some_and(|mark| completed >= *mark) {
            marks.next();
            checkpoints.push(Checkpoint {
                grants: completed,
                elapsed_ms: started.elapsed().as_millis() as u64,
                status: etcd_status(etcd_endpoints, etcd_tls, &prefix).await?,
            });
        }
        tokio::time::sleep(Duration::from_millis(SAMPLE_PERIOD_MS)).await;
    }
    for w in workers {
        w.await.map_err(soak_err)?.map_err(soak_err)?;
    }
    let elapsed = started.elapsed();
    let after = etcd_status(etcd_endpoints, etcd_tls, &prefix).await?;
    checkpoints.push(Checkpoint {
        grants: done.load(Ordering::Relaxed),
        elapsed_ms: elapsed.as_millis() as u64,
        status: after.clone(),
    });
    server.stop().await;
    Ok(SoakReport {
        grants: done.load(Ordering::Relaxed),
        concurrency,
        grant_retention_ms,
        before,
        checkpoints,
        after,
        elapsed_ms: elapsed.as_millis() as u64,
        grants_per_s: grants as f64 / elapsed.as_secs_f64().max(f64::EPSILON),
    })
}
