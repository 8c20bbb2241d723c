//! A private PostgreSQL server: `initdb` into its own directory, run as an unprivileged user,
//! reachable on 127.0.0.1 with trust authentication (a test or local-stack server, never shared).

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::Context;

use crate::process::{Lifetime, ManagedProcess, ProcessSpec};
use crate::util::{hand_over, unprivileged_user, wait_blocking};

/// initdb plus first start takes about two seconds here; a cold machine is slower.
pub const READY_TIMEOUT_MS: u64 = 60_000;
/// Tests run many pools at once (each service's pool is bounded at 16).
pub const MAX_CONNECTIONS: u32 = 400;

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
}

pub struct Postgres {
    pub name: String,
    pub port: u16,
    pub dir: PathBuf,
    pub process: ManagedProcess,
}

impl Postgres {
    /// Initialises `dir` if it holds no cluster yet, then starts the server and waits until it
    /// accepts connections.
    pub fn start(name: &str, dir: &Path, port: u16, options: &PgOptions) -> anyhow::Result<Self> {
        let bin = bin_dir()?;
        let user = unprivileged_user();
        let data = dir.join("data");
        let socket_dir = dir.join("socket");
        std::fs::create_dir_all(&socket_dir)?;
        if !data.join("PG_VERSION").exists() {
            std::fs::create_dir_all(&data)?;
            hand_over(dir, user)?;
            let log = dir.join("initdb.log");
            let out = std::process::Command::new(bin.join("initdb"))
                .args(["-D".as_ref(), data.as_os_str()])
                .args([
                    "-U",
                    "postgres",
                    "--auth=trust",
                    "-E",
                    "UTF8",
                    "--locale=C.UTF-8",
                    "--no-instructions",
                ])
                .args(if options.durable {
                    &[][..]
                } else {
                    &["--no-sync"][..]
                })
                .uid_gid(user)
                .output()
                .context("running initdb")?;
            std::fs::write(&log, [&out.stdout[..], &out.stderr[..]].concat())?;
            anyhow::ensure!(
                out.status.success(),
                "initdb failed for {name}: see {}",
                log.display()
            );
        } else {
            hand_over(dir, user)?;
        }
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
        .user(user)
        .lifetime(options.lifetime);
        if !options.durable {
            // Without fsync a killed *process* still loses nothing (the kernel has the pages); only a
            // machine crash would. synchronous_commit stays on: a commit must be durable to a kill.
            spec = spec.args(["-c", "fsync=off", "-c", "full_page_writes=off"]);
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
        };
        server.wait_ready()?;
        Ok(server)
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

    /// URL of a database on this server.
    pub fn url(&self, database: &str) -> String {
        format!("postgres://postgres@127.0.0.1:{}/{database}", self.port)
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
