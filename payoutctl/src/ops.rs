//! What the operator commands (`payout`, `lock`, `outbox`) share: which deployment they talk to
//! ([`Deployment`]), the exit codes every `payoutctl` command keeps ([`exit`]), and the plain-text
//! tables they print by default.
//!
//! A command reaches only the parts it needs, each named by its own flag (a deployment) or found
//! in the local stack's record (no endpoint flag and no certificate given). Reads go through a
//! read-only role (the reconciler's, in the local stack); the one write a command makes in a
//! database (a quarantine replay) goes through the role that owns it there.

use anyhow::Context;
use clap::Args as ClapArgs;

use crate::record::{StackRecord, SystemRecord};

/// Exit codes, the same for every `payoutctl` command (the after-help of `payoutctl --help` and
/// the README's "Operating it" carry the table).
pub mod exit {
    /// Done; nothing wrong found.
    pub const OK: u8 = 0;
    /// A problem found or an action refused: not found, refused by the service or the workflow,
    /// a violation, a database not current, or any error once connected.
    pub const PROBLEM: u8 = 1;
    /// Usage: a flag or a value that does not parse (clap's own code); nothing was done.
    pub const USAGE: u8 = 2;
    /// Could not connect: a database, a service, Temporal or etcd did not answer, or there is no
    /// deployment to talk to (no stack record); nothing was done.
    pub const UNREACHABLE: u8 = 3;

    /// The table, as `payoutctl --help` prints it after the commands.
    pub const TABLE: &str = "Exit status (every command):\n  \
        0  done, nothing wrong found\n  \
        1  a problem found or an action refused (not found, refused, a violation, a database \
        not current)\n  \
        2  usage: a flag or value that does not parse; nothing was done\n  \
        3  could not connect (a database, a service, Temporal, etcd, or no stack record); \
        nothing was done";

    /// A part of the deployment did not answer: exit status [`UNREACHABLE`]. Make one with
    /// [`unreachable`]; `payoutctl`'s `main` finds it anywhere in the chain.
    #[derive(Debug)]
    pub struct Unreachable {
        pub what: String,
        pub detail: String,
    }

    impl std::fmt::Display for Unreachable {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            write!(f, "could not connect to {}: {}", self.what, self.detail)
        }
    }

    impl std::error::Error for Unreachable {}

    /// `error`, marked as a failure to connect to `what`.
    pub fn unreachable(what: impl Into<String>, error: impl std::fmt::Display) -> anyhow::Error {
        anyhow::Error::new(Unreachable {
            what: what.into(),
            detail: format!("{error:#}"),
        })
    }

    /// The exit status of a command that ended in `error`.
    pub fn code_of(error: &anyhow::Error) -> u8 {
        if error.chain().any(|c| c.is::<Unreachable>()) {
            UNREACHABLE
        } else {
            PROBLEM
        }
    }
}

/// Where the operator commands find the deployment. With no endpoint flag and no certificate
/// flag, the local stack (its record under `--state-dir`); otherwise a deployment, where each
/// command requires the flags of the parts it uses.
#[derive(ClapArgs, Clone, Debug)]
pub struct Deployment {
    /// State directory of the local stack (used when no endpoint or certificate flag is given).
    #[arg(long, env = "PAYOUT_STATE_DIR", default_value = crate::record::DEFAULT_STATE_DIR,
          value_parser = crate::record::state_dir_arg)]
    pub state_dir: std::path::PathBuf,
    /// A deployment's paydb, as a read-only role (the reconciler's; the password in the
    /// environment, never on a command line).
    #[arg(long, env = "PAYOUT_PAYDB_URL")]
    pub paydb_url: Option<String>,
    /// A deployment's proxydb, as a read-only role (the reconciler's).
    #[arg(long, env = "PAYOUT_PROXYDB_URL")]
    pub proxydb_url: Option<String>,
    /// A deployment's gldb, as a read-only role (the reconciler's).
    #[arg(long, env = "PAYOUT_GLDB_URL")]
    pub gldb_url: Option<String>,
    /// The payment resource (`https://host:port`).
    #[arg(long, env = "PAYOUT_PAYMENT_URL")]
    pub payment_url: Option<String>,
    /// The rail proxy (`https://host:port`): the rail's movements are asked through its
    /// read-only lookup.
    #[arg(long, env = "PAYOUT_PROXY_URL")]
    pub proxy_url: Option<String>,
    /// The lock service (`https://host:port`).
    #[arg(long, env = "PAYOUT_LOCK_URL")]
    pub lock_url: Option<String>,
    /// Temporal, configured as the `temporal` CLI is (TEMPORAL_ADDRESS, TEMPORAL_NAMESPACE,
    /// TLS, API key, profiles: `payout_workflows::client`). The local stack's Temporal when no
    /// deployment is named.
    #[command(flatten)]
    pub temporal: payout_workflows::client::TemporalArgs,
    /// A deployment's certificate authority (PEM): every service call is mutual TLS.
    #[arg(long = "tls-ca", env = "PAYOUT_TLS_CA")]
    pub tls_ca: Option<std::path::PathBuf>,
    /// This operator's certificate (`payoutctl pki issue --role operator --name NAME`).
    #[arg(long = "tls-cert", env = "PAYOUT_TLS_CERT")]
    pub tls_cert: Option<std::path::PathBuf>,
    /// This operator's certificate key.
    #[arg(long = "tls-key", env = "PAYOUT_TLS_KEY")]
    pub tls_key: Option<std::path::PathBuf>,
}

/// The local stack's or the deployment's parts, resolved one at a time.
pub struct Parts {
    deployment: Deployment,
    /// The local stack's record; `None` for a deployment.
    record: Option<(StackRecord, SystemRecord)>,
}

impl Deployment {
    /// Whether a deployment is named (an endpoint or a certificate flag), not the local stack.
    pub fn is_deployment(&self) -> bool {
        [
            &self.paydb_url,
            &self.proxydb_url,
            &self.gldb_url,
            &self.payment_url,
            &self.proxy_url,
            &self.lock_url,
            &self.temporal.address,
        ]
        .iter()
        .any(|v| v.is_some())
            || self.tls_ca.is_some()
    }

    /// The parts: for the local stack its record is read now (no record: could not connect).
    pub fn parts(&self) -> anyhow::Result<Parts> {
        let record = if self.is_deployment() {
            None
        } else {
            let record = StackRecord::load(&self.state_dir).map_err(|e| {
                exit::unreachable(
                    format!("the local stack at {}", self.state_dir.display()),
                    e,
                )
            })?;
            let system = record.system.clone().with_context(|| {
                "the local stack runs no services (it was started with --infra-only)"
            })?;
            Some((record, system))
        };
        Ok(Parts {
            deployment: self.clone(),
            record,
        })
    }
}

fn required(value: &Option<String>, flag: &str) -> anyhow::Result<String> {
    value.clone().with_context(|| {
        format!("--{flag} is required with a deployment (an endpoint or --tls-ca given)")
    })
}

/// Which database a command reads.
#[derive(Clone, Copy)]
pub enum Db {
    Paydb,
    Proxydb,
    Gldb,
}

impl Db {
    pub fn name(self) -> &'static str {
        match self {
            Db::Paydb => "paydb",
            Db::Proxydb => "proxydb",
            Db::Gldb => "gldb",
        }
    }
}

impl Parts {
    /// A read-only connection to `db` (the reconciler's role in the local stack; the URL given
    /// for a deployment).
    pub async fn read(&self, db: Db) -> anyhow::Result<sqlx::PgConnection> {
        let url = match &self.record {
            None => required(
                match db {
                    Db::Paydb => &self.deployment.paydb_url,
                    Db::Proxydb => &self.deployment.proxydb_url,
                    Db::Gldb => &self.deployment.gldb_url,
                },
                &format!("{}-url", db.name()),
            )?,
            Some((record, _)) => {
                let port = match db {
                    Db::Proxydb => record.ports.pg_proxy,
                    Db::Paydb | Db::Gldb => record.ports.pg_main,
                };
                StackRecord::login_url(&self.deployment.state_dir, "reconciler", port, db.name())?
            }
        };
        connect_db(&url, db.name()).await
    }

    fn service_url(
        &self,
        given: &Option<String>,
        flag: &str,
        port: impl Fn(&SystemRecord) -> u16,
    ) -> anyhow::Result<String> {
        match &self.record {
            None => required(given, flag),
            Some((_, system)) => Ok(SystemRecord::url(port(system))),
        }
    }

    /// The local stack's system record (its task queue, its settlement window); `None` for a
    /// deployment.
    pub fn local_system(&self) -> Option<&SystemRecord> {
        self.record.as_ref().map(|(_, system)| system)
    }

    pub fn payment_url(&self) -> anyhow::Result<String> {
        self.service_url(&self.deployment.payment_url, "payment-url", |s| {
            s.ports.payment_resource
        })
    }

    pub fn proxy_url(&self) -> anyhow::Result<String> {
        self.service_url(&self.deployment.proxy_url, "proxy-url", |s| {
            s.ports.rail_proxy
        })
    }

    pub fn lock_url(&self) -> anyhow::Result<String> {
        self.service_url(&self.deployment.lock_url, "lock-url", |s| {
            s.ports.lock_server
        })
    }

    /// Connects to Temporal: the deployment's as configured, or the local stack's.
    pub async fn temporal(&self, identity: &str) -> anyhow::Result<temporalio_client::Client> {
        use payout_workflows::client::{connect_to, TemporalArgs, DEFAULT_NAMESPACE};
        let args = match &self.record {
            None => self.deployment.temporal.clone(),
            // Through the local stack's Temporal front, with its operator certificate.
            Some((record, _)) => TemporalArgs {
                address: Some(record.temporal_address()),
                namespace: Some(
                    self.deployment
                        .temporal
                        .namespace
                        .clone()
                        .unwrap_or_else(|| DEFAULT_NAMESPACE.to_string()),
                ),
                config_file: Some(StackRecord::temporal_clients_file(
                    &self.deployment.state_dir,
                )),
                profile: Some(mtls::Role::Operator.name().to_string()),
            },
        };
        let target = args.resolve()?;
        connect_to(&target, identity)
            .await
            .map_err(|e| exit::unreachable(format!("Temporal at {}", target.describe()), e))
    }

    /// The operator's certificate: the one given (a deployment), or one the local stack's own
    /// authority issues to `operator` (an operator's certificate carries its name: the lock
    /// service records a force-revoke under the name the certificate proves).
    pub fn operator_tls(&self, operator: &str) -> anyhow::Result<mtls::Tls> {
        match &self.record {
            None => match (&self.deployment.tls_ca, &self.deployment.tls_cert, &self.deployment.tls_key) {
                (Some(ca), Some(cert), Some(key)) => Ok(mtls::Tls::load(ca, cert, key)?),
                _ => anyhow::bail!(
                    "with a deployment, --tls-ca, --tls-cert and --tls-key are required (every service call is mutual TLS)"
                ),
            },
            Some(_) => {
                anyhow::ensure!(
                    mtls::is_operator_name(operator),
                    "--operator {operator:?}: an operator's name is one DNS label (letters, digits and '-', at most 63)"
                );
                let authority = mtls::issue::Authority::open_or_create(
                    &self.deployment.state_dir.join("system").join("pki"),
                )?;
                Ok(authority.issue(mtls::Role::Operator, operator)?.tls())
            }
        }
    }
}

/// The operator name a read-only command presents in the local stack (nothing is recorded
/// under it).
pub const READER_NAME: &str = "payoutctl";

/// Connects to a database, or fails as unreachable.
pub async fn connect_db(url: &str, name: &str) -> anyhow::Result<sqlx::PgConnection> {
    db_access::connect(url)
        .await
        .map_err(|e| exit::unreachable(format!("{name} at {}", db_access::redact(url)), e))
}

/// A plain-text table: a header row and rows, each column as wide as its widest cell.
pub fn table(header: &[&str], rows: &[Vec<String>]) -> String {
    let mut widths: Vec<usize> = header.iter().map(|h| h.chars().count()).collect();
    for row in rows {
        for (i, cell) in row.iter().enumerate() {
            if i < widths.len() {
                widths[i] = widths[i].max(cell.chars().count());
            }
        }
    }
    let line = |cells: Vec<&str>| {
        let mut out = String::new();
        for (i, cell) in cells.iter().enumerate() {
            if i + 1 == cells.len() {
                out.push_str(cell);
            } else {
                out.push_str(&format!("{cell:<width$}  ", width = widths[i]));
            }
        }
        out.trim_end().to_string() + "\n"
    };
    let mut out = line(header.to_vec());
    for row in rows {
        out.push_str(&line(row.iter().map(String::as_str).collect()));
    }
    out
}

/// An optional cell: `-` when absent.
pub fn cell<T: std::fmt::Display>(value: &Option<T>) -> String {
    value
        .as_ref()
        .map(|v| v.to_string())
        .unwrap_or_else(|| "-".into())
}

/// Test support for a command group's subcommands `C` (`payout`, `lock`, ...), outside the
/// binary's own parser.
#[cfg(test)]
pub(crate) mod cli_test {
    use clap::Subcommand;

    fn command<C: Subcommand>() -> clap::Command {
        C::augment_subcommands(clap::Command::new("payoutctl")).subcommand_required(true)
    }

    /// Parses `args` as `payoutctl <group> args...` would after the group's name.
    pub(crate) fn parse<C: Subcommand>(args: &[&str]) -> Result<C, clap::Error> {
        let matches = command::<C>()
            .try_get_matches_from(std::iter::once("payoutctl").chain(args.iter().copied()))?;
        C::from_arg_matches(&matches)
    }

    /// Every subcommand of `C` (recursively) says what it does and every flag has its help.
    pub(crate) fn assert_every_flag_has_help<C: Subcommand>() {
        fn check(command: &clap::Command) {
            for sub in command.get_subcommands() {
                assert!(sub.get_about().is_some(), "{}", sub.get_name());
                for arg in sub.get_arguments() {
                    assert!(
                        arg.get_help().is_some() || arg.get_id() == "help",
                        "{} --{}",
                        sub.get_name(),
                        arg.get_id()
                    );
                }
                check(sub);
            }
        }
        check(&command::<C>());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_table_aligns_its_columns_and_trims_the_last() {
        let text = table(
            &["ID", "STATE"],
            &[
                vec!["p-1".into(), "POSTED".into()],
                vec!["p-100".into(), "-".into()],
            ],
        );
        assert_eq!(text, "ID     STATE\np-1    POSTED\np-100  -\n");
    }

    #[test]
    fn an_unreachable_part_anywhere_in_the_chain_exits_3_anything_else_1() {
        let e = exit::unreachable("paydb at postgres://r:***@h/paydb", "Connection refused")
            .context("reading the payout");
        assert_eq!(exit::code_of(&e), exit::UNREACHABLE);
        assert!(
            format!("{e:#}").contains("could not connect to paydb"),
            "{e:#}"
        );
        assert_eq!(
            exit::code_of(&anyhow::anyhow!("no payout p-1")),
            exit::PROBLEM
        );
    }
}
