//! The hash map every module uses: hashbrown with rustc's Fx hasher (keys
//! are already well-mixed hashes or small ids), chosen over `std`'s for its
//! exact `allocation_size`, which memory figures report.

pub(crate) type FxHashMap<K, V> = hashbrown::HashMap<K, V, rustc_hash::FxBuildHasher>;
/// The set of the same kind.
pub(crate) type FxHashSet<K> = hashbrown::HashSet<K, rustc_hash::FxBuildHasher>;

/// Heap bytes a map holds (its table, tombstones included).
pub(crate) fn map_bytes<K: Eq + std::hash::Hash, V>(map: &FxHashMap<K, V>) -> usize {
    map.allocation_size()
}
