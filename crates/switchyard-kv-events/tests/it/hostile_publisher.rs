//! A misbehaving event publisher on loopback: real ZMQ sockets, a raw PUB
//! that sends what no engine would (a payload of msgpack `nil`s, a batch
//! of more events than the cap, endless new block hashes), beside an
//! honest one. The hostile stream is refused and counted, its worker's
//! share of the index stays within its cap, and the honest worker's
//! prefix is still found.

use crate::support::wait_for;
use std::sync::{Arc, Mutex};
use switchyard_core::hashing::{local_block_hashes, DEFAULT_SEED};
use switchyard_core::index::TieredIndex;
use switchyard_core::{EngineHash, WorkerId};
use switchyard_kv_events::metrics::KvEventMetrics;
use switchyard_kv_events::subscriber::{KvEventSubscriber, SubscriberConfig};
use switchyard_wire::kv_events::{encode_batch, BlockStored, KvEvent, KvEventBatch};

const BLOCK: u32 = 4;
/// Blocks one worker may hold in the test's index.
const CAP: usize = 1024;
/// The bound the index must stay under while the hostile worker publishes
/// tens of thousands of new blocks: the capped worker's blocks at about
/// 50 bytes each (node, name, order entry), with room for growth slack.
const INDEX_BYTES_BOUND: usize = 512 << 10;

fn stored(first: u64, blocks: u64, tokens: &[u32]) -> KvEvent {
    KvEvent::BlockStored(Box::new(BlockStored {
        block_hashes: (first..first + blocks).map(EngineHash).collect(),
        parent_block_hash: None,
        token_ids: tokens.to_vec(),
        block_size: BLOCK,
        medium: Some("GPU".into()),
        ..BlockStored::default()
    }))
}

fn payload(events: Vec<KvEvent>) -> Vec<u8> {
    encode_batch(&KvEventBatch {
        ts: 1.0,
        events,
        data_parallel_rank: Some(0),
    })
}

/// `[0.0, [nil; n]]`: `n` bytes on the wire, `n` whole values as a tree.
fn nil_flood(n: usize) -> Vec<u8> {
    let mut bytes = vec![0x92, 0xcb, 0, 0, 0, 0, 0, 0, 0, 0, 0xdd];
    bytes.extend_from_slice(&(n as u32).to_be_bytes());
    bytes.resize(bytes.len() + n, 0xc0);
    bytes
}

struct Peer {
    socket: zmq::Socket,
    seq: u64,
}

impl Peer {
    fn bind(context: &zmq::Context) -> (Self, String) {
        let socket = context.socket(zmq::PUB).unwrap();
        socket.set_linger(0).unwrap();
        socket.set_sndhwm(100_000).unwrap();
        socket.bind("tcp://127.0.0.1:*").unwrap();
        let endpoint = socket.get_last_endpoint().unwrap().unwrap();
        (Self { socket, seq: 0 }, endpoint)
    }

    fn send(&mut self, payload: &[u8]) {
        let seq = self.seq.to_be_bytes();
        self.socket
            .send_multipart([&b""[..], &seq[..], payload], 0)
            .unwrap();
        self.seq += 1;
    }
}

#[test]
fn a_hostile_publisher_is_refused_and_capped_while_an_honest_prefix_is_still_found() {
    let context = zmq::Context::new();
    let index = Arc::new(Mutex::new(TieredIndex::with_max_blocks_per_worker(CAP)));
    let metrics = KvEventMetrics::new();
    let (honest, hostile) = (WorkerId::new(1), WorkerId::new(2));
    let (mut honest_peer, honest_endpoint) = Peer::bind(&context);
    let (mut hostile_peer, hostile_endpoint) = Peer::bind(&context);
    let _subs: Vec<KvEventSubscriber> = [
        (honest, honest_endpoint, "honest"),
        (hostile, hostile_endpoint, "hostile"),
    ]
    .into_iter()
    .map(|(worker, endpoint, name)| {
        KvEventSubscriber::spawn(
            &context,
            SubscriberConfig::new(worker, endpoint, BLOCK),
            index.clone(),
            metrics.worker(name),
        )
        .unwrap()
    })
    .collect();

    // The honest engine stores one 8-block prompt.
    let prompt: Vec<u32> = (0..8 * BLOCK).collect();
    let hashes = local_block_hashes(&prompt, BLOCK as usize, DEFAULT_SEED);
    let honest_payload = payload(vec![stored(1, 8, &prompt)]);
    wait_for("the honest prompt to be indexed", || {
        honest_peer.send(&honest_payload);
        index.lock().unwrap().device().holds(honest, EngineHash(8))
    });

    // 8 MiB of nils (256 MiB and more as a value tree), a batch one event
    // past the cap, and 32 new blocks a batch, with new tokens each time.
    let flood = nil_flood(8 << 20);
    let too_many = payload(vec![KvEvent::AllBlocksCleared; 65_537]);
    let mut next = 1_000_000u64;
    let mut max_bytes = 0;
    wait_for(
        "floods refused and the hostile worker held at its cap",
        || {
            for _ in 0..20 {
                let tokens: Vec<u32> = (0..32 * BLOCK).map(|t| next as u32 * 7 + t).collect();
                hostile_peer.send(&payload(vec![stored(next, 32, &tokens)]));
                next += 32;
            }
            let t = metrics.total();
            if t.dropped("over_decode_budget") < 3 {
                hostile_peer.send(&flood);
            }
            if t.dropped("too_many_events") < 3 {
                hostile_peer.send(&too_many);
            }
            let index = index.lock().unwrap();
            assert!(index.device().worker_blocks(hostile) <= CAP);
            max_bytes = max_bytes.max(index.estimated_bytes());
            let t = metrics.total();
            t.dropped("over_decode_budget") >= 3
                && t.dropped("too_many_events") >= 3
                && index.evicted_over_cap() >= 20 * CAP as u64
        },
    );

    let index = index.lock().unwrap();
    assert_eq!(index.device().worker_blocks(hostile), CAP);
    assert!(
        max_bytes < INDEX_BYTES_BOUND,
        "index grew to {max_bytes} bytes"
    );
    // Routing still finds the honest worker's whole prefix, and only it.
    let overlaps = index.device().find_overlaps(&hashes);
    assert_eq!(overlaps.depth(honest), 8);
    assert_eq!(overlaps.depth(hostile), 0);
    // Nothing of the floods was applied: no `AllBlocksCleared` got through.
    assert!(index.device().holds(honest, EngineHash(1)));
}
