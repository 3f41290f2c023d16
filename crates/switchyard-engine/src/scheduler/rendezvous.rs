//! The rendezvous and lease API: a request restoring its prefix from another
//! engine's capture, the transfer handed to it, and the captures this
//! engine lends.

use super::{AdmitError, Engine, NewRequest};
use crate::device::DeviceLayer;
use crate::lease::{LeaseCounters, LeaseError, LeaseRef, LeasedKv};
use switchyard_core::hashing::{chain_hash, local_block_hash};
use switchyard_core::{LocalHash, RequestId, SequenceHash};

/// A request's rendezvous source: the lease it was given and, once the
/// driver has transferred it, the captured blocks (kept across capacity
/// deferrals: the retry uses exactly these).
pub(super) struct Rendezvous {
    pub(super) lease: LeaseRef,
    pub(super) delivered: Option<LeasedKv>,
    pub(super) deferrals: u32,
    /// Whether `RequestStateNotReady` was decided (and counted) already.
    pub(super) waited: bool,
}

/// Why a transfer could not be handed to a request.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum DeliverError {
    /// The engine does not hold the request.
    #[error("no such request")]
    UnknownRequest,
    /// The request restores from no rendezvous, or no longer needs it.
    #[error("the request awaits no rendezvous")]
    NotAwaited,
    /// A transfer was already handed over.
    #[error("the rendezvous was already delivered")]
    AlreadyDelivered,
    /// The tokens are not `block_size` per hash.
    #[error("{tokens} tokens for {blocks} blocks of {block_size}")]
    Malformed {
        /// Tokens delivered.
        tokens: usize,
        /// Hashes delivered.
        blocks: usize,
        /// Tokens per block here.
        block_size: usize,
    },
}

/// The block hashes of `tokens`' first `blocks` full blocks.
fn block_hashes(tokens: &[u32], seed: u64, blocks: usize, block_size: usize) -> Vec<SequenceHash> {
    let mut hashes: Vec<SequenceHash> = Vec::with_capacity(blocks);
    for chunk in tokens.chunks_exact(block_size).take(blocks) {
        let local = local_block_hash(chunk, seed);
        hashes.push(match hashes.last() {
            None => SequenceHash(local.0),
            Some(&prev) => chain_hash(prev, LocalHash(local.0)),
        });
    }
    hashes
}

impl<D: DeviceLayer> Engine<D> {
    /// Queues a request that restores its prefix from another engine's
    /// capture `lease` (a rendezvous): it waits (`RequestStateNotReady`,
    /// letting the requests behind it go first) until the driver hands the
    /// transfer over with [`Self::deliver_rendezvous`].
    pub fn add_rendezvous_request(
        &mut self,
        request: NewRequest,
        lease: LeaseRef,
    ) -> Result<(), AdmitError> {
        if self.checkpoints.is_some() {
            return Err(AdmitError::HybridTransfer);
        }
        let id = request.id;
        self.add_request(request)?;
        let seq = self.by_request[&id];
        self.seq_mut(seq).rendezvous = Some(Rendezvous {
            lease,
            delivered: None,
            deferrals: 0,
            waited: false,
        });
        Ok(())
    }

    /// Hands a transferred capture to the request waiting for it. Checked
    /// for shape here and against the prompt at admission.
    pub fn deliver_rendezvous(
        &mut self,
        request: RequestId,
        transfer: LeasedKv,
    ) -> Result<(), DeliverError> {
        let bs = self.config.block_size;
        let &id = self
            .by_request
            .get(&request)
            .ok_or(DeliverError::UnknownRequest)?;
        let Some(rendezvous) = self.seq_mut(id).rendezvous.as_mut() else {
            return Err(DeliverError::NotAwaited);
        };
        if rendezvous.delivered.is_some() {
            return Err(DeliverError::AlreadyDelivered);
        }
        if transfer.tokens.len() != transfer.hashes.len() * bs {
            return Err(DeliverError::Malformed {
                tokens: transfer.tokens.len(),
                blocks: transfer.hashes.len(),
                block_size: bs,
            });
        }
        rendezvous.delivered = Some(transfer);
        Ok(())
    }

    /// Captures the leading blocks of `prompt` the device caches under a
    /// lease for another engine to restore from, until `expires_at_ms`;
    /// `token` is its secret (the driver draws it from a CSPRNG). Returns
    /// the lease and the blocks it holds.
    pub fn capture(
        &mut self,
        prompt: &[u32],
        hash_seed: u64,
        token: u128,
        expires_at_ms: f64,
    ) -> Result<(LeaseRef, usize), LeaseError> {
        let bs = self.config.block_size;
        let hashes = block_hashes(prompt, hash_seed, prompt.len() / bs, bs);
        self.leases
            .capture(&mut self.kv, &hashes, token, expires_at_ms)
    }

    /// Leading full blocks of `prompt` this engine's device caches now (a
    /// transfer need not move those).
    pub fn cached_prefix_blocks(&self, prompt: &[u32], hash_seed: u64) -> usize {
        let bs = self.config.block_size;
        self.kv
            .lookup_prefix(&block_hashes(prompt, hash_seed, prompt.len() / bs, bs))
    }

    /// A lease's blocks, for the transfer to the engine restoring them.
    pub fn read_lease(&mut self, lease: LeaseRef) -> Result<LeasedKv, LeaseError> {
        self.leases.read(&self.kv, lease)
    }

    /// Releases a lease (its blocks stay cached, evictable again).
    pub fn release_lease(&mut self, lease: LeaseRef) -> Result<(), LeaseError> {
        self.leases.release(&mut self.kv, lease)
    }

    /// Releases the leases past their expiry; returns how many.
    pub fn expire_leases(&mut self, now_ms: f64) -> usize {
        self.leases.expire(&mut self.kv, now_ms)
    }

    /// Leases held now.
    pub fn leases_held(&self) -> usize {
        self.leases.len()
    }

    /// Lease counters so far.
    pub fn lease_counters(&self) -> LeaseCounters {
        self.leases.counters()
    }
}
