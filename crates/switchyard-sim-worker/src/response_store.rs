//! The responses a sim-worker stores for `previous_response_id` and
//! `GET /v1/responses/{id}` ([`crate::agentic`]), bounded: the oldest is
//! forgotten first.

use serde_json::Value;
use std::collections::{HashMap, VecDeque};
use std::sync::Mutex;
use switchyard_tokenizer::ChatMessage;

/// Most responses a worker keeps for `previous_response_id` and `GET`.
pub const MAX_STORED: usize = 4096;

/// One stored response: the conversation it ends (its answer included)
/// and the response object `GET` returns.
pub(crate) struct Stored {
    pub(crate) conversation: Vec<ChatMessage>,
    pub(crate) object: Value,
}

/// The responses a worker stores, bounded: the oldest goes first.
#[derive(Default)]
pub struct ResponseStore {
    inner: Mutex<StoreInner>,
}

#[derive(Default)]
struct StoreInner {
    by_id: HashMap<String, Stored>,
    order: VecDeque<String>,
    /// Responses forgotten to make room.
    evicted: u64,
}

impl ResponseStore {
    fn lock(&self) -> std::sync::MutexGuard<'_, StoreInner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub(crate) fn put(&self, id: String, stored: Stored) {
        let mut inner = self.lock();
        while inner.order.len() >= MAX_STORED {
            if let Some(old) = inner.order.pop_front() {
                inner.by_id.remove(&old);
                inner.evicted += 1;
            }
        }
        inner.order.push_back(id.clone());
        inner.by_id.insert(id, stored);
    }

    pub(crate) fn conversation(&self, id: &str) -> Option<Vec<ChatMessage>> {
        self.lock().by_id.get(id).map(|s| s.conversation.clone())
    }

    pub(crate) fn object(&self, id: &str) -> Option<Value> {
        self.lock().by_id.get(id).map(|s| s.object.clone())
    }

    /// How many responses are stored.
    pub fn len(&self) -> usize {
        self.lock().by_id.len()
    }

    /// Whether none is.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Responses forgotten to make room.
    pub fn evicted(&self) -> u64 {
        self.lock().evicted
    }
}
