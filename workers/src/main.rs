//! The shipped payout worker: [`payout_worker::serve`] with the services' backend as it is.

use clap::Parser;
use payout_worker::WorkerConfig;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    service_kit::init_tracing("payout-worker");
    payout_worker::serve(WorkerConfig::parse(), |backend| backend).await
}
