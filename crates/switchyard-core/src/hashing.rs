//! Token ids to block hashes.
//!
//! - A **local block hash** is xxh3-64 over the little-endian `u32` token ids
//!   of one block, with a seed ([`DEFAULT_SEED`] unless a LoRA adapter or a
//!   cache salt folds into it, see [`seed_for`]).
//! - A **sequence hash** chains them: `seq[0] = local[0]`,
//!   `seq[i] = xxh3(le(seq[i-1]) ‖ le(local[i]))`, so it names the whole
//!   prefix up to block `i`.
//!
//! A partial trailing block is not a block: it is never hashed.

use crate::types::{LocalHash, SequenceHash};
use xxhash_rust::xxh3::{xxh3_64, xxh3_64_with_seed};

/// Seed of local block hashes for the base model with no cache salt.
pub const DEFAULT_SEED: u64 = 1337;

/// The seed for a request's local block hashes.
///
/// Requests for different LoRA adapters, or with different cache salts, must
/// never share KV blocks, so each folds into the seed: the seed is
/// `xxh3_64_with_seed("lora\0" ‖ name ‖ "\0salt\0" ‖ salt, DEFAULT_SEED)`
/// (an absent part is the empty string). With neither, it is [`DEFAULT_SEED`].
pub fn seed_for(lora_name: Option<&str>, cache_salt: Option<&str>) -> u64 {
    if lora_name.is_none() && cache_salt.is_none() {
        return DEFAULT_SEED;
    }
    let lora = lora_name.unwrap_or("");
    let salt = cache_salt.unwrap_or("");
    let mut material = Vec::with_capacity(11 + lora.len() + salt.len());
    material.extend_from_slice(b"lora\0");
    material.extend_from_slice(lora.as_bytes());
    material.extend_from_slice(b"\0salt\0");
    material.extend_from_slice(salt.as_bytes());
    xxh3_64_with_seed(&material, DEFAULT_SEED)
}

/// Hash of one full block of token ids.
pub fn local_block_hash(block_tokens: &[u32], seed: u64) -> LocalHash {
    LocalHash(hash_tokens_le(block_tokens, seed))
}

/// Local hashes of every full block of `tokens`; a partial trailing block is
/// dropped. A `block_size` of zero yields no blocks.
pub fn local_block_hashes(tokens: &[u32], block_size: usize, seed: u64) -> Vec<LocalHash> {
    let mut out = Vec::new();
    extend_local_block_hashes(tokens, block_size, seed, &mut out);
    out
}

/// Like [`local_block_hashes`], appending to a caller-owned buffer so the
/// request path can reuse its allocation.
pub fn extend_local_block_hashes(
    tokens: &[u32],
    block_size: usize,
    seed: u64,
    out: &mut Vec<LocalHash>,
) {
    if block_size == 0 {
        return;
    }
    out.reserve(tokens.len() / block_size);
    out.extend(
        tokens
            .chunks_exact(block_size)
            .map(|block| local_block_hash(block, seed)),
    );
}

/// The sequence hash of the block after `parent` whose local hash is `local`.
#[inline]
pub fn chain_hash(parent: SequenceHash, local: LocalHash) -> SequenceHash {
    let mut bytes = [0u8; 16];
    bytes[..8].copy_from_slice(&parent.0.to_le_bytes());
    bytes[8..].copy_from_slice(&local.0.to_le_bytes());
    SequenceHash(xxh3_64(&bytes))
}

/// Chained sequence hashes of a run of local hashes starting at the root.
pub fn sequence_hashes(local: &[LocalHash]) -> Vec<SequenceHash> {
    let mut out = Vec::with_capacity(local.len());
    extend_sequence_hashes(local, &mut out);
    out
}

/// Like [`sequence_hashes`], appending to a caller-owned buffer so the
/// routing path can reuse its allocation.
pub fn extend_sequence_hashes(local: &[LocalHash], out: &mut Vec<SequenceHash>) {
    out.reserve(local.len());
    let mut iter = local.iter();
    if let Some(first) = iter.next() {
        let mut prev = SequenceHash(first.0);
        out.push(prev);
        for &l in iter {
            prev = chain_hash(prev, l);
            out.push(prev);
        }
    }
}

fn hash_tokens_le(tokens: &[u32], seed: u64) -> u64 {
    if cfg!(target_endian = "little") {
        xxh3_64_with_seed(bytemuck::cast_slice(tokens), seed)
    } else {
        let bytes: Vec<u8> = tokens.iter().flat_map(|t| t.to_le_bytes()).collect();
        xxh3_64_with_seed(&bytes, seed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn local_hash_is_xxh3_of_little_endian_tokens_with_seed_1337() {
        let tokens: Vec<u32> = (0..16).collect();
        let bytes: Vec<u8> = tokens.iter().flat_map(|t| t.to_le_bytes()).collect();
        assert_eq!(
            local_block_hash(&tokens, DEFAULT_SEED).0,
            xxh3_64_with_seed(&bytes, 1337)
        );
    }

    #[test]
    fn fixed_vectors_do_not_drift() {
        // Pinned outputs: a change here changes every hash a deployed router
        // and its peers agree on, so it must be deliberate. Computed independently
        // with Python's `xxhash` package (`xxh3_64_intdigest`).
        let tokens: Vec<u32> = (0..16).collect();
        assert_eq!(
            local_block_hash(&tokens, DEFAULT_SEED).0,
            0xd47a_8f41_c833_328a
        );
        let block = [1u32, 2, 3, 4];
        assert_eq!(
            local_block_hash(&block, DEFAULT_SEED).0,
            0xcb38_e4d7_fb2d_ca5c
        );
        let seq = sequence_hashes(&[LocalHash(1), LocalHash(2)]);
        assert_eq!(seq[0], SequenceHash(1));
        assert_eq!(seq[1].0, 0x07ee_86c2_8144_6bef);
    }

    #[test]
    fn partial_trailing_block_is_not_a_block() {
        let tokens: Vec<u32> = (0..40).collect();
        let hashes = local_block_hashes(&tokens, 16, DEFAULT_SEED);
        assert_eq!(hashes.len(), 2);
        assert_eq!(hashes[0], local_block_hash(&tokens[..16], DEFAULT_SEED));
        assert_eq!(hashes[1], local_block_hash(&tokens[16..32], DEFAULT_SEED));
        assert!(local_block_hashes(&tokens[..15], 16, DEFAULT_SEED).is_empty());
        assert!(local_block_hashes(&tokens, 0, DEFAULT_SEED).is_empty());
    }

    #[test]
    fn sequence_hashes_chain_from_the_first_local_hash() {
        let local = [LocalHash(10), LocalHash(20), LocalHash(30)];
        let seq = sequence_hashes(&local);
        assert_eq!(seq[0], SequenceHash(10));
        assert_eq!(seq[1], chain_hash(SequenceHash(10), LocalHash(20)));
        assert_eq!(seq[2], chain_hash(seq[1], LocalHash(30)));
        let mut bytes = Vec::new();
        bytes.extend_from_slice(&10u64.to_le_bytes());
        bytes.extend_from_slice(&20u64.to_le_bytes());
        assert_eq!(seq[1].0, xxh3_64(&bytes));
        assert!(sequence_hashes(&[]).is_empty());
    }

    #[test]
    fn same_block_under_different_prefixes_has_different_sequence_hashes() {
        let a = sequence_hashes(&[LocalHash(1), LocalHash(3)]);
        let b = sequence_hashes(&[LocalHash(2), LocalHash(3)]);
        assert_ne!(a[1], b[1]);
    }

    #[test]
    fn lora_and_salt_fold_into_the_seed() {
        assert_eq!(seed_for(None, None), DEFAULT_SEED);
        let lora = seed_for(Some("adapter-a"), None);
        let other = seed_for(Some("adapter-b"), None);
        let salted = seed_for(None, Some("tenant-1"));
        let both = seed_for(Some("adapter-a"), Some("tenant-1"));
        let all = [DEFAULT_SEED, lora, other, salted, both];
        for (i, a) in all.iter().enumerate() {
            for b in &all[i + 1..] {
                assert_ne!(a, b);
            }
        }
        // A name cannot be confused with a salt.
        assert_ne!(seed_for(Some("x"), None), seed_for(None, Some("x")));
        let tokens: Vec<u32> = (0..16).collect();
        assert_ne!(
            local_block_hash(&tokens, lora),
            local_block_hash(&tokens, DEFAULT_SEED)
        );
    }
}
