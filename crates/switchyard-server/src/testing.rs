//! Helpers the server's unit tests share (compiled for tests only).

use crate::config::WorkerSpec;
use crate::driver::booking::{Booking, WaitHandle};
use crate::driver::{Driver, Request};
use crate::fleet::Fleet;
use crate::metrics::ServerMetrics;
use crate::upstream::client as upstream_client;
use crate::{build_driver, ServerConfig};
use std::sync::Arc;
use std::time::Duration;
use switchyard_core::sequences::AddRequest;
use switchyard_core::{LocalHash, ReplicaId, RequestId, WorkerId};
use switchyard_wire::replica::{ActiveSequenceEvent, ReplicaBatch};

/// The routing state of a router configured by `config`, with workers
/// `names` in selection (nothing listens at their URLs).
pub(crate) fn shared_with(config: &ServerConfig, names: &[&str]) -> (Arc<Driver>, Vec<WorkerId>) {
    let driver =
        Arc::new(build_driver(config, Arc::new(ServerMetrics::new(config.policy.name()))).unwrap());
    let ids = names
        .iter()
        .map(|name| {
            let id = driver
                .add_worker(name, &format!("http://{name}.invalid:1"))
                .unwrap();
            driver.set_in_router(id, true);
            id
        })
        .collect();
    (driver, ids)
}

/// A fleet over a default router with workers `names` in selection
/// (nothing listens at their URLs; health checks give up after 100 ms).
pub(crate) fn fleet_with(names: &[&str]) -> (Fleet, Arc<Driver>, Vec<WorkerId>) {
    let (driver, ids) = shared_with(&ServerConfig::default(), names);
    (fleet_over(&driver, false), driver, ids)
}

/// A fleet driving `driver` with the default block size, following KV
/// events when `uses_events`; health checks give up after 100 ms and
/// declare a worker dead after 3 failures.
pub(crate) fn fleet_over(driver: &Arc<Driver>, uses_events: bool) -> Fleet {
    Fleet::new(
        driver.clone(),
        upstream_client(Duration::from_millis(100)),
        uses_events,
        ServerConfig::default().block_size,
        3,
        Duration::from_millis(100),
    )
}

/// A worker named `name` at `http://127.0.0.1:PORT`, without KV events.
pub(crate) fn loopback_spec(name: &str, port: u16) -> WorkerSpec {
    WorkerSpec {
        url: format!("http://127.0.0.1:{port}"),
        name: Some(name.to_owned()),
        events: None,
        replay: None,
        block_size: None,
        role: Default::default(),
        bootstrap_port: None,
        dp_size: None,
    }
}

/// A request of `tokens` prompt tokens hashed into `blocks`.
pub(crate) fn request(blocks: &[u64], tokens: u32) -> Request<'static> {
    Request {
        blocks: blocks.iter().copied().map(LocalHash).collect(),
        prompt_tokens: tokens,
        session: None,
        model: None,
        adapter: None,
        settings: Default::default(),
        flow: Default::default(),
        pinned: None,
    }
}

/// Submits `request` under a fresh id and waits for its placement.
pub(crate) async fn place(driver: &Arc<Driver>, request: Request<'_>) -> Option<Booking> {
    let id = driver.next_request_id();
    WaitHandle::submit(driver, id, request)
        .ok()?
        .placed()
        .await
        .ok()
}

/// A peer replica's booking of request `id` on `worker`, applied the way
/// replica sync applies it (a wire batch).
pub(crate) fn book_remotely(driver: &Driver, id: u128, worker: WorkerId) {
    let add = AddRequest {
        request: RequestId(id),
        worker,
        prompt_tokens: 4,
        blocks: Vec::new(),
        overlap_blocks: 0,
        expected_prefill_ms: None,
    };
    let peer = ReplicaId(7);
    let batch = ReplicaBatch {
        router_id: peer,
        events: vec![ActiveSequenceEvent::add(peer, &add, None)],
        sessions: Vec::new(),
        digest: None,
        responses: Vec::new(),
    };
    assert_eq!(driver.apply_replica_batch(&batch).applied, 1);
}
