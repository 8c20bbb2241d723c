//! The rail proxy with a test-only switch, for the tests that must see what a protection
//! prevents: the shipped proxy's start-up (proxydb migrations, the gRPC server, `/metrics`) with
//! one of
//! - `--mode abort-after-intent` (the default; the crash tests): `Failpoint::AbortAfterIntent`, so
//!   the process `abort()`s right after its first intent commits;
//! - `--mode instruction-unverified` (the attack suite's negative control of the signed
//!   instruction, issue 33): every submit is taken at its word, no instruction checked;
//! - `--mode rail-answers-unverified` (the attack suite's negative control of the rail's answer
//!   signature, issue 34): every answer on the rail's address is believed.
//!
//! Both switches exist only behind the proxy library's `negative-controls` feature, which this
//! test crate enables and no shipped binary is built with. It takes the shipped binary's flags
//! (and its database URL from the same environment variable), so a test system can run it in
//! the proxy's place (`SystemOptions::rail_proxy_binary`).

use std::net::SocketAddr;
use std::time::Duration;

use anyhow::Context;
use clap::{Parser, ValueEnum};
use rail_proxy::{Failpoint, ProxyConfig};

#[derive(Debug, Clone, Copy, ValueEnum)]
enum Mode {
    AbortAfterIntent,
    InstructionUnverified,
    RailAnswersUnverified,
}

#[derive(Parser, Debug)]
#[command(
    name = "rail-proxy-failpoint",
    about = "TEST ONLY: the rail proxy with a failpoint or a protection switched off"
)]
struct Args {
    #[arg(long, value_enum, default_value = "abort-after-intent")]
    mode: Mode,
    #[arg(long)]
    listen: SocketAddr,
    /// Where `/metrics` is served, if anywhere.
    #[arg(long)]
    metrics_listen: Option<SocketAddr>,
    #[arg(long, env = "RAIL_PROXY_DATABASE_URL")]
    database_url: String,
    #[command(flatten)]
    rail: rail_proxy::RailLinkArgs,
    #[arg(long, default_value_t = rail_proxy::RAIL_CALL_TIMEOUT_MS_DEFAULT)]
    rail_timeout_ms: u64,
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
    let keys = args.keys.load()?;
    let config = ProxyConfig::new(args.rail.try_into().context("the rail link")?, keys, tls)
        .with_rail_timeout(Duration::from_millis(args.rail_timeout_ms));
    let config = match args.mode {
        Mode::AbortAfterIntent => config.with_failpoint(Some(Failpoint::AbortAfterIntent)),
        Mode::InstructionUnverified => {
            config.disable_instruction_verification_for_negative_control()
        }
        Mode::RailAnswersUnverified => {
            config.disable_rail_answer_verification_for_negative_control()
        }
    };
    let pool = service_kit::connect_pg(&args.database_url).await?;
    match args.mode {
        // The crash tests hand it a fresh database as its owner.
        Mode::AbortAfterIntent => rail_proxy::migrate(&pool)
            .await
            .context("applying proxydb migrations")?,
        // In a test system's place: the schema is migrated, the login is the proxy's own.
        Mode::InstructionUnverified | Mode::RailAnswersUnverified => {
            rail_proxy::require_schema(&pool).await?
        }
    }
    let shutdown = service_kit::Shutdown::on_signal();
    let metrics = service_kit::Metrics::default();
    if let Some(at) = args.metrics_listen {
        let metrics_listener = service_kit::bind(at).await?;
        tokio::spawn(service_kit::serve_metrics(
            metrics_listener,
            metrics.clone(),
            shutdown.clone().wait(),
        ));
    }
    let listener = service_kit::bind(args.listen).await?;
    rail_proxy::run(listener, pool, config, metrics, shutdown)
        .await
        .context("rail proxy")?;
    match args.mode {
        Mode::AbortAfterIntent => {
            anyhow::bail!("the failpoint proxy stopped serving without crashing")
        }
        Mode::InstructionUnverified | Mode::RailAnswersUnverified => Ok(()),
    }
}
