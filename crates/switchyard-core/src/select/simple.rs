//! Load-only policies: round-robin, random, least-loaded, power-of-two.

use super::{argmin_random_tie, Candidate, Decision, RoutingContext, SelectOutcome, Selector};
use crate::maps::FxHashMap;
use crate::types::WorkerId;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

fn selected(c: &Candidate) -> SelectOutcome {
    SelectOutcome::Selected(Decision {
        worker: c.worker,
        overlap_blocks: c.overlap_blocks,
        peer: None,
    })
}

/// Load of a worker for the load-only policies: active requests, then
/// prefill tokens still to compute.
fn load(c: &Candidate) -> (usize, u64) {
    (c.active_requests, c.active_prefill_tokens)
}

/// Each available worker in turn: the one chosen least recently among
/// the candidates (ties in candidate order). Within any one set of
/// candidates that is a rotation, however placements among other sets
/// interleave with it — the two pools of a disaggregated fleet each rotate
/// on their own.
#[derive(Debug, Default)]
pub struct RoundRobinSelector {
    /// Placements made so far.
    turn: u64,
    /// The turn each worker was last chosen at (bounded by the workers:
    /// [`Selector::remove_worker`] forgets one).
    last: FxHashMap<WorkerId, u64>,
}

impl Selector for RoundRobinSelector {
    fn name(&self) -> &'static str {
        "round-robin"
    }

    fn select(&mut self, ctx: &RoutingContext<'_>) -> SelectOutcome {
        let chosen = ctx
            .candidates
            .iter()
            .filter(|c| !c.busy)
            .min_by_key(|c| self.last.get(&c.worker).copied().unwrap_or(0));
        let Some(c) = chosen else {
            return ctx.unavailable();
        };
        self.turn += 1;
        self.last.insert(c.worker, self.turn);
        selected(c)
    }

    fn remove_worker(&mut self, worker: WorkerId) {
        self.last.remove(&worker);
    }
}

/// A uniformly random available worker.
#[derive(Debug)]
pub struct RandomSelector {
    rng: StdRng,
}

impl RandomSelector {
    /// A selector with a seeded RNG.
    pub fn new(seed: u64) -> Self {
        Self {
            rng: StdRng::seed_from_u64(seed),
        }
    }
}

impl Selector for RandomSelector {
    fn name(&self) -> &'static str {
        "random"
    }

    fn select(&mut self, ctx: &RoutingContext<'_>) -> SelectOutcome {
        argmin_random_tie(ctx.available(), &mut self.rng, |_| 0)
            .map_or_else(|| ctx.unavailable(), selected)
    }
}

/// The available worker with the fewest active requests (then the fewest
/// prefill tokens; exact ties at random).
#[derive(Debug)]
pub struct LeastLoadedSelector {
    rng: StdRng,
}

impl LeastLoadedSelector {
    /// A selector with a seeded RNG for ties.
    pub fn new(seed: u64) -> Self {
        Self {
            rng: StdRng::seed_from_u64(seed),
        }
    }
}

impl Selector for LeastLoadedSelector {
    fn name(&self) -> &'static str {
        "least-loaded"
    }

    fn select(&mut self, ctx: &RoutingContext<'_>) -> SelectOutcome {
        argmin_random_tie(ctx.available(), &mut self.rng, load)
            .map_or_else(|| ctx.unavailable(), selected)
    }
}

/// The less loaded of two distinct random available workers.
#[derive(Debug)]
pub struct PowerOfTwoSelector {
    rng: StdRng,
    scratch: Vec<usize>,
}

impl PowerOfTwoSelector {
    /// A selector with a seeded RNG.
    pub fn new(seed: u64) -> Self {
        Self {
            rng: StdRng::seed_from_u64(seed),
            scratch: Vec::new(),
        }
    }
}

impl Selector for PowerOfTwoSelector {
    fn name(&self) -> &'static str {
        "power-of-two"
    }

    fn select(&mut self, ctx: &RoutingContext<'_>) -> SelectOutcome {
        self.scratch.clear();
        self.scratch.extend(
            ctx.candidates
                .iter()
                .enumerate()
                .filter(|(_, c)| !c.busy)
                .map(|(i, _)| i),
        );
        let n = self.scratch.len();
        if n == 0 {
            return ctx.unavailable();
        }
        let a = self.rng.gen_range(0..n);
        let b = if n == 1 {
            a
        } else {
            (a + self.rng.gen_range(1..n)) % n
        };
        let (a, b) = (
            &ctx.candidates[self.scratch[a]],
            &ctx.candidates[self.scratch[b]],
        );
        selected(if load(b) < load(a) { b } else { a })
    }
}

#[cfg(test)]
mod tests {
    use super::super::test_support::*;
    use super::*;

    #[test]
    fn round_robin_cycles_through_workers_in_order() {
        let cands = [candidate(1), candidate(2), candidate(3)];
        let mut s = RoundRobinSelector::default();
        let picks: Vec<u64> = (0..6)
            .map(|_| chosen(s.select(&ctx(&[], 1, &cands))))
            .collect();
        assert_eq!(picks, vec![1, 2, 3, 1, 2, 3]);
    }

    #[test]
    fn round_robin_rotates_within_each_set_of_candidates_however_they_interleave() {
        let prefill = [candidate(1), candidate(2)];
        let decode = [candidate(3), candidate(4)];
        let mut s = RoundRobinSelector::default();
        let mut picks = Vec::new();
        // Two prefills for each decode, then the other way round.
        for round in 0..6 {
            let pattern: &[&[Candidate]] = if round < 3 {
                &[&prefill, &prefill, &decode]
            } else {
                &[&decode, &decode, &prefill]
            };
            for cands in pattern {
                picks.push(chosen(s.select(&ctx(&[], 1, cands))));
            }
        }
        let of = |pool: &[u64]| -> Vec<u64> {
            picks.iter().copied().filter(|w| pool.contains(w)).collect()
        };
        assert_eq!(of(&[1, 2]), vec![1, 2, 1, 2, 1, 2, 1, 2, 1]);
        assert_eq!(of(&[3, 4]), vec![3, 4, 3, 4, 3, 4, 3, 4, 3]);
    }

    #[test]
    fn round_robin_skips_a_busy_worker_and_forgets_a_removed_one() {
        let mut cands = [candidate(1), candidate(2), candidate(3)];
        let mut s = RoundRobinSelector::default();
        cands[0].busy = true;
        assert_eq!(chosen(s.select(&ctx(&[], 1, &cands))), 2);
        cands[0].busy = false;
        // Never chosen yet: its turn comes first.
        assert_eq!(chosen(s.select(&ctx(&[], 1, &cands))), 1);
        assert_eq!(chosen(s.select(&ctx(&[], 1, &cands))), 3);
        s.remove_worker(WorkerId::new(2));
        assert_eq!(s.last.len(), 2);
    }

    #[test]
    fn least_loaded_picks_the_fewest_active_requests() {
        let mut cands = [candidate(1), candidate(2), candidate(3)];
        cands[0].active_requests = 3;
        cands[1].active_requests = 1;
        cands[2].active_requests = 1;
        cands[2].active_prefill_tokens = 100;
        let mut s = LeastLoadedSelector::new(1);
        assert_eq!(chosen(s.select(&ctx(&[], 1, &cands))), 2);
    }

    #[test]
    fn power_of_two_never_picks_the_most_loaded_of_two() {
        let mut cands = [candidate(1), candidate(2)];
        cands[0].active_requests = 5;
        let mut s = PowerOfTwoSelector::new(3);
        for _ in 0..50 {
            assert_eq!(chosen(s.select(&ctx(&[], 1, &cands))), 2);
        }
    }

    #[test]
    fn random_spreads_over_every_worker() {
        let cands = [candidate(1), candidate(2), candidate(3), candidate(4)];
        let mut s = RandomSelector::new(9);
        let mut seen = [0; 5];
        for _ in 0..400 {
            seen[chosen(s.select(&ctx(&[], 1, &cands))) as usize] += 1;
        }
        for (w, &count) in seen.iter().enumerate().skip(1) {
            assert!((50..150).contains(&count), "worker {w}: {count} of 400");
        }
    }
}
