//! The router's own metrics: the counters and histograms the request path
//! updates, as `prometheus-client` metrics. Counting a request, an
//! admission decision or a migration is one relaxed atomic add on a handle
//! taken when [`ServerMetrics::new`] created the family's label sets;
//! observing a latency is one histogram observe (a short uncontended lock
//! around a bucket increment). Nothing on the request path allocates.
//!
//! [`ServerMetrics::register`] puts the families into the `/metrics`
//! registry, beside the routing state's gauges (read at scrape time,
//! [`crate::metrics_state`]) and the KV-event and replica planes' families.
//! Names follow DESIGN.md "Interfaces"; counters are registered without
//! their `_total` suffix, which the encoder appends.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;
use std::sync::atomic::AtomicU64;
use switchyard_core::dispatch::failure::{Failure, GiveUp};

/// Upper bounds (seconds) of the latency histograms' buckets.
pub const LATENCY_BUCKETS: [f64; 20] = [
    0.000_01, 0.000_025, 0.000_05, 0.000_1, 0.000_25, 0.000_5, 0.001, 0.002_5, 0.005, 0.01, 0.025,
    0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
];

/// How a request ended, as the `status` label of `switchyard_requests_total`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RequestStatus {
    /// The worker answered 2xx and the body was delivered.
    Ok,
    /// The worker answered with an error status (passed through).
    WorkerError,
    /// Refused by the router: bad input, bad key, unknown model (4xx).
    Invalid,
    /// Refused for overload: admission queue full (429) or the in-flight
    /// limit reached (503).
    Rejected,
    /// No worker could take it, or the worker failed (502/503).
    Unavailable,
    /// The client went away first.
    Cancelled,
}

impl RequestStatus {
    /// Every status, in declaration order (a status's index is `as usize`).
    pub const ALL: [RequestStatus; 6] = [
        RequestStatus::Ok,
        RequestStatus::WorkerError,
        RequestStatus::Invalid,
        RequestStatus::Rejected,
        RequestStatus::Unavailable,
        RequestStatus::Cancelled,
    ];

    /// Its `status` label.
    pub fn label(self) -> &'static str {
        match self {
            RequestStatus::Ok => "ok",
            RequestStatus::WorkerError => "worker_error",
            RequestStatus::Invalid => "invalid",
            RequestStatus::Rejected => "rejected",
            RequestStatus::Unavailable => "unavailable",
            RequestStatus::Cancelled => "cancelled",
        }
    }
}

/// Admission outcomes, as the `decision` label.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AdmissionDecision {
    /// Queued ready.
    Queued,
    /// Deferred by the strategy.
    Deferred,
    /// Refused (429).
    Rejected,
    /// Left the queue because the client gave up.
    Cancelled,
}

impl AdmissionDecision {
    /// Every decision, in declaration order (an index is `as usize`).
    pub const ALL: [AdmissionDecision; 4] = [
        AdmissionDecision::Queued,
        AdmissionDecision::Deferred,
        AdmissionDecision::Rejected,
        AdmissionDecision::Cancelled,
    ];

    /// Its `decision` label.
    pub fn label(self) -> &'static str {
        match self {
            AdmissionDecision::Queued => "queued",
            AdmissionDecision::Deferred => "deferred",
            AdmissionDecision::Rejected => "rejected",
            AdmissionDecision::Cancelled => "cancelled",
        }
    }
}

/// What a refused credential was for, as the `scope` label of
/// `switchyard_auth_failures_total`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AuthScope {
    /// A client API key, on `/v1/*`.
    Client,
    /// The admin token, on `/admin/*`.
    Admin,
    /// The metrics key, on `/metrics`.
    Metrics,
}

impl AuthScope {
    /// Every scope, in declaration order (an index is `as usize`).
    pub const ALL: [AuthScope; 3] = [AuthScope::Client, AuthScope::Admin, AuthScope::Metrics];

    /// Its `scope` label.
    pub fn label(self) -> &'static str {
        match self {
            AuthScope::Client => "client",
            AuthScope::Admin => "admin",
            AuthScope::Metrics => "metrics",
        }
    }
}

/// The input limit that refused a request, as the `limit` label of
/// `switchyard_input_limit_refusals_total`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum InputLimit {
    /// `--max-body-bytes` (413).
    BodyBytes,
    /// The prompt token limit (`--max-prompt-tokens` or the workers'
    /// `max_model_len`).
    PromptTokens,
    /// `--max-messages`.
    Messages,
    /// `--max-content-parts`.
    ContentParts,
    /// `--max-n`.
    N,
    /// `--max-output-tokens` (`max_tokens`, `max_completion_tokens`).
    OutputTokens,
}

impl InputLimit {
    /// Every limit, in declaration order (an index is `as usize`).
    pub const ALL: [InputLimit; 6] = [
        InputLimit::BodyBytes,
        InputLimit::PromptTokens,
        InputLimit::Messages,
        InputLimit::ContentParts,
        InputLimit::N,
        InputLimit::OutputTokens,
    ];

    /// Its `limit` label.
    pub fn label(self) -> &'static str {
        match self {
            InputLimit::BodyBytes => "body_bytes",
            InputLimit::PromptTokens => "prompt_tokens",
            InputLimit::Messages => "messages",
            InputLimit::ContentParts => "content_parts",
            InputLimit::N => "n",
            InputLimit::OutputTokens => "output_tokens",
        }
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ScopeLabels {
    scope: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct LimitLabels {
    limit: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RequestLabels {
    policy: &'static str,
    status: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct DecisionLabels {
    decision: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ReasonLabels {
    reason: &'static str,
}

/// A gauge of a non-negative count.
pub type CountGauge = Gauge<u64, AtomicU64>;

/// Router-wide metrics. Every field is a handle sharing its atomic with
/// the registered family, so cloning one out of here and updating it shows
/// at the next scrape.
#[derive(Debug)]
pub struct ServerMetrics {
    requests_by_status: Family<RequestLabels, Counter>,
    /// Handles of `requests_by_status`, indexed by `RequestStatus as usize`.
    requests: [Counter; RequestStatus::ALL.len()],
    admissions_by_decision: Family<DecisionLabels, Counter>,
    /// Handles, indexed by `AdmissionDecision as usize`.
    admissions: [Counter; AdmissionDecision::ALL.len()],
    migrations_by_reason: Family<ReasonLabels, Counter>,
    /// Handles, indexed by [`Failure::index`].
    migrations: [Counter; Failure::ALL.len()],
    auth_failures_by_scope: Family<ScopeLabels, Counter>,
    /// Handles, indexed by `AuthScope as usize`.
    auth_failures: [Counter; AuthScope::ALL.len()],
    refused_by_reason: Family<ReasonLabels, Counter>,
    /// Handles, indexed by [`GiveUp::index`].
    refused: [Counter; GiveUp::LABELS.len()],
    limit_refusals_by_limit: Family<LimitLabels, Counter>,
    /// Handles, indexed by `InputLimit as usize`.
    limit_refusals: [Counter; InputLimit::ALL.len()],
    /// Arrival to first body byte from the worker.
    pub ttft: Histogram,
    /// Between consecutive streamed chunks.
    pub itl: Histogram,
    /// One routing decision (route + book) under the router's lock,
    /// tokenization excluded: a dispatcher call's time shared between the
    /// decisions it made.
    pub routing_decision: Histogram,
    /// Prompt to token ids (chat template included).
    pub tokenize: Histogram,
    /// Routes made before the lock that were the decision.
    pub pre_routes_used: Counter,
    /// Routes made before the lock that were set aside and made again
    /// under it (the request waited, or its worker could no longer take
    /// it).
    pub pre_routes_rerouted: Counter,
    /// Worker failures reported by the proxy (`Booking::worker_failed`).
    pub upstream_failures: Counter,
    /// Requests freed by a worker's removal rather than by their own end.
    pub freed_by_removal: Counter,
    /// Requests that failed on a worker and could not be migrated (limit
    /// reached, too long, not resumable, or no other worker).
    pub migrations_exhausted: Counter,
    /// Requests cancelled by the request timeout.
    pub request_timeouts: Counter,
    /// KV events from a subscriber whose worker left the router since.
    pub stale_kv_events: Counter,
    /// Requests holding an in-flight permit (every route but the probes);
    /// the in-flight limiter counts in this gauge's atomic
    /// ([`crate::front::inflight`]).
    pub inflight: CountGauge,
    /// The in-flight limit (`--max-inflight`).
    pub inflight_limit: CountGauge,
    /// Requests refused at the in-flight limit (503).
    pub inflight_rejected: Counter,
    /// Request bodies cut at the body-read deadline (408).
    pub slow_uploads: Counter,
    /// Bytes of request bodies held now, against the body budget
    /// ([`crate::front::upload::BodyBudget`]).
    pub body_budget_held: CountGauge,
    /// The body budget (`--max-body-bytes-total`), in bytes.
    pub body_budget_limit: CountGauge,
    /// Requests refused (503) because their body did not fit the budget.
    pub body_budget_refusals: Counter,
    /// Client connections open now ([`crate::front::accept`]).
    pub connections_open: CountGauge,
    /// The connection cap (`--max-connections`).
    pub connections_limit: CountGauge,
    /// Connections closed at accept because the cap was reached.
    pub connections_refused: Counter,
    /// Connections closed because a request head (or the next one on an
    /// idle keep-alive connection) did not arrive within the header-read
    /// timeout.
    pub header_read_timeouts: Counter,
    /// Connections closed because their writes made no progress within
    /// the send timeout ([`crate::front::accept`]).
    pub send_timeouts: Counter,
    /// TLS connections closed before their handshake ended: it failed
    /// (no common version, a certificate refused, not TLS) or took longer
    /// than the header-read timeout.
    pub tls_handshake_failures: Counter,
}

impl ServerMetrics {
    /// Fresh metrics of a router running `policy` (the `policy` label of
    /// `switchyard_requests_total`). Every label set of the request path
    /// is created here, so each is exported from the start, at zero.
    pub fn new(policy: &'static str) -> Self {
        let requests_by_status = Family::<RequestLabels, Counter>::default();
        let requests = RequestStatus::ALL.map(|status| {
            requests_by_status
                .get_or_create(&RequestLabels {
                    policy,
                    status: status.label(),
                })
                .clone()
        });
        let admissions_by_decision = Family::<DecisionLabels, Counter>::default();
        let admissions = AdmissionDecision::ALL.map(|decision| {
            admissions_by_decision
                .get_or_create(&DecisionLabels {
                    decision: decision.label(),
                })
                .clone()
        });
        let migrations_by_reason = Family::<ReasonLabels, Counter>::default();
        let migrations = Failure::ALL.map(|reason| {
            migrations_by_reason
                .get_or_create(&ReasonLabels {
                    reason: reason.label(),
                })
                .clone()
        });
        let auth_failures_by_scope = Family::<ScopeLabels, Counter>::default();
        let auth_failures = AuthScope::ALL.map(|scope| {
            auth_failures_by_scope
                .get_or_create(&ScopeLabels {
                    scope: scope.label(),
                })
                .clone()
        });
        let refused_by_reason = Family::<ReasonLabels, Counter>::default();
        let refused = GiveUp::LABELS.map(|reason| {
            refused_by_reason
                .get_or_create(&ReasonLabels { reason })
                .clone()
        });
        let limit_refusals_by_limit = Family::<LimitLabels, Counter>::default();
        let limit_refusals = InputLimit::ALL.map(|limit| {
            limit_refusals_by_limit
                .get_or_create(&LimitLabels {
                    limit: limit.label(),
                })
                .clone()
        });
        let latency = || Histogram::new(LATENCY_BUCKETS);
        Self {
            auth_failures_by_scope,
            auth_failures,
            requests_by_status,
            requests,
            admissions_by_decision,
            admissions,
            migrations_by_reason,
            migrations,
            refused_by_reason,
            refused,
            limit_refusals_by_limit,
            limit_refusals,
            ttft: latency(),
            itl: latency(),
            routing_decision: latency(),
            pre_routes_used: Counter::default(),
            pre_routes_rerouted: Counter::default(),
            tokenize: latency(),
            upstream_failures: Counter::default(),
            freed_by_removal: Counter::default(),
            migrations_exhausted: Counter::default(),
            request_timeouts: Counter::default(),
            stale_kv_events: Counter::default(),
            inflight: CountGauge::default(),
            inflight_limit: CountGauge::default(),
            inflight_rejected: Counter::default(),
            slow_uploads: Counter::default(),
            body_budget_held: CountGauge::default(),
            body_budget_limit: CountGauge::default(),
            body_budget_refusals: Counter::default(),
            connections_open: CountGauge::default(),
            connections_limit: CountGauge::default(),
            connections_refused: Counter::default(),
            header_read_timeouts: Counter::default(),
            tls_handshake_failures: Counter::default(),
            send_timeouts: Counter::default(),
        }
    }

    /// Counts a request refused for a missing or wrong credential.
    pub fn count_auth_failure(&self, scope: AuthScope) {
        self.auth_failures[scope as usize].inc();
    }

    /// Refusals counted with `scope`.
    pub fn auth_failures(&self, scope: AuthScope) -> u64 {
        self.auth_failures[scope as usize].get()
    }

    /// Counts a finished request.
    pub fn count_request(&self, status: RequestStatus) {
        self.requests[status as usize].inc();
    }

    /// Requests counted with `status`.
    pub fn requests(&self, status: RequestStatus) -> u64 {
        self.requests[status as usize].get()
    }

    /// Counts one migration of a request away from a failed worker.
    pub fn count_migration(&self, reason: Failure) {
        self.migrations[reason.index()].inc();
    }

    /// Migrations counted with `reason`.
    pub fn migrations(&self, reason: Failure) -> u64 {
        self.migrations[reason.index()].get()
    }

    /// Counts a failed request that was not moved to another worker, by
    /// why (besides `migrations_exhausted`, which counts every such request).
    pub fn count_refused(&self, why: &GiveUp) {
        self.refused[why.index()].inc();
    }

    /// Refusals counted under `why`'s label.
    pub fn refused(&self, why: &GiveUp) -> u64 {
        self.refused[why.index()].get()
    }

    /// Counts a request refused (400 or 413) at an input limit.
    pub fn count_limit_refusal(&self, limit: InputLimit) {
        self.limit_refusals[limit as usize].inc();
    }

    /// Refusals counted at `limit`.
    pub fn limit_refusals(&self, limit: InputLimit) -> u64 {
        self.limit_refusals[limit as usize].get()
    }

    /// Counts `n` admission outcomes.
    pub fn count_admissions(&self, decision: AdmissionDecision, n: u32) {
        self.admissions[decision as usize].inc_by(u64::from(n));
    }

    /// Admission outcomes counted with `decision`.
    pub fn admissions(&self, decision: AdmissionDecision) -> u64 {
        self.admissions[decision as usize].get()
    }

    /// Registers every family into `registry` (shared with `self`).
    pub fn register(&self, registry: &mut Registry) {
        registry.register(
            "switchyard_requests",
            "Requests by routing policy and how they ended",
            self.requests_by_status.clone(),
        );
        registry.register(
            "switchyard_admission_decisions",
            "Admission outcomes",
            self.admissions_by_decision.clone(),
        );
        registry.register(
            "switchyard_time_to_first_token_seconds",
            "Arrival at the router to the first response byte from the worker",
            self.ttft.clone(),
        );
        registry.register(
            "switchyard_inter_token_latency_seconds",
            "Time between consecutive streamed chunks",
            self.itl.clone(),
        );
        registry.register(
            "switchyard_routing_decision_seconds",
            "Worker selection and booking, tokenization excluded",
            self.routing_decision.clone(),
        );
        registry.register(
            "switchyard_pre_routes_used",
            "Routes made on the published loads before the routing lock that were the decision",
            self.pre_routes_used.clone(),
        );
        registry.register(
            "switchyard_pre_routes_rerouted",
            "Routes made before the routing lock that were made again under it (request queued, or its worker could no longer take it)",
            self.pre_routes_rerouted.clone(),
        );
        registry.register(
            "switchyard_tokenize_seconds",
            "Prompt to token ids, chat template included",
            self.tokenize.clone(),
        );
        registry.register(
            "switchyard_upstream_failures",
            "Worker failures seen by the proxy (refused, reset, 5xx, timeout, broken stream), each reported to the worker's circuit breaker",
            self.upstream_failures.clone(),
        );
        registry.register(
            "switchyard_requests_freed_by_removal",
            "Bookings dropped because their worker was removed",
            self.freed_by_removal.clone(),
        );
        registry.register(
            "switchyard_migrations",
            "Requests moved to another worker after a failure, by reason",
            self.migrations_by_reason.clone(),
        );
        registry.register(
            "switchyard_migrations_exhausted",
            "Failed requests that could not be migrated (limit, length, or no other worker)",
            self.migrations_exhausted.clone(),
        );
        registry.register(
            "switchyard_migrations_refused",
            "Failed requests not moved to another worker, by why: limit (--migration-limit), too_long (--migration-max-seq-len), not_resumable (a stream whose request the resume cannot reproduce), request_fault (a second suspect failure), worker_limit (--max-attempt-workers)",
            self.refused_by_reason.clone(),
        );
        registry.register(
            "switchyard_request_timeouts",
            "Requests cancelled by the request timeout",
            self.request_timeouts.clone(),
        );
        registry.register(
            "switchyard_kv_events_stale",
            "KV events dropped because their worker left the router after the subscriber started",
            self.stale_kv_events.clone(),
        );
        registry.register(
            "switchyard_inflight_requests",
            "OpenAI requests in the router (queued, waiting or streaming)",
            self.inflight.clone(),
        );
        registry.register(
            "switchyard_inflight_limit",
            "The in-flight limit (--max-inflight)",
            self.inflight_limit.clone(),
        );
        registry.register(
            "switchyard_inflight_rejected",
            "Requests refused with 503 at the in-flight limit",
            self.inflight_rejected.clone(),
        );
        registry.register(
            "switchyard_auth_failures",
            "Requests refused with 401 for a missing or wrong credential, by scope (client, admin, metrics); no body byte of them was read",
            self.auth_failures_by_scope.clone(),
        );
        registry.register(
            "switchyard_slow_uploads",
            "Request bodies cut with 408 at the body-read deadline (--body-read-timeout-ms)",
            self.slow_uploads.clone(),
        );
        registry.register(
            "switchyard_body_budget_held_bytes",
            "Bytes of request bodies the router holds now (read, or declared and being read), against --max-body-bytes-total",
            self.body_budget_held.clone(),
        );
        registry.register(
            "switchyard_body_budget_bytes",
            "The body budget: bytes of request bodies held at once (--max-body-bytes-total)",
            self.body_budget_limit.clone(),
        );
        registry.register(
            "switchyard_body_budget_refusals",
            "Requests refused with 503 because their body did not fit the body budget (--max-body-bytes-total)",
            self.body_budget_refusals.clone(),
        );
        registry.register(
            "switchyard_connections_open",
            "Client connections open now",
            self.connections_open.clone(),
        );
        registry.register(
            "switchyard_connections_limit",
            "The connection cap (--max-connections)",
            self.connections_limit.clone(),
        );
        registry.register(
            "switchyard_connections_refused",
            "Connections closed at accept because the connection cap was reached",
            self.connections_refused.clone(),
        );
        registry.register(
            "switchyard_header_read_timeouts",
            "Connections closed because a request head did not arrive within --header-read-timeout-ms (idle keep-alive connections included)",
            self.header_read_timeouts.clone(),
        );
        registry.register(
            "switchyard_tls_handshake_failures",
            "TLS connections closed before their handshake ended (it failed, or took longer than --header-read-timeout-ms)",
            self.tls_handshake_failures.clone(),
        );
        registry.register(
            "switchyard_send_timeouts",
            "Connections closed because their client read nothing of the answer within --send-timeout-ms (the request's in-flight place, buffered answer and upstream freed with it)",
            self.send_timeouts.clone(),
        );
        registry.register(
            "switchyard_input_limit_refusals",
            "Requests refused at an input limit (body bytes, prompt tokens, messages, content parts, n, output tokens)",
            self.limit_refusals_by_limit.clone(),
        );
    }
}

// ---- The Responses and Messages APIs ------------------------------------

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ApiLabels {
    api: &'static str,
    status: &'static str,
}

/// Requests of the Responses and Messages APIs by API and how they ended
/// (`switchyard_api_requests_total`; each is counted in
/// `switchyard_requests_total` too); every label set made up front.
#[derive(Debug)]
pub(crate) struct ApiMetrics {
    family: Family<ApiLabels, Counter>,
    /// `[Responses, Messages] × RequestStatus`.
    counts: [[Counter; RequestStatus::ALL.len()]; 2],
}

fn api_index(api: switchyard_wire::agentic::AgenticApi) -> usize {
    usize::from(api == switchyard_wire::agentic::AgenticApi::Messages)
}

impl ApiMetrics {
    pub(crate) fn new() -> Self {
        use switchyard_wire::agentic::AgenticApi;
        let family = Family::<ApiLabels, Counter>::default();
        let counts = [AgenticApi::Responses, AgenticApi::Messages].map(|api| {
            RequestStatus::ALL.map(|status| {
                family
                    .get_or_create(&ApiLabels {
                        api: api.label(),
                        status: status.label(),
                    })
                    .clone()
            })
        });
        Self { family, counts }
    }

    pub(crate) fn register(&self, registry: &mut Registry) {
        registry.register(
            "switchyard_api_requests",
            "Requests of the Responses and Messages APIs by API and how they ended (also counted in switchyard_requests_total)",
            self.family.clone(),
        );
    }

    /// Counts a request of `api` that ended with `status`.
    pub(crate) fn count(&self, api: switchyard_wire::agentic::AgenticApi, status: RequestStatus) {
        self.counts[api_index(api)][status as usize].inc();
    }

    /// Requests of `api` counted with `status` (tests).
    #[cfg_attr(not(test), allow(dead_code))]
    pub(crate) fn counted(
        &self,
        api: switchyard_wire::agentic::AgenticApi,
        status: RequestStatus,
    ) -> u64 {
        self.counts[api_index(api)][status as usize].get()
    }
}

// ---- Disaggregated requests (`serve --disagg`) --------------------------

/// How a half ended, as the `outcome` label.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum DisaggOutcome {
    /// Answered 2xx.
    Ok,
    /// Failed (refused, reset, 5xx, timeout, broken answer): reported.
    Failed,
    /// Answered a client error, passed to the client.
    Refused,
    /// A decode whose transfer failed (lease or room unknown, its prefill
    /// worker unreachable): not the decode worker's failure.
    TransferFailed,
}

impl DisaggOutcome {
    const ALL: [DisaggOutcome; 4] = [
        DisaggOutcome::Ok,
        DisaggOutcome::Failed,
        DisaggOutcome::Refused,
        DisaggOutcome::TransferFailed,
    ];
    pub(crate) fn label(self) -> &'static str {
        match self {
            DisaggOutcome::Ok => "ok",
            DisaggOutcome::Failed => "failed",
            DisaggOutcome::Refused => "refused",
            DisaggOutcome::TransferFailed => "transfer_failed",
        }
    }
}

/// Why a half was tried again, as the `reason` label of the retries, and
/// why a request failed, of the failures.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum DisaggReason {
    /// The prefill worker failed.
    Prefill,
    /// The decode worker failed.
    Decode,
    /// The decode worker could not take the KV (lease or room unknown or
    /// expired, prefill worker unreachable, KV not the prompt's).
    Transfer,
    /// The request timeout passed.
    Timeout,
    /// No worker of a pool could take it.
    NoWorker,
}

impl DisaggReason {
    const ALL: [DisaggReason; 5] = [
        DisaggReason::Prefill,
        DisaggReason::Decode,
        DisaggReason::Transfer,
        DisaggReason::Timeout,
        DisaggReason::NoWorker,
    ];
    pub(crate) fn label(self) -> &'static str {
        match self {
            DisaggReason::Prefill => "prefill",
            DisaggReason::Decode => "decode",
            DisaggReason::Transfer => "transfer",
            DisaggReason::Timeout => "timeout",
            DisaggReason::NoWorker => "no_worker",
        }
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct HalfLabels {
    role: &'static str,
    outcome: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct DisaggReasonLabels {
    reason: &'static str,
}

/// The disaggregated requests' counts; every label set made up front.
#[derive(Debug)]
pub(crate) struct DisaggMetrics {
    pub(crate) requests: Counter,
    halves_family: Family<HalfLabels, Counter>,
    /// `[prefill, decode] × Outcome`.
    halves: [[Counter; DisaggOutcome::ALL.len()]; 2],
    retries_family: Family<DisaggReasonLabels, Counter>,
    retries: [Counter; DisaggReason::ALL.len()],
    failures_family: Family<DisaggReasonLabels, Counter>,
    failures: [Counter; DisaggReason::ALL.len()],
    /// Arrival to the prefill worker's answer (vLLM).
    pub(crate) prefill_seconds: Histogram,
}

fn role_index(role: crate::roster::Role) -> usize {
    usize::from(role == crate::roster::Role::Decode)
}

impl DisaggMetrics {
    pub(crate) fn new() -> Self {
        let halves_family = Family::<HalfLabels, Counter>::default();
        let halves = [crate::roster::Role::Prefill, crate::roster::Role::Decode].map(|role| {
            DisaggOutcome::ALL.map(|outcome| {
                halves_family
                    .get_or_create(&HalfLabels {
                        role: role.label(),
                        outcome: outcome.label(),
                    })
                    .clone()
            })
        });
        let by_reason = |family: &Family<DisaggReasonLabels, Counter>| {
            DisaggReason::ALL.map(|r| {
                family
                    .get_or_create(&DisaggReasonLabels { reason: r.label() })
                    .clone()
            })
        };
        let retries_family = Family::default();
        let failures_family = Family::default();
        Self {
            requests: Counter::default(),
            halves,
            retries: by_reason(&retries_family),
            failures: by_reason(&failures_family),
            halves_family,
            retries_family,
            failures_family,
            prefill_seconds: Histogram::new(LATENCY_BUCKETS),
        }
    }

    pub(crate) fn register(&self, registry: &mut Registry) {
        registry.register(
            "switchyard_disagg_requests",
            "Requests served as a prefill and a decode half (--disagg)",
            self.requests.clone(),
        );
        registry.register(
            "switchyard_disagg_halves",
            "Halves of disaggregated requests sent to workers, by role and how each ended",
            self.halves_family.clone(),
        );
        registry.register(
            "switchyard_disagg_retries",
            "Halves of disaggregated requests sent again, by why",
            self.retries_family.clone(),
        );
        registry.register(
            "switchyard_disagg_failures",
            "Disaggregated requests answered with an error, by which part failed",
            self.failures_family.clone(),
        );
        registry.register(
            "switchyard_disagg_prefill_seconds",
            "Arrival to the prefill worker's answer, vLLM protocol",
            self.prefill_seconds.clone(),
        );
    }

    pub(crate) fn half(&self, role: crate::roster::Role, outcome: DisaggOutcome) {
        self.halves[role_index(role)][outcome as usize].inc();
    }

    pub(crate) fn retry(&self, reason: DisaggReason) {
        self.retries[reason as usize].inc();
    }

    pub(crate) fn failure(&self, reason: DisaggReason) {
        self.failures[reason as usize].inc();
    }

    /// Halves counted with `role` and `outcome` (tests).
    #[cfg(test)]
    pub(crate) fn halves(&self, role: crate::roster::Role, outcome: DisaggOutcome) -> u64 {
        self.halves[role_index(role)][outcome as usize].get()
    }
}

/// Writes `(name, help, value)` counters read at scrape time (a
/// collector's fixed, unlabelled series).
pub(crate) fn encode_const_counters(
    encoder: &mut prometheus_client::encoding::DescriptorEncoder<'_>,
    series: &[(&str, &str, u64)],
) -> std::fmt::Result {
    use prometheus_client::metrics::counter::ConstCounter;
    encode_const(
        encoder,
        series.iter().map(|&(n, h, v)| (n, h, ConstCounter::new(v))),
    )
}

/// Writes `(name, help, value)` gauges read at scrape time, as
/// [`encode_const_counters`] writes counters.
pub(crate) fn encode_const_gauges(
    encoder: &mut prometheus_client::encoding::DescriptorEncoder<'_>,
    series: &[(&str, &str, i64)],
) -> std::fmt::Result {
    use prometheus_client::metrics::gauge::ConstGauge;
    encode_const(
        encoder,
        series.iter().map(|&(n, h, v)| (n, h, ConstGauge::new(v))),
    )
}

/// Writes each `(name, help, metric)`, unlabelled, as the metric's type.
fn encode_const<'a, M: prometheus_client::encoding::EncodeMetric>(
    encoder: &mut prometheus_client::encoding::DescriptorEncoder<'_>,
    series: impl Iterator<Item = (&'a str, &'a str, M)>,
) -> std::fmt::Result {
    for (name, help, metric) in series {
        metric.encode(encoder.encode_descriptor(name, help, None, metric.metric_type())?)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use prometheus_client::encoding::prometheus_text::encode;

    fn text(m: &ServerMetrics) -> String {
        let mut registry = Registry::default();
        m.register(&mut registry);
        let mut out = String::new();
        encode(&mut out, &registry).unwrap();
        out
    }

    #[test]
    fn a_histogram_exports_cumulative_buckets_sum_and_count() {
        let m = ServerMetrics::new("kv");
        m.ttft.observe(0.0001);
        m.ttft.observe(0.002);
        m.ttft.observe(100.0);
        let out = text(&m);
        let family = "switchyard_time_to_first_token_seconds";
        assert!(
            out.contains(&format!("# TYPE {family} histogram\n")),
            "{out}"
        );
        assert!(
            out.contains(&format!("{family}_bucket{{le=\"0.0001\"}} 1\n")),
            "{out}"
        );
        assert!(
            out.contains(&format!("{family}_bucket{{le=\"0.0025\"}} 2\n")),
            "{out}"
        );
        assert!(
            out.contains(&format!("{family}_bucket{{le=\"30\"}} 2\n")),
            "{out}"
        );
        assert!(
            out.contains(&format!("{family}_bucket{{le=\"+Inf\"}} 3\n")),
            "{out}"
        );
        assert!(out.contains(&format!("{family}_count 3\n")), "{out}");
    }

    #[test]
    fn every_status_label_is_exported_even_at_zero() {
        let m = ServerMetrics::new("kv");
        m.count_request(RequestStatus::Rejected);
        let out = text(&m);
        assert!(out.contains("switchyard_requests_total{policy=\"kv\",status=\"rejected\"} 1\n"));
        assert!(out.contains("switchyard_requests_total{policy=\"kv\",status=\"ok\"} 0\n"));
        assert!(out.contains("switchyard_migrations_total{reason=\"midstream\"} 0\n"));
        assert!(out.contains("switchyard_migrations_refused_total{reason=\"not_resumable\"} 0\n"));
        assert!(out.contains("switchyard_admission_decisions_total{decision=\"queued\"} 0\n"));
        assert!(out.contains("switchyard_auth_failures_total{scope=\"admin\"} 0\n"));
    }

    #[test]
    fn every_family_has_help_and_type_and_counters_end_in_total() {
        let out = text(&ServerMetrics::new("kv"));
        let families: Vec<&str> = out
            .lines()
            .filter_map(|l| l.strip_prefix("# TYPE "))
            .collect();
        assert_eq!(families.len(), 30, "{out}");
        for typed in families {
            let (name, kind) = typed.split_once(' ').unwrap();
            assert!(out.contains(&format!("# HELP {name} ")), "{name}");
            assert_eq!(kind == "counter", name.ends_with("_total"), "{typed}");
        }
    }

    #[test]
    fn handles_are_indexed_like_their_labels() {
        let m = ServerMetrics::new("kv");
        for (i, status) in RequestStatus::ALL.into_iter().enumerate() {
            assert_eq!(status as usize, i);
        }
        for (i, decision) in AdmissionDecision::ALL.into_iter().enumerate() {
            assert_eq!(decision as usize, i);
        }
        m.count_admissions(AdmissionDecision::Cancelled, 3);
        assert!(
            text(&m).contains("switchyard_admission_decisions_total{decision=\"cancelled\"} 3\n")
        );
        assert_eq!(m.admissions(AdmissionDecision::Cancelled), 3);
        for (i, limit) in InputLimit::ALL.into_iter().enumerate() {
            assert_eq!(limit as usize, i);
        }
        m.count_limit_refusal(InputLimit::Messages);
        assert!(text(&m).contains("switchyard_input_limit_refusals_total{limit=\"messages\"} 1\n"));
        assert!(text(&m).contains("switchyard_input_limit_refusals_total{limit=\"n\"} 0\n"));
        assert_eq!(m.limit_refusals(InputLimit::Messages), 1);
    }

    /// The request path's metric updates, run with a counting allocator
    /// (`allocation-counter` counts this thread's allocations).
    #[test]
    fn the_request_path_updates_metrics_without_allocating() {
        let m = ServerMetrics::new("kv");
        let replica = switchyard_replica::ReplicaMetrics::default();
        // Warm up once: parking_lot's and the histograms' lazy state.
        m.ttft.observe(0.01);
        let updates = allocation_counter::measure(|| {
            for i in 0..10_000u32 {
                let seconds = f64::from(i % 4096) * 1e-5;
                for status in RequestStatus::ALL {
                    m.count_request(status);
                }
                for decision in AdmissionDecision::ALL {
                    m.count_admissions(decision, 1);
                }
                for reason in Failure::ALL {
                    m.count_migration(reason);
                }
                m.count_refused(&GiveUp::RequestFault);
                for limit in InputLimit::ALL {
                    m.count_limit_refusal(limit);
                }
                m.ttft.observe(seconds);
                m.itl.observe(seconds);
                m.routing_decision.observe(seconds);
                m.tokenize.observe(seconds);
                m.upstream_failures.inc();
                m.request_timeouts.inc();
                m.migrations_exhausted.inc();
                m.inflight.inc();
                m.inflight.dec();
                for scope in AuthScope::ALL {
                    m.count_auth_failure(scope);
                }
                m.slow_uploads.inc();
                m.connections_open.inc();
                m.connections_open.dec();
                m.connections_refused.inc();
                m.header_read_timeouts.inc();
                m.send_timeouts.inc();
                replica.published.inc_by(3);
                replica.dropped.inc();
            }
        });
        assert_eq!(updates.count_total, 0, "{updates:?}");
        let control = allocation_counter::measure(|| {
            std::hint::black_box(vec![0u8; 8]);
        });
        assert_eq!(
            control.count_total, 1,
            "the counting allocator is installed"
        );
        assert_eq!(m.requests(RequestStatus::Ok), 10_000);
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct FlowLabels {
    tenant: String,
    band: String,
}

/// Flow control's wait histograms, one per (tenant, band) of the
/// configuration: a bounded label set, made at startup so the request
/// path only indexes and observes. The per-(tenant, band) counters are
/// the core's, read at scrape time ([`crate::metrics_state::Snapshot`]).
#[derive(Debug)]
pub struct FlowMetrics {
    family: Family<FlowLabels, Histogram, fn() -> Histogram>,
    /// Handles, at `tenant * bands + band`.
    waits: Vec<Histogram>,
    bands: usize,
}

/// Buckets of the admission-queue wait, seconds: from no wait at all to
/// a minute.
const WAIT_BUCKETS: [f64; 12] = [
    0.0, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0, 60.0,
];

fn wait_histogram() -> Histogram {
    Histogram::new(WAIT_BUCKETS)
}

impl FlowMetrics {
    /// A histogram per (tenant, band) of `flows`.
    pub fn new(flows: &switchyard_core::admission::FlowPolicy) -> Self {
        use switchyard_core::admission::{Band, TenantId};
        let family = Family::<FlowLabels, Histogram, fn() -> Histogram>::new_with_constructor(
            wait_histogram,
        );
        let bands = flows.band_count();
        let mut waits = Vec::with_capacity(flows.tenant_count() * bands);
        for t in 0..flows.tenant_count() {
            for b in 0..bands {
                let labels = FlowLabels {
                    tenant: flows.tenant_name(TenantId(t as u16)).to_owned(),
                    band: flows.band_name(Band(b as u8)).to_owned(),
                };
                waits.push(family.get_or_create(&labels).clone());
            }
        }
        Self {
            family,
            waits,
            bands,
        }
    }

    /// Registers the wait histograms.
    pub fn register(&self, registry: &mut Registry) {
        registry.register(
            "switchyard_flow_wait_seconds",
            "Time requests waited in the admission queue before a worker took them, by tenant and priority band",
            self.family.clone(),
        );
    }

    /// A request of `flow` waited `waited_ms` before it was placed.
    pub fn observe_wait(&self, flow: &switchyard_core::admission::Flow, waited_ms: f64) {
        let at = usize::from(flow.tenant.0) * self.bands + usize::from(flow.band.0);
        if let Some(h) = self.waits.get(at) {
            h.observe(waited_ms.max(0.0) / 1e3);
        }
    }
}
