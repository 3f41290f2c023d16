//! Engine configuration: one struct, documented defaults, `validate()`.

use crate::blocks::KvConfig;
use crate::checkpoints::CheckpointPolicy;
use crate::timing::{TimingConfig, TimingConfigError};
use serde::{Deserialize, Serialize};
use std::sync::Arc;

/// What the scheduler does with the newest running sequence when the pool
/// stays dry and nothing else can run.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Preemption {
    /// Free its blocks; it computes its tokens again on resume (vLLM's default).
    #[default]
    Recompute,
    /// Save its computed KV to the host (`SaveSequenceState`), free its
    /// blocks, and load them back on resume; falls back to recompute when
    /// the spill area is full.
    Spill,
}

/// Speculative decoding (multi-token prediction): each decode step of a
/// sequence verifies `draft_tokens` drafted positions after its last
/// token and keeps the accepted prefix of them.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SpecDecode {
    /// Drafted positions per decode step (3; 1..=16).
    pub draft_tokens: u32,
    /// Probability each draft is accepted, given the ones before it were
    /// (0..=1); the first rejection discards it and every later draft.
    pub acceptance_rate: f64,
}

impl Default for SpecDecode {
    fn default() -> Self {
        Self {
            draft_tokens: 3,
            acceptance_rate: 0.7,
        }
    }
}

/// A hybrid (SSM + attention) model's SSM checkpoints (see
/// [`crate::checkpoints`]). The step cost of its SSM layers is the timing
/// model's ([`crate::timing::SsmTiming`]); [`EngineConfig::hybrid`] sets
/// both.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Hybrid {
    /// Which states are kept (`marconi`, the default, or `every-block`).
    pub checkpoints: CheckpointPolicy,
    /// Most checkpoints kept (512).
    pub max_checkpoints: usize,
    /// Bytes of one SSM state, copied at each checkpoint and each resume
    /// (16 MiB: an assumption of the order of a few-billion-parameter
    /// hybrid's states over all its SSM layers, not a measured model).
    pub state_bytes: u64,
    /// Marconi's weight of the recompute time saved against recency in
    /// eviction (1.0: equal weight).
    pub flop_weight: f64,
}

impl Default for Hybrid {
    fn default() -> Self {
        Self {
            checkpoints: CheckpointPolicy::Marconi,
            max_checkpoints: 512,
            state_bytes: 16 << 20,
            flop_weight: 1.0,
        }
    }
}

/// Every knob of the simulated engine. Defaults follow vLLM's.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct EngineConfig {
    /// Tokens per KV block (16).
    pub block_size: usize,
    /// Device KV blocks in the pool (16,384).
    pub num_blocks: usize,
    /// Host-tier capacity in blocks (0: no host tier).
    pub host_blocks: usize,
    /// Most sequences running in one step (256).
    pub max_num_seqs: usize,
    /// Most tokens computed in one step (8,192); longer prompts are chunked.
    pub max_num_batched_tokens: usize,
    /// Most requests waiting; beyond it new requests are refused (4,096).
    pub max_waiting: usize,
    /// Longest prompt plus output a request may have (32,768 tokens).
    pub max_model_len: usize,
    /// Host-tier restores shorter than this are skipped (256 tokens).
    pub min_restore_tokens: usize,
    /// Times a restore may be deferred for device capacity before the
    /// request computes its prefix instead (8).
    pub max_restore_deferrals: u32,
    /// Capture leases held at once for other engines to restore from
    /// (1,024); a capture beyond it is refused and counted.
    pub max_leases: usize,
    /// Whether to record KV events (the simulator may not need them).
    pub emit_kv_events: bool,
    /// KV events buffered between drains (65,536); beyond it they are dropped and counted.
    pub max_buffered_events: usize,
    /// Preemption when the pool stays dry: `recompute` (default) or `spill`.
    pub preemption: Preemption,
    /// Host blocks set aside for spilled sequences' state (0; `spill` needs > 0).
    pub spill_blocks: usize,
    /// Fixed per-sequence state slots, as an SSM keeps (0: none, a pure
    /// attention model). When > 0 it also bounds the running sequences.
    pub state_slots: u32,
    /// Whether each sampling step copies its logits rows to the host
    /// (`ReadLogits`, for a host-side sampler or logprobs); off: sampling
    /// stays on the device and only token ids come back.
    pub read_logits: bool,
    /// Logits per row when `read_logits` (32,768).
    pub vocab_size: usize,
    /// Bytes per logit, the model's element width (2: bf16).
    pub logits_elem_bytes: u32,
    /// The timing model.
    pub timing: TimingConfig,
    /// Speculative decoding (`None`, the default: one token per decode
    /// step). See [`SpecDecode`].
    pub spec_decode: Option<SpecDecode>,
    /// The token ids output tokens are drawn from, when they must be text
    /// a client can re-tokenize (the sim-worker fills it with its
    /// tokenizer's word tokens); `None`: 32,000 ids above the special
    /// ids, as the fleet simulator uses. Not a file setting: a vocabulary
    /// comes from a tokenizer.
    #[serde(skip)]
    pub output_vocabulary: Option<Arc<[u32]>>,
    /// A hybrid (SSM + attention) model (`None`, the default: attention
    /// only). Needs a state slot per running sequence and no host tier.
    pub hybrid: Option<Hybrid>,
}

impl Default for EngineConfig {
    fn default() -> Self {
        Self {
            block_size: 16,
            num_blocks: 16_384,
            host_blocks: 0,
            max_num_seqs: 256,
            max_num_batched_tokens: 8_192,
            max_waiting: 4_096,
            max_model_len: 32_768,
            min_restore_tokens: 256,
            max_restore_deferrals: 8,
            max_leases: 1_024,
            emit_kv_events: true,
            max_buffered_events: 1 << 16,
            preemption: Preemption::Recompute,
            spill_blocks: 0,
            state_slots: 0,
            read_logits: false,
            vocab_size: 32_768,
            logits_elem_bytes: 2,
            timing: TimingConfig::default(),
            spec_decode: None,
            output_vocabulary: None,
            hybrid: None,
        }
    }
}

/// An engine configuration that makes no sense.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ConfigError {
    /// A count that must be positive is zero.
    #[error("{0} must be > 0")]
    Zero(&'static str),
    /// Too many blocks for 32-bit block ids.
    #[error("num_blocks must be < 2^32 - 1")]
    TooManyBlocks,
    /// A block size beyond what anyone uses.
    #[error("block_size must be <= 1024, got {0}")]
    BlockSize(usize),
    /// Spill preemption with no host blocks to spill into.
    #[error("preemption = \"spill\" needs spill_blocks > 0")]
    SpillWithoutHost,
    /// A logits element width no model uses.
    #[error("logits_elem_bytes must be 1, 2 or 4, got {0}")]
    LogitsWidth(u32),
    /// An output vocabulary with nothing to draw from.
    #[error("output_vocabulary must not be empty")]
    EmptyOutputVocabulary,
    /// Speculative decoding out of range.
    #[error("spec_decode: draft_tokens must be 1..=16 and acceptance_rate a finite number in 0..=1, got {draft_tokens} and {acceptance_rate}")]
    SpecDecode {
        /// Drafts asked.
        draft_tokens: u32,
        /// Acceptance rate asked.
        acceptance_rate: f64,
    },
    /// A hybrid model needs a state slot per running sequence.
    #[error(
        "a hybrid model needs state_slots >= max_num_seqs ({max_num_seqs}), got {state_slots}"
    )]
    HybridSlots {
        /// Slots configured.
        state_slots: u32,
        /// Running sequences allowed.
        max_num_seqs: usize,
    },
    /// A host tier for a hybrid model's checkpoints is not modelled.
    #[error("a hybrid model with a host tier (host_blocks > 0) is not modelled")]
    HybridHostTier,
    /// Hybrid knobs out of range.
    #[error("hybrid: max_checkpoints must be > 0 and flop_weight a finite number >= 0")]
    Hybrid,
    /// Timing knobs.
    #[error(transparent)]
    Timing(#[from] TimingConfigError),
}

impl EngineConfig {
    /// Checks ranges and relations.
    pub fn validate(&self) -> Result<(), ConfigError> {
        for (name, value) in [
            ("block_size", self.block_size),
            ("num_blocks", self.num_blocks),
            ("max_num_seqs", self.max_num_seqs),
            ("max_num_batched_tokens", self.max_num_batched_tokens),
            ("max_waiting", self.max_waiting),
            ("max_model_len", self.max_model_len),
            ("max_leases", self.max_leases),
        ] {
            if value == 0 {
                return Err(ConfigError::Zero(name));
            }
        }
        if self.block_size > 1024 {
            return Err(ConfigError::BlockSize(self.block_size));
        }
        if self.num_blocks >= u32::MAX as usize {
            return Err(ConfigError::TooManyBlocks);
        }
        if self.preemption == Preemption::Spill && self.spill_blocks == 0 {
            return Err(ConfigError::SpillWithoutHost);
        }
        if self.read_logits && self.vocab_size == 0 {
            return Err(ConfigError::Zero("vocab_size"));
        }
        if ![1, 2, 4].contains(&self.logits_elem_bytes) {
            return Err(ConfigError::LogitsWidth(self.logits_elem_bytes));
        }
        if self
            .output_vocabulary
            .as_ref()
            .is_some_and(|v| v.is_empty())
        {
            return Err(ConfigError::EmptyOutputVocabulary);
        }
        if let Some(spec) = self.spec_decode {
            let rate = spec.acceptance_rate;
            if !(1..=16).contains(&spec.draft_tokens) || !(0.0..=1.0).contains(&rate) {
                return Err(ConfigError::SpecDecode {
                    draft_tokens: spec.draft_tokens,
                    acceptance_rate: rate,
                });
            }
        }
        if let Some(hybrid) = self.hybrid {
            if (self.state_slots as usize) < self.max_num_seqs {
                return Err(ConfigError::HybridSlots {
                    state_slots: self.state_slots,
                    max_num_seqs: self.max_num_seqs,
                });
            }
            if self.host_blocks > 0 {
                return Err(ConfigError::HybridHostTier);
            }
            if hybrid.max_checkpoints == 0
                || !(hybrid.flop_weight.is_finite() && hybrid.flop_weight >= 0.0)
            {
                return Err(ConfigError::Hybrid);
            }
        }
        self.timing.validate()?;
        Ok(())
    }

    /// This configuration as a hybrid model keeping checkpoints by
    /// `policy`: a state slot per running sequence, and SSM layers costed
    /// by [`crate::timing::SsmTiming`]'s defaults.
    pub fn hybrid(mut self, policy: CheckpointPolicy) -> Self {
        self.hybrid = Some(Hybrid {
            checkpoints: policy,
            ..Hybrid::default()
        });
        self.state_slots = self
            .state_slots
            .max(self.max_num_seqs.min(u32::MAX as usize) as u32);
        self.timing.ssm = Some(crate::timing::SsmTiming::default());
        self
    }

    /// The block manager's part.
    pub fn kv(&self) -> KvConfig {
        KvConfig {
            block_size: self.block_size,
            num_blocks: self.num_blocks,
            host_blocks: self.host_blocks,
            emit_events: self.emit_kv_events,
            max_buffered_events: self.max_buffered_events,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_defaults_validate() {
        assert_eq!(EngineConfig::default().validate(), Ok(()));
        let hybrid = EngineConfig::default().hybrid(CheckpointPolicy::EveryBlock);
        assert_eq!(hybrid.validate(), Ok(()));
    }

    #[test]
    fn a_hybrid_model_needs_its_slots_and_no_host_tier() {
        let mut c = EngineConfig::default().hybrid(CheckpointPolicy::Marconi);
        c.state_slots = 8;
        assert!(matches!(c.validate(), Err(ConfigError::HybridSlots { .. })));
        let mut c = EngineConfig::default().hybrid(CheckpointPolicy::Marconi);
        c.host_blocks = 64;
        assert_eq!(c.validate(), Err(ConfigError::HybridHostTier));
        let mut c = EngineConfig::default().hybrid(CheckpointPolicy::Marconi);
        c.hybrid.as_mut().unwrap().max_checkpoints = 0;
        assert_eq!(c.validate(), Err(ConfigError::Hybrid));
    }

    #[test]
    fn a_zero_block_size_is_rejected() {
        let c = EngineConfig {
            block_size: 0,
            ..EngineConfig::default()
        };
        assert_eq!(c.validate(), Err(ConfigError::Zero("block_size")));
    }

    #[test]
    fn spill_preemption_without_spill_blocks_is_rejected() {
        let c = EngineConfig {
            preemption: Preemption::Spill,
            ..EngineConfig::default()
        };
        assert_eq!(c.validate(), Err(ConfigError::SpillWithoutHost));
        let c = EngineConfig {
            spill_blocks: 64,
            ..c
        };
        assert_eq!(c.validate(), Ok(()));
    }

    #[test]
    fn preemption_reads_as_a_lowercase_word_and_logits_width_is_checked() {
        let c: EngineConfig =
            serde_json::from_str(r#"{"preemption": "spill", "spill_blocks": 8}"#).unwrap();
        assert_eq!(c.preemption, Preemption::Spill);
        let c = EngineConfig {
            logits_elem_bytes: 3,
            ..EngineConfig::default()
        };
        assert_eq!(c.validate(), Err(ConfigError::LogitsWidth(3)));
    }

    #[test]
    fn an_empty_output_vocabulary_is_rejected() {
        let c = EngineConfig {
            output_vocabulary: Some(Arc::from(Vec::new())),
            ..EngineConfig::default()
        };
        assert_eq!(c.validate(), Err(ConfigError::EmptyOutputVocabulary));
    }

    #[test]
    fn spec_decode_is_off_by_default_and_checked_when_on() {
        assert_eq!(EngineConfig::default().spec_decode, None);
        let with = |draft_tokens, acceptance_rate| EngineConfig {
            spec_decode: Some(SpecDecode {
                draft_tokens,
                acceptance_rate,
            }),
            ..EngineConfig::default()
        };
        assert_eq!(with(3, 0.7).validate(), Ok(()));
        assert_eq!(with(16, 0.0).validate(), Ok(()));
        assert_eq!(with(1, 1.0).validate(), Ok(()));
        for (d, p) in [(0, 0.5), (17, 0.5), (3, -0.1), (3, 1.5), (3, f64::NAN)] {
            assert!(
                matches!(with(d, p).validate(), Err(ConfigError::SpecDecode { .. })),
                "{d} {p}"
            );
        }
        let c: EngineConfig =
            serde_json::from_str(r#"{"spec_decode": {"acceptance_rate": 0.5}}"#).unwrap();
        assert_eq!(c.spec_decode.map(|s| s.draft_tokens), Some(3));
    }

    #[test]
    fn unknown_config_keys_are_rejected() {
        let err = serde_json::from_str::<EngineConfig>(r#"{"block_sise": 16}"#);
        assert!(err.is_err());
    }
}
