//! Worker-origin marks: a worker (the simulated engine, or a sidecar next
//! to a real one) publishes `MarkPrefillCompleted` for its requests straight
//! onto the replica plane, so every replica learns that a prefill finished
//! even when the booking replica is slow to stream the first token.
//!
//! The marks carry the worker's own origin id; replicas accept marks from
//! any origin (see `switchyard_core::replica`), and applying one twice is
//! harmless, so the booking replica's own mark may follow.
//!
//! A router with replica sync on sends every upstream request with
//! [`REQUEST_ID_HEADER`] (its request id, 32 hex digits) and
//! [`ROUTER_ID_HEADER`] (its replica id); a worker marks only requests
//! that carry both ([`routed_request_id`]).

use super::config::ReplicaConfig;
use super::metrics::ReplicaMetrics;
use super::publisher::{spawn_publisher, PublishError, ReplicaPublisher};
use super::random_replica_id;
use super::transport::Transport;
use std::sync::Arc;
use switchyard_core::sequences::SequenceEvent;
use switchyard_core::{ReplicaId, RequestId, WorkerId};
use switchyard_wire::replica::ActiveSequenceEvent;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

/// The router's request id, on upstream requests.
pub const REQUEST_ID_HEADER: &str = "x-request-id";

/// The booking replica's id, on upstream requests while replica sync is on.
pub const ROUTER_ID_HEADER: &str = "x-switchyard-router-id";

/// The booking replica and the request id a replica-syncing router gave a
/// request, from the values of [`ROUTER_ID_HEADER`] (16 hex digits) and
/// [`REQUEST_ID_HEADER`] (32 hex digits); `None` unless both are present
/// and well formed.
pub fn routed_request_id(
    router_id: Option<&str>,
    request_id: Option<&str>,
) -> Option<(ReplicaId, RequestId)> {
    let router = parse_hex(router_id?, 16)?;
    let id = parse_hex(request_id?, 32)?;
    Some((ReplicaId(u64::try_from(router).ok()?), RequestId(id)))
}

fn parse_hex(text: &str, digits: usize) -> Option<u128> {
    if text.len() != digits || !text.bytes().all(|b| b.is_ascii_hexdigit()) {
        return None;
    }
    u128::from_str_radix(text, 16).ok()
}

/// A worker's non-blocking mark publisher (same queue rules as a replica's).
#[derive(Debug)]
pub struct WorkerMarks {
    worker: WorkerId,
    publisher: ReplicaPublisher,
    cancel: CancellationToken,
    task: Option<JoinHandle<()>>,
}

impl WorkerMarks {
    /// Starts publishing marks of `worker` on the plane `config` names.
    pub fn start<T: Transport>(transport: T, config: &ReplicaConfig, worker: WorkerId) -> Self {
        let cancel = CancellationToken::new();
        let (publisher, task) = spawn_publisher(
            transport,
            config.subject(),
            random_replica_id(),
            config,
            Arc::new(ReplicaMetrics::default()),
            cancel.clone(),
        );
        Self {
            worker,
            publisher,
            cancel,
            task: Some(task),
        }
    }

    /// The first token of `router`'s request was produced. The mark names
    /// the booking replica as the booking's origin (replicas key remote
    /// bookings by origin and request id); the message is this worker's.
    /// Never blocks.
    pub fn prefill_completed(
        &self,
        router: ReplicaId,
        request: RequestId,
    ) -> Result<(), PublishError> {
        self.publisher
            .publish(ActiveSequenceEvent::from_sequence_event(
                router,
                self.worker,
                &SequenceEvent::MarkPrefillCompleted(request),
                None,
            ))
    }

    /// Stops the publisher (pending marks may be dropped) and waits for it.
    pub async fn shutdown(mut self) {
        self.cancel.cancel();
        if let Some(task) = self.task.take() {
            let _ = task.await;
        }
    }
}

impl Drop for WorkerMarks {
    fn drop(&mut self) {
        self.cancel.cancel();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_requests_with_both_identity_headers_are_marked() {
        let id = RequestId((0xabc << 64) | 7);
        let text = id.to_string();
        let router = ReplicaId(0xff).to_string();
        assert_eq!(
            routed_request_id(Some(&router), Some(&text)),
            Some((ReplicaId(0xff), id))
        );
        assert_eq!(routed_request_id(None, Some(&text)), None);
        assert_eq!(routed_request_id(Some(&router), None), None);
        assert_eq!(routed_request_id(Some("00ff"), Some(&text)), None);
        assert_eq!(routed_request_id(Some(&router), Some("req-1")), None);
        let signed = format!("+{}", &text[1..]);
        assert_eq!(routed_request_id(Some(&router), Some(&signed)), None);
    }
}
