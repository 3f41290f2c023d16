use super::*;
use std::sync::Mutex;
use std::time::Duration;
use switchyard_core::admission::{
    AdmissionStrategy, SessionAwareConfig, SessionAwareStrategy, SessionKey,
};
use switchyard_core::dispatch::{Dispatcher, DispatcherConfig, Submission};
use switchyard_core::router::WorkerCapacity;
use switchyard_core::sequences::AddRequest;
use switchyard_core::{LocalHash, RequestId, WorkerId};
use switchyard_wire::replica::{decode_batch, ActiveSequenceData, SessionBinding};

fn config() -> ReplicaConfig {
    ReplicaConfig {
        heartbeat_ms: 50.0,
        ..ReplicaConfig::default()
    }
}

fn add(id: u128, worker: u64) -> AddRequest {
    AddRequest {
        request: RequestId(id),
        worker: WorkerId::new(worker),
        prompt_tokens: 40,
        blocks: vec![LocalHash(1), LocalHash(id as u64)],
        overlap_blocks: 0,
        expected_prefill_ms: None,
    }
}

/// A dispatcher over workers 0 and 1, with the session-aware strategy when
/// asked.
fn dispatcher(session_aware: bool) -> Arc<Mutex<Dispatcher>> {
    let strategy = session_aware.then(|| {
        Box::new(SessionAwareStrategy::new(SessionAwareConfig::default()).unwrap())
            as Box<dyn AdmissionStrategy + Send>
    });
    let mut d = Dispatcher::new(DispatcherConfig::default(), strategy).unwrap();
    for w in 0..2 {
        let _ = d.add_worker(WorkerId::new(w), WorkerCapacity::default(), 0.0);
    }
    Arc::new(Mutex::new(d))
}

/// A sink over `dispatcher` that publishes what a peer's batch makes it
/// publish (nothing waits in these tests, so nothing is dispatched).
fn sink(
    dispatcher: &Arc<Mutex<Dispatcher>>,
    id: ReplicaId,
    epoch: std::time::Instant,
) -> DispatcherSink {
    DispatcherSink::new(
        dispatcher.clone(),
        id,
        epoch,
        Box::new(|fx| assert!(fx.dispatch.is_empty())),
    )
}

/// `(request, kind)` of every event seen by a raw subscriber.
async fn collect(mut sub: Subscription, events: usize) -> Vec<(u128, &'static str)> {
    use futures_util::StreamExt as _;
    let mut seen = Vec::new();
    while seen.len() < events {
        let payload = tokio::time::timeout(Duration::from_secs(5), sub.next())
            .await
            .expect("events arrive")
            .expect("subscription open");
        for e in decode_batch(&payload).unwrap().events {
            let kind = match e.data {
                ActiveSequenceData::AddRequest { .. } => "add",
                ActiveSequenceData::MarkPrefillCompleted => "mark",
                ActiveSequenceData::Free => "free",
            };
            seen.push((e.request_id.0, kind));
        }
    }
    seen
}

async fn order_is_preserved(batching: bool) {
    let bus = InProcessBus::new();
    let transport = InProcessTransport::new(bus, batching, 1024);
    let cfg = config();
    let sub = transport.subscribe(&cfg.subject()).await.unwrap();
    let metrics = Arc::new(ReplicaMetrics::default());
    let cancel = CancellationToken::new();
    let (publisher, _task) = spawn_publisher(
        transport,
        cfg.subject(),
        ReplicaId(1),
        &cfg,
        metrics.clone(),
        cancel.clone(),
    );
    // Interleave the lifecycles of many requests.
    let mut expected = Vec::new();
    for id in 0..300u128 {
        publisher.added(&add(id, 0), None).unwrap();
        expected.push((id, "add"));
        if id >= 1 {
            publisher
                .prefill_completed(RequestId(id - 1), WorkerId::new(0))
                .unwrap();
            expected.push((id - 1, "mark"));
        }
        if id >= 2 {
            publisher
                .freed(RequestId(id - 2), WorkerId::new(0))
                .unwrap();
            expected.push((id - 2, "free"));
        }
    }
    let seen = collect(sub, expected.len()).await;
    assert_eq!(seen, expected);
    let snapshot = metrics.snapshot();
    assert_eq!(snapshot.published, expected.len() as u64);
    if batching {
        assert!(snapshot.batches_published < expected.len() as u64);
    } else {
        assert_eq!(snapshot.batches_published, expected.len() as u64);
    }
    cancel.cancel();
}

#[tokio::test]
async fn a_singleton_transport_preserves_the_order_of_every_event() {
    order_is_preserved(false).await;
}

#[tokio::test]
async fn a_batching_transport_preserves_the_order_of_every_event() {
    order_is_preserved(true).await;
}

/// A publisher whose transport is stuck: the one subscriber never reads
/// and its inbox holds one payload.
async fn blocked_publisher(
    capacity: usize,
) -> (
    ReplicaPublisher,
    JoinHandle<()>,
    CancellationToken,
    Subscription,
) {
    let transport = InProcessTransport::new(InProcessBus::new(), false, 1);
    let cfg = ReplicaConfig {
        queue_capacity: capacity,
        ..config()
    };
    let sub = transport.subscribe(&cfg.subject()).await.unwrap();
    let cancel = CancellationToken::new();
    let (publisher, task) = spawn_publisher(
        transport,
        cfg.subject(),
        ReplicaId(1),
        &cfg,
        Arc::new(ReplicaMetrics::default()),
        cancel.clone(),
    );
    // Event 1 fills the inbox; event 2 blocks the task in `publish`.
    publisher.added(&add(1, 0), None).unwrap();
    publisher.added(&add(2, 0), None).unwrap();
    tokio::time::sleep(Duration::from_millis(50)).await;
    (publisher, task, cancel, sub)
}

#[tokio::test]
async fn a_full_queue_drops_the_newest_event_counts_it_and_names_it() {
    let (publisher, _task, _cancel, _sub) = blocked_publisher(2).await;
    publisher.added(&add(3, 0), None).unwrap();
    publisher.added(&add(4, 0), None).unwrap();
    let err = publisher.added(&add(5, 0), None).unwrap_err();
    assert_eq!(
        err,
        PublishError::QueueFull {
            request_id: RequestId(5),
            capacity: 2
        }
    );
    assert_eq!(
        err.to_string(),
        "replica event queue full (capacity 2): dropped the newest event, for request \
         00000000000000000000000000000005"
    );
    assert_eq!(publisher.metrics().snapshot().dropped, 1);
}

#[tokio::test]
async fn cancellation_stops_a_blocked_publisher_promptly() {
    let (publisher, task, cancel, _sub) = blocked_publisher(4).await;
    assert!(!task.is_finished());
    cancel.cancel();
    tokio::time::timeout(Duration::from_millis(200), task)
        .await
        .expect("the publisher stops within 200 ms")
        .unwrap();
    // The in-flight event was dropped and counted.
    assert_eq!(publisher.metrics().snapshot().dropped, 1);
    let err = publisher.added(&add(9, 0), None).unwrap_err();
    assert_eq!(
        err,
        PublishError::Closed {
            during_shutdown: true
        }
    );
    assert_eq!(
        err.to_string(),
        "replica event queue closed during shutdown"
    );
}

#[tokio::test]
async fn a_publisher_that_died_says_it_was_not_shutting_down() {
    let transport = InProcessTransport::new(InProcessBus::new(), true, 16);
    let cfg = config();
    let (publisher, task, ..) = {
        let cancel = CancellationToken::new();
        let (p, t) = spawn_publisher(
            transport,
            cfg.subject(),
            ReplicaId(1),
            &cfg,
            Arc::new(ReplicaMetrics::default()),
            cancel.clone(),
        );
        (p, t, cancel)
    };
    task.abort();
    let _ = task.await;
    let err = publisher.added(&add(1, 0), None).unwrap_err();
    assert_eq!(
        err,
        PublishError::Closed {
            during_shutdown: false
        }
    );
    assert!(err.to_string().contains("while not shutting down"));
}

#[tokio::test]
async fn a_replica_ignores_its_own_events_and_its_peer_applies_them() {
    let bus = InProcessBus::new();
    let cfg = config();
    let epoch = std::time::Instant::now();
    let (dispatcher_a, dispatcher_b) = (dispatcher(false), dispatcher(false));
    let a = ReplicaPlane::start(
        Arc::new(InProcessTransport::new(bus.clone(), true, 1024)),
        &cfg,
        ReplicaId(1),
        sink(&dispatcher_a, ReplicaId(1), epoch),
    )
    .await
    .unwrap();
    let b = ReplicaPlane::start(
        Arc::new(InProcessTransport::new(bus, true, 1024)),
        &cfg,
        ReplicaId(2),
        sink(&dispatcher_b, ReplicaId(2), epoch),
    )
    .await
    .unwrap();
    // A request on A: the dispatcher books it and publishes the booking.
    let submission = Submission {
        blocks: vec![LocalHash(1)],
        prompt_tokens: 16,
        ..Submission::default()
    };
    let now = epoch.elapsed().as_secs_f64() * 1e3;
    let (_, fx) = dispatcher_a
        .lock()
        .unwrap()
        .submit(RequestId(7), submission, now)
        .unwrap();
    assert_eq!(fx.dispatch.len(), 1);
    publish_effects(&a.publisher, &fx.publish, &fx.bindings);
    wait_until(|| {
        dispatcher_b
            .lock()
            .unwrap()
            .router()
            .remote()
            .key_of(ReplicaId(1), RequestId(7))
            .is_some()
    })
    .await;
    let key = dispatcher_b
        .lock()
        .unwrap()
        .router()
        .remote()
        .key_of(ReplicaId(1), RequestId(7))
        .unwrap();
    assert_eq!(
        dispatcher_b.lock().unwrap().router().remote().owner(key),
        Some(ReplicaId(1))
    );
    // A saw its own batch and ignored it: one booking, local.
    wait_until(|| a.metrics.snapshot().batches_own >= 1).await;
    {
        let d = dispatcher_a.lock().unwrap();
        assert_eq!(d.router().sequences().active_requests(), 1);
        assert_eq!(d.router().remote().remote_requests(), 0);
    }
    assert_eq!(a.metrics.snapshot().applied, 0);
    a.shutdown().await;
    b.shutdown().await;
}

#[tokio::test]
async fn session_bindings_reach_the_peers_strategy() {
    let bus = InProcessBus::new();
    let cfg = config();
    let epoch = std::time::Instant::now();
    let a = ReplicaPlane::start(
        Arc::new(InProcessTransport::new(bus.clone(), true, 1024)),
        &cfg,
        ReplicaId(1),
        sink(&dispatcher(true), ReplicaId(1), epoch),
    )
    .await
    .unwrap();
    let peer = dispatcher(true);
    let b = ReplicaPlane::start(
        Arc::new(InProcessTransport::new(bus, true, 1024)),
        &cfg,
        ReplicaId(2),
        sink(&peer, ReplicaId(2), epoch),
    )
    .await
    .unwrap();
    let binding = SessionBinding {
        session: SessionKey::from_client_id("chat-42"),
        worker: WorkerId::new(1),
        context_tokens: 900,
    };
    a.publisher.session_bound(binding).unwrap();
    wait_until(|| b.metrics.sessions_applied.get() == 1).await;
    let counts = peer
        .lock()
        .unwrap()
        .admission()
        .strategy()
        .unwrap()
        .event_counts();
    assert!(counts.contains(&("remote_bindings", 1)), "{counts:?}");
    a.shutdown().await;
    b.shutdown().await;
}

async fn wait_until(mut done: impl FnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    while !done() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "condition not met within 5 s"
        );
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

#[test]
fn worker_ids_come_from_names_so_every_replica_agrees() {
    // FNV-1a 64 of "w0": fixed across processes, builds and platforms.
    assert_eq!(
        worker_id_for_name("w0"),
        WorkerId::new(0x08cb_8607_b56d_7952)
    );
    assert_eq!(worker_id_for_name("w0"), worker_id_for_name("w0"));
    assert_ne!(worker_id_for_name("w0"), worker_id_for_name("w1"));
}

/// A booking of `blocks` blocks (about 9 bytes each on the wire).
fn long_add(id: u128, worker: u64, blocks: u64) -> AddRequest {
    AddRequest {
        request: RequestId(id),
        worker: WorkerId::new(worker),
        prompt_tokens: blocks as u32 * 16,
        blocks: (0..blocks)
            .map(|b| LocalHash(u64::MAX - b - id as u64))
            .collect(),
        overlap_blocks: 0,
        expected_prefill_ms: None,
    }
}

#[tokio::test]
async fn a_burst_of_long_prompts_over_a_small_payload_limit_arrives_whole_with_every_free() {
    const LIMIT: usize = 64 * 1024;
    let bus = InProcessBus::new();
    let cfg = config();
    let epoch = std::time::Instant::now();
    let peer = dispatcher(false);
    let b = ReplicaPlane::start(
        Arc::new(InProcessTransport::new(bus.clone(), true, 1024).with_max_payload(LIMIT)),
        &cfg,
        ReplicaId(2),
        sink(&peer, ReplicaId(2), epoch),
    )
    .await
    .unwrap();
    let transport = InProcessTransport::new(bus, true, 1024).with_max_payload(LIMIT);
    let raw = transport.subscribe(&cfg.subject()).await.unwrap();
    let a = ReplicaPlane::start(
        Arc::new(transport),
        &cfg,
        ReplicaId(1),
        sink(&dispatcher(false), ReplicaId(1), epoch),
    )
    .await
    .unwrap();
    // 100 bookings of 2,000 blocks (about 18 KB each): a 128-event batch
    // would be about 2 MB, 30 times the limit. Then one over the limit
    // alone, then every free.
    for id in 1..=100u128 {
        a.publisher
            .added(&long_add(id, id as u64 % 2, 2_000), None)
            .unwrap();
    }
    a.publisher.added(&long_add(101, 0, 10_000), None).unwrap();
    for id in 1..=101u128 {
        a.publisher
            .freed(RequestId(id), WorkerId::new(id as u64 % 2))
            .unwrap();
    }
    wait_until(|| b.metrics.snapshot().applied == 202).await;
    assert_eq!(peer.lock().unwrap().router().remote().remote_requests(), 0);
    let m = a.metrics.snapshot();
    assert_eq!(m.dropped, 0);
    assert_eq!(m.published, 202);
    assert!(m.batches_split >= 1, "{m:?}");
    assert_eq!(a.metrics.truncated.get(), 1);
    // Every message on the bus fits the limit.
    let mut raw = raw;
    use futures_util::StreamExt as _;
    let mut events = 0;
    while events < 202 {
        let payload = tokio::time::timeout(Duration::from_secs(5), raw.next())
            .await
            .unwrap()
            .unwrap();
        assert!(payload.len() <= LIMIT, "{} bytes", payload.len());
        events += decode_batch(&payload).unwrap().events.len();
    }
    a.shutdown().await;
    b.shutdown().await;
}

#[tokio::test]
async fn a_digest_drops_a_booking_whose_free_was_lost_and_keeps_live_ones() {
    let bus = InProcessBus::new();
    let cfg = ReplicaConfig {
        digest_ms: 100.0,
        ..config()
    };
    let epoch = std::time::Instant::now();
    let (dispatcher_a, peer) = (dispatcher(false), dispatcher(false));
    let a = ReplicaPlane::start(
        Arc::new(InProcessTransport::new(bus.clone(), true, 1024)),
        &cfg,
        ReplicaId(1),
        sink(&dispatcher_a, ReplicaId(1), epoch),
    )
    .await
    .unwrap();
    let b = ReplicaPlane::start(
        Arc::new(InProcessTransport::new(bus, true, 1024)),
        &cfg,
        ReplicaId(2),
        sink(&peer, ReplicaId(2), epoch),
    )
    .await
    .unwrap();
    // A live booking on A, published as the server does.
    let submission = Submission {
        blocks: vec![LocalHash(1)],
        prompt_tokens: 16,
        ..Submission::default()
    };
    let now = epoch.elapsed().as_secs_f64() * 1e3;
    let (_, fx) = dispatcher_a
        .lock()
        .unwrap()
        .submit(RequestId(7), submission, now)
        .unwrap();
    publish_effects(&a.publisher, &fx.publish, &fx.bindings);
    // A booking A published and no longer holds: its free was lost.
    a.publisher.added(&add(8, 1), None).unwrap();
    let held = |id: u128| {
        peer.lock()
            .unwrap()
            .router()
            .remote()
            .key_of(ReplicaId(1), RequestId(id))
            .is_some()
    };
    wait_until(|| held(7) && held(8)).await;
    let seen = std::time::Instant::now();
    wait_until(|| !held(8)).await;
    let took = seen.elapsed();
    // Not before the grace, and within a digest period or two after it.
    let grace = Duration::from_secs_f64(switchyard_core::replica::DIGEST_GRACE_MS / 1e3);
    assert!(took >= grace - Duration::from_millis(50), "{took:?}");
    assert!(took < grace + Duration::from_millis(1_000), "{took:?}");
    assert!(held(7), "the live booking stays");
    assert_eq!(b.metrics.snapshot().digest_freed, 1);
    assert!(a.metrics.snapshot().digests_published >= 1);
    a.shutdown().await;
    b.shutdown().await;
}

/// A transport that loses every message carrying a free, as a refused
/// publish or a network fault would: the frees it swallowed are counted.
struct LosingFrees {
    inner: InProcessTransport,
    lost: Arc<std::sync::atomic::AtomicU64>,
}

impl Transport for LosingFrees {
    fn batching(&self) -> bool {
        self.inner.batching()
    }

    async fn publish(&self, subject: &str, payload: bytes::Bytes) -> Result<(), TransportError> {
        let frees = decode_batch(&payload)
            .map(|b| {
                b.events
                    .iter()
                    .filter(|e| e.data == ActiveSequenceData::Free)
                    .count()
            })
            .unwrap_or(0);
        if frees > 0 {
            self.lost
                .fetch_add(frees as u64, std::sync::atomic::Ordering::Relaxed);
            return Ok(());
        }
        self.inner.publish(subject, payload).await
    }

    async fn subscribe(&self, subject: &str) -> Result<Subscription, TransportError> {
        self.inner.subscribe(subject).await
    }
}

#[tokio::test]
async fn requests_whose_frees_are_lost_in_transit_leave_the_peer_within_a_few_seconds() {
    let bus = InProcessBus::new();
    let cfg = ReplicaConfig {
        digest_ms: 200.0,
        ..config()
    };
    let epoch = std::time::Instant::now();
    let (dispatcher_a, peer) = (dispatcher(false), dispatcher(false));
    let lost = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let a = ReplicaPlane::start(
        Arc::new(LosingFrees {
            inner: InProcessTransport::new(bus.clone(), true, 1024),
            lost: lost.clone(),
        }),
        &cfg,
        ReplicaId(1),
        sink(&dispatcher_a, ReplicaId(1), epoch),
    )
    .await
    .unwrap();
    let b = ReplicaPlane::start(
        Arc::new(InProcessTransport::new(bus, true, 1024)),
        &cfg,
        ReplicaId(2),
        sink(&peer, ReplicaId(2), epoch),
    )
    .await
    .unwrap();
    let now = || epoch.elapsed().as_secs_f64() * 1e3;
    let drive = |call: &dyn Fn(&mut Dispatcher) -> switchyard_core::dispatch::Effects| {
        let fx = call(&mut dispatcher_a.lock().unwrap());
        publish_effects(&a.publisher, &fx.publish, &fx.bindings);
    };
    // Ten requests on A; the peer sees all ten.
    for id in 1..=10u128 {
        drive(&|d| {
            let submission = Submission {
                blocks: vec![LocalHash(id as u64)],
                prompt_tokens: 16,
                ..Submission::default()
            };
            d.submit(RequestId(id), submission, now()).unwrap().1
        });
    }
    let remote = || peer.lock().unwrap().router().remote().remote_requests();
    wait_until(|| remote() == 10).await;
    // Six end; their frees are lost on the way.
    for id in 1..=6u128 {
        drive(&|d| d.finish(RequestId(id), 20, now()));
    }
    let ended = std::time::Instant::now();
    let deadline = ended + Duration::from_secs(4);
    while remote() != 4 {
        assert!(
            std::time::Instant::now() < deadline,
            "stale bookings linger: {} held",
            remote()
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    eprintln!(
        "stale bookings dropped {:?} after their end",
        ended.elapsed()
    );
    assert_eq!(lost.load(std::sync::atomic::Ordering::Relaxed), 6);
    assert_eq!(b.metrics.snapshot().digest_freed, 6);
    // The four live ones stay through further digests.
    tokio::time::sleep(Duration::from_millis(600)).await;
    assert_eq!(remote(), 4);
    a.shutdown().await;
    b.shutdown().await;
}
