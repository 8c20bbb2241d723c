//! The rail's own certificate authority for a system under test (or the local stack): the rail
//! stub's server certificate, and client certificates for the rail proxy (a merchant of the
//! rail) and the harness (the only client of the stub's admin API). Apart from the system's
//! authority, as a real rail's is from ours: no certificate of our services reaches the rail, and
//! no certificate of the rail's reaches our services.

use std::path::{Path, PathBuf};

use anyhow::Context;

/// The folder the rail's authority lives in under the directory it was made for.
pub const DIR: &str = "rail-pki";
/// The rail proxy's client certificate's name.
pub const PROXY_NAME: &str = "rail-proxy";
/// The harness's (the stub's admin API serves no other): the stub's `tls::HARNESS_NAME`.
pub const HARNESS_NAME: &str = "harness";
/// The names of the stub's certificate: what its clients connect to (the stub's `SERVER_NAMES`).
pub const STUB_NAMES: [&str; 3] = ["rail-stub", "127.0.0.1", "localhost"];

/// One certificate and its key as files, with the authority's certificate beside them.
#[derive(Debug, Clone)]
pub struct Identity {
    pub ca: PathBuf,
    pub cert: PathBuf,
    pub key: PathBuf,
}

impl Identity {
    /// The three files loaded.
    pub fn load(&self) -> anyhow::Result<mtls::Tls> {
        mtls::Tls::load(&self.ca, &self.cert, &self.key)
            .with_context(|| format!("loading {}", self.cert.display()))
    }
}

/// The rail's authority in `dir/rail-pki` (made on first use, kept across restarts) and the
/// three certificates a system needs of it.
pub struct RailTls {
    authority: mtls::issue::Authority,
    dir: PathBuf,
    pub stub: Identity,
    pub proxy: Identity,
    pub harness: Identity,
}

impl RailTls {
    /// The rail's authority under `dir` (made now if absent), and the stub's, the proxy's and
    /// the harness's certificates issued afresh into it.
    pub fn issue(dir: &Path) -> anyhow::Result<Self> {
        let dir = dir.join(DIR);
        let authority = mtls::issue::Authority::open_or_create(&dir)
            .with_context(|| format!("the rail's authority in {}", dir.display()))?;
        let write = |names: &[&str], name: &str| -> anyhow::Result<Identity> {
            let args = authority
                .issue_named(names, name)
                .and_then(|issued| issued.write(&dir, name))
                .with_context(|| format!("issuing the rail's {name} certificate"))?;
            Ok(Identity {
                ca: args.ca,
                cert: args.cert,
                key: args.key,
            })
        };
        Ok(Self {
            stub: write(&STUB_NAMES, "rail-stub")?,
            proxy: write(&[PROXY_NAME], PROXY_NAME)?,
            harness: write(&[HARNESS_NAME], HARNESS_NAME)?,
            authority,
            dir,
        })
    }

    /// The stub's `--tls-ca/--tls-cert/--tls-key`.
    pub fn stub_args(&self) -> Vec<String> {
        flags(&["--tls-ca", "--tls-cert", "--tls-key"], &self.stub)
    }

    /// The rail proxy's `--rail-ca/--rail-client-cert/--rail-client-key`.
    pub fn proxy_args(&self) -> Vec<String> {
        flags(
            &["--rail-ca", "--rail-client-cert", "--rail-client-key"],
            &self.proxy,
        )
    }

    /// Another client certificate of the rail's authority, named `name`, in memory: a caller the
    /// rail knows that is neither the proxy nor the harness.
    pub fn client(&self, name: &str) -> anyhow::Result<mtls::Tls> {
        Ok(self
            .authority
            .issue_named(&[name], name)
            .with_context(|| format!("issuing the rail's {name} certificate"))?
            .tls())
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }
}

fn flags(names: &[&str; 3], identity: &Identity) -> Vec<String> {
    let paths = [&identity.ca, &identity.cert, &identity.key];
    names
        .iter()
        .zip(paths)
        .flat_map(|(flag, path)| [flag.to_string(), path.display().to_string()])
        .collect()
}
