//! Router replicas in the simulator: how many, how they sync, how a load
//! balancer spreads requests over them, and what their staleness cost.
//!
//! Each replica is a whole routing core (its own `Router` and admission
//! controller), as each `switchyard serve` process is. Engine KV events reach
//! every replica (they all subscribe to the engines). A replica's own
//! bookings (`Add`, `MarkPrefillCompleted`, `Free`) apply on it at once and
//! reach its peers `sync_delay_ms` later through `Router::apply_remote`, the
//! same remote-booking code the server's replica plane runs; with sync off
//! peers never learn of them.
//!
//! Choices the model makes, and why:
//!
//! - **Delay** is one constant per run (no jitter), so a run stays a pure
//!   function of its configuration; per-request order (add, mark, free) is
//!   kept, as the real publisher keeps it. A delay of 0 applies an event on
//!   every peer in the same instant, before any other event, so every
//!   replica's view equals every other's after each event.
//! - **Default delay** [`DEFAULT_SYNC_DELAY_MS`] = 7 ms: the p99 of the
//!   measured booking → visibility latency over local NATS (`bench
//!   replica`: p50 2.3 ms, p99 6.9 ms). The p99 rather than the median
//!   because a burst's later events wait behind its batch, and replicas on
//!   other machines add a network hop: better to overstate staleness than
//!   hide it.
//! - **Load balancer**: round-robin over requests by default, or uniformly
//!   random (seeded). With session-aware admission a session's turns stay on
//!   the replica of its first turn (a session-affinity balancer): each
//!   replica's session strategy then sees all turns of its sessions, which is
//!   what it needs to serialize them; the server's cross-replica session
//!   bindings are not modeled.
//! - **Tie-breaks**: replica 0 uses the router seed, replica `r` a seed
//!   derived from it, so replicas do not break exact cost ties in lockstep.
//! - **Heartbeats** are not simulated: every remote booking in these runs
//!   ends long before the 300 s silence expiry.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::{Deserialize, Serialize};

/// Default booking → visibility delay between replicas (see the module docs).
pub const DEFAULT_SYNC_DELAY_MS: f64 = 7.0;

/// How a load balancer spreads requests over replicas.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Balance {
    /// Each request to the next replica in turn.
    #[default]
    RoundRobin,
    /// Each request to a uniformly random replica (seeded).
    Random,
}

/// Router replicas in front of the simulated fleet.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ReplicasConfig {
    /// Router replicas (1: the single router).
    pub count: usize,
    /// Peers apply each other's bookings; `false`: they never learn of them.
    pub sync: bool,
    /// Delay from a replica's booking event to its peers applying it.
    pub sync_delay_ms: f64,
    /// How requests are spread over replicas.
    pub balance: Balance,
}

impl Default for ReplicasConfig {
    fn default() -> Self {
        Self {
            count: 1,
            sync: true,
            sync_delay_ms: DEFAULT_SYNC_DELAY_MS,
            balance: Balance::RoundRobin,
        }
    }
}

/// Why a [`ReplicasConfig`] was refused.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum ReplicasConfigError {
    /// No replica.
    #[error("replicas must be at least 1")]
    Count,
    /// A delay that is negative or not finite.
    #[error("sync_delay_ms must be finite and >= 0, got {0}")]
    Delay(f64),
}

impl ReplicasConfig {
    /// Checks ranges.
    pub fn validate(&self) -> Result<(), ReplicasConfigError> {
        if self.count == 0 {
            return Err(ReplicasConfigError::Count);
        }
        if !(self.sync_delay_ms.is_finite() && self.sync_delay_ms >= 0.0) {
            return Err(ReplicasConfigError::Delay(self.sync_delay_ms));
        }
        Ok(())
    }

    /// Whether bookings travel between replicas at all.
    pub fn shares_bookings(&self) -> bool {
        self.sync && self.count > 1
    }
}

/// The router seed of replica `index`: the configured seed for replica 0
/// (so one replica is the single router), a distinct derived seed for the
/// others.
pub fn replica_seed(seed: u64, index: usize) -> u64 {
    if index == 0 {
        seed
    } else {
        seed ^ (index as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15)
    }
}

/// The load balancer in front of the replicas.
#[derive(Debug)]
pub struct Balancer {
    count: usize,
    balance: Balance,
    next: usize,
    rng: StdRng,
}

impl Balancer {
    /// A balancer over `count` replicas (at least 1), seeded by `seed`.
    pub fn new(config: &ReplicasConfig, seed: u64) -> Self {
        Self {
            count: config.count.max(1),
            balance: config.balance,
            next: 0,
            rng: StdRng::seed_from_u64(seed ^ 0xB41A_4CE5),
        }
    }

    /// The replica that receives the next request.
    pub fn pick(&mut self) -> usize {
        if self.count == 1 {
            return 0;
        }
        match self.balance {
            Balance::RoundRobin => {
                let r = self.next;
                self.next = (self.next + 1) % self.count;
                r
            }
            Balance::Random => self.rng.gen_range(0..self.count),
        }
    }
}

/// What replicas did during a run, and what their stale views cost.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct ReplicaStats {
    /// Router replicas.
    pub replicas: usize,
    /// Whether bookings were shared.
    pub sync: bool,
    /// Delay of shared bookings.
    pub sync_delay_ms: f64,
    /// Requests each replica routed.
    pub routed_per_replica: Vec<u64>,
    /// Peer events that changed a replica's state.
    pub remote_applied: u64,
    /// Peer events that changed nothing (a `Free` or mark of a request the
    /// peer had not yet heard of or had already dropped).
    pub remote_ignored: u64,
    /// Mean, over routing decisions, of |active requests the routing replica
    /// sees − active requests booked fleet-wide|.
    pub view_error_requests: f64,
    /// Mean, over dispatches, of the chosen worker's true active requests
    /// minus the least-loaded worker's: 0 when every choice went to a
    /// least-loaded worker.
    pub excess_requests: f64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_robin_visits_every_replica_in_turn() {
        let config = ReplicasConfig {
            count: 3,
            ..ReplicasConfig::default()
        };
        let mut b = Balancer::new(&config, 0);
        let picks: Vec<usize> = (0..6).map(|_| b.pick()).collect();
        assert_eq!(picks, vec![0, 1, 2, 0, 1, 2]);
    }

    #[test]
    fn random_balance_is_seeded_and_covers_every_replica() {
        let config = ReplicasConfig {
            count: 4,
            balance: Balance::Random,
            ..ReplicasConfig::default()
        };
        let picks = |seed| {
            let mut b = Balancer::new(&config, seed);
            (0..400).map(|_| b.pick()).collect::<Vec<_>>()
        };
        assert_eq!(picks(3), picks(3));
        for r in 0..4 {
            let n = picks(3).iter().filter(|&&p| p == r).count();
            assert!((60..140).contains(&n), "replica {r}: {n} of 400");
        }
    }

    #[test]
    fn one_replica_keeps_the_router_seed_and_others_differ() {
        assert_eq!(replica_seed(42, 0), 42);
        assert_ne!(replica_seed(42, 1), 42);
        assert_ne!(replica_seed(42, 1), replica_seed(42, 2));
    }

    #[test]
    fn bad_replica_settings_are_refused() {
        let zero = ReplicasConfig {
            count: 0,
            ..ReplicasConfig::default()
        };
        assert_eq!(zero.validate(), Err(ReplicasConfigError::Count));
        let negative = ReplicasConfig {
            sync_delay_ms: -1.0,
            ..ReplicasConfig::default()
        };
        assert_eq!(negative.validate(), Err(ReplicasConfigError::Delay(-1.0)));
        assert!(ReplicasConfig::default().validate().is_ok());
    }
}
