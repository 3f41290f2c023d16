//! [`EngineFlags`]: the simulated engine's command-line flags and the one
//! mapping from them to an [`EngineConfig`], flattened into both
//! `switchyard sim-worker` (one engine in real time) and `switchyard replay`
//! (a fleet of them in virtual time).
//!
//! Why here: the flags are the command line's face of the engine, so they
//! sit in the lowest crate that already has a command line and the engine
//! below it. `switchyard-engine` stays a pure core with no `clap` (not even
//! behind a feature, which Cargo would switch on for the whole workspace),
//! and `switchyard` (home of `replay`) already depends on this crate for
//! `sim-worker`, so sharing the flags adds no dependency anywhere.
//!
//! A few defaults differ by command on purpose: a sim-worker is one engine
//! with vLLM's defaults, a replay fleet is sized by its `--profile` and takes
//! trace prompts of any length. Those flags are `Option`s here, and each
//! command passes its own [`EngineDefaults`] to
//! [`EngineFlags::engine_config`]; every other default is
//! [`EngineConfig::default`]'s, read from it rather than written again.

use clap::{Args, ValueEnum};
use serde::Serialize;
use switchyard_core::engine_profile::EngineProfile;
use switchyard_engine::{
    CheckpointPolicy, EngineConfig, Hybrid, Preemption, SpecDecode, TimingConfig,
};

/// The simulated engine's flags. Flattened last into a command's flags
/// (its help heading holds for every flag declared after it).
#[derive(Clone, Debug, PartialEq, Args, Serialize)]
#[command(next_help_heading = "Engine")]
pub struct EngineFlags {
    /// Tokens per KV block (the router's too) [default: sim-worker 16;
    /// replay: its --profile's, 64].
    #[arg(long)]
    pub block_size: Option<usize>,
    /// Device KV blocks per engine [default: sim-worker 16384; replay: its
    /// --profile's, 16384].
    #[arg(long)]
    pub num_blocks: Option<usize>,
    /// Host-tier (CPU) KV blocks per engine that evicted device blocks
    /// spill into and requests restore from (0: no host tier). A router
    /// indexes them from the engines' host-tier events (and replay's `ttft`
    /// policy credits a host hit by its restore time).
    #[arg(long, default_value_t = EngineConfig::default().host_blocks)]
    pub host_blocks: usize,
    /// Speed-up over the timing model: wall time = model time / F
    /// [default: sim-worker 1 (0 makes every step instant); replay: its
    /// --profile's, 4 (must be positive)].
    #[arg(long)]
    pub speedup: Option<f64>,
    /// What preempting a sequence does when the KV pool stays dry:
    /// `recompute` frees its blocks and computes its tokens again on resume;
    /// `spill` saves its KV to the host (needs --spill-blocks) and loads it
    /// back, recomputing when the spill area is full.
    #[arg(long, value_enum, default_value_t = PreemptionChoice::Recompute)]
    pub preemption: PreemptionChoice,
    /// Host blocks set aside for spilled sequences' KV (--preemption spill).
    #[arg(long, default_value_t = EngineConfig::default().spill_blocks)]
    pub spill_blocks: usize,
    /// The architecture simulated: `attention`, or `hybrid` (SSM +
    /// attention layers: a cached prefix resumes only from a kept SSM state,
    /// see --checkpoints; a sim-worker publishes the states kept as vLLM's
    /// "mamba" cache group).
    #[arg(long, value_enum, default_value_t = ArchitectureChoice::Attention)]
    pub architecture: ArchitectureChoice,
    /// With --architecture hybrid: which SSM states are kept (`marconi`:
    /// ends of prompts and branch points; `every-block`).
    #[arg(long, value_enum, default_value_t = CheckpointChoice::Marconi)]
    pub checkpoints: CheckpointChoice,
    /// With --architecture hybrid: most SSM checkpoints kept per engine.
    #[arg(long, default_value_t = Hybrid::default().max_checkpoints)]
    pub max_checkpoints: usize,
    /// Speculative decoding (multi-token prediction): each decode step
    /// verifies --spec-draft-tokens drafts, each accepted with this
    /// probability (0..=1) until the first rejection. Off unless given.
    #[arg(long, value_name = "RATE")]
    pub spec_decode: Option<f64>,
    /// With --spec-decode: drafted positions per decode step (1..=16).
    #[arg(long, default_value_t = SpecDecode::default().draft_tokens)]
    pub spec_draft_tokens: u32,
    /// Most sequences running in one step.
    #[arg(long, default_value_t = EngineConfig::default().max_num_seqs)]
    pub max_num_seqs: usize,
    /// Most tokens computed in one step (longer prompts are chunked).
    #[arg(long, default_value_t = EngineConfig::default().max_num_batched_tokens)]
    pub max_num_batched_tokens: usize,
    /// Most requests waiting before new ones are refused (a sim-worker
    /// answers 503).
    #[arg(long, default_value_t = EngineConfig::default().max_waiting)]
    pub max_waiting: usize,
    /// Longest prompt plus output a request may have [default: sim-worker
    /// 32768; replay: 1048576, as trace prompts reach 126k tokens and the
    /// KV pool is the real limit].
    #[arg(long)]
    pub max_model_len: Option<usize>,
    /// Host-tier restores shorter than this many tokens are skipped.
    #[arg(long, default_value_t = EngineConfig::default().min_restore_tokens)]
    pub min_restore_tokens: usize,
    /// Times a host-tier restore may wait for device capacity before the
    /// prefix is recomputed instead.
    #[arg(long, default_value_t = EngineConfig::default().max_restore_deferrals)]
    pub max_restore_deferrals: u32,
    /// KV events buffered while their reader lags; beyond it the newest are
    /// dropped and counted.
    #[arg(long, default_value_t = EngineConfig::default().max_buffered_events)]
    pub max_buffered_events: usize,
    /// KV bytes per token, for host-tier restore time.
    #[arg(long, default_value_t = TimingConfig::default().bytes_per_token)]
    pub bytes_per_token: u64,
    /// Host-to-device bandwidth in bytes per second, for restore time.
    #[arg(long, default_value_t = TimingConfig::default().restore_bandwidth_bytes_per_s)]
    pub restore_bandwidth: f64,
    /// An engine profile (TOML, as `switchyard calibrate` writes it): its
    /// prefill and decode curves replace the default timing model, the KV
    /// capacity it reports is the default of --num-blocks and
    /// --block-size, and the default speed-up is 1 (the profile is the
    /// engine's own time).
    #[arg(long, value_name = "FILE", value_parser = ProfileArg::read)]
    pub engine_profile: Option<ProfileArg>,
}

/// `--engine-profile`: the file named and the profile read from it.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ProfileArg {
    /// The file.
    pub path: std::path::PathBuf,
    /// Its profile.
    pub profile: EngineProfile,
}

impl ProfileArg {
    /// Reads and checks the profile at `path`.
    pub fn read(path: &str) -> Result<Self, String> {
        let text = std::fs::read_to_string(path).map_err(|e| format!("reading {path}: {e}"))?;
        let profile = EngineProfile::from_toml(&text).map_err(|e| format!("{path}: {e}"))?;
        Ok(Self {
            path: path.into(),
            profile,
        })
    }
}

/// The defaults of the flags that differ by command (the `Option` fields
/// of [`EngineFlags`]); a flag given on the command line wins.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct EngineDefaults {
    /// `--block-size`.
    pub block_size: usize,
    /// `--num-blocks`.
    pub num_blocks: usize,
    /// `--speedup`.
    pub speedup: f64,
    /// `--max-model-len`.
    pub max_model_len: usize,
}

impl EngineDefaults {
    /// `sim-worker`'s: one engine of [`EngineConfig::default`] (vLLM's
    /// figures), in real time.
    pub fn sim_worker() -> Self {
        let engine = EngineConfig::default();
        Self {
            block_size: engine.block_size,
            num_blocks: engine.num_blocks,
            speedup: engine.timing.speedup,
            max_model_len: engine.max_model_len,
        }
    }
}

/// `--architecture`: the model architecture the engine simulates.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, ValueEnum, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum ArchitectureChoice {
    /// Attention layers only: every cached block is reusable.
    #[default]
    Attention,
    /// SSM (Mamba) and attention layers: a cached prefix is reusable only
    /// up to a kept SSM state (`--checkpoints`).
    Hybrid,
}

/// `--checkpoints`: a hybrid engine's [`CheckpointPolicy`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, ValueEnum, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum CheckpointChoice {
    /// Ends of prompts and branch points, evicted by recency plus the
    /// recompute time saved (Marconi).
    #[default]
    Marconi,
    /// Every block boundary, least recently used evicted first.
    EveryBlock,
}

/// `--preemption`: the engine's [`Preemption`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, ValueEnum, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum PreemptionChoice {
    /// Free the sequence's blocks; it recomputes them on resume (vLLM's
    /// default).
    #[default]
    Recompute,
    /// Save its KV to the host and load it back on resume.
    Spill,
}

impl From<CheckpointChoice> for CheckpointPolicy {
    fn from(choice: CheckpointChoice) -> Self {
        match choice {
            CheckpointChoice::Marconi => CheckpointPolicy::Marconi,
            CheckpointChoice::EveryBlock => CheckpointPolicy::EveryBlock,
        }
    }
}

impl From<PreemptionChoice> for Preemption {
    fn from(choice: PreemptionChoice) -> Self {
        match choice {
            PreemptionChoice::Recompute => Preemption::Recompute,
            PreemptionChoice::Spill => Preemption::Spill,
        }
    }
}

impl EngineFlags {
    /// The engine these flags describe, with `defaults` for the flags not
    /// given that have no default of their own; everything without a flag
    /// is [`EngineConfig::default`]'s. Not validated: the caller adds what
    /// its command sets (KV events, an output vocabulary) and calls
    /// [`EngineConfig::validate`].
    pub fn engine_config(&self, defaults: EngineDefaults) -> EngineConfig {
        let profile = self.engine_profile.as_ref().map(|p| &p.profile);
        let timing = TimingConfig {
            // A profile is the engine's own wall-clock time: speed-up 1
            // unless the flag says otherwise.
            speedup: self
                .speedup
                .or(profile.map(|_| 1.0))
                .unwrap_or(defaults.speedup),
            bytes_per_token: self.bytes_per_token,
            restore_bandwidth_bytes_per_s: self.restore_bandwidth,
            ..TimingConfig::default()
        };
        let config = EngineConfig {
            block_size: self
                .block_size
                .or(profile.and_then(|p| p.block_size))
                .unwrap_or(defaults.block_size),
            num_blocks: self
                .num_blocks
                .or(profile.and_then(|p| p.num_blocks))
                .unwrap_or(defaults.num_blocks),
            host_blocks: self.host_blocks,
            preemption: self.preemption.into(),
            spill_blocks: self.spill_blocks,
            max_num_seqs: self.max_num_seqs,
            max_num_batched_tokens: self.max_num_batched_tokens,
            max_waiting: self.max_waiting,
            max_model_len: self.max_model_len.unwrap_or(defaults.max_model_len),
            min_restore_tokens: self.min_restore_tokens,
            max_restore_deferrals: self.max_restore_deferrals,
            max_buffered_events: self.max_buffered_events,
            timing: match profile {
                Some(p) => timing.with_profile(p),
                None => timing,
            },
            spec_decode: self.spec_decode.map(|acceptance_rate| SpecDecode {
                draft_tokens: self.spec_draft_tokens,
                acceptance_rate,
            }),
            ..EngineConfig::default()
        };
        match self.architecture {
            ArchitectureChoice::Attention => config,
            ArchitectureChoice::Hybrid => {
                let mut config = config.hybrid(self.checkpoints.into());
                if let Some(hybrid) = config.hybrid.as_mut() {
                    hybrid.max_checkpoints = self.max_checkpoints;
                }
                config
            }
        }
    }
}

impl EngineFlags {
    /// The flags that describe `engine`, every flag given (so no command's
    /// defaults apply): the inverse of [`Self::engine_config`], for a
    /// driver that starts sim-workers from an engine configuration (`bench
    /// twin`). `Err` names the settings no flag carries (other timing
    /// polynomials, a lease cap, logits reading, ...), found by mapping the
    /// flags back and comparing — nothing is dropped silently. What a
    /// command sets beside its flags (KV events, an output vocabulary) is
    /// the command's and is not compared.
    pub fn describing(engine: &EngineConfig) -> Result<Self, String> {
        Self::describing_profiled(engine, None)
    }

    /// [`Self::describing`] for an engine stepping on `profile`'s timing
    /// (`--engine-profile`, whose curves no other flag carries).
    pub fn describing_profiled(
        engine: &EngineConfig,
        profile: Option<ProfileArg>,
    ) -> Result<Self, String> {
        let default = Self::defaults();
        let (architecture, checkpoints, max_checkpoints) = match &engine.hybrid {
            None => (
                ArchitectureChoice::Attention,
                default.checkpoints,
                default.max_checkpoints,
            ),
            Some(hybrid) => (
                ArchitectureChoice::Hybrid,
                match hybrid.checkpoints {
                    CheckpointPolicy::Marconi => CheckpointChoice::Marconi,
                    CheckpointPolicy::EveryBlock => CheckpointChoice::EveryBlock,
                },
                hybrid.max_checkpoints,
            ),
        };
        let flags = Self {
            block_size: Some(engine.block_size),
            num_blocks: Some(engine.num_blocks),
            host_blocks: engine.host_blocks,
            speedup: Some(engine.timing.speedup),
            preemption: match engine.preemption {
                Preemption::Recompute => PreemptionChoice::Recompute,
                Preemption::Spill => PreemptionChoice::Spill,
            },
            spill_blocks: engine.spill_blocks,
            architecture,
            checkpoints,
            max_checkpoints,
            spec_decode: engine.spec_decode.map(|s| s.acceptance_rate),
            spec_draft_tokens: engine
                .spec_decode
                .map_or(default.spec_draft_tokens, |s| s.draft_tokens),
            max_num_seqs: engine.max_num_seqs,
            max_num_batched_tokens: engine.max_num_batched_tokens,
            max_waiting: engine.max_waiting,
            max_model_len: Some(engine.max_model_len),
            min_restore_tokens: engine.min_restore_tokens,
            max_restore_deferrals: engine.max_restore_deferrals,
            max_buffered_events: engine.max_buffered_events,
            bytes_per_token: engine.timing.bytes_per_token,
            restore_bandwidth: engine.timing.restore_bandwidth_bytes_per_s,
            engine_profile: profile,
        };
        let mut back = flags.engine_config(EngineDefaults::sim_worker());
        back.emit_kv_events = engine.emit_kv_events;
        back.output_vocabulary = engine.output_vocabulary.clone();
        if back != *engine {
            return Err(format!(
                "the engine configuration has settings no engine flag carries: it is {engine:?}, \
                 its flags give {back:?}"
            ));
        }
        Ok(flags)
    }

    /// The command line of these flags (each given explicitly), which
    /// parses back into them.
    pub fn to_args(&self) -> Vec<String> {
        fn name(choice: impl ValueEnum) -> String {
            choice
                .to_possible_value()
                .expect("every choice has a name")
                .get_name()
                .to_owned()
        }
        let mut args: Vec<(&str, String)> = Vec::new();
        let mut opt = |flag, value: Option<String>| {
            if let Some(value) = value {
                args.push((flag, value));
            }
        };
        opt("--block-size", self.block_size.map(|v| v.to_string()));
        opt("--num-blocks", self.num_blocks.map(|v| v.to_string()));
        opt("--speedup", self.speedup.map(|v| v.to_string()));
        opt("--max-model-len", self.max_model_len.map(|v| v.to_string()));
        opt("--spec-decode", self.spec_decode.map(|v| v.to_string()));
        opt(
            "--engine-profile",
            self.engine_profile
                .as_ref()
                .map(|p| p.path.display().to_string()),
        );
        args.extend([
            ("--host-blocks", self.host_blocks.to_string()),
            ("--preemption", name(self.preemption)),
            ("--spill-blocks", self.spill_blocks.to_string()),
            ("--architecture", name(self.architecture)),
            ("--checkpoints", name(self.checkpoints)),
            ("--max-checkpoints", self.max_checkpoints.to_string()),
            ("--spec-draft-tokens", self.spec_draft_tokens.to_string()),
            ("--max-num-seqs", self.max_num_seqs.to_string()),
            (
                "--max-num-batched-tokens",
                self.max_num_batched_tokens.to_string(),
            ),
            ("--max-waiting", self.max_waiting.to_string()),
            ("--min-restore-tokens", self.min_restore_tokens.to_string()),
            (
                "--max-restore-deferrals",
                self.max_restore_deferrals.to_string(),
            ),
            (
                "--max-buffered-events",
                self.max_buffered_events.to_string(),
            ),
            ("--bytes-per-token", self.bytes_per_token.to_string()),
            ("--restore-bandwidth", self.restore_bandwidth.to_string()),
        ]);
        args.into_iter()
            .flat_map(|(flag, value)| [flag.to_owned(), value])
            .collect()
    }

    /// The flags as parsed from an empty command line.
    fn defaults() -> Self {
        #[derive(clap::Parser)]
        struct Cli {
            #[command(flatten)]
            engine: EngineFlags,
        }
        <Cli as clap::Parser>::try_parse_from(["engine"])
            .expect("every engine flag has a default or is optional")
            .engine
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;
    use switchyard_engine::config::ConfigError;

    fn parse(flags: &[&str]) -> Result<EngineFlags, clap::Error> {
        #[derive(Parser)]
        struct Cli {
            #[command(flatten)]
            engine: EngineFlags,
        }
        Cli::try_parse_from(std::iter::once("engine").chain(flags.iter().copied()))
            .map(|cli| cli.engine)
    }

    fn config(flags: &[&str]) -> EngineConfig {
        parse(flags)
            .unwrap()
            .engine_config(EngineDefaults::sim_worker())
    }

    #[test]
    fn an_engine_profile_sets_the_curves_and_the_default_capacity() {
        let dir =
            std::env::temp_dir().join(format!("switchyard-profile-flag-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("engine.toml");
        std::fs::write(
            &path,
            "prefill = [2e-6, 0.03, 40.0]\ndecode = [-5.0, 20.0, 9.0]\ndecode_floor_ms = 2.0\nblock_size = 32\nnum_blocks = 777\n",
        )
        .unwrap();
        let file = path.display().to_string();
        let engine = config(&["--engine-profile", &file, "--speedup", "3"]);
        assert_eq!(engine.timing.prefill, [2e-6, 0.03, 40.0]);
        assert_eq!(engine.timing.decode, [-5.0, 20.0, 9.0]);
        assert_eq!(engine.timing.decode_floor_ms, 2.0);
        assert_eq!(engine.timing.speedup, 3.0, "the speed-up stays the flag's");
        assert_eq!((engine.block_size, engine.num_blocks), (32, 777));
        let replay_like = EngineDefaults {
            speedup: 4.0,
            ..EngineDefaults::sim_worker()
        };
        let engine = parse(&["--engine-profile", &file])
            .unwrap()
            .engine_config(replay_like);
        assert_eq!(
            engine.timing.speedup, 1.0,
            "a profile runs in the engine's own time"
        );
        let flagged = config(&["--engine-profile", &file, "--num-blocks", "100"]);
        assert_eq!(flagged.num_blocks, 100, "a flag wins over the profile");
        let back = parse(&["--engine-profile", &file]).unwrap().to_args();
        assert!(back
            .windows(2)
            .any(|w| w[0] == "--engine-profile" && w[1] == file));

        std::fs::write(&path, "prefill = [1.0]\n").unwrap();
        let err = parse(&["--engine-profile", &file]).unwrap_err().to_string();
        assert!(
            err.contains(&file) && err.contains("not an engine profile"),
            "{err}"
        );
        let missing = dir.join("none.toml").display().to_string();
        let err = parse(&["--engine-profile", &missing])
            .unwrap_err()
            .to_string();
        assert!(err.contains("reading"), "{err}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// `describing` and `to_args` are the inverse of the parse and
    /// `engine_config`: every configuration the flags can make comes back
    /// whole through a command line, whatever the command's defaults.
    #[test]
    fn an_engine_configuration_round_trips_through_its_command_line() {
        let other = EngineDefaults {
            block_size: 64,
            num_blocks: 1,
            speedup: 9.0,
            max_model_len: 7,
        };
        for flags in [
            &[][..],
            &[
                "--block-size",
                "64",
                "--num-blocks",
                "1000",
                "--speedup",
                "0.25",
            ][..],
            &[
                "--architecture",
                "hybrid",
                "--checkpoints",
                "every-block",
                "--max-checkpoints",
                "32",
            ][..],
            &[
                "--preemption",
                "spill",
                "--spill-blocks",
                "512",
                "--host-blocks",
                "1024",
            ][..],
            &[
                "--spec-decode",
                "0.7",
                "--spec-draft-tokens",
                "3",
                "--restore-bandwidth",
                "1.5e10",
            ][..],
        ] {
            let engine = config(flags);
            let described = EngineFlags::describing(&engine).unwrap();
            let args = described.to_args();
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            let parsed = parse(&args).unwrap();
            assert_eq!(parsed, described, "{flags:?}");
            assert_eq!(parsed.engine_config(other), engine, "{flags:?}");
        }
    }

    #[test]
    fn a_setting_no_flag_carries_is_refused_rather_than_dropped() {
        let mut engine = EngineConfig::default();
        engine.timing.decode = [0.0, 0.0, 2.0];
        let why = EngineFlags::describing(&engine).unwrap_err();
        assert!(why.contains("no engine flag carries"), "{why}");
        let mut engine = EngineConfig::default();
        engine.max_leases += 1;
        assert!(EngineFlags::describing(&engine).is_err());
        // What a command sets itself is not the flags' to carry.
        let mut engine = EngineConfig::default();
        engine.emit_kv_events = !engine.emit_kv_events;
        assert!(EngineFlags::describing(&engine).is_ok());
    }

    #[test]
    fn no_flags_with_the_sim_workers_defaults_is_the_engines_default() {
        assert_eq!(config(&[]), EngineConfig::default());
    }

    #[test]
    fn a_commands_defaults_fill_only_the_flags_not_given() {
        let defaults = EngineDefaults {
            block_size: 64,
            num_blocks: 1000,
            speedup: 4.0,
            max_model_len: 1 << 20,
        };
        let config = parse(&[]).unwrap().engine_config(defaults);
        assert_eq!(
            (
                config.block_size,
                config.num_blocks,
                config.timing.speedup,
                config.max_model_len
            ),
            (64, 1000, 4.0, 1 << 20)
        );
        let flags = parse(&[
            "--block-size",
            "32",
            "--num-blocks",
            "77",
            "--speedup",
            "2",
            "--max-model-len",
            "4096",
        ])
        .unwrap();
        let config = flags.engine_config(defaults);
        assert_eq!(
            (
                config.block_size,
                config.num_blocks,
                config.timing.speedup,
                config.max_model_len
            ),
            (32, 77, 2.0, 4096)
        );
    }

    #[test]
    fn every_other_flag_reaches_its_field() {
        let config = config(&[
            "--host-blocks",
            "8",
            "--max-num-seqs",
            "9",
            "--max-num-batched-tokens",
            "10",
            "--max-waiting",
            "11",
            "--min-restore-tokens",
            "12",
            "--max-restore-deferrals",
            "13",
            "--max-buffered-events",
            "14",
            "--bytes-per-token",
            "15",
            "--restore-bandwidth",
            "16e9",
        ]);
        assert_eq!(
            (
                config.host_blocks,
                config.max_num_seqs,
                config.max_num_batched_tokens,
                config.max_waiting,
                config.min_restore_tokens,
                config.max_restore_deferrals,
                config.max_buffered_events,
                config.timing.bytes_per_token,
                config.timing.restore_bandwidth_bytes_per_s,
            ),
            (8, 9, 10, 11, 12, 13, 14, 15, 16e9)
        );
    }

    #[test]
    fn a_hybrid_model_takes_its_checkpoint_policy_and_state_slots() {
        assert_eq!(config(&[]).hybrid, None);
        let config = config(&[
            "--architecture",
            "hybrid",
            "--checkpoints",
            "every-block",
            "--max-checkpoints",
            "32",
        ]);
        let hybrid = config.hybrid.expect("hybrid");
        assert_eq!(
            (hybrid.checkpoints, hybrid.max_checkpoints),
            (CheckpointPolicy::EveryBlock, 32)
        );
        assert!(config.timing.ssm.is_some());
        assert!(config.state_slots as usize >= config.max_num_seqs);
        assert_eq!(config.validate(), Ok(()));
    }

    #[test]
    fn a_hybrid_model_with_a_host_tier_is_refused() {
        let refused = self::config(&["--architecture", "hybrid", "--host-blocks", "8"]).validate();
        assert_eq!(refused, Err(ConfigError::HybridHostTier));
    }

    #[test]
    fn spill_preemption_takes_its_spill_blocks_and_is_validated() {
        let config = self::config(&["--preemption", "spill", "--spill-blocks", "512"]);
        assert_eq!(
            (config.preemption, config.spill_blocks),
            (Preemption::Spill, 512)
        );
        assert_eq!(config.validate(), Ok(()));
        let refused = self::config(&["--preemption", "spill"]).validate();
        assert_eq!(refused, Err(ConfigError::SpillWithoutHost));
        assert!(parse(&["--preemption", "swap"]).is_err());
    }

    #[test]
    fn spec_decode_is_off_unless_given_and_is_validated() {
        assert_eq!(config(&[]).spec_decode, None);
        let config = self::config(&["--spec-decode", "0.5", "--spec-draft-tokens", "5"]);
        assert_eq!(
            config.spec_decode,
            Some(SpecDecode {
                draft_tokens: 5,
                acceptance_rate: 0.5
            })
        );
        assert!(self::config(&["--spec-decode", "1.5"]).validate().is_err());
        let refused = self::config(&["--spec-decode", "0.5", "--spec-draft-tokens", "0"]);
        assert!(refused.validate().is_err());
    }
}
