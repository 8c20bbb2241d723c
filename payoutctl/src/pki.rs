//! `payoutctl pki`: the certificates of a deployment (every gRPC call is mutual TLS).
//!
//! `pki issue --dir DIR --role ROLE --name NAME` makes the certificate authority in DIR on first
//! use (`ca.pem`, and `ca.key` mode 0600: keep it offline once a deployment's certificates are
//! issued) and issues NAME's certificate for ROLE into DIR (`NAME.pem`, `NAME.key` mode 0600).
//! A service takes them as `--tls-ca DIR/ca.pem --tls-cert DIR/NAME.pem --tls-key DIR/NAME.key`
//! (or `PAYOUT_TLS_CA`, `PAYOUT_TLS_CERT`, `PAYOUT_TLS_KEY`); an operator gets a certificate of
//! role `operator` the same way and hands it to payoutctl with the same three flags.
//! Each certificate of a role carries it twice: as its DNS subject name (what our services check)
//! and as the subject's `OU` (what the Temporal front, nginx, checks: it cannot read the SAN).
//!
//! `pki issue-server --dir DIR --name NAME --host H...` issues a server certificate with no role:
//! a database, an etcd member, or the Temporal front (`--name temporal --host temporal --host
//! 127.0.0.1`; every Temporal client sets the server name `temporal`).

use std::path::PathBuf;

use anyhow::Context;
use clap::{Args as ClapArgs, Subcommand};

#[derive(Subcommand)]
pub enum Command {
    /// Issue a certificate for one process (or one operator), making the authority if absent.
    Issue(IssueArgs),
    /// Issue a server certificate for a database or etcd member, named by every host name and
    /// address its clients connect to (each is checked: `sslmode=verify-full`).
    IssueServer(IssueServerArgs),
}

#[derive(ClapArgs)]
pub struct IssueServerArgs {
    /// The folder holding the authority (`ca.pem`, `ca.key`) and the issued certificates.
    #[arg(long)]
    pub dir: PathBuf,
    /// The certificate's name (its files are NAME.pem and NAME.key), e.g. `paydb`.
    #[arg(long)]
    pub name: String,
    /// A host name or IP address the server is reached at; repeat for each (at least one).
    #[arg(long = "host", required = true)]
    pub hosts: Vec<String>,
}

fn check_name(name: &str) -> anyhow::Result<()> {
    anyhow::ensure!(
        !name.is_empty()
            && name
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || "._-".contains(c)),
        "--name must be letters, digits, '.', '_' or '-'"
    );
    Ok(())
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
            check_name(&args.name)?;
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
        Command::IssueServer(args) => {
            check_name(&args.name)?;
            for host in &args.hosts {
                anyhow::ensure!(
                    !host.is_empty()
                        && host
                            .chars()
                            .all(|c| c.is_ascii_alphanumeric() || ".-:".contains(c)),
                    "--host {host:?} is not a host name or an IP address"
                );
            }
            let authority = mtls::issue::Authority::open_or_create(&args.dir)
                .with_context(|| format!("the authority in {}", args.dir.display()))?;
            let hosts: Vec<&str> = args.hosts.iter().map(String::as_str).collect();
            let files = authority
                .issue_named(&hosts, &args.name)?
                .write(&args.dir, &args.name)?;
            println!("{} {}", files.cert.display(), files.key.display());
            Ok(std::process::ExitCode::SUCCESS)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    fn issue(dir: &std::path::Path, role: &str, name: &str) -> anyhow::Result<()> {
        run(Command::Issue(IssueArgs {
            dir: dir.to_path_buf(),
            role: role.into(),
            name: name.into(),
        }))
        .map(|_| ())
    }

    #[test]
    fn issued_files_load_name_their_role_and_keep_keys_owner_only() {
        let dir = tempfile::tempdir().unwrap();
        issue(dir.path(), "operator", "alice").unwrap();
        issue(dir.path(), "worker", "worker-1").unwrap();
        for key in ["ca.key", "alice.key", "worker-1.key"] {
            let mode = std::fs::metadata(dir.path().join(key))
                .unwrap()
                .permissions()
                .mode()
                & 0o777;
            assert_eq!(mode, 0o600, "{key}");
        }
        let tls = mtls::Tls::load(
            &dir.path().join("ca.pem"),
            &dir.path().join("alice.pem"),
            &dir.path().join("alice.key"),
        );
        assert!(tls.is_ok(), "{tls:?}");
        let pem = std::fs::read(dir.path().join("alice.pem")).unwrap();
        let der: rustls_pki_types::CertificateDer =
            rustls_pki_types::pem::PemObject::from_pem_slice(&pem).unwrap();
        assert_eq!(mtls::role_of(&der), Some(mtls::Role::Operator));
    }

    #[test]
    fn an_unknown_role_or_a_bad_name_writes_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let target = dir.path().join("pki");
        let err = issue(&target, "root", "alice").unwrap_err().to_string();
        assert!(err.contains("is not a role"), "{err}");
        let err = issue(&target, "operator", "../alice")
            .unwrap_err()
            .to_string();
        assert!(err.contains("--name"), "{err}");
        assert!(!target.exists(), "something was written");
    }
}
