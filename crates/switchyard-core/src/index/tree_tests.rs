use super::*;
use proptest::prelude::*;
use std::collections::{HashMap, HashSet};

fn w(id: u64) -> WorkerId {
    WorkerId::new(id)
}

fn blocks(pairs: &[(u64, u64)]) -> Vec<StoredBlock> {
    pairs
        .iter()
        .map(|&(e, l)| StoredBlock {
            engine_hash: EngineHash(e),
            local_hash: LocalHash(l),
        })
        .collect()
}

fn locals(hashes: &[u64]) -> Vec<LocalHash> {
    hashes.iter().map(|&h| LocalHash(h)).collect()
}

#[test]
fn overlaps_report_each_workers_matched_prefix_depth() {
    let mut index = PrefixIndex::new();
    index.store(w(1), None, &blocks(&[(101, 1), (102, 2), (103, 3)]));
    index.store(w(2), None, &blocks(&[(201, 1), (202, 2)]));
    let scores = index.find_overlaps(&locals(&[1, 2, 3, 4]));
    assert_eq!(scores.depth(w(1)), 3);
    assert_eq!(scores.depth(w(2)), 2);
    assert_eq!(scores.entries.len(), 2);
    assert_eq!(index.find_overlaps(&locals(&[2, 3])).entries.len(), 0);
    assert_eq!(index.find_overlaps(&[]).entries.len(), 0);
}

#[test]
fn a_stored_chain_continues_from_its_parent() {
    let mut index = PrefixIndex::new();
    index.store(w(1), None, &blocks(&[(11, 1)]));
    let outcome = index.store(w(1), Some(EngineHash(11)), &blocks(&[(12, 2)]));
    assert_eq!(
        outcome,
        ApplyOutcome::Applied {
            changed: 1,
            unknown: 0
        }
    );
    assert_eq!(index.find_overlaps(&locals(&[1, 2])).depth(w(1)), 2);
}

#[test]
fn a_parent_never_stored_drops_the_event_and_is_counted() {
    let mut index = PrefixIndex::new();
    let outcome = index.store(w(1), Some(EngineHash(99)), &blocks(&[(12, 2)]));
    assert_eq!(outcome, ApplyOutcome::UnknownParent);
    index.store(w(1), None, &blocks(&[(11, 1)]));
    let outcome = index.store(w(1), Some(EngineHash(99)), &blocks(&[(12, 2)]));
    assert_eq!(outcome, ApplyOutcome::UnknownParent);
    assert_eq!(index.counters().unknown_parent, 2);
    assert_eq!(index.live_pairs(), 1);
    index.check_invariants();
}

#[test]
fn restoring_a_cached_block_changes_nothing() {
    let mut index = PrefixIndex::new();
    let chain = blocks(&[(11, 1), (12, 2)]);
    index.store(w(1), None, &chain);
    let bytes = index.live_nodes();
    let outcome = index.store(w(1), None, &chain);
    assert_eq!(
        outcome,
        ApplyOutcome::Applied {
            changed: 0,
            unknown: 0
        }
    );
    assert_eq!(index.live_pairs(), 2);
    assert_eq!(index.live_nodes(), bytes);
}

#[test]
fn a_worker_missing_a_middle_block_matches_only_up_to_it() {
    let mut index = PrefixIndex::new();
    index.store(w(1), None, &blocks(&[(11, 1), (12, 2), (13, 3)]));
    index.remove(w(1), &[EngineHash(12)]);
    assert_eq!(index.find_overlaps(&locals(&[1, 2, 3])).depth(w(1)), 1);
    // The unheld middle node stays as structure for its held child.
    assert_eq!(index.live_nodes(), 3);
    index.check_invariants();
    index.remove(w(1), &[EngineHash(13)]);
    assert_eq!(index.live_nodes(), 1);
    index.check_invariants();
}

#[test]
fn removing_everything_reclaims_every_node() {
    let mut index = PrefixIndex::new();
    index.store(w(1), None, &blocks(&[(11, 1), (12, 2), (13, 3)]));
    index.store(w(2), None, &blocks(&[(21, 1), (22, 2), (24, 4)]));
    index.remove(w(1), &[EngineHash(13), EngineHash(12), EngineHash(11)]);
    index.clear(w(2));
    assert_eq!(index.live_pairs(), 0);
    assert_eq!(index.live_nodes(), 0);
    index.check_invariants();
}

#[test]
fn unknown_workers_and_blocks_are_outcomes() {
    let mut index = PrefixIndex::new();
    assert_eq!(
        index.remove(w(7), &[EngineHash(1)]),
        ApplyOutcome::UnknownWorker
    );
    assert_eq!(index.clear(w(7)), ApplyOutcome::UnknownWorker);
    assert!(!index.remove_worker(w(7)));
    index.store(w(7), None, &blocks(&[(11, 1)]));
    assert_eq!(
        index.remove(w(7), &[EngineHash(5), EngineHash(11)]),
        ApplyOutcome::Applied {
            changed: 1,
            unknown: 1
        }
    );
    assert_eq!(index.counters().unknown_removed_blocks, 1);
}

#[test]
fn a_removed_worker_is_never_matched_again() {
    let mut index = PrefixIndex::new();
    index.store(w(1), None, &blocks(&[(11, 1)]));
    index.store(w(2), None, &blocks(&[(21, 1)]));
    assert!(index.remove_worker(w(1)));
    let scores = index.find_overlaps(&locals(&[1]));
    assert_eq!(scores.entries.len(), 1);
    assert_eq!(scores.depth(w(2)), 1);
    assert_eq!(index.workers().collect::<Vec<_>>(), vec![w(2)]);
}

#[test]
fn an_engine_hash_reused_for_other_content_moves_to_the_new_block() {
    let mut index = PrefixIndex::new();
    index.store(w(1), None, &blocks(&[(11, 1)]));
    index.store(w(1), None, &blocks(&[(11, 5)]));
    assert_eq!(index.find_overlaps(&locals(&[1])).depth(w(1)), 0);
    assert_eq!(index.find_overlaps(&locals(&[5])).depth(w(1)), 1);
    assert_eq!(index.live_pairs(), 1);
    index.check_invariants();
}

#[test]
fn two_engine_names_for_one_block_keep_it_until_both_are_removed() {
    let mut index = PrefixIndex::new();
    index.store(w(1), None, &blocks(&[(11, 1)]));
    index.store(w(1), None, &blocks(&[(12, 1)]));
    assert_eq!(index.live_pairs(), 1);
    index.remove(w(1), &[EngineHash(11)]);
    assert_eq!(index.find_overlaps(&locals(&[1])).depth(w(1)), 1);
    index.remove(w(1), &[EngineHash(12)]);
    assert_eq!(index.find_overlaps(&locals(&[1])).depth(w(1)), 0);
    index.check_invariants();
}

#[test]
fn more_than_64_workers_widen_the_holder_sets() {
    let mut index = PrefixIndex::new();
    for id in 0..130 {
        let depth = 1 + id % 3;
        let chain: Vec<(u64, u64)> = (0..depth).map(|d| (1000 * id + d, d + 1)).collect();
        index.store(w(id), None, &blocks(&chain));
    }
    let scores = index.find_overlaps(&locals(&[1, 2, 3]));
    assert_eq!(scores.entries.len(), 130);
    for id in 0..130 {
        assert_eq!(scores.depth(w(id)), (1 + id % 3) as u32, "worker {id}");
    }
    index.check_invariants();
    for id in 0..130 {
        index.remove_worker(w(id));
    }
    assert_eq!(index.live_nodes(), 0);
}

#[test]
fn a_chain_stored_under_a_path_no_one_holds_keeps_the_path_as_structure() {
    let mut index = PrefixIndex::new();
    let outcome = index.store_under_path(w(1), &locals(&[1, 2]), &blocks(&[(13, 3)]));
    assert_eq!(
        outcome,
        ApplyOutcome::Applied {
            changed: 1,
            unknown: 0
        }
    );
    assert_eq!(index.live_pairs(), 1);
    assert_eq!(index.live_nodes(), 3);
    // Not a prefix match (blocks 1 and 2 are not held) ...
    assert_eq!(index.find_overlaps(&locals(&[1, 2, 3])).depth(w(1)), 0);
    // ... but a run from block 2.
    let mut runs = OverlapScores::new();
    index.runs_from(&locals(&[1, 2, 3, 4]), |_| 2, &mut runs);
    assert_eq!(runs.depth(w(1)), 1);
    index.check_invariants();
    index.remove(w(1), &[EngineHash(13)]);
    assert_eq!(index.live_nodes(), 0, "the path goes with its chain");
    index.check_invariants();
    assert_eq!(
        index.store_under_path(w(1), &locals(&[1]), &[]),
        ApplyOutcome::Applied {
            changed: 0,
            unknown: 0
        }
    );
    assert_eq!(index.live_nodes(), 0, "an empty chain leaves no path");
}

#[test]
fn the_path_of_a_block_is_its_prefix_from_the_root() {
    let mut index = PrefixIndex::new();
    index.store(w(1), None, &blocks(&[(11, 1), (12, 2), (13, 3)]));
    let mut path = vec![LocalHash(99)];
    assert!(index.path_of(w(1), EngineHash(12), &mut path));
    assert_eq!(path, locals(&[1, 2]));
    assert!(!index.path_of(w(2), EngineHash(12), &mut path));
    assert!(!index.path_of(w(1), EngineHash(14), &mut path));
    assert!(path.is_empty());
}

#[test]
fn a_run_stops_at_the_first_block_not_held() {
    let mut index = PrefixIndex::new();
    index.store(w(1), None, &blocks(&[(11, 1), (12, 2), (13, 3), (14, 4)]));
    index.remove(w(1), &[EngineHash(13)]);
    index.store(w(2), None, &blocks(&[(21, 1)]));
    let mut runs = OverlapScores::new();
    let query = locals(&[1, 2, 3, 4]);
    index.runs_from(&query, |_| 1, &mut runs);
    assert_eq!(runs.depth(w(1)), 1, "block 2 held, block 3 not");
    assert_eq!(runs.depth(w(2)), 0);
    index.runs_from(&query, |_| 3, &mut runs);
    assert_eq!(runs.depth(w(1)), 1, "block 4 alone");
    index.runs_from(&query, |_| 9, &mut runs);
    assert!(
        runs.entries.is_empty(),
        "a start past the prompt runs nowhere"
    );
}

#[test]
fn the_deepest_held_block_is_found_within_each_workers_limit() {
    // Checkpoints at blocks 1 and 3 of a path whose block 2 nobody
    // holds in this tier (it is structure under the device path).
    let mut index = PrefixIndex::new();
    index.store(w(1), None, &blocks(&[(11, 1)]));
    index.store_under_path(w(1), &locals(&[1, 2]), &blocks(&[(13, 3)]));
    index.store(w(2), None, &blocks(&[(21, 1)]));
    let query = locals(&[1, 2, 3, 4]);
    let mut out = OverlapScores::new();
    index.deepest_within(&query, |_| 4, &mut out);
    assert_eq!(out.depth(w(1)), 3);
    assert_eq!(out.depth(w(2)), 1);
    index.deepest_within(&query, |_| 2, &mut out);
    assert_eq!(out.depth(w(1)), 1, "block 3 lies past the limit");
    index.deepest_within(&query, |_| 0, &mut out);
    assert!(out.entries.is_empty());
}

// --- model-based property test ----------------------------------------

/// Naive reference: per worker, engine hash → full prefix (as a vector of
/// local hashes) it names.
#[derive(Default)]
struct Model {
    workers: HashMap<u64, HashMap<u64, Vec<u64>>>,
    /// Per worker, its engine hashes in the order first stored.
    order: HashMap<u64, Vec<u64>>,
    /// Most engine hashes a worker holds; past it the oldest go.
    cap: usize,
    /// Engine hashes dropped at the cap.
    evicted: u64,
}

impl Model {
    fn capped(cap: usize) -> Self {
        Self {
            cap,
            ..Self::default()
        }
    }

    /// Records that `worker` holds `engine` as `prefix` (a new name
    /// joins the back of the order; a reused one keeps its place).
    fn store(&mut self, worker: u64, engine: u64, prefix: Vec<u64>) {
        let entry = self.workers.entry(worker).or_default();
        if entry.insert(engine, prefix).is_none() {
            self.order.entry(worker).or_default().push(engine);
        }
    }

    fn remove(&mut self, worker: u64, engine: u64) {
        if let Some(m) = self.workers.get_mut(&worker) {
            if m.remove(&engine).is_some() {
                let order = self.order.entry(worker).or_default();
                order.retain(|&e| e != engine);
            }
        }
    }

    /// Drops each worker's oldest names past the cap.
    fn evict(&mut self) {
        for (worker, m) in &mut self.workers {
            let order = self.order.entry(*worker).or_default();
            while m.len() > self.cap {
                let oldest = order.remove(0);
                m.remove(&oldest);
                self.evicted += 1;
            }
        }
    }

    fn prefixes(&self, worker: u64) -> HashSet<Vec<u64>> {
        self.workers
            .get(&worker)
            .map(|m| m.values().cloned().collect())
            .unwrap_or_default()
    }

    fn depth(&self, worker: u64, query: &[u64]) -> u32 {
        self.run_from(worker, query, 0)
    }

    /// Consecutive query blocks the worker holds from block `start` on.
    fn run_from(&self, worker: u64, query: &[u64], start: usize) -> u32 {
        let held = self.prefixes(worker);
        (start + 1..=query.len())
            .take_while(|&n| held.contains(&query[..n]))
            .count() as u32
    }

    /// The deepest 1-based position within the first `limit` query
    /// blocks whose prefix the worker holds (0: none).
    fn deepest_within(&self, worker: u64, query: &[u64], limit: usize) -> u32 {
        let held = self.prefixes(worker);
        (1..=query.len().min(limit))
            .rev()
            .find(|&n| held.contains(&query[..n]))
            .unwrap_or(0) as u32
    }
}

#[derive(Clone, Debug)]
enum Op {
    /// Store a chain of local hashes under the prefix of an existing
    /// engine hash (by index into the worker's known ones) or the root.
    Store {
        worker: u64,
        parent: Option<usize>,
        locals: Vec<u64>,
        engine_base: u64,
    },
    /// Store a chain under an arbitrary prefix path, held or not.
    StoreUnderPath {
        worker: u64,
        path: Vec<u64>,
        locals: Vec<u64>,
        engine_base: u64,
    },
    Remove {
        worker: u64,
        picks: Vec<usize>,
        bogus: bool,
    },
    Clear {
        worker: u64,
    },
    RemoveWorker {
        worker: u64,
    },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => (0..5u64, proptest::option::of(0..50usize), proptest::collection::vec(0..4u64, 1..6), 0..40u64)
            .prop_map(|(worker, parent, locals, engine_base)| Op::Store { worker, parent, locals, engine_base }),
        2 => (0..5u64, proptest::collection::vec(0..4u64, 0..4), proptest::collection::vec(0..4u64, 1..4), 0..40u64)
            .prop_map(|(worker, path, locals, engine_base)| Op::StoreUnderPath { worker, path, locals, engine_base }),
        3 => (0..5u64, proptest::collection::vec(0..50usize, 1..4), any::<bool>())
            .prop_map(|(worker, picks, bogus)| Op::Remove { worker, picks, bogus }),
        1 => (0..5u64).prop_map(|worker| Op::Clear { worker }),
        1 => (0..5u64).prop_map(|worker| Op::RemoveWorker { worker }),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn index_agrees_with_a_naive_model(ops in proptest::collection::vec(op(), 1..80)) {
        agrees_with_the_model(ops, usize::MAX)?;
    }

    #[test]
    fn a_capped_index_drops_each_workers_oldest_as_the_model_does(
        ops in proptest::collection::vec(op(), 1..80),
        cap in 1..10usize,
    ) {
        agrees_with_the_model(ops, cap)?;
    }
}

fn agrees_with_the_model(ops: Vec<Op>, cap: usize) -> Result<(), TestCaseError> {
    {
        let mut index = PrefixIndex::with_max_blocks_per_worker(cap);
        let mut model = Model::capped(cap);
        let mut queries: Vec<Vec<u64>> = vec![vec![0, 1, 2, 3, 0]];
        for op in ops {
            match op {
                Op::Store {
                    worker,
                    parent,
                    locals,
                    engine_base,
                } => {
                    let known: Vec<(u64, Vec<u64>)> = {
                        let mut v: Vec<_> = model
                            .workers
                            .get(&worker)
                            .map(|m| m.iter().map(|(k, p)| (*k, p.clone())).collect())
                            .unwrap_or_default();
                        v.sort();
                        v
                    };
                    let (parent_hash, mut prefix) = match parent {
                        Some(i) if !known.is_empty() => {
                            let (e, p) = &known[i % known.len()];
                            (Some(EngineHash(*e)), p.clone())
                        }
                        // A parent the worker never stored.
                        Some(_) => (Some(EngineHash(999_999)), vec![]),
                        None => (None, vec![]),
                    };
                    let chain: Vec<StoredBlock> = locals
                        .iter()
                        .enumerate()
                        .map(|(i, &l)| StoredBlock {
                            engine_hash: EngineHash(engine_base * 8 + i as u64),
                            local_hash: LocalHash(l),
                        })
                        .collect();
                    let outcome = index.store(WorkerId::new(worker), parent_hash, &chain);
                    if parent.is_some() && known.is_empty() {
                        prop_assert_eq!(outcome, ApplyOutcome::UnknownParent);
                        continue;
                    }
                    let applied = matches!(outcome, ApplyOutcome::Applied { .. });
                    prop_assert!(applied, "store was not applied: {:?}", outcome);
                    for block in &chain {
                        prefix.push(block.local_hash.0);
                        model.store(worker, block.engine_hash.0, prefix.clone());
                    }
                    queries.push(prefix);
                }
                Op::StoreUnderPath {
                    worker,
                    path,
                    locals,
                    engine_base,
                } => {
                    let chain: Vec<StoredBlock> = locals
                        .iter()
                        .enumerate()
                        .map(|(i, &l)| StoredBlock {
                            engine_hash: EngineHash(engine_base * 8 + i as u64),
                            local_hash: LocalHash(l),
                        })
                        .collect();
                    let path_hashes: Vec<LocalHash> = path.iter().map(|&l| LocalHash(l)).collect();
                    let outcome =
                        index.store_under_path(WorkerId::new(worker), &path_hashes, &chain);
                    let applied = matches!(outcome, ApplyOutcome::Applied { .. });
                    prop_assert!(applied, "store was not applied: {:?}", outcome);
                    let mut prefix = path.clone();
                    for block in &chain {
                        prefix.push(block.local_hash.0);
                        model.store(worker, block.engine_hash.0, prefix.clone());
                    }
                    queries.push(prefix);
                }
                Op::Remove {
                    worker,
                    picks,
                    bogus,
                } => {
                    let mut known: Vec<u64> = model
                        .workers
                        .get(&worker)
                        .map(|m| m.keys().copied().collect())
                        .unwrap_or_default();
                    known.sort();
                    let mut hashes: Vec<EngineHash> = if known.is_empty() {
                        vec![]
                    } else {
                        picks
                            .iter()
                            .map(|&i| EngineHash(known[i % known.len()]))
                            .collect()
                    };
                    if bogus {
                        hashes.push(EngineHash(777_777));
                    }
                    index.remove(WorkerId::new(worker), &hashes);
                    for h in &hashes {
                        model.remove(worker, h.0);
                    }
                }
                Op::Clear { worker } => {
                    index.clear(WorkerId::new(worker));
                    if let Some(m) = model.workers.get_mut(&worker) {
                        m.clear();
                    }
                    model.order.remove(&worker);
                }
                Op::RemoveWorker { worker } => {
                    index.remove_worker(WorkerId::new(worker));
                    model.workers.remove(&worker);
                    model.order.remove(&worker);
                }
            }
            model.evict();
            index.check_invariants();
            prop_assert_eq!(index.counters().evicted_over_cap, model.evicted);
            for worker in 0..5u64 {
                let held = model.workers.get(&worker).map_or(0, HashMap::len);
                prop_assert!(held <= cap);
            }
            let model_pairs: usize = model.workers.keys().map(|&w| model.prefixes(w).len()).sum();
            prop_assert_eq!(index.live_pairs(), model_pairs);
            for query in &queries {
                let scores = index.find_overlaps(&locals(query));
                for worker in 0..5u64 {
                    prop_assert_eq!(
                        scores.depth(WorkerId::new(worker)),
                        model.depth(worker, query),
                        "worker {} query {:?}",
                        worker,
                        query
                    );
                }
                for e in &scores.entries {
                    prop_assert!(e.depth > 0);
                    prop_assert_eq!(e.cached_blocks, model.prefixes(e.worker.worker_id).len());
                }
                // Runs from a per-worker start, as the host tier is read.
                let start = |w: WorkerId| (w.worker_id % 3) as u32;
                let mut runs = OverlapScores::new();
                index.runs_from(&locals(query), start, &mut runs);
                for worker in 0..5u64 {
                    let run = runs.depth(WorkerId::new(worker));
                    prop_assert_eq!(
                        run,
                        model.run_from(worker, query, (worker % 3) as usize),
                        "worker {} query {:?}",
                        worker,
                        query
                    );
                }
                // The deepest held block within a per-worker limit, as
                // the SSM-checkpoint tier is read.
                let limit = |w: WorkerId| (w.worker_id % 4 + 1) as u32;
                let mut deepest = OverlapScores::new();
                index.deepest_within(&locals(query), limit, &mut deepest);
                for worker in 0..5u64 {
                    prop_assert_eq!(
                        deepest.depth(WorkerId::new(worker)),
                        model.deepest_within(worker, query, (worker % 4 + 1) as usize),
                        "worker {} query {:?}",
                        worker,
                        query
                    );
                }
            }
            // Every block's path is the prefix the model gave it.
            let mut path = Vec::new();
            for (&worker, blocks) in &model.workers {
                for (&engine, prefix) in blocks {
                    prop_assert!(index.path_of(
                        WorkerId::new(worker),
                        EngineHash(engine),
                        &mut path
                    ));
                    prop_assert_eq!(&path, &locals(prefix));
                }
            }
            prop_assert!(!index.path_of(WorkerId::new(0), EngineHash(888_888), &mut path));
            prop_assert!(path.is_empty());
        }
        for worker in 0..5u64 {
            index.remove_worker(WorkerId::new(worker));
        }
        prop_assert_eq!(index.live_pairs(), 0);
        prop_assert_eq!(index.live_nodes(), 0);
        index.check_invariants();
    }
    Ok(())
}

#[test]
fn a_worker_past_its_cap_loses_its_oldest_blocks_first() {
    let mut index = PrefixIndex::with_max_blocks_per_worker(4);
    index.store(w(1), None, &blocks(&[(1, 10), (2, 20)]));
    index.store(w(2), None, &blocks(&[(1, 10), (2, 20)]));
    index.store(w(1), None, &blocks(&[(3, 30), (4, 40), (5, 50)]));
    // Worker 1's oldest name went; worker 2, within its cap, kept its own.
    assert_eq!(index.counters().evicted_over_cap, 1);
    assert!(!index.holds(w(1), EngineHash(1)));
    assert!(index.holds(w(1), EngineHash(2)));
    assert_eq!(index.worker_blocks(w(1)), 4);
    assert_eq!(index.find_overlaps(&locals(&[10, 20])).depth(w(1)), 0);
    assert_eq!(index.find_overlaps(&locals(&[10, 20])).depth(w(2)), 2);
    index.check_invariants();
}

#[test]
fn a_worker_publishing_endless_new_hashes_stays_within_its_cap() {
    let mut index = PrefixIndex::with_max_blocks_per_worker(64);
    index.store(w(2), None, &blocks(&[(7, 70)]));
    for round in 0..1_000u64 {
        let chain: Vec<(u64, u64)> = (0..8)
            .map(|i| (round * 8 + i + 100, round * 8 + i + 100))
            .collect();
        index.store(w(1), None, &blocks(&chain));
        if round % 3 == 0 {
            // Engine removals in between leave stale names to skip.
            index.remove(w(1), &[EngineHash(round * 8 + 100)]);
        }
    }
    assert!(index.worker_blocks(w(1)) <= 64);
    assert!(index.live_pairs() <= 65);
    assert_eq!(index.find_overlaps(&locals(&[70])).depth(w(2)), 1);
    index.check_invariants();
}
