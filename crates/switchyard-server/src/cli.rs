//! `switchyard serve`'s flags ([`ServeArgs`]): each also read from
//! `SWITCHYARD_<NAME>`, over the `--config` file, into one validated
//! [`ServerConfig`].

use crate::{config, replica, ServerConfig, WorkerSpec};
use clap::Args;
use std::path::PathBuf;
use switchyard_core::engine_profile::EngineProfile;
use switchyard_core::select::PolicyKind;
use switchyard_replica::Secret;

/// Options of `switchyard serve`. Each flag also reads `SWITCHYARD_<NAME>`;
/// flags and variables override the `--config` file.
#[derive(Debug, Clone, Args)]
pub struct ServeArgs {
    /// TOML file with any of the settings below (`[[workers]]` tables).
    #[arg(long, env = "SWITCHYARD_CONFIG")]
    pub config: Option<PathBuf>,
    /// Address to listen on [default: 127.0.0.1].
    #[arg(long, env = "SWITCHYARD_HOST")]
    pub host: Option<String>,
    /// Port (0: any free port; the address is printed) [default: 8080].
    #[arg(long, env = "SWITCHYARD_PORT")]
    pub port: Option<u16>,
    /// Routing policy: ttft, kv, cache-aware, round-robin, random, least-loaded, power-of-two [default: ttft].
    #[arg(long, env = "SWITCHYARD_POLICY")]
    pub policy: Option<PolicyKind>,
    /// A worker: URL[,events=tcp://H:P][,replay=tcp://H:P][,block-size=N][,name=NAME][,role=prefill|decode|both][,bootstrap-port=N]; repeat.
    #[arg(long = "worker", env = "SWITCHYARD_WORKERS", value_delimiter = ';')]
    pub workers: Vec<String>,
    /// Tokens per KV block; must match the engines' [default: 16].
    #[arg(long, env = "SWITCHYARD_BLOCK_SIZE")]
    pub block_size: Option<u32>,
    /// Cache tracking: auto (events if every worker has events=), events, approximate.
    #[arg(long, env = "SWITCHYARD_CACHE", value_enum)]
    pub cache: Option<config::CacheMode>,
    /// Busy threshold (fraction of a worker's capacity); busy workers are skipped and requests queue.
    #[arg(long, env = "SWITCHYARD_BUSY_THRESHOLD")]
    pub busy_threshold: Option<f64>,
    /// Admission strategy: none or session-aware.
    #[arg(long, env = "SWITCHYARD_ADMISSION", value_enum)]
    pub admission: Option<config::AdmissionMode>,
    /// Omit the x-switchyard-worker response header (default: omitted
    /// while client keys are required, as it names internal workers).
    #[arg(
        long,
        env = "SWITCHYARD_NO_WORKER_HEADER",
        conflicts_with = "worker_header"
    )]
    pub no_worker_header: bool,
    /// Add the x-switchyard-worker response header even with client keys.
    #[arg(long, env = "SWITCHYARD_WORKER_HEADER")]
    pub worker_header: bool,
    /// Bearer token for /admin/* (without one the admin routes do not exist).
    #[arg(
        long,
        env = "SWITCHYARD_ADMIN_TOKEN",
        hide_env_values = true,
        conflicts_with = "admin_token_file"
    )]
    pub admin_token: Option<Secret>,
    /// File holding the admin token (first non-blank, non-# line).
    #[arg(long, env = "SWITCHYARD_ADMIN_TOKEN_FILE")]
    pub admin_token_file: Option<PathBuf>,
    /// Client API key for /v1/* (Authorization: Bearer); repeat for several.
    #[arg(
        long = "api-key",
        env = "SWITCHYARD_API_KEYS",
        hide_env_values = true,
        value_delimiter = ','
    )]
    pub api_keys: Vec<Secret>,
    /// File of client API keys, one a line (blank lines and # comments
    /// skipped); added to --api-key.
    #[arg(long, env = "SWITCHYARD_API_KEY_FILE")]
    pub api_key_file: Option<PathBuf>,
    /// Bearer token /metrics requires [default: none, /metrics is open].
    #[arg(
        long,
        env = "SWITCHYARD_METRICS_KEY",
        hide_env_values = true,
        conflicts_with = "metrics_key_file"
    )]
    pub metrics_key: Option<Secret>,
    /// File holding the metrics key.
    #[arg(long, env = "SWITCHYARD_METRICS_KEY_FILE")]
    pub metrics_key_file: Option<PathBuf>,
    /// Key the router sends to workers (Authorization: Bearer) on every
    /// request, health check and probe.
    #[arg(
        long,
        env = "SWITCHYARD_WORKER_API_KEY",
        hide_env_values = true,
        conflicts_with = "worker_api_key_file"
    )]
    pub worker_api_key: Option<Secret>,
    /// File holding the worker key.
    #[arg(long, env = "SWITCHYARD_WORKER_API_KEY_FILE")]
    pub worker_api_key_file: Option<PathBuf>,
    /// PEM roots an https:// worker's certificate must chain to [default: the system's].
    #[arg(long, env = "SWITCHYARD_WORKER_CA_FILE")]
    pub worker_ca_file: Option<PathBuf>,
    /// Client certificate chain (PEM) presented to https:// workers.
    #[arg(
        long,
        env = "SWITCHYARD_WORKER_CLIENT_CERT",
        requires = "worker_client_key"
    )]
    pub worker_client_cert: Option<PathBuf>,
    /// The worker client certificate's private key (PEM).
    #[arg(
        long,
        env = "SWITCHYARD_WORKER_CLIENT_KEY",
        requires = "worker_client_cert"
    )]
    pub worker_client_key: Option<PathBuf>,
    /// Serve HTTPS with this certificate chain (PEM), re-read when it changes.
    #[arg(long, env = "SWITCHYARD_TLS_CERT", requires = "tls_key")]
    pub tls_cert: Option<PathBuf>,
    /// The HTTPS certificate's private key (PEM).
    #[arg(long, env = "SWITCHYARD_TLS_KEY", requires = "tls_cert")]
    pub tls_key: Option<PathBuf>,
    /// Require client certificates signed by this CA (PEM); needs --tls-cert.
    #[arg(long, env = "SWITCHYARD_TLS_CLIENT_CA_FILE", requires = "tls_cert")]
    pub tls_client_ca_file: Option<PathBuf>,
    /// Largest request body in bytes [default: 33554432].
    #[arg(long, env = "SWITCHYARD_MAX_BODY_BYTES")]
    pub max_body_bytes: Option<usize>,
    /// Bytes of request bodies held at once, all requests together; a body
    /// that does not fit gets a 503 with Retry-After, never a wait; at
    /// least --max-body-bytes [default: 4 × --max-body-bytes].
    #[arg(long, env = "SWITCHYARD_MAX_BODY_BYTES_TOTAL")]
    pub max_body_bytes_total: Option<usize>,
    /// Client connections open at once; more are closed at accept [default: 10240].
    #[arg(long, env = "SWITCHYARD_MAX_CONNECTIONS")]
    pub max_connections: Option<usize>,
    /// Time for a request head to arrive, and for an idle keep-alive
    /// connection to send its next one, in ms [default: 10000].
    #[arg(long, env = "SWITCHYARD_HEADER_READ_TIMEOUT_MS")]
    pub header_read_timeout_ms: Option<u64>,
    /// Time for a request body to arrive after its head, in ms; a slower
    /// upload gets a 408 [default: 30000].
    #[arg(long, env = "SWITCHYARD_BODY_READ_TIMEOUT_MS")]
    pub body_read_timeout_ms: Option<u64>,
    /// Time a connection's answer may make no progress (its client reads
    /// nothing) before the connection is closed, in ms; never more than
    /// the request timeout [default: 30000].
    #[arg(long, env = "SWITCHYARD_SEND_TIMEOUT_MS")]
    pub send_timeout_ms: Option<u64>,
    /// Most tokens in one prompt; past it, 400 [default: the largest
    /// max_model_len the workers report on /v1/models, else 131072].
    #[arg(long, env = "SWITCHYARD_MAX_PROMPT_TOKENS")]
    pub max_prompt_tokens: Option<usize>,
    /// Most messages in one chat request; past it, 400 [default: 4096].
    #[arg(long, env = "SWITCHYARD_MAX_MESSAGES")]
    pub max_messages: Option<usize>,
    /// Most content parts in all of a chat's messages; past it, 400 [default: 16384].
    #[arg(long, env = "SWITCHYARD_MAX_CONTENT_PARTS")]
    pub max_content_parts: Option<usize>,
    /// Largest `n` a request may ask for; past it, 400 [default: 16].
    #[arg(long, env = "SWITCHYARD_MAX_N")]
    pub max_n: Option<u32>,
    /// Largest max_tokens / max_completion_tokens; past it, 400 [default: the prompt token limit].
    #[arg(long, env = "SWITCHYARD_MAX_OUTPUT_TOKENS")]
    pub max_output_tokens: Option<u32>,
    /// Milliseconds between worker health checks [default: 1000].
    #[arg(long, env = "SWITCHYARD_HEALTH_INTERVAL_MS")]
    pub health_interval_ms: Option<u64>,
    /// Consecutive failed checks that take a worker out [default: 2].
    #[arg(long, env = "SWITCHYARD_HEALTH_FAILURES")]
    pub health_failures: Option<u32>,
    /// Expected milliseconds to load a LoRA adapter on a worker: what the
    /// ttft policy charges a worker without a request's adapter (adapters:
    /// `[[adapters]]` tables in --config) [default: 500].
    #[arg(long, env = "SWITCHYARD_ADAPTER_LOAD_MS")]
    pub adapter_load_ms: Option<f64>,
    /// Download a `[[models]]` table's `hub_id` tokenizer from the Hugging
    /// Face hub when the hub cache lacks it (off: the cache only).
    #[arg(long, env = "SWITCHYARD_ALLOW_HUB_DOWNLOAD")]
    pub allow_hub_download: bool,
    /// The Hugging Face hub cache [default: HF_HUB_CACHE, else HF_HOME/hub,
    /// else ~/.cache/huggingface/hub].
    #[arg(long, env = "SWITCHYARD_HUB_CACHE_DIR")]
    pub hub_cache_dir: Option<PathBuf>,
    /// Consecutive request failures that open a worker's circuit [default: 3].
    #[arg(long, env = "SWITCHYARD_CIRCUIT_FAILURES")]
    pub circuit_failures: Option<u32>,
    /// First cooldown of an open circuit, in ms; doubles per failed probe [default: 5000].
    #[arg(long, env = "SWITCHYARD_CIRCUIT_COOLDOWN_MS")]
    pub circuit_cooldown_ms: Option<u64>,
    /// Longest cooldown of an open circuit, in ms [default: 60000].
    #[arg(long, env = "SWITCHYARD_CIRCUIT_MAX_COOLDOWN_MS")]
    pub circuit_max_cooldown_ms: Option<u64>,
    /// OpenAI requests in the router at once (queued, waiting or streaming);
    /// beyond it, 503 with Retry-After [default: 8192].
    #[arg(long, env = "SWITCHYARD_MAX_INFLIGHT")]
    pub max_inflight: Option<usize>,
    /// On SIGTERM/Ctrl-C, how long in-flight requests may finish before
    /// they are cancelled, in ms [default: 30000].
    #[arg(
        long,
        visible_alias = "shutdown-timeout",
        env = "SWITCHYARD_SHUTDOWN_TIMEOUT_MS"
    )]
    pub shutdown_timeout_ms: Option<u64>,
    /// Log JSON lines.
    #[arg(long, env = "SWITCHYARD_LOG_JSON")]
    pub log_json: bool,
    /// Migrations per request after a worker fails it (0: off) [default: 3].
    #[arg(long, env = "SWITCHYARD_MIGRATION_LIMIT")]
    pub migration_limit: Option<u32>,
    /// Prompt plus generated tokens above which a broken stream is not resumed [default: 32768].
    #[arg(long, env = "SWITCHYARD_MIGRATION_MAX_SEQ_LEN")]
    pub migration_max_seq_len: Option<u64>,
    /// Workers a request may fail on (refused connections aside) before it
    /// ends instead of going to another [default: 2].
    #[arg(long, env = "SWITCHYARD_MAX_ATTEMPT_WORKERS")]
    pub max_attempt_workers: Option<u32>,
    /// Seconds to wait for a worker's first byte (and, mid-stream, its next event) [default: 60].
    #[arg(long, env = "SWITCHYARD_FIRST_TOKEN_TIMEOUT")]
    pub first_token_timeout: Option<f64>,
    /// Seconds a request may take in all; then it is cancelled with a 504 [default: 600].
    #[arg(long, env = "SWITCHYARD_REQUEST_TIMEOUT")]
    pub request_timeout: Option<f64>,
    /// Largest non-streaming response the router buffers, in bytes [default: 16777216].
    #[arg(long, env = "SWITCHYARD_MAX_RESPONSE_BYTES")]
    pub max_response_bytes: Option<usize>,
    /// Most stored responses (`/v1/responses`) whose worker the router remembers; the oldest is forgotten first [default: 100000].
    #[arg(long, env = "SWITCHYARD_MAX_STORED_RESPONSES")]
    pub max_stored_responses: Option<usize>,
    /// Most stored responses the router remembers for one client key; a key at it forgets its own oldest, never another's [default: 10000].
    #[arg(long, env = "SWITCHYARD_MAX_STORED_RESPONSES_PER_KEY")]
    pub max_stored_responses_per_key: Option<usize>,
    /// Seconds the router remembers which worker stores a response [default: 86400].
    #[arg(long, env = "SWITCHYARD_STORED_RESPONSE_TTL_SECS")]
    pub stored_response_ttl_secs: Option<u64>,
    /// Tokenizer directory: a Hugging Face model's tokenizer.json and
    /// tokenizer_config.json (or qwen3-tokenizer.json and
    /// qwen3-tokenizer_config.json) [default: the bundled Qwen3 tokenizer].
    #[arg(long, env = "SWITCHYARD_TOKENIZER_DIR")]
    pub tokenizer_dir: Option<PathBuf>,
    /// Token ids kept for text already tokenized (a chat's earlier
    /// messages), some 4 bytes each plus 64 per entry; 0: off [default: 4194304].
    #[arg(long, env = "SWITCHYARD_TOKEN_CACHE_IDS")]
    pub token_cache_ids: Option<u64>,
    /// Long prompts (over 8 KiB) tokenized at once; more wait their turn
    /// by priority band, then tenant fair share (1 to 512) [default: one
    /// per core].
    #[arg(long, env = "SWITCHYARD_TOKENIZE_SLOTS")]
    pub tokenize_slots: Option<usize>,
    /// The workers' engine profile (TOML, as `switchyard calibrate` writes
    /// it): the prefill and decode curves the router estimates with,
    /// measured on the engine (--prefill-curve, if given, wins for the
    /// prefill curve).
    #[arg(long, value_name = "FILE", env = "SWITCHYARD_ENGINE_PROFILE", value_parser = read_engine_profile)]
    pub engine_profile: Option<EngineProfile>,
    /// The workers' prefill time in ms for T uncached tokens, `A,B,C` in
    /// A·T²+B·T+C per chunk [default: the simulated engine's fit].
    #[arg(long, env = "SWITCHYARD_PREFILL_CURVE", value_parser = parse_curve)]
    pub prefill_curve: Option<[f64; 3]>,
    /// The workers' speed-up over that curve (a sim-worker's --speedup) [default: 1].
    #[arg(long, env = "SWITCHYARD_PREFILL_SPEEDUP")]
    pub prefill_speedup: Option<f64>,
    /// Uncached tokens the workers prefill per step (their max_num_batched_tokens) [default: 8192].
    #[arg(long, env = "SWITCHYARD_PREFILL_CHUNK_TOKENS")]
    pub prefill_chunk_tokens: Option<u32>,
    /// Model ms to restore one token of KV from a worker's host (CPU) tier:
    /// KV bytes per token over the host-to-device bandwidth, divided by the
    /// speed-up like the curve [default: 0.002048, 128 KiB over 64 GB/s].
    #[arg(long, env = "SWITCHYARD_RESTORE_MS_PER_TOKEN")]
    pub restore_ms_per_token: Option<f64>,
    /// Keep the configured prefill model; do not fit it per worker from observed times to first token.
    #[arg(long, env = "SWITCHYARD_NO_PREFILL_FIT")]
    pub no_prefill_fit: bool,
    /// Prefill/decode disaggregation: the engines' protocol, vllm or
    /// sglang; workers then take role=prefill|decode|both [default: off].
    #[arg(long, env = "SWITCHYARD_DISAGG", value_enum)]
    pub disagg: Option<config::DisaggMode>,
    /// Replica sync (off unless --replica-sync is given).
    #[command(flatten)]
    pub replica: replica::ReplicaArgs,
    /// TOML file of [[workers]] tables, watched: workers added, changed or
    /// removed there are added or drained without a restart.
    #[arg(long, env = "SWITCHYARD_WORKERS_FILE")]
    pub workers_file: Option<PathBuf>,
    /// Milliseconds between reads of --workers-file [default: 1000].
    #[arg(long, env = "SWITCHYARD_WORKERS_FILE_INTERVAL_MS")]
    pub workers_file_interval_ms: Option<u64>,
    /// NAME:PORT whose A/AAAA records are workers (http://IP:PORT), re-resolved
    /// on an interval (a Kubernetes headless Service); repeat for several.
    #[arg(
        long = "workers-dns",
        env = "SWITCHYARD_WORKERS_DNS",
        value_delimiter = ','
    )]
    pub workers_dns: Vec<String>,
    /// Milliseconds between resolutions of each --workers-dns name [default: 5000].
    #[arg(long, env = "SWITCHYARD_WORKERS_DNS_INTERVAL_MS")]
    pub workers_dns_interval_ms: Option<u64>,
    /// Nameserver IP:PORT for --workers-dns; repeat for several [default:
    /// the system's, from /etc/resolv.conf].
    #[arg(
        long = "dns-server",
        env = "SWITCHYARD_DNS_SERVERS",
        value_delimiter = ','
    )]
    pub dns_servers: Vec<std::net::SocketAddr>,
    /// Most workers one discovery source may add; the rest are dropped and
    /// counted [default: 256].
    #[arg(long, env = "SWITCHYARD_DISCOVERY_MAX_WORKERS")]
    pub discovery_max_workers: Option<usize>,
}

impl ServeArgs {
    /// The file (if any), overridden by flags and environment, validated.
    pub fn to_config(&self) -> anyhow::Result<ServerConfig> {
        let mut c = match &self.config {
            Some(path) => ServerConfig::from_toml_file(path)?,
            None => ServerConfig::default(),
        };
        macro_rules! set {
            ($($field:ident),*) => { $( if let Some(v) = self.$field.clone() { c.$field = v; } )* };
        }
        set!(
            host,
            port,
            policy,
            block_size,
            cache,
            admission,
            max_body_bytes,
            max_messages,
            max_content_parts,
            max_n,
            health_interval_ms,
            health_failures,
            adapter_load_ms,
            migration_limit,
            migration_max_seq_len,
            max_attempt_workers,
            max_response_bytes,
            max_stored_responses,
            max_stored_responses_per_key,
            stored_response_ttl_secs,
            max_inflight,
            max_connections,
            header_read_timeout_ms,
            body_read_timeout_ms,
            send_timeout_ms,
            token_cache_ids
        );
        if self.max_prompt_tokens.is_some() {
            c.max_prompt_tokens = self.max_prompt_tokens;
        }
        if self.tokenize_slots.is_some() {
            c.tokenize_slots = self.tokenize_slots;
        }
        if self.max_body_bytes_total.is_some() {
            c.max_body_bytes_total = self.max_body_bytes_total;
        }
        if self.max_output_tokens.is_some() {
            c.max_output_tokens = self.max_output_tokens;
        }
        if let Some(secs) = self.first_token_timeout {
            c.first_token_timeout_secs = secs;
        }
        if let Some(secs) = self.request_timeout {
            c.request_timeout_secs = secs;
        }
        if let Some(ms) = self.shutdown_timeout_ms {
            c.shutdown_grace_ms = ms;
        }
        if let Some(n) = self.circuit_failures {
            c.circuit.failure_threshold = n;
        }
        if let Some(ms) = self.circuit_cooldown_ms {
            c.circuit.cooldown_ms = ms;
            c.circuit.max_cooldown_ms = c.circuit.max_cooldown_ms.max(ms);
        }
        if let Some(ms) = self.circuit_max_cooldown_ms {
            c.circuit.max_cooldown_ms = ms;
        }
        if self.busy_threshold.is_some() {
            c.busy_threshold = self.busy_threshold;
        }
        if let Some(profile) = &self.engine_profile {
            c.estimator.prefill_curve = profile.prefill;
            c.estimator.decode_curve = profile.decode;
            c.estimator.decode_floor_ms = profile.decode_floor_ms;
            c.estimator.decode_per_sequence_ms = profile.decode_per_sequence_ms;
        }
        if let Some(curve) = self.prefill_curve {
            c.estimator.prefill_curve = curve;
        }
        if let Some(speedup) = self.prefill_speedup {
            c.estimator.speedup = speedup;
        }
        if let Some(tokens) = self.prefill_chunk_tokens {
            c.estimator.chunk_tokens = tokens;
        }
        if let Some(ms) = self.restore_ms_per_token {
            c.estimator.restore_ms_per_token = ms;
        }
        if self.disagg.is_some() {
            c.disagg = self.disagg;
        }
        if self.no_prefill_fit {
            c.estimator.online = false;
        }
        // A secret given by flag or environment replaces the file's,
        // whichever form each uses.
        for (flag, flag_file, slot, slot_file) in [
            (
                &self.admin_token,
                &self.admin_token_file,
                &mut c.admin_token,
                &mut c.admin_token_file,
            ),
            (
                &self.metrics_key,
                &self.metrics_key_file,
                &mut c.metrics_key,
                &mut c.metrics_key_file,
            ),
            (
                &self.worker_api_key,
                &self.worker_api_key_file,
                &mut c.worker_api_key,
                &mut c.worker_api_key_file,
            ),
        ] {
            if flag.is_some() || flag_file.is_some() {
                *slot = flag.clone();
                *slot_file = flag_file.clone();
            }
        }
        if self.api_key_file.is_some() {
            c.api_key_file = self.api_key_file.clone();
        }
        if self.tokenizer_dir.is_some() {
            c.tokenizer_dir = self.tokenizer_dir.clone();
        }
        if self.allow_hub_download {
            c.allow_hub_download = true;
        }
        if self.hub_cache_dir.is_some() {
            c.hub_cache_dir = self.hub_cache_dir.clone();
        }
        if !self.api_keys.is_empty() {
            c.api_keys = self.api_keys.clone();
        }
        for (flag, slot) in [
            (&self.worker_ca_file, &mut c.worker_ca_file),
            (&self.worker_client_cert, &mut c.worker_client_cert),
            (&self.worker_client_key, &mut c.worker_client_key),
            (&self.tls_cert, &mut c.tls_cert),
            (&self.tls_key, &mut c.tls_key),
            (&self.tls_client_ca_file, &mut c.tls_client_ca_file),
        ] {
            if flag.is_some() {
                slot.clone_from(flag);
            }
        }
        if self.no_worker_header {
            c.worker_header = Some(false);
        }
        if self.worker_header {
            c.worker_header = Some(true);
        }
        if self.log_json {
            c.log_json = true;
        }
        for w in &self.workers {
            c.workers.push(WorkerSpec::parse(w)?);
        }
        self.replica.apply(&mut c.replica);
        let discovery = &mut c.discovery;
        if self.workers_file.is_some() {
            discovery.workers_file = self.workers_file.clone();
        }
        if let Some(ms) = self.workers_file_interval_ms {
            discovery.workers_file_interval_ms = ms;
        }
        if !self.workers_dns.is_empty() {
            discovery.workers_dns = self.workers_dns.clone();
        }
        if let Some(ms) = self.workers_dns_interval_ms {
            discovery.workers_dns_interval_ms = ms;
        }
        if !self.dns_servers.is_empty() {
            discovery.dns_servers = self.dns_servers.clone();
        }
        if let Some(n) = self.discovery_max_workers {
            discovery.max_workers_per_source = n;
        }
        c.validate()?;
        c.load_secret_files()?;
        Ok(c)
    }
}

/// `A,B,C` as three finite numbers.
/// `--engine-profile`: the profile in the file at `path`, checked.
fn read_engine_profile(path: &str) -> Result<EngineProfile, String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("reading {path}: {e}"))?;
    EngineProfile::from_toml(&text).map_err(|e| format!("{path}: {e}"))
}

fn parse_curve(text: &str) -> Result<[f64; 3], String> {
    let parts: Vec<f64> = text
        .split(',')
        .map(|p| p.trim().parse::<f64>())
        .collect::<Result<_, _>>()
        .map_err(|e| format!("{text:?}: {e}"))?;
    match parts.as_slice() {
        [a, b, c] if parts.iter().all(|x| x.is_finite()) => Ok([*a, *b, *c]),
        _ => Err(format!("{text:?}: expected three finite numbers A,B,C")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::start::{dispatcher_config, metrics_open_while_keyed, open_beyond_loopback};
    use crate::{front, metrics};
    use clap::Parser as _;
    use std::net::SocketAddr;
    use std::sync::Arc;

    #[derive(clap::Parser)]
    struct Cli {
        #[command(flatten)]
        serve: ServeArgs,
    }

    fn config(args: &[&str]) -> anyhow::Result<ServerConfig> {
        let cli = Cli::try_parse_from(std::iter::once("serve").chain(args.iter().copied()))?;
        cli.serve.to_config()
    }

    fn scratch(name: &str, text: &str) -> String {
        let dir =
            std::env::temp_dir().join(format!("switchyard-serve-args-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join(name);
        std::fs::write(&path, text).unwrap();
        path.to_string_lossy().into_owned()
    }

    #[test]
    fn an_engine_profile_sets_the_estimators_curves_and_the_curve_flag_wins() {
        let profile = scratch(
            "engine.toml",
            "prefill = [2e-6, 0.03, 40.0]\ndecode = [-5.0, 20.0, 9.0]\ndecode_floor_ms = 2.0\n",
        );
        let c = config(&[
            "--engine-profile",
            &profile,
            "--worker",
            "http://127.0.0.1:1",
        ])
        .unwrap();
        assert_eq!(c.estimator.prefill_curve, [2e-6, 0.03, 40.0]);
        assert_eq!(c.estimator.decode_curve, [-5.0, 20.0, 9.0]);
        assert_eq!(c.estimator.decode_floor_ms, 2.0);
        let c = config(&[
            "--engine-profile",
            &profile,
            "--prefill-curve",
            "0,1,2",
            "--worker",
            "http://127.0.0.1:1",
        ])
        .unwrap();
        assert_eq!(c.estimator.prefill_curve, [0.0, 1.0, 2.0]);
        assert_eq!(c.estimator.decode_curve, [-5.0, 20.0, 9.0]);
        let bad = scratch("bad-engine.toml", "prefill = \"fast\"\n");
        let err = config(&["--engine-profile", &bad]).unwrap_err().to_string();
        assert!(err.contains("not an engine profile"), "{err}");
    }

    #[test]
    fn secret_flags_and_files_fill_the_config_and_a_flag_replaces_the_files_form() {
        let keys = scratch("keys", "# clients\nsk-1\nsk-2\n");
        let token = scratch("token", "adm-file\n");
        let toml = scratch(
            "serve.toml",
            "admin_token = \"adm-toml\"\nworker_api_key = \"wk-toml\"\n",
        );
        let c = config(&[
            "--config",
            &toml,
            "--api-key",
            "sk-0",
            "--api-key-file",
            &keys,
            "--admin-token-file",
            &token,
            "--max-connections",
            "7",
            "--header-read-timeout-ms",
            "100",
            "--body-read-timeout-ms",
            "200",
            "--send-timeout-ms",
            "300",
        ])
        .unwrap();
        let keys: Vec<&str> = c.api_keys.iter().map(Secret::expose).collect();
        assert_eq!(keys, ["sk-0", "sk-1", "sk-2"]);
        assert_eq!(c.admin_token, Some("adm-file".into()));
        assert_eq!(c.worker_api_key, Some("wk-toml".into()));
        assert_eq!(c.metrics_key, None);
        assert_eq!(
            (
                c.max_connections,
                c.header_read_timeout_ms,
                c.body_read_timeout_ms,
                c.send_timeout_ms
            ),
            (7, 100, 200, 300)
        );
        assert!(
            config(&["--admin-token", "a", "--admin-token-file", &token]).is_err(),
            "one form per secret on the command line"
        );
        let err = config(&["--api-key-file", "/nonexistent/keys"]).unwrap_err();
        assert!(err.to_string().contains("/nonexistent/keys"), "{err}");
    }

    #[test]
    fn debug_of_the_flags_and_the_config_never_shows_a_secret() {
        let args = [
            "--admin-token",
            "adm-secret-1",
            "--api-key",
            "sk-secret-2",
            "--metrics-key",
            "mk-secret-3",
            "--worker-api-key",
            "wk-secret-4",
            "--nats-user",
            "u",
            "--nats-password",
            "pw-secret-5",
        ];
        let cli = Cli::try_parse_from(std::iter::once("serve").chain(args)).unwrap();
        let mut config = cli.serve.to_config().unwrap();
        config.rate_limits = crate::front::ratelimit::RateLimitConfig {
            keys: vec![crate::front::ratelimit::NamedKey {
                name: "team".into(),
                key: Some("nk-secret-6".into()),
                key_file: None,
                requests_per_second: None,
                burst: None,
                tokens_per_minute: None,
            }],
            ..Default::default()
        };
        let metrics = Arc::new(metrics::ServerMetrics::new(config.policy.name()));
        let credentials = front::auth::Credentials::new(&config, metrics);
        for shown in [
            format!("{:?}", cli.serve),
            format!("{config:?}"),
            format!("{credentials:?}"),
        ] {
            for secret in args.iter().chain(&["nk-secret-6"]) {
                if secret.contains("secret") {
                    assert!(!shown.contains(secret), "{secret} in {shown}");
                }
            }
        }
        assert!(format!("{config:?}").contains("<redacted>"));
    }

    #[test]
    fn listening_beyond_loopback_without_a_key_is_flagged() {
        let open = ServerConfig::default();
        let keyed = ServerConfig {
            api_keys: vec!["sk".into()],
            ..ServerConfig::default()
        };
        for (addr, beyond) in [
            ("0.0.0.0:8080", true),
            ("10.1.2.3:8080", true),
            ("[::]:8080", true),
            ("127.0.0.1:8080", false),
            ("[::1]:8080", false),
        ] {
            let addr: SocketAddr = addr.parse().unwrap();
            assert_eq!(open_beyond_loopback(addr, &open), beyond, "{addr}");
            assert!(!open_beyond_loopback(addr, &keyed), "{addr} with a key");
        }
    }

    #[test]
    fn open_metrics_beside_client_keys_is_flagged() {
        let keyed = ServerConfig {
            api_keys: vec!["sk".into()],
            ..ServerConfig::default()
        };
        assert!(metrics_open_while_keyed(&keyed));
        let both = ServerConfig {
            metrics_key: Some("mk".into()),
            ..keyed
        };
        assert!(!metrics_open_while_keyed(&both));
        // Without client keys everything is open alike: nothing to flag.
        assert!(!metrics_open_while_keyed(&ServerConfig::default()));
        let named = ServerConfig::from_toml("[[rate_limits.keys]]\nname = \"a\"\nkey = \"sk-a\"\n")
            .unwrap();
        assert!(metrics_open_while_keyed(&named));
    }

    #[test]
    fn the_body_budget_flag_sets_it_and_is_checked_against_the_body_limit() {
        let c = config(&["--max-body-bytes", "1000", "--max-body-bytes-total", "5000"]).unwrap();
        assert_eq!(c.body_bytes_total(), 5000);
        let err = config(&["--max-body-bytes", "1000", "--max-body-bytes-total", "10"])
            .unwrap_err()
            .to_string();
        assert!(err.contains("max_body_bytes_total"), "{err}");
    }

    #[test]
    fn the_front_door_defaults_are_the_documented_ones() {
        let c = config(&[]).unwrap();
        assert_eq!(c.max_connections, 10_240);
        assert_eq!(c.body_bytes_total(), 128 * 1024 * 1024);
        assert_eq!(c.header_read_timeout_ms, 10_000);
        assert_eq!(c.body_read_timeout_ms, 30_000);
        assert_eq!(c.send_timeout_ms, 30_000);
        assert!(c.api_keys.is_empty() && c.admin_token.is_none() && c.metrics_key.is_none());
    }

    #[test]
    fn adapters_come_from_the_config_file_and_their_load_time_from_a_flag_too() {
        let file = scratch(
            "adapters.toml",
            "adapter_load_ms = 250\n[[adapters]]\nname = \"sql\"\npath = \"/a/sql\"\nbase_model = \"base\"\n",
        );
        let c = config(&["--config", &file]).unwrap();
        assert_eq!(c.adapters.len(), 1);
        assert_eq!(c.adapters[0].base_model.as_deref(), Some("base"));
        assert_eq!(c.adapter_load_ms, 250.0);
        let c = config(&["--config", &file, "--adapter-load-ms", "40"]).unwrap();
        assert_eq!(c.adapter_load_ms, 40.0);
        assert_eq!(dispatcher_config(&c).router.adapters.load_ms, 40.0);
        let twice = scratch(
            "adapters-twice.toml",
            "[[adapters]]\nname = \"a\"\npath = \"/a\"\n[[adapters]]\nname = \"a\"\npath = \"/b\"\n",
        );
        assert!(config(&["--config", &twice]).is_err());
        let negative = config(&["--adapter-load-ms=-1"]).unwrap_err().to_string();
        assert!(negative.contains("adapter_load_ms"), "{negative}");
    }

    #[test]
    fn discovery_flags_fill_the_discovery_settings() {
        let c = config(&[
            "--workers-file",
            "/etc/switchyard/workers.toml",
            "--workers-file-interval-ms",
            "250",
            "--workers-dns",
            "a.svc:8000",
            "--workers-dns",
            "b.svc:9000",
            "--dns-server",
            "127.0.0.1:5353",
            "--discovery-max-workers",
            "8",
        ])
        .unwrap();
        let d = &c.discovery;
        assert_eq!(
            d.workers_file.as_deref(),
            Some(std::path::Path::new("/etc/switchyard/workers.toml"))
        );
        assert_eq!(d.workers_file_interval_ms, 250);
        assert_eq!(d.workers_dns, ["a.svc:8000", "b.svc:9000"]);
        assert_eq!(d.workers_dns_interval_ms, 5000, "the default");
        assert_eq!(
            d.dns_servers,
            ["127.0.0.1:5353".parse::<SocketAddr>().unwrap()]
        );
        assert_eq!(d.max_workers_per_source, 8);
        assert!(config(&["--workers-dns", "no-port"]).is_err());
        assert!(config(&[]).is_ok_and(|c| !c.discovery.enabled()));
    }
}
