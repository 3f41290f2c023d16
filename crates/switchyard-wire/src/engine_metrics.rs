//! What an engine worker's `/metrics` page says about its KV cache, read
//! from each engine's own metric names: the prefix-cache counters (prompt
//! tokens queried, tokens found cached), the fraction of the KV cache in
//! use, and vLLM's KV capacity.
//!
//! Every name below was checked against the engine's source or a real
//! page of it:
//!
//! - the sim-worker (`crates/switchyard-sim-worker/src/metrics.rs`):
//!   `switchyard_engine_prompt_tokens_total`,
//!   `switchyard_engine_prefix_hit_tokens_total`,
//!   `switchyard_engine_kv_usage_ratio`.
//! - vLLM, a real 0.32.0 page (`tests/fixtures/vllm_0.32_cpu_metrics.txt`):
//!   `vllm:prefix_cache_queries_total` and `vllm:prefix_cache_hits_total`
//!   (tokens, one series per `engine` and `model_name`),
//!   `vllm:kv_cache_usage_perc`, and `vllm:cache_config_info`, whose
//!   labels carry `num_gpu_blocks` and `block_size` (vLLM serves no
//!   `/get_server_info`). The names before 0.9,
//!   `vllm:gpu_prefix_cache_queries` and `vllm:gpu_prefix_cache_hits`
//!   (counters, so `_total` on the page) and `vllm:gpu_cache_usage_perc`,
//!   are in `vllm/v1/metrics/loggers.py` ("Deprecated in 0.9 - Renamed as
//!   vllm:prefix_cache_queries"); they are read only when the current
//!   names are absent.
//! - SGLang, `python/sglang/srt/metrics/collector.py`
//!   (`TokenizerMetricsCollector`): `Counter(name="sglang:prompt_tokens_total",
//!   documentation="Number of prefill tokens processed.")` and
//!   `Counter(name="sglang:cached_tokens_total", documentation="Number of
//!   cached prompt tokens.")`, both labelled by the collector's labels
//!   (newer versions add a `cache_source` label to the cached tokens:
//!   device, host, storage — all are summed); `sglang:token_usage`
//!   (`SchedulerMetricsCollector`) for the KV usage. SGLang increments its
//!   cached-tokens counter only `if cached_tokens > 0`, so its series
//!   appears at the first hit: a hit counter without a series reads 0.
//!
//! Each reader takes a [`Scrape`] (one page, read once) and trusts
//! nothing in it: a counter that is negative or not finite, a usage out of
//! `0..=1`, a capacity of zero are not read.

use crate::prometheus::{Sample, Scrape};
use std::fmt;

/// The engine family whose metric names a page carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum EngineFamily {
    /// Switchyard's simulated engine (`switchyard sim-worker`).
    SimWorker,
    /// vLLM.
    Vllm,
    /// SGLang.
    Sglang,
}

impl EngineFamily {
    /// The family's name as people write it.
    pub fn name(self) -> &'static str {
        match self {
            Self::SimWorker => "sim-worker",
            Self::Vllm => "vLLM",
            Self::Sglang => "SGLang",
        }
    }
}

impl fmt::Display for EngineFamily {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// One family's prefix-cache counters: (family, tokens queried, tokens hit).
struct CounterNames {
    family: EngineFamily,
    queried: &'static str,
    hit: &'static str,
}

/// The prefix-cache counters, in the order they are looked for.
const PREFIX_CACHE_COUNTERS: [CounterNames; 4] = [
    CounterNames {
        family: EngineFamily::SimWorker,
        queried: "switchyard_engine_prompt_tokens_total",
        hit: "switchyard_engine_prefix_hit_tokens_total",
    },
    CounterNames {
        family: EngineFamily::Vllm,
        queried: "vllm:prefix_cache_queries_total",
        hit: "vllm:prefix_cache_hits_total",
    },
    CounterNames {
        family: EngineFamily::Vllm,
        queried: "vllm:gpu_prefix_cache_queries_total",
        hit: "vllm:gpu_prefix_cache_hits_total",
    },
    CounterNames {
        family: EngineFamily::Sglang,
        queried: "sglang:prompt_tokens_total",
        hit: "sglang:cached_tokens_total",
    },
];

/// An engine's prefix-cache counters at one moment: prompt tokens it
/// looked up in its prefix cache, and those it found there. Counters only
/// grow while the engine runs: the hit rate over a time is the ratio of
/// their growth.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PrefixCacheCounters {
    /// Whose names they were read under.
    pub family: EngineFamily,
    /// Prompt tokens queried (summed over the page's label sets: engines,
    /// models).
    pub queried_tokens: f64,
    /// Of which found in the prefix cache.
    pub hit_tokens: f64,
}

impl PrefixCacheCounters {
    /// The first family's counters the page has (its queried-tokens
    /// counter present; a hit counter without a series counts 0), or
    /// `None` when it has none or they are not counts.
    pub fn read(scrape: &Scrape<'_>) -> Option<Self> {
        let count = |v: f64| v.is_finite() && v >= 0.0;
        PREFIX_CACHE_COUNTERS.iter().find_map(|names| {
            let queried_tokens = scrape.sum(names.queried)?;
            let hit_tokens = scrape.sum(names.hit).unwrap_or(0.0);
            (count(queried_tokens) && count(hit_tokens)).then_some(Self {
                family: names.family,
                queried_tokens,
                hit_tokens,
            })
        })
    }
}

/// Prometheus series giving the fraction of an engine's KV cache in use, in
/// the order they are looked for: ours (the sim-worker), vLLM's current and
/// older names, SGLang's.
pub const KV_USAGE_SERIES: [&str; 4] = [
    "switchyard_engine_kv_usage_ratio",
    "vllm:kv_cache_usage_perc",
    "vllm:gpu_cache_usage_perc",
    "sglang:token_usage",
];

/// The fraction of the KV cache in use: the first of [`KV_USAGE_SERIES`]
/// present (any labels; with several series of one name, e.g. per engine,
/// the largest). `None` when none is there or no value is a number in
/// `0..=1`.
pub fn kv_usage_fraction(scrape: &Scrape<'_>) -> Option<f64> {
    KV_USAGE_SERIES.iter().find_map(|name| {
        scrape
            .series(name)
            .map(Sample::value)
            .filter(|v| (0.0..=1.0).contains(v))
            .reduce(f64::max)
    })
}

/// The KV cache an engine's server information names (`/server_info`,
/// `/get_server_info`: SGLang's and the sim-worker's field names).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ServerInfoCache {
    /// `num_gpu_blocks`.
    pub blocks: Option<u64>,
    /// `page_size`, else `block_size`: tokens per block.
    pub page_size: Option<u64>,
    /// `max_total_num_tokens` (SGLang's capacity in tokens).
    pub max_tokens: Option<u64>,
}

impl ServerInfoCache {
    /// Reads the fields from a server-information body (absent or not a
    /// number: `None`).
    pub fn read(info: &serde_json::Value) -> Self {
        Self {
            blocks: info["num_gpu_blocks"].as_u64(),
            page_size: info["page_size"].as_u64().or(info["block_size"].as_u64()),
            max_tokens: info["max_total_num_tokens"].as_u64(),
        }
    }

    /// Capacity in tokens: SGLang's own count, else blocks times the page.
    pub fn tokens(&self) -> Option<u64> {
        self.max_tokens
            .or_else(|| self.blocks?.checked_mul(self.page_size?))
    }
}

/// An engine's KV cache size.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvCapacity {
    /// KV blocks on the device (all engines of the worker together).
    pub blocks: u64,
    /// Tokens per block (the engine's, which need not be the router's).
    pub block_size: u32,
    /// The engines the blocks were summed over: a data-parallel worker's
    /// ranks, each with a cache of its own.
    pub engines: u32,
}

impl KvCapacity {
    /// Capacity in tokens (`None` on overflow).
    pub fn tokens(&self) -> Option<u64> {
        self.blocks.checked_mul(u64::from(self.block_size))
    }

    /// One engine's share: the capacity of one data-parallel rank.
    pub fn per_engine(&self) -> Self {
        Self {
            blocks: self.blocks / u64::from(self.engines.max(1)),
            engines: 1,
            ..*self
        }
    }

    /// vLLM's, from the labels of `vllm:cache_config_info`
    /// (`num_gpu_blocks`, `block_size`): the blocks of all its series
    /// summed (a data-parallel worker has one engine, and one series, per
    /// rank). `None` when the page has no such series, one lacks a number
    /// in either label (`num_gpu_blocks="None"` before the cache is
    /// sized), a number is zero, or the series disagree on the block size.
    pub fn from_vllm(scrape: &Scrape<'_>) -> Option<Self> {
        let mut capacity: Option<Self> = None;
        for info in scrape.series("vllm:cache_config_info") {
            let blocks: u64 = info.label("num_gpu_blocks")?.parse().ok()?;
            let block_size: u32 = info.label("block_size")?.parse().ok()?;
            if blocks == 0 || block_size == 0 {
                return None;
            }
            capacity = Some(match capacity {
                None => Self {
                    blocks,
                    block_size,
                    engines: 1,
                },
                Some(sum) if sum.block_size == block_size => Self {
                    blocks: sum.blocks.checked_add(blocks)?,
                    block_size,
                    engines: sum.engines.saturating_add(1),
                },
                Some(_) => return None,
            });
        }
        capacity
    }
}

/// vLLM's LoRA slots: the `max_lora` label of `vllm:lora_requests_info`
/// (`--max-loras`, the adapters one batch can hold). vLLM sets that gauge
/// only with `--enable-lora`, and only once it has logged a step
/// (`vllm/v1/metrics/loggers.py`): a server that has served nothing yet
/// has no series. The largest over the series; `None` without a number.
pub fn vllm_lora_slots(scrape: &Scrape<'_>) -> Option<usize> {
    scrape
        .series("vllm:lora_requests_info")
        .filter_map(|s| s.label("max_lora")?.parse::<usize>().ok())
        .max()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn server_information_names_blocks_pages_and_sglangs_token_count() {
        let sim =
            ServerInfoCache::read(&serde_json::json!({"num_gpu_blocks": 1024, "block_size": 16}));
        assert_eq!(
            (sim.blocks, sim.page_size, sim.tokens()),
            (Some(1024), Some(16), Some(16_384))
        );
        let sglang = ServerInfoCache::read(
            &serde_json::json!({"page_size": 64, "block_size": 16, "max_total_num_tokens": 5000}),
        );
        assert_eq!((sglang.page_size, sglang.tokens()), (Some(64), Some(5000)));
        let none = ServerInfoCache::read(&serde_json::json!({"num_gpu_blocks": "many"}));
        assert_eq!(none, ServerInfoCache::default());
        assert_eq!(none.tokens(), None);
    }

    /// The excerpt of a real vLLM 0.32.0 (CPU build) `/metrics` page the
    /// issue quotes.
    const VLLM_EXCERPT: &str = r#"# HELP vllm:prefix_cache_queries_total Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{engine="0",model_name="tiny"} 75303.0
# HELP vllm:prefix_cache_queries_created Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries_created gauge
vllm:prefix_cache_queries_created{engine="0",model_name="tiny"} 1.7963139956946387e+09
vllm:prefix_cache_hits_total{engine="0",model_name="tiny"} 44416.0
vllm:prefix_cache_hits_created{engine="0",model_name="tiny"} 1.7963139956946661e+09
vllm:kv_cache_usage_perc{engine="0",model_name="tiny"} 0.0
vllm:num_requests_running{engine="0",model_name="tiny"} 0.0
vllm:num_requests_waiting{engine="0",model_name="tiny"} 0.0
vllm:cache_config_info{_block_size_resolved="True",block_size="32",cache_dtype="auto",cache_hit_alignment_tokens="None",effective_attention_block_size="32",enable_mamba_shared_prefix_checkpoint="False",enable_prefix_caching="True",engine="0",gpu_memory_utilization="0.92",hash_block_size="None",is_attention_free="False",kv_cache_dtype_skip_layers="[]",kv_cache_layout="None",kv_cache_max_concurrency="256.0",kv_cache_memory_bytes="1073741824",kv_cache_size_tokens="1048576",kv_offloading_backend="native",kv_offloading_size="None",kv_sharing_fast_prefill="False",mamba_block_size="None",mamba_cache_dtype="auto",mamba_cache_mode="none",mamba_page_size_padded="None",mamba_ssm_cache_dtype="float32",num_cpu_blocks="None",num_gpu_blocks="32768",num_gpu_blocks_override="None",prefix_cache_retention_interval="0",prefix_caching_hash_algo="sha256",prefix_match_unit="None",replayssm_buffer_len="16",skip_page_size_padded="None",sliding_window="None",swa_bounded_replay="True",use_kda_recoverssm="False",use_replayssm="False",user_specified_block_size="True"} 1.0
vllm:prompt_tokens_total{engine="0",model_name="tiny"} 75303.0
vllm:prompt_tokens_cached_total{engine="0",model_name="tiny"} 44416.0
"#;

    /// The whole page the excerpt comes from (a later scrape).
    const VLLM_PAGE: &str = include_str!("../tests/fixtures/vllm_0.32_cpu_metrics.txt");

    fn counters(text: &str) -> Option<PrefixCacheCounters> {
        PrefixCacheCounters::read(&Scrape::parse(text))
    }

    fn usage(text: &str) -> Option<f64> {
        kv_usage_fraction(&Scrape::parse(text))
    }

    fn vllm_capacity(text: &str) -> Option<KvCapacity> {
        KvCapacity::from_vllm(&Scrape::parse(text))
    }

    #[test]
    fn vllms_prefix_cache_counters_are_read_from_its_real_page() {
        assert_eq!(
            counters(VLLM_EXCERPT),
            Some(PrefixCacheCounters {
                family: EngineFamily::Vllm,
                queried_tokens: 75303.0,
                hit_tokens: 44416.0,
            })
        );
        let whole = counters(VLLM_PAGE).unwrap();
        assert_eq!(whole.family, EngineFamily::Vllm);
        assert_eq!((whole.queried_tokens, whole.hit_tokens), (75305.0, 44416.0));
    }

    #[test]
    fn vllms_counters_are_summed_over_engines_and_models() {
        let text = "vllm:prefix_cache_queries_total{engine=\"0\",model_name=\"m\"} 100.0\n\
                    vllm:prefix_cache_queries_total{engine=\"1\",model_name=\"m\"} 50.0\n\
                    vllm:prefix_cache_hits_total{engine=\"0\",model_name=\"m\"} 40.0\n\
                    vllm:prefix_cache_hits_total{engine=\"1\",model_name=\"m\"} 10.0\n";
        let read = counters(text).unwrap();
        assert_eq!((read.queried_tokens, read.hit_tokens), (150.0, 50.0));
    }

    #[test]
    fn vllms_names_before_0_9_are_read_only_without_the_current_ones() {
        let old = "vllm:gpu_prefix_cache_queries_total{model_name=\"m\"} 20\n\
                   vllm:gpu_prefix_cache_hits_total{model_name=\"m\"} 5\n";
        let read = counters(old).unwrap();
        assert_eq!(
            (read.family, read.queried_tokens, read.hit_tokens),
            (EngineFamily::Vllm, 20.0, 5.0)
        );
        // 0.9 exported both names with the same counts: never added up.
        let both = format!("{old}{VLLM_EXCERPT}");
        assert_eq!(counters(&both).unwrap().queried_tokens, 75303.0);
    }

    #[test]
    fn the_sim_workers_counters_are_read() {
        let text = "# TYPE switchyard_engine_prompt_tokens_total counter\n\
                    switchyard_engine_prompt_tokens_total 1000\n\
                    switchyard_engine_prefix_hit_tokens_total 250\n";
        assert_eq!(
            counters(text),
            Some(PrefixCacheCounters {
                family: EngineFamily::SimWorker,
                queried_tokens: 1000.0,
                hit_tokens: 250.0,
            })
        );
    }

    #[test]
    fn sglangs_counters_are_read_and_summed_over_cache_sources() {
        let text = "sglang:prompt_tokens_total{model_name=\"qwen\",is_streaming=\"false\"} 3000.0\n\
                    sglang:prompt_tokens_total{model_name=\"qwen\",is_streaming=\"true\"} 1096.0\n\
                    sglang:cached_tokens_total{model_name=\"qwen\",cache_source=\"device\"} 3000.0\n\
                    sglang:cached_tokens_total{model_name=\"qwen\",cache_source=\"host\"} 168.0\n";
        assert_eq!(
            counters(text),
            Some(PrefixCacheCounters {
                family: EngineFamily::Sglang,
                queried_tokens: 4096.0,
                hit_tokens: 3168.0,
            })
        );
    }

    #[test]
    fn sglang_before_its_first_hit_has_no_cached_series_and_reads_zero_hits() {
        let text = "# TYPE sglang:cached_tokens_total counter\n\
                    sglang:prompt_tokens_total{model_name=\"qwen\"} 512.0\n";
        let read = counters(text).unwrap();
        assert_eq!((read.family, read.hit_tokens), (EngineFamily::Sglang, 0.0));
    }

    #[test]
    fn a_page_without_prefix_cache_counters_reads_none() {
        assert_eq!(counters(""), None);
        assert_eq!(counters("vllm:num_requests_running 1\n"), None);
        // Only a hit counter, or the names as comments: nothing to divide by.
        assert_eq!(counters("vllm:prefix_cache_hits_total 5\n"), None);
        assert_eq!(
            counters("# TYPE vllm:prefix_cache_queries_total counter\n"),
            None
        );
        // A prefix is not the name.
        assert_eq!(
            counters("vllm:prefix_cache_queries_total_x 5\nvllm:prefix_cache_hits_total 1\n"),
            None
        );
    }

    #[test]
    fn counters_that_are_not_counts_are_not_read() {
        assert_eq!(
            counters("vllm:prefix_cache_queries_total NaN\nvllm:prefix_cache_hits_total 1\n"),
            None
        );
        assert_eq!(
            counters("vllm:prefix_cache_queries_total 10\nvllm:prefix_cache_hits_total -1\n"),
            None
        );
        assert_eq!(
            counters("vllm:prefix_cache_queries_total +Inf\nvllm:prefix_cache_hits_total 1\n"),
            None
        );
    }

    #[test]
    fn kv_usage_is_read_from_the_sim_worker_vllm_and_sglang_series() {
        let ours = "# HELP switchyard_engine_kv_usage_ratio x\n# TYPE switchyard_engine_kv_usage_ratio gauge\nswitchyard_engine_kv_usage_ratio 0.25\n";
        assert_eq!(usage(ours), Some(0.25));
        let vllm = "vllm:num_requests_running{model_name=\"m\"} 3\nvllm:kv_cache_usage_perc{engine=\"0\",model_name=\"m\"} 0.5\nvllm:kv_cache_usage_perc{engine=\"1\",model_name=\"m\"} 0.75\n";
        assert_eq!(usage(vllm), Some(0.75), "the fullest engine");
        let old_vllm = "vllm:gpu_cache_usage_perc{model_name=\"m\"} 0.125\n";
        assert_eq!(usage(old_vllm), Some(0.125));
        let sglang = "sglang:token_usage{model_name=\"m\"} 0.0625\n";
        assert_eq!(usage(sglang), Some(0.0625));
        assert_eq!(usage(VLLM_EXCERPT), Some(0.0));
    }

    #[test]
    fn kv_usage_ignores_other_series_and_values_out_of_range() {
        assert_eq!(usage(""), None);
        assert_eq!(usage("vllm:kv_cache_usage_perc_total 0.5\n"), None);
        assert_eq!(usage("vllm:kv_cache_usage_perc 1.5\n"), None);
        assert_eq!(usage("vllm:kv_cache_usage_perc NaN\n"), None);
        assert_eq!(usage("vllm:kv_cache_usage_perc{a=\"}\"} x\n"), None);
        assert_eq!(usage("# vllm:kv_cache_usage_perc 0.5\n"), None);
    }

    #[test]
    fn vllms_kv_capacity_is_read_from_its_cache_config_info_labels() {
        let capacity = vllm_capacity(VLLM_EXCERPT).unwrap();
        assert_eq!(
            capacity,
            KvCapacity {
                blocks: 32768,
                block_size: 32,
                engines: 1,
            }
        );
        // The page's own `kv_cache_size_tokens` label agrees.
        assert_eq!(capacity.tokens(), Some(1_048_576));
        assert_eq!(vllm_capacity(VLLM_PAGE), Some(capacity));
    }

    #[test]
    fn a_data_parallel_vllms_engines_add_up_at_one_block_size() {
        let info = |engine: u32, blocks: &str, block_size: u32| {
            format!("vllm:cache_config_info{{block_size=\"{block_size}\",engine=\"{engine}\",num_gpu_blocks=\"{blocks}\"}} 1.0\n")
        };
        let two = info(0, "1000", 16) + &info(1, "1000", 16);
        let both = vllm_capacity(&two).unwrap();
        assert_eq!(
            both,
            KvCapacity {
                blocks: 2000,
                block_size: 16,
                engines: 2,
            }
        );
        // A rank routed as a target of its own has its own engine's cache.
        assert_eq!(
            both.per_engine(),
            KvCapacity {
                blocks: 1000,
                block_size: 16,
                engines: 1,
            }
        );
        let mixed = info(0, "1000", 16) + &info(1, "1000", 32);
        assert_eq!(vllm_capacity(&mixed), None);
    }

    #[test]
    fn a_capacity_that_is_not_known_yet_or_not_a_number_is_not_read() {
        let info = |blocks: &str, block_size: &str| {
            format!("vllm:cache_config_info{{block_size=\"{block_size}\",num_gpu_blocks=\"{blocks}\"}} 1.0\n")
        };
        assert_eq!(vllm_capacity(&info("None", "16")), None);
        assert_eq!(vllm_capacity(&info("0", "16")), None);
        assert_eq!(vllm_capacity(&info("100", "0")), None);
        assert_eq!(vllm_capacity(&info("-5", "16")), None);
        assert_eq!(vllm_capacity(&info("100", "99999999999")), None);
        assert_eq!(vllm_capacity("vllm:cache_config_info 1.0\n"), None);
        assert_eq!(vllm_capacity("vllm:num_requests_running 1\n"), None);
        let huge = KvCapacity {
            blocks: u64::MAX,
            block_size: 2,
            engines: 1,
        };
        assert_eq!(huge.tokens(), None);
    }

    #[test]
    fn vllms_lora_slots_are_the_max_lora_label_once_it_has_served() {
        // Captured from vLLM 0.32.0 (CPU) with `--enable-lora --max-loras 1`
        // after an adapter's request.
        let page = "# HELP vllm:lora_requests_info Running stats on lora requests.\n\
# TYPE vllm:lora_requests_info gauge\n\
vllm:lora_requests_info{max_lora=\"1\",running_lora_adapters=\"lora-a\",waiting_lora_adapters=\"lora-a\"} 1.796314671937986e+09\n\
vllm:lora_requests_info{max_lora=\"1\",running_lora_adapters=\"\",waiting_lora_adapters=\"\"} 1.7963146719675994e+09\n";
        assert_eq!(vllm_lora_slots(&Scrape::parse(page)), Some(1));
        assert_eq!(vllm_lora_slots(&Scrape::parse(VLLM_PAGE)), None, "no LoRA");
        let odd = "vllm:lora_requests_info{max_lora=\"many\"} 1\n";
        assert_eq!(vllm_lora_slots(&Scrape::parse(odd)), None);
    }
}
