//! The whole local stack: two PostgreSQL servers, etcd, and (on demand) the Temporal dev server.
//!
//! Tests share one stack per test binary ([`Stack::shared`]) and isolate themselves with fresh
//! databases and key prefixes; a test that kills or restarts a part builds its own
//! ([`Stack::builder`]) so its faults cannot reach another test.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, OnceLock};

use anyhow::Context;

use crate::etcd::{EtcdCluster, EtcdRole};
use crate::postgres::{PgOptions, Postgres};
use crate::process::Lifetime;
use crate::temporal::{TemporalDev, TemporalPorts};
use crate::util::free_port;

/// Which PostgreSQL server. The rail proxy's store lives on its own server so that one failure
/// cannot remove a guard's record and the resource it protects together (BRIEF).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PgServer {
    /// paydb, gldb, lockdb.
    Main,
    /// proxydb.
    Proxy,
}

/// Fixed ports for a long-lived stack (`payoutdev stack up`); tests use free ports.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct StackPorts {
    pub pg_main: u16,
    pub pg_proxy: u16,
    pub etcd_clients: Vec<u16>,
    pub temporal: u16,
    pub temporal_ui: u16,
    pub temporal_http: u16,
    pub temporal_metrics: u16,
}

/// Set (to anything) to keep a test stack's state directory after the test exits.
pub const KEEP_STATE_ENV: &str = "PAYOUT_KEEP_TEST_STATE";

pub struct StackBuilder {
    etcd_members: usize,
    temporal: bool,
    temporal_ui: bool,
    state_dir: Option<PathBuf>,
    lifetime: Lifetime,
    durable: bool,
    ports: Option<StackPorts>,
    temporal_isolation: bool,
    capped_volumes: bool,
}

/// The chaos stack's capped volumes ([`StackBuilder::capped_volumes`]): each PostgreSQL server's
/// WAL volume. Twice what the WAL between two checkpoints reaches (`max_wal_size` 48 MiB).
pub const PG_WAL_VOLUME_BYTES: u64 = 96 << 20;
/// The chaos stack's etcd backend quota: a chaos run keeps a few MiB live, so reaching this takes
/// a writer that should not be there (the fault's scratch keys), in seconds.
pub const CHAOS_ETCD_QUOTA_BYTES: u64 = 64 << 20;
/// The capped etcd member's data volume: room for its WAL (64 MiB segments, preallocated), its
/// database up to the quota, and a restore's second copy beside it.
pub const ETCD_DATA_VOLUME_BYTES: u64 = 512 << 20;
/// Which etcd member's data is on a capped volume (the last of three; a smaller cluster has none).
pub const CAPPED_ETCD_MEMBER: usize = 2;

impl StackBuilder {
    /// Put each PostgreSQL server's WAL and one etcd member's data on size-capped volumes, and
    /// give etcd a small backend quota, so a test can fill a disk (the chaos stack). Where this
    /// machine cannot mount them, the stack starts without and says why
    /// ([`Stack::volumes_unavailable`]).
    pub fn capped_volumes(mut self, capped: bool) -> Self {
        self.capped_volumes = capped;
        self
    }
    /// Whether the Temporal dev server's raw ports are closed to all but its front when root
    /// (default on). Off only to measure the front against the raw frontend
    /// (`payoutdev stack up --no-temporal-isolation`).
    pub fn temporal_isolation(mut self, isolate: bool) -> Self {
        self.temporal_isolation = isolate;
        self
    }
    pub fn etcd_members(mut self, count: usize) -> Self {
        self.etcd_members = count;
        self
    }
    /// Start Temporal now instead of on first use.
    pub fn temporal(mut self, ui: bool) -> Self {
        self.temporal = true;
        self.temporal_ui = ui;
        self
    }
    /// Keep state here (and keep it after exit) instead of a temporary directory.
    pub fn state_dir(mut self, dir: impl Into<PathBuf>) -> Self {
        self.state_dir = Some(dir.into());
        self
    }
    pub fn lifetime(mut self, lifetime: Lifetime) -> Self {
        self.lifetime = lifetime;
        self
    }
    pub fn durable(mut self, durable: bool) -> Self {
        self.durable = durable;
        self
    }
    pub fn ports(mut self, ports: StackPorts) -> Self {
        self.ports = Some(ports);
        self
    }

    pub fn start(self) -> anyhow::Result<Stack> {
        let (state, tempdir) = match &self.state_dir {
            Some(dir) => {
                std::fs::create_dir_all(dir)?;
                (dir.canonicalize()?, None)
            }
            // `PAYOUT_KEEP_TEST_STATE=1`: a test's stack (logs, databases, lock histories) is
            // kept after it exits, for the evidence of a failed run.
            None if std::env::var_os(KEEP_STATE_ENV).is_some() => {
                let t = tempfile::Builder::new().prefix("payout-stack-").tempdir()?;
                let kept = t.keep();
                eprintln!("testkit: keeping this stack's state in {}", kept.display());
                (kept, None)
            }
            None => {
                let t = tempfile::Builder::new().prefix("payout-stack-").tempdir()?;
                crate::process::remove_at_exit(t.path());
                (t.path().to_path_buf(), Some(t))
            }
        };
        // The stack's own authority (its PostgreSQL servers' certificates; each system has its
        // own for its services) and its database passwords, both kept in the state directory.
        let pki = crate::pki::Pki::in_dir(&state)?;
        let credentials = std::sync::Arc::new(
            db_access::Credentials::load_or_generate(&state.join(db_access::CREDENTIALS_FILE))
                .context("the stack's database credentials")?,
        );
        let pg_tls = |name: &str| -> anyhow::Result<crate::postgres::PgTls> {
            let issued = pki.issue_named(&["127.0.0.1", "localhost"], name)?;
            Ok(crate::postgres::PgTls {
                cert_pem: issued.cert_pem,
                key_pem: issued.key_pem,
                ca_file: pki.ca_file(),
            })
        };
        let volumes_unavailable = if self.capped_volumes {
            crate::volume::CappedVolume::available().err()
        } else {
            Some("not asked for".to_string())
        };
        let capped = volumes_unavailable.is_none();
        let main_options = PgOptions {
            durable: self.durable,
            lifetime: self.lifetime,
            credentials: credentials.clone(),
            tls: pg_tls("postgres-main")?,
            wal_volume_bytes: capped.then_some(PG_WAL_VOLUME_BYTES),
        };
        let mut etcd_limits = crate::etcd::EtcdLimits::default();
        if capped {
            etcd_limits = etcd_limits.with_quota_backend_bytes(CHAOS_ETCD_QUOTA_BYTES);
            if self.etcd_members > CAPPED_ETCD_MEMBER {
                etcd_limits =
                    etcd_limits.with_data_volume(CAPPED_ETCD_MEMBER, ETCD_DATA_VOLUME_BYTES);
            }
        }
        let proxy_options = PgOptions {
            tls: pg_tls("postgres-proxy")?,
            ..main_options.clone()
        };
        let ports = self.ports.clone();
        if let Some(p) = &ports {
            crate::util::reserve_ports(
                [
                    p.pg_main,
                    p.pg_proxy,
                    p.temporal,
                    p.temporal_ui,
                    p.temporal_http,
                    p.temporal_metrics,
                ]
                .into_iter()
                .chain(p.etcd_clients.iter().copied()),
            );
        }
        let (main, proxy, etcd) = std::thread::scope(|scope| {
            let main = scope.spawn(|| {
                let port = ports.as_ref().map(|p| p.pg_main).unwrap_or_else(free_port);
                Postgres::start("main", &state.join("pg-main"), port, &main_options)
            });
            let proxy = scope.spawn(|| {
                let port = ports.as_ref().map(|p| p.pg_proxy).unwrap_or_else(free_port);
                Postgres::start("proxy", &state.join("pg-proxy"), port, &proxy_options)
            });
            let etcd = scope.spawn(|| {
                EtcdCluster::start_with_limits(
                    &state.join("etcd"),
                    self.etcd_members,
                    ports.as_ref().map(|p| p.etcd_clients.clone()),
                    self.lifetime,
                    &etcd_limits,
                    crate::etcd::EtcdTls::issue(&state.join(crate::etcd::STACK_DIR))?,
                )
            });
            (
                main.join().expect("postgres main thread"),
                proxy.join().expect("postgres proxy thread"),
                etcd.join().expect("etcd thread"),
            )
        });
        let stack = Stack {
            state,
            main: main.context("starting PostgreSQL (main)")?,
            proxy: proxy.context("starting PostgreSQL (proxy)")?,
            etcd: etcd.context("starting etcd")?,
            pki,
            temporal: OnceLock::new(),
            temporal_start: Mutex::new(()),
            temporal_ports: self.ports.as_ref().map(|p| TemporalPorts {
                frontend: p.temporal,
                ui: Some(p.temporal_ui),
                http: p.temporal_http,
                metrics: p.temporal_metrics,
                // Behind the front: only the front dials them, so any free port does.
                raw_frontend: free_port(),
                raw_ui: Some(free_port()),
            }),
            temporal_ui: self.temporal_ui,
            temporal_isolation: self.temporal_isolation,
            lifetime: self.lifetime,
            volumes_unavailable,
            counter: AtomicU64::new(0),
            _tempdir: tempdir,
        };
        if self.temporal {
            stack.try_temporal()?;
        }
        Ok(stack)
    }
}

pub struct Stack {
    state: PathBuf,
    pub main: Postgres,
    pub proxy: Postgres,
    pub etcd: EtcdCluster,
    /// The stack's own authority: its PostgreSQL servers' and etcd's certificates, and the
    /// client certificates its etcd admits.
    pki: crate::pki::Pki,
    temporal: OnceLock<TemporalDev>,
    temporal_start: Mutex<()>,
    temporal_ports: Option<TemporalPorts>,
    temporal_ui: bool,
    temporal_isolation: bool,
    lifetime: Lifetime,
    /// Why the stack's disks are not capped (`StackBuilder::capped_volumes`), if they are not.
    pub volumes_unavailable: Option<String>,
    counter: AtomicU64,
    /// Last field: dropped after every process above is dead.
    _tempdir: Option<tempfile::TempDir>,
}

impl Stack {
    pub fn builder() -> StackBuilder {
        StackBuilder {
            etcd_members: 1,
            temporal: false,
            temporal_ui: false,
            state_dir: None,
            lifetime: Lifetime::Attached,
            durable: false,
            ports: None,
            temporal_isolation: true,
            capped_volumes: false,
        }
    }

    /// The stack of this test binary: started on first use, killed at process exit.
    pub fn shared() -> &'static Stack {
        static SHARED: OnceLock<Stack> = OnceLock::new();
        SHARED.get_or_init(|| {
            Stack::builder()
                .start()
                .expect("starting the shared test stack")
        })
    }

    pub fn state_dir(&self) -> &Path {
        &self.state
    }

    pub fn pg(&self, server: PgServer) -> &Postgres {
        match server {
            PgServer::Main => &self.main,
            PgServer::Proxy => &self.proxy,
        }
    }

    /// A brand-new, empty database on `server`, for one test.
    pub async fn fresh_db(&self, server: PgServer) -> String {
        let n = self.counter.fetch_add(1, Ordering::Relaxed);
        let name = format!("t{}_{n}", std::process::id());
        self.pg(server)
            .create_database(&name)
            .await
            .expect("creating a test database")
    }

    /// A brand-new database of kind `kind` on `server` as a deployment has it: owned by the owner
    /// role, migrated by it, reachable only by the owner and `kind`'s service roles. Answers the
    /// superuser's URL (for the test's own reads); services get [`Postgres::login_url`].
    pub async fn provisioned_db(&self, server: PgServer, kind: db_access::Database) -> String {
        let n = self.counter.fetch_add(1, Ordering::Relaxed);
        let name = format!("t{}_{n}_{}", std::process::id(), kind.name());
        self.pg(server)
            .provision_database(&name, kind)
            .await
            .expect("provisioning a test database")
    }

    /// A key prefix no other test of this stack uses.
    pub fn unique_prefix(&self, name: &str) -> String {
        let n = self.counter.fetch_add(1, Ordering::Relaxed);
        format!("/t{}/{n}/{name}/", std::process::id())
    }

    pub fn etcd_endpoints(&self) -> Vec<String> {
        self.etcd.endpoints()
    }

    /// An identity for a lock-server or reconciler of one test: a certificate of etcd's own
    /// authority with a name of its own (`payout-lock-server-{n}`: tests of one binary run at
    /// once) that the stack's etcd knows as a user with `role`'s permissions on `prefix` only
    /// (`mtls::etcd_access`). `prefix` is the one the service uses (`--etcd-prefix`,
    /// `--lock-prefix`).
    pub fn etcd_identity(&self, role: EtcdRole, prefix: &str) -> anyhow::Result<mtls::EtcdTlsArgs> {
        let n = self.counter.fetch_add(1, Ordering::Relaxed);
        self.etcd.identity(
            &self.state.join(crate::etcd::STACK_DIR),
            &format!("{}-{n}", role.table_role()),
            role,
            prefix,
        )
    }

    /// The same, loaded: for a lock-server or reconciler run in-process.
    pub fn etcd_identity_tls(&self, role: EtcdRole, prefix: &str) -> mtls::Tls {
        self.etcd_identity(role, prefix)
            .and_then(|args| Ok(args.load()?))
            .expect("an etcd identity")
    }

    /// A certificate of etcd's own authority whose name (`{name}-{n}`) is no user of the
    /// stack's etcd: it completes TLS and is authorised for nothing (an attacker's, a
    /// stranger's), or serves an etcd a test runs itself without authentication.
    pub fn etcd_certificate_without_user(&self, name: &str) -> mtls::Tls {
        let n = self.counter.fetch_add(1, Ordering::Relaxed);
        crate::etcd::EtcdTls::client_of(
            &self.etcd.tls.pki,
            &self.state.join(crate::etcd::STACK_DIR),
            &format!("{name}-{n}"),
        )
        .and_then(|args| Ok(args.load()?))
        .expect("an etcd client certificate")
    }

    /// An etcd client of the test kit's own identity (`root`) to the stack's etcd.
    pub async fn etcd_client(&self) -> anyhow::Result<crate::etcd::RootClient> {
        self.etcd.client().await
    }

    /// The Temporal dev server, started on first use (a few seconds).
    pub fn temporal(&self) -> &TemporalDev {
        self.try_temporal().expect("starting Temporal")
    }

    pub fn try_temporal(&self) -> anyhow::Result<&TemporalDev> {
        if let Some(t) = self.temporal.get() {
            return Ok(t);
        }
        let _guard = self.temporal_start.lock().expect("temporal start lock");
        if let Some(t) = self.temporal.get() {
            return Ok(t);
        }
        let ports = self
            .temporal_ports
            .clone()
            .unwrap_or_else(|| TemporalPorts::free(self.temporal_ui));
        let dev = TemporalDev::start(
            &self.state.join("temporal"),
            ports,
            crate::temporal::TemporalOptions {
                lifetime: self.lifetime,
                isolate: self.temporal_isolation,
            },
            &self.pki,
        )?;
        Ok(self.temporal.get_or_init(|| dev))
    }

    /// The stack's own authority (a test that starts a Temporal dev server of its own fronts it
    /// with it).
    pub fn pki(&self) -> &crate::pki::Pki {
        &self.pki
    }

    pub fn temporal_if_started(&self) -> Option<&TemporalDev> {
        self.temporal.get()
    }
}
