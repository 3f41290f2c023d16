//! The agent workload as the tools take it: its parameters from a TOML
//! file (`--agentic-config`, every field optional: see
//! [`AgenticConfig`]), and the bundled tokenizer's vocabulary it is
//! written in. `replay --workload agentic` and `loadgen --workload
//! agentic` both start here, so that one file and one `--seed` name one
//! workload in either.
//!
//! ```toml
//! sessions = 200
//! sessions_per_sec = 0.5
//! context_cap_tokens = 128000
//!
//! [[kinds]]
//! prefix_tokens = 6000
//!
//! [[kinds]]
//! prefix_tokens = 12000
//! weight = 2
//!
//! [tool_output_tokens]   # a distribution is given whole
//! median = 500
//! sigma = 1.5
//! min = 1
//! max = 32000
//!
//! [fan_out]
//! probability = 0.05
//! ```

use anyhow::Context as _;
use std::path::Path;
use std::sync::Arc;
use switchyard_sim::workload::{AgentVocabulary, AgenticConfig};

/// The agent workload's parameters: `path`'s (TOML) or the defaults,
/// seeded with `seed`, checked.
pub fn config(path: Option<&Path>, seed: u64) -> anyhow::Result<AgenticConfig> {
    let mut config = match path {
        Some(path) => {
            let text = std::fs::read_to_string(path)
                .with_context(|| format!("reading {}", path.display()))?;
            toml::from_str(&text).with_context(|| format!("{}", path.display()))?
        }
        None => AgenticConfig::default(),
    };
    config.seed = seed;
    config.validate().map_err(|e| match path {
        Some(path) => anyhow::anyhow!("{}: {e}", path.display()),
        None => anyhow::anyhow!("{e}"),
    })?;
    Ok(config)
}

/// The bundled tokenizer's word tokens and chat template, as the agent
/// workload writes with them (the tokenizer `serve` and the sim-workers
/// count prompts with; [`switchyard_tokenizer::Tokenizer::bundled`]).
pub fn vocabulary() -> anyhow::Result<Arc<AgentVocabulary>> {
    let tokenizer = switchyard_tokenizer::Tokenizer::bundled()
        .map_err(|e| anyhow::anyhow!("loading the bundled tokenizer: {e}"))?;
    let vocabulary = AgentVocabulary::from_tokenizer(&tokenizer)
        .map_err(|e| anyhow::anyhow!("the agent workload with the bundled tokenizer: {e}"))?;
    Ok(Arc::new(vocabulary))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file(name: &str, text: &str) -> std::path::PathBuf {
        let path = std::env::temp_dir().join(format!(
            "switchyard-agentic-{}-{name}.toml",
            std::process::id()
        ));
        std::fs::write(&path, text).unwrap();
        path
    }

    #[test]
    fn a_file_sets_what_it_names_and_the_defaults_stand_for_the_rest() {
        let path = file(
            "some",
            "sessions = 12\n[[kinds]]\nprefix_tokens = 700\n[fan_out]\nprobability = 0.5\n",
        );
        let some = config(Some(&path), 9).unwrap();
        assert_eq!(some.sessions, 12);
        assert_eq!(some.seed, 9);
        assert_eq!(some.kinds.len(), 1);
        assert_eq!(some.kinds[0].weight, 1.0);
        assert_eq!(some.fan_out.probability, 0.5);
        let defaults = AgenticConfig::default();
        assert_eq!(some.fan_out.max_agents, defaults.fan_out.max_agents);
        assert_eq!(some.tool_output_tokens, defaults.tool_output_tokens);
        // The module documentation's example reads too.
        let example: String = include_str!("agentic.rs")
            .lines()
            .skip_while(|l| !l.starts_with("//! ```toml"))
            .skip(1)
            .take_while(|l| !l.starts_with("//! ```"))
            .map(|l| format!("{}\n", l.trim_start_matches("//!").trim_start()))
            .collect();
        let example = config(Some(&file("example", &example)), 0).unwrap();
        assert_eq!(example.kinds[1].weight, 2.0);
        assert_eq!(example.tool_output_tokens.median, 500.0);
    }

    #[test]
    fn a_bad_file_is_refused_naming_the_file_and_the_field() {
        for (name, text, expected) in [
            ("unknown", "session = 3\n", "unknown field"),
            ("seed", "seed = 3\n", "unknown field"),
            ("half", "[calls]\nmedian = 3\n", "missing field"),
            (
                "range",
                "[fan_out]\nprobability = 2.0\n",
                "fan_out.probability",
            ),
            ("cap", "context_cap_tokens = 1000\n", "context_cap_tokens"),
        ] {
            let path = file(name, text);
            let err = format!("{:#}", config(Some(&path), 0).unwrap_err());
            assert!(err.contains(&path.display().to_string()), "{err}");
            assert!(err.contains(expected), "{name}: {err}");
        }
    }
}
