//! `payoutctl pki`: the certificates of a deployment (every gRPC call is mutual TLS).
//!
//! `pki issue --dir DIR --role ROLE --name NAME` makes the certificate authority in DIR on first
//! use (`ca.pem`, and `ca.key` mode 0600: keep it offline once a deployment's certificates are
//! issued) and issues NAME's certificate for ROLE into DIR (`NAME.pem`, `NAME.key` mode 0600).
//! A service takes them as `--tls-ca DIR/ca.pem --tls-cert DIR/NAME.pem --tls-key DIR/NAME.key`
//! (or `PAYOUT_TLS_CA`, `PAYOUT_TLS_CERT`, `PAYOUT_TLS_KEY`); an operator gets a certificate of
//! role `operator` the same way and hands it to payoutctl with the same three flags.

use std::path::PathBuf;

use anyhow::Context;
use clap::{Args as ClapArgs, Subcommand};

#[derive(Subcommand)]
pub enum Command {
    /// Issue a certificate for one process (or one operator), making the authority if absent.
    Issue(IssueArgs),
}

#[derive(ClapArgs)]
pub struct IssueArgs {
    /// The folder holding the authority (`ca.pem`, `ca.key`) and the issued certificates.
    #[arg(long)]
    pub dir: PathBuf,
    /// lock-server, payment-resource, rail-proxy, general-ledger, outbox-dispatcher, worker,
    /// reconciler, operator, fixture (local stacks and tests only) or intake.
    #[arg(long)]
    pub role: String,
    /// The certificate's name (its files are NAME.pem and NAME.key), e.g. `worker-3` or `alice`.
    #[arg(long)]
    pub name: String,
}

pub fn run(command: Command) -> anyhow::Result<std::process::ExitCode> {
    match command {
        Command::Issue(args) => {
            let role = mtls::Role::parse(&args.role)?;
            anyhow::ensure!(
                !args.name.is_empty()
                    && args
                        .name
                        .chars()
                        .all(|c| c.is_ascii_alphanumeric() || "._-".contains(c)),
                "--name must be letters, digits, '.', '_' or '-'"
            );
            let authority = mtls::issue::Authority::open_or_create(&args.dir)
                .with_context(|| format!("the authority in {}", args.dir.display()))?;
            let files = authority.issue_to(role, &args.name, &args.dir)?;
            println!(
                "--tls-ca {} --tls-cert {} --tls-key {}",
                files.ca.display(),
                files.cert.display(),
                files.key.display()
            );
            Ok(std::process::ExitCode::SUCCESS)
        }
    }
}
