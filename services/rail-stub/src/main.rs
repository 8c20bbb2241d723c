//! The rail stub's binary: flags (with environment fallbacks) for the three listeners (payments,
//! admin, metrics), their TLS (the rail's authority, the stub's certificate and key), the durable
//! movements file, the settlement window, the answer signing key and the initial fault
//! configuration. `rail-stub keygen --key-id ID --out FILE` makes an answer key: the secret to
//! FILE (mode 0600, never over an existing file), the public line the proxy's
//! `--rail-answer-verify-keys` takes to standard output (as a provider publishes its key).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use std::io::Write;
use std::sync::Arc;

use anyhow::Context;
use clap::{Parser, Subcommand};
use grant_signing::Signer;
use rail_stub::{FaultConfig, StubConfig};

#[derive(Parser, Debug)]
#[command(
    name = "rail-stub",
    about = "A non-idempotent payment rail stand-in with fault injection"
)]
#[command(args_conflicts_with_subcommands = true)]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
    #[command(flatten)]
    serve: Option<Args>,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Make an answer signing key: the secret to --out (mode 0600, never overwritten), the
    /// public line (`id=hex`, for the proxy's --rail-answer-verify-keys) to standard output.
    Keygen {
        /// The key's id: 1 to 64 characters of [A-Za-z0-9._-].
        #[arg(long)]
        key_id: String,
        /// Where to write the secret. Refused if the file exists.
        #[arg(long)]
        out: PathBuf,
    },
}

#[derive(clap::Args, Debug)]
struct Args {
    /// The rail's payments API (`/v1/payments`): what the rail proxy calls.
    #[arg(long, env = "RAIL_STUB_LISTEN", default_value = "127.0.0.1:8090")]
    listen: SocketAddr,
    /// The harness's admin API (`/admin/*`: ground truth, faults, a payment outside the proxy).
    #[arg(long, env = "RAIL_STUB_ADMIN_LISTEN", default_value = "127.0.0.1:8091")]
    admin_listen: SocketAddr,
    /// `/healthz` and `/metrics`.
    #[arg(
        long,
        env = "RAIL_STUB_METRICS_LISTEN",
        default_value = "127.0.0.1:9094"
    )]
    metrics_listen: SocketAddr,
    /// The rail's authority: every client of the payments and admin APIs must present a
    /// certificate of it (the admin API: the harness's, naming `harness`).
    #[arg(long, env = "RAIL_STUB_TLS_CA")]
    tls_ca: PathBuf,
    /// The stub's certificate (issued by the rail's authority, naming what its clients connect to).
    #[arg(long, env = "RAIL_STUB_TLS_CERT")]
    tls_cert: PathBuf,
    /// The stub's private key (readable by the stub only).
    #[arg(long, env = "RAIL_STUB_TLS_KEY")]
    tls_key: PathBuf,
    /// Append-only JSON-lines file of every movement, fsynced before each answer.
    #[arg(long, env = "RAIL_STUB_MOVEMENTS_FILE")]
    movements_file: PathBuf,
    /// The id of the key every payments answer is signed with (`rail-stub keygen`).
    #[arg(long, env = "RAIL_STUB_ANSWER_SIGNING_KEY_ID")]
    answer_signing_key_id: String,
    /// The answer signing key's file (its PKCS#8 document in hex, readable by the stub only).
    #[arg(long, env = "RAIL_STUB_ANSWER_SIGNING_KEY_FILE")]
    answer_signing_key_file: PathBuf,
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

/// Writes a fresh answer key's secret to `out` (mode 0600, refused if it exists) and returns the
/// public line.
fn keygen(key_id: &str, out: &std::path::Path) -> anyhow::Result<String> {
    let (signer, secret) = Signer::generate(key_id)?;
    let mut options = std::fs::OpenOptions::new();
    options.write(true).create_new(true);
    #[cfg(unix)]
    std::os::unix::fs::OpenOptionsExt::mode(&mut options, 0o600);
    let mut file = options.open(out).with_context(|| {
        format!(
            "creating {} (an existing key is never overwritten)",
            out.display()
        )
    })?;
    file.write_all(secret.as_bytes())
        .and_then(|()| file.sync_all())
        .with_context(|| format!("writing {}", out.display()))?;
    Ok(signer.public_key().to_string())
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    let args = match (cli.command, cli.serve) {
        (Some(Command::Keygen { key_id, out }), _) => {
            println!("{}", keygen(&key_id, &out)?);
            return Ok(());
        }
        (None, Some(args)) => args,
        (None, None) => anyhow::bail!("nothing to do: give the serving flags or a subcommand"),
    };
    service_kit::init_tracing("rail-stub");
    let key_file = &args.answer_signing_key_file;
    let answer_signer = std::fs::read_to_string(key_file)
        .map_err(anyhow::Error::from)
        .and_then(|text| Ok(Signer::from_hex(&args.answer_signing_key_id, &text)?))
        .with_context(|| format!("reading the answer signing key {}", key_file.display()))?;
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
    let tls = mtls::Tls::load(&args.tls_ca, &args.tls_cert, &args.tls_key)
        .context("the stub's TLS (--tls-ca, --tls-cert, --tls-key)")?;
    let config = StubConfig {
        settlement_window: Duration::from_millis(args.settlement_window_ms),
        movements_file: Some(args.movements_file),
        faults,
        answer_signer: Arc::new(answer_signer),
    };
    let listeners = rail_stub::StubListeners {
        payments: service_kit::bind(args.listen).await?,
        admin: service_kit::bind(args.admin_listen).await?,
        metrics: service_kit::bind(args.metrics_listen).await?,
    };
    rail_stub::run(listeners, &tls, config, service_kit::Shutdown::on_signal())
        .await
        .context("rail stub")
}
