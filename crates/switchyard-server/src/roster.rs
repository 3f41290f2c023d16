//! The worker table: what the server knows of each worker beyond what the
//! dispatcher decides with — its name and URL, its models, whether it is in
//! the router or draining, its health-check streak, its measured KV usage,
//! the epoch of its KV-event subscriber and its circuit transitions.
//!
//! Pure data under the router's lock ([`crate::driver`]); nothing here
//! touches the network or the dispatcher. Which workers may take a request
//! is the core's ([`switchyard_core::eligibility`]), asked of this table.

use axum::http::uri::{Authority, Scheme};
use axum::http::{HeaderValue, Uri};
use rustc_hash::FxHashMap;
use std::sync::Arc;
use switchyard_core::dispatch::CircuitChange;
use switchyard_core::health::CircuitState;
use switchyard_core::router::WorkerCapacity;
use switchyard_core::{Eligible, WorkerId};

pub use switchyard_core::eligibility::Role;
pub(crate) use switchyard_core::eligibility::UnknownModel;
use switchyard_core::eligibility::{self, Candidate};

/// One worker as the server knows it.
#[derive(Debug, Clone)]
pub struct WorkerInfo {
    /// Stable id in the routing core (a hash of the name: replicas agree).
    pub id: WorkerId,
    /// Name in metrics, logs and `x-switchyard-worker`.
    pub name: Arc<str>,
    /// Base URL, `http://host:port`.
    pub url: Arc<str>,
    /// Its name and URL as requests use them, made once.
    pub endpoint: Arc<Endpoint>,
    /// Models from its `/v1/models` (empty until first fetched).
    pub models: Vec<String>,
    /// In the routing core (healthy and not removed).
    pub in_router: bool,
    /// Draining: no new requests; removed once idle.
    pub draining: bool,
    /// Consecutive failed health checks.
    pub failures: u32,
    /// What it can hold, from its `/get_server_info` or, for vLLM, its
    /// `/metrics` (for busy thresholds and the `ttft` policy).
    pub capacity: WorkerCapacity,
    /// Fraction of its KV cache in use, from its `/metrics` (read only when
    /// an admission strategy needs it).
    pub kv_usage: Option<f64>,
    /// Counts entries into the router: KV events from a subscriber started
    /// for an earlier entry are stale and dropped.
    pub events_epoch: u64,
    /// Its circuit's state, as the dispatcher last reported it.
    pub circuit: CircuitState,
    /// Circuit transitions into each state, indexed by `CircuitState as
    /// usize`; they only grow (a counter family).
    pub circuit_transitions: [u64; 3],
    /// Its part in a disaggregated fleet.
    pub role: Role,
    /// SGLang: its KV bootstrap port.
    pub bootstrap_port: Option<u16>,
}

/// A worker's name and URL in the forms a request to it uses, made once
/// when the worker is added: each request shares them (a reference
/// count) instead of parsing or copying them again.
#[derive(Debug)]
pub struct Endpoint {
    /// The name as an `x-switchyard-worker` value (`None` when a name
    /// cannot be a header value).
    pub name_header: Option<HeaderValue>,
    /// The URL's scheme and authority when the URL is just those (no path
    /// prefix): a request's URI is these and its path.
    pub origin: Option<(Scheme, Authority)>,
    /// A data-parallel rank's number as an [`DP_RANK_HEADER`] value
    /// (`None`: the worker has one rank and requests name none).
    pub dp_rank: Option<HeaderValue>,
}

/// The header vLLM takes a request's data-parallel rank from.
pub(crate) const DP_RANK_HEADER: &str = "x-data-parallel-rank";

impl Endpoint {
    /// The endpoint of a worker named `name` at `url` (no trailing `/`).
    pub fn new(name: &str, url: &str) -> Self {
        let origin = url.parse::<Uri>().ok().and_then(|uri| {
            let bare = uri
                .path_and_query()
                .is_none_or(|pq| pq.as_str().is_empty() || pq.as_str() == "/");
            let parts = uri.into_parts();
            match (parts.scheme, parts.authority) {
                (Some(scheme), Some(authority)) if bare => Some((scheme, authority)),
                _ => None,
            }
        });
        Self {
            name_header: HeaderValue::from_str(name).ok(),
            origin,
            dp_rank: None,
        }
    }

    /// The endpoint of data-parallel rank `rank` of the worker at `url`.
    pub fn of_rank(name: &str, url: &str, rank: u32) -> Self {
        Self {
            dp_rank: Some(HeaderValue::from(rank)),
            ..Self::new(name, url)
        }
    }
}

/// Every worker, by id.
#[derive(Debug, Default)]
pub(crate) struct Roster {
    workers: FxHashMap<WorkerId, WorkerInfo>,
}

impl Roster {
    /// A worker by id.
    pub(crate) fn get(&self, id: WorkerId) -> Option<&WorkerInfo> {
        self.workers.get(&id)
    }

    /// A worker by id, mutably.
    pub(crate) fn get_mut(&mut self, id: WorkerId) -> Option<&mut WorkerInfo> {
        self.workers.get_mut(&id)
    }

    /// Registers a worker named `name` with id `id`; refused when the name
    /// or the id is taken.
    pub(crate) fn insert(&mut self, id: WorkerId, name: &str, url: &str) -> Result<(), String> {
        if self.workers.values().any(|w| &*w.name == name) {
            return Err(format!("a worker named {name:?} exists"));
        }
        if self.workers.contains_key(&id) {
            return Err(format!(
                "the worker name {name:?} collides with another's id"
            ));
        }
        self.workers.insert(
            id,
            WorkerInfo {
                id,
                name: name.into(),
                url: url.trim_end_matches('/').into(),
                endpoint: Arc::new(Endpoint::new(name, url.trim_end_matches('/'))),
                models: Vec::new(),
                in_router: false,
                draining: false,
                failures: 0,
                capacity: WorkerCapacity::default(),
                kv_usage: None,
                events_epoch: 0,
                circuit: CircuitState::Closed,
                circuit_transitions: [0; 3],
                role: Role::Both,
                bootstrap_port: None,
            },
        );
        Ok(())
    }

    /// Makes a worker data-parallel rank `rank` of its URL: its requests
    /// name the rank.
    pub(crate) fn set_dp_rank(&mut self, id: WorkerId, rank: u32) {
        if let Some(info) = self.workers.get_mut(&id) {
            info.endpoint = Arc::new(Endpoint::of_rank(&info.name, &info.url, rank));
        }
    }

    /// Forgets a worker.
    pub(crate) fn remove(&mut self, id: WorkerId) -> Option<WorkerInfo> {
        self.workers.remove(&id)
    }

    /// Every worker, sorted by name.
    pub(crate) fn sorted(&self) -> Vec<&WorkerInfo> {
        let mut list: Vec<&WorkerInfo> = self.workers.values().collect();
        list.sort_unstable_by(|a, b| a.name.cmp(&b.name));
        list
    }

    /// Counts and logs circuit transitions.
    pub(crate) fn circuit_changed(&mut self, change: &CircuitChange) {
        let Some(info) = self.workers.get_mut(&change.worker) else {
            return;
        };
        info.circuit = change.to;
        info.circuit_transitions[change.to as usize] += 1;
        match change.to {
            CircuitState::Open => tracing::warn!(
                worker = %info.name,
                cooldown_until_ms = change.open_until_ms.unwrap_or_default(),
                "circuit open: worker out of selection"
            ),
            CircuitState::HalfOpen => {
                tracing::info!(worker = %info.name, "circuit half-open: one probe request")
            }
            CircuitState::Closed => tracing::info!(worker = %info.name, "circuit closed"),
        }
    }

    /// The workers as the core's eligibility reads them.
    fn candidates(&self) -> impl Iterator<Item = Candidate<'_>> + Clone {
        self.workers.values().map(|w| Candidate {
            id: w.id,
            models: &w.models,
            in_router: w.in_router,
            draining: w.draining,
            role: w.role,
        })
    }

    /// Whether the fleet is disaggregated (the core's
    /// [`eligibility::disaggregated`]).
    pub(crate) fn disaggregated(&self) -> bool {
        eligibility::disaggregated(self.candidates())
    }

    /// The workers that may take a new request for `model` in `pool`
    /// (`Both`: any), by the core's [`eligibility::eligible_in`];
    /// `UnknownModel` when workers are up but none serves `model`.
    pub(crate) fn eligible_in(
        &self,
        model: Option<&str>,
        pool: Role,
    ) -> Result<Eligible, UnknownModel> {
        eligibility::eligible_in(self.candidates(), model, pool)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn roster(workers: &[(&str, &[&str])]) -> Roster {
        let mut r = Roster::default();
        for (i, (name, models)) in workers.iter().enumerate() {
            let id = WorkerId::new(i as u64 + 1);
            r.insert(id, name, "http://h:1/").unwrap();
            let info = r.get_mut(id).unwrap();
            info.in_router = true;
            info.models = models.iter().map(|m| m.to_string()).collect();
        }
        r
    }

    #[test]
    fn names_and_ids_are_unique_and_urls_lose_their_trailing_slash() {
        let mut r = roster(&[("a", &[])]);
        assert!(r.insert(WorkerId::new(9), "a", "http://x").is_err());
        assert!(r.insert(WorkerId::new(1), "b", "http://x").is_err());
        assert_eq!(&*r.get(WorkerId::new(1)).unwrap().url, "http://h:1");
    }
}
