//! The plan against a naive model of the worker table: a source adds
//! what is new, drains what vanished or changed, never touches a worker it
//! did not add, and its passes converge on the desired set.

use super::*;
use proptest::prelude::*;

/// A worker as a source lists it: its name and port (the name is its key).
type WorkerSpec = (String, u16);
type WorkerSet = super::WorkerSet<WorkerSpec>;
type Plan = super::Plan<WorkerSpec>;

fn spec(name: &str, port: u16) -> WorkerSpec {
    (name.to_owned(), port)
}

fn set(specs: &[WorkerSpec]) -> WorkerSet {
    specs.iter().map(|s| (s.0.clone(), s.clone())).collect()
}

fn names(list: &[&str]) -> BTreeSet<String> {
    list.iter().map(|s| s.to_string()).collect()
}

#[test]
fn new_workers_are_added_and_vanished_ones_drained() {
    let owned = set(&[spec("a", 1), spec("b", 2)]);
    let desired = set(&[spec("b", 2), spec("c", 3)]);
    let p = plan(&owned, &desired, &BTreeSet::new());
    assert_eq!(p.add, vec![spec("c", 3)]);
    assert_eq!(p.drain, vec!["a".to_owned()]);
    assert!(p.conflicts.is_empty());
}

#[test]
fn a_source_never_touches_a_worker_it_did_not_add() {
    let desired = set(&[spec("manual", 9)]);
    let p = plan(&WorkerSet::new(), &desired, &names(&["manual", "other"]));
    assert!(p.add.is_empty() && p.drain.is_empty(), "{p:?}");
    assert_eq!(p.conflicts, vec!["manual".to_owned()]);
    // Nor drains it when it leaves the source: it was never owned.
    let p = plan(&WorkerSet::new(), &WorkerSet::new(), &names(&["manual"]));
    assert!(p.add.is_empty() && p.drain.is_empty() && p.conflicts.is_empty());
}

#[test]
fn a_worker_changed_in_place_is_drained_then_re_added() {
    let owned = set(&[spec("a", 1)]);
    let desired = set(&[spec("a", 2)]);
    let p = plan(&owned, &desired, &BTreeSet::new());
    assert_eq!(p.drain, vec!["a".to_owned()]);
    assert!(p.add.is_empty(), "not while the old one holds the name");
    // Next pass: the old form is draining (someone else's name now).
    let p = plan(&WorkerSet::new(), &desired, &names(&["a"]));
    assert!(p.add.is_empty() && p.conflicts == vec!["a".to_owned()]);
    // Once it has left, the new form goes in.
    let p = plan(&WorkerSet::new(), &desired, &BTreeSet::new());
    assert_eq!(p.add, vec![spec("a", 2)]);
}

#[test]
fn an_unchanged_source_plans_nothing() {
    let owned = set(&[spec("a", 1), spec("b", 2)]);
    assert_eq!(
        plan(&owned, &owned.clone(), &names(&["x"])),
        Plan::default()
    );
}

#[test]
fn the_cap_keeps_the_first_names_and_counts_the_rest() {
    let listed = [spec("c", 3), spec("a", 1), spec("b", 2), spec("a", 4)];
    let (kept, dropped) = capped(listed.map(|s| (s.0.clone(), s)), 2);
    assert_eq!(kept.keys().collect::<Vec<_>>(), ["a", "b"]);
    assert_eq!(kept["a"], spec("a", 1), "the first entry of a name");
    assert_eq!(dropped, 2, "one repeat, one past the cap");
}

/// The naive model: the table as name → (owner, spec, draining), where
/// owner 0 is "by hand" and 1 is the source under test. One pass of
/// the source, applied the way the driver applies it.
#[derive(Clone, Debug, Default)]
struct Table(BTreeMap<String, (u8, WorkerSpec, bool)>);

impl Table {
    fn owned(&self) -> WorkerSet {
        self.0
            .iter()
            .filter(|(_, (owner, _, draining))| *owner == 1 && !draining)
            .map(|(n, (_, s, _))| (n.clone(), s.clone()))
            .collect()
    }
    fn others(&self) -> BTreeSet<String> {
        let owned = self.owned();
        self.0
            .keys()
            .filter(|n| !owned.contains_key(*n))
            .cloned()
            .collect()
    }
    fn apply(&mut self, p: &Plan) {
        for name in &p.drain {
            let entry = self.0.get_mut(name).expect("drained a name in the table");
            assert_eq!(entry.0, 1, "drained a worker the source does not own");
            entry.2 = true;
        }
        for s in &p.add {
            let previous = self.0.insert(s.0.clone(), (1, s.clone(), false));
            assert!(previous.is_none(), "added over an existing name");
        }
    }
}

#[derive(Clone, Debug)]
enum Op {
    /// The source now lists these (name index, port).
    Source(Vec<(u8, u16)>),
    /// A worker added by hand.
    Manual(u8),
    /// Draining workers finish and leave.
    Drained,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => proptest::collection::vec((0u8..8, 1u16..3), 0..6).prop_map(Op::Source),
        1 => (0u8..8).prop_map(Op::Manual),
        1 => Just(Op::Drained),
    ]
}

proptest! {
    /// Against the naive table: after every pass the source owns
    /// exactly the desired workers whose name no one else holds, it
    /// never drains what it did not add, and hand-added workers are
    /// never drained.
    #[test]
    fn passes_converge_on_the_desired_set_without_touching_others(
        ops in proptest::collection::vec(op(), 1..40)
    ) {
        let mut table = Table::default();
        let mut desired = WorkerSet::new();
        for op in ops {
            match op {
                Op::Source(list) => {
                    desired = list
                        .into_iter()
                        .map(|(i, port)| spec(&format!("w{i}"), port))
                        .map(|s| (s.0.clone(), s))
                        .collect();
                }
                Op::Manual(i) => {
                    let name = format!("w{i}");
                    table.0.entry(name.clone()).or_insert((0, spec(&name, 99), false));
                }
                Op::Drained => table.0.retain(|_, (_, _, draining)| !*draining),
            }
            let before = table.clone();
            let p = plan(&table.owned(), &desired, &table.others());
            table.apply(&p);
            // A second pass right after: drained names now held by
            // their draining selves; nothing else moves.
            let again = plan(&table.owned(), &desired, &table.others());
            prop_assert!(again.drain.is_empty(), "{again:?}");
            table.apply(&again);
            let by_hand = |t: &Table| -> Vec<(String, WorkerSpec)> {
                t.0.iter().filter(|(_, e)| e.0 == 0).map(|(n, e)| (n.clone(), e.1.clone())).collect()
            };
            prop_assert_eq!(by_hand(&before), by_hand(&table));
            // The model: a desired worker is owned after the pass when
            // the source already held it unchanged, or no one held its
            // name.
            let expected: WorkerSet = desired
                .iter()
                .filter(|(n, s)| match before.0.get(*n) {
                    Some((1, held, false)) => held == *s,
                    Some(_) => false,
                    None => true,
                })
                .map(|(n, s)| (n.clone(), s.clone()))
                .collect();
            prop_assert_eq!(table.owned(), expected);
            prop_assert!(table.owned().iter().all(|(n, s)| desired.get(n) == Some(s)));
        }
    }
}
