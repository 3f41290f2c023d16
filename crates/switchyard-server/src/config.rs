//! The router's configuration: one validated struct filled by the TOML file
//! (`--config FILE`), then `SWITCHYARD_*` environment variables and command
//! line flags (both through clap, flags winning), in that order.

use serde::{Deserialize, Serialize};
use std::path::PathBuf;
use switchyard_core::admission::{AdmissionConfig, SessionAwareConfig};
use switchyard_core::estimate::EstimatorConfig;
use switchyard_core::health::CircuitConfig;
use switchyard_core::select::{PolicyConfig, PolicyKind};
use switchyard_replica::ReplicaConfig;

/// One worker, as `--worker URL[,events=tcp://H:P][,replay=tcp://H:P][,block-size=N][,name=NAME]`
/// or a `[[workers]]` table.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WorkerSpec {
    /// Base URL, e.g. `http://10.0.0.5:8000` (no path).
    pub url: String,
    /// Name in metrics, logs and `x-switchyard-worker` (default: host:port).
    #[serde(default)]
    pub name: Option<String>,
    /// The engine's KV-event PUB endpoint; without it the router predicts
    /// the worker's cache from its own decisions (approximate mode).
    #[serde(default)]
    pub events: Option<String>,
    /// The engine's KV-event replay endpoint.
    #[serde(default)]
    pub replay: Option<String>,
    /// The engine's block size; must equal the router's.
    #[serde(default, rename = "block-size", alias = "block_size")]
    pub block_size: Option<u32>,
}

impl WorkerSpec {
    /// Parses the command-line form.
    pub fn parse(text: &str) -> Result<Self, ConfigError> {
        let mut parts = text.split(',');
        let url = parts.next().unwrap_or_default().trim().to_owned();
        let mut spec = WorkerSpec {
            url,
            name: None,
            events: None,
            replay: None,
            block_size: None,
        };
        for part in parts {
            let (key, value) = part.split_once('=').ok_or_else(|| {
                ConfigError::Worker(format!(
                    "{text:?}: expected key=value after the URL, got {part:?}"
                ))
            })?;
            let value = value.trim().to_owned();
            match key.trim() {
                "events" => spec.events = Some(value),
                "replay" => spec.replay = Some(value),
                "name" => spec.name = Some(value),
                "block-size" | "block_size" => {
                    spec.block_size = Some(value.parse().map_err(|_| {
                        ConfigError::Worker(format!("{text:?}: block-size must be a positive integer"))
                    })?)
                }
                other => {
                    return Err(ConfigError::Worker(format!(
                        "{text:?}: unknown worker option {other:?} (expected events, replay, block-size, name)"
                    )))
                }
            }
        }
        spec.validate()?;
        Ok(spec)
    }

    /// The worker's `host:port`, the default name.
    pub fn authority(&self) -> &str {
        let rest = self.url.strip_prefix("http://").unwrap_or(&self.url);
        rest.split('/').next().unwrap_or(rest)
    }

    /// The name used everywhere.
    pub fn display_name(&self) -> String {
        self.name
            .clone()
            .unwrap_or_else(|| self.authority().to_owned())
    }

    /// Checks the URL and options.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let Some(rest) = self.url.strip_prefix("http://") else {
            return Err(ConfigError::Worker(format!(
                "{:?}: worker URLs must start with http://",
                self.url
            )));
        };
        let authority = rest.trim_end_matches('/');
        if authority.is_empty() || authority.contains('/') {
            return Err(ConfigError::Worker(format!(
                "{:?}: a worker URL is scheme://host:port with no path",
                self.url
            )));
        }
        if self.block_size == Some(0) {
            return Err(ConfigError::Worker(format!(
                "{:?}: block-size must be positive",
                self.url
            )));
        }
        for endpoint in self.events.iter().chain(&self.replay) {
            if !endpoint.starts_with("tcp://") && !endpoint.starts_with("ipc://") {
                return Err(ConfigError::Worker(format!(
                    "{endpoint:?}: event endpoints are tcp://HOST:PORT or ipc://PATH"
                )));
            }
        }
        if self.replay.is_some() && self.events.is_none() {
            return Err(ConfigError::Worker(format!(
                "{:?}: replay= needs events=",
                self.url
            )));
        }
        Ok(())
    }
}

/// How the router learns workers' caches.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum CacheMode {
    /// Exact (KV events) when every configured worker has `events=`,
    /// approximate otherwise.
    #[default]
    Auto,
    /// KV events only.
    Events,
    /// The router's own decisions with a TTL.
    Approximate,
}

/// Admission strategies.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum AdmissionMode {
    /// The policy queue only.
    #[default]
    None,
    /// Session-aware admission (sessions from `x-session-id` or `session_id`).
    SessionAware,
}

/// Every setting of `switchyard serve`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ServerConfig {
    /// Address to listen on.
    pub host: String,
    /// Port to listen on (0: any free port; the address is printed).
    pub port: u16,
    /// Routing policy.
    pub policy: PolicyKind,
    /// Policy settings.
    pub policies: PolicyConfig,
    /// Tokens per KV block (must match the engines').
    pub block_size: u32,
    /// Exact or approximate cache tracking.
    pub cache: CacheMode,
    /// Busy threshold as a fraction of a worker's capacity (none: off).
    pub busy_threshold: Option<f64>,
    /// Admission strategy.
    pub admission: AdmissionMode,
    /// Policy-queue and record limits.
    pub queue: AdmissionConfig,
    /// Session-aware strategy settings.
    pub session: SessionAwareConfig,
    /// The fleet.
    pub workers: Vec<WorkerSpec>,
    /// Add `x-switchyard-worker` to responses.
    pub worker_header: bool,
    /// Bearer token the admin API requires (admin API off without one).
    pub admin_token: Option<String>,
    /// Client API keys (`Authorization: Bearer`); empty: no check.
    pub api_keys: Vec<String>,
    /// Largest request body, in bytes.
    pub max_body_bytes: usize,
    /// Most tokens in one prompt (token ids as given, or text and chats
    /// as the router tokenizes them). None: the largest `max_model_len`
    /// the workers report on `/v1/models`, else
    /// [`FALLBACK_MAX_PROMPT_TOKENS`].
    pub max_prompt_tokens: Option<usize>,
    /// Most messages in one chat request.
    pub max_messages: usize,
    /// Most content parts in all of one chat request's messages.
    pub max_content_parts: usize,
    /// Largest `n` (choices asked for).
    pub max_n: u32,
    /// Largest `max_tokens` / `max_completion_tokens`. None: the prompt
    /// token limit in force (a model's context bounds its output too).
    pub max_output_tokens: Option<u32>,
    /// Milliseconds between health checks of each worker.
    pub health_interval_ms: u64,
    /// Consecutive failed checks that take a worker out.
    pub health_failures: u32,
    /// Connect timeout to a worker, in milliseconds.
    pub connect_timeout_ms: u64,
    /// How long shutdown waits for in-flight streams before cancelling
    /// them, in milliseconds (`--shutdown-timeout-ms`).
    pub shutdown_grace_ms: u64,
    /// Passive failure detection: each worker's circuit breaker.
    pub circuit: CircuitConfig,
    /// Prefill-duration hints (`[estimator]`): the workers' timing model
    /// and its online fit.
    pub estimator: EstimatorConfig,
    /// OpenAI requests the router holds at once (queued, waiting or
    /// streaming); beyond it, 503 with `Retry-After`.
    pub max_inflight: usize,
    /// Logs as JSON lines.
    pub log_json: bool,
    /// Tokenizer directory (default: the bundled Qwen3 tokenizer).
    pub tokenizer_dir: Option<PathBuf>,
    /// Seed of the policies' random choices.
    pub seed: u64,
    /// Migrations allowed per request (0: a failed worker fails the request).
    pub migration_limit: u32,
    /// Prompt plus generated tokens above which a broken stream is not
    /// resumed (the client gets an error event instead).
    pub migration_max_seq_len: u64,
    /// Seconds to wait for a worker's response headers and first streamed
    /// event (and, mid-stream, for its next event) before moving the request.
    pub first_token_timeout_secs: f64,
    /// Seconds a request may take in all; then the upstream work is
    /// cancelled and the client gets a 504 (or an error event mid-stream).
    pub request_timeout_secs: f64,
    /// Largest non-streaming response the router buffers, in bytes.
    pub max_response_bytes: usize,
    /// Replica sync (`[replica]`; off unless `nats_url` is set).
    pub replica: ReplicaConfig,
}

impl Default for ServerConfig {
    fn default() -> Self {
        Self {
            host: "127.0.0.1".into(),
            port: 8080,
            policy: PolicyKind::DEFAULT,
            policies: PolicyConfig::default(),
            block_size: 16,
            cache: CacheMode::Auto,
            busy_threshold: None,
            admission: AdmissionMode::None,
            queue: AdmissionConfig::default(),
            session: SessionAwareConfig::default(),
            workers: Vec::new(),
            worker_header: true,
            admin_token: None,
            api_keys: Vec::new(),
            max_body_bytes: 32 * 1024 * 1024,
            max_prompt_tokens: None,
            max_messages: 4096,
            max_content_parts: 16_384,
            max_n: 16,
            max_output_tokens: None,
            health_interval_ms: 1000,
            health_failures: 2,
            connect_timeout_ms: 1000,
            shutdown_grace_ms: 30_000,
            circuit: CircuitConfig::default(),
            estimator: EstimatorConfig::default(),
            // The default admission queue (4096) full, plus as many
            // dispatched responses. Worst-case body memory is
            // max_inflight × max_body_bytes; real prompts are kilobytes.
            max_inflight: 8192,
            log_json: false,
            tokenizer_dir: None,
            seed: 0,
            migration_limit: 3,
            migration_max_seq_len: 32_768,
            first_token_timeout_secs: 60.0,
            request_timeout_secs: 600.0,
            max_response_bytes: 16 * 1024 * 1024,
            replica: ReplicaConfig::default(),
        }
    }
}

/// The prompt token limit when none is configured and no worker reports
/// its `max_model_len`.
pub const FALLBACK_MAX_PROMPT_TOKENS: usize = 131_072;

/// Why a configuration was refused.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// A worker entry.
    #[error("worker: {0}")]
    Worker(String),
    /// A setting out of range.
    #[error("{0}")]
    Invalid(String),
    /// The TOML file.
    #[error("config file {path}: {reason}")]
    File {
        /// The file.
        path: PathBuf,
        /// Why.
        reason: String,
    },
}

impl ServerConfig {
    /// Reads a TOML file.
    pub fn from_toml_file(path: &std::path::Path) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|e| ConfigError::File {
            path: path.to_owned(),
            reason: e.to_string(),
        })?;
        Self::from_toml(&text).map_err(|e| match e {
            ConfigError::File { reason, .. } => ConfigError::File {
                path: path.to_owned(),
                reason,
            },
            other => other,
        })
    }

    /// Parses TOML text (and validates it).
    pub fn from_toml(text: &str) -> Result<Self, ConfigError> {
        let config: Self = toml::from_str(text).map_err(|e| ConfigError::File {
            path: PathBuf::from("<text>"),
            reason: e.to_string(),
        })?;
        config.validate()?;
        Ok(config)
    }

    /// Checks ranges and relations.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let invalid = |m: String| Err(ConfigError::Invalid(m));
        if self.block_size == 0 {
            return invalid("block_size must be positive".into());
        }
        if let Some(t) = self.busy_threshold {
            if !(t.is_finite() && t > 0.0) {
                return invalid(format!("busy_threshold must be positive, got {t}"));
            }
        }
        if self.max_body_bytes == 0 {
            return invalid("max_body_bytes must be positive".into());
        }
        for (name, value) in [
            ("max_prompt_tokens", self.max_prompt_tokens.unwrap_or(1)),
            ("max_messages", self.max_messages),
            ("max_content_parts", self.max_content_parts),
            ("max_n", self.max_n as usize),
            (
                "max_output_tokens",
                self.max_output_tokens.map_or(1, |v| v as usize),
            ),
        ] {
            if value == 0 {
                return invalid(format!("{name} must be positive"));
            }
        }
        if self.health_interval_ms == 0 || self.health_failures == 0 {
            return invalid("health_interval_ms and health_failures must be positive".into());
        }
        for (name, secs) in [
            ("first_token_timeout_secs", self.first_token_timeout_secs),
            ("request_timeout_secs", self.request_timeout_secs),
        ] {
            if !(secs.is_finite() && secs > 0.0 && secs <= 1e6) {
                return invalid(format!(
                    "{name} must be a positive number of seconds (at most 1e6), got {secs}"
                ));
            }
        }
        if self.max_response_bytes == 0 {
            return invalid("max_response_bytes must be positive".into());
        }
        if self.max_inflight == 0 {
            return invalid("max_inflight must be positive".into());
        }
        self.circuit
            .validate()
            .map_err(|e| ConfigError::Invalid(e.to_string()))?;
        self.estimator
            .validate()
            .map_err(|e| ConfigError::Invalid(format!("estimator: {e}")))?;
        self.policies
            .validate()
            .map_err(|e| ConfigError::Invalid(e.to_string()))?;
        self.queue
            .validate()
            .map_err(|e| ConfigError::Invalid(format!("queue: {e}")))?;
        self.session
            .validate()
            .map_err(|e| ConfigError::Invalid(format!("session: {e}")))?;
        self.replica
            .validate()
            .map_err(|e| ConfigError::Invalid(e.to_string()))?;
        let mut names = std::collections::HashSet::new();
        for worker in &self.workers {
            worker.validate()?;
            if let Some(bs) = worker.block_size {
                if bs != self.block_size {
                    return Err(ConfigError::Worker(format!(
                        "{}: block-size {bs} differs from the router's {}; run the router with --block-size {bs}",
                        worker.url, self.block_size
                    )));
                }
            }
            if !names.insert(worker.display_name()) {
                return Err(ConfigError::Worker(format!(
                    "two workers are named {:?}",
                    worker.display_name()
                )));
            }
        }
        if self.cache == CacheMode::Events && self.workers.iter().any(|w| w.events.is_none()) {
            return invalid("--cache events needs events= on every worker".into());
        }
        Ok(())
    }

    /// Whether the router follows KV events (else approximate).
    pub fn uses_events(&self) -> bool {
        match self.cache {
            CacheMode::Events => true,
            CacheMode::Approximate => false,
            CacheMode::Auto => {
                !self.workers.is_empty() && self.workers.iter().all(|w| w.events.is_some())
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_worker_flag_with_every_option_parses() {
        let w = WorkerSpec::parse(
            "http://127.0.0.1:8001,events=tcp://127.0.0.1:5557,replay=tcp://127.0.0.1:5558,block-size=16,name=w1",
        )
        .unwrap();
        assert_eq!(w.url, "http://127.0.0.1:8001");
        assert_eq!(w.events.as_deref(), Some("tcp://127.0.0.1:5557"));
        assert_eq!(w.replay.as_deref(), Some("tcp://127.0.0.1:5558"));
        assert_eq!(w.block_size, Some(16));
        assert_eq!(w.display_name(), "w1");
    }

    #[test]
    fn input_limits_have_defaults_and_must_be_positive() {
        let c = ServerConfig::default();
        assert_eq!(
            (c.max_prompt_tokens, c.max_messages, c.max_content_parts),
            (None, 4096, 16_384)
        );
        assert_eq!((c.max_n, c.max_output_tokens), (16, None));
        let c = ServerConfig::from_toml(
            "max_prompt_tokens = 8192\nmax_messages = 10\nmax_content_parts = 20\nmax_n = 2\nmax_output_tokens = 100",
        )
        .unwrap();
        assert_eq!(c.max_prompt_tokens, Some(8192));
        assert_eq!(c.max_output_tokens, Some(100));
        for zero in [
            "max_prompt_tokens = 0",
            "max_messages = 0",
            "max_content_parts = 0",
            "max_n = 0",
            "max_output_tokens = 0",
        ] {
            let error = ServerConfig::from_toml(zero).unwrap_err().to_string();
            assert!(error.contains("must be positive"), "{zero}: {error}");
        }
    }

    #[test]
    fn a_worker_without_a_name_is_named_by_host_and_port() {
        let w = WorkerSpec::parse("http://127.0.0.1:8001").unwrap();
        assert_eq!(w.display_name(), "127.0.0.1:8001");
    }

    #[test]
    fn unknown_worker_options_and_bad_urls_are_refused() {
        assert!(WorkerSpec::parse("http://h:1,colour=red").is_err());
        assert!(WorkerSpec::parse("https://h:1").is_err());
        assert!(WorkerSpec::parse("http://h:1/v1").is_err());
        assert!(WorkerSpec::parse("http://h:1,replay=tcp://h:2").is_err());
    }

    #[test]
    fn a_toml_file_fills_the_same_struct_and_refuses_unknown_keys() {
        let config = ServerConfig::from_toml(
            r#"
            port = 9000
            policy = "round-robin"
            [[workers]]
            url = "http://127.0.0.1:8001"
            events = "tcp://127.0.0.1:5557"
            "#,
        )
        .unwrap();
        assert_eq!(config.port, 9000);
        assert_eq!(config.policy, PolicyKind::RoundRobin);
        assert!(config.uses_events());
        assert!(ServerConfig::from_toml("colour = 1").is_err());
    }

    #[test]
    fn serve_runs_the_cores_default_policy_when_none_is_named() {
        assert_eq!(ServerConfig::default().policy, PolicyKind::DEFAULT);
        assert_eq!(
            ServerConfig::from_toml("").unwrap().policy,
            PolicyKind::DEFAULT
        );
    }

    #[test]
    fn the_ttft_policy_and_its_settings_come_from_the_policies_table() {
        let config = ServerConfig::from_toml(
            r#"
            policy = "ttft"
            [policies.ttft]
            locality_weight = 0.5
            pressure_weight = 4.0
            "#,
        )
        .unwrap();
        assert_eq!(config.policy, PolicyKind::Ttft);
        assert_eq!(config.policies.ttft.locality_weight, 0.5);
        assert_eq!(config.policies.ttft.pressure_weight, 4.0);
        let err = ServerConfig::from_toml("[policies.ttft]\nlocality_weight = -1.0").unwrap_err();
        assert!(err.to_string().contains("locality_weight"), "{err}");
    }

    #[test]
    fn timeouts_must_be_positive_and_finite() {
        for bad in [0.0, -1.0, f64::NAN, f64::INFINITY] {
            let config = ServerConfig {
                request_timeout_secs: bad,
                ..ServerConfig::default()
            };
            assert!(config.validate().is_err(), "{bad}");
            let config = ServerConfig {
                first_token_timeout_secs: bad,
                ..ServerConfig::default()
            };
            assert!(config.validate().is_err(), "{bad}");
        }
        assert!(ServerConfig::from_toml("migration_limit = 0\nrequest_timeout_secs = 2.5").is_ok());
    }

    #[test]
    fn a_worker_block_size_that_differs_from_the_routers_is_refused() {
        let config = ServerConfig {
            workers: vec![WorkerSpec::parse("http://h:1,block-size=64").unwrap()],
            ..ServerConfig::default()
        };
        assert!(config.validate().is_err());
    }

    #[test]
    fn overload_and_circuit_settings_are_validated() {
        let zero_inflight = ServerConfig {
            max_inflight: 0,
            ..ServerConfig::default()
        };
        assert!(zero_inflight.validate().is_err());
        let config = ServerConfig::from_toml(
            "max_inflight = 64\nshutdown_grace_ms = 500\n[circuit]\nfailure_threshold = 5\ncooldown_ms = 100\nmax_cooldown_ms = 1000\n",
        )
        .unwrap();
        assert_eq!(config.max_inflight, 64);
        assert_eq!(config.circuit.failure_threshold, 5);
        assert!(ServerConfig::from_toml("[circuit]\nfailure_threshold = 0\n").is_err());
        assert!(
            ServerConfig::from_toml("[circuit]\ncooldown_ms = 10\nmax_cooldown_ms = 1\n").is_err()
        );
    }

    #[test]
    fn a_worker_without_events_makes_auto_mode_approximate() {
        let config = ServerConfig {
            workers: vec![
                WorkerSpec::parse("http://h:1,events=tcp://h:2").unwrap(),
                WorkerSpec::parse("http://h:3").unwrap(),
            ],
            ..ServerConfig::default()
        };
        assert!(!config.uses_events());
    }

    #[test]
    fn replica_sync_is_off_by_default_and_a_replica_table_turns_it_on() {
        assert!(!ServerConfig::default().replica.enabled());
        let config = ServerConfig::from_toml(
            r#"
            [replica]
            nats_url = "nats://10.0.0.9:4222"
            endpoint = "chat"
            silence_expiry_ms = 2000.0
            "#,
        )
        .unwrap();
        assert!(config.replica.enabled());
        assert_eq!(
            config.replica.subject(),
            "switchyard.default.chat.active_sequences"
        );
    }

    #[test]
    fn bad_replica_settings_are_refused_with_a_clear_error() {
        let err = ServerConfig::from_toml("[replica]\nnats_url = \"http://h:4222\"")
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("--replica-sync must be nats://HOST:PORT"),
            "{err}"
        );
        let err = ServerConfig::from_toml("[replica]\nendpoint = \"a.b\"")
            .unwrap_err()
            .to_string();
        assert!(err.contains("endpoint"), "{err}");
        assert!(ServerConfig::from_toml("[replica]\nnats = 1").is_err());
    }
}
