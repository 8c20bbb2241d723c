//! A stub running in the caller's process (tests, benchmarks), with a rail authority of its own.
//! Behind the `in-process` feature: the shipped stub never issues a certificate.

use std::net::SocketAddr;
use std::sync::Arc;

use grant_signing::{PublicKey, Verifier};
use service_kit::Shutdown;

use crate::{client, run, tls, StubConfig, StubError, StubListeners, SERVER_NAMES};

/// A stub running in this process, for tests and the benchmark, with a rail authority of its own:
/// its certificate, and client certificates for whoever calls it ([`RunningStub::identity`]).
/// Behind the `in-process` feature (tests and benchmarks): the shipped stub never issues.
pub struct RunningStub {
    /// The payments API's address.
    pub addr: SocketAddr,
    pub admin_addr: SocketAddr,
    pub metrics_addr: SocketAddr,
    /// The public half of the key its answers are signed with.
    pub answer_key: PublicKey,
    authority: Arc<mtls::issue::Authority>,
    stop: tokio::sync::watch::Sender<bool>,
    task: tokio::task::JoinHandle<Result<(), StubError>>,
}

impl RunningStub {
    /// Binds three free ports of 127.0.0.1 and serves `config` there.
    pub async fn start(config: StubConfig) -> Result<Self, StubError> {
        let listeners = StubListeners::local().await.map_err(StubError::Serve)?;
        let addr_of = |l: &tokio::net::TcpListener| l.local_addr().map_err(StubError::Serve);
        let (addr, admin_addr, metrics_addr) = (
            addr_of(&listeners.payments)?,
            addr_of(&listeners.admin)?,
            addr_of(&listeners.metrics)?,
        );
        let (shutdown, stop) = Shutdown::new();
        config.faults.validate()?;
        let answer_key = config.answer_signer.public_key();
        let authority = mtls::issue::Authority::create()?;
        let server = authority.issue_named(&SERVER_NAMES, "rail-stub")?.tls();
        // The configuration is checked here, so a bad one is this call's error.
        tls::server_config(&server)?;
        let task = tokio::spawn(async move { run(listeners, &server, config, shutdown).await });
        Ok(Self {
            addr,
            admin_addr,
            metrics_addr,
            answer_key,
            authority: Arc::new(authority),
            stop,
            task,
        })
    }
    /// The payments API's base URL (what the rail proxy calls).
    pub fn base_url(&self) -> String {
        format!("https://{}", self.addr)
    }
    /// A client certificate of this stub's authority naming `name` (a DNS name in its subject
    /// alternative names), with the authority to check the stub against: the rail proxy's
    /// (`"rail-proxy"`), the harness's ([`tls::HARNESS_NAME`]), or any other client's.
    pub fn identity(&self, name: &str) -> mtls::Tls {
        self.issue(&[name], name)
    }
    /// A certificate of this stub's authority naming `names` (a server's: [`SERVER_NAMES`] makes
    /// a copy of the stub's own, what an attacker who took the stub's TLS material holds).
    pub fn issue(&self, names: &[&str], name: &str) -> mtls::Tls {
        self.authority
            .issue_named(names, name)
            .expect("the stub's own authority issues")
            .tls()
    }
    /// Both APIs' base URLs, with the harness's identity.
    pub fn endpoints(&self) -> client::RailEndpoints {
        client::RailEndpoints {
            payments_url: self.base_url(),
            admin_url: format!("https://{}", self.admin_addr),
            tls: self.identity(tls::HARNESS_NAME),
        }
    }
    /// What the proxy verifies this stub's answers with (`--rail-answer-verify-keys`).
    pub fn answer_verifier(&self) -> Verifier {
        Verifier::new([self.answer_key.clone()]).expect("one key is a verifier")
    }
    /// The harness's client of this stub.
    pub fn client(&self) -> client::StubClient {
        client::StubClient::new(self.endpoints()).expect("the stub's own TLS material reads")
    }
    /// Stops serving (held responses are reset) and waits for the server to end.
    pub async fn stop(self) -> Result<(), StubError> {
        let _ = self.stop.send(true);
        self.task.await.expect("stub task does not panic")
    }
}
