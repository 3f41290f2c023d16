//! The plan's guarantees, over any owned, desired and other sets: a
//! source never drains what it did not add, never adds a name another
//! holds, and after its passes (drain, then add) owns exactly the desired
//! workers it can hold.

use super::*;
use proptest::prelude::*;

/// A worker as its source lists it: its name and a URL-like number (two
/// values, so that workers change in place often).
type Spec = (String, u8);

fn names() -> impl Strategy<Value = String> {
    (0u8..12).prop_map(|n| format!("w{n}"))
}

fn set() -> impl Strategy<Value = WorkerSet<Spec>> {
    prop::collection::btree_map(names(), 0u8..2, 0..8).prop_map(|m| {
        m.into_iter()
            .map(|(name, url)| (name.clone(), (name, url)))
            .collect()
    })
}

/// `owned` after `plan` is carried out: drained names leave, added ones
/// arrive.
fn applied(owned: &WorkerSet<Spec>, plan: &Plan<Spec>) -> WorkerSet<Spec> {
    let mut after = owned.clone();
    for name in &plan.drain {
        after.remove(name);
    }
    for spec in &plan.add {
        after.insert(spec.0.clone(), spec.clone());
    }
    after
}

proptest! {
    #[test]
    fn one_pass_owns_what_it_can_hold_and_touches_nothing_else(
        owned in set(),
        desired in set(),
        others in prop::collection::btree_set(names(), 0..6),
    ) {
        // The table holds a name once: what the source owns is no other's.
        let others: BTreeSet<String> =
            others.into_iter().filter(|n| !owned.contains_key(n)).collect();
        let p = plan(&owned, &desired, &others);
        for name in &p.drain {
            prop_assert!(owned.contains_key(name), "drained {}, not owned", name);
        }
        for (name, _) in &p.add {
            prop_assert!(!owned.contains_key(name) && !others.contains(name), "added {}", name);
        }
        let after = applied(&owned, &p);
        // Everything the source owns after the pass is desired as it is.
        for (name, spec) in &after {
            prop_assert_eq!(desired.get(name), Some(spec));
        }
        // Every desired worker it can hold is owned, but those changed in
        // place (drained now, added at the next pass).
        for (name, spec) in &desired {
            let changed = owned.get(name).is_some_and(|old| old != spec);
            prop_assert_eq!(after.contains_key(name), !changed && !others.contains(name), "{}", name);
        }
        // Conflicts are the desired names another holds.
        let conflicts: BTreeSet<&String> = p.conflicts.iter().collect();
        let expected: BTreeSet<&String> = desired.keys().filter(|n| others.contains(*n)).collect();
        prop_assert_eq!(conflicts, expected);
    }

    #[test]
    fn with_no_conflict_a_second_pass_finishes_what_changed_in_place(
        owned in set(),
        desired in set(),
    ) {
        let none = BTreeSet::new();
        let after = applied(&owned, &plan(&owned, &desired, &none));
        let second = plan(&after, &desired, &none);
        prop_assert!(second.drain.is_empty());
        prop_assert_eq!(applied(&after, &second), desired.clone());
        // And a third pass has nothing to do.
        let done = plan(&desired, &desired, &none);
        prop_assert_eq!(done, Plan::default());
    }
}

#[test]
fn a_capped_set_keeps_the_first_names_and_counts_the_rest() {
    let workers = [("b", 1), ("a", 1), ("a", 2), ("c", 1)].map(|(n, s)| (n.to_owned(), s));
    let (set, dropped) = capped(workers, 2);
    let kept: Vec<(String, u8)> = set.into_iter().collect();
    assert_eq!(kept, [("a".to_owned(), 1), ("b".to_owned(), 1)]);
    // The repeated `a`, and `c` past the cap.
    assert_eq!(dropped, 2);
}
