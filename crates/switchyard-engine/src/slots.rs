//! State slots: fixed per-sequence state (an SSM's recurrent state) held in
//! a table of `capacity` slots, one per running sequence.
//!
//! Every slot is in exactly one state: free, owned by one sequence, or
//! detached (a compaction moved its sequence to another slot and the old
//! one waits for the device to disown it). Ownership moves, never copies:
//!
//! - [`SlotTable::allocate`] hands a free slot to a sequence that holds none;
//! - [`SlotTable::compact`] moves a sequence to the lowest free slot below
//!   its own; its old slot becomes detached, owned by nobody;
//! - [`SlotTable::detach`] returns a detached slot to the free list;
//! - [`SlotTable::free`] returns the slot a sequence owns *now*.
//!
//! A sequence names its slot only through the table, so a slot can never be
//! freed twice: freeing a sequence that holds none, or detaching a slot that
//! is not detached, is refused with a [`SlotError`] and changes nothing.

use crate::blocks::SeqId;
use rustc_hash::FxHashMap;
use std::collections::BTreeSet;

/// One slot of the state table.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct SlotId(pub u32);

/// A slot operation the table refused (it changed nothing).
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum SlotError {
    /// Every slot is owned or detached.
    #[error("every state slot is in use")]
    Full,
    /// The sequence already owns a slot.
    #[error("sequence {0:?} already owns slot {1:?}")]
    AlreadyOwned(SeqId, SlotId),
    /// The sequence owns no slot (never allocated, or freed already).
    #[error("sequence {0:?} owns no state slot")]
    NotOwned(SeqId),
    /// The slot is not detached (free, owned, or out of range).
    #[error("slot {0:?} is not detached")]
    NotDetached(SlotId),
}

/// A compaction: the sequence's state moves `from` → `to`; `from` is
/// detached until [`SlotTable::detach`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SlotMove {
    /// The sequence moved.
    pub seq: SeqId,
    /// Its old slot, now detached.
    pub from: SlotId,
    /// Its new slot.
    pub to: SlotId,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum SlotState {
    Free,
    Owned(SeqId),
    Detached,
}

/// The slot table. Invariant: `owner` and `slots` agree (a sequence owns
/// the slot whose state names it, and nothing else), and `free` holds
/// exactly the free slots.
#[derive(Clone, Debug)]
pub struct SlotTable {
    slots: Vec<SlotState>,
    owner: FxHashMap<SeqId, SlotId>,
    free: BTreeSet<SlotId>,
}

impl SlotTable {
    /// A table of `capacity` free slots.
    pub fn new(capacity: u32) -> Self {
        Self {
            slots: vec![SlotState::Free; capacity as usize],
            owner: FxHashMap::default(),
            free: (0..capacity).map(SlotId).collect(),
        }
    }

    /// Slots in the table.
    pub fn capacity(&self) -> usize {
        self.slots.len()
    }

    /// Free slots.
    pub fn free_len(&self) -> usize {
        self.free.len()
    }

    /// Slots owned by a sequence.
    pub fn owned_len(&self) -> usize {
        self.owner.len()
    }

    /// Slots detached and not yet returned.
    pub fn detached_len(&self) -> usize {
        self.capacity() - self.free_len() - self.owned_len()
    }

    /// The slot `seq` owns now.
    pub fn slot_of(&self, seq: SeqId) -> Option<SlotId> {
        self.owner.get(&seq).copied()
    }

    /// Gives `seq` the lowest free slot.
    pub fn allocate(&mut self, seq: SeqId) -> Result<SlotId, SlotError> {
        if let Some(&slot) = self.owner.get(&seq) {
            return Err(SlotError::AlreadyOwned(seq, slot));
        }
        let slot = self.free.pop_first().ok_or(SlotError::Full)?;
        self.slots[slot.0 as usize] = SlotState::Owned(seq);
        self.owner.insert(seq, slot);
        Ok(slot)
    }

    /// Moves `seq` to the lowest free slot if that is below its own;
    /// `Ok(None)` when it is already as low as it can go.
    pub fn compact(&mut self, seq: SeqId) -> Result<Option<SlotMove>, SlotError> {
        let from = self.slot_of(seq).ok_or(SlotError::NotOwned(seq))?;
        let Some(&to) = self.free.first().filter(|&&to| to < from) else {
            return Ok(None);
        };
        self.free.remove(&to);
        self.slots[to.0 as usize] = SlotState::Owned(seq);
        self.slots[from.0 as usize] = SlotState::Detached;
        self.owner.insert(seq, to);
        Ok(Some(SlotMove { seq, from, to }))
    }

    /// Returns a detached slot to the free list.
    pub fn detach(&mut self, slot: SlotId) -> Result<(), SlotError> {
        match self.slots.get(slot.0 as usize) {
            Some(SlotState::Detached) => {
                self.slots[slot.0 as usize] = SlotState::Free;
                self.free.insert(slot);
                Ok(())
            }
            _ => Err(SlotError::NotDetached(slot)),
        }
    }

    /// Frees the slot `seq` owns now and returns it.
    pub fn free(&mut self, seq: SeqId) -> Result<SlotId, SlotError> {
        let slot = self.owner.remove(&seq).ok_or(SlotError::NotOwned(seq))?;
        self.slots[slot.0 as usize] = SlotState::Free;
        self.free.insert(slot);
        Ok(slot)
    }

    /// The owned slot with the highest index and its sequence, the first
    /// candidate for compaction.
    pub fn highest_owned(&self) -> Option<(SeqId, SlotId)> {
        self.slots
            .iter()
            .enumerate()
            .rev()
            .find_map(|(i, state)| match state {
                SlotState::Owned(seq) => Some((*seq, SlotId(i as u32))),
                _ => None,
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::{BTreeMap, HashSet};

    #[test]
    fn a_compacted_sequence_frees_only_its_new_slot() {
        let mut table = SlotTable::new(4);
        assert_eq!(table.allocate(SeqId(0)), Ok(SlotId(0)));
        assert_eq!(table.allocate(SeqId(1)), Ok(SlotId(1)));
        assert_eq!(table.free(SeqId(0)), Ok(SlotId(0)));
        let moved = table.compact(SeqId(1)).unwrap().unwrap();
        assert_eq!((moved.from, moved.to), (SlotId(1), SlotId(0)));
        assert_eq!(table.free(SeqId(1)), Ok(SlotId(0)));
        assert_eq!(table.free(SeqId(1)), Err(SlotError::NotOwned(SeqId(1))));
        assert_eq!(table.free_len(), 3, "slot 1 waits for its detach");
        assert_eq!(table.detach(SlotId(1)), Ok(()));
        assert_eq!(
            table.detach(SlotId(1)),
            Err(SlotError::NotDetached(SlotId(1)))
        );
        assert_eq!(table.free_len(), 4);
    }

    #[test]
    fn a_full_table_refuses_and_a_second_allocation_is_refused() {
        let mut table = SlotTable::new(1);
        table.allocate(SeqId(0)).unwrap();
        assert_eq!(
            table.allocate(SeqId(0)),
            Err(SlotError::AlreadyOwned(SeqId(0), SlotId(0)))
        );
        assert_eq!(table.allocate(SeqId(1)), Err(SlotError::Full));
        assert_eq!(table.compact(SeqId(0)), Ok(None));
    }

    #[derive(Clone, Debug)]
    enum Op {
        Allocate(u32),
        Compact(u32),
        Detach(u32),
        Free(u32),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            (0u32..8).prop_map(Op::Allocate),
            (0u32..8).prop_map(Op::Compact),
            (0u32..6).prop_map(Op::Detach),
            (0u32..8).prop_map(Op::Free),
        ]
    }

    proptest! {
        /// Against a naive model (who owns which slot; which slots are
        /// detached): every answer agrees, no slot is ever freed twice or
        /// held by two sequences, and none leaks — free, owned and detached
        /// always add up to the capacity.
        #[test]
        fn slots_are_never_freed_twice_and_never_leak(ops in proptest::collection::vec(op(), 1..80)) {
            let capacity = 5u32;
            let mut table = SlotTable::new(capacity);
            let mut owned: BTreeMap<u32, u32> = BTreeMap::new();
            let mut detached: HashSet<u32> = HashSet::new();
            let mut freed_since_use: HashSet<u32> = (0..capacity).collect();
            for op in ops {
                let free = |owned: &BTreeMap<u32, u32>, detached: &HashSet<u32>| {
                    (0..capacity).find(|s| !owned.values().any(|o| o == s) && !detached.contains(s))
                };
                match op {
                    Op::Allocate(seq) => {
                        let got = table.allocate(SeqId(seq));
                        match (owned.get(&seq), free(&owned, &detached)) {
                            (Some(&slot), _) => prop_assert_eq!(got, Err(SlotError::AlreadyOwned(SeqId(seq), SlotId(slot)))),
                            (None, None) => prop_assert_eq!(got, Err(SlotError::Full)),
                            (None, Some(slot)) => {
                                prop_assert_eq!(got, Ok(SlotId(slot)));
                                prop_assert!(freed_since_use.remove(&slot), "slot {} handed out while in use", slot);
                                owned.insert(seq, slot);
                            }
                        }
                    }
                    Op::Compact(seq) => {
                        let got = table.compact(SeqId(seq));
                        match owned.get(&seq).copied() {
                            None => prop_assert_eq!(got, Err(SlotError::NotOwned(SeqId(seq)))),
                            Some(from) => match free(&owned, &detached).filter(|&to| to < from) {
                                None => prop_assert_eq!(got, Ok(None)),
                                Some(to) => {
                                    prop_assert_eq!(got, Ok(Some(SlotMove { seq: SeqId(seq), from: SlotId(from), to: SlotId(to) })));
                                    prop_assert!(freed_since_use.remove(&to));
                                    owned.insert(seq, to);
                                    detached.insert(from);
                                }
                            },
                        }
                    }
                    Op::Detach(slot) => {
                        let got = table.detach(SlotId(slot));
                        if detached.remove(&slot) {
                            prop_assert_eq!(got, Ok(()));
                            prop_assert!(freed_since_use.insert(slot), "slot {} freed twice", slot);
                        } else {
                            prop_assert_eq!(got, Err(SlotError::NotDetached(SlotId(slot))));
                        }
                    }
                    Op::Free(seq) => {
                        let got = table.free(SeqId(seq));
                        match owned.remove(&seq) {
                            Some(slot) => {
                                prop_assert_eq!(got, Ok(SlotId(slot)));
                                prop_assert!(freed_since_use.insert(slot), "slot {} freed twice", slot);
                            }
                            None => prop_assert_eq!(got, Err(SlotError::NotOwned(SeqId(seq)))),
                        }
                    }
                }
                prop_assert_eq!(table.owned_len(), owned.len());
                prop_assert_eq!(table.detached_len(), detached.len());
                prop_assert_eq!(table.free_len(), freed_since_use.len());
                prop_assert_eq!(table.free_len() + table.owned_len() + table.detached_len(), capacity as usize);
            }
        }
    }
}
