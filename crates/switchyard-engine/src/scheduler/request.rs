//! What a driver hands the engine, and why it may be refused.

use std::sync::Arc;
use switchyard_core::RequestId;

/// A request as the engine takes it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NewRequest {
    /// Its id.
    pub id: RequestId,
    /// Prompt token ids.
    pub prompt: Vec<u32>,
    /// Output tokens to generate (at least 1).
    pub max_tokens: u32,
    /// Block-hash seed (see `switchyard_core::hashing::seed_for`): the
    /// prefix cache's keys, so requests share cached blocks only under
    /// the same seed. A LoRA request's is its adapter's,
    /// `seed_for(lora_name, cache_salt)`, the seed a router hashes the
    /// prompt with and a subscriber hashes the published tokens with.
    pub hash_seed: u64,
    /// The LoRA adapter the request runs under (`None`: the base model),
    /// named on the KV events of the blocks it caches, as vLLM names it.
    /// `hash_seed` must fold it in (the engine shares blocks by hash).
    pub lora_name: Option<Arc<str>>,
}

/// Why a request was refused. Bad input, not an engine fault.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum AdmitError {
    /// The id is already in the engine.
    #[error("request {0} is already in the engine")]
    Duplicate(RequestId),
    /// An empty prompt.
    #[error("the prompt is empty")]
    EmptyPrompt,
    /// `max_tokens` of zero.
    #[error("max_tokens must be at least 1")]
    NoOutput,
    /// Prompt plus output exceeds the model length or the pool.
    #[error("prompt of {prompt_tokens} tokens plus {max_tokens} output tokens exceeds the limit of {limit}")]
    TooLong {
        /// Prompt length.
        prompt_tokens: usize,
        /// Requested output.
        max_tokens: u32,
        /// The limit.
        limit: usize,
    },
    /// The waiting queue is full.
    #[error("the waiting queue is full ({0} requests)")]
    QueueFull(usize),
    /// A hybrid model's KV transfer would need its SSM state moved too,
    /// which is not modelled.
    #[error("a hybrid model takes no KV transfer (its SSM state is not transferred)")]
    HybridTransfer,
}
