//! What one router replica publishes reaching its peers: at once at sync
//! delay zero, otherwise as a scheduled delivery (see [`crate::replicas`]).

use super::event::Event;
use super::Simulation;
use switchyard_core::dispatch::{Published, SessionBound};

impl Simulation {
    /// Sends `origin`'s published events to its peers: at once when the
    /// delay is zero, otherwise as one scheduled delivery.
    pub(super) fn publish(
        &mut self,
        origin: usize,
        events: Vec<Published>,
        bindings: Vec<SessionBound>,
    ) {
        let delay = self.config.replicas.sync_delay_ms;
        if delay == 0.0 {
            self.apply_on_peers(origin, events, bindings);
        } else {
            self.schedule(
                self.now + delay,
                Event::ReplicaSync {
                    origin,
                    events,
                    bindings,
                },
            );
        }
    }

    pub(super) fn apply_on_peers(
        &mut self,
        origin: usize,
        events: Vec<Published>,
        bindings: Vec<SessionBound>,
    ) {
        let from = self.replicas[origin].id;
        for r in 0..self.replicas.len() {
            if r == origin {
                continue;
            }
            let (_, fx) = self.replicas[r].dispatcher.apply_replica_batch(
                from,
                events.iter().map(|e| (from, e.event.clone())),
                bindings.iter().copied(),
                None,
                self.now,
            );
            self.effects.push_back((r, fx));
        }
    }
}
