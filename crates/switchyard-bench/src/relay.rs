//! `switchyard bench relay`: a TCP relay that copies bytes both ways
//! between each client connection and a connection of its own to `--to`,
//! parsing nothing.
//!
//! `bench proxy` puts one in front of the sim-worker beside the routers:
//! whatever it adds is what the extra hop itself costs on the machine (two
//! more sockets, their system calls and wake-ups, on the same kind of
//! tokio runtime as `serve`), with no HTTP, no tokenizing and no routing.
//! It is the floor under any proxy's added latency there.
//!
//! It listens on a free loopback port only: a relay that forwards anyone's
//! bytes anywhere is not something to expose.

use anyhow::Context as _;
use clap::Args;
use tokio::net::{TcpListener, TcpStream};

/// Options of `bench relay`.
#[derive(Debug, Clone, Args)]
pub struct RelayArgs {
    /// Where each connection is relayed to (HOST:PORT).
    #[arg(long)]
    pub to: String,
}

/// Runs the relay until killed.
pub fn run(args: RelayArgs) -> anyhow::Result<()> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the tokio runtime")?;
    runtime.block_on(async move {
        // A bad --to is refused here, not once per connection.
        tokio::net::lookup_host(&args.to)
            .await
            .ok()
            .and_then(|mut addresses| addresses.next())
            .with_context(|| format!("--to {:?}: expected HOST:PORT that resolves", args.to))?;
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .context("listening on a loopback port")?;
        println!(
            "switchyard bench relay listening on http://{} (to {})",
            listener.local_addr()?,
            args.to
        );
        accept_forever(listener, args.to).await
    })
}

/// Relays every connection `listener` accepts to `to`; never returns.
async fn accept_forever(listener: TcpListener, to: String) -> anyhow::Result<()> {
    loop {
        let (client, _) = match listener.accept().await {
            Ok(accepted) => accepted,
            Err(e) => {
                // Out of descriptors and the like: the next accept may
                // succeed once a connection closes; nothing else is lost.
                eprintln!("switchyard bench relay: accept: {e}");
                tokio::time::sleep(std::time::Duration::from_millis(10)).await;
                continue;
            }
        };
        tokio::spawn(relay(client, to.clone()));
    }
}

/// Copies one connection's bytes both ways until either side closes.
async fn relay(mut client: TcpStream, to: String) {
    let mut upstream = match TcpStream::connect(&to).await {
        Ok(upstream) => upstream,
        Err(e) => {
            eprintln!("switchyard bench relay: connecting to {to}: {e}");
            return;
        }
    };
    // Each request and each answer is one small write: send it at once.
    let _ = client.set_nodelay(true);
    let _ = upstream.set_nodelay(true);
    let _ = tokio::io::copy_bidirectional(&mut client, &mut upstream).await;
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    #[tokio::test]
    async fn bytes_go_through_both_ways_unchanged() {
        // Upstream: answers each 5-byte message with it reversed.
        let upstream = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let to = upstream.local_addr().unwrap().to_string();
        tokio::spawn(async move {
            let (mut s, _) = upstream.accept().await.unwrap();
            let mut buf = [0u8; 5];
            while s.read_exact(&mut buf).await.is_ok() {
                buf.reverse();
                s.write_all(&buf).await.unwrap();
            }
        });
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let at = listener.local_addr().unwrap();
        tokio::spawn(accept_forever(listener, to));
        let mut client = TcpStream::connect(at).await.unwrap();
        for message in [*b"hello", *b"relay"] {
            client.write_all(&message).await.unwrap();
            let mut answer = [0u8; 5];
            client.read_exact(&mut answer).await.unwrap();
            let mut expected = message;
            expected.reverse();
            assert_eq!(answer, expected);
        }
    }
}
