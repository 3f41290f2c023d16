//! What a fleet simulation is configured with: the fleet and its router
//! replicas ([`FleetConfig`]), and prefill/decode disaggregation over a link
//! ([`DisaggConfig`], [`TransferConfig`]), each validated.

use crate::replicas::{replica_seed, ReplicasConfig};
use serde::{Deserialize, Serialize};
use switchyard_core::admission::{AdmissionConfig, SessionAwareConfig};
use switchyard_core::dispatch::failure::MigrationPolicy;
use switchyard_core::dispatch::DispatcherConfig;
use switchyard_core::estimate::{EstimatorConfig, PeerTransferModel};
use switchyard_core::router::RouterConfig;
use switchyard_engine::EngineConfig;

/// Prefill/decode disaggregation of a fleet.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DisaggConfig {
    /// Workers `0..prefill_workers` prefill; the rest decode.
    pub prefill_workers: usize,
    /// The link KV moves over.
    pub transfer: TransferConfig,
    /// How long a captured prefix is held for its decode worker
    /// (simulated ms); a lease not released by then expires.
    pub lease_ttl_ms: f64,
}

impl Default for DisaggConfig {
    fn default() -> Self {
        Self {
            prefill_workers: 1,
            transfer: TransferConfig::default(),
            lease_ttl_ms: 60_000.0,
        }
    }
}

/// The link between workers: a transfer of `b` bytes takes `latency_ms +
/// b / bandwidth` model milliseconds (divided by the engines' speed-up in
/// wall time, as their steps are).
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TransferConfig {
    /// Bytes per second. Default 25 GB/s: the line rate of one 200 Gb/s
    /// RDMA NIC (an assumption about the hardware, not a measurement).
    pub bandwidth_bytes_per_s: f64,
    /// Fixed cost per transfer, in ms. Default 1 ms: an assumption for the
    /// handshake and the completion notice, not a measurement.
    pub latency_ms: f64,
}

impl Default for TransferConfig {
    fn default() -> Self {
        Self {
            bandwidth_bytes_per_s: 25e9,
            latency_ms: 1.0,
        }
    }
}

impl TransferConfig {
    /// Checks ranges.
    pub fn validate(&self) -> Result<(), String> {
        if !(self.bandwidth_bytes_per_s.is_finite() && self.bandwidth_bytes_per_s > 0.0) {
            return Err(format!(
                "transfer bandwidth must be > 0 bytes/s, got {}",
                self.bandwidth_bytes_per_s
            ));
        }
        if !(self.latency_ms.is_finite() && self.latency_ms >= 0.0) {
            return Err(format!(
                "transfer latency must be >= 0 ms, got {}",
                self.latency_ms
            ));
        }
        Ok(())
    }

    /// Model milliseconds to move `bytes`.
    pub fn transfer_ms(&self, bytes: u64) -> f64 {
        self.latency_ms + bytes as f64 / self.bandwidth_bytes_per_s * 1e3
    }
}

impl DisaggConfig {
    /// Checks it against a fleet of `workers`.
    pub fn validate(&self, workers: usize) -> Result<(), String> {
        if self.prefill_workers == 0 || self.prefill_workers >= workers {
            return Err(format!(
                "{} prefill workers in a fleet of {workers}: at least one of each role is needed",
                self.prefill_workers
            ));
        }
        self.transfer.validate()?;
        if !(self.lease_ttl_ms.is_finite() && self.lease_ttl_ms > 0.0) {
            return Err(format!(
                "the lease ttl must be > 0 ms, got {}",
                self.lease_ttl_ms
            ));
        }
        Ok(())
    }
}

/// One fleet and its router replicas.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct FleetConfig {
    /// Simulated workers.
    pub workers: usize,
    /// Every worker's engine.
    pub engine: EngineConfig,
    /// Every replica's router (its block size is forced to the engine's).
    pub router: RouterConfig,
    /// Delay from an engine emitting a KV event to the routers applying it.
    pub kv_event_delay_ms: f64,
    /// Fit each worker's prefill-duration hints online from observed times
    /// to first token, as `serve` does (the model itself is always the
    /// engines' timing model).
    pub online_prefill_fit: bool,
    /// Width of the per-worker load timeline buckets.
    pub timeline_bucket_ms: f64,
    /// Per-tenant figures also count the tokens served up to this time
    /// (the end of the arrivals, while every tenant still sends); `None`:
    /// no window.
    pub tenant_window_ms: Option<f64>,
    /// The policy queue.
    pub admission: AdmissionConfig,
    /// Session-aware admission (multi-turn sessions); `None`: no strategy.
    pub session_aware: Option<SessionAwareConfig>,
    /// Router replicas, their sync and the load balancer in front of them.
    pub replicas: ReplicasConfig,
    /// Prefill/decode disaggregation; `None`: every worker does both.
    pub disagg: Option<DisaggConfig>,
    /// Peer prefix restore in an aggregated fleet, over this link: the
    /// `ttft` policy may place a request on a worker together with a
    /// restore of the prompt's longest cached prefix from the worker
    /// holding it, when the transfer and the rest beat waiting (the
    /// router's estimator gets the same link). `None`: off.
    pub peer_restore: Option<TransferConfig>,
    /// With hybrid engines: the routers skip the engines' SSM-checkpoint
    /// events and credit each worker's whole attention prefix, as a router
    /// that does not know hybrid models does. `false`: they credit a
    /// hybrid worker only up to its deepest checkpoint.
    pub attention_only_routing: bool,
    /// LoRA adapters: each session asks for one of a mix, each engine
    /// holds a few ([`crate::adapters`]); `None`: base model only. The
    /// routers' adapter affinity is `router.adapters` (`blind` for
    /// adapter-blind routing).
    pub adapters: Option<crate::adapters::AdapterMix>,
    /// Attention data parallelism: every worker holds this many ranks,
    /// each its own engine, routed rank-aware or rank-blind
    /// ([`super::DpConfig`]); `None`: one engine per worker.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub dp: Option<super::DpConfig>,
    /// Workers that fail during the run ([`super::WorkerFailure`]); empty:
    /// none.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub failures: Vec<super::WorkerFailure>,
    /// What a failed request may become (moved, resumed, given up): the
    /// same limits as `serve`'s, and its defaults.
    #[serde(skip_serializing_if = "MigrationPolicy::is_default")]
    pub migration: MigrationPolicy,
    /// Every multi-turn session is a Responses API chain: each later turn
    /// continues the response its previous turn stored, which only the
    /// worker that answered it holds, so the turn may go there and nowhere
    /// else (the core's response affinity, as `serve` routes a
    /// `previous_response_id`); a turn whose previous response is not
    /// known (forgotten, or its worker's) ends in an error.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub responses_chain: bool,
}

impl Default for FleetConfig {
    fn default() -> Self {
        Self {
            workers: 8,
            engine: EngineConfig::default(),
            router: RouterConfig::default(),
            kv_event_delay_ms: 10.0,
            online_prefill_fit: false,
            timeline_bucket_ms: 10_000.0,
            tenant_window_ms: None,
            admission: AdmissionConfig::default(),
            session_aware: None,
            replicas: ReplicasConfig::default(),
            disagg: None,
            peer_restore: None,
            attention_only_routing: false,
            adapters: None,
            dp: None,
            failures: Vec::new(),
            migration: MigrationPolicy::default(),
            responses_chain: false,
        }
    }
}

impl FleetConfig {
    /// The dispatcher settings of replica `index`: the router with the
    /// engine's block size and the replica's seed, and prefill hints from
    /// the engines' own timing model (their prefill polynomial, batch
    /// budget, host-tier restore cost and speed-up).
    pub fn dispatcher(&self, index: usize) -> DispatcherConfig {
        let mut router = RouterConfig {
            seed: replica_seed(self.router.seed, index),
            ..self.router
        };
        router.sequences.block_size = self.engine.block_size as u32;
        let timing = &self.engine.timing;
        if let Some(mix) = &self.adapters {
            // The routers price a load in wall ms, as everything else.
            router.adapters.load_ms = timing.wall_ms(mix.load_ms);
        }
        DispatcherConfig {
            router,
            admission: self.admission.clone(),
            estimator: EstimatorConfig {
                prefill_curve: timing.prefill,
                decode_curve: timing.decode,
                decode_floor_ms: timing.decode_floor_ms,
                decode_per_sequence_ms: timing.decode_per_sequence_ms,
                chunk_tokens: self.engine.max_num_batched_tokens.max(1) as u32,
                restore_ms_per_token: timing.restore_ms_per_token(),
                speedup: timing.speedup,
                online: self.online_prefill_fit,
                peer_transfer: self.peer_restore.map(|t| PeerTransferModel {
                    latency_ms: t.latency_ms,
                    ms_per_token: timing.bytes_per_token as f64 / t.bandwidth_bytes_per_s * 1e3,
                }),
                ..EstimatorConfig::default()
            },
            ..DispatcherConfig::default()
        }
    }
}
