//! The sim-worker's KV events on the wire: the engine's typed events mapped
//! onto vLLM's shapes (`switchyard_sim::engine_events::to_wire`, the mapping
//! the fleet simulator also applies), published by the event plane's ZMQ
//! publisher (PUB with sequence numbers, ROUTER replay of a bounded ring).
//!
//! Each data-parallel rank has its own publisher; its batches name the
//! rank (`data_parallel_rank`, 0 for a worker of one rank).
//!
//! The publisher does blocking socket calls, so it runs on a thread of its
//! own fed by the driver through a bounded channel.

use super::metrics::Metrics;
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};
use switchyard_engine::KvEvent;
use switchyard_kv_events::publisher::KvEventPublisher;
use switchyard_sim::engine_events::to_wire;
use switchyard_wire::kv_events::KvEventBatch;
use tokio::sync::mpsc;

/// Starts the publishing thread; it ends when the driver drops its sender.
pub fn spawn(
    publisher: KvEventPublisher,
    mut batches: mpsc::Receiver<Vec<KvEvent>>,
    metrics: Arc<Metrics>,
    rank: u32,
) -> std::io::Result<std::thread::JoinHandle<()>> {
    std::thread::Builder::new()
        .name("kv-publish".into())
        .spawn(move || {
            while let Some(events) = batches.blocking_recv() {
                let n = events.len() as u64;
                let batch = KvEventBatch {
                    ts: SystemTime::now()
                        .duration_since(UNIX_EPOCH)
                        .map_or(0.0, |d| d.as_secs_f64()),
                    events: to_wire(events),
                    data_parallel_rank: Some(i64::from(rank)),
                };
                match publisher.publish(&batch) {
                    Ok(_) => {
                        metrics.kv_batches_published.inc();
                    }
                    Err(_) => {
                        metrics.kv_events_dropped.inc_by(n);
                    }
                }
            }
        })
}
