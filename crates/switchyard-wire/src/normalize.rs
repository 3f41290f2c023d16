//! Decoded KV events → prefix-index events (filled in by the next commit).
