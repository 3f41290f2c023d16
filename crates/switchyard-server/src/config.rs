//! The router's configuration: one validated struct filled by the TOML file
//! (`--config FILE`), then `SWITCHYARD_*` environment variables and command
//! line flags (both through clap, flags winning), in that order.

use crate::front::ratelimit::RateLimitConfig;
use serde::{Deserialize, Serialize};
use std::path::PathBuf;
use switchyard_core::admission::{AdmissionConfig, FlowConfig, FlowPolicy, SessionAwareConfig};
use switchyard_core::dispatch::failure::MigrationPolicy;
use switchyard_core::estimate::EstimatorConfig;
use switchyard_core::health::CircuitConfig;
use switchyard_core::select::{PolicyConfig, PolicyKind};
use switchyard_replica::{ReplicaConfig, Secret};

/// One worker, as `--worker URL[,events=tcp://H:P][,replay=tcp://H:P][,block-size=N][,name=NAME][,role=prefill|decode|both][,bootstrap-port=N][,dp-size=N]`
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
    /// Its part in a prefill/decode-disaggregated fleet (`--disagg`):
    /// `prefill`, `decode` or `both` (the default: either half, or whole
    /// requests).
    #[serde(default)]
    pub role: Role,
    /// SGLang: the port its prefill side serves KV transfers on
    /// (`--disaggregation-bootstrap-port`; default 8998, SGLang's).
    #[serde(
        default,
        rename = "bootstrap-port",
        alias = "bootstrap_port",
        skip_serializing_if = "Option::is_none"
    )]
    pub bootstrap_port: Option<u16>,
    /// Attention data-parallel ranks behind the URL (vLLM's
    /// `--data-parallel-size`): each rank is a routing target of its own,
    /// named `NAME/r`, its requests carrying `X-data-parallel-rank: r`,
    /// its KV events read from the `events=` port plus `r` (as vLLM
    /// publishes them). `None` or 1: one rank.
    #[serde(
        default,
        rename = "dp-size",
        alias = "dp_size",
        skip_serializing_if = "Option::is_none"
    )]
    pub dp_size: Option<u32>,
}

/// Most data-parallel ranks one worker may declare (vLLM deployments use
/// up to a few dozen; the bound keeps the targets of a mistyped size
/// few).
pub const MAX_DP_SIZE: u32 = 256;

pub use crate::roster::Role;

/// The prefill/decode protocol of a disaggregated fleet's engines
/// (`serve --disagg`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum DisaggMode {
    /// vLLM's: a prefill request asking for a remote decode, whose
    /// answer's `kv_transfer_params` the decode request then carries.
    Vllm,
    /// SGLang's: the same request with `bootstrap_host`, `bootstrap_port`
    /// and `bootstrap_room` to a prefill and a decode worker at once.
    Sglang,
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
            role: Role::Both,
            bootstrap_port: None,
            dp_size: None,
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
                "role" => {
                    spec.role = value.parse().map_err(|e: String| {
                        ConfigError::Worker(format!("{text:?}: {e}"))
                    })?
                }
                "bootstrap-port" | "bootstrap_port" => {
                    spec.bootstrap_port = Some(value.parse().map_err(|_| {
                        ConfigError::Worker(format!(
                            "{text:?}: bootstrap-port must be a port number 1-65535"
                        ))
                    })?)
                }
                "dp-size" | "dp_size" => {
                    spec.dp_size = Some(value.parse().map_err(|_| {
                        ConfigError::Worker(format!(
                            "{text:?}: dp-size must be a whole number 1-{MAX_DP_SIZE}"
                        ))
                    })?)
                }
                other => {
                    return Err(ConfigError::Worker(format!(
                        "{text:?}: unknown worker option {other:?} (expected events, replay, block-size, name, role, bootstrap-port, dp-size)"
                    )))
                }
            }
        }
        spec.validate()?;
        Ok(spec)
    }

    /// The worker's `host:port`, the default name.
    pub fn authority(&self) -> &str {
        let rest = strip_scheme(&self.url).unwrap_or(&self.url);
        rest.split('/').next().unwrap_or(rest)
    }

    /// Its data-parallel ranks (1 when it declares none).
    pub fn ranks(&self) -> u32 {
        self.dp_size.unwrap_or(1).max(1)
    }

    /// The name used everywhere.
    pub fn display_name(&self) -> String {
        self.name
            .clone()
            .unwrap_or_else(|| self.authority().to_owned())
    }

    /// Checks the URL and options.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let Some(rest) = strip_scheme(&self.url) else {
            return Err(ConfigError::Worker(format!(
                "{:?}: worker URLs must start with http:// or https://",
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
        if let Some(n) = self.dp_size {
            if n == 0 || n > MAX_DP_SIZE {
                return Err(ConfigError::Worker(format!(
                    "{:?}: dp-size must be 1-{MAX_DP_SIZE}, got {n}",
                    self.url
                )));
            }
            if n > 1 {
                for endpoint in self.events.iter().chain(&self.replay) {
                    if rank_endpoint(endpoint, n - 1).is_none() {
                        return Err(ConfigError::Worker(format!(
                            "{endpoint:?}: with dp-size={n} an event endpoint is tcp://HOST:PORT with room for a port per rank (rank r publishes on PORT+r)"
                        )));
                    }
                }
            }
        }
        if self.bootstrap_port == Some(0) {
            return Err(ConfigError::Worker(format!(
                "{:?}: bootstrap-port must be 1-65535",
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

/// The event endpoint of data-parallel rank `rank` of an engine whose
/// rank 0 publishes on `endpoint`: vLLM offsets the port by the rank.
/// `None` when `endpoint` is not `tcp://HOST:PORT` or the port overflows.
pub fn rank_endpoint(endpoint: &str, rank: u32) -> Option<String> {
    let rest = endpoint.strip_prefix("tcp://")?;
    let (host, port) = rest.rsplit_once(':')?;
    let port: u16 = port.parse().ok()?;
    let port = port.checked_add(u16::try_from(rank).ok()?)?;
    Some(format!("tcp://{host}:{port}"))
}

/// `url` without its `http://` or `https://` (`None`: neither).
pub fn strip_scheme(url: &str) -> Option<&str> {
    url.strip_prefix("http://")
        .or_else(|| url.strip_prefix("https://"))
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
    /// Most blocks one worker may hold in each tier of the prefix index;
    /// past it the worker's oldest are dropped (counted in
    /// `switchyard_index_evicted_blocks_total`).
    pub max_index_blocks_per_worker: usize,
    /// Admission strategy.
    pub admission: AdmissionMode,
    /// Policy-queue and record limits.
    pub queue: AdmissionConfig,
    /// Session-aware strategy settings.
    pub session: SessionAwareConfig,
    /// The fleet.
    pub workers: Vec<WorkerSpec>,
    /// Add `x-switchyard-worker` (the serving worker's name) to responses;
    /// `None`: only while no client key is required
    /// ([`Self::names_workers`]).
    pub worker_header: Option<bool>,
    /// Bearer token the admin API requires (admin API off without one:
    /// its routes do not exist).
    pub admin_token: Option<Secret>,
    /// A file holding the admin token (its first non-comment line);
    /// read at startup ([`Self::load_secret_files`]).
    pub admin_token_file: Option<PathBuf>,
    /// Client API keys (`Authorization: Bearer`) for `/v1/*`; empty: no check.
    pub api_keys: Vec<Secret>,
    /// A file of client API keys, one a line (blank lines and `#` comments
    /// ignored), added to `api_keys` at startup.
    pub api_key_file: Option<PathBuf>,
    /// Bearer token `/metrics` requires (none: `/metrics` is open).
    pub metrics_key: Option<Secret>,
    /// A file holding the metrics key.
    pub metrics_key_file: Option<PathBuf>,
    /// Key the router sends to every worker (`Authorization: Bearer`) on
    /// proxied requests, health checks and model probes.
    pub worker_api_key: Option<Secret>,
    /// A file holding the worker key.
    pub worker_api_key_file: Option<PathBuf>,
    /// PEM roots an `https://` worker's certificate must chain to (none:
    /// the system's roots).
    pub worker_ca_file: Option<PathBuf>,
    /// A client certificate chain (PEM) presented to `https://` workers.
    pub worker_client_cert: Option<PathBuf>,
    /// The client certificate's private key (PEM).
    pub worker_client_key: Option<PathBuf>,
    /// The front door's certificate chain (PEM): with `tls_key`, the router
    /// serves HTTPS only ([`crate::front::tls`]).
    pub tls_cert: Option<PathBuf>,
    /// The front door's private key (PEM).
    pub tls_key: Option<PathBuf>,
    /// Clients must present a certificate this CA (PEM) signed.
    pub tls_client_ca_file: Option<PathBuf>,
    /// Largest request body, in bytes.
    pub max_body_bytes: usize,
    /// Bytes of request bodies the router holds at once, every request's
    /// together ([`crate::front::upload`]); past it, 503 with
    /// `Retry-After`. None: [`DEFAULT_BODY_BUDGET_BODIES`] ×
    /// `max_body_bytes` ([`Self::body_bytes_total`]).
    pub max_body_bytes_total: Option<usize>,
    /// Connections the router holds open at once; a connection accepted
    /// beyond it is closed at once (counted).
    pub max_connections: usize,
    /// How long a client may take to send a request's head (and how long
    /// an idle keep-alive connection stays open), in milliseconds.
    pub header_read_timeout_ms: u64,
    /// How long a client may take to send a request's body, from its head
    /// on, in milliseconds; a slower upload gets a 408 (counted).
    pub body_read_timeout_ms: u64,
    /// How long a connection's answer may make no progress (its client
    /// reads nothing) before the connection is closed, in milliseconds;
    /// never more than the request timeout ([`Self::send_timeout`]).
    pub send_timeout_ms: u64,
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
    /// Token ids the tokenizer's segment cache holds (the ids of chat
    /// messages already seen); 0 turns it off.
    pub token_cache_ids: u64,
    /// Long prompts tokenized at once ([`crate::tokenize_gate`]; more
    /// wait, by band and tenant fair share), 1 to
    /// [`MAX_TOKENIZE_SLOTS`]. None: one per core.
    pub tokenize_slots: Option<usize>,
    /// Seed of the policies' random choices.
    pub seed: u64,
    /// Migrations allowed per request (0: a failed worker fails the request).
    pub migration_limit: u32,
    /// Prompt plus generated tokens above which a broken stream is not
    /// resumed (the client gets an error event instead).
    pub migration_max_seq_len: u64,
    /// Workers a request may fail on (workers that received it; a refused
    /// connection does not count) before it ends with a 502 or an error
    /// event instead of going to another: a prompt that failed on two
    /// workers is probably the cause.
    pub max_attempt_workers: u32,
    /// Seconds to wait for a worker's response headers and first streamed
    /// event (and, mid-stream, for its next event) before moving the request.
    pub first_token_timeout_secs: f64,
    /// Seconds a request may take in all; then the upstream work is
    /// cancelled and the client gets a 504 (or an error event mid-stream).
    pub request_timeout_secs: f64,
    /// Largest non-streaming response the router buffers, in bytes.
    pub max_response_bytes: usize,
    /// Most stored responses whose worker the router remembers
    /// (`/v1/responses`; [`crate::response_map`]).
    pub max_stored_responses: usize,
    /// Most stored responses remembered for one client key: a key at it
    /// forgets its own oldest (without keys, only the global cap binds).
    pub max_stored_responses_per_key: usize,
    /// Seconds the router remembers a stored response's worker.
    pub stored_response_ttl_secs: u64,
    /// Replica sync (`[replica]`; off unless `nats_url` is set).
    pub replica: ReplicaConfig,
    /// Per-key rate limits and named keys (`[rate_limits]`; none by default).
    pub rate_limits: RateLimitConfig,
    /// Flow control (`[flow]`, `[[flow.tenants]]`): priority bands, the
    /// tenants (named keys' names) with their weights, bands, ceilings
    /// and caps.
    pub flow: FlowConfig,
    /// With client keys off, the header naming a request's tenant (e.g.
    /// `x-tenant`); with keys on the key's name is the tenant and this is
    /// ignored. None: every request is the default tenant's.
    pub tenant_header: Option<String>,
    /// Live worker discovery (`[discovery]`: a watched workers file, DNS
    /// names; off by default).
    pub discovery: DiscoveryConfig,
    /// The prefill/decode protocol of a disaggregated fleet (none: every
    /// request is served whole; worker roles then are refused).
    pub disagg: Option<DisaggMode>,
    /// LoRA adapters requests may name (`[[adapters]]`: `name`, `path`,
    /// `base_model`); loaded on a worker on demand
    /// ([`crate::adapters`]).
    pub adapters: Vec<crate::adapters::AdapterSpec>,
    /// Expected milliseconds to load an adapter on a worker: what the
    /// `ttft` policy charges a worker without the request's adapter.
    pub adapter_load_ms: f64,
    /// Models with routing settings of their own (`[[models]]`: `name`,
    /// `tokenizer_dir` or `hub_id`, `block_size`, `policy`;
    /// [`crate::models`]); every other model routes with the router's.
    pub models: Vec<crate::models::ModelSpec>,
    /// Download a `[[models]]` table's `hub_id` tokenizer from the
    /// Hugging Face hub when the hub cache lacks it (off: the cache only).
    pub allow_hub_download: bool,
    /// The Hugging Face hub cache (default: `HF_HUB_CACHE`, else
    /// `HF_HOME/hub`, else `~/.cache/huggingface/hub`).
    pub hub_cache_dir: Option<PathBuf>,
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
            max_index_blocks_per_worker: switchyard_core::index::DEFAULT_MAX_BLOCKS_PER_WORKER,
            admission: AdmissionMode::None,
            queue: AdmissionConfig::default(),
            session: SessionAwareConfig::default(),
            workers: Vec::new(),
            worker_header: None,
            admin_token: None,
            admin_token_file: None,
            api_keys: Vec::new(),
            api_key_file: None,
            metrics_key: None,
            metrics_key_file: None,
            worker_api_key: None,
            worker_api_key_file: None,
            worker_ca_file: None,
            worker_client_cert: None,
            worker_client_key: None,
            tls_cert: None,
            tls_key: None,
            tls_client_ca_file: None,
            max_body_bytes: 32 * 1024 * 1024,
            max_body_bytes_total: None,
            // Above the in-flight limit (plus probes), so an overloaded
            // router answers 503 rather than closing connections; each
            // connection costs a file descriptor and its buffers.
            max_connections: 10_240,
            header_read_timeout_ms: 10_000,
            send_timeout_ms: 30_000,
            body_read_timeout_ms: 30_000,
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
            token_cache_ids: switchyard_tokenizer::segment_cache::DEFAULT_CAPACITY_IDS,
            tokenize_slots: None,
            seed: 0,
            migration_limit: MigrationPolicy::default().limit,
            migration_max_seq_len: MigrationPolicy::default().max_seq_len,
            max_attempt_workers: MigrationPolicy::default().max_workers,
            first_token_timeout_secs: 60.0,
            request_timeout_secs: 600.0,
            disagg: None,
            max_response_bytes: 16 * 1024 * 1024,
            max_stored_responses: crate::response_map::DEFAULT_CAPACITY,
            max_stored_responses_per_key: crate::response_map::DEFAULT_PER_KEY,
            stored_response_ttl_secs: crate::response_map::DEFAULT_TTL.as_secs(),
            replica: ReplicaConfig::default(),
            rate_limits: RateLimitConfig::default(),
            flow: FlowConfig::default(),
            tenant_header: None,
            discovery: DiscoveryConfig::default(),
            adapters: Vec::new(),
            adapter_load_ms: switchyard_core::adapters::AdapterConfig::default().load_ms,
            models: Vec::new(),
            allow_hub_download: false,
            hub_cache_dir: None,
        }
    }
}

/// The prompt token limit when none is configured and no worker reports
/// its `max_model_len`.
pub const FALLBACK_MAX_PROMPT_TOKENS: usize = 131_072;

/// Bodies of the largest size (`max_body_bytes`) the router holds at once
/// when `max_body_bytes_total` is not set: 128 MiB at the default 32 MiB.
/// Real prompts are kilobytes, so this bounds only the outsized uploads,
/// which hold memory several times their size while they are parsed and
/// tokenized.
pub const DEFAULT_BODY_BUDGET_BODIES: usize = 4;

/// Why a configuration was refused.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// A worker entry.
    #[error("worker: {0}")]
    Worker(String),
    /// A setting out of range.
    #[error("{0}")]
    Invalid(String),
    /// A file of keys or tokens.
    #[error("secret file {path}: {reason}")]
    SecretFile {
        /// The file.
        path: PathBuf,
        /// Why (never the file's contents).
        reason: String,
    },
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
    /// The block sizes the router hashes prompts at: its own first, then
    /// each `[[models]]` table's.
    pub fn block_sizes(&self) -> Vec<u32> {
        let mut sizes = vec![self.block_size];
        for size in self.models.iter().filter_map(|m| m.block_size) {
            if !sizes.contains(&size) {
                sizes.push(size);
            }
        }
        sizes
    }

    /// The send timeout in force: `send_timeout_ms`, but never more than
    /// the request timeout (a request's answer is due by then anyway).
    pub fn send_timeout(&self) -> std::time::Duration {
        let configured = std::time::Duration::from_millis(self.send_timeout_ms);
        // A positive finite timeout (validated); a bad one leaves the send
        // timeout as configured.
        std::time::Duration::try_from_secs_f64(self.request_timeout_secs)
            .map_or(configured, |request| configured.min(request))
    }

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

    /// Parses TOML text (and validates it). An error names the line and
    /// the fault without quoting the file ([`toml_error`]): the line may
    /// hold a secret.
    pub fn from_toml(text: &str) -> Result<Self, ConfigError> {
        let config: Self = toml::from_str(text).map_err(|e| ConfigError::File {
            path: PathBuf::from("<text>"),
            reason: toml_error(text, &e),
        })?;
        config.validate()?;
        Ok(config)
    }

    /// Checks ranges and relations.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let invalid = |m: String| Err(ConfigError::Invalid(m));
        if self.tls_cert.is_some() != self.tls_key.is_some() {
            return invalid("tls_cert and tls_key go together: give both or neither".into());
        }
        if self.tls_client_ca_file.is_some() && self.tls_cert.is_none() {
            return invalid("tls_client_ca_file needs tls_cert and tls_key".into());
        }
        if self.worker_client_cert.is_some() != self.worker_client_key.is_some() {
            return invalid(
                "worker_client_cert and worker_client_key go together: give both or neither".into(),
            );
        }
        if self.disagg.is_none() {
            if let Some(w) = self.workers.iter().find(|w| w.role != Role::Both) {
                return invalid(format!(
                    "worker {}: role={} needs --disagg vllm|sglang",
                    w.url,
                    w.role.label()
                ));
            }
        }
        if self.block_size == 0 {
            return invalid("block_size must be positive".into());
        }
        if self.max_index_blocks_per_worker == 0 {
            return invalid("max_index_blocks_per_worker must be at least 1".into());
        }
        if let Some(t) = self.busy_threshold {
            if !(t.is_finite() && t > 0.0) {
                return invalid(format!("busy_threshold must be positive, got {t}"));
            }
        }
        if self.max_body_bytes == 0 {
            return invalid("max_body_bytes must be positive".into());
        }
        if let Some(total) = self.max_body_bytes_total {
            if total < self.max_body_bytes {
                return invalid(format!(
                    "max_body_bytes_total ({total}) must be at least max_body_bytes ({}): a body the size limit admits must fit the budget",
                    self.max_body_bytes
                ));
            }
        }
        if !(self.adapter_load_ms.is_finite() && self.adapter_load_ms >= 0.0) {
            return invalid("adapter_load_ms must be finite and non-negative".into());
        }
        if self.adapters.len() > crate::adapters::MAX_LEARNED {
            return invalid(format!(
                "at most {} [[adapters]] tables",
                crate::adapters::MAX_LEARNED
            ));
        }
        if self.models.len() > crate::models::MAX_MODELS {
            return invalid(format!(
                "at most {} [[models]] tables",
                crate::models::MAX_MODELS
            ));
        }
        for (i, spec) in self.models.iter().enumerate() {
            spec.validate().or_else(invalid)?;
            if self.models[..i].iter().any(|s| s.name == spec.name) {
                return invalid(format!("models: `{}` is named twice", spec.name));
            }
        }
        for (i, spec) in self.adapters.iter().enumerate() {
            spec.validate().or_else(invalid)?;
            if self.adapters[..i].iter().any(|s| s.name == spec.name) {
                return invalid(format!("adapters: `{}` is named twice", spec.name));
            }
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
        if self.max_stored_responses == 0
            || self.max_stored_responses_per_key == 0
            || self.stored_response_ttl_secs == 0
        {
            return invalid(
                "max_stored_responses, max_stored_responses_per_key and stored_response_ttl_secs must be positive".into(),
            );
        }
        if self.max_response_bytes == 0 {
            return invalid("max_response_bytes must be positive".into());
        }
        if let Some(slots) = self.tokenize_slots {
            if !(1..=MAX_TOKENIZE_SLOTS).contains(&slots) {
                return invalid(format!(
                    "tokenize_slots must be between 1 and {MAX_TOKENIZE_SLOTS}, got {slots}"
                ));
            }
        }
        if self.max_attempt_workers == 0 {
            return invalid("max_attempt_workers must be positive".into());
        }
        if self.max_inflight == 0 {
            return invalid("max_inflight must be positive".into());
        }
        if self.max_connections == 0 {
            return invalid("max_connections must be positive".into());
        }
        if self.header_read_timeout_ms == 0
            || self.body_read_timeout_ms == 0
            || self.send_timeout_ms == 0
        {
            return invalid(
                "header_read_timeout_ms, body_read_timeout_ms and send_timeout_ms must be positive"
                    .into(),
            );
        }
        self.validate_secrets()?;
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
        self.rate_limits.validate().map_err(ConfigError::Invalid)?;
        FlowPolicy::new(self.flow.clone())
            .map_err(|e| ConfigError::Invalid(format!("flow: {e}")))?;
        if let (Some((what, _)), None) =
            (self.flow.reserve_needing_threshold(), self.busy_threshold)
        {
            return invalid(format!(
                "flow.{what} holds capacity back below the busy threshold: set busy_threshold too"
            ));
        }
        if let Some(h) = &self.tenant_header {
            if axum::http::HeaderName::from_bytes(h.as_bytes()).is_err() {
                return invalid(format!("tenant_header {h:?} is not a header name"));
            }
        }
        validate_workers(&self.workers, &self.block_sizes(), self.cache)?;
        self.discovery.validate(self.cache)?;
        Ok(())
    }

    /// Checks the secrets: each is a usable bearer token, and no secret is
    /// given both inline and as a file.
    fn validate_secrets(&self) -> Result<(), ConfigError> {
        for (name, inline, file) in [
            (
                "admin_token",
                self.admin_token.is_some(),
                &self.admin_token_file,
            ),
            (
                "metrics_key",
                self.metrics_key.is_some(),
                &self.metrics_key_file,
            ),
            (
                "worker_api_key",
                self.worker_api_key.is_some(),
                &self.worker_api_key_file,
            ),
        ] {
            if inline && file.is_some() {
                return Err(ConfigError::Invalid(format!(
                    "{name} and {name}_file are both set; give one"
                )));
            }
        }
        let secrets = self
            .api_keys
            .iter()
            .map(|k| ("an api key", k.expose()))
            .chain(self.admin_token.iter().map(|t| ("admin_token", t.expose())))
            .chain(self.metrics_key.iter().map(|t| ("metrics_key", t.expose())))
            .chain(
                self.worker_api_key
                    .iter()
                    .map(|t| ("worker_api_key", t.expose())),
            )
            .chain(
                self.rate_limits
                    .keys
                    .iter()
                    .filter_map(|k| k.key.as_deref())
                    .map(|k| ("a rate_limits key", k)),
            );
        for (name, secret) in secrets {
            check_secret(name, secret)?;
        }
        Ok(())
    }

    /// Reads the secret files (`api_key_file`, `admin_token_file`,
    /// `metrics_key_file`, `worker_api_key_file`) into their settings and
    /// clears the paths, so loading twice reads nothing twice. An
    /// unreadable file or one without a secret is an error naming the file,
    /// never its contents.
    pub fn load_secret_files(&mut self) -> Result<(), ConfigError> {
        self.validate_secrets()?;
        if let Some(path) = self.api_key_file.take() {
            let keys = read_secrets(&path)?;
            self.api_keys.extend(keys.into_iter().map(Secret));
        }
        for (slot, file) in [
            (&mut self.admin_token, &mut self.admin_token_file),
            (&mut self.metrics_key, &mut self.metrics_key_file),
            (&mut self.worker_api_key, &mut self.worker_api_key_file),
        ] {
            if let Some(path) = file.take() {
                *slot = Some(Secret(read_one_secret(&path)?));
            }
        }
        for named in &mut self.rate_limits.keys {
            if let Some(path) = named.key_file.take() {
                named.key = Some(read_one_secret(&path)?);
            }
        }
        self.validate_secrets()
    }

    /// The bytes of request bodies held at once: `max_body_bytes_total`,
    /// else [`DEFAULT_BODY_BUDGET_BODIES`] bodies of the largest size.
    pub fn body_bytes_total(&self) -> usize {
        self.max_body_bytes_total.unwrap_or_else(|| {
            self.max_body_bytes
                .saturating_mul(DEFAULT_BODY_BUDGET_BODIES)
        })
    }

    /// Whether clients must present a key: `api_keys` or a named key of
    /// `[rate_limits]`.
    pub fn requires_client_key(&self) -> bool {
        !self.api_keys.is_empty() || !self.rate_limits.keys.is_empty()
    }

    /// Whether responses name their worker (`x-switchyard-worker`): as
    /// set, else only while clients need no key. A worker's name is its
    /// `name=` or else its URL, an internal address that a router open to
    /// outside clients should not hand them unasked.
    pub fn names_workers(&self) -> bool {
        self.worker_header
            .unwrap_or_else(|| !self.requires_client_key())
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

/// Most `tokenize_slots`: the blocking threads tokio keeps by default.
pub const MAX_TOKENIZE_SLOTS: usize = 512;

/// Checks a worker table (the config's `[[workers]]`, or a watched
/// workers file's): each entry valid, its block size one the router
/// hashes prompts at (`block_sizes`: the router's first, then the
/// `[[models]]` tables'), names unique, and KV events on every worker when
/// the cache mode requires them.
pub fn validate_workers(
    workers: &[WorkerSpec],
    block_sizes: &[u32],
    cache: CacheMode,
) -> Result<(), ConfigError> {
    let mut names = std::collections::HashSet::new();
    for worker in workers {
        worker.validate()?;
        if let Some(bs) = worker.block_size {
            if !block_sizes.contains(&bs) {
                let router = block_sizes.first().copied().unwrap_or_default();
                return Err(ConfigError::Worker(format!(
                    "{}: block-size {bs} differs from the router's {router}{}; run the router with --block-size {bs}, or give the worker's model a [[models]] table with block_size = {bs}",
                    worker.url,
                    match block_sizes.len() {
                        0 | 1 => String::new(),
                        _ => format!(" and from its [[models]] tables' {:?}", &block_sizes[1..]),
                    }
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
    if cache == CacheMode::Events && workers.iter().any(|w| w.events.is_none()) {
        return Err(ConfigError::Invalid(
            "--cache events needs events= on every worker".into(),
        ));
    }
    Ok(())
}

/// A watched workers file (`--workers-file`): `[[workers]]` tables as in
/// the config file, and nothing else.
#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct WorkersFile {
    /// The workers the file names.
    pub workers: Vec<WorkerSpec>,
}

impl WorkersFile {
    /// Parses and checks a workers file's text ([`validate_workers`]).
    /// A syntax error is one line naming the line and the fault, without
    /// quoting the file.
    pub fn parse(text: &str, block_sizes: &[u32], cache: CacheMode) -> Result<Self, ConfigError> {
        let file: Self = toml::from_str(text).map_err(|e| ConfigError::File {
            path: PathBuf::from("<workers file>"),
            reason: toml_error(text, &e),
        })?;
        validate_workers(&file.workers, block_sizes, cache)?;
        Ok(file)
    }
}

/// Live worker discovery (`[discovery]`): workers from a watched file and
/// from DNS names, reconciled into the same worker table the flags and the
/// admin API fill (`crate::discovery`). Off unless a file or a name is
/// given.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DiscoveryConfig {
    /// A TOML file of `[[workers]]` tables, re-read every
    /// `workers_file_interval_ms` (`--workers-file`).
    pub workers_file: Option<PathBuf>,
    /// Milliseconds between reads of the workers file [default: 1000].
    pub workers_file_interval_ms: u64,
    /// `NAME:PORT` names whose A/AAAA records are workers, each
    /// `http://IP:PORT` (`--workers-dns`, repeatable).
    pub workers_dns: Vec<String>,
    /// Milliseconds between resolutions of each name [default: 5000].
    pub workers_dns_interval_ms: u64,
    /// Nameservers (`IP:PORT`) to ask instead of the system's
    /// (`/etc/resolv.conf`) (`--dns-server`).
    pub dns_servers: Vec<std::net::SocketAddr>,
    /// Most workers one source may add; entries past it (by name order)
    /// are dropped and counted [default: 256].
    pub max_workers_per_source: usize,
}

impl Default for DiscoveryConfig {
    fn default() -> Self {
        Self {
            workers_file: None,
            workers_file_interval_ms: 1000,
            workers_dns: Vec::new(),
            workers_dns_interval_ms: 5000,
            dns_servers: Vec::new(),
            max_workers_per_source: 256,
        }
    }
}

/// The most workers one discovery source may be allowed to add.
pub const MAX_WORKERS_PER_SOURCE: usize = 4096;

impl DiscoveryConfig {
    /// Whether any source is configured.
    pub fn enabled(&self) -> bool {
        self.workers_file.is_some() || !self.workers_dns.is_empty()
    }

    /// Checks intervals, limits and `NAME:PORT`s; DNS-discovered workers
    /// publish no KV events the router knows of, so `cache` must not be
    /// `events` with a DNS source.
    pub fn validate(&self, cache: CacheMode) -> Result<(), ConfigError> {
        let invalid = |m: String| Err(ConfigError::Invalid(format!("discovery: {m}")));
        if self.workers_file_interval_ms < 10 || self.workers_dns_interval_ms < 10 {
            return invalid(
                "workers_file_interval_ms and workers_dns_interval_ms must be at least 10".into(),
            );
        }
        if !(1..=MAX_WORKERS_PER_SOURCE).contains(&self.max_workers_per_source) {
            return invalid(format!(
                "max_workers_per_source must be in 1..={MAX_WORKERS_PER_SOURCE}"
            ));
        }
        let mut seen = std::collections::HashSet::new();
        for target in &self.workers_dns {
            parse_dns_target(target)
                .map_err(|m| ConfigError::Invalid(format!("discovery: {m}")))?;
            if !seen.insert(target) {
                return invalid(format!("{target:?} is given twice"));
            }
        }
        if cache == CacheMode::Events && !self.workers_dns.is_empty() {
            return invalid(
                "workers found by DNS have no KV-event endpoints; use --cache auto or approximate"
                    .into(),
            );
        }
        Ok(())
    }
}

/// `NAME:PORT` as its name and port: a DNS name (letters, digits, `-`,
/// `_`, `.`; at most 253 bytes) and a port above 0.
pub fn parse_dns_target(text: &str) -> Result<(String, u16), String> {
    let (name, port) = text
        .rsplit_once(':')
        .ok_or_else(|| format!("{text:?}: expected NAME:PORT"))?;
    let port: u16 = port
        .parse()
        .ok()
        .filter(|&p| p > 0)
        .ok_or_else(|| format!("{text:?}: the port must be 1..=65535"))?;
    let valid = !name.is_empty()
        && name.len() <= 253
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'));
    if !valid {
        return Err(format!(
            "{text:?}: the name must be a DNS name (letters, digits, '-', '_', '.')"
        ));
    }
    Ok((name.to_owned(), port))
}

/// The secrets in `path`: one a line, trimmed, blank lines and lines
/// starting with `#` skipped; at least one.
/// A TOML error as one line: the line it is on and the fault, with every
/// double-quoted value in the fault shown as `"…"`. Not the `toml` crate's
/// own `Display`, which quotes the offending source line: a line such as
/// `admin_token = "…` (unterminated) would be printed whole; and serde's
/// faults quote a wrong-typed value (`invalid type: string "…"`), which
/// may be a secret given where a list belongs.
fn toml_error(text: &str, e: &toml::de::Error) -> String {
    let line = e
        .span()
        .map(|span| text[..span.start.min(text.len())].matches('\n').count() + 1);
    let fault: Vec<&str> = e
        .message()
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .collect();
    let fault = without_quoted_values(&fault.join("; "));
    match line {
        Some(line) => format!("line {line}: {fault}"),
        None => fault,
    }
}

/// `message` with the contents of each double-quoted part replaced by `…`
/// (a backslash escapes the next character; an unclosed quote hides the
/// rest). A quote character named in backticks (`` `"` ``) is kept.
fn without_quoted_values(message: &str) -> String {
    let mut out = String::with_capacity(message.len());
    let mut chars = message.chars().peekable();
    while let Some(c) = chars.next() {
        let named = out.ends_with('`') && chars.peek() == Some(&'`');
        out.push(c);
        if c != '"' || named {
            continue;
        }
        out.push('…');
        while let Some(inner) = chars.next() {
            match inner {
                '\\' => {
                    chars.next();
                }
                '"' => {
                    out.push('"');
                    break;
                }
                _ => {}
            }
        }
    }
    out
}

fn read_secrets(path: &std::path::Path) -> Result<Vec<String>, ConfigError> {
    let file_error = |reason: String| ConfigError::SecretFile {
        path: path.to_owned(),
        reason,
    };
    let text = std::fs::read_to_string(path).map_err(|e| file_error(e.to_string()))?;
    let secrets: Vec<String> = text
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .map(str::to_owned)
        .collect();
    if secrets.is_empty() {
        return Err(file_error(
            "holds no secret (blank lines and # comments are skipped)".into(),
        ));
    }
    for (line, secret) in secrets.iter().enumerate() {
        check_secret("a secret", secret).map_err(|_| {
            file_error(format!(
                "secret {} is not a usable bearer token (visible ASCII, no spaces)",
                line + 1
            ))
        })?;
    }
    Ok(secrets)
}

/// The one secret in `path` ([`read_secrets`]; more than one is an error).
fn read_one_secret(path: &std::path::Path) -> Result<String, ConfigError> {
    let mut secrets = read_secrets(path)?;
    match (secrets.pop(), secrets.len()) {
        (Some(secret), 0) => Ok(secret),
        (_, more) => Err(ConfigError::SecretFile {
            path: path.to_owned(),
            reason: format!("holds {} secrets; expected one", more + 1),
        }),
    }
}

/// A bearer token a client can send: non-empty visible ASCII, no spaces.
fn check_secret(name: &str, secret: &str) -> Result<(), ConfigError> {
    if secret.is_empty() || !secret.bytes().all(|b| b.is_ascii_graphic()) {
        return Err(ConfigError::Invalid(format!(
            "{name} must be non-empty visible ASCII with no spaces"
        )));
    }
    Ok(())
}

#[cfg(test)]
#[path = "config_tests.rs"]
mod tests;
