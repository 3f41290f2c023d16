//! The tokenizing gate: long prompts (those tokenized on a blocking
//! thread, [`crate::tokenize::INLINE_CHARS`]) take one of a few slots —
//! one per core by default — handed out by the core's
//! [`FairGate`]: the highest band first, then each tenant's weighted fair
//! share of the bytes tokenized. Flow control orders requests once they
//! are tokenized; this orders the tokenizing itself, so that on a router
//! whose CPU is saturated a light tenant's prompt is not tokenized behind
//! a noisy tenant's 200 KB prompts.
//!
//! Between pieces of a long prompt ([`Slot::pause_point`], on the
//! blocking thread that tokenizes it) the holder asks the gate whether a
//! waiter is owed the slot first — a light tenant's prompt that arrived
//! while a noisy tenant's 200 KB one is under way — and if so hands it
//! on and waits to resume ([`FairGate::should_pause`]): a slot, once
//! taken, no longer runs a 200 KB prompt to its end before a light one.
//!
//! A waiter that gives up (its client went away) leaves the line; a slot
//! whose holder is dropped is handed to the next waiter. Beyond
//! [`MAX_WAITING`] waiters a request gets a 503 (counted).

use crate::metrics::{encode_const_counters, encode_const_gauges};
use prometheus_client::collector::Collector;
use prometheus_client::encoding::DescriptorEncoder;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use switchyard_core::admission::gate::{Entry, FairGate, GateTicket, Turn};
use switchyard_core::admission::Flow;
use tokio::sync::oneshot;

/// Prompts waiting for a slot at most; beyond, a request is refused.
pub const MAX_WAITING: usize = 4096;

/// See the module documentation.
#[derive(Debug)]
pub struct TokenizeGate {
    /// Each waiter holds its wake-up, which hands it its turn.
    gate: Mutex<Gate>,
}

type Gate = FairGate<oneshot::Sender<Turn>>;

/// The gate was full: too many prompts waiting.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GateFull;

/// A slot, held while a prompt is tokenized; dropping it hands the slot
/// to the next waiter.
#[derive(Debug)]
pub struct Slot {
    gate: Arc<TokenizeGate>,
    turn: Turn,
}

impl Slot {
    /// Between pieces of the prompt, `done` bytes of it tokenized: hands
    /// the slot on and blocks until it comes back when a waiter is owed
    /// it first. Called on a blocking thread (it parks the thread).
    pub fn pause_point(&self, done: usize) {
        let mut gate = self.gate.lock();
        if !gate.should_pause(&self.turn, done as u64) {
            return;
        }
        let (wake, woken) = oneshot::channel();
        gate.requeue(&self.turn, done as u64, wake);
        pass_on(&mut gate);
        drop(gate);
        // The gate keeps a paused job's wake-up until it lets it through
        // (it cannot be cancelled), so this returns with the slot ours.
        let _ = woken.blocking_recv();
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        pass_on(&mut self.gate.lock());
    }
}

/// A waiter's place in line; dropped before its turn, it leaves the
/// line (or, let through meanwhile, hands its slot on).
struct Waiter {
    gate: Arc<TokenizeGate>,
    ticket: GateTicket,
    done: bool,
}

impl Drop for Waiter {
    fn drop(&mut self) {
        if self.done {
            return;
        }
        let mut gate = self.gate.lock();
        if gate.cancel(self.ticket).is_none() {
            // Let through while going away: the slot is ours to pass on.
            pass_on(&mut gate);
        }
    }
}

impl TokenizeGate {
    /// A gate of `slots` slots (at least 1).
    pub fn new(slots: usize) -> Arc<Self> {
        Arc::new(Self {
            gate: Mutex::new(FairGate::new(slots, MAX_WAITING)),
        })
    }

    /// A gate of one slot per core this process may use.
    pub fn per_core() -> Arc<Self> {
        Self::new(std::thread::available_parallelism().map_or(1, usize::from))
    }

    /// Its slots.
    pub fn slots(&self) -> usize {
        self.lock().slots()
    }

    fn lock(&self) -> MutexGuard<'_, Gate> {
        self.gate.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Waits for a slot for a prompt of `flow` of `bytes` bytes, its
    /// tenant weighing `weight`.
    pub async fn enter(
        self: &Arc<Self>,
        flow: &Flow,
        bytes: usize,
        weight: f64,
    ) -> Result<Slot, GateFull> {
        let (wake, woken) = oneshot::channel();
        let ticket = match self.lock().enter(flow, bytes as u64, weight, wake) {
            Entry::Run(turn) => {
                return Ok(Slot {
                    gate: self.clone(),
                    turn,
                })
            }
            Entry::Full => return Err(GateFull),
            Entry::Wait(ticket) => ticket,
        };
        let mut waiter = Waiter {
            gate: self.clone(),
            ticket,
            done: false,
        };
        // The sender is only dropped when the ticket is let through (sent)
        // or cancelled (by this waiter's drop), so this cannot fail while
        // the waiter lives.
        let turn = woken.await;
        waiter.done = true;
        match turn {
            Ok(turn) => Ok(Slot {
                gate: self.clone(),
                turn,
            }),
            // Unreachable while the waiter lives (above): a wake-up dropped
            // unsent was taken out of line without a slot.
            Err(_) => Err(GateFull),
        }
    }
}

/// A slot is free: wakes the next waiter with it (past any that went
/// away), or leaves it free.
fn pass_on(gate: &mut Gate) {
    while let Some(next) = gate.release() {
        if next.waiter.send(next.turn).is_ok() {
            return;
        }
    }
}

/// The gate's series, read at scrape time.
#[derive(Debug)]
pub struct TokenizeGateCollector(pub Arc<TokenizeGate>);

impl Collector for TokenizeGateCollector {
    fn encode(&self, mut encoder: DescriptorEncoder<'_>) -> std::fmt::Result {
        let (c, slots, busy, waiting) = {
            let gate = self.0.lock();
            (gate.counters(), gate.slots(), gate.busy(), gate.waiting())
        };
        encode_const_counters(
            &mut encoder,
            &[
                (
                    "switchyard_tokenize_gate_immediate",
                    "Long prompts tokenized at once (a slot was free).",
                    c.immediate,
                ),
                (
                    "switchyard_tokenize_gate_waited",
                    "Long prompts that waited for a tokenizing slot (by band, then tenant fair share).",
                    c.waited,
                ),
                (
                    "switchyard_tokenize_gate_cancelled",
                    "Long prompts whose client went away while waiting for a tokenizing slot.",
                    c.cancelled,
                ),
                (
                    "switchyard_tokenize_gate_refused",
                    "Requests refused with 503 because too many prompts waited for a tokenizing slot.",
                    c.refused,
                ),
                (
                    "switchyard_tokenize_gate_paused",
                    "Times a long prompt being tokenized handed its slot to a waiter owed it first (a higher band, or a tenant under its share), to resume after it.",
                    c.paused,
                ),
            ],
        )?;
        encode_const_gauges(
            &mut encoder,
            &[
                (
                    "switchyard_tokenize_gate_slots",
                    "Tokenizing slots for long prompts (one per core by default).",
                    slots as i64,
                ),
                (
                    "switchyard_tokenize_gate_busy",
                    "Tokenizing slots in use.",
                    busy as i64,
                ),
                (
                    "switchyard_tokenize_gate_waiting",
                    "Long prompts waiting for a tokenizing slot.",
                    waiting as i64,
                ),
            ],
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;
    use switchyard_core::admission::TenantId;

    fn flow(tenant: u16) -> Flow {
        Flow {
            tenant: TenantId(tenant),
            ..Flow::default()
        }
    }

    #[tokio::test]
    async fn a_freed_slot_wakes_the_light_tenant_before_the_noisy_ones_backlog() {
        let gate = TokenizeGate::new(1);
        let held = gate.enter(&flow(1), 200_000, 1.0).await.unwrap();
        let order = Arc::new(Mutex::new(Vec::new()));
        let mut tasks = Vec::new();
        for (name, tenant, bytes) in [
            ("noisy", 1, 200_000),
            ("noisy", 1, 200_000),
            ("light", 2, 2_000),
        ] {
            let (g, order) = (gate.clone(), order.clone());
            tasks.push(tokio::spawn(async move {
                let _slot = g.enter(&flow(tenant), bytes, 1.0).await.unwrap();
                order.lock().unwrap().push(name);
            }));
            // Each is in line before the next asks.
            while gate.lock().waiting() < tasks.len() {
                tokio::task::yield_now().await;
            }
        }
        drop(held);
        for t in tasks {
            t.await.unwrap();
        }
        assert_eq!(*order.lock().unwrap(), ["light", "noisy", "noisy"]);
        let inner = gate.lock();
        assert_eq!((inner.busy(), inner.waiting()), (0, 0));
    }

    #[tokio::test]
    async fn a_prompt_under_way_hands_its_slot_to_a_light_one_and_resumes_after_it() {
        let gate = TokenizeGate::new(1);
        let noisy = gate.enter(&flow(1), 200_000, 1.0).await.unwrap();
        let order = Arc::new(Mutex::new(Vec::new()));
        let light = tokio::spawn({
            let (gate, order) = (gate.clone(), order.clone());
            async move {
                let _slot = gate.enter(&flow(2), 20_000, 1.0).await.unwrap();
                order.lock().unwrap().push("light");
            }
        });
        while gate.lock().waiting() < 1 {
            tokio::task::yield_now().await;
        }
        let o = order.clone();
        tokio::task::spawn_blocking(move || {
            o.lock().unwrap().push("noisy, first piece");
            noisy.pause_point(16_384);
            o.lock().unwrap().push("noisy, the rest");
        })
        .await
        .unwrap();
        light.await.unwrap();
        assert_eq!(
            *order.lock().unwrap(),
            ["noisy, first piece", "light", "noisy, the rest"]
        );
        let inner = gate.lock();
        assert_eq!(inner.counters().paused, 1);
        assert_eq!((inner.busy(), inner.waiting()), (0, 0));
    }

    #[tokio::test]
    async fn a_waiter_that_gives_up_leaves_the_line_and_loses_no_slot() {
        let gate = TokenizeGate::new(1);
        let held = gate.enter(&flow(1), 10, 1.0).await.unwrap();
        let gave_up =
            tokio::time::timeout(Duration::from_millis(20), gate.enter(&flow(2), 10, 1.0)).await;
        assert!(gave_up.is_err(), "no slot while one is held");
        assert_eq!(gate.lock().counters().cancelled, 1);
        drop(held);
        // The slot came back: the next prompt runs at once.
        let again = gate.enter(&flow(3), 10, 1.0).await.unwrap();
        assert_eq!(gate.lock().busy(), 1);
        drop(again);
        assert_eq!(gate.lock().busy(), 0);
    }

    #[tokio::test]
    async fn a_waiter_dropped_after_its_turn_came_hands_the_slot_on() {
        let gate = TokenizeGate::new(1);
        let held = gate.enter(&flow(1), 10, 1.0).await.unwrap();
        let light = flow(2);
        let mut first = Box::pin(gate.enter(&light, 10, 1.0));
        // Polled once: in line.
        let polled = std::future::poll_fn(|cx| {
            std::task::Poll::Ready(std::future::Future::poll(first.as_mut(), cx).is_pending())
        })
        .await;
        assert!(polled, "no slot while one is held");
        let second = tokio::spawn({
            let gate = gate.clone();
            async move { gate.enter(&flow(3), 10, 1.0).await.map(drop) }
        });
        while gate.lock().waiting() < 2 {
            tokio::task::yield_now().await;
        }
        // The slot goes to `first`, which is dropped without taking it.
        drop(held);
        drop(first);
        second.await.unwrap().unwrap();
        assert_eq!(gate.lock().busy(), 0);
    }
}
