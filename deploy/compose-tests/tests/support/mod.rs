//! The repository's `docker-compose.yml` as a test fixture, through the `testcontainers` crate:
//! its compose support runs `docker compose up` (Compose v2's CLI, which scripts/setup.sh
//! installs) under a unique project name with the suite's environment, finds the services'
//! containers, maps their published ports, and runs `docker compose down --volumes` on drop,
//! whatever happened. Everything else goes through bollard, the Docker API client testcontainers
//! wraps and re-exports, because testcontainers has no call for it: the health wait (compose's
//! `--wait` is fixed at 60 s there, too short for a cold start on 2 shared cores, and fails on the
//! one-shot `db-setup`), the cuts (stop, kill, pause, restart, a network disconnect), exec and
//! logs in a container of a scaled service (testcontainers keeps one container per service name,
//! so the second worker replica is only reachable by its id). No docker CLI call is left.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context};
use futures::StreamExt;
use testcontainers::bollard::container::LogOutput;
use testcontainers::bollard::exec::{CreateExecOptions, StartExecResults};
use testcontainers::bollard::models::{
    ContainerStateStatusEnum as Status, HealthStatusEnum as Health, NetworkConnectRequest,
    NetworkDisconnectRequest,
};
use testcontainers::bollard::query_parameters::{
    KillContainerOptions, ListContainersOptions, ListNetworksOptions, LogsOptions,
    RestartContainerOptions, StopContainerOptions,
};
use testcontainers::bollard::Docker;
use testcontainers::compose::DockerCompose;

/// Services that run once and exit (`db-setup`: roles, databases, migrations).
pub const ONE_SHOT: &[&str] = &["db-setup", "etcd-setup"];

/// Health checks run every 2 s; a cold start initialises two PostgreSQL servers, forms the etcd
/// cluster and migrates Temporal's SQLite file, on 2 shared cores.
pub const UP_TIMEOUT: Duration = Duration::from_secs(300);
/// Between two health polls.
const POLL: Duration = Duration::from_millis(500);
/// What a stop or a restart gives a container before SIGKILL: the cuts are meant to be abrupt.
const CUT_GRACE_SECS: i32 = 2;
/// The override file that sets the number of worker replicas (testcontainers runs `up` without
/// `--scale`), and the variable it reads.
const WORKERS_OVERRIDE: &str = "workers.yml";
const WORKERS_VAR: &str = "PAYOUT_COMPOSE_TEST_WORKERS";
/// testcontainers' own switch to leave containers up (its drop reads it too).
const KEEP_VAR: &str = "TESTCONTAINERS_COMMAND";

const PROJECT_LABEL: &str = "com.docker.compose.project";
const SERVICE_LABEL: &str = "com.docker.compose.service";
const NETWORK_LABEL: &str = "com.docker.compose.network";

/// The repository root (this crate is `deploy/compose-tests`).
pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../..")
        .canonicalize()
        .expect("repository root")
}

/// Why the compose suite cannot run here: the one allowed skip.
pub enum Engine {
    Ready(Docker),
    Absent { reason: String },
}

impl Engine {
    /// A Docker engine answers on DOCKER_HOST (or the local socket). With an engine, a missing
    /// Compose v2 CLI is a failure, not a skip: scripts/setup.sh installs it.
    pub async fn detect() -> anyhow::Result<Self> {
        let docker = match Docker::connect_with_defaults() {
            Ok(docker) => docker,
            Err(e) => {
                return Ok(Engine::Absent {
                    reason: format!("no Docker engine to connect to ({e})"),
                })
            }
        };
        match docker.version().await {
            Ok(_) => {}
            Err(e) => {
                return Ok(Engine::Absent {
                    reason: format!("no Docker engine answers: {e}"),
                })
            }
        }
        // testcontainers' local compose client runs `docker compose`; its other client runs
        // the CLI in a `docker:*-cli` image pulled from a registry, which cannot be reached here.
        let compose = tokio::process::Command::new("docker")
            .args(["compose", "version"])
            .stdin(std::process::Stdio::null())
            .output()
            .await;
        match compose {
            Ok(out) if out.status.success() => Ok(Engine::Ready(docker)),
            Ok(out) => bail!(
                "a Docker engine answers but `docker compose` (Compose v2) does not: {} \
                 (scripts/setup.sh installs it)",
                String::from_utf8_lossy(&out.stderr).trim()
            ),
            Err(e) => bail!("a Docker engine answers but the docker CLI does not run: {e}"),
        }
    }
}

/// Every variable docker-compose.yml publishes a host port with (`127.0.0.1:${PAYOUT_*_PORT...}`),
/// each set to 0: Docker picks a free port at every start and [`Deployment::host_port`] reads it
/// back, so a run takes no fixed port and races nobody for one. Read from the file, so a service
/// added there is covered without a change here.
pub fn published_port_vars() -> anyhow::Result<BTreeMap<String, String>> {
    const HOST_PORT: &str = "127.0.0.1:${";
    let file = repo_root().join("docker-compose.yml");
    let text = std::fs::read_to_string(&file).with_context(|| format!("{}", file.display()))?;
    let mut vars = BTreeMap::new();
    for (start, _) in text.match_indices(HOST_PORT) {
        let name: String = text[start + HOST_PORT.len()..]
            .chars()
            .take_while(|c| c.is_ascii_uppercase() || c.is_ascii_digit() || *c == '_')
            .collect();
        if name.starts_with("PAYOUT_") && name.ends_with("_PORT") {
            vars.insert(name, "0".to_string());
        }
    }
    ensure!(!vars.is_empty(), "no PAYOUT_*_PORT in {}", file.display());
    Ok(vars)
}

/// One compose project of the repository's docker-compose.yml.
pub struct Deployment {
    pub name: String,
    compose: Option<DockerCompose>,
    docker: Docker,
}

impl Deployment {
    /// `docker compose up -d` of docker-compose.yml with `workers` worker replicas under the
    /// project `name` (`env` added to the inherited environment: the PAYOUT_* settings), then
    /// waits until every container is healthy (a one-shot: exited 0). On a failure the project's
    /// last log lines are in the error, and the project is taken down.
    pub async fn up(
        docker: Docker,
        name: &str,
        workers: usize,
        mut env: BTreeMap<String, String>,
    ) -> anyhow::Result<Self> {
        env.insert(WORKERS_VAR.into(), workers.to_string());
        let files = [
            repo_root().join("docker-compose.yml"),
            Path::new(env!("CARGO_MANIFEST_DIR")).join(WORKERS_OVERRIDE),
        ];
        let compose = DockerCompose::with_local_client(&files)
            .with_project_name(name)
            .with_env_vars(env.into_iter().collect::<HashMap<_, _>>())
            .with_wait(false);
        let mut deployment = Self {
            name: name.to_string(),
            compose: Some(compose),
            docker,
        };
        let started = async {
            deployment
                .compose
                .as_mut()
                .expect("not yet down")
                .up()
                .await
                .context("docker compose up")?;
            deployment.wait_healthy(UP_TIMEOUT).await?;
            let running = deployment.service_containers("worker").await?.len();
            ensure!(
                running == workers,
                "{running} worker containers, {workers} wanted"
            );
            anyhow::Ok(())
        }
        .await;
        if let Err(e) = started {
            let logs = deployment.logs_tail(40).await;
            deployment.down().await;
            bail!("{e:#}\n---- last log lines of every container ----\n{logs}");
        }
        Ok(deployment)
    }

    fn compose(&self) -> &DockerCompose {
        self.compose.as_ref().expect("project not yet down")
    }

    /// Every container of the project (running or not), with its service, in a stable order.
    async fn containers(&self) -> anyhow::Result<Vec<(String, String)>> {
        self.list(&[(PROJECT_LABEL, &self.name)]).await
    }

    async fn list(&self, labels: &[(&str, &str)]) -> anyhow::Result<Vec<(String, String)>> {
        let filters = HashMap::from([(
            "label".to_string(),
            labels.iter().map(|(k, v)| format!("{k}={v}")).collect(),
        )]);
        let mut found: Vec<(String, String)> = self
            .docker
            .list_containers(Some(ListContainersOptions {
                all: true,
                filters: Some(filters),
                ..Default::default()
            }))
            .await?
            .into_iter()
            .filter_map(|c| {
                let service = c.labels?.get(SERVICE_LABEL)?.clone();
                Some((c.id?, service))
            })
            .collect();
        found.sort();
        Ok(found)
    }

    /// The container ids of one service (running or not), in a stable order. For a scaled
    /// service (the workers) every replica, which testcontainers' service map does not keep.
    pub async fn service_containers(&self, service: &str) -> anyhow::Result<Vec<String>> {
        Ok(self
            .list(&[(PROJECT_LABEL, &self.name), (SERVICE_LABEL, service)])
            .await?
            .into_iter()
            .map(|(id, _)| id)
            .collect())
    }

    /// The container of a service that runs one, as testcontainers found it at `up`.
    pub fn container(&self, service: &str) -> anyhow::Result<String> {
        Ok(self
            .compose()
            .service(service)
            .with_context(|| format!("no container for service {service}"))?
            .id()
            .to_string())
    }

    /// The host port Docker published `port` of `service` on (127.0.0.1), read at each call: a
    /// container that was stopped and started again may have another.
    pub async fn host_port(&self, service: &str, port: u16) -> anyhow::Result<u16> {
        self.compose()
            .service(service)
            .with_context(|| format!("no container for service {service}"))?
            .get_host_port_ipv4(port)
            .await
            .with_context(|| format!("the host port of {service}:{port}"))
    }

    /// Waits until every container of the project is running and healthy (a one-shot: exited
    /// with status 0); fails at once when one has exited otherwise or turned unhealthy, with its
    /// last log lines.
    pub async fn wait_healthy(&self, timeout: Duration) -> anyhow::Result<()> {
        let deadline = Instant::now() + timeout;
        loop {
            let containers = self.containers().await?;
            let mut waiting = Vec::new();
            for (id, service) in &containers {
                let (name, status, health, exit_code) = self.state(id).await?;
                let one_shot = ONE_SHOT.contains(&service.as_str());
                match (status, health) {
                    (Status::RUNNING, Health::HEALTHY) => {}
                    // A one-shot (db-setup) is done when it exited successfully.
                    (Status::EXITED, _) if one_shot && exit_code == 0 => {}
                    (Status::RUNNING | Status::CREATED, _) if one_shot => {
                        waiting.push(format!("{name} {status}"))
                    }
                    (Status::EXITED | Status::DEAD | Status::RESTARTING, _)
                    | (_, Health::UNHEALTHY) => {
                        let logs = self.logs(id, 30).await;
                        bail!("{name} is {status}/{health} (exit {exit_code}); its last log lines:\n{logs}");
                    }
                    _ => waiting.push(format!("{name} {status}/{health}")),
                }
            }
            if !containers.is_empty() && waiting.is_empty() {
                return Ok(());
            }
            if Instant::now() > deadline {
                bail!("not healthy within {timeout:?}: {waiting:?}");
            }
            tokio::time::sleep(POLL).await;
        }
    }

    /// Waits until one container is running and healthy again.
    pub async fn wait_container_healthy(&self, id: &str, timeout: Duration) -> anyhow::Result<()> {
        let deadline = Instant::now() + timeout;
        loop {
            let (name, status, health, _) = self.state(id).await?;
            if (status, health) == (Status::RUNNING, Health::HEALTHY) {
                return Ok(());
            }
            if Instant::now() > deadline {
                bail!("{name} not healthy within {timeout:?}: {status}/{health}");
            }
            tokio::time::sleep(POLL).await;
        }
    }

    /// A container's name, status, health (`none` without a health check) and exit code.
    async fn state(&self, id: &str) -> anyhow::Result<(String, Status, Health, i64)> {
        let inspect = self
            .docker
            .inspect_container(id, None)
            .await
            .with_context(|| format!("inspect {id}"))?;
        let state = inspect.state.unwrap_or_default();
        Ok((
            inspect.name.unwrap_or_else(|| id.to_string()),
            state.status.unwrap_or(Status::EMPTY),
            state.health.and_then(|h| h.status).unwrap_or(Health::NONE),
            state.exit_code.unwrap_or_default(),
        ))
    }

    /// Stops a container (SIGTERM, then SIGKILL after [`CUT_GRACE_SECS`]).
    pub async fn stop(&self, id: &str) -> anyhow::Result<()> {
        let options = StopContainerOptions {
            t: Some(CUT_GRACE_SECS),
            ..Default::default()
        };
        Ok(self.docker.stop_container(id, Some(options)).await?)
    }

    pub async fn start(&self, id: &str) -> anyhow::Result<()> {
        Ok(self.docker.start_container(id, None).await?)
    }

    /// SIGKILL, no grace.
    pub async fn kill(&self, id: &str) -> anyhow::Result<()> {
        let options = KillContainerOptions {
            signal: "SIGKILL".into(),
        };
        Ok(self.docker.kill_container(id, Some(options)).await?)
    }

    /// Freezes every process of the container (the cgroup freezer): it holds its sockets and
    /// state and resumes where it was at [`Deployment::unpause`].
    pub async fn pause(&self, id: &str) -> anyhow::Result<()> {
        Ok(self.docker.pause_container(id).await?)
    }

    pub async fn unpause(&self, id: &str) -> anyhow::Result<()> {
        Ok(self.docker.unpause_container(id).await?)
    }

    pub async fn restart(&self, id: &str) -> anyhow::Result<()> {
        let options = RestartContainerOptions {
            t: Some(CUT_GRACE_SECS),
            ..Default::default()
        };
        Ok(self.docker.restart_container(id, Some(options)).await?)
    }

    /// The project's network whose compose name is `network` (e.g. "lock").
    pub async fn network(&self, network: &str) -> anyhow::Result<String> {
        let filters = HashMap::from([(
            "label".to_string(),
            vec![
                format!("{PROJECT_LABEL}={}", self.name),
                format!("{NETWORK_LABEL}={network}"),
            ],
        )]);
        self.docker
            .list_networks(Some(ListNetworksOptions {
                filters: Some(filters),
            }))
            .await?
            .into_iter()
            .find_map(|n| n.id)
            .with_context(|| format!("no network {network} in project {}", self.name))
    }

    /// Cuts a container off a network (forced: it may be paused or mid-request).
    pub async fn disconnect(&self, network: &str, id: &str) -> anyhow::Result<()> {
        let request = NetworkDisconnectRequest {
            container: id.to_string(),
            force: Some(true),
        };
        Ok(self.docker.disconnect_network(network, request).await?)
    }

    pub async fn connect(&self, network: &str, id: &str) -> anyhow::Result<()> {
        let request = NetworkConnectRequest {
            container: id.to_string(),
            endpoint_config: None,
        };
        Ok(self.docker.connect_network(network, request).await?)
    }

    /// A command inside a running container: its stdout, or an error with its exit code and
    /// output when it exits non-zero.
    pub async fn exec(&self, id: &str, cmd: &[&str]) -> anyhow::Result<String> {
        let (code, stdout, stderr) = self.exec_outcome(id, cmd).await?;
        ensure!(
            code == Some(0),
            "exec {cmd:?} in {id} exited {code:?}: {stdout}{stderr}"
        );
        Ok(stdout)
    }

    /// A command inside a running container, whatever its exit: (exit code, stdout, stderr).
    pub async fn exec_outcome(
        &self,
        id: &str,
        cmd: &[&str],
    ) -> anyhow::Result<(Option<i64>, String, String)> {
        let exec = self
            .docker
            .create_exec(
                id,
                CreateExecOptions {
                    cmd: Some(cmd.to_vec()),
                    attach_stdout: Some(true),
                    attach_stderr: Some(true),
                    ..Default::default()
                },
            )
            .await
            .with_context(|| format!("exec {cmd:?} in {id}"))?;
        let (mut stdout, mut stderr) = (String::new(), String::new());
        if let StartExecResults::Attached { mut output, .. } =
            self.docker.start_exec(&exec.id, None).await?
        {
            while let Some(chunk) = output.next().await {
                match chunk? {
                    LogOutput::StdErr { message } => {
                        stderr.push_str(&String::from_utf8_lossy(&message))
                    }
                    other => stdout.push_str(&String::from_utf8_lossy(&other.into_bytes())),
                }
            }
        }
        let code = self.docker.inspect_exec(&exec.id).await?.exit_code;
        Ok((code, stdout, stderr))
    }

    /// A container's last `lines` log lines, stdout and stderr both.
    pub async fn logs(&self, id: &str, lines: usize) -> String {
        let options = LogsOptions {
            stdout: true,
            stderr: true,
            tail: lines.to_string(),
            ..Default::default()
        };
        let mut logs = String::new();
        let mut stream = self.docker.logs(id, Some(options));
        while let Some(chunk) = stream.next().await {
            match chunk {
                Ok(chunk) => logs.push_str(&String::from_utf8_lossy(&chunk.into_bytes())),
                Err(e) => {
                    logs.push_str(&format!("(no more logs: {e})"));
                    break;
                }
            }
        }
        logs
    }

    /// A container's configured environment (`docker inspect`'s Config.Env: what anyone who can
    /// inspect it reads, for its whole life, exited or not).
    pub async fn container_env(&self, id: &str) -> anyhow::Result<Vec<String>> {
        Ok(self
            .docker
            .inspect_container(id, None)
            .await?
            .config
            .and_then(|c| c.env)
            .unwrap_or_default())
    }

    /// Every container of the project (one-shots included) with its service and the bounds its
    /// host config carries: (service, memory bytes, nano-CPUs, pids limit, log max-size).
    pub async fn container_bounds(
        &self,
    ) -> anyhow::Result<Vec<(String, i64, i64, i64, Option<String>)>> {
        let mut bounds = Vec::new();
        for (id, service) in self.containers().await? {
            let host = self
                .docker
                .inspect_container(&id, None)
                .await?
                .host_config
                .unwrap_or_default();
            let max_size = host
                .log_config
                .and_then(|l| l.config)
                .and_then(|c| c.get("max-size").cloned());
            bounds.push((
                service,
                host.memory.unwrap_or(0),
                host.nano_cpus.unwrap_or(0),
                host.pids_limit.unwrap_or(0),
                max_size,
            ));
        }
        Ok(bounds)
    }

    /// Every container's last log lines, for a failure report.
    pub async fn logs_tail(&self, lines: usize) -> String {
        let containers = match self.containers().await {
            Ok(c) => c,
            Err(e) => return format!("(logs unavailable: {e:#})"),
        };
        let mut all = String::new();
        for (id, service) in containers {
            let short = &id[..id.len().min(12)];
            for line in self.logs(&id, lines).await.lines() {
                all.push_str(&format!("{service} {short} | {line}\n"));
            }
        }
        all
    }

    /// `docker compose down --volumes`: containers, networks and volumes; left up when
    /// TESTCONTAINERS_COMMAND=keep (testcontainers' own switch), for inspection.
    pub async fn down(&mut self) {
        let Some(compose) = self.compose.take() else {
            return;
        };
        if std::env::var(KEEP_VAR).is_ok_and(|v| v == "keep") {
            eprintln!("compose: {KEEP_VAR}=keep, leaving project {} up", self.name);
            // Its drop reads the same switch and leaves the project up too.
            drop(compose);
            return;
        }
        if let Err(e) = compose.down().await {
            eprintln!("compose: down of {} failed: {e}", self.name);
        }
    }
}
