use super::*;
use crate::blocks::KvConfig;
use crate::timing::TimingConfig;

fn kv() -> BlockManager {
    BlockManager::new(KvConfig {
        block_size: 4,
        num_blocks: 16,
        ..KvConfig::default()
    })
}

#[test]
fn rollback_on_the_synchronous_device_is_an_error() {
    let mut kv = kv();
    let mut dev = SyncDevice::new(TimingConfig::default());
    assert_eq!(
        dev.reserve_kv(&mut kv, SeqId(0), 5),
        Ok(Reservation::Reserved { blocks: 2 })
    );
    assert_eq!(
        dev.rollback(&mut kv, SeqId(0)),
        Err(DeviceError::RollbackUnsupported)
    );
    assert_eq!(kv.seq_blocks(SeqId(0)).len(), 2);
}

#[test]
fn rollback_before_launch_releases_everything_the_last_reservation_added() {
    let mut kv = kv();
    let mut dev = AheadDevice::new(TimingConfig::default(), 1);
    assert_eq!(
        dev.reserve_kv(&mut kv, SeqId(0), 4),
        Ok(Reservation::Reserved { blocks: 2 })
    );
    assert_eq!(
        dev.reserve_kv(&mut kv, SeqId(0), 8),
        Ok(Reservation::Reserved { blocks: 1 })
    );
    assert_eq!(dev.rollback(&mut kv, SeqId(0)), Ok(1));
    assert_eq!(kv.seq_blocks(SeqId(0)).len(), 2);
    assert_eq!(kv.free_blocks(), 14);
}

#[test]
fn rollback_after_launch_releases_only_the_lookahead() {
    let mut kv = kv();
    let mut dev = AheadDevice::new(TimingConfig::default(), 1);
    assert_eq!(
        dev.reserve_kv(&mut kv, SeqId(0), 8),
        Ok(Reservation::Reserved { blocks: 3 })
    );
    dev.launch_step(&kv, &StepShape::default()).unwrap();
    dev.step_result().unwrap();
    assert_eq!(dev.rollback(&mut kv, SeqId(0)), Ok(1));
    assert_eq!(kv.seq_blocks(SeqId(0)).len(), 2);
    assert_eq!(
        dev.rollback(&mut kv, SeqId(0)),
        Ok(0),
        "a second rollback has nothing left"
    );
}

#[test]
fn the_ahead_device_falls_back_to_the_exact_need_when_the_lookahead_does_not_fit() {
    let mut kv = kv();
    let mut dev = AheadDevice::new(TimingConfig::default(), 1);
    assert_eq!(
        dev.reserve_kv(&mut kv, SeqId(0), 64),
        Ok(Reservation::Reserved { blocks: 16 })
    );
    assert_eq!(
        dev.reserve_kv(&mut kv, SeqId(1), 1),
        Ok(Reservation::Exhausted)
    );
}

#[test]
fn an_overrun_rollback_keeps_the_blocks_of_kept_tokens_on_every_device() {
    let mut kv = kv();
    let mut dev = ScriptedDevice::new(TimingConfig::default());
    // 5 kept tokens and a 4-position over-run: 9 tokens, 3 blocks.
    assert_eq!(
        dev.reserve_kv(&mut kv, SeqId(0), 9),
        Ok(Reservation::Reserved { blocks: 3 })
    );
    assert_eq!(dev.rollback_overrun(&mut kv, SeqId(0), 6), Ok(1));
    assert_eq!(kv.seq_blocks(SeqId(0)).len(), 2);
    assert_eq!(
        dev.rollback_overrun(&mut kv, SeqId(0), 6),
        Ok(0),
        "nothing beyond the kept tokens is left"
    );
    assert_eq!(
        dev.log[1],
        Effect::RollbackOverrun {
            seq: SeqId(0),
            keep_tokens: 6
        }
    );
    let mut ahead = AheadDevice::new(TimingConfig::default(), 1);
    ahead.reserve_kv(&mut kv, SeqId(1), 9).unwrap();
    assert_eq!(kv.seq_blocks(SeqId(1)).len(), 3, "the lookahead fits in");
    assert_eq!(ahead.rollback_overrun(&mut kv, SeqId(1), 4), Ok(2));
    assert_eq!(
        ahead.rollback(&mut kv, SeqId(1)),
        Ok(0),
        "nothing ahead left"
    );
    assert_eq!(kv.seq_blocks(SeqId(1)).len(), 1);
    ahead.quiesce().unwrap();
    assert_eq!(
        ahead.rollback_overrun(&mut kv, SeqId(1), 0),
        Ok(1),
        "a quiesced device still rolls back"
    );
}

#[test]
fn every_effect_has_its_own_label() {
    let effects = [
        Effect::ReserveKv {
            seq: SeqId(0),
            tokens: 1,
        },
        Effect::Rollback { seq: SeqId(0) },
        Effect::RollbackOverrun {
            seq: SeqId(0),
            keep_tokens: 4,
        },
        Effect::ReleaseSeq {
            seq: SeqId(0),
            cache: true,
            what: Label("finished"),
        },
        Effect::AckRestore { seq: SeqId(0) },
        Effect::LaunchStep {
            shape: StepShape::default(),
        },
        Effect::ReadStepResult,
        Effect::ReadLogits {
            rows: 1,
            vocab: 8,
            elem_bytes: 2,
        },
        Effect::CompactSlot {
            seq: SeqId(0),
            from: SlotId(1),
            to: SlotId(0),
        },
        Effect::DetachSlot { slot: SlotId(1) },
        Effect::SaveSequenceState {
            seq: SeqId(0),
            tokens: 4,
        },
        Effect::LoadSequenceState {
            seq: SeqId(0),
            tokens: 4,
            device_prefix_blocks: 0,
        },
        Effect::DropSequenceState { seq: SeqId(0) },
        Effect::MarconiCheckpoint {
            seq: SeqId(0),
            slot: SlotId(0),
            tokens: 4,
        },
        Effect::LoadCheckpoint {
            seq: SeqId(0),
            slot: SlotId(0),
            tokens: 4,
        },
        Effect::SaveHiddenCatchup {
            seq: SeqId(0),
            tokens: 4,
        },
        Effect::SyncSecondary,
        Effect::Quiesce,
        Effect::EpShutdown,
    ];
    let labels: std::collections::BTreeSet<Label> = effects.iter().map(Effect::label).collect();
    assert_eq!(labels.len(), effects.len());
}

#[test]
fn a_quiesced_device_takes_no_new_work_but_still_releases() {
    let mut kv = kv();
    let mut dev = ScriptedDevice::new(TimingConfig::default());
    dev.reserve_kv(&mut kv, SeqId(0), 8).unwrap();
    assert_eq!(dev.ep_shutdown(), Err(DeviceError::NotQuiesced));
    dev.quiesce().unwrap();
    dev.quiesce().unwrap();
    assert_eq!(dev.state(), DeviceState::Quiesced);
    assert_eq!(
        dev.reserve_kv(&mut kv, SeqId(1), 8),
        Err(DeviceError::Quiesced {
            effect: Label("reserve_kv")
        })
    );
    assert!(dev.launch_step(&kv, &StepShape::default()).is_err());
    dev.release_seq(&mut kv, SeqId(0), true, Label("cancelled"))
        .unwrap();
    assert_eq!(kv.free_blocks(), 16);
}

#[test]
fn a_shut_down_device_refuses_every_effect_with_a_clear_error() {
    let mut kv = kv();
    let mut dev = SyncDevice::new(TimingConfig::default());
    dev.quiesce().unwrap();
    dev.ep_shutdown().unwrap();
    assert_eq!(dev.state(), DeviceState::Shutdown);
    let refused = [
        dev.reserve_kv(&mut kv, SeqId(0), 1).map(|_| ()),
        dev.release_seq(&mut kv, SeqId(0), true, Label("cancelled")),
        dev.step_result().map(|_| ()),
        dev.read_logits(1, 8, 2).map(|_| ()),
        dev.detach_slot(SlotId(0)),
        dev.save_sequence_state(&kv, SeqId(0), 4).map(|_| ()),
        dev.drop_sequence_state(SeqId(0)).map(|_| ()),
        dev.sync_secondary(),
        dev.quiesce(),
        dev.ep_shutdown(),
    ];
    for outcome in refused {
        assert!(
            matches!(outcome, Err(DeviceError::ShutDown { .. })),
            "{outcome:?}"
        );
    }
    let message = dev
        .reserve_kv(&mut kv, SeqId(0), 1)
        .unwrap_err()
        .to_string();
    assert_eq!(message, "the device is shut down and refuses reserve_kv");
}

#[test]
fn a_saved_state_is_loaded_or_dropped_exactly_once() {
    let mut kv = kv();
    let mut dev = SyncDevice::new(TimingConfig::default());
    let saved = dev.save_sequence_state(&kv, SeqId(0), 8).unwrap();
    assert_eq!(saved.tokens, 8);
    assert!((saved.duration_ms - TimingConfig::default().restore_ms(8)).abs() < 1e-12);
    assert!(
        dev.save_sequence_state(&kv, SeqId(0), 8).is_err(),
        "saved twice"
    );
    assert_eq!(dev.secondary_pending(), 1);
    dev.sync_secondary().unwrap();
    assert_eq!(dev.secondary_pending(), 0);
    assert!(
        dev.load_sequence_state(&mut kv, SeqId(0), 4, 0).is_err(),
        "another extent than was saved"
    );
    assert_eq!(
        dev.load_sequence_state(&mut kv, SeqId(0), 8, 0),
        Ok(Reservation::Reserved { blocks: 2 })
    );
    assert_eq!(
        dev.drop_sequence_state(SeqId(0)),
        Err(DeviceError::SavedState {
            effect: Label("drop_sequence_state"),
            seq: SeqId(0)
        }),
        "loaded already"
    );
    dev.save_sequence_state(&kv, SeqId(1), 4).unwrap();
    assert_eq!(dev.drop_sequence_state(SeqId(1)), Ok(4));
    assert_eq!(dev.saved_len(), 0);
}

#[test]
fn logits_come_back_at_the_asked_width_and_cost_their_bytes() {
    let mut dev = SyncDevice::new(TimingConfig::default());
    let logits = dev.read_logits(3, 1_000, 2).unwrap();
    assert_eq!(
        (logits.rows, logits.elem_bytes, logits.bytes),
        (3, 2, 6_000)
    );
    assert!((logits.duration_ms - 6_000.0 / 64e9 * 1e3).abs() < 1e-12);
}

#[test]
fn an_ssm_checkpoint_is_taken_only_on_a_block_boundary() {
    let kv = kv();
    let mut dev = ScriptedDevice::new(TimingConfig::default());
    assert_eq!(
        dev.marconi_checkpoint(&kv, SeqId(0), SlotId(1), 8),
        Ok(Checkpoint {
            slot: SlotId(1),
            tokens: 8
        })
    );
    assert_eq!(
        dev.marconi_checkpoint(&kv, SeqId(0), SlotId(1), 9),
        Err(DeviceError::UnalignedCheckpoint {
            tokens: 9,
            block_size: 4
        })
    );
    assert_eq!(dev.secondary_pending(), 1, "a snapshot is a copy");
    // Resuming from one: the same alignment rule, a copy too.
    assert_eq!(
        dev.load_checkpoint(&kv, SeqId(1), SlotId(0), 4),
        Ok(Checkpoint {
            slot: SlotId(0),
            tokens: 4
        })
    );
    assert!(dev.load_checkpoint(&kv, SeqId(1), SlotId(0), 0).is_err());
    assert_eq!(dev.secondary_pending(), 2);
    assert_eq!(
        dev.log[0],
        Effect::MarconiCheckpoint {
            seq: SeqId(0),
            slot: SlotId(1),
            tokens: 8
        }
    );
}

#[test]
fn the_catch_up_ring_keeps_its_newest_entries_in_order_until_release() {
    let mut kv = kv();
    let mut dev = SyncDevice::new(TimingConfig::default());
    for tokens in 1..=6 {
        let ring = dev.save_hidden_catchup(SeqId(0), tokens).unwrap();
        assert_eq!(ring.newest_tokens, tokens);
        assert_eq!(ring.held, tokens.min(CATCHUP_RING_DEPTH));
    }
    assert_eq!(
        dev.save_hidden_catchup(SeqId(0), 6),
        Err(DeviceError::CatchupOutOfOrder {
            seq: SeqId(0),
            tokens: 6,
            newest: 6
        })
    );
    dev.release_seq(&mut kv, SeqId(0), true, Label("finished"))
        .unwrap();
    assert_eq!(
        dev.save_hidden_catchup(SeqId(0), 1).map(|r| r.held),
        Ok(1),
        "a released sequence's ring starts over"
    );
}

#[test]
fn a_result_without_a_launch_is_a_contract_error() {
    let mut dev = SyncDevice::new(TimingConfig::default());
    assert_eq!(dev.step_result(), Err(DeviceError::NoStepLaunched));
}
