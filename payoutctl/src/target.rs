//! Which deployment a command talks to: the local stack (its state directory's record), or an
//! existing deployment such as the docker compose one, named by its endpoints.

use anyhow::Context;
use clap::Args as ClapArgs;

use crate::record::{StackRecord, LOCK_ETCD_PREFIX, TASK_QUEUE};

#[derive(ClapArgs, Clone)]
pub struct Target {
    #[arg(long, env = "PAYOUT_STATE_DIR", default_value = crate::record::DEFAULT_STATE_DIR)]
    pub state_dir: std::path::PathBuf,
    /// An existing deployment instead of the local stack (e.g. docker compose: see
    /// deploy/README.md). With it, every endpoint below is required.
    #[arg(long, env = "PAYOUT_PAYDB_URL")]
    pub paydb_url: Option<String>,
    #[arg(long, env = "PAYOUT_PROXYDB_URL")]
    pub proxydb_url: Option<String>,
    #[arg(long, env = "PAYOUT_GLDB_URL")]
    pub gldb_url: Option<String>,
    /// The rail (stub) base URL: its movements are the ground truth.
    #[arg(long, env = "PAYOUT_RAIL_URL")]
    pub rail_url: Option<String>,
    #[arg(long, env = "PAYOUT_PAYMENT_URL")]
    pub payment_url: Option<String>,
    /// The rail proxy: the reconciler asks the rail through its read-only lookup.
    #[arg(long, env = "PAYOUT_PROXY_URL")]
    pub proxy_url: Option<String>,
    /// Temporal frontend, host:port.
    #[arg(long, env = "PAYOUT_TEMPORAL_ADDRESS")]
    pub temporal_address: Option<String>,
    #[arg(long, env = "PAYOUT_TEMPORAL_UI")]
    pub temporal_ui: Option<String>,
    /// The lock service's etcd endpoints (comma-separated), for the grant records.
    #[arg(long, env = "PAYOUT_ETCD_ENDPOINTS", value_delimiter = ',')]
    pub etcd_endpoints: Vec<String>,
    #[arg(long, env = "PAYOUT_LOCK_PREFIX", default_value = LOCK_ETCD_PREFIX)]
    pub lock_prefix: String,
    #[arg(long, env = "PAYOUT_TASK_QUEUE", default_value = TASK_QUEUE)]
    pub task_queue: String,
    /// The rail's settlement window in the target deployment.
    #[arg(long, env = "PAYOUT_SETTLEMENT_WINDOW_MS", default_value_t = 2000)]
    pub settlement_window_ms: u64,
}

/// Every endpoint a command needs, wherever it came from.
pub struct Resolved {
    pub paydb: String,
    pub proxydb: String,
    pub gldb: String,
    pub rail_url: String,
    pub payment_url: String,
    pub proxy_url: String,
    pub temporal_address: String,
    pub ui_url: String,
    pub etcd_endpoints: Vec<String>,
    pub lock_prefix: String,
    pub task_queue: String,
    pub settlement_window_ms: u64,
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
                payment_url: need(&self.payment_url, "payment-url")?,
                proxy_url: need(&self.proxy_url, "proxy-url")?,
                ui_url: self
                    .temporal_ui
                    .clone()
                    .unwrap_or_else(|| "(not given)".into()),
                temporal_address,
                etcd_endpoints: self.etcd_endpoints.clone(),
                lock_prefix: self.lock_prefix.clone(),
                task_queue: self.task_queue.clone(),
                settlement_window_ms: self.settlement_window_ms,
            });
        }
        let record = StackRecord::load(&self.state_dir)?;
        let system = record
            .system
            .as_ref()
            .context("the stack runs no services (it was started with --infra-only)")?;
        Ok(Resolved {
            paydb: system.databases.paydb.clone(),
            proxydb: system.databases.proxydb.clone(),
            gldb: system.databases.gldb.clone(),
            rail_url: system.rail_url(),
            payment_url: system.payment_url(),
            proxy_url: system.proxy_url(),
            temporal_address: record.temporal_address(),
            ui_url: record.ui_url(),
            etcd_endpoints: record.etcd_endpoints(),
            lock_prefix: LOCK_ETCD_PREFIX.to_string(),
            task_queue: system.task_queue.clone(),
            settlement_window_ms: system.settlement_window_ms,
        })
    }
}
