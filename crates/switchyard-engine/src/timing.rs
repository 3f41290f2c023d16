//! The timing model: how long a step or a host-tier restore takes.
//!
//! Fitted polynomials (DESIGN.md, "Engine side"):
//!
//! - prefill: `ms = a·T² + b·T + c`, `T` = uncached tokens computed in the
//!   batch (decode tokens riding along in a mixed batch count too);
//! - decode-only batch: `ms = a·u² + b·u + c` with `u` = used / total device
//!   KV blocks, never below [`TimingConfig::decode_floor_ms`];
//! - speculative decoding: a step verifying drafted positions computes them
//!   too — with prefill work they join `T`; in a decode-only batch each
//!   costs the prefill fit's per-token slope `b` on top of the decode time
//!   (the batch's extra compute; with no drafts nothing changes);
//! - restore: `tokens × bytes_per_token / bandwidth`, added to the step that
//!   carries the restore; the same host link carries a spilled sequence's
//!   state both ways (saved on preemption, loaded on resume) and logits read
//!   back to the host (`rows × vocab × elem_bytes / bandwidth`).
//!
//! All of these are *model* milliseconds. [`TimingConfig::wall_ms`] divides by
//! the speed-up factor for a real-time driver (`0` makes every step instant).

use serde::{Deserialize, Serialize};
use switchyard_core::engine_profile::EngineProfile;

/// Timing-model knobs. Defaults are the documented fit.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TimingConfig {
    /// Prefill polynomial `[a, b, c]` in `a·T² + b·T + c` (ms, `T` tokens).
    pub prefill: [f64; 3],
    /// Decode polynomial `[a, b, c]` in `a·u² + b·u + c` (ms, `u` KV usage 0..=1).
    pub decode: [f64; 3],
    /// Lower bound of a decode step (ms).
    pub decode_floor_ms: f64,
    /// Model ms each sequence decoding in a step adds to it, decode-only or
    /// beside a prefill (per-sequence work: sampling, streaming; 0 by
    /// default, as in the fit the defaults come from).
    pub decode_per_sequence_ms: f64,
    /// Bytes of KV cache per token, for restore time (default 128 KiB).
    pub bytes_per_token: u64,
    /// Host-to-device bandwidth in bytes per second (default 64 GB/s).
    pub restore_bandwidth_bytes_per_s: f64,
    /// Real-time speed-up: wall time = model time / speedup; `0` = instant.
    pub speedup: f64,
    /// A hybrid model's SSM layers (`None`: attention only).
    pub ssm: Option<SsmTiming>,
}

/// The cost of a hybrid model's layers: the attention layers are
/// `attention_share` of the model and cost that share of the fitted
/// curves' token- and usage-dependent parts; the SSM layers cost
/// `ms_per_token` per computed token, independent of context (their state
/// has a fixed size). The defaults are assumptions, not a measured model:
/// one attention layer in eight (Jamba's published 1:7 interleave), and
/// SSM layers as costly per token as the attention layers' linear part.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SsmTiming {
    /// Share of the layers that are attention (0..=1; 0.125).
    pub attention_share: f64,
    /// Model ms per computed token in the SSM layers.
    pub ms_per_token: f64,
}

impl Default for SsmTiming {
    fn default() -> Self {
        let share = 0.125;
        Self {
            attention_share: share,
            ms_per_token: (1.0 - share) * switchyard_core::estimate::DEFAULT_PREFILL_CURVE[1],
        }
    }
}

impl Default for TimingConfig {
    fn default() -> Self {
        Self {
            prefill: switchyard_core::estimate::DEFAULT_PREFILL_CURVE,
            decode: switchyard_core::estimate::DEFAULT_DECODE_CURVE,
            decode_floor_ms: switchyard_core::estimate::DEFAULT_DECODE_FLOOR_MS,
            decode_per_sequence_ms: 0.0,
            bytes_per_token: switchyard_core::estimate::DEFAULT_KV_BYTES_PER_TOKEN,
            restore_bandwidth_bytes_per_s:
                switchyard_core::estimate::DEFAULT_RESTORE_BANDWIDTH_BYTES_PER_S,
            speedup: 1.0,
            ssm: None,
        }
    }
}

/// A timing configuration that makes no sense.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum TimingConfigError {
    /// Speed-up must be finite and not negative.
    #[error("speedup must be a finite number >= 0, got {0}")]
    Speedup(f64),
    /// Restore bandwidth must be positive.
    #[error("restore bandwidth must be > 0 bytes/s, got {0}")]
    Bandwidth(f64),
    /// Polynomial coefficients must be finite.
    #[error("timing coefficients must be finite")]
    Coefficients,
    /// SSM knobs out of range.
    #[error("ssm: attention_share must be in 0..=1 and ms_per_token a finite number >= 0")]
    Ssm,
}

impl TimingConfig {
    /// This timing with `profile`'s curves (speed-up, restore bandwidth
    /// and the rest unchanged).
    pub fn with_profile(self, profile: &EngineProfile) -> Self {
        Self {
            prefill: profile.prefill,
            decode: profile.decode,
            decode_floor_ms: profile.decode_floor_ms,
            decode_per_sequence_ms: profile.decode_per_sequence_ms,
            ..self
        }
    }

    /// Checks ranges.
    pub fn validate(&self) -> Result<(), TimingConfigError> {
        if !self.speedup.is_finite() || self.speedup < 0.0 {
            return Err(TimingConfigError::Speedup(self.speedup));
        }
        if !(self.restore_bandwidth_bytes_per_s.is_finite()
            && self.restore_bandwidth_bytes_per_s > 0.0)
        {
            return Err(TimingConfigError::Bandwidth(
                self.restore_bandwidth_bytes_per_s,
            ));
        }
        let all = self
            .prefill
            .iter()
            .chain(&self.decode)
            .chain(std::iter::once(&self.decode_floor_ms));
        if all.into_iter().any(|c| !c.is_finite())
            || !(self.decode_per_sequence_ms.is_finite() && self.decode_per_sequence_ms >= 0.0)
        {
            return Err(TimingConfigError::Coefficients);
        }
        if let Some(ssm) = self.ssm {
            let share = (0.0..=1.0).contains(&ssm.attention_share);
            let cost = ssm.ms_per_token.is_finite() && ssm.ms_per_token >= 0.0;
            if !(share && cost) {
                return Err(TimingConfigError::Ssm);
            }
        }
        Ok(())
    }

    /// Model ms of a batch computing `tokens` uncached tokens with prefill work.
    pub fn prefill_ms(&self, tokens: u64) -> f64 {
        let t = tokens as f64;
        let [a, b, c] = self.prefill;
        match self.ssm {
            None => (a * t * t + b * t + c).max(0.0),
            Some(ssm) => {
                (ssm.attention_share * (a * t * t + b * t) + c + ssm.ms_per_token * t).max(0.0)
            }
        }
    }

    /// Model ms of a decode-only batch at KV usage `usage` (clamped to 0..=1).
    pub fn decode_ms(&self, usage: f64) -> f64 {
        let u = usage.clamp(0.0, 1.0);
        let [a, b, c] = self.decode;
        let share = self.ssm.map_or(1.0, |ssm| ssm.attention_share);
        (share * (a * u * u + b * u) + c).max(self.decode_floor_ms)
    }

    /// Model ms to copy one token of KV from host to device (what the
    /// router's estimator calls `restore_ms_per_token`).
    pub fn restore_ms_per_token(&self) -> f64 {
        switchyard_core::estimate::restore_ms_per_token(
            self.bytes_per_token,
            self.restore_bandwidth_bytes_per_s,
        )
    }

    /// Model ms to copy `tokens` tokens of KV from host to device.
    pub fn restore_ms(&self, tokens: u64) -> f64 {
        tokens as f64 * self.bytes_per_token as f64 / self.restore_bandwidth_bytes_per_s * 1e3
    }

    /// Model ms to copy `bytes` over the host link (either direction).
    pub fn host_copy_ms(&self, bytes: u64) -> f64 {
        bytes as f64 / self.restore_bandwidth_bytes_per_s * 1e3
    }

    /// Model ms of one step of the given shape.
    pub fn step_ms(&self, shape: &StepShape) -> f64 {
        let compute = if shape.prefill_tokens > 0 {
            self.prefill_ms(shape.prefill_tokens + shape.decode_tokens + shape.draft_tokens)
        } else if shape.decode_tokens > 0 {
            self.decode_ms(shape.kv_usage()) + self.verify_ms(shape.draft_tokens)
        } else {
            0.0
        };
        let sequences = self.decode_per_sequence_ms * shape.decode_tokens as f64;
        compute + sequences + self.restore_ms(shape.restore_tokens + shape.saved_tokens)
    }

    /// Model ms a decode-only batch adds to verify `drafts` drafted
    /// positions: the prefill fit's per-token slope each (0 for none).
    pub fn verify_ms(&self, drafts: u64) -> f64 {
        if drafts == 0 {
            0.0
        } else {
            (self.prefill[1] * drafts as f64).max(0.0)
        }
    }

    /// Wall-clock ms for `model_ms` under the speed-up factor (`0`: instant).
    pub fn wall_ms(&self, model_ms: f64) -> f64 {
        if self.speedup == 0.0 {
            0.0
        } else {
            model_ms / self.speedup
        }
    }
}

/// What a step computes, as the timing model needs it. Lengths only.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct StepShape {
    /// Prompt (or recompute) tokens computed this step, after prefix hits.
    pub prefill_tokens: u64,
    /// Sequences decoding one token this step.
    pub decode_tokens: u64,
    /// Drafted positions the decoding sequences verify this step
    /// (speculative decoding; 0 without it).
    pub draft_tokens: u64,
    /// Tokens restored from the host tier (or a spilled sequence's saved
    /// state loaded back) this step.
    pub restore_tokens: u64,
    /// Tokens of spilled sequences' state saved to the host this step.
    pub saved_tokens: u64,
    /// Device blocks in use when the step launches.
    pub kv_used_blocks: u64,
    /// Device blocks in the pool.
    pub kv_total_blocks: u64,
}

impl StepShape {
    /// Used / total device blocks.
    pub fn kv_usage(&self) -> f64 {
        if self.kv_total_blocks == 0 {
            0.0
        } else {
            self.kv_used_blocks as f64 / self.kv_total_blocks as f64
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefill_of_a_thousand_tokens_costs_the_documented_polynomial() {
        let t = TimingConfig::default();
        let expected = 4.209989e-7 * 1e6 + 1.518344e-2 * 1000.0 + 16.50142;
        assert!((t.prefill_ms(1000) - expected).abs() < 1e-9);
    }

    #[test]
    fn decode_never_drops_below_the_floor() {
        let t = TimingConfig {
            decode: [0.0, 0.0, -5.0],
            ..TimingConfig::default()
        };
        assert_eq!(t.decode_ms(0.5), 1.0);
        assert!((TimingConfig::default().decode_ms(0.0) - 5.74).abs() < 1e-12);
    }

    #[test]
    fn each_decoding_sequence_adds_its_cost_to_a_step_with_or_without_a_prefill() {
        let t = TimingConfig {
            decode_per_sequence_ms: 0.5,
            ..TimingConfig::default()
        };
        let plain = TimingConfig::default();
        let decode = StepShape {
            decode_tokens: 10,
            kv_used_blocks: 30,
            kv_total_blocks: 100,
            ..StepShape::default()
        };
        assert!((t.step_ms(&decode) - plain.step_ms(&decode) - 5.0).abs() < 1e-12);
        let mixed = StepShape {
            prefill_tokens: 512,
            ..decode
        };
        assert!((t.step_ms(&mixed) - plain.step_ms(&mixed) - 5.0).abs() < 1e-12);
        let prefill = StepShape {
            prefill_tokens: 512,
            ..StepShape::default()
        };
        assert_eq!(t.step_ms(&prefill), plain.step_ms(&prefill));
        let bad = TimingConfig {
            decode_per_sequence_ms: f64::NAN,
            ..TimingConfig::default()
        };
        assert!(bad.validate().is_err());
    }

    #[test]
    fn restore_of_a_million_tokens_at_defaults_takes_about_two_seconds() {
        let t = TimingConfig::default();
        let ms = t.restore_ms(1_000_000);
        assert!((ms - 1_000_000.0 * 131_072.0 / 64e9 * 1e3).abs() < 1e-6);
    }

    #[test]
    fn saving_a_spilled_sequence_costs_the_host_link_like_a_restore() {
        let t = TimingConfig::default();
        let shape = StepShape {
            saved_tokens: 1_000,
            ..StepShape::default()
        };
        assert!((t.step_ms(&shape) - t.restore_ms(1_000)).abs() < 1e-12);
    }

    #[test]
    fn logits_read_back_costs_their_bytes_over_the_host_link() {
        let t = TimingConfig::default();
        // 256 rows of a 32k vocabulary in bf16: 16 MiB at 64 GB/s.
        let bytes = 256 * 32_768 * 2;
        assert!((t.host_copy_ms(bytes) - bytes as f64 / 64e9 * 1e3).abs() < 1e-12);
    }

    #[test]
    fn verifying_drafts_costs_the_prefill_slope_per_draft_on_top_of_decode() {
        let t = TimingConfig::default();
        let plain = StepShape {
            decode_tokens: 8,
            kv_used_blocks: 10,
            kv_total_blocks: 100,
            ..StepShape::default()
        };
        let drafted = StepShape {
            draft_tokens: 24,
            ..plain
        };
        let extra = t.step_ms(&drafted) - t.step_ms(&plain);
        assert!((extra - 24.0 * t.prefill[1]).abs() < 1e-12);
        let mixed = StepShape {
            prefill_tokens: 100,
            ..drafted
        };
        assert!((t.step_ms(&mixed) - t.prefill_ms(132)).abs() < 1e-12);
    }

    #[test]
    fn speedup_zero_is_instant_and_two_halves_wall_time() {
        let mut t = TimingConfig {
            speedup: 0.0,
            ..TimingConfig::default()
        };
        assert_eq!(t.wall_ms(100.0), 0.0);
        t.speedup = 2.0;
        assert_eq!(t.wall_ms(100.0), 50.0);
    }

    #[test]
    fn a_negative_speedup_is_rejected() {
        let t = TimingConfig {
            speedup: -1.0,
            ..TimingConfig::default()
        };
        assert_eq!(t.validate(), Err(TimingConfigError::Speedup(-1.0)));
    }
}
