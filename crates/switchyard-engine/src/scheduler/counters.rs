//! The engine's monotonic counters.

/// Counts of restore outcomes, by decision.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RestoreCounters {
    /// `NoReusableEntry` decisions.
    pub no_reusable_entry: u64,
    /// `SequenceCapacityNotReady` decisions (deferrals).
    pub sequence_capacity_not_ready: u64,
    /// `NativeRestoreSkipped` decisions.
    pub native_restore_skipped: u64,
    /// `RetainedSourceLost` decisions (a retry's source no longer follows
    /// the device prefix).
    pub retained_source_lost: u64,
    /// `RequestStateNotReady` decisions (a rendezvous not yet delivered).
    pub request_state_not_ready: u64,
    /// Restores acknowledged (`Restored`).
    pub restored: u64,
    /// Restores that failed after publication.
    pub failed: u64,
}

/// Engine counters (monotonic).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct EngineCounters {
    /// Steps that computed something.
    pub steps: u64,
    /// Prompt tokens admitted (counted once per request).
    pub prompt_tokens: u64,
    /// Prompt tokens served from the cache at first admission.
    pub prefix_hit_tokens: u64,
    /// Output tokens sampled.
    pub generated_tokens: u64,
    /// Preemptions (recompute and spill).
    pub preemptions: u64,
    /// Running sequences kept out of a step because their reservation
    /// answered `Exhausted` (counted once per sequence and step).
    pub kept_out: u64,
    /// Preemptions that saved the sequence's state to the host.
    pub spills: u64,
    /// Spilled states loaded back on resume.
    pub spill_loads: u64,
    /// Spilled states dropped (their request cancelled while spilled).
    pub spill_drops: u64,
    /// Spill preemptions that recomputed instead (the spill area was full).
    pub spill_fallbacks: u64,
    /// Waiting sequences passed over for a step because the next block of
    /// their prompt was being computed by a running sequence: they take it
    /// from the cache once it is computed, as vLLM shares a block from the
    /// step that schedules it (counted once per sequence and step).
    pub prefix_in_flight_waits: u64,
    /// State-slot compactions.
    pub slot_compactions: u64,
    /// Logits bytes read back to the host.
    pub logits_bytes: u64,
    /// Requests finished at their length.
    pub finished: u64,
    /// Requests cancelled.
    pub cancelled: u64,
    /// Restore outcomes.
    pub restores: RestoreCounters,
    /// Observations dropped because nobody drained them.
    pub observations_dropped: u64,
    /// Speculative decoding: draft positions verified.
    pub draft_tokens_proposed: u64,
    /// Speculative decoding: drafts accepted (emitted as output tokens).
    pub draft_tokens_accepted: u64,
    /// Speculative decoding: over-runs rolled back (steps that rejected a
    /// draft, `RollbackOverrun`).
    pub spec_rollbacks: u64,
    /// Speculative decoding: blocks those rollbacks released.
    pub spec_rollback_blocks: u64,
    /// Speculative decoding: decode steps that ran without drafts because
    /// the over-run's reservation answered `Exhausted` and one position
    /// fitted.
    pub spec_fallbacks: u64,
    /// Hybrid models: SSM checkpoints saved (`MarconiCheckpoint`).
    pub ssm_checkpoints: u64,
    /// Hybrid models: SSM checkpoints evicted.
    pub ssm_checkpoint_evictions: u64,
    /// Hybrid models: admissions resumed from an SSM checkpoint
    /// (`LoadCheckpoint`).
    pub ssm_resumes: u64,
    /// Hybrid models: cached attention tokens an admission could not use
    /// because no SSM state was kept that deep (recomputed).
    pub ssm_unusable_hit_tokens: u64,
}
