//! Load-only policies: round-robin, random, least-loaded, power-of-two.

use super::{argmin_random_tie, Candidate, Decision, RoutingContext, SelectOutcome, Selector};
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

/// Each available worker in turn.
#[derive(Debug, Default)]
pub struct RoundRobinSelector {
    next: usize,
}

impl Selector for RoundRobinSelector {
    fn name(&self) -> &'static str {
        "round-robin"
    }

    fn select(&mut self, ctx: &RoutingContext<'_>) -> SelectOutcome {
        let n = ctx.candidates.len();
        for step in 0..n {
            let i = (self.next + step) % n;
            if !ctx.candidates[i].busy {
                self.next = (i + 1) % n;
                return selected(&ctx.candidates[i]);
            }
        }
        ctx.unavailable()
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
