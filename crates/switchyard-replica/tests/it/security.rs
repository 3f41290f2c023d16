//! The replica plane's trust boundary over a real `nats-server`: NATS
//! authentication keeps unauthenticated publishers off the bus, batches
//! stay under the server's `max_payload`, and forged batches change no
//! more than the core's checks allow.

use crate::support::{nats, nats_with, wait_for};
use bytes::Bytes;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use switchyard_core::dispatch::{Dispatcher, DispatcherConfig};
use switchyard_core::replica::{booking_bytes, MAX_REMOTE_PROMPT_TOKENS, REMOTE_KEY_BIT};
use switchyard_core::router::WorkerCapacity;
use switchyard_core::sequences::AddRequest;
use switchyard_core::{LocalHash, ReplicaId, RequestId, WorkerId};
use switchyard_replica::{
    payload_limit, DispatcherSink, LocalNatsServer, NatsAuth, NatsTransport, ReplicaConfig,
    ReplicaPlane, Secret, Transport,
};
use switchyard_wire::replica::{encode_batch, ActiveSequenceEvent, ReplicaBatch};

const WORKERS: [WorkerId; 2] = [WorkerId::new(1), WorkerId::new(2)];

struct Replica {
    dispatcher: Arc<Mutex<Dispatcher>>,
    plane: ReplicaPlane,
    transport: Arc<NatsTransport>,
}

impl Replica {
    async fn start(config: &ReplicaConfig, id: ReplicaId) -> Self {
        Self::start_with(config, id, DispatcherConfig::default()).await
    }

    async fn start_with(config: &ReplicaConfig, id: ReplicaId, core: DispatcherConfig) -> Self {
        let mut dispatcher = Dispatcher::new(core, None).unwrap();
        for worker in WORKERS {
            let _ = dispatcher.add_worker(worker, WorkerCapacity::default(), 0.0);
        }
        let dispatcher = Arc::new(Mutex::new(dispatcher));
        let transport = Arc::new(
            NatsTransport::connect_with(config.nats_url.as_deref().unwrap(), &config.auth)
                .await
                .unwrap(),
        );
        let sink = DispatcherSink::new(
            dispatcher.clone(),
            id,
            Instant::now(),
            Box::new(|fx| assert!(fx.dispatch.is_empty())),
        );
        let plane = ReplicaPlane::start(transport.clone(), config, id, sink)
            .await
            .unwrap();
        Self {
            dispatcher,
            plane,
            transport,
        }
    }

    fn remote_requests(&self) -> usize {
        self.dispatcher
            .lock()
            .unwrap()
            .router()
            .remote()
            .remote_requests()
    }

    fn holds(&self, origin: ReplicaId, id: u128) -> bool {
        let d = self.dispatcher.lock().unwrap();
        d.router().remote().key_of(origin, RequestId(id)).is_some()
    }
}

fn config(server: &LocalNatsServer) -> ReplicaConfig {
    ReplicaConfig {
        nats_url: Some(server.url()),
        heartbeat_ms: 50.0,
        expiry_check_ms: 20.0,
        ..ReplicaConfig::default()
    }
}

fn booking(id: u128, worker: WorkerId, blocks: u64, prompt_tokens: u32) -> AddRequest {
    AddRequest {
        request: RequestId(id),
        worker,
        prompt_tokens,
        blocks: (0..blocks)
            .map(|b| LocalHash(u64::MAX - b - id as u64))
            .collect(),
        overlap_blocks: 0,
        expected_prefill_ms: None,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_of_long_prompts_through_a_64_kib_server_loses_no_free() {
    let server = nats_with("max_payload: 65536");
    let config = config(&server);
    let a = Replica::start(&config, ReplicaId(1)).await;
    let b = Replica::start(&config, ReplicaId(2)).await;
    assert_eq!(a.transport.max_payload(), payload_limit(65_536));
    // 120 prompts of 3,000 blocks (about 27 KB each on the wire), all
    // queued at once, then their frees.
    for id in 1..=120u128 {
        let add = booking(id, WORKERS[id as usize % 2], 3_000, 48_000);
        a.plane.publisher.added(&add, None).unwrap();
    }
    wait_for("every booking reaches b", Duration::from_secs(10), || {
        b.remote_requests() == 120
    })
    .await;
    for id in 1..=120u128 {
        a.plane
            .publisher
            .freed(RequestId(id), WORKERS[id as usize % 2])
            .unwrap();
    }
    wait_for("every free reaches b", Duration::from_secs(10), || {
        b.remote_requests() == 0
    })
    .await;
    let m = a.plane.metrics.snapshot();
    assert_eq!(m.dropped, 0, "{m:?}");
    assert!(m.batches_split >= 1, "{m:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_a_password_on_the_server_only_authenticated_replicas_reach_the_bus() {
    let server = nats_with("authorization { user: router, password: s3cret-pw }");
    let dir = std::env::temp_dir().join(format!("sy-nats-auth-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let password_file = dir.join("password");
    std::fs::write(&password_file, "s3cret-pw\n").unwrap();
    let mut config_a = config(&server);
    config_a.auth = NatsAuth {
        user: Some("router".into()),
        password_file: Some(password_file),
        ..NatsAuth::default()
    };
    let mut config_b = config(&server);
    config_b.auth = NatsAuth {
        user: Some("router".into()),
        password: Some(Secret("s3cret-pw".into())),
        ..NatsAuth::default()
    };
    let a = Replica::start(&config_a, ReplicaId(1)).await;
    let b = Replica::start(&config_b, ReplicaId(2)).await;
    a.plane
        .publisher
        .added(&booking(1, WORKERS[0], 2, 32), None)
        .unwrap();
    wait_for(
        "an authenticated pair syncs",
        Duration::from_secs(30),
        || b.holds(ReplicaId(1), 1),
    )
    .await;

    // No credentials, or the wrong password: no connection at all.
    let url = server.url();
    let refused = NatsTransport::connect(&url).await.unwrap_err().to_string();
    assert!(refused.contains("authorization"), "{refused}");
    let wrong = NatsAuth {
        user: Some("router".into()),
        password: Some(Secret("guess".into())),
        ..NatsAuth::default()
    };
    let refused = NatsTransport::connect_with(&url, &wrong)
        .await
        .unwrap_err()
        .to_string();
    assert!(refused.contains("authorization"), "{refused}");
    assert!(
        !refused.contains("guess"),
        "the secret is not echoed: {refused}"
    );
    // A raw client that tries anyway never gets to publish a forged free.
    assert!(async_nats::connect(&url).await.is_err());

    // Nothing changed: b still holds a's booking, and heard nothing else.
    let received = b.plane.metrics.snapshot().batches_received;
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(b.holds(ReplicaId(1), 1));
    assert_eq!(b.remote_requests(), 1);
    let m = b.plane.metrics.snapshot();
    assert_eq!(m.batches_malformed, 0);
    assert_eq!(m.peer_dropped, 0);
    // Only a's heartbeats arrived meanwhile.
    assert!(m.batches_received >= received);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_a_token_on_the_server_a_token_file_connects_and_no_token_does_not() {
    let server = nats_with("authorization { token: t0k3n-abc }");
    let dir = std::env::temp_dir().join(format!("sy-nats-token-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let token_file = dir.join("token");
    std::fs::write(&token_file, "t0k3n-abc\n").unwrap();
    let auth = NatsAuth {
        token_file: Some(token_file),
        ..NatsAuth::default()
    };
    let transport = NatsTransport::connect_with(&server.url(), &auth)
        .await
        .unwrap();
    transport.flush().await.unwrap();
    assert!(NatsTransport::connect(&server.url()).await.is_err());
    let missing = NatsAuth {
        token_file: Some(dir.join("absent")),
        ..NatsAuth::default()
    };
    let err = NatsTransport::connect_with(&server.url(), &missing)
        .await
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("token file") && err.contains("absent"),
        "{err}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forged_batches_change_nothing_beyond_the_clamps() {
    let server = nats();
    // a's booking below is published without being booked in a's own
    // dispatcher, so a's digests (every 2 s by default) would free it on b
    // a second after it arrived: on a loaded machine, before this test
    // looks. No digest runs during the test.
    let config = ReplicaConfig {
        digest_ms: 3_600_000.0,
        ..config(&server)
    };
    let honest = ReplicaId(1);
    let a = Replica::start(&config, honest).await;
    let b = Replica::start(&config, ReplicaId(2)).await;
    a.plane
        .publisher
        .added(&booking(1, WORKERS[0], 2, 32), None)
        .unwrap();
    wait_for("b holds a's booking", Duration::from_secs(30), || {
        b.holds(honest, 1)
    })
    .await;
    let forger = ReplicaId(66);
    let raw = NatsTransport::connect(&server.url()).await.unwrap();
    let send = |batch: ReplicaBatch| {
        let raw = raw.clone();
        let subject = config.subject();
        async move {
            raw.publish(&subject, Bytes::from(encode_batch(&batch)))
                .await
                .unwrap();
            raw.flush().await.unwrap();
        }
    };
    let batch = |sender: ReplicaId, events: Vec<ActiveSequenceEvent>| ReplicaBatch {
        events,
        ..ReplicaBatch::heartbeat(sender)
    };
    let free = |origin: ReplicaId, id: u128, worker: WorkerId| {
        ActiveSequenceEvent::from_sequence_event(
            origin,
            worker,
            &switchyard_core::sequences::SequenceEvent::Free(RequestId(id)),
            None,
        )
    };
    // Another replica's origin: a free of a's booking in a's name, sent by
    // the forger; and a whole batch claiming to be b itself.
    send(batch(forger, vec![free(honest, 1, WORKERS[0])])).await;
    send(batch(
        ReplicaId(2),
        vec![ActiveSequenceEvent::add(
            ReplicaId(2),
            &booking(5, WORKERS[0], 1, 16),
            None,
        )],
    ))
    .await;
    // Unknown workers, huge token counts, maximal everything.
    let mut huge = booking(2, WORKERS[1], 4, u32::MAX);
    huge.overlap_blocks = u32::MAX;
    huge.expected_prefill_ms = Some(f64::MAX);
    send(batch(
        forger,
        vec![
            ActiveSequenceEvent::add(forger, &booking(3, WorkerId::new(999), 1, 16), None),
            ActiveSequenceEvent::add(forger, &huge, None),
        ],
    ))
    .await;
    // Garbage.
    raw.publish(
        &config.subject(),
        Bytes::from_static(b"\xc1\xff not a batch"),
    )
    .await
    .unwrap();
    raw.flush().await.unwrap();
    wait_for("b counted every forgery", Duration::from_secs(30), || {
        let m = &b.plane.metrics;
        m.dropped_for("origin_mismatch") == 1
            && m.dropped_for("unknown_worker") == 1
            && m.clamped.get() == 1
            && m.snapshot().batches_malformed == 1
    })
    .await;
    let d = b.dispatcher.lock().unwrap();
    let router = d.router();
    // a's booking is still there; the forger's clamped one is its own.
    assert!(router.remote().key_of(honest, RequestId(1)).is_some());
    assert!(router.remote().key_of(ReplicaId(2), RequestId(5)).is_none());
    let key = router.remote().key_of(forger, RequestId(2)).unwrap();
    assert_ne!(key.0 & REMOTE_KEY_BIT, 0);
    let load = router.sequences().registry().load(WORKERS[1]).unwrap();
    assert!(load.active_prefill_tokens(0.0) <= u64::from(MAX_REMOTE_PROMPT_TOKENS));
    assert_eq!(router.remote().remote_requests(), 2);
    drop(d);
    assert_eq!(b.plane.metrics.snapshot().batches_own, 1);
}

/// A CA and a server certificate for 127.0.0.1 made with the `openssl`
/// command in `dir`; `None` (the test skips, saying why) without it.
fn test_certificates(dir: &std::path::Path) -> Option<()> {
    let openssl = |args: &[&str]| {
        std::process::Command::new("openssl")
            .args(args)
            .current_dir(dir)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    };
    std::fs::write(
        dir.join("ext.cnf"),
        "subjectAltName=IP:127.0.0.1\nbasicConstraints=CA:FALSE\nextendedKeyUsage=serverAuth\n",
    )
    .unwrap();
    let ec = [
        "-newkey",
        "ec",
        "-pkeyopt",
        "ec_paramgen_curve:P-256",
        "-nodes",
    ];
    let made = openssl(
        &[
            &["req", "-x509"][..],
            &ec,
            &[
                "-keyout",
                "ca-key.pem",
                "-out",
                "ca.pem",
                "-days",
                "2",
                "-subj",
                "/CN=switchyard test CA",
            ],
        ]
        .concat(),
    ) && openssl(
        &[
            &["req"][..],
            &ec,
            &[
                "-keyout",
                "server-key.pem",
                "-out",
                "server.csr",
                "-subj",
                "/CN=127.0.0.1",
            ],
        ]
        .concat(),
    ) && openssl(&[
        "x509",
        "-req",
        "-in",
        "server.csr",
        "-CA",
        "ca.pem",
        "-CAkey",
        "ca-key.pem",
        "-CAcreateserial",
        "-out",
        "server.pem",
        "-days",
        "2",
        "-extfile",
        "ext.cnf",
    ]);
    made.then_some(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn over_tls_a_replica_that_trusts_the_servers_ca_syncs_and_one_that_does_not_cannot_connect()
{
    let dir = std::env::temp_dir().join(format!("sy-nats-tls-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    if test_certificates(&dir).is_none() {
        eprintln!("skipping: the openssl command could not make test certificates");
        return;
    }
    let server = nats_with(&format!(
        "tls {{ cert_file: \"{}\", key_file: \"{}\" }}\nauthorization {{ token: tls-token }}",
        dir.join("server.pem").display(),
        dir.join("server-key.pem").display()
    ));
    let tls_url = server.url().replace("nats://", "tls://");
    let mut config = config(&server);
    config.nats_url = Some(tls_url.clone());
    config.auth = NatsAuth {
        token: Some(Secret("tls-token".into())),
        tls_ca_file: Some(dir.join("ca.pem")),
        ..NatsAuth::default()
    };
    config.validate().unwrap();
    let a = Replica::start(&config, ReplicaId(1)).await;
    let b = Replica::start(&config, ReplicaId(2)).await;
    a.plane
        .publisher
        .added(&booking(1, WORKERS[0], 2, 32), None)
        .unwrap();
    wait_for("a pair syncs over TLS", Duration::from_secs(30), || {
        b.holds(ReplicaId(1), 1)
    })
    .await;
    // Without the CA the server's certificate is not trusted; without TLS
    // at all the server refuses.
    let untrusting = NatsAuth {
        token: Some(Secret("tls-token".into())),
        ..NatsAuth::default()
    };
    let err = NatsTransport::connect_with(&tls_url, &untrusting)
        .await
        .unwrap_err()
        .to_string();
    assert!(
        err.to_lowercase().contains("certificate") || err.contains("tls"),
        "{err}"
    );
    assert!(NatsTransport::connect_with(&server.url(), &untrusting)
        .await
        .is_err());
    let missing_ca = NatsAuth {
        tls_ca_file: Some(dir.join("absent.pem")),
        ..untrusting
    };
    let err = NatsTransport::connect_with(&tls_url, &missing_ca)
        .await
        .unwrap_err()
        .to_string();
    assert!(err.contains("absent.pem"), "{err}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The key the signing tests' replicas share.
const KEY: &str = "a key the replicas share, 32 bytes or more";

/// Publishes `batches` on `config`'s subject from a client that is not a
/// replica (it holds no signing key), then flushes.
async fn forge(server: &LocalNatsServer, config: &ReplicaConfig, batches: Vec<Bytes>) {
    let raw = NatsTransport::connect(&server.url()).await.unwrap();
    for payload in batches {
        raw.publish(&config.subject(), payload).await.unwrap();
    }
    raw.flush().await.unwrap();
}

/// Heartbeats of `n` made-up origins, then a free of `victim`'s booking 1
/// in its own name: what a client of the NATS server that is no replica
/// sends to push a real peer out of the origin table and free its load.
fn forged_origins(n: u64, victim: ReplicaId) -> Vec<Bytes> {
    let mut out: Vec<Bytes> = (0..n)
        .map(|i| {
            Bytes::from(encode_batch(&ReplicaBatch::heartbeat(ReplicaId(
                10_000 + i,
            ))))
        })
        .collect();
    out.push(Bytes::from(encode_batch(&ReplicaBatch {
        events: vec![ActiveSequenceEvent::from_sequence_event(
            victim,
            WORKERS[0],
            &switchyard_core::sequences::SequenceEvent::Free(RequestId(1)),
            None,
        )],
        ..ReplicaBatch::heartbeat(victim)
    })));
    out
}

/// A core that tracks `max_replicas` origins.
fn core_with_origins(max_replicas: usize) -> DispatcherConfig {
    let mut core = DispatcherConfig::default();
    core.router.remote.max_replicas = max_replicas;
    core
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_signing_key_forged_origins_evict_a_real_peer() {
    // The attack the key stops, shown on a plane without one: a flood of
    // made-up origins evicts the real peer at the origin cap (and a free in
    // its name would free its booking outright).
    let server = nats();
    let config = ReplicaConfig {
        digest_ms: 3_600_000.0,
        ..config(&server)
    };
    let honest = ReplicaId(1);
    let a = Replica::start(&config, honest).await;
    let b = Replica::start_with(&config, ReplicaId(2), core_with_origins(8)).await;
    a.plane
        .publisher
        .added(&booking(1, WORKERS[0], 2, 32), None)
        .unwrap();
    wait_for("b holds a's booking", Duration::from_secs(30), || {
        b.holds(honest, 1)
    })
    .await;
    forge(&server, &config, forged_origins(64, ReplicaId(99))).await;
    wait_for("a is evicted on b", Duration::from_secs(30), || {
        !b.holds(honest, 1)
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_a_signing_key_forged_origins_cannot_evict_or_free_a_real_peer() {
    let server = nats();
    let config = ReplicaConfig {
        digest_ms: 3_600_000.0,
        signing_key: Some(Secret(KEY.into())),
        ..config(&server)
    };
    assert!(config.security_warnings().is_empty());
    let honest = ReplicaId(1);
    let a = Replica::start(&config, honest).await;
    let b = Replica::start_with(&config, ReplicaId(2), core_with_origins(8)).await;
    a.plane
        .publisher
        .added(&booking(1, WORKERS[0], 2, 32), None)
        .unwrap();
    wait_for(
        "b holds a's signed booking",
        Duration::from_secs(30),
        || b.holds(honest, 1),
    )
    .await;
    // Unsigned forgeries, then forgeries signed with another key.
    let mut forged = forged_origins(64, honest);
    let wrong =
        switchyard_replica::BatchSigner::with_key(b"not the plane's key, but long enough").unwrap();
    let resigned: Vec<Bytes> = forged_origins(64, honest)
        .into_iter()
        .map(|batch| wrong.seal(&config.subject(), batch).unwrap())
        .collect();
    forged.extend(resigned);
    forge(&server, &config, forged).await;
    wait_for(
        "b refused and counted every forgery",
        Duration::from_secs(30),
        || {
            let m = b.plane.metrics.snapshot();
            m.batches_unsigned == 65 && m.batches_bad_signature == 65
        },
    )
    .await;
    // a's heartbeats still arrive, its booking stands, and no made-up
    // origin was ever tracked.
    let d = b.dispatcher.lock().unwrap();
    assert!(d.router().remote().key_of(honest, RequestId(1)).is_some());
    assert_eq!(d.router().remote().replicas(), 1);
    assert_eq!(d.router().remote().counters().evicted_replicas, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn byte_heavy_batches_and_bookings_are_refused_and_counted() {
    let server = nats();
    let config = ReplicaConfig {
        digest_ms: 3_600_000.0,
        max_batch_bytes: 64 << 10,
        ..config(&server)
    };
    // b holds at most three 1,000-block bookings of any one peer.
    let mut core = DispatcherConfig::default();
    core.router.remote.max_bytes_per_replica = 3 * booking_bytes(1_000);
    let honest = ReplicaId(1);
    let a = Replica::start(&config, honest).await;
    let b = Replica::start_with(&config, ReplicaId(2), core).await;
    let heavy = ReplicaId(66);
    let add = |id: u128, blocks: u64| {
        Bytes::from(encode_batch(&ReplicaBatch {
            events: vec![ActiveSequenceEvent::add(
                heavy,
                &booking(id, WORKERS[1], blocks, 16_000),
                None,
            )],
            ..ReplicaBatch::heartbeat(heavy)
        }))
    };
    // One message over the 64 KiB limit (10,000 blocks, about 90 KB), then
    // ten 1,000-block bookings (about 9 KB each) of which three fit.
    let mut batches = vec![add(100, 10_000)];
    assert!(batches[0].len() > 64 << 10);
    batches.extend((1..=10).map(|id| add(id, 1_000)));
    forge(&server, &config, batches).await;
    wait_for(
        "b refused and counted the heavy peer's excess",
        Duration::from_secs(30),
        || {
            b.plane.metrics.snapshot().batches_oversized == 1
                && b.plane.metrics.dropped_for("bytes_full") == 7
        },
    )
    .await;
    // The heavy peer's share is its own: an honest peer still books.
    a.plane
        .publisher
        .added(&booking(1, WORKERS[0], 1_000, 16_000), None)
        .unwrap();
    wait_for(
        "b holds the honest booking",
        Duration::from_secs(30),
        || b.holds(honest, 1),
    )
    .await;
    let d = b.dispatcher.lock().unwrap();
    assert!(d.router().remote().key_of(heavy, RequestId(100)).is_none());
    assert_eq!(d.router().remote().remote_requests(), 4);
    assert!(d.router().remote().held_bytes() <= 4 * booking_bytes(1_000));
}
