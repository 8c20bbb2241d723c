//! The local stack's record (`<state dir>/stack.json`): where each part listens and which process
//! it is. `payoutdev stack up` writes it; the operator commands read it to find the deployment
//! when no endpoint is given (`crate::target`). Its types are plain data, so the operator CLI
//! needs nothing of the developer harness that starts the stack.

use std::path::Path;

use anyhow::Context;
use serde::{Deserialize, Serialize};

/// The local stack's state directory, relative to the working directory.
pub const DEFAULT_STATE_DIR: &str = ".state/stack";

/// The value parser of every `--state-dir` / `PAYOUT_STATE_DIR`: the directory made absolute
/// against the working directory at the command's start. Every path the stack writes into a
/// configuration or a saved command line is built from it, and a relative one is resolved later
/// against whatever folder reads it: Prometheus resolved the default `.state/stack`'s rule file
/// against its configuration's own folder and loaded no rule; a part restarted from another
/// working directory would look for its files there.
pub fn state_dir_arg(value: &str) -> Result<std::path::PathBuf, String> {
    if value.is_empty() {
        return Err("the state directory must not be empty".into());
    }
    std::path::absolute(value).map_err(|e| format!("{value}: {e}"))
}
/// The task queue of the local stack's workers.
pub const TASK_QUEUE: &str = "payouts";
const RECORD_FILE: &str = "stack.json";

/// The infrastructure's ports (PostgreSQL x2, etcd's members, Temporal and its UI).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct StackPorts {
    pub pg_main: u16,
    pub pg_proxy: u16,
    pub etcd_clients: Vec<u16>,
    pub temporal: u16,
    pub temporal_ui: u16,
    pub temporal_http: u16,
    pub temporal_metrics: u16,
}

/// Our services' ports.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SystemPorts {
    pub lock_server: u16,
    pub payment_resource: u16,
    pub rail_stub: u16,
    pub rail_proxy: u16,
    pub general_ledger: u16,
    /// `/metrics` of each service, in the order above, then the dispatcher's.
    pub metrics: Vec<u16>,
    /// Worker i serves `/metrics` and `/healthz` on this + i (`None` in a record written
    /// before workers served them).
    #[serde(default)]
    pub worker_metrics_base: Option<u16>,
    /// The rail stub's admin API (0 in a record written before it had its own listener).
    #[serde(default)]
    pub rail_stub_admin: u16,
}

/// The databases' URLs.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Databases {
    pub paydb: String,
    pub proxydb: String,
    pub gldb: String,
}

#[derive(Debug, Serialize, Deserialize)]
pub struct StackRecord {
    pub ports: StackPorts,
    pub parts: Vec<Part>,
    /// Our services, when they were started.
    #[serde(default)]
    pub system: Option<SystemRecord>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SystemRecord {
    pub ports: SystemPorts,
    pub databases: Databases,
    pub task_queue: String,
    pub settlement_window_ms: u64,
}

impl SystemRecord {
    /// A gRPC endpoint of the stack: every one is mutual TLS.
    pub fn url(port: u16) -> String {
        format!("https://127.0.0.1:{port}")
    }
    pub fn payment_url(&self) -> String {
        Self::url(self.ports.payment_resource)
    }
    /// The rail stub's admin API (HTTPS, the harness's certificate only: ground truth, faults).
    /// Its payments API stands for the external rail, which only the proxy calls.
    pub fn rail_url(&self) -> String {
        format!("https://127.0.0.1:{}", self.ports.rail_stub_admin)
    }
    pub fn proxy_url(&self) -> String {
        Self::url(self.ports.rail_proxy)
    }
}

/// The lock-server's etcd key prefix in the local stack.
pub const LOCK_ETCD_PREFIX: &str = "/payout/lock/";

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Part {
    pub name: String,
    pub pid: u32,
    pub address: String,
}

impl StackRecord {
    pub fn load(state_dir: &Path) -> anyhow::Result<Self> {
        let path = state_dir.join(RECORD_FILE);
        let text = std::fs::read_to_string(&path).with_context(|| {
            format!(
                "no stack record at {} (run `payoutdev stack up`)",
                path.display()
            )
        })?;
        serde_json::from_str(&text).with_context(|| format!("reading {}", path.display()))
    }

    pub fn save(&self, state_dir: &Path) -> anyhow::Result<()> {
        let tmp = state_dir.join(format!("{RECORD_FILE}.tmp"));
        std::fs::write(&tmp, serde_json::to_vec_pretty(self)?)?;
        std::fs::rename(&tmp, state_dir.join(RECORD_FILE))?;
        Ok(())
    }

    /// One of the stack's PostgreSQL servers: TLS, its certificate from the stack's authority.
    pub fn pg_server(state_dir: &Path, port: u16) -> db_access::Server {
        let state_dir = state_dir
            .canonicalize()
            .unwrap_or_else(|_| state_dir.to_path_buf());
        db_access::Server {
            host: "127.0.0.1".into(),
            port,
            ca_file: state_dir.join("pki").join("ca.pem"),
        }
    }

    /// The superuser's URL of `db`, without its password: what is recorded and printed.
    pub fn pg_url(&self, state_dir: &Path, port: u16, db: &str) -> String {
        Self::pg_server(state_dir, port).url_without_password("postgres", db)
    }

    /// (database, url without a password) for every database of the system.
    pub fn database_urls(&self, state_dir: &Path) -> Vec<(&'static str, String)> {
        self.databases()
            .into_iter()
            .map(|(db, port)| (db.name(), self.pg_url(state_dir, port, db.name())))
            .collect()
    }

    /// Every database of the system and the port of the server it is on.
    pub fn databases(&self) -> Vec<(db_access::Database, u16)> {
        use db_access::Database;
        vec![
            (Database::Paydb, self.ports.pg_main),
            (Database::Gldb, self.ports.pg_main),
            (Database::Lockdb, self.ports.pg_main),
            (Database::Proxydb, self.ports.pg_proxy),
        ]
    }

    /// `login`'s URL of `db` on the server at `port`, with the password the stack generated
    /// (`<state dir>/db-credentials.json`, mode 0600). It holds a secret: never print it.
    pub fn login_url(state_dir: &Path, login: &str, port: u16, db: &str) -> anyhow::Result<String> {
        let path = state_dir.join(db_access::CREDENTIALS_FILE);
        let credentials = db_access::Credentials::load(&path)
            .with_context(|| format!("the stack's database credentials ({})", path.display()))?;
        let password = credentials
            .password(login)
            .with_context(|| format!("no password for {login} in {}", path.display()))?;
        Ok(Self::pg_server(state_dir, port).url(login, &password, db))
    }

    pub fn etcd_endpoints(&self) -> Vec<String> {
        self.ports
            .etcd_clients
            .iter()
            .map(|p| format!("https://127.0.0.1:{p}"))
            .collect()
    }

    pub fn temporal_address(&self) -> String {
        format!("127.0.0.1:{}", self.ports.temporal)
    }

    /// The UI behind the Temporal front's login (user `operator`, password in
    /// [`StackRecord::temporal_ui_password_file`]).
    pub fn ui_url(&self) -> String {
        format!("https://127.0.0.1:{}", self.ports.temporal_ui)
    }

    /// The Temporal front's client profiles of the local stack, one per admitted role (what the
    /// test kit writes beside the dev server's folder): `--temporal-config-file` /
    /// `TEMPORAL_CONFIG_FILE` with the profile `operator`.
    /// The harness's TLS to the local stack's rail stub: the rail's authority and the harness's
    /// certificate, where the test kit's `rail::RailTls` writes them (`system/rail-pki`).
    pub fn rail_harness_tls(state_dir: &Path) -> anyhow::Result<mtls::Tls> {
        let dir = state_dir.join("system").join("rail-pki");
        mtls::Tls::load(
            &dir.join("ca.pem"),
            &dir.join("harness.pem"),
            &dir.join("harness.key"),
        )
        .with_context(|| {
            format!(
                "the harness's certificate of the local rail in {} (restart the stack)",
                dir.display()
            )
        })
    }

    pub fn temporal_clients_file(state_dir: &Path) -> std::path::PathBuf {
        state_dir
            .join("temporal-clients")
            .join("temporal-clients.toml")
    }

    /// The local stack's UI password file (mode 0600).
    pub fn temporal_ui_password_file(state_dir: &Path) -> std::path::PathBuf {
        state_dir
            .join("temporal-clients")
            .join("temporal-ui.password")
    }
}
