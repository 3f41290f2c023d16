//! A private `nats-server` on a free loopback port, for tests and
//! `switchyard bench replica`: spawned from the Debian package's binary,
//! killed on drop.

use std::net::{TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A running `nats-server`; killed when dropped.
#[derive(Debug)]
pub struct LocalNatsServer {
    child: Child,
    port: u16,
    /// The configuration file passed with `-c`, removed on drop.
    config_file: Option<PathBuf>,
}

/// Where `nats-server` is: `$NATS_SERVER`, else `PATH`, else the Debian
/// package's `/usr/sbin`.
pub fn nats_server_binary() -> Option<PathBuf> {
    if let Some(path) = std::env::var_os("NATS_SERVER") {
        return Some(PathBuf::from(path));
    }
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain(["/usr/sbin", "/usr/bin", "/usr/local/bin"].map(PathBuf::from))
        .map(|dir| dir.join("nats-server"))
        .find(|candidate| candidate.is_file())
}

impl LocalNatsServer {
    /// Starts a server on a free port of 127.0.0.1 and waits (up to 10 s)
    /// until it accepts connections.
    pub fn start() -> anyhow::Result<Self> {
        Self::start_with_config("")
    }

    /// [`Self::start`] with `config` (nats-server configuration syntax,
    /// e.g. `authorization { user: a, password: b }` or
    /// `max_payload: 65536`) in a file passed with `-c`; the address and
    /// port flags override any in it.
    pub fn start_with_config(config: &str) -> anyhow::Result<Self> {
        let binary = nats_server_binary().ok_or_else(|| {
            anyhow::anyhow!(
                "nats-server not found (set NATS_SERVER or install it: \
                 apt-get update && apt-get install -y nats-server)"
            )
        })?;
        let port = TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
        let mut command = Command::new(&binary);
        command.args(["-a", "127.0.0.1", "-p", &port.to_string()]);
        let config_file = if config.is_empty() {
            None
        } else {
            let path = std::env::temp_dir().join(format!(
                "switchyard-nats-{}-{port}.conf",
                std::process::id()
            ));
            std::fs::write(&path, config)?;
            command.arg("-c").arg(&path);
            Some(path)
        };
        let child = command
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|e| anyhow::anyhow!("spawning {}: {e}", binary.display()))?;
        let mut server = Self {
            child,
            port,
            config_file,
        };
        let deadline = Instant::now() + Duration::from_secs(10);
        while TcpStream::connect(("127.0.0.1", port)).is_err() {
            if let Some(status) = server.child.try_wait()? {
                anyhow::bail!("nats-server exited early ({status}) on port {port}");
            }
            if Instant::now() > deadline {
                anyhow::bail!("nats-server did not listen on 127.0.0.1:{port} within 10 s");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(server)
    }

    /// `nats://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }
}

impl Drop for LocalNatsServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        if let Some(path) = self.config_file.take() {
            let _ = std::fs::remove_file(path);
        }
    }
}
