//! SGLang's routers as benchmark peers, shared by `bench versus` and
//! `bench proxy`: which one ([`Peer`]), finding or installing it with pip
//! into a virtual environment of its own ([`peer_program`]), starting it
//! with SGLang's cache-aware policy in front of given workers
//! ([`launch`]), waiting until it serves ([`wait_ready`]), and the CPU time
//! a router process has used ([`cpu_seconds`]).
//!
//! When pip cannot install a peer (no network, no `python3 -m venv`),
//! [`peer_program`] says why and the benchmark goes on without it.

use anyhow::Context as _;
use clap::ValueEnum;
use serde::Serialize;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};
use switchyard_commands::child::Children;
use switchyard_commands::demo::free_port;
use switchyard_commands::loadgen::{self, Pacing};

/// How long a router may take to answer its first request.
pub(crate) const READY_TIMEOUT: Duration = Duration::from_secs(90);

/// SGLang's routers.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Peer {
    /// The Shepherd Model Gateway (`pip install smg==1.13.0`, `smg launch`).
    Smg,
    /// SGLang's Rust router (`pip install sglang-router==0.3.2`).
    Sglang,
}

impl Peer {
    /// The pip requirement.
    pub fn requirement(self) -> &'static str {
        match self {
            Peer::Smg => "smg==1.13.0",
            Peer::Sglang => "sglang-router==0.3.2",
        }
    }

    /// The name `--peer` takes.
    pub fn name(self) -> &'static str {
        match self {
            Peer::Smg => "smg",
            Peer::Sglang => "sglang",
        }
    }

    /// The program in the venv's `bin/` that starts it.
    fn program(self) -> &'static str {
        match self {
            Peer::Smg => "smg",
            Peer::Sglang => "python3",
        }
    }

    /// Its command line in front of `workers`, listening on `port` and
    /// serving its Prometheus metrics on `metrics_port` (both default to
    /// 29000: two peers side by side need their own).
    pub(crate) fn command(
        self,
        program: &Path,
        port: u16,
        metrics_port: u16,
        workers: &[String],
    ) -> Command {
        let mut c = Command::new(program);
        match self {
            Peer::Smg => {
                c.arg("launch");
            }
            Peer::Sglang => {
                c.args(["-m", "sglang_router.launch_router"]);
            }
        }
        c.args(["--host", "127.0.0.1", "--port", &port.to_string()])
            .args(["--prometheus-host", "127.0.0.1"])
            .args(["--prometheus-port", &metrics_port.to_string()])
            .args(["--policy", "cache_aware", "--worker-urls"])
            .args(workers);
        c
    }
}

/// Finds or installs `peer`: `bin` when given, else the peer in `venv`
/// [default: TMPDIR/switchyard-versus-REQUIREMENT], installed there with pip
/// when it is not yet. `Err` says why it cannot be run.
pub(crate) fn peer_program(
    peer: Peer,
    bin: Option<&Path>,
    venv: Option<&Path>,
) -> Result<PathBuf, String> {
    if let Some(bin) = bin {
        return Ok(bin.to_owned());
    }
    let venv = venv.map(Path::to_owned).unwrap_or_else(|| {
        std::env::temp_dir().join(format!(
            "switchyard-versus-{}",
            peer.requirement().replace("==", "-")
        ))
    });
    let program = venv.join("bin").join(peer.program());
    let python = venv.join("bin").join("python3");
    let installed = || {
        Command::new(&python)
            .args(["-m", "pip", "show", "-q"])
            .arg(peer.requirement().split("==").next().unwrap_or_default())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    };
    if program.exists() && installed() {
        return Ok(program);
    }
    eprintln!(
        "installing {} into {} (pip)...",
        peer.requirement(),
        venv.display()
    );
    let run = |c: &mut Command, what: &str| -> Result<(), String> {
        let out = c
            .output()
            .map_err(|e| format!("{what} could not start: {e}"))?;
        if out.status.success() {
            Ok(())
        } else {
            let stderr = String::from_utf8_lossy(&out.stderr);
            let last = stderr.lines().rev().find(|l| !l.trim().is_empty());
            Err(format!("{what} failed: {}", last.unwrap_or("no message")))
        }
    };
    run(
        Command::new("python3").args(["-m", "venv"]).arg(&venv),
        "python3 -m venv",
    )?;
    run(
        Command::new(&python).args(["-m", "pip", "install", "-q", peer.requirement()]),
        "pip install",
    )?;
    if program.exists() && installed() {
        Ok(program)
    } else {
        Err(format!(
            "pip installed {} but {} is missing",
            peer.requirement(),
            program.display()
        ))
    }
}

/// The `PEER=VALUE` (or, with one peer, plain `VALUE`) entry for `peer`.
pub(crate) fn for_peer(
    values: &[String],
    peer: Peer,
    peers: usize,
) -> anyhow::Result<Option<PathBuf>> {
    for v in values {
        match v.split_once('=') {
            Some((name, path)) if Peer::from_str(name, true).is_ok() => {
                if name.eq_ignore_ascii_case(peer.name()) {
                    return Ok(Some(PathBuf::from(path)));
                }
            }
            _ if peers == 1 => return Ok(Some(PathBuf::from(v))),
            _ => anyhow::bail!("{v:?}: name the peer (PEER=PATH) when comparing several"),
        }
    }
    Ok(None)
}

/// Starts `peer` (`program`) in front of `workers` on a free loopback
/// port, with `extra` flags after the usual ones, its output discarded;
/// the child joins `children` (killed with them). Returns its base URL.
pub(crate) fn launch(
    peer: Peer,
    program: &Path,
    workers: &[String],
    extra: &[String],
    children: &mut Children,
) -> anyhow::Result<String> {
    let port = free_port()?;
    let child = peer
        .command(program, port, free_port()?, workers)
        .args(extra)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .with_context(|| format!("starting {}", program.display()))?;
    children.0.push(child);
    Ok(format!("http://127.0.0.1:{port}"))
}

/// The model a sim-worker serves (what requests to it name).
pub(crate) const SIM_MODEL: &str = "switchyard-sim";

/// Waits until `base` answers a one-token completion for `model` (the
/// same warm-up request for every router); fails early when the last of
/// `children` (the router being waited for) has exited.
pub(crate) fn wait_ready(
    runtime: &tokio::runtime::Runtime,
    base: &str,
    model: &str,
    children: &mut Children,
    what: &str,
) -> anyhow::Result<()> {
    let started = Instant::now();
    let body = serde_json::json!({"model": model, "prompt": "warm", "max_tokens": 1});
    let warm = loadgen::PreparedRequest {
        tenant: None,
        path: "/v1/completions",
        body: serde_json::to_vec(&body)?.into(),
        session: None,
        next_turn: None,
    };
    loop {
        let report = runtime.block_on(loadgen::run_load(
            base,
            vec![warm.clone()],
            Pacing::Concurrency(1),
            false,
            &[],
            false,
        ));
        if report.errors == 0 {
            return Ok(());
        }
        if let Some(router) = children.0.last_mut() {
            if let Ok(Some(status)) = router.try_wait() {
                anyhow::bail!("{what} exited ({status}) before serving");
            }
        }
        anyhow::ensure!(
            started.elapsed() < READY_TIMEOUT,
            "{what} did not serve a request within {READY_TIMEOUT:?}"
        );
        std::thread::sleep(Duration::from_millis(250));
    }
}

/// Clock ticks per second of `/proc/PID/stat` times (`USER_HZ`, 100 on
/// every mainstream Linux architecture).
const USER_HZ: f64 = 100.0;

/// CPU seconds (user + system) process `pid` has used so far.
pub(crate) fn cpu_seconds(pid: u32) -> Option<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name, field 2, is in parentheses and may hold spaces.
    let after = &stat[stat.rfind(')')? + 2..];
    let fields: Vec<&str> = after.split_whitespace().collect();
    // utime and stime are fields 14 and 15 of the whole line, 11 and 12
    // after the name.
    let utime: f64 = fields.get(11)?.parse().ok()?;
    let stime: f64 = fields.get(12)?.parse().ok()?;
    Some((utime + stime) / USER_HZ)
}

pub use switchyard_commands::stats::median;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_peer_program_is_named_by_peer_or_alone() {
        let values = vec!["smg=/a/smg".to_owned(), "sglang=/b/python3".to_owned()];
        assert_eq!(
            for_peer(&values, Peer::Sglang, 2).unwrap(),
            Some(PathBuf::from("/b/python3"))
        );
        assert_eq!(
            for_peer(&["/a/smg".to_owned()], Peer::Smg, 1).unwrap(),
            Some(PathBuf::from("/a/smg"))
        );
        assert!(for_peer(&["/a/smg".to_owned()], Peer::Smg, 2).is_err());
        assert_eq!(for_peer(&[], Peer::Smg, 1).unwrap(), None);
    }

    #[test]
    fn each_peer_is_started_with_sglangs_cache_aware_policy_on_loopback() {
        let workers = [
            "http://127.0.0.1:1".to_owned(),
            "http://127.0.0.1:2".to_owned(),
        ];
        for (peer, head) in [
            (Peer::Smg, vec!["launch"]),
            (Peer::Sglang, vec!["-m", "sglang_router.launch_router"]),
        ] {
            let c = peer.command(Path::new("/bin/peer"), 8123, 8124, &workers);
            let argv: Vec<_> = c
                .get_args()
                .map(|a| a.to_string_lossy().into_owned())
                .collect();
            assert_eq!(argv[..head.len()], head[..]);
            let rest = &argv[head.len()..];
            assert_eq!(
                rest,
                [
                    "--host",
                    "127.0.0.1",
                    "--port",
                    "8123",
                    "--prometheus-host",
                    "127.0.0.1",
                    "--prometheus-port",
                    "8124",
                    "--policy",
                    "cache_aware",
                    "--worker-urls",
                    "http://127.0.0.1:1",
                    "http://127.0.0.1:2"
                ]
            );
        }
    }

    #[test]
    fn this_processs_cpu_time_is_read_and_grows_with_work() {
        let before = cpu_seconds(std::process::id()).expect("/proc/self/stat is readable");
        let mut x = 0u64;
        let started = Instant::now();
        let mut after = before;
        // Spin until a clock tick of CPU time shows (10 ms of CPU), however
        // busy the machine; a minute of wall time is far past any load.
        while after <= before && started.elapsed() < Duration::from_secs(60) {
            for _ in 0..100_000 {
                x = x.wrapping_mul(6364136223846793005).wrapping_add(1);
            }
            std::hint::black_box(x);
            after = cpu_seconds(std::process::id()).unwrap();
        }
        assert!(after > before, "{before} -> {after}");
    }

    #[test]
    fn a_peer_that_cannot_be_installed_is_a_reason_not_a_panic() {
        let why =
            peer_program(Peer::Smg, None, Some(Path::new("/proc/no-such-dir/venv"))).unwrap_err();
        assert!(why.contains("venv"), "{why}");
    }

    #[test]
    fn the_median_of_an_even_count_is_the_mean_of_the_middle_two() {
        assert_eq!(median(&[3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&[4.0, 1.0, 3.0, 2.0]), 2.5);
        assert!(median(&[]).is_nan());
    }
}
