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

/// What [`FairGate::enter`] decided.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Entry {
    /// A slot is the caller's: run now, then [`FairGate::release`].
    Run,
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
    live: FxHashMap<u64, W>,
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
        let weight = if weight.is_finite() && weight > 1e-6 {
            weight
        } else {
            1e-6
        };
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
            return Entry::Run;
        }
        let ticket = self.next;
        self.next += 1;
        self.waiting
            .push(Reverse((flow.band.0, start.to_bits(), ticket)));
        self.live.insert(ticket, waiter);
        self.counters.waited += 1;
        Entry::Wait(GateTicket(ticket))
    }

    /// A job's slot is free: the next waiter's ticket and what it holds
    /// (its job now holds the slot), or `None` (the slot stays free).
    pub fn release(&mut self) -> Option<(GateTicket, W)> {
        while let Some(Reverse((_, start, ticket))) = self.waiting.pop() {
            if let Some(waiter) = self.live.remove(&ticket) {
                self.virtual_time = self.virtual_time.max(f64::from_bits(start));
                return Some((GateTicket(ticket), waiter));
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
        if was.is_some() {
            self.counters.cancelled += 1;
            if self.live.is_empty() {
                self.waiting.clear();
            } else if self.waiting.len() > 2 * self.live.len() + 16 {
                let live = &self.live;
                self.waiting
                    .retain(|Reverse((_, _, t))| live.contains_key(t));
            }
        }
        was
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

#[cfg(test)]
#[path = "gate_tests.rs"]
mod tests;
