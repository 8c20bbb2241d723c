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
