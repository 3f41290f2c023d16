//! The router side: one SUB client per worker endpoint, on its own thread.
//!
//! Per message `[topic, seq, payload]` the subscriber asks [`SeqTracker`]
//! (pure) what the sequence number means, then acts:
//!
//! - **next in order** — decode, normalize, apply to the sink.
//! - **gap** — ask the replay ROUTER (DEALER, `[b"", from]`) for the missing
//!   batches and apply them in order. Replies may carry a topic frame or not
//!   (vLLM sends `[b"", seq, payload]`); the frame count decides. If replay
//!   is off, times out, or no longer holds the first missing batch, the
//!   worker's index entries are cleared (a lower hit rate for a while, never
//!   a wrong one) and whatever contiguous tail replay returned is applied.
//! - **first contact** mid-stream — the worker's entries are cleared and, if
//!   replay is on, the buffered history is applied.
//! - **sequence went backwards** — the engine restarted: clear, then go on.
//!
//! libzmq reconnects a dropped TCP peer by itself with exponential backoff
//! (100 ms doubling to 5 s); a socket that fails outright is rebuilt with
//! the same backoff. Each worker has its own thread and sockets, so one
//! worker's bad stream never stalls another's. Every buffer is bounded, in
//! bytes as well as in messages:
//!
//! - one message by `max_message_bytes` (`ZMQ_MAXMSGSIZE`);
//! - the SUB and replay queues by `max_queue_bytes`: libzmq counts its
//!   queues in messages only, so the high-water mark is `max_queue_bytes /
//!   max_message_bytes` messages (at least 1, at most 100,000). A full SUB
//!   queue stops reading the TCP stream, so the publisher's own send queue
//!   absorbs a burst; nothing is dropped here;
//! - the replay collection by `max_replay_batches` and `max_replay_bytes`
//!   (past either, the replay counts as unavailable: the worker is reset);
//! - one message's decode by [`DecodeLimits`] (a value-tree budget and an
//!   events cap: past either, the message is dropped and counted).

use super::metrics::WorkerMetrics;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};
use switchyard_core::index::{CacheTier, IndexEvent, TieredIndex};
use switchyard_core::WorkerId;
use switchyard_wire::kv_events::{
    decode_batch_lossy_within, DecodeLimits, Format, END_OF_REPLAY_SEQ,
};
use switchyard_wire::normalize::{Normalized, Normalizer};

/// Where normalized events go. Implementations must not block for long:
/// the subscriber thread waits on them.
pub trait IndexSink: Send + Sync + 'static {
    /// Applies one event about `worker`'s cache `tier` (a `Cleared`, which
    /// the subscriber also sends to resync, clears every tier).
    fn apply(&self, worker: WorkerId, tier: CacheTier, event: &IndexEvent);
}

impl IndexSink for Mutex<TieredIndex> {
    fn apply(&self, worker: WorkerId, tier: CacheTier, event: &IndexEvent) {
        let mut index = self.lock().unwrap_or_else(|p| p.into_inner());
        index.apply(worker, tier, event);
    }
}

/// Subscriber settings for one worker endpoint.
#[derive(Clone, Debug)]
pub struct SubscriberConfig {
    /// The worker whose index entries this stream feeds.
    pub worker: WorkerId,
    /// PUB endpoint to connect to, e.g. `tcp://10.0.0.5:5557`.
    pub endpoint: String,
    /// The engine's replay ROUTER endpoint, if it has one.
    pub replay_endpoint: Option<String>,
    /// Topic prefix to subscribe to (empty: everything).
    pub topic: String,
    /// The router's block size; events must match it.
    pub block_size: u32,
    /// Accepted payload shapes.
    pub format: Format,
    /// How long one replay may take before it counts as unavailable.
    pub replay_timeout: Duration,
    /// Largest gap replay is asked to fill; larger ones reset the worker.
    pub max_replay_batches: u64,
    /// Most bytes the batches of one replay may hold together.
    pub max_replay_bytes: usize,
    /// Largest message accepted, in bytes.
    pub max_message_bytes: i64,
    /// Most bytes a receive queue (live or replay) may hold: its
    /// high-water mark is this over `max_message_bytes` messages.
    pub max_queue_bytes: i64,
    /// What decoding one message may cost.
    pub decode: DecodeLimits,
    /// Longest reconnect backoff.
    pub max_backoff: Duration,
    /// Data-parallel ranks the worker declared: this stream carries rank
    /// `worker.dp_rank`'s events; a batch naming a rank `>= dp_size` is
    /// dropped as `dp_rank_out_of_range`, one naming another rank as
    /// `dp_rank_mismatch`. A batch naming none is the stream's rank.
    pub dp_size: u32,
}

impl SubscriberConfig {
    /// Defaults for `worker` at `endpoint`.
    pub fn new(worker: WorkerId, endpoint: impl Into<String>, block_size: u32) -> Self {
        Self {
            worker,
            endpoint: endpoint.into(),
            replay_endpoint: None,
            topic: String::new(),
            block_size,
            format: Format::Auto,
            replay_timeout: Duration::from_secs(2),
            max_replay_batches: 10_000,
            max_replay_bytes: 256 << 20,
            max_message_bytes: 64 << 20,
            max_queue_bytes: 256 << 20,
            decode: DecodeLimits::default(),
            max_backoff: Duration::from_secs(5),
            dp_size: 1,
        }
    }
}

/// What a sequence number means, given the last one applied.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SeqAction {
    /// The first message of this stream; `seq` batches came before it.
    FirstContact,
    /// The next batch in order.
    InOrder,
    /// Batches `from..seq` are missing.
    Gap {
        /// First missing sequence number.
        from: u64,
    },
    /// The sequence went backwards: the publisher restarted.
    Restarted,
}

impl SubscriberConfig {
    /// The receive high-water mark, in messages, that keeps a queue within
    /// `max_queue_bytes` (at least 1, at most 100,000).
    pub fn receive_hwm(&self) -> i32 {
        let per_message = self.max_message_bytes.max(1);
        (self.max_queue_bytes / per_message).clamp(1, 100_000) as i32
    }
}

/// Tracks one stream's sequence numbers. Pure: decides, does nothing.
#[derive(Clone, Copy, Debug, Default)]
pub struct SeqTracker {
    expected: Option<u64>,
}

impl SeqTracker {
    /// What `seq` means now. Call [`SeqTracker::applied`] once it is handled.
    pub fn classify(&self, seq: u64) -> SeqAction {
        match self.expected {
            None => SeqAction::FirstContact,
            Some(expected) if seq == expected => SeqAction::InOrder,
            Some(expected) if seq > expected => SeqAction::Gap { from: expected },
            Some(_) => SeqAction::Restarted,
        }
    }

    /// Records that `seq` was handled.
    pub fn applied(&mut self, seq: u64) {
        self.expected = Some(seq.wrapping_add(1));
    }
}

/// A running subscriber; dropping it (or [`KvEventSubscriber::shutdown`])
/// stops the thread within about one poll interval.
#[derive(Debug)]
pub struct KvEventSubscriber {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

const POLL_MS: i64 = 100;
const MIN_BACKOFF: Duration = Duration::from_millis(100);

impl KvEventSubscriber {
    /// Starts a subscriber thread for one worker endpoint.
    pub fn spawn(
        context: &zmq::Context,
        config: SubscriberConfig,
        sink: Arc<dyn IndexSink>,
        metrics: Arc<WorkerMetrics>,
    ) -> std::io::Result<Self> {
        let stop = Arc::new(AtomicBool::new(false));
        let mut stream = Stream {
            context: context.clone(),
            normalizer: Normalizer::new(config.block_size),
            config,
            sink,
            metrics,
            stop: stop.clone(),
            tracker: SeqTracker::default(),
        };
        let thread = std::thread::Builder::new()
            .name(format!("kv-sub-{}", stream.config.worker))
            .spawn(move || stream.run())?;
        Ok(Self {
            stop,
            thread: Some(thread),
        })
    }

    /// Stops the thread and waits for it.
    pub fn shutdown(mut self) {
        self.stop_and_join();
    }

    fn stop_and_join(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

impl Drop for KvEventSubscriber {
    fn drop(&mut self) {
        self.stop_and_join();
    }
}

struct Stream {
    context: zmq::Context,
    config: SubscriberConfig,
    normalizer: Normalizer,
    sink: Arc<dyn IndexSink>,
    metrics: Arc<WorkerMetrics>,
    stop: Arc<AtomicBool>,
    tracker: SeqTracker,
}

enum ReplayError {
    Unavailable,
    Stopped,
}

impl Stream {
    fn stopped(&self) -> bool {
        self.stop.load(Ordering::Relaxed)
    }

    fn run(&mut self) {
        let mut backoff = MIN_BACKOFF;
        while !self.stopped() {
            let socket = match self.connect() {
                Ok(socket) => socket,
                Err(_) => {
                    self.sleep(backoff);
                    backoff = (backoff * 2).min(self.config.max_backoff);
                    continue;
                }
            };
            backoff = MIN_BACKOFF;
            while !self.stopped() {
                match socket.poll(zmq::POLLIN, POLL_MS) {
                    Ok(0) => continue,
                    Ok(_) => {}
                    Err(_) => break,
                }
                match socket.recv_multipart(zmq::DONTWAIT) {
                    Ok(frames) => self.on_message(frames),
                    Err(zmq::Error::EAGAIN) => continue,
                    Err(_) => break,
                }
            }
        }
    }

    fn sleep(&self, total: Duration) {
        let deadline = Instant::now() + total;
        while !self.stopped() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn connect(&self) -> Result<zmq::Socket, zmq::Error> {
        let socket = self.context.socket(zmq::SUB)?;
        socket.set_linger(0)?;
        socket.set_maxmsgsize(self.config.max_message_bytes)?;
        socket.set_rcvhwm(self.config.receive_hwm())?;
        socket.set_reconnect_ivl(MIN_BACKOFF.as_millis() as i32)?;
        socket.set_reconnect_ivl_max(self.config.max_backoff.as_millis() as i32)?;
        socket.set_subscribe(self.config.topic.as_bytes())?;
        socket.connect(&self.config.endpoint)?;
        Ok(socket)
    }

    fn on_message(&mut self, frames: Vec<Vec<u8>>) {
        let [_topic, seq, payload] = &frames[..] else {
            self.metrics.drop_for("bad_framing");
            return;
        };
        let Ok(seq) = <[u8; 8]>::try_from(&seq[..]).map(u64::from_be_bytes) else {
            self.metrics.drop_for("bad_sequence");
            return;
        };
        match self.tracker.classify(seq) {
            SeqAction::InOrder => {}
            SeqAction::FirstContact => {
                self.clear();
                if seq > 0 && self.config.replay_endpoint.is_some() {
                    if let Ok(batches) = self.replay(0, seq) {
                        // The history missed before first contact is a gap
                        // filled too (a router restarted beside a busy
                        // engine), and counted as one.
                        let n = batches.len() as u64;
                        if self.apply_contiguous_tail(batches, seq) && n > 0 {
                            self.metrics.replay(n);
                        }
                    }
                }
            }
            SeqAction::Gap { from } => {
                self.metrics.gap();
                self.fill_gap(from, seq);
            }
            SeqAction::Restarted => {
                self.metrics.reset();
                self.clear();
            }
        }
        self.apply_payload(payload);
        self.tracker.applied(seq);
    }

    fn fill_gap(&mut self, from: u64, to: u64) {
        let replayable =
            self.config.replay_endpoint.is_some() && to - from <= self.config.max_replay_batches;
        let batches = if replayable {
            self.replay(from, to)
        } else {
            Err(ReplayError::Unavailable)
        };
        match batches {
            Ok(batches) if batches.first().map(|(s, _)| *s) == Some(from) => {
                let n = batches.len() as u64;
                if self.apply_contiguous_tail(batches, to) {
                    self.metrics.replay(n);
                } else {
                    self.metrics.reset();
                }
            }
            Ok(batches) => {
                // Replay no longer holds the first missing batch.
                self.metrics.reset();
                self.clear();
                self.apply_contiguous_tail(batches, to);
            }
            Err(ReplayError::Unavailable) => {
                self.metrics.reset();
                self.clear();
            }
            Err(ReplayError::Stopped) => {}
        }
    }

    /// Applies `batches` if they are consecutive and end right before `to`;
    /// otherwise clears the worker. Returns whether they were applied.
    fn apply_contiguous_tail(&mut self, batches: Vec<(u64, Vec<u8>)>, to: u64) -> bool {
        let consecutive = batches.windows(2).all(|w| w[1].0 == w[0].0 + 1);
        let ends_right = match batches.last() {
            Some((last, _)) => last + 1 == to,
            None => true,
        };
        if !(consecutive && ends_right) {
            self.clear();
            return false;
        }
        for (_, payload) in &batches {
            self.apply_payload(payload);
        }
        true
    }

    fn clear(&self) {
        self.sink
            .apply(self.config.worker, CacheTier::Device, &IndexEvent::Cleared);
    }

    /// Asks the replay socket for batches `from..to` (at most
    /// `max_replay_batches` of them), in order.
    fn replay(&self, from: u64, to: u64) -> Result<Vec<(u64, Vec<u8>)>, ReplayError> {
        let Some(endpoint) = &self.config.replay_endpoint else {
            return Err(ReplayError::Unavailable);
        };
        let unavailable = |_| ReplayError::Unavailable;
        let dealer = self.context.socket(zmq::DEALER).map_err(unavailable)?;
        dealer.set_linger(0).map_err(unavailable)?;
        dealer
            .set_maxmsgsize(self.config.max_message_bytes)
            .map_err(unavailable)?;
        dealer
            .set_rcvhwm(self.config.receive_hwm())
            .map_err(unavailable)?;
        dealer.connect(endpoint).map_err(unavailable)?;
        let request: [&[u8]; 2] = [b"", &from.to_be_bytes()];
        dealer.send_multipart(request, 0).map_err(unavailable)?;
        let deadline = Instant::now() + self.config.replay_timeout;
        let cap = self.config.max_replay_batches.min(to - from) as usize;
        let mut batches = Vec::new();
        let mut bytes = 0usize;
        loop {
            if self.stopped() {
                return Err(ReplayError::Stopped);
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(ReplayError::Unavailable);
            }
            let wait = left.as_millis().min(POLL_MS as u128) as i64;
            match dealer.poll(zmq::POLLIN, wait) {
                Ok(0) => continue,
                Ok(_) => {}
                Err(_) => return Err(ReplayError::Unavailable),
            }
            let Ok(frames) = dealer.recv_multipart(zmq::DONTWAIT) else {
                continue;
            };
            let Some((seq, payload)) = parse_replay_reply(frames) else {
                self.metrics.drop_for("bad_framing");
                continue;
            };
            if seq == END_OF_REPLAY_SEQ {
                return Ok(batches);
            }
            if seq >= from && seq < to && batches.len() < cap {
                bytes = bytes.saturating_add(payload.len());
                if bytes > self.config.max_replay_bytes {
                    self.metrics.drop_for("replay_over_bytes");
                    return Err(ReplayError::Unavailable);
                }
                batches.push((seq, payload));
            }
        }
    }

    fn apply_payload(&mut self, payload: &[u8]) {
        let decoded = decode_batch_lossy_within(payload, self.config.format, &self.config.decode);
        let (batch, errors) = match decoded {
            Ok(decoded) => decoded,
            Err(err) => {
                self.metrics.drop_for(err.reason());
                return;
            }
        };
        self.metrics.batch();
        if let Some(rank) = batch.data_parallel_rank {
            if let Err(reason) = rank_check(rank, self.config.worker.dp_rank, self.config.dp_size) {
                self.metrics.drop_for(reason);
                return;
            }
        }
        for error in &errors {
            self.metrics.drop_for(error.error.reason());
        }
        for event in &batch.events {
            self.metrics.event(event.type_name());
            match self.normalizer.normalize(event) {
                Normalized::Index(tier, index_event) => {
                    self.metrics.applied(tier);
                    self.sink.apply(self.config.worker, tier, &index_event);
                }
                Normalized::Skipped(reason) => self.metrics.drop_for(reason.as_str()),
            }
        }
    }
}

/// Whether a batch naming data-parallel rank `rank` belongs to the stream
/// of rank `stream` of a worker of `dp_size` ranks; the drop reason if
/// not.
pub fn rank_check(rank: i64, stream: u32, dp_size: u32) -> Result<(), &'static str> {
    match u32::try_from(rank) {
        Ok(r) if r < dp_size.max(1) => {
            if r == stream {
                Ok(())
            } else {
                Err("dp_rank_mismatch")
            }
        }
        _ => Err("dp_rank_out_of_range"),
    }
}

/// A replay reply: `[b"", topic, seq, payload]` or `[b"", seq, payload]`
/// (the delimiter may be absent too). `None` for any other framing.
pub fn parse_replay_reply(mut frames: Vec<Vec<u8>>) -> Option<(u64, Vec<u8>)> {
    if frames.len() >= 3 && frames[0].is_empty() {
        frames.remove(0);
    }
    let (seq, payload) = match frames.len() {
        3 => {
            let payload = frames.pop()?;
            (frames.pop()?, payload)
        }
        2 => {
            let payload = frames.pop()?;
            (frames.pop()?, payload)
        }
        _ => return None,
    };
    let seq = u64::from_be_bytes(<[u8; 8]>::try_from(&seq[..]).ok()?);
    Some((seq, payload))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_batch_is_its_streams_only_when_it_names_the_streams_rank() {
        // Rank 2 of a worker of 4: its own rank passes.
        assert_eq!(rank_check(2, 2, 4), Ok(()));
        // Another declared rank's batch on this stream is a misconfiguration.
        assert_eq!(rank_check(1, 2, 4), Err("dp_rank_mismatch"));
        // Ranks the worker did not declare, or that are no rank at all.
        assert_eq!(rank_check(4, 2, 4), Err("dp_rank_out_of_range"));
        assert_eq!(rank_check(-1, 0, 4), Err("dp_rank_out_of_range"));
        assert_eq!(rank_check(i64::MAX, 0, 4), Err("dp_rank_out_of_range"));
        // A worker that declared no ranks takes rank 0's batches only.
        assert_eq!(rank_check(0, 0, 1), Ok(()));
        assert_eq!(rank_check(1, 0, 1), Err("dp_rank_out_of_range"));
        // Both reasons are counted.
        for reason in ["dp_rank_mismatch", "dp_rank_out_of_range"] {
            assert!(crate::metrics::DROP_REASONS.contains(&reason));
        }
    }

    #[test]
    fn the_tracker_classifies_order_gaps_and_restarts() {
        let mut t = SeqTracker::default();
        assert_eq!(t.classify(5), SeqAction::FirstContact);
        t.applied(5);
        assert_eq!(t.classify(6), SeqAction::InOrder);
        assert_eq!(t.classify(9), SeqAction::Gap { from: 6 });
        t.applied(9);
        assert_eq!(t.classify(0), SeqAction::Restarted);
        assert_eq!(t.classify(3), SeqAction::Restarted);
    }

    #[test]
    fn a_queue_holds_at_most_its_bytes_in_largest_messages() {
        let mut config = SubscriberConfig::new(WorkerId::new(1), "tcp://127.0.0.1:1", 16);
        assert_eq!(config.receive_hwm(), 4, "256 MiB of 64 MiB messages");
        config.max_message_bytes = 1 << 20;
        assert_eq!(config.receive_hwm(), 256);
        config.max_message_bytes = 1;
        assert_eq!(config.receive_hwm(), 100_000);
        config.max_message_bytes = 1 << 30;
        assert_eq!(
            config.receive_hwm(),
            1,
            "never zero: 0 is unlimited in libzmq"
        );
    }

    #[test]
    fn replay_replies_parse_with_and_without_a_topic_frame() {
        let seq = 7u64.to_be_bytes().to_vec();
        let with_topic = vec![vec![], b"kv".to_vec(), seq.clone(), b"p".to_vec()];
        let without_topic = vec![vec![], seq.clone(), b"p".to_vec()];
        let bare = vec![seq.clone(), b"p".to_vec()];
        for frames in [with_topic, without_topic, bare] {
            assert_eq!(parse_replay_reply(frames), Some((7, b"p".to_vec())));
        }
        let end = vec![vec![], END_OF_REPLAY_SEQ.to_be_bytes().to_vec(), vec![]];
        assert_eq!(parse_replay_reply(end), Some((END_OF_REPLAY_SEQ, vec![])));
        assert_eq!(parse_replay_reply(vec![vec![], vec![1, 2], vec![]]), None);
        assert_eq!(parse_replay_reply(vec![vec![1]]), None);
    }
}
