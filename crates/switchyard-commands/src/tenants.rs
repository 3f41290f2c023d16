//! Tenant mixes: one scenario file that `replay --tenants` runs in the
//! simulator and `loadgen --tenants` sends through `serve`.
//!
//! ```toml
//! # Optional: the bands and switches, as `serve`'s `[flow]` (its
//! # tenants are listed below instead).
//! [flow]
//! reserve_for_top_band = 0.2
//!
//! [[tenants]]
//! name = "chat"          # the API key's name in serve's config
//! weight = 1             # share within its band
//! band = "standard"      # its requests' band (default: the default band)
//! rate_scale = 4         # its arrival-rate multiplier on its trace
//! slo_ttft_ms = 2000     # optional: each request's TTFT deadline
//! key_env = "CHAT_KEY"   # loadgen: the environment variable holding its key
//!
//! [[tenants]]
//! name = "batch"
//! band = "sheddable"
//! rate_scale = 40
//! trace = "batch.jsonl"  # optional: its own trace (default: the run's)
//! ```
//!
//! Each tenant replays its trace (its own, or the run's) at its own rate;
//! the streams merge in arrival order. Tenants that replay the same trace
//! get distinct prompts (salted), as different customers do not share
//! system prompts and documents.

use anyhow::Context;
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};
use switchyard_core::admission::{
    FlowConfig, FlowPolicy, TenantConfig, MAX_DEADLINE_MS, MAX_TENANTS,
};
use switchyard_sim::workload::SessionFlow;

/// Largest scenario file read.
const MAX_FILE_BYTES: u64 = 1 << 20;

/// One tenant of a mix.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MixTenant {
    /// Its name (the API key's name in `serve`'s configuration).
    pub name: String,
    /// Its weight within its band.
    #[serde(default = "one")]
    pub weight: f64,
    /// Its requests' band.
    #[serde(default)]
    pub band: Option<String>,
    /// The highest band it may ask for.
    #[serde(default)]
    pub max_band: Option<String>,
    /// Most of its requests in flight.
    #[serde(default)]
    pub max_concurrency: Option<u32>,
    /// Its arrival-rate multiplier (replaces the run's `--rate-scale`).
    pub rate_scale: f64,
    /// Its own trace; the run's when unset.
    #[serde(default)]
    pub trace: Option<PathBuf>,
    /// Each of its requests' TTFT deadline, ms.
    #[serde(default)]
    pub slo_ttft_ms: Option<u32>,
    /// `loadgen`: the environment variable that holds its API key (none:
    /// no key is sent).
    #[serde(default)]
    pub key_env: Option<String>,
}

fn one() -> f64 {
    1.0
}

/// A scenario: tenants and how they send.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TenantMix {
    /// Bands and switches, as `serve`'s `[flow]`; its `tenants` stay
    /// empty (the mix's own are listed below).
    #[serde(default)]
    pub flow: FlowConfig,
    /// The tenants (at least one).
    pub tenants: Vec<MixTenant>,
}

impl TenantMix {
    /// Reads and checks a scenario file.
    pub fn load(path: &Path) -> anyhow::Result<Self> {
        let len = std::fs::metadata(path)
            .with_context(|| format!("reading {}", path.display()))?
            .len();
        anyhow::ensure!(
            len <= MAX_FILE_BYTES,
            "{}: {len} bytes, more than the {MAX_FILE_BYTES} a tenant mix may have",
            path.display()
        );
        let text =
            std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        let mut mix: Self =
            toml::from_str(&text).with_context(|| format!("parsing {}", path.display()))?;
        // A tenant's own trace is relative to the scenario file.
        let base = path.parent().unwrap_or(Path::new("."));
        for t in &mut mix.tenants {
            if let Some(trace) = &mut t.trace {
                if trace.is_relative() {
                    *trace = base.join(&*trace);
                }
            }
        }
        mix.validate()
            .with_context(|| format!("checking {}", path.display()))?;
        Ok(mix)
    }

    /// Checks the mix: the flow configuration it makes, rates and
    /// deadlines.
    pub fn validate(&self) -> anyhow::Result<()> {
        anyhow::ensure!(!self.tenants.is_empty(), "a tenant mix needs tenants");
        anyhow::ensure!(
            self.flow.tenants.is_empty(),
            "a tenant mix lists its tenants as [[tenants]], not [[flow.tenants]]"
        );
        anyhow::ensure!(
            self.tenants.len() < MAX_TENANTS,
            "at most {} tenants in a mix",
            MAX_TENANTS - 1
        );
        for t in &self.tenants {
            anyhow::ensure!(
                t.rate_scale.is_finite() && t.rate_scale > 0.0,
                "tenant {:?}: rate_scale must be positive, got {}",
                t.name,
                t.rate_scale
            );
            if let Some(slo) = t.slo_ttft_ms {
                anyhow::ensure!(
                    (1..=MAX_DEADLINE_MS).contains(&u64::from(slo)),
                    "tenant {:?}: slo_ttft_ms must be 1 to {MAX_DEADLINE_MS}, got {slo}",
                    t.name
                );
            }
        }
        FlowPolicy::new(self.flow_config(true)).map_err(|e| anyhow::anyhow!("{e}"))?;
        Ok(())
    }

    /// The flow configuration the mix describes. With `fair` off every
    /// tenant's requests share one tenant and one band, as they did before
    /// flow control (first come, first served); the mix's tenants are then
    /// only labels of the figures.
    pub fn flow_config(&self, fair: bool) -> FlowConfig {
        let tenants = self
            .tenants
            .iter()
            .map(|t| TenantConfig {
                name: t.name.clone(),
                weight: t.weight,
                band: t.band.clone(),
                max_band: t.max_band.clone(),
                max_concurrency: t.max_concurrency,
            })
            .collect();
        let flow = FlowConfig {
            tenants,
            ..self.flow.clone()
        };
        if fair {
            return flow;
        }
        FlowConfig {
            reserve_for_top_band: 0.0,
            reserve_for_light_tenants: 0.0,
            refuse_late: false,
            fair_share: false,
            ..flow
        }
    }

    /// Tenant `index`'s sessions' flow under `policy` (built from
    /// [`Self::flow_config`]).
    pub fn session_flow(&self, policy: &FlowPolicy, index: usize) -> SessionFlow {
        let t = &self.tenants[index];
        let tenant = policy.tenant(Some(&t.name));
        SessionFlow {
            tenant,
            band: None,
            ttft_budget_ms: t.slo_ttft_ms,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A scenario file in a fresh directory of its own.
    fn write(text: &str) -> (PathBuf, PathBuf) {
        use std::sync::atomic::{AtomicU32, Ordering};
        static N: AtomicU32 = AtomicU32::new(0);
        let dir = std::env::temp_dir().join(format!(
            "switchyard-mix-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("mix.toml");
        std::fs::write(&path, text).unwrap();
        (dir, path)
    }

    #[test]
    fn a_mix_reads_its_tenants_and_makes_their_flow_configuration() {
        let (_dir, path) = write(
            "[flow]\nreserve_for_top_band = 0.25\nreserve_for_light_tenants = 0.3\n\
             [[tenants]]\nname = \"chat\"\nrate_scale = 4\nslo_ttft_ms = 900\n\
             [[tenants]]\nname = \"batch\"\nweight = 3\nband = \"sheddable\"\nrate_scale = 40\ntrace = \"b.jsonl\"\n",
        );
        let mix = TenantMix::load(&path).unwrap();
        assert_eq!(mix.tenants.len(), 2);
        assert_eq!(
            mix.tenants[1].trace,
            Some(path.parent().unwrap().join("b.jsonl"))
        );
        let policy = FlowPolicy::new(mix.flow_config(true)).unwrap();
        assert_eq!(policy.tenant_count(), 3, "the default tenant is added");
        let batch = mix.session_flow(&policy, 1);
        assert_eq!(policy.tenant_name(batch.tenant), "batch");
        assert_eq!(policy.weight(batch.tenant), 3.0);
        assert_eq!(mix.session_flow(&policy, 0).ttft_budget_ms, Some(900));
        assert_eq!(policy.config().reserve_for_top_band, 0.25);
        let unfair = mix.flow_config(false);
        assert!(!unfair.fair_share);
        assert_eq!(policy.config().reserve_for_light_tenants, 0.3);
        assert_eq!(unfair.reserve_for_top_band, 0.0);
        assert_eq!(unfair.reserve_for_light_tenants, 0.0);
    }

    #[test]
    fn bad_mixes_are_refused_with_the_reason() {
        for (text, why) in [
            ("tenants = []\n", "needs tenants"),
            ("[[tenants]]\nname = \"a\"\nrate_scale = 0\n", "rate_scale"),
            (
                "[[tenants]]\nname = \"a\"\nrate_scale = 1\nband = \"gold\"\n",
                "gold",
            ),
            (
                "[[tenants]]\nname = \"a\"\nrate_scale = 1\nslo_ttft_ms = 0\n",
                "slo_ttft_ms",
            ),
            (
                "[[tenants]]\nname = \"a\"\nrate_scale = 1\ncolour = 1\n",
                "colour",
            ),
            (
                "[[flow.tenants]]\nname = \"b\"\n[[tenants]]\nname = \"a\"\nrate_scale = 1\n",
                "[[flow.tenants]]",
            ),
        ] {
            let (_dir, path) = write(text);
            let err = format!("{:#}", TenantMix::load(&path).unwrap_err());
            assert!(err.contains(why), "{text:?}: {err}");
        }
    }
}
