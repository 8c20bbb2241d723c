//! The containers' health check (no gRPC health client ships in Debian's packages):
//!
//! - `payout-probe grpc 127.0.0.1:50052 payment-resource`: `grpc.health.v1.Health/Check` answers
//!   SERVING over mutual TLS (the container's `PAYOUT_TLS_*`), from a server of that role.
//! - `payout-probe http 127.0.0.1:9472 /healthz`: a plain HTTP GET answers 200 (the worker's
//!   `/healthz` does only while it is connected to Temporal with its pollers running).
//!
//! Exit status 0 means healthy; anything else prints why on stderr.

use clap::{Parser, Subcommand};
use compose_tests::probe;

#[derive(Parser)]
#[command(about = "Health probe for the compose deployment's containers")]
struct Cli {
    #[command(subcommand)]
    check: Check,
    /// Gives up after this long (a health check must answer before Docker's own timeout).
    #[arg(long, default_value_t = 2_000)]
    timeout_ms: u64,
}

#[derive(Subcommand)]
enum Check {
    /// grpc.health.v1 Check("") == SERVING.
    Grpc {
        addr: String,
        /// The server's role, as its certificate names it.
        server: String,
    },
    /// HTTP GET answers 200.
    Http {
        addr: String,
        #[arg(default_value = "/")]
        path: String,
    },
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    let timeout = std::time::Duration::from_millis(cli.timeout_ms);
    let result = match cli.check {
        Check::Grpc { addr, server } => match mtls::Role::parse(&server) {
            Ok(role) => probe::grpc(&addr, role, timeout).await,
            Err(e) => Err(e.into()),
        },
        Check::Http { addr, path } => probe::http(&addr, &path, timeout).await,
    };
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("unhealthy: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
