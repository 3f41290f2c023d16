//! The sim-worker's Prometheus metrics (names as in DESIGN.md "Interfaces"),
//! in a `prometheus-client` registry that `/metrics` encodes.
//!
//! The driver copies the engine's counters and gauges after every step
//! ([`Metrics::observe`]); `/metrics` reads them without locking the
//! engine. The engine's own counters only grow, so each is mirrored into
//! its Prometheus counter by adding what it grew since the last copy (the
//! driver is the only writer).

use prometheus_client::encoding::prometheus_text;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use std::sync::atomic::AtomicU64;
use switchyard_engine::{DeviceLayer, Engine};

/// The `Content-Type` of [`Metrics::encode`]'s text.
pub const CONTENT_TYPE: &str = prometheus_text::CONTENT_TYPE;

/// How a request left the engine: the `status` label of
/// `switchyard_engine_requests_total`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RequestOutcome {
    /// Generated up to its length.
    Finished,
    /// Cancelled (its client hung up).
    Cancelled,
    /// Its host-tier restore failed.
    RestoreFailed,
    /// Refused at admission.
    Rejected,
}

impl RequestOutcome {
    /// Every outcome, in declaration order (an index is `as usize`).
    pub const ALL: [RequestOutcome; 4] = [
        RequestOutcome::Finished,
        RequestOutcome::Cancelled,
        RequestOutcome::RestoreFailed,
        RequestOutcome::Rejected,
    ];

    /// Its `status` label.
    pub fn label(self) -> &'static str {
        match self {
            RequestOutcome::Finished => "finished",
            RequestOutcome::Cancelled => "cancelled",
            RequestOutcome::RestoreFailed => "restore_failed",
            RequestOutcome::Rejected => "rejected",
        }
    }
}

/// Why a disaggregation step failed: the `reason` label of
/// `switchyard_engine_disagg_failures_total`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DisaggFailure {
    /// A request's `kv_transfer_params` or bootstrap fields (or an
    /// internal endpoint's body) were malformed.
    InvalidParams,
    /// A pull named a lease or room its worker does not hold.
    UnknownLease,
    /// The prefill worker could not be reached.
    Unreachable,
    /// The room did not become ready within `--bootstrap-timeout-ms`.
    Timeout,
    /// The pulled transfer did not fit (engine id, block size, blocks).
    InvalidTransfer,
    /// A prefill's capture was refused (the lease table is full).
    CaptureRefused,
    /// A prefill's prompt was shorter than one block: nothing to move.
    NothingCached,
    /// A room was already held.
    RoomConflict,
    /// `--max-rooms` rooms were held.
    RoomsFull,
    /// A remote lease's release failed (it expires at its worker).
    ReleaseFailed,
    /// A remote lease's release was dropped: the release queue was full.
    ReleaseDropped,
}

impl DisaggFailure {
    /// Every reason, in declaration order (an index is `as usize`).
    pub const ALL: [DisaggFailure; 11] = [
        DisaggFailure::InvalidParams,
        DisaggFailure::UnknownLease,
        DisaggFailure::Unreachable,
        DisaggFailure::Timeout,
        DisaggFailure::InvalidTransfer,
        DisaggFailure::CaptureRefused,
        DisaggFailure::NothingCached,
        DisaggFailure::RoomConflict,
        DisaggFailure::RoomsFull,
        DisaggFailure::ReleaseFailed,
        DisaggFailure::ReleaseDropped,
    ];

    /// Its `reason` label.
    pub fn label(self) -> &'static str {
        match self {
            DisaggFailure::InvalidParams => "invalid_params",
            DisaggFailure::UnknownLease => "unknown_lease",
            DisaggFailure::Unreachable => "unreachable",
            DisaggFailure::Timeout => "timeout",
            DisaggFailure::InvalidTransfer => "invalid_transfer",
            DisaggFailure::CaptureRefused => "capture_refused",
            DisaggFailure::NothingCached => "nothing_cached",
            DisaggFailure::RoomConflict => "room_conflict",
            DisaggFailure::RoomsFull => "rooms_full",
            DisaggFailure::ReleaseFailed => "release_failed",
            DisaggFailure::ReleaseDropped => "release_dropped",
        }
    }
}

/// The `event` labels of `switchyard_engine_leases_total`, in the order
/// of [`Metrics::observe`]'s copy.
const LEASE_LABELS: [&str; 5] = [
    "captured",
    "released",
    "expired",
    "refused_full",
    "refused_unknown",
];

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ReasonLabels {
    reason: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct EventLabels {
    event: &'static str,
}

/// The `decision` labels of `switchyard_engine_restores_total`, in the
/// order of [`Metrics::observe`]'s copy.
const RESTORE_LABELS: [&str; 7] = [
    "no_reusable_entry",
    "sequence_capacity_not_ready",
    "native_restore_skipped",
    "retained_source_lost",
    "request_state_not_ready",
    "restored",
    "failed",
];

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct StatusLabels {
    status: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct DecisionLabels {
    decision: &'static str,
}

type CountGauge = Gauge<u64, AtomicU64>;

/// The registry and handles into each of its metrics.
#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    kv_usage: Gauge<f64, AtomicU64>,
    prompt_tokens: Counter,
    prefix_hit_tokens: Counter,
    generation_tokens: Counter,
    preemptions: Counter,
    kept_out: Counter,
    prefix_in_flight_waits: Counter,
    spills: Counter,
    spill_loads: Counter,
    spill_drops: Counter,
    spill_fallbacks: Counter,
    slot_compactions: Counter,
    logits_bytes: Counter,
    steps: Counter,
    running: CountGauge,
    waiting: CountGauge,
    cached_blocks: CountGauge,
    host_blocks: CountGauge,
    paced_seconds: Counter<f64, AtomicU64>,
    pacing_dropped_seconds: Counter<f64, AtomicU64>,
    pacing_resyncs: Counter,
    /// Indexed like `RESTORE_LABELS`.
    restores: [Counter; RESTORE_LABELS.len()],
    /// Indexed by `RequestOutcome as usize`.
    requests: [Counter; RequestOutcome::ALL.len()],
    /// Indexed like `LEASE_LABELS`.
    leases: [Counter; LEASE_LABELS.len()],
    leases_held: CountGauge,
    /// Indexed by `DisaggFailure as usize`.
    disagg_failures: [Counter; DisaggFailure::ALL.len()],
    /// Prefill captures handed to a remote decode.
    pub disagg_captures: Counter,
    /// KV transfers a decode pulled and delivered.
    pub disagg_transfers: Counter,
    /// Modeled bytes of those transfers.
    pub disagg_transfer_bytes: Counter,
    /// Pulls this worker served.
    pub disagg_pulls_served: Counter,
    /// Pulls this worker refused (no such lease or room, or a wrong token).
    pub disagg_pulls_unknown: Counter,
    /// KV events emitted.
    pub kv_events: Counter,
    /// KV events dropped because the publisher lagged or failed.
    pub kv_events_dropped: Counter,
    /// KV-event batches published over ZMQ.
    pub kv_batches_published: Counter,
    /// LoRA adapters loaded (`/v1/load_lora_adapter`, `--lora-modules`).
    pub lora_loads: Counter,
    /// LoRA adapters unloaded (`/v1/unload_lora_adapter`).
    pub lora_unloads: Counter,
    /// Loads refused (bad body, already loaded, LoRA off).
    pub lora_load_failures: Counter,
    /// Adapters evicted (least recently used) to make room for a load.
    pub lora_evictions: Counter,
    /// Adapters loaded now.
    pub lora_adapters: Gauge,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    /// Every series registered, at zero.
    pub fn new() -> Self {
        let mut registry = Registry::default();
        let kv_usage = Gauge::<f64, AtomicU64>::default();
        registry.register(
            "switchyard_engine_kv_usage_ratio",
            "Used over total device KV blocks",
            kv_usage.clone(),
        );
        let mut counter = |name: &str, help: &str| {
            let c = Counter::default();
            registry.register(name, help, c.clone());
            c
        };
        let prompt_tokens = counter("switchyard_engine_prompt_tokens", "Prompt tokens admitted");
        let prefix_hit_tokens = counter(
            "switchyard_engine_prefix_hit_tokens",
            "Prompt tokens served from the prefix cache",
        );
        let generation_tokens = counter(
            "switchyard_engine_generation_tokens",
            "Output tokens generated",
        );
        let preemptions = counter(
            "switchyard_engine_preemptions",
            "Requests preempted (recompute and spill)",
        );
        let kept_out = counter(
            "switchyard_engine_kept_out",
            "Running sequences kept out of a step because their KV reservation answered Exhausted (once per sequence and step)",
        );
        let prefix_in_flight_waits = counter(
            "switchyard_engine_prefix_in_flight_waits",
            "Waiting sequences passed over for a step because the next block of their prompt was being computed by a running sequence (once per sequence and step)",
        );
        let spills = counter(
            "switchyard_engine_spills",
            "Preemptions that saved the sequence's KV state to the host (--preemption spill)",
        );
        let spill_loads = counter(
            "switchyard_engine_spill_loads",
            "Spilled sequence states loaded back to the device on resume",
        );
        let spill_drops = counter(
            "switchyard_engine_spill_drops",
            "Spilled sequence states dropped because their request was cancelled while spilled",
        );
        let spill_fallbacks = counter(
            "switchyard_engine_spill_fallbacks",
            "Spill preemptions that recomputed instead because the spill area was full",
        );
        let slot_compactions = counter(
            "switchyard_engine_slot_compactions",
            "State-slot compactions (a live sequence's fixed state moved to a lower slot)",
        );
        let logits_bytes = counter(
            "switchyard_engine_logits_bytes",
            "Logits bytes read back to the host (only with read_logits)",
        );
        let steps = counter(
            "switchyard_engine_steps",
            "Scheduler steps that computed something",
        );
        let kv_events = counter("switchyard_engine_kv_events", "KV events emitted");
        let kv_events_dropped = counter(
            "switchyard_engine_kv_events_dropped",
            "KV events dropped because the publisher lagged or failed",
        );
        let lora_loads = counter(
            "switchyard_engine_lora_loads",
            "LoRA adapters loaded (/v1/load_lora_adapter and --lora-modules)",
        );
        let lora_unloads = counter(
            "switchyard_engine_lora_unloads",
            "LoRA adapters unloaded (/v1/unload_lora_adapter)",
        );
        let lora_load_failures = counter(
            "switchyard_engine_lora_load_failures",
            "LoRA adapter loads refused (bad body, already loaded, LoRA off)",
        );
        let lora_evictions = counter(
            "switchyard_engine_lora_evictions",
            "LoRA adapters evicted (least recently used) to make room for a load",
        );
        let kv_batches_published = counter(
            "switchyard_engine_kv_batches_published",
            "KV-event batches published over ZMQ",
        );
        let disagg_captures = counter(
            "switchyard_engine_disagg_captures",
            "Prefills whose prompt KV was captured under a lease for a remote decode (--disagg)",
        );
        let disagg_transfers = counter(
            "switchyard_engine_disagg_transfers",
            "KV transfers pulled from a prefill worker and handed to the engine (--disagg)",
        );
        let disagg_transfer_bytes = counter(
            "switchyard_engine_disagg_transfer_bytes",
            "Modeled KV bytes of those transfers: the tokens of the blocks the decode worker lacked x --bytes-per-token",
        );
        let disagg_pulls_served = counter(
            "switchyard_engine_disagg_pulls_served",
            "KV pulls this worker answered with a lease's blocks (--disagg)",
        );
        let disagg_pulls_unknown = counter(
            "switchyard_engine_disagg_pulls_unknown",
            "KV pulls by lease this worker refused: no such lease (never issued, released, expired) or a wrong token",
        );
        let pacing_resyncs = counter(
            "switchyard_engine_pacing_resyncs",
            "Times the driver gave up schedule (see switchyard_engine_pacing_dropped_seconds_total)",
        );
        let paced_seconds = Counter::<f64, AtomicU64>::default();
        registry.register(
            "switchyard_engine_paced_seconds",
            "Wall time the timing model gave the steps run (model time / speed-up)",
            paced_seconds.clone(),
        );
        let pacing_dropped_seconds = Counter::<f64, AtomicU64>::default();
        registry.register(
            "switchyard_engine_pacing_dropped_seconds",
            "Schedule the driver fell too far behind to catch up on and gave up: the worker ran that much slower than its model",
            pacing_dropped_seconds.clone(),
        );
        let mut gauge = |name: &str, help: &str| {
            let g = CountGauge::default();
            registry.register(name, help, g.clone());
            g
        };
        let running = gauge("switchyard_engine_running", "Requests running");
        let waiting = gauge("switchyard_engine_waiting", "Requests waiting");
        let cached_blocks = gauge(
            "switchyard_engine_cached_blocks",
            "Device blocks holding a cached prefix block",
        );
        let host_blocks = gauge("switchyard_engine_host_cached_blocks", "Host-tier blocks");
        let restores_by_decision = Family::<DecisionLabels, Counter>::default();
        let restores = RESTORE_LABELS.map(|decision| {
            restores_by_decision
                .get_or_create(&DecisionLabels { decision })
                .clone()
        });
        registry.register(
            "switchyard_engine_restores",
            "Restore outcomes by decision (host tier, and rendezvous transfers with --disagg)",
            restores_by_decision,
        );
        let leases_by_event = Family::<EventLabels, Counter>::default();
        let leases = LEASE_LABELS.map(|event| {
            leases_by_event
                .get_or_create(&EventLabels { event })
                .clone()
        });
        registry.register(
            "switchyard_engine_leases",
            "Capture leases by event (captured, released by their holder, expired, refused)",
            leases_by_event,
        );
        let leases_held = CountGauge::default();
        registry.register(
            "switchyard_engine_leases_held",
            "Capture leases held now",
            leases_held.clone(),
        );
        let failures_by_reason = Family::<ReasonLabels, Counter>::default();
        let disagg_failures = DisaggFailure::ALL.map(|reason| {
            failures_by_reason
                .get_or_create(&ReasonLabels {
                    reason: reason.label(),
                })
                .clone()
        });
        registry.register(
            "switchyard_engine_disagg_failures",
            "Disaggregation failures by reason (--disagg)",
            failures_by_reason,
        );
        let requests_by_status = Family::<StatusLabels, Counter>::default();
        let requests = RequestOutcome::ALL.map(|outcome| {
            requests_by_status
                .get_or_create(&StatusLabels {
                    status: outcome.label(),
                })
                .clone()
        });
        registry.register(
            "switchyard_engine_requests",
            "Requests by final status",
            requests_by_status,
        );
        let lora_adapters = Gauge::default();
        registry.register(
            "switchyard_engine_lora_adapters",
            "LoRA adapters loaded now",
            lora_adapters.clone(),
        );
        Self {
            registry,
            kv_usage,
            prompt_tokens,
            prefix_hit_tokens,
            generation_tokens,
            preemptions,
            kept_out,
            prefix_in_flight_waits,
            spills,
            spill_loads,
            spill_drops,
            spill_fallbacks,
            slot_compactions,
            logits_bytes,
            steps,
            running,
            waiting,
            cached_blocks,
            host_blocks,
            paced_seconds,
            pacing_dropped_seconds,
            pacing_resyncs,
            restores,
            requests,
            leases,
            leases_held,
            disagg_failures,
            disagg_captures,
            disagg_transfers,
            disagg_transfer_bytes,
            disagg_pulls_served,
            disagg_pulls_unknown,
            kv_events,
            kv_events_dropped,
            kv_batches_published,
            lora_loads,
            lora_unloads,
            lora_load_failures,
            lora_evictions,
            lora_adapters,
        }
    }

    /// Counts a request leaving with `outcome`.
    pub fn count_request(&self, outcome: RequestOutcome) {
        self.requests[outcome as usize].inc();
    }

    /// Counts a disaggregation failure.
    pub fn count_disagg_failure(&self, reason: DisaggFailure) {
        self.disagg_failures[reason as usize].inc();
    }

    /// Counts one paced step: the wall time the timing model gave it and
    /// the schedule given up before it (see the driver's `MAX_LAG`).
    pub fn record_pacing(&self, paced: std::time::Duration, dropped: std::time::Duration) {
        self.paced_seconds.inc_by(paced.as_secs_f64());
        if !dropped.is_zero() {
            self.pacing_dropped_seconds.inc_by(dropped.as_secs_f64());
            self.pacing_resyncs.inc();
        }
    }

    /// Copies the engine's counters and gauges.
    pub fn observe<D: DeviceLayer>(&self, engine: &Engine<D>) {
        let c = engine.counters();
        self.kv_usage.set(engine.kv_usage());
        mirror(&self.prompt_tokens, c.prompt_tokens);
        mirror(&self.prefix_hit_tokens, c.prefix_hit_tokens);
        mirror(&self.generation_tokens, c.generated_tokens);
        mirror(&self.preemptions, c.preemptions);
        mirror(&self.kept_out, c.kept_out);
        mirror(&self.prefix_in_flight_waits, c.prefix_in_flight_waits);
        mirror(&self.spills, c.spills);
        mirror(&self.spill_loads, c.spill_loads);
        mirror(&self.spill_drops, c.spill_drops);
        mirror(&self.spill_fallbacks, c.spill_fallbacks);
        mirror(&self.slot_compactions, c.slot_compactions);
        mirror(&self.logits_bytes, c.logits_bytes);
        mirror(&self.steps, c.steps);
        self.running.set(engine.running_len() as u64);
        self.waiting.set(engine.waiting_len() as u64);
        self.cached_blocks.set(engine.kv().cached_blocks() as u64);
        self.host_blocks.set(engine.kv().host_blocks() as u64);
        let l = engine.lease_counters();
        for (counter, total) in self.leases.iter().zip([
            l.captured,
            l.released,
            l.expired,
            l.refused_full,
            l.refused_unknown,
        ]) {
            mirror(counter, total);
        }
        self.leases_held.set(engine.leases_held() as u64);
        let r = c.restores;
        for (counter, total) in self.restores.iter().zip([
            r.no_reusable_entry,
            r.sequence_capacity_not_ready,
            r.native_restore_skipped,
            r.retained_source_lost,
            r.request_state_not_ready,
            r.restored,
            r.failed,
        ]) {
            mirror(counter, total);
        }
    }

    /// The engine's (waiting, running) requests as last observed.
    pub fn queue(&self) -> (u64, u64) {
        (self.waiting.get(), self.running.get())
    }

    /// Prometheus text exposition of every series.
    pub fn encode(&self) -> String {
        let mut out = String::with_capacity(4096);
        prometheus_text::encode(&mut out, &self.registry).expect("writing to a String cannot fail");
        out
    }
}

/// Brings `counter` up to the engine's running `total`.
fn mirror(counter: &Counter, total: u64) {
    counter.inc_by(total.saturating_sub(counter.get()));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_series_is_exported_with_help_and_type() {
        let m = Metrics::new();
        m.count_request(RequestOutcome::Cancelled);
        m.kv_events.inc_by(3);
        mirror(&m.prompt_tokens, 10);
        mirror(&m.prompt_tokens, 25);
        m.kv_usage.set(0.25);
        let text = m.encode();
        for line in [
            "# HELP switchyard_engine_prompt_tokens_total Prompt tokens admitted.\n",
            "# TYPE switchyard_engine_prompt_tokens_total counter\n",
            "switchyard_engine_prompt_tokens_total 25\n",
            "switchyard_engine_kv_events_total 3\n",
            "# TYPE switchyard_engine_running gauge\n",
            "switchyard_engine_running 0\n",
            "switchyard_engine_kv_usage_ratio 0.25\n",
            "switchyard_engine_requests_total{status=\"cancelled\"} 1\n",
            "switchyard_engine_requests_total{status=\"finished\"} 0\n",
            "switchyard_engine_restores_total{decision=\"restored\"} 0\n",
            "# TYPE switchyard_engine_kept_out_total counter\n",
            "switchyard_engine_kept_out_total 0\n",
            "switchyard_engine_prefix_in_flight_waits_total 0\n",
            "switchyard_engine_spills_total 0\n",
            "switchyard_engine_spill_loads_total 0\n",
            "switchyard_engine_spill_drops_total 0\n",
            "switchyard_engine_spill_fallbacks_total 0\n",
            "switchyard_engine_slot_compactions_total 0\n",
            "switchyard_engine_logits_bytes_total 0\n",
            "switchyard_engine_leases_total{event=\"released\"} 0\n",
            "switchyard_engine_leases_held 0\n",
            "switchyard_engine_disagg_failures_total{reason=\"unknown_lease\"} 0\n",
            "switchyard_engine_disagg_transfer_bytes_total 0\n",
            "switchyard_engine_lora_loads_total 0\n",
            "switchyard_engine_lora_unloads_total 0\n",
            "switchyard_engine_lora_load_failures_total 0\n",
            "switchyard_engine_lora_evictions_total 0\n",
            "switchyard_engine_lora_adapters 0\n",
        ] {
            assert!(text.contains(line), "{line}in:\n{text}");
        }
        let typed = text.lines().filter(|l| l.starts_with("# TYPE ")).count();
        let helped = text.lines().filter(|l| l.starts_with("# HELP ")).count();
        assert_eq!((typed, helped), (39, 39), "{text}");
        m.record_pacing(
            std::time::Duration::from_millis(1500),
            std::time::Duration::from_millis(250),
        );
        let text = m.encode();
        for line in [
            "switchyard_engine_paced_seconds_total 1.5\n",
            "switchyard_engine_pacing_dropped_seconds_total 0.25\n",
            "switchyard_engine_pacing_resyncs_total 1\n",
        ] {
            assert!(text.contains(line), "{line}in:\n{text}");
        }
    }

    /// `observe` mirrors the engine's spill, kept-out and logits counters:
    /// two running sequences, a dry pool for both, so the newest is
    /// spilled and later loaded back, with logits read back every step.
    #[test]
    fn the_spill_and_logits_counters_follow_the_engine() {
        use switchyard_core::RequestId;
        use switchyard_engine::{EngineConfig, NewRequest, Preemption, ScriptedDevice, StepReport};
        let config = EngineConfig {
            num_blocks: 256,
            preemption: Preemption::Spill,
            spill_blocks: 64,
            read_logits: true,
            ..EngineConfig::default()
        };
        let device = ScriptedDevice::new(config.timing.clone());
        let mut engine = Engine::new(config, device).unwrap();
        for (id, first) in [(1, 0), (2, 1_000)] {
            engine
                .add_request(NewRequest {
                    id: RequestId(id),
                    prompt: (first..first + 40).collect(),
                    max_tokens: 5,
                    hash_seed: 0,
                    lora_name: None,
                })
                .unwrap();
        }
        let m = Metrics::new();
        let mut report = StepReport::default();
        engine.step(&mut report).unwrap();
        engine.device_mut().exhaust_next = 2;
        while engine.has_work() {
            engine.step(&mut report).unwrap();
            m.observe(&engine);
        }
        let c = engine.counters();
        assert_eq!((c.spills, c.spill_loads), (1, 1), "{c:?}");
        assert!(c.kept_out > 0 && c.logits_bytes > 0, "{c:?}");
        let text = m.encode();
        for (name, value) in [
            ("kept_out", c.kept_out),
            ("spills", c.spills),
            ("spill_loads", c.spill_loads),
            ("spill_drops", c.spill_drops),
            ("spill_fallbacks", c.spill_fallbacks),
            ("slot_compactions", c.slot_compactions),
            ("logits_bytes", c.logits_bytes),
            ("preemptions", c.preemptions),
        ] {
            let line = format!("switchyard_engine_{name}_total {value}\n");
            assert!(text.contains(&line), "{line}in:\n{text}");
        }
    }
}
