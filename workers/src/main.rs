use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use clap::Parser;
use payout_activities::services::{ServiceBackend, ServiceConfig};
use payout_worker::WorkerConfig;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    service_kit::init_tracing("payout-worker");
    let config = WorkerConfig::parse();
    let required = |name: &str, value: &Option<String>| {
        value.clone().with_context(|| format!("{name} is required"))
    };
    let private_task_queue = config.private_task_queue();
    let backend = ServiceBackend::connect(ServiceConfig {
        owner: config.identity(),
        private_task_queue: private_task_queue.clone(),
        lock_server_url: required("LOCK_SERVER_URL", &config.lock_server_url)?,
        payment_resource_url: required("PAYMENT_RESOURCE_URL", &config.payment_resource_url)?,
        rail_proxy_url: required("RAIL_PROXY_URL", &config.rail_proxy_url)?,
        lock_ttl: Duration::from_millis(config.lock_ttl_ms),
        lock_history_path: config.lock_history_path.clone(),
        unclaimed_grant_max: Duration::from_millis(config.unclaimed_grant_max_ms),
    })
    .await
    .context("connecting the worker's services")?;
    let backend = Arc::new(backend);
    let shutdown = service_kit::Shutdown::on_signal();
    let result = payout_worker::run(
        &config,
        backend.clone(),
        Some(private_task_queue),
        shutdown.wait(),
    )
    .await;
    // After the pollers stopped: ending the session frees this worker's keys at once, so the
    // payouts it handed back continue on another replica without waiting for the lease.
    backend.close().await;
    result
}
