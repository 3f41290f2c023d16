//! Prefix restore from the host tier: the decision, the deferral guard and
//! the validation of a restored output.
//!
//! Protocol, for a request about to compute its first prefill chunk:
//!
//! 1. [`decide`] turns lengths into a [`RestoreDecision`]. A host hit is only
//!    a candidate.
//! 2. `SequenceCapacityNotReady`: the request waits; a [`RestoreDeferral`]
//!    retains the source (which blocks of the prompt, pinned on the host)
//!    until it is retried or dropped. The retry decides on that source
//!    alone ([`retry`]): it never re-selects from the index.
//! 3. `Restore`: the device layer copies the blocks and returns a
//!    [`RestoreOutput`]; [`validate`] checks it against the admitted
//!    [`RestoreTicket`] and against the block manager's own table for the
//!    sequence (an [`InstalledTable`]), not the device's word alone. The
//!    scheduler installs the progress, acknowledges, and only then
//!    observes `Restored`. A failed validation or a failed acknowledgement
//!    cancels that request (the restore was already published to the
//!    device) and nothing else: no fallback to recompute.
//!
//! Observations carry lengths, never token contents.

use crate::blocks::HostPins;
pub use crate::blocks::InstalledTable;
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
    /// A rendezvous source has not arrived yet (the other engine's capture
    /// has not been transferred): the request waits, and the scheduler
    /// admits the requests behind it meanwhile.
    RequestStateNotReady,
    /// A retry found its retained source no longer following the device
    /// prefix (device blocks before it were evicted meanwhile): the source
    /// is dropped and the request computes what the device lacks.
    RetainedSourceLost,
}

impl RestoreDecision {
    /// The metric label of the decision.
    pub fn label(&self) -> &'static str {
        match self {
            RestoreDecision::NoReusableEntry => "no_reusable_entry",
            RestoreDecision::SequenceCapacityNotReady { .. } => "sequence_capacity_not_ready",
            RestoreDecision::NativeRestoreSkipped => "native_restore_skipped",
            RestoreDecision::Restore { .. } => "restore",
            RestoreDecision::RetainedSourceLost => "retained_source_lost",
            RestoreDecision::RequestStateNotReady => "request_state_not_ready",
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

/// A deferred restore. It retains its source — blocks `from_block ..
/// from_block + blocks` of the prompt, pinned on the host — so the retry
/// restores exactly that; dropping it (the request was cancelled, or the
/// retry is done with it) unpins.
#[derive(Debug)]
#[must_use = "dropping a deferral unpins its host source"]
pub struct RestoreDeferral {
    /// Tokens the restore would bring back.
    pub candidate_prefix_tokens: usize,
    /// Times this request has been deferred.
    pub attempts: u32,
    /// The source's first block, as an index into the prompt's blocks.
    pub from_block: usize,
    /// The source's length in blocks.
    pub blocks: usize,
    pins: HostPins,
}

impl RestoreDeferral {
    /// A deferral of `blocks` blocks from `from_block`, holding `pins`.
    pub fn new(
        from_block: usize,
        blocks: usize,
        block_size: usize,
        attempts: u32,
        pins: HostPins,
    ) -> Self {
        Self {
            candidate_prefix_tokens: blocks * block_size,
            attempts,
            from_block,
            blocks,
            pins,
        }
    }

    /// Host blocks held.
    pub fn pinned_blocks(&self) -> usize {
        self.pins.len()
    }
}

/// The decision of a retry: the retained source only, from the device
/// prefix it finds now (`device_hit_blocks`). The part of the source the
/// device caches meanwhile is not restored again; a source whose start the
/// device prefix no longer reaches is lost.
pub fn retry(
    deferral: &RestoreDeferral,
    device_hit_blocks: usize,
    free_device_blocks: usize,
    block_size: usize,
) -> RestoreDecision {
    if device_hit_blocks < deferral.from_block {
        return RestoreDecision::RetainedSourceLost;
    }
    let end = deferral.from_block + deferral.blocks;
    let remaining = end.saturating_sub(device_hit_blocks);
    if remaining == 0 {
        return RestoreDecision::NoReusableEntry;
    }
    let tokens = remaining * block_size.max(1);
    if free_device_blocks < remaining {
        RestoreDecision::SequenceCapacityNotReady {
            candidate_prefix_tokens: tokens,
        }
    } else {
        RestoreDecision::Restore {
            candidate_prefix_tokens: tokens,
        }
    }
}

/// The decision for a request whose source is a rendezvous: `delivered`
/// is the other engine's capture once transferred (`None` before), and
/// `prompt_hashes` the prompt's block hashes that may be restored (capped
/// so that a token is left to compute). Only the leading blocks the two
/// share are used; a source whose first block is not the prompt's is
/// refused ([`RestoreError::SourceMismatch`]). A retry calls this again
/// with the same delivered source: nothing is re-selected.
pub fn decide_rendezvous(
    delivered: Option<&crate::lease::LeasedKv>,
    prompt_hashes: &[switchyard_core::SequenceHash],
    device_hit_blocks: usize,
    free_device_blocks: usize,
    block_size: usize,
) -> Result<RestoreDecision, RestoreError> {
    let Some(source) = delivered else {
        return Ok(RestoreDecision::RequestStateNotReady);
    };
    let shared = source
        .hashes
        .iter()
        .zip(prompt_hashes)
        .take_while(|(a, b)| a == b)
        .count();
    if shared == 0 && !source.hashes.is_empty() && !prompt_hashes.is_empty() {
        return Err(RestoreError::SourceMismatch);
    }
    let candidate = shared.saturating_sub(device_hit_blocks);
    if candidate == 0 {
        return Ok(RestoreDecision::NoReusableEntry);
    }
    let tokens = candidate * block_size.max(1);
    Ok(if free_device_blocks < candidate {
        RestoreDecision::SequenceCapacityNotReady {
            candidate_prefix_tokens: tokens,
        }
    } else {
        RestoreDecision::Restore {
            candidate_prefix_tokens: tokens,
        }
    })
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
    /// The device's report disagrees with the block manager's table.
    #[error("device reports {reported} blocks installed; the block table holds {table} (matching the source: {matches_source})")]
    TableMismatch {
        /// Blocks the device reported.
        reported: usize,
        /// Blocks the table holds after the device prefix.
        table: usize,
        /// Whether the table's blocks are the source's.
        matches_source: bool,
    },
    /// A rendezvous source holds another prompt's blocks: its first block is
    /// not this prompt's.
    #[error("the rendezvous source holds another prompt's blocks")]
    SourceMismatch,
    /// The scheduler installed the progress but the device refused the
    /// acknowledgement: the restore cannot be trusted.
    #[error("the device did not accept the restore's acknowledgement")]
    AcknowledgeFailed,
}

impl RestoreError {
    /// The metric label of the failure.
    pub fn label(&self) -> &'static str {
        match self {
            RestoreError::WrongRequest => "wrong_request",
            RestoreError::PromptLengthMismatch { .. } => "prompt_length_mismatch",
            RestoreError::NoSuffixLeft => "no_suffix_left",
            RestoreError::ExtentMismatch { .. } => "extent_mismatch",
            RestoreError::TableMismatch { .. } => "table_mismatch",
            RestoreError::AcknowledgeFailed => "acknowledge_failed",
            RestoreError::SourceMismatch => "source_mismatch",
        }
    }
}

/// Checks a restore output against its ticket and against the block
/// manager's table. Returns the tokens now computed for the request.
pub fn validate(
    ticket: &RestoreTicket,
    output: &RestoreOutput,
    table: &InstalledTable,
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
    if table.blocks != output.blocks_installed || !table.matches_source {
        return Err(RestoreError::TableMismatch {
            reported: output.blocks_installed,
            table: table.blocks,
            matches_source: table.matches_source,
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

    /// The table as a correct restore of `output()` leaves it.
    fn table() -> InstalledTable {
        InstalledTable {
            blocks: 4,
            matches_source: true,
        }
    }

    #[test]
    fn an_output_the_block_table_contradicts_is_rejected() {
        // Self-consistent (16 + 3 × 16 = 64), but the table holds 4 blocks.
        let out = RestoreOutput {
            restored_tokens: 64,
            blocks_installed: 3,
            ..output()
        };
        assert_eq!(
            validate(&ticket(), &out, &table(), 16),
            Err(RestoreError::TableMismatch {
                reported: 3,
                table: 4,
                matches_source: true
            })
        );
        // The right count of blocks, but not the source's.
        let foreign = InstalledTable {
            matches_source: false,
            ..table()
        };
        assert!(matches!(
            validate(&ticket(), &output(), &foreign, 16),
            Err(RestoreError::TableMismatch { .. })
        ));
    }

    fn deferral(from_block: usize, blocks: usize) -> RestoreDeferral {
        RestoreDeferral::new(from_block, blocks, 16, 1, HostPins::default())
    }

    #[test]
    fn a_retry_restores_its_retained_source_from_the_device_prefix_it_finds() {
        // Deferred: blocks 2..10 of the prompt from the host.
        let d = deferral(2, 8);
        assert_eq!(
            retry(&d, 2, 100, 16),
            RestoreDecision::Restore {
                candidate_prefix_tokens: 128
            }
        );
        // The device cached three of them meanwhile: the rest only.
        assert_eq!(
            retry(&d, 5, 100, 16),
            RestoreDecision::Restore {
                candidate_prefix_tokens: 80
            }
        );
        // Still no room: deferred again, the same source.
        assert_eq!(
            retry(&d, 2, 7, 16),
            RestoreDecision::SequenceCapacityNotReady {
                candidate_prefix_tokens: 128
            }
        );
        // The device holds all of it now: nothing to restore.
        assert_eq!(retry(&d, 10, 0, 16), RestoreDecision::NoReusableEntry);
        // The device prefix no longer reaches the source: lost, not
        // re-selected.
        assert_eq!(retry(&d, 1, 100, 16), RestoreDecision::RetainedSourceLost);
    }

    #[test]
    fn a_rendezvous_restores_what_it_shares_with_the_prompt_beyond_the_device_prefix() {
        use crate::lease::LeasedKv;
        use switchyard_core::SequenceHash;
        let prompt: Vec<SequenceHash> = (1..=10).map(SequenceHash).collect();
        let kv = |hashes: &[u64]| LeasedKv {
            hashes: hashes.iter().copied().map(SequenceHash).collect(),
            tokens: vec![0; hashes.len() * 16],
        };
        assert_eq!(
            decide_rendezvous(None, &prompt, 0, 100, 16),
            Ok(RestoreDecision::RequestStateNotReady)
        );
        let all = kv(&[1, 2, 3, 4, 5, 6]);
        assert_eq!(
            decide_rendezvous(Some(&all), &prompt, 2, 100, 16),
            Ok(RestoreDecision::Restore {
                candidate_prefix_tokens: 64
            })
        );
        assert_eq!(
            decide_rendezvous(Some(&all), &prompt, 2, 3, 16),
            Ok(RestoreDecision::SequenceCapacityNotReady {
                candidate_prefix_tokens: 64
            })
        );
        assert_eq!(
            decide_rendezvous(Some(&all), &prompt, 6, 100, 16),
            Ok(RestoreDecision::NoReusableEntry)
        );
        // Diverging after three blocks: those three only.
        assert_eq!(
            decide_rendezvous(Some(&kv(&[1, 2, 3, 99])), &prompt, 0, 100, 16),
            Ok(RestoreDecision::Restore {
                candidate_prefix_tokens: 48
            })
        );
        assert_eq!(
            decide_rendezvous(Some(&kv(&[7, 8])), &prompt, 0, 100, 16),
            Err(RestoreError::SourceMismatch)
        );
    }

    #[test]
    fn a_matching_output_validates_to_its_extent() {
        assert_eq!(validate(&ticket(), &output(), &table(), 16), Ok(80));
    }

    #[test]
    fn an_output_for_another_request_is_rejected() {
        let out = RestoreOutput {
            request: RequestId(8),
            ..output()
        };
        assert_eq!(
            validate(&ticket(), &out, &table(), 16),
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
            validate(&ticket(), &out, &table(), 16),
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
            validate(&ticket(), &out, &table(), 16),
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
            validate(&ticket(), &out, &table(), 16),
            Err(RestoreError::ExtentMismatch {
                restored_tokens: 80,
                blocks_installed: 3
            })
        );
    }
}
