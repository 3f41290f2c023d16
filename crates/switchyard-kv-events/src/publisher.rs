//! The engine side of the KV-event plane, as vLLM runs it: a PUB socket
//! sending `[topic, seq (8 bytes BE), payload]` and an optional ROUTER
//! socket replaying a bounded ring of recent batches.
//!
//! Replay protocol: a DEALER sends `[b"", start_seq (8 bytes BE)]`; the
//! publisher answers `[b"", topic, seq, payload]` for every buffered batch
//! with `seq >= start_seq`, then `[b"", topic, 0xFFFF_FFFF_FFFF_FFFF, b""]`.
//! (vLLM itself omits the topic frame; subscribers accept both.)

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use switchyard_wire::kv_events::{encode_batch, KvEventBatch, END_OF_REPLAY_SEQ};

/// How long the replay thread waits for a request before checking for
/// shutdown.
const REPLAY_POLL_MS: i64 = 50;

/// Publisher settings.
#[derive(Clone, Debug)]
pub struct PublisherConfig {
    /// PUB endpoint to bind, e.g. `tcp://*:5557` (`tcp://127.0.0.1:*` picks a
    /// free port; read it back with [`KvEventPublisher::endpoint`]).
    pub endpoint: String,
    /// ROUTER endpoint to bind for replay, if any.
    pub replay_endpoint: Option<String>,
    /// Topic frame (vLLM's default is empty).
    pub topic: String,
    /// Batches kept for replay (vLLM's `buffer_steps`, default 10 000).
    pub replay_buffer: usize,
}

impl PublisherConfig {
    /// vLLM's defaults on the given endpoints.
    pub fn new(endpoint: impl Into<String>, replay_endpoint: Option<String>) -> Self {
        Self {
            endpoint: endpoint.into(),
            replay_endpoint,
            topic: String::new(),
            replay_buffer: 10_000,
        }
    }
}

/// Why publishing failed.
#[derive(Debug, thiserror::Error)]
pub enum PublishError {
    /// A socket call failed.
    #[error("zmq: {0}")]
    Zmq(#[from] zmq::Error),
    /// The publisher's thread died or the lock was poisoned.
    #[error("publisher is shut down")]
    Closed,
}

type Ring = VecDeque<(u64, Arc<[u8]>)>;

struct PubState {
    socket: zmq::Socket,
    next_seq: u64,
}

/// Publishes KV-event batches; dropping it stops the replay thread and
/// closes the sockets.
pub struct KvEventPublisher {
    // Field order is drop order: sockets close before the context ends.
    state: Mutex<PubState>,
    ring: Arc<Mutex<Ring>>,
    stop: Arc<AtomicBool>,
    replay_thread: Option<JoinHandle<()>>,
    topic: Vec<u8>,
    capacity: usize,
    endpoint: String,
    replay_endpoint: Option<String>,
    _context: zmq::Context,
}

impl std::fmt::Debug for KvEventPublisher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KvEventPublisher")
            .field("endpoint", &self.endpoint)
            .field("replay_endpoint", &self.replay_endpoint)
            .finish_non_exhaustive()
    }
}

impl KvEventPublisher {
    /// Binds the sockets and starts the replay thread.
    pub fn bind(config: PublisherConfig) -> Result<Self, PublishError> {
        let context = zmq::Context::new();
        let socket = context.socket(zmq::PUB)?;
        socket.set_linger(0)?;
        socket.set_sndhwm(100_000)?;
        socket.bind(&config.endpoint)?;
        let endpoint = last_endpoint(&socket)?;
        let ring = Arc::new(Mutex::new(VecDeque::new()));
        let stop = Arc::new(AtomicBool::new(false));
        let topic = config.topic.into_bytes();
        let (replay_thread, replay_endpoint) = match &config.replay_endpoint {
            None => (None, None),
            Some(replay) => {
                let router = context.socket(zmq::ROUTER)?;
                router.set_linger(0)?;
                router.bind(replay)?;
                let bound = last_endpoint(&router)?;
                let (ring, stop, topic) = (ring.clone(), stop.clone(), topic.clone());
                let thread = std::thread::Builder::new()
                    .name("kv-replay".into())
                    .spawn(move || serve_replay(router, ring, stop, topic))
                    .map_err(|_| PublishError::Closed)?;
                (Some(thread), Some(bound))
            }
        };
        Ok(Self {
            state: Mutex::new(PubState {
                socket,
                next_seq: 0,
            }),
            ring,
            stop,
            replay_thread,
            topic,
            capacity: config.replay_buffer.max(1),
            endpoint,
            replay_endpoint,
            _context: context,
        })
    }

    /// The bound PUB endpoint (with the port resolved).
    pub fn endpoint(&self) -> &str {
        &self.endpoint
    }

    /// The bound ROUTER endpoint, if replay is on.
    pub fn replay_endpoint(&self) -> Option<&str> {
        self.replay_endpoint.as_deref()
    }

    /// Sends a batch under the next sequence number and buffers it for
    /// replay. Returns its sequence number.
    pub fn publish(&self, batch: &KvEventBatch) -> Result<u64, PublishError> {
        self.publish_inner(batch, true)
    }

    /// Assigns the next sequence number and buffers the batch for replay
    /// *without* sending it: a lost message, for fault-injection tests.
    pub fn publish_unsent(&self, batch: &KvEventBatch) -> Result<u64, PublishError> {
        self.publish_inner(batch, false)
    }

    fn publish_inner(&self, batch: &KvEventBatch, send: bool) -> Result<u64, PublishError> {
        let payload: Arc<[u8]> = encode_batch(batch).into();
        let mut state = self.state.lock().map_err(|_| PublishError::Closed)?;
        let seq = state.next_seq;
        if send {
            let seq_bytes = seq.to_be_bytes();
            state
                .socket
                .send_multipart([&self.topic[..], &seq_bytes[..], &payload[..]], 0)?;
        }
        state.next_seq += 1;
        // Buffer under the PUB lock so the ring's order is the seq order.
        let mut ring = self.ring.lock().map_err(|_| PublishError::Closed)?;
        if ring.len() >= self.capacity {
            ring.pop_front();
        }
        ring.push_back((seq, payload));
        Ok(seq)
    }
}

impl Drop for KvEventPublisher {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(thread) = self.replay_thread.take() {
            let _ = thread.join();
        }
    }
}

fn last_endpoint(socket: &zmq::Socket) -> Result<String, PublishError> {
    match socket.get_last_endpoint()? {
        Ok(endpoint) => Ok(endpoint),
        Err(_) => Err(PublishError::Closed),
    }
}

fn serve_replay(
    router: zmq::Socket,
    ring: Arc<Mutex<Ring>>,
    stop: Arc<AtomicBool>,
    topic: Vec<u8>,
) {
    while !stop.load(Ordering::Relaxed) {
        match router.poll(zmq::POLLIN, REPLAY_POLL_MS) {
            Ok(0) => continue,
            Ok(_) => {}
            Err(_) => return,
        }
        let Ok(frames) = router.recv_multipart(zmq::DONTWAIT) else {
            continue;
        };
        // [identity, b"", start_seq]; anything else is ignored.
        let [identity, delimiter, start] = &frames[..] else {
            continue;
        };
        let Ok(start) = <[u8; 8]>::try_from(&start[..]) else {
            continue;
        };
        if !delimiter.is_empty() {
            continue;
        }
        let start = u64::from_be_bytes(start);
        let batches: Vec<(u64, Arc<[u8]>)> = match ring.lock() {
            Ok(ring) => ring
                .iter()
                .filter(|(seq, _)| *seq >= start)
                .cloned()
                .collect(),
            Err(_) => return,
        };
        for (seq, payload) in batches {
            let seq = seq.to_be_bytes();
            let frames: [&[u8]; 5] = [identity, b"", &topic, &seq, &payload];
            if router.send_multipart(frames, 0).is_err() {
                break;
            }
        }
        let end = END_OF_REPLAY_SEQ.to_be_bytes();
        let frames: [&[u8]; 5] = [identity, b"", &topic, &end, b""];
        let _ = router.send_multipart(frames, 0);
    }
}
