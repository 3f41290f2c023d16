//! The fair gate: slots first come while free, then band, then weighted
//! fair share; cancelled waiters are skipped; against a naive model.

use super::*;
use crate::admission::tenants::{Band, TenantId};
use proptest::prelude::*;

fn flow(tenant: u16, band: u8) -> Flow {
    Flow {
        tenant: TenantId(tenant),
        band: Band(band),
        ..Flow::default()
    }
}

fn ticket(entry: Entry) -> GateTicket {
    match entry {
        Entry::Wait(t) => t,
        other => panic!("expected to wait, got {other:?}"),
    }
}

#[test]
fn jobs_run_at_once_while_a_slot_is_free_then_wait_in_arrival_order() {
    let mut gate = FairGate::<()>::new(2, 16);
    assert_eq!(gate.enter(&flow(0, 1), 100, 1.0, ()), Entry::Run);
    assert_eq!(gate.enter(&flow(1, 1), 100, 1.0, ()), Entry::Run);
    let a = ticket(gate.enter(&flow(2, 1), 100, 1.0, ()));
    let b = ticket(gate.enter(&flow(3, 1), 100, 1.0, ()));
    assert_eq!((gate.busy(), gate.waiting()), (2, 2));
    assert_eq!(
        gate.release().map(|(t, ())| t),
        Some(a),
        "a freed slot goes to the first waiter"
    );
    assert_eq!(gate.release().map(|(t, ())| t), Some(b));
    assert_eq!(gate.busy(), 2, "each handed-over slot stays busy");
    assert_eq!(gate.release().map(|(t, ())| t), None);
    assert_eq!(gate.release().map(|(t, ())| t), None);
    assert_eq!(gate.busy(), 0);
    let c = gate.counters();
    assert_eq!((c.immediate, c.waited), (2, 2));
}

#[test]
fn a_higher_band_goes_before_every_lower_bands_waiter() {
    let mut gate = FairGate::<()>::new(1, 16);
    assert_eq!(gate.enter(&flow(0, 2), 1, 1.0, ()), Entry::Run);
    let low: Vec<_> = (0..3)
        .map(|_| ticket(gate.enter(&flow(0, 2), 1, 1.0, ())))
        .collect();
    let high = ticket(gate.enter(&flow(1, 0), 1_000_000, 1.0, ()));
    assert_eq!(gate.release().map(|(t, ())| t), Some(high));
    for t in low {
        assert_eq!(gate.release().map(|(t, ())| t), Some(t));
    }
}

#[test]
fn a_light_tenants_prompt_is_not_held_behind_a_noisy_tenants_backlog() {
    let mut gate = FairGate::<()>::new(1, 64);
    assert_eq!(gate.enter(&flow(1, 1), 200_000, 1.0, ()), Entry::Run);
    let noisy: Vec<_> = (0..10)
        .map(|_| ticket(gate.enter(&flow(1, 1), 200_000, 1.0, ())))
        .collect();
    let light = ticket(gate.enter(&flow(2, 1), 2_000, 1.0, ()));
    // The noisy tenant's jobs are tagged one after another: the light
    // tenant's starts at the gate's virtual time, before all but the
    // first of them.
    assert_eq!(gate.release().map(|(t, ())| t), Some(light));
    for t in noisy {
        assert_eq!(gate.release().map(|(t, ())| t), Some(t));
    }
}

#[test]
fn backlogged_tenants_are_let_through_in_proportion_to_their_weights() {
    let mut gate = FairGate::<()>::new(1, 1024);
    assert_eq!(gate.enter(&flow(9, 0), 1, 1.0, ()), Entry::Run);
    let mut owner = FxHashMap::default();
    for _ in 0..200 {
        owner.insert(ticket(gate.enter(&flow(1, 0), 1_000, 3.0, ())), 1u16);
        owner.insert(ticket(gate.enter(&flow(2, 0), 1_000, 1.0, ())), 2u16);
    }
    let mut counts = [0u32; 3];
    for _ in 0..100 {
        let t = gate.release().map(|(t, ())| t).expect("a waiter");
        counts[owner[&t] as usize] += 1;
    }
    assert!(
        (74..=76).contains(&counts[1]) && (24..=26).contains(&counts[2]),
        "weights 3:1 gave {counts:?}"
    );
}

#[test]
fn an_idle_tenant_banks_no_credit() {
    let mut gate = FairGate::<()>::new(1, 64);
    // Tenant 1 alone for a long while moves the virtual time on.
    for _ in 0..50 {
        assert_eq!(gate.enter(&flow(1, 0), 1_000, 1.0, ()), Entry::Run);
        assert_eq!(gate.release().map(|(t, ())| t), None);
    }
    assert_eq!(gate.enter(&flow(1, 0), 1_000, 1.0, ()), Entry::Run);
    let quiet = ticket(gate.enter(&flow(2, 0), 1_000, 1.0, ()));
    let busy = ticket(gate.enter(&flow(1, 0), 1_000, 1.0, ()));
    let quiet_again = ticket(gate.enter(&flow(2, 0), 1_000, 1.0, ()));
    // The newcomer starts at the virtual time, not at zero: it gets its
    // turn, then alternates rather than running 50 jobs in a row.
    assert_eq!(gate.release().map(|(t, ())| t), Some(quiet));
    assert_eq!(gate.release().map(|(t, ())| t), Some(busy));
    assert_eq!(gate.release().map(|(t, ())| t), Some(quiet_again));
}

#[test]
fn a_cancelled_waiter_is_skipped_and_counted() {
    let mut gate = FairGate::<()>::new(1, 16);
    assert_eq!(gate.enter(&flow(0, 0), 1, 1.0, ()), Entry::Run);
    let a = ticket(gate.enter(&flow(0, 0), 1, 1.0, ()));
    let b = ticket(gate.enter(&flow(1, 0), 1, 1.0, ()));
    assert!(gate.cancel(a).is_some());
    assert!(gate.cancel(a).is_none(), "only once");
    assert_eq!(gate.release().map(|(t, ())| t), Some(b));
    assert!(gate.cancel(b).is_none(), "already let through");
    assert_eq!(gate.release().map(|(t, ())| t), None);
    assert_eq!(gate.counters().cancelled, 1);
    assert_eq!((gate.busy(), gate.waiting()), (0, 0));
}

#[test]
fn waiters_beyond_the_cap_are_refused_and_counted() {
    let mut gate = FairGate::<()>::new(1, 2);
    assert_eq!(gate.enter(&flow(0, 0), 1, 1.0, ()), Entry::Run);
    ticket(gate.enter(&flow(0, 0), 1, 1.0, ()));
    ticket(gate.enter(&flow(0, 0), 1, 1.0, ()));
    assert_eq!(gate.enter(&flow(1, 0), 1, 1.0, ()), Entry::Full);
    assert_eq!(gate.counters().refused, 1);
    assert_eq!(gate.waiting(), 2);
}

#[test]
fn a_bad_weight_is_treated_as_tiny_not_a_panic() {
    let mut gate = FairGate::<()>::new(1, 4);
    for weight in [0.0, -1.0, f64::NAN, f64::INFINITY] {
        assert_eq!(gate.enter(&flow(0, 0), u64::MAX, weight, ()), Entry::Run);
        assert_eq!(gate.release().map(|(t, ())| t), None);
    }
}

/// The naive model: every live waiter in a list, the least
/// (band, start, arrival) taken by a scan.
#[derive(Default)]
struct Model {
    slots: usize,
    busy: usize,
    max_waiting: usize,
    waiting: Vec<(u8, f64, u64)>,
    finish: std::collections::BTreeMap<u16, f64>,
    virtual_time: f64,
    next: u64,
}

impl Model {
    fn enter(&mut self, tenant: u16, band: u8, cost: u64, weight: f64) -> Entry {
        let start = self
            .virtual_time
            .max(self.finish.get(&tenant).copied().unwrap_or(0.0));
        let run = self.busy < self.slots && self.waiting.is_empty();
        if !run && self.waiting.len() >= self.max_waiting {
            return Entry::Full;
        }
        self.finish.insert(tenant, start + cost as f64 / weight);
        if run {
            self.busy += 1;
            self.virtual_time = start;
            return Entry::Run;
        }
        let t = self.next;
        self.next += 1;
        self.waiting.push((band, start, t));
        Entry::Wait(GateTicket(t))
    }

    fn release(&mut self) -> Option<GateTicket> {
        let best = (0..self.waiting.len()).min_by(|&i, &j| {
            let (a, b) = (self.waiting[i], self.waiting[j]);
            (a.0, a.1.to_bits(), a.2).cmp(&(b.0, b.1.to_bits(), b.2))
        });
        match best {
            Some(i) => {
                let (_, start, t) = self.waiting.remove(i);
                self.virtual_time = self.virtual_time.max(start);
                Some(GateTicket(t))
            }
            None => {
                self.busy = self.busy.saturating_sub(1);
                None
            }
        }
    }

    fn cancel(&mut self, ticket: GateTicket) -> bool {
        let before = self.waiting.len();
        self.waiting.retain(|w| w.2 != ticket.0);
        self.waiting.len() != before
    }
}

#[derive(Clone, Debug)]
enum Op {
    Enter {
        tenant: u16,
        band: u8,
        cost: u64,
        weight: u8,
    },
    Release,
    Cancel(u64),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        (0u16..4, 0u8..3, 1u64..5_000, 1u8..5).prop_map(|(tenant, band, cost, weight)| Op::Enter {
            tenant,
            band,
            cost,
            weight
        }),
        Just(Op::Release),
        (0u64..64).prop_map(Op::Cancel),
    ]
}

proptest! {
    #[test]
    fn the_gate_lets_through_what_the_naive_model_does(
        slots in 1usize..4,
        max_waiting in 1usize..12,
        ops in proptest::collection::vec(op(), 1..200),
    ) {
        let mut gate = FairGate::<()>::new(slots, max_waiting);
        let mut model = Model { slots, max_waiting, ..Model::default() };
        for op in ops {
            match op {
                Op::Enter { tenant, band, cost, weight } => {
                    let f = flow(tenant, band);
                    prop_assert_eq!(
                        gate.enter(&f, cost, f64::from(weight), ()),
                        model.enter(tenant, band, cost, f64::from(weight))
                    );
                }
                Op::Release => prop_assert_eq!(gate.release().map(|(t, ())| t), model.release()),
                Op::Cancel(t) => {
                    prop_assert_eq!(gate.cancel(GateTicket(t)).is_some(), model.cancel(GateTicket(t)))
                }
            }
            prop_assert_eq!(gate.busy(), model.busy);
            prop_assert_eq!(gate.waiting(), model.waiting.len());
            prop_assert!(gate.busy() <= slots);
        }
    }
}
