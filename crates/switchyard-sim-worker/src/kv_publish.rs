//! The sim-worker's KV events on the wire: the engine's typed events mapped
//! onto vLLM's shapes, published by the event plane's ZMQ publisher (PUB
//! with sequence numbers, ROUTER replay of a bounded ring).
//!
//! The publisher does blocking socket calls, so it runs on a thread of its
//! own fed by the driver through a bounded channel.

use super::metrics::Metrics;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};
use switchyard_engine::{KvEvent, Medium};
use switchyard_kv_events::publisher::KvEventPublisher;
use switchyard_wire::kv_events::{self as wire, BlockRemoved, BlockStored, KvEventBatch};
use tokio::sync::mpsc;

/// vLLM's medium name for an engine medium.
fn medium(m: Medium) -> Option<String> {
    Some(m.vllm_name().to_owned())
}

/// Maps engine events onto the wire's vLLM shapes (fields the engine does
/// not have stay absent).
pub fn to_wire(events: Vec<KvEvent>) -> Vec<wire::KvEvent> {
    events
        .into_iter()
        .map(|event| match event {
            KvEvent::BlockStored {
                block_hashes,
                parent_block_hash,
                token_ids,
                block_size,
                medium: m,
            } => wire::KvEvent::BlockStored(Box::new(BlockStored {
                block_hashes,
                parent_block_hash,
                token_ids,
                block_size,
                medium: medium(m),
                ..BlockStored::default()
            })),
            KvEvent::BlockRemoved {
                block_hashes,
                medium: m,
            } => wire::KvEvent::BlockRemoved(BlockRemoved {
                block_hashes,
                medium: medium(m),
                ..BlockRemoved::default()
            }),
            KvEvent::AllBlocksCleared => wire::KvEvent::AllBlocksCleared,
        })
        .collect()
}

/// Starts the publishing thread; it ends when the driver drops its sender.
pub fn spawn(
    publisher: KvEventPublisher,
    mut batches: mpsc::Receiver<Vec<KvEvent>>,
    metrics: Arc<Metrics>,
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
                    data_parallel_rank: Some(0),
                };
                match publisher.publish(&batch) {
                    Ok(_) => {
                        metrics.kv_batches_published.fetch_add(1, Ordering::Relaxed);
                    }
                    Err(_) => {
                        metrics.kv_events_dropped.fetch_add(n, Ordering::Relaxed);
                    }
                }
            }
        })
}

#[cfg(test)]
mod tests {
    use super::*;
    use switchyard_core::EngineHash;

    #[test]
    fn engine_events_map_onto_vllm_shapes_with_gpu_and_cpu_media() {
        let wire = to_wire(vec![
            KvEvent::BlockStored {
                block_hashes: vec![EngineHash(1), EngineHash(2)],
                parent_block_hash: Some(EngineHash(9)),
                token_ids: (0..32).collect(),
                block_size: 16,
                medium: Medium::Device,
            },
            KvEvent::BlockRemoved {
                block_hashes: vec![EngineHash(1)],
                medium: Medium::Host,
            },
            KvEvent::AllBlocksCleared,
        ]);
        let wire::KvEvent::BlockStored(stored) = &wire[0] else {
            panic!("not stored")
        };
        assert_eq!(stored.block_hashes, vec![EngineHash(1), EngineHash(2)]);
        assert_eq!(stored.parent_block_hash, Some(EngineHash(9)));
        assert_eq!(stored.token_ids.len(), 32);
        assert_eq!(stored.medium.as_deref(), Some("GPU"));
        let wire::KvEvent::BlockRemoved(removed) = &wire[1] else {
            panic!("not removed")
        };
        assert_eq!(removed.medium.as_deref(), Some("CPU"));
        assert_eq!(wire[2], wire::KvEvent::AllBlocksCleared);
    }
}
