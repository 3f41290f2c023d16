//! Deterministic synthetic tokens and draft-acceptance draws: hashes of the
//! request and the output position, no random state.

use switchyard_core::RequestId;

/// The synthetic token sampled at output position `index` of `request`:
/// deterministic, drawn from `vocabulary` when given and not empty
/// ([`EngineConfig::validate`](crate::EngineConfig::validate) refuses an
/// empty one), else spread over 32,000 ids above the special ids.
pub fn synthetic_token(request: RequestId, index: u32, vocabulary: Option<&[u32]>) -> u32 {
    let mut x = (request.0 as u64)
        ^ ((request.0 >> 64) as u64)
        ^ (u64::from(index) << 32 | u64::from(index));
    x ^= x >> 33;
    x = x.wrapping_mul(0xff51_afd7_ed55_8ccd);
    x ^= x >> 33;
    match vocabulary {
        Some(ids) if !ids.is_empty() => ids[(x % ids.len() as u64) as usize],
        _ => 100 + (x % 32_000) as u32,
    }
}

/// Drafts accepted of `drafts` proposed after output position
/// `first_index` of `request`: each with probability `rate`, stopping at
/// the first rejection. Deterministic (a hash of the request and the
/// position, as [`synthetic_token`]): no random state.
pub fn accepted_drafts(request: RequestId, first_index: u32, drafts: usize, rate: f64) -> usize {
    (0..drafts as u32)
        .take_while(|&j| draft_draw(request, first_index.wrapping_add(j)) < rate)
        .count()
}

/// A uniform draw in `[0, 1)` for the draft at output position `index`.
fn draft_draw(request: RequestId, index: u32) -> f64 {
    let mut x = (request.0 as u64)
        ^ ((request.0 >> 64) as u64).rotate_left(29)
        ^ u64::from(index).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    x ^= x >> 30;
    x = x.wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x ^= x >> 27;
    x = x.wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^= x >> 31;
    (x >> 11) as f64 / (1u64 << 53) as f64
}
