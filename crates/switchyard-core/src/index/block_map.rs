//! One worker's map from engine block hash to trie node.
//!
//! `Removed` events name blocks only by engine hash, so every removed block
//! costs one lookup here and every stored block one insert. The map is
//! hashbrown's, with a key that hashes as one `u64`: the engine hash stored
//! as two `u32` halves (12-byte entries rather than 16) used to be hashed as
//! a byte slice with a length prefix, two hasher calls and a byte loop a
//! block.
//!
//! An open-addressing table of our own (linear probing, backward-shift
//! deletion, no tombstones) was tried here and measured: at the loads this
//! map runs at (up to 4/5 full, to stay within hashbrown's memory) probe runs
//! grew long, and `remove` cost 2.2× the instructions of hashbrown's (callgrind,
//! `bench index micro` workload). hashbrown's SIMD group probe stays short at
//! 7/8 full.

use std::hash::{BuildHasherDefault, Hash, Hasher};

/// An engine hash as two `u32` halves: a 4-byte-aligned key, so that
/// (key, node) entries pack into 12 bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Key([u32; 2]);

impl Key {
    #[inline]
    fn new(hash: u64) -> Self {
        Self([hash as u32, (hash >> 32) as u32])
    }
}

impl Hash for Key {
    #[inline]
    fn hash<H: Hasher>(&self, state: &mut H) {
        state.write_u64(u64::from(self.0[0]) | u64::from(self.0[1]) << 32);
    }
}

type Map = hashbrown::HashMap<Key, u32, BuildHasherDefault<rustc_hash::FxHasher>>;

/// Engine hash → node for one worker. See the module docs.
#[derive(Clone, Debug, Default)]
pub(super) struct BlockMap {
    map: Map,
}

impl BlockMap {
    /// Keys stored.
    pub(super) fn len(&self) -> usize {
        self.map.len()
    }

    /// Heap bytes held (the table, tombstones included).
    pub(super) fn bytes(&self) -> usize {
        self.map.allocation_size()
    }

    /// The node `key` names.
    #[inline]
    pub(super) fn get(&self, key: u64) -> Option<u32> {
        self.map.get(&Key::new(key)).copied()
    }

    /// Whether `key` is present.
    pub(super) fn contains(&self, key: u64) -> bool {
        self.map.contains_key(&Key::new(key))
    }

    /// Maps `key` to `node`; returns the node it named before, if any.
    #[inline]
    pub(super) fn insert(&mut self, key: u64, node: u32) -> Option<u32> {
        self.map.insert(Key::new(key), node)
    }

    /// Unmaps `key`; returns the node it named. Never shrinks the table.
    #[inline]
    pub(super) fn remove(&mut self, key: u64) -> Option<u32> {
        self.map.remove(&Key::new(key))
    }

    /// Nodes of all entries, in table order.
    pub(super) fn nodes(&self) -> impl Iterator<Item = u32> + '_ {
        self.map.values().copied()
    }

    /// Empties the map and frees its table, handing the old one back.
    pub(super) fn take(&mut self) -> BlockMap {
        std::mem::take(self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::HashMap;

    #[test]
    fn an_empty_map_finds_nothing_and_holds_no_memory() {
        let mut map = BlockMap::default();
        assert_eq!(map.get(0), None);
        assert_eq!(map.remove(7), None);
        assert_eq!(map.bytes(), 0);
    }

    #[test]
    fn inserting_a_key_again_replaces_its_node() {
        let mut map = BlockMap::default();
        assert_eq!(map.insert(0, 1), None);
        assert_eq!(map.insert(0, 2), Some(1));
        assert_eq!(map.get(0), Some(2));
        assert_eq!(map.len(), 1);
    }

    #[test]
    fn removing_does_not_shrink_and_taking_frees() {
        let mut map = BlockMap::default();
        for key in 0..1000 {
            map.insert(key, key as u32);
        }
        let bytes = map.bytes();
        for key in 0..1000 {
            assert_eq!(map.remove(key), Some(key as u32));
        }
        assert_eq!(map.bytes(), bytes);
        assert_eq!(map.len(), 0);
        map.insert(5, 5);
        let old = map.take();
        assert_eq!(old.len(), 1);
        assert_eq!(map.bytes(), 0);
        assert_eq!(map.get(5), None);
    }

    #[derive(Clone, Debug)]
    enum Op {
        Insert(u64, u32),
        Remove(u64),
    }

    /// Keys from a small range collide and wrap around the table's end;
    /// large ones exercise the high half of the split key.
    fn key() -> impl Strategy<Value = u64> {
        prop_oneof![0..64u64, any::<u64>(), (0..8u64).prop_map(|k| k << 61)]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]

        #[test]
        fn agrees_with_a_hash_map(ops in proptest::collection::vec(
            prop_oneof![
                3 => (key(), 0..1000u32).prop_map(|(k, n)| Op::Insert(k, n)),
                2 => key().prop_map(Op::Remove),
            ],
            1..300,
        )) {
            let mut map = BlockMap::default();
            let mut model = HashMap::new();
            for op in ops {
                match op {
                    Op::Insert(k, n) => prop_assert_eq!(map.insert(k, n), model.insert(k, n)),
                    Op::Remove(k) => prop_assert_eq!(map.remove(k), model.remove(&k)),
                }
                prop_assert_eq!(map.len(), model.len());
                for (&k, &n) in &model {
                    prop_assert_eq!(map.get(k), Some(n));
                }
                let mut nodes: Vec<u32> = map.nodes().collect();
                let mut expected: Vec<u32> = model.values().copied().collect();
                nodes.sort_unstable();
                expected.sort_unstable();
                prop_assert_eq!(nodes, expected);
            }
        }
    }
}
