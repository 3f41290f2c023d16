//! Identities shared by every module.

use serde::{Deserialize, Serialize};
use std::fmt;

/// One engine instance: a worker id plus its data-parallel rank.
///
/// Data-parallel ranks of one engine hold separate KV caches, so each rank is
/// a routing target of its own.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct WorkerId {
    /// The engine instance.
    pub worker_id: u64,
    /// Data-parallel rank within the instance (0 when the engine has one).
    pub dp_rank: u32,
}

impl WorkerId {
    /// A worker with data-parallel rank 0.
    pub const fn new(worker_id: u64) -> Self {
        Self {
            worker_id,
            dp_rank: 0,
        }
    }

    /// A worker's data-parallel rank `dp_rank`.
    pub const fn with_rank(worker_id: u64, dp_rank: u32) -> Self {
        Self { worker_id, dp_rank }
    }
}

impl fmt::Display for WorkerId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.dp_rank == 0 {
            write!(f, "{}", self.worker_id)
        } else {
            write!(f, "{}:{}", self.worker_id, self.dp_rank)
        }
    }
}

/// A request, unique across router replicas (a UUID fits).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct RequestId(pub u128);

impl fmt::Display for RequestId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:032x}", self.0)
    }
}

/// Hash of one block's token ids only (see [`crate::hashing`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct LocalHash(pub u64);

/// Chained hash identifying a whole prefix up to and including one block.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct SequenceHash(pub u64);

/// The opaque id an engine publishes for a block. Mapped to router nodes,
/// never recomputed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct EngineHash(pub u64);

/// One router replica (or another origin of replica events, such as a worker
/// publishing its own prefill marks). Drawn at random at start-up; unique
/// among the replicas of one endpoint.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct ReplicaId(pub u64);

impl fmt::Display for ReplicaId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:016x}", self.0)
    }
}

/// Which workers may serve a request: every worker the router knows, or
/// only those listed — one (a response's worker), several (a model's), or
/// none (nothing can take it now: the request waits or ends, it is never
/// placed elsewhere).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum Eligible {
    /// Any worker.
    #[default]
    Every,
    /// These workers only (none when empty).
    Only(Vec<WorkerId>),
}

impl Eligible {
    /// No worker.
    pub fn none() -> Self {
        Self::Only(Vec::new())
    }

    /// `worker` only.
    pub fn one(worker: WorkerId) -> Self {
        Self::Only(vec![worker])
    }

    /// Whether `worker` may serve the request.
    pub fn allows(&self, worker: WorkerId) -> bool {
        match self {
            Self::Every => true,
            Self::Only(list) => list.contains(&worker),
        }
    }

    /// The workers listed (`None`: every worker).
    pub fn listed(&self) -> Option<&[WorkerId]> {
        match self {
            Self::Every => None,
            Self::Only(list) => Some(list),
        }
    }

    /// Whether every worker may serve it.
    pub fn is_every(&self) -> bool {
        matches!(self, Self::Every)
    }

    /// Whether no worker may.
    pub fn is_none(&self) -> bool {
        matches!(self, Self::Only(list) if list.is_empty())
    }

    /// Heap bytes held.
    pub fn heap_bytes(&self) -> usize {
        match self {
            Self::Every => 0,
            Self::Only(list) => list.capacity() * std::mem::size_of::<WorkerId>(),
        }
    }

    /// These workers but `excluded`, into `out` (every worker of
    /// `all` when [`Eligible::Every`]).
    pub fn without(
        &self,
        all: impl Iterator<Item = WorkerId>,
        excluded: &[WorkerId],
        out: &mut Vec<WorkerId>,
    ) {
        out.clear();
        match self {
            Self::Every => out.extend(all),
            Self::Only(list) => out.extend_from_slice(list),
        }
        out.retain(|w| !excluded.contains(w));
    }
}
