//! Any byte string fed to the KV-event decoder and normalizer must produce a
//! value or a typed error, never a panic, in every accepted format.
#![no_main]

use libfuzzer_sys::fuzz_target;
use switchyard_wire::kv_events::{decode_batch_lossy, encode_batch, Format};
use switchyard_wire::normalize::Normalizer;

fuzz_target!(|data: &[u8]| {
    for format in [Format::Auto, Format::Vllm, Format::Sglang] {
        if let Ok((batch, _errors)) = decode_batch_lossy(data, format) {
            let mut normalizer = Normalizer::new(16);
            for event in &batch.events {
                let _ = normalizer.normalize(event);
            }
            // Whatever decodes must re-encode and decode again.
            let _ = decode_batch_lossy(&encode_batch(&batch), Format::Auto)
                .expect("a re-encoded batch decodes");
        }
    }
});
