//! Prefill/decode disaggregation (`--disagg vllm|sglang`): the sim-worker
//! takes part in vLLM's and SGLang's handshakes over HTTP, moving its
//! engine's captured KV ([`switchyard_engine::lease`]) to a peer that
//! restores it through the restore protocol's rendezvous source.
//!
//! - **vLLM** (`kv_transfer_params`, as vLLM's NixlConnector and its toy
//!   disaggregation proxy use them): a request asking for
//!   `do_remote_decode` is a prefill — one token, then its prompt's KV is
//!   captured under a lease and the answer carries `kv_transfer_params`
//!   naming this worker; a request presenting `do_remote_prefill` is a
//!   decode — it pulls the lease from the named worker, restores it, and
//!   generates. Any worker takes either role, per request.
//! - **SGLang** (`bootstrap_host`, `bootstrap_port`, `bootstrap_room`, sent
//!   to a prefill and a decode worker at once): the prefill worker
//!   (`--disagg-role prefill`) holds the captured KV under the room and
//!   serves it on its bootstrap port; the decode worker (`--disagg-role
//!   decode`) polls that port for the room until the prefill is done or
//!   `--bootstrap-timeout-ms` passes.
//!
//! The KV "bytes" are the prefix's tokens and hashes (a transfer's time is
//! modeled: `--kv-transfer-latency-ms` plus the modeled bytes over
//! `--kv-transfer-bandwidth`, divided by the speed-up as steps are); the
//! handshake, the lease (secret, bounded, expiring, released once) and the
//! failures are real. Parsing and validation are pure ([`plan`]); the
//! transfer client ([`Transfers`]), the releaser and the internal endpoints
//! ([`internal_router`]) are the I/O around them.

use crate::driver::{DriverHandle, RemoteLease};
use crate::metrics::{DisaggFailure, Metrics};
pub use crate::transfer::{LeaseHandle, TransferError};
use axum::body::Bytes;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Json, Router};
use clap::Args;
use serde::Deserialize;
use serde_json::{json, Value};
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::{Duration, Instant};
use switchyard_core::SequenceHash;
use switchyard_engine::lease::LeasedKv;
use tokio::sync::mpsc;

/// `--disagg`: whose protocol the worker speaks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum DisaggProtocol {
    /// vLLM's `kv_transfer_params` (NixlConnector).
    Vllm,
    /// SGLang's bootstrap host, port and room.
    Sglang,
}

/// `--disagg-role` (SGLang): which half this worker serves.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum DisaggRole {
    /// Computes prompts and holds their KV under the room.
    Prefill,
    /// Pulls the room's KV and generates.
    Decode,
}

/// Default `--bootstrap-port`: SGLang's `--disaggregation-bootstrap-port`
/// default.
pub const SGLANG_BOOTSTRAP_PORT: u16 = 8998;

/// The disaggregation flags of `switchyard sim-worker`.
#[derive(Debug, Clone, Args)]
pub struct DisaggArgs {
    /// Take part in this engine's prefill/decode disaggregation protocol
    /// (default: off, every request is served whole).
    #[arg(long, value_enum)]
    pub disagg: Option<DisaggProtocol>,
    /// With `--disagg sglang`: this worker's half (required there; vLLM
    /// workers take the role from each request's `kv_transfer_params`).
    #[arg(long, value_enum)]
    pub disagg_role: Option<DisaggRole>,
    /// With `--disagg sglang --disagg-role prefill`: the bootstrap port
    /// decode workers pull rooms from (0: any free port; it is printed).
    #[arg(long, default_value_t = SGLANG_BOOTSTRAP_PORT)]
    pub bootstrap_port: u16,
    /// Host named to decode workers (`remote_host`; default the listen
    /// address, or 127.0.0.1 when that is unspecified). An IP address.
    #[arg(long)]
    pub advertise_host: Option<IpAddr>,
    /// KV transfer bandwidth between workers, bytes per second (default
    /// 25 GB/s, one 200 Gb/s RDMA NIC's line rate, as `replay --disagg`).
    #[arg(long, default_value_t = 25e9)]
    pub kv_transfer_bandwidth: f64,
    /// Fixed cost of one KV transfer, in model ms (default 1 ms, as
    /// `replay --disagg`).
    #[arg(long, default_value_t = 1.0)]
    pub kv_transfer_latency_ms: f64,
    /// How long a prefill's captured KV waits for its decode worker, in
    /// wall ms; an unreleased lease expires then (default 60 s, as
    /// `replay --disagg`).
    #[arg(long, default_value_t = 60_000)]
    pub lease_ttl_ms: u64,
    /// How long a decode worker waits for the prefill worker to hold the
    /// room, in wall ms (default 30 s).
    #[arg(long, default_value_t = 30_000)]
    pub bootstrap_timeout_ms: u64,
    /// Rooms a prefill worker holds at once; beyond it a capture is
    /// refused and counted (default 1024, the engine's lease bound).
    #[arg(long, default_value_t = 1024)]
    pub max_rooms: usize,
}

/// The validated disaggregation configuration.
#[derive(Clone, Debug, PartialEq)]
pub struct DisaggConfig {
    /// The protocol.
    pub protocol: DisaggProtocol,
    /// SGLang's role (`None` for vLLM).
    pub role: Option<DisaggRole>,
    /// Bootstrap port to bind (SGLang prefill).
    pub bootstrap_port: u16,
    /// Host named to peers.
    pub advertise_host: Option<IpAddr>,
    /// Bytes per second.
    pub bandwidth_bytes_per_s: f64,
    /// Model ms per transfer.
    pub latency_ms: f64,
    /// Lease lifetime, wall ms.
    pub lease_ttl_ms: u64,
    /// Room wait, wall ms.
    pub bootstrap_timeout_ms: u64,
    /// Rooms held at once.
    pub max_rooms: usize,
}

impl DisaggArgs {
    /// The configuration these flags describe (`None`: off), checked.
    pub fn config(&self) -> Result<Option<DisaggConfig>, String> {
        let Some(protocol) = self.disagg else {
            if self.disagg_role.is_some() {
                return Err("--disagg-role needs --disagg sglang".into());
            }
            return Ok(None);
        };
        let role = match (protocol, self.disagg_role) {
            (DisaggProtocol::Vllm, Some(_)) => {
                return Err("--disagg vllm takes each request's role from its \
                            kv_transfer_params; --disagg-role is for sglang"
                    .into())
            }
            (DisaggProtocol::Sglang, None) => {
                return Err("--disagg sglang needs --disagg-role prefill|decode".into())
            }
            (_, role) => role,
        };
        if !(self.kv_transfer_bandwidth.is_finite() && self.kv_transfer_bandwidth > 0.0) {
            return Err(format!(
                "--kv-transfer-bandwidth must be > 0 bytes/s, got {}",
                self.kv_transfer_bandwidth
            ));
        }
        if !(self.kv_transfer_latency_ms.is_finite() && self.kv_transfer_latency_ms >= 0.0) {
            return Err(format!(
                "--kv-transfer-latency-ms must be >= 0, got {}",
                self.kv_transfer_latency_ms
            ));
        }
        if self.lease_ttl_ms == 0 || self.bootstrap_timeout_ms == 0 || self.max_rooms == 0 {
            return Err(
                "--lease-ttl-ms, --bootstrap-timeout-ms and --max-rooms must be > 0".into(),
            );
        }
        Ok(Some(DisaggConfig {
            protocol,
            role,
            bootstrap_port: self.bootstrap_port,
            advertise_host: self.advertise_host,
            bandwidth_bytes_per_s: self.kv_transfer_bandwidth,
            latency_ms: self.kv_transfer_latency_ms,
            lease_ttl_ms: self.lease_ttl_ms,
            bootstrap_timeout_ms: self.bootstrap_timeout_ms,
            max_rooms: self.max_rooms,
        }))
    }
}

impl DisaggConfig {
    /// Model ms to move `bytes`.
    pub fn transfer_ms(&self, bytes: u64) -> f64 {
        self.latency_ms + bytes as f64 / self.bandwidth_bytes_per_s * 1e3
    }

    /// Whether this worker serves SGLang's bootstrap port.
    pub fn serves_bootstrap(&self) -> bool {
        self.role == Some(DisaggRole::Prefill)
    }
}

/// The extra field of `kv_transfer_params` carrying the lease (vLLM's
/// proxies forward the prefill's `kv_transfer_params` whole, so it reaches
/// the decode worker with the rest).
pub const LEASE_FIELD: &str = "switchyard_lease";

/// Where a decode request's KV comes from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Source {
    /// vLLM: a lease on the worker at `peer`.
    Lease {
        /// The prefill worker's HTTP address.
        peer: SocketAddr,
        /// Its lease.
        lease: LeaseHandle,
        /// Its `remote_engine_id` (checked against the pulled KV's).
        engine_id: String,
        /// Its `remote_block_ids` (checked against the pulled KV's).
        block_ids: Vec<u64>,
    },
    /// SGLang: a room on the bootstrap server at `peer`.
    Room {
        /// The prefill worker's bootstrap address.
        peer: SocketAddr,
        /// The room.
        room: u64,
    },
}

impl Source {
    /// The address the pull goes to.
    pub fn peer(&self) -> SocketAddr {
        match self {
            Source::Lease { peer, .. } | Source::Room { peer, .. } => *peer,
        }
    }
}

/// What a request asks of this worker.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Plan {
    /// Served whole.
    Plain,
    /// A prefill for a remote decode: one token, then its KV captured
    /// (held under `room` for SGLang).
    Prefill {
        /// SGLang's room.
        room: Option<u64>,
    },
    /// A decode restoring its prompt's KV from `Source`.
    Decode(Source),
}

/// A malformed disaggregation field: answered 400 with `param`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FieldError {
    /// The offending field.
    pub param: &'static str,
    /// Why (no prompt contents).
    pub message: String,
}

fn field_error(param: &'static str, message: impl Into<String>) -> FieldError {
    FieldError {
        param,
        message: message.into(),
    }
}

/// The body fields the handshakes use (the rest are the OpenAI parser's).
#[derive(Deserialize, Default)]
struct DisaggFields {
    #[serde(default)]
    kv_transfer_params: Option<Value>,
    #[serde(default)]
    bootstrap_host: Option<Value>,
    #[serde(default)]
    bootstrap_port: Option<Value>,
    #[serde(default)]
    bootstrap_room: Option<Value>,
}

/// Longest `remote_engine_id` accepted.
pub const MAX_ENGINE_ID: usize = 128;
/// SGLang's rooms are random 63-bit integers.
pub const MAX_ROOM: u64 = (1 << 63) - 1;

/// What `body` asks of a worker configured with `config`, whose prompts
/// hold at most `max_blocks` blocks. Pure; every field is checked and
/// clamped here, so the I/O after it never sees a bad value.
pub fn plan(config: &DisaggConfig, body: &[u8], max_blocks: usize) -> Result<Plan, FieldError> {
    let fields: DisaggFields = serde_json::from_slice(body).unwrap_or_default();
    match config.protocol {
        DisaggProtocol::Vllm => plan_vllm(fields.kv_transfer_params, max_blocks),
        DisaggProtocol::Sglang => plan_sglang(config, fields),
    }
}

fn plan_vllm(params: Option<Value>, max_blocks: usize) -> Result<Plan, FieldError> {
    const P: &str = "kv_transfer_params";
    let params = match params {
        None | Some(Value::Null) => return Ok(Plan::Plain),
        Some(Value::Object(map)) => map,
        Some(_) => return Err(field_error(P, "kv_transfer_params must be an object")),
    };
    let flag = |name: &str| match params.get(name) {
        None | Some(Value::Null) => Ok(false),
        Some(Value::Bool(b)) => Ok(*b),
        Some(_) => Err(field_error(
            P,
            format!("kv_transfer_params.{name} must be a boolean"),
        )),
    };
    let (remote_decode, remote_prefill) = (flag("do_remote_decode")?, flag("do_remote_prefill")?);
    match (remote_decode, remote_prefill) {
        (false, false) => Ok(Plan::Plain),
        (true, true) => Err(field_error(
            P,
            "kv_transfer_params asks for both do_remote_decode and do_remote_prefill",
        )),
        (true, false) => Ok(Plan::Prefill { room: None }),
        (false, true) => {
            let host = ip_field(
                params.get("remote_host"),
                P,
                "kv_transfer_params.remote_host",
            )?;
            let port = port_field(
                params.get("remote_port"),
                P,
                "kv_transfer_params.remote_port",
            )?;
            let engine_id = match params.get("remote_engine_id") {
                Some(Value::String(s))
                    if !s.is_empty()
                        && s.len() <= MAX_ENGINE_ID
                        && s.bytes().all(|b| b.is_ascii_graphic()) =>
                {
                    s.clone()
                }
                _ => {
                    return Err(field_error(
                        P,
                        format!(
                            "kv_transfer_params.remote_engine_id must be 1 to {MAX_ENGINE_ID} \
                             printable ASCII characters"
                        ),
                    ))
                }
            };
            let block_ids = match params.get("remote_block_ids") {
                Some(Value::Array(ids)) if ids.len() <= max_blocks => ids
                    .iter()
                    .map(Value::as_u64)
                    .collect::<Option<Vec<u64>>>()
                    .ok_or_else(|| {
                        field_error(
                            P,
                            "kv_transfer_params.remote_block_ids must hold unsigned integers",
                        )
                    })?,
                Some(Value::Array(ids)) => {
                    return Err(field_error(
                        P,
                        format!(
                            "kv_transfer_params.remote_block_ids holds {} blocks, more than \
                             a prompt here can ({max_blocks})",
                            ids.len()
                        ),
                    ))
                }
                _ => {
                    return Err(field_error(
                        P,
                        "kv_transfer_params.remote_block_ids must be an array",
                    ))
                }
            };
            let lease = params
                .get(LEASE_FIELD)
                .and_then(Value::as_str)
                .and_then(LeaseHandle::from_wire)
                .ok_or_else(|| {
                    field_error(
                        P,
                        format!(
                            "kv_transfer_params.{LEASE_FIELD} is missing or malformed: this \
                             worker pulls KV only from a Switchyard sim-worker's prefill answer"
                        ),
                    )
                })?;
            Ok(Plan::Decode(Source::Lease {
                peer: SocketAddr::new(host, port),
                lease,
                engine_id,
                block_ids,
            }))
        }
    }
}

fn plan_sglang(config: &DisaggConfig, fields: DisaggFields) -> Result<Plan, FieldError> {
    let room = match fields.bootstrap_room {
        None | Some(Value::Null) => return Ok(Plan::Plain),
        Some(v) => v.as_u64().filter(|&r| r <= MAX_ROOM).ok_or_else(|| {
            field_error(
                "bootstrap_room",
                "bootstrap_room must be an integer from 0 to 2^63-1",
            )
        })?,
    };
    let host = ip_field(
        fields.bootstrap_host.as_ref(),
        "bootstrap_host",
        "bootstrap_host",
    )?;
    let port = port_field(
        fields.bootstrap_port.as_ref(),
        "bootstrap_port",
        "bootstrap_port",
    )?;
    match config.role {
        Some(DisaggRole::Decode) => Ok(Plan::Decode(Source::Room {
            peer: SocketAddr::new(host, port),
            room,
        })),
        _ => Ok(Plan::Prefill { room: Some(room) }),
    }
}

fn ip_field(value: Option<&Value>, param: &'static str, name: &str) -> Result<IpAddr, FieldError> {
    value
        .and_then(Value::as_str)
        .filter(|s| s.len() <= 64)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| field_error(param, format!("{name} must be an IP address")))
}

fn port_field(value: Option<&Value>, param: &'static str, name: &str) -> Result<u16, FieldError> {
    value
        .and_then(Value::as_u64)
        .filter(|p| (1..=65_535).contains(p))
        .map(|p| p as u16)
        .ok_or_else(|| field_error(param, format!("{name} must be a port from 1 to 65535")))
}

/// The `kv_transfer_params` a vLLM prefill answer carries.
pub fn prefill_params(
    host: IpAddr,
    port: u16,
    engine_id: &str,
    request_id: &str,
    lease: LeaseHandle,
    block_ids: &[u64],
) -> Value {
    json!({
        "do_remote_prefill": true,
        "do_remote_decode": false,
        "remote_block_ids": block_ids,
        "remote_engine_id": engine_id,
        "remote_request_id": request_id,
        "remote_host": host.to_string(),
        "remote_port": port,
        "tp_size": 1,
        LEASE_FIELD: lease.to_wire(),
    })
}

/// A pulled capture: the KV, the lease to release, the modeled bytes.
#[derive(Debug)]
pub struct Pulled {
    /// The KV as the engine takes it.
    pub kv: LeasedKv,
    /// Where and what to release when the engine is done with it.
    pub release: RemoteLease,
    /// Modeled bytes moved.
    pub bytes: u64,
}

/// The pull endpoint's answer.
#[derive(Deserialize)]
struct PullAnswer {
    engine_id: String,
    block_size: usize,
    lease: String,
    block_ids: Vec<u64>,
    tokens: Vec<u32>,
}

/// The decode side's client: pulls captures from peers, models the
/// transfer's time, releases leases.
#[derive(Clone)]
pub struct Transfers {
    client: reqwest::Client,
    config: Arc<DisaggConfig>,
    api_key: Option<Arc<str>>,
    block_size: usize,
    max_blocks: usize,
    bytes_per_token: u64,
    /// Wall ms per model ms (0 with `--no-delay`).
    wall_per_model_ms: f64,
    metrics: Arc<Metrics>,
}

impl std::fmt::Debug for Transfers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Transfers").finish_non_exhaustive()
    }
}

/// Longest a single pull or release request may take.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);

impl Transfers {
    /// A client for a worker of `block_size` tokens per block and prompts
    /// of at most `max_blocks` blocks.
    pub fn new(
        config: Arc<DisaggConfig>,
        api_key: Option<&str>,
        block_size: usize,
        max_blocks: usize,
        bytes_per_token: u64,
        wall_per_model_ms: f64,
        metrics: Arc<Metrics>,
    ) -> reqwest::Result<Self> {
        let client = reqwest::Client::builder()
            .timeout(REQUEST_TIMEOUT)
            .connect_timeout(Duration::from_secs(2))
            .build()?;
        Ok(Self {
            client,
            config,
            api_key: api_key.map(Into::into),
            block_size,
            max_blocks,
            bytes_per_token,
            wall_per_model_ms,
            metrics,
        })
    }

    fn post(&self, peer: SocketAddr, path: &str, body: &Value) -> reqwest::RequestBuilder {
        let request = self.client.post(format!("http://{peer}{path}")).json(body);
        match &self.api_key {
            Some(key) => request.bearer_auth(key),
            None => request,
        }
    }

    /// Pulls `source`'s KV: at once for a lease; for a room, polling until
    /// the prefill worker holds it or the bootstrap timeout. Then waits
    /// the modeled transfer time of the blocks beyond the `own_blocks`
    /// this worker caches already (as the simulator charges). Counts the
    /// outcome.
    pub async fn pull(&self, source: &Source, own_blocks: usize) -> Result<Pulled, TransferError> {
        let result = self.pull_uncounted(source, own_blocks).await;
        match &result {
            Ok(pulled) => {
                self.metrics.disagg_transfers.inc();
                self.metrics.disagg_transfer_bytes.inc_by(pulled.bytes);
            }
            Err(err) => self.metrics.count_disagg_failure(err.failure()),
        }
        result
    }

    async fn pull_uncounted(
        &self,
        source: &Source,
        own_blocks: usize,
    ) -> Result<Pulled, TransferError> {
        let body = match source {
            Source::Lease { lease, .. } => json!({ "lease": lease.to_wire() }),
            Source::Room { room, .. } => json!({ "room": room }),
        };
        let deadline = Instant::now() + Duration::from_millis(self.config.bootstrap_timeout_ms);
        let mut backoff = Duration::from_millis(2);
        let answer = loop {
            let response = self
                .post(source.peer(), "/internal/kv/pull", &body)
                .send()
                .await
                .map_err(|e| TransferError::Unreachable(without_url(&e)))?;
            match response.status() {
                StatusCode::OK => break read_capped(response, self.max_answer_bytes()).await?,
                StatusCode::NOT_FOUND if matches!(source, Source::Room { .. }) => {
                    // The prefill may not have reached the room yet.
                    if Instant::now() + backoff > deadline {
                        return Err(TransferError::Timeout);
                    }
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(Duration::from_millis(50));
                }
                StatusCode::NOT_FOUND => return Err(TransferError::UnknownLease),
                status => {
                    return Err(TransferError::Unreachable(format!(
                        "the pull answered HTTP {status}"
                    )))
                }
            }
        };
        let answer: PullAnswer = serde_json::from_slice(&answer)
            // Position only: serde's message may quote the body.
            .map_err(|e| {
                TransferError::Invalid(format!(
                    "unreadable answer (line {}, column {})",
                    e.line(),
                    e.column()
                ))
            })?;
        let lease = LeaseHandle::from_wire(&answer.lease)
            .ok_or_else(|| TransferError::Invalid("malformed lease".into()))?;
        let release = RemoteLease {
            peer: source.peer(),
            lease,
        };
        // From here on the lease is ours: a refused transfer still frees it.
        let checked = self.check(source, &answer);
        if let Err(err) = checked {
            self.release(release).await;
            return Err(err);
        }
        let moved_tokens = answer.block_ids.len().saturating_sub(own_blocks) * self.block_size;
        let bytes = (moved_tokens as u64).saturating_mul(self.bytes_per_token);
        let wall_ms = self.config.transfer_ms(bytes) * self.wall_per_model_ms;
        if wall_ms > 0.0 {
            tokio::time::sleep(Duration::from_secs_f64(wall_ms / 1e3)).await;
        }
        Ok(Pulled {
            kv: LeasedKv {
                hashes: answer.block_ids.into_iter().map(SequenceHash).collect(),
                tokens: answer.tokens,
            },
            release,
            bytes,
        })
    }

    fn max_answer_bytes(&self) -> usize {
        // Up to 11 bytes a token and 21 a block id, plus the envelope.
        self.max_blocks * (self.block_size * 11 + 21) + 4096
    }

    fn check(&self, source: &Source, answer: &PullAnswer) -> Result<(), TransferError> {
        if answer.block_size != self.block_size {
            return Err(TransferError::Invalid(format!(
                "blocks of {} tokens, this worker's hold {}",
                answer.block_size, self.block_size
            )));
        }
        if answer.block_ids.len() > self.max_blocks
            || answer.tokens.len() != answer.block_ids.len() * self.block_size
        {
            return Err(TransferError::Invalid(format!(
                "{} tokens for {} blocks",
                answer.tokens.len(),
                answer.block_ids.len()
            )));
        }
        if let Source::Lease {
            engine_id,
            block_ids,
            ..
        } = source
        {
            if &answer.engine_id != engine_id {
                return Err(TransferError::Invalid(
                    "another engine id than remote_engine_id (the prefill worker restarted?)"
                        .into(),
                ));
            }
            if &answer.block_ids != block_ids {
                return Err(TransferError::Invalid(
                    "other blocks than remote_block_ids".into(),
                ));
            }
        }
        Ok(())
    }

    /// Releases a lease at its peer; a failure is counted (the lease then
    /// expires at the peer's `--lease-ttl-ms`).
    pub async fn release(&self, remote: RemoteLease) {
        let body = json!({ "lease": remote.lease.to_wire() });
        let ok = match self
            .post(remote.peer, "/internal/kv/release", &body)
            .send()
            .await
        {
            Ok(response) => response.status().is_success(),
            Err(_) => false,
        };
        if !ok {
            self.metrics
                .count_disagg_failure(DisaggFailure::ReleaseFailed);
        }
    }

    /// Starts the task that releases the leases the driver is done with;
    /// returns its bounded queue (the driver drops and counts beyond it).
    pub fn spawn_releaser(&self) -> mpsc::Sender<RemoteLease> {
        let (tx, mut rx) = mpsc::channel::<RemoteLease>(1024);
        let transfers = self.clone();
        tokio::spawn(async move {
            while let Some(remote) = rx.recv().await {
                transfers.release(remote).await;
            }
        });
        tx
    }
}

/// A reqwest error's text without its URL (which holds no secret, but the
/// answer need not name the peer's address twice).
fn without_url(err: &reqwest::Error) -> String {
    if err.is_connect() {
        "connection refused or failed".into()
    } else if err.is_timeout() {
        "timed out".into()
    } else {
        "request failed".into()
    }
}

async fn read_capped(
    mut response: reqwest::Response,
    cap: usize,
) -> Result<Vec<u8>, TransferError> {
    let mut body = Vec::new();
    loop {
        match response.chunk().await {
            Ok(Some(chunk)) => {
                if body.len() + chunk.len() > cap {
                    return Err(TransferError::Invalid(format!(
                        "answer larger than {cap} bytes"
                    )));
                }
                body.extend_from_slice(&chunk);
            }
            Ok(None) => return Ok(body),
            Err(e) => return Err(TransferError::Unreachable(without_url(&e))),
        }
    }
}

/// What the internal endpoints need.
#[derive(Clone)]
pub struct InternalState {
    /// The engine's driver.
    pub driver: DriverHandle,
    /// Metrics.
    pub metrics: Arc<Metrics>,
    /// This worker's engine id.
    pub engine_id: Arc<str>,
    /// Tokens per block.
    pub block_size: usize,
}

/// `POST /internal/kv/pull` and `POST /internal/kv/release`: the prefill
/// side of a transfer. Authenticated by the lease's secret (or, for
/// SGLang, by the room: 63 random bits chosen by the router, taken at most
/// once), and by `--api-key` when the worker has one.
pub fn internal_router(state: InternalState) -> Router {
    Router::new()
        .route("/internal/kv/pull", post(pull))
        .route("/internal/kv/release", post(release))
        .with_state(state)
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct PullRequest {
    #[serde(default)]
    lease: Option<String>,
    #[serde(default)]
    room: Option<u64>,
}

fn internal_error(status: StatusCode, message: &str) -> Response {
    (status, Json(json!({ "error": message }))).into_response()
}

async fn pull(State(state): State<InternalState>, body: Bytes) -> Response {
    let request: Option<PullRequest> = serde_json::from_slice(&body).ok();
    let is_room = matches!(&request, Some(PullRequest { room: Some(_), .. }));
    let pulled = match request {
        Some(PullRequest {
            lease: Some(lease),
            room: None,
        }) => match LeaseHandle::from_wire(&lease) {
            Some(handle) => state
                .driver
                .read_lease(handle.0)
                .await
                .map(|kv| kv.ok().map(|kv| (handle.0, kv))),
            None => Some(None),
        },
        Some(PullRequest {
            lease: None,
            room: Some(room),
        }) => state.driver.take_room(room).await,
        _ => {
            state
                .metrics
                .count_disagg_failure(DisaggFailure::InvalidParams);
            return internal_error(
                StatusCode::BAD_REQUEST,
                "expected {\"lease\": \"ID.TOKEN\"} or {\"room\": N}",
            );
        }
    };
    match pulled {
        None => internal_error(StatusCode::SERVICE_UNAVAILABLE, "the engine has stopped"),
        Some(None) => {
            // A room not held yet is the normal wait of SGLang's decode
            // (it polls; its timeout is counted there), not a refusal.
            if !is_room {
                state.metrics.disagg_pulls_unknown.inc();
            }
            internal_error(StatusCode::NOT_FOUND, "no such lease or room")
        }
        Some(Some((lease, kv))) => {
            state.metrics.disagg_pulls_served.inc();
            Json(json!({
                "engine_id": &*state.engine_id,
                "block_size": state.block_size,
                "lease": LeaseHandle(lease).to_wire(),
                "block_ids": kv.hashes.iter().map(|h| h.0).collect::<Vec<u64>>(),
                "tokens": kv.tokens,
            }))
            .into_response()
        }
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ReleaseRequest {
    lease: String,
}

async fn release(State(state): State<InternalState>, body: Bytes) -> Response {
    let Some(handle) = serde_json::from_slice::<ReleaseRequest>(&body)
        .ok()
        .and_then(|r| LeaseHandle::from_wire(&r.lease))
    else {
        state
            .metrics
            .count_disagg_failure(DisaggFailure::InvalidParams);
        return internal_error(
            StatusCode::BAD_REQUEST,
            "expected {\"lease\": \"ID.TOKEN\"}",
        );
    };
    match state.driver.release_lease(handle.0).await {
        None => internal_error(StatusCode::SERVICE_UNAVAILABLE, "the engine has stopped"),
        Some(Err(_)) => internal_error(StatusCode::NOT_FOUND, "no such lease"),
        Some(Ok(())) => StatusCode::NO_CONTENT.into_response(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use switchyard_engine::lease::{LeaseId, LeaseRef};

    fn config(protocol: DisaggProtocol, role: Option<DisaggRole>) -> DisaggConfig {
        DisaggConfig {
            protocol,
            role,
            bootstrap_port: SGLANG_BOOTSTRAP_PORT,
            advertise_host: None,
            bandwidth_bytes_per_s: 25e9,
            latency_ms: 1.0,
            lease_ttl_ms: 60_000,
            bootstrap_timeout_ms: 30_000,
            max_rooms: 16,
        }
    }

    fn vllm(body: Value) -> Result<Plan, FieldError> {
        plan(
            &config(DisaggProtocol::Vllm, None),
            body.to_string().as_bytes(),
            8,
        )
    }

    fn decode_params() -> Value {
        json!({
            "do_remote_prefill": true,
            "do_remote_decode": false,
            "remote_block_ids": [1, 2],
            "remote_engine_id": "e",
            "remote_request_id": "r",
            "remote_host": "127.0.0.1",
            "remote_port": 8100,
            "tp_size": 1,
            LEASE_FIELD: format!("7.{:032x}", 0xabcu128),
        })
    }

    #[test]
    fn a_lease_handle_round_trips_and_refuses_anything_else() {
        let handle = LeaseHandle(LeaseRef {
            id: LeaseId(42),
            token: u128::MAX - 5,
        });
        assert_eq!(LeaseHandle::from_wire(&handle.to_wire()), Some(handle));
        for bad in [
            "",
            "42",
            "42.",
            ".ff",
            "x.00000000000000000000000000000000",
            "1.zz",
        ] {
            assert_eq!(LeaseHandle::from_wire(bad), None, "{bad:?}");
        }
        assert!(!format!("{handle:?}").contains("fffffff"));
    }

    #[test]
    fn vllm_requests_take_their_role_from_kv_transfer_params() {
        assert_eq!(vllm(json!({"prompt": "x"})), Ok(Plan::Plain));
        assert_eq!(vllm(json!({"kv_transfer_params": null})), Ok(Plan::Plain));
        let prefill = json!({"kv_transfer_params": {
            "do_remote_decode": true, "do_remote_prefill": false,
            "remote_engine_id": null, "remote_block_ids": null,
            "remote_host": null, "remote_port": null,
        }});
        assert_eq!(vllm(prefill), Ok(Plan::Prefill { room: None }));
        let Ok(Plan::Decode(Source::Lease {
            peer,
            lease,
            engine_id,
            block_ids,
        })) = vllm(json!({ "kv_transfer_params": decode_params() }))
        else {
            panic!("a decode")
        };
        assert_eq!(peer, "127.0.0.1:8100".parse().unwrap());
        assert_eq!((lease.0.id, lease.0.token), (LeaseId(7), 0xabc));
        assert_eq!((engine_id.as_str(), block_ids), ("e", vec![1, 2]));
    }

    #[test]
    fn malformed_kv_transfer_params_are_refused_with_the_field() {
        let with = |key: &str, value: Value| {
            let mut params = decode_params();
            params[key] = value;
            vllm(json!({ "kv_transfer_params": params }))
        };
        for (key, value) in [
            ("remote_host", json!("example.com")),
            ("remote_host", json!(5)),
            ("remote_port", json!(0)),
            ("remote_port", json!(70_000)),
            ("remote_port", json!("8100")),
            ("remote_engine_id", json!("")),
            ("remote_engine_id", json!("x".repeat(129))),
            ("remote_block_ids", json!([1, -2])),
            ("remote_block_ids", json!(vec![0; 9])),
            ("remote_block_ids", json!(null)),
            (LEASE_FIELD, json!("7.abc")),
            ("do_remote_prefill", json!("yes")),
            ("do_remote_decode", json!(true)),
        ] {
            let refused = with(key, value.clone());
            assert!(
                matches!(&refused, Err(e) if e.param == "kv_transfer_params"),
                "{key} = {value}: {refused:?}"
            );
        }
        assert!(vllm(json!({"kv_transfer_params": [1]})).is_err());
    }

    #[test]
    fn sglang_requests_take_their_role_from_the_worker() {
        let body = json!({"bootstrap_host": "127.0.0.1", "bootstrap_port": 8998,
                          "bootstrap_room": MAX_ROOM})
        .to_string();
        let prefill = config(DisaggProtocol::Sglang, Some(DisaggRole::Prefill));
        let decode = config(DisaggProtocol::Sglang, Some(DisaggRole::Decode));
        assert_eq!(
            plan(&prefill, body.as_bytes(), 8),
            Ok(Plan::Prefill {
                room: Some(MAX_ROOM)
            })
        );
        assert_eq!(
            plan(&decode, body.as_bytes(), 8),
            Ok(Plan::Decode(Source::Room {
                peer: "127.0.0.1:8998".parse().unwrap(),
                room: MAX_ROOM
            }))
        );
        assert_eq!(plan(&decode, b"{\"prompt\": \"x\"}", 8), Ok(Plan::Plain));
        for bad in [
            json!({"bootstrap_host": "127.0.0.1", "bootstrap_port": 8998, "bootstrap_room": -1}),
            json!({"bootstrap_host": "127.0.0.1", "bootstrap_port": 8998,
                   "bootstrap_room": 1u64 << 63}),
            json!({"bootstrap_host": "127.0.0.1", "bootstrap_port": 8998, "bootstrap_room": [1]}),
            json!({"bootstrap_host": "h", "bootstrap_port": 8998, "bootstrap_room": 1}),
            json!({"bootstrap_host": "127.0.0.1", "bootstrap_port": 0, "bootstrap_room": 1}),
            json!({"bootstrap_room": 1}),
        ] {
            assert!(
                plan(&decode, bad.to_string().as_bytes(), 8).is_err(),
                "{bad}"
            );
        }
    }

    #[test]
    fn flags_are_validated_before_the_worker_starts() {
        use clap::Parser;
        #[derive(Parser)]
        struct Cli {
            #[command(flatten)]
            args: DisaggArgs,
        }
        let config = |flags: &[&str]| {
            Cli::try_parse_from(std::iter::once("w").chain(flags.iter().copied()))
                .unwrap()
                .args
                .config()
        };
        assert_eq!(config(&[]), Ok(None));
        assert!(config(&["--disagg", "sglang"]).is_err());
        assert!(config(&["--disagg", "vllm", "--disagg-role", "prefill"]).is_err());
        assert!(config(&["--disagg-role", "decode"]).is_err());
        assert!(config(&["--disagg", "vllm", "--kv-transfer-bandwidth", "0"]).is_err());
        assert!(config(&["--disagg", "vllm", "--lease-ttl-ms", "0"]).is_err());
        let on = config(&["--disagg", "sglang", "--disagg-role", "decode"])
            .unwrap()
            .unwrap();
        assert_eq!(on.bootstrap_port, 8998);
        // 1 ms plus 25 MB over 25 GB/s.
        assert!((on.transfer_ms(25_000_000) - 2.0).abs() < 1e-9);
    }
}
