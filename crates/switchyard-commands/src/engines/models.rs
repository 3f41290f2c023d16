//! Tiny random-weight models for real engines, made on the spot by
//! `engines/make_models.py` (compiled into this binary) with the engines'
//! Python: nothing is downloaded. What it writes, and why each exists:
//!
//! - `qwen3-tiny/`: a 2-layer `Qwen3ForCausalLM` (hidden 256, head_dim 64)
//!   with the bundled Qwen3 tokenizer and chat template, so the router's
//!   own tokenizer is the engine's;
//! - `qwen3-tiny-lora-a/`, `-b/`, `-c/`: three rank-8 LoRA adapters for
//!   it, as PEFT lays them out;
//! - `bpe-tiny/`: a second model whose byte-level BPE tokenizer (4,096
//!   tokens, trained there on the first bundled ShareGPT conversations) and
//!   ChatML template differ from Qwen3's, for two models behind one router.
//!
//! The weights are random from a fixed seed: the text is gibberish, the
//! engine's caching, scheduling, events and metrics are real.

use anyhow::Context as _;
use std::path::{Path, PathBuf};
use std::process::Command;
use switchyard_tokenizer::Tokenizer;

/// The script (`crates/switchyard-commands/engines/make_models.py`).
static MAKE_MODELS: &str = include_str!("../../engines/make_models.py");

/// The directory of made models.
#[derive(Clone, Debug)]
pub struct TinyModels {
    /// Where they are.
    pub dir: PathBuf,
}

impl TinyModels {
    /// Makes the models under `out` with `python` (kept when made before).
    pub fn make(python: &Path, out: &Path) -> anyhow::Result<Self> {
        let inputs = out.join("inputs");
        std::fs::create_dir_all(&inputs)
            .with_context(|| format!("creating {}", inputs.display()))?;
        let script = inputs.join("make_models.py");
        std::fs::write(&script, MAKE_MODELS)?;
        let tokenizer = inputs.join("qwen3-tokenizer");
        std::fs::create_dir_all(&tokenizer)?;
        std::fs::write(tokenizer.join("tokenizer.json"), Tokenizer::bundled_json())?;
        std::fs::write(
            tokenizer.join("tokenizer_config.json"),
            Tokenizer::bundled_config_json(),
        )?;
        let mut command = Command::new(python);
        command
            .arg(&script)
            .arg("--out")
            .arg(out)
            .arg("--qwen3-tokenizer-dir")
            .arg(&tokenizer)
            .env("HF_HUB_OFFLINE", "1")
            .env("TRANSFORMERS_OFFLINE", "1");
        if let Ok(sharegpt) = crate::data::data_path("traces/sharegpt_multiturn_3000.jsonl.gz") {
            command.arg("--sharegpt").arg(sharegpt);
        }
        let output = command
            .output()
            .with_context(|| format!("running {}", python.display()))?;
        anyhow::ensure!(
            output.status.success(),
            "make_models.py failed ({}): {}",
            output.status,
            super::tail(&String::from_utf8_lossy(&output.stderr), 15)
        );
        Ok(Self {
            dir: out.to_owned(),
        })
    }

    /// The Qwen3 model with the bundled tokenizer.
    pub fn qwen3(&self) -> PathBuf {
        self.dir.join("qwen3-tiny")
    }

    /// LoRA adapter `a`, `b` or `c` for [`Self::qwen3`].
    pub fn qwen3_lora(&self, which: char) -> PathBuf {
        self.dir.join(format!("qwen3-tiny-lora-{which}"))
    }

    /// The model with a tokenizer of its own.
    pub fn bpe(&self) -> PathBuf {
        self.dir.join("bpe-tiny")
    }
}
