//! Worker selection: the cost function and the routing policies.
//!
//! Every policy implements [`Selector`] and sees the same
//! [`RoutingContext`]: the request's facts and one [`Candidate`] per eligible
//! worker (cached overlap from the prefix index, load from the prompt
//! registry, and whether the worker is over its busy threshold). That is what
//! lets the simulator and the server compare policies on equal terms.
//!
//! | policy | picks |
//! |---|---|
//! | `round-robin` | the next worker in turn |
//! | `random` | a uniformly random worker |
//! | `least-loaded` | the worker with the fewest active requests |
//! | `power-of-two` | the less loaded of two random workers |
//! | `kv` | the lowest [`kv`] cost: prefill work to do plus decode blocks held (Dynamo's form) |
//! | `ttft` | the lowest [`ttft`] cost: expected time to first token plus the recompute it adds to the fleet |
//! | `cache-aware` | SGLang-router style: its own prefix tree of past choices, a match-ratio threshold, and a load-imbalance fallback |
//!
//! Busy workers are skipped by every policy; when all are busy the outcome is
//! [`SelectOutcome::AllBusy`] and the request waits in the policy queue.
//!
//! Only `ttft` reads a candidate's host tier
//! ([`Candidate::host_overlap_blocks`], priced by restore time); every other
//! policy weighs the device overlap alone, as if host-tier blocks were
//! misses.

mod cache_aware;
mod kv;
mod simple;
mod ttft;

pub use cache_aware::{CacheAwareConfig, CacheAwareSelector};
pub use kv::{KvConfig, KvSelector};
pub use simple::{LeastLoadedSelector, PowerOfTwoSelector, RandomSelector, RoundRobinSelector};
pub use ttft::{TtftConfig, TtftCost, TtftSelector};

use crate::types::{LocalHash, WorkerId};
use rand::rngs::StdRng;
use rand::Rng;
use serde::{Deserialize, Serialize};
use std::fmt;
use std::str::FromStr;

/// Facts about the request being routed.
#[derive(Clone, Copy, Debug)]
pub struct RoutingRequest<'a> {
    /// Prompt length in tokens.
    pub prompt_tokens: u32,
    /// Local hashes of the prompt's full blocks.
    pub blocks: &'a [LocalHash],
    /// The LoRA adapter it names (`None`: the base model).
    pub adapter: Option<&'a str>,
    /// Its model's own settings, where they differ from the router's.
    pub model: ModelSettings,
    /// Share of the busy threshold held back from it: it finds a worker
    /// busy at `(1 - headroom) ×` the threshold (a request below the top
    /// priority band when the flow configuration reserves capacity for
    /// it). 0: the threshold itself.
    pub headroom: f64,
}

/// A model's routing settings where they differ from the router's (a
/// fleet serving several models: `serve`'s `[[models]]` tables). The
/// request's blocks were hashed at `block_size`, and every worker that
/// may serve it runs its model at that block size.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ModelSettings {
    /// Tokens per KV block (`None`: the router's).
    pub block_size: Option<u32>,
    /// The routing policy (`None`: the router's).
    pub policy: Option<PolicyKind>,
}

/// One eligible worker as a selector sees it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Candidate {
    /// The worker.
    pub worker: WorkerId,
    /// Leading prompt blocks in the worker's KV cache (prefix index) that
    /// it can resume from: for a hybrid (SSM + attention) worker, up to its
    /// deepest SSM checkpoint within them.
    pub overlap_blocks: u32,
    /// Leading prompt blocks the worker holds on its device, resumable or
    /// not: more than `overlap_blocks` for a hybrid worker whose deepest
    /// SSM checkpoint is shallower — where it would keep the branch point's
    /// state for the turns after. `overlap_blocks` for any other worker.
    pub held_prefix_blocks: u32,
    /// Prompt blocks right after those that the worker holds in its host
    /// (CPU) tier, consecutively: the engine restores them by a copy
    /// instead of computing them. 0 without host-tier events.
    pub host_overlap_blocks: u32,
    /// Blocks the worker holds in the prefix index (tie-break).
    pub cached_blocks: usize,
    /// Leading prompt blocks already held by the worker's active requests.
    pub active_prompt_blocks: u32,
    /// Uncached prefill tokens still to compute on the worker.
    pub active_prefill_tokens: u64,
    /// KV blocks held by the worker's active requests.
    pub active_decode_blocks: usize,
    /// Active requests on the worker.
    pub active_requests: usize,
    /// The worker's KV capacity in router blocks, when it reported one.
    pub kv_capacity_blocks: Option<u64>,
    /// Uncached tokens this router booked on the worker lately (fading
    /// with a one-minute time constant): how fast its cache is rewritten.
    /// 0 when the worker reported no KV capacity: what it is weighed
    /// against (`ttft`'s turnover) is unknown then, and the fade costs an
    /// `exp` per candidate.
    pub recent_writes_tokens: f64,
    /// Wall ms before the request's adapter is ready on the worker: 0
    /// when it names none or the worker has it loaded, the rest of a load
    /// under way, else the adapter's load time
    /// ([`crate::adapters::AdapterTable::load_cost_ms`]). Only `ttft`
    /// prices it; the others are given only the adapter's holders when any
    /// is available, and workers far less busy than them (the router
    /// filters).
    pub adapter_load_ms: f64,
    /// Over its busy threshold: not to be chosen now.
    pub busy: bool,
}

impl Candidate {
    /// Share of the worker's KV memory its running requests hold (0..=1;
    /// 0 without a reported capacity): what its decode steps' length
    /// depends on.
    pub fn held_share(&self) -> f64 {
        match self.kv_capacity_blocks {
            Some(capacity) => (self.active_decode_blocks as f64 / capacity.max(1) as f64).min(1.0),
            None => 0.0,
        }
    }
}

/// How long a worker takes to prefill uncached tokens and to run a decode
/// step: the dispatcher's [`crate::estimate::PrefillEstimator`], or the
/// configured model alone.
pub trait PrefillTime {
    /// Expected wall milliseconds for `worker` to prefill `tokens`
    /// uncached tokens (0 tokens may still cost a fitted fixed overhead).
    fn prefill_ms(&self, worker: WorkerId, tokens: u64) -> f64;

    /// Expected wall milliseconds of one decode-only step on `worker` at
    /// KV usage `usage` (used / total device blocks, 0..=1).
    fn decode_step_ms(&self, worker: WorkerId, usage: f64) -> f64;

    /// Expected wall milliseconds for `worker` to restore `tokens` tokens
    /// of KV from its host tier to its device (0 tokens take no time).
    fn restore_ms(&self, worker: WorkerId, tokens: u64) -> f64;

    /// Expected wall milliseconds to move `tokens` tokens of KV from
    /// another worker's device to `worker`'s (a peer restore), or `None`
    /// when the driver cannot move KV between workers — then no policy
    /// offers one.
    fn transfer_ms(&self, _worker: WorkerId, _tokens: u64) -> Option<f64> {
        None
    }
}

/// Everything a selector may read for one decision.
#[derive(Clone, Copy)]
pub struct RoutingContext<'a> {
    /// The request.
    pub request: RoutingRequest<'a>,
    /// Eligible workers, in a stable order.
    pub candidates: &'a [Candidate],
    /// Tokens per KV block.
    pub block_size: u32,
    /// The driver's clock.
    pub now_ms: f64,
    /// Prefill durations per worker (the time-based policies' model).
    pub prefill: &'a dyn PrefillTime,
}

impl fmt::Debug for RoutingContext<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RoutingContext")
            .field("request", &self.request)
            .field("candidates", &self.candidates)
            .field("block_size", &self.block_size)
            .field("now_ms", &self.now_ms)
            .finish_non_exhaustive()
    }
}

impl<'a> RoutingContext<'a> {
    /// Prompt blocks, counting a partial trailing block.
    pub fn prompt_blocks(&self) -> u64 {
        (self.request.prompt_tokens as u64).div_ceil(self.block_size.max(1) as u64)
    }

    /// Candidates not over their busy threshold.
    pub fn available(&self) -> impl Iterator<Item = &'a Candidate> + 'a {
        self.candidates.iter().filter(|c| !c.busy)
    }

    /// The outcome when no available candidate exists.
    pub fn unavailable(&self) -> SelectOutcome {
        if self.candidates.is_empty() {
            SelectOutcome::NoWorkers
        } else {
            SelectOutcome::AllBusy
        }
    }
}

/// A worker chosen for a request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Decision {
    /// The chosen worker.
    pub worker: WorkerId,
    /// Leading prompt blocks the router predicts it has cached (with a
    /// peer restore, once the restore is in).
    pub overlap_blocks: u32,
    /// Restore the prompt's leading blocks from another worker first.
    pub peer: Option<PeerSource>,
}

/// A peer restore: the worker holding the prompt's longest cached prefix
/// lends it to the chosen worker, which restores it instead of computing
/// it (the restore protocol's rendezvous source).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PeerSource {
    /// The worker holding the prefix.
    pub holder: WorkerId,
    /// Its leading prompt blocks to move.
    pub blocks: u32,
}

/// What a selector answered.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SelectOutcome {
    /// A worker was chosen.
    Selected(Decision),
    /// Every eligible worker is over its busy threshold: wait and retry.
    AllBusy,
    /// No worker is eligible at all.
    NoWorkers,
}

/// A routing policy. Implementations are deterministic given their seed.
pub trait Selector: Send {
    /// The policy's name, as the CLI spells it.
    fn name(&self) -> &'static str;

    /// Chooses a worker among `ctx.candidates`, skipping busy ones.
    fn select(&mut self, ctx: &RoutingContext<'_>) -> SelectOutcome;

    /// Forgets any per-worker state about `worker`.
    fn remove_worker(&mut self, _worker: WorkerId) {}
}

/// The routing policies, by name.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum PolicyKind {
    /// [`RoundRobinSelector`].
    RoundRobin,
    /// [`RandomSelector`].
    Random,
    /// [`LeastLoadedSelector`].
    LeastLoaded,
    /// [`PowerOfTwoSelector`].
    PowerOfTwo,
    /// [`KvSelector`].
    Kv,
    /// [`CacheAwareSelector`].
    CacheAware,
    /// [`TtftSelector`].
    Ttft,
}

impl PolicyKind {
    /// The policy `serve`, the core, `replay`'s reports and `demo` run when
    /// none is named: `ttft`, which has the lowest TTFT p90 of every policy
    /// on every bundled trace in the simulator at ≥ 95% of the pooled-LRU
    /// hit rate, and end to end the lowest TTFT p90 beside SGLang's routers
    /// at the same throughput (docs/simulator.md).
    pub const DEFAULT: PolicyKind = PolicyKind::Ttft;

    /// Every policy, in the order reports list them.
    pub const ALL: [PolicyKind; 7] = [
        PolicyKind::RoundRobin,
        PolicyKind::Random,
        PolicyKind::LeastLoaded,
        PolicyKind::PowerOfTwo,
        PolicyKind::Kv,
        PolicyKind::CacheAware,
        PolicyKind::Ttft,
    ];

    /// Whether the policy's selector keeps no state between decisions but
    /// its random generator (a tie-breaker): then a selector per placing
    /// thread decides as one shared selector would, and a route may be
    /// made outside the dispatcher's lock ([`crate::router::board`]).
    /// `cache-aware` keeps its own tree of past decisions and
    /// `round-robin` a turn, so theirs stay under the lock.
    pub fn keeps_no_state(self) -> bool {
        match self {
            PolicyKind::Random
            | PolicyKind::LeastLoaded
            | PolicyKind::PowerOfTwo
            | PolicyKind::Kv
            | PolicyKind::Ttft => true,
            PolicyKind::RoundRobin | PolicyKind::CacheAware => false,
        }
    }

    /// The CLI name.
    pub fn name(self) -> &'static str {
        match self {
            PolicyKind::RoundRobin => "round-robin",
            PolicyKind::Random => "random",
            PolicyKind::LeastLoaded => "least-loaded",
            PolicyKind::PowerOfTwo => "power-of-two",
            PolicyKind::Kv => "kv",
            PolicyKind::CacheAware => "cache-aware",
            PolicyKind::Ttft => "ttft",
        }
    }
}

impl fmt::Display for PolicyKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// An unknown policy name.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("unknown policy {0:?}; expected one of round-robin, random, least-loaded, power-of-two, kv, cache-aware, ttft")]
pub struct UnknownPolicy(pub String);

impl FromStr for PolicyKind {
    type Err = UnknownPolicy;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        PolicyKind::ALL
            .into_iter()
            .find(|p| p.name() == s)
            .ok_or_else(|| UnknownPolicy(s.to_owned()))
    }
}

/// Settings of every policy; each reads its own part.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PolicyConfig {
    /// `kv` settings.
    pub kv: KvConfig,
    /// `cache-aware` settings.
    pub cache_aware: CacheAwareConfig,
    /// `ttft` settings.
    pub ttft: TtftConfig,
}

/// Why a policy's settings were refused.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum PolicyConfigError {
    /// A `kv` setting out of range.
    #[error("kv policy: {0}")]
    Kv(String),
    /// A `cache-aware` setting out of range.
    #[error("cache-aware policy: {0}")]
    CacheAware(String),
    /// A `ttft` setting out of range.
    #[error("ttft policy: {0}")]
    Ttft(String),
}

impl PolicyConfig {
    /// Checks every part.
    pub fn validate(&self) -> Result<(), PolicyConfigError> {
        self.kv.validate()?;
        self.cache_aware.validate()?;
        self.ttft.validate()
    }
}

/// A policy setting's range check: `value` finite and at least `min`,
/// otherwise the message that names it.
pub(crate) fn at_least(name: &str, value: f64, min: f64) -> Result<(), String> {
    if value.is_finite() && value >= min {
        Ok(())
    } else {
        Err(format!("{name} must be finite and >= {min}, got {value}"))
    }
}

/// Builds the selector for `kind` with a seeded RNG.
pub fn build_selector(
    kind: PolicyKind,
    config: &PolicyConfig,
    seed: u64,
) -> Result<Box<dyn Selector>, PolicyConfigError> {
    config.validate()?;
    Ok(match kind {
        PolicyKind::RoundRobin => Box::new(RoundRobinSelector::default()),
        PolicyKind::Random => Box::new(RandomSelector::new(seed)),
        PolicyKind::LeastLoaded => Box::new(LeastLoadedSelector::new(seed)),
        PolicyKind::PowerOfTwo => Box::new(PowerOfTwoSelector::new(seed)),
        PolicyKind::Kv => Box::new(KvSelector::new(config.kv, seed)),
        PolicyKind::CacheAware => Box::new(CacheAwareSelector::new(config.cache_aware, seed)),
        PolicyKind::Ttft => Box::new(TtftSelector::new(config.ttft, seed)),
    })
}

/// Picks uniformly among the available candidates minimizing `key`, with the
/// RNG breaking exact ties (reservoir sampling: one pass, no allocation).
pub(crate) fn argmin_random_tie<'a, K: PartialOrd>(
    candidates: impl Iterator<Item = &'a Candidate>,
    rng: &mut StdRng,
    mut key: impl FnMut(&Candidate) -> K,
) -> Option<&'a Candidate> {
    let mut best: Option<(&Candidate, K)> = None;
    let mut ties = 0u32;
    for c in candidates {
        let k = key(c);
        // One comparison per candidate; an incomparable key (NaN) replaces
        // the best, as a smaller one does.
        match best.as_ref().and_then(|(_, bk)| k.partial_cmp(bk)) {
            Some(std::cmp::Ordering::Greater) => {}
            Some(std::cmp::Ordering::Equal) => {
                ties += 1;
                if rng.gen_range(0..=ties) == 0 {
                    best = Some((c, k));
                }
            }
            _ => {
                best = Some((c, k));
                ties = 0;
            }
        }
    }
    best.map(|(c, _)| c)
}

#[cfg(test)]
pub(crate) mod test_support {
    use super::*;

    pub(crate) fn candidate(worker: u64) -> Candidate {
        Candidate {
            worker: WorkerId::new(worker),
            overlap_blocks: 0,
            held_prefix_blocks: 0,
            host_overlap_blocks: 0,
            cached_blocks: 0,
            active_prompt_blocks: 0,
            active_prefill_tokens: 0,
            active_decode_blocks: 0,
            active_requests: 0,
            kv_capacity_blocks: None,
            recent_writes_tokens: 0.0,
            adapter_load_ms: 0.0,
            busy: false,
        }
    }

    /// 1 ms a token, no chunking, no fixed cost: costs easy to compute by
    /// hand. Restores take the given ms a token.
    pub(crate) struct LinearModel {
        pub(crate) restore_ms_per_token: f64,
    }

    /// [`LinearModel`] with restores at 0.1 ms a token.
    pub(crate) const LINEAR: LinearModel = LinearModel {
        restore_ms_per_token: 0.1,
    };

    impl PrefillTime for LinearModel {
        fn prefill_ms(&self, _: WorkerId, tokens: u64) -> f64 {
            tokens as f64
        }

        /// 10 ms at an empty cache, 50 ms at a full one.
        fn decode_step_ms(&self, _: WorkerId, usage: f64) -> f64 {
            10.0 + 40.0 * usage
        }

        fn restore_ms(&self, _: WorkerId, tokens: u64) -> f64 {
            tokens as f64 * self.restore_ms_per_token
        }
    }

    /// An engine that takes no time (`--speedup 0`).
    pub(crate) struct InstantModel;

    impl PrefillTime for InstantModel {
        fn prefill_ms(&self, _: WorkerId, _: u64) -> f64 {
            0.0
        }

        fn decode_step_ms(&self, _: WorkerId, _: f64) -> f64 {
            0.0
        }

        fn restore_ms(&self, _: WorkerId, _: u64) -> f64 {
            0.0
        }
    }

    /// A context with block size 16 and [`LinearModel`].
    pub(crate) fn ctx<'a>(
        blocks: &'a [LocalHash],
        prompt_tokens: u32,
        candidates: &'a [Candidate],
    ) -> RoutingContext<'a> {
        ctx_with_model(blocks, prompt_tokens, candidates, &LINEAR)
    }

    pub(crate) fn ctx_with_model<'a>(
        blocks: &'a [LocalHash],
        prompt_tokens: u32,
        candidates: &'a [Candidate],
        prefill: &'a dyn PrefillTime,
    ) -> RoutingContext<'a> {
        RoutingContext {
            request: RoutingRequest {
                prompt_tokens,
                blocks,
                adapter: None,
                model: Default::default(),
                headroom: 0.0,
            },
            candidates,
            block_size: 16,
            now_ms: 0.0,
            prefill,
        }
    }

    pub(crate) fn chosen(outcome: SelectOutcome) -> u64 {
        match outcome {
            SelectOutcome::Selected(d) => d.worker.worker_id,
            other => panic!("expected a selection, got {other:?}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::test_support::*;
    use super::*;

    #[test]
    fn policy_names_round_trip() {
        for kind in PolicyKind::ALL {
            assert_eq!(kind.name().parse::<PolicyKind>(), Ok(kind));
        }
        let err = "fastest".parse::<PolicyKind>().unwrap_err();
        assert!(err.to_string().contains("round-robin"));
    }

    #[test]
    fn every_policy_skips_busy_workers_and_reports_all_busy() {
        let mut busy = candidate(1);
        busy.busy = true;
        let free = candidate(2);
        for kind in PolicyKind::ALL {
            let mut s = build_selector(kind, &PolicyConfig::default(), 7).unwrap();
            for _ in 0..20 {
                let cands = [busy, free];
                assert_eq!(chosen(s.select(&ctx(&[], 10, &cands))), 2, "{kind}");
            }
            assert_eq!(
                s.select(&ctx(&[], 10, &[busy])),
                SelectOutcome::AllBusy,
                "{kind}"
            );
            assert_eq!(
                s.select(&ctx(&[], 10, &[])),
                SelectOutcome::NoWorkers,
                "{kind}"
            );
        }
    }

    #[test]
    fn ties_are_broken_by_the_seeded_rng_reproducibly() {
        let cands = [candidate(1), candidate(2), candidate(3)];
        let run = |seed| {
            let mut rng = <StdRng as rand::SeedableRng>::seed_from_u64(seed);
            (0..50)
                .map(|_| {
                    argmin_random_tie(cands.iter(), &mut rng, |_| 0)
                        .unwrap()
                        .worker
                        .worker_id
                })
                .collect::<Vec<_>>()
        };
        assert_eq!(run(1), run(1));
        let picks = run(1);
        for w in 1..=3 {
            assert!(picks.contains(&w), "worker {w} never picked: {picks:?}");
        }
    }
}
