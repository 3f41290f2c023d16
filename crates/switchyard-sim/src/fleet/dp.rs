//! Attention data-parallel ranks: a worker that holds several ranks, each
//! its own engine (its own KV cache and scheduler) behind the worker's one
//! address, as one vLLM server started with `--data-parallel-size N`.
//!
//! With rank-aware routing the routers see every (worker, rank) as a
//! target of its own ([`WorkerId::with_rank`]) and name the rank they chose
//! (the server sends it as `X-data-parallel-rank`). With rank-blind routing
//! the routers see one target per worker, with the ranks' capacity pooled,
//! every rank's KV events applied to it, and the worker's own load
//! balancer ([`RankBalancer`]) picks the rank — today's router in front of
//! a data-parallel vLLM server.

use super::Simulation;
use serde::{Deserialize, Serialize};
use switchyard_core::WorkerId;

/// How the routers treat a worker's data-parallel ranks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum DpRouting {
    /// Every (worker, rank) is a target; the router picks the rank.
    Aware,
    /// One target per worker; the worker's internal balancer picks the rank.
    Blind,
}

impl DpRouting {
    /// The name figures and row labels use.
    pub const fn name(self) -> &'static str {
        match self {
            Self::Aware => "aware",
            Self::Blind => "blind",
        }
    }
}

/// Attention data parallelism of every worker of a fleet.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DpConfig {
    /// Ranks per worker, each its own engine.
    pub size: usize,
    /// What the routers see of the ranks.
    pub routing: DpRouting,
}

/// Most ranks a worker may hold (vLLM deployments use up to a few dozen;
/// the bound keeps a mistyped size from allocating thousands of engines).
pub const MAX_DP_SIZE: usize = 256;

impl DpConfig {
    /// Checks the size.
    pub fn validate(&self) -> Result<(), String> {
        if self.size == 0 || self.size > MAX_DP_SIZE {
            return Err(format!(
                "the data-parallel size must be 1..={MAX_DP_SIZE}, got {}",
                self.size
            ));
        }
        Ok(())
    }
}

/// How often a rank-blind worker's balancer refreshes its view of the
/// ranks' queues, in simulated ms: vLLM's data-parallel coordinator
/// publishes the engines' request counts to the front end about every
/// 100 ms.
pub const STATS_INTERVAL_MS: f64 = 100.0;

/// Weight of a waiting request against a running one in the balancer's
/// score (vLLM scores a rank `waiting * 4 + running`).
const WAITING_WEIGHT: u64 = 4;

/// A rank-blind worker's own load balancer, modelled on vLLM's front end
/// when a request names no rank: the rank with the lowest `waiting * 4 +
/// running` in its view, the first such rank on a tie (one front end
/// scans from rank 0). Its view is the counts last published
/// (every [`STATS_INTERVAL_MS`]) plus one waiting request per request it
/// sent since.
#[derive(Clone, Debug)]
pub struct RankBalancer {
    /// (waiting, running) per rank, as the balancer believes.
    view: Vec<(u64, u64)>,
    /// When the view is next refreshed.
    next_refresh_ms: f64,
}

impl RankBalancer {
    /// A balancer over `ranks` ranks, its view due a refresh.
    pub fn new(ranks: usize) -> Self {
        Self {
            view: vec![(0, 0); ranks],
            next_refresh_ms: 0.0,
        }
    }

    /// The rank for the next request at `now_ms`; `counts(rank)` reads a
    /// rank's true (waiting, running) when the view is due a refresh.
    pub fn pick(&mut self, now_ms: f64, counts: impl Fn(usize) -> (u64, u64)) -> usize {
        if now_ms >= self.next_refresh_ms {
            for (rank, v) in self.view.iter_mut().enumerate() {
                *v = counts(rank);
            }
            self.next_refresh_ms = ((now_ms / STATS_INTERVAL_MS).floor() + 1.0) * STATS_INTERVAL_MS;
        }
        let mut best = 0;
        let mut best_score = u64::MAX;
        for (rank, &(waiting, running)) in self.view.iter().enumerate() {
            let score = waiting
                .saturating_mul(WAITING_WEIGHT)
                .saturating_add(running);
            if score < best_score {
                best = rank;
                best_score = score;
            }
        }
        if let Some(v) = self.view.get_mut(best) {
            v.0 += 1;
        }
        best
    }
}

/// The fleet's ranks at run time.
pub(super) struct DpState {
    pub(super) config: DpConfig,
    /// One balancer per worker (rank-blind only).
    pub(super) balancers: Vec<RankBalancer>,
    pub(super) requests_per_rank: Vec<u64>,
    /// Whether a rank idles while another of its worker queues, since
    /// `since_ms`.
    idle_now: bool,
    since_ms: f64,
    idle_ms: f64,
}

impl DpState {
    pub(super) fn new(config: DpConfig, workers: usize) -> Self {
        Self {
            config,
            balancers: match config.routing {
                DpRouting::Aware => Vec::new(),
                DpRouting::Blind => (0..workers)
                    .map(|_| RankBalancer::new(config.size))
                    .collect(),
            },
            requests_per_rank: vec![0; workers * config.size],
            idle_now: false,
            since_ms: 0.0,
            idle_ms: 0.0,
        }
    }

    pub(super) fn idle_ms(&self) -> f64 {
        self.idle_ms
    }
}

/// The router's id of engine `index` of a fleet of `ranks` ranks per
/// worker (`None`: no data parallelism, one engine per worker).
pub(super) fn router_id(index: usize, dp: Option<DpConfig>) -> WorkerId {
    match dp {
        None => WorkerId::new(index as u64),
        Some(c) => {
            let worker = (index / c.size) as u64;
            match c.routing {
                DpRouting::Aware => WorkerId::with_rank(worker, (index % c.size) as u32),
                DpRouting::Blind => WorkerId::new(worker),
            }
        }
    }
}

impl Simulation {
    /// The engine a placement on router target `id` runs on: the target's
    /// own engine, or for a rank-blind worker the rank its balancer picks.
    pub(super) fn engine_for(&mut self, id: WorkerId) -> Option<usize> {
        let first = *self.by_worker_id.get(&id)?;
        let Some(dp) = self.dp.as_mut() else {
            return Some(first);
        };
        let engine = match dp.config.routing {
            DpRouting::Aware => first,
            DpRouting::Blind => {
                let size = dp.config.size;
                let worker = first / size;
                let workers = &self.workers;
                let rank = dp.balancers.get_mut(worker)?.pick(self.now, |r| {
                    let e = &workers[worker * size + r].engine;
                    (e.waiting_len() as u64, e.running_len() as u64)
                });
                worker * size + rank
            }
        };
        if let Some(n) = dp.requests_per_rank.get_mut(engine) {
            *n += 1;
        }
        Some(engine)
    }

    /// The KV usage the routers are told for engine `index`'s target: its
    /// own, or for a rank-blind worker the mean of its ranks'.
    pub(super) fn reported_usage(&self, index: usize) -> f64 {
        match self.dp {
            Some(DpState {
                config:
                    DpConfig {
                        size,
                        routing: DpRouting::Blind,
                    },
                ..
            }) => {
                let worker = index / size;
                let ranks = &self.workers[worker * size..(worker + 1) * size];
                ranks.iter().map(|w| w.engine.kv_usage()).sum::<f64>() / size as f64
            }
            _ => self.workers[index].engine.kv_usage(),
        }
    }

    /// Accounts the time since the last event and looks again whether a
    /// rank idles while another rank of its worker queues.
    pub(super) fn track_rank_idleness(&mut self) {
        let Some(dp) = self.dp.as_mut() else {
            return;
        };
        if dp.idle_now && self.first_arrival.is_some() {
            dp.idle_ms += self.now - dp.since_ms;
        }
        dp.since_ms = self.now;
        let size = dp.config.size;
        dp.idle_now = self.workers.chunks(size).any(|ranks| {
            let idle = ranks.iter().any(|w| !w.engine.has_work());
            let queued = ranks.iter().any(|w| w.engine.waiting_len() > 0);
            idle && queued
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_balancer_sends_to_the_rank_with_the_lowest_waiting_times_four_plus_running() {
        let mut lb = RankBalancer::new(3);
        // Rank 0: 1 waiting (score 4); rank 1: 3 running (3); rank 2: 5 running (5).
        let counts = [(1, 0), (0, 3), (0, 5)];
        assert_eq!(lb.pick(0.0, |r| counts[r]), 1);
    }

    #[test]
    fn between_refreshes_the_balancer_counts_its_own_sends_as_waiting() {
        let mut lb = RankBalancer::new(2);
        let idle = |_| (0, 0);
        // Ties go to the first rank; each send adds 4 to the rank's score.
        assert_eq!(lb.pick(0.0, idle), 0);
        assert_eq!(lb.pick(10.0, idle), 1);
        assert_eq!(lb.pick(20.0, idle), 0);
        // Before the next refresh the true counts are not read.
        let busy_zero = |r| if r == 0 { (9, 9) } else { (0, 0) };
        assert_eq!(lb.pick(99.0, busy_zero), 1);
        // At the refresh the view is the engines' counts again.
        assert_eq!(lb.pick(100.0, busy_zero), 1);
        assert_eq!(lb.pick(100.0, busy_zero), 1);
    }

    #[test]
    fn rank_aware_targets_name_the_rank_and_rank_blind_ones_the_worker() {
        let aware = Some(DpConfig {
            size: 4,
            routing: DpRouting::Aware,
        });
        let blind = Some(DpConfig {
            size: 4,
            routing: DpRouting::Blind,
        });
        assert_eq!(router_id(6, aware), WorkerId::with_rank(1, 2));
        assert_eq!(router_id(6, blind), WorkerId::new(1));
        assert_eq!(router_id(6, None), WorkerId::new(6));
    }

    #[test]
    fn a_size_of_zero_or_beyond_the_bound_is_refused() {
        for size in [0, MAX_DP_SIZE + 1] {
            let c = DpConfig {
                size,
                routing: DpRouting::Aware,
            };
            assert!(c.validate().unwrap_err().contains("data-parallel size"));
        }
    }
}
