//! What every handler reads: the router's settings and shared parts as one
//! [`AppState`], built once at startup (the front door, the routes and
//! the request path read it; it depends on none of them).

use crate::driver::Driver;
use crate::fleet::Fleet;
use crate::front::auth::Credentials;
use crate::models::Models;
use crate::tokenize::PromptTokenizer;
pub use crate::upstream::Upstream;
use crate::upstream::UpstreamClient;
use axum::http::HeaderValue;
use prometheus_client::registry::Registry;
use std::sync::Arc;
use std::time::Duration;
use switchyard_core::dispatch::failure::MigrationPolicy;

/// Everything a handler reads, grouped by what it is for: the routing
/// state and the workers, how a request goes to them ([`Upstream`]), what
/// a request is checked against on its way in ([`Intake`]), how its
/// prompt becomes routing input ([`Prompts`]), and what the APIs beyond
/// chat keep ([`Apis`]).
pub struct AppState {
    /// Routing state.
    pub driver: Arc<Driver>,
    /// Workers.
    pub fleet: Arc<Fleet>,
    /// How requests go to workers, and their limits there.
    pub upstream: Upstream,
    /// What a request is checked against before it is placed.
    pub intake: Intake,
    /// How a prompt becomes routing input.
    pub prompts: Prompts,
    /// What the Responses, Messages and disaggregated paths keep.
    pub apis: Apis,
    /// What `/metrics` encodes: the router's families and the routing
    /// state ([`Driver::register_metrics`]) and the KV-event plane's.
    pub registry: Registry,
}

/// What a request is checked against on its way in: its credential, its
/// body's size and deadline, the limits on what the body holds, and its
/// flow (tenant and band).
pub struct Intake {
    /// The credentials checked from request heads.
    pub credentials: Arc<Credentials>,
    /// Whether the admin routes exist (an admin token is configured).
    pub admin_api: bool,
    /// Body limit.
    pub max_body_bytes: usize,
    /// The bytes of bodies held at once, every request's together
    /// (`--max-body-bytes-total`; [`crate::front::upload`]).
    pub(crate) body_budget: Arc<crate::front::upload::BodyBudget>,
    /// Time from a request's head to its body's last byte.
    pub body_read_timeout: Duration,
    /// Limits on what a body holds ([`crate::request::limits`]).
    pub limits: InputLimits,
    /// Tenants and bands ([`crate::request::flow`]).
    pub flows: Arc<switchyard_core::admission::FlowPolicy>,
    /// Waits per tenant and band.
    pub flow_metrics: Arc<crate::metrics::FlowMetrics>,
    /// With keys off, the header naming a request's tenant.
    pub tenant_header: Option<axum::http::HeaderName>,
}

/// How a prompt becomes routing input.
pub struct Prompts {
    /// Each model's tokenizer, block size and policy (`[[models]]`; the
    /// router's own for every other model).
    pub models: Arc<Models>,
    /// Seed of block hashes (no LoRA, no salt).
    pub hash_seed: u64,
    /// Slots for tokenizing long prompts, by band and fair share.
    pub tokenize_gate: Arc<crate::tokenize_gate::TokenizeGate>,
}

/// What the APIs beyond chat keep.
pub struct Apis {
    /// The disaggregated fleet's protocol (`--disagg`), when on.
    pub disagg: Option<crate::config::DisaggMode>,
    /// Counts of disaggregated requests' halves.
    pub(crate) disagg_metrics: Arc<crate::metrics::DisaggMetrics>,
    /// Which worker stores which response, for whom (the Responses API's
    /// `previous_response_id`, `GET` and `cancel`).
    pub(crate) stored_responses: Arc<crate::response_map::ResponseMap>,
    /// The Responses and Messages APIs' requests by how they ended.
    pub(crate) api_metrics: Arc<crate::metrics::ApiMetrics>,
}

impl AppState {
    /// The state of a router configured by `config` (already validated);
    /// `router_id` is this replica's id while replica sync is on.
    pub fn new(
        config: &crate::config::ServerConfig,
        driver: Arc<Driver>,
        fleet: Arc<Fleet>,
        client: UpstreamClient,
        tokenizer: Arc<dyn PromptTokenizer>,
        router_id: Option<HeaderValue>,
    ) -> Self {
        let mut registry = Registry::default();
        driver.register_metrics(&mut registry);
        fleet.kv_metrics.register(&mut registry);
        driver.adapters.register(&mut registry);
        let credentials = Arc::new(Credentials::new(config, driver.metrics().clone()));
        credentials.rate_limits().register(&mut registry);
        let disagg_metrics = Arc::new(crate::metrics::DisaggMetrics::new());
        disagg_metrics.register(&mut registry);
        // `ServerConfig::validate` refused an invalid `[flow]`.
        let flows = Arc::new(
            switchyard_core::admission::FlowPolicy::new(config.flow.clone()).unwrap_or_default(),
        );
        let flow_metrics = Arc::new(crate::metrics::FlowMetrics::new(&flows));
        flow_metrics.register(&mut registry);
        let api_metrics = Arc::new(crate::metrics::ApiMetrics::new());
        api_metrics.register(&mut registry);
        let stored_responses = Arc::new(crate::response_map::ResponseMap::new(
            config.max_stored_responses,
            config.max_stored_responses_per_key,
            Duration::from_secs(config.stored_response_ttl_secs),
        ));
        stored_responses.register(&mut registry);
        // Peers' stored responses go in this map (the first state made
        // over a router keeps it).
        let _ = driver.stored_responses.set(stored_responses.clone());
        registry.register_collector(Box::new(crate::tokenize::TokenizerCollector(
            tokenizer.clone(),
        )));
        let tokenize_gate = match config.tokenize_slots {
            Some(slots) => crate::tokenize_gate::TokenizeGate::new(slots),
            None => crate::tokenize_gate::TokenizeGate::per_core(),
        };
        registry.register_collector(Box::new(crate::tokenize_gate::TokenizeGateCollector(
            tokenize_gate.clone(),
        )));
        let hub = switchyard_tokenizer::hub::HubOptions {
            allow_download: config.allow_hub_download,
            cache_dir: config.hub_cache_dir.clone(),
        };
        let models = Arc::new(Models::new(
            tokenizer,
            config.tokenizer_dir.is_some(),
            config.block_size,
            &config.models,
            |spec| crate::models::load_tokenizer(spec, &hub, config.token_cache_ids),
        ));
        registry.register_collector(Box::new(crate::models::ModelsCollector(models.clone())));
        fleet.check_tokenizers_of(models.clone());
        let body_budget = crate::front::upload::BodyBudget::new(
            config.body_bytes_total(),
            driver.metrics().clone(),
        );
        Self {
            driver,
            fleet,
            upstream: Upstream {
                client,
                worker_auth: worker_authorization(config),
                router_id,
                worker_header: config.names_workers(),
                first_token_timeout: Duration::from_secs_f64(config.first_token_timeout_secs),
                request_timeout: Duration::from_secs_f64(config.request_timeout_secs),
                max_response_bytes: config.max_response_bytes,
                migration: MigrationPolicy {
                    limit: config.migration_limit,
                    max_seq_len: config.migration_max_seq_len,
                    max_workers: config.max_attempt_workers,
                },
            },
            intake: Intake {
                credentials,
                admin_api: config.admin_token.is_some(),
                max_body_bytes: config.max_body_bytes,
                body_budget,
                body_read_timeout: Duration::from_millis(config.body_read_timeout_ms),
                limits: InputLimits::new(config),
                flow_metrics,
                flows,
                tenant_header: config
                    .tenant_header
                    .as_deref()
                    .and_then(|h| axum::http::HeaderName::from_bytes(h.as_bytes()).ok()),
            },
            prompts: Prompts {
                models,
                hash_seed: switchyard_core::hashing::seed_for(None, None),
                tokenize_gate,
            },
            apis: Apis {
                disagg: config.disagg,
                disagg_metrics,
                stored_responses,
                api_metrics,
            },
            registry,
        }
    }
}

/// The `Authorization` header value the router sends to workers, when
/// `--worker-api-key` is set (marked sensitive: never logged by hyper).
pub(crate) fn worker_authorization(config: &crate::config::ServerConfig) -> Option<HeaderValue> {
    let key = config.worker_api_key.as_ref()?.expose();
    let mut value = HeaderValue::from_str(&format!("Bearer {key}")).ok()?;
    value.set_sensitive(true);
    Some(value)
}

pub(crate) type App = Arc<AppState>;

/// The configured input limits ([`crate::request::limits`] applies them).
#[derive(Clone, Copy, Debug)]
pub struct InputLimits {
    /// `--max-prompt-tokens` (None: the workers' `max_model_len`).
    pub prompt_tokens: Option<usize>,
    /// `--max-messages`.
    pub messages: usize,
    /// `--max-content-parts`.
    pub content_parts: usize,
    /// `--max-n`.
    pub n: u32,
    /// `--max-output-tokens` (None: the prompt token limit).
    pub output_tokens: Option<u32>,
}

impl InputLimits {
    /// The limits of `config`.
    pub fn new(config: &crate::config::ServerConfig) -> Self {
        Self {
            prompt_tokens: config.max_prompt_tokens,
            messages: config.max_messages,
            content_parts: config.max_content_parts,
            n: config.max_n,
            output_tokens: config.max_output_tokens,
        }
    }
}

impl AppState {
    /// How the router speaks of workers to clients: guarded while client
    /// keys are required ([`crate::upstream::disclosure`]).
    pub(crate) fn disclosure(&self) -> crate::upstream::disclosure::Disclosure {
        crate::upstream::disclosure::Disclosure::when_keys_required(
            self.intake.credentials.client_keys_required(),
        )
    }
}
