//! An SGLang-router-style cache-aware policy, for comparison on equal terms.
//!
//! It does not read the engines' KV events: like SGLang's router it keeps an
//! approximate prefix tree of its own past assignments (here over block
//! hashes rather than characters, with a TTL and a size cap) and decides:
//!
//! 1. If the load is imbalanced — `max − min > balance_abs_threshold` and
//!    `max > min · balance_rel_threshold`, load being active requests — route
//!    to the least-loaded worker.
//! 2. Otherwise, if the best-matching worker's match ratio (matched blocks /
//!    prompt blocks) exceeds `cache_threshold`, route to it (ties: least
//!    loaded).
//! 3. Otherwise route to the least-loaded worker.
//!
//! Every choice is recorded in the tree. Defaults are SGLang's.

use super::{
    argmin_random_tie, at_least, Candidate, Decision, PolicyConfigError, RoutingContext,
    SelectOutcome, Selector,
};
use crate::index::{ApproxConfig, ApproxIndex, OverlapScores};
use crate::types::WorkerId;
use rand::rngs::StdRng;
use rand::SeedableRng;
use serde::{Deserialize, Serialize};

/// Settings of the `cache-aware` policy.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct CacheAwareConfig {
    /// Minimum match ratio to route by cache.
    pub cache_threshold: f64,
    /// Absolute load gap that, with the relative one, means imbalance.
    pub balance_abs_threshold: usize,
    /// Relative load gap that, with the absolute one, means imbalance.
    pub balance_rel_threshold: f64,
    /// The policy's own prefix tree.
    pub tree: ApproxConfig,
}

impl Default for CacheAwareConfig {
    fn default() -> Self {
        Self {
            cache_threshold: 0.3,
            balance_abs_threshold: 64,
            balance_rel_threshold: 1.5,
            tree: ApproxConfig::default(),
        }
    }
}

impl CacheAwareConfig {
    /// Checks ranges.
    pub fn validate(&self) -> Result<(), PolicyConfigError> {
        if !(0.0..=1.0).contains(&self.cache_threshold) {
            return Err(PolicyConfigError::CacheAware(format!(
                "cache_threshold must be in [0, 1], got {}",
                self.cache_threshold
            )));
        }
        at_least("balance_rel_threshold", self.balance_rel_threshold, 1.0)
            .map_err(PolicyConfigError::CacheAware)?;
        self.tree
            .validate()
            .map_err(|e| PolicyConfigError::CacheAware(e.to_string()))
    }
}

/// The `cache-aware` policy.
#[derive(Debug)]
pub struct CacheAwareSelector {
    config: CacheAwareConfig,
    tree: ApproxIndex,
    rng: StdRng,
    scores: OverlapScores,
}

impl CacheAwareSelector {
    /// A selector with an empty tree; `config` must validate (see
    /// [`super::build_selector`]).
    pub fn new(config: CacheAwareConfig, seed: u64) -> Self {
        let tree = ApproxIndex::new(config.tree).unwrap_or_else(|_| {
            ApproxIndex::new(ApproxConfig::default()).expect("defaults are valid")
        });
        Self {
            config,
            tree,
            rng: StdRng::seed_from_u64(seed),
            scores: OverlapScores::new(),
        }
    }

    fn least_loaded<'a>(&mut self, ctx: &RoutingContext<'a>) -> Option<&'a Candidate> {
        argmin_random_tie(ctx.available(), &mut self.rng, |c| c.active_requests)
    }
}

impl Selector for CacheAwareSelector {
    fn name(&self) -> &'static str {
        "cache-aware"
    }

    fn select(&mut self, ctx: &RoutingContext<'_>) -> SelectOutcome {
        let (min, max) = ctx.available().fold((usize::MAX, 0), |(lo, hi), c| {
            (lo.min(c.active_requests), hi.max(c.active_requests))
        });
        if min == usize::MAX {
            return ctx.unavailable();
        }
        let imbalanced = max - min > self.config.balance_abs_threshold
            && max as f64 > min as f64 * self.config.balance_rel_threshold;
        self.tree.overlaps(ctx.request.blocks, &mut self.scores);
        let depth_of = |scores: &OverlapScores, c: &Candidate| scores.depth(c.worker);
        let chosen = if imbalanced {
            self.least_loaded(ctx)
        } else {
            let scores = std::mem::take(&mut self.scores);
            let best = ctx
                .available()
                .map(|c| depth_of(&scores, c))
                .max()
                .unwrap_or(0);
            let blocks = ctx.request.blocks.len();
            let ratio = if blocks == 0 {
                0.0
            } else {
                best as f64 / blocks as f64
            };
            let pick = if best > 0 && ratio > self.config.cache_threshold {
                argmin_random_tie(
                    ctx.available().filter(|c| depth_of(&scores, c) == best),
                    &mut self.rng,
                    |c| c.active_requests,
                )
            } else {
                self.least_loaded(ctx)
            };
            self.scores = scores;
            pick
        };
        let Some(c) = chosen else {
            return ctx.unavailable();
        };
        let predicted = self.scores.depth(c.worker);
        self.tree.record(c.worker, ctx.request.blocks, ctx.now_ms);
        SelectOutcome::Selected(Decision {
            worker: c.worker,
            overlap_blocks: predicted,
            peer: None,
        })
    }

    fn remove_worker(&mut self, worker: WorkerId) {
        self.tree.remove_worker(worker);
    }
}

#[cfg(test)]
mod tests {
    use super::super::test_support::*;
    use super::*;
    use crate::types::LocalHash;

    fn blocks(hashes: &[u64]) -> Vec<LocalHash> {
        hashes.iter().map(|&h| LocalHash(h)).collect()
    }

    #[test]
    fn a_repeated_prefix_goes_back_to_the_worker_that_served_it() {
        let cands = [candidate(1), candidate(2), candidate(3)];
        let mut s = CacheAwareSelector::new(CacheAwareConfig::default(), 5);
        let prompt = blocks(&[1, 2, 3, 4]);
        let first = chosen(s.select(&ctx(&prompt, 64, &cands)));
        let longer = blocks(&[1, 2, 3, 4, 5]);
        for _ in 0..5 {
            assert_eq!(chosen(s.select(&ctx(&longer, 80, &cands))), first);
        }
    }

    #[test]
    fn a_weak_match_goes_to_the_least_loaded_worker() {
        let mut s = CacheAwareSelector::new(CacheAwareConfig::default(), 5);
        let mut cands = [candidate(1), candidate(2)];
        cands[1].active_requests = 3;
        let first = blocks(&[1, 2, 3, 4, 5, 6, 7, 8, 9, 10]);
        assert_eq!(chosen(s.select(&ctx(&first, 160, &cands))), 1);
        // Worker 1 is now busier; a prompt sharing 2 of 10 blocks (0.2 ≤ 0.3)
        // goes by load.
        cands[0].active_requests = 5;
        let weak = blocks(&[1, 2, 30, 40, 50, 60, 70, 80, 90, 100]);
        assert_eq!(chosen(s.select(&ctx(&weak, 160, &cands))), 2);
    }

    #[test]
    fn imbalance_overrides_the_cache() {
        let prompt = blocks(&[1, 2, 3]);
        let run = |loads: [usize; 2]| {
            let mut s = CacheAwareSelector::new(CacheAwareConfig::default(), 5);
            let mut cands = [candidate(1), candidate(2)];
            cands[1].active_requests = 1;
            assert_eq!(chosen(s.select(&ctx(&prompt, 48, &cands))), 1);
            cands[0].active_requests = loads[0];
            cands[1].active_requests = loads[1];
            chosen(s.select(&ctx(&prompt, 48, &cands)))
        };
        // 100 vs 10: gap 90 > 64 and 100 > 1.5 · 10: least loaded.
        assert_eq!(run([100, 10]), 2);
        // 100 vs 80: gap 20, not imbalanced: the cached worker.
        assert_eq!(run([100, 80]), 1);
        // 70 vs 0: gap 70 > 64 and 70 > 0: least loaded.
        assert_eq!(run([70, 0]), 2);
    }

    #[test]
    fn bad_settings_are_refused() {
        let bad = CacheAwareConfig {
            cache_threshold: 1.5,
            ..Default::default()
        };
        assert!(bad.validate().is_err());
        let bad = CacheAwareConfig {
            balance_rel_threshold: 0.5,
            ..Default::default()
        };
        assert!(bad.validate().is_err());
    }
}
