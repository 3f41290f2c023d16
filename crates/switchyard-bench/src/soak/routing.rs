//! The core soak: the routing core under a long stream of real block events.
//!
//! Simulated engines (`switchyard-engine`, the same cores the fleet
//! simulator and `sim-worker` run) serve Mooncake-shaped requests that the
//! real request lifecycle (the core's `Dispatcher`, policy `kv`) admits,
//! routes, books, marks and frees; every KV event the engines emit goes
//! through the router's normalizer into the index
//! (`switchyard_sim::engine_events`). Each pass over the trace uses fresh
//! hash ids, so content never repeats across passes and the index churns
//! for as long as the run lasts. The loop is closed (a fixed number of
//! requests in flight) and steps every engine in lockstep; it ticks the
//! dispatcher once a virtual second, as the server's ticker does at the
//! latest.

use super::plateau::statm_rss_bytes;
use serde::Serialize;
use std::collections::HashMap;
use std::time::Instant;
use switchyard_core::dispatch::{Dispatcher, DispatcherConfig, Effects, Submission};
use switchyard_core::hashing::{local_block_hashes, DEFAULT_SEED};
use switchyard_core::index::{CacheTier, IndexEvent};
use switchyard_core::router::{RouterMemory, WorkerCapacity};
use switchyard_core::select::PolicyKind;
use switchyard_core::{RequestId, WorkerId};
use switchyard_engine::{Engine, EngineConfig, KvEvent, NewRequest, StepReport, SyncDevice};
use switchyard_sim::engine_events::EngineEventStream;
use switchyard_sim::trace::{synthetic_tokens, MooncakeRecord};

/// Settings of one core soak.
#[derive(Clone, Debug, Serialize)]
pub struct CoreSoakConfig {
    /// Stop after this many blocks stored or removed (and clears) applied.
    pub block_events: u64,
    /// Memory samples over the run.
    pub samples: usize,
    /// Simulated engines.
    pub workers: usize,
    /// Requests in flight across the fleet.
    pub concurrency: usize,
    /// Output tokens per request at most.
    pub max_output_tokens: u32,
    /// Prompt tokens per request at most (longer prompts are cut).
    pub max_prompt_tokens: u32,
    /// Engine and router block size.
    pub block_size: usize,
    /// Device KV blocks per engine.
    pub num_blocks: usize,
    /// Virtual milliseconds between dispatcher ticks (expiry sweeps).
    pub expire_every_ms: f64,
}

impl Default for CoreSoakConfig {
    fn default() -> Self {
        Self {
            block_events: 10_000_000,
            samples: 40,
            workers: 4,
            concurrency: 256,
            max_output_tokens: 16,
            max_prompt_tokens: 16_384,
            block_size: 16,
            num_blocks: 16_384,
            expire_every_ms: 1_000.0,
        }
    }
}

/// One memory sample.
#[derive(Clone, Copy, Debug, Serialize)]
pub struct CoreSample {
    /// Block events applied so far.
    pub block_events: u64,
    /// Requests routed so far.
    pub requests: u64,
    /// Wall seconds since the start.
    pub wall_seconds: f64,
    /// Virtual seconds since the start.
    pub virtual_seconds: f64,
    /// Live (block, worker) pairs in the index.
    pub live_pairs: usize,
    /// Active requests booked.
    pub active_requests: usize,
    /// The core's own byte accounting, total: the router's parts plus the
    /// dispatcher's tables.
    pub core_bytes: usize,
    /// The router's part, by part.
    pub memory: RouterMemory,
    /// The dispatcher's request table, admission and estimator.
    pub dispatcher_bytes: usize,
    /// This process's resident set, from `/proc/self/statm`.
    pub rss_bytes: Option<u64>,
}

/// What a core soak did.
#[derive(Clone, Debug, Serialize)]
pub struct CoreSoakOutcome {
    /// Samples in order.
    pub samples: Vec<CoreSample>,
    /// Block events applied.
    pub block_events: u64,
    /// Blocks stored, removed, and clears applied.
    pub stored_blocks: u64,
    /// Blocks removed.
    pub removed_blocks: u64,
    /// Requests routed.
    pub requests: u64,
    /// Requests an engine refused (freed at once).
    pub refused: u64,
    /// Requests freed by the expiry sweep (a lost free would show here).
    pub expired: u64,
    /// KV events the index dropped (unknown parent, unknown blocks).
    pub index_unknown_parent: u64,
    /// Wall seconds.
    pub wall_seconds: f64,
    /// Virtual seconds.
    pub virtual_seconds: f64,
}

struct Run<'a> {
    config: &'a CoreSoakConfig,
    dispatcher: Dispatcher,
    streams: Vec<EngineEventStream>,
    index_events: Vec<(CacheTier, IndexEvent)>,
    engines: Vec<Engine<SyncDevice>>,
    reports: Vec<StepReport>,
    records: &'a [MooncakeRecord],
    next_record: u64,
    /// Started requests: prompt length, and whether the first token is
    /// still to come.
    started: HashMap<RequestId, (u32, bool)>,
    in_flight: usize,
    now_ms: f64,
    kv_scratch: Vec<KvEvent>,
    /// Prompt and output cap of each submitted request not yet started.
    payloads: HashMap<RequestId, (Vec<u32>, u32)>,
    ids: Vec<u64>,
    out: CoreSoakOutcome,
}

/// Runs a core soak over `records` (cycled, fresh ids each pass), calling
/// `on_sample` as each sample is taken.
pub fn run_core(
    config: &CoreSoakConfig,
    records: &[MooncakeRecord],
    mut on_sample: impl FnMut(&CoreSample),
) -> anyhow::Result<CoreSoakOutcome> {
    anyhow::ensure!(!records.is_empty(), "the trace has no records");
    anyhow::ensure!(config.workers > 0, "--workers must be at least 1");
    anyhow::ensure!(config.concurrency > 0, "--concurrency must be at least 1");
    anyhow::ensure!(config.samples >= 1, "--samples must be at least 1");
    let engine = EngineConfig {
        block_size: config.block_size,
        num_blocks: config.num_blocks,
        max_model_len: 1 << 20,
        ..EngineConfig::default()
    };
    engine
        .validate()
        .map_err(|e| anyhow::anyhow!("engine: {e}"))?;
    let mut dispatcher_config = DispatcherConfig::default();
    dispatcher_config.router.policy = PolicyKind::Kv;
    dispatcher_config.router.sequences.block_size = config.block_size as u32;
    dispatcher_config.estimator.prefill_curve = engine.timing.prefill;
    dispatcher_config.estimator.chunk_tokens = engine.max_num_batched_tokens as u32;
    dispatcher_config.estimator.speedup = engine.timing.speedup;
    let mut dispatcher = Dispatcher::new(dispatcher_config, None)?;
    let mut engines = Vec::with_capacity(config.workers);
    for w in 0..config.workers {
        let capacity = WorkerCapacity {
            max_num_batched_tokens: Some(engine.max_num_batched_tokens as u64),
            kv_blocks: Some(engine.num_blocks as u64),
            kv_tokens: Some((engine.num_blocks * engine.block_size) as u64),
            block_size: None,
        };
        let _ = dispatcher.add_worker(WorkerId::new(w as u64), capacity, 0.0);
        engines.push(
            Engine::new(engine.clone(), SyncDevice::new(engine.timing.clone()))
                .map_err(|e| anyhow::anyhow!("engine: {e}"))?,
        );
    }
    let mut run = Run {
        config,
        dispatcher,
        streams: (0..config.workers)
            .map(|_| EngineEventStream::new(config.block_size as u32))
            .collect(),
        index_events: Vec::new(),
        reports: (0..config.workers).map(|_| StepReport::default()).collect(),
        engines,
        records,
        next_record: 0,
        started: HashMap::new(),
        in_flight: 0,
        now_ms: 0.0,
        kv_scratch: Vec::new(),
        payloads: HashMap::new(),
        ids: Vec::new(),
        out: CoreSoakOutcome {
            samples: Vec::with_capacity(config.samples + 1),
            block_events: 0,
            stored_blocks: 0,
            removed_blocks: 0,
            requests: 0,
            refused: 0,
            expired: 0,
            index_unknown_parent: 0,
            wall_seconds: 0.0,
            virtual_seconds: 0.0,
        },
    };
    let started = Instant::now();
    let every = (config.block_events / config.samples as u64).max(1);
    let mut next_sample = every;
    let mut next_expiry = config.expire_every_ms;
    while run.out.block_events < config.block_events {
        run.admit();
        run.step();
        if run.now_ms >= next_expiry {
            let fx = run.dispatcher.tick(run.now_ms);
            run.out.expired += u64::from(fx.counts.expired);
            run.carry_out(fx);
            next_expiry = run.now_ms + config.expire_every_ms;
        }
        while run.out.block_events >= next_sample && run.out.samples.len() < config.samples {
            let sample = run.sample(started);
            on_sample(&sample);
            run.out.samples.push(sample);
            next_sample += every;
        }
    }
    run.out.wall_seconds = started.elapsed().as_secs_f64();
    run.out.virtual_seconds = run.now_ms / 1000.0;
    run.out.index_unknown_parent = run
        .dispatcher
        .router()
        .with_index(|index| index.counters().unknown_parent);
    Ok(run.out)
}

impl Run<'_> {
    /// Submits requests until `concurrency` are in flight.
    fn admit(&mut self) {
        while self.in_flight < self.config.concurrency {
            let records = self.records;
            let n = records.len() as u64;
            let record = &records[(self.next_record % n) as usize];
            let pass = self.next_record / n;
            self.next_record += 1;
            self.ids.clear();
            self.ids
                .extend(record.hash_ids.iter().map(|&h| h ^ (pass << 48)));
            let len = record
                .input_length
                .min(self.config.max_prompt_tokens)
                .min(self.ids.len() as u32 * 512)
                .max(1);
            let mut tokens = Vec::new();
            synthetic_tokens(&self.ids, len as usize, &mut tokens);
            let blocks = local_block_hashes(&tokens, self.config.block_size, DEFAULT_SEED);
            let id = RequestId(u128::from(self.next_record));
            let submission = Submission {
                blocks,
                prompt_tokens: tokens.len() as u32,
                ..Submission::default()
            };
            let max_tokens = record.output_length.clamp(1, self.config.max_output_tokens);
            self.payloads.insert(id, (tokens, max_tokens));
            self.in_flight += 1;
            match self.dispatcher.submit(id, submission, self.now_ms) {
                Ok((_, fx)) => self.carry_out(fx),
                Err(_) => {
                    // Nothing waits here (no busy threshold, no strategy),
                    // so the queue never fills: counted, never hidden.
                    self.payloads.remove(&id);
                    self.in_flight -= 1;
                    self.out.refused += 1;
                    return;
                }
            }
        }
    }

    /// Starts what the dispatcher placed; a request an engine refuses is
    /// aborted (its booking freed) and counted.
    fn carry_out(&mut self, fx: Effects) {
        for sent in fx.dispatch {
            let Some((prompt, max_tokens)) = self.payloads.remove(&sent.id) else {
                continue;
            };
            self.out.requests += 1;
            let prompt_tokens = prompt.len() as u32;
            let engine = &mut self.engines[sent.worker.worker_id as usize];
            let admitted = engine.add_request(NewRequest {
                id: sent.id,
                prompt,
                max_tokens,
                hash_seed: DEFAULT_SEED,
                lora_name: None,
            });
            if admitted.is_err() {
                let fx = self.dispatcher.abort(sent.id, self.now_ms);
                debug_assert!(fx.dispatch.is_empty(), "nothing waits in the soak");
                self.out.refused += 1;
                self.in_flight -= 1;
                continue;
            }
            self.started.insert(sent.id, (prompt_tokens, true));
        }
        for id in fx.no_worker {
            self.payloads.remove(&id);
            self.in_flight -= 1;
        }
    }

    /// Steps every engine with work once, advances virtual time by the
    /// longest step, then applies first tokens, completions and KV events.
    fn step(&mut self) {
        let mut longest_ms = 0.0f64;
        for (engine, report) in self.engines.iter_mut().zip(&mut self.reports) {
            if !engine.has_work() {
                *report = StepReport::default();
                continue;
            }
            if engine.step(report).is_err() {
                *report = StepReport::default();
            }
            longest_ms = longest_ms.max(engine.config().timing.wall_ms(report.model_ms));
        }
        self.now_ms += longest_ms.max(1.0);
        let now = self.now_ms;
        for w in 0..self.engines.len() {
            let report = std::mem::take(&mut self.reports[w]);
            for token in &report.tokens {
                let Some((_, awaiting)) = self.started.get_mut(&token.request) else {
                    continue;
                };
                if std::mem::take(awaiting) {
                    let fx = self.dispatcher.first_token(token.request, now);
                    self.carry_out(fx);
                }
            }
            for done in &report.finished {
                let prompt = self.started.remove(&done.request).map_or(0, |s| s.0);
                let context = u64::from(prompt) + done.output_tokens as u64;
                let fx = self.dispatcher.finish(done.request, context, now);
                self.carry_out(fx);
                self.in_flight -= 1;
            }
            // The engine reuses the report's buffers on its next step.
            self.reports[w] = report;
            self.kv_scratch.clear();
            self.engines[w].drain_kv_events(&mut self.kv_scratch);
            let worker = WorkerId::new(w as u64);
            self.index_events.clear();
            self.streams[w].normalize(self.kv_scratch.drain(..), &mut self.index_events);
            for (tier, event) in &self.index_events {
                match event {
                    IndexEvent::Stored { blocks, .. } => {
                        self.out.stored_blocks += blocks.len() as u64;
                        self.out.block_events += blocks.len() as u64;
                    }
                    IndexEvent::Removed { blocks } => {
                        self.out.removed_blocks += blocks.len() as u64;
                        self.out.block_events += blocks.len() as u64;
                    }
                    IndexEvent::Cleared => self.out.block_events += 1,
                }
                self.dispatcher.apply_kv_event(worker, *tier, event);
            }
        }
    }

    fn sample(&self, started: Instant) -> CoreSample {
        let router = self.dispatcher.router();
        let memory = router.memory();
        let dispatcher_bytes = self.dispatcher.heap_bytes();
        CoreSample {
            block_events: self.out.block_events,
            requests: self.out.requests,
            wall_seconds: started.elapsed().as_secs_f64(),
            virtual_seconds: self.now_ms / 1000.0,
            live_pairs: router.with_index(|index| index.live_pairs()),
            active_requests: router.sequences().active_requests(),
            core_bytes: memory.total() + dispatcher_bytes,
            memory,
            dispatcher_bytes,
            rss_bytes: statm_rss_bytes(None),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn records() -> Vec<MooncakeRecord> {
        // Eight conversations of growing prompts sharing their first blocks.
        (0..64u64)
            .map(|i| MooncakeRecord {
                timestamp: i as f64 * 100.0,
                input_length: 512 * (1 + (i % 4) as u32),
                output_length: 8,
                hash_ids: (0..=(i % 4)).map(|b| (i % 8) * 100 + b).collect(),
            })
            .collect()
    }

    #[test]
    fn a_short_core_soak_takes_every_sample_and_frees_what_it_books() {
        let config = CoreSoakConfig {
            block_events: 60_000,
            samples: 8,
            workers: 2,
            concurrency: 16,
            num_blocks: 512,
            ..CoreSoakConfig::default()
        };
        let mut seen = 0;
        let out = run_core(&config, &records(), |_| seen += 1).unwrap();
        assert_eq!(out.samples.len(), 8);
        assert_eq!(seen, 8);
        assert!(out.block_events >= 60_000);
        assert!(out
            .samples
            .windows(2)
            .all(|w| w[0].block_events < w[1].block_events && w[0].requests <= w[1].requests));
        // The pools are small: engines evict, so removals keep pace.
        assert!(out.removed_blocks > out.stored_blocks / 2);
        assert!(out.samples.iter().all(|s| s.core_bytes > 0
            && s.core_bytes == s.memory.total() + s.dispatcher_bytes
            && s.active_requests <= 16));
        assert_eq!(
            (out.refused, out.expired, out.index_unknown_parent),
            (0, 0, 0)
        );
    }

    #[test]
    fn an_empty_trace_is_a_clear_error() {
        let err = run_core(&CoreSoakConfig::default(), &[], |_| {}).unwrap_err();
        assert_eq!(err.to_string(), "the trace has no records");
    }
}
