//! The KV-aware cost function.
//!
//! For a request of `n` prompt blocks (a partial tail counts) and each worker
//! `w`:
//!
//! ```text
//! prefill_blocks[w] = (active_prefill_tokens[w] + max(0, prompt_tokens − overlap[w]·block_size)) / block_size
//! decode_blocks[w]  = active_decode_blocks[w] + n − active_prompt_blocks[w]
//! cost[w]           = overlap_weight · prefill_blocks[w] + decode_blocks[w]
//! ```
//!
//! Temperature 0 picks the lowest cost (ties: fewest cached blocks, then
//! random). Temperature `T > 0` samples `softmax(−cost/max_cost / T)`.

use super::{
    argmin_random_tie, at_least, Candidate, Decision, PolicyConfigError, RoutingContext,
    SelectOutcome, Selector,
};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::{Deserialize, Serialize};

/// Settings of the `kv` policy.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct KvConfig {
    /// Weight of prefill work against decode load (0 ignores the cache).
    pub overlap_weight: f64,
    /// Softmax temperature; 0 is deterministic argmin.
    pub temperature: f64,
}

impl Default for KvConfig {
    fn default() -> Self {
        Self {
            overlap_weight: 1.0,
            temperature: 0.0,
        }
    }
}

impl KvConfig {
    /// Checks ranges.
    pub fn validate(&self) -> Result<(), PolicyConfigError> {
        at_least("overlap_weight", self.overlap_weight, 0.0).map_err(PolicyConfigError::Kv)?;
        at_least("temperature", self.temperature, 0.0).map_err(PolicyConfigError::Kv)
    }
}

/// The `kv` policy.
#[derive(Debug)]
pub struct KvSelector {
    config: KvConfig,
    rng: StdRng,
    costs: Vec<f64>,
}

impl KvSelector {
    /// A selector with a seeded RNG.
    pub fn new(config: KvConfig, seed: u64) -> Self {
        Self {
            config,
            rng: StdRng::seed_from_u64(seed),
            costs: Vec::new(),
        }
    }

    /// The cost of routing the request in `ctx` to `c`.
    pub fn cost(&self, ctx: &RoutingContext<'_>, c: &Candidate) -> f64 {
        let block_size = ctx.block_size.max(1) as f64;
        let cached_tokens = c.overlap_blocks as f64 * block_size;
        let new_tokens = (ctx.request.prompt_tokens as f64 - cached_tokens).max(0.0);
        let prefill_blocks = (c.active_prefill_tokens as f64 + new_tokens) / block_size;
        let n = ctx.prompt_blocks() as f64;
        let decode_blocks =
            c.active_decode_blocks as f64 + (n - c.active_prompt_blocks as f64).max(0.0);
        self.config.overlap_weight * prefill_blocks + decode_blocks
    }
}

impl Selector for KvSelector {
    fn name(&self) -> &'static str {
        "kv"
    }

    fn select(&mut self, ctx: &RoutingContext<'_>) -> SelectOutcome {
        let chosen = if self.config.temperature == 0.0 {
            let mut rng = std::mem::replace(&mut self.rng, StdRng::seed_from_u64(0));
            let best = argmin_random_tie(ctx.available(), &mut rng, |c| {
                (self.cost(ctx, c), c.cached_blocks)
            });
            self.rng = rng;
            best
        } else {
            self.sample(ctx)
        };
        match chosen {
            Some(c) => SelectOutcome::Selected(Decision {
                worker: c.worker,
                overlap_blocks: c.overlap_blocks,
                peer: None,
            }),
            None => ctx.unavailable(),
        }
    }
}

impl KvSelector {
    fn sample<'a>(&mut self, ctx: &RoutingContext<'a>) -> Option<&'a Candidate> {
        let mut costs = std::mem::take(&mut self.costs);
        costs.clear();
        costs.extend(
            ctx.candidates
                .iter()
                .map(|c| if c.busy { f64::NAN } else { self.cost(ctx, c) }),
        );
        let max = costs
            .iter()
            .filter(|c| !c.is_nan())
            .fold(0.0f64, |a, &b| a.max(b));
        let scale = if max > 0.0 { max } else { 1.0 };
        let min = costs
            .iter()
            .filter(|c| !c.is_nan())
            .fold(f64::INFINITY, |a, &b| a.min(b / scale));
        // Weights relative to the cheapest, so the largest is exp(0) = 1.
        let t = self.config.temperature;
        for cost in costs.iter_mut() {
            *cost = if cost.is_nan() {
                0.0
            } else {
                (-(*cost / scale - min) / t).exp()
            };
        }
        let total: f64 = costs.iter().sum();
        let picked = if total > 0.0 {
            let mut x = self.rng.gen_range(0.0..total);
            let mut pick = None;
            for (i, &weight) in costs.iter().enumerate() {
                if weight > 0.0 {
                    pick = Some(i);
                    if x < weight {
                        break;
                    }
                    x -= weight;
                }
            }
            pick.map(|i| &ctx.candidates[i])
        } else {
            None
        };
        self.costs = costs;
        picked
    }
}

#[cfg(test)]
mod tests {
    use super::super::test_support::*;
    use super::*;
    use crate::types::LocalHash;

    const BLOCKS: [LocalHash; 4] = [LocalHash(1), LocalHash(2), LocalHash(3), LocalHash(4)];

    #[test]
    fn the_cost_is_prefill_work_plus_decode_blocks() {
        let s = KvSelector::new(KvConfig::default(), 0);
        let mut c = candidate(1);
        c.overlap_blocks = 2;
        c.active_prefill_tokens = 32;
        c.active_decode_blocks = 10;
        c.active_prompt_blocks = 1;
        // 64 prompt tokens, 16-token blocks: n = 4.
        let cost = s.cost(&ctx(&BLOCKS, 64, &[]), &c);
        // prefill (32 + 64 − 32) / 16 = 4; decode 10 + 4 − 1 = 13.
        assert_eq!(cost, 17.0);
        let heavy = KvSelector::new(
            KvConfig {
                overlap_weight: 2.0,
                temperature: 0.0,
            },
            0,
        );
        assert_eq!(heavy.cost(&ctx(&BLOCKS, 64, &[]), &c), 21.0);
    }

    #[test]
    fn a_cached_prefix_wins_when_load_is_equal() {
        let mut cands = [candidate(1), candidate(2), candidate(3)];
        cands[1].overlap_blocks = 3;
        let mut s = KvSelector::new(KvConfig::default(), 0);
        let outcome = s.select(&ctx(&BLOCKS, 64, &cands));
        assert_eq!(
            outcome,
            SelectOutcome::Selected(Decision {
                worker: cands[1].worker,
                overlap_blocks: 3,
                peer: None,
            })
        );
    }

    #[test]
    fn load_outweighs_a_small_overlap() {
        let mut cands = [candidate(1), candidate(2)];
        cands[0].overlap_blocks = 1;
        cands[0].active_prefill_tokens = 16 * 50;
        let mut s = KvSelector::new(KvConfig::default(), 0);
        assert_eq!(chosen(s.select(&ctx(&BLOCKS, 64, &cands))), 2);
    }

    #[test]
    fn equal_costs_prefer_the_worker_with_fewer_cached_blocks() {
        let mut cands = [candidate(1), candidate(2)];
        cands[0].cached_blocks = 500;
        cands[1].cached_blocks = 20;
        let mut s = KvSelector::new(KvConfig::default(), 0);
        for _ in 0..10 {
            assert_eq!(chosen(s.select(&ctx(&BLOCKS, 64, &cands))), 2);
        }
    }

    #[test]
    fn with_temperature_cheaper_workers_are_picked_more_often() {
        let mut cands = [candidate(1), candidate(2)];
        cands[0].overlap_blocks = 4;
        cands[1].active_decode_blocks = 8;
        let mut s = KvSelector::new(
            KvConfig {
                overlap_weight: 1.0,
                temperature: 0.5,
            },
            42,
        );
        let mut first = 0;
        for _ in 0..1000 {
            if chosen(s.select(&ctx(&BLOCKS, 64, &cands))) == 1 {
                first += 1;
            }
        }
        // cost 4 vs 16: weights 1 and exp(-(1 − 0.25)/0.5) ≈ 0.22 → p ≈ 0.82.
        assert!(
            (760..880).contains(&first),
            "picked the cheap worker {first} of 1000 times"
        );
    }

    #[test]
    fn bad_settings_are_refused() {
        for config in [
            KvConfig {
                overlap_weight: -1.0,
                temperature: 0.0,
            },
            KvConfig {
                overlap_weight: 1.0,
                temperature: f64::INFINITY,
            },
            KvConfig {
                overlap_weight: f64::NAN,
                temperature: 0.0,
            },
        ] {
            assert!(config.validate().is_err(), "{config:?}");
        }
    }
}
