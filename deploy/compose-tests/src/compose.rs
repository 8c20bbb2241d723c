//! Drives a compose project of the repository's `docker-compose.yml` from the tests: the engine
//! check (the one allowed skip), `up` under a unique project name, the health wait (compose v1
//! has no `up --wait`, so it polls `docker inspect`), the cuts (stop, kill, restart, network
//! disconnect), and `down -v` on drop, whatever happened.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};

/// Services that run once and exit (`db-setup`: roles, databases, migrations).
pub const ONE_SHOT: &[&str] = &["db-setup"];

/// Health checks run every 2 s; a cold start initialises two PostgreSQL servers, forms the etcd
/// cluster and migrates Temporal's SQLite file, on 2 shared cores.
pub const UP_TIMEOUT: Duration = Duration::from_secs(300);
/// Between two `docker inspect` polls.
pub const POLL: Duration = Duration::from_millis(500);

/// The repository root (this crate is `deploy/compose-tests`).
pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../..")
        .canonicalize()
        .expect("repository root")
}

/// Runs a command, returning its output, failing (with stderr) on a non-zero exit.
pub fn run(cmd: &mut Command) -> anyhow::Result<String> {
    let out: Output = cmd
        .stdin(Stdio::null())
        .output()
        .with_context(|| format!("spawn {cmd:?}"))?;
    if !out.status.success() {
        bail!(
            "{cmd:?} exited {}: {}{}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// A container's last `lines` log lines, stdout and stderr both.
pub fn container_logs(id: &str, lines: usize) -> String {
    match Command::new("docker")
        .args(["logs", "--tail", &lines.to_string(), id])
        .stdin(Stdio::null())
        .output()
    {
        Ok(o) => format!(
            "{}{}",
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&o.stderr)
        ),
        Err(e) => format!("(no logs: {e})"),
    }
}

pub fn docker(args: &[&str]) -> anyhow::Result<String> {
    run(Command::new("docker").args(args))
}

/// Why the compose suite cannot run here, or the compose command to use.
pub enum Engine {
    Ready { compose: Vec<String> },
    Absent { reason: String },
}

impl Engine {
    /// A Docker engine answers `docker info`, and `docker compose` (v2) or `docker-compose` (v1)
    /// exists. `PAYOUT_COMPOSE` ("docker-compose" or "docker compose") forces the tool.
    pub fn detect() -> Self {
        match Command::new("docker")
            .args(["info", "--format", "{{.ServerVersion}}"])
            .stdin(Stdio::null())
            .output()
        {
            Err(e) => {
                return Engine::Absent {
                    reason: format!("the docker client is not installed ({e})"),
                }
            }
            Ok(o) if !o.status.success() => {
                return Engine::Absent {
                    reason: format!(
                        "no Docker engine answers `docker info`: {}",
                        String::from_utf8_lossy(&o.stderr).trim()
                    ),
                }
            }
            Ok(_) => {}
        }
        let candidates: Vec<Vec<String>> = match std::env::var("PAYOUT_COMPOSE") {
            Ok(forced) => vec![forced.split_whitespace().map(String::from).collect()],
            Err(_) => vec![
                vec!["docker".into(), "compose".into()],
                vec!["docker-compose".into()],
            ],
        };
        for compose in candidates {
            let ok = Command::new(&compose[0])
                .args(&compose[1..])
                .arg("version")
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status()
                .is_ok_and(|s| s.success());
            if ok {
                return Engine::Ready { compose };
            }
        }
        Engine::Absent {
            reason: "a Docker engine answers but neither `docker compose` nor `docker-compose` \
                     is installed"
                .into(),
        }
    }
}

/// One compose project; `down -v` when dropped.
pub struct Project {
    pub name: String,
    compose: Vec<String>,
    file: PathBuf,
    env: BTreeMap<String, String>,
}

impl Project {
    /// A project named `name` over the repository's docker-compose.yml, with `env` (the
    /// PAYOUT_* settings, e.g. host ports) set for every compose command.
    pub fn new(compose: Vec<String>, name: &str, env: BTreeMap<String, String>) -> Self {
        Self {
            name: name.to_string(),
            compose,
            file: repo_root().join("docker-compose.yml"),
            env,
        }
    }

    pub fn compose(&self, args: &[&str]) -> anyhow::Result<String> {
        let mut cmd = Command::new(&self.compose[0]);
        cmd.args(&self.compose[1..])
            .arg("-f")
            .arg(&self.file)
            .args(["-p", &self.name])
            .args(args)
            .envs(&self.env);
        run(&mut cmd)
    }

    /// `up -d` with `workers` worker replicas, then waits until every container is healthy.
    pub fn up(&self, workers: usize) -> anyhow::Result<Duration> {
        let start = Instant::now();
        let scale = format!("worker={workers}");
        self.compose(&["up", "-d", "--scale", &scale])?;
        self.wait_healthy(UP_TIMEOUT)?;
        Ok(start.elapsed())
    }

    /// Every container of the project (running or not).
    pub fn containers(&self) -> anyhow::Result<Vec<String>> {
        let label = format!("label=com.docker.compose.project={}", self.name);
        Ok(docker(&["ps", "-a", "-q", "--filter", &label])?
            .split_whitespace()
            .map(String::from)
            .collect())
    }

    /// The container ids of one service (running or not), in a stable order.
    pub fn service_containers(&self, service: &str) -> anyhow::Result<Vec<String>> {
        let project = format!("label=com.docker.compose.project={}", self.name);
        let svc = format!("label=com.docker.compose.service={service}");
        let mut ids: Vec<String> =
            docker(&["ps", "-a", "-q", "--filter", &project, "--filter", &svc])?
                .split_whitespace()
                .map(String::from)
                .collect();
        ids.sort();
        Ok(ids)
    }

    pub fn container(&self, service: &str) -> anyhow::Result<String> {
        self.service_containers(service)?
            .into_iter()
            .next()
            .with_context(|| format!("no container for service {service}"))
    }

    /// Waits until every container of the project is running and healthy (a one-shot: exited with
    /// status 0); fails at once when one has exited otherwise or turned unhealthy, with its last
    /// log lines.
    pub fn wait_healthy(&self, timeout: Duration) -> anyhow::Result<()> {
        let deadline = Instant::now() + timeout;
        loop {
            let ids = self.containers()?;
            let mut waiting = Vec::new();
            for id in &ids {
                let state = docker(&[
                    "inspect",
                    "--format",
                    "{{.Name}} {{.State.Status}} {{if .State.Health}}{{.State.Health.Status}}{{else}}none{{end}} {{.State.ExitCode}} {{index .Config.Labels \"com.docker.compose.service\"}}",
                    id,
                ])?;
                let fields: Vec<&str> = state.split_whitespace().collect();
                let (name, status, health) = (fields[0], fields[1], fields[2]);
                let (exit_code, service) = (
                    fields.get(3).copied().unwrap_or(""),
                    fields.get(4).copied().unwrap_or(""),
                );
                match (status, health) {
                    ("running", "healthy") => {}
                    // A one-shot (db-setup) is done when it exited successfully.
                    ("exited", _) if ONE_SHOT.contains(&service) && exit_code == "0" => {}
                    ("running" | "created", _) if ONE_SHOT.contains(&service) => {
                        waiting.push(format!("{name} {status}"))
                    }
                    ("exited" | "dead" | "restarting", _) | (_, "unhealthy") => {
                        let logs = container_logs(id, 30);
                        bail!("{name} is {status}/{health}; its last log lines:\n{logs}");
                    }
                    _ => waiting.push(format!("{name} {status}/{health}")),
                }
            }
            if !ids.is_empty() && waiting.is_empty() {
                return Ok(());
            }
            if Instant::now() > deadline {
                bail!("not healthy within {timeout:?}: {waiting:?}");
            }
            std::thread::sleep(POLL);
        }
    }

    /// Waits until one container is running and healthy again.
    pub fn wait_container_healthy(&self, id: &str, timeout: Duration) -> anyhow::Result<()> {
        let deadline = Instant::now() + timeout;
        loop {
            let health = docker(&[
                "inspect",
                "--format",
                "{{.State.Status}} {{if .State.Health}}{{.State.Health.Status}}{{else}}none{{end}}",
                id,
            ])?;
            if health.trim() == "running healthy" {
                return Ok(());
            }
            if Instant::now() > deadline {
                bail!(
                    "container {id} not healthy within {timeout:?}: {}",
                    health.trim()
                );
            }
            std::thread::sleep(POLL);
        }
    }

    /// The project's network whose compose name is `network` (e.g. "lock").
    pub fn network(&self, network: &str) -> anyhow::Result<String> {
        let project = format!("label=com.docker.compose.project={}", self.name);
        let net = format!("label=com.docker.compose.network={network}");
        docker(&[
            "network", "ls", "-q", "--filter", &project, "--filter", &net,
        ])?
        .split_whitespace()
        .next()
        .map(String::from)
        .with_context(|| format!("no network {network} in project {}", self.name))
    }

    /// A command inside a running container.
    pub fn exec(&self, id: &str, args: &[&str]) -> anyhow::Result<String> {
        let mut all = vec!["exec", id];
        all.extend_from_slice(args);
        docker(&all)
    }

    /// Every container's last log lines, for a failure report.
    pub fn logs_tail(&self, lines: usize) -> String {
        self.compose(&["logs", "--no-color", "--tail", &lines.to_string()])
            .unwrap_or_else(|e| format!("(logs unavailable: {e})"))
    }

    /// `down -v --remove-orphans`: containers, networks and volumes.
    pub fn down(&self) -> anyhow::Result<()> {
        self.compose(&["down", "-v", "--remove-orphans", "-t", "5"])
            .map(|_| ())
    }
}

impl Drop for Project {
    fn drop(&mut self) {
        if std::env::var_os("PAYOUT_COMPOSE_KEEP").is_some() {
            eprintln!(
                "compose: PAYOUT_COMPOSE_KEEP set, leaving project {} up",
                self.name
            );
            return;
        }
        if let Err(e) = self.down() {
            eprintln!("compose: down -v of {} failed: {e:#}", self.name);
        }
    }
}
