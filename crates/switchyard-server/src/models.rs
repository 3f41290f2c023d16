//! Per-model routing state: the `[[models]]` tables.
//!
//! A router in front of a fleet that serves several models keeps, for
//! each model the workers name in their `/v1/models`, its own tokenizer
//! and chat template, its block size and, optionally, its own policy. The
//! rest of the state is per worker and so per model already: the prefix
//! index holds each worker's blocks (a request only ever looks at the
//! workers that serve its model: [`switchyard_core::eligibility`]),
//! and the load view is each worker's. One table entry is the *default*:
//! the router's own tokenizer (`--tokenizer-dir` or the bundled one),
//! `--block-size` and `--policy`, for every model not listed.
//!
//! A listed model whose tokenizer cannot be loaded (a missing directory,
//! a hub id not in the cache while downloads are off) is still served: its
//! requests are routed by load alone (no prefix hashes; the prompt's
//! length estimated from its bytes), which the log says at start-up and
//! `switchyard_model_tokenizer_loaded{model}` shows as 0. A stream of
//! such a model cannot be resumed on another worker mid-way (the router
//! does not know its prompt's ids).
//!
//! A stream is resumed on another worker by its token ids, so only while
//! the model's ids, as the router computes them, are known to be the
//! engine's ([`IdsTrust`]): its tokenizer was configured (a `[[models]]`
//! table's source, or `--tokenizer-dir`), or a worker's engine tokenized
//! a probe text exactly as the router does (`POST /tokenize`, checked as
//! each worker enters selection: [`crate::fleet`]). The bundled
//! tokenizer, used for models nobody named, is otherwise a guess: a
//! broken stream of such a model ends with an error instead of going on
//! under a prompt the engine would read differently.
//!
//! `/metrics` has each model's requests, prompt blocks and the blocks the
//! router expected its chosen worker to hold, so that each model's hit
//! rate is its own ([`ModelsCollector`]).

use crate::adapters::Adapters;
use crate::tokenize::PromptTokenizer;
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::MetricType;
use rustc_hash::FxHashMap;
use serde::{Deserialize, Serialize};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, AtomicU8, Ordering};
use std::sync::Arc;
use switchyard_core::select::{ModelSettings, PolicyKind};

/// Most `[[models]]` tables (each is a label value of the per-model
/// series, and a tokenizer in memory).
pub(crate) const MAX_MODELS: usize = 64;
/// Longest model name.
pub(crate) const MAX_MODEL_NAME_BYTES: usize = 256;
/// The label of the default entry (models not listed).
pub(crate) const DEFAULT_LABEL: &str = "default";
/// Bytes per token assumed for a prompt whose model has no tokenizer
/// here (English text averages about four bytes a token with the common
/// BPE vocabularies); only the load view reads it.
pub(crate) const BYTES_PER_TOKEN_ESTIMATE: usize = 4;

/// Text the router and each worker's engine tokenize to check that they
/// agree ([`IdsTrust`]): words, digits, punctuation, whitespace runs,
/// accents, CJK and an emoji, so that different vocabularies or
/// pre-tokenizers split it differently; no special token.
pub(crate) const TOKENIZER_PROBE: &str = "Switchyard checks its tokenizer: 0123456789, \"quoted\" (text)\n\n\tnaïve café — 東京の天気 🚀 don't stop...";

/// Whether a model's token ids, as the router computes them, are the
/// engine's (a stream is resumed by token ids only then).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum IdsTrust {
    /// Its tokenizer was configured by the operator.
    Configured,
    /// Not configured and not checked yet (no worker of the model answered
    /// `/tokenize`).
    Unchecked,
    /// A worker's engine tokenized the probe as the router does, and none
    /// differed.
    Agrees,
    /// A worker's engine tokenized the probe differently (sticky: the
    /// router's prefix hashes are not that engine's either).
    Disagrees,
}

impl IdsTrust {
    fn from_u8(v: u8) -> Self {
        match v {
            0 => Self::Configured,
            1 => Self::Unchecked,
            2 => Self::Agrees,
            _ => Self::Disagrees,
        }
    }

    fn to_u8(self) -> u8 {
        match self {
            Self::Configured => 0,
            Self::Unchecked => 1,
            Self::Agrees => 2,
            Self::Disagrees => 3,
        }
    }

    /// Its `switchyard_model_tokenizer_checked` value.
    fn gauge(self) -> i64 {
        match self {
            Self::Configured | Self::Agrees => 1,
            Self::Unchecked => 0,
            Self::Disagrees => -1,
        }
    }
}

/// One `[[models]]` table.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelSpec {
    /// The model's name as its workers' `/v1/models` and requests name it.
    pub name: String,
    /// A directory with its `tokenizer.json` (and `tokenizer_config.json`
    /// for the chat template).
    #[serde(default)]
    pub tokenizer_dir: Option<PathBuf>,
    /// Its Hugging Face hub id (`Qwen/Qwen3-0.6B`): the tokenizer is read
    /// from the hub cache, and downloaded there only with
    /// `allow_hub_download`.
    #[serde(default)]
    pub hub_id: Option<String>,
    /// Tokens per KV block of its engines (default: the router's).
    #[serde(default)]
    pub block_size: Option<u32>,
    /// Its routing policy (default: the router's).
    #[serde(default)]
    pub policy: Option<PolicyKind>,
}

impl ModelSpec {
    /// Checks the name, the block size and the tokenizer source.
    pub fn validate(&self) -> Result<(), String> {
        if self.name.is_empty() || self.name.len() > MAX_MODEL_NAME_BYTES {
            return Err(format!(
                "models: a name must be 1 to {MAX_MODEL_NAME_BYTES} bytes"
            ));
        }
        if self.name == DEFAULT_LABEL {
            return Err(format!(
                "models: `{DEFAULT_LABEL}` is the label of the models not listed; name the model as its workers do"
            ));
        }
        if self.block_size == Some(0) {
            return Err(format!(
                "models: `{}`: block_size must be positive",
                self.name
            ));
        }
        if self.tokenizer_dir.is_some() && self.hub_id.is_some() {
            return Err(format!(
                "models: `{}`: give tokenizer_dir or hub_id, not both",
                self.name
            ));
        }
        Ok(())
    }
}

/// One model's routing settings and counters.
pub struct ModelRouting {
    /// Its name, or [`DEFAULT_LABEL`]: the `model` label of its series.
    pub label: Arc<str>,
    /// Its tokenizer; `None`: its requests are routed by load alone.
    pub tokenizer: Option<Arc<dyn PromptTokenizer>>,
    /// Tokens per KV block.
    pub block_size: u32,
    /// What the core is told (block size and policy where they are not
    /// the router's).
    pub settings: ModelSettings,
    /// An [`IdsTrust`].
    trust: AtomicU8,
    requests: AtomicU64,
    prompt_blocks: AtomicU64,
    expected_hit_blocks: AtomicU64,
}

impl std::fmt::Debug for ModelRouting {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ModelRouting")
            .field("label", &self.label)
            .field("tokenizer", &self.tokenizer.is_some())
            .field("block_size", &self.block_size)
            .field("settings", &self.settings)
            .finish_non_exhaustive()
    }
}

impl ModelRouting {
    fn new(
        label: &str,
        tokenizer: Option<Arc<dyn PromptTokenizer>>,
        configured: bool,
        block_size: u32,
        settings: ModelSettings,
    ) -> Self {
        let trust = match configured {
            true => IdsTrust::Configured,
            false => IdsTrust::Unchecked,
        };
        Self {
            label: label.into(),
            tokenizer,
            block_size,
            settings,
            trust: AtomicU8::new(trust.to_u8()),
            requests: AtomicU64::new(0),
            prompt_blocks: AtomicU64::new(0),
            expected_hit_blocks: AtomicU64::new(0),
        }
    }

    /// A request of this model was placed: `prompt_blocks` full blocks,
    /// `hit_blocks` of them expected cached on the chosen worker.
    pub fn record_placement(&self, prompt_blocks: usize, hit_blocks: u32) {
        self.requests.fetch_add(1, Ordering::Relaxed);
        self.prompt_blocks
            .fetch_add(prompt_blocks as u64, Ordering::Relaxed);
        self.expected_hit_blocks.fetch_add(
            u64::from(hit_blocks).min(prompt_blocks as u64),
            Ordering::Relaxed,
        );
    }

    /// Whether its token ids are known to be the engine's.
    pub fn ids_trust(&self) -> IdsTrust {
        IdsTrust::from_u8(self.trust.load(Ordering::Relaxed))
    }

    /// Whether a broken stream of this model may be resumed by token ids:
    /// `Err` says why not.
    pub fn resume_by_ids(&self) -> Result<(), &'static str> {
        if self.tokenizer.is_none() {
            return Err("its model has no tokenizer here, so its prompt's token ids are unknown");
        }
        match self.ids_trust() {
            IdsTrust::Configured | IdsTrust::Agrees => Ok(()),
            IdsTrust::Unchecked => Err("its model's tokenizer is not known to be the engine's (name it in a [[models]] table or --tokenizer-dir, or serve /tokenize on the workers)"),
            IdsTrust::Disagrees => Err("its model's engine tokenizes differently from the router"),
        }
    }

    /// Whether the tokenizer still needs a check against an engine.
    pub fn wants_engine_check(&self) -> bool {
        self.tokenizer.is_some()
            && matches!(self.ids_trust(), IdsTrust::Unchecked | IdsTrust::Agrees)
    }

    /// A worker's engine tokenized [`TOKENIZER_PROBE`] as the router does
    /// (`agrees`) or not; returns the trust before. A configured tokenizer
    /// stays trusted, and a disagreement is never undone.
    pub fn engine_checked(&self, agrees: bool) -> IdsTrust {
        let next = if agrees {
            IdsTrust::Agrees
        } else {
            IdsTrust::Disagrees
        };
        let before = self
            .trust
            .fetch_update(
                Ordering::Relaxed,
                Ordering::Relaxed,
                |v| match IdsTrust::from_u8(v) {
                    IdsTrust::Unchecked | IdsTrust::Agrees => Some(next.to_u8()),
                    IdsTrust::Configured | IdsTrust::Disagrees => None,
                },
            )
            .unwrap_or_else(|v| v);
        IdsTrust::from_u8(before)
    }

    /// The prompt's length as routing counts it when there is no
    /// tokenizer: its bytes over [`BYTES_PER_TOKEN_ESTIMATE`].
    pub fn estimated_tokens(bytes: usize) -> u32 {
        u32::try_from(bytes.div_ceil(BYTES_PER_TOKEN_ESTIMATE)).unwrap_or(u32::MAX)
    }
}

/// Every model's routing state, by name.
#[derive(Debug)]
pub struct Models {
    by_name: FxHashMap<Box<str>, Arc<ModelRouting>>,
    default: Arc<ModelRouting>,
}

impl Models {
    /// One model family: every request routes with `tokenizer` at
    /// `block_size` and the router's policy.
    /// `configured`: the operator named the tokenizer ([`IdsTrust`]).
    pub fn single(tokenizer: Arc<dyn PromptTokenizer>, configured: bool, block_size: u32) -> Self {
        Self {
            by_name: FxHashMap::default(),
            default: Arc::new(ModelRouting::new(
                DEFAULT_LABEL,
                Some(tokenizer),
                configured,
                block_size,
                ModelSettings::default(),
            )),
        }
    }

    /// The default entry (`tokenizer`, named by the operator when
    /// `configured`, and `block_size`) and one per spec, each with its
    /// tokenizer loaded by `load` (`None` with a warning in the log: routed
    /// by load).
    pub fn new(
        tokenizer: Arc<dyn PromptTokenizer>,
        configured: bool,
        block_size: u32,
        specs: &[ModelSpec],
        mut load: impl FnMut(&ModelSpec) -> Result<Arc<dyn PromptTokenizer>, String>,
    ) -> Self {
        let mut models = Self::single(tokenizer, configured, block_size);
        for spec in specs.iter().take(MAX_MODELS) {
            let own = spec.tokenizer_dir.is_some() || spec.hub_id.is_some();
            let tokenizer = match own {
                // No source named: the router's own tokenizer.
                false => models.default.tokenizer.clone(),
                true => match load(spec) {
                    Ok(t) => Some(t),
                    Err(e) => {
                        tracing::warn!(model = %spec.name, error = %e, "no tokenizer for this model: its requests are routed by load alone (switchyard_model_tokenizer_loaded 0)");
                        None
                    }
                },
            };
            let settings = ModelSettings {
                block_size: spec.block_size.filter(|&b| b != block_size),
                policy: spec.policy,
            };
            let routing = ModelRouting::new(
                &spec.name,
                tokenizer,
                own || configured,
                spec.block_size.unwrap_or(block_size),
                settings,
            );
            tracing::info!(model = %spec.name, block_size = routing.block_size, tokenizer = routing.tokenizer.is_some(), policy = ?spec.policy, "model routing state");
            models
                .by_name
                .insert(spec.name.as_str().into(), Arc::new(routing));
        }
        models
    }

    /// The routing state of `model` (the default entry's when it is not
    /// listed or not named).
    pub fn get(&self, model: Option<&str>) -> &Arc<ModelRouting> {
        model
            .and_then(|m| self.by_name.get(m))
            .unwrap_or(&self.default)
    }

    /// The routing state of a request naming `model`: an adapter's is its
    /// base model's.
    pub fn for_request(&self, adapters: &Adapters, model: Option<&str>) -> &Arc<ModelRouting> {
        // One model family (no tables): nothing to resolve per request.
        if self.by_name.is_empty() {
            return &self.default;
        }
        self.get(adapters.resolve(model).eligible_model.as_deref())
    }

    /// Every entry, the default first, then by name.
    pub fn entries(&self) -> Vec<Arc<ModelRouting>> {
        let mut listed: Vec<_> = self.by_name.values().cloned().collect();
        listed.sort_by(|a, b| a.label.cmp(&b.label));
        std::iter::once(self.default.clone())
            .chain(listed)
            .collect()
    }
}

/// The block size of each `[[models]]` table that names one.
pub(crate) fn block_sizes(specs: &[ModelSpec]) -> FxHashMap<String, u32> {
    specs
        .iter()
        .take(MAX_MODELS)
        .filter_map(|m| Some((m.name.clone(), m.block_size?)))
        .collect()
}

/// The block size of a worker serving `served` (its `/v1/models`): that
/// of the first model with one in `sizes` ([`block_sizes`]), else `None`
/// (the router's).
pub(crate) fn worker_block_size(sizes: &FxHashMap<String, u32>, served: &[String]) -> Option<u32> {
    served.iter().find_map(|m| sizes.get(m).copied())
}

/// A listed model's tokenizer: from its directory, or from the hub cache
/// (downloaded when `switchyard_tokenizer::hub` allows it).
pub(crate) fn load_tokenizer(
    spec: &ModelSpec,
    hub: &switchyard_tokenizer::hub::HubOptions,
    segment_cache_ids: u64,
) -> Result<Arc<dyn PromptTokenizer>, String> {
    let dir: PathBuf = match (&spec.tokenizer_dir, &spec.hub_id) {
        (Some(dir), _) => dir.clone(),
        (None, Some(id)) => {
            switchyard_tokenizer::hub::tokenizer_dir_from_hub(id, hub).map_err(|e| e.to_string())?
        }
        (None, None) => return Err("no tokenizer_dir or hub_id".into()),
    };
    let tokenizer = switchyard_tokenizer::Tokenizer::from_dir(&dir)
        .map_err(|e| e.to_string())?
        .with_segment_cache(segment_cache_ids);
    Ok(Arc::new(crate::tokenize::HfTokenizer(tokenizer)))
}

/// A per-model series: its name, its help and how a model's value is read.
type Series<T> = (&'static str, &'static str, fn(&ModelRouting) -> T);

/// Each model's series, read at scrape time.
pub(crate) struct ModelsCollector(pub Arc<Models>);

impl std::fmt::Debug for ModelsCollector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ModelsCollector").finish_non_exhaustive()
    }
}

impl Collector for ModelsCollector {
    fn encode(&self, mut encoder: DescriptorEncoder<'_>) -> std::fmt::Result {
        let entries = self.0.entries();
        let counters: [Series<u64>; 3] = [
            (
                "switchyard_model_requests",
                "Requests placed on a worker, by model (`default`: models without a [[models]] table).",
                |m| m.requests.load(Ordering::Relaxed),
            ),
            (
                "switchyard_model_prompt_blocks",
                "Full KV blocks of the prompts placed, by model.",
                |m| m.prompt_blocks.load(Ordering::Relaxed),
            ),
            (
                "switchyard_model_expected_hit_blocks",
                "Prompt blocks the router expected the chosen worker to hold in its KV cache, by model: over switchyard_model_prompt_blocks, the model's predicted hit rate.",
                |m| m.expected_hit_blocks.load(Ordering::Relaxed),
            ),
        ];
        for (name, help, read) in counters {
            let mut family = encoder.encode_descriptor(name, help, None, MetricType::Counter)?;
            for m in &entries {
                let labels = [("model", &*m.label)];
                ConstCounter::new(read(m)).encode(family.encode_family(&labels)?)?;
            }
        }
        let gauges: [Series<i64>; 3] = [
            (
                "switchyard_model_tokenizer_loaded",
                "1 when the router tokenizes the model's prompts; 0: routed by load alone (its tokenizer could not be loaded: see the start-up log).",
                |m| i64::from(m.tokenizer.is_some()),
            ),
            (
                "switchyard_model_tokenizer_checked",
                "1 when the model's token ids, as the router computes them, are known to be the engine's (its tokenizer configured, or a worker's /tokenize agreed on a probe); 0: not checked; -1: a worker's engine tokenized the probe differently. A broken stream is resumed on another worker only at 1.",
                |m| m.ids_trust().gauge(),
            ),
            (
                "switchyard_model_block_size",
                "Tokens per KV block the router hashes the model's prompts at.",
                |m| i64::from(m.block_size),
            ),
        ];
        for (name, help, read) in gauges {
            let mut family = encoder.encode_descriptor(name, help, None, MetricType::Gauge)?;
            for m in &entries {
                let labels = [("model", &*m.label)];
                ConstGauge::new(read(m)).encode(family.encode_family(&labels)?)?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use switchyard_tokenizer::{ChatMessage, TokenizerError};

    struct Fixed(u32);

    impl PromptTokenizer for Fixed {
        fn encode(&self, _: &str) -> Result<Vec<u32>, TokenizerError> {
            Ok(vec![self.0])
        }
        fn encode_chat(&self, _: &[ChatMessage]) -> Result<Vec<u32>, TokenizerError> {
            Ok(vec![self.0])
        }
    }

    fn spec(name: &str) -> ModelSpec {
        ModelSpec {
            name: name.into(),
            tokenizer_dir: None,
            hub_id: None,
            block_size: None,
            policy: None,
        }
    }

    fn models() -> Models {
        let a = ModelSpec {
            tokenizer_dir: Some("/a".into()),
            block_size: Some(32),
            policy: Some(PolicyKind::RoundRobin),
            ..spec("a")
        };
        let missing = ModelSpec {
            hub_id: Some("org/missing".into()),
            ..spec("missing")
        };
        let same = ModelSpec {
            block_size: Some(16),
            ..spec("same")
        };
        Models::new(
            Arc::new(Fixed(0)),
            false,
            16,
            &[a, missing, same],
            |s| match s.name.as_str() {
                "a" => Ok(Arc::new(Fixed(1)) as Arc<dyn PromptTokenizer>),
                _ => Err("not in the cache".into()),
            },
        )
    }

    #[test]
    fn a_listed_model_routes_with_its_own_tokenizer_block_size_and_policy() {
        let models = models();
        let a = models.get(Some("a"));
        assert_eq!(&*a.label, "a");
        assert_eq!(a.tokenizer.as_ref().unwrap().encode("x").unwrap(), [1]);
        assert_eq!(a.block_size, 32);
        assert_eq!(
            a.settings,
            ModelSettings {
                block_size: Some(32),
                policy: Some(PolicyKind::RoundRobin)
            }
        );
    }

    #[test]
    fn models_not_listed_route_with_the_routers_settings() {
        let models = models();
        for name in [None, Some("other")] {
            let d = models.get(name);
            assert_eq!(&*d.label, DEFAULT_LABEL);
            assert_eq!(d.tokenizer.as_ref().unwrap().encode("x").unwrap(), [0]);
            assert_eq!((d.block_size, d.settings), (16, ModelSettings::default()));
        }
        // A table without a tokenizer source takes the router's; a block
        // size equal to the router's is no override.
        let same = models.get(Some("same"));
        assert_eq!(same.tokenizer.as_ref().unwrap().encode("x").unwrap(), [0]);
        assert_eq!(same.settings, ModelSettings::default());
    }

    #[test]
    fn a_model_whose_tokenizer_cannot_load_is_routed_by_load() {
        let models = models();
        let m = models.get(Some("missing"));
        assert!(m.tokenizer.is_none());
        assert_eq!(ModelRouting::estimated_tokens(9), 3);
    }

    #[test]
    fn a_worker_takes_the_block_size_of_the_first_listed_model_it_serves() {
        let sizes = block_sizes(&[
            ModelSpec {
                block_size: Some(32),
                ..spec("a")
            },
            ModelSpec {
                block_size: Some(64),
                ..spec("b")
            },
            spec("c"),
        ]);
        let served = |names: &[&str]| names.iter().map(|n| n.to_string()).collect::<Vec<_>>();
        assert_eq!(
            worker_block_size(&sizes, &served(&["x", "a", "b"])),
            Some(32)
        );
        assert_eq!(worker_block_size(&sizes, &served(&["c", "b"])), Some(64));
        assert_eq!(worker_block_size(&sizes, &served(&["x", "c"])), None);
    }

    #[test]
    fn streams_resume_by_ids_only_when_the_tokenizer_is_configured_or_agreed_on() {
        let models = models();
        // A table with its own source is the operator's word.
        let a = models.get(Some("a"));
        assert_eq!(a.ids_trust(), IdsTrust::Configured);
        assert!(a.resume_by_ids().is_ok());
        assert_eq!(a.engine_checked(false), IdsTrust::Configured);
        assert_eq!(a.ids_trust(), IdsTrust::Configured, "configured stays");
        assert!(!a.wants_engine_check());
        // The bundled default is a guess until an engine agrees.
        let d = models.get(None);
        assert_eq!(d.ids_trust(), IdsTrust::Unchecked);
        assert!(d.resume_by_ids().unwrap_err().contains("not known"));
        assert!(d.wants_engine_check());
        assert_eq!(d.engine_checked(true), IdsTrust::Unchecked);
        assert!(d.resume_by_ids().is_ok());
        assert!(d.wants_engine_check(), "every entering worker is checked");
        // One engine that disagrees ends it, whatever agrees later.
        assert_eq!(d.engine_checked(false), IdsTrust::Agrees);
        assert_eq!(d.engine_checked(true), IdsTrust::Disagrees);
        assert!(d.resume_by_ids().unwrap_err().contains("differently"));
        assert!(!d.wants_engine_check());
        // A table without a source shares the default's tokenizer, and its
        // trust starts as the default's did.
        assert_eq!(models.get(Some("same")).ids_trust(), IdsTrust::Unchecked);
        // Without a tokenizer there are no ids to resume by.
        let m = models.get(Some("missing"));
        assert!(m.resume_by_ids().unwrap_err().contains("no tokenizer"));
        assert!(!m.wants_engine_check());
        // With the router's tokenizer configured, every entry starts trusted.
        let configured = Models::new(Arc::new(Fixed(0)), true, 16, &[spec("same")], |_| {
            Err("unused".into())
        });
        assert_eq!(configured.get(None).ids_trust(), IdsTrust::Configured);
        assert_eq!(
            configured.get(Some("same")).ids_trust(),
            IdsTrust::Configured
        );
    }

    #[test]
    fn specs_are_validated() {
        assert!(spec("m").validate().is_ok());
        assert!(spec("").validate().is_err());
        assert!(spec(DEFAULT_LABEL).validate().is_err());
        let zero = ModelSpec {
            block_size: Some(0),
            ..spec("m")
        };
        assert!(zero.validate().unwrap_err().contains("block_size"));
        let both = ModelSpec {
            tokenizer_dir: Some("/t".into()),
            hub_id: Some("o/m".into()),
            ..spec("m")
        };
        assert!(both.validate().unwrap_err().contains("not both"));
    }

    #[test]
    fn each_models_hit_rate_is_its_own_in_metrics() {
        let models = Arc::new(models());
        models.get(Some("a")).record_placement(10, 4);
        models.get(None).record_placement(5, 9);
        let mut registry = prometheus_client::registry::Registry::default();
        registry.register_collector(Box::new(ModelsCollector(models)));
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
        for line in [
            r#"switchyard_model_prompt_blocks_total{model="a"} 10"#,
            r#"switchyard_model_expected_hit_blocks_total{model="a"} 4"#,
            r#"switchyard_model_prompt_blocks_total{model="default"} 5"#,
            // Clamped to the prompt.
            r#"switchyard_model_expected_hit_blocks_total{model="default"} 5"#,
            r#"switchyard_model_tokenizer_loaded{model="missing"} 0"#,
            r#"switchyard_model_block_size{model="a"} 32"#,
        ] {
            assert!(text.contains(line), "{line} in\n{text}");
        }
    }
}
