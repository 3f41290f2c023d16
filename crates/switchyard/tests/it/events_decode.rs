//! `switchyard events decode` as a user runs it: the built binary on the
//! golden fixtures and on garbage.

use crate::support::{machine_blocking, scratch_file};
use serde_json::Value;
use std::path::PathBuf;
use std::process::Command;

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../switchyard-wire/tests/fixtures")
        .join(name)
}

fn decode(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_switchyard"))
        .arg("events")
        .arg("decode")
        .args(args)
        .output()
        .unwrap()
}

#[test]
fn decode_prints_every_fixture_as_json_with_unsigned_hashes_and_null_absent_fields() {
    let _machine = machine_blocking();
    for name in [
        "vllm_int_hashes.msgpack",
        "vllm_bytes32_hashes.msgpack",
        "vllm_legacy_array.msgpack",
        "sglang_signed_partial.msgpack",
    ] {
        let out = decode(&[fixture(name).to_str().unwrap()]);
        assert!(
            out.status.success(),
            "{name}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let json: Value = serde_json::from_slice(&out.stdout).unwrap();
        assert!(json["ts"].is_f64(), "{name}");
        assert!(json.get("data_parallel_rank").is_some(), "{name}");
        let first = &json["events"][0];
        assert_eq!(first["type"], "BlockStored", "{name}");
        assert!(first["block_hashes"][0].is_u64(), "{name}");
        assert!(first["lora_name"].is_null() || first["lora_name"].is_string());
    }
    let out = decode(&[
        "--format",
        "sglang",
        fixture("sglang_signed_partial.msgpack").to_str().unwrap(),
    ]);
    let json: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(
        json["events"][0]["block_hashes"][0],
        serde_json::json!(u64::MAX - 4)
    );
    assert_eq!(json["events"][0]["parent_block_hash"], Value::Null);
    assert_eq!(json["events"][0]["group_idx"], Value::Null);
}

#[test]
fn decode_rejects_garbage_with_one_line_and_a_nonzero_exit() {
    let _machine = machine_blocking();
    let garbage = scratch_file("garbage.bin", &[0x93, 0xcb, 0x00]);
    let out = decode(&[garbage.to_str().unwrap()]);
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(stderr.trim_end().lines().count(), 1, "{stderr}");
    assert!(stderr.contains("malformed KV-event batch"), "{stderr}");
    let out = decode(&[
        "--format",
        "sglang",
        fixture("vllm_bytes32_hashes.msgpack").to_str().unwrap(),
    ]);
    assert!(!out.status.success());
}
