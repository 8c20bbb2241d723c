//! The rail proxy with a failpoint, for the crash tests: the shipped proxy's start-up (proxydb
//! migrations, the gRPC server) with `Failpoint::AbortAfterIntent`, so the process `abort()`s
//! right after its first intent commits. The failpoint exists only behind the proxy library's
//! `negative-controls` feature, which this test crate enables and no shipped binary is built with.

use std::net::SocketAddr;

use anyhow::Context;
use clap::Parser;
use rail_proxy::{Failpoint, ProxyConfig};

#[derive(Parser, Debug)]
#[command(
    name = "rail-proxy-failpoint",
    about = "TEST ONLY: the rail proxy that aborts right after its first intent commit"
)]
struct Args {
    #[arg(long)]
    listen: SocketAddr,
    #[arg(long)]
    database_url: String,
    #[arg(long)]
    rail_url: String,
    /// As the shipped proxy's: the grant and instruction public keys, the rail-fact signing key.
    #[command(flatten)]
    keys: rail_proxy::GuardKeyArgs,
    #[command(flatten)]
    tls: service_kit::grpc::TlsArgs,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    service_kit::init_tracing("rail-proxy-failpoint");
    let args = Args::parse();
    let tls = args.tls.load().context("TLS material")?;
    let config = ProxyConfig::new(args.rail_url, args.keys.load()?, tls)
        .with_failpoint(Some(Failpoint::AbortAfterIntent));
    let pool = service_kit::connect_pg(&args.database_url).await?;
    rail_proxy::migrate(&pool)
        .await
        .context("applying proxydb migrations")?;
    let listener = service_kit::bind(args.listen).await?;
    rail_proxy::run(
        listener,
        pool,
        config,
        service_kit::Metrics::default(),
        service_kit::Shutdown::on_signal(),
    )
    .await
    .context("rail proxy")?;
    anyhow::bail!("the failpoint proxy stopped serving without crashing")
}
