//! A private `nats-server` on a free loopback port, for tests and
//! `switchyard bench replica`: spawned from the Debian package's binary,
//! killed on drop.
//!
//! The server picks its own port (`-p -1`) and reports it in a ports file
//! (`--ports_file_dir`), which it writes once it listens. Picking a free
//! port here and passing it on raced with other servers started at the
//! same time: two could be handed the same port, the loser exited, and its
//! test connected to the winner until that one stopped.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// A running `nats-server`; killed when dropped.
#[derive(Debug)]
pub struct LocalNatsServer {
    child: Child,
    port: u16,
    /// A directory of this server's own: its configuration file (passed
    /// with `-c`) and its ports file; removed on drop.
    dir: PathBuf,
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
        static NEXT: AtomicU64 = AtomicU64::new(0);
        let dir = std::env::temp_dir().join(format!(
            "switchyard-nats-{}-{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir_all(&dir)?;
        let mut command = Command::new(&binary);
        command.args(["-a", "127.0.0.1", "-p", "-1", "--ports_file_dir"]);
        command.arg(&dir);
        if !config.is_empty() {
            let path = dir.join("nats.conf");
            std::fs::write(&path, config)?;
            command.arg("-c").arg(&path);
        }
        let child = command
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|e| anyhow::anyhow!("spawning {}: {e}", binary.display()))?;
        let ports_file = dir.join(format!("nats-server_{}.ports", child.id()));
        let mut server = Self {
            child,
            port: 0,
            dir,
        };
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            if let Some(port) = client_port(&ports_file) {
                server.port = port;
                return Ok(server);
            }
            if let Some(status) = server.child.try_wait()? {
                anyhow::bail!("nats-server exited early ({status})");
            }
            if Instant::now() > deadline {
                anyhow::bail!("nats-server did not report a listening port within 10 s");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
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
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// The client port in a ports file (`{"nats":["nats://127.0.0.1:PORT"]}`),
/// or `None` while the file is absent or not yet whole.
fn client_port(ports_file: &Path) -> Option<u16> {
    let text = std::fs::read_to_string(ports_file).ok()?;
    let ports: serde_json::Value = serde_json::from_str(&text).ok()?;
    let url = ports.get("nats")?.as_array()?.first()?.as_str()?;
    url.rsplit(':').next()?.parse().ok()
}
