//! Real ZMQ sockets on loopback: our publisher, our subscriber, and the
//! prefix index the subscriber builds compared with the publisher's truth.
//!
//! Ports are picked by the OS (`tcp://127.0.0.1:*`). Waits poll a condition
//! with a generous deadline; no test relies on a fixed sleep being enough.

use crate::support::wait_for;
use std::sync::{Arc, Mutex};
use switchyard_core::hashing::{local_block_hashes, DEFAULT_SEED};
use switchyard_core::index::TieredIndex;
use switchyard_core::{EngineHash, WorkerId};
use switchyard_kv_events::metrics::KvEventMetrics;
use switchyard_kv_events::publisher::{KvEventPublisher, PublisherConfig};
use switchyard_kv_events::subscriber::{KvEventSubscriber, SubscriberConfig};
use switchyard_wire::kv_events::{encode_batch, BlockRemoved, BlockStored, KvEvent, KvEventBatch};
use switchyard_wire::normalize::{Normalized, Normalizer};

const BLOCK: u32 = 4;

/// A chain of `blocks` blocks under `parent`; engine hashes `first..`.
fn stored(first: u64, parent: Option<u64>, blocks: u64, token_base: u32) -> KvEvent {
    let tokens = (0..blocks as u32 * BLOCK).map(|t| token_base + t).collect();
    KvEvent::BlockStored(Box::new(BlockStored {
        block_hashes: (first..first + blocks).map(EngineHash).collect(),
        parent_block_hash: parent.map(EngineHash),
        token_ids: tokens,
        block_size: BLOCK,
        medium: Some("GPU".into()),
        ..BlockStored::default()
    }))
}

fn removed(hashes: &[u64]) -> KvEvent {
    KvEvent::BlockRemoved(BlockRemoved {
        block_hashes: hashes.iter().map(|&h| EngineHash(h)).collect(),
        medium: Some("GPU".into()),
        ..BlockRemoved::default()
    })
}

fn batch(events: Vec<KvEvent>) -> KvEventBatch {
    KvEventBatch {
        ts: 1.0,
        events,
        data_parallel_rank: Some(0),
    }
}

/// The batches the engine "publishes": stores, a removal, and more stores
/// that chain onto blocks stored in earlier batches.
fn script() -> Vec<KvEventBatch> {
    vec![
        batch(vec![stored(100, None, 3, 0)]),
        batch(vec![stored(200, Some(102), 2, 1000)]),
        batch(vec![removed(&[201]), stored(300, None, 2, 5000)]),
        batch(vec![stored(400, Some(301), 1, 7000)]),
        batch(vec![stored(500, Some(200), 2, 9000)]),
    ]
}

fn truth(worker: WorkerId, batches: &[KvEventBatch]) -> TieredIndex {
    let mut index = TieredIndex::new();
    let mut normalizer = Normalizer::new(BLOCK);
    for b in batches {
        for e in &b.events {
            if let Normalized::Index(tier, ie) = normalizer.normalize(e) {
                index.apply(worker, tier, &ie);
            }
        }
    }
    index
}

/// Prompts that walk every stored chain, for comparing overlaps.
fn probes() -> Vec<Vec<u32>> {
    let chain = |parts: &[(u32, u32)]| {
        parts
            .iter()
            .flat_map(|&(base, blocks)| base..base + blocks * BLOCK)
            .collect::<Vec<u32>>()
    };
    vec![
        chain(&[(0, 3)]),
        chain(&[(0, 3), (1000, 2)]),
        chain(&[(0, 3), (1000, 1), (9000, 2)]),
        chain(&[(5000, 2), (7000, 1)]),
        chain(&[(42, 2)]),
    ]
}

fn same_index(a: &TieredIndex, b: &TieredIndex, worker: WorkerId) -> bool {
    let (a, b, host) = (
        a.device(),
        b.device(),
        a.host().live_pairs() == b.host().live_pairs(),
    );
    host && a.live_pairs() == b.live_pairs()
        && a.worker_blocks(worker) == b.worker_blocks(worker)
        && probes().iter().all(|tokens| {
            let hashes = local_block_hashes(tokens, BLOCK as usize, DEFAULT_SEED);
            a.find_overlaps(&hashes).depth(worker) == b.find_overlaps(&hashes).depth(worker)
        })
}

struct Rig {
    publisher: KvEventPublisher,
    index: Arc<Mutex<TieredIndex>>,
    metrics: KvEventMetrics,
    subscriber: Option<KvEventSubscriber>,
    worker: WorkerId,
    _context: zmq::Context,
}

fn rig(replay: bool) -> Rig {
    rig_after(replay, &[])
}

/// [`rig`] whose publisher sent `history` before the subscriber started:
/// batches nobody received, kept in the publisher's replay buffer (a
/// router started beside an engine that has been serving).
fn rig_after(replay: bool, history: &[KvEventBatch]) -> Rig {
    let publisher = KvEventPublisher::bind(PublisherConfig::new(
        "tcp://127.0.0.1:*",
        replay.then(|| "tcp://127.0.0.1:*".to_string()),
    ))
    .unwrap();
    for b in history {
        publisher.publish(b).unwrap();
    }
    let worker = WorkerId::new(1);
    let index = Arc::new(Mutex::new(TieredIndex::new()));
    let metrics = KvEventMetrics::new();
    let mut config = SubscriberConfig::new(worker, publisher.endpoint(), BLOCK);
    config.replay_endpoint = publisher.replay_endpoint().map(str::to_owned);
    let context = zmq::Context::new();
    let subscriber =
        KvEventSubscriber::spawn(&context, config, index.clone(), metrics.worker("w1")).unwrap();
    Rig {
        publisher,
        index,
        metrics,
        subscriber: Some(subscriber),
        worker,
        _context: context,
    }
}

impl Rig {
    /// Publishes empty batches until the subscriber has seen one, so the SUB
    /// connection is up before the script starts.
    fn warm_up(&self) {
        wait_for("the subscription to connect", || {
            self.publisher.publish(&batch(vec![])).unwrap();
            self.metrics.total().batches > 0
        });
    }

    fn index_matches(&self, expected: &TieredIndex) -> bool {
        same_index(&self.index.lock().unwrap(), expected, self.worker)
    }
}

impl Drop for Rig {
    fn drop(&mut self) {
        if let Some(sub) = self.subscriber.take() {
            sub.shutdown();
        }
    }
}

#[test]
fn in_order_batches_build_the_same_index_as_applying_them_directly() {
    let rig = rig(true);
    rig.warm_up();
    let batches = script();
    for b in &batches {
        rig.publisher.publish(b).unwrap();
    }
    let expected = truth(rig.worker, &batches);
    wait_for("the index to match", || rig.index_matches(&expected));
    assert_eq!(rig.metrics.total().gaps, 0);
    assert!(expected.device().live_pairs() > 0);
}

#[test]
fn a_sequence_gap_is_filled_from_the_replay_socket_and_the_index_ends_exact() {
    let rig = rig(true);
    rig.warm_up();
    // The warm-up's first contact may itself have replayed the empty
    // batches the subscription missed.
    let before = rig.metrics.total();
    let batches = script();
    for (i, b) in batches.iter().enumerate() {
        // Batch 2 (a removal and a new chain) and batch 3 (which chains onto
        // it) are lost on PUB but kept for replay.
        if i == 2 || i == 3 {
            rig.publisher.publish_unsent(b).unwrap();
        } else {
            rig.publisher.publish(b).unwrap();
        }
    }
    let expected = truth(rig.worker, &batches);
    wait_for("the gap to be replayed", || {
        rig.metrics.total().replays == before.replays + 1 && rig.index_matches(&expected)
    });
    let totals = rig.metrics.total();
    assert_eq!(totals.gaps, 1);
    assert_eq!(totals.replayed_batches - before.replayed_batches, 2);
    assert_eq!(totals.resets, 0);
    assert!(rig
        .metrics
        .encode_text()
        .contains("switchyard_kv_event_gaps_total{worker=\"w1\"} 1"));
}

#[test]
fn a_subscriber_started_after_its_engine_published_learns_the_history_from_replay() {
    let history = script();
    let rig = rig_after(true, &history);
    // Its first contact is mid-stream (sequence `history.len()` or later):
    // everything before it comes from the replay socket, counted as one
    // filled gap, not as a sequence gap or a reset.
    rig.warm_up();
    let expected = truth(rig.worker, &history);
    wait_for("the history to be replayed", || {
        rig.index_matches(&expected)
    });
    let totals = rig.metrics.total();
    assert_eq!(totals.replays, 1);
    assert!(
        totals.replayed_batches >= history.len() as u64,
        "{totals:?}"
    );
    assert_eq!((totals.gaps, totals.resets), (0, 0));
    assert!(expected.device().live_pairs() > 0);
}

#[test]
fn without_replay_a_gap_clears_the_worker_and_later_events_rebuild_it() {
    let rig = rig(false);
    rig.warm_up();
    let batches = script();
    rig.publisher.publish(&batches[0]).unwrap();
    rig.publisher.publish_unsent(&batches[1]).unwrap();
    rig.publisher.publish(&batches[2]).unwrap();
    // After the reset only batch 2's root chain is known: its removal names
    // a block the subscriber no longer holds, and its new chain stands alone.
    let expected = truth(rig.worker, &batches[2..3]);
    wait_for("the reset and rebuild", || {
        rig.metrics.total().resets == 1 && rig.index_matches(&expected)
    });
    assert_eq!(rig.metrics.total().gaps, 1);
    // Never overclaims: the chain stored before the gap is gone.
    let tokens: Vec<u32> = (0..12).collect();
    let hashes = local_block_hashes(&tokens, BLOCK as usize, DEFAULT_SEED);
    assert_eq!(
        rig.index
            .lock()
            .unwrap()
            .device()
            .find_overlaps(&hashes)
            .depth(rig.worker),
        0
    );
}

#[test]
fn garbage_on_the_wire_is_counted_and_neither_its_stream_nor_another_stalls() {
    let rig = rig(true);
    rig.warm_up();
    // A raw PUB peer, so the test can send frames our publisher never would.
    let context = zmq::Context::new();
    let rogue = context.socket(zmq::PUB).unwrap();
    rogue.set_linger(0).unwrap();
    rogue.bind("tcp://127.0.0.1:*").unwrap();
    let rogue_endpoint = rogue.get_last_endpoint().unwrap().unwrap();
    let worker = WorkerId::new(2);
    let index = Arc::new(Mutex::new(TieredIndex::new()));
    let metrics = KvEventMetrics::new();
    let sub = KvEventSubscriber::spawn(
        &context,
        SubscriberConfig::new(worker, rogue_endpoint, BLOCK),
        index.clone(),
        metrics.worker("w2"),
    )
    .unwrap();
    let partial = {
        let KvEvent::BlockStored(mut s) = stored(2, None, 1, 0) else {
            unreachable!()
        };
        s.token_ids.pop();
        KvEvent::BlockStored(s)
    };
    let good = encode_batch(&batch(vec![stored(1, None, 1, 0), partial]));
    let mut seq = 0u64;
    wait_for("the rogue stream to be read", || {
        let frames: [&[u8]; 3] = [b"", b"short", b"x"];
        rogue.send_multipart(frames, 0).unwrap();
        rogue
            .send_multipart([&b""[..], &b"two frames"[..]], 0)
            .unwrap();
        // A truncated batch: an array header, then half a float.
        let s = seq.to_be_bytes();
        rogue
            .send_multipart([&b""[..], &s[..], &[0x93, 0xcb][..]], 0)
            .unwrap();
        let s = (seq + 1).to_be_bytes();
        rogue
            .send_multipart([&b""[..], &s[..], &good[..]], 0)
            .unwrap();
        seq += 2;
        let t = metrics.total();
        [
            "partial_block",
            "invalid_msgpack",
            "bad_sequence",
            "bad_framing",
        ]
        .iter()
        .all(|reason| t.dropped(reason) > 0)
    });
    let totals = metrics.total();
    assert!(totals.dropped("bad_sequence") > 0);
    assert!(totals.dropped("bad_framing") > 0);
    assert!(totals.dropped("invalid_msgpack") > 0);
    assert!(index.lock().unwrap().device().holds(worker, EngineHash(1)));
    // The healthy worker is unaffected.
    let batches = script();
    for b in &batches {
        rig.publisher.publish(b).unwrap();
    }
    let expected = truth(rig.worker, &batches);
    wait_for("the healthy worker's index", || {
        rig.index_matches(&expected)
    });
    sub.shutdown();
}
