//! Real processes on loopback for the router's integration tests.

#![allow(dead_code, unreachable_pub)]

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A child process killed when the test ends, pass or fail.
pub struct Proc {
    pub child: Child,
    pub base: String,
}

impl Proc {
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Starts `switchyard ARGS...` and waits for its `http://` address line.
// The child is waited for by `Proc`'s drop, or on the early-exit path.
#[allow(clippy::zombie_processes)]
pub fn spawn(args: &[&str]) -> Proc {
    let mut child = Command::new(env!("CARGO_BIN_EXE_switchyard"))
        .args(args)
        .env("RUST_LOG", "warn")
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("the switchyard binary starts");
    let stdout = child.stdout.take().expect("stdout is piped");
    let mut reader = BufReader::new(stdout);
    let mut line = String::new();
    loop {
        line.clear();
        let n = reader.read_line(&mut line).expect("reading stdout");
        assert!(
            n > 0,
            "switchyard {args:?} exited before printing its address"
        );
        if let Some(url) = line.split_whitespace().find(|w| w.starts_with("http://")) {
            let base = url.trim_end_matches('/').to_owned();
            // Keep draining stdout so the child never blocks on a full pipe.
            std::thread::spawn(move || {
                let mut sink = String::new();
                while reader.read_line(&mut sink).map(|n| n > 0).unwrap_or(false) {
                    sink.clear();
                }
            });
            return Proc { child, base };
        }
    }
}

/// A sim-worker on a free port.
pub fn sim_worker(speedup: &str) -> Proc {
    spawn(&[
        "sim-worker",
        "--host",
        "127.0.0.1",
        "--port",
        "0",
        "--speedup",
        speedup,
        "--num-blocks",
        "1024",
    ])
}

/// A sim-worker on `port` (0: any free port) with extra flags.
pub fn sim_worker_on(port: u16, speedup: &str, extra: &[&str]) -> Proc {
    let port = port.to_string();
    let mut args = vec![
        "sim-worker",
        "--host",
        "127.0.0.1",
        "--port",
        &port,
        "--speedup",
        speedup,
        "--num-blocks",
        "1024",
    ];
    args.extend_from_slice(extra);
    spawn(&args)
}

/// The port of a `http://host:port` base URL.
pub fn port_of(base: &str) -> u16 {
    base.rsplit(':')
        .next()
        .and_then(|p| p.parse().ok())
        .expect("a base URL with a port")
}

/// `GET base/metrics` as text ("" when unreachable).
pub async fn metrics_text(client: &reqwest::Client, base: &str) -> String {
    match client.get(format!("{base}/metrics")).send().await {
        Ok(r) => r.text().await.unwrap_or_default(),
        Err(_) => String::new(),
    }
}

/// Sum of every sample of a metric family (`name{...} v` and `name v`).
pub fn metric_sum(text: &str, name: &str) -> f64 {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter(|l| {
            l.strip_prefix(name)
                .is_some_and(|rest| rest.starts_with('{') || rest.starts_with(' '))
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// The router in front of `workers` (`URL,name=...` specs) with extra flags.
pub fn router(workers: &[String], extra: &[&str]) -> Proc {
    let mut args: Vec<String> = vec![
        "serve".into(),
        "--host".into(),
        "127.0.0.1".into(),
        "--port".into(),
        "0".into(),
        "--health-interval-ms".into(),
        "200".into(),
    ];
    for w in workers {
        args.push("--worker".into());
        args.push(w.clone());
    }
    args.extend(extra.iter().map(|s| s.to_string()));
    let refs: Vec<&str> = args.iter().map(String::as_str).collect();
    spawn(&refs)
}

/// One sample of a Prometheus text, by its exact series name.
pub fn metric(text: &str, series: &str) -> Option<f64> {
    text.lines()
        .find_map(|l| {
            l.strip_prefix(series)
                .and_then(|rest| rest.strip_prefix(' '))
        })
        .and_then(|v| v.trim().parse().ok())
}

/// Polls `check` until it holds or `timeout` passes.
pub async fn eventually<F, Fut>(timeout: Duration, mut check: F) -> bool
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let start = Instant::now();
    while start.elapsed() < timeout {
        if check().await {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    false
}
