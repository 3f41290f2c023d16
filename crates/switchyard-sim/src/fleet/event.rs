//! The event queue's entries: what happens at a simulated instant, ordered
//! by time and then by scheduling order.

use std::cmp::Ordering;
use switchyard_core::dispatch::{Published, SessionBound};
use switchyard_core::index::{CacheTier, IndexEvent};
use switchyard_core::RequestId;
use switchyard_engine::lease::LeasedKv;
use switchyard_engine::NewRequest;

#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) struct At(pub(super) f64);

impl Eq for At {}

impl PartialOrd for At {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for At {
    fn cmp(&self, other: &Self) -> Ordering {
        self.0.total_cmp(&other.0)
    }
}

#[derive(Debug)]
pub(super) enum Event {
    /// The next session from the stream arrives.
    NextSession,
    /// Turn `turn` of an active session arrives.
    Turn { session: u64, turn: usize },
    /// A worker's running step completes (of its engine `epoch`).
    StepDone { worker: usize, epoch: u64 },
    /// A worker fails ([`super::WorkerFailure`]).
    WorkerDown { worker: usize },
    /// A failed worker is back, empty.
    WorkerUp { worker: usize },
    /// KV events reach the routers.
    KvDelivery {
        worker: usize,
        events: Vec<(CacheTier, IndexEvent)>,
    },
    /// A replica's dispatcher asked to be ticked.
    Tick { replica: usize },
    /// A replica's published events reach its peers.
    ReplicaSync {
        origin: usize,
        events: Vec<Published>,
        bindings: Vec<SessionBound>,
    },
    /// A LoRA adapter is loaded: its request may start.
    AdapterReady {
        worker: usize,
        replica: usize,
        session: u64,
        request: NewRequest,
    },
    /// A captured prefix reaches the decode worker of `request`.
    Transfer {
        worker: usize,
        request: RequestId,
        kv: LeasedKv,
    },
}

pub(super) struct Scheduled {
    pub(super) at: At,
    pub(super) seq: u64,
    pub(super) event: Event,
}

impl PartialEq for Scheduled {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}

impl Eq for Scheduled {}

impl PartialOrd for Scheduled {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for Scheduled {
    /// Reversed: the heap pops the earliest, then the first scheduled.
    fn cmp(&self, other: &Self) -> Ordering {
        other.at.cmp(&self.at).then(other.seq.cmp(&self.seq))
    }
}
