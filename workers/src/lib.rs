//! The payout worker: registers `PayoutWorkflow` and its activities on the `payouts` task queue
//! and polls until told to stop. Any number of replicas may run at once: correctness never
//! depends on which one runs a task (the guards and the proxy decide), only liveness does.

pub mod deployment;
pub mod services;
pub mod telemetry;

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use payout_activities::{Backend, PayoutActivities};
use payout_workflows::PayoutWorkflow;
use services::{ServiceBackend, ServiceConfig};
use temporalio_client::Client;
use temporalio_sdk::runtime::worker_tuner::{FixedSizeSlotSupplier, TunerHolder};
use temporalio_sdk::{Runtime, Worker, WorkerOptions};

pub use telemetry::Telemetry;

/// A task that stops when its handle is dropped (the worker's Temporal probe; `payoutdev`'s start
/// watch).
pub struct AbortOnDrop(pub tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// On SIGTERM the worker stops polling and lets in-flight activities finish for this long; then
/// it cancels them and hands the work back to Temporal (another replica picks it up). It is
/// above the longest activity start-to-close (the rail submission's 30 s) so that a submission
/// in flight is allowed to record its ending rather than becoming ambiguous.
pub const GRACEFUL_SHUTDOWN_PERIOD: Duration = Duration::from_secs(35);
/// Cached workflow executions per worker: each is a small state machine; this bounds memory at a
/// batch of a few hundred in-flight payouts per replica.
pub const MAX_CACHED_WORKFLOWS: usize = 1_000;
/// Activity slots of this process's own queue. Payouts waiting in an account's line wait there
/// (one parked `AcquireGrant` each, a future and no thread), so a busy batch parks hundreds at
/// once; with the SDK's default of 100, waiters beyond it would sit in the queue unstarted and
/// time out their schedule-to-start. Fenced work is a few short calls per payout on top.
pub const PRIVATE_QUEUE_ACTIVITY_SLOTS: usize = 5_000;

/// The private queue's tuner: [`PRIVATE_QUEUE_ACTIVITY_SLOTS`] activity slots (it runs no
/// workflows, so its other slot kinds stay at the SDK's default size).
fn private_queue_tuner() -> TunerHolder {
    const SDK_DEFAULT_SLOTS: usize = 100;
    TunerHolder::builder()
        .workflow_task_slot_supplier(FixedSizeSlotSupplier::new(SDK_DEFAULT_SLOTS))
        .activity_task_slot_supplier(FixedSizeSlotSupplier::new(PRIVATE_QUEUE_ACTIVITY_SLOTS))
        .local_activity_task_slot_supplier(FixedSizeSlotSupplier::new(SDK_DEFAULT_SLOTS))
        .nexus_task_slot_supplier(FixedSizeSlotSupplier::new(SDK_DEFAULT_SLOTS))
        .build()
}

#[derive(Debug, Clone, clap::Parser)]
#[command(name = "payout-worker", about = "Temporal worker for payout workflows")]
pub struct WorkerConfig {
    /// Temporal: configured as the `temporal` CLI is (TEMPORAL_ADDRESS, TEMPORAL_NAMESPACE,
    /// TEMPORAL_TLS_*, TEMPORAL_API_KEY, TEMPORAL_PROFILE and its config file); a flag overrides
    /// the environment.
    #[command(flatten)]
    pub temporal: payout_workflows::client::TemporalArgs,
    /// The deployment version this worker runs (Worker Versioning).
    #[command(flatten)]
    pub deployment: deployment::DeploymentArgs,
    #[arg(long, env = "PAYOUT_TASK_QUEUE", default_value = payout_workflows::TASK_QUEUE)]
    pub task_queue: String,
    /// This replica's identity: the lock owner and the claimer recorded by the guards.
    #[arg(long, env = "PAYOUT_WORKER_IDENTITY")]
    pub identity: Option<String>,
    /// lock-server gRPC endpoint, e.g. http://127.0.0.1:20051
    #[arg(long, env = "LOCK_SERVER_URL")]
    pub lock_server_url: Option<String>,
    /// payment-resource gRPC endpoint.
    #[arg(long, env = "PAYMENT_RESOURCE_URL")]
    pub payment_resource_url: Option<String>,
    /// rail-proxy gRPC endpoint.
    #[arg(long, env = "RAIL_PROXY_URL")]
    pub rail_proxy_url: Option<String>,
    /// The lock session's lease TTL. Short values make a frozen worker lose its grants fast
    /// (fault tests); the default suits a deployment.
    #[arg(long, env = "PAYOUT_LOCK_TTL_MS", default_value_t = services::LOCK_TTL_MS_DEFAULT)]
    pub lock_ttl_ms: u64,
    /// Append this worker's lock history (every grant, session deadline, loss and release, on
    /// the monotonic clock) to this file: the evidence INV-06's detective control checks (no two
    /// grants of one key believed held at once). Off when unset.
    #[arg(long, env = "PAYOUT_LOCK_HISTORY_PATH")]
    pub lock_history_path: Option<std::path::PathBuf>,
    /// A grant no workflow has used this long after it was made (its acquire's answer reached
    /// nobody) is released, so it cannot keep the account's key from later payouts.
    #[arg(long, env = "PAYOUT_UNCLAIMED_GRANT_MS", default_value_t = services::UNCLAIMED_GRANT_MAX_MS_DEFAULT)]
    pub unclaimed_grant_max_ms: u64,
    /// This worker's certificate (role `worker`) and the authority it trusts: every call to the
    /// lock service and both guards is mutual TLS, and the lock session belongs to this
    /// certificate.
    #[command(flatten)]
    pub tls: mtls::TlsArgs,
    /// Serve `/metrics` (this worker's activity latencies and the Temporal SDK's own metrics)
    /// and `/healthz` (200 while connected to Temporal with its pollers running, else 503 and
    /// why) on this address. Off when unset.
    #[arg(long, env = "PAYOUT_WORKER_METRICS_LISTEN")]
    pub metrics_listen: Option<std::net::SocketAddr>,
}

impl WorkerConfig {
    pub fn identity(&self) -> String {
        self.identity
            .clone()
            .unwrap_or_else(|| format!("payout-worker-{}", std::process::id()))
    }

    /// This process's own task queue, where the fenced activities of its grants are routed. It
    /// is unique per process (pid and start time), so a restarted worker with the same identity
    /// never receives tasks meant for its previous incarnation's session.
    pub fn private_task_queue(&self) -> String {
        let started_ns = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0);
        format!(
            "{}/{}/{}-{started_ns}",
            self.task_queue,
            self.identity(),
            std::process::id()
        )
    }
}

pub async fn connect(config: &WorkerConfig) -> anyhow::Result<Client> {
    let target = config.temporal.resolve()?;
    let client = payout_workflows::client::connect_to(&target, &config.identity()).await?;
    tracing::info!(temporal = %target.describe(), "connected to Temporal");
    Ok(client)
}

/// Runs the worker until `stop` resolves, then shuts it down gracefully and returns when every
/// in-flight task has completed or been handed back.
///
/// Two pollers share one backend: the shared `config.task_queue` (workflows and the unfenced
/// activities: acquire, reads, inquiries) and, when `private_task_queue` is given, this process's
/// own queue, where the workflow routes every fenced activity of a grant this process holds
/// (`Grant::task_queue`): only the process whose session holds a grant can vouch for it.
pub async fn run(
    config: &WorkerConfig,
    backend: Arc<dyn Backend>,
    private_task_queue: Option<String>,
    stop: impl std::future::Future<Output = ()>,
) -> anyhow::Result<()> {
    run_with(config, backend, private_task_queue, &Telemetry::new(), stop).await
}

/// [`run`], recording into `telemetry` (whose endpoint the caller serves): the SDK's metrics,
/// each activity's latency, and the health `/healthz` answers from.
pub async fn run_with(
    config: &WorkerConfig,
    backend: Arc<dyn Backend>,
    private_task_queue: Option<String>,
    telemetry: &Telemetry,
    stop: impl std::future::Future<Output = ()>,
) -> anyhow::Result<()> {
    let runtime = Runtime::from_current_tokio(telemetry.runtime_options()?)?;
    let deployment_options = config.deployment.options()?;
    tracing::info!(version = %config.deployment.version_name(), routed = config.deployment.versioning, "worker deployment version");
    let client = connect(config).await?;
    // Aborted when this function returns: the probe lives as long as the pollers.
    let probe = AbortOnDrop(tokio::spawn(telemetry::watch_temporal(
        client.clone(),
        telemetry.health_handle(),
    )));
    let mut options = WorkerOptions::new(config.task_queue.clone())
        .register_workflow::<PayoutWorkflow>()?
        .register_activities(PayoutActivities::new(backend.clone()))
        .build();
    options.graceful_shutdown_period = Some(GRACEFUL_SHUTDOWN_PERIOD);
    options.max_cached_workflows = MAX_CACHED_WORKFLOWS;
    options.client_identity_override = Some(config.identity());
    options.deployment_options = deployment_options.clone();
    options.activity_inbound_interceptor(telemetry.activity_timing());
    let mut worker = Worker::new(&runtime, client.clone(), options)?;
    let mut private = match &private_task_queue {
        Some(queue) => {
            let mut options = WorkerOptions::new(queue.clone())
                .register_activities(PayoutActivities::new(backend))
                .build();
            options.graceful_shutdown_period = Some(GRACEFUL_SHUTDOWN_PERIOD);
            options.client_identity_override = Some(config.identity());
            options.tuner = private_queue_tuner().into();
            options.deployment_options = config.deployment.private_queue_options();
            options.activity_inbound_interceptor(telemetry.activity_timing());
            Some(Worker::new(&runtime, client, options)?)
        }
        None => None,
    };
    let shutdown = worker.shutdown_handle();
    let private_shutdown = private.as_ref().map(|w| w.shutdown_handle());
    tracing::info!(task_queue = %config.task_queue, private_task_queue = ?private_task_queue, identity = %config.identity(), "worker polling");
    let health = telemetry.health();
    let has_private = private.is_some();
    health.polling(1 + usize::from(has_private));
    let private_run = async {
        let result = match private.as_mut() {
            Some(w) => w.run().await,
            None => Ok(()),
        };
        if has_private {
            health.poller_stopped();
        }
        result
    };
    let shared_run = async {
        let result = worker.run().await;
        health.poller_stopped();
        result
    };
    let (result, private_result, ()) = tokio::join!(shared_run, private_run, async {
        stop.await;
        tracing::info!("shutdown requested: finishing in-flight tasks");
        health.stopping();
        shutdown();
        if let Some(s) = private_shutdown {
            s();
        }
    });
    drop(probe);
    result.context("worker stopped with an error")?;
    private_result.context("private-queue worker stopped with an error")?;
    tracing::info!("worker stopped");
    Ok(())
}

/// The worker process: connects its services, puts `wrap` around the backend (the shipped
/// binary wraps nothing; the fault tests' worker puts its stall points there), polls until
/// SIGTERM or SIGINT, then ends its lock session.
///
/// A worker that cannot reach the lock service for longer than its lease stops polling
/// Temporal (in-flight tasks finish or are handed back, as on SIGTERM; `/healthz` answers 503),
/// so the tasks it could not do go to a worker that can; it polls again once the lock service
/// answers. The process does not exit: nothing needs a supervisor to bring it back.
pub async fn serve(
    config: WorkerConfig,
    wrap: impl FnOnce(Arc<dyn Backend>) -> Arc<dyn Backend>,
) -> anyhow::Result<()> {
    let required = |name: &str, value: &Option<String>| {
        value.clone().with_context(|| format!("{name} is required"))
    };
    // Temporal's and the deployment version's settings are checked before anything else: a bad
    // one stops the worker at start, naming it (not after its services have answered).
    config.temporal.resolve()?;
    config.deployment.options()?;
    let private_task_queue = config.private_task_queue();
    let tls = config.tls.load().context("TLS material")?;
    let service_config = ServiceConfig {
        tls,
        owner: config.identity(),
        private_task_queue: private_task_queue.clone(),
        lock_server_url: required("LOCK_SERVER_URL", &config.lock_server_url)?,
        payment_resource_url: required("PAYMENT_RESOURCE_URL", &config.payment_resource_url)?,
        rail_proxy_url: required("RAIL_PROXY_URL", &config.rail_proxy_url)?,
        lock_ttl: Duration::from_millis(config.lock_ttl_ms),
        lock_history_path: config.lock_history_path.clone(),
        unclaimed_grant_max: Duration::from_millis(config.unclaimed_grant_max_ms),
    };
    let mut stop = Box::pin(service_kit::Shutdown::on_signal().wait());
    // The endpoint answers from the start (503 while the services are awaited) until the worker
    // has stopped.
    let telemetry = Telemetry::new();
    let (endpoint_stop, endpoint_stopped) = tokio::sync::oneshot::channel::<()>();
    let endpoint = match config.metrics_listen {
        Some(addr) => {
            let listener = service_kit::bind(addr).await?;
            tracing::info!(%addr, "serving /metrics and /healthz");
            Some(tokio::spawn(telemetry.clone().serve(listener, async {
                let _ = endpoint_stopped.await;
            })))
        }
        None => None,
    };
    // A service that is down now (restarting, cut off) is waited for; only the worker's own
    // configuration ends it here. It polls Temporal only once every service answered.
    let mut retry_in = services::CONNECT_RETRY_FIRST;
    let backend = loop {
        match ServiceBackend::connect(service_config.clone()).await {
            Ok(backend) => break backend,
            Err(e) if e.is_transient() => {
                tracing::warn!(error = %e, retry_in_ms = retry_in.as_millis() as u64,
                    "a service the worker needs is not reachable; waiting for it");
                tokio::select! {
                    () = tokio::time::sleep(retry_in) => {}
                    () = &mut stop => {
                        tracing::info!("shutdown requested before the worker's services answered");
                        return Ok(());
                    }
                }
                retry_in = (retry_in * 2).min(services::CONNECT_RETRY_MAX);
            }
            Err(e) => return Err(e).context("connecting the worker's services"),
        }
    };
    tracing::info!("the worker's services answered");
    let backend = Arc::new(backend);
    let wrapped = wrap(backend.clone());
    let result = loop {
        let cut_off = std::sync::Mutex::new(None::<String>);
        let stop_or_cut_off = async {
            tokio::select! {
                () = &mut stop => {}
                why = backend.cut_off_from_lock_service() => {
                    tracing::error!(error = %why, lease_ms = config.lock_ttl_ms,
                        "cut off from the lock service for longer than a lease: stopping polling so \
                         its tasks go to a worker that reaches it");
                    *cut_off.lock().expect("cut_off") = Some(why);
                }
            }
        };
        let result = run_with(
            &config,
            wrapped.clone(),
            Some(private_task_queue.clone()),
            &telemetry,
            stop_or_cut_off,
        )
        .await;
        if result.is_err() || cut_off.lock().expect("cut_off").is_none() {
            break result;
        }
        tokio::select! {
            () = backend.lock_service_back() => {
                tracing::info!("the lock service answers again: polling again");
            }
            () = &mut stop => break Ok(()),
        }
    };
    let _ = endpoint_stop.send(());
    if let Some(endpoint) = endpoint {
        match endpoint.await {
            Ok(Err(e)) => tracing::warn!(error = %e, "the metrics and health endpoint failed"),
            Err(e) => tracing::warn!(error = %e, "the metrics and health endpoint's task failed"),
            Ok(Ok(())) => {}
        }
    }
    // After the pollers stopped: ending the session frees this worker's keys at once, so the
    // payouts it handed back continue on another replica without waiting for the lease.
    backend.close().await;
    result
}
