//! `switchyard loadgen`: an OpenAI-API load generator.
//!
//! Replays a trace against any OpenAI-compatible endpoint — the router, a
//! sim-worker, a real engine — streaming every answer, and reports TTFT,
//! inter-token latency, end-to-end latency, throughput, errors, the share
//! of each worker (from `x-switchyard-worker`) and, given the workers'
//! `/metrics`, the engines' prefix hit rate, from each engine's own
//! counters (the sim-worker's, vLLM's, SGLang's:
//! [`switchyard_wire::engine_metrics::PrefixCacheCounters`]); a worker
//! whose counters cannot be read is named in the report, with why.
//!
//! - Mooncake traces (`--trace`, the default is the bundled conversation
//!   trace) become `/v1/completions` requests with token-id prompts
//!   expanded from the hash ids.
//! - ShareGPT (`--sharegpt`, `.jsonl` or `.jsonl.gz`) becomes
//!   `/v1/chat/completions` turns with real text, each turn's prompt being
//!   the conversation so far, sent with `x-session-id`.
//! - The agent workload (`--workload agentic`, the generator `replay
//!   --workload agentic` replays: [`agentic_requests`]) becomes
//!   `/v1/chat/completions` calls whose messages tokenize to the very
//!   prompts `replay` simulates, paced as the simulator paces them
//!   ([`Pacing::Sessions`]).
//!
//! Answers are read with the wire crate's SSE parser and OpenAI types
//! ([`StreamTally`]): tokens are counted per event (a chunk's token ids, or
//! one for a chunk with text), whatever the network's framing, and a
//! stream counts as an error unless it ends with `[DONE]` and no error
//! event.
//! Pacing: closed loop (`--concurrency`), open loop at a fixed rate
//! (`--rate`), open loop at the trace's own timestamps (`--timestamps`,
//! Mooncake: [`Pacing::Arrivals`], the arrival times `replay` uses), or
//! sessions of dependent calls (`--workload agentic`).

use crate::data::Trace;
use crate::stats::{write_json, Latency};
use anyhow::Context as _;
use bytes::Bytes;
use clap::Args;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use serde::Serialize;
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::io::BufRead;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use switchyard_sim::trace::{synthetic_tokens, MooncakeReader};
use switchyard_wire::engine_metrics::PrefixCacheCounters;
use switchyard_wire::openai::completion_tokens;
use switchyard_wire::prometheus::{Scrape, MAX_INPUT_BYTES};
use switchyard_wire::sse::{classify, Chunk, SseParser};

/// Largest streamed event read; a longer one fails the request.
const MAX_EVENT_BYTES: usize = 1 << 20;
use switchyard_sim::workload::agentic::{agent_sessions, AgentSession};
use switchyard_sim::workload::{
    mooncake_slice, AgentVocabulary, AgenticConfig, Session, TraceSlice,
};

/// Built-in workloads `loadgen` can send instead of a trace.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum LoadWorkload {
    /// Agent sessions (`replay --workload agentic`'s): tool calls,
    /// heavy-tailed tool outputs, tool gaps and sub-agents, as chat.
    Agentic,
}

/// Options of `switchyard loadgen`.
#[derive(Debug, Clone, Args)]
pub struct LoadgenArgs {
    /// Base URL of the OpenAI-compatible endpoint, e.g. http://127.0.0.1:8080.
    #[arg(long)]
    pub url: String,
    /// Mooncake trace (JSONL) [default: the bundled conversation trace].
    #[arg(long, conflicts_with = "sharegpt")]
    pub trace: Option<PathBuf>,
    /// A built-in workload instead of a trace. `agentic`: each session's
    /// first call at its arrival, each later call after the previous
    /// answer and its tool gap, sub-agents started together and waited
    /// for, a failed call ending its session (as `replay` does); sent as
    /// chat messages with `x-session-id`. `--max-requests` takes whole
    /// sessions until it is reached.
    #[arg(long, value_enum, conflicts_with_all = ["trace", "sharegpt", "rate", "concurrency", "timestamps", "tenants"])]
    pub workload: Option<LoadWorkload>,
    /// With `--workload agentic`: its parameters (TOML), as `replay
    /// --agentic-config` takes them.
    #[arg(long, requires = "workload")]
    pub agentic_config: Option<PathBuf>,
    /// With `--workload agentic`: its seed, as `replay --seed`.
    #[arg(long, default_value_t = 0, requires = "workload")]
    pub seed: u64,
    /// ShareGPT conversations (JSONL, optionally gzipped): real prompts, turn by turn.
    #[arg(long)]
    pub sharegpt: Option<PathBuf>,
    /// Open loop: requests per second.
    #[arg(long, conflicts_with = "concurrency")]
    pub rate: Option<f64>,
    /// Open loop at the trace's own timestamps (Mooncake only; records
    /// sharing a timestamp are spread over its ~3 s step, as `replay` does).
    #[arg(long, conflicts_with_all = ["rate", "concurrency", "sharegpt"])]
    pub timestamps: bool,
    /// With --timestamps or --workload agentic: arrival-rate multiplier (2
    /// = twice as fast).
    #[arg(long, default_value_t = 1.0)]
    pub rate_scale: f64,
    /// Closed loop: requests in flight [default: 8].
    #[arg(long)]
    pub concurrency: Option<usize>,
    /// Stop after this many requests.
    #[arg(long, default_value_t = 200)]
    pub max_requests: usize,
    /// Cap on each request's output tokens.
    #[arg(long, default_value_t = 64)]
    pub max_output_tokens: u32,
    /// Skip trace records with longer prompts (Mooncake only).
    #[arg(long, default_value_t = 32_000)]
    pub max_prompt_tokens: u32,
    /// Model name to send (omitted by default).
    #[arg(long)]
    pub model: Option<String>,
    /// Non-streaming requests (TTFT then equals e2e).
    #[arg(long)]
    pub no_stream: bool,
    /// A worker's base URL whose /metrics give the prefix hit rate (the
    /// sim-worker's, vLLM's or SGLang's counters); repeat.
    #[arg(long = "worker-metrics")]
    pub worker_metrics: Vec<String>,
    /// Write the figures here as JSON.
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// A tenant mix (`replay --tenants`'s file): each tenant replays its
    /// Mooncake trace (or `--trace`) at its own rate for `--duration`,
    /// with its own key (`key_env`), band (`x-priority`), TTFT budget
    /// (`x-slo-ttft-ms`) and `x-tenant`; figures per tenant.
    #[arg(long, conflicts_with_all = ["sharegpt", "rate", "concurrency", "timestamps"])]
    pub tenants: Option<PathBuf>,
    /// With `--tenants`: seconds of arrivals to send.
    #[arg(long, default_value_t = 60.0, requires = "tenants")]
    pub duration: f64,
}

/// One prepared request.
#[derive(Debug, Clone)]
pub struct PreparedRequest {
    /// `/v1/completions` or `/v1/chat/completions`.
    pub path: &'static str,
    /// The JSON body.
    pub body: Bytes,
    /// Session header, if any.
    pub session: Option<String>,
    /// The index of this session's next turn in the same request list.
    /// Closed-loop pacing sends it from the same slot once this one has
    /// been answered, as a user does (reads the answer, then writes);
    /// open-loop pacing ignores it.
    pub next_turn: Option<usize>,
    /// The tenant that sends it (`--tenants`) and its headers.
    pub tenant: Option<Arc<TenantSend>>,
}

/// How one tenant of a mix sends: its name (for the figures) and the
/// headers each of its requests carries (its key, band, TTFT budget and
/// `x-tenant`).
#[derive(Debug)]
pub struct TenantSend {
    /// The tenant's name.
    pub name: String,
    /// Headers added to each request.
    pub headers: Vec<(hyper::header::HeaderName, hyper::header::HeaderValue)>,
}

/// How the load is offered.
#[derive(Debug, Clone)]
pub enum Pacing {
    /// This many requests in flight.
    Concurrency(usize),
    /// Open loop at this many requests per second.
    Rate(f64),
    /// Open loop: request `i` is sent `arrivals[i]` ms after the start (a
    /// trace's timestamps; requests beyond the list are not sent).
    Arrivals(Arc<[f64]>),
    /// Sessions of dependent calls ([`SessionPlan`]): each session opens
    /// at its arrival (open loop), then sends its calls one after another
    /// ([`PreparedRequest::next_turn`]), each after the previous answer
    /// and its pause; a call's sub-sessions start together when its answer
    /// ends and the next call waits for them all. A failed call ends its
    /// session, as in the simulator.
    Sessions(Arc<SessionPlan>),
}

/// When [`Pacing::Sessions`] sends what: the simulator's schedule
/// (`switchyard_sim::fleet`) for requests that form sessions.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct SessionPlan {
    /// Each session's first request and its arrival, ms from the start,
    /// in arrival order (sub-sessions are not here: their parents start
    /// them).
    pub starts: Vec<(usize, f64)>,
    /// Per request: the pause after its answer (after its sub-sessions,
    /// when it has some) before its session's next call, ms.
    pub pause_ms: Vec<f64>,
    /// Per request: the first requests of the sub-sessions its answer
    /// starts.
    pub spawns: Vec<Vec<usize>>,
}

/// The figures (keys per DESIGN.md "Interfaces").
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    /// Requests sent.
    pub requests: usize,
    /// Requests that failed (non-2xx or broken stream).
    pub errors: usize,
    /// Time to first token, ms.
    pub ttft_ms: Latency,
    /// Between streamed tokens, ms.
    pub itl_ms: Latency,
    /// End to end, ms.
    pub e2e_ms: Latency,
    /// Completed requests per second.
    pub throughput_rps: f64,
    /// Streamed tokens per second.
    pub output_tokens_per_sec: f64,
    /// Engines' prefix hit rate over the run (null without worker metrics,
    /// or when some worker's counters could not be read).
    pub hit_rate: Option<f64>,
    /// Why `hit_rate` is null: no `--worker-metrics`, or each worker whose
    /// prefix-cache counters could not be read, and why.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub hit_rate_unavailable: Option<String>,
    /// Requests per `x-switchyard-worker`.
    pub worker_share: BTreeMap<String, usize>,
    /// Wall time of the run.
    pub wall_seconds: f64,
    /// Open loop: how late each request was sent against its schedule
    /// (null in closed loop).
    pub send_lag_ms: Option<Latency>,
    /// Figures per tenant (`--tenants`; absent otherwise).
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub tenants: BTreeMap<String, TenantReport>,
}

/// What one tenant's requests got.
#[derive(Debug, Clone, Default, Serialize)]
pub struct TenantReport {
    /// Requests sent.
    pub requests: usize,
    /// Requests refused with 429 (shed, or over a limit), answered at once.
    pub shed: usize,
    /// Other failures.
    pub errors: usize,
    /// Time to first token of the completed requests, ms.
    pub ttft_ms: Latency,
    /// Streamed tokens of the completed requests.
    pub output_tokens: u64,
}

/// The samples' figures per tenant.
fn tenant_reports(samples: &[Sample]) -> BTreeMap<String, TenantReport> {
    let mut ttfts: BTreeMap<String, Vec<f64>> = BTreeMap::new();
    let mut out: BTreeMap<String, TenantReport> = BTreeMap::new();
    for s in samples {
        let Some(t) = &s.tenant else {
            continue;
        };
        let r = out.entry(t.name.clone()).or_default();
        r.requests += 1;
        if s.ok {
            ttfts.entry(t.name.clone()).or_default().push(s.ttft_ms);
            r.output_tokens += s.tokens;
        } else if s.status == 429 {
            r.shed += 1;
        } else {
            r.errors += 1;
        }
    }
    for (name, mut samples) in ttfts {
        if let Some(r) = out.get_mut(&name) {
            r.ttft_ms = Latency::of(&mut samples);
        }
    }
    out
}

/// Mooncake records as completion requests; records whose prompt exceeds
/// `max_prompt_tokens` are skipped (an engine would refuse them).
pub fn mooncake_requests(
    trace: &Trace,
    max: usize,
    max_output: u32,
    max_prompt_tokens: u32,
    model: Option<&str>,
) -> anyhow::Result<Vec<PreparedRequest>> {
    let mut out = Vec::new();
    let mut tokens = Vec::new();
    for record in MooncakeReader::new(trace.open()?) {
        let record = record.with_context(|| trace.to_string())?;
        if out.len() >= max {
            break;
        }
        if record.input_length > max_prompt_tokens {
            continue;
        }
        tokens.clear();
        synthetic_tokens(&record.hash_ids, record.input_length as usize, &mut tokens);
        let mut body = json!({
            "prompt": tokens,
            "max_tokens": record.output_length.clamp(1, max_output),
            "stream": true,
        });
        if let Some(m) = model {
            body["model"] = json!(m);
        }
        out.push(PreparedRequest {
            tenant: None,
            path: "/v1/completions",
            body: serde_json::to_vec(&body)?.into(),
            session: None,
            next_turn: None,
        });
    }
    Ok(out)
}

/// One-turn sessions (a [`mooncake_slice`]) as completion requests with
/// their arrival times in ms, for [`Pacing::Arrivals`]: token-id prompts
/// and the sessions' output lengths as `max_tokens`.
pub fn session_requests(
    sessions: &[Session],
    model: Option<&str>,
) -> anyhow::Result<(Vec<PreparedRequest>, Vec<f64>)> {
    let mut requests = Vec::with_capacity(sessions.len());
    let mut arrivals = Vec::with_capacity(sessions.len());
    for s in sessions {
        let [turn] = &s.turns[..] else {
            anyhow::bail!(
                "session {} has {} turns; timed requests are single-turn",
                s.id,
                s.turns.len()
            );
        };
        let mut body = json!({
            "prompt": turn.prompt.tokens(),
            "max_tokens": turn.output_tokens,
            "stream": true,
        });
        if let Some(m) = model {
            body["model"] = json!(m);
        }
        requests.push(PreparedRequest {
            tenant: None,
            path: "/v1/completions",
            body: serde_json::to_vec(&body)?.into(),
            session: None,
            next_turn: None,
        });
        arrivals.push(s.arrival_ms);
    }
    Ok((requests, arrivals))
}

/// A tenant mix's requests in arrival order, with their arrival times in
/// ms: each tenant's trace sliced at its rate for `args.duration`
/// (prompts salted apart per tenant, as `replay --tenants` does), sent
/// with the tenant's headers.
pub fn tenant_requests(
    args: &LoadgenArgs,
    path: &Path,
    trace: Option<&Path>,
) -> anyhow::Result<(Vec<PreparedRequest>, Vec<f64>)> {
    use hyper::header::{HeaderName, HeaderValue};
    anyhow::ensure!(
        args.duration.is_finite() && args.duration > 0.0,
        "--duration must be positive, got {}",
        args.duration
    );
    let mix = crate::tenants::TenantMix::load(path)?;
    let policy = switchyard_core::admission::FlowPolicy::new(mix.flow_config(true))
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    let duration_ms = args.duration * 1e3;
    let mut streams = Vec::with_capacity(mix.tenants.len());
    let mut sends = Vec::with_capacity(mix.tenants.len());
    for (i, tenant) in mix.tenants.iter().enumerate() {
        let trace = Trace::or_bundled(tenant.trace.as_deref().or(trace));
        let slice = TraceSlice {
            requests: args.max_requests,
            max_prompt_tokens: args.max_prompt_tokens,
            max_output_tokens: Some(args.max_output_tokens),
            rate_scale: tenant.rate_scale,
        };
        let sessions =
            mooncake_slice(trace.open()?, &slice).map_err(|e| anyhow::anyhow!("{trace}: {e}"))?;
        let sessions: Vec<_> = sessions
            .into_iter()
            .filter(|s| s.arrival_ms <= duration_ms)
            .map(Ok)
            .collect();
        let flow = mix.session_flow(&policy, i);
        streams.push(switchyard_sim::workload::tenants::for_tenant(
            Box::new(sessions.into_iter()),
            flow,
            i as u64 + 1,
        ));
        let mut headers = vec![(
            HeaderName::from_static("x-tenant"),
            HeaderValue::from_str(&tenant.name)
                .with_context(|| format!("tenant name {:?} as a header", tenant.name))?,
        )];
        if let Some(var) = &tenant.key_env {
            let key = std::env::var(var).with_context(|| {
                format!("tenant {:?}: reading its key from ${var}", tenant.name)
            })?;
            let mut value = HeaderValue::from_str(&format!("Bearer {key}"))
                .with_context(|| format!("tenant {:?}: its key as a header", tenant.name))?;
            value.set_sensitive(true);
            headers.push((hyper::header::AUTHORIZATION, value));
        }
        if let Some(band) = &tenant.band {
            headers.push((
                HeaderName::from_static(switchyard_server::request::flow::BAND_HEADER),
                HeaderValue::from_str(band)?,
            ));
        }
        if let Some(ms) = tenant.slo_ttft_ms {
            headers.push((
                HeaderName::from_static(switchyard_server::request::flow::DEADLINE_HEADER),
                HeaderValue::from(ms),
            ));
        }
        sends.push(Arc::new(TenantSend {
            name: tenant.name.clone(),
            headers,
        }));
    }
    let mut requests = Vec::new();
    let mut arrivals = Vec::new();
    for session in switchyard_sim::workload::tenants::merge(streams) {
        let session = session.map_err(|e| anyhow::anyhow!("{e}"))?;
        let (mut one, times) =
            session_requests(std::slice::from_ref(&session), args.model.as_deref())?;
        let tenant = policy.tenant_name(session.flow.tenant);
        let send = sends.iter().find(|s| s.name == tenant).cloned();
        for r in &mut one {
            r.tenant = send.clone();
        }
        requests.append(&mut one);
        arrivals.extend(times);
    }
    Ok((requests, arrivals))
}

/// ShareGPT conversations as chat turns: sessions are taken 16 at a time
/// and their turns interleaved, so each turn follows its predecessor in the
/// list; each turn names its successor ([`PreparedRequest::next_turn`]), so
/// closed-loop pacing sends a session's turns one after another, never two
/// at once.
pub fn sharegpt_requests(
    path: &Path,
    max: usize,
    max_output: u32,
    model: Option<&str>,
) -> anyhow::Result<Vec<PreparedRequest>> {
    let file = std::fs::File::open(path).with_context(|| format!("opening {}", path.display()))?;
    let reader: Box<dyn BufRead> = if path.extension().is_some_and(|e| e == "gz") {
        Box::new(std::io::BufReader::new(flate2::read::GzDecoder::new(file)))
    } else {
        Box::new(std::io::BufReader::new(file))
    };
    let mut conversations: Vec<(String, Vec<Vec<Value>>)> = Vec::new();
    let mut planned = 0;
    for (n, line) in reader.lines().enumerate() {
        if planned >= max {
            break;
        }
        let line = line?;
        let v: Value = serde_json::from_str(&line)
            .with_context(|| format!("{}:{}: not JSON", path.display(), n + 1))?;
        let id = v["id"]
            .as_str()
            .map_or_else(|| format!("conv-{n}"), str::to_owned);
        let mut messages = Vec::new();
        let mut turns = Vec::new();
        for turn in v["conversations"].as_array().into_iter().flatten() {
            let text = turn["value"].as_str().unwrap_or_default();
            let role = if turn["from"] == "human" {
                "user"
            } else {
                "assistant"
            };
            messages.push(json!({"role": role, "content": text}));
            if role == "user" {
                turns.push(messages.clone());
            }
        }
        planned += turns.len();
        conversations.push((id, turns));
    }
    let mut out: Vec<PreparedRequest> = Vec::new();
    for window in conversations.chunks(16) {
        let longest = window.iter().map(|(_, t)| t.len()).max().unwrap_or(0);
        // Where each session of the window put its latest turn.
        let mut latest: Vec<Option<usize>> = vec![None; window.len()];
        for k in 0..longest {
            for (j, (id, turns)) in window.iter().enumerate() {
                if let Some(messages) = turns.get(k) {
                    if let Some(before) = latest[j] {
                        out[before].next_turn = Some(out.len());
                    }
                    latest[j] = Some(out.len());
                    let mut body =
                        json!({"messages": messages, "max_tokens": max_output, "stream": true});
                    if let Some(m) = model {
                        body["model"] = json!(m);
                    }
                    out.push(PreparedRequest {
                        tenant: None,
                        path: "/v1/chat/completions",
                        body: serde_json::to_vec(&body)?.into(),
                        session: Some(id.clone()),
                        next_turn: None,
                    });
                }
            }
        }
    }
    out.truncate(max);
    for r in &mut out {
        r.next_turn = r.next_turn.filter(|&n| n < max);
    }
    Ok(out)
}

/// Agent sessions — [`agent_sessions`], the generator `replay --workload
/// agentic` renders as token ids — as chat calls, each call's messages
/// [`AgentVocabulary::messages`] (which tokenize to the ids `replay`
/// simulates), with `max_tokens` its answer's length capped at
/// `max_output`, and when to send each ([`SessionPlan`]: arrivals divided
/// by `rate_scale`). Sessions are taken whole, in arrival order, until
/// `max_requests` calls are reached (a session's sub-agents with it);
/// each session's calls follow each other in the list, its sub-agents'
/// after the call that starts them.
pub fn agentic_requests(
    config: AgenticConfig,
    vocabulary: &AgentVocabulary,
    max_requests: usize,
    max_output: u32,
    rate_scale: f64,
    model: Option<&str>,
) -> anyhow::Result<(Vec<PreparedRequest>, SessionPlan)> {
    anyhow::ensure!(
        rate_scale.is_finite() && rate_scale > 0.0,
        "--rate-scale must be positive, got {rate_scale}"
    );
    let mut out = Vec::new();
    let mut plan = SessionPlan::default();
    let taken = agent_sessions_taken(config.clone(), vocabulary, max_requests);
    for session in agent_sessions(config, vocabulary).take(taken) {
        let head =
            push_agent_session(&session, vocabulary, max_output, model, &mut out, &mut plan)?;
        plan.starts.push((head, session.arrival_ms / rate_scale));
    }
    Ok((out, plan))
}

/// How many of the agent workload's sessions [`agentic_requests`] takes
/// for `max_requests` calls: whole sessions, in arrival order, until the
/// calls reach it (the last one may pass it).
pub fn agent_sessions_taken(
    config: AgenticConfig,
    vocabulary: &AgentVocabulary,
    max_requests: usize,
) -> usize {
    let mut calls = 0;
    agent_sessions(config, vocabulary)
        .take_while(|s| {
            let take = calls < max_requests;
            calls += s.total_calls();
            take
        })
        .count()
}

/// Appends `session`'s calls (and its sub-agents', after the call that
/// starts them) to `out` and `plan`; returns its first call's index.
fn push_agent_session(
    session: &AgentSession,
    vocabulary: &AgentVocabulary,
    max_output: u32,
    model: Option<&str>,
    out: &mut Vec<PreparedRequest>,
    plan: &mut SessionPlan,
) -> anyhow::Result<usize> {
    let head = out.len();
    let id = format!("agent-{}", session.id);
    let mut previous: Option<usize> = None;
    for (i, call) in session.calls.iter().enumerate() {
        let messages: Vec<Value> = vocabulary
            .messages(session, i)
            .iter()
            .enumerate()
            .map(|(at, m)| agent_message(at, m))
            .collect();
        let mut body = json!({
            "messages": messages,
            "max_tokens": call.output_tokens.clamp(1, max_output.max(1)),
            "stream": true,
        });
        if let Some(m) = model {
            body["model"] = json!(m);
        }
        let at = out.len();
        if let Some(before) = previous.replace(at) {
            out[before].next_turn = Some(at);
        }
        out.push(PreparedRequest {
            tenant: None,
            path: "/v1/chat/completions",
            body: serde_json::to_vec(&body)?.into(),
            session: Some(id.clone()),
            next_turn: None,
        });
        plan.pause_ms.push(call.pause_ms);
        plan.spawns.push(Vec::new());
        for child in &call.spawn {
            let first = push_agent_session(child, vocabulary, max_output, model, out, plan)?;
            plan.spawns[at].push(first);
        }
    }
    Ok(head)
}

/// An agent session's message `at` (its place in the conversation) as a
/// chat API message: its role and text, and for a tool output the
/// `tool_call_id` the API requires (`call_AT`; SGLang's gateway refuses a
/// tool message without one). Chat templates do not render the id (the
/// bundled Qwen3 one does not), so the prompt's tokens stay the ones the
/// simulator replays.
pub fn agent_message(at: usize, message: &switchyard_tokenizer::ChatMessage) -> Value {
    let mut m = json!({"role": message.role, "content": message.content});
    if message.role == "tool" {
        m["tool_call_id"] = json!(format!("call_{at}"));
    }
    m
}

/// The requests that are no request's [`PreparedRequest::next_turn`], in
/// list order: where closed-loop pacing starts each session.
fn first_turns(requests: &[PreparedRequest]) -> Vec<usize> {
    let mut follows = vec![false; requests.len()];
    for n in requests.iter().filter_map(|r| r.next_turn) {
        if let Some(f) = follows.get_mut(n) {
            *f = true;
        }
    }
    (0..requests.len()).filter(|&i| !follows[i]).collect()
}

/// The load generator's pooled HTTP/1 client.
pub type HttpClient = Client<HttpConnector, Full<Bytes>>;

/// A client with `TCP_NODELAY` and a pool deep enough for any concurrency.
pub fn client() -> HttpClient {
    let mut connector = HttpConnector::new();
    connector.set_nodelay(true);
    Client::builder(hyper_util::rt::TokioExecutor::new())
        .pool_max_idle_per_host(4096)
        .build(connector)
}

#[derive(Default)]
struct Sample {
    ok: bool,
    ttft_ms: f64,
    e2e_ms: f64,
    itl_ms: Vec<f64>,
    tokens: u64,
    worker: Option<String>,
    /// The answer's status (0: none came).
    status: u16,
    tenant: Option<Arc<TenantSend>>,
}

/// Sends `request` to `base` and reads its answer whole; whether it
/// succeeded (a background load's request, not measured).
pub async fn send(client: &HttpClient, base: &str, request: &PreparedRequest) -> bool {
    one(client, base, request, true).await.ok
}

/// One streamed answer's timing: time to first token and each later
/// frame's gap over its tokens, ms; `None` when it failed.
pub(crate) async fn timed(
    client: &HttpClient,
    base: &str,
    request: &PreparedRequest,
) -> Option<(f64, Vec<f64>)> {
    let sample = one(client, base, request, true).await;
    sample.ok.then_some((sample.ttft_ms, sample.itl_ms))
}

async fn one(client: &HttpClient, base: &str, request: &PreparedRequest, stream: bool) -> Sample {
    let started = Instant::now();
    let mut sample = Sample::default();
    let streams = request.body.windows(13).any(|w| w == b"\"stream\":true");
    let body = if stream || !streams {
        request.body.clone()
    } else {
        match serde_json::from_slice::<Value>(&request.body) {
            Ok(mut v) => {
                v["stream"] = json!(false);
                serde_json::to_vec(&v).map(Bytes::from).unwrap_or_default()
            }
            Err(_) => request.body.clone(),
        }
    };
    let mut builder = hyper::Request::post(format!("{base}{}", request.path))
        .header("content-type", "application/json");
    if let Some(s) = &request.session {
        builder = builder.header("x-session-id", s);
    }
    if let Some(t) = &request.tenant {
        sample.tenant = Some(t.clone());
        for (name, value) in &t.headers {
            builder = builder.header(name, value);
        }
    }
    let Ok(http_request) = builder.body(Full::new(body)) else {
        return sample;
    };
    let Ok(response) = client.request(http_request).await else {
        return sample;
    };
    sample.worker = response
        .headers()
        .get("x-switchyard-worker")
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    sample.status = response.status().as_u16();
    let status_ok = response.status().is_success();
    let mut body = response.into_body();
    let mut tally = StreamTally::new(started);
    let mut whole = Vec::new();
    let mut broken = false;
    while let Some(frame) = body.frame().await {
        let Ok(frame) = frame else {
            broken = true;
            break;
        };
        let Some(data) = frame.data_ref() else {
            continue;
        };
        if stream {
            tally.frame(data, Instant::now());
        } else {
            whole.extend_from_slice(data);
        }
    }
    sample.e2e_ms = started.elapsed().as_secs_f64() * 1e3;
    if stream {
        sample.ttft_ms = tally.ttft_ms.unwrap_or(sample.e2e_ms);
        sample.itl_ms = tally.itl_ms;
        sample.tokens = tally.tokens;
        sample.ok = status_ok && !broken && tally.done && !tally.failed;
    } else {
        sample.ttft_ms = sample.e2e_ms;
        sample.tokens = completion_tokens(&whole);
        sample.ok = status_ok && !broken;
    }
    sample
}

/// One streamed answer, read event by event as its frames arrive: the
/// same figures however the network split or joined the events.
#[derive(Debug)]
struct StreamTally {
    parser: SseParser,
    started: Instant,
    /// Arrival of the last frame that carried a token.
    last: Option<Instant>,
    /// Until the first frame with a token.
    ttft_ms: Option<f64>,
    /// One sample per later frame with tokens: its gap over its tokens.
    itl_ms: Vec<f64>,
    tokens: u64,
    /// `[DONE]` arrived.
    done: bool,
    /// An error event, or a stream the parser refused.
    failed: bool,
}

impl StreamTally {
    fn new(started: Instant) -> Self {
        Self {
            parser: SseParser::new(MAX_EVENT_BYTES),
            started,
            last: None,
            ttft_ms: None,
            itl_ms: Vec::new(),
            tokens: 0,
            done: false,
            failed: false,
        }
    }

    /// One network frame, received at `now`.
    fn frame(&mut self, bytes: &[u8], now: Instant) {
        self.parser.push(bytes);
        let mut tokens = 0;
        loop {
            match self.parser.next_event() {
                Ok(Some(data)) => match classify(&data) {
                    Chunk::Delta(delta) => tokens += delta.tokens() as u64,
                    Chunk::Done => self.done = true,
                    Chunk::Error => self.failed = true,
                    Chunk::Unknown => {}
                },
                Ok(None) => break,
                Err(_) => {
                    self.failed = true;
                    break;
                }
            }
        }
        if tokens == 0 {
            return;
        }
        let ms = |d: Duration| d.as_secs_f64() * 1e3;
        match self.last {
            None => self.ttft_ms = Some(ms(now - self.started)),
            Some(last) => self.itl_ms.push(ms(now - last) / tokens as f64),
        }
        self.last = Some(now);
        self.tokens += tokens;
    }
}

/// GETs `url`; the body as text when the status is a success, else `None`.
pub async fn get_text(client: &HttpClient, url: &str) -> Option<String> {
    let request = hyper::Request::get(url)
        .body(Full::new(Bytes::new()))
        .ok()?;
    let response = client.request(request).await.ok()?;
    if !response.status().is_success() {
        return None;
    }
    let body = response.into_body().collect().await.ok()?.to_bytes();
    Some(String::from_utf8_lossy(&body).into_owned())
}

/// How long reading one worker's `/metrics` may take.
const WORKER_METRICS_TIMEOUT: Duration = Duration::from_secs(10);

/// One `--worker-metrics` worker's prefix-cache counters (`None`: its page
/// has none the wire crate recognises), or why its `/metrics` could not be
/// read.
type CounterReading = Result<Option<PrefixCacheCounters>, String>;

/// Reads every worker's prefix-cache counters, in order.
async fn engine_counters(client: &HttpClient, workers: &[String]) -> Vec<CounterReading> {
    let mut readings = Vec::with_capacity(workers.len());
    for worker in workers {
        let url = format!("{}/metrics", worker.trim_end_matches('/'));
        readings.push(
            get_bounded(client, &url)
                .await
                .map(|body| PrefixCacheCounters::read(&Scrape::parse_bytes(&body))),
        );
    }
    readings
}

/// GETs `url` within [`WORKER_METRICS_TIMEOUT`], at most the bytes the
/// Prometheus reader looks at; the body of a success, or why not.
async fn get_bounded(client: &HttpClient, url: &str) -> Result<Bytes, String> {
    let request = hyper::Request::get(url)
        .body(Full::new(Bytes::new()))
        .map_err(|e| format!("not a URL: {e}"))?;
    let fetch = async {
        let response = client
            .request(request)
            .await
            .map_err(|e| format!("cannot read /metrics: {}", error_chain(&e)))?;
        let status = response.status();
        if !status.is_success() {
            return Err(format!("/metrics answered {status}"));
        }
        let body = http_body_util::Limited::new(response.into_body(), MAX_INPUT_BYTES);
        body.collect()
            .await
            .map(|b| b.to_bytes())
            .map_err(|e| format!("cannot read /metrics: {e}"))
    };
    tokio::time::timeout(WORKER_METRICS_TIMEOUT, fetch)
        .await
        .unwrap_or_else(|_| {
            Err(format!(
                "/metrics gave no answer within {WORKER_METRICS_TIMEOUT:?}"
            ))
        })
}

/// An error and its sources, `: `-separated (hyper's own message is only
/// "client error (Connect)").
fn error_chain(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}

/// The engines' prefix hit rate over a run: the growth of their hit
/// counters over that of their queried-token counters, summed over
/// `workers`, from readings `before` and `after` the run. `Err` says why
/// there is none, naming every worker that could not be counted.
fn hit_rate_over(
    workers: &[String],
    before: &[CounterReading],
    after: &[CounterReading],
) -> Result<f64, String> {
    if workers.is_empty() {
        return Err("no --worker-metrics".to_owned());
    }
    let (mut hits, mut queried) = (0.0, 0.0);
    let mut unread = Vec::new();
    for ((worker, before), after) in workers.iter().zip(before).zip(after) {
        let worker = worker.trim_end_matches('/');
        match (before, after) {
            (Err(why), _) | (_, Err(why)) => unread.push(format!("{worker}: {why}")),
            (Ok(_), Ok(None)) => {
                unread.push(format!("{worker}: no prefix-cache counters in /metrics"));
            }
            (Ok(before), Ok(Some(after))) => {
                let (hit0, queried0) = match before {
                    Some(b) if b.family != after.family => {
                        unread.push(format!(
                            "{worker}: its counters changed from {}'s to {}'s names during the run",
                            b.family, after.family
                        ));
                        continue;
                    }
                    Some(b) => (b.hit_tokens, b.queried_tokens),
                    // Counters without a series before the run started at
                    // zero (SGLang's appear at the first request counted).
                    None => (0.0, 0.0),
                };
                if after.hit_tokens < hit0 || after.queried_tokens < queried0 {
                    unread.push(format!(
                        "{worker}: its counters went down during the run (restarted?)"
                    ));
                } else {
                    hits += after.hit_tokens - hit0;
                    queried += after.queried_tokens - queried0;
                }
            }
        }
    }
    if !unread.is_empty() {
        return Err(unread.join("; "));
    }
    if queried <= 0.0 {
        return Err("the engines counted no prompt tokens during the run".to_owned());
    }
    Ok((hits / queried).clamp(0.0, 1.0))
}

/// Runs `requests` against `base` and summarizes.
pub async fn run_load(
    base: &str,
    requests: Vec<PreparedRequest>,
    pacing: Pacing,
    stream: bool,
    worker_metrics: &[String],
    progress: bool,
) -> Report {
    let client = client();
    let base: Arc<str> = base.trim_end_matches('/').into();
    let before = engine_counters(&client, worker_metrics).await;
    let total = requests.len();
    let requests = Arc::new(requests);
    let next = Arc::new(AtomicUsize::new(0));
    let samples = Arc::new(Mutex::new(Vec::with_capacity(total)));
    let started = Instant::now();
    let reporter = progress.then(|| {
        let samples = samples.clone();
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(Duration::from_secs(1)).await;
                let done = samples.lock().map(|s| s.len()).unwrap_or(0);
                eprint!("\rloadgen: {done}/{total} requests");
            }
        })
    });
    let mut tasks = Vec::new();
    let mut send_lag = Vec::new();
    match pacing {
        Pacing::Concurrency(c) => {
            // A slot takes the next session's first turn and sends its
            // later turns itself, each once the one before is answered.
            let heads: Arc<Vec<usize>> = Arc::new(first_turns(&requests));
            for _ in 0..c.max(1) {
                let (client, base, requests, heads, next, samples) = (
                    client.clone(),
                    base.clone(),
                    requests.clone(),
                    heads.clone(),
                    next.clone(),
                    samples.clone(),
                );
                tasks.push(tokio::spawn(async move {
                    while let Some(&head) = heads.get(next.fetch_add(1, Ordering::Relaxed)) {
                        let mut turn = Some(head);
                        while let Some(i) = turn {
                            let Some(request) = requests.get(i) else {
                                break;
                            };
                            let s = one(&client, &base, request, stream).await;
                            samples.lock().unwrap_or_else(|p| p.into_inner()).push(s);
                            // Only forward: a list naming an earlier turn
                            // cannot loop.
                            turn = request.next_turn.filter(|&n| n > i);
                        }
                    }
                }));
            }
        }
        Pacing::Sessions(plan) => {
            let run = Arc::new(SessionRun {
                client: client.clone(),
                base: base.clone(),
                requests: requests.clone(),
                plan: plan.clone(),
                samples: samples.clone(),
                stream,
            });
            for &(head, ms) in &plan.starts {
                let at = started + Duration::from_secs_f64(ms.max(0.0) / 1e3);
                tokio::time::sleep_until(at.into()).await;
                send_lag.push(at.elapsed().as_secs_f64() * 1e3);
                tasks.push(tokio::spawn(send_session(run.clone(), head)));
            }
        }
        Pacing::Rate(_) | Pacing::Arrivals(_) => {
            // When request `i` is due (`None`: not at all).
            let due = |i: usize| match &pacing {
                Pacing::Rate(rate) => {
                    Some(started + Duration::from_secs_f64(i as f64 / rate.max(1e-6)))
                }
                Pacing::Arrivals(arrivals) => arrivals
                    .get(i)
                    .map(|&ms| started + Duration::from_secs_f64(ms.max(0.0) / 1e3)),
                Pacing::Concurrency(_) | Pacing::Sessions(_) => None,
            };
            for i in 0..total {
                let Some(at) = due(i) else {
                    break;
                };
                tokio::time::sleep_until(at.into()).await;
                send_lag.push(at.elapsed().as_secs_f64() * 1e3);
                let (client, base, requests, samples) = (
                    client.clone(),
                    base.clone(),
                    requests.clone(),
                    samples.clone(),
                );
                tasks.push(tokio::spawn(async move {
                    let s = one(&client, &base, &requests[i], stream).await;
                    samples.lock().unwrap_or_else(|p| p.into_inner()).push(s);
                }));
            }
        }
    }
    for t in tasks {
        let _ = t.await;
    }
    if let Some(r) = reporter {
        r.abort();
        eprintln!();
    }
    let wall = started.elapsed().as_secs_f64();
    let after = engine_counters(&client, worker_metrics).await;
    let samples = std::mem::take(&mut *samples.lock().unwrap_or_else(|p| p.into_inner()));
    let mut ttft = Vec::new();
    let mut itl = Vec::new();
    let mut e2e = Vec::new();
    let mut tokens = 0;
    let mut errors = 0;
    let mut share = BTreeMap::new();
    for s in &samples {
        if let Some(w) = &s.worker {
            *share.entry(w.clone()).or_insert(0) += 1;
        }
        if !s.ok {
            errors += 1;
            continue;
        }
        ttft.push(s.ttft_ms);
        e2e.push(s.e2e_ms);
        itl.extend_from_slice(&s.itl_ms);
        tokens += s.tokens;
    }
    let hit_rate = hit_rate_over(worker_metrics, &before, &after);
    Report {
        requests: samples.len(),
        errors,
        throughput_rps: e2e.len() as f64 / wall,
        output_tokens_per_sec: tokens as f64 / wall,
        ttft_ms: Latency::of(&mut ttft),
        itl_ms: Latency::of(&mut itl),
        e2e_ms: Latency::of(&mut e2e),
        hit_rate: hit_rate.as_ref().ok().copied(),
        hit_rate_unavailable: hit_rate.err(),
        worker_share: share,
        wall_seconds: wall,
        send_lag_ms: (!send_lag.is_empty()).then(|| Latency::of(&mut send_lag)),
        tenants: tenant_reports(&samples),
    }
}

/// What every session of a [`Pacing::Sessions`] run shares.
struct SessionRun {
    client: HttpClient,
    base: Arc<str>,
    requests: Arc<Vec<PreparedRequest>>,
    plan: Arc<SessionPlan>,
    samples: Arc<Mutex<Vec<Sample>>>,
    stream: bool,
}

/// Sends the session that opens with request `head`: each call once the
/// previous one is answered, its sub-sessions, and its pause, are over.
fn send_session(
    run: Arc<SessionRun>,
    head: usize,
) -> std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>> {
    Box::pin(async move {
        let mut turn = Some(head);
        while let Some(i) = turn {
            let Some(request) = run.requests.get(i) else {
                break;
            };
            let sample = one(&run.client, &run.base, request, run.stream).await;
            let ok = sample.ok;
            run.samples
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .push(sample);
            if !ok {
                break;
            }
            let children: Vec<_> = run
                .plan
                .spawns
                .get(i)
                .into_iter()
                .flatten()
                .map(|&child| tokio::spawn(send_session(run.clone(), child)))
                .collect();
            for child in children {
                let _ = child.await;
            }
            let pause = run.plan.pause_ms.get(i).copied().unwrap_or(0.0);
            tokio::time::sleep(Duration::from_secs_f64(pause.max(0.0) / 1e3)).await;
            // Only forward: a list naming an earlier call cannot loop.
            turn = request.next_turn.filter(|&n| n > i);
        }
    })
}

/// Prints a report as a few lines.
pub fn print_report(title: &str, r: &Report) {
    let lat = |l: &Latency| {
        format!(
            "mean {:.1} p50 {:.1} p90 {:.1} p99 {:.1}",
            l.mean, l.p50, l.p90, l.p99
        )
    };
    println!("{title}");
    println!(
        "  requests {}  errors {}  wall {:.1} s",
        r.requests, r.errors, r.wall_seconds
    );
    println!("  TTFT ms  {}", lat(&r.ttft_ms));
    println!("  ITL ms   {}", lat(&r.itl_ms));
    println!("  e2e ms   {}", lat(&r.e2e_ms));
    println!(
        "  throughput {:.1} req/s, {:.0} output tokens/s",
        r.throughput_rps, r.output_tokens_per_sec
    );
    match (r.hit_rate, &r.hit_rate_unavailable) {
        (Some(h), _) => println!("  engine prefix hit rate {:.1}%", h * 100.0),
        (None, why) => println!(
            "  engine prefix hit rate: n/a ({})",
            why.as_deref().unwrap_or("no --worker-metrics")
        ),
    }
    if let Some(lag) = &r.send_lag_ms {
        println!(
            "  sent late by ms: p50 {:.2} p99 {:.2} (open loop)",
            lag.p50, lag.p99
        );
    }
    if !r.worker_share.is_empty() {
        let share: Vec<String> = r
            .worker_share
            .iter()
            .map(|(w, n)| format!("{w}={n}"))
            .collect();
        println!("  per-worker share {}", share.join(" "));
    }
    for (name, t) in &r.tenants {
        println!(
            "  tenant {name}: {} requests, {} shed (429), {} errors; TTFT p50 {:.1} p90 {:.1} ms; {} tokens",
            t.requests, t.shed, t.errors, t.ttft_ms.p50, t.ttft_ms.p90, t.output_tokens
        );
    }
}

/// Runs `switchyard loadgen`.
pub fn run(args: LoadgenArgs) -> anyhow::Result<()> {
    anyhow::ensure!(
        args.rate_scale == 1.0 || args.timestamps || args.workload.is_some(),
        "--rate-scale needs --timestamps or --workload"
    );
    let mut arrivals = None;
    let mut sessions = None;
    let requests = match (&args.sharegpt, &args.trace) {
        _ if args.workload == Some(LoadWorkload::Agentic) => {
            let config = crate::agentic::config(args.agentic_config.as_deref(), args.seed)?;
            let vocabulary = crate::agentic::vocabulary()?;
            let (requests, plan) = agentic_requests(
                config,
                &vocabulary,
                args.max_requests,
                args.max_output_tokens,
                args.rate_scale,
                args.model.as_deref(),
            )?;
            sessions = Some(Arc::new(plan));
            requests
        }
        (None, trace) if args.tenants.is_some() => {
            let path = args.tenants.as_deref().expect("matched");
            let (requests, times) = tenant_requests(&args, path, trace.as_deref())?;
            arrivals = Some(times);
            requests
        }
        (None, trace) if args.timestamps => {
            anyhow::ensure!(
                args.rate_scale.is_finite() && args.rate_scale > 0.0,
                "--rate-scale must be positive, got {}",
                args.rate_scale
            );
            let trace = Trace::or_bundled(trace.as_deref());
            let slice = TraceSlice {
                requests: args.max_requests,
                max_prompt_tokens: args.max_prompt_tokens,
                max_output_tokens: Some(args.max_output_tokens),
                rate_scale: args.rate_scale,
            };
            let sessions = mooncake_slice(trace.open()?, &slice)
                .map_err(|e| anyhow::anyhow!("{trace}: {e}"))?;
            let (requests, times) = session_requests(&sessions, args.model.as_deref())?;
            arrivals = Some(times);
            requests
        }
        (Some(path), _) => sharegpt_requests(
            path,
            args.max_requests,
            args.max_output_tokens,
            args.model.as_deref(),
        )?,
        (None, trace) => mooncake_requests(
            &Trace::or_bundled(trace.as_deref()),
            args.max_requests,
            args.max_output_tokens,
            args.max_prompt_tokens,
            args.model.as_deref(),
        )?,
    };
    let pacing = match (sessions, arrivals, args.rate, args.concurrency) {
        (Some(plan), ..) => Pacing::Sessions(plan),
        (None, Some(times), _, _) => Pacing::Arrivals(times.into()),
        (None, None, Some(r), _) if r.is_finite() && r > 0.0 => Pacing::Rate(r),
        (None, None, Some(r), _) => anyhow::bail!("--rate must be positive, got {r}"),
        (None, None, None, c) => Pacing::Concurrency(c.unwrap_or(8)),
    };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    let report = runtime.block_on(run_load(
        &args.url,
        requests,
        pacing,
        !args.no_stream,
        &args.worker_metrics,
        true,
    ));
    print_report(&format!("loadgen against {}", args.url), &report);
    if let Some(path) = &args.json {
        write_json(path, &report)?;
    }
    Ok(())
}

#[cfg(test)]
#[path = "loadgen_tests.rs"]
mod tests;
