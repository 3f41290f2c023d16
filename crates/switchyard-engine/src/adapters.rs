//! The simulated engine's LoRA adapter slots: at most `slots` adapters
//! loaded, each with what its driver keeps of it (a path, the time its
//! load ends) and when it was last used; a load into a full table evicts
//! the least recently used one, as vLLM's LRU cache of adapters does.
//!
//! Pure, like the rest of the engine: the caller gives the time (or any
//! increasing stamp). The fleet simulator and `switchyard sim-worker`
//! both keep their engines' adapters here.

/// One loaded adapter.
#[derive(Clone, Debug)]
struct Slot<T> {
    name: Box<str>,
    /// Its last use (the caller's clock).
    used: f64,
    value: T,
}

/// An engine's loaded adapters (see the module docs).
#[derive(Clone, Debug)]
pub struct AdapterSlots<T> {
    slots: usize,
    loaded: Vec<Slot<T>>,
}

impl<T> Default for AdapterSlots<T> {
    fn default() -> Self {
        Self::new(0)
    }
}

impl<T> AdapterSlots<T> {
    /// A table of `slots` adapters (0: nothing can be loaded).
    pub fn new(slots: usize) -> Self {
        Self {
            slots,
            loaded: Vec::new(),
        }
    }

    /// Its slots.
    pub fn slots(&self) -> usize {
        self.slots
    }

    /// Adapters loaded.
    pub fn len(&self) -> usize {
        self.loaded.len()
    }

    /// Whether none is loaded.
    pub fn is_empty(&self) -> bool {
        self.loaded.is_empty()
    }

    /// Whether `name` is loaded.
    pub fn contains(&self, name: &str) -> bool {
        self.loaded.iter().any(|s| &*s.name == name)
    }

    /// `name`'s value, its use at `now` recorded; `None` when not loaded.
    pub fn touch(&mut self, name: &str, now: f64) -> Option<&mut T> {
        let slot = self.loaded.iter_mut().find(|s| &*s.name == name)?;
        slot.used = now;
        Some(&mut slot.value)
    }

    /// Loads `name` with `value` at `now`, first evicting the least
    /// recently used adapters (the first loaded of equally old ones) while
    /// the table is full: the names evicted. A name already loaded is
    /// replaced in place.
    pub fn load(&mut self, name: &str, value: T, now: f64) -> Vec<Box<str>> {
        if let Some(slot) = self.loaded.iter_mut().find(|s| &*s.name == name) {
            slot.value = value;
            slot.used = now;
            return Vec::new();
        }
        let mut evicted = Vec::new();
        while !self.loaded.is_empty() && self.loaded.len() >= self.slots.max(1) {
            let coldest = (0..self.loaded.len())
                .min_by(|&a, &b| self.loaded[a].used.total_cmp(&self.loaded[b].used))
                .unwrap_or(0);
            evicted.push(self.loaded.remove(coldest).name);
        }
        self.loaded.push(Slot {
            name: name.into(),
            used: now,
            value,
        });
        evicted
    }

    /// Unloads `name`: its value, `None` when it was not loaded.
    pub fn unload(&mut self, name: &str) -> Option<T> {
        let i = self.loaded.iter().position(|s| &*s.name == name)?;
        Some(self.loaded.remove(i).value)
    }

    /// Every loaded adapter's name and value, in load order.
    pub fn iter(&self) -> impl Iterator<Item = (&str, &T)> {
        self.loaded.iter().map(|s| (&*s.name, &s.value))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn a_full_table_evicts_its_least_recently_used_adapter() {
        let mut t = AdapterSlots::new(2);
        assert!(t.load("a", 1, 10.0).is_empty());
        assert!(t.load("b", 2, 20.0).is_empty());
        // `a` used after `b`: `b` is the coldest.
        assert_eq!(t.touch("a", 30.0), Some(&mut 1));
        assert_eq!(t.load("c", 3, 40.0), vec![Box::<str>::from("b")]);
        assert_eq!(t.iter().collect::<Vec<_>>(), [("a", &1), ("c", &3)]);
        assert_eq!(t.unload("a"), Some(1));
        assert_eq!(t.unload("a"), None);
        assert_eq!(t.touch("b", 50.0), None);
        // Loading a loaded name replaces it in place.
        assert!(t.load("c", 4, 60.0).is_empty());
        assert_eq!(t.iter().collect::<Vec<_>>(), [("c", &4)]);
    }

    proptest! {
        /// Against a naive model: a list in load order with last-use
        /// stamps, the oldest (first of equals) evicted while full.
        #[test]
        fn the_table_is_a_bounded_lru(
            slots in 1usize..4,
            ops in proptest::collection::vec((0u8..3, 0u8..5), 1..60),
        ) {
            let mut t = AdapterSlots::new(slots);
            let mut model: Vec<(String, f64)> = Vec::new();
            for (i, (op, name)) in ops.into_iter().enumerate() {
                let now = i as f64;
                let name = format!("a{name}");
                match op {
                    0 => {
                        t.load(&name, (), now);
                        if let Some(e) = model.iter_mut().find(|e| e.0 == name) {
                            e.1 = now;
                        } else {
                            while model.len() >= slots {
                                let oldest = (0..model.len())
                                    .min_by(|&a, &b| model[a].1.total_cmp(&model[b].1))
                                    .unwrap();
                                model.remove(oldest);
                            }
                            model.push((name, now));
                        }
                    }
                    1 => {
                        let hit = t.touch(&name, now).is_some();
                        let e = model.iter_mut().find(|e| e.0 == name);
                        prop_assert_eq!(hit, e.is_some());
                        if let Some(e) = e {
                            e.1 = now;
                        }
                    }
                    _ => {
                        let gone = t.unload(&name).is_some();
                        let before = model.len();
                        model.retain(|e| e.0 != name);
                        prop_assert_eq!(gone, model.len() < before);
                    }
                }
                prop_assert!(t.len() <= slots);
                let names: Vec<&str> = t.iter().map(|(n, _)| n).collect();
                let expected: Vec<&str> = model.iter().map(|e| e.0.as_str()).collect();
                prop_assert_eq!(names, expected);
            }
        }
    }
}
