//! Routes made before the routing lock: the published load board, its
//! publisher, and the lock guard that queues the load changes a call made
//! and applies them once the lock is let go.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, MutexGuard};
use switchyard_core::router::board::{BoardWriter, LoadChange, PreRouter, PreRoutes, Proposal};
use switchyard_core::select::RoutingRequest;

use super::{Driver, Inner, Request};

/// Routing outside the lock (`switchyard_core::router::board`): a
/// request is routed on the published index and load board before the
/// lock is taken, and the dispatcher takes that route as its decision
/// when it places the request at once.
pub(super) struct PreRouting {
    pub(super) routes: PreRoutes,
    pub(super) board: BoardPublisher,
    /// Pre-routers not in use: a placing thread takes one for a route
    /// and puts it back (made on demand: at most one per thread routing
    /// at the same moment).
    pub(super) idle: Mutex<Vec<PreRouter>>,
    /// Whether the last request submitted could go to every worker: the
    /// next one is routed among all before the lock, and its eligibility
    /// checked under it. Requests of a fleet whose models or roles split
    /// the workers are routed under the lock.
    pub(super) every_worker: AtomicBool,
}

/// The board of loads that routes outside the lock read, and its writer.
///
/// Changes leave the dispatcher in order, under its lock, into `queue`
/// (lock order: `inner`, then `queue`); whoever then gets `writer`
/// applies everything queued, after letting go of `inner`, so that
/// neither the changes' second application nor the writer's wait for
/// routes still reading the old copy holds the routing lock. A caller
/// that finds the writer busy leaves its changes to the holder, which
/// looks at the queue again once it lets go.
pub(super) struct BoardPublisher {
    pub(super) queue: Mutex<Vec<LoadChange>>,
    /// The writer and a spare buffer swapped with the queue.
    pub(super) writer: Mutex<(BoardWriter, Vec<LoadChange>)>,
}

impl PreRouting {
    pub(super) fn new(routes: PreRoutes, writer: BoardWriter) -> Self {
        Self {
            routes,
            board: BoardPublisher {
                queue: Mutex::new(Vec::new()),
                writer: Mutex::new((writer, Vec::new())),
            },
            idle: Mutex::new(Vec::new()),
            every_worker: AtomicBool::new(true),
        }
    }
}

impl BoardPublisher {
    /// Applies every change queued, unless another thread is applying
    /// (it will apply ours too).
    pub(super) fn flush(&self) {
        loop {
            {
                let mut held = match self.writer.try_lock() {
                    Ok(held) => held,
                    Err(std::sync::TryLockError::WouldBlock) => return,
                    Err(std::sync::TryLockError::Poisoned(p)) => p.into_inner(),
                };
                let (writer, spare) = &mut *held;
                std::mem::swap(
                    &mut *self.queue.lock().unwrap_or_else(|p| p.into_inner()),
                    spare,
                );
                writer.apply(spare);
            }
            // Changes queued while this thread applied were left to it.
            if self
                .queue
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .is_empty()
            {
                return;
            }
        }
    }
}

/// The router's state as a call holds it; on release the changes it made
/// to the loads are queued for the board, in order, and applied once the
/// lock is let go.
pub(super) struct Locked<'a> {
    pub(super) guard: Option<MutexGuard<'a, Inner>>,
    pub(super) board: Option<&'a BoardPublisher>,
}

impl std::ops::Deref for Locked<'_> {
    type Target = Inner;
    fn deref(&self) -> &Inner {
        self.guard.as_ref().expect("held until dropped")
    }
}

impl std::ops::DerefMut for Locked<'_> {
    fn deref_mut(&mut self) -> &mut Inner {
        self.guard.as_mut().expect("held until dropped")
    }
}

impl Drop for Locked<'_> {
    fn drop(&mut self) {
        let (Some(mut inner), Some(board)) = (self.guard.take(), self.board) else {
            return;
        };
        let queued = {
            let mut queue = board.queue.lock().unwrap_or_else(|p| p.into_inner());
            inner.dispatcher.take_load_changes(&mut queue);
            !queue.is_empty()
        };
        drop(inner);
        // Nothing queued: nothing for this thread to apply (a holder of
        // the writer applies what others queued meanwhile).
        if queued {
            board.flush();
        }
    }
}

impl Driver {
    /// The request routed on the published index and load board, before
    /// the lock (`None` when routing outside the lock is off, the last
    /// request could not go to every worker, or the route must be made
    /// under the lock: see `PreRouter::route`).
    pub(super) fn pre_route(&self, request: &Request<'_>, now: f64) -> Option<Proposal> {
        let pre = self.pre.as_ref()?;
        if !pre.every_worker.load(Ordering::Relaxed) {
            return None;
        }
        let taken = pre.idle.lock().unwrap_or_else(|p| p.into_inner()).pop();
        let mut router = taken.unwrap_or_else(|| pre.routes.router());
        let routing = RoutingRequest {
            prompt_tokens: request.prompt_tokens,
            blocks: &request.blocks,
            adapter: request.adapter,
            model: request.settings,
            headroom: 0.0,
        };
        let proposal = router.route(routing, None, now);
        pre.idle
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(router);
        proposal
    }
}
