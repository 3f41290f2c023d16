//! The engine's own KV-cache events, one per store, removal or clear.
//!
//! They carry what vLLM's `BlockStored` / `BlockRemoved` / `AllBlocksCleared`
//! carry, typed and independent of any wire encoding: a driver maps them onto
//! the wire format (msgpack over ZMQ) or straight into a prefix index.

use std::sync::Arc;
use switchyard_core::EngineHash;

/// Where a block lives. vLLM names these `"GPU"` and `"CPU"`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Medium {
    /// Device (GPU) memory.
    Device,
    /// Host (CPU) memory: the spill tier.
    Host,
}

impl Medium {
    /// vLLM's wire name for the medium.
    pub fn vllm_name(self) -> &'static str {
        match self {
            Medium::Device => "GPU",
            Medium::Host => "CPU",
        }
    }
}

/// One KV-cache event.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum KvEvent {
    /// A chain of full blocks became cached on `medium`.
    BlockStored {
        /// Engine hashes of the blocks, in prompt order.
        block_hashes: Vec<EngineHash>,
        /// Engine hash of the block the first one follows (`None`: the root).
        parent_block_hash: Option<EngineHash>,
        /// Every token of the listed blocks (`block_size` per block).
        token_ids: Vec<u32>,
        /// Tokens per block.
        block_size: u32,
        /// Where the blocks now live.
        medium: Medium,
        /// The LoRA adapter whose KV the blocks hold (`None`: the base
        /// model), as vLLM's `lora_name`: a consumer hashes the tokens
        /// with its seed.
        lora_name: Option<Arc<str>>,
    },
    /// Blocks left the cache of `medium`.
    BlockRemoved {
        /// Engine hashes of the evicted blocks.
        block_hashes: Vec<EngineHash>,
        /// The medium they left.
        medium: Medium,
    },
    /// A hybrid model kept a sequence's SSM state at the end of a block
    /// (an SSM checkpoint, [`crate::checkpoints`]); published as vLLM
    /// publishes its `"mamba"` cache group's stores.
    CheckpointStored {
        /// Engine hash of the block the state ends.
        block_hash: EngineHash,
        /// Engine hash of the block before it (`None`: the first block).
        parent_block_hash: Option<EngineHash>,
        /// The block's tokens.
        token_ids: Vec<u32>,
        /// Tokens per block.
        block_size: u32,
        /// The sequence's LoRA adapter (`None`: the base model).
        lora_name: Option<Arc<str>>,
    },
    /// SSM checkpoints were evicted.
    CheckpointRemoved {
        /// Engine hashes of the blocks whose states were dropped.
        block_hashes: Vec<EngineHash>,
    },
    /// Every cached block of every medium was dropped.
    AllBlocksCleared,
}
