//! A private PostgreSQL server: `initdb` into its own directory, run as an unprivileged user,
//! reachable on 127.0.0.1 over TLS only (its certificate from the stack's authority, checked by
//! every client with `sslmode=verify-full`), every login with a password (SCRAM). Its roles are
//! provisioned at start (`db_access::provision_roles`): the superuser is for the test kit's own
//! administration and for tests that inspect a store; services log in as their own roles.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::Context;

use crate::process::{Lifetime, ManagedProcess, ProcessSpec};
use crate::util::{hand_over, unprivileged_user, wait_blocking};
use crate::volume::CappedVolume;

/// initdb plus first start takes about two seconds here; a cold machine is slower.
pub const READY_TIMEOUT_MS: u64 = 60_000;
/// Tests run many pools at once (each service's pool is bounded at 16), and a connection (TLS and
/// a SCRAM exchange) takes longer to open than it did in the clear, so under load the pools hold
/// more at once: room for a test binary's thirty-odd services and their test pools.
pub const MAX_CONNECTIONS: u32 = 1_000;

/// Where Debian installs the server binaries: `/usr/lib/postgresql/<major>/bin`, newest major
/// first; `PG_BIN` overrides.
pub fn bin_dir() -> anyhow::Result<PathBuf> {
    if let Some(dir) = std::env::var_os("PG_BIN") {
        return Ok(PathBuf::from(dir));
    }
    let mut majors: Vec<(u32, PathBuf)> = std::fs::read_dir("/usr/lib/postgresql")
        .context(
            "PostgreSQL is not installed (/usr/lib/postgresql is missing): run scripts/setup.sh",
        )?
        .filter_map(|e| e.ok())
        .filter_map(|e| Some((e.file_name().to_str()?.parse().ok()?, e.path().join("bin"))))
        .filter(|(_, bin): &(u32, PathBuf)| bin.join("postgres").exists())
        .collect();
    majors.sort();
    majors
        .pop()
        .map(|(_, bin)| bin)
        .context("no PostgreSQL server binaries under /usr/lib/postgresql/*/bin")
}

#[derive(Debug, Clone)]
pub struct PgOptions {
    /// Durable (fsync on) for the local stack; off for tests, whose data dies with them anyway.
    pub durable: bool,
    pub lifetime: Lifetime,
    /// The passwords of the superuser and of every role (the stack's, generated).
    pub credentials: std::sync::Arc<db_access::Credentials>,
    /// The server's certificate and key (PEM) and the authority's certificate file.
    pub tls: PgTls,
    /// WAL on a volume of its own of this many bytes (a [`CappedVolume`]), so a test can fill it:
    /// the chaos stack's full disk. `None`: WAL in the data directory.
    pub wal_volume_bytes: Option<u64>,
}

#[derive(Clone)]
pub struct PgTls {
    pub cert_pem: String,
    pub key_pem: String,
    pub ca_file: PathBuf,
}

impl std::fmt::Debug for PgTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PgTls")
            .field("ca_file", &self.ca_file)
            .finish_non_exhaustive()
    }
}

pub struct Postgres {
    pub name: String,
    pub port: u16,
    pub dir: PathBuf,
    pub process: ManagedProcess,
    /// Where its WAL lives when capped (`PgOptions::wal_volume_bytes`). After `process`: the
    /// server is killed before its volume is unmounted.
    pub wal_volume: Option<CappedVolume>,
    credentials: std::sync::Arc<db_access::Credentials>,
    ca_file: PathBuf,
}

/// Host connections: TLS and a password only. The Unix socket (in the server's own directory,
/// reachable only by its user and root) stays `trust` for local administration.
const PG_HBA: &str = "\
local all all trust
hostssl all all all scram-sha-256
";

impl Postgres {
    /// Initialises `dir` if it holds no cluster yet, then starts the server and waits until it
    /// accepts connections.
    pub fn start(name: &str, dir: &Path, port: u16, options: &PgOptions) -> anyhow::Result<Self> {
        let bin = bin_dir()?;
        let user = unprivileged_user();
        let data = dir.join("data");
        let socket_dir = dir.join("socket");
        std::fs::create_dir_all(&socket_dir)?;
        let mut wal_volume = None;
        if !data.join("PG_VERSION").exists() {
            std::fs::create_dir_all(&data)?;
            if let Some(bytes) = options.wal_volume_bytes {
                wal_volume = Some(CappedVolume::mount(&dir.join("wal-volume"), bytes, user)?);
            }
            hand_over(dir, user)?;
            let log = dir.join("initdb.log");
            let pwfile = dir.join("initdb-password");
            write_private(&pwfile, &options.credentials.superuser, user)?;
            let out = std::process::Command::new(bin.join("initdb"))
                .args(["-D".as_ref(), data.as_os_str()])
                .args([
                    "-U",
                    "postgres",
                    "--auth-local=trust",
                    "--auth-host=scram-sha-256",
                ])
                .arg(format!("--pwfile={}", pwfile.display()))
                .args(
                    wal_volume
                        .as_ref()
                        .map(|v| format!("--waldir={}", v.path().join("pg_wal").display())),
                )
                .args(["-E", "UTF8", "--locale=C.UTF-8", "--no-instructions"])
                .args(if options.durable {
                    &[][..]
                } else {
                    &["--no-sync"][..]
                })
                .uid_gid(user)
                .output()
                .context("running initdb")?;
            std::fs::remove_file(&pwfile)?;
            std::fs::write(&log, [&out.stdout[..], &out.stderr[..]].concat())?;
            anyhow::ensure!(
                out.status.success(),
                "initdb failed for {name}: see {}",
                log.display()
            );
        } else {
            hand_over(dir, user)?;
        }
        // Rewritten on every start, so a state directory from before TLS is brought up to it.
        write_private(&data.join("pg_hba.conf"), PG_HBA, user)?;
        write_private(&data.join("server.crt"), &options.tls.cert_pem, user)?;
        write_private(&data.join("server.key"), &options.tls.key_pem, user)?;
        remove_stale_lock_file(&data.join("postmaster.pid"))?;
        for entry in std::fs::read_dir(&socket_dir)?.filter_map(|e| e.ok()) {
            if entry.file_name().to_string_lossy().ends_with(".lock") {
                remove_stale_lock_file(&entry.path())?;
            }
        }
        let mut spec = ProcessSpec::new(
            &format!("postgres-{name}"),
            bin.join("postgres"),
            dir.join("postgres.log"),
        )
        .args(["-D".into(), data.clone().into_os_string()])
        .args(["-p".to_string(), port.to_string()])
        .args(["-k".into(), socket_dir.into_os_string()])
        .args(["-c", "listen_addresses=127.0.0.1"])
        .args([
            "-c".to_string(),
            format!("max_connections={MAX_CONNECTIONS}"),
        ])
        .args(["-c", "shared_buffers=64MB"])
        .args(["-c", "ssl=on", "-c", "ssl_min_protocol_version=TLSv1.2"])
        .args(["-c", "password_encryption=scram-sha-256"])
        // Who did what: every log line names the role and the database.
        .args(["-c", "log_line_prefix=%m [%p] %q%u@%d "])
        .user(user)
        .lifetime(options.lifetime);
        if !options.durable {
            // Without fsync a killed *process* still loses nothing (the kernel has the pages); only a
            // machine crash would. synchronous_commit stays on: a commit must be durable to a kill.
            spec = spec.args(["-c", "fsync=off", "-c", "full_page_writes=off"]);
        }
        if wal_volume.is_some() {
            // A full WAL volume must refuse the next write, not the next segment: segments are
            // created sparse (not zero-filled) and never recycled, so every new WAL page needs
            // space; and checkpoints come often enough that the volume holds the WAL between
            // two of them (a few MiB a second at most in a chaos run).
            spec = spec.args([
                "-c",
                "wal_init_zero=off",
                "-c",
                "wal_recycle=off",
                "-c",
                "min_wal_size=32MB",
                "-c",
                "max_wal_size=48MB",
            ]);
        }
        // The log file must be writable by the unprivileged user.
        std::fs::File::create(&spec.log_path)?;
        hand_over(&spec.log_path, user)?;
        let process = ManagedProcess::start(spec)?;
        let server = Self {
            name: name.to_string(),
            port,
            dir: dir.to_path_buf(),
            process,
            wal_volume,
            credentials: options.credentials.clone(),
            ca_file: options.tls.ca_file.clone(),
        };
        server.wait_ready()?;
        server.provision_roles()?;
        Ok(server)
    }

    /// The owner and every service role, with the stack's passwords (idempotent).
    fn provision_roles(&self) -> anyhow::Result<()> {
        let url = self.url("postgres");
        let credentials = self.credentials.clone();
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        runtime
            .block_on(async move {
                let mut admin = db_access::connect(&url).await?;
                db_access::provision_roles(&mut admin, |login| credentials.password(login)).await
            })
            .with_context(|| format!("provisioning the roles of postgres {}", self.name))
    }

    /// Where this server is, for [`db_access::Server::url`].
    pub fn server(&self) -> db_access::Server {
        db_access::Server {
            host: "127.0.0.1".into(),
            port: self.port,
            ca_file: self.ca_file.clone(),
        }
    }

    pub fn credentials(&self) -> &db_access::Credentials {
        &self.credentials
    }

    /// URL of `database` for `login` (a role of `db_access::logins`), with its password.
    pub fn login_url(&self, login: &str, database: &str) -> String {
        let password = self
            .credentials
            .password(login)
            .unwrap_or_else(|| panic!("no password for {login}"));
        self.server().url(login, &password, database)
    }

    /// Creates `name` as a database of kind `kind`, owned by the owner role, reachable only by
    /// the owner and `kind`'s service roles, and applies its migrations as the owner (what
    /// `payoutctl db provision` and `payoutctl migrate` do in a deployment). Answers the
    /// superuser's URL of it.
    pub async fn provision_database(
        &self,
        name: &str,
        kind: db_access::Database,
    ) -> anyhow::Result<String> {
        let mut admin = db_access::connect(&self.url("postgres")).await?;
        db_access::provision_database(&mut admin, name, kind).await?;
        sqlx::Connection::close(admin).await?;
        let owner = sqlx::PgPool::connect(&self.login_url(db_access::OWNER, name)).await?;
        db_access::migrations::migrator(kind)
            .run(&owner)
            .await
            .with_context(|| format!("migrating {name} as the owner"))?;
        owner.close().await;
        Ok(self.url(name))
    }

    pub fn wait_ready(&self) -> anyhow::Result<()> {
        let bin = bin_dir()?;
        wait_blocking(
            Duration::from_millis(READY_TIMEOUT_MS),
            &format!("postgres {} ready", self.name),
            || {
                std::process::Command::new(bin.join("pg_isready"))
                    .args([
                        "-h",
                        "127.0.0.1",
                        "-p",
                        &self.port.to_string(),
                        "-U",
                        "postgres",
                        "-q",
                    ])
                    .status()
                    .is_ok_and(|s| s.success())
            },
        )
        .with_context(|| format!("log tail:\n{}", self.process.log_tail(20)))
    }

    /// The superuser's URL of a database on this server (it holds the password: tests pass it to
    /// nothing but their own pools).
    pub fn url(&self, database: &str) -> String {
        self.server()
            .url("postgres", &self.credentials.superuser, database)
    }

    /// A backup of `database` as an operator takes one: `pg_dump --format=custom` as the
    /// superuser over TLS, into `file`.
    pub fn dump(&self, database: &str, file: &Path) -> anyhow::Result<()> {
        let status = self
            .pg_tool("pg_dump")?
            .args(["--format=custom", "--file"])
            .arg(file)
            .args(["--dbname", database])
            .status()
            .context("running pg_dump")?;
        anyhow::ensure!(status.success(), "pg_dump of {database} failed: {status}");
        Ok(())
    }

    /// A restore of `database` from `file` (a [`Postgres::dump`]) into the same database, as an
    /// operator restores one: `pg_restore --clean --if-exists --single-transaction` as the
    /// superuser, which drops every object of the dump and recreates it with the dump's rows.
    pub fn restore_clean(&self, database: &str, file: &Path) -> anyhow::Result<()> {
        let output = self
            .pg_tool("pg_restore")?
            .args([
                "--clean",
                "--if-exists",
                "--single-transaction",
                "--dbname",
                database,
            ])
            .arg(file)
            .output()
            .context("running pg_restore")?;
        anyhow::ensure!(
            output.status.success(),
            "pg_restore of {database} failed: {}: {}",
            output.status,
            String::from_utf8_lossy(&output.stderr)
        );
        Ok(())
    }

    /// A PostgreSQL client tool of this server's version, connecting to this server as the
    /// superuser over TLS with the certificate checked (the password through the environment).
    fn pg_tool(&self, tool: &str) -> anyhow::Result<std::process::Command> {
        let mut command = std::process::Command::new(bin_dir()?.join(tool));
        command
            .env("PGHOST", "127.0.0.1")
            .env("PGPORT", self.port.to_string())
            .env("PGUSER", "postgres")
            .env("PGPASSWORD", &self.credentials.superuser)
            .env("PGSSLMODE", "verify-full")
            .env("PGSSLROOTCERT", &self.ca_file);
        Ok(command)
    }

    /// Creates `database` if it does not exist (idempotent).
    pub async fn create_database(&self, database: &str) -> anyhow::Result<String> {
        use sqlx::Connection;
        anyhow::ensure!(
            database
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '_'),
            "database name {database:?} must be [A-Za-z0-9_]"
        );
        let mut conn = sqlx::PgConnection::connect(&self.url("postgres")).await?;
        let exists: bool =
            sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM pg_database WHERE datname = $1)")
                .bind(database)
                .fetch_one(&mut conn)
                .await?;
        if !exists {
            sqlx::query(&format!("CREATE DATABASE \"{database}\""))
                .execute(&mut conn)
                .await?;
        }
        conn.close().await?;
        Ok(self.url(database))
    }

    /// Stops and starts the server again with its data (a PostgreSQL restart).
    pub fn restart(&self) -> anyhow::Result<()> {
        if self.process.is_running() {
            // Fast shutdown: clients are disconnected (SIGTERM would wait for them to leave).
            self.process.terminate_with(libc::SIGINT)?;
        }
        self.process.restart()?;
        self.wait_ready()
    }
}

/// Writes `contents` to `path`, mode 0600, owned by the server's user (PostgreSQL refuses a key
/// file others can read).
fn write_private(path: &Path, contents: &str, user: Option<(u32, u32)>) -> anyhow::Result<()> {
    let _ = std::fs::remove_file(path);
    crate::grants::write_secret(path, contents)?;
    // Only the file changes hands: its folders keep their modes (PostgreSQL refuses a data
    // directory others may enter).
    if let Some((uid, gid)) = user {
        std::os::unix::fs::chown(path, Some(uid), Some(gid))
            .with_context(|| format!("chown {}", path.display()))?;
    }
    Ok(())
}

trait UidGid {
    fn uid_gid(&mut self, user: Option<(u32, u32)>) -> &mut Self;
}

impl UidGid for std::process::Command {
    fn uid_gid(&mut self, user: Option<(u32, u32)>) -> &mut Self {
        use std::os::unix::process::CommandExt;
        if let Some((uid, gid)) = user {
            self.uid(uid).gid(gid);
        }
        self
    }
}

/// A `postmaster.pid` left by a server that is gone. PostgreSQL itself only asks `kill(pid, 0)`,
/// which succeeds for an unreaped zombie (a container whose init does not reap leaves those), and
/// then refuses to start. A zombie cannot be using the data directory, so its lock file goes.
/// The same holds for the lock file of its Unix socket.
fn remove_stale_lock_file(pid_file: &Path) -> anyhow::Result<()> {
    let Ok(text) = std::fs::read_to_string(pid_file) else {
        return Ok(());
    };
    let pid: Option<u32> = text.lines().next().and_then(|l| l.trim().parse().ok());
    if let Some(pid) = pid {
        if !crate::util::pid_alive(pid) {
            std::fs::remove_file(pid_file)?;
        }
    }
    Ok(())
}
