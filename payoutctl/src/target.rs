//! Which deployment a command talks to: the local stack (its state directory's record), or an
//! existing deployment such as the docker compose one, named by its endpoints.

use anyhow::Context;
use clap::Args as ClapArgs;

use crate::record::{StackRecord, LOCK_ETCD_PREFIX, TASK_QUEUE};

#[derive(ClapArgs, Clone)]
pub struct Target {
    #[arg(long, env = "PAYOUT_STATE_DIR", default_value = crate::record::DEFAULT_STATE_DIR,
          value_parser = crate::record::state_dir_arg)]
    pub state_dir: std::path::PathBuf,
    /// An existing deployment instead of the local stack (e.g. docker compose: see
    /// deploy/README.md). With it, every endpoint below is required.
    #[arg(long, env = "PAYOUT_PAYDB_URL")]
    pub paydb_url: Option<String>,
    #[arg(long, env = "PAYOUT_PROXYDB_URL")]
    pub proxydb_url: Option<String>,
    #[arg(long, env = "PAYOUT_GLDB_URL")]
    pub gldb_url: Option<String>,
    /// The rail stub's admin API (its movements are the ground truth), `https://`.
    #[arg(long, env = "PAYOUT_RAIL_URL")]
    pub rail_url: Option<String>,
    /// With a deployment: the rail's authority, and the harness's certificate and key of it (the
    /// stub's admin API serves no other). The local stack's are in its folder.
    #[arg(long, env = "PAYOUT_RAIL_CA")]
    pub rail_ca: Option<std::path::PathBuf>,
    #[arg(long, env = "PAYOUT_RAIL_CERT")]
    pub rail_cert: Option<std::path::PathBuf>,
    #[arg(long, env = "PAYOUT_RAIL_KEY")]
    pub rail_key: Option<std::path::PathBuf>,
    #[arg(long, env = "PAYOUT_PAYMENT_URL")]
    pub payment_url: Option<String>,
    /// The rail proxy: the reconciler asks the rail through its read-only lookup.
    #[arg(long, env = "PAYOUT_PROXY_URL")]
    pub proxy_url: Option<String>,
    /// With a deployment: the certificate authority, and this operator's certificate and key
    /// (`payoutctl pki issue`). The local stack's are made from its own authority.
    #[arg(long = "tls-ca", env = "PAYOUT_TLS_CA")]
    pub tls_ca: Option<std::path::PathBuf>,
    #[arg(long = "tls-cert", env = "PAYOUT_TLS_CERT")]
    pub tls_cert: Option<std::path::PathBuf>,
    #[arg(long = "tls-key", env = "PAYOUT_TLS_KEY")]
    pub tls_key: Option<std::path::PathBuf>,
    /// Temporal frontend, host:port.
    #[arg(long, env = "PAYOUT_TEMPORAL_ADDRESS")]
    pub temporal_address: Option<String>,
    #[arg(long, env = "PAYOUT_TEMPORAL_UI")]
    pub temporal_ui: Option<String>,
    /// The lock service's etcd endpoints (comma-separated, `https://`), for the grant records.
    #[arg(long, env = "PAYOUT_ETCD_ENDPOINTS", value_delimiter = ',')]
    pub etcd_endpoints: Vec<String>,
    /// etcd's authority and this operator's certificate from it (a deployment; the local stack's
    /// is issued from the stack's own authority).
    #[command(flatten)]
    pub etcd_tls: mtls::EtcdTlsArgs,
    #[arg(long, env = "PAYOUT_LOCK_PREFIX", default_value = LOCK_ETCD_PREFIX)]
    pub lock_prefix: String,
    #[arg(long, env = "PAYOUT_TASK_QUEUE", default_value = TASK_QUEUE)]
    pub task_queue: String,
    /// The rail's settlement window in the target deployment.
    #[arg(long, env = "PAYOUT_SETTLEMENT_WINDOW_MS", default_value_t = 2000)]
    pub settlement_window_ms: u64,
    /// The registered operators' public keys (`name=hex,...`, what the payment resource's
    /// PAYOUT_OPERATOR_KEYS holds): the reconciler verifies every account opening's funding
    /// against them. The local stack's own operator by default; none given for a deployment: that
    /// check is reported skipped.
    #[arg(long, env = "PAYOUT_OPERATOR_KEYS")]
    pub operator_keys: Option<String>,
}

/// The local stack's registered operator (`testkit::grants::OPERATOR`, its key beside the
/// stack's other secrets).
pub const LOCAL_OPERATOR: &str = "operator-1";

/// `--operator-keys` parsed; empty is none.
fn parse_operators(spec: Option<&str>) -> anyhow::Result<Option<grant_signing::Verifier>> {
    match spec.map(str::trim) {
        None | Some("") => Ok(None),
        Some(spec) => Ok(Some(
            grant_signing::Verifier::parse(spec).context("--operator-keys")?,
        )),
    }
}

/// The local stack's operator's public key, from its secret in the stack's folder (none if the
/// stack has none).
fn local_operators(state_dir: &std::path::Path) -> anyhow::Result<Option<grant_signing::Verifier>> {
    let file = state_dir
        .join("system")
        .join(format!("{LOCAL_OPERATOR}.key"));
    let text = match std::fs::read_to_string(&file) {
        Ok(text) => text,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e).with_context(|| format!("reading {}", file.display())),
    };
    let signer = grant_signing::Signer::from_hex(LOCAL_OPERATOR, &text)
        .with_context(|| format!("reading {}", file.display()))?;
    Ok(Some(grant_signing::Verifier::new([signer.public_key()])?))
}

/// Every endpoint a command needs, wherever it came from.
pub struct Resolved {
    pub paydb: String,
    pub proxydb: String,
    pub gldb: String,
    pub rail_url: String,
    /// The harness's TLS to the rail stub's admin API (`None`: not given for a deployment).
    pub rail_tls: Option<mtls::Tls>,
    pub payment_url: String,
    pub proxy_url: String,
    /// Where payoutctl's certificates come from: see [`Resolved::tls`].
    pub certificates: Certificates,
    pub temporal_address: String,
    /// The local stack's Temporal front profiles (`None` for a deployment, whose TLS settings
    /// come from the Temporal environment or config file): see [`Resolved::temporal_args`].
    pub temporal_clients: Option<std::path::PathBuf>,
    pub ui_url: String,
    pub etcd_endpoints: Vec<String>,
    /// etcd's authority and payoutctl's certificate from it.
    pub etcd_tls: mtls::Tls,
    pub lock_prefix: String,
    pub task_queue: String,
    pub settlement_window_ms: u64,
    /// The registered operators' public keys, for the funding check (None: not checked).
    pub operators: Option<grant_signing::Verifier>,
}

impl Target {
    pub fn is_external(&self) -> bool {
        self.paydb_url.is_some()
    }

    pub fn resolve(&self) -> anyhow::Result<Resolved> {
        if self.is_external() {
            let need = |value: &Option<String>, flag: &str| {
                value.clone().with_context(|| {
                    format!("--{flag} is required with --paydb-url (an external deployment)")
                })
            };
            anyhow::ensure!(
                !self.etcd_endpoints.is_empty(),
                "--etcd-endpoints is required with --paydb-url"
            );
            let temporal_address = need(&self.temporal_address, "temporal-address")?;
            return Ok(Resolved {
                paydb: need(&self.paydb_url, "paydb-url")?,
                proxydb: need(&self.proxydb_url, "proxydb-url")?,
                gldb: need(&self.gldb_url, "gldb-url")?,
                rail_url: need(&self.rail_url, "rail-url")?,
                rail_tls: match (&self.rail_ca, &self.rail_cert, &self.rail_key) {
                    (Some(ca), Some(cert), Some(key)) => Some(mtls::Tls::load(ca, cert, key)?),
                    (None, None, None) => None,
                    _ => anyhow::bail!("--rail-ca, --rail-cert and --rail-key go together"),
                },
                payment_url: need(&self.payment_url, "payment-url")?,
                proxy_url: need(&self.proxy_url, "proxy-url")?,
                certificates: match (&self.tls_ca, &self.tls_cert, &self.tls_key) {
                    (Some(ca), Some(cert), Some(key)) => {
                        Certificates::Given(mtls::Tls::load(ca, cert, key)?)
                    }
                    _ => anyhow::bail!(
                        "with a deployment, --tls-ca, --tls-cert and --tls-key are required (every service call is mutual TLS)"
                    ),
                },
                ui_url: self
                    .temporal_ui
                    .clone()
                    .unwrap_or_else(|| "(not given)".into()),
                temporal_address,
                temporal_clients: None,
                etcd_endpoints: self.etcd_endpoints.clone(),
                etcd_tls: self.etcd_tls.load()?,
                lock_prefix: self.lock_prefix.clone(),
                task_queue: self.task_queue.clone(),
                settlement_window_ms: self.settlement_window_ms,
                operators: parse_operators(self.operator_keys.as_deref())?,
            });
        }
        let record = StackRecord::load(&self.state_dir)?;
        let system = record
            .system
            .as_ref()
            .context("the stack runs no services (it was started with --infra-only)")?;
        // The reconciler's role: it reads every store and may write none.
        let reader =
            |port: u16, db: &str| StackRecord::login_url(&self.state_dir, "reconciler", port, db);
        Ok(Resolved {
            paydb: reader(record.ports.pg_main, "paydb")?,
            proxydb: reader(record.ports.pg_proxy, "proxydb")?,
            gldb: reader(record.ports.pg_main, "gldb")?,
            rail_url: system.rail_url(),
            rail_tls: Some(StackRecord::rail_harness_tls(&self.state_dir)?),
            payment_url: system.payment_url(),
            proxy_url: system.proxy_url(),
            // The local stack's own authority (made by `payoutdev stack up`, never committed).
            certificates: Certificates::Local(std::sync::Arc::new(
                mtls::issue::Authority::open_or_create(&self.state_dir.join("system").join("pki"))?,
            )),
            temporal_address: record.temporal_address(),
            temporal_clients: Some(StackRecord::temporal_clients_file(&self.state_dir)),
            ui_url: record.ui_url(),
            etcd_endpoints: record.etcd_endpoints(),
            etcd_tls: local_etcd_tls(&self.state_dir)?,
            lock_prefix: LOCK_ETCD_PREFIX.to_string(),
            task_queue: system.task_queue.clone(),
            settlement_window_ms: system.settlement_window_ms,
            operators: match parse_operators(self.operator_keys.as_deref())? {
                Some(given) => Some(given),
                None => local_operators(&self.state_dir)?,
            },
        })
    }
}

impl Resolved {
    /// Temporal as an operator: the local stack's front with its operator profile, or a
    /// deployment's at its address with the TLS of the Temporal environment or config file.
    pub fn temporal_args(&self) -> payout_workflows::client::TemporalArgs {
        let base = match &self.temporal_clients {
            Some(file) => payout_workflows::client::TemporalArgs::profile_of(
                file,
                mtls::Role::Operator.name(),
            ),
            None => payout_workflows::client::TemporalArgs::default(),
        };
        payout_workflows::client::TemporalArgs {
            address: Some(self.temporal_address.clone()),
            ..base
        }
    }
}

/// The name of payoutctl's etcd certificate for the local stack: a user of the stack's etcd with
/// the reconciler's read-only role on its prefix (`payoutdev stack up` makes it).
pub const LOCAL_ETCD_USER: &str = "payoutctl";

/// payoutctl's etcd client certificate for the local stack, from etcd's own authority
/// (`<state dir>/etcd-tls/pki`, made by `payoutdev stack up`; no certificate of the services'
/// authority reaches etcd), named [`LOCAL_ETCD_USER`].
pub fn local_etcd_tls(state_dir: &std::path::Path) -> anyhow::Result<mtls::Tls> {
    Ok(
        mtls::issue::Authority::open(&state_dir.join("etcd-tls").join("pki"))?
            .issue_named(
                &[&format!("{LOCAL_ETCD_USER}.etcd-client")],
                LOCAL_ETCD_USER,
            )?
            .tls(),
    )
}

/// The certificates payoutctl calls services with.
#[derive(Clone)]
pub enum Certificates {
    /// The local stack: its own authority (made by `payoutdev stack up` under the state
    /// directory, never committed) issues payoutctl a certificate of whatever role the command
    /// plays (fixture to open accounts, reconciler to check, operator to intervene).
    Local(std::sync::Arc<mtls::issue::Authority>),
    /// A deployment: the certificate the operator was issued (`--tls-*`), whatever its role;
    /// a service refuses what that role may not do.
    Given(mtls::Tls),
}

impl Resolved {
    /// A certificate for `role` (local stack), or the operator's own (deployment).
    pub fn tls(&self, role: mtls::Role) -> anyhow::Result<mtls::Tls> {
        Ok(match &self.certificates {
            Certificates::Local(authority) => authority.issue(role, "payoutctl")?.tls(),
            Certificates::Given(tls) => tls.clone(),
        })
    }
}
