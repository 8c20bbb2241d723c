//! The certificates of a system under test (or of the local stack): a certificate authority made
//! on first use in the system's directory (kept across restarts of its processes, never
//! committed), and one certificate per process, each with its own key. Test code that calls a
//! service directly asks for a certificate of the role it plays ([`Pki::tls`]).

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use anyhow::Context;
pub use mtls::{Role, Tls, TlsArgs};

/// The folder an authority lives in under the directory it was made for.
pub const DIR: &str = "pki";

/// The operator a test's operator certificate ([`Pki::tls`]`(Role::Operator)`) carries: the name
/// its break-glass calls must give (the services record the certified name, never a free one).
pub const TEST_OPERATOR: &str = "test-operator";

pub struct Pki {
    dir: PathBuf,
    authority: mtls::issue::Authority,
}

impl std::fmt::Debug for Pki {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pki").field("dir", &self.dir).finish()
    }
}

impl Pki {
    /// The authority under `dir/pki`, made now if it is not there yet.
    pub fn in_dir(dir: &Path) -> anyhow::Result<Self> {
        let dir = dir.join(DIR);
        let authority = mtls::issue::Authority::open_or_create(&dir)
            .with_context(|| format!("certificate authority in {}", dir.display()))?;
        Ok(Self { dir, authority })
    }

    /// Issues `instance`'s certificate for `role` into the directory, for a child process
    /// (`--tls-ca/--tls-cert/--tls-key`, or the `PAYOUT_TLS_*` environment).
    pub fn issue(&self, role: Role, instance: &str) -> anyhow::Result<TlsArgs> {
        self.authority
            .issue_to(role, instance, &self.dir)
            .with_context(|| format!("issuing {instance}'s certificate"))
    }

    /// Issues `instance`'s certificate for `role` into `dir` (with the authority's `ca.pem`), for
    /// clients whose files live apart from the services' (the Temporal front's clients).
    pub fn issue_into(&self, role: Role, instance: &str, dir: &Path) -> anyhow::Result<TlsArgs> {
        self.authority
            .issue_to(role, instance, dir)
            .with_context(|| format!("issuing {instance}'s certificate"))
    }

    /// A certificate for a server that is not one of ours (PostgreSQL, etcd), named by the
    /// names and addresses its clients connect to.
    pub fn issue_named(
        &self,
        names: &[&str],
        instance: &str,
    ) -> anyhow::Result<mtls::issue::Issued> {
        self.authority
            .issue_named(names, instance)
            .with_context(|| format!("issuing {instance}'s certificate"))
    }

    /// A fresh certificate of `role`, in memory: what a test presents when it calls a service
    /// directly as that role. An operator's is [`TEST_OPERATOR`]'s.
    pub fn tls(&self, role: Role) -> Tls {
        self.authority
            .issue(role, &format!("test-{role}"))
            .expect("issuing a test certificate")
            .tls()
    }

    pub fn ca_file(&self) -> PathBuf {
        self.dir.join("ca.pem")
    }
}

/// One authority for the in-process servers and clients of a test binary (its directory is a
/// temporary one, kept for the life of the process).
pub fn shared() -> &'static Pki {
    static SHARED: OnceLock<(tempfile::TempDir, Pki)> = OnceLock::new();
    let (_, pki) = SHARED.get_or_init(|| {
        let dir = tempfile::tempdir().expect("a temporary directory");
        let pki = Pki::in_dir(dir.path()).expect("a certificate authority");
        (dir, pki)
    });
    pki
}

/// A fresh certificate of `role` from [`shared`].
pub fn tls(role: Role) -> Tls {
    shared().tls(role)
}

/// An empty certificate denylist file, for a server binary a test starts by hand
/// (`PAYOUT_TLS_DENYLIST`: every server requires one).
pub fn empty_denylist() -> PathBuf {
    let path = shared().dir.join("empty-denylist");
    if !path.exists() {
        std::fs::write(&path, "").expect("writing the empty denylist");
    }
    path
}

/// TEST ONLY (the test kit is linked by no shipped package): a copy of `policy` in which every
/// role may call every method of its table. A service's own in-process suite, whose subject is the
/// service's logic and which calls it from one client as several roles, serves with it; the real
/// table is what the binaries serve, and the system and attack suites run against them.
pub fn every_role(policy: &'static mtls::authz::Policy) -> &'static mtls::authz::Policy {
    let rules: Vec<mtls::authz::Rule> = policy
        .rules
        .iter()
        .map(|r| mtls::authz::Rule {
            method: r.method,
            roles: &Role::ALL,
        })
        .collect();
    Box::leak(Box::new(mtls::authz::Policy {
        service: policy.service,
        rules: Box::leak(rules.into_boxed_slice()),
    }))
}
