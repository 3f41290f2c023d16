//! One vLLM server (its CPU build) as a child process group, on loopback.
//!
//! [`VllmOptions`] are the engine's settings the router depends on, turned
//! into vLLM's own flags by [`VllmOptions::args`] (what the guide
//! `docs/vllm.md` shows, and the real-engine tier runs):
//!
//! - `--block-size N` (the router's `block-size=N`; vLLM's CPU attention
//!   needs a multiple of 32) and `--enable-prefix-caching`;
//! - `--kv-events-config` with the ZMQ publisher on `tcp://*:PORT` and its
//!   replay socket on `tcp://*:PORT`: vLLM binds only an endpoint with `*`
//!   (or `::`, `ipc://`); to any other address it connects, and a router
//!   connecting to it then never hears a thing;
//! - `-O0`: no `torch.compile` (start-up in about 55 s instead of 75 s or
//!   more on two cores, and nothing cached between runs; the scheduler,
//!   prefix cache, events and metrics are the same);
//! - LoRA: `--enable-lora --max-loras N --max-lora-rank R
//!   [--lora-modules NAME=PATH ...]`, with
//!   `VLLM_ALLOW_RUNTIME_LORA_UPDATING=True` so the router may load and
//!   unload adapters through `/v1/load_lora_adapter`.
//!
//! The environment sets the KV cache's size (`VLLM_CPU_KVCACHE_SPACE`,
//! GiB), the core the engine's threads are bound to
//! (`VLLM_CPU_OMP_THREADS_BIND`), and keeps it offline (`HF_HUB_OFFLINE`)
//! and silent about usage (`VLLM_NO_USAGE_STATS`).
//!
//! vLLM forks an engine-core process and a worker process; the server is
//! started as the leader of its own process group and stopped as a group
//! (SIGTERM, then SIGKILL), so none of them outlives a [`VllmWorker`]
//! dropped on any path, a failing test's included.

use super::tail;
use crate::demo::free_port;
use anyhow::Context as _;
use rustix::process::{kill_process_group, Pid, Signal};
use std::fs::File;
use std::os::unix::process::CommandExt as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// How long a vLLM server may take to answer `/v1/models` after it starts.
pub const READY_TIMEOUT: Duration = Duration::from_secs(300);

/// How long a stopping server gets after SIGTERM before SIGKILL.
const STOP_GRACE: Duration = Duration::from_secs(15);

/// A vLLM server's settings.
#[derive(Clone, Debug)]
pub struct VllmOptions {
    /// The model directory.
    pub model: PathBuf,
    /// The name it serves the model under (`--served-model-name`).
    pub served_name: String,
    /// Tokens per KV block (a multiple of 32 on CPU).
    pub block_size: u32,
    /// `--max-model-len`.
    pub max_model_len: u32,
    /// KV cache size, GiB (`VLLM_CPU_KVCACHE_SPACE`).
    pub kv_cache_gib: u32,
    /// The CPU core its threads are bound to (`None`: vLLM's choice).
    pub cpu: Option<usize>,
    /// Publish KV events (and serve their replay) over ZMQ.
    pub kv_events: bool,
    /// LoRA adapters.
    pub lora: Option<LoraOptions>,
    /// More flags, as they are.
    pub extra_args: Vec<String>,
    /// More environment variables, as they are (e.g.
    /// `VLLM_ENABLE_RESPONSES_API_STORE=1`, without which vLLM keeps no
    /// Responses API response: no `previous_response_id`, no retrieve).
    pub extra_env: Vec<(String, String)>,
}

/// LoRA settings of a vLLM server.
#[derive(Clone, Debug)]
pub struct LoraOptions {
    /// `--max-loras`: adapters in one batch.
    pub max_loras: u32,
    /// `--max-lora-rank`.
    pub max_rank: u32,
    /// Adapters loaded at start (`--lora-modules NAME=PATH`).
    pub modules: Vec<(String, PathBuf)>,
}

/// The ports one server listens on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Ports {
    /// HTTP.
    pub http: u16,
    /// The KV events' ZMQ PUB socket.
    pub events: u16,
    /// Their replay ROUTER socket.
    pub replay: u16,
}

impl VllmOptions {
    /// `model` served as `served_name`, 32 tokens a block, 4,096 tokens a
    /// sequence, a 1 GiB KV cache, KV events on.
    pub fn new(model: &Path, served_name: &str) -> Self {
        Self {
            model: model.to_owned(),
            served_name: served_name.to_owned(),
            block_size: 32,
            max_model_len: 4096,
            kv_cache_gib: 1,
            cpu: None,
            kv_events: true,
            lora: None,
            extra_args: Vec::new(),
            extra_env: Vec::new(),
        }
    }

    /// The arguments after `python -m vllm.entrypoints.openai.api_server`.
    pub fn args(&self, ports: Ports) -> Vec<String> {
        let mut a: Vec<String> = vec![
            "--model".into(),
            self.model.display().to_string(),
            "--served-model-name".into(),
            self.served_name.clone(),
            "--host".into(),
            "127.0.0.1".into(),
            "--port".into(),
            ports.http.to_string(),
            "--block-size".into(),
            self.block_size.to_string(),
            "--enable-prefix-caching".into(),
            "--max-model-len".into(),
            self.max_model_len.to_string(),
            "-O0".into(),
        ];
        if self.kv_events {
            let config = serde_json::json!({
                "enable_kv_cache_events": true,
                "publisher": "zmq",
                "endpoint": format!("tcp://*:{}", ports.events),
                "replay_endpoint": format!("tcp://*:{}", ports.replay),
            });
            a.extend(["--kv-events-config".into(), config.to_string()]);
        }
        if let Some(lora) = &self.lora {
            a.extend([
                "--enable-lora".into(),
                "--max-loras".into(),
                lora.max_loras.to_string(),
                "--max-lora-rank".into(),
                lora.max_rank.to_string(),
            ]);
            if !lora.modules.is_empty() {
                a.push("--lora-modules".into());
                a.extend(
                    lora.modules
                        .iter()
                        .map(|(name, path)| format!("{name}={}", path.display())),
                );
            }
        }
        a.extend(self.extra_args.iter().cloned());
        a
    }

    /// The environment the server runs with (besides the inherited one),
    /// [`Self::extra_env`] last (a variable named twice takes its last
    /// value).
    pub fn env(&self) -> Vec<(String, String)> {
        let mut e = vec![
            ("VLLM_CPU_KVCACHE_SPACE", self.kv_cache_gib.to_string()),
            ("HF_HUB_OFFLINE", "1".to_owned()),
            ("TRANSFORMERS_OFFLINE", "1".to_owned()),
            ("VLLM_NO_USAGE_STATS", "1".to_owned()),
            ("DO_NOT_TRACK", "1".to_owned()),
        ];
        if let Some(cpu) = self.cpu {
            e.push(("VLLM_CPU_OMP_THREADS_BIND", cpu.to_string()));
        }
        if self.lora.is_some() {
            e.push(("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "True".to_owned()));
        }
        e.into_iter()
            .map(|(k, v)| (k.to_owned(), v))
            .chain(self.extra_env.iter().cloned())
            .collect()
    }
}

/// A running vLLM server; stopped with everything it forked when dropped.
#[derive(Debug)]
pub struct VllmWorker {
    child: Child,
    stopped: bool,
    /// `http://127.0.0.1:PORT`.
    pub base: String,
    /// Its ports.
    pub ports: Ports,
    /// Whether it publishes KV events.
    pub kv_events: bool,
    /// Its output.
    pub log: PathBuf,
}

impl VllmWorker {
    /// Starts a server with `python` (free loopback ports; its output to
    /// `log`). It serves once [`Self::ready`] returns.
    pub fn spawn(python: &Path, options: &VllmOptions, log: &Path) -> anyhow::Result<Self> {
        let ports = Ports {
            http: free_port()?,
            events: free_port()?,
            replay: free_port()?,
        };
        if let Some(dir) = log.parent() {
            std::fs::create_dir_all(dir)?;
        }
        let out = File::create(log).with_context(|| format!("creating {}", log.display()))?;
        let child = Command::new(python)
            .args(["-m", "vllm.entrypoints.openai.api_server"])
            .args(options.args(ports))
            .envs(options.env())
            .stdin(Stdio::null())
            .stdout(out.try_clone()?)
            .stderr(out)
            .process_group(0)
            .spawn()
            .with_context(|| format!("starting vLLM with {}", python.display()))?;
        Ok(Self {
            child,
            stopped: false,
            base: format!("http://127.0.0.1:{}", ports.http),
            ports,
            kv_events: options.kv_events,
            log: log.to_owned(),
        })
    }

    /// Waits until it answers `/v1/models`, up to `timeout`; `Err` (with
    /// the end of its log) when it exits first or takes longer.
    pub async fn ready(&mut self, timeout: Duration) -> anyhow::Result<()> {
        let client = crate::loadgen::client();
        let started = Instant::now();
        let url = format!("{}/v1/models", self.base);
        loop {
            if let Some(status) = self.child.try_wait()? {
                anyhow::bail!(
                    "vLLM at {} exited ({status}) before serving; the errors it logged:\n{}\nthe end of {}:\n{}",
                    self.base,
                    self.log_errors(12),
                    self.log.display(),
                    self.log_tail(30)
                );
            }
            if crate::loadgen::get_text(&client, &url).await.is_some() {
                return Ok(());
            }
            if started.elapsed() > timeout {
                anyhow::bail!(
                    "vLLM at {} did not serve within {timeout:?}; the end of {}:\n{}",
                    self.base,
                    self.log.display(),
                    self.log_tail(30)
                );
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    }

    /// Its `--worker` spec for `serve`: `URL,name=NAME` and, when it
    /// publishes KV events, `events=` and `replay=` on loopback.
    pub fn worker_spec(&self, name: &str) -> String {
        let mut spec = format!("{},name={name}", self.base);
        if self.kv_events {
            spec.push_str(&format!(
                ",events=tcp://127.0.0.1:{},replay=tcp://127.0.0.1:{}",
                self.ports.events, self.ports.replay
            ));
        }
        spec
    }

    /// The last `lines` lines of its output.
    pub fn log_tail(&self, lines: usize) -> String {
        std::fs::read_to_string(&self.log)
            .map(|text| tail(&text, lines))
            .unwrap_or_default()
    }

    /// The first `lines` distinct lines of its output that name an error
    /// (a failed start's root cause is logged long before its last lines).
    pub fn log_errors(&self, lines: usize) -> String {
        std::fs::read_to_string(&self.log)
            .map(|text| error_lines(&text, lines))
            .unwrap_or_default()
    }

    /// Whether its server process has exited.
    pub fn exited(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(Some(_)))
    }

    /// Kills it at once, every process of its group (a worker dying).
    pub fn kill(&mut self) {
        self.signal(Signal::KILL);
        let _ = self.child.wait();
        self.stopped = true;
    }

    /// Stops it: SIGTERM to its group, SIGKILL after a grace period.
    pub fn stop(&mut self) {
        if self.stopped {
            return;
        }
        self.signal(Signal::TERM);
        let deadline = Instant::now() + STOP_GRACE;
        while Instant::now() < deadline {
            if matches!(self.child.try_wait(), Ok(Some(_))) {
                break;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        // The forked engine processes too, whether or not the leader left.
        self.kill();
    }

    fn signal(&self, signal: Signal) {
        // ESRCH (the group is gone) is what stopping wants.
        let _ = kill_process_group(Pid::from_child(&self.child), signal);
    }
}

/// The first `max` distinct lines of `text` that name an error.
fn error_lines(text: &str, max: usize) -> String {
    let mut seen: Vec<&str> = Vec::new();
    for line in text.lines().map(str::trim) {
        if seen.len() == max {
            break;
        }
        let names_error = ["Error", "ERROR", "error:"]
            .iter()
            .any(|e| line.contains(e));
        if names_error && !seen.contains(&line) {
            seen.push(line);
        }
    }
    seen.join("\n")
}

impl Drop for VllmWorker {
    fn drop(&mut self) {
        self.stop();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_failed_starts_errors_are_read_from_anywhere_in_its_log_once_each() {
        let log = "INFO starting\nERROR 12-06 EngineCore failed to start.\nTraceback (most recent call last):\n  ...\nOSError: [Errno 98] Address already in use\nINFO more\nRuntimeError: Engine core initialization failed.\nRuntimeError: Engine core initialization failed.\n";
        assert_eq!(
            error_lines(log, 12),
            "ERROR 12-06 EngineCore failed to start.\nOSError: [Errno 98] Address already in use\nRuntimeError: Engine core initialization failed."
        );
        assert_eq!(
            error_lines(log, 1),
            "ERROR 12-06 EngineCore failed to start."
        );
        assert_eq!(error_lines("INFO all well\n", 12), "");
    }

    #[test]
    fn the_command_line_binds_events_on_a_wildcard_and_names_block_size_and_adapters() {
        let mut options = VllmOptions::new(Path::new("/m/qwen3-tiny"), "tiny");
        options.lora = Some(LoraOptions {
            max_loras: 1,
            max_rank: 8,
            modules: vec![("lora-a".into(), PathBuf::from("/m/a"))],
        });
        let ports = Ports {
            http: 8000,
            events: 5557,
            replay: 5558,
        };
        let args = options.args(ports).join(" ");
        assert!(
            args.contains("--block-size 32 --enable-prefix-caching"),
            "{args}"
        );
        assert!(args.contains("--port 8000"), "{args}");
        assert!(
            args.contains(r#""endpoint":"tcp://*:5557""#)
                && args.contains(r#""replay_endpoint":"tcp://*:5558""#),
            "vLLM binds only wildcard endpoints: {args}"
        );
        assert!(
            args.contains(
                "--enable-lora --max-loras 1 --max-lora-rank 8 --lora-modules lora-a=/m/a"
            ),
            "{args}"
        );
        options
            .extra_env
            .push(("VLLM_ENABLE_RESPONSES_API_STORE".into(), "1".into()));
        let env = options.env();
        let has = |k: &str, v: &str| env.contains(&(k.to_owned(), v.to_owned()));
        assert!(has("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "True"));
        assert!(has("VLLM_CPU_KVCACHE_SPACE", "1"));
        assert!(has("VLLM_ENABLE_RESPONSES_API_STORE", "1"));
    }

    #[test]
    fn without_events_the_worker_spec_names_no_endpoints() {
        let mut options = VllmOptions::new(Path::new("/m"), "m");
        options.kv_events = false;
        assert!(!options
            .args(Ports {
                http: 1,
                events: 2,
                replay: 3
            })
            .iter()
            .any(|a| a == "--kv-events-config"));
    }
}
