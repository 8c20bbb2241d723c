//! The payout path's services in this process, for `payoutdev bench e2e`'s pair of
//! configurations that differ in one thing only: the security.
//!
//! [`Security::AsDeployed`] serves the lock service, the payment resource and the rail proxy as
//! their binaries do: mutual TLS with a certificate per role, the real authorisation tables,
//! both guards verifying every grant's signature and its key, and each verifying the other's
//! signed facts. [`Security::FactsUnchecked`] is the same with only the signed facts' checks
//! switched off (the third configuration, issue 33). [`Security::Off`] serves the same
//! libraries on the same databases, etcd and rail with all of that switched off by the
//! test-only switches (plaintext, no table, no grant verification at either guard), which this
//! crate, never shipped, may use. The lock service signs every grant in both (its signer is not a
//! switch): the figure is what the rest of the security costs on top of one Ed25519 signature
//! per grant. Both use the same PostgreSQL logins (TLS to the database and the roles are the
//! bench stack's, not switched) and a zero-latency rail stub of their own.

use std::time::Duration;

use grant_signing::Signer;
use mtls::Role;
use service_kit::{Metrics, Shutdown};
use tonic::transport::Channel;

use crate::pki::tls;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Security {
    /// Mutual TLS, the authorisation tables, grant verification at both guards, the signed facts
    /// checked (the instruction at the proxy, the rail's outcomes and evidence at the payment
    /// resource).
    AsDeployed,
    /// TEST ONLY: as deployed but the signed facts are not checked (issue 33): what their checks
    /// cost. They are still signed (the payment resource signs each instruction, the proxy each
    /// answer), so the pair's ratio is the checks' cost, not the signatures'.
    FactsUnchecked,
    /// TEST ONLY: plaintext, no tables, no grant verification, no signed-fact check.
    Off,
}

/// Where the hosted services keep their state: the bench stack's etcd and two fresh databases.
pub struct Backing {
    pub etcd_endpoints: Vec<String>,
    pub etcd_tls: mtls::Tls,
    /// A prefix for the lock keys no other run uses.
    pub etcd_prefix: String,
    /// An empty database on the main server (paydb's migrations are applied here).
    pub paydb_url: String,
    /// An empty database on the proxy's server (the proxy applies its own).
    pub proxydb_url: String,
}

/// The three services and the rail, running until [`Hosted::stop`].
pub struct Hosted {
    pub security: Security,
    pub lock_addr: std::net::SocketAddr,
    pub payment_addr: std::net::SocketAddr,
    pub proxy_addr: std::net::SocketAddr,
    stops: Vec<tokio::sync::watch::Sender<bool>>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
    proxy: rail_proxy::RunningProxy,
    stub: rail_stub::RunningStub,
    _issued_dir: tempfile::TempDir,
}

#[derive(Debug, thiserror::Error)]
pub enum HostError {
    #[error("{0}")]
    Start(String),
}

fn start_error<E: std::fmt::Display>(what: &str) -> impl Fn(E) -> HostError + '_ {
    move |e| HostError::Start(format!("{what}: {e}"))
}

async fn listener() -> Result<(tokio::net::TcpListener, std::net::SocketAddr), HostError> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .map_err(|e| HostError::Start(format!("binding a loopback port: {e}")))?;
    let addr = listener
        .local_addr()
        .map_err(|e| HostError::Start(format!("a bound listener's address: {e}")))?;
    Ok((listener, addr))
}

/// A certificate of `role` from the authority the hosted services trust.
pub fn certificate(role: Role) -> mtls::Tls {
    tls(role)
}

impl Hosted {
    /// `operators`: the operators whose signatures fund the bench's accounts.
    pub async fn start(
        backing: &Backing,
        security: Security,
        operators: grant_signing::Verifier,
    ) -> Result<Self, HostError> {
        let secured = security != Security::Off;
        let facts_checked = security == Security::AsDeployed;
        let stub = rail_stub::RunningStub::start(rail_stub::StubConfig::default())
            .await
            .map_err(start_error("rail stub"))?;
        let (signer, _) = Signer::generate("bench").map_err(start_error("signer"))?;
        let public_key = signer.public_key();

        // The lock service on etcd.
        let issued_dir = tempfile::tempdir().map_err(start_error("issued tokens"))?;
        let config = lock_server::Config {
            backend: lock_server::BackendConfig::Etcd {
                endpoints: backing.etcd_endpoints.clone(),
                tls: backing.etcd_tls.clone(),
                prefix: backing.etcd_prefix.clone(),
                grant_retention_ms: lock_server::backend::etcd::GRANT_RETENTION_MS_DEFAULT,
            },
            issued_tokens_path: issued_dir.path().join("issued-tokens"),
            issued_tokens_limits: Default::default(),
            caller_limits: Default::default(),
            signer: std::sync::Arc::new(signer),
        };
        let metrics = Metrics::default();
        let lock = lock_server::build(&config, &metrics)
            .await
            .map_err(start_error("lock server"))?;
        let (lock_listener, lock_addr) = listener().await?;
        let (lock_shutdown, lock_stop) = Shutdown::new();
        let lock_task = if secured {
            let server_tls = tls(Role::LockServer);
            tokio::spawn(async move {
                if let Err(e) = lock_server::serve(
                    lock,
                    lock_listener,
                    &server_tls,
                    &lock_server::authz::POLICY,
                    &metrics,
                    lock_shutdown,
                )
                .await
                {
                    eprintln!("hosted lock server: {e}");
                }
            })
        } else {
            tokio::spawn(async move {
                if let Err(e) =
                    lock_server::serve_plaintext_for_benches(lock, lock_listener, lock_shutdown)
                        .await
                {
                    eprintln!("hosted lock server: {e}");
                }
            })
        };

        // The payment resource on its own paydb.
        let paydb = service_kit::connect_pg(&backing.paydb_url)
            .await
            .map_err(start_error("paydb"))?;
        payment_resource::migrate(&paydb)
            .await
            .map_err(start_error("paydb migrations"))?;
        let verifier = payment_resource::Verifier::new([public_key.clone()])
            .map_err(start_error("verifier"))?;
        // The signed facts' two keys, made for this host (the payment resource signs
        // instructions, the proxy rail facts; each verifies the other's).
        let (instruction_signer, _) =
            grant_signing::Signer::generate("hosted-instruction").map_err(start_error("key"))?;
        let (fact_signer, _) =
            grant_signing::Signer::generate("hosted-rail-fact").map_err(start_error("key"))?;
        let instruction_keys = grant_signing::Verifier::new([instruction_signer.public_key()])
            .map_err(start_error("verifier"))?;
        let fact_keys = grant_signing::Verifier::new([fact_signer.public_key()])
            .map_err(start_error("verifier"))?;
        let facts = payment_resource::SignedFacts::new(
            std::sync::Arc::new(instruction_signer),
            grant_signing::instruction::TTL_DEFAULT_MS,
            fact_keys,
        )
        .map_err(start_error("signed facts"))?;
        let mut options =
            payment_resource::StoreOptions::new(verifier, facts).with_operator_keys(operators);
        if !secured {
            options = options
                .without_grant_verification_for_tests()
                .without_key_binding_for_tests();
        }
        if !facts_checked {
            options = options.without_rail_fact_verification_for_tests();
        }
        let metrics = Metrics::default();
        let store = payment_resource::Store::new(paydb, options, &metrics);
        let mut front = payment_resource::Front::new(tls(Role::PaymentResource), metrics)
            .with_fixture_accounts(true);
        if !secured {
            front = front.plaintext_for_benches();
        }
        let (payment_listener, payment_addr) = listener().await?;
        let (payment_shutdown, payment_stop) = Shutdown::new();
        let payment_task = tokio::spawn(async move {
            if let Err(e) =
                payment_resource::serve(payment_listener, store, front, payment_shutdown).await
            {
                eprintln!("hosted payment resource: {e}");
            }
        });

        // The rail proxy on its own proxydb, in front of the stub.
        let proxydb = service_kit::connect_pg(&backing.proxydb_url)
            .await
            .map_err(start_error("proxydb"))?;
        let verifier = rail_proxy::Verifier::new([public_key]).map_err(start_error("verifier"))?;
        let keys = rail_proxy::GuardKeys {
            grants: verifier,
            instructions: instruction_keys,
            fact_signer: std::sync::Arc::new(fact_signer),
        };
        let mut config = rail_proxy::ProxyConfig::new(
            rail_proxy::RailLink::new(
                stub.base_url(),
                stub.answer_verifier(),
                &stub.identity("rail-proxy"),
            )
            .map_err(start_error("rail link"))?,
            keys,
            tls(Role::RailProxy),
        );
        if !secured {
            config = config
                .disable_grant_verification_for_negative_control()
                .plaintext_for_benches();
        }
        if !facts_checked {
            config = config.disable_instruction_verification_for_negative_control();
        }
        let proxy = rail_proxy::RunningProxy::start(proxydb, config)
            .await
            .map_err(start_error("rail proxy"))?;

        Ok(Self {
            security,
            lock_addr,
            payment_addr,
            proxy_addr: proxy.addr,
            stops: vec![lock_stop, payment_stop],
            tasks: vec![lock_task, payment_task],
            proxy,
            stub,
            _issued_dir: issued_dir,
        })
    }

    /// A channel to the service at `addr` (one of this host's), as a caller of `role`:
    /// mutual TLS with that role's certificate, or plaintext when the security is off.
    pub async fn channel(
        &self,
        addr: std::net::SocketAddr,
        server: Role,
        role: Role,
    ) -> Result<Channel, HostError> {
        let endpoint = match self.security {
            Security::AsDeployed | Security::FactsUnchecked => tls(role)
                .endpoint(&format!("https://{addr}"), server)
                .map_err(start_error("client TLS"))?,
            Security::Off => tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
                .map_err(start_error("endpoint"))?,
        };
        // Every listener was bound before `start` returned: the connection is accepted at once.
        endpoint
            .connect_timeout(Duration::from_secs(5))
            .connect()
            .await
            .map_err(|e| HostError::Start(format!("connecting {addr}: {e}")))
    }

    /// Stops every service and the stub.
    pub async fn stop(self) {
        for stop in &self.stops {
            let _ = stop.send(true);
        }
        let _ = self.proxy.stop().await;
        for task in self.tasks {
            let _ = tokio::time::timeout(Duration::from_secs(10), task).await;
        }
        let _ = self.stub.stop().await;
    }
}
