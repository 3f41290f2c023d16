//! Live worker discovery: workers from a watched file (`--workers-file`)
//! and from DNS names (`--workers-dns`), added to and drained from the
//! same worker table the flags, the config file and the admin API fill,
//! through the same calls ([`Fleet::add`] then [`Fleet::check_soon`], as
//! the admin API's [`Fleet::join`]; [`Fleet::remove`] with drain):
//! a discovered worker is health-checked, selected, drained and removed
//! exactly like one added by hand.
//!
//! - The pure part is the core's (`switchyard_core::membership`): one
//!   source's owned set and desired set in, the adds and drains out. A
//!   source drains only what it added.
//! - [`file`] — the file source: read, hash, parse with the config file's
//!   parser; a bad or missing file keeps the last good set.
//! - [`dns`] — the DNS source: A/AAAA records to `http://IP:PORT`; a failed
//!   or empty resolution keeps the last set.
//!
//! Data flow, per source and per interval: poll the source → (on a change)
//! the capped desired set → read the worker table → `membership::plan` →
//! drain, then add. Every pass reconciles, changed or not: an add refused
//! once (its name still draining, say) is retried at the next.

pub(crate) mod dns;
pub(crate) mod file;

use crate::config::{parse_dns_target, ServerConfig, WorkerSpec};
use crate::fleet::Fleet;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;
use switchyard_core::membership;

/// A source's workers by name.
type WorkerSet = membership::WorkerSet<WorkerSpec>;
use tokio::task::JoinHandle;

/// The discovery sources' metrics, labelled by source (`file`, or
/// `dns:NAME:PORT`: as many as configured, so the label set is bounded).
#[derive(Debug, Default)]
pub(crate) struct DiscoveryMetrics {
    workers: Family<SourceLabels, Gauge>,
    errors: Family<ErrorLabels, Counter>,
    dropped: Family<SourceLabels, Counter>,
    changes: Family<ChangeLabels, Counter>,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct SourceLabels {
    source: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ErrorLabels {
    source: String,
    reason: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ChangeLabels {
    source: String,
    change: &'static str,
}

impl DiscoveryMetrics {
    /// Puts the families into the `/metrics` registry.
    pub(crate) fn register(&self, registry: &mut Registry) {
        registry.register(
            "switchyard_discovery_workers",
            "Workers a discovery source has in the worker table",
            self.workers.clone(),
        );
        registry.register(
            "switchyard_discovery_errors",
            "Discovery failures that kept the last set of workers (missing, read, invalid, resolve, empty) and adds the fleet refused (add)",
            self.errors.clone(),
        );
        registry.register(
            "switchyard_discovery_dropped_workers",
            "Workers a source listed past its cap (max_workers_per_source), not added",
            self.dropped.clone(),
        );
        registry.register(
            "switchyard_discovery_changes",
            "Workers a discovery source added or drained",
            self.changes.clone(),
        );
    }

    fn error(&self, source: &str, reason: &'static str) {
        self.errors
            .get_or_create(&ErrorLabels {
                source: source.to_owned(),
                reason,
            })
            .inc();
    }

    fn change(&self, source: &str, change: &'static str) {
        self.changes
            .get_or_create(&ChangeLabels {
                source: source.to_owned(),
                change,
            })
            .inc();
    }

    fn label(source: &str) -> SourceLabels {
        SourceLabels {
            source: source.to_owned(),
        }
    }
}

/// One source's side of the worker table: what it wants and what it has
/// added. Owned by the source's task; the table itself is the fleet's.
#[derive(Debug)]
struct Source {
    /// The `source` label, and the name in logs.
    label: String,
    /// The last good set the source gave (empty before the first).
    desired: WorkerSet,
    /// Workers this source added, still in the table and not draining.
    owned: WorkerSet,
    /// Desired names not added at the last pass (refused or held by
    /// another): logged once, not at every pass.
    reported: BTreeSet<String>,
    /// The most workers this source may add.
    limit: usize,
}

impl Source {
    fn new(label: String, limit: usize) -> Self {
        Self {
            label,
            desired: WorkerSet::new(),
            owned: WorkerSet::new(),
            reported: BTreeSet::new(),
            limit,
        }
    }

    /// The source's new listing, capped.
    fn set_desired(&mut self, specs: Vec<WorkerSpec>, metrics: &DiscoveryMetrics) {
        let listed = specs.len();
        let named = specs.into_iter().map(|s| (s.display_name(), s));
        let (desired, dropped) = membership::capped(named, self.limit);
        if dropped > 0 {
            tracing::warn!(source = %self.label, listed, limit = self.limit, dropped, "a discovery source listed more workers than it may add: the rest are dropped");
            metrics
                .dropped
                .get_or_create(&DiscoveryMetrics::label(&self.label))
                .inc_by(dropped as u64);
        }
        if desired != self.desired {
            tracing::info!(source = %self.label, workers = desired.len(), "discovery source changed");
        }
        self.desired = desired;
    }

    /// One reconciliation against the fleet's table: drains, then adds.
    fn pass(&mut self, fleet: &Arc<Fleet>, metrics: &DiscoveryMetrics) {
        let table = fleet.workers();
        // What we added and is still there as we added it (not removed or
        // drained by hand, not replaced under the same name).
        // A worker with data-parallel ranks is in the table as its ranks
        // (`NAME/r`).
        let is_target_of = crate::fleet::is_target_of;
        self.owned.retain(|name, spec| {
            table.iter().any(|w| {
                is_target_of(&w.name, name)
                    && &*w.url == spec.url.trim_end_matches('/')
                    && !w.draining
            })
        });
        let others: BTreeSet<String> = table
            .iter()
            .map(|w| w.name.to_string())
            .filter(|n| !self.owned.keys().any(|owned| is_target_of(n, owned)))
            .collect();
        let plan = membership::plan(&self.owned, &self.desired, &others);
        for name in &plan.drain {
            tracing::info!(source = %self.label, worker = %name, "discovered worker gone from its source (or changed there): draining");
            if fleet.remove(name, true) {
                metrics.change(&self.label, "drained");
            }
            self.owned.remove(name);
        }
        let mut added = false;
        for spec in &plan.add {
            let name = spec.display_name();
            match fleet.add(spec) {
                Ok(_) => {
                    tracing::info!(source = %self.label, worker = %name, url = %spec.url, "discovered worker added");
                    metrics.change(&self.label, "added");
                    self.owned.insert(name, spec.clone());
                    added = true;
                }
                Err(error) => {
                    if self.reported.insert(name.clone()) {
                        tracing::warn!(source = %self.label, worker = %name, %error, "discovered worker refused; retried at each pass");
                        metrics.error(&self.label, "add");
                    }
                }
            }
        }
        if added {
            fleet.check_soon();
        }
        for name in &plan.conflicts {
            if self.reported.insert(name.clone()) {
                tracing::info!(source = %self.label, worker = %name, "the name is held by a worker this source did not add (or one still draining): left alone");
            }
        }
        let owned = &self.owned;
        self.reported
            .retain(|n| self.desired.contains_key(n) && !owned.contains_key(n));
        metrics
            .workers
            .get_or_create(&DiscoveryMetrics::label(&self.label))
            .set(self.owned.len() as i64);
    }
}

/// The configured sources, ready to start: built before the router binds,
/// so that a resolver that cannot be built fails the start cleanly.
#[derive(Debug)]
pub(crate) struct Sources {
    file: Option<(file::FileWatch, Duration)>,
    dns: Vec<DnsTarget>,
    limit: usize,
}

/// One `--workers-dns` name and the resolver it is asked through.
struct DnsTarget {
    resolver: Arc<hickory_resolver::TokioResolver>,
    name: String,
    port: u16,
    interval: Duration,
    label: String,
}

impl std::fmt::Debug for DnsTarget {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DnsTarget")
            .field("source", &self.label)
            .field("interval", &self.interval)
            .finish_non_exhaustive()
    }
}

impl Sources {
    /// The sources of `config` (none when discovery is off). Fails only on
    /// a resolver that cannot be built (an unreadable system DNS
    /// configuration); a source's later failures keep its last set.
    pub(crate) fn new(config: &ServerConfig) -> Result<Self, String> {
        let discovery = &config.discovery;
        let file = discovery.workers_file.as_ref().map(|path| {
            (
                file::FileWatch::new(path, config.block_sizes(), config.cache),
                Duration::from_millis(discovery.workers_file_interval_ms),
            )
        });
        let mut dns = Vec::new();
        if !discovery.workers_dns.is_empty() {
            let interval = Duration::from_millis(discovery.workers_dns_interval_ms);
            let timeout = interval.clamp(Duration::from_secs(1), Duration::from_secs(5));
            let resolver = Arc::new(dns::resolver(&discovery.dns_servers, timeout)?);
            for target in &discovery.workers_dns {
                let (name, port) = parse_dns_target(target)?;
                dns.push(DnsTarget {
                    resolver: resolver.clone(),
                    name,
                    port,
                    interval,
                    label: format!("dns:{target}"),
                });
            }
        }
        Ok(Self {
            file,
            dns,
            limit: discovery.max_workers_per_source,
        })
    }

    /// Starts one task per source, adding to and draining from `fleet`.
    pub(crate) fn spawn(
        self,
        fleet: &Arc<Fleet>,
        metrics: &Arc<DiscoveryMetrics>,
    ) -> Vec<JoinHandle<()>> {
        let mut tasks = Vec::new();
        if let Some((watch, interval)) = self.file {
            tasks.push(tokio::spawn(watch_file(
                watch,
                interval,
                Source::new("file".into(), self.limit),
                fleet.clone(),
                metrics.clone(),
            )));
        }
        for target in self.dns {
            let source = Source::new(target.label.clone(), self.limit);
            tasks.push(tokio::spawn(watch_dns(
                target,
                source,
                fleet.clone(),
                metrics.clone(),
            )));
        }
        tasks
    }
}

fn ticker(interval: Duration) -> tokio::time::Interval {
    let mut ticker = tokio::time::interval(interval);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    ticker
}

/// The file source's loop: poll (off the async threads), reconcile.
async fn watch_file(
    mut watch: file::FileWatch,
    interval: Duration,
    mut source: Source,
    fleet: Arc<Fleet>,
    metrics: Arc<DiscoveryMetrics>,
) {
    let mut ticker = ticker(interval);
    loop {
        ticker.tick().await;
        let Ok((back, poll)) = tokio::task::spawn_blocking(move || {
            let poll = watch.poll();
            (watch, poll)
        })
        .await
        else {
            tracing::error!(source = %source.label, "the workers file poll panicked: discovery from the file stops");
            return;
        };
        watch = back;
        match poll {
            file::Poll::Unchanged => {}
            file::Poll::Changed(specs) => source.set_desired(specs, &metrics),
            file::Poll::Failed(error) => {
                tracing::error!(source = %source.label, %error, "workers file");
                metrics.error(&source.label, error.reason());
            }
        }
        source.pass(&fleet, &metrics);
    }
}

/// A DNS source's loop: resolve, reconcile. Every failed resolution is
/// counted; a run of failures is logged when it starts and when it ends.
async fn watch_dns(
    target: DnsTarget,
    mut source: Source,
    fleet: Arc<Fleet>,
    metrics: Arc<DiscoveryMetrics>,
) {
    let mut ticker = ticker(target.interval);
    let mut failing = false;
    loop {
        ticker.tick().await;
        match dns::lookup(&target.resolver, &target.name).await {
            Ok(ips) => {
                if std::mem::take(&mut failing) {
                    tracing::info!(source = %source.label, "resolving again");
                }
                source.set_desired(dns::workers_at(&ips, target.port), &metrics);
            }
            Err(error) => {
                if !std::mem::replace(&mut failing, true) {
                    tracing::error!(source = %source.label, %error, "DNS discovery");
                }
                metrics.error(&source.label, error.reason());
            }
        }
        source.pass(&fleet, &metrics);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{fleet_with, loopback_spec as spec, place, request};

    /// A fleet holding one worker added by hand, `manual` (in selection;
    /// nothing listens at its URL).
    fn fleet() -> (Arc<Fleet>, Arc<crate::driver::Driver>) {
        let (fleet, driver, _) = fleet_with(&["manual"]);
        (Arc::new(fleet), driver)
    }

    fn names(fleet: &Fleet) -> Vec<String> {
        fleet.workers().iter().map(|w| w.name.to_string()).collect()
    }

    #[tokio::test]
    async fn a_source_adds_and_removes_its_own_workers_and_never_one_added_by_hand() {
        let (fleet, _) = fleet();
        let metrics = DiscoveryMetrics::default();
        let mut source = Source::new("file".into(), 8);
        source.set_desired(vec![spec("a", 1), spec("manual", 2)], &metrics);
        source.pass(&fleet, &metrics);
        assert_eq!(names(&fleet), ["a", "manual"]);
        assert_eq!(
            fleet.workers()[1].url.as_ref(),
            "http://manual.invalid:1",
            "the hand-added worker is not replaced"
        );
        source.set_desired(vec![], &metrics);
        source.pass(&fleet, &metrics);
        assert_eq!(names(&fleet), ["manual"], "only what the source added goes");
    }

    #[tokio::test]
    async fn a_discovered_worker_with_data_parallel_ranks_is_kept_across_passes_and_removed_whole()
    {
        let (fleet, _) = fleet();
        let metrics = DiscoveryMetrics::default();
        let mut source = Source::new("file".into(), 8);
        let mut moe = spec("moe", 1);
        moe.dp_size = Some(2);
        source.set_desired(vec![moe], &metrics);
        for _ in 0..2 {
            source.pass(&fleet, &metrics);
            assert_eq!(names(&fleet), ["manual", "moe/0", "moe/1"]);
        }
        source.set_desired(vec![], &metrics);
        source.pass(&fleet, &metrics);
        assert_eq!(names(&fleet), ["manual"]);
    }

    #[tokio::test]
    async fn a_worker_gone_from_its_source_drains_its_requests_first() {
        let (fleet, driver) = fleet();
        let metrics = DiscoveryMetrics::default();
        let mut source = Source::new("file".into(), 8);
        fleet.remove("manual", false);
        source.set_desired(vec![spec("a", 1)], &metrics);
        source.pass(&fleet, &metrics);
        let id = fleet.workers()[0].id;
        driver.set_in_router(id, true);
        let booking = place(&driver, request(&[], 4)).await.unwrap();
        source.set_desired(vec![], &metrics);
        source.pass(&fleet, &metrics);
        assert!(fleet.workers()[0].draining, "in flight: draining, not gone");
        source.pass(&fleet, &metrics);
        assert_eq!(names(&fleet), ["a"], "a second pass leaves the drain alone");
        drop(booking);
        fleet.check_all().await;
        assert!(fleet.workers().is_empty(), "removed once its request ended");
    }

    #[tokio::test]
    async fn a_refused_add_is_counted_once_and_retried() {
        let (fleet, _) = fleet();
        let metrics = DiscoveryMetrics::default();
        let mut source = Source::new("file".into(), 8);
        let mut bad = spec("b", 1);
        bad.block_size = Some(64);
        source.set_desired(vec![bad], &metrics);
        source.pass(&fleet, &metrics);
        source.pass(&fleet, &metrics);
        let label = ErrorLabels {
            source: "file".into(),
            reason: "add",
        };
        assert_eq!(metrics.errors.get_or_create(&label).get(), 1);
        assert_eq!(names(&fleet), ["manual"]);
    }

    #[tokio::test]
    async fn a_source_past_its_cap_adds_the_first_and_counts_the_rest() {
        let (fleet, _) = fleet();
        let metrics = DiscoveryMetrics::default();
        let mut source = Source::new("file".into(), 2);
        source.set_desired(vec![spec("c", 3), spec("b", 2), spec("a", 1)], &metrics);
        source.pass(&fleet, &metrics);
        assert_eq!(names(&fleet), ["a", "b", "manual"]);
        let dropped = metrics
            .dropped
            .get_or_create(&DiscoveryMetrics::label("file"))
            .get();
        assert_eq!(dropped, 1);
    }
}
