//! Child processes of this binary (sim-workers, routers) that the demo and
//! the benchmarks start on loopback.

use anyhow::Context as _;
use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};

/// Child processes, killed and reaped when dropped (a benchmark or the
/// demo that stops, by an error or Ctrl-C, leaves none running).
#[derive(Debug, Default)]
pub(crate) struct Children(pub(crate) Vec<Child>);

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
pub(crate) fn spawn_printing_url(
    mut command: Command,
    what: &str,
) -> anyhow::Result<(Child, String)> {
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
pub(crate) fn this_binary() -> anyhow::Result<Command> {
    let exe = std::env::current_exe().context("locating the switchyard binary")?;
    Ok(Command::new(exe))
}
