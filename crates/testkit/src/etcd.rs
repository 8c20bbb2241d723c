//! A private etcd cluster of one or three members (Debian's `etcd-server`), on loopback ports.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::Context;
use mtls::etcd_access::Access;

use crate::process::{Lifetime, ManagedProcess, ProcessSpec};
use crate::util::{free_port, http_get, wait_blocking};

/// A member's first start, or a restart that replays its WAL.
pub const READY_TIMEOUT_MS: u64 = 60_000;

/// History etcd keeps for the tests and the local stack (`--auto-compaction-mode periodic`). The
/// lock-server reads history only through a watch opened from a revision it read milliseconds
/// before, and handles a compacted start by reading again; one second is enough for that, makes
/// compaction happen inside every test that waits for a lock (so the compacted path is exercised,
/// not just written), and keeps a soak of thousands of grants bounded within seconds. The compose
/// deployment keeps five minutes (`docker-compose.yml`).
pub const AUTO_COMPACTION_RETENTION: &str = "1s";
/// Backend quota of the tests and the local stack. The largest test run (a chaos run of thousands
/// of payouts, or the lock-server's soak) keeps a few MiB live; 256 MiB is two orders of magnitude
/// above that, so a run that reaches the quota (etcd raises `NOSPACE` and refuses writes, and the
/// lock service fails closed) has found a leak, and the bound is still small for a CI disk.
pub const QUOTA_BACKEND_BYTES: u64 = 256 * 1024 * 1024;

/// How an etcd member bounds its database: compacted history and a backend quota. Every etcd the
/// testkit starts gets these flags; [`EtcdLimits::args`] also serves the tests that run etcd
/// themselves.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EtcdLimits {
    /// `--auto-compaction-retention` (periodic); `None` only in a test's negative control.
    compaction_retention: Option<String>,
    quota_backend_bytes: u64,
    /// One member's data directory on a volume of its own of this many bytes (member index,
    /// bytes): the chaos stack fills it to see a member's disk run out.
    data_volume: Option<(usize, u64)>,
}

impl Default for EtcdLimits {
    fn default() -> Self {
        Self {
            compaction_retention: Some(AUTO_COMPACTION_RETENTION.to_string()),
            quota_backend_bytes: QUOTA_BACKEND_BYTES,
            data_volume: None,
        }
    }
}

impl EtcdLimits {
    /// Test-only negative control: history is never compacted, so the database grows with every
    /// revision. No binary offers this; it exists to show what compaction is worth.
    #[doc(hidden)]
    pub fn without_compaction_for_tests(mut self) -> Self {
        self.compaction_retention = None;
        self
    }

    /// A smaller (or larger) backend quota: the chaos stack's is small enough that a fault can
    /// reach it in seconds and see etcd raise `NOSPACE`.
    pub fn with_quota_backend_bytes(mut self, bytes: u64) -> Self {
        self.quota_backend_bytes = bytes;
        self
    }

    /// Member `member`'s data directory on a size-capped volume of `bytes`
    /// ([`crate::volume::CappedVolume`]).
    pub fn with_data_volume(mut self, member: usize, bytes: u64) -> Self {
        self.data_volume = Some((member, bytes));
        self
    }

    pub fn quota_backend_bytes(&self) -> u64 {
        self.quota_backend_bytes
    }

    pub fn compaction_retention(&self) -> Option<&str> {
        self.compaction_retention.as_deref()
    }

    /// The etcd flags. Compaction off is stated explicitly (retention 0), never left to a default.
    pub fn args(&self) -> Vec<String> {
        vec![
            "--auto-compaction-mode".into(),
            "periodic".into(),
            "--auto-compaction-retention".into(),
            self.compaction_retention
                .clone()
                .unwrap_or_else(|| "0".into()),
            "--quota-backend-bytes".into(),
            self.quota_backend_bytes.to_string(),
        ]
    }
}

/// The folder of a stack's state directory that holds etcd's certificates.
pub const STACK_DIR: &str = "etcd-tls";
/// The name of the test kit's own etcd client certificate: etcd's `root` (issue 34). The kit
/// enables authentication, provisions every test's identity, snapshots and restores, and reads
/// any test's keys for its assertions; nothing else runs as root.
const KIT_CLIENT: &str = mtls::etcd_access::ROOT;

/// Which row of `mtls::etcd_access`'s table an identity of a test gets ([`EtcdCluster::grant`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EtcdRole {
    /// Read-write on its prefix, nothing outside it.
    LockServer,
    /// Read-only on its prefix's grant records and audit chain (also payoutctl's `reconcile` and
    /// `restore rearm`).
    Reconciler,
}

impl EtcdRole {
    /// The table's role whose permissions this one gets; also the stem of the kit's user names
    /// (`payout-lock-server-3`).
    pub fn table_role(self) -> &'static str {
        match self {
            EtcdRole::LockServer => mtls::etcd_access::LOCK_SERVER_ROLE,
            EtcdRole::Reconciler => mtls::etcd_access::RECONCILER_ROLE,
        }
    }
}

/// The cluster's TLS, as files under the cluster's directory: **an authority of etcd's own**
/// (`<dir>/pki`, issue 34: no certificate of the services' authority, a worker's, an intake's, the
/// general ledger's, reaches etcd at all), the members' certificate (names
/// [`mtls::ETCD_SERVER_NAME`], [`PEER_NAME`], `127.0.0.1`, `localhost`; it serves peers and
/// clients) and the test kit's own client certificate. Members serve TLS only, admit only a client
/// with a certificate from that authority, and a peer only if its certificate also names
/// [`PEER_NAME`] (`--peer-cert-allowed-hostname`): a client's certificate cannot join the cluster.
/// With authentication on ([`EtcdCluster::start`]) a client certificate's common name is its
/// etcd user: the kit's own is `root`, a test's lock-server or reconciler gets a user and role of
/// its own ([`EtcdCluster::identity`]).
#[derive(Debug, Clone)]
pub struct EtcdTls {
    pub ca_file: PathBuf,
    member_cert: PathBuf,
    member_key: PathBuf,
    /// etcd's own authority: the lock-server's and the reconciler's client certificates come
    /// from it ([`EtcdTls::client_of`]).
    pub pki: std::sync::Arc<crate::pki::Pki>,
    /// The test kit's own client identity, etcd's `root` (etcdctl, its etcd clients).
    pub client: mtls::EtcdTlsArgs,
}

/// The name only a member's certificate carries: etcd admits a peer whose certificate names it
/// (`--peer-cert-allowed-hostname`), and no client certificate does.
pub const PEER_NAME: &str = "etcd-peer";

impl EtcdTls {
    /// etcd's own authority in `dir/pki` (made now if absent, kept across restarts) and the
    /// members' and the kit's certificates from it, into `dir`.
    pub fn issue(dir: &Path) -> anyhow::Result<Self> {
        std::fs::create_dir_all(dir)?;
        let pki = std::sync::Arc::new(crate::pki::Pki::in_dir(dir)?);
        let member = pki.issue_named(
            &[mtls::ETCD_SERVER_NAME, PEER_NAME, "127.0.0.1", "localhost"],
            "etcd-member",
        )?;
        let (member_cert, member_key) = (dir.join("member.pem"), dir.join("member.key"));
        // Issued afresh at every start (a restarted stack keeps its authority, not these files).
        let _ = std::fs::remove_file(&member_key);
        std::fs::write(&member_cert, &member.cert_pem)?;
        crate::grants::write_secret(&member_key, &member.key_pem)?;
        let client = Self::client_of(&pki, dir, KIT_CLIENT)?;
        Ok(Self {
            ca_file: pki.ca_file(),
            member_cert,
            member_key,
            pki,
            client,
        })
    }

    /// For an etcd of its own outside any stack (the soak): an authority of its own in `dir`.
    pub fn with_own_authority(dir: &Path) -> anyhow::Result<Self> {
        Self::issue(&dir.join(STACK_DIR))
    }

    /// Where the test kit's own client certificate is in a stack's state directory (what
    /// [`EtcdTls::issue`] wrote there for the stack's etcd, named `root`): `payoutdev stack
    /// status` reads etcd with it.
    pub fn kit_client_in(state_dir: &Path) -> mtls::EtcdTlsArgs {
        let dir = state_dir.join(STACK_DIR);
        mtls::EtcdTlsArgs::new(
            Self::authority_dir_in(state_dir).join("ca.pem"),
            dir.join(format!("{KIT_CLIENT}-client.pem")),
            dir.join(format!("{KIT_CLIENT}-client.key")),
        )
    }

    /// Where etcd's own authority is in a stack's state directory (`payoutctl`'s local target
    /// issues itself an etcd client certificate there).
    pub fn authority_dir_in(state_dir: &Path) -> PathBuf {
        state_dir.join(STACK_DIR).join(crate::pki::DIR)
    }

    /// A client certificate for `name` (a lock-server, a reconciler) from `pki`, written into
    /// `dir`: the flags that give it to a process.
    pub fn client_of(
        pki: &crate::pki::Pki,
        dir: &Path,
        name: &str,
    ) -> anyhow::Result<mtls::EtcdTlsArgs> {
        let issued = pki.issue_named(&[&format!("{name}.etcd-client")], name)?;
        let (cert, key) = (
            dir.join(format!("{name}-client.pem")),
            dir.join(format!("{name}-client.key")),
        );
        let _ = std::fs::remove_file(&key);
        std::fs::write(&cert, &issued.cert_pem)?;
        crate::grants::write_secret(&key, &issued.key_pem)?;
        Ok(mtls::EtcdTlsArgs::new(pki.ca_file(), cert, key))
    }

    /// A member's TLS flags: clients and peers over TLS, each with a certificate from the
    /// authority.
    pub fn member_args(&self) -> Vec<std::ffi::OsString> {
        let (ca, cert, key) = (&self.ca_file, &self.member_cert, &self.member_key);
        let mut args: Vec<std::ffi::OsString> = Vec::new();
        for (flag, path) in [
            ("--cert-file", cert),
            ("--key-file", key),
            ("--trusted-ca-file", ca),
            ("--peer-cert-file", cert),
            ("--peer-key-file", key),
            ("--peer-trusted-ca-file", ca),
        ] {
            args.push(flag.into());
            args.push(path.clone().into_os_string());
        }
        args.push("--client-cert-auth".into());
        args.push("--peer-client-cert-auth".into());
        args.push("--peer-cert-allowed-hostname".into());
        args.push(PEER_NAME.into());
        args
    }

    /// etcdctl's flags for the kit's own identity.
    pub fn etcdctl_args(&self) -> Vec<String> {
        let path = |p: &Option<PathBuf>| p.as_deref().map(Path::display).map(|d| d.to_string());
        let c = &self.client;
        vec![
            format!("--cacert={}", path(&c.ca).unwrap_or_default()),
            format!("--cert={}", path(&c.cert).unwrap_or_default()),
            format!("--key={}", path(&c.key).unwrap_or_default()),
        ]
    }

    /// The members' own certificate and key (what a peer presents).
    pub fn member_identity(&self) -> (&Path, &Path) {
        (&self.member_cert, &self.member_key)
    }

    /// An etcd client of the kit's own identity to `endpoints`.
    pub async fn connect(&self, endpoints: &[String]) -> anyhow::Result<etcd_client::Client> {
        connect_as(endpoints, &self.client).await
    }
}

pub struct EtcdMember {
    pub name: String,
    pub client_port: u16,
    pub peer_port: u16,
    /// Plain HTTP on loopback for `/health` and `/metrics` only (`--listen-metrics-urls`): no
    /// keyspace is reachable through it.
    pub metrics_port: u16,
    pub data_dir: PathBuf,
    pub process: ManagedProcess,
    /// The capped volume its data directory is on, if any (`EtcdLimits::with_data_volume`).
    /// After `process`: the member is killed before its volume is unmounted.
    pub volume: Option<crate::volume::CappedVolume>,
}

impl EtcdMember {
    pub fn endpoint(&self) -> String {
        format!("https://127.0.0.1:{}", self.client_port)
    }

    /// Member's own health: `/health` answers `"health":"true"` only when the cluster has a leader.
    pub fn is_healthy(&self) -> bool {
        http_get(self.metrics_port, "/health", Duration::from_millis(500))
            .is_ok_and(|(status, body)| status == 200 && body.contains("\"true\""))
    }

    /// Starts the member again with its data directory after a kill or stop.
    pub fn restart(&self) -> anyhow::Result<()> {
        self.process.restart()
    }
}

pub struct EtcdCluster {
    pub members: Vec<EtcdMember>,
    pub tls: EtcdTls,
    /// `--initial-cluster` and `--initial-cluster-token` of the first start: a restore from a
    /// snapshot rebuilds the same membership.
    initial_cluster: String,
    token: String,
}

impl EtcdCluster {
    /// Starts `count` members under `dir` (ports given, or fresh free ports if `None`), waits
    /// until every member reports a leader, and turns authentication on (`root` is the kit's own
    /// certificate; [`EtcdCluster::identity`] gives a test's services theirs).
    pub fn start(
        dir: &Path,
        count: usize,
        client_ports: Option<Vec<u16>>,
        lifetime: Lifetime,
        tls: EtcdTls,
    ) -> anyhow::Result<Self> {
        Self::start_with_limits(
            dir,
            count,
            client_ports,
            lifetime,
            &EtcdLimits::default(),
            tls,
        )
    }

    /// [`EtcdCluster::start`] with explicit limits (the soak's negative control turns compaction off).
    pub fn start_with_limits(
        dir: &Path,
        count: usize,
        client_ports: Option<Vec<u16>>,
        lifetime: Lifetime,
        limits: &EtcdLimits,
        tls: EtcdTls,
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
        let metrics_ports: Vec<u16> = (0..count).map(|_| free_port()).collect();
        let initial_cluster = (0..count)
            .map(|i| format!("m{i}=https://127.0.0.1:{}", peer_ports[i]))
            .collect::<Vec<_>>()
            .join(",");
        // A per-cluster token keeps members of different test stacks from ever joining each other.
        let token = format!("payout-{}-{}", std::process::id(), client_ports[0]);
        let mut members = Vec::new();
        for i in 0..count {
            let name = format!("m{i}");
            // A capped member's data directory is one level down its volume, so a restore can
            // replace the directory without touching the mount.
            let volume = match limits.data_volume {
                Some((member, bytes)) if member == i => Some(crate::volume::CappedVolume::mount(
                    &dir.join(format!("{name}-volume")),
                    bytes,
                    None,
                )?),
                _ => None,
            };
            let data_dir = volume
                .as_ref()
                .map_or_else(|| dir.join(&name), |v| v.path().join("data"));
            std::fs::create_dir_all(&data_dir)?;
            let client = format!("https://127.0.0.1:{}", client_ports[i]);
            let peer = format!("https://127.0.0.1:{}", peer_ports[i]);
            let metrics = format!("http://127.0.0.1:{}", metrics_ports[i]);
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
            .args(tls.member_args())
            .args(["--listen-metrics-urls", &metrics])
            // Short election timings so a leader kill is survived in about a second.
            .args(["--heartbeat-interval", "100", "--election-timeout", "1000"])
            .args(limits.args())
            .args(["--log-level", "warn", "--logger", "zap"])
            .lifetime(lifetime);
            let process = ManagedProcess::start(spec)?;
            members.push(EtcdMember {
                name,
                client_port: client_ports[i],
                peer_port: peer_ports[i],
                metrics_port: metrics_ports[i],
                data_dir,
                process,
                volume,
            });
        }
        let cluster = Self {
            members,
            tls,
            initial_cluster,
            token,
        };
        cluster.wait_healthy()?;
        cluster.enable_auth()?;
        Ok(cluster)
    }

    /// Test-only negative control: a one-member cluster with authentication off (turned off by
    /// root right after the start), so every certificate of etcd's authority may do anything:
    /// what every test etcd was before issue 34. No binary offers this; it exists to show what
    /// the roles refuse, and for a test of provisioning, which turns authentication on itself.
    #[doc(hidden)]
    pub fn start_without_auth_for_tests(
        dir: &Path,
        lifetime: Lifetime,
        tls: EtcdTls,
    ) -> anyhow::Result<Self> {
        let cluster = Self::start(dir, 1, None, lifetime, tls)?;
        let (tls, endpoints) = (cluster.tls.clone(), cluster.endpoints());
        block_on(async move {
            let mut root = tls.connect(&endpoints).await?;
            root.auth_disable()
                .await
                .context("disabling authentication")?;
            Ok(())
        })?;
        Ok(cluster)
    }

    /// Authentication on, once the cluster is healthy: the user `root` (the kit's own
    /// certificate's name; no password, the certificate is the credential) with the role `root`,
    /// then `auth enable`. Idempotent: a stack restarted from its state directory already has
    /// both, and root may add what exists (refused as existing) and enable again (a no-op).
    fn enable_auth(&self) -> anyhow::Result<()> {
        let (tls, endpoints) = (self.tls.clone(), self.endpoints());
        block_on(async move {
            let mut root = tls.connect(&endpoints).await?;
            add_user(&mut root, mtls::etcd_access::ROOT).await?;
            root.user_grant_role(mtls::etcd_access::ROOT, mtls::etcd_access::ROOT)
                .await
                .context("granting root to root")?;
            root.auth_enable()
                .await
                .context("enabling authentication")?;
            Ok(())
        })
    }

    /// A client certificate of etcd's authority named `user` (written into `dir`) that the
    /// cluster knows as a user with `role`'s permissions rendered against `prefix` and no other
    /// ([`EtcdCluster::grant`]): a lock-server's or a reconciler's `--etcd-tls-*` flags.
    pub fn identity(
        &self,
        dir: &Path,
        user: &str,
        role: EtcdRole,
        prefix: &str,
    ) -> anyhow::Result<mtls::EtcdTlsArgs> {
        let args = EtcdTls::client_of(&self.tls.pki, dir, user)?;
        self.grant(user, role, prefix)?;
        Ok(args)
    }

    /// Makes `user` (a certificate's common name) a user of the cluster whose only role is one of
    /// its own, named after it, with the permissions `mtls::etcd_access` gives `role` on `prefix`.
    /// A role per user, not the table's shared one: tests share a cluster under prefixes of
    /// their own, so no test's identity may reach another's keys. Made anew each time (deleted
    /// first: etcd takes a deleted role from its users), so a stack restarted from its state
    /// directory holds exactly this prefix for the name.
    pub fn grant(&self, user: &str, role: EtcdRole, prefix: &str) -> anyhow::Result<()> {
        let table = mtls::etcd_access::roles(prefix)
            .into_iter()
            .find(|r| r.name == role.table_role())
            .context("mtls::etcd_access has every EtcdRole")?;
        let (tls, endpoints, user) = (self.tls.clone(), self.endpoints(), user.to_string());
        block_on(async move {
            let mut root = tls.connect(&endpoints).await?;
            match root.role_delete(user.as_str()).await {
                Err(e) if !e.to_string().contains("role name not found") => {
                    return Err(e).with_context(|| format!("deleting role {user}"))
                }
                _ => {}
            }
            root.role_add(user.as_str())
                .await
                .with_context(|| format!("adding role {user}"))?;
            for p in &table.permissions {
                let permission = match p.access {
                    Access::Read => etcd_client::Permission::read(p.prefix.as_bytes()),
                    Access::ReadWrite => etcd_client::Permission::read_write(p.prefix.as_bytes()),
                }
                .with_prefix();
                root.role_grant_permission(user.as_str(), permission)
                    .await
                    .with_context(|| format!("granting {user} on {:?}", p.prefix))?;
            }
            add_user(&mut root, &user).await?;
            root.user_grant_role(user.as_str(), user.as_str())
                .await
                .with_context(|| format!("granting role {user} to user {user}"))?;
            Ok(())
        })
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

    /// Debian's `etcdctl` as an operator runs it: as `root` (the kit's certificate), against the
    /// running members' endpoints. Answers its standard output; a non-zero exit is the error,
    /// with etcdctl's standard error.
    pub fn etcdctl_as_root(&self, args: &[&str]) -> anyhow::Result<String> {
        let identity = self.tls.etcdctl_args();
        let endpoints = self
            .members
            .iter()
            .filter(|m| m.process.is_running())
            .map(EtcdMember::endpoint)
            .collect::<Vec<_>>()
            .join(",");
        let mut all: Vec<&str> = identity.iter().map(String::as_str).collect();
        all.extend(["--endpoints", &endpoints]);
        all.extend_from_slice(args);
        etcdctl(&all)
    }

    /// Saves a snapshot of the cluster's keyspace (asked of a healthy member) to `path`, with
    /// Debian's `etcdctl snapshot save`. Returns the revision the snapshot holds.
    pub fn snapshot(&self, path: &Path) -> anyhow::Result<i64> {
        let member = self
            .members
            .iter()
            .find(|m| m.process.is_running() && m.is_healthy())
            .context("no healthy etcd member to snapshot")?;
        let _ = std::fs::remove_file(path);
        let identity = self.tls.etcdctl_args();
        let mut save: Vec<&str> = identity.iter().map(String::as_str).collect();
        let endpoint = member.endpoint();
        save.extend([
            "--endpoints",
            &endpoint,
            "snapshot",
            "save",
            path.to_str().context("snapshot path is UTF-8")?,
        ]);
        etcdctl(&save)?;
        let status = etcdctl(&[
            "snapshot",
            "status",
            path.to_str().context("snapshot path is UTF-8")?,
            "-w",
            "json",
        ])?;
        let v: serde_json::Value = serde_json::from_str(&status)
            .with_context(|| format!("etcdctl snapshot status: {status}"))?;
        v["revision"]
            .as_i64()
            .with_context(|| format!("no revision in {status}"))
    }

    /// Disaster recovery as an operator does it: every member is stopped (SIGKILL), its data
    /// directory replaced by `etcdctl snapshot restore` of `snapshot` (same names, peer URLs and
    /// cluster token), and the cluster started again. Everything written after the snapshot is
    /// gone, and the cluster's revision is the snapshot's again. No revision bump: that is the
    /// restore procedure's job ([`EtcdCluster::advance_revision_past`]), which a test may skip.
    pub fn restore_from_snapshot(&self, snapshot: &Path) -> anyhow::Result<()> {
        for m in &self.members {
            let _ = m.process.kill();
        }
        for m in &self.members {
            let restored = m.data_dir.with_extension("restoring");
            let _ = std::fs::remove_dir_all(&restored);
            etcdctl(&[
                "snapshot",
                "restore",
                snapshot.to_str().context("snapshot path is UTF-8")?,
                "--name",
                &m.name,
                "--data-dir",
                restored.to_str().context("data dir is UTF-8")?,
                "--initial-cluster",
                &self.initial_cluster,
                "--initial-cluster-token",
                &self.token,
                "--initial-advertise-peer-urls",
                &format!("https://127.0.0.1:{}", m.peer_port),
            ])?;
            std::fs::remove_dir_all(&m.data_dir)
                .with_context(|| format!("removing {}", m.data_dir.display()))?;
            std::fs::rename(&restored, &m.data_dir)?;
        }
        for m in &self.members {
            m.restart()?;
        }
        self.wait_healthy()
    }

    /// Step 5 of the etcd restore procedure (`services/lock-server/RESTORE.md`): etcd 3.4 has no
    /// `--bump-revision`, so a scratch key is written until the cluster's revision is above
    /// `target` (each put advances it by one), then deleted. Returns the revision reached.
    pub async fn advance_revision_past(&self, target: i64) -> anyhow::Result<i64> {
        let mut client = self.client().await?;
        const SCRATCH: &str = "/restore/scratch";
        let mut revision = 0;
        while revision <= target {
            let r = client.put(SCRATCH, "x", None).await?;
            revision = r.header().map(|h| h.revision()).unwrap_or_default();
        }
        let r = client.delete(SCRATCH, None).await?;
        Ok(r.header().map(|h| h.revision()).unwrap_or(revision))
    }

    /// The cluster's current revision.
    pub async fn revision(&self) -> anyhow::Result<i64> {
        let mut client = self.client().await?;
        let r = client.get("/restore/probe", None).await?;
        Ok(r.header().map(|h| h.revision()).unwrap_or_default())
    }

    /// Step 7 of the restore procedure: revokes every session lease the cluster knows (after a
    /// restore: the snapshot's, whose owners are not keeping a restored cluster alive, or must not
    /// be trusted to). Grant-record retention leases are kept: each carries the lock-server's
    /// marker key `{prefix}retention/{lease id}`, and revoking one would delete the INV-07 grant
    /// records attached to it. Returns how many leases were revoked.
    pub async fn revoke_session_leases(&self) -> anyhow::Result<usize> {
        let mut client = self.client().await?;
        let leases = client.leases().await?;
        let ids: Vec<i64> = leases.leases().iter().map(|l| l.id()).collect();
        let mut revoked = 0;
        for id in ids {
            let marker = format!("/retention/{id}");
            let keys = client
                .lease_time_to_live(
                    id,
                    Some(etcd_client::LeaseTimeToLiveOptions::new().with_keys()),
                )
                .await?;
            if keys.keys().iter().any(|k| k.ends_with(marker.as_bytes())) {
                continue;
            }
            // A lease that expired in the meantime is already gone: not an error.
            if client.lease_revoke(id).await.is_ok() {
                revoked += 1;
            }
        }
        Ok(revoked)
    }

    pub fn endpoints(&self) -> Vec<String> {
        self.members.iter().map(|m| m.endpoint()).collect()
    }

    /// A client of the kit's own identity to every member.
    pub async fn client(&self) -> anyhow::Result<RootClient> {
        Ok(RootClient::new(self.tls.connect(&self.endpoints()).await?))
    }

    /// Index of the current leader, asked of every running member.
    pub async fn leader(&self) -> anyhow::Result<usize> {
        for member in self.members.iter().filter(|m| m.process.is_running()) {
            let Ok(mut client) = self.tls.connect(&[member.endpoint()]).await else {
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

/// An etcd client to `endpoints` presenting `identity` (its certificate's name is its user).
pub async fn connect_as(
    endpoints: &[String],
    identity: &mtls::EtcdTlsArgs,
) -> anyhow::Result<etcd_client::Client> {
    let tls = identity.load()?;
    Ok(etcd_client::Client::connect(
        endpoints,
        Some(etcd_client::ConnectOptions::new().with_tls(tls.etcd_client_config())),
    )
    .await?)
}

/// One read of `key` from `endpoint` as a client presenting `tls` (none: a plaintext client),
/// within a few seconds: Ok, or what refused it (the handshake, or the user's permissions). The
/// attack suite's probe of what etcd admits.
pub async fn read_as(endpoint: &str, tls: Option<&mtls::Tls>, key: &str) -> Result<(), String> {
    let mut options = etcd_client::ConnectOptions::new()
        .with_connect_timeout(Duration::from_secs(3))
        .with_timeout(Duration::from_secs(3));
    if let Some(tls) = tls {
        options = options.with_tls(tls.etcd_client_config());
    }
    let mut client = etcd_client::Client::connect([endpoint], Some(options))
        .await
        .map_err(|e| e.to_string())?;
    client
        .get(key, None)
        .await
        .map(drop)
        .map_err(|e| e.to_string())
}

/// One request to a member's **peer** listener (`GET /members`, what a joining member asks)
/// presenting `cert`/`key`, with curl: Ok, or what refused it. The attack suite's probe of who
/// etcd admits as a peer.
pub fn peer_request_as(peer_port: u16, ca: &Path, cert: &Path, key: &Path) -> Result<(), String> {
    let out = std::process::Command::new("curl")
        .args(["-sS", "--fail", "--http1.1", "--max-time", "5", "--cacert"])
        .arg(ca)
        .arg("--cert")
        .arg(cert)
        .arg("--key")
        .arg(key)
        .arg(format!("https://127.0.0.1:{peer_port}/members"))
        .output()
        .map_err(|e| format!("running curl: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(String::from_utf8_lossy(&out.stderr).trim().to_string())
    }
}

/// Adds `name` as a user with no password (its certificate is its credential); one already there
/// is left as it is.
async fn add_user(root: &mut etcd_client::Client, name: &str) -> anyhow::Result<()> {
    let no_password = etcd_client::UserAddOptions::new().with_no_pwd();
    match root.user_add(name, "", Some(no_password)).await {
        Err(e) if !e.to_string().contains("already exists") => {
            Err(e).with_context(|| format!("adding user {name}"))
        }
        _ => Ok(()),
    }
}

/// Runs `work` on a runtime of its own on a thread of its own: the kit's blocking API (a stack's
/// start, a test's identity) is called from plain threads and from tests' async code alike.
fn block_on<T: Send>(
    work: impl std::future::Future<Output = anyhow::Result<T>> + Send,
) -> anyhow::Result<T> {
    std::thread::scope(|scope| {
        scope
            .spawn(|| {
                tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()?
                    .block_on(work)
            })
            .join()
            .expect("the etcd provisioning thread")
    })
}

/// Runs Debian's `etcdctl` (API v3) and returns its standard output.
fn etcdctl(args: &[&str]) -> anyhow::Result<String> {
    let binary = which("etcdctl").context("etcdctl is not installed: run scripts/setup.sh")?;
    let out = std::process::Command::new(binary)
        .env("ETCDCTL_API", "3")
        .args(args)
        .output()?;
    anyhow::ensure!(
        out.status.success(),
        "etcdctl {}: {}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

pub(crate) fn which(program: &str) -> Option<PathBuf> {
    std::env::var_os("PATH")?
        .to_str()?
        .split(':')
        .map(|dir| Path::new(dir).join(program))
        .find(|p| p.is_file())
}

/// The kit's `root` client for tests and the kit's own helpers: the key-value and lease calls
/// tests make, each sent again while etcd refuses it because a change of users or roles was
/// applied while it was in flight (`mtls::etcd_access::AUTH_REVISION_OLD`: nothing applied, so
/// safe to resend; etcd's own Go client does the same). Tests of one binary provision identities
/// ([`EtcdCluster::grant`]) while others call etcd, so without this a test's read could fail for
/// another test's provisioning. [`RootClient::raw`] for anything else.
#[derive(Clone)]
pub struct RootClient(etcd_client::Client);

macro_rules! resending {
    ($self:ident, $call:ident($($arg:ident),*)) => {{
        let client = $self.0.clone();
        mtls::etcd_access::resend_on_auth_change(|| {
            let mut client = client.clone();
            $(let $arg = $arg.clone();)*
            async move { client.$call($($arg),*).await }
        })
        .await
    }};
}

impl RootClient {
    pub fn new(client: etcd_client::Client) -> Self {
        Self(client)
    }

    /// The client itself, whose calls are not sent again (membership, auth, maintenance).
    pub fn raw(&self) -> etcd_client::Client {
        self.0.clone()
    }

    pub async fn get(
        &mut self,
        key: impl Into<Vec<u8>>,
        options: Option<etcd_client::GetOptions>,
    ) -> Result<etcd_client::GetResponse, etcd_client::Error> {
        let key = key.into();
        resending!(self, get(key, options))
    }

    pub async fn put(
        &mut self,
        key: impl Into<Vec<u8>>,
        value: impl Into<Vec<u8>>,
        options: Option<etcd_client::PutOptions>,
    ) -> Result<etcd_client::PutResponse, etcd_client::Error> {
        let (key, value) = (key.into(), value.into());
        resending!(self, put(key, value, options))
    }

    pub async fn delete(
        &mut self,
        key: impl Into<Vec<u8>>,
        options: Option<etcd_client::DeleteOptions>,
    ) -> Result<etcd_client::DeleteResponse, etcd_client::Error> {
        let key = key.into();
        resending!(self, delete(key, options))
    }

    pub async fn txn(
        &mut self,
        txn: etcd_client::Txn,
    ) -> Result<etcd_client::TxnResponse, etcd_client::Error> {
        resending!(self, txn(txn))
    }

    pub async fn compact(
        &mut self,
        revision: i64,
        options: Option<etcd_client::CompactionOptions>,
    ) -> Result<etcd_client::CompactionResponse, etcd_client::Error> {
        resending!(self, compact(revision, options))
    }

    pub async fn lease_grant(
        &mut self,
        ttl: i64,
        options: Option<etcd_client::LeaseGrantOptions>,
    ) -> Result<etcd_client::LeaseGrantResponse, etcd_client::Error> {
        resending!(self, lease_grant(ttl, options))
    }

    pub async fn lease_revoke(
        &mut self,
        id: i64,
    ) -> Result<etcd_client::LeaseRevokeResponse, etcd_client::Error> {
        resending!(self, lease_revoke(id))
    }

    pub async fn lease_time_to_live(
        &mut self,
        id: i64,
        options: Option<etcd_client::LeaseTimeToLiveOptions>,
    ) -> Result<etcd_client::LeaseTimeToLiveResponse, etcd_client::Error> {
        resending!(self, lease_time_to_live(id, options))
    }

    pub async fn leases(&mut self) -> Result<etcd_client::LeaseLeasesResponse, etcd_client::Error> {
        resending!(self, leases())
    }
}
