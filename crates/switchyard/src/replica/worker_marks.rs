//! Worker-origin marks: a worker (the simulated engine, or a sidecar next
//! to a real one) publishes `MarkPrefillCompleted` for its requests straight
//! onto the replica plane, so every replica learns that a prefill finished
//! even when the booking replica is slow to stream the first token.
//!
//! The marks carry the worker's own origin id; replicas accept marks from
//! any origin (see `switchyard_core::replica`), and applying one twice is
//! harmless, so the booking replica's own mark may follow.

use super::config::ReplicaConfig;
use super::metrics::ReplicaMetrics;
use super::publisher::{spawn_publisher, PublishError, ReplicaPublisher};
use super::random_replica_id;
use super::transport::Transport;
use std::sync::Arc;
use switchyard_core::{RequestId, WorkerId};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

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

    /// The request's first token was produced. Never blocks.
    pub fn prefill_completed(&self, request: RequestId) -> Result<(), PublishError> {
        self.publisher.prefill_completed(request, self.worker)
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
