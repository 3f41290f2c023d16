//! What `/metrics` shows of the routing state: a [`Snapshot`] read under the
//! router's lock in one go ([`crate::driver::Driver::snapshot`]) at
//! scrape time, so the request path never updates these gauges. A
//! [`RoutingStateCollector`] takes one per scrape and encodes it through
//! `prometheus-client` (a `Snapshot` is itself a collector of the state it
//! holds). Per-worker series are labelled by the worker's name.

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeGaugeValue, EncodeMetric};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::MetricType;
use std::fmt;
use std::sync::Arc;
use switchyard_core::health::CircuitState;

/// One worker's row.
#[derive(Debug, Clone)]
pub struct WorkerRow {
    /// Its name.
    pub name: Arc<str>,
    /// Uncached prefill tokens booked on it now.
    pub prefill_tokens: u64,
    /// KV blocks its active requests hold.
    pub decode_blocks: usize,
    /// Requests booked on it (this replica's and its peers').
    pub requests: usize,
    /// Of those, this replica's.
    pub local_requests: usize,
    /// Of those, its peers'.
    pub remote_requests: usize,
    /// In selection.
    pub up: bool,
    /// Measured KV usage, when read.
    pub kv_usage: Option<f64>,
    /// Its circuit's state.
    pub circuit: CircuitState,
    /// Circuit transitions into each state.
    pub circuit_transitions: [u64; 3],
}

/// The routing state at one instant.
#[derive(Debug, Clone)]
pub struct Snapshot {
    /// Every worker, sorted by name.
    pub workers: Vec<WorkerRow>,
    /// Requests booked on any worker.
    pub active_requests: usize,
    /// Live (block, worker) pairs in the prefix index.
    pub index_blocks: usize,
    /// Estimated heap bytes of the index and the registry.
    pub index_bytes: usize,
    /// Blocks the index dropped because their worker was past its cap.
    pub index_evicted_blocks: u64,
    /// Requests waiting in the admission queue.
    pub queue_depth: usize,
    /// The admission strategy's name and event counters, when one is on.
    pub strategy: Option<(&'static str, Vec<(&'static str, u64)>)>,
    /// Flow control per (tenant, band) that saw any request, labelled by
    /// name (a bounded set: the configured tenants and bands).
    pub flows: Vec<FlowRow>,
}

/// One (tenant, band)'s queue figures.
#[derive(Debug, Clone)]
pub struct FlowRow {
    /// The tenant's name.
    pub tenant: String,
    /// The band's name.
    pub band: String,
    /// Requests waiting now.
    pub waiting: usize,
    /// Its counters.
    pub counters: switchyard_core::admission::FlowCounters,
}

impl Snapshot {
    /// Encodes every series of the snapshot.
    pub fn encode_into(&self, encoder: &mut DescriptorEncoder<'_>) -> fmt::Result {
        let rows = &self.workers;
        by_worker(
            encoder,
            "switchyard_worker_active_prefill_tokens",
            "Uncached prefill tokens booked on the worker.",
            rows.iter().map(|r| (&*r.name, r.prefill_tokens)),
        )?;
        by_worker(
            encoder,
            "switchyard_worker_active_decode_blocks",
            "KV blocks held by the worker's active requests.",
            rows.iter().map(|r| (&*r.name, r.decode_blocks)),
        )?;
        by_worker(
            encoder,
            "switchyard_worker_active_requests",
            "Requests booked on the worker and not yet freed.",
            rows.iter().map(|r| (&*r.name, r.requests)),
        )?;
        by_worker(
            encoder,
            "switchyard_worker_up",
            "1 while the worker is in selection.",
            rows.iter().map(|r| (&*r.name, u32::from(r.up))),
        )?;
        by_worker(
            encoder,
            "switchyard_worker_kv_usage_ratio",
            "Fraction of the worker's KV cache in use, from its /metrics (read while an admission strategy is on).",
            rows.iter().filter_map(|r| Some((&*r.name, r.kv_usage?))),
        )?;
        by_worker(
            encoder,
            "switchyard_circuit_state",
            "Circuit breaker per worker: 0 closed, 1 open, 2 half-open.",
            rows.iter().map(|r| (&*r.name, r.circuit as u32)),
        )?;
        let mut family = encoder.encode_descriptor(
            "switchyard_circuit_transitions",
            "Circuit breaker transitions per worker, by the state entered.",
            None,
            MetricType::Counter,
        )?;
        for r in rows {
            for to in CircuitState::ALL {
                let labels = [("worker", &*r.name), ("to", to.label())];
                ConstCounter::new(r.circuit_transitions[to as usize])
                    .encode(family.encode_family(&labels)?)?;
            }
        }
        let mut family = encoder.encode_descriptor(
            "switchyard_worker_active_requests_by_origin",
            "Requests booked on the worker, by the replica that booked them (local: this one).",
            None,
            MetricType::Gauge,
        )?;
        for r in rows {
            for (origin, n) in [("local", r.local_requests), ("remote", r.remote_requests)] {
                let labels = [("worker", &*r.name), ("origin", origin)];
                ConstGauge::new(n).encode(family.encode_family(&labels)?)?;
            }
        }
        for (name, help, value) in [
            (
                "switchyard_active_requests",
                "Requests booked on any worker.",
                self.active_requests,
            ),
            (
                "switchyard_index_blocks",
                "Live (block, worker) pairs in the prefix index.",
                self.index_blocks,
            ),
            (
                "switchyard_index_bytes",
                "Estimated heap bytes of the index and the registry.",
                self.index_bytes,
            ),
            (
                "switchyard_queue_depth",
                "Requests waiting in the admission queue.",
                self.queue_depth,
            ),
        ] {
            ConstGauge::new(value).encode(encoder.encode_descriptor(
                name,
                help,
                None,
                MetricType::Gauge,
            )?)?;
        }
        ConstCounter::new(self.index_evicted_blocks).encode(encoder.encode_descriptor(
            "switchyard_index_evicted_blocks",
            "Blocks dropped from the prefix index because their worker held more than its cap (its oldest first).",
            None,
            MetricType::Counter,
        )?)?;
        let mut family = encoder.encode_descriptor(
            "switchyard_flow_waiting_requests",
            "Requests waiting in the admission queue, by tenant and priority band.",
            None,
            MetricType::Gauge,
        )?;
        for f in &self.flows {
            let labels = [("tenant", &*f.tenant), ("band", &*f.band)];
            ConstGauge::new(f.waiting).encode(family.encode_family(&labels)?)?;
        }
        let mut family = encoder.encode_descriptor(
            "switchyard_flow_requests",
            "Requests by tenant, priority band and what admission did: dispatched to a worker, shed (429: a sheddable band under overload), late (429: a deadline the prefill estimate could not meet), refused (429: its queue full).",
            None,
            MetricType::Counter,
        )?;
        for f in &self.flows {
            let c = &f.counters;
            for (outcome, n) in [
                ("dispatched", c.dispatched),
                ("shed", c.shed),
                ("late", c.late),
                ("refused", c.refused),
            ] {
                let labels = [
                    ("tenant", &*f.tenant),
                    ("band", &*f.band),
                    ("outcome", outcome),
                ];
                ConstCounter::new(n).encode(family.encode_family(&labels)?)?;
            }
        }
        let mut family = encoder.encode_descriptor(
            "switchyard_flow_tokens_dispatched",
            "Tokens charged to the fair share at dispatch (uncached prompt plus expected output), by tenant and priority band.",
            None,
            MetricType::Counter,
        )?;
        for f in &self.flows {
            let labels = [("tenant", &*f.tenant), ("band", &*f.band)];
            ConstCounter::new(f.counters.tokens_dispatched)
                .encode(family.encode_family(&labels)?)?;
        }
        if let Some((strategy, counts)) = &self.strategy {
            let mut family = encoder.encode_descriptor(
                "switchyard_admission_strategy_events",
                "Events of the admission strategy (deferrals, pauses, resumes, migrated turns, expiries).",
                None,
                MetricType::Counter,
            )?;
            for (event, n) in counts {
                let labels = [("strategy", *strategy), ("event", *event)];
                ConstCounter::new(*n).encode(family.encode_family(&labels)?)?;
            }
        }
        Ok(())
    }
}

/// One gauge family with a `worker` label: a sample per row, in row order.
fn by_worker<'r, V: EncodeGaugeValue>(
    encoder: &mut DescriptorEncoder<'_>,
    name: &str,
    help: &str,
    rows: impl IntoIterator<Item = (&'r str, V)>,
) -> fmt::Result {
    let mut family = encoder.encode_descriptor(name, help, None, MetricType::Gauge)?;
    for (worker, value) in rows {
        let labels = [("worker", worker)];
        ConstGauge::new(value).encode(family.encode_family(&labels)?)?;
    }
    Ok(())
}

impl Collector for Snapshot {
    fn encode(&self, mut encoder: DescriptorEncoder<'_>) -> fmt::Result {
        self.encode_into(&mut encoder)
    }
}

/// The routing state's series for a registry: a fresh [`Snapshot`] from
/// `take` at every scrape.
pub(crate) struct RoutingStateCollector {
    take: Box<dyn Fn() -> Snapshot + Send + Sync>,
}

impl RoutingStateCollector {
    /// A collector that snapshots with `take` (the router's
    /// [`crate::driver::Driver::snapshot`]).
    pub(crate) fn new(take: impl Fn() -> Snapshot + Send + Sync + 'static) -> Self {
        Self {
            take: Box::new(take),
        }
    }
}

impl fmt::Debug for RoutingStateCollector {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RoutingStateCollector")
            .finish_non_exhaustive()
    }
}

impl Collector for RoutingStateCollector {
    fn encode(&self, mut encoder: DescriptorEncoder<'_>) -> fmt::Result {
        (self.take)().encode_into(&mut encoder)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use prometheus_client::encoding::prometheus_text::encode;
    use prometheus_client::registry::Registry;

    fn row(name: &str) -> WorkerRow {
        WorkerRow {
            name: name.into(),
            prefill_tokens: 12,
            decode_blocks: 3,
            requests: 2,
            local_requests: 1,
            remote_requests: 1,
            up: true,
            kv_usage: Some(0.5),
            circuit: CircuitState::Open,
            circuit_transitions: [0, 1, 0],
        }
    }

    fn text(snapshot: Snapshot) -> String {
        let mut registry = Registry::default();
        registry.register_collector(Box::new(snapshot));
        let mut out = String::new();
        encode(&mut out, &registry).unwrap();
        out
    }

    fn snapshot(workers: Vec<WorkerRow>) -> Snapshot {
        Snapshot {
            workers,
            active_requests: 2,
            index_blocks: 40,
            index_bytes: 4096,
            index_evicted_blocks: 3,
            queue_depth: 1,
            strategy: Some(("session-aware", vec![("pauses", 4)])),
            flows: Vec::new(),
        }
    }

    #[test]
    fn every_family_has_help_and_type() {
        let out = text(snapshot(vec![row("a")]));
        let typed: Vec<&str> = out
            .lines()
            .filter_map(|l| l.strip_prefix("# TYPE "))
            .collect();
        assert_eq!(typed.len(), 17, "{out}");
        for t in typed {
            let (name, kind) = t.split_once(' ').unwrap();
            assert!(out.contains(&format!("# HELP {name} ")), "{name}");
            assert_eq!(kind == "counter", name.ends_with("_total"), "{t}");
        }
        assert!(out.contains("switchyard_worker_active_prefill_tokens{worker=\"a\"} 12\n"));
        assert!(out.contains("switchyard_circuit_state{worker=\"a\"} 1\n"));
        assert!(out.contains("switchyard_circuit_transitions_total{worker=\"a\",to=\"open\"} 1\n"));
        assert!(out.contains(
            "switchyard_worker_active_requests_by_origin{worker=\"a\",origin=\"remote\"} 1\n"
        ));
        assert!(out.contains("switchyard_worker_kv_usage_ratio{worker=\"a\"} 0.5\n"));
        assert!(out.contains("switchyard_queue_depth 1\n"));
        assert!(out.contains("switchyard_index_evicted_blocks_total 3\n"));
        assert!(out.contains(
            "switchyard_admission_strategy_events_total{strategy=\"session-aware\",event=\"pauses\"} 4\n"
        ));
    }

    #[test]
    fn a_worker_name_with_quotes_and_backslashes_is_escaped() {
        let out = text(snapshot(vec![row("gpu \"0\"\\a\nb")]));
        let label = "worker=\"gpu \\\"0\\\"\\\\a\\nb\"";
        for family in [
            "switchyard_worker_active_requests",
            "switchyard_worker_up",
            "switchyard_circuit_state",
        ] {
            assert!(
                out.contains(&format!("{family}{{{label}}} ")),
                "{family}:\n{out}"
            );
        }
        assert!(out.contains(&format!(
            "switchyard_circuit_transitions_total{{{label},to=\"closed\"}} 0\n"
        )));
        assert!(
            !out.lines().any(|l| l == "b\"} 2"),
            "no raw newline splits a sample:\n{out}"
        );
    }

    #[test]
    fn without_a_strategy_its_family_is_absent() {
        let mut s = snapshot(Vec::new());
        s.strategy = None;
        let out = text(s);
        assert!(!out.contains("switchyard_admission_strategy_events"));
        assert!(out.contains("# TYPE switchyard_worker_up gauge\n"));
    }
}
