//! One routing decision, written once for both places a route is made:
//! under the dispatcher's lock, from the router's own write model
//! ([`Router::route_with`](super::Router::route_with)), and outside it,
//! from the published load board ([`super::board::PreRouter`]). Both read
//! the same prefix index and build the same candidates the same way; only
//! where the loads come from differs ([`Loads`]).

use super::{depth_of, RouterConfig, SlotDepths, WorkerSlot};
use crate::adapters::AdapterTable;
use crate::index::{OverlapScores, PrefixIndex, TieredIndex};
use crate::select::{
    Candidate, PolicyKind, PrefillTime, RoutingContext, RoutingRequest, SelectOutcome, Selector,
};
use crate::sequences::{ActiveSequences, WorkerLoad};
use crate::types::{SequenceHash, WorkerId};

/// What a route reads of the workers besides their caches, by registry
/// slot ([`ActiveSequences::slot_of`]).
pub(crate) trait Loads {
    /// One past the highest slot in use.
    fn slot_count(&self) -> usize;
    /// The load of the worker in `slot`, if one is there.
    fn load(&self, slot: usize) -> Option<&WorkerLoad>;
    /// Its capacity, recent writes and selectability.
    fn worker(&self, slot: usize) -> Option<&WorkerSlot>;
    /// The slot of `worker`.
    fn slot_of(&self, worker: WorkerId) -> Option<usize>;
    /// `each(slot, depth)` for every worker on which the prompt's leading
    /// blocks are active ([`ActiveSequences::active_prompt_depths`]).
    fn active_depths(
        &self,
        blocks: &[crate::types::LocalHash],
        chain: &mut Vec<SequenceHash>,
        each: &mut dyn FnMut(usize, u32),
    );
}

/// Whether a worker with `load` and `slot`'s capacity, `prefill_tokens`
/// still to prefill, is over the busy threshold (never without one), less
/// the `headroom` held back from the request.
pub(super) fn is_busy(
    config: &RouterConfig,
    slot: Option<&WorkerSlot>,
    load: &WorkerLoad,
    prefill_tokens: u64,
    headroom: f64,
) -> bool {
    match (config.busy_threshold, slot.map(|s| &s.capacity)) {
        (Some(t), Some(cap)) => {
            let t = if headroom > 0.0 {
                t * (1.0 - headroom.min(1.0))
            } else {
                t
            };
            cap.max_num_batched_tokens
                .is_some_and(|m| prefill_tokens as f64 > t * m as f64)
                || cap
                    .kv_blocks_of(cap.block_size_or(config.sequences.block_size))
                    .is_some_and(|m| load.decode_blocks as f64 > t * m as f64)
        }
        _ => false,
    }
}

/// The router's own loads: its write model and worker slots.
pub(crate) struct OwnLoads<'a> {
    pub sequences: &'a ActiveSequences,
    pub workers: &'a [Option<WorkerSlot>],
}

impl Loads for OwnLoads<'_> {
    fn slot_count(&self) -> usize {
        self.sequences.registry().slot_count()
    }

    fn load(&self, slot: usize) -> Option<&WorkerLoad> {
        self.sequences.registry().slot(slot)
    }

    fn worker(&self, slot: usize) -> Option<&WorkerSlot> {
        self.workers.get(slot)?.as_ref()
    }

    fn slot_of(&self, worker: WorkerId) -> Option<usize> {
        self.sequences.slot_of(worker)
    }

    fn active_depths(
        &self,
        blocks: &[crate::types::LocalHash],
        chain: &mut Vec<SequenceHash>,
        each: &mut dyn FnMut(usize, u32),
    ) {
        self.sequences.active_prompt_depths(blocks, chain, each);
    }
}

/// A route's working buffers, kept between decisions so that one
/// allocates nothing.
#[derive(Debug, Default)]
pub(crate) struct RouteScratch {
    overlaps: OverlapScores,
    /// Each worker's host-tier run right after its device prefix (empty
    /// while no worker holds a host-tier block).
    host_runs: OverlapScores,
    /// Hybrid workers' deepest SSM checkpoints within their device prefix.
    checkpoint_depths: OverlapScores,
    /// Every worker's device prefix before the hybrid workers' were cut
    /// back (empty when no worker is hybrid).
    held: OverlapScores,
    /// The prompt's chained hashes, for its active-prompt depths.
    chain: Vec<SequenceHash>,
    /// Each worker's cached blocks by registry slot, read with the
    /// overlaps in one visit to the index.
    cached: Vec<usize>,
    /// Each worker's depths by registry slot.
    depths: Vec<SlotDepths>,
    /// The last decision's candidates.
    pub candidates: Vec<Candidate>,
}

impl RouteScratch {
    /// Lends the prompt-chain buffer, cleared, to `f`.
    pub(super) fn chain_for_depths(&mut self, f: impl FnOnce(&mut Vec<SequenceHash>)) {
        self.chain.clear();
        f(&mut self.chain);
    }

    /// Heap bytes of the buffers.
    pub(super) fn heap_bytes(&self) -> usize {
        (self.overlaps.entries.capacity()
            + self.host_runs.entries.capacity()
            + self.checkpoint_depths.entries.capacity()
            + self.held.entries.capacity())
            * std::mem::size_of::<crate::index::WorkerOverlap>()
            + self.cached.capacity() * std::mem::size_of::<usize>()
            + self.depths.capacity() * std::mem::size_of::<SlotDepths>()
            + self.chain.capacity() * std::mem::size_of::<SequenceHash>()
            + self.candidates.capacity() * std::mem::size_of::<Candidate>()
    }

    /// One visit to the index (one read of a published one): the prompt's
    /// overlaps, every worker's cached blocks, once any worker runs a
    /// hybrid model each hybrid worker's prefix cut back to its deepest
    /// SSM checkpoint (the engine resumes from there, not from the end of
    /// its attention prefix), and, once any worker holds host-tier
    /// blocks, each worker's host-tier run right after its device prefix.
    pub(super) fn read_index(
        &mut self,
        blocks: &[crate::types::LocalHash],
        loads: &impl Loads,
        device: &PrefixIndex,
        tiers: Option<&TieredIndex>,
    ) {
        let RouteScratch {
            overlaps,
            host_runs,
            checkpoint_depths,
            held,
            cached,
            ..
        } = self;
        device.overlaps(blocks, overlaps);
        cached.clear();
        cached.resize(loads.slot_count(), 0);
        for (slot, cached) in cached.iter_mut().enumerate() {
            if let Some(load) = loads.load(slot) {
                *cached = device.worker_blocks(load.worker);
            }
        }
        overlaps.entries.sort_unstable_by_key(|e| e.worker);
        held.entries.clear();
        let Some(tiers) = tiers else {
            host_runs.entries.clear();
            return;
        };
        let checkpoints = tiers.checkpoint();
        if checkpoints.workers().next().is_some() {
            checkpoints.deepest_within(blocks, |w| depth_of(overlaps, w), checkpoint_depths);
            checkpoint_depths.entries.sort_unstable_by_key(|e| e.worker);
            held.entries.extend_from_slice(&overlaps.entries);
            for entry in overlaps.entries.iter_mut() {
                if tiers.is_hybrid(entry.worker) {
                    entry.depth = depth_of(checkpoint_depths, entry.worker);
                }
            }
            overlaps.entries.retain(|e| e.depth > 0);
        }
        let host = tiers.host();
        if host.live_pairs() > 0 {
            let overlaps = &*overlaps;
            host.runs_from(blocks, |w| depth_of(overlaps, w), host_runs);
            host_runs.entries.sort_unstable_by_key(|e| e.worker);
        } else {
            host_runs.entries.clear();
        }
    }

    /// The rest of a decision, after [`Self::read_index`] for the same
    /// request and loads: every eligible, selectable worker as a
    /// candidate, adapter affinity, then `selector`'s choice.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn select(
        &mut self,
        request: RoutingRequest<'_>,
        eligible: Option<&[WorkerId]>,
        loads: &impl Loads,
        config: &RouterConfig,
        adapters: &AdapterTable,
        selector: &mut dyn Selector,
        prefill: &dyn PrefillTime,
        now_ms: f64,
    ) -> SelectOutcome {
        // Every depth by registry slot: a few scattered entries, then one
        // read per candidate instead of a search per candidate and score.
        let depths = &mut self.depths;
        depths.clear();
        depths.resize(loads.slot_count(), SlotDepths::default());
        let mut scatter = |scores: &OverlapScores, set: fn(&mut SlotDepths, u32)| {
            for e in &scores.entries {
                if let Some(d) = loads.slot_of(e.worker).and_then(|s| depths.get_mut(s)) {
                    set(d, e.depth);
                }
            }
        };
        // Without hybrid workers the prefix held is the device prefix.
        if self.held.entries.is_empty() {
            scatter(&self.overlaps, |d, v| (d.overlap, d.held) = (v, v));
        } else {
            scatter(&self.overlaps, |d, v| d.overlap = v);
            scatter(&self.held, |d, v| d.held = v);
        }
        scatter(&self.host_runs, |d, v| d.host = v);
        loads.active_depths(request.blocks, &mut self.chain, &mut |slot, depth| {
            if let Some(d) = depths.get_mut(slot) {
                d.active = depth;
            }
        });
        self.candidates.clear();
        // The request's blocks were hashed at its model's block size, the
        // size of every worker that may serve it.
        let block_size = request
            .model
            .block_size
            .filter(|&b| b > 0)
            .unwrap_or(config.sequences.block_size);
        for slot in 0..loads.slot_count() {
            let Some(load) = loads.load(slot) else {
                continue;
            };
            let worker = load.worker;
            let (cached_blocks, depths) = (self.cached[slot], self.depths[slot]);
            if let Some(eligible) = eligible {
                if !eligible.contains(&worker) {
                    continue;
                }
            }
            let slot = loads.worker(slot);
            if slot.is_some_and(|s| !s.selectable) {
                continue;
            }
            let prefill_tokens = load.active_prefill_tokens(now_ms);
            let busy = is_busy(config, slot, load, prefill_tokens, request.headroom);
            let block_size = u64::from(block_size.max(1));
            let kv_capacity_blocks = slot
                .and_then(|s| s.capacity.kv_tokens)
                .map(|tokens| tokens / block_size);
            self.candidates.push(Candidate {
                worker,
                overlap_blocks: depths.overlap,
                held_prefix_blocks: depths.held,
                host_overlap_blocks: depths.host,
                cached_blocks,
                active_prompt_blocks: depths.active,
                active_prefill_tokens: prefill_tokens,
                active_decode_blocks: load.decode_blocks,
                active_requests: load.requests,
                kv_capacity_blocks,
                recent_writes_tokens: match (slot, kv_capacity_blocks) {
                    (Some(slot), Some(_)) => slot.writes.at(now_ms),
                    _ => 0.0,
                },
                adapter_load_ms: request
                    .adapter
                    .map_or(0.0, |a| adapters.load_cost_ms(worker, a, now_ms)),
                busy,
            });
        }
        // Adapter affinity for the policies that do not price time: the
        // workers that have the adapter, when any available one does, and
        // those far less busy than every holder (a hot adapter spreads).
        if let Some(adapter) = request.adapter {
            // An adapter nobody can load runs only where it is loaded.
            if adapters.holders_only(adapter) {
                self.candidates.retain(|c| adapters.has(c.worker, adapter));
            }
            let adapter_config = adapters.config();
            let least_busy_holder = self
                .candidates
                .iter()
                .filter(|c| !c.busy && adapters.has(c.worker, adapter))
                .map(|c| c.active_requests)
                .min();
            if let (false, false, Some(holder)) = (
                adapter_config.blind,
                config.policy == PolicyKind::Ttft,
                least_busy_holder,
            ) {
                let slack = adapter_config.affinity_slack_requests;
                self.candidates.retain(|c| {
                    adapters.has(c.worker, adapter) || c.active_requests + slack < holder
                });
            }
        }
        selector.select(&RoutingContext {
            request,
            candidates: &self.candidates,
            block_size,
            now_ms,
            prefill,
        })
    }
}
