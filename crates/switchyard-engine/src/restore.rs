//! Prefix restore from the host tier: the decision, the deferral guard and
//! the validation of a restored output.
//!
//! Protocol, for a request about to compute its first prefill chunk:
//!
//! 1. [`decide`] turns lengths into a [`RestoreDecision`]. A host hit is only
//!    a candidate.
//! 2. `SequenceCapacityNotReady`: the request waits; a [`RestoreDeferral`]
//!    keeps the host source pinned until it is retried or dropped.
//! 3. `Restore`: the device layer copies the blocks and returns a
//!    [`RestoreOutput`]; [`validate`] checks it against the admitted
//!    [`RestoreTicket`]. The scheduler installs the progress, acknowledges,
//!    and only then observes `Restored`. A failed validation cancels the
//!    request (the restore was already published to the device).
//!
//! Observations carry lengths, never token contents.

use crate::blocks::HostPins;
use crate::timing::TimingConfig;
use switchyard_core::RequestId;

/// What to do about a candidate host-tier prefix.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RestoreDecision {
    /// The host tier holds nothing beyond the device prefix.
    NoReusableEntry,
    /// Not enough free device blocks now: defer and retry, source pinned.
    SequenceCapacityNotReady {
        /// Tokens the restore would bring back.
        candidate_prefix_tokens: usize,
    },
    /// A candidate exists but restoring it is not worth it (too short, or
    /// slower than recomputing).
    NativeRestoreSkipped,
    /// Restore this many tokens now.
    Restore {
        /// Tokens the restore brings back.
        candidate_prefix_tokens: usize,
    },
}

impl RestoreDecision {
    /// The metric label of the decision.
    pub fn label(&self) -> &'static str {
        match self {
            RestoreDecision::NoReusableEntry => "no_reusable_entry",
            RestoreDecision::SequenceCapacityNotReady { .. } => "sequence_capacity_not_ready",
            RestoreDecision::NativeRestoreSkipped => "native_restore_skipped",
            RestoreDecision::Restore { .. } => "restore",
        }
    }
}

/// Inputs of [`decide`], all lengths.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RestoreQuery {
    /// Prompt (or recompute) length of the sequence.
    pub prompt_tokens: usize,
    /// Leading blocks already cached on the device.
    pub device_hit_blocks: usize,
    /// Blocks after those that the host tier holds, consecutively.
    pub host_run_blocks: usize,
    /// Free device blocks now.
    pub free_device_blocks: usize,
    /// Tokens per block.
    pub block_size: usize,
    /// Restores shorter than this are skipped.
    pub min_restore_tokens: usize,
}

/// Decides what to do with a host-tier candidate.
///
/// The candidate is capped so that at least one prompt token is left to
/// compute (no logits are cached). It is skipped when shorter than
/// `min_restore_tokens` or when copying it would take longer than
/// recomputing it.
pub fn decide(query: &RestoreQuery, timing: &TimingConfig) -> RestoreDecision {
    let bs = query.block_size.max(1);
    let max_blocks = query.prompt_tokens.saturating_sub(1) / bs;
    let candidate = query
        .host_run_blocks
        .min(max_blocks.saturating_sub(query.device_hit_blocks));
    if candidate == 0 {
        return RestoreDecision::NoReusableEntry;
    }
    let tokens = candidate * bs;
    let saved_ms = timing.prefill_ms(
        query
            .prompt_tokens
            .saturating_sub(query.device_hit_blocks * bs) as u64,
    ) - timing.prefill_ms(
        query
            .prompt_tokens
            .saturating_sub((query.device_hit_blocks + candidate) * bs) as u64,
    );
    if tokens < query.min_restore_tokens || timing.restore_ms(tokens as u64) >= saved_ms {
        return RestoreDecision::NativeRestoreSkipped;
    }
    if query.free_device_blocks < candidate {
        return RestoreDecision::SequenceCapacityNotReady {
            candidate_prefix_tokens: tokens,
        };
    }
    RestoreDecision::Restore {
        candidate_prefix_tokens: tokens,
    }
}

/// A deferred restore. It keeps the host source pinned; dropping it (the
/// request was cancelled, or the retry decided otherwise) unpins.
#[derive(Debug)]
#[must_use = "dropping a deferral unpins its host source"]
pub struct RestoreDeferral {
    /// Tokens the restore would bring back.
    pub candidate_prefix_tokens: usize,
    /// Times this request has been deferred.
    pub attempts: u32,
    pins: HostPins,
}

impl RestoreDeferral {
    /// A deferral holding `pins`.
    pub fn new(candidate_prefix_tokens: usize, attempts: u32, pins: HostPins) -> Self {
        Self {
            candidate_prefix_tokens,
            attempts,
            pins,
        }
    }

    /// Host blocks held.
    pub fn pinned_blocks(&self) -> usize {
        self.pins.len()
    }
}

/// What the scheduler admitted for a restore: the output must match it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RestoreTicket {
    /// The request restored.
    pub request: RequestId,
    /// Its prompt (or recompute) length.
    pub prompt_tokens: usize,
    /// Tokens the device already held before the restore.
    pub device_prefix_tokens: usize,
    /// Blocks asked for.
    pub blocks: usize,
}

/// What a device layer reports after restoring.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RestoreOutput {
    /// The request it restored for.
    pub request: RequestId,
    /// The prompt length it saw.
    pub prompt_tokens: usize,
    /// Tokens now computed for the request (device prefix plus restored).
    pub restored_tokens: usize,
    /// Blocks it installed.
    pub blocks_installed: usize,
}

/// Why a restored output cannot be used.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum RestoreError {
    /// The output names another request.
    #[error("restore output is for another request")]
    WrongRequest,
    /// The output saw another prompt length.
    #[error("restore output saw prompt length {got}, admitted {admitted}")]
    PromptLengthMismatch {
        /// Admitted length.
        admitted: usize,
        /// Reported length.
        got: usize,
    },
    /// Nothing would be left to compute: no logits are cached.
    #[error("restore covers the whole prompt; at least one token must be computed")]
    NoSuffixLeft,
    /// The restored extent does not match the blocks installed.
    #[error("restored {restored_tokens} tokens but installed {blocks_installed} blocks")]
    ExtentMismatch {
        /// Reported tokens.
        restored_tokens: usize,
        /// Reported blocks.
        blocks_installed: usize,
    },
}

impl RestoreError {
    /// The metric label of the failure.
    pub fn label(&self) -> &'static str {
        match self {
            RestoreError::WrongRequest => "wrong_request",
            RestoreError::PromptLengthMismatch { .. } => "prompt_length_mismatch",
            RestoreError::NoSuffixLeft => "no_suffix_left",
            RestoreError::ExtentMismatch { .. } => "extent_mismatch",
        }
    }
}

/// Checks a restore output against its ticket. Returns the tokens now
/// computed for the request.
pub fn validate(
    ticket: &RestoreTicket,
    output: &RestoreOutput,
    block_size: usize,
) -> Result<usize, RestoreError> {
    if output.request != ticket.request {
        return Err(RestoreError::WrongRequest);
    }
    if output.prompt_tokens != ticket.prompt_tokens {
        return Err(RestoreError::PromptLengthMismatch {
            admitted: ticket.prompt_tokens,
            got: output.prompt_tokens,
        });
    }
    if output.restored_tokens >= ticket.prompt_tokens {
        return Err(RestoreError::NoSuffixLeft);
    }
    if output.restored_tokens != ticket.device_prefix_tokens + output.blocks_installed * block_size
        || output.blocks_installed == 0
        || output.blocks_installed > ticket.blocks
    {
        return Err(RestoreError::ExtentMismatch {
            restored_tokens: output.restored_tokens,
            blocks_installed: output.blocks_installed,
        });
    }
    Ok(output.restored_tokens)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn query() -> RestoreQuery {
        RestoreQuery {
            prompt_tokens: 4096,
            device_hit_blocks: 0,
            host_run_blocks: 128,
            free_device_blocks: 1000,
            block_size: 16,
            min_restore_tokens: 16,
        }
    }

    #[test]
    fn nothing_on_the_host_is_no_reusable_entry() {
        let q = RestoreQuery {
            host_run_blocks: 0,
            ..query()
        };
        assert_eq!(
            decide(&q, &TimingConfig::default()),
            RestoreDecision::NoReusableEntry
        );
    }

    #[test]
    fn a_host_hit_covering_the_whole_prompt_leaves_one_block_to_compute() {
        let q = RestoreQuery {
            prompt_tokens: 64,
            host_run_blocks: 4,
            ..query()
        };
        assert_eq!(
            decide(&q, &TimingConfig::default()),
            RestoreDecision::Restore {
                candidate_prefix_tokens: 48
            }
        );
    }

    #[test]
    fn too_few_free_blocks_defer_the_restore() {
        let q = RestoreQuery {
            free_device_blocks: 10,
            ..query()
        };
        assert_eq!(
            decide(&q, &TimingConfig::default()),
            RestoreDecision::SequenceCapacityNotReady {
                candidate_prefix_tokens: 2048
            }
        );
    }

    #[test]
    fn a_restore_slower_than_recompute_is_skipped() {
        let timing = TimingConfig {
            restore_bandwidth_bytes_per_s: 1e6,
            ..TimingConfig::default()
        };
        assert_eq!(
            decide(&query(), &timing),
            RestoreDecision::NativeRestoreSkipped
        );
    }

    #[test]
    fn a_restore_below_the_minimum_length_is_skipped() {
        let q = RestoreQuery {
            min_restore_tokens: 4096,
            ..query()
        };
        assert_eq!(
            decide(&q, &TimingConfig::default()),
            RestoreDecision::NativeRestoreSkipped
        );
    }

    #[test]
    fn enough_capacity_restores_the_candidate() {
        assert_eq!(
            decide(&query(), &TimingConfig::default()),
            RestoreDecision::Restore {
                candidate_prefix_tokens: 2048
            }
        );
    }

    fn ticket() -> RestoreTicket {
        RestoreTicket {
            request: RequestId(7),
            prompt_tokens: 100,
            device_prefix_tokens: 16,
            blocks: 4,
        }
    }

    fn output() -> RestoreOutput {
        RestoreOutput {
            request: RequestId(7),
            prompt_tokens: 100,
            restored_tokens: 80,
            blocks_installed: 4,
        }
    }

    #[test]
    fn a_matching_output_validates_to_its_extent() {
        assert_eq!(validate(&ticket(), &output(), 16), Ok(80));
    }

    #[test]
    fn an_output_for_another_request_is_rejected() {
        let out = RestoreOutput {
            request: RequestId(8),
            ..output()
        };
        assert_eq!(
            validate(&ticket(), &out, 16),
            Err(RestoreError::WrongRequest)
        );
    }

    #[test]
    fn an_output_with_another_prompt_length_is_rejected() {
        let out = RestoreOutput {
            prompt_tokens: 99,
            ..output()
        };
        assert_eq!(
            validate(&ticket(), &out, 16),
            Err(RestoreError::PromptLengthMismatch {
                admitted: 100,
                got: 99
            })
        );
    }

    #[test]
    fn a_restore_must_leave_a_nonempty_suffix() {
        let out = RestoreOutput {
            restored_tokens: 100,
            ..output()
        };
        assert_eq!(
            validate(&ticket(), &out, 16),
            Err(RestoreError::NoSuffixLeft)
        );
    }

    #[test]
    fn a_restored_extent_must_equal_the_blocks_installed() {
        let out = RestoreOutput {
            blocks_installed: 3,
            ..output()
        };
        assert_eq!(
            validate(&ticket(), &out, 16),
            Err(RestoreError::ExtentMismatch {
                restored_tokens: 80,
                blocks_installed: 3
            })
        );
    }
}
