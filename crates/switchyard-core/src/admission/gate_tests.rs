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

fn runs(entry: Entry) -> bool {
    matches!(entry, Entry::Run(_))
}

/// An entry without its turn, to compare with the model's.
#[derive(Debug, PartialEq)]
enum Shape {
    Run,
    Wait(GateTicket),
    Full,
}

fn shape(entry: Entry) -> Shape {
    match entry {
        Entry::Run(_) => Shape::Run,
        Entry::Wait(t) => Shape::Wait(t),
        Entry::Full => Shape::Full,
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
    assert!(runs(gate.enter(&flow(0, 1), 100, 1.0, ())));
    assert!(runs(gate.enter(&flow(1, 1), 100, 1.0, ())));
    let a = ticket(gate.enter(&flow(2, 1), 100, 1.0, ()));
    let b = ticket(gate.enter(&flow(3, 1), 100, 1.0, ()));
    assert_eq!((gate.busy(), gate.waiting()), (2, 2));
    assert_eq!(
        gate.release().map(|l| l.ticket),
        Some(a),
        "a freed slot goes to the first waiter"
    );
    assert_eq!(gate.release().map(|l| l.ticket), Some(b));
    assert_eq!(gate.busy(), 2, "each handed-over slot stays busy");
    assert_eq!(gate.release().map(|l| l.ticket), None);
    assert_eq!(gate.release().map(|l| l.ticket), None);
    assert_eq!(gate.busy(), 0);
    let c = gate.counters();
    assert_eq!((c.immediate, c.waited), (2, 2));
}

#[test]
fn a_higher_band_goes_before_every_lower_bands_waiter() {
    let mut gate = FairGate::<()>::new(1, 16);
    assert!(runs(gate.enter(&flow(0, 2), 1, 1.0, ())));
    let low: Vec<_> = (0..3)
        .map(|_| ticket(gate.enter(&flow(0, 2), 1, 1.0, ())))
        .collect();
    let high = ticket(gate.enter(&flow(1, 0), 1_000_000, 1.0, ()));
    assert_eq!(gate.release().map(|l| l.ticket), Some(high));
    for t in low {
        assert_eq!(gate.release().map(|l| l.ticket), Some(t));
    }
}

#[test]
fn a_light_tenants_prompt_is_not_held_behind_a_noisy_tenants_backlog() {
    let mut gate = FairGate::<()>::new(1, 64);
    assert!(runs(gate.enter(&flow(1, 1), 200_000, 1.0, ())));
    let noisy: Vec<_> = (0..10)
        .map(|_| ticket(gate.enter(&flow(1, 1), 200_000, 1.0, ())))
        .collect();
    let light = ticket(gate.enter(&flow(2, 1), 2_000, 1.0, ()));
    // The noisy tenant's jobs are tagged one after another: the light
    // tenant's starts at the gate's virtual time, before all but the
    // first of them.
    assert_eq!(gate.release().map(|l| l.ticket), Some(light));
    for t in noisy {
        assert_eq!(gate.release().map(|l| l.ticket), Some(t));
    }
}

#[test]
fn backlogged_tenants_are_let_through_in_proportion_to_their_weights() {
    let mut gate = FairGate::<()>::new(1, 1024);
    assert!(runs(gate.enter(&flow(9, 0), 1, 1.0, ())));
    let mut owner = FxHashMap::default();
    for _ in 0..200 {
        owner.insert(ticket(gate.enter(&flow(1, 0), 1_000, 3.0, ())), 1u16);
        owner.insert(ticket(gate.enter(&flow(2, 0), 1_000, 1.0, ())), 2u16);
    }
    let mut counts = [0u32; 3];
    for _ in 0..100 {
        let t = gate.release().map(|l| l.ticket).expect("a waiter");
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
        assert!(runs(gate.enter(&flow(1, 0), 1_000, 1.0, ())));
        assert_eq!(gate.release().map(|l| l.ticket), None);
    }
    assert!(runs(gate.enter(&flow(1, 0), 1_000, 1.0, ())));
    let quiet = ticket(gate.enter(&flow(2, 0), 1_000, 1.0, ()));
    let busy = ticket(gate.enter(&flow(1, 0), 1_000, 1.0, ()));
    let quiet_again = ticket(gate.enter(&flow(2, 0), 1_000, 1.0, ()));
    // The newcomer starts at the virtual time, not at zero: it gets its
    // turn, then alternates rather than running 50 jobs in a row.
    assert_eq!(gate.release().map(|l| l.ticket), Some(quiet));
    assert_eq!(gate.release().map(|l| l.ticket), Some(busy));
    assert_eq!(gate.release().map(|l| l.ticket), Some(quiet_again));
}

#[test]
fn a_cancelled_waiter_is_skipped_and_counted() {
    let mut gate = FairGate::<()>::new(1, 16);
    assert!(runs(gate.enter(&flow(0, 0), 1, 1.0, ())));
    let a = ticket(gate.enter(&flow(0, 0), 1, 1.0, ()));
    let b = ticket(gate.enter(&flow(1, 0), 1, 1.0, ()));
    assert!(gate.cancel(a).is_some());
    assert!(gate.cancel(a).is_none(), "only once");
    assert_eq!(gate.release().map(|l| l.ticket), Some(b));
    assert!(gate.cancel(b).is_none(), "already let through");
    assert_eq!(gate.release().map(|l| l.ticket), None);
    assert_eq!(gate.counters().cancelled, 1);
    assert_eq!((gate.busy(), gate.waiting()), (0, 0));
}

#[test]
fn waiters_beyond_the_cap_are_refused_and_counted() {
    let mut gate = FairGate::<()>::new(1, 2);
    assert!(runs(gate.enter(&flow(0, 0), 1, 1.0, ())));
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
        assert!(runs(gate.enter(&flow(0, 0), u64::MAX, weight, ())));
        assert_eq!(gate.release().map(|l| l.ticket), None);
    }
}

/// The naive model: every live waiter in a list, the least
/// (band, tag, arrival) taken by a scan; each running job's turn as
/// (band, start, weight).
#[derive(Default)]
struct Model {
    slots: usize,
    busy: usize,
    max_waiting: usize,
    /// (band, tag, arrival, weight, paused)
    waiting: Vec<(u8, f64, u64, f64, bool)>,
    finish: std::collections::BTreeMap<u16, f64>,
    virtual_time: f64,
    next: u64,
}

type ModelTurn = (u8, f64, f64);

impl Model {
    fn enter(
        &mut self,
        tenant: u16,
        band: u8,
        cost: u64,
        weight: f64,
    ) -> (Shape, Option<ModelTurn>) {
        let start = self
            .virtual_time
            .max(self.finish.get(&tenant).copied().unwrap_or(0.0));
        let run = self.busy < self.slots && self.waiting.is_empty();
        if !run && self.waiting.len() >= self.max_waiting {
            return (Shape::Full, None);
        }
        self.finish.insert(tenant, start + cost as f64 / weight);
        if run {
            self.busy += 1;
            self.virtual_time = start;
            return (Shape::Run, Some((band, start, weight)));
        }
        (Shape::Wait(self.push(band, start, weight, false)), None)
    }

    fn push(&mut self, band: u8, tag: f64, weight: f64, paused: bool) -> GateTicket {
        let t = self.next;
        self.next += 1;
        self.waiting.push((band, tag, t, weight, paused));
        GateTicket(t)
    }

    fn best(&self) -> Option<usize> {
        (0..self.waiting.len()).min_by(|&i, &j| {
            let (a, b) = (self.waiting[i], self.waiting[j]);
            (a.0, a.1.to_bits(), a.2).cmp(&(b.0, b.1.to_bits(), b.2))
        })
    }

    /// The ticket let through, and its turn when it had not run before.
    fn release(&mut self) -> Option<(GateTicket, bool, ModelTurn)> {
        match self.best() {
            Some(i) => {
                let (band, start, t, weight, paused) = self.waiting.remove(i);
                self.virtual_time = self.virtual_time.max(start);
                Some((GateTicket(t), paused, (band, start, weight)))
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

    fn should_pause(&self, turn: ModelTurn, done: u64) -> bool {
        let paused = self.waiting.iter().filter(|w| w.4).count();
        if paused >= self.slots * PAUSED_PER_SLOT {
            return false;
        }
        let progress = turn.1 + done as f64 / turn.2;
        self.best()
            .is_some_and(|i| (self.waiting[i].0, self.waiting[i].1) < (turn.0, progress))
    }
}

#[test]
fn a_noisy_prompt_under_way_pauses_for_a_light_tenants_and_resumes_before_its_next() {
    let mut gate = FairGate::<&str>::new(1, 16);
    let Entry::Run(noisy) = gate.enter(&flow(1, 1), 200_000, 1.0, "noisy 1") else {
        panic!("a free slot runs at once");
    };
    ticket(gate.enter(&flow(1, 1), 200_000, 1.0, "noisy 2"));
    assert!(
        !gate.should_pause(&noisy, 0),
        "nobody is owed anything before the work starts"
    );
    let light = ticket(gate.enter(&flow(2, 1), 20_000, 1.0, "light"));
    assert!(!gate.should_pause(&noisy, 0));
    assert!(
        gate.should_pause(&noisy, 64_000),
        "the light tenant's tag is before the noisy prompt's progress"
    );
    let resumed = gate.requeue(&noisy, 64_000, "noisy 1, paused");
    let next = gate.release().expect("the slot is handed on");
    assert_eq!((next.ticket, next.waiter), (light, "light"));
    assert!(
        !gate.should_pause(&next.turn, 20_000),
        "the light prompt runs to its end: the paused one's tag is after it"
    );
    let after = gate.release().expect("the paused prompt is next");
    assert_eq!(
        (after.ticket, after.waiter),
        (resumed, "noisy 1, paused"),
        "it resumes before its tenant's next prompt"
    );
    assert_eq!(gate.release().map(|l| l.waiter), Some("noisy 2"));
    assert_eq!(gate.counters().paused, 1);
}

#[test]
fn a_prompt_of_the_same_tenant_or_a_lower_band_does_not_pause_one_under_way() {
    let mut gate = FairGate::<()>::new(1, 16);
    let Entry::Run(turn) = gate.enter(&flow(1, 1), 200_000, 1.0, ()) else {
        panic!("a free slot runs at once");
    };
    ticket(gate.enter(&flow(1, 1), 1_000, 1.0, ()));
    ticket(gate.enter(&flow(2, 2), 1_000, 1.0, ()));
    assert!(!gate.should_pause(&turn, 199_999));
    ticket(gate.enter(&flow(3, 0), 1_000, 1.0, ()));
    assert!(
        gate.should_pause(&turn, 0),
        "a higher band goes first at once"
    );
}

#[test]
fn paused_jobs_are_bounded() {
    let mut gate = FairGate::<()>::new(1, 64);
    let Entry::Run(mut turn) = gate.enter(&flow(0, 1), 1_000_000, 1.0, ()) else {
        panic!("a free slot runs at once");
    };
    for tenant in 1..=PAUSED_PER_SLOT as u16 {
        // Each newcomer pauses the job under way, then is let through
        // and is itself paused by the next one.
        ticket(gate.enter(&flow(tenant, 1), 1_000_000, 1.0, ()));
        assert!(gate.should_pause(&turn, 1_000));
        gate.requeue(&turn, 1_000, ());
        turn = gate.release().expect("the newcomer").turn;
    }
    ticket(gate.enter(&flow(99, 1), 1_000, 1.0, ()));
    assert!(
        !gate.should_pause(&turn, 1_000),
        "{PAUSED_PER_SLOT} jobs are paused already"
    );
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
    /// The running job at this index (modulo) asks whether to pause with
    /// this much done, and pauses if told to.
    Pause(usize, u64),
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
        (0usize..4, 0u64..5_000).prop_map(|(i, done)| Op::Pause(i, done)),
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
        // The running jobs' turns on both sides, in the order they ran; a
        // release ends the oldest; paused jobs keep theirs aside.
        let mut running: Vec<(Turn, ModelTurn)> = Vec::new();
        let mut paused: FxHashMap<GateTicket, (Turn, ModelTurn)> = FxHashMap::default();
        // Waiters let through get a turn when they had not run before.
        let let_through = |l: LetThrough<()>, m: (GateTicket, bool, ModelTurn),
                               running: &mut Vec<(Turn, ModelTurn)>,
                               paused: &mut FxHashMap<GateTicket, (Turn, ModelTurn)>| {
            assert_eq!(l.ticket, m.0);
            let turns = if m.1 { paused.remove(&l.ticket).expect("a paused job") } else { (l.turn, m.2) };
            running.push(turns);
        };
        for op in ops {
            match op {
                Op::Enter { tenant, band, cost, weight } => {
                    let f = flow(tenant, band);
                    let entry = gate.enter(&f, cost, f64::from(weight), ());
                    let (want, turn) = model.enter(tenant, band, cost, f64::from(weight));
                    if let (Entry::Run(t), Some(m)) = (entry, turn) {
                        running.push((t, m));
                    }
                    prop_assert_eq!(shape(entry), want);
                }
                Op::Release => {
                    if running.is_empty() {
                        continue;
                    }
                    running.remove(0);
                    match (gate.release(), model.release()) {
                        (Some(l), Some(m)) => let_through(l, m, &mut running, &mut paused),
                        (None, None) => {}
                        (got, want) => prop_assert!(false, "gate {:?}, model {:?}", got.map(|l| l.ticket), want.map(|m| m.0)),
                    }
                }
                Op::Cancel(t) => {
                    if paused.contains_key(&GateTicket(t)) {
                        continue;
                    }
                    prop_assert_eq!(gate.cancel(GateTicket(t)).is_some(), model.cancel(GateTicket(t)))
                }
                Op::Pause(i, done) => {
                    if running.is_empty() {
                        continue;
                    }
                    let i = i % running.len();
                    let (turn, m) = running[i];
                    let pause = gate.should_pause(&turn, done);
                    prop_assert_eq!(pause, model.should_pause(m, done));
                    if pause {
                        running.remove(i);
                        let t = gate.requeue(&turn, done, ());
                        prop_assert_eq!(model.push(m.0, m.1 + done as f64 / m.2, m.2, true), t);
                        paused.insert(t, (turn, m));
                        match (gate.release(), model.release()) {
                            (Some(l), Some(m)) => let_through(l, m, &mut running, &mut paused),
                            (got, want) => prop_assert!(false, "gate {:?}, model {:?}", got.map(|l| l.ticket), want.map(|m| m.0)),
                        }
                    }
                }
            }
            prop_assert_eq!(gate.busy(), model.busy);
            prop_assert_eq!(gate.busy(), running.len());
            prop_assert_eq!(gate.waiting(), model.waiting.len());
            prop_assert!(gate.busy() <= slots);
        }
    }
}
