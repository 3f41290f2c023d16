//! The router's accept loop: hyper's HTTP/1 server on each connection, with
//! the bounds `axum::serve` does not offer.
//!
//! - A connection cap (`--max-connections`): a connection accepted while
//!   the cap is reached is closed at once, before any byte of it is read,
//!   and counted (`switchyard_connections_refused_total`). Closing rather
//!   than leaving it in the kernel's backlog tells the client now (it may
//!   retry another replica) and costs nothing to hold.
//! - A header-read timeout (`--header-read-timeout-ms`): a request head
//!   must arrive within it, and an idle keep-alive connection is closed
//!   after it (`switchyard_header_read_timeouts_total`).
//! - A send timeout (`--send-timeout-ms`): a connection whose writes make
//!   no progress for that long — its client stopped reading, and the
//!   socket's buffers are full — is closed
//!   (`switchyard_send_timeouts_total`). Closing it drops the response
//!   body it was blocked on, so the request's in-flight permit, its
//!   buffered answer and its upstream connection go with it. This is the
//!   rule for every client that does not read: one that streams and never
//!   reads, and one that pipelines requests (`GET /health` or any other)
//!   and never reads their answers. A client that reads slowly is not cut:
//!   every write that moves a byte starts the timeout again.
//! - `TCP_NODELAY` on every connection: streamed tokens are small writes,
//!   and Nagle's algorithm would hold each one for the client's delayed ACK.
//! - TLS (`--tls-cert`, [`crate::front::tls`]): the handshake, once the
//!   connection has its place, within the header-read timeout; a failed
//!   or late one is counted (`switchyard_tls_handshake_failures_total`).
//! - Graceful shutdown: once stopped, the loop accepts nothing more, idle
//!   connections close, and it returns when every open request has ended.
//!
//! The body-read deadline is per request, in [`crate::front::upload`].

use crate::metrics::ServerMetrics;
use hyper::rt::{Read, ReadBufCursor, Write};
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;
use tokio::net::TcpListener;
use tokio::sync::{watch, Semaphore};
use tokio::time::{Instant, Sleep};
use tokio_rustls::TlsAcceptor;

/// Largest read buffer of one connection, so the largest request head
/// (hyper's default is about 400 KiB). An open connection costs at most
/// this much for reading, whatever its client sends.
pub(crate) const READ_BUFFER_BYTES: usize = 64 * 1024;

/// The per-connection bounds.
#[derive(Clone, Copy, Debug)]
pub(crate) struct ConnectionLimits {
    /// Connections open at once.
    pub max_connections: usize,
    /// Time for a request head to arrive (and for an idle connection to
    /// send its next one).
    pub header_read_timeout: Duration,
    /// Time a connection's writes may make no progress (its client does
    /// not read) before it is closed.
    pub send_timeout: Duration,
}

/// Serves `app` on `listener` until `stop` turns true, then waits for the
/// open requests to end (the caller bounds that wait).
pub(crate) async fn serve(
    listener: TcpListener,
    app: axum::Router,
    limits: ConnectionLimits,
    tls: Option<TlsAcceptor>,
    metrics: Arc<ServerMetrics>,
    mut stop: watch::Receiver<bool>,
) -> std::io::Result<()> {
    let max = limits.max_connections.max(1);
    metrics.connections_limit.set(max as u64);
    let slots = Arc::new(Semaphore::new(max));
    let mut http = hyper::server::conn::http1::Builder::new();
    http.timer(TokioTimer::new())
        .header_read_timeout(limits.header_read_timeout)
        .max_buf_size(READ_BUFFER_BYTES)
        .keep_alive(true);
    let graceful = GracefulShutdown::new();
    // Also ends when the sender is dropped.
    let stopped = async move { stop.wait_for(|stopped| *stopped).await.is_ok() };
    tokio::pin!(stopped);
    loop {
        let tcp = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((tcp, _peer)) => tcp,
                Err(e) => {
                    accept_failed(e).await;
                    continue;
                }
            },
            _ = &mut stopped => break,
        };
        let Ok(slot) = slots.clone().try_acquire_owned() else {
            metrics.connections_refused.inc();
            drop(tcp);
            continue;
        };
        let _ = tcp.set_nodelay(true);
        let (http, app, watcher, metrics) = (
            http.clone(),
            app.clone(),
            graceful.watcher(),
            metrics.clone(),
        );
        let tls = tls.clone();
        tokio::spawn(async move {
            let _slot = slot;
            let _open = OpenConnection::new(&metrics);
            let served = match tls {
                None => {
                    let io =
                        SendDeadline::new(TokioIo::new(tcp), limits.send_timeout, metrics.clone());
                    let connection = http.serve_connection(io, TowerToHyperService::new(app));
                    watcher.watch(connection).await
                }
                Some(acceptor) => {
                    // The handshake is bounded as a request head is.
                    let handshake =
                        tokio::time::timeout(limits.header_read_timeout, acceptor.accept(tcp));
                    let stream = match handshake.await {
                        Ok(Ok(stream)) => stream,
                        Ok(Err(e)) => {
                            metrics.tls_handshake_failures.inc();
                            tracing::debug!(error = %e, "TLS handshake failed");
                            return;
                        }
                        Err(_) => {
                            metrics.tls_handshake_failures.inc();
                            return;
                        }
                    };
                    let io = SendDeadline::new(
                        TokioIo::new(stream),
                        limits.send_timeout,
                        metrics.clone(),
                    );
                    let connection = http.serve_connection(io, TowerToHyperService::new(app));
                    watcher.watch(connection).await
                }
            };
            if let Err(e) = served {
                if e.is_timeout() {
                    metrics.header_read_timeouts.inc();
                }
                // Clients that go away mid-request are routine.
                tracing::debug!(error = %e, "client connection ended with an error");
            }
        });
    }
    drop(listener);
    graceful.shutdown().await;
    Ok(())
}

/// A connection's socket, failing its writes once they have made no
/// progress for `timeout`: hyper then ends the connection, and everything
/// its request held with it.
///
/// The deadline is armed when a write first finds the socket full and
/// cleared by any write that moves a byte; it is polled with that write,
/// so its timer wakes the connection's task, hyper flushes again, and the
/// flush fails. A connection that is not writing is never cut here (an
/// idle one is the header-read timeout's).
struct SendDeadline<T> {
    inner: T,
    timeout: Duration,
    /// Armed while writes are blocked; allocated at the first block.
    blocked: Option<Pin<Box<Sleep>>>,
    armed: bool,
    metrics: Arc<ServerMetrics>,
}

impl<T> SendDeadline<T> {
    fn new(inner: T, timeout: Duration, metrics: Arc<ServerMetrics>) -> Self {
        Self {
            inner,
            timeout,
            blocked: None,
            armed: false,
            metrics,
        }
    }

    /// What a write's outcome means: progress disarms the deadline; a full
    /// socket arms it (at the first block) and fails once it has passed.
    fn watch<R>(
        &mut self,
        cx: &mut Context<'_>,
        outcome: Poll<io::Result<R>>,
    ) -> Poll<io::Result<R>> {
        if outcome.is_ready() {
            self.armed = false;
            return outcome;
        }
        let deadline = Instant::now() + self.timeout;
        let sleep = self
            .blocked
            .get_or_insert_with(|| Box::pin(tokio::time::sleep_until(deadline)));
        if !self.armed {
            sleep.as_mut().reset(deadline);
            self.armed = true;
        }
        match sleep.as_mut().poll(cx) {
            Poll::Pending => Poll::Pending,
            Poll::Ready(()) => {
                self.armed = false;
                self.metrics.send_timeouts.inc();
                Poll::Ready(Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    "the client read nothing within the send timeout",
                )))
            }
        }
    }
}

impl<T: Read + Unpin> Read for SendDeadline<T> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: ReadBufCursor<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_read(cx, buf)
    }
}

impl<T: Write + Unpin> Write for SendDeadline<T> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let outcome = Pin::new(&mut this.inner).poll_write(cx, buf);
        this.watch(cx, outcome)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let outcome = Pin::new(&mut this.inner).poll_write_vectored(cx, bufs);
        this.watch(cx, outcome)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let outcome = Pin::new(&mut this.inner).poll_flush(cx);
        this.watch(cx, outcome)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
    }
}

/// Counts a connection in `switchyard_connections_open` while it lives.
struct OpenConnection<'a>(&'a ServerMetrics);

impl<'a> OpenConnection<'a> {
    fn new(metrics: &'a ServerMetrics) -> Self {
        metrics.connections_open.inc();
        Self(metrics)
    }
}

impl Drop for OpenConnection<'_> {
    fn drop(&mut self) {
        self.0.connections_open.dec();
    }
}

/// After a failed accept: a connection that died in the backlog is
/// skipped; anything else (out of file descriptors, most often) is logged
/// and the loop pauses, so it does not spin while nothing can be accepted.
async fn accept_failed(e: std::io::Error) {
    use std::io::ErrorKind;
    if matches!(
        e.kind(),
        ErrorKind::ConnectionAborted | ErrorKind::ConnectionReset | ErrorKind::ConnectionRefused
    ) {
        return;
    }
    tracing::warn!(error = %e, "accepting a connection failed; pausing 100 ms");
    tokio::time::sleep(Duration::from_millis(100)).await;
}
