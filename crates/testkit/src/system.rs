//! Every service of the payout system as a real process over a [`Stack`]: lock-server,
//! payment-resource, rail-stub, rail-proxy, general-ledger, outbox-dispatcher and N workers.
//! Each `System` has its own databases, etcd prefix and Temporal task queue, so several can share
//! one stack. The binaries must be built (`cargo build --bins`); the test command does that.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;

use crate::etcd::EtcdRole;
use crate::pki::Role;
use crate::process::{Lifetime, ManagedProcess, ProcessSpec};
use crate::stack::{PgServer, Stack};
use crate::util::{free_port, workspace_bin};

/// A service applies its migrations and binds within this on a loaded two-core machine.
pub const SERVICE_READY_TIMEOUT_MS: u64 = 60_000;

#[derive(Debug, Clone)]
pub struct SystemOptions {
    pub workers: usize,
    /// The rail stub's initial fault configuration (`POST /admin/faults` shape), if any.
    pub rail_faults_json: Option<String>,
    /// After this, the rail's lookups are authoritative.
    pub settlement_window_ms: u64,
    /// The proxy gives up on the rail after this (and records TIMEOUT).
    pub rail_timeout_ms: u64,
    /// Extra environment for every worker (e.g. lease TTLs for fault tests).
    pub worker_env: Vec<(String, String)>,
    /// Run the fault tests' worker (`payout-test-worker`: the shipped worker with the test-only
    /// stall points of `system_tests::stall` in front of its backend) instead of `payout-worker`.
    pub test_worker: bool,
    pub lifetime: Lifetime,
    /// Where logs and the stub's movement file go; a directory under the stack's state if `None`.
    pub dir: Option<PathBuf>,
    /// Fixed listen ports (payoutdev's long-lived stack); free ports if `None`.
    pub ports: Option<SystemPorts>,
    /// Fixed database names (payoutdev); fresh per-system databases if `None`.
    pub databases: Option<Databases>,
    /// Task queue; a unique one if `None`.
    pub task_queue: Option<String>,
    /// The lock-server's etcd key prefix; a unique one if `None`.
    pub etcd_prefix: Option<String>,
    /// The payment resource's resolution SLA (when an operator may abandon an ambiguous
    /// payout); its production default (one hour) if `None`.
    pub resolution_sla_ms: Option<u64>,
    /// TEST ONLY: another binary in the rail proxy's place (a test binary of the workspace that
    /// takes the proxy's flags, e.g. `rail-proxy-failpoint`) and extra arguments for it: a
    /// negative control's proxy with a protection switched off. The shipped `rail-proxy` if `None`.
    pub rail_proxy_binary: Option<(String, Vec<String>)>,
    /// The dispatcher delivers the payout workflow starts CreatePayout stages (paydb 0009), on
    /// this system's task queue with these clocks. `None` (the tests' default: they start their
    /// own workflows, with their own clocks, or none at all): `--without-workflow-starts`.
    pub workflow_starts: Option<WorkflowStarts>,
    /// Start the lock-server, the payment resource, the rail proxy and every worker under
    /// libfaketime, so that [`System::set_clock_offset`] can step their wall clocks (the
    /// `clock_jump` fault). Off: every process reads the host's clock untouched.
    pub movable_clocks: bool,
}

/// The ambiguity clocks of the workflows the dispatcher's starter starts.
#[derive(Debug, Clone, Copy)]
pub struct WorkflowStarts {
    pub settlement_window_ms: u64,
    pub resolution_sla_ms: u64,
}

impl Default for SystemOptions {
    fn default() -> Self {
        Self {
            workers: 2,
            rail_faults_json: None,
            settlement_window_ms: 2_000,
            rail_timeout_ms: 2_000,
            worker_env: Vec::new(),
            test_worker: false,
            lifetime: Lifetime::Attached,
            dir: None,
            ports: None,
            databases: None,
            task_queue: None,
            etcd_prefix: None,
            resolution_sla_ms: None,
            rail_proxy_binary: None,
            workflow_starts: None,
            movable_clocks: false,
        }
    }
}

#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct SystemPorts {
    pub lock_server: u16,
    pub payment_resource: u16,
    /// The rail stub's payments API (what the rail proxy calls).
    pub rail_stub: u16,
    pub rail_proxy: u16,
    pub general_ledger: u16,
    /// `/metrics` of each service, in the order above, then the dispatcher's (the rail stub's
    /// `/metrics` and `/healthz` on its own metrics listener).
    pub metrics: Vec<u16>,
    /// The rail stub's admin API (the harness's: ground truth, faults).
    #[serde(default)]
    pub rail_stub_admin: u16,
    /// Worker i (`worker-<i>`, started by [`System::add_worker`]) serves `/metrics` and
    /// `/healthz` on this + i; free ports if `None`.
    #[serde(default)]
    pub worker_metrics_base: Option<u16>,
}

impl SystemPorts {
    pub fn free() -> Self {
        Self {
            lock_server: free_port(),
            payment_resource: free_port(),
            rail_stub: free_port(),
            rail_proxy: free_port(),
            general_ledger: free_port(),
            metrics: (0..6).map(|_| free_port()).collect(),
            rail_stub_admin: free_port(),
            worker_metrics_base: None,
        }
    }
}

#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct Databases {
    pub paydb: String,
    pub proxydb: String,
    pub gldb: String,
}

pub struct System {
    pub ports: SystemPorts,
    pub etcd_prefix: String,
    pub databases: Databases,
    pub task_queue: String,
    /// The Temporal front's address, and its clients' profiles (one per admitted role, the SDK's
    /// envconfig format): `TemporalArgs::profile_of(&system.temporal_clients, "operator")`.
    pub temporal_address: String,
    pub temporal_clients: PathBuf,
    pub dir: PathBuf,
    /// The key the lock-server signs grants with; the guards hold its public half.
    pub grant_keys: crate::grants::SigningKey,
    /// The payment resource's instruction key (the rail proxy verifies with its public half).
    pub instruction_keys: crate::grants::SigningKey,
    /// The rail proxy's rail-fact key (the payment resource verifies with its public half).
    pub rail_fact_keys: crate::grants::SigningKey,
    /// The rail's (the stub's) answer key (the rail proxy verifies with its public half).
    pub rail_answer_keys: crate::grants::SigningKey,
    /// The system's certificate authority: every process has its own certificate from it.
    pub pki: crate::pki::Pki,
    /// The rail's own authority (apart from the system's, as a real rail's): the stub's
    /// certificate, the proxy's and the harness's client certificates.
    pub rail_tls: crate::rail::RailTls,
    /// The system's registered operator (the payment resource's `--operator-keys`).
    pub operator: crate::grants::OperatorKey,
    pub lock_server: ManagedProcess,
    pub payment_resource: ManagedProcess,
    pub rail_stub: ManagedProcess,
    pub rail_proxy: ManagedProcess,
    pub general_ledger: ManagedProcess,
    pub dispatcher: ManagedProcess,
    pub workers: Vec<ManagedProcess>,
    /// The `/metrics` and `/healthz` port of each of `workers`, in the same order.
    pub worker_metrics: Vec<u16>,
    worker_template: ProcessSpec,
    /// The wall clocks [`System::set_clock_offset`] moves, or why there are none.
    clocks: Result<crate::clock::MovableClocks, String>,
}

/// The lock-server's issued-token record (INV-04's memory), in the system's directory.
pub const ISSUED_TOKENS_FILE: &str = "lock-issued-tokens.json";
/// The system's certificate denylist, in its folder.
pub const DENYLIST_FILE: &str = "tls-denylist";
/// The folder of the movable clocks' offset files (one per process, named after it).
pub const CLOCK_DIR: &str = "clock";

/// The database name of a URL this kit made (`postgres://…/NAME?…`).
pub fn database_name(url: &str) -> &str {
    let path = url.split('?').next().unwrap_or(url);
    path.rsplit('/').next().unwrap_or(path)
}

/// Every gRPC endpoint is mutual TLS.
fn url(port: u16) -> String {
    format!("https://127.0.0.1:{port}")
}

/// The rail stub's payments and admin APIs are HTTPS, with the rail's own authority.
fn rail_url(port: u16) -> String {
    format!("https://127.0.0.1:{port}")
}

impl System {
    /// Starts every service and waits until each answers. Temporal is started if it is not yet.
    pub async fn start(stack: &Stack, options: SystemOptions) -> anyhow::Result<Self> {
        let n = free_port();
        let dir = options
            .dir
            .clone()
            .unwrap_or_else(|| stack.state_dir().join(format!("system-{n}")));
        std::fs::create_dir_all(&dir)?;
        // Logs, keys and the stub's movement file go on the services' command lines, which a
        // restart may run from another working directory: absolute, whatever was given.
        let dir = std::path::absolute(&dir)?;
        let temporal = stack.try_temporal()?;
        let databases = match &options.databases {
            Some(d) => d.clone(),
            None => Databases {
                paydb: stack
                    .provisioned_db(PgServer::Main, db_access::Database::Paydb)
                    .await,
                proxydb: stack
                    .provisioned_db(PgServer::Proxy, db_access::Database::Proxydb)
                    .await,
                gldb: stack
                    .provisioned_db(PgServer::Main, db_access::Database::Gldb)
                    .await,
            },
        };
        // Each service logs in as its own role; the URL (it holds the password) goes through the
        // environment, never the command line.
        let login = |server: PgServer, role: &str, admin_url: &str| {
            stack.pg(server).login_url(role, database_name(admin_url))
        };
        if let Some(p) = &options.ports {
            crate::util::reserve_ports(
                [
                    p.lock_server,
                    p.payment_resource,
                    p.rail_stub,
                    p.rail_proxy,
                    p.general_ledger,
                ]
                .into_iter()
                .chain(p.metrics.iter().copied()),
            );
        }
        let ports = options.ports.clone().unwrap_or_else(SystemPorts::free);
        let task_queue = options
            .task_queue
            .clone()
            .unwrap_or_else(|| format!("payouts-{}-{n}", std::process::id()));
        let etcd_prefix = options
            .etcd_prefix
            .clone()
            .unwrap_or_else(|| format!("/payout/{n}/lock/"));
        let log = |name: &str| dir.join(format!("{name}.log"));
        // The certificates every server refuses (`payoutctl pki deny` appends; kept across a
        // restart of the stack). The servers read it from PAYOUT_TLS_DENYLIST; the clients
        // ignore it.
        let denylist = dir.join(DENYLIST_FILE);
        if !denylist.exists() {
            std::fs::write(&denylist, "")?;
        }
        let spec = |name: &str| {
            Ok::<_, anyhow::Error>(
                ProcessSpec::new(name, workspace_bin(name), log(name))
                    .lifetime(options.lifetime)
                    .env("PAYOUT_TLS_DENYLIST", denylist.display().to_string()),
            )
        };
        let m = &ports.metrics;
        let clocks = if options.movable_clocks {
            crate::clock::MovableClocks::find(&dir.join(CLOCK_DIR))
        } else {
            Err("not asked for (SystemOptions::movable_clocks is off)".to_string())
        };
        let movable = |spec: ProcessSpec| match &clocks {
            Ok(clocks) => clocks.apply(spec),
            Err(_) => Ok(spec),
        };

        let grant_keys = crate::grants::SigningKey::grant(&dir)?;
        let instruction_keys = crate::grants::SigningKey::instruction(&dir)?;
        let rail_fact_keys = crate::grants::SigningKey::rail_fact(&dir)?;
        let rail_answer_keys = crate::grants::SigningKey::rail_answer(&dir)?;
        let pki = crate::pki::Pki::in_dir(&dir)?;
        let rail_tls = crate::rail::RailTls::issue(&dir)?;
        let operator = crate::grants::OperatorKey::in_dir(&dir)?;
        let lock_server = ManagedProcess::start(movable(
            spec("lock-server")?
                .args(grant_keys.lock_server_args())
                .args(pki.issue(Role::LockServer, "lock-server")?.to_args())
                .args([
                    "--listen".into(),
                    format!("127.0.0.1:{}", ports.lock_server),
                ])
                .args(["--metrics-listen".into(), format!("127.0.0.1:{}", m[0])])
                .args(["--backend", "etcd"])
                .args(["--etcd-endpoints".into(), stack.etcd_endpoints().join(",")])
                .args(
                    stack
                        .etcd_identity(EtcdRole::LockServer, &etcd_prefix)?
                        .to_args(),
                )
                .args(["--etcd-prefix".into(), etcd_prefix.clone()])
                .args([
                    "--issued-tokens-path".into(),
                    dir.join(ISSUED_TOKENS_FILE).into_os_string(),
                ]),
        )?)?;
        let payment_resource = ManagedProcess::start(movable(
            spec("payment-resource")?
                .arg("serve")
                .args([
                    "--listen".into(),
                    format!("127.0.0.1:{}", ports.payment_resource),
                ])
                .args(["--metrics-listen".into(), format!("127.0.0.1:{}", m[1])])
                .env(
                    "PAYDB_URL",
                    login(PgServer::Main, "payment_resource", &databases.paydb),
                )
                .args(["--grant-verify-keys".into(), grant_keys.verify_keys()])
                .args(instruction_keys.signing_args("instruction"))
                .args([
                    "--rail-fact-verify-keys".into(),
                    rail_fact_keys.verify_keys(),
                ])
                .args(["--operator-keys".into(), operator.registered()])
                .args(
                    pki.issue(Role::PaymentResource, "payment-resource")?
                        .to_args(),
                )
                .arg("--fixture-accounts")
                .args(
                    options
                        .resolution_sla_ms
                        .map(|ms| ["--resolution-sla-ms".to_string(), ms.to_string()])
                        .into_iter()
                        .flatten(),
                ),
        )?)?;
        let mut stub = spec("rail-stub")?
            .args(["--listen".into(), format!("127.0.0.1:{}", ports.rail_stub)])
            .args([
                "--admin-listen".into(),
                format!("127.0.0.1:{}", ports.rail_stub_admin),
            ])
            .args([
                "--metrics-listen".into(),
                format!("127.0.0.1:{}", ports.metrics[2]),
            ])
            .args(rail_answer_keys.signing_args("answer"))
            .args(rail_tls.stub_args())
            .args([
                "--movements-file".into(),
                dir.join("rail-movements.jsonl").into_os_string(),
            ])
            .args([
                "--settlement-window-ms".into(),
                options.settlement_window_ms.to_string(),
            ]);
        if let Some(faults) = &options.rail_faults_json {
            stub = stub.args(["--faults-json", faults]);
        }
        let rail_stub = ManagedProcess::start(stub)?;
        let (proxy_binary, proxy_extra) = options
            .rail_proxy_binary
            .clone()
            .unwrap_or_else(|| ("rail-proxy".to_string(), Vec::new()));
        let rail_proxy = ManagedProcess::start(movable(
            spec(&proxy_binary)?
                .args(proxy_extra)
                .args(["--listen".into(), format!("127.0.0.1:{}", ports.rail_proxy)])
                .args(["--metrics-listen".into(), format!("127.0.0.1:{}", m[3])])
                .env(
                    "RAIL_PROXY_DATABASE_URL",
                    login(PgServer::Proxy, "rail_proxy", &databases.proxydb),
                )
                .args(["--grant-verify-keys".into(), grant_keys.verify_keys()])
                .args([
                    "--instruction-verify-keys".into(),
                    instruction_keys.verify_keys(),
                ])
                .args(rail_fact_keys.signing_args("rail-fact"))
                .args(pki.issue(Role::RailProxy, "rail-proxy")?.to_args())
                .args(["--rail-url".into(), rail_url(ports.rail_stub)])
                .args(rail_tls.proxy_args())
                .args([
                    "--rail-answer-verify-keys".into(),
                    rail_answer_keys.verify_keys(),
                ])
                .args([
                    "--rail-timeout-ms".into(),
                    options.rail_timeout_ms.to_string(),
                ]),
        )?)?;
        let general_ledger = ManagedProcess::start(
            spec("general-ledger")?
                .env(
                    "GL_DATABASE_URL",
                    login(PgServer::Main, "general_ledger", &databases.gldb),
                )
                .args([
                    "--listen".into(),
                    format!("127.0.0.1:{}", ports.general_ledger),
                ])
                .args(["--metrics-listen".into(), format!("127.0.0.1:{}", m[4])])
                .arg("serve")
                .args(pki.issue(Role::GeneralLedger, "general-ledger")?.to_args()),
        )?;
        let worker_template = {
            let binary = if options.test_worker {
                "payout-test-worker"
            } else {
                "payout-worker"
            };
            let mut w = spec(binary)?
                .env("TEMPORAL_ADDRESS", temporal.address())
                .env("TEMPORAL_NAMESPACE", crate::temporal::NAMESPACE)
                .env("PAYOUT_TASK_QUEUE", task_queue.clone())
                .env("LOCK_SERVER_URL", url(ports.lock_server))
                .env("PAYMENT_RESOURCE_URL", url(ports.payment_resource))
                .env("RAIL_PROXY_URL", url(ports.rail_proxy));
            w = w.envs(temporal.env(Role::Worker));
            for (k, v) in &options.worker_env {
                w = w.env(k, v.clone());
            }
            w
        };

        // The payment resource migrates paydb (which holds the outbox) before the dispatcher reads it.
        let probe = pki.tls(Role::Reconciler);
        wait_grpc(
            ports.payment_resource,
            &payment_resource,
            &probe,
            Role::PaymentResource,
        )
        .await?;
        let starts: Vec<String> = match options.workflow_starts {
            Some(clocks) => vec![
                "--temporal-address".into(),
                temporal.address(),
                "--temporal-namespace".into(),
                crate::temporal::NAMESPACE.into(),
                "--payout-task-queue".into(),
                task_queue.clone(),
                "--settlement-window-ms".into(),
                clocks.settlement_window_ms.to_string(),
                "--resolution-sla-ms".into(),
                clocks.resolution_sla_ms.to_string(),
            ],
            None => vec!["--without-workflow-starts".into()],
        };
        let dispatcher = ManagedProcess::start(
            spec("outbox-dispatcher")?
                .envs(temporal.env(Role::OutboxDispatcher))
                .env(
                    "PAYDB_DATABASE_URL",
                    login(PgServer::Main, "outbox_dispatcher", &databases.paydb),
                )
                .arg("run")
                .args(
                    pki.issue(Role::OutboxDispatcher, "outbox-dispatcher")?
                        .to_args(),
                )
                .args(["--gl-endpoint".into(), url(ports.general_ledger)])
                .args(["--metrics-listen".into(), format!("127.0.0.1:{}", m[5])])
                .args(starts),
        )?;
        wait_grpc(ports.lock_server, &lock_server, &probe, Role::LockServer).await?;
        wait_grpc(ports.rail_proxy, &rail_proxy, &probe, Role::RailProxy).await?;
        wait_grpc(
            ports.general_ledger,
            &general_ledger,
            &probe,
            Role::GeneralLedger,
        )
        .await?;
        for port in [ports.rail_stub, ports.rail_stub_admin, ports.metrics[2]] {
            wait_tcp(port, &rail_stub).await?;
        }
        wait_tcp(m[5], &dispatcher).await?;

        let mut system = Self {
            ports,
            etcd_prefix,
            databases,
            task_queue,
            temporal_address: temporal.address(),
            temporal_clients: temporal.clients_file().to_path_buf(),
            dir,
            grant_keys,
            instruction_keys,
            rail_fact_keys,
            rail_answer_keys,
            pki,
            rail_tls,
            operator,
            lock_server,
            payment_resource,
            rail_stub,
            rail_proxy,
            general_ledger,
            dispatcher,
            workers: Vec::new(),
            worker_metrics: Vec::new(),
            worker_template,
            clocks,
        };
        for _ in 0..options.workers {
            system.add_worker()?;
        }
        Ok(system)
    }

    /// Starts one more worker (identity `worker-<index>`).
    pub fn add_worker(&mut self) -> anyhow::Result<&ManagedProcess> {
        let index = self.workers.len();
        let port = match self.ports.worker_metrics_base {
            Some(base) => base + u16::try_from(index).context("too many workers")?,
            None => free_port(),
        };
        let spec = self
            .worker_spec(&format!("worker-{index}"))
            .env("PAYOUT_WORKER_METRICS_LISTEN", format!("127.0.0.1:{port}"));
        let worker = ManagedProcess::start(spec)?;
        self.worker_metrics.push(port);
        self.workers.push(worker);
        Ok(self.workers.last().expect("just pushed"))
    }

    /// Starts a worker with `identity` that the caller owns (a test that brings a worker in
    /// mid-scenario); its log is `payout-<identity>.log` in the system's directory.
    pub fn start_worker(&self, identity: &str) -> anyhow::Result<ManagedProcess> {
        ManagedProcess::start(self.worker_spec(identity))
    }

    /// The spec of a worker with `identity`, for a caller that changes it before starting it
    /// (e.g. to run it inside a network namespace: [`crate::netns::NetNs::wrap`]). With
    /// `SystemOptions::movable_clocks`, its wall clock is movable under its name
    /// (`payout-<identity>`).
    pub fn worker_spec(&self, identity: &str) -> ProcessSpec {
        let name = format!("payout-{identity}");
        // Each worker its own certificate: its lock session belongs to it alone.
        let tls = self
            .pki
            .issue(Role::Worker, &name)
            .expect("issuing a worker's certificate");
        let mut spec = self
            .worker_template
            .clone()
            .env("PAYOUT_WORKER_IDENTITY", identity.to_string());
        for (name, path) in tls.to_env() {
            spec = spec.env(name, path.display().to_string());
        }
        spec.name = name.clone();
        spec.log_path = self.dir.join(format!("{name}.log"));
        match &self.clocks {
            Ok(clocks) => clocks
                .apply(spec)
                .expect("writing a worker's clock offset file"),
            Err(_) => spec,
        }
    }

    /// Steps the wall clock (`CLOCK_REALTIME`) of the process named `process` (a worker's
    /// `payout-<identity>`, `lock-server`, `payment-resource`, the rail proxy's binary name) to
    /// `offset_s` seconds from the real time, 0 to heal; in effect within
    /// [`crate::clock::OFFSET_CACHE_S`]. Refused without `SystemOptions::movable_clocks`.
    pub fn set_clock_offset(&self, process: &str, offset_s: i64) -> anyhow::Result<()> {
        match &self.clocks {
            Ok(clocks) => clocks.set_offset(process, offset_s),
            Err(why) => anyhow::bail!("no movable clocks: {why}"),
        }
    }

    /// Why this system's wall clocks cannot be moved, if they cannot.
    pub fn clocks_unmovable(&self) -> Option<&str> {
        self.clocks.as_ref().err().map(String::as_str)
    }

    pub fn lock_url(&self) -> String {
        url(self.ports.lock_server)
    }
    pub fn payment_url(&self) -> String {
        url(self.ports.payment_resource)
    }
    pub fn proxy_url(&self) -> String {
        url(self.ports.rail_proxy)
    }
    /// The rail stub's payments API (the rail is outside the system's PKI: only the proxy
    /// calls it).
    pub fn rail_url(&self) -> String {
        rail_url(self.ports.rail_stub)
    }
    /// Both of the rail stub's base URLs, `(payments API, the harness's admin API, the
    /// harness's TLS)`: what `rail_stub::client::StubClient::new` takes (the kit starts the
    /// stub's binary and links no server, so it names no type of the stub's).
    pub fn rail_stub_endpoints(&self) -> (String, String, mtls::Tls) {
        (
            self.rail_url(),
            self.rail_admin_url(),
            self.rail_tls
                .harness
                .load()
                .expect("the harness's certificate of the rail reads"),
        )
    }
    /// The rail stub's admin API (the harness's certificate only).
    pub fn rail_admin_url(&self) -> String {
        rail_url(self.ports.rail_stub_admin)
    }
    pub fn gl_url(&self) -> String {
        url(self.ports.general_ledger)
    }

    /// A fresh certificate of `role` from this system's authority, for a test (or a tool) that
    /// calls a service directly as that role.
    /// The certificate denylist every server of the system reads (PAYOUT_TLS_DENYLIST): a line
    /// appended here (`mtls::denylist::append`, `payoutctl pki deny`) is in force within
    /// `mtls::denylist::RELOAD_MS`.
    pub fn denylist_path(&self) -> PathBuf {
        self.dir.join(DENYLIST_FILE)
    }

    pub fn tls(&self, role: Role) -> crate::pki::Tls {
        self.pki.tls(role)
    }

    /// The reconciler's certificate (role reconciler, from this system's authority) and every
    /// source it reads (the three databases, the lock-server, the proxy, the payment resource,
    /// Temporal at `temporal_address` through the front with the reconciler's profile), the
    /// payout workers' queue and a resumed run's settlement window: `reconciler serve` or `once`
    /// over this system, as `payoutdev stack up` passes them (without etcd: its INV-07 check is
    /// reported skipped).
    pub fn reconciler_args(
        &self,
        temporal_address: &str,
        settlement_window_ms: u64,
    ) -> anyhow::Result<Vec<String>> {
        let tls = self.pki.issue(Role::Reconciler, "reconciler")?.to_args();
        let s = |v: &str| v.to_string();
        Ok(tls
            .into_iter()
            .map(|a| a.to_string_lossy().into_owned())
            .chain([
                s("--paydb-url"),
                self.databases.paydb.clone(),
                s("--proxydb-url"),
                self.databases.proxydb.clone(),
                s("--gldb-url"),
                self.databases.gldb.clone(),
                s("--lock-server-url"),
                self.lock_url(),
                s("--rail-proxy-url"),
                self.proxy_url(),
                s("--payment-resource-url"),
                self.payment_url(),
                s("--temporal-address"),
                s(temporal_address),
                s("--temporal-config-file"),
                self.temporal_clients.display().to_string(),
                s("--temporal-profile"),
                s("reconciler"),
                s("--payout-task-queue"),
                self.task_queue.clone(),
                s("--settlement-window-ms"),
                settlement_window_ms.to_string(),
            ])
            .collect())
    }

    /// Every process of the system with its name, for status displays and fault injection.
    pub fn processes(&self) -> Vec<&ManagedProcess> {
        let mut all = vec![
            &self.lock_server,
            &self.payment_resource,
            &self.rail_stub,
            &self.rail_proxy,
            &self.general_ledger,
            &self.dispatcher,
        ];
        all.extend(self.workers.iter());
        all
    }
}

/// Waits until `grpc.health.v1` says SERVING on `port` (a `server` certificate, asked with
/// `tls`).
pub async fn wait_grpc(
    port: u16,
    process: &ManagedProcess,
    tls: &crate::pki::Tls,
    server: Role,
) -> anyhow::Result<()> {
    use tonic_health::pb::health_client::HealthClient;
    use tonic_health::pb::HealthCheckRequest;
    crate::util::eventually(
        Duration::from_millis(SERVICE_READY_TIMEOUT_MS),
        &format!("{} serving", process.name()),
        || async {
            if !process.is_running() {
                return Some(false);
            }
            let channel = tls
                .endpoint(&url(port), server)
                .ok()?
                .connect()
                .await
                .ok()?;
            let reply = HealthClient::new(channel)
                .check(HealthCheckRequest {
                    service: String::new(),
                })
                .await
                .ok()?;
            (reply.into_inner().status
                == tonic_health::pb::health_check_response::ServingStatus::Serving as i32)
                .then_some(true)
        },
    )
    .await
    .and_then(|running| {
        anyhow::ensure!(running, "{} exited during start-up", process.name());
        Ok(())
    })
    .with_context(|| format!("{} log tail:\n{}", process.name(), process.log_tail(20)))
}

/// Waits until something accepts connections on `port`.
pub async fn wait_tcp(port: u16, process: &ManagedProcess) -> anyhow::Result<()> {
    crate::util::eventually(
        Duration::from_millis(SERVICE_READY_TIMEOUT_MS),
        &format!("{} listening", process.name()),
        || async {
            if !process.is_running() {
                return Some(false);
            }
            tokio::net::TcpStream::connect(("127.0.0.1", port))
                .await
                .ok()
                .map(|_| true)
        },
    )
    .await
    .and_then(|running| {
        anyhow::ensure!(running, "{} exited during start-up", process.name());
        Ok(())
    })
    .with_context(|| format!("{} log tail:\n{}", process.name(), process.log_tail(20)))
}

/// One `grpc.health.v1` probe of a `server` certificate on `port`, asked with `tls`: SERVING or
/// not, within a second.
pub async fn probe_grpc(port: u16, tls: &crate::pki::Tls, server: Role) -> bool {
    use tonic_health::pb::health_client::HealthClient;
    use tonic_health::pb::HealthCheckRequest;
    let probe = async {
        let channel = tls
            .endpoint(&url(port), server)
            .ok()?
            .connect()
            .await
            .ok()?;
        let reply = HealthClient::new(channel)
            .check(HealthCheckRequest {
                service: String::new(),
            })
            .await
            .ok()?;
        Some(
            reply.into_inner().status
                == tonic_health::pb::health_check_response::ServingStatus::Serving as i32,
        )
    };
    tokio::time::timeout(Duration::from_secs(1), probe)
        .await
        .ok()
        .flatten()
        .unwrap_or(false)
}
