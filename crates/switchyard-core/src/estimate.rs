//! Prefill-duration hints: how long a request's uncached prefill should take
//! on a worker, for the active-sequence model's prefill-time rules
//! ([`crate::sequences`]: spillover, anchor shift).
//!
//! One estimator serves both drivers (the server and the simulator):
//!
//! - **The configured timing model** answers until a worker has been seen
//!   often enough: the prefill polynomial `ms = a·T² + b·T + c` per chunk of
//!   at most `chunk_tokens` uncached tokens (engines prefill long prompts in
//!   chunks of their batch budget), divided by the speed-up factor. The
//!   defaults are the documented fit the simulated engine also runs
//!   ([`DEFAULT_PREFILL_CURVE`], shared with `switchyard-engine`).
//! - **An online fit per worker**, from observed times to first token. A
//!   sample is taken only when the request was the sole local prefill on its
//!   worker when it was placed (otherwise its time to first token measures
//!   the queue, not its prefill), and it is compared with the model's time
//!   to first token *for the worker as it was* when the request was placed
//!   ([`EstimatorConfig::first_token_model_ms`]: half the decode step under
//!   way, then the prefill with one decode token per running request riding
//!   in it), so a worker that runs more requests, or requests holding more
//!   KV memory, is not taken for a slower one: the model already explains
//!   that part of its wait, and the fit learns the worker's speed alone.
//!   (Fitted against the bare prefill instead, the busier of two identical
//!   workers looked up to twice as slow end to end, and the `ttft` policy
//!   moved sessions off the worker holding their history.) Each worker
//!   keeps the newest [`EstimatorConfig::window`] samples; from
//!   [`EstimatorConfig::min_samples`] on, the estimate is
//!   `scale · model(T) + offset`, fitted by least squares
//!   over the window (the offset takes the network and framework overhead
//!   the model leaves out); when the samples' model times are too alike to
//!   separate scale from offset, the offset is zero and the scale is the
//!   median ratio. Scale and offset are clamped ([`SCALE_RANGE`],
//!   [`MAX_OFFSET_MS`]), so a worker reporting nonsense cannot push hints to
//!   zero or to minutes.
//!
//! Restores from a worker's host tier are priced by the configured model
//! alone, `tokens × restore_ms_per_token / speedup` (the engines' copy time
//! over their host-to-device link, [`default_restore_ms_per_token`]); the
//! online fit learns prefill times only.
//!
//! State is bounded: `window` samples per worker, and workers are forgotten
//! with [`PrefillEstimator::remove_worker`].

use crate::maps::FxHashMap;
use crate::select::PrefillTime;
use crate::types::WorkerId;
use serde::{Deserialize, Serialize};
use std::collections::VecDeque;

/// The documented prefill fit `[a, b, c]` of `a·T² + b·T + c` model
/// milliseconds for `T` uncached tokens in a batch (DESIGN.md, "Engine side").
pub const DEFAULT_PREFILL_CURVE: [f64; 3] = [4.209989e-7, 1.518344e-2, 16.50142];

/// The documented decode fit `[a, b, c]` of `a·u² + b·u + c` model
/// milliseconds for one decode-only step at KV usage `u` (used / total
/// device blocks; DESIGN.md, "Engine side").
pub const DEFAULT_DECODE_CURVE: [f64; 3] = [-25.74, 54.01, 5.74];

/// The documented lower bound of a decode step, model milliseconds.
pub const DEFAULT_DECODE_FLOOR_MS: f64 = 1.0;
/// Bytes of KV cache per token the engines' timing model assumes (the
/// simulated engine's default, shared with `switchyard-engine`).
pub const DEFAULT_KV_BYTES_PER_TOKEN: u64 = 128 * 1024;

/// Host-to-device bandwidth, bytes per second, the engines' timing model
/// assumes (shared with `switchyard-engine`).
pub const DEFAULT_RESTORE_BANDWIDTH_BYTES_PER_S: f64 = 64e9;

/// Model milliseconds to restore one token of KV from a host tier at
/// `bytes_per_token` over `bandwidth_bytes_per_s`: the engine's
/// `restore_ms` per token.
pub fn restore_ms_per_token(bytes_per_token: u64, bandwidth_bytes_per_s: f64) -> f64 {
    bytes_per_token as f64 / bandwidth_bytes_per_s * 1e3
}

/// [`restore_ms_per_token`] at the timing model's defaults (128 KiB a
/// token over 64 GB/s: 0.002048 ms a token).
pub fn default_restore_ms_per_token() -> f64 {
    restore_ms_per_token(
        DEFAULT_KV_BYTES_PER_TOKEN,
        DEFAULT_RESTORE_BANDWIDTH_BYTES_PER_S,
    )
}

/// The fitted scale is kept within this range.
pub const SCALE_RANGE: (f64, f64) = (0.02, 50.0);

/// The fitted offset is kept within `0..=MAX_OFFSET_MS`.
pub const MAX_OFFSET_MS: f64 = 5_000.0;

/// Settings of a [`PrefillEstimator`].
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct EstimatorConfig {
    /// Prefill polynomial `[a, b, c]` (model ms for `T` tokens).
    pub prefill_curve: [f64; 3],
    /// Decode-step polynomial `[a, b, c]` (model ms at KV usage `u`).
    pub decode_curve: [f64; 3],
    /// Lower bound of a decode step (model ms).
    pub decode_floor_ms: f64,
    /// Model ms each running sequence adds to a step (the engine
    /// profile's `decode_per_sequence_ms`; 0 by default).
    pub decode_per_sequence_ms: f64,
    /// Most uncached tokens an engine prefills in one step (its
    /// `max_num_batched_tokens`); longer prompts take several steps.
    pub chunk_tokens: u32,
    /// Model milliseconds to restore one token of KV from a worker's host
    /// tier (the engines' bytes per token over their host-to-device
    /// bandwidth; default [`default_restore_ms_per_token`]). Priced by the
    /// `ttft` policy for prompt blocks found in a host tier.
    pub restore_ms_per_token: f64,
    /// Wall time = model time / `speedup` (the simulated engine's factor;
    /// 1 for a real engine, whose scale the online fit learns anyway; 0 for
    /// an instant engine, whose hints are all zero).
    pub speedup: f64,
    /// Fit each worker from observed times to first token.
    pub online: bool,
    /// Samples before a worker's fit replaces the model.
    pub min_samples: usize,
    /// Newest samples kept per worker.
    pub window: usize,
    /// The link KV moves over between workers, when the driver can move
    /// it (a peer restore, see [`crate::select::PeerSource`]); `None`: it
    /// cannot, and no policy offers one. Set by the simulator only (not
    /// read from a config file: `serve` cannot move KV between workers).
    #[serde(skip)]
    pub peer_transfer: Option<PeerTransferModel>,
}

/// Model time to move KV between two workers: `latency_ms + tokens ×
/// ms_per_token` (divided by the speed-up, as every model time is).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PeerTransferModel {
    /// Fixed cost per transfer (model ms).
    pub latency_ms: f64,
    /// Model ms per token moved.
    pub ms_per_token: f64,
}

impl Default for EstimatorConfig {
    fn default() -> Self {
        Self {
            prefill_curve: DEFAULT_PREFILL_CURVE,
            decode_curve: DEFAULT_DECODE_CURVE,
            decode_floor_ms: DEFAULT_DECODE_FLOOR_MS,
            decode_per_sequence_ms: 0.0,
            chunk_tokens: 8192,
            restore_ms_per_token: default_restore_ms_per_token(),
            speedup: 1.0,
            online: true,
            min_samples: 16,
            window: 64,
            peer_transfer: None,
        }
    }
}

/// Why an [`EstimatorConfig`] was refused.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum EstimatorConfigError {
    /// A coefficient that is not finite.
    #[error("prefill_curve coefficients must be finite")]
    Curve,
    /// A decode coefficient that is not finite, or a floor that is
    /// negative or not finite.
    #[error("decode_curve coefficients must be finite, decode_floor_ms and decode_per_sequence_ms finite and >= 0")]
    DecodeCurve,
    /// A chunk of zero tokens.
    #[error("chunk_tokens must be at least 1")]
    Chunk,
    /// A restore cost that is negative or not finite.
    #[error("restore_ms_per_token must be a finite number >= 0, got {0}")]
    RestoreCost(f64),
    /// A speed-up that is negative or not finite.
    #[error("speedup must be a finite number >= 0, got {0}")]
    Speedup(f64),
    /// A window smaller than the samples a fit needs, or a fit from fewer
    /// than two samples.
    #[error(
        "window ({window}) must be at least min_samples ({min_samples}), which must be at least 2"
    )]
    Window {
        /// The window.
        window: usize,
        /// The samples a fit needs.
        min_samples: usize,
    },
}

impl EstimatorConfig {
    /// Checks ranges and relations.
    pub fn validate(&self) -> Result<(), EstimatorConfigError> {
        if self.prefill_curve.iter().any(|c| !c.is_finite()) {
            return Err(EstimatorConfigError::Curve);
        }
        if self.decode_curve.iter().any(|c| !c.is_finite())
            || !(self.decode_floor_ms.is_finite() && self.decode_floor_ms >= 0.0)
            || !(self.decode_per_sequence_ms.is_finite() && self.decode_per_sequence_ms >= 0.0)
        {
            return Err(EstimatorConfigError::DecodeCurve);
        }
        if self.chunk_tokens == 0 {
            return Err(EstimatorConfigError::Chunk);
        }
        if !(self.restore_ms_per_token.is_finite() && self.restore_ms_per_token >= 0.0) {
            return Err(EstimatorConfigError::RestoreCost(self.restore_ms_per_token));
        }
        if !(self.speedup.is_finite() && self.speedup >= 0.0) {
            return Err(EstimatorConfigError::Speedup(self.speedup));
        }
        if let Some(t) = self.peer_transfer {
            for v in [t.latency_ms, t.ms_per_token] {
                if !(v.is_finite() && v >= 0.0) {
                    return Err(EstimatorConfigError::RestoreCost(v));
                }
            }
        }
        if self.min_samples < 2 || self.window < self.min_samples {
            return Err(EstimatorConfigError::Window {
                window: self.window,
                min_samples: self.min_samples,
            });
        }
        Ok(())
    }

    /// The configured model: wall milliseconds to prefill `tokens`
    /// uncached tokens, chunked as the engine batches them (no tokens, no
    /// time).
    pub fn model_ms(&self, tokens: u64) -> f64 {
        if self.speedup == 0.0 {
            return 0.0;
        }
        let [a, b, c] = self.prefill_curve;
        let chunk = u64::from(self.chunk_tokens);
        let curve = |t: u64| {
            let t = t as f64;
            (a * t * t + b * t + c).max(0.0)
        };
        // Most prompts fit one chunk: no division for them (it is the
        // slowest instruction here, and routing asks this per candidate).
        let (full, rest) = if tokens < chunk {
            (0, tokens)
        } else {
            (tokens / chunk, tokens % chunk)
        };
        let mut ms = if full > 0 {
            full as f64 * curve(chunk)
        } else {
            0.0
        };
        if rest > 0 {
            ms += curve(rest);
        }
        ms / self.speedup
    }

    /// Wall milliseconds to restore `tokens` tokens of KV from a host
    /// tier: `tokens × restore_ms_per_token / speedup` (0 for an instant
    /// engine).
    pub fn restore_model_ms(&self, tokens: u64) -> f64 {
        if self.speedup == 0.0 {
            return 0.0;
        }
        tokens as f64 * self.restore_ms_per_token / self.speedup
    }

    /// Wall milliseconds to move `tokens` tokens of KV from one worker to
    /// another, when [`Self::peer_transfer`] says how.
    pub fn transfer_model_ms(&self, tokens: u64) -> Option<f64> {
        let t = self.peer_transfer?;
        if self.speedup == 0.0 {
            return Some(0.0);
        }
        Some((t.latency_ms + tokens as f64 * t.ms_per_token) / self.speedup)
    }
}

impl EstimatorConfig {
    /// The configured model: wall milliseconds from placing a request of
    /// `tokens` uncached tokens on a worker running `running` requests that
    /// hold `held` of its KV memory to its first token — half the decode
    /// step under way when it lands (none on an idle worker), then its
    /// prefill with one decode token per running request in the batch;
    /// both steps carry each running sequence's cost.
    pub fn first_token_model_ms(&self, tokens: u64, running: usize, held: f64) -> f64 {
        let sequences = self.sequences_model_ms(running);
        let wait = if running == 0 {
            0.0
        } else {
            0.5 * (self.decode_model_ms(held) + sequences)
        };
        wait + self.model_ms(tokens + running as u64) + sequences
    }

    /// Wall milliseconds `running` sequences add to a step.
    pub fn sequences_model_ms(&self, running: usize) -> f64 {
        if self.speedup == 0.0 {
            return 0.0;
        }
        self.decode_per_sequence_ms * running as f64 / self.speedup
    }

    /// The configured model: wall milliseconds of one decode-only step at
    /// KV usage `usage` (clamped to 0..=1).
    pub fn decode_model_ms(&self, usage: f64) -> f64 {
        if self.speedup == 0.0 {
            return 0.0;
        }
        let u = if usage.is_nan() {
            0.0
        } else {
            usage.clamp(0.0, 1.0)
        };
        let [a, b, c] = self.decode_curve;
        (a * u * u + b * u + c).max(self.decode_floor_ms) / self.speedup
    }
}

impl EstimatorConfig {
    /// Expected wall milliseconds to prefill `tokens` uncached tokens on a
    /// worker with `fit` (the configured model without one).
    pub fn fitted_model_ms(&self, fit: Option<Fit>, tokens: u64) -> f64 {
        let model = self.model_ms(tokens);
        match fit {
            Some(fit) => fit.scale * model + fit.offset_ms,
            None => model,
        }
    }

    /// The configured decode model, times the fitted scale (a worker whose
    /// prefills run twice the model's time decodes at half its speed too;
    /// the offset is a per-request overhead, not a per-step one).
    pub fn fitted_decode_step_ms(&self, fit: Option<Fit>, usage: f64) -> f64 {
        let model = self.decode_model_ms(usage);
        match fit {
            Some(fit) => fit.scale * model,
            None => model,
        }
    }
}

impl PrefillTime for EstimatorConfig {
    /// The configured model, the same for every worker.
    fn prefill_ms(&self, _worker: WorkerId, tokens: u64) -> f64 {
        self.model_ms(tokens)
    }

    fn decode_step_ms(&self, _worker: WorkerId, usage: f64) -> f64 {
        self.decode_model_ms(usage)
    }

    fn restore_ms(&self, _worker: WorkerId, tokens: u64) -> f64 {
        self.restore_model_ms(tokens)
    }

    fn transfer_ms(&self, _worker: WorkerId, tokens: u64) -> Option<f64> {
        self.transfer_model_ms(tokens)
    }
}

/// Per-worker fits with the settings they refine: priced the estimator's
/// way ([`PrefillTime`] for every such source: the estimator itself, and
/// the load board's copy of its fits, `crate::router::board`).
pub(crate) trait Fits {
    /// The settings.
    fn settings(&self) -> &EstimatorConfig;
    /// `worker`'s fit in force, if any.
    fn fit_of(&self, worker: WorkerId) -> Option<Fit>;
}

impl Fits for PrefillEstimator {
    fn settings(&self) -> &EstimatorConfig {
        &self.config
    }

    fn fit_of(&self, worker: WorkerId) -> Option<Fit> {
        self.fit(worker)
    }
}

impl<T: Fits> PrefillTime for T {
    fn prefill_ms(&self, worker: WorkerId, tokens: u64) -> f64 {
        self.settings().fitted_model_ms(self.fit_of(worker), tokens)
    }

    /// The configured decode model, times the worker's fitted scale (a
    /// worker whose prefills run twice the model's time decodes at half
    /// its speed too; the offset is a per-request overhead, not a
    /// per-step one).
    fn decode_step_ms(&self, worker: WorkerId, usage: f64) -> f64 {
        self.settings()
            .fitted_decode_step_ms(self.fit_of(worker), usage)
    }

    /// The configured model: restores are not fitted.
    fn restore_ms(&self, _worker: WorkerId, tokens: u64) -> f64 {
        self.settings().restore_model_ms(tokens)
    }

    /// The configured model: transfers are not fitted.
    fn transfer_ms(&self, _worker: WorkerId, tokens: u64) -> Option<f64> {
        self.settings().transfer_model_ms(tokens)
    }
}

/// A worker's fit: `scale · model(T) + offset`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Fit {
    /// Multiplies the model.
    pub scale: f64,
    /// Added to it, in ms.
    pub offset_ms: f64,
    /// Samples it was fitted from.
    pub samples: usize,
}

#[derive(Debug, Default)]
struct WorkerSamples {
    /// `(model ms, observed ms)`, newest last.
    samples: VecDeque<(f64, f64)>,
    fit: Option<Fit>,
}

/// Prefill-duration hints per worker (see the module docs).
#[derive(Debug)]
pub struct PrefillEstimator {
    config: EstimatorConfig,
    workers: FxHashMap<WorkerId, WorkerSamples>,
    rejected_samples: u64,
}

impl PrefillEstimator {
    /// An estimator; `config` must validate.
    pub fn new(config: EstimatorConfig) -> Result<Self, EstimatorConfigError> {
        config.validate()?;
        Ok(Self {
            config,
            workers: FxHashMap::default(),
            rejected_samples: 0,
        })
    }

    /// The settings in force.
    pub fn config(&self) -> &EstimatorConfig {
        &self.config
    }

    /// Expected wall milliseconds for `worker` to prefill `tokens` uncached
    /// tokens.
    pub fn expected_ms(&self, worker: WorkerId, tokens: u64) -> f64 {
        self.config.fitted_model_ms(self.fit(worker), tokens)
    }

    /// The fit in force for `worker`, once it has enough samples.
    pub fn fit(&self, worker: WorkerId) -> Option<Fit> {
        self.workers.get(&worker).and_then(|w| w.fit)
    }

    /// Every worker's fit in force.
    pub fn fits(&self) -> impl Iterator<Item = (WorkerId, Fit)> + '_ {
        self.workers
            .iter()
            .filter_map(|(&worker, w)| Some((worker, w.fit?)))
    }

    /// Samples refused as not finite or not positive (counted, never used).
    pub fn rejected_samples(&self) -> u64 {
        self.rejected_samples
    }

    /// Records one observation: a request, the only local prefill on
    /// `worker` when it was placed, took `observed_ms` from placement to its
    /// first token, where the configured model expected `model` ms for the
    /// worker as it was then ([`EstimatorConfig::first_token_model_ms`]).
    /// Ignored when the fit is off.
    pub fn observe(&mut self, worker: WorkerId, model: f64, observed_ms: f64) {
        if !self.config.online {
            return;
        }
        if !(observed_ms.is_finite() && observed_ms > 0.0 && model.is_finite() && model > 0.0) {
            self.rejected_samples += 1;
            return;
        }
        let entry = self.workers.entry(worker).or_default();
        if entry.samples.len() == self.config.window {
            entry.samples.pop_front();
        }
        entry.samples.push_back((model, observed_ms));
        if entry.samples.len() >= self.config.min_samples {
            entry.fit = Some(fit(&entry.samples));
        }
    }

    /// Forgets a worker's samples (it left the fleet).
    pub fn remove_worker(&mut self, worker: WorkerId) {
        self.workers.remove(&worker);
    }

    /// Heap bytes held (sample windows and the worker map).
    pub fn heap_bytes(&self) -> usize {
        crate::maps::map_bytes(&self.workers)
            + self
                .workers
                .values()
                .map(|w| w.samples.capacity() * std::mem::size_of::<(f64, f64)>())
                .sum::<usize>()
    }
}

/// Least squares of `observed = scale · model + offset`, clamped; the
/// median ratio with no offset when the model times barely vary.
fn fit(samples: &VecDeque<(f64, f64)>) -> Fit {
    let n = samples.len() as f64;
    let mean_x = samples.iter().map(|s| s.0).sum::<f64>() / n;
    let mean_y = samples.iter().map(|s| s.1).sum::<f64>() / n;
    let sxx: f64 = samples.iter().map(|s| (s.0 - mean_x).powi(2)).sum();
    let sxy: f64 = samples
        .iter()
        .map(|s| (s.0 - mean_x) * (s.1 - mean_y))
        .sum();
    // Relative spread of the model times: below 10% the slope is noise.
    let spread = (sxx / n).sqrt() / mean_x;
    let (scale, offset_ms) = if spread >= 0.1 {
        let scale = (sxy / sxx).clamp(SCALE_RANGE.0, SCALE_RANGE.1);
        let offset = (mean_y - scale * mean_x).clamp(0.0, MAX_OFFSET_MS);
        (scale, offset)
    } else {
        let mut ratios: Vec<f64> = samples.iter().map(|s| s.1 / s.0).collect();
        ratios.sort_unstable_by(f64::total_cmp);
        let median = ratios[ratios.len() / 2];
        (median.clamp(SCALE_RANGE.0, SCALE_RANGE.1), 0.0)
    };
    Fit {
        scale,
        offset_ms,
        samples: samples.len(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn estimator() -> PrefillEstimator {
        PrefillEstimator::new(EstimatorConfig::default()).unwrap()
    }

    const W: WorkerId = WorkerId::new(1);

    #[test]
    fn the_model_is_the_documented_polynomial_divided_by_the_speedup() {
        let config = EstimatorConfig {
            speedup: 4.0,
            ..EstimatorConfig::default()
        };
        let expected = (4.209989e-7 * 1e6 + 1.518344e-2 * 1000.0 + 16.50142) / 4.0;
        assert!((config.model_ms(1000) - expected).abs() < 1e-9);
    }

    #[test]
    fn a_decode_step_is_the_documented_curve_at_the_usage_over_the_speedup() {
        let config = EstimatorConfig {
            speedup: 4.0,
            ..EstimatorConfig::default()
        };
        let at = |u: f64| (-25.74 * u * u + 54.01 * u + 5.74) / 4.0;
        assert!((config.decode_model_ms(0.5) - at(0.5)).abs() < 1e-9);
        // Usage is clamped to 0..=1 (NaN reads as empty).
        assert!((config.decode_model_ms(7.0) - at(1.0)).abs() < 1e-9);
        assert!((config.decode_model_ms(f64::NAN) - at(0.0)).abs() < 1e-9);
        // Never below the floor; an instant engine takes no time.
        let floor = EstimatorConfig {
            decode_curve: [0.0, 0.0, -5.0],
            ..EstimatorConfig::default()
        };
        assert_eq!(floor.decode_model_ms(0.3), DEFAULT_DECODE_FLOOR_MS);
        let instant = EstimatorConfig {
            speedup: 0.0,
            ..EstimatorConfig::default()
        };
        assert_eq!(instant.decode_model_ms(0.9), 0.0);
    }

    #[test]
    fn a_worker_fitted_slower_decodes_slower_by_the_same_scale() {
        let mut e = estimator();
        for i in 0..64u64 {
            let tokens = 200 + i * 100;
            e.observe(
                W,
                e.config().model_ms(tokens),
                3.0 * e.config().model_ms(tokens) + 7.0,
            );
        }
        let model = e.config().decode_model_ms(0.5);
        assert!((e.decode_step_ms(W, 0.5) - 3.0 * model).abs() < 1e-6);
        assert_eq!(e.decode_step_ms(WorkerId::new(2), 0.5), model);
    }

    #[test]
    fn a_long_prompt_is_prefilled_in_chunks_of_the_batch_budget() {
        let config = EstimatorConfig {
            chunk_tokens: 1000,
            ..EstimatorConfig::default()
        };
        let one = config.model_ms(1000);
        assert!((config.model_ms(2500) - (2.0 * one + config.model_ms(500))).abs() < 1e-9);
        assert_eq!(config.model_ms(0), 0.0);
    }

    #[test]
    fn without_enough_samples_the_model_answers() {
        let mut e = estimator();
        for _ in 0..15 {
            e.observe(W, e.config().model_ms(1000), 500.0);
        }
        assert_eq!(e.fit(W), None);
        assert_eq!(e.expected_ms(W, 1000), e.config().model_ms(1000));
    }

    #[test]
    fn a_worker_three_times_slower_with_a_fixed_overhead_is_learned() {
        let mut e = estimator();
        for i in 0..64u64 {
            let tokens = 200 + i * 100;
            let observed = 3.0 * e.config().model_ms(tokens) + 7.0;
            e.observe(W, e.config().model_ms(tokens), observed);
        }
        let fit = e.fit(W).unwrap();
        assert!((fit.scale - 3.0).abs() < 1e-6, "{fit:?}");
        assert!((fit.offset_ms - 7.0).abs() < 1e-6, "{fit:?}");
        let expected = 3.0 * e.config().model_ms(5000) + 7.0;
        assert!((e.expected_ms(W, 5000) - expected).abs() < 1e-6);
        // Another worker still gets the model.
        let other = WorkerId::new(2);
        assert_eq!(e.expected_ms(other, 5000), e.config().model_ms(5000));
    }

    #[test]
    fn alike_prompts_give_a_median_ratio_and_no_offset() {
        let mut e = estimator();
        for i in 0..20 {
            // Every sample the same length: the slope is undefined.
            e.observe(
                W,
                e.config().model_ms(1000),
                e.config().model_ms(1000) * if i % 2 == 0 { 2.0 } else { 2.2 },
            );
        }
        let fit = e.fit(W).unwrap();
        assert_eq!(fit.offset_ms, 0.0);
        assert!((fit.scale - 2.2).abs() < 1e-9 || (fit.scale - 2.0).abs() < 1e-9);
    }

    #[test]
    fn nonsense_samples_are_counted_and_never_used() {
        let mut e = estimator();
        for bad in [f64::NAN, f64::INFINITY, -1.0, 0.0] {
            e.observe(W, e.config().model_ms(1000), bad);
        }
        assert_eq!(e.rejected_samples(), 4);
        // A model time that is not a positive finite number is refused too.
        for bad in [f64::NAN, f64::INFINITY, 0.0] {
            e.observe(W, bad, 10.0);
        }
        assert_eq!(e.rejected_samples(), 7);
        assert_eq!(e.heap_bytes(), 0);
    }

    #[test]
    fn the_model_time_to_first_token_adds_half_a_decode_step_and_the_riding_tokens() {
        let config = EstimatorConfig {
            speedup: 4.0,
            ..EstimatorConfig::default()
        };
        // Idle: the prefill alone.
        assert_eq!(
            config.first_token_model_ms(1000, 0, 0.0),
            config.model_ms(1000)
        );
        // Three running requests holding 40% of the memory: half of that
        // decode step, then 1,003 tokens in the prefill step.
        let expected = 0.5 * config.decode_model_ms(0.4) + config.model_ms(1003);
        assert!((config.first_token_model_ms(1000, 3, 0.4) - expected).abs() < 1e-12);
    }

    #[test]
    fn each_running_sequence_adds_its_cost_to_both_steps_before_the_first_token() {
        let config = EstimatorConfig {
            speedup: 2.0,
            decode_per_sequence_ms: 0.5,
            ..EstimatorConfig::default()
        };
        let without = EstimatorConfig {
            decode_per_sequence_ms: 0.0,
            ..config
        };
        // Eight sequences: 4 model ms a step, 2 wall ms; half of it in
        // the step under way, all of it in the prefill's step.
        assert_eq!(config.sequences_model_ms(8), 2.0);
        let added =
            config.first_token_model_ms(1000, 8, 0.3) - without.first_token_model_ms(1000, 8, 0.3);
        assert!((added - 3.0).abs() < 1e-12, "{added}");
        assert_eq!(
            config.first_token_model_ms(1000, 0, 0.0),
            without.first_token_model_ms(1000, 0, 0.0),
            "an idle worker runs none"
        );
        let bad = EstimatorConfig {
            decode_per_sequence_ms: -1.0,
            ..config
        };
        assert_eq!(bad.validate(), Err(EstimatorConfigError::DecodeCurve));
    }

    #[test]
    fn a_busier_worker_of_the_same_speed_is_not_learned_as_slower() {
        // Two workers of the model's speed with 20 ms of overhead; one runs
        // nothing when its samples are taken, the other eight requests
        // holding 60% of its memory. Each observes exactly what the model
        // says for its state.
        let config = EstimatorConfig::default();
        let mut e = PrefillEstimator::new(config).unwrap();
        let busy = WorkerId::new(2);
        for i in 0..64u64 {
            let tokens = 200 + i * 100;
            let idle_ms = config.first_token_model_ms(tokens, 0, 0.0);
            e.observe(W, idle_ms, idle_ms + 20.0);
            let busy_ms = config.first_token_model_ms(tokens, 8, 0.6);
            e.observe(busy, busy_ms, busy_ms + 20.0);
        }
        let (idle, loaded) = (e.fit(W).unwrap(), e.fit(busy).unwrap());
        assert!((idle.scale - 1.0).abs() < 1e-6, "{idle:?}");
        assert!((loaded.scale - 1.0).abs() < 1e-6, "{loaded:?}");
        assert!((idle.offset_ms - 20.0).abs() < 1e-6, "{idle:?}");
        assert!((loaded.offset_ms - 20.0).abs() < 1e-6, "{loaded:?}");
        assert!((e.expected_ms(W, 3000) - e.expected_ms(busy, 3000)).abs() < 1e-6);
    }

    #[test]
    fn the_fit_can_be_turned_off() {
        let mut e = PrefillEstimator::new(EstimatorConfig {
            online: false,
            ..EstimatorConfig::default()
        })
        .unwrap();
        for _ in 0..100 {
            e.observe(W, e.config().model_ms(1000), 1.0);
        }
        assert_eq!(e.fit(W), None);
    }

    #[test]
    fn bad_settings_are_refused() {
        let bad = |c: EstimatorConfig| PrefillEstimator::new(c).unwrap_err();
        let d = EstimatorConfig::default();
        assert_eq!(
            bad(EstimatorConfig { speedup: -1.0, ..d }),
            EstimatorConfigError::Speedup(-1.0)
        );
        assert_eq!(
            bad(EstimatorConfig {
                chunk_tokens: 0,
                ..d
            }),
            EstimatorConfigError::Chunk
        );
        assert!(matches!(
            bad(EstimatorConfig { window: 8, ..d }),
            EstimatorConfigError::Window { .. }
        ));
        assert_eq!(
            bad(EstimatorConfig {
                prefill_curve: [f64::NAN, 0.0, 0.0],
                ..d
            }),
            EstimatorConfigError::Curve
        );
        for (decode_curve, decode_floor_ms) in [
            ([0.0, f64::INFINITY, 0.0], 1.0),
            (DEFAULT_DECODE_CURVE, -1.0),
            (DEFAULT_DECODE_CURVE, f64::NAN),
        ] {
            let c = EstimatorConfig {
                decode_curve,
                decode_floor_ms,
                ..d
            };
            assert_eq!(bad(c), EstimatorConfigError::DecodeCurve);
        }
        for cost in [-0.5, f64::INFINITY] {
            assert_eq!(
                bad(EstimatorConfig {
                    restore_ms_per_token: cost,
                    ..d
                }),
                EstimatorConfigError::RestoreCost(cost)
            );
        }
        assert!(matches!(
            bad(EstimatorConfig {
                restore_ms_per_token: f64::NAN,
                ..d
            }),
            EstimatorConfigError::RestoreCost(_)
        ));
    }

    #[test]
    fn a_restore_costs_the_engines_copy_time_divided_by_the_speedup() {
        // 128 KiB a token over 64 GB/s: 131,072 / 64e9 s = 2.048 µs a token.
        assert!((default_restore_ms_per_token() - 0.002048).abs() < 1e-12);
        let config = EstimatorConfig {
            speedup: 4.0,
            ..EstimatorConfig::default()
        };
        // 10,000 tokens: 20.48 model ms, 5.12 wall ms at speed-up 4.
        assert!((config.restore_model_ms(10_000) - 5.12).abs() < 1e-9);
        let e = PrefillEstimator::new(config).unwrap();
        assert_eq!(e.restore_ms(W, 10_000), config.restore_model_ms(10_000));
        let instant = EstimatorConfig {
            speedup: 0.0,
            ..EstimatorConfig::default()
        };
        assert_eq!(instant.restore_model_ms(10_000), 0.0);
    }

    proptest! {
        /// Whatever a worker reports, the window stays bounded and the fit
        /// stays in its clamps.
        #[test]
        fn the_window_is_bounded_and_the_fit_clamped(
            samples in proptest::collection::vec((0u64..100_000, -1e6f64..1e7), 0..300)
        ) {
            let mut e = estimator();
            for (tokens, observed) in samples {
                e.observe(W, e.config().model_ms(tokens), observed);
            }
            if let Some(fit) = e.fit(W) {
                prop_assert!(fit.samples <= 64);
                prop_assert!((SCALE_RANGE.0..=SCALE_RANGE.1).contains(&fit.scale));
                prop_assert!((0.0..=MAX_OFFSET_MS).contains(&fit.offset_ms));
                prop_assert!(e.expected_ms(W, 1000).is_finite());
            }
        }
    }
}
