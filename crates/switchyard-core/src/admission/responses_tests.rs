//! Response affinity as a specification: owners, both caps, expiry, and a
//! property test against a naive model (a list in insertion order).

use super::*;
use proptest::prelude::*;

const A: Option<Owner> = Some(Owner(1));
const B: Option<Owner> = Some(Owner(2));

fn holder(w: u64, owner: Option<Owner>) -> Holder {
    Holder {
        worker: WorkerId::new(w),
        session: None,
        owner,
    }
}

fn map(capacity: usize, per_key: usize) -> ResponseAffinity {
    ResponseAffinity::new(capacity, per_key, 60_000.0)
}

#[test]
fn an_entry_is_found_by_its_owner_only_and_looks_unknown_to_others() {
    let mut map = map(10, 10);
    let t = 0.0;
    assert_eq!(map.insert("resp_a", holder(1, A), t), Inserted::Stored);
    assert_eq!(map.get("resp_a", A, t), Some(holder(1, A)));
    assert_eq!(map.get("resp_a", B, t), None);
    assert_eq!(map.get("resp_a", None, t), None, "no key is no owner");
    assert_eq!(map.get("resp_unknown", B, t), None);
    assert_eq!(map.len(), 1, "another's lookup forgets nothing");
}

#[test]
fn an_answer_never_moves_an_id_another_key_holds() {
    let mut map = map(10, 10);
    let t = 0.0;
    map.insert("resp_a", holder(1, A), t);
    assert_eq!(map.insert("resp_a", holder(2, B), t), Inserted::Taken);
    assert_eq!(map.get("resp_a", A, t), Some(holder(1, A)));
    assert_eq!(map.get("resp_a", B, t), None);
    assert_eq!(map.taken(), 1);
    // Its owner may refresh it (a later turn answered with the same id).
    assert_eq!(map.insert("resp_a", holder(3, A), t), Inserted::Stored);
    assert_eq!(map.get("resp_a", A, t), Some(holder(3, A)));
    // Once expired, the id is free again.
    let later = t + 61000.0;
    assert_eq!(map.insert("resp_a", holder(2, B), later), Inserted::Stored);
    assert_eq!(map.get("resp_a", B, later), Some(holder(2, B)));
}

#[test]
fn a_key_at_its_cap_forgets_its_own_oldest_never_anothers() {
    let mut map = map(100, 3);
    let t = 0.0;
    map.insert("a1", holder(1, A), t);
    map.insert("a2", holder(1, A), t);
    for i in 0..60 {
        map.insert(&format!("b{i}"), holder(2, B), t);
    }
    assert_eq!(map.len_of(B), 3);
    assert_eq!(map.len_of(A), 2);
    assert_eq!(map.get("a1", A, t), Some(holder(1, A)));
    assert_eq!(map.get("a2", A, t), Some(holder(1, A)));
    assert_eq!(map.get("b59", B, t), Some(holder(2, B)));
    assert_eq!(map.get("b56", B, t), None);
    assert_eq!(map.drops(Forgotten::KeyCapacity), 57);
    assert_eq!(map.drops(Forgotten::Capacity), 0);
}

#[test]
fn a_full_map_forgets_its_oldest_entry_and_counts_it() {
    let mut map = map(2, 10);
    let t = 0.0;
    map.insert("resp_a", holder(1, None), t);
    map.insert("resp_b", holder(2, None), t);
    map.insert("resp_c", holder(3, None), t);
    assert_eq!(map.len(), 2);
    assert_eq!(map.get("resp_a", None, t), None);
    assert_eq!(map.get("resp_c", None, t), Some(holder(3, None)));
    assert_eq!(map.drops(Forgotten::Capacity), 1);
    // Re-inserting a held id does not evict another.
    map.insert("resp_c", holder(4, None), t);
    assert_eq!(map.get("resp_b", None, t), Some(holder(2, None)));
    assert_eq!(map.get("resp_c", None, t), Some(holder(4, None)));
}

#[test]
fn an_entry_expires_after_the_ttl_and_is_counted() {
    let mut map = map(10, 10);
    let t = 0.0;
    map.insert("resp_a", holder(1, None), t);
    assert_eq!(map.get("resp_a", None, t + 59000.0), Some(holder(1, None)));
    assert_eq!(map.get("resp_a", None, t + 60000.0), None);
    assert_eq!(map.drops(Forgotten::Expired), 1);
    // Swept at an insert, too.
    map.insert("resp_b", holder(1, None), t);
    map.insert("resp_c", holder(1, None), t + 61000.0);
    assert_eq!(map.len(), 1);
    assert_eq!(map.drops(Forgotten::Expired), 2);
}

#[test]
fn ids_past_the_bound_are_neither_stored_nor_looked_up() {
    let mut map = map(10, 10);
    let long = "r".repeat(MAX_RESPONSE_ID_BYTES + 1);
    assert_eq!(map.insert(&long, holder(1, None), 0.0), Inserted::Ignored);
    assert!(map.is_empty());
    assert_eq!(map.get(&long, None, 0.0), None);
}

#[test]
fn a_chain_keeps_one_session_from_its_second_turn_on() {
    let first = session_of("resp_1", &holder(1, None), None);
    let carried = Holder {
        session: Some(first),
        ..holder(1, None)
    };
    assert_eq!(session_of("resp_2", &carried, None), first);
    assert_ne!(
        session_of("resp_1", &holder(1, A), Some("api-key-1")),
        first
    );
}

#[test]
fn owners_are_digests_of_key_names() {
    assert_eq!(Owner::of_key("alpha"), Owner::of_key("alpha"));
    assert_ne!(Owner::of_key("alpha"), Owner::of_key("beta"));
}

/// The naive model: entries in the order the real map queues them.
#[derive(Default)]
struct Model {
    entries: Vec<(u8, Option<Owner>, u64, u64)>,
    capacity: usize,
    per_key: usize,
    ttl: u64,
    drops: [u64; 3],
    taken: u64,
}

impl Model {
    fn position(&self, id: u8) -> Option<usize> {
        self.entries.iter().position(|e| e.0 == id)
    }

    fn insert(&mut self, id: u8, owner: Option<Owner>, worker: u64, now: u64) -> Inserted {
        if let Some(i) = self.position(id) {
            let (_, held_by, _, at) = self.entries[i];
            if now - at >= self.ttl {
                self.entries.remove(i);
                self.drops[Forgotten::Expired as usize] += 1;
            } else if held_by != owner {
                self.taken += 1;
                return Inserted::Taken;
            } else {
                self.entries.remove(i);
                self.entries.push((id, owner, worker, now));
                return Inserted::Stored;
            }
        }
        let before = self.entries.len();
        let ttl = self.ttl;
        self.entries.retain(|e| now - e.3 < ttl);
        self.drops[Forgotten::Expired as usize] += (before - self.entries.len()) as u64;
        if owner.is_some() && self.entries.iter().filter(|e| e.1 == owner).count() >= self.per_key {
            let i = self.entries.iter().position(|e| e.1 == owner).unwrap();
            self.entries.remove(i);
            self.drops[Forgotten::KeyCapacity as usize] += 1;
        }
        while self.entries.len() >= self.capacity {
            self.entries.remove(0);
            self.drops[Forgotten::Capacity as usize] += 1;
        }
        self.entries.push((id, owner, worker, now));
        Inserted::Stored
    }

    fn get(&mut self, id: u8, caller: Option<Owner>, now: u64) -> Option<u64> {
        let i = self.position(id)?;
        let (_, owner, worker, at) = self.entries[i];
        if owner != caller {
            return None;
        }
        if now - at >= self.ttl {
            self.entries.remove(i);
            self.drops[Forgotten::Expired as usize] += 1;
            return None;
        }
        Some(worker)
    }
}

#[derive(Clone, Debug)]
enum Op {
    Insert { id: u8, owner: u8, worker: u64 },
    Get { id: u8, owner: u8 },
    Wait(u64),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0u8..8, 0u8..3, 0u64..4).prop_map(|(id, owner, worker)| Op::Insert { id, owner, worker }),
        2 => (0u8..8, 0u8..3).prop_map(|(id, owner)| Op::Get { id, owner }),
        1 => (1u64..30).prop_map(Op::Wait),
    ]
}

fn owner(o: u8) -> Option<Owner> {
    (o > 0).then_some(Owner(u64::from(o)))
}

proptest! {
    #[test]
    fn the_map_behaves_as_the_naive_model(
        capacity in 1usize..6,
        per_key in 1usize..4,
        ops in proptest::collection::vec(op(), 1..120),
    ) {
        let ttl = 40;
        let mut real = ResponseAffinity::new(capacity, per_key, ttl as f64 * 1e3);
        let mut model = Model { capacity, per_key, ttl, ..Model::default() };
        let mut now = 0u64;
        for op in ops {
            let t = now as f64 * 1e3;
            match op {
                Op::Insert { id, owner: o, worker } => {
                    let got = real.insert(&format!("r{id}"), holder(worker, owner(o)), t);
                    prop_assert_eq!(got, model.insert(id, owner(o), worker, now));
                }
                Op::Get { id, owner: o } => {
                    let got = real.get(&format!("r{id}"), owner(o), t).map(|h| h.worker);
                    let want = model.get(id, owner(o), now).map(WorkerId::new);
                    prop_assert_eq!(got, want);
                }
                Op::Wait(s) => now += s,
            }
            prop_assert_eq!(real.len(), model.entries.len());
            for o in 0..3 {
                let want = model.entries.iter().filter(|e| e.1 == owner(o)).count();
                prop_assert_eq!(real.len_of(owner(o)), want);
            }
            for why in Forgotten::ALL {
                prop_assert_eq!(real.drops(why), model.drops[why as usize], "{:?}", why);
            }
            prop_assert_eq!(real.taken(), model.taken);
        }
    }
}

#[test]
fn a_continued_response_goes_to_its_worker_unless_it_is_unknown_gone_or_out_of_selection() {
    let mut map = map(10, 10);
    map.insert("resp_a", holder(1, A), 0.0);
    let at = |standing| {
        move |w: WorkerId| {
            assert_eq!(w, WorkerId::new(1), "asked of the holder's worker");
            standing
        }
    };
    let h = holder(1, A);
    assert_eq!(
        map.locate("resp_a", A, 0.0, at(Standing::InSelection)),
        Located::At(h)
    );
    assert_eq!(
        map.locate("resp_a", A, 0.0, at(Standing::OutOfSelection)),
        Located::WorkerOutOfSelection(h)
    );
    assert_eq!(
        map.locate("resp_a", A, 0.0, at(Standing::Gone)),
        Located::WorkerGone(h)
    );
    // Another owner's is unknown, and its worker is never asked about.
    let never = |_| -> Standing { panic!("asked about an unknown response's worker") };
    assert_eq!(map.locate("resp_a", B, 0.0, never), Located::Unknown);
    assert_eq!(map.locate("resp_b", A, 0.0, never), Located::Unknown);
}
