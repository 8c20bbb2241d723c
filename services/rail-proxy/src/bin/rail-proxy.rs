//! The rail proxy's binary: configuration, migrations, the gRPC server, `/metrics`. It has no
//! test flag: the test switches exist only in the library, behind the `negative-controls`
//! feature, which this binary is never built with when shipped.

use std::net::SocketAddr;
use std::time::Duration;

use anyhow::Context;
use clap::Parser;
use rail_proxy::ProxyConfig;

#[derive(Parser, Debug)]
#[command(
    name = "rail-proxy",
    about = "The second guard: fenced, at-most-once submissions to the rail"
)]
struct Args {
    #[arg(long, env = "RAIL_PROXY_LISTEN", default_value = "127.0.0.1:50053")]
    listen: SocketAddr,
    #[arg(
        long,
        env = "RAIL_PROXY_METRICS_LISTEN",
        default_value = "127.0.0.1:9093"
    )]
    metrics_listen: SocketAddr,
    /// proxydb: a database in a different PostgreSQL server from paydb.
    #[arg(long, env = "RAIL_PROXY_DATABASE_URL")]
    database_url: String,
    #[command(flatten)]
    rail: rail_proxy::RailLinkArgs,
    #[arg(long, env = "RAIL_PROXY_RAIL_TIMEOUT_MS", default_value_t = rail_proxy::RAIL_CALL_TIMEOUT_MS_DEFAULT)]
    rail_timeout_ms: u64,
    #[command(flatten)]
    keys: rail_proxy::GuardKeyArgs,
    #[command(flatten)]
    tls: service_kit::grpc::ServerTlsArgs,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    service_kit::init_tracing("rail-proxy");
    let args = Args::parse();
    let tls = args.tls.load().context("TLS material")?;
    let keys = args.keys.load()?;
    let config = ProxyConfig::new(args.rail.try_into().context("the rail link")?, keys, tls)
        .with_rail_timeout(Duration::from_millis(args.rail_timeout_ms));
    let pool = service_kit::connect_pg(&args.database_url).await?;
    rail_proxy::require_schema(&pool).await?;
    let shutdown = service_kit::Shutdown::on_signal();
    let metrics = service_kit::Metrics::default();
    let metrics_listener = service_kit::bind(args.metrics_listen).await?;
    tokio::spawn(service_kit::serve_metrics(
        metrics_listener,
        metrics.clone(),
        shutdown.clone().wait(),
    ));
    let listener = service_kit::bind(args.listen).await?;
    rail_proxy::run(listener, pool, config, metrics, shutdown)
        .await
        .context("rail proxy")
}
