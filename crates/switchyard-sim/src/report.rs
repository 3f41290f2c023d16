//! Figures a simulation produces, and how they are summarized.

use serde::Serialize;

/// Mean and percentiles of a sample, in the unit the caller chose.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct Latency {
    /// Arithmetic mean.
    pub mean: f64,
    /// Median.
    pub p50: f64,
    /// 90th percentile.
    pub p90: f64,
    /// 99th percentile.
    pub p99: f64,
}

impl Latency {
    /// Summarizes `samples` (sorted in place; nearest-rank percentiles). An
    /// empty sample is all zeros.
    pub fn of(samples: &mut [f64]) -> Self {
        if samples.is_empty() {
            return Self::default();
        }
        samples.sort_by(f64::total_cmp);
        let at = |q: f64| {
            let i = ((samples.len() as f64 * q).ceil() as usize).clamp(1, samples.len()) - 1;
            samples[i]
        };
        Self {
            mean: samples.iter().sum::<f64>() / samples.len() as f64,
            p50: at(0.50),
            p90: at(0.90),
            p99: at(0.99),
        }
    }
}

/// What one policy achieved on one fleet.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct PolicyReport {
    /// Time to first token.
    pub ttft_ms: Latency,
    /// Inter-token latency.
    pub itl_ms: Latency,
    /// End-to-end latency.
    pub e2e_ms: Latency,
    /// Time from arrival to dispatch (waiting in the router's queue).
    pub queue_ms: Latency,
    /// Cached prompt tokens / prompt tokens, as the engines saw it.
    pub hit_rate: f64,
    /// Prompt tokens the router predicted cached / prompt tokens.
    pub predicted_hit_rate: f64,
    /// Completed requests per second of simulated time.
    pub throughput_rps: f64,
    /// Output tokens per second of simulated time.
    pub output_tokens_per_sec: f64,
    /// Coefficient of variation of tokens computed per worker.
    pub load_cv: f64,
    /// Preemptions across the fleet.
    pub preemptions: u64,
    /// Requests that completed.
    pub completed: u64,
    /// Requests refused (by an engine's limits) or lost.
    pub errors: u64,
    /// Requests shed by flow control: refused at once with a 429 (a
    /// sheddable band under overload, or a deadline that cannot be met).
    #[serde(skip_serializing_if = "is_zero")]
    pub shed: u64,
    /// Multi-turn sessions whose every turn completed.
    pub sessions_completed: u64,
    /// Simulated seconds from the first arrival to the last completion.
    pub makespan_s: f64,
    /// Engine steps simulated.
    pub engine_steps: u64,
    /// Disaggregated fleets: KV transfers from prefill to decode workers.
    pub transfers: u64,
    /// Disaggregated fleets: bytes those transfers moved.
    pub transfer_bytes: u64,
    /// Disaggregated fleets: decode halves that computed their prompt
    /// instead (nothing captured, or the lease gone before the transfer).
    pub transfer_fallbacks: u64,
    /// Speculative decoding's counters across the fleet (absent when the
    /// engines ran without it).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub spec_decode: Option<SpecFigures>,
    /// Hybrid models' SSM checkpoints across the fleet (absent for
    /// attention-only engines).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ssm: Option<SsmFigures>,
    /// LoRA adapters: loads and waits across the fleet (absent without an
    /// adapter mix).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub adapters: Option<crate::adapters::AdapterFigures>,
    /// With data-parallel ranks: `aware` or `blind`, what the routers saw
    /// of the ranks.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub dp_routing: Option<&'static str>,
    /// With data-parallel ranks: what the ranks did.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub dp: Option<DpFigures>,
    /// Fan-out bursts: whether each computed its shared prefix once
    /// (absent when the workload spawns no burst).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub bursts: Option<BurstFigures>,
    /// Figures per tenant, by name (absent unless the run names tenants).
    #[serde(skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub tenants: std::collections::BTreeMap<String, TenantFigures>,
    /// Responses chains: turns that continued a response no worker holds
    /// any more (its worker failed, or it was forgotten); they ended in
    /// an error.
    #[serde(skip_serializing_if = "is_zero")]
    pub responses_unknown: u64,
    /// Worker failures: what became of the requests they hit (absent
    /// unless the run fails workers).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub failures: Option<FailureFigures>,
}

/// What worker failures did to the requests they hit, as the core's
/// failure decision placed them (`serve` counts the same outcomes in
/// `switchyard_migrations_total` and `switchyard_migrations_refused_total`).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct FailureFigures {
    /// Attempts that failed: requests on a worker when it died, and
    /// requests placed on a worker that was down.
    pub failed_attempts: u64,
    /// Requests moved before their first token: retried as they came.
    pub retried: u64,
    /// Streams moved after tokens reached the client: resumed from them.
    pub resumed: u64,
    /// Requests not moved on (a limit reached): they ended in an error.
    pub gave_up: u64,
    /// The given-up requests by why, under `serve`'s labels of
    /// `switchyard_migrations_refused_total{reason}`.
    #[serde(skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub gave_up_by_reason: std::collections::BTreeMap<&'static str, u64>,
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

/// Fan-out bursts (sessions one turn spawned together, sharing its
/// context) whose every member's first call ended; see the fleet's
/// `bursts` module for the definitions.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct BurstFigures {
    /// Bursts counted.
    pub bursts: u64,
    /// Of them, those whose shared prefix at most one member computed.
    pub once: u64,
    /// Bursts that started while no engine had a request waiting.
    pub quiet: u64,
    /// Quiet bursts that computed their shared prefix once.
    pub quiet_once: u64,
    /// Shared-prefix tokens over the bursts counted.
    pub shared_tokens: u64,
    /// Shared-prefix tokens computed, over every member that computed it.
    pub computed_tokens: u64,
}

/// What one tenant's requests got.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct TenantFigures {
    /// Median time to first token, ms.
    pub ttft_p50_ms: f64,
    /// 90th percentile time to first token, ms.
    pub ttft_p90_ms: f64,
    /// Median wait in the router's queue, ms.
    pub wait_p50_ms: f64,
    /// 90th percentile wait in the router's queue, ms.
    pub wait_p90_ms: f64,
    /// Requests that completed.
    pub completed: u64,
    /// Requests refused at once by flow control (sheddable under
    /// overload, or a deadline that could not be met).
    pub shed: u64,
    /// Requests refused or lost otherwise.
    pub errors: u64,
    /// Tokens served: prompt tokens computed (not cached) plus output
    /// tokens, of completed requests (the fair share's measure).
    pub tokens_served: u64,
    /// [`Self::tokens_served`] by requests that completed within the
    /// arrivals' window (`replay --duration`), while every tenant still
    /// sends: the share a saturating tenant got (absent without a window).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tokens_served_in_window: Option<u64>,
}

/// One tenant's samples while a simulation runs.
#[derive(Clone, Debug, Default)]
pub struct TenantTally {
    /// Times to first token.
    pub ttft: Vec<f64>,
    /// Waits in the router's queue.
    pub wait: Vec<f64>,
    /// See [`TenantFigures::completed`].
    pub completed: u64,
    /// See [`TenantFigures::shed`].
    pub shed: u64,
    /// See [`TenantFigures::errors`].
    pub errors: u64,
    /// See [`TenantFigures::tokens_served`].
    pub tokens_served: u64,
    /// See [`TenantFigures::tokens_served_in_window`].
    pub tokens_served_in_window: u64,
}

impl TenantTally {
    /// The figures of the samples (`windowed`: the run had a window).
    pub fn figures(&mut self, windowed: bool) -> TenantFigures {
        let ttft = Latency::of(&mut self.ttft);
        let wait = Latency::of(&mut self.wait);
        TenantFigures {
            ttft_p50_ms: ttft.p50,
            ttft_p90_ms: ttft.p90,
            wait_p50_ms: wait.p50,
            wait_p90_ms: wait.p90,
            completed: self.completed,
            shed: self.shed,
            errors: self.errors,
            tokens_served: self.tokens_served,
            tokens_served_in_window: windowed.then_some(self.tokens_served_in_window),
        }
    }
}

/// A hybrid model's SSM checkpoints across a fleet's engines.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct SsmFigures {
    /// Checkpoints saved (`MarconiCheckpoint`).
    pub checkpoints: u64,
    /// Checkpoints evicted.
    pub evictions: u64,
    /// Admissions resumed from a checkpoint.
    pub resumes: u64,
    /// Cached attention tokens recomputed because no SSM state was kept
    /// that deep, as a share of all prompt tokens.
    pub unusable_hit_share: f64,
}

/// Speculative decoding across a fleet's engines.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct SpecFigures {
    /// Draft positions verified.
    pub draft_tokens_proposed: u64,
    /// Drafts accepted (emitted as output tokens).
    pub draft_tokens_accepted: u64,
    /// Accepted / proposed.
    pub acceptance: f64,
    /// Steps whose rejected drafts were rolled back (`RollbackOverrun`).
    pub rollbacks: u64,
    /// KV blocks those rollbacks released.
    pub rollback_blocks: u64,
    /// Decode steps without drafts because the over-run did not fit.
    pub fallbacks: u64,
}

/// With data-parallel ranks (`replay --dp-size`): what the
/// ranks did.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct DpFigures {
    /// Ranks per worker.
    pub size: usize,
    /// Requests started per (worker, rank), worker-major.
    pub requests_per_rank: Vec<u64>,
    /// Share of the run (first arrival to last completion) during which
    /// some rank had nothing to run while another rank of the same worker
    /// had requests waiting in its queue.
    pub idle_while_queued_share: f64,
}

/// Per-worker load over time, for plots: tokens computed per bucket.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct LoadTimeline {
    /// Bucket width in simulated milliseconds.
    pub bucket_ms: f64,
    /// `tokens[worker][bucket]`.
    pub tokens: Vec<Vec<u64>>,
}

/// Most buckets a timeline keeps; later steps land in the last one.
pub const MAX_BUCKETS: usize = 4096;

impl LoadTimeline {
    /// An empty timeline for `workers` workers.
    pub fn new(workers: usize, bucket_ms: f64) -> Self {
        Self {
            bucket_ms,
            tokens: vec![Vec::new(); workers],
        }
    }

    /// Adds `tokens` computed by `worker` at `at_ms`.
    pub fn add(&mut self, worker: usize, at_ms: f64, tokens: u64) {
        let bucket = ((at_ms.max(0.0) / self.bucket_ms) as usize).min(MAX_BUCKETS - 1);
        let row = &mut self.tokens[worker];
        if row.len() <= bucket {
            row.resize(bucket + 1, 0);
        }
        row[bucket] += tokens;
    }
}

/// Coefficient of variation (standard deviation over mean) of `values`.
pub fn coefficient_of_variation(values: &[f64]) -> f64 {
    if values.is_empty() {
        return 0.0;
    }
    let n = values.len() as f64;
    let mean = values.iter().sum::<f64>() / n;
    if mean == 0.0 {
        return 0.0;
    }
    let var = values.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / n;
    var.sqrt() / mean
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_are_nearest_rank() {
        let mut v: Vec<f64> = (1..=100).map(f64::from).collect();
        let l = Latency::of(&mut v);
        assert_eq!((l.p50, l.p90, l.p99), (50.0, 90.0, 99.0));
        assert_eq!(l.mean, 50.5);
        assert_eq!(Latency::of(&mut []), Latency::default());
    }

    #[test]
    fn coefficient_of_variation_of_equal_loads_is_zero() {
        assert_eq!(coefficient_of_variation(&[5.0, 5.0, 5.0]), 0.0);
        assert!((coefficient_of_variation(&[0.0, 10.0]) - 1.0).abs() < 1e-12);
        assert_eq!(coefficient_of_variation(&[]), 0.0);
    }

    #[test]
    fn the_timeline_is_bounded() {
        let mut t = LoadTimeline::new(2, 10.0);
        t.add(1, 25.0, 7);
        t.add(1, 1e12, 1);
        assert_eq!(t.tokens[1][2], 7);
        assert_eq!(t.tokens[1].len(), MAX_BUCKETS);
        assert!(t.tokens[0].is_empty());
    }
}
