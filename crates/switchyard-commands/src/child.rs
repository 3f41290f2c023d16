//! Child processes of this binary (sim-workers, routers) that the demo and
//! the benchmarks start on loopback.

use anyhow::Context as _;
use rustix::thread::{sched_getaffinity, sched_setaffinity, CpuSet};
use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};

/// Child processes, killed and reaped when dropped (a benchmark or the
/// demo that stops, by an error or Ctrl-C, leaves none running).
#[derive(Debug, Default)]
pub struct Children(pub Vec<Child>);

impl Drop for Children {
    fn drop(&mut self) {
        for c in &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// Spawns `command` (a `switchyard` subcommand listening on port 0) and
/// returns it with the `http://` address it prints once it has bound. Its
/// further output is drained on a thread so it never blocks on a full pipe.
/// A child that exits first, or cannot be read, is killed and reported as
/// `what`.
pub fn spawn_printing_url(mut command: Command, what: &str) -> anyhow::Result<(Child, String)> {
    let mut child = command
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .with_context(|| format!("starting {what}"))?;
    let stdout = child.stdout.take().context("child stdout")?;
    let mut reader = BufReader::new(stdout);
    let mut line = String::new();
    let url = loop {
        line.clear();
        match reader.read_line(&mut line) {
            Ok(n) if n > 0 => {}
            outcome => {
                let _ = child.kill();
                let _ = child.wait();
                let why = outcome.err().map(|e| format!(": {e}")).unwrap_or_default();
                anyhow::bail!("{what} exited before printing its address{why}");
            }
        }
        if let Some(url) = line.split_whitespace().find(|w| w.starts_with("http://")) {
            break url.to_owned();
        }
    };
    std::thread::spawn(move || {
        let mut sink = String::new();
        while reader.read_line(&mut sink).map(|n| n > 0).unwrap_or(false) {
            sink.clear();
        }
    });
    Ok((child, url))
}

/// This binary, to start a subcommand of.
pub fn this_binary() -> anyhow::Result<Command> {
    let exe = std::env::current_exe().context("locating the switchyard binary")?;
    Ok(Command::new(exe))
}

/// The cores a benchmark splits between the router and the rest (its
/// client and the sim-workers) when it gives the router a core of its
/// own, as a deployment does: the router runs on another machine than
/// the engines and the clients.
#[derive(Debug, Clone)]
pub struct CoreSplit {
    /// The router's: the first core this process may use.
    pub router: CpuSet,
    /// Every other core this process may use.
    pub rest: CpuSet,
}

impl CoreSplit {
    /// The split of the cores this thread may use; an error with fewer
    /// than two.
    pub fn of_this_thread() -> anyhow::Result<Self> {
        let mine = sched_getaffinity(None).context("reading this thread's cores")?;
        let cores: Vec<usize> = (0..CpuSet::MAX_CPU).filter(|&c| mine.is_set(c)).collect();
        anyhow::ensure!(
            cores.len() >= 2,
            "giving the router a core of its own needs two cores at least; this process may use {}",
            cores.len()
        );
        let (mut router, mut rest) = (CpuSet::new(), CpuSet::new());
        router.set(cores[0]);
        for &c in &cores[1..] {
            rest.set(c);
        }
        Ok(Self { router, rest })
    }
}

/// Pins the calling thread to `cores`: the threads and processes it
/// starts afterwards inherit them.
pub fn pin_this_thread(cores: &CpuSet) -> anyhow::Result<()> {
    sched_setaffinity(None, cores).context("pinning a thread to its cores")
}

/// Runs `start` (which spawns a child) on a thread pinned to `cores`, so
/// that the child starts on them, every thread of it included.
pub fn start_on<T: Send>(
    cores: &CpuSet,
    start: impl FnOnce() -> anyhow::Result<T> + Send,
) -> anyhow::Result<T> {
    std::thread::scope(|s| {
        s.spawn(|| {
            pin_this_thread(cores)?;
            start()
        })
        .join()
        .map_err(|_| anyhow::anyhow!("the thread starting a child panicked"))?
    })
}
