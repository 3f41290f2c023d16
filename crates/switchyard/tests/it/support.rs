//! What the binary's integration tests share: `switchyard` processes on
//! loopback that die with the test, and the machine they run on. What the
//! server crate's tests share too (`/metrics`, waits that poll a condition
//! up to a deadline instead of sleeping a fixed time, error bodies, scratch
//! files) is one file there, included here and re-exported.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use tokio::io::AsyncReadExt as _;
use tokio::net::TcpStream;
use tokio::sync::{RwLock, RwLockReadGuard, RwLockWriteGuard};

#[path = "../../../switchyard-server/tests/it/support.rs"]
mod router_support;
pub(crate) use router_support::*;

/// The machine, as the tests in this binary share it: libtest runs them
/// two at a time (a thread per core), and each holds the machine shared for
/// its whole run ([`machine`]), except a test that times the router to tens
/// of milliseconds: it holds it alone ([`machine_alone`]), as when it was a
/// test binary of its own. The lock is fair, so a test waiting to be alone
/// waits only for the tests already running.
static MACHINE: RwLock<()> = RwLock::const_new(());

/// Holds the machine shared with the other tests; call first.
pub(crate) async fn machine() -> RwLockReadGuard<'static, ()> {
    MACHINE.read().await
}

/// [`machine`], for a test outside an async runtime.
pub(crate) fn machine_blocking() -> RwLockReadGuard<'static, ()> {
    MACHINE.blocking_read()
}

/// Holds the machine with no other test running; call first.
pub(crate) async fn machine_alone() -> RwLockWriteGuard<'static, ()> {
    MACHINE.write().await
}

/// A process's resident memory, from `/proc/PID/status`, in bytes.
pub(crate) fn resident_bytes(proc: &Proc) -> u64 {
    status_kib(proc, "VmRSS:") * 1024
}

/// The most resident memory the process has had (its high-water mark),
/// in bytes: what a short-lived allocation leaves behind once freed.
pub(crate) fn peak_resident_bytes(proc: &Proc) -> u64 {
    status_kib(proc, "VmHWM:") * 1024
}

fn status_kib(proc: &Proc, field: &str) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{}/status", proc.child.id()))
        .expect("the process is alive");
    status
        .lines()
        .find_map(|l| l.strip_prefix(field))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or_else(|| panic!("{field} in /proc/PID/status"))
}

/// A `switchyard` process, killed and reaped when the test ends, pass or
/// fail.
pub(crate) struct Proc {
    pub(crate) child: Child,
    /// `http://127.0.0.1:PORT`, from the address line it printed.
    pub(crate) base: String,
    /// `(pub, replay)` endpoints a sim-worker printed for `--kv-events`.
    pub(crate) kv: Option<(String, String)>,
    /// The bootstrap port a `--disagg sglang --disagg-role prefill`
    /// sim-worker printed.
    pub(crate) bootstrap: Option<u16>,
}

impl Proc {
    /// SIGKILL, then reap.
    pub(crate) fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// The port it listens on.
    pub(crate) fn port(&self) -> u16 {
        self.base
            .rsplit(':')
            .next()
            .and_then(|p| p.parse().ok())
            .expect("a base URL with a port")
    }

    /// Its `--worker` spec for a router: `URL,name=NAME`.
    pub(crate) fn named(&self, name: &str) -> String {
        format!("{},name={name}", self.base)
    }

    /// [`Proc::named`] with the KV-event endpoints a sim-worker started
    /// with `--kv-events` and `--kv-replay` printed.
    pub(crate) fn named_with_events(&self, name: &str) -> String {
        let (events, replay) = self
            .kv
            .clone()
            .expect("the sim-worker printed its KV endpoints");
        format!("{},events={events},replay={replay}", self.named(name))
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Starts `switchyard ARGS...` and returns once it printed its `http://`
/// address (it listens from then on).
pub(crate) fn spawn<S: AsRef<str>>(args: &[S]) -> Proc {
    let args: Vec<&str> = args.iter().map(AsRef::as_ref).collect();
    let child = Command::new(env!("CARGO_BIN_EXE_switchyard"))
        .args(&args)
        .env("RUST_LOG", "warn")
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("the switchyard binary starts");
    // Owned by the guard from here on, so every exit path kills and reaps it.
    let mut proc = Proc {
        child,
        base: String::new(),
        kv: None,
        bootstrap: None,
    };
    let stdout = proc.child.stdout.take().expect("stdout is piped");
    let mut reader = BufReader::new(stdout);
    let mut line = String::new();
    loop {
        line.clear();
        let n = reader.read_line(&mut line).expect("reading stdout");
        assert!(
            n > 0,
            "switchyard {args:?} exited before printing its address"
        );
        let words: Vec<&str> = line.split_whitespace().collect();
        // `switchyard sim-worker kv-events PUB replay REPLAY`
        // (the first: with `--dp-size`, rank 0's; the other ranks' follow
        // on the next ports).
        if let Some(i) = words.iter().position(|w| *w == "kv-events") {
            if proc.kv.is_none() {
                proc.kv = Some((words[i + 1].to_owned(), words[i + 3].to_owned()));
            }
        }
        // `switchyard sim-worker bootstrap http://ADDR`, before its address.
        if words.get(2) == Some(&"bootstrap") {
            proc.bootstrap = words[3].rsplit(':').next().and_then(|p| p.parse().ok());
            continue;
        }
        if let Some(url) = words
            .iter()
            .find(|w| w.starts_with("http://") || w.starts_with("https://"))
        {
            proc.base = url.trim_end_matches('/').to_owned();
            // Keep draining stdout so the child never blocks on a full pipe.
            std::thread::spawn(move || {
                let mut sink = String::new();
                while reader.read_line(&mut sink).is_ok_and(|n| n > 0) {
                    sink.clear();
                }
            });
            return proc;
        }
    }
}

/// `switchyard sim-worker` on 127.0.0.1:`port` (0: a free port) with
/// exactly `flags` besides the address.
pub(crate) fn sim_worker_with<S: AsRef<str>>(port: u16, flags: &[S]) -> Proc {
    let port = port.to_string();
    let mut args = vec!["sim-worker", "--host", "127.0.0.1", "--port", &port];
    args.extend(flags.iter().map(AsRef::as_ref));
    spawn(&args)
}

/// A sim-worker on `port` (0: a free port) at `speedup` with a 1024-block
/// pool, as most router tests use.
pub(crate) fn sim_worker_on(port: u16, speedup: &str) -> Proc {
    sim_worker_with(port, &["--speedup", speedup, "--num-blocks", "1024"])
}

/// [`sim_worker_on`] a free port.
pub(crate) fn sim_worker(speedup: &str) -> Proc {
    sim_worker_on(0, speedup)
}

/// `switchyard serve` on a free loopback port with exactly `flags` besides
/// the address.
pub(crate) fn serve<S: AsRef<str>>(flags: &[S]) -> Proc {
    let mut args = vec!["serve", "--host", "127.0.0.1", "--port", "0"];
    args.extend(flags.iter().map(AsRef::as_ref));
    spawn(&args)
}

/// The router in front of `workers` (`URL,name=...` specs), health-checking
/// them every 200 ms, with `extra` flags.
pub(crate) fn router(workers: &[String], extra: &[&str]) -> Proc {
    let mut flags = vec!["--health-interval-ms", "200"];
    for w in workers {
        flags.extend(["--worker", w.as_str()]);
    }
    flags.extend_from_slice(extra);
    serve(&flags)
}

/// The worker the router names in `x-switchyard-worker`.
pub(crate) fn served_by(response: &reqwest::Response) -> String {
    response.headers()["x-switchyard-worker"]
        .to_str()
        .expect("the worker header is ASCII")
        .to_owned()
}

/// POSTs a completion `body` to `base`: the status, the worker that served
/// it (`x-switchyard-worker`; empty when the router named none) and the
/// answer's JSON (`Null` when it is not JSON).
pub(crate) async fn completion(
    client: &reqwest::Client,
    base: &str,
    body: &serde_json::Value,
) -> (u16, String, serde_json::Value) {
    let response = client
        .post(format!("{base}/v1/completions"))
        .json(body)
        .send()
        .await
        .unwrap();
    let status = response.status().as_u16();
    let worker = response
        .headers()
        .get("x-switchyard-worker")
        .map(|_| served_by(&response))
        .unwrap_or_default();
    let answer = response.json().await.unwrap_or_default();
    (status, worker, answer)
}

// ---- Fake workers: loopback HTTP/1.1 servers a test writes by hand ----

/// Reads one request whole: its method, path and body (`None`: the
/// connection ended first).
pub(crate) async fn read_request(socket: &mut TcpStream) -> Option<(String, String, String)> {
    let mut buf = Vec::new();
    let mut chunk = [0u8; 4096];
    let head_end = loop {
        let n = socket.read(&mut chunk).await.ok()?;
        if n == 0 {
            return None;
        }
        buf.extend_from_slice(&chunk[..n]);
        if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break i + 4;
        }
    };
    let head = String::from_utf8_lossy(&buf[..head_end]).to_lowercase();
    let length: usize = head
        .lines()
        .find_map(|l| l.strip_prefix("content-length:"))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0);
    while buf.len() < head_end + length {
        match socket.read(&mut chunk).await {
            Ok(0) | Err(_) => return None,
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
        }
    }
    let mut words = head.split_whitespace();
    let method = words.next().unwrap_or("get").to_owned();
    let path = words.next().unwrap_or("/").to_owned();
    Some((
        method,
        path,
        String::from_utf8_lossy(&buf[head_end..]).into_owned(),
    ))
}

/// A 404 without a body; the connection closes.
pub(crate) const NOT_FOUND: &str =
    "HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\nconnection: close\r\n\r\n";

/// A 200 with JSON `body`; the connection closes.
pub(crate) fn reply(body: &str) -> String {
    format!(
        "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    )
}

/// Waits until the router at `base` is ready (a worker in selection).
pub(crate) async fn wait_ready(client: &reqwest::Client, base: &str) {
    wait_for("the router to have a worker", PATIENCE, async || {
        client
            .get(format!("{base}/ready"))
            .send()
            .await
            .is_ok_and(|r| r.status() == 200)
    })
    .await;
}
