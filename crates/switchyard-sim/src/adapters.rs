//! LoRA adapters in the fleet simulator: which adapter each session asks
//! for (a Zipf-like mix), and each engine's adapter slots.
//!
//! Each session is assigned one of `count` adapters, adapter `k` (0-based)
//! with probability proportional to `1 / (k + 1)^skew` (skew 0: uniform),
//! drawn from a hash of the session id and the seed, so every policy sees
//! the same mix. Each engine holds at most `max_loras` adapters; loading
//! one takes `load_ms` of model time (wall time: divided by the speed-up,
//! as the engines' steps), during which the requests that need it wait;
//! a request for an adapter the engine lacks loads it, evicting the least
//! recently used when the slots are full. The routers place requests by
//! the core's adapter affinity ([`switchyard_core::adapters`]) — or blind
//! to adapters, for comparison — and a placement that says "load it"
//! loads it there (unloading the victim the router named).
//!
//! A request's KV is its adapter's own, as in vLLM (which hashes an
//! adapter's blocks with the adapter), by the code `serve` and the
//! sim-worker run: the routers hash the prompt with the adapter's seed
//! (`switchyard_core::hashing::seed_for`), the engines key their prefix
//! caches with the same seed and name the adapter on their KV events
//! (`lora_name`), which the routers' normalizer hashes with that seed
//! again. So prompts of different adapters never share a cached block and
//! prompts of the same adapter share as before. The hit-rate references
//! (infinite cache, pooled LRU) ignore adapters: an upper bound.
//!
//! Not modelled: a load's cost to the engine's other requests (it only
//! delays the requests that need the adapter), an adapter's effect on step
//! time, and adapters in disaggregated fleets (only aggregated workers
//! load them).

use serde::{Deserialize, Serialize};
use switchyard_engine::adapters::AdapterSlots;

/// The adapter mix and the engines' adapter slots.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AdapterMix {
    /// Distinct adapters (at least 1).
    pub count: usize,
    /// Zipf exponent of their popularity (0: uniform).
    pub skew: f64,
    /// Adapter slots per engine (vLLM's `--max-loras`; at least 1).
    pub max_loras: usize,
    /// Model milliseconds to load one adapter.
    pub load_ms: f64,
    /// Seed of the assignment.
    pub seed: u64,
}

impl Default for AdapterMix {
    fn default() -> Self {
        Self {
            count: 16,
            skew: 1.0,
            max_loras: 4,
            load_ms: 200.0,
            seed: 0,
        }
    }
}

impl AdapterMix {
    /// Checks the settings.
    pub fn validate(&self) -> Result<(), String> {
        if self.count == 0 || self.count > 65_536 {
            return Err(format!("adapters must be 1..=65536, got {}", self.count));
        }
        if !(self.skew.is_finite() && self.skew >= 0.0) {
            return Err(format!(
                "adapter skew must be finite and >= 0, got {}",
                self.skew
            ));
        }
        if self.max_loras == 0 || self.max_loras > 1024 {
            return Err(format!(
                "max_loras must be 1..=1024, got {}",
                self.max_loras
            ));
        }
        if !(self.load_ms.is_finite() && self.load_ms >= 0.0) {
            return Err(format!(
                "lora load ms must be finite and >= 0, got {}",
                self.load_ms
            ));
        }
        Ok(())
    }

    /// The cumulative distribution of adapter popularity.
    pub fn cdf(&self) -> Vec<f64> {
        let weights: Vec<f64> = (0..self.count)
            .map(|k| 1.0 / ((k + 1) as f64).powf(self.skew))
            .collect();
        let total: f64 = weights.iter().sum();
        let mut acc = 0.0;
        weights
            .iter()
            .map(|w| {
                acc += w / total;
                acc
            })
            .collect()
    }

    /// The adapter of `session` (its index), given [`Self::cdf`].
    pub fn adapter_of(&self, cdf: &[f64], session: u64) -> usize {
        let u =
            (splitmix64(session ^ self.seed.rotate_left(17)) >> 11) as f64 / (1u64 << 53) as f64;
        cdf.partition_point(|&c| c <= u)
            .min(cdf.len().saturating_sub(1))
    }
}

/// The name of adapter `k`.
pub fn adapter_name(k: usize) -> String {
    format!("lora-{k}")
}

fn splitmix64(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// An engine's loaded adapters (the truth the routers' tables track): the
/// simulated engine's slots ([`AdapterSlots`]), each adapter with the
/// wall time its load ends.
#[derive(Clone, Debug)]
pub(crate) struct EngineAdapters {
    loaded: AdapterSlots<f64>,
}

impl EngineAdapters {
    /// An engine of `slots` adapter slots (at least one).
    pub(crate) fn new(slots: usize) -> Self {
        Self {
            loaded: AdapterSlots::new(slots.max(1)),
        }
    }

    /// The same engine with nothing loaded (a restart).
    pub(crate) fn emptied(&self) -> Self {
        Self::new(self.loaded.slots())
    }

    /// A request for `adapter` starts here at `now`: when it can run (a
    /// load under way or made now), and whether this made a load.
    /// `unload` is the router's named victim; a full engine evicts its
    /// least recently used otherwise.
    pub(crate) fn acquire(
        &mut self,
        adapter: &str,
        unload: Option<&str>,
        load_wall_ms: f64,
        now: f64,
    ) -> (f64, bool) {
        if let Some(ready) = self.loaded.touch(adapter, now) {
            return (ready.max(now), false);
        }
        if let Some(victim) = unload {
            self.loaded.unload(victim);
        }
        let ready = now + load_wall_ms;
        self.loaded.load(adapter, ready, now);
        (ready, true)
    }
}

/// Adapter figures of one run.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct AdapterFigures {
    /// Adapter loads the engines made.
    pub loads: u64,
    /// Requests that waited for a load.
    pub waited: u64,
    /// Requests for an adapter.
    pub requests: u64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_mix_is_zipf_like_and_deterministic() {
        let mix = AdapterMix {
            count: 8,
            skew: 1.0,
            ..AdapterMix::default()
        };
        let cdf = mix.cdf();
        assert!((cdf[7] - 1.0).abs() < 1e-9);
        let mut counts = [0u32; 8];
        for s in 0..20_000 {
            counts[mix.adapter_of(&cdf, s)] += 1;
        }
        assert!(
            counts[0] > 2 * counts[3] && counts[3] > counts[7],
            "{counts:?}"
        );
        assert_eq!(mix.adapter_of(&cdf, 42), mix.adapter_of(&cdf, 42));
        let uniform = AdapterMix { skew: 0.0, ..mix };
        let cdf = uniform.cdf();
        let mut counts = [0u32; 8];
        for s in 0..20_000 {
            counts[uniform.adapter_of(&cdf, s)] += 1;
        }
        assert!(
            counts.iter().all(|&c| (2_000..3_000).contains(&c)),
            "{counts:?}"
        );
    }

    #[test]
    fn an_engine_keeps_its_slots_and_a_load_under_way_is_shared() {
        let mut e = EngineAdapters::new(2);
        assert_eq!(e.acquire("a", None, 50.0, 0.0), (50.0, true));
        assert_eq!(e.acquire("a", None, 50.0, 10.0), (50.0, false));
        e.acquire("b", None, 50.0, 20.0);
        // Full: c evicts a (used at 10) rather than b (20).
        e.acquire("c", None, 50.0, 30.0);
        assert_eq!(e.loaded.len(), 2);
        assert!(!e.loaded.contains("a"));
        // The router's victim goes first.
        e.acquire("d", Some("c"), 50.0, 40.0);
        assert!(e.loaded.contains("b"));
    }
}
