//! The worker the fault tests run: the shipped `payout-worker`, with the test-only stall points
//! ([`system_tests::stall`]) in front of its backend. Nothing else differs; the shipped worker
//! binary contains no stall point.

use std::sync::Arc;

use clap::Parser;
use payout_worker::WorkerConfig;
use system_tests::stall::StallingBackend;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    service_kit::init_tracing("payout-test-worker");
    let config = WorkerConfig::parse();
    let identity = config.identity();
    payout_worker::serve(config, move |backend| {
        Arc::new(StallingBackend::from_env(backend, &identity))
    })
    .await
}
