use clap::Parser;
use payout_worker::WorkerConfig;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    service_kit::init_tracing("payout-worker");
    let config = WorkerConfig::parse();
    // The service-backed activities (lock-client, payment-resource, rail-proxy clients) are
    // wired here once those contracts have landed; until then the worker refuses to start
    // rather than run activities against nothing.
    let missing: Vec<&str> = [
        ("LOCK_SERVER_URL", config.lock_server_url.is_none()),
        (
            "PAYMENT_RESOURCE_URL",
            config.payment_resource_url.is_none(),
        ),
        ("RAIL_PROXY_URL", config.rail_proxy_url.is_none()),
    ]
    .into_iter()
    .filter_map(|(name, absent)| absent.then_some(name))
    .collect();
    anyhow::ensure!(missing.is_empty(), "missing configuration: {missing:?}");
    anyhow::bail!(
        "the service-backed activity backend is not wired yet (rail-proxy contract pending); \
         run the worker library with a backend (payout_worker::run)"
    )
}
