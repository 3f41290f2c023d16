//! Replica sync in the router server (`--replica-sync nats://HOST:PORT`).
//!
//! - [`ReplicaArgs`] — the `serve` flags (and `SWITCHYARD_REPLICA_*`
//!   variables) that override the config file's `[replica]` table.
//! - The request path's side lives in [`crate::driver`]: the dispatcher
//!   returns this replica's lifecycle events and session bindings with each
//!   call, and they are enqueued on the plane's publisher with the router's
//!   lock held, so the queue sees one request's events in the order they
//!   happened. Enqueueing never awaits; a full queue drops and counts.
//! - [`ServerSink`] — the subscriber's side: peers' batches go into the
//!   same dispatcher ([`Driver::apply_replica_batch`]: remote
//!   bookings, session bindings into the admission strategy, then queued
//!   requests get another chance).
//!
//! Workers are named by id on the wire; the server derives every worker's
//! id from its name ([`switchyard_replica::worker_id_for_name`]), so replicas
//! configured with the same worker names agree on ids.

use crate::driver::Driver;
use clap::Args;
use std::sync::Arc;
use switchyard_core::RequestId;
use switchyard_replica::{
    random_replica_id, BatchReport, NatsAuthArgs, NatsTransport, ReplicaConfig, ReplicaPlane,
    ReplicaSink, Transport, TransportError,
};
use switchyard_wire::replica::ReplicaBatch;

/// `switchyard serve`'s replica-sync flags; each also reads its
/// `SWITCHYARD_*` variable, and each set one overrides the config file.
#[derive(Debug, Clone, Default, Args)]
pub struct ReplicaArgs {
    /// Share bookings with peer replicas over NATS at this URL; off when
    /// absent. (A NATS URL may carry `user:password@`: `--help` does not
    /// show the variable's value.)
    #[arg(
        long = "replica-sync",
        env = "SWITCHYARD_REPLICA_SYNC",
        hide_env_values = true,
        value_name = "nats://HOST:PORT"
    )]
    pub replica_sync: Option<String>,
    /// Replica-sync namespace (first subject level) [default: default].
    #[arg(long, env = "SWITCHYARD_REPLICA_NAMESPACE")]
    pub replica_namespace: Option<String>,
    /// Replica-sync endpoint: replicas of different endpoints never see each other [default: generate].
    #[arg(long, env = "SWITCHYARD_REPLICA_ENDPOINT")]
    pub replica_endpoint: Option<String>,
    /// Replica events queued for publishing before the newest is dropped [default: 100000].
    #[arg(long, env = "SWITCHYARD_REPLICA_QUEUE_CAPACITY")]
    pub replica_queue_capacity: Option<usize>,
    /// Most events in one published batch [default: 128].
    #[arg(long, env = "SWITCHYARD_REPLICA_BATCH_MAX_EVENTS")]
    pub replica_batch_max_events: Option<usize>,
    /// Longest wait for a batch to fill, in ms [default: 1].
    #[arg(long, env = "SWITCHYARD_REPLICA_BATCH_MAX_DELAY_MS")]
    pub replica_batch_max_delay_ms: Option<f64>,
    /// An idle replica publishes a heartbeat this often, in ms [default: 1000].
    #[arg(long, env = "SWITCHYARD_REPLICA_HEARTBEAT_MS")]
    pub replica_heartbeat_ms: Option<f64>,
    /// A peer silent this long has its bookings freed, in ms [default: 300000].
    #[arg(long, env = "SWITCHYARD_REPLICA_EXPIRY_MS")]
    pub replica_expiry_ms: Option<f64>,
    /// How often silent peers are looked for, in ms [default: 1000].
    #[arg(long, env = "SWITCHYARD_REPLICA_EXPIRY_CHECK_MS")]
    pub replica_expiry_check_ms: Option<f64>,
    /// How often this replica publishes a digest of its live bookings, so peers drop bookings whose free was lost, in ms [default: 2000].
    #[arg(long, env = "SWITCHYARD_REPLICA_DIGEST_MS")]
    pub replica_digest_ms: Option<f64>,
    /// Bytes of bookings held per peer replica; its further bookings are dropped [default: 134217728].
    #[arg(long, env = "SWITCHYARD_REPLICA_MAX_BYTES_PER_PEER")]
    pub replica_max_bytes_per_peer: Option<usize>,
    /// Bytes of bookings held across every peer replica [default: 536870912].
    #[arg(long, env = "SWITCHYARD_REPLICA_MAX_PEER_BYTES_TOTAL")]
    pub replica_max_peer_bytes_total: Option<usize>,
    /// Largest replica message published or accepted, signature aside [default: 1048576].
    #[arg(long, env = "SWITCHYARD_REPLICA_MAX_BATCH_BYTES")]
    pub replica_max_batch_bytes: Option<usize>,
    /// Key shared by the replicas to sign batches (HMAC-SHA256, at least 32 bytes; prefer --replica-signing-key-file).
    #[arg(long, env = "SWITCHYARD_REPLICA_SIGNING_KEY", hide_env_values = true)]
    pub replica_signing_key: Option<String>,
    /// File holding the replicas' signing key (trailing newline ignored).
    #[arg(long, env = "SWITCHYARD_REPLICA_SIGNING_KEY_FILE", value_name = "PATH")]
    pub replica_signing_key_file: Option<std::path::PathBuf>,
    /// NATS authentication and TLS (`--nats-*`).
    #[command(flatten)]
    pub nats: NatsAuthArgs,
}

impl ReplicaArgs {
    /// Overrides the settings given on the command line or in the
    /// environment (validation is the whole config's).
    pub fn apply(&self, config: &mut ReplicaConfig) {
        if let Some(url) = &self.replica_sync {
            config.nats_url = Some(url.clone());
        }
        if let Some(v) = &self.replica_namespace {
            config.namespace = v.clone();
        }
        if let Some(v) = &self.replica_endpoint {
            config.endpoint = v.clone();
        }
        if let Some(v) = self.replica_queue_capacity {
            config.queue_capacity = v;
        }
        if let Some(v) = self.replica_batch_max_events {
            config.batch_max_events = v;
        }
        if let Some(v) = self.replica_batch_max_delay_ms {
            config.batch_max_delay_ms = v;
        }
        if let Some(v) = self.replica_heartbeat_ms {
            config.heartbeat_ms = v;
        }
        if let Some(v) = self.replica_expiry_ms {
            config.silence_expiry_ms = v;
        }
        if let Some(v) = self.replica_expiry_check_ms {
            config.expiry_check_ms = v;
        }
        if let Some(v) = self.replica_digest_ms {
            config.digest_ms = v;
        }
        if let Some(v) = self.replica_max_bytes_per_peer {
            config.max_bytes_per_peer = v;
        }
        if let Some(v) = self.replica_max_peer_bytes_total {
            config.max_peer_bytes_total = v;
        }
        if let Some(v) = self.replica_max_batch_bytes {
            config.max_batch_bytes = v;
        }
        // Either form replaces the file's key of both forms.
        if let Some(v) = &self.replica_signing_key {
            config.signing_key = Some(switchyard_replica::Secret(v.clone()));
            config.signing_key_file = None;
        }
        if let Some(v) = &self.replica_signing_key_file {
            config.signing_key_file = Some(v.clone());
            config.signing_key = None;
        }
        self.nats.apply(&mut config.auth);
    }
}

/// Peers' events into the server's routing state.
#[derive(Debug)]
pub(crate) struct ServerSink {
    driver: Arc<Driver>,
}

impl ReplicaSink for ServerSink {
    fn apply_batch(&self, batch: &ReplicaBatch) -> BatchReport {
        self.driver.apply_replica_batch(batch)
    }

    fn expire_silent(&self) -> u64 {
        self.driver.expire_silent_replicas()
    }

    fn local_bookings(&self) -> Vec<RequestId> {
        self.driver.local_booking_ids()
    }
}

/// Connects to NATS, starts the plane of a fresh replica id over `shared`
/// and attaches its [`ReplicaLink`] to the core. Call before serving.
pub(crate) async fn start(
    config: &ReplicaConfig,
    driver: &Arc<Driver>,
) -> Result<ReplicaPlane, TransportError> {
    let url = config
        .nats_url
        .as_deref()
        .ok_or_else(|| TransportError::Connect("replica sync is off".into()))?;
    for warning in config.security_warnings() {
        tracing::warn!("{warning}");
    }
    let transport = Arc::new(NatsTransport::connect_with(url, &config.auth).await?);
    start_over(transport, config, driver).await
}

/// [`start`] over any transport (in-process replicas share an
/// [`switchyard_replica::InProcessBus`]).
pub(crate) async fn start_over<T: Transport>(
    transport: Arc<T>,
    config: &ReplicaConfig,
    driver: &Arc<Driver>,
) -> Result<ReplicaPlane, TransportError> {
    let id = random_replica_id();
    let sink = ServerSink {
        driver: driver.clone(),
    };
    let plane = ReplicaPlane::start(transport, config, id, sink).await?;
    driver.attach_replica(id, plane.publisher.clone());
    Ok(plane)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{AdmissionMode, ServerConfig};
    use crate::driver::booking::WaitHandle;
    use crate::driver::Request;
    use crate::testing::shared_with;
    use std::time::Duration;
    use switchyard_core::admission::SessionKey;
    use switchyard_core::LocalHash;
    use switchyard_replica::{InProcessBus, InProcessTransport, Secret};

    #[test]
    fn flags_override_only_what_they_set() {
        let mut config = ReplicaConfig {
            endpoint: "chat".into(),
            ..ReplicaConfig::default()
        };
        ReplicaArgs {
            replica_sync: Some("nats://127.0.0.1:4222".into()),
            replica_expiry_ms: Some(2_000.0),
            ..ReplicaArgs::default()
        }
        .apply(&mut config);
        assert!(config.enabled());
        assert_eq!(config.endpoint, "chat");
        assert_eq!(config.silence_expiry_ms, 2_000.0);
        assert_eq!(config.queue_capacity, 100_000);
    }

    #[test]
    fn auth_flags_fill_the_auth_table_and_a_secret_flag_replaces_the_files_other_form() {
        let mut config = ReplicaConfig::default();
        config.auth.user = Some("file-user".into());
        config.auth.password = Some(Secret("from-file".into()));
        ReplicaArgs {
            replica_sync: Some("tls://nats.internal:4222".into()),
            nats: NatsAuthArgs {
                nats_password_file: Some("/run/secrets/nats".into()),
                nats_tls_ca: Some("/etc/ca.pem".into()),
                ..NatsAuthArgs::default()
            },
            replica_digest_ms: Some(500.0),
            ..ReplicaArgs::default()
        }
        .apply(&mut config);
        assert_eq!(config.auth.user.as_deref(), Some("file-user"));
        assert_eq!(config.auth.password, None);
        assert_eq!(
            config.auth.password_file.as_deref(),
            Some(std::path::Path::new("/run/secrets/nats"))
        );
        assert_eq!(
            config.auth.tls_ca_file.as_deref(),
            Some(std::path::Path::new("/etc/ca.pem"))
        );
        assert_eq!(config.digest_ms, 500.0);
        assert_eq!(config.validate(), Ok(()));
    }

    /// A server's routing state with session-aware admission and two
    /// workers, on the plane of `bus`.
    async fn replica(bus: &Arc<InProcessBus>) -> (Arc<Driver>, ReplicaPlane) {
        let config = ServerConfig {
            admission: AdmissionMode::SessionAware,
            ..ServerConfig::default()
        };
        let (driver, _) = shared_with(&config, &["w0", "w1"]);
        let transport = Arc::new(InProcessTransport::new(bus.clone(), true, 1024));
        let plane = start_over(transport, &config.replica, &driver)
            .await
            .unwrap();
        (driver, plane)
    }

    /// What the router's `/metrics` would show of `shared`.
    fn rendered(driver: &Arc<Driver>) -> String {
        let mut registry = prometheus_client::registry::Registry::default();
        driver.register_metrics(&mut registry);
        let mut out = String::new();
        prometheus_client::encoding::prometheus_text::encode(&mut out, &registry).unwrap();
        out
    }

    async fn eventually(what: &str, check: impl Fn() -> bool) {
        for _ in 0..400 {
            if check() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        panic!("never: {what}");
    }

    #[tokio::test]
    async fn a_booking_its_session_binding_and_its_free_reach_the_peer() {
        let bus = InProcessBus::new();
        let (a, plane_a) = replica(&bus).await;
        let (b, plane_b) = replica(&bus).await;
        let wait = WaitHandle::submit(
            &a,
            a.next_request_id(),
            Request {
                blocks: vec![LocalHash(1), LocalHash(2)],
                prompt_tokens: 40,
                session: Some(SessionKey(5)),
                model: None,
                adapter: None,
                settings: Default::default(),
                flow: Default::default(),
                pinned: None,
            },
        )
        .unwrap();
        let mut booking = wait.placed().await.unwrap();
        let remote = format!(
            "switchyard_worker_active_requests_by_origin{{worker=\"{}\",origin=\"remote\"}} 1",
            booking.name
        );
        let local = remote.replace("remote", "local");
        assert!(rendered(&a).contains(&local), "{}", rendered(&a));
        eventually("the peer holds the booking as remote", || {
            rendered(&b).contains(&remote)
        })
        .await;
        eventually("the peer's strategy got the session binding", || {
            plane_b.metrics.snapshot().applied >= 1 && plane_b.metrics.sessions_applied.get() == 1
        })
        .await;
        booking.mark_first_token();
        drop(booking);
        eventually("the free reaches the peer", || {
            b.total_active_requests() == 0
        })
        .await;
        // add, mark, free from A; nothing from B.
        assert_eq!(plane_a.metrics.snapshot().published, 3);
        assert_eq!(plane_b.metrics.snapshot().published, 0);
        assert!(rendered(&b).contains("switchyard_replica_events_total{direction=\"applied\"} 3"));
        plane_a.shutdown().await;
        plane_b.shutdown().await;
    }

    #[tokio::test]
    async fn a_sessions_next_turn_on_another_replica_lands_on_its_worker() {
        let bus = InProcessBus::new();
        let (a, plane_a) = replica(&bus).await;
        let (b, plane_b) = replica(&bus).await;
        let submit = |r: &Arc<Driver>, session: u64, first_block: u64| {
            WaitHandle::submit(
                r,
                r.next_request_id(),
                Request {
                    blocks: (first_block..first_block + 4).map(LocalHash).collect(),
                    prompt_tokens: 64,
                    session: Some(SessionKey(session)),
                    model: None,
                    adapter: None,
                    settings: Default::default(),
                    flow: Default::default(),
                    pinned: None,
                },
            )
            .unwrap()
        };
        // Replica A serves the first turns of sessions 5 and 6, one on each
        // worker (the second goes to the idle one).
        let mut five = submit(&a, 5, 100).placed().await.unwrap();
        let mut six = submit(&a, 6, 200).placed().await.unwrap();
        let (x, y) = (five.worker, six.worker);
        assert_ne!(x, y, "A spread its two sessions");
        eventually("B holds both bindings", || {
            plane_b.metrics.sessions_applied.get() == 2
        })
        .await;
        five.mark_first_token();
        six.mark_first_token();
        drop((five, six));
        eventually("B sees both turns end", || b.total_active_requests() == 0).await;
        // Replica B gets the next turns, in the other order and with new
        // prompts (no cache overlap to explain a choice). B's policy, seeded
        // like A's on an idle fleet, would put the first on x and the
        // second on y; the bindings put each on its session's worker.
        let six_again = submit(&b, 6, 300).placed().await.unwrap();
        let five_again = submit(&b, 5, 400).placed().await.unwrap();
        assert_eq!(six_again.worker, y, "session 6 stays on its worker");
        assert_eq!(five_again.worker, x, "session 5 stays on its worker");
        drop((six_again, five_again));
        plane_a.shutdown().await;
        plane_b.shutdown().await;
    }

    #[tokio::test]
    async fn a_stored_response_answered_through_one_replica_is_found_by_its_peers() {
        use crate::response_map::{Holder, ResponseMap};
        use switchyard_core::WorkerId;
        let bus = InProcessBus::new();
        let (a, plane_a) = replica(&bus).await;
        let (b, plane_b) = replica(&bus).await;
        let (c, plane_c) = replica(&bus).await;
        let maps: Vec<Arc<ResponseMap>> = [&a, &b, &c]
            .iter()
            .map(|driver| {
                let map = Arc::new(ResponseMap::new(4, 4, std::time::Duration::from_secs(60)));
                driver.stored_responses.set(map.clone()).unwrap();
                map
            })
            .collect();
        let owner = Some(crate::response_map::Owner::of_key("tenant-a"));
        let holder = Holder {
            worker: WorkerId::new(11),
            session: Some(SessionKey(3)),
            owner,
        };
        maps[0].insert("resp_chain_1", holder, std::time::Instant::now());
        a.publish_stored_response("resp_chain_1", holder);
        eventually("both peers know the response's worker", || {
            let now = std::time::Instant::now();
            maps[1].get("resp_chain_1", owner, now) == Some(holder)
                && maps[2].get("resp_chain_1", owner, now) == Some(holder)
        })
        .await;
        // The owner crossed with it: no other caller finds it on a peer.
        let now = std::time::Instant::now();
        assert_eq!(maps[1].get("resp_chain_1", None, now), None);
        let other = Some(crate::response_map::Owner::of_key("tenant-b"));
        assert_eq!(maps[2].get("resp_chain_1", other, now), None);
        // A peer's entries are bounded like local ones.
        for i in 0..10 {
            b.publish_stored_response(&format!("resp_{i}"), holder);
        }
        eventually("the flood reached C", || {
            maps[2]
                .get("resp_9", owner, std::time::Instant::now())
                .is_some()
        })
        .await;
        assert_eq!(maps[2].len(), 4);
        let dropped = maps[2].drops(crate::response_map::Forgotten::Capacity)
            + maps[2].drops(crate::response_map::Forgotten::KeyCapacity);
        assert!(dropped >= 7, "{dropped}");
        plane_a.shutdown().await;
        plane_b.shutdown().await;
        plane_c.shutdown().await;
    }
}
