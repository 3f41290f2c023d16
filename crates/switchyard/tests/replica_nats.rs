//! Replica sync over a real `nats-server` (the Debian package's binary,
//! spawned on a free loopback port; a missing binary fails the test).
//!
//! Each replica is a `Router` with a NATS publisher and subscriber in this
//! process, each on its own NATS connection, routing to the same two
//! workers.

use rand::{Rng, SeedableRng};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use switchyard_core::router::WorkerCapacity;
use switchyard_core::sequences::{ActiveSequences, AddRequest, SequenceEvent, SequencesConfig};
use switchyard_core::{LocalHash, RequestId, Router, RouterConfig, WorkerId};
use switchyard_replica::{
    random_replica_id, Clock, LocalNatsServer, NatsTransport, ReplicaConfig, ReplicaPlane,
    RouterSink,
};

const WORKERS: [WorkerId; 2] = [WorkerId::new(1), WorkerId::new(2)];

fn nats() -> LocalNatsServer {
    LocalNatsServer::start().unwrap_or_else(|e| {
        panic!("these tests need a real nats-server: {e:#}");
    })
}

struct Replica {
    router: Arc<Mutex<Router>>,
    plane: ReplicaPlane,
    clock: Clock,
}

impl Replica {
    async fn start(config: &ReplicaConfig, clock: Clock) -> Self {
        let mut router = Router::new(RouterConfig {
            remote: switchyard_core::replica::RemoteConfig {
                silence_expiry_ms: config.silence_expiry_ms,
                ..Default::default()
            },
            ..RouterConfig::default()
        })
        .unwrap();
        for worker in WORKERS {
            router.add_worker(worker, WorkerCapacity::default());
        }
        let router = Arc::new(Mutex::new(router));
        let id = random_replica_id();
        let transport = Arc::new(
            NatsTransport::connect(config.nats_url.as_deref().unwrap())
                .await
                .unwrap(),
        );
        let plane = ReplicaPlane::start(
            transport,
            config,
            id,
            RouterSink::new(router.clone(), id, clock),
        )
        .await
        .unwrap();
        Self {
            router,
            plane,
            clock,
        }
    }

    /// Local mutation first, then enqueue, as the server does.
    fn apply_local(&self, event: &SequenceEvent, worker: WorkerId) {
        let now = self.clock.now_ms();
        let mut router = self.router.lock().unwrap();
        match event {
            SequenceEvent::Add(add) => {
                router.book_request(add, now);
                self.plane.publisher.added(add, None).unwrap();
            }
            SequenceEvent::MarkPrefillCompleted(id) => {
                router.mark_prefill_completed(*id, now);
                self.plane.publisher.prefill_completed(*id, worker).unwrap();
            }
            SequenceEvent::Free(id) => {
                router.free(*id, now);
                self.plane.publisher.freed(*id, worker).unwrap();
            }
        }
    }

    /// `(worker, requests, decode blocks)` per worker.
    fn loads(&self) -> Vec<(WorkerId, usize, usize)> {
        loads(self.router.lock().unwrap().sequences())
    }
}

fn loads(s: &ActiveSequences) -> Vec<(WorkerId, usize, usize)> {
    let mut out: Vec<_> = s
        .registry()
        .loads()
        .map(|l| (l.worker, l.requests, l.decode_blocks))
        .collect();
    out.sort();
    out
}

fn config(server: &LocalNatsServer, endpoint: &str) -> ReplicaConfig {
    ReplicaConfig {
        nats_url: Some(server.url()),
        endpoint: endpoint.into(),
        heartbeat_ms: 50.0,
        expiry_check_ms: 20.0,
        ..ReplicaConfig::default()
    }
}

fn truth() -> ActiveSequences {
    let mut s = ActiveSequences::new(SequencesConfig::default()).unwrap();
    for worker in WORKERS {
        s.add_worker(worker);
    }
    s
}

fn booking(id: u128, worker: WorkerId, rng: &mut impl Rng) -> AddRequest {
    let blocks: Vec<LocalHash> = (0..rng.gen_range(1..12))
        .map(|i| LocalHash(if i < 2 { i } else { rng.gen() }))
        .collect();
    AddRequest {
        request: RequestId(id),
        worker,
        prompt_tokens: blocks.len() as u32 * 16 + rng.gen_range(0..16),
        blocks,
        overlap_blocks: 0,
        expected_prefill_ms: None,
    }
}

async fn wait_for(what: &str, within: Duration, mut done: impl FnMut() -> bool) -> Duration {
    let start = Instant::now();
    while !done() {
        assert!(start.elapsed() < within, "{what}: not within {within:?}");
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    start.elapsed()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bookings_spread_across_three_replicas_converge_to_the_truth_within_100_ms() {
    let server = nats();
    let config = config(&server, "generate");
    let clock = Clock::new();
    let mut replicas = Vec::new();
    for _ in 0..3 {
        replicas.push(Replica::start(&config, clock).await);
    }
    let mut truth = truth();
    let mut rng = rand::rngs::StdRng::seed_from_u64(6);
    // Live requests: (id, replica that booked it, worker, marked).
    let mut live: Vec<(u128, usize, WorkerId, bool)> = Vec::new();
    for id in 1..=600u128 {
        let roll: f64 = rng.gen();
        let event = if roll < 0.5 || live.is_empty() {
            let replica = rng.gen_range(0..replicas.len());
            let worker = WORKERS[rng.gen_range(0..WORKERS.len())];
            live.push((id, replica, worker, false));
            (
                replica,
                worker,
                SequenceEvent::Add(booking(id, worker, &mut rng)),
            )
        } else if roll < 0.75 {
            let i = rng.gen_range(0..live.len());
            live[i].3 = true;
            let (rid, replica, worker, _) = live[i];
            (
                replica,
                worker,
                SequenceEvent::MarkPrefillCompleted(RequestId(rid)),
            )
        } else {
            let (rid, replica, worker, _) = live.swap_remove(rng.gen_range(0..live.len()));
            (replica, worker, SequenceEvent::Free(RequestId(rid)))
        };
        let (replica, worker, event) = event;
        truth.apply(&event, clock.now_ms());
        replicas[replica].apply_local(&event, worker);
        if id % 50 == 0 {
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    }
    let expected = loads(&truth);
    assert!(expected.iter().any(|(_, requests, _)| *requests > 0));
    // Quiescence starts now: every replica must agree within 100 ms.
    let took = wait_for(
        "three replicas converge",
        Duration::from_millis(100),
        || replicas.iter().all(|r| r.loads() == expected),
    )
    .await;
    eprintln!("converged {took:?} after the last event");
    for r in &replicas {
        let m = r.plane.metrics.snapshot();
        assert_eq!(m.dropped, 0);
        assert!(m.received > 0 && m.applied > 0);
    }
    for r in replicas {
        r.plane.shutdown().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopped_replicas_bookings_expire_on_the_others_and_live_ones_stay() {
    let server = nats();
    let config = ReplicaConfig {
        silence_expiry_ms: 300.0,
        ..config(&server, "generate")
    };
    let clock = Clock::new();
    let a = Replica::start(&config, clock).await;
    let b = Replica::start(&config, clock).await;
    let c = Replica::start(&config, clock).await;
    let mut rng = rand::rngs::StdRng::seed_from_u64(7);
    for id in 1..=5 {
        a.apply_local(
            &SequenceEvent::Add(booking(id, WORKERS[0], &mut rng)),
            WORKERS[0],
        );
    }
    b.apply_local(
        &SequenceEvent::Add(booking(100, WORKERS[1], &mut rng)),
        WORKERS[1],
    );
    wait_for("bookings reach c", Duration::from_secs(2), || {
        c.router.lock().unwrap().sequences().active_requests() == 6
    })
    .await;
    a.plane.shutdown().await;
    let took = wait_for("a's bookings expire on c", Duration::from_secs(2), || {
        c.router.lock().unwrap().sequences().active_requests() == 1
    })
    .await;
    eprintln!("expired {took:?} after a stopped (expiry 300 ms)");
    assert!(
        took >= Duration::from_millis(150),
        "expired too early: {took:?}"
    );
    // b kept heartbeating: its booking survives well past the expiry.
    tokio::time::sleep(Duration::from_millis(400)).await;
    let c_router = c.router.lock().unwrap();
    assert_eq!(c_router.sequences().owner(RequestId(100)), Some(WORKERS[1]));
    assert_eq!(c_router.sequences().active_requests(), 1);
    drop(c_router);
    assert_eq!(c.plane.metrics.snapshot().expired, 5);
    assert_eq!(b.router.lock().unwrap().sequences().active_requests(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_on_another_endpoint_see_nothing() {
    let server = nats();
    let clock = Clock::new();
    let a = Replica::start(&config(&server, "generate"), clock).await;
    let b = Replica::start(&config(&server, "generate"), clock).await;
    let other = Replica::start(&config(&server, "embed"), clock).await;
    let mut rng = rand::rngs::StdRng::seed_from_u64(8);
    for id in 1..=20 {
        a.apply_local(
            &SequenceEvent::Add(booking(id, WORKERS[0], &mut rng)),
            WORKERS[0],
        );
    }
    wait_for("b sees a", Duration::from_secs(2), || {
        b.router.lock().unwrap().sequences().active_requests() == 20
    })
    .await;
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(
        other.router.lock().unwrap().sequences().active_requests(),
        0
    );
    let m = other.plane.metrics.snapshot();
    assert_eq!((m.received, m.batches_received), (0, 0));
}
