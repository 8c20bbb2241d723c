//! The stub's TLS, as a rail's: its listeners serve only TLS with a certificate of the rail's
//! authority, and take only clients that present a certificate of the same authority (a rail
//! authenticates its merchant). The admin listener takes one client only: the test harness, whose
//! certificate names [`HARNESS_NAME`].
//!
//! Each accepted TCP connection is wrapped in a `ResettableStream` *under* TLS (so the reset
//! faults are still TCP RSTs) and its handshake runs in a task of its own, bounded by
//! [`HANDSHAKE_TIMEOUT_MS`]: a slow or silent client never holds up the accept loop.
//!
//! The metrics listener (`/healthz`, `/metrics`: counts only) stays plain HTTP, for Prometheus
//! and a container's health check.

use std::io;
use std::pin::Pin;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::extract::connect_info::Connected;
use axum::serve::{IncomingStream, Listener};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpListener;
use tokio_rustls::server::TlsStream;

use crate::conn::{ConnectionHandle, ResettableStream};

/// The name the harness's client certificate carries (a DNS name in its subject alternative
/// names), the only client the admin listener serves.
pub const HARNESS_NAME: &str = "harness";
/// How long one TLS handshake may take before its connection is dropped.
pub const HANDSHAKE_TIMEOUT_MS: u64 = 10_000;
/// Handshaken connections waiting for the server to take them.
const ACCEPTED_QUEUE: usize = 256;

#[derive(Debug, thiserror::Error)]
pub enum RailTlsError {
    #[error("{what} holds no {kind}")]
    Pem { what: String, kind: &'static str },
    #[error("TLS configuration: {0}")]
    Config(String),
}

/// The server configuration of one listener from the stub's TLS material (the rail's authority,
/// which clients must chain to; the stub's own certificate chain and key): the stub's certificate,
/// a client certificate of the rail's authority required.
pub fn server_config(tls: &mtls::Tls) -> Result<Arc<rustls::ServerConfig>, RailTlsError> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut roots = rustls::RootCertStore::empty();
    for cert in certificates(tls.ca_pem(), "the rail's authority")? {
        roots
            .add(cert)
            .map_err(|e| RailTlsError::Config(e.to_string()))?;
    }
    let verifier =
        rustls::server::WebPkiClientVerifier::builder_with_provider(roots.into(), provider.clone())
            .build()
            .map_err(|e| RailTlsError::Config(e.to_string()))?;
    let key = PrivateKeyDer::from_pem_slice(tls.key_pem()).map_err(|_| RailTlsError::Pem {
        what: "the stub's key".into(),
        kind: "private key",
    })?;
    let config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| RailTlsError::Config(e.to_string()))?
        .with_client_cert_verifier(verifier)
        .with_single_cert(certificates(tls.cert_pem(), "the stub's certificate")?, key)
        .map_err(|e| RailTlsError::Config(e.to_string()))?;
    Ok(Arc::new(config))
}

fn certificates(pem: &[u8], what: &str) -> Result<Vec<CertificateDer<'static>>, RailTlsError> {
    let certs: Vec<_> = CertificateDer::pem_slice_iter(pem)
        .collect::<Result<_, _>>()
        .map_err(|_| RailTlsError::Pem {
            what: what.into(),
            kind: "certificate",
        })?;
    if certs.is_empty() {
        return Err(RailTlsError::Pem {
            what: what.into(),
            kind: "certificate",
        });
    }
    Ok(certs)
}

/// Whether the verified client certificate names `name` (webpki's own name matching).
fn names(cert: &CertificateDer<'_>, name: &str) -> bool {
    let Ok(end_entity) = webpki::EndEntityCert::try_from(cert) else {
        return false;
    };
    let Ok(server_name) = rustls::pki_types::ServerName::try_from(name) else {
        return false;
    };
    end_entity
        .verify_is_valid_for_subject_name(&server_name)
        .is_ok()
}

/// Who a listener serves once the handshake has verified the client's chain.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Clients {
    /// Any client certificate of the rail's authority (the payments API: merchants).
    Authority,
    /// Only the harness's certificate (the admin API).
    HarnessOnly,
}

/// A TLS listener for axum: TCP accepted here, handshakes in their own tasks, each finished
/// connection handed to the server in accept order of completion.
pub struct TlsListener {
    accepted: tokio::sync::mpsc::Receiver<(TlsConnection, std::net::SocketAddr)>,
    local_addr: std::net::SocketAddr,
    _accept_loop: tokio::task::JoinHandle<()>,
}

impl TlsListener {
    pub fn new(
        listener: TcpListener,
        config: Arc<rustls::ServerConfig>,
        clients: Clients,
    ) -> io::Result<Self> {
        let local_addr = listener.local_addr()?;
        let (tx, accepted) = tokio::sync::mpsc::channel(ACCEPTED_QUEUE);
        let acceptor = tokio_rustls::TlsAcceptor::from(config);
        let accept_loop = tokio::spawn(async move {
            let mut listener = crate::conn::ResettableListener(listener);
            loop {
                let (stream, addr) = Listener::accept(&mut listener).await;
                let (acceptor, tx) = (acceptor.clone(), tx.clone());
                tokio::spawn(async move {
                    let reset = stream.reset_flag();
                    let handshake = tokio::time::timeout(
                        Duration::from_millis(HANDSHAKE_TIMEOUT_MS),
                        acceptor.accept(stream),
                    )
                    .await;
                    let tls = match handshake {
                        Ok(Ok(tls)) => tls,
                        Ok(Err(e)) => {
                            tracing::warn!(%addr, error = %e, "rail TLS handshake refused");
                            return;
                        }
                        Err(_) => {
                            tracing::warn!(%addr, "rail TLS handshake timed out");
                            return;
                        }
                    };
                    if clients == Clients::HarnessOnly {
                        let harness = tls
                            .get_ref()
                            .1
                            .peer_certificates()
                            .and_then(|chain| chain.first())
                            .is_some_and(|cert| names(cert, HARNESS_NAME));
                        if !harness {
                            tracing::warn!(
                                %addr,
                                "admin API: a client certificate that is not the harness's, refused"
                            );
                            return;
                        }
                    }
                    let _ = tx.send((TlsConnection { inner: tls, reset }, addr)).await;
                });
            }
        });
        Ok(Self {
            accepted,
            local_addr,
            _accept_loop: accept_loop,
        })
    }
}

impl Drop for TlsListener {
    fn drop(&mut self) {
        self._accept_loop.abort();
    }
}

impl Listener for TlsListener {
    type Io = TlsConnection;
    type Addr = std::net::SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        match self.accepted.recv().await {
            Some(connection) => connection,
            // The accept loop never ends while the listener lives.
            None => std::future::pending().await,
        }
    }

    fn local_addr(&self) -> io::Result<Self::Addr> {
        Ok(self.local_addr)
    }
}

/// One TLS connection over a resettable TCP stream.
pub struct TlsConnection {
    inner: TlsStream<ResettableStream>,
    reset: Arc<AtomicBool>,
}

impl Connected<IncomingStream<'_, TlsListener>> for ConnectionHandle {
    fn connect_info(stream: IncomingStream<'_, TlsListener>) -> Self {
        ConnectionHandle::of(stream.io().reset.clone())
    }
}

impl AsyncRead for TlsConnection {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl AsyncWrite for TlsConnection {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }
    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }
    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}
