//! A private etcd cluster of one or three members (Debian's `etcd-server`), on loopback ports.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::Context;

use crate::process::{Lifetime, ManagedProcess, ProcessSpec};
use crate::util::{free_port, http_get, wait_blocking};

/// A member's first start, or a restart that replays its WAL.
pub const READY_TIMEOUT_MS: u64 = 60_000;

pub struct EtcdMember {
    pub name: String,
    pub client_port: u16,
    pub peer_port: u16,
    pub data_dir: PathBuf,
    pub process: ManagedProcess,
}

impl EtcdMember {
    pub fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.client_port)
    }

    /// Member's own health: `/health` answers `"health":"true"` only when the cluster has a leader.
    pub fn is_healthy(&self) -> bool {
        http_get(self.client_port, "/health", Duration::from_millis(500))
            .is_ok_and(|(status, body)| status == 200 && body.contains("\"true\""))
    }

    /// Starts the member again with its data directory after a kill or stop.
    pub fn restart(&self) -> anyhow::Result<()> {
        self.process.restart()
    }
}

pub struct EtcdCluster {
    pub members: Vec<EtcdMember>,
}

impl EtcdCluster {
    /// Starts `count` members under `dir` (ports given, or fresh free ports if `None`), and waits
    /// until every member reports a leader.
    pub fn start(
        dir: &Path,
        count: usize,
        client_ports: Option<Vec<u16>>,
        lifetime: Lifetime,
    ) -> anyhow::Result<Self> {
        anyhow::ensure!(
            count == 1 || count == 3 || count == 5,
            "etcd members must be 1, 3 or 5, got {count}"
        );
        let binary = which("etcd").context("etcd is not installed: run scripts/setup.sh")?;
        let client_ports =
            client_ports.unwrap_or_else(|| (0..count).map(|_| free_port()).collect());
        anyhow::ensure!(client_ports.len() == count, "one client port per member");
        let peer_ports: Vec<u16> = (0..count).map(|_| free_port()).collect();
        let initial_cluster = (0..count)
            .map(|i| format!("m{i}=http://127.0.0.1:{}", peer_ports[i]))
            .collect::<Vec<_>>()
            .join(",");
        // A per-cluster token keeps members of different test stacks from ever joining each other.
        let token = format!("payout-{}-{}", std::process::id(), client_ports[0]);
        let mut members = Vec::new();
        for i in 0..count {
            let name = format!("m{i}");
            let data_dir = dir.join(&name);
            std::fs::create_dir_all(&data_dir)?;
            let client = format!("http://127.0.0.1:{}", client_ports[i]);
            let peer = format!("http://127.0.0.1:{}", peer_ports[i]);
            let spec = ProcessSpec::new(
                &format!("etcd-{name}"),
                &binary,
                dir.join(format!("{name}.log")),
            )
            .args(["--name", &name])
            .args(["--data-dir".into(), data_dir.clone().into_os_string()])
            .args([
                "--listen-client-urls",
                &client,
                "--advertise-client-urls",
                &client,
            ])
            .args([
                "--listen-peer-urls",
                &peer,
                "--initial-advertise-peer-urls",
                &peer,
            ])
            .args([
                "--initial-cluster",
                &initial_cluster,
                "--initial-cluster-state",
                "new",
            ])
            .args(["--initial-cluster-token", &token])
            // Short election timings so a leader kill is survived in about a second.
            .args(["--heartbeat-interval", "100", "--election-timeout", "1000"])
            .args(["--log-level", "warn", "--logger", "zap"])
            .lifetime(lifetime);
            let process = ManagedProcess::start(spec)?;
            members.push(EtcdMember {
                name,
                client_port: client_ports[i],
                peer_port: peer_ports[i],
                data_dir,
                process,
            });
        }
        let cluster = Self { members };
        cluster.wait_healthy()?;
        Ok(cluster)
    }

    pub fn wait_healthy(&self) -> anyhow::Result<()> {
        for member in self.members.iter().filter(|m| m.process.is_running()) {
            wait_blocking(
                Duration::from_millis(READY_TIMEOUT_MS),
                &format!("etcd {} healthy", member.name),
                || member.is_healthy(),
            )
            .with_context(|| format!("log tail:\n{}", member.process.log_tail(20)))?;
        }
        Ok(())
    }

    pub fn endpoints(&self) -> Vec<String> {
        self.members.iter().map(|m| m.endpoint()).collect()
    }

    /// Index of the current leader, asked of every running member.
    pub async fn leader(&self) -> anyhow::Result<usize> {
        for member in self.members.iter().filter(|m| m.process.is_running()) {
            let Ok(mut client) = etcd_client::Client::connect([member.endpoint()], None).await
            else {
                continue;
            };
            let Ok(status) = client.status().await else {
                continue;
            };
            let leader_id = status.leader();
            let own_id = status.header().map(|h| h.member_id()).unwrap_or_default();
            if leader_id == own_id {
                return Ok(self
                    .members
                    .iter()
                    .position(|m| m.name == member.name)
                    .expect("member of cluster"));
            }
            // Ask the member list which member the leader id belongs to.
            if let Ok(list) = client.member_list().await {
                if let Some(m) = list.members().iter().find(|m| m.id() == leader_id) {
                    if let Some(index) = self.members.iter().position(|x| x.name == m.name()) {
                        return Ok(index);
                    }
                }
            }
        }
        anyhow::bail!("no running etcd member knows a leader")
    }
}

pub(crate) fn which(program: &str) -> Option<PathBuf> {
    std::env::var_os("PATH")?
        .to_str()?
        .split(':')
        .map(|dir| Path::new(dir).join(program))
        .find(|p| p.is_file())
}
