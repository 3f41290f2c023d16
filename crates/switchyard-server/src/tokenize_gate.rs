//! The tokenizing gate: long prompts (those tokenized on a blocking
//! thread, [`crate::tokenize::INLINE_CHARS`]) take one of a few slots —
//! one per core by default — handed out by the core's
//! [`FairGate`]: the highest band first, then each tenant's weighted fair
//! share of the bytes tokenized. Flow control orders requests once they
//! are tokenized; this orders the tokenizing itself, so that on a router
//! whose CPU is saturated a light tenant's prompt is not tokenized behind
//! a noisy tenant's 200 KB prompts.
//!
//! A waiter that gives up (its client went away) leaves the line; a slot
//! whose holder is dropped is handed to the next waiter. Beyond
//! [`MAX_WAITING`] waiters a request gets a 503 (counted).

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::MetricType;
use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use switchyard_core::admission::gate::{Entry, FairGate, GateTicket};
use switchyard_core::admission::Flow;
use tokio::sync::oneshot;

/// Prompts waiting for a slot at most; beyond, a request is refused.
pub const MAX_WAITING: usize = 4096;

/// See the module documentation.
#[derive(Debug)]
pub struct TokenizeGate {
    inner: Mutex<Inner>,
    slots: usize,
}

#[derive(Debug)]
struct Inner {
    gate: FairGate,
    /// The waiters' wake-ups, one per waiting ticket.
    wakers: HashMap<GateTicket, oneshot::Sender<()>>,
}

/// The gate was full: too many prompts waiting.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GateFull;

/// A slot, held while a prompt is tokenized; dropping it hands the slot
/// to the next waiter.
#[derive(Debug)]
pub struct Slot {
    gate: Arc<TokenizeGate>,
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.gate.pass_on(&mut self.gate.lock());
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
        let mut inner = self.gate.lock();
        if inner.gate.cancel(self.ticket) {
            inner.wakers.remove(&self.ticket);
        } else {
            // Let through while going away: the slot is ours to pass on.
            self.gate.pass_on(&mut inner);
        }
    }
}

impl TokenizeGate {
    /// A gate of `slots` slots (at least 1).
    pub fn new(slots: usize) -> Arc<Self> {
        let slots = slots.max(1);
        Arc::new(Self {
            inner: Mutex::new(Inner {
                gate: FairGate::new(slots, MAX_WAITING),
                wakers: HashMap::new(),
            }),
            slots,
        })
    }

    /// A gate of one slot per core this process may use.
    pub fn per_core() -> Arc<Self> {
        Self::new(std::thread::available_parallelism().map_or(1, usize::from))
    }

    /// Its slots.
    pub fn slots(&self) -> usize {
        self.slots
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Waits for a slot for a prompt of `flow` of `bytes` bytes, its
    /// tenant weighing `weight`.
    pub async fn enter(
        self: &Arc<Self>,
        flow: &Flow,
        bytes: usize,
        weight: f64,
    ) -> Result<Slot, GateFull> {
        let (ticket, woken) = {
            let mut inner = self.lock();
            match inner.gate.enter(flow, bytes as u64, weight) {
                Entry::Run => return Ok(Slot { gate: self.clone() }),
                Entry::Full => return Err(GateFull),
                Entry::Wait(ticket) => {
                    let (tx, rx) = oneshot::channel();
                    inner.wakers.insert(ticket, tx);
                    (ticket, rx)
                }
            }
        };
        let mut waiter = Waiter {
            gate: self.clone(),
            ticket,
            done: false,
        };
        // The sender is only dropped when the ticket is let through (sent)
        // or cancelled (by this waiter's drop), so this cannot fail while
        // the waiter lives; if it ever did, the slot is still handed on.
        let _ = woken.await;
        waiter.done = true;
        Ok(Slot { gate: self.clone() })
    }

    /// A slot is free: wakes the next waiter with it, or leaves it free.
    fn pass_on(&self, inner: &mut Inner) {
        while let Some(ticket) = inner.gate.release() {
            if let Some(tx) = inner.wakers.remove(&ticket) {
                if tx.send(()).is_ok() {
                    return;
                }
            }
        }
    }
}

/// The gate's series, read at scrape time.
#[derive(Debug)]
pub struct TokenizeGateCollector(pub Arc<TokenizeGate>);

impl Collector for TokenizeGateCollector {
    fn encode(&self, mut encoder: DescriptorEncoder<'_>) -> std::fmt::Result {
        let (counters, busy, waiting) = {
            let inner = self.0.lock();
            (
                inner.gate.counters(),
                inner.gate.busy(),
                inner.gate.waiting(),
            )
        };
        for (name, help, value) in [
            (
                "switchyard_tokenize_gate_immediate",
                "Long prompts tokenized at once (a slot was free).",
                counters.immediate,
            ),
            (
                "switchyard_tokenize_gate_waited",
                "Long prompts that waited for a tokenizing slot (by band, then tenant fair share).",
                counters.waited,
            ),
            (
                "switchyard_tokenize_gate_cancelled",
                "Long prompts whose client went away while waiting for a tokenizing slot.",
                counters.cancelled,
            ),
            (
                "switchyard_tokenize_gate_refused",
                "Requests refused with 503 because too many prompts waited for a tokenizing slot.",
                counters.refused,
            ),
        ] {
            ConstCounter::new(value).encode(encoder.encode_descriptor(
                name,
                help,
                None,
                MetricType::Counter,
            )?)?;
        }
        for (name, help, value) in [
            (
                "switchyard_tokenize_gate_slots",
                "Tokenizing slots for long prompts (one per core).",
                self.0.slots,
            ),
            (
                "switchyard_tokenize_gate_busy",
                "Tokenizing slots in use.",
                busy,
            ),
            (
                "switchyard_tokenize_gate_waiting",
                "Long prompts waiting for a tokenizing slot.",
                waiting,
            ),
        ] {
            ConstGauge::new(value as i64).encode(encoder.encode_descriptor(
                name,
                help,
                None,
                MetricType::Gauge,
            )?)?;
        }
        Ok(())
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
            while gate.lock().gate.waiting() < tasks.len() {
                tokio::task::yield_now().await;
            }
        }
        drop(held);
        for t in tasks {
            t.await.unwrap();
        }
        assert_eq!(*order.lock().unwrap(), ["light", "noisy", "noisy"]);
        let inner = gate.lock();
        assert_eq!((inner.gate.busy(), inner.gate.waiting()), (0, 0));
        assert!(inner.wakers.is_empty());
    }

    #[tokio::test]
    async fn a_waiter_that_gives_up_leaves_the_line_and_loses_no_slot() {
        let gate = TokenizeGate::new(1);
        let held = gate.enter(&flow(1), 10, 1.0).await.unwrap();
        let gave_up =
            tokio::time::timeout(Duration::from_millis(20), gate.enter(&flow(2), 10, 1.0)).await;
        assert!(gave_up.is_err(), "no slot while one is held");
        assert_eq!(gate.lock().gate.counters().cancelled, 1);
        drop(held);
        // The slot came back: the next prompt runs at once.
        let again = gate.enter(&flow(3), 10, 1.0).await.unwrap();
        assert_eq!(gate.lock().gate.busy(), 1);
        drop(again);
        assert_eq!(gate.lock().gate.busy(), 0);
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
        while gate.lock().gate.waiting() < 2 {
            tokio::task::yield_now().await;
        }
        // The slot goes to `first`, which is dropped without taking it.
        drop(held);
        drop(first);
        second.await.unwrap().unwrap();
        assert_eq!(gate.lock().gate.busy(), 0);
    }
}
