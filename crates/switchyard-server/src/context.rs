//! What every handler reads: the router's settings and shared parts as one
//! [`AppState`], built once at startup.

use crate::migration::MigrationPolicy;
use crate::shared::SharedRouter;
use crate::tokenize::PromptTokenizer;
use crate::workers::{Fleet, UpstreamClient};
use axum::http::HeaderValue;
use prometheus_client::registry::Registry;
use std::sync::Arc;
use std::time::Duration;

/// Largest single SSE event the router accepts from a worker.
pub const MAX_EVENT_BYTES: usize = 256 * 1024;

/// Header naming the worker that served a response.
pub const WORKER_HEADER: &str = "x-switchyard-worker";

/// Everything a handler reads.
pub struct AppState {
    /// Routing state.
    pub shared: Arc<SharedRouter>,
    /// Workers.
    pub fleet: Arc<Fleet>,
    /// Upstream client.
    pub client: UpstreamClient,
    /// Tokenizer for routing.
    pub tokenizer: Arc<dyn PromptTokenizer>,
    /// What `/metrics` encodes: the router's families and the routing
    /// state ([`SharedRouter::register_metrics`]) and the KV-event plane's.
    pub registry: Registry,
    /// Router block size.
    pub block_size: u32,
    /// Seed of block hashes (no LoRA, no salt).
    pub hash_seed: u64,
    /// Add `x-switchyard-worker`.
    pub worker_header: bool,
    /// Client keys (empty: none required).
    pub api_keys: Vec<String>,
    /// Admin token (none: admin API off).
    pub admin_token: Option<String>,
    /// Body limit.
    pub max_body_bytes: usize,
    /// Limits on what a body holds ([`crate::limits`]).
    pub limits: crate::limits::InputLimits,
    /// Migration limits.
    pub migration: MigrationPolicy,
    /// Wait for a worker's headers and first event (and each next event).
    pub first_token_timeout: Duration,
    /// A request's total time.
    pub request_timeout: Duration,
    /// Largest buffered (non-streaming) response.
    pub max_response_bytes: usize,
    /// This replica's id for upstream requests, while replica sync is on.
    pub router_id: Option<HeaderValue>,
}

impl AppState {
    /// The state of a router configured by `config` (already validated);
    /// `router_id` is this replica's id while replica sync is on.
    pub fn new(
        config: &crate::config::ServerConfig,
        shared: Arc<SharedRouter>,
        fleet: Arc<Fleet>,
        client: UpstreamClient,
        tokenizer: Arc<dyn PromptTokenizer>,
        router_id: Option<HeaderValue>,
    ) -> Self {
        let mut registry = Registry::default();
        shared.register_metrics(&mut registry);
        fleet.kv_metrics.register(&mut registry);
        Self {
            shared,
            fleet,
            client,
            tokenizer,
            registry,
            block_size: config.block_size,
            hash_seed: switchyard_core::hashing::seed_for(None, None),
            worker_header: config.worker_header,
            api_keys: config.api_keys.clone(),
            admin_token: config.admin_token.clone(),
            max_body_bytes: config.max_body_bytes,
            limits: crate::limits::InputLimits::new(config),
            migration: MigrationPolicy {
                limit: config.migration_limit,
                max_seq_len: config.migration_max_seq_len,
            },
            first_token_timeout: Duration::from_secs_f64(config.first_token_timeout_secs),
            request_timeout: Duration::from_secs_f64(config.request_timeout_secs),
            max_response_bytes: config.max_response_bytes,
            router_id,
        }
    }
}

pub(crate) type Shared = Arc<AppState>;
