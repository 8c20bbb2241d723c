//! The rail stub's binary: flags (with environment fallbacks) for the listener, the durable
//! movements file, the settlement window and the initial fault configuration.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use clap::Parser;
use rail_stub::{FaultConfig, StubConfig};

#[derive(Parser, Debug)]
#[command(
    name = "rail-stub",
    about = "A non-idempotent payment rail stand-in with fault injection"
)]
struct Args {
    #[arg(long, env = "RAIL_STUB_LISTEN", default_value = "127.0.0.1:8090")]
    listen: SocketAddr,
    /// Append-only JSON-lines file of every movement, fsynced before each answer.
    #[arg(long, env = "RAIL_STUB_MOVEMENTS_FILE")]
    movements_file: PathBuf,
    #[arg(long, env = "RAIL_STUB_SETTLEMENT_WINDOW_MS", default_value_t = rail_stub::SETTLEMENT_WINDOW_MS_DEFAULT)]
    settlement_window_ms: u64,
    /// The whole initial fault configuration as JSON (same shape as `POST /admin/faults`);
    /// the flags below override its fields.
    #[arg(long, env = "RAIL_STUB_FAULTS_JSON")]
    faults_json: Option<String>,
    #[arg(long, env = "RAIL_STUB_SEED")]
    seed: Option<u64>,
    #[arg(long, env = "RAIL_STUB_LATENCY_MS_MIN")]
    latency_ms_min: Option<u64>,
    #[arg(long, env = "RAIL_STUB_LATENCY_MS_MAX")]
    latency_ms_max: Option<u64>,
    #[arg(long, env = "RAIL_STUB_DECLINE_RATE")]
    decline_rate: Option<f64>,
    #[arg(long, env = "RAIL_STUB_FAIL_BEFORE_ACTING_RATE")]
    fail_before_acting_rate: Option<f64>,
    #[arg(long, env = "RAIL_STUB_ACCEPT_THEN_FAIL_RATE")]
    accept_then_fail_rate: Option<f64>,
    #[arg(long, env = "RAIL_STUB_ACCEPT_THEN_HANG_RATE")]
    accept_then_hang_rate: Option<f64>,
    #[arg(long, env = "RAIL_STUB_RESET_BEFORE_ACTING_RATE")]
    reset_before_acting_rate: Option<f64>,
    #[arg(long, env = "RAIL_STUB_ACCEPT_THEN_RESET_RATE")]
    accept_then_reset_rate: Option<f64>,
    #[arg(long, env = "RAIL_STUB_LOOKUP_LATENCY_MS")]
    lookup_latency_ms: Option<u64>,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    service_kit::init_tracing("rail-stub");
    let args = Args::parse();
    let mut faults: FaultConfig = match &args.faults_json {
        Some(json) => serde_json::from_str(json).context("parsing --faults-json")?,
        None => FaultConfig::default(),
    };
    let overrides = [
        (args.decline_rate, &mut faults.decline_rate),
        (
            args.fail_before_acting_rate,
            &mut faults.fail_before_acting_rate,
        ),
        (
            args.accept_then_fail_rate,
            &mut faults.accept_then_fail_rate,
        ),
        (
            args.accept_then_hang_rate,
            &mut faults.accept_then_hang_rate,
        ),
        (
            args.reset_before_acting_rate,
            &mut faults.reset_before_acting_rate,
        ),
        (
            args.accept_then_reset_rate,
            &mut faults.accept_then_reset_rate,
        ),
    ];
    for (value, field) in overrides {
        if let Some(value) = value {
            *field = value;
        }
    }
    for (value, field) in [
        (args.seed, &mut faults.seed),
        (args.latency_ms_min, &mut faults.latency_ms_min),
        (args.latency_ms_max, &mut faults.latency_ms_max),
        (args.lookup_latency_ms, &mut faults.lookup_latency_ms),
    ] {
        if let Some(value) = value {
            *field = value;
        }
    }
    faults.validate().context("fault configuration")?;
    let config = StubConfig {
        settlement_window: Duration::from_millis(args.settlement_window_ms),
        movements_file: Some(args.movements_file),
        faults,
    };
    let listener = service_kit::bind(args.listen).await?;
    rail_stub::run(listener, config, service_kit::Shutdown::on_signal())
        .await
        .context("rail stub")
}
