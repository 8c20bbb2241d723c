//! `payoutctl pki`: the certificates of a deployment (every gRPC call is mutual TLS).
//!
//! The authority and what it issues live in separate folders (issue 34): `pki init --authority A`
//! makes the authority (`A/ca.pem`, and `A/ca.key` mode 0600), which stays with the operator and is
//! mounted by no service; `pki issue --authority A --out O --role ROLE --name NAME` writes
//! `O/ca.pem`, `O/NAME.pem` and `O/NAME.key` (mode 0600), one folder per process, so a process's
//! container holds its own key and nobody else's. Issuing refuses a folder without `ca.key` (it
//! never makes up a new authority over an old `ca.pem`). A service takes its files as `--tls-ca
//! O/ca.pem --tls-cert O/NAME.pem --tls-key O/NAME.key` (or `PAYOUT_TLS_CA`, `PAYOUT_TLS_CERT`,
//! `PAYOUT_TLS_KEY`); an operator gets a certificate of role `operator` the same way, into a
//! folder of their own, and hands it to payoutctl with the same three flags.
//! Each certificate of a role carries it twice: as its DNS subject name (what our services check)
//! and as the subject's `OU` (what the Temporal front, nginx, checks: it cannot read the SAN).
//!
//! `pki issue-server --authority A --out O --name NAME --host H...` issues a server certificate with no role:
//! a database, an etcd member, or the Temporal front (`--name temporal --host temporal --host
//! 127.0.0.1`; every Temporal client sets the server name `temporal`).
//!
//! `pki fingerprint --cert FILE` prints a certificate's fingerprints; `pki deny --cert FILE
//! --denylist FILE --reason TEXT` appends its line to a certificate denylist (`mtls::denylist`):
//! every server reading that file refuses the certificate within seconds, whatever its role. No
//! authority key is needed (services/lock-server/RESTORE.md, "Certificates").

use std::path::PathBuf;

use anyhow::Context;
use clap::{Args as ClapArgs, Subcommand};

#[derive(Subcommand)]
pub enum Command {
    /// Make a new certificate authority in a folder of its own (refused if one is there).
    Init(InitArgs),
    /// Issue a certificate for one process (or one operator) into its own folder.
    Issue(IssueArgs),
    /// Issue a server certificate for a database or etcd member, named by every host name and
    /// address its clients connect to (each is checked: `sslmode=verify-full`).
    IssueServer(IssueServerArgs),
    /// Print a certificate's SHA-256 and SHA-1 fingerprints (its denylist line).
    Fingerprint(FingerprintArgs),
    /// Revoke a certificate: append its fingerprints to a denylist every server reads.
    Deny(DenyArgs),
}

#[derive(ClapArgs)]
pub struct FingerprintArgs {
    /// The certificate (PEM).
    #[arg(long)]
    pub cert: PathBuf,
}

#[derive(ClapArgs)]
pub struct DenyArgs {
    /// The certificate to refuse (PEM).
    #[arg(long)]
    pub cert: PathBuf,
    /// The denylist file the servers read (PAYOUT_TLS_DENYLIST); created if missing.
    #[arg(long)]
    pub denylist: PathBuf,
    /// Why (the incident or ticket): kept as the line's comment.
    #[arg(long)]
    pub reason: String,
}

fn entry_of(cert: &std::path::Path) -> anyhow::Result<mtls::denylist::Entry> {
    let pem = std::fs::read(cert).with_context(|| format!("reading {}", cert.display()))?;
    mtls::denylist::entry_of_pem(&pem)
        .with_context(|| format!("{} holds no PEM certificate", cert.display()))
}

#[derive(ClapArgs)]
pub struct InitArgs {
    /// The authority's folder (`ca.pem`, `ca.key`): the operator's, mounted by no service.
    #[arg(long)]
    pub authority: PathBuf,
}

#[derive(ClapArgs)]
pub struct IssueServerArgs {
    /// The authority's folder (`ca.pem`, `ca.key`; `pki init`).
    #[arg(long)]
    pub authority: PathBuf,
    /// The folder the certificate goes to, with the authority's `ca.pem`: the process's own.
    #[arg(long)]
    pub out: PathBuf,
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
    /// The authority's folder (`ca.pem`, `ca.key`; `pki init`).
    #[arg(long)]
    pub authority: PathBuf,
    /// The folder the certificate goes to, with the authority's `ca.pem`: the process's own.
    #[arg(long)]
    pub out: PathBuf,
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
        Command::Init(args) => {
            mtls::issue::Authority::init(&args.authority)?;
            println!("{}", args.authority.join("ca.pem").display());
            eprintln!(
                "payoutctl: a new authority in {} (ca.key mode 0600): keep the folder with the \
                 operator; issue each process into its own folder with --out",
                args.authority.display()
            );
            Ok(std::process::ExitCode::SUCCESS)
        }
        Command::Issue(args) => {
            let role = mtls::Role::parse(&args.role)?;
            check_name(&args.name)?;
            let authority = mtls::issue::Authority::open(&args.authority)?;
            let files = authority.issue_to(role, &args.name, &args.out)?;
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
            let authority = mtls::issue::Authority::open(&args.authority)?;
            let hosts: Vec<&str> = args.hosts.iter().map(String::as_str).collect();
            let files = authority
                .issue_named(&hosts, &args.name)?
                .write(&args.out, &args.name)?;
            println!("{} {}", files.cert.display(), files.key.display());
            Ok(std::process::ExitCode::SUCCESS)
        }
        Command::Fingerprint(args) => {
            println!("{}", entry_of(&args.cert)?.line(""));
            Ok(std::process::ExitCode::SUCCESS)
        }
        Command::Deny(args) => {
            anyhow::ensure!(!args.reason.trim().is_empty(), "--reason must say why");
            let entry = entry_of(&args.cert)?;
            mtls::denylist::append(&args.denylist, &entry, &args.reason)
                .with_context(|| format!("appending to {}", args.denylist.display()))?;
            // The whole file must still load: a server would otherwise keep its last good list.
            mtls::denylist::Denylist::load(&args.denylist)?;
            println!("{}", entry.line(&args.reason));
            eprintln!(
                "payoutctl: {} denied in {}; every server reading it refuses the certificate within {} s",
                args.cert.display(),
                args.denylist.display(),
                mtls::denylist::RELOAD_MS / 1_000
            );
            Ok(std::process::ExitCode::SUCCESS)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    /// Issues into `dir` from the authority in `dir`'s sibling `authority` (made on first use).
    fn issue(dir: &std::path::Path, role: &str, name: &str) -> anyhow::Result<()> {
        let authority = dir.with_file_name("authority");
        if !authority.join("ca.key").exists() {
            run(Command::Init(InitArgs {
                authority: authority.clone(),
            }))?;
        }
        run(Command::Issue(IssueArgs {
            authority,
            out: dir.to_path_buf(),
            role: role.into(),
            name: name.into(),
        }))
        .map(|_| ())
    }

    /// Issue 34, rows 1a and 1e: the authority's key stays in its own folder, never in a
    /// process's; issuing from a folder without `ca.key` (the key moved away) is refused and
    /// writes nothing, where `--dir` used to make a new authority over the old `ca.pem`.
    #[test]
    fn the_authority_key_stays_in_its_folder_and_issuing_needs_it() {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("worker");
        issue(&out, "worker", "worker").unwrap();
        let mut files: Vec<String> = std::fs::read_dir(&out)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        files.sort();
        assert_eq!(files, ["ca.pem", "worker.key", "worker.pem"]);
        // An operator who moved ca.key off the host and issues from the certificates' folder.
        let err = run(Command::Issue(IssueArgs {
            authority: out.clone(),
            out: out.clone(),
            role: "intake".into(),
            name: "x".into(),
        }))
        .unwrap_err()
        .to_string();
        assert!(err.contains("no authority key"), "{err}");
        assert!(!out.join("x.pem").exists() && !out.join("ca.key").exists());
        let err = run(Command::Init(InitArgs {
            authority: dir.path().join("authority"),
        }))
        .unwrap_err()
        .to_string();
        assert!(err.contains("already holds an authority"), "{err}");
    }

    #[test]
    fn deny_appends_the_certificates_line_once_and_the_list_loads() {
        let dir = tempfile::tempdir().unwrap();
        issue(dir.path(), "reconciler", "leaked").unwrap();
        issue(dir.path(), "reconciler", "kept").unwrap();
        let list = dir.path().join("denylist");
        for _ in 0..2 {
            run(Command::Deny(DenyArgs {
                cert: dir.path().join("leaked.pem"),
                denylist: list.clone(),
                reason: "INC-42".into(),
            }))
            .unwrap();
        }
        let loaded = mtls::denylist::Denylist::load(&list).unwrap();
        assert_eq!(loaded.len(), 1);
        let fingerprint = |name: &str| {
            entry_of(&dir.path().join(format!("{name}.pem")))
                .unwrap()
                .sha256
        };
        assert!(loaded.is_denied(&fingerprint("leaked")));
        assert!(!loaded.is_denied(&fingerprint("kept")));
        let text = std::fs::read_to_string(&list).unwrap();
        assert!(
            text.contains("# INC-42") && text.contains(" sha1:"),
            "{text}"
        );
        assert!(run(Command::Deny(DenyArgs {
            cert: dir.path().join("missing.pem"),
            denylist: list,
            reason: "x".into(),
        }))
        .is_err());
    }

    #[test]
    fn issued_files_load_name_their_role_and_keep_keys_owner_only() {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("issued");
        issue(&out, "operator", "alice").unwrap();
        issue(&out, "worker", "worker-1").unwrap();
        for key in [
            "authority/ca.key",
            "issued/alice.key",
            "issued/worker-1.key",
        ] {
            let mode = std::fs::metadata(dir.path().join(key))
                .unwrap()
                .permissions()
                .mode()
                & 0o777;
            assert_eq!(mode, 0o600, "{key}");
        }
        let tls = mtls::Tls::load(
            &out.join("ca.pem"),
            &out.join("alice.pem"),
            &out.join("alice.key"),
        );
        assert!(tls.is_ok(), "{tls:?}");
        let pem = std::fs::read(out.join("alice.pem")).unwrap();
        let der: rustls_pki_types::CertificateDer =
            rustls_pki_types::pem::PemObject::from_pem_slice(&pem).unwrap();
        assert_eq!(mtls::role_of(&der), Some(mtls::Role::Operator));
    }

    #[test]
    fn an_unknown_role_or_a_bad_name_writes_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let target = dir.path().join("pki");
        run(Command::Init(InitArgs {
            authority: dir.path().join("authority"),
        }))
        .unwrap();
        let err = issue(&target, "root", "alice").unwrap_err().to_string();
        assert!(err.contains("is not a role"), "{err}");
        let err = issue(&target, "operator", "../alice")
            .unwrap_err()
            .to_string();
        assert!(err.contains("--name"), "{err}");
        assert!(!target.exists(), "something was written");
    }
}
