//! Mutual TLS for every gRPC connection of the payout system, and who may call what.
//!
//! - Every process holds its own key and a certificate issued by the project's certificate
//!   authority ([`issue`], behind the `issue` feature: payoutctl, the test kit and the dev tools
//!   issue; services only load). The certificate names one [`Role`] as its DNS subject name.
//! - A server requires a client certificate from that authority ([`Tls::server_config`]); a
//!   client requires the server's certificate to name the role it meant to reach
//!   ([`Tls::endpoint`]), so a worker's certificate cannot stand in for the payment resource.
//! - Each server puts [`authz::Authorize`] in front of its routes: one table per service of which
//!   roles may call which method. The verified caller ([`Caller`]: its role and its certificate's
//!   fingerprint) travels to the handler in the request's extensions, so a handler that owns
//!   per-caller state (the lock service's sessions) binds it to the certificate, not to anything
//!   the caller says about itself.
//!
//! There is no plaintext mode: a URL that is not `https://` is refused by [`Tls::endpoint`]
//! instead of silently connecting in the clear.

pub mod authz;
pub mod denylist;
pub mod etcd_access;
#[cfg(feature = "issue")]
pub mod htpasswd;
#[cfg(feature = "issue")]
pub mod issue;

use std::path::{Path, PathBuf};

use rustls_pki_types::{CertificateDer, ServerName};
use tonic::transport::{Certificate, ClientTlsConfig, Endpoint, Identity, ServerTlsConfig};

/// What a process is, as its certificate says. The certificate's DNS subject name is
/// [`Role::name`]; authorisation tables and server-name checks use nothing else.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Role {
    LockServer,
    PaymentResource,
    RailProxy,
    GeneralLedger,
    OutboxDispatcher,
    /// A payout worker: the only role that makes fenced mutations.
    Worker,
    /// The reconciler and the resolver: reads, and the corrective calls spec 2.6 gives them.
    Reconciler,
    /// A person at `payoutctl`: break-glass actions (force-revoke, GL mode, quarantine replay).
    Operator,
    /// Opens funded accounts. Local stack and tests only; a deployment does not issue it.
    Fixture,
    /// An integrator submitting payouts (CreatePayout) and reading them back.
    Intake,
}

impl Role {
    pub const ALL: [Role; 10] = [
        Role::LockServer,
        Role::PaymentResource,
        Role::RailProxy,
        Role::GeneralLedger,
        Role::OutboxDispatcher,
        Role::Worker,
        Role::Reconciler,
        Role::Operator,
        Role::Fixture,
        Role::Intake,
    ];

    /// The certificate's DNS subject name for this role.
    pub fn name(self) -> &'static str {
        match self {
            Role::LockServer => "lock-server",
            Role::PaymentResource => "payment-resource",
            Role::RailProxy => "rail-proxy",
            Role::GeneralLedger => "general-ledger",
            Role::OutboxDispatcher => "outbox-dispatcher",
            Role::Worker => "worker",
            Role::Reconciler => "reconciler",
            Role::Operator => "operator",
            Role::Fixture => "fixture",
            Role::Intake => "intake",
        }
    }

    pub fn parse(name: &str) -> Result<Role, TlsError> {
        Role::ALL
            .into_iter()
            .find(|r| r.name() == name)
            .ok_or_else(|| TlsError::UnknownRole(name.to_string()))
    }
}

impl std::fmt::Display for Role {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("reading {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{what} in {path} is not a PEM {expected}")]
    NotPem {
        what: &'static str,
        path: PathBuf,
        expected: &'static str,
    },
    #[error("{0:?} is not a role (one of: lock-server, payment-resource, rail-proxy, general-ledger, outbox-dispatcher, worker, reconciler, operator, fixture, intake)")]
    UnknownRole(String),
    #[error("{0:?} cannot be an operator's name: one DNS label (letters, digits and '-', at most 63), which the certificate carries as <name>.operator")]
    OperatorName(String),
    #[error("etcd is reached over mutual TLS only: --etcd-tls-ca, --etcd-tls-cert and --etcd-tls-key (ETCD_TLS_CA, ETCD_TLS_CERT, ETCD_TLS_KEY) are all required")]
    EtcdTlsMissing,
    #[error("{url}: every connection is mutual TLS, so the URL must be https://")]
    NotHttps { url: String },
    #[error("{url}: {source}")]
    BadUrl {
        url: String,
        source: tonic::transport::Error,
    },
    #[error("TLS configuration: {0}")]
    Config(tonic::transport::Error),
    #[cfg(feature = "issue")]
    #[error("issuing a certificate: {0}")]
    Issue(#[from] rcgen::Error),
    #[error("{dir} holds no authority key (ca.key): issuing needs the authority's folder, which stays with the operator (`payoutctl pki init --authority DIR` makes one)")]
    NoAuthorityKey { dir: PathBuf },
    #[error("{dir} already holds an authority ({file}): refusing to make another over it")]
    AuthorityExists { dir: PathBuf, file: &'static str },
    #[error("writing {path}: {source}")]
    Write {
        path: PathBuf,
        source: std::io::Error,
    },
}

/// Where a process's TLS material is: the authority's certificate, its own certificate and key.
/// Every service binary takes these three flags; none has a default and there is no flag that
/// turns TLS off.
#[derive(Debug, Clone, clap::Args)]
pub struct TlsArgs {
    /// The certificate authority (PEM) whose certificates this process trusts, as server and as
    /// client.
    #[arg(long = "tls-ca", env = "PAYOUT_TLS_CA", value_name = "PEM")]
    pub ca: PathBuf,
    /// This process's own certificate (PEM), issued by that authority for its role.
    #[arg(long = "tls-cert", env = "PAYOUT_TLS_CERT", value_name = "PEM")]
    pub cert: PathBuf,
    /// This process's private key (PEM, PKCS#8).
    #[arg(long = "tls-key", env = "PAYOUT_TLS_KEY", value_name = "PEM")]
    pub key: PathBuf,
}

impl TlsArgs {
    pub fn load(&self) -> Result<Tls, TlsError> {
        Tls::load(&self.ca, &self.cert, &self.key)
    }

    /// The same three paths from the environment (`PAYOUT_TLS_CA`, `PAYOUT_TLS_CERT`,
    /// `PAYOUT_TLS_KEY`), for processes configured by environment only (the workers).
    pub fn from_env() -> Result<Self, String> {
        let var = |name: &str| {
            std::env::var_os(name)
                .map(PathBuf::from)
                .ok_or_else(|| format!("{name} is not set (every connection is mutual TLS)"))
        };
        Ok(Self {
            ca: var("PAYOUT_TLS_CA")?,
            cert: var("PAYOUT_TLS_CERT")?,
            key: var("PAYOUT_TLS_KEY")?,
        })
    }

    /// The flags that pass these paths to a child process.
    pub fn to_args(&self) -> Vec<std::ffi::OsString> {
        vec![
            "--tls-ca".into(),
            self.ca.clone().into_os_string(),
            "--tls-cert".into(),
            self.cert.clone().into_os_string(),
            "--tls-key".into(),
            self.key.clone().into_os_string(),
        ]
    }

    /// The environment that passes these paths to a child process.
    pub fn to_env(&self) -> Vec<(&'static str, PathBuf)> {
        vec![
            ("PAYOUT_TLS_CA", self.ca.clone()),
            ("PAYOUT_TLS_CERT", self.cert.clone()),
            ("PAYOUT_TLS_KEY", self.key.clone()),
        ]
    }
}

/// The DNS name every etcd member's certificate carries, and the one an etcd client checks
/// whatever address it dials (`Tls::etcd_client_config`).
pub const ETCD_SERVER_NAME: &str = "etcd";

/// Where an etcd client's TLS material is (the lock-server's etcd backend, the reconciler's read
/// of the grant records): etcd's certificate authority, and this process's certificate from it
/// and its key. etcd serves TLS only and admits only a client with a certificate from that
/// authority (`--client-cert-auth`); there is no plaintext mode.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct EtcdTlsArgs {
    /// The authority (PEM) of the etcd cluster's certificates.
    #[arg(
        id = "etcd_tls_ca",
        long = "etcd-tls-ca",
        env = "ETCD_TLS_CA",
        value_name = "PEM"
    )]
    pub ca: Option<PathBuf>,
    /// This process's certificate (PEM) for etcd, from that authority.
    #[arg(
        id = "etcd_tls_cert",
        long = "etcd-tls-cert",
        env = "ETCD_TLS_CERT",
        value_name = "PEM"
    )]
    pub cert: Option<PathBuf>,
    /// Its private key (PEM, PKCS#8).
    #[arg(
        id = "etcd_tls_key",
        long = "etcd-tls-key",
        env = "ETCD_TLS_KEY",
        value_name = "PEM"
    )]
    pub key: Option<PathBuf>,
}

impl EtcdTlsArgs {
    pub fn new(ca: PathBuf, cert: PathBuf, key: PathBuf) -> Self {
        Self {
            ca: Some(ca),
            cert: Some(cert),
            key: Some(key),
        }
    }

    /// The three files, loaded; a missing flag is named (whoever talks to etcd needs all three).
    pub fn load(&self) -> Result<Tls, TlsError> {
        match (&self.ca, &self.cert, &self.key) {
            (Some(ca), Some(cert), Some(key)) => Tls::load(ca, cert, key),
            _ => Err(TlsError::EtcdTlsMissing),
        }
    }

    /// The flags that pass these paths to a child process.
    pub fn to_args(&self) -> Vec<std::ffi::OsString> {
        let mut args = Vec::new();
        for (flag, path) in [
            ("--etcd-tls-ca", &self.ca),
            ("--etcd-tls-cert", &self.cert),
            ("--etcd-tls-key", &self.key),
        ] {
            if let Some(path) = path {
                args.push(flag.into());
                args.push(path.clone().into_os_string());
            }
        }
        args
    }
}

/// Refuses an etcd endpoint that is not `https://`: with TLS configured, etcd's client would
/// refuse it too, but with a less helpful message.
pub fn require_https(url: &str) -> Result<(), TlsError> {
    if url.starts_with("https://") {
        Ok(())
    } else {
        Err(TlsError::NotHttps {
            url: url.to_string(),
        })
    }
}

/// A process's loaded TLS material.
#[derive(Clone)]
pub struct Tls {
    ca_pem: Vec<u8>,
    cert_pem: Vec<u8>,
    key_pem: Vec<u8>,
    /// The certificates a server built on this material refuses ([`denylist`]); empty unless a
    /// server's `--tls-denylist` gave one.
    denylist: std::sync::Arc<denylist::Denylist>,
}

impl std::fmt::Debug for Tls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tls").finish_non_exhaustive()
    }
}

fn read(path: &Path) -> Result<Vec<u8>, TlsError> {
    std::fs::read(path).map_err(|source| TlsError::Read {
        path: path.to_path_buf(),
        source,
    })
}

fn require_pem(
    bytes: &[u8],
    what: &'static str,
    path: &Path,
    expected: &'static str,
) -> Result<(), TlsError> {
    let text = String::from_utf8_lossy(bytes);
    if text.contains(&format!("-----BEGIN {expected}")) {
        Ok(())
    } else {
        Err(TlsError::NotPem {
            what,
            path: path.to_path_buf(),
            expected,
        })
    }
}

impl Tls {
    /// Reads the three PEM files; a missing or non-PEM file stops the start with its path.
    pub fn load(ca: &Path, cert: &Path, key: &Path) -> Result<Tls, TlsError> {
        let tls = Tls {
            ca_pem: read(ca)?,
            cert_pem: read(cert)?,
            key_pem: read(key)?,
            denylist: denylist::Denylist::empty(),
        };
        require_pem(&tls.ca_pem, "the authority", ca, "CERTIFICATE")?;
        require_pem(&tls.cert_pem, "the certificate", cert, "CERTIFICATE")?;
        require_pem(&tls.key_pem, "the key", key, "PRIVATE KEY")?;
        Ok(tls)
    }

    /// From PEM text already in memory (the test kit's freshly issued certificates).
    pub fn from_pem(ca_pem: &str, cert_pem: &str, key_pem: &str) -> Tls {
        Tls {
            ca_pem: ca_pem.as_bytes().to_vec(),
            cert_pem: cert_pem.as_bytes().to_vec(),
            key_pem: key_pem.as_bytes().to_vec(),
            denylist: denylist::Denylist::empty(),
        }
    }

    /// The authority's certificate(s), PEM: what a peer's certificate must chain to. For the
    /// HTTPS clients and servers built outside tonic (the rail link, the rail stub).
    pub fn ca_pem(&self) -> &[u8] {
        &self.ca_pem
    }

    /// This process's certificate chain, PEM.
    pub fn cert_pem(&self) -> &[u8] {
        &self.cert_pem
    }

    /// This process's private key, PEM.
    pub fn key_pem(&self) -> &[u8] {
        &self.key_pem
    }

    /// The certificate followed by its key, as one PEM document (what `reqwest::Identity::
    /// from_pem` reads).
    pub fn identity_pem(&self) -> Vec<u8> {
        let mut pem = self.cert_pem.clone();
        if !pem.ends_with(b"\n") {
            pem.push(b'\n');
        }
        pem.extend_from_slice(&self.key_pem);
        pem
    }

    /// The same material, a server built on it refusing the certificates of `denylist`.
    pub fn with_denylist(mut self, denylist: std::sync::Arc<denylist::Denylist>) -> Tls {
        self.denylist = denylist;
        self
    }

    /// The certificates a server built on this material refuses.
    pub fn denylist(&self) -> &std::sync::Arc<denylist::Denylist> {
        &self.denylist
    }

    /// This certificate's denylist line (`payoutctl pki deny` writes the same for a file).
    pub fn own_denylist_entry(&self) -> Option<denylist::Entry> {
        denylist::entry_of_pem(&self.cert_pem)
    }

    /// Server side: this process's certificate, and a client certificate from the authority
    /// required on every connection (a handshake without one fails before any request).
    pub fn server_config(&self) -> ServerTlsConfig {
        ServerTlsConfig::new()
            .identity(Identity::from_pem(&self.cert_pem, &self.key_pem))
            .client_ca_root(Certificate::from_pem(&self.ca_pem))
            .timeout(std::time::Duration::from_secs(HANDSHAKE_TIMEOUT_S))
    }

    /// Client side: an endpoint to `url` (which must be `https://`) that presents this process's
    /// certificate and accepts only a server whose certificate names `server`.
    pub fn endpoint(&self, url: &str, server: Role) -> Result<Endpoint, TlsError> {
        if !url.starts_with("https://") {
            return Err(TlsError::NotHttps {
                url: url.to_string(),
            });
        }
        Endpoint::from_shared(url.to_string())
            .map_err(|source| TlsError::BadUrl {
                url: url.to_string(),
                source,
            })?
            .tls_config(self.client_config(server))
            .map_err(TlsError::Config)
    }

    /// The client TLS configuration on its own, for callers that build their endpoint.
    pub fn client_config(&self, server: Role) -> ClientTlsConfig {
        self.client_config_named(server.name())
    }

    /// The client TLS configuration for an etcd cluster (etcd-client's `TlsOptions` is this
    /// type): this certificate presented, the member's certificate checked for
    /// [`ETCD_SERVER_NAME`].
    pub fn etcd_client_config(&self) -> ClientTlsConfig {
        self.client_config_named(ETCD_SERVER_NAME)
    }

    fn client_config_named(&self, server: &str) -> ClientTlsConfig {
        ClientTlsConfig::new()
            .ca_certificate(Certificate::from_pem(&self.ca_pem))
            .identity(Identity::from_pem(&self.cert_pem, &self.key_pem))
            .domain_name(server)
            .timeout(std::time::Duration::from_secs(HANDSHAKE_TIMEOUT_S))
    }

    /// Connects to `url` at once (a lazy channel would report a bad certificate only on the first
    /// call).
    pub async fn connect(
        &self,
        url: &str,
        server: Role,
    ) -> Result<tonic::transport::Channel, ConnectError> {
        let endpoint = self.endpoint(url, server)?;
        endpoint
            .connect()
            .await
            .map_err(|source| ConnectError::Connect {
                url: url.to_string(),
                source,
            })
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ConnectError {
    #[error(transparent)]
    Tls(#[from] TlsError),
    #[error("connecting to {url}: {source}")]
    Connect {
        url: String,
        source: tonic::transport::Error,
    },
}

/// A TLS handshake that has not finished in this long is dropped (a slow-loris connection holds
/// nothing).
pub const HANDSHAKE_TIMEOUT_S: u64 = 10;

/// The verified caller of a request: its role and the SHA-256 of its certificate (unique per
/// process: each process has its own key). Set by [`authz::Authorize`] in the request's
/// extensions before the handler runs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Caller {
    pub role: Role,
    pub fingerprint: [u8; 32],
    /// The verified certificate itself: what a claimed operator name is checked against.
    pub certificate: CertificateDer<'static>,
}

/// The DNS name an operator's certificate carries beside its role's (`<name>.operator`): the
/// identity an operator action is recorded under is a name the certificate proves, not a string
/// the request carries.
pub fn operator_subject(name: &str) -> String {
    format!("{name}.{}", Role::Operator.name())
}

/// Whether `name` can be an operator's certified name: one DNS label (letters, digits, `-`, at
/// most 63), so that `<name>.operator` is a name a certificate can carry and webpki can check.
pub fn is_operator_name(name: &str) -> bool {
    (1..=63).contains(&name.len())
        && name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-')
        && !name.starts_with('-')
        && !name.ends_with('-')
}

impl Caller {
    /// Whether this caller is the operator `name`: an operator's certificate that carries
    /// [`operator_subject`]`(name)`. Any other role, or another operator's certificate, is not.
    pub fn is_operator_named(&self, name: &str) -> bool {
        if self.role != Role::Operator || !is_operator_name(name) {
            return false;
        }
        let Ok(end_entity) = webpki::EndEntityCert::try_from(&self.certificate) else {
            return false;
        };
        ServerName::try_from(operator_subject(name))
            .ok()
            .is_some_and(|n| end_entity.verify_is_valid_for_subject_name(&n).is_ok())
    }

    /// The fingerprint in hex, as logs and the lock service's session owner record it.
    pub fn fingerprint_hex(&self) -> String {
        self.fingerprint
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect()
    }

    /// The caller a handler was given by [`authz::Authorize`]. `None` only if the server was
    /// built without the layer, which every server's own test rules out.
    pub fn of<T>(request: &tonic::Request<T>) -> Option<&Caller> {
        request.extensions().get::<Caller>()
    }
}

/// The role a certificate names, if any. The chain was verified by the TLS handshake against the
/// authority; this reads the name the same way a client checks a server's name.
pub fn role_of(cert: &CertificateDer<'_>) -> Option<Role> {
    let end_entity = webpki::EndEntityCert::try_from(cert).ok()?;
    Role::ALL.into_iter().find(|role| {
        ServerName::try_from(role.name())
            .ok()
            .is_some_and(|name| end_entity.verify_is_valid_for_subject_name(&name).is_ok())
    })
}

/// SHA-256 of a certificate's DER.
pub fn fingerprint(cert: &CertificateDer<'_>) -> [u8; 32] {
    let digest = ring::digest::digest(&ring::digest::SHA256, cert.as_ref());
    let mut out = [0u8; 32];
    out.copy_from_slice(digest.as_ref());
    out
}
