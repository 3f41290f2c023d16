//! Model-based property tests of the scheduler core over the scripted device.

use proptest::prelude::*;
use std::collections::BTreeSet;
use switchyard_core::hashing::{local_block_hash, DEFAULT_SEED};
use switchyard_core::index::{IndexEvent, PrefixIndex, StoredBlock};
use switchyard_core::{RequestId, WorkerId};
use switchyard_engine::device::{AheadDevice, DeviceLayer, ScriptedDevice};
use switchyard_engine::{
    Engine, EngineConfig, KvEvent, Medium, NewRequest, StepReport, TimingConfig,
};

#[derive(Clone, Debug)]
enum Op {
    Arrive {
        prefix: u8,
        prefix_len: u16,
        suffix_len: u16,
        max_tokens: u8,
    },
    Cancel {
        pick: u16,
    },
    Step {
        dry: bool,
    },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => (0u8..4, 0u16..300, 1u16..200, 1u8..40).prop_map(|(prefix, prefix_len, suffix_len, max_tokens)| Op::Arrive {
            prefix,
            prefix_len,
            suffix_len,
            max_tokens
        }),
        1 => any::<u16>().prop_map(|pick| Op::Cancel { pick }),
        6 => any::<u8>().prop_map(|b| Op::Step { dry: b % 16 == 0 }),
    ]
}

/// Applies engine events to a model set of (medium, hash) and to a prefix
/// index of device blocks.
struct Replay {
    model: BTreeSet<(Medium, u64)>,
    index: PrefixIndex,
    worker: WorkerId,
}

impl Replay {
    fn new() -> Self {
        Self {
            model: BTreeSet::new(),
            index: PrefixIndex::new(),
            worker: WorkerId::new(1),
        }
    }

    fn apply(&mut self, event: &KvEvent) {
        match event {
            KvEvent::BlockStored {
                block_hashes,
                parent_block_hash,
                token_ids,
                block_size,
                medium,
                lora_name: _,
            } => {
                for h in block_hashes {
                    assert!(
                        self.model.insert((*medium, h.0)),
                        "stored twice without removal"
                    );
                }
                if *medium == Medium::Device {
                    let blocks: Vec<StoredBlock> = block_hashes
                        .iter()
                        .zip(token_ids.chunks_exact(*block_size as usize))
                        .map(|(h, tokens)| StoredBlock {
                            engine_hash: *h,
                            local_hash: local_block_hash(tokens, DEFAULT_SEED),
                        })
                        .collect();
                    self.index.apply(
                        self.worker,
                        &IndexEvent::Stored {
                            parent: *parent_block_hash,
                            blocks,
                        },
                    );
                }
            }
            KvEvent::BlockRemoved {
                block_hashes,
                medium,
            } => {
                for h in block_hashes {
                    assert!(
                        self.model.remove(&(*medium, h.0)),
                        "removed a block never stored"
                    );
                }
                if *medium == Medium::Device {
                    self.index.apply(
                        self.worker,
                        &IndexEvent::Removed {
                            blocks: block_hashes.clone(),
                        },
                    );
                }
            }
            KvEvent::AllBlocksCleared => {
                self.model.clear();
                self.index.apply(self.worker, &IndexEvent::Cleared);
            }
            // An attention-only engine keeps no SSM checkpoints.
            KvEvent::CheckpointStored { .. } | KvEvent::CheckpointRemoved { .. } => {
                panic!("a checkpoint event from an attention-only engine")
            }
        }
    }
}

fn run<D: DeviceLayer>(ops: Vec<Op>, host_blocks: usize, device: D, run_dry: fn(&mut D)) {
    let config = EngineConfig {
        block_size: 16,
        num_blocks: 96,
        host_blocks,
        max_num_seqs: 8,
        max_num_batched_tokens: 256,
        min_restore_tokens: 16,
        ..EngineConfig::default()
    };
    let mut engine = Engine::new(config, device).unwrap();
    let mut replay = Replay::new();
    let mut events = Vec::new();
    let mut report = StepReport::default();
    let mut live: Vec<u128> = Vec::new();
    let mut next_id = 0u128;
    let mut drain = |engine: &mut Engine<D>, replay: &mut Replay| {
        engine.drain_kv_events(&mut events);
        for e in events.drain(..) {
            replay.apply(&e);
        }
    };
    for op in ops {
        match op {
            Op::Arrive {
                prefix,
                prefix_len,
                suffix_len,
                max_tokens,
            } => {
                next_id += 1;
                let mut prompt: Vec<u32> = (0..u32::from(prefix_len))
                    .map(|t| t + 1000 * u32::from(prefix))
                    .collect();
                prompt.extend(
                    (0..u32::from(suffix_len)).map(|t| 100_000 + (next_id as u32) * 1000 + t),
                );
                let ok = engine
                    .add_request(NewRequest {
                        id: RequestId(next_id),
                        prompt,
                        max_tokens: u32::from(max_tokens),
                        hash_seed: DEFAULT_SEED,
                        lora_name: None,
                    })
                    .is_ok();
                if ok {
                    live.push(next_id);
                }
            }
            Op::Cancel { pick } => {
                if !live.is_empty() {
                    let id = live.swap_remove(pick as usize % live.len());
                    engine.cancel(RequestId(id)).unwrap();
                }
            }
            Op::Step { dry } => {
                if dry {
                    run_dry(engine.device_mut());
                }
                engine.step(&mut report).unwrap();
                for f in &report.finished {
                    live.retain(|&id| id != f.request.0);
                }
            }
        }
        drain(&mut engine, &mut replay);
    }
    let mut steps = 0;
    while engine.has_work() {
        engine.step(&mut report).unwrap();
        steps += 1;
        assert!(steps < 100_000, "engine did not drain");
    }
    drain(&mut engine, &mut replay);

    assert_eq!(engine.kv().free_blocks(), engine.kv().num_blocks());
    let cached: BTreeSet<(Medium, u64)> = engine
        .kv()
        .cached_state()
        .into_iter()
        .map(|(m, h)| (m, h.0))
        .collect();
    assert_eq!(replay.model, cached);
    let device_blocks = cached.iter().filter(|(m, _)| *m == Medium::Device).count();
    assert_eq!(replay.index.worker_blocks(replay.worker), device_blocks);
    for (m, h) in &cached {
        if *m == Medium::Device {
            assert!(replay
                .index
                .holds(replay.worker, switchyard_core::EngineHash(*h)));
        }
    }
    assert!(engine.reset_prefix_cache());
    drain(&mut engine, &mut replay);
    assert!(replay.model.is_empty());
}

fn scripted() -> ScriptedDevice {
    let mut device = ScriptedDevice::new(TimingConfig::default());
    device.record = false;
    device
}

fn dry_once(device: &mut ScriptedDevice) {
    device.exhaust_next = 1;
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn after_everything_finishes_the_pool_is_free_and_events_replay_to_the_cache(ops in prop::collection::vec(op(), 1..200)) {
        run(ops, 0, scripted(), dry_once);
    }

    #[test]
    fn with_a_host_tier_events_of_both_media_replay_to_the_cache(ops in prop::collection::vec(op(), 1..200)) {
        run(ops, 48, scripted(), dry_once);
    }

    #[test]
    fn a_device_reserving_ahead_rolls_back_and_still_drains_to_a_free_pool(ops in prop::collection::vec(op(), 1..200)) {
        run(ops, 48, AheadDevice::new(TimingConfig::default(), 1), |_| {});
    }
}
