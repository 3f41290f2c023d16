//! A fair gate: a few slots of a resource the router spends before a
//! request reaches the policy queue (the CPU that tokenizes long
//! prompts), handed out in the policy queue's order — the highest band
//! first, then within a band by each tenant's weighted fair share of the
//! work — so that a noisy tenant's long prompts do not hold a light
//! tenant's behind them.
//!
//! The share is start-time fair queueing on the work's cost (for
//! tokenizing, the prompt's bytes): a job's start tag is the later of
//! the gate's virtual time and its tenant's last finish tag, its finish
//! tag the start plus cost over the tenant's weight; waiting jobs run in
//! order of (band, start tag, arrival), and the virtual time is the start
//! tag of the job last let through. A tenant idle for a while comes back
//! at the current virtual time: it banks no credit.
//!
//! A job that runs long can hand its slot on part way
//! ([`FairGate::should_pause`], [`FairGate::requeue`]): between pieces of
//! its work it asks whether a waiter's tag is before its own progress (its
//! start tag plus the cost done so far over its weight) — a light
//! tenant's prompt that arrived while a noisy tenant's 200 KB prompt is
//! being tokenized — and if so waits again at that progress, its cost
//! already charged, so the waiter runs first and the paused job resumes
//! before its tenant's next job. At most `slots` × [`PAUSED_PER_SLOT`]
//! jobs are paused at once (each holds a thread of the driver's).
//!
//! Sans-I/O: each waiter carries the driver's `W` (the server's: how to
//! wake it), which the gate hands back with the slot
//! ([`FairGate::release`]) or when the waiter gives up
//! ([`FairGate::cancel`]); the driver holds the gate behind its lock. The
//! state is bounded: one finish tag per tenant id (a `u16`), and at most
//! `max_waiting` waiters (beyond: refused).

use super::tenants::Flow;
use crate::maps::FxHashMap;
use std::cmp::Reverse;
use std::collections::BinaryHeap;

/// A waiter's handle.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct GateTicket(pub u64);

/// Jobs paused part way at most, per slot.
pub const PAUSED_PER_SLOT: usize = 4;

/// A running job's place in the fair order, kept by its driver to ask
/// [`FairGate::should_pause`]: its band, its start tag and its weight.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Turn {
    band: u8,
    start: f64,
    weight: f64,
}

impl Turn {
    /// The job's progress tag with `done` of its cost done.
    fn progress(&self, done: u64) -> f64 {
        self.start + done as f64 / self.weight
    }
}

/// A waiter let through by [`FairGate::release`]: its slot is now taken.
#[derive(Debug)]
pub struct LetThrough<W> {
    /// Its ticket.
    pub ticket: GateTicket,
    /// Its place, for [`FairGate::should_pause`] (a job resumed after a
    /// pause keeps the turn it started with).
    pub turn: Turn,
    /// What the driver left with it.
    pub waiter: W,
}

/// What [`FairGate::enter`] decided.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Entry {
    /// A slot is the caller's: run now, then [`FairGate::release`].
    Run(Turn),
    /// Wait until [`FairGate::release`] returns this ticket (the slot is
    /// then the caller's).
    Wait(GateTicket),
    /// Too many waiters already.
    Full,
}

/// Counters for metrics; they only grow.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GateCounters {
    /// Jobs that ran at once.
    pub immediate: u64,
    /// Jobs that waited for a slot.
    pub waited: u64,
    /// Waiters that gave up before their turn.
    pub cancelled: u64,
    /// Jobs refused because `max_waiting` jobs waited.
    pub refused: u64,
    /// Times a running job handed its slot on part way.
    pub paused: u64,
}

/// A live waiter: its weight, whether it is a paused job, and the
/// driver's `W`.
#[derive(Debug)]
struct Waiting<W> {
    weight: f64,
    paused: bool,
    waiter: W,
}

/// Heap order: band (0 first), start tag (as ordered bits of a
/// non-negative float), arrival.
type Key = Reverse<(u8, u64, u64)>;

/// See the module documentation.
#[derive(Debug)]
pub struct FairGate<W> {
    slots: usize,
    busy: usize,
    max_waiting: usize,
    waiting: BinaryHeap<Key>,
    /// Live waiters and what the driver left with each (a cancelled
    /// one's heap key goes stale).
    live: FxHashMap<u64, Waiting<W>>,
    /// Of them, paused jobs.
    paused: usize,
    finish: FxHashMap<u16, f64>,
    virtual_time: f64,
    next: u64,
    counters: GateCounters,
}

impl<W> FairGate<W> {
    /// A gate of `slots` slots (at least 1) holding at most `max_waiting`
    /// waiters.
    pub fn new(slots: usize, max_waiting: usize) -> Self {
        Self {
            slots: slots.max(1),
            busy: 0,
            max_waiting,
            waiting: BinaryHeap::new(),
            live: FxHashMap::default(),
            paused: 0,
            finish: FxHashMap::default(),
            virtual_time: 0.0,
            next: 0,
            counters: GateCounters::default(),
        }
    }

    /// A job of `flow` costing `cost` (weighted by its tenant's `weight`,
    /// at least a small positive value) asks for a slot. It runs at once
    /// only when a slot is free and nobody waits; else it waits, holding
    /// `waiter` (dropped when it runs at once or is refused).
    pub fn enter(&mut self, flow: &Flow, cost: u64, weight: f64, waiter: W) -> Entry {
        let weight = sane_weight(weight);
        let start = self
            .virtual_time
            .max(self.finish.get(&flow.tenant.0).copied().unwrap_or(0.0));
        let run_now = self.busy < self.slots && self.live.is_empty();
        if !run_now && self.live.len() >= self.max_waiting {
            self.counters.refused += 1;
            return Entry::Full;
        }
        self.finish
            .insert(flow.tenant.0, start + cost as f64 / weight);
        if run_now {
            self.busy += 1;
            self.virtual_time = start;
            self.counters.immediate += 1;
            return Entry::Run(Turn {
                band: flow.band.0,
                start,
                weight,
            });
        }
        self.counters.waited += 1;
        Entry::Wait(self.push(flow.band.0, start, weight, false, waiter))
    }

    fn push(&mut self, band: u8, tag: f64, weight: f64, paused: bool, waiter: W) -> GateTicket {
        let ticket = self.next;
        self.next += 1;
        self.waiting.push(Reverse((band, tag.to_bits(), ticket)));
        self.live.insert(
            ticket,
            Waiting {
                weight,
                paused,
                waiter,
            },
        );
        self.paused += usize::from(paused);
        GateTicket(ticket)
    }

    /// A job's slot is free: the next waiter (its job now holds the slot),
    /// or `None` (the slot stays free).
    pub fn release(&mut self) -> Option<LetThrough<W>> {
        while let Some(Reverse((band, start, ticket))) = self.waiting.pop() {
            if let Some(w) = self.live.remove(&ticket) {
                let start = f64::from_bits(start);
                self.virtual_time = self.virtual_time.max(start);
                self.paused -= usize::from(w.paused);
                return Some(LetThrough {
                    ticket: GateTicket(ticket),
                    turn: Turn {
                        band,
                        start,
                        weight: w.weight,
                    },
                    waiter: w.waiter,
                });
            }
        }
        self.busy = self.busy.saturating_sub(1);
        if self.live.is_empty() {
            self.waiting.clear();
        }
        None
    }

    /// A waiter gave up before its turn: what it held, or `None` when
    /// `ticket` was not waiting (already let through, or unknown).
    pub fn cancel(&mut self, ticket: GateTicket) -> Option<W> {
        let was = self.live.remove(&ticket.0);
        if let Some(w) = &was {
            self.paused -= usize::from(w.paused);
            self.counters.cancelled += 1;
            if self.live.is_empty() {
                self.waiting.clear();
            } else if self.waiting.len() > 2 * self.live.len() + 16 {
                let live = &self.live;
                self.waiting
                    .retain(|Reverse((_, _, t))| live.contains_key(t));
            }
        }
        was.map(|w| w.waiter)
    }

    /// Whether a job holding a slot on `turn`, with `done` of its cost
    /// done, should hand the slot on: a waiter's tag is before the job's
    /// progress (a higher band, or a tenant owed its share), and fewer
    /// than `slots` × [`PAUSED_PER_SLOT`] jobs are paused.
    pub fn should_pause(&mut self, turn: &Turn, done: u64) -> bool {
        if self.paused >= self.slots.saturating_mul(PAUSED_PER_SLOT) {
            return false;
        }
        // Stale keys of cancelled waiters on top are dropped first.
        while let Some(Reverse((_, _, ticket))) = self.waiting.peek() {
            if self.live.contains_key(ticket) {
                break;
            }
            self.waiting.pop();
        }
        self.waiting.peek().is_some_and(|Reverse((band, tag, _))| {
            (*band, f64::from_bits(*tag)) < (turn.band, turn.progress(done))
        })
    }

    /// A job holding a slot pauses: it waits again at its progress (its
    /// tenant's finish tag unchanged: its whole cost was charged when it
    /// entered), holding `waiter`. The driver then calls
    /// [`Self::release`] to hand the slot on — to the job itself again if
    /// nobody is before it any more — and the job resumes when let
    /// through, with the turn it started with. A paused job cannot be
    /// cancelled (its work is under way); the driver waits for it.
    pub fn requeue(&mut self, turn: &Turn, done: u64, waiter: W) -> GateTicket {
        self.counters.paused += 1;
        self.push(turn.band, turn.progress(done), turn.weight, true, waiter)
    }

    /// Its slots.
    pub fn slots(&self) -> usize {
        self.slots
    }

    /// Jobs holding a slot.
    pub fn busy(&self) -> usize {
        self.busy
    }

    /// Jobs waiting.
    pub fn waiting(&self) -> usize {
        self.live.len()
    }

    /// The counters.
    pub fn counters(&self) -> GateCounters {
        self.counters
    }
}

/// A weight as the gate uses it: at least a small positive value.
fn sane_weight(weight: f64) -> f64 {
    if weight.is_finite() && weight > 1e-6 {
        weight
    } else {
        1e-6
    }
}

#[cfg(test)]
#[path = "gate_tests.rs"]
mod tests;
