//! The official `openai` Python client talks to the router unchanged:
//! chat and completions, streaming and not. Skipped, with the reason
//! printed, when python3 or pip cannot install the client.

use crate::support::{machine_blocking, router, sim_worker};
use std::path::PathBuf;
use std::process::Command;

const SCRIPT: &str = r#"
import sys
from openai import OpenAI
client = OpenAI(base_url=sys.argv[1] + "/v1", api_key="sk-test")
models = [m.id for m in client.models.list()]
assert models == ["switchyard-sim"], models
chat = client.chat.completions.create(
    model="switchyard-sim", messages=[{"role": "user", "content": "Hello there"}], max_tokens=4)
assert chat.choices[0].message.content, chat
raw = client.chat.completions.with_raw_response.create(
    model="switchyard-sim", messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
assert raw.headers.get("x-switchyard-worker") == "w0", raw.headers
stream = client.chat.completions.create(
    model="switchyard-sim", messages=[{"role": "user", "content": "Stream please"}], max_tokens=5, stream=True)
deltas = [c.choices[0].delta.content for c in stream if c.choices and c.choices[0].delta.content]
assert len(deltas) >= 1, deltas
done = client.completions.create(model="switchyard-sim", prompt="Once upon a time", max_tokens=3)
assert done.choices[0].text, done
ids = client.completions.create(model="switchyard-sim", prompt=[1, 2, 3, 4], max_tokens=3, stream=True)
assert sum(1 for _ in ids) >= 3
try:
    client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    raise SystemExit("expected NotFoundError")
except Exception as e:
    assert type(e).__name__ == "NotFoundError", repr(e)
print("OPENAI-CLIENT-OK")
"#;

/// A venv with `openai` and `anthropic`, cached under the target
/// directory and made once per run (tests ask for it concurrently: two
/// makers would remove each other's half-made venv). `Err` says why it
/// cannot be made; with `SWITCHYARD_REQUIRE_CLIENTS=1` (what `scripts/test`
/// sets) that is a failure, not a skip.
pub(crate) fn venv() -> Result<PathBuf, String> {
    static VENV: std::sync::OnceLock<Result<PathBuf, String>> = std::sync::OnceLock::new();
    let made = VENV.get_or_init(make_venv).clone();
    if let Err(why) = &made {
        let required = std::env::var("SWITCHYARD_REQUIRE_CLIENTS").is_ok_and(|v| v == "1");
        assert!(!required, "the official Python clients are required: {why}");
    }
    made
}

fn make_venv() -> Result<PathBuf, String> {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("openai-venv");
    let python = dir.join("bin/python");
    let ready = Command::new(&python)
        .args(["-c", "import openai, anthropic"])
        .status()
        .is_ok_and(|s| s.success());
    if ready {
        return Ok(python);
    }
    let _ = std::fs::remove_dir_all(&dir);
    let made = Command::new("python3")
        .args(["-m", "venv"])
        .arg(&dir)
        .status()
        .map_err(|e| format!("python3 not available: {e}"))?;
    if !made.success() {
        return Err("python3 -m venv failed".into());
    }
    let pip = Command::new(dir.join("bin/pip"))
        .args(["install", "-q", "openai", "anthropic"])
        .status()
        .map_err(|e| format!("pip not available: {e}"))?;
    if !pip.success() {
        return Err("pip install openai anthropic failed (no registry?)".into());
    }
    Ok(python)
}

#[test]
fn the_official_openai_python_client_works_against_the_router_unchanged() {
    let _machine = machine_blocking();
    let python = match venv() {
        Ok(p) => p,
        Err(reason) => {
            println!("skipping: {reason}");
            return;
        }
    };
    let worker = sim_worker("0");
    let router = router(&[worker.named("w0")], &[]);
    let output = Command::new(python)
        .args(["-c", SCRIPT, &router.base])
        .output()
        .expect("python runs");
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success() && stdout.contains("OPENAI-CLIENT-OK"),
        "stdout: {stdout}\nstderr: {stderr}"
    );
}
