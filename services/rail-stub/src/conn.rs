//! A listener whose connections a handler can reset: the rail's "connection dropped without a
//! response" fault. axum always writes the handler's response, so the reset is done below it:
//! the handler flags its connection, and the connection's next read or write fails after the
//! socket is set to linger zero, which makes the kernel send a RST instead of an orderly close.

use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};

use axum::extract::connect_info::Connected;
use axum::serve::{IncomingStream, Listener};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};

pub struct ResettableListener(pub TcpListener);

impl Listener for ResettableListener {
    type Io = ResettableStream;
    type Addr = std::net::SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        let (stream, addr) = Listener::accept(&mut self.0).await;
        // Each answer (and, over TLS, each handshake flight) leaves in several writes: with
        // Nagle's algorithm on, the second waits for the client's delayed ACK of the first
        // (about 40 ms on Linux), which with a connection per payment was most of a payment's
        // time (the proxy's Submit at 177/s against 927/s over plain HTTP, release).
        if let Err(e) = stream.set_nodelay(true) {
            tracing::warn!(%addr, error = %e, "could not set TCP_NODELAY on a rail connection");
        }
        (
            ResettableStream {
                inner: stream,
                reset: Arc::new(AtomicBool::new(false)),
            },
            addr,
        )
    }

    fn local_addr(&self) -> io::Result<Self::Addr> {
        self.0.local_addr()
    }
}

pub struct ResettableStream {
    inner: TcpStream,
    reset: Arc<AtomicBool>,
}

/// A handler's handle on its own connection.
#[derive(Clone)]
pub struct ConnectionHandle(Arc<AtomicBool>);

impl ConnectionHandle {
    /// The handle on the connection whose reset flag this is.
    pub(crate) fn of(flag: Arc<AtomicBool>) -> Self {
        Self(flag)
    }

    /// The connection is dropped with a RST at its next I/O; no response reaches the client.
    pub fn reset(&self) {
        self.0.store(true, Ordering::SeqCst);
    }
}

impl Connected<IncomingStream<'_, ResettableListener>> for ConnectionHandle {
    fn connect_info(stream: IncomingStream<'_, ResettableListener>) -> Self {
        Self(stream.io().reset.clone())
    }
}

impl ResettableStream {
    /// The flag a handler sets to reset this connection (shared with the layers above it).
    pub(crate) fn reset_flag(&self) -> Arc<AtomicBool> {
        self.reset.clone()
    }

    fn check(&self) -> io::Result<()> {
        if self.reset.load(Ordering::SeqCst) {
            let _ = self.inner.set_zero_linger();
            return Err(io::Error::new(
                io::ErrorKind::ConnectionReset,
                "fault injection: connection reset",
            ));
        }
        Ok(())
    }
}

impl AsyncRead for ResettableStream {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        self.check()?;
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl AsyncWrite for ResettableStream {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        self.check()?;
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }
    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        self.check()?;
        Pin::new(&mut self.inner).poll_flush(cx)
    }
    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        self.check()?;
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every accepted connection has Nagle's algorithm off: over TLS, with a connection per
    /// payment, a handshake flight or an answer written in two parts otherwise waited for the
    /// client's delayed ACK (about 40 ms a payment; `docs/performance.md`, issue 34).
    #[tokio::test]
    async fn accepted_connections_send_without_waiting_for_acks() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let mut listener = ResettableListener(listener);
        let _client = TcpStream::connect(addr).await.unwrap();
        let (accepted, _) = Listener::accept(&mut listener).await;
        assert!(accepted.inner.nodelay().unwrap());
    }
}
