//! Identity tables of the write model.

use crate::maps::{map_bytes, FxHashMap};
use crate::types::{RequestId, WorkerId};

/// Maps worker identity to a dense slot, reusing the lowest free slot so that
/// per-slot arrays stay short.
#[derive(Debug, Default)]
pub struct WorkerTable {
    slots: FxHashMap<WorkerId, u32>,
    ids: Vec<Option<WorkerId>>,
}

impl WorkerTable {
    /// The slot of `worker`, inserting it if new.
    pub fn insert(&mut self, worker: WorkerId) -> u32 {
        if let Some(&slot) = self.slots.get(&worker) {
            return slot;
        }
        let slot = match self.ids.iter().position(Option::is_none) {
            Some(i) => i,
            None => {
                self.ids.push(None);
                self.ids.len() - 1
            }
        };
        self.ids[slot] = Some(worker);
        let slot = slot as u32;
        self.slots.insert(worker, slot);
        slot
    }

    /// Removes `worker`; returns the slot it had.
    pub fn remove(&mut self, worker: WorkerId) -> Option<u32> {
        let slot = self.slots.remove(&worker)?;
        self.ids[slot as usize] = None;
        Some(slot)
    }

    /// The slot of `worker`.
    pub fn slot(&self, worker: WorkerId) -> Option<u32> {
        self.slots.get(&worker).copied()
    }

    /// The worker in `slot`.
    pub fn id(&self, slot: u32) -> Option<WorkerId> {
        self.ids.get(slot as usize).copied().flatten()
    }

    /// Workers, in slot order.
    pub fn iter(&self) -> impl Iterator<Item = WorkerId> + '_ {
        self.ids.iter().flatten().copied()
    }

    /// Number of workers.
    pub fn len(&self) -> usize {
        self.slots.len()
    }

    /// Whether the table is empty.
    pub fn is_empty(&self) -> bool {
        self.slots.is_empty()
    }

    /// Heap bytes of the slot map and the slot array.
    pub fn estimated_bytes(&self) -> usize {
        map_bytes(&self.slots) + self.ids.capacity() * std::mem::size_of::<Option<WorkerId>>()
    }
}

/// Maps each active request to the slot of the worker that owns it.
#[derive(Debug, Default)]
pub struct RequestIndex {
    owners: FxHashMap<RequestId, u32>,
}

impl RequestIndex {
    /// Records the owner of a new request.
    pub fn insert(&mut self, id: RequestId, slot: u32) {
        self.owners.insert(id, slot);
    }

    /// Forgets a request; returns its owner.
    pub fn remove(&mut self, id: RequestId) -> Option<u32> {
        let slot = self.owners.remove(&id);
        if self.owners.is_empty() {
            self.owners.shrink_to(1024);
        }
        slot
    }

    /// The owner of a request.
    pub fn owner(&self, id: RequestId) -> Option<u32> {
        self.owners.get(&id).copied()
    }

    /// Active requests.
    pub fn len(&self) -> usize {
        self.owners.len()
    }

    /// Whether no request is active.
    pub fn is_empty(&self) -> bool {
        self.owners.is_empty()
    }

    /// Heap bytes of the owner map.
    pub fn estimated_bytes(&self) -> usize {
        map_bytes(&self.owners)
    }
}
