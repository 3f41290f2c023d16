//! Tenants and priority bands: who sent a request and how urgent it is.
//!
//! A [`FlowConfig`] names a bounded set of priority bands (highest first)
//! and of tenants (each with a weight, a default band, a band ceiling and
//! an optional cap on requests in flight). [`FlowPolicy`] is its checked,
//! indexed form: it turns what a driver knows about a request (the
//! tenant's name, a band the client asked for, a TTFT deadline header)
//! into a [`Flow`], the request's place in the fair queue, or a
//! [`FlowError`] that the driver answers with a 400. The server and the
//! simulator resolve requests through this one value, so a scenario
//! means the same thing in both.
//!
//! Unknown tenants fall into the default tenant (index 0, named
//! `default` unless the configuration names one so). A band above the
//! tenant's ceiling is capped to the ceiling, not refused; a band that
//! does not exist is refused.

use crate::maps::FxHashMap;
use serde::{Deserialize, Serialize};

/// Most tenants a configuration may name (the default one included).
pub const MAX_TENANTS: usize = 256;
/// Most priority bands.
pub const MAX_BANDS: usize = 8;
/// Longest tenant or band name, in bytes.
pub const MAX_NAME_BYTES: usize = 64;
/// Largest TTFT deadline a request may carry, in milliseconds.
pub const MAX_DEADLINE_MS: u64 = 3_600_000;
/// Largest weight (the smallest is anything above zero).
pub const MAX_WEIGHT: f64 = 1e6;
/// How long after its last dispatch a tenant still counts as active, for
/// [`FlowConfig::reserve_for_light_tenants`]: a tenant seen within it may
/// be sending again, so a saturating one leaves it room.
pub const ACTIVE_WINDOW_MS: f64 = 10_000.0;

/// A tenant: an index into [`FlowPolicy`]'s tenants; 0 is the default.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct TenantId(pub u16);

/// A priority band: an index into [`FlowPolicy`]'s bands; 0 is the
/// highest priority.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Band(pub u8);

/// A request's place in the fair queue.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Flow {
    /// Who sent it.
    pub tenant: TenantId,
    /// How urgent it is (already capped by the tenant's ceiling).
    pub band: Band,
    /// When its first token is due, on the driver's clock; `None`: no
    /// deadline.
    pub deadline_ms: Option<f64>,
    /// Output tokens it is expected to generate (its `max_tokens`,
    /// clamped), part of its cost in the fair share.
    pub expected_output_tokens: u32,
}

/// One priority band.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BandConfig {
    /// Its name, as headers and configuration spell it.
    pub name: String,
    /// Whether its requests are refused at once rather than wait in the
    /// router's queue: under overload they are shed before any request
    /// of another band waits.
    #[serde(default)]
    pub sheddable: bool,
    /// The engine-side scheduling priority its requests are sent with
    /// (the body's `priority`, which vLLM and SGLang read with
    /// `--scheduling-policy priority`: lower runs first). A client's own
    /// `priority` never reaches an engine: it is replaced by this, or
    /// removed when unset.
    #[serde(default)]
    pub engine_priority: Option<i64>,
}

/// One tenant.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TenantConfig {
    /// Its name: the API key's name (or the tenant header's value).
    pub name: String,
    /// Its share of the fleet within a band, relative to the other
    /// tenants' weights (tokens served per unit of weight are equalised).
    #[serde(default = "default_weight")]
    pub weight: f64,
    /// Its requests' band when they ask for none; the configuration's
    /// default band when unset.
    #[serde(default)]
    pub band: Option<String>,
    /// The highest band its requests may ask for; higher asks are capped
    /// to it. Its own band when unset.
    #[serde(default)]
    pub max_band: Option<String>,
    /// Most of its requests in flight (placed and not finished) at once;
    /// beyond it they wait. Unlimited when unset.
    #[serde(default)]
    pub max_concurrency: Option<u32>,
}

fn default_weight() -> f64 {
    1.0
}

impl TenantConfig {
    /// A tenant of weight 1 in the default band.
    pub fn named(name: &str) -> Self {
        Self {
            name: name.to_owned(),
            weight: 1.0,
            band: None,
            max_band: None,
            max_concurrency: None,
        }
    }
}

/// Tenants, bands and the flow-control switches.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct FlowConfig {
    /// The bands, highest priority first.
    pub bands: Vec<BandConfig>,
    /// The band of requests that ask for none, when their tenant names
    /// none either.
    pub default_band: String,
    /// The tenants. A tenant named `default` is the default one;
    /// otherwise a default tenant of weight 1 is added first.
    pub tenants: Vec<TenantConfig>,
    /// Share of each worker's capacity held back for the top band: a
    /// request of any other band finds a worker busy at `1 - share` of
    /// the busy threshold. Needs a busy threshold; 0 holds nothing back.
    pub reserve_for_top_band: f64,
    /// Share of each worker's capacity held back for light tenants: a
    /// request whose tenant was recently served more tokens than its
    /// weight's share, while another tenant is active (in flight, or
    /// served within [`ACTIVE_WINDOW_MS`]), finds a worker busy at
    /// `1 - share` of the busy threshold. A tenant within its share then
    /// starts at once beside a saturating one, whose requests wait in the
    /// router's fair queue rather than in the engines' batches. A tenant
    /// alone is never held back. Needs a busy threshold; 0 holds nothing
    /// back.
    pub reserve_for_light_tenants: f64,
    /// Refuse at once a request whose TTFT deadline the prefill estimate
    /// says cannot be met, rather than serve it late.
    pub refuse_late: bool,
    /// Share each band between its tenants by weight. Off, a band is
    /// served first come, first served whoever sent the request (the
    /// tenants are then only labels of the figures and caps).
    pub fair_share: bool,
}

impl Default for FlowConfig {
    fn default() -> Self {
        Self {
            bands: vec![
                BandConfig {
                    name: "critical".into(),
                    sheddable: false,
                    engine_priority: None,
                },
                BandConfig {
                    name: "standard".into(),
                    sheddable: false,
                    engine_priority: None,
                },
                BandConfig {
                    name: "sheddable".into(),
                    sheddable: true,
                    engine_priority: None,
                },
            ],
            default_band: "standard".into(),
            tenants: Vec::new(),
            reserve_for_top_band: 0.0,
            reserve_for_light_tenants: 0.0,
            refuse_late: false,
            fair_share: true,
        }
    }
}

impl FlowConfig {
    /// The capacity reserves, named as in the configuration.
    pub fn reserves(&self) -> [(&'static str, f64); 2] {
        [
            ("reserve_for_top_band", self.reserve_for_top_band),
            ("reserve_for_light_tenants", self.reserve_for_light_tenants),
        ]
    }

    /// The first reserve that is set: it holds back a share of the busy
    /// threshold, so it needs one.
    pub fn reserve_needing_threshold(&self) -> Option<(&'static str, f64)> {
        self.reserves().into_iter().find(|&(_, share)| share > 0.0)
    }
}

/// Why a [`FlowConfig`] was refused.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum FlowConfigError {
    /// No band, or too many.
    #[error("flow control needs 1 to {MAX_BANDS} bands, got {0}")]
    BandCount(usize),
    /// Too many tenants.
    #[error("at most {MAX_TENANTS} tenants (the default one included), got {0}")]
    TenantCount(usize),
    /// An empty, overlong or numeric name.
    #[error("{what} name {name:?} must be 1 to {MAX_NAME_BYTES} bytes and not a number")]
    Name {
        /// `band` or `tenant`.
        what: &'static str,
        /// The name.
        name: String,
    },
    /// A name given twice.
    #[error("{what} {name:?} is named twice")]
    Duplicate {
        /// `band` or `tenant`.
        what: &'static str,
        /// The name.
        name: String,
    },
    /// A band name that no band has.
    #[error("{field} names band {name:?}, which is not one of the bands")]
    UnknownBand {
        /// Where it was named.
        field: String,
        /// The name.
        name: String,
    },
    /// A ceiling below the tenant's own band.
    #[error("tenant {tenant:?}: max_band {max_band:?} is below its band {band:?}")]
    CeilingBelowBand {
        /// The tenant.
        tenant: String,
        /// Its ceiling.
        max_band: String,
        /// Its band.
        band: String,
    },
    /// A weight that is not positive and finite, or too large.
    #[error("tenant {tenant:?}: weight must be in (0, {MAX_WEIGHT}], got {weight}")]
    Weight {
        /// The tenant.
        tenant: String,
        /// The weight.
        weight: f64,
    },
    /// A concurrency cap of zero.
    #[error("tenant {0:?}: max_concurrency must be at least 1")]
    Concurrency(String),
    /// A reserve outside `[0, 1)`.
    #[error("{what} must be in [0, 1), got {share}")]
    Reserve {
        /// `reserve_for_top_band` or `reserve_for_light_tenants`.
        what: &'static str,
        /// The share.
        share: f64,
    },
}

/// Why a request's flow could not be resolved (the driver answers 400).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum FlowError {
    /// A band that does not exist.
    #[error("unknown priority band {0:?} (the bands are {1})")]
    UnknownBand(String, String),
    /// A deadline that is not a whole number of milliseconds in range.
    #[error("a TTFT deadline must be a whole number of milliseconds from 1 to {MAX_DEADLINE_MS}, got {0:?}")]
    Deadline(String),
}

#[derive(Clone, Debug)]
struct Tenant {
    name: Box<str>,
    weight: f64,
    band: Band,
    ceiling: Band,
    max_concurrency: Option<u32>,
}

/// A checked [`FlowConfig`], indexed by name.
#[derive(Clone, Debug)]
pub struct FlowPolicy {
    config: FlowConfig,
    bands: Vec<(Box<str>, bool)>,
    tenants: Vec<Tenant>,
    by_name: FxHashMap<Box<str>, TenantId>,
}

fn check_name(what: &'static str, name: &str) -> Result<(), FlowConfigError> {
    if name.is_empty() || name.len() > MAX_NAME_BYTES || name.parse::<u64>().is_ok() {
        return Err(FlowConfigError::Name {
            what,
            name: name.chars().take(MAX_NAME_BYTES).collect(),
        });
    }
    Ok(())
}

impl Default for FlowPolicy {
    fn default() -> Self {
        Self::new(FlowConfig::default()).expect("the default flow configuration is valid")
    }
}

impl FlowPolicy {
    /// Checks `config` and indexes it.
    pub fn new(config: FlowConfig) -> Result<Self, FlowConfigError> {
        if config.bands.is_empty() || config.bands.len() > MAX_BANDS {
            return Err(FlowConfigError::BandCount(config.bands.len()));
        }
        let mut bands: Vec<(Box<str>, bool)> = Vec::with_capacity(config.bands.len());
        for b in &config.bands {
            check_name("band", &b.name)?;
            if bands.iter().any(|(n, _)| **n == *b.name) {
                return Err(FlowConfigError::Duplicate {
                    what: "band",
                    name: b.name.clone(),
                });
            }
            bands.push((b.name.as_str().into(), b.sheddable));
        }
        let band_of = |field: String, name: &str| -> Result<Band, FlowConfigError> {
            bands
                .iter()
                .position(|(n, _)| **n == *name)
                .map(|i| Band(i as u8))
                .ok_or(FlowConfigError::UnknownBand {
                    field,
                    name: name.to_owned(),
                })
        };
        let default_band = band_of("default_band".into(), &config.default_band)?;
        for (what, share) in config.reserves() {
            if !(0.0..1.0).contains(&share) {
                return Err(FlowConfigError::Reserve { what, share });
            }
        }
        let has_default = config.tenants.iter().any(|t| t.name == "default");
        let count = config.tenants.len() + usize::from(!has_default);
        if count > MAX_TENANTS {
            return Err(FlowConfigError::TenantCount(count));
        }
        let mut listed: Vec<&TenantConfig> = config.tenants.iter().collect();
        let implicit = TenantConfig::named("default");
        match listed.iter().position(|t| t.name == "default") {
            Some(i) => {
                let d = listed.remove(i);
                listed.insert(0, d);
            }
            None => listed.insert(0, &implicit),
        }
        let mut tenants = Vec::with_capacity(listed.len());
        let mut by_name = FxHashMap::default();
        for t in listed {
            check_name("tenant", &t.name)?;
            if !(t.weight.is_finite() && t.weight > 0.0 && t.weight <= MAX_WEIGHT) {
                return Err(FlowConfigError::Weight {
                    tenant: t.name.clone(),
                    weight: t.weight,
                });
            }
            if t.max_concurrency == Some(0) {
                return Err(FlowConfigError::Concurrency(t.name.clone()));
            }
            let band = match &t.band {
                Some(b) => band_of(format!("tenant {:?}'s band", t.name), b)?,
                None => default_band,
            };
            let ceiling = match &t.max_band {
                Some(b) => band_of(format!("tenant {:?}'s max_band", t.name), b)?,
                None => band,
            };
            if ceiling > band {
                return Err(FlowConfigError::CeilingBelowBand {
                    tenant: t.name.clone(),
                    max_band: bands[ceiling.0 as usize].0.to_string(),
                    band: bands[band.0 as usize].0.to_string(),
                });
            }
            let id = TenantId(tenants.len() as u16);
            if by_name.insert(t.name.as_str().into(), id).is_some() {
                return Err(FlowConfigError::Duplicate {
                    what: "tenant",
                    name: t.name.clone(),
                });
            }
            tenants.push(Tenant {
                name: t.name.as_str().into(),
                weight: t.weight,
                band,
                ceiling,
                max_concurrency: t.max_concurrency,
            });
        }
        Ok(Self {
            config,
            bands,
            tenants,
            by_name,
        })
    }

    /// The configuration it was built from.
    pub fn config(&self) -> &FlowConfig {
        &self.config
    }

    /// Number of bands.
    pub fn band_count(&self) -> usize {
        self.bands.len()
    }

    /// Number of tenants, the default one included.
    pub fn tenant_count(&self) -> usize {
        self.tenants.len()
    }

    /// The tenant of `name`; the default tenant for an unknown or absent
    /// name.
    pub fn tenant(&self, name: Option<&str>) -> TenantId {
        name.and_then(|n| self.by_name.get(n).copied())
            .unwrap_or_default()
    }

    /// A tenant's name (for metric labels: a bounded set).
    pub fn tenant_name(&self, tenant: TenantId) -> &str {
        self.tenants
            .get(tenant.0 as usize)
            .map_or("default", |t| &t.name)
    }

    /// A band's name (for metric labels: a bounded set).
    pub fn band_name(&self, band: Band) -> &str {
        self.bands
            .get(band.0 as usize)
            .map_or("unknown", |(n, _)| n)
    }

    /// The engine-side priority a band's requests are sent with, when
    /// its configuration maps one ([`BandConfig::engine_priority`]).
    pub fn engine_priority(&self, band: Band) -> Option<i64> {
        self.config
            .bands
            .get(band.0 as usize)
            .and_then(|b| b.engine_priority)
    }

    /// A tenant's weight (1 for an unknown id).
    pub fn weight(&self, tenant: TenantId) -> f64 {
        self.tenants
            .get(tenant.0 as usize)
            .map_or(1.0, |t| t.weight)
    }

    /// A tenant's cap on requests in flight.
    pub fn max_concurrency(&self, tenant: TenantId) -> Option<u32> {
        self.tenants
            .get(tenant.0 as usize)
            .and_then(|t| t.max_concurrency)
    }

    /// Whether `band`'s requests are shed rather than wait.
    pub fn is_sheddable(&self, band: Band) -> bool {
        self.bands.get(band.0 as usize).is_some_and(|(_, s)| *s)
    }

    /// The band `asked` names: a band's name or its index (`0` is the
    /// highest).
    pub fn band_named(&self, asked: &str) -> Option<Band> {
        if let Ok(i) = asked.parse::<usize>() {
            return (i < self.bands.len()).then_some(Band(i as u8));
        }
        self.bands
            .iter()
            .position(|(n, _)| **n == *asked)
            .map(|i| Band(i as u8))
    }

    /// The band of a request from `tenant` that asked for `asked`: the
    /// tenant's own band when it asked for none, capped by the tenant's
    /// ceiling.
    pub fn resolve_band(&self, tenant: TenantId, asked: Option<&str>) -> Result<Band, FlowError> {
        let Some(asked) = asked else {
            return Ok(self.cap_band(tenant, None));
        };
        let band = self.band_named(asked.trim()).ok_or_else(|| {
            let names: Vec<&str> = self.bands.iter().map(|(n, _)| &**n).collect();
            FlowError::UnknownBand(
                asked.chars().take(MAX_NAME_BYTES).collect(),
                names.join(", "),
            )
        })?;
        Ok(self.cap_band(tenant, Some(band)))
    }

    /// The band of a request of `tenant` that asked for `asked`: capped
    /// by the tenant's ceiling; the tenant's own band when it asked for
    /// none or for a band the policy does not have.
    pub fn cap_band(&self, tenant: TenantId, asked: Option<Band>) -> Band {
        let t = self
            .tenants
            .get(tenant.0 as usize)
            .unwrap_or(&self.tenants[0]);
        match asked {
            Some(band) if (band.0 as usize) < self.bands.len() => band.max(t.ceiling),
            _ => t.band,
        }
    }

    /// The deadline of a request that arrived at `now_ms` with a TTFT
    /// budget of `budget` milliseconds (a header's text).
    pub fn deadline(now_ms: f64, budget: &str) -> Result<f64, FlowError> {
        match budget.trim().parse::<u64>() {
            Ok(ms) if (1..=MAX_DEADLINE_MS).contains(&ms) => Ok(now_ms + ms as f64),
            _ => Err(FlowError::Deadline(budget.chars().take(32).collect())),
        }
    }

    /// The flow of a request: its tenant (by name), the band it asked
    /// for and its TTFT budget, checked.
    pub fn resolve(
        &self,
        tenant: Option<&str>,
        band: Option<&str>,
        ttft_budget: Option<&str>,
        expected_output_tokens: u32,
        now_ms: f64,
    ) -> Result<Flow, FlowError> {
        let tenant = self.tenant(tenant);
        Ok(Flow {
            tenant,
            band: self.resolve_band(tenant, band)?,
            deadline_ms: ttft_budget.map(|b| Self::deadline(now_ms, b)).transpose()?,
            expected_output_tokens,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy(toml_tenants: Vec<TenantConfig>) -> FlowPolicy {
        FlowPolicy::new(FlowConfig {
            tenants: toml_tenants,
            ..Default::default()
        })
        .unwrap()
    }

    #[test]
    fn unknown_and_absent_tenants_fall_into_the_default_one() {
        let p = policy(vec![TenantConfig::named("chat")]);
        assert_eq!(p.tenant_count(), 2);
        assert_eq!(p.tenant(Some("chat")), TenantId(1));
        assert_eq!(p.tenant(Some("stranger")), TenantId(0));
        assert_eq!(p.tenant(None), TenantId(0));
        assert_eq!(p.tenant_name(TenantId(0)), "default");
    }

    #[test]
    fn a_named_default_tenant_takes_index_zero() {
        let mut d = TenantConfig::named("default");
        d.weight = 5.0;
        let p = policy(vec![TenantConfig::named("a"), d]);
        assert_eq!(p.tenant_count(), 2);
        assert_eq!(p.weight(TenantId(0)), 5.0);
        assert_eq!(p.tenant(Some("a")), TenantId(1));
    }

    #[test]
    fn a_band_is_the_tenants_own_unless_asked_and_capped_by_its_ceiling() {
        let mut batch = TenantConfig::named("batch");
        batch.band = Some("sheddable".into());
        let mut chat = TenantConfig::named("chat");
        chat.max_band = Some("critical".into());
        let p = policy(vec![batch, chat]);
        let batch = p.tenant(Some("batch"));
        let chat = p.tenant(Some("chat"));
        assert_eq!(p.resolve_band(batch, None), Ok(Band(2)));
        // Asking above the ceiling is capped, not refused.
        assert_eq!(p.resolve_band(batch, Some("critical")), Ok(Band(2)));
        assert_eq!(p.resolve_band(chat, None), Ok(Band(1)));
        assert_eq!(p.resolve_band(chat, Some("critical")), Ok(Band(0)));
        assert_eq!(p.resolve_band(chat, Some("0")), Ok(Band(0)));
        assert_eq!(p.resolve_band(chat, Some("sheddable")), Ok(Band(2)));
        // A band already as an index (the simulator's sessions): the same
        // ceiling; a band the policy lacks is the tenant's own.
        assert_eq!(p.cap_band(batch, Some(Band(0))), Band(2));
        assert_eq!(p.cap_band(chat, Some(Band(0))), Band(0));
        assert_eq!(p.cap_band(chat, Some(Band(7))), Band(1));
        assert_eq!(p.cap_band(chat, None), Band(1));
        assert!(matches!(
            p.resolve_band(chat, Some("urgent")),
            Err(FlowError::UnknownBand(..))
        ));
        assert!(matches!(
            p.resolve_band(chat, Some("3")),
            Err(FlowError::UnknownBand(..))
        ));
        assert!(p.is_sheddable(Band(2)) && !p.is_sheddable(Band(1)));
    }

    #[test]
    fn deadlines_are_whole_milliseconds_in_range() {
        assert_eq!(FlowPolicy::deadline(100.0, "250"), Ok(350.0));
        for bad in [
            "-1",
            "0",
            "1.5",
            "",
            "abc",
            "99999999999999999999",
            "3600001",
        ] {
            assert!(FlowPolicy::deadline(0.0, bad).is_err(), "{bad:?}");
        }
        let long = "9".repeat(10_000);
        let Err(FlowError::Deadline(echo)) = FlowPolicy::deadline(0.0, &long) else {
            panic!("accepted");
        };
        assert!(echo.len() <= 32, "the error echoes a bounded prefix");
    }

    #[test]
    fn bad_configurations_are_refused_with_the_reason() {
        let bad = |f: &dyn Fn(&mut FlowConfig)| {
            let mut c = FlowConfig::default();
            f(&mut c);
            FlowPolicy::new(c).unwrap_err()
        };
        assert!(matches!(
            bad(&|c| c.bands.clear()),
            FlowConfigError::BandCount(0)
        ));
        assert!(matches!(
            bad(&|c| c.default_band = "gold".into()),
            FlowConfigError::UnknownBand { .. }
        ));
        assert!(matches!(
            bad(&|c| c.reserve_for_top_band = 1.0),
            FlowConfigError::Reserve { .. }
        ));
        assert!(matches!(
            bad(&|c| c.reserve_for_light_tenants = -0.1),
            FlowConfigError::Reserve {
                what: "reserve_for_light_tenants",
                ..
            }
        ));
        assert!(matches!(
            bad(&|c| c.tenants = vec![TenantConfig::named("a"), TenantConfig::named("a")]),
            FlowConfigError::Duplicate { .. }
        ));
        assert!(matches!(
            bad(&|c| c.tenants = vec![TenantConfig::named("7")]),
            FlowConfigError::Name { .. }
        ));
        assert!(matches!(
            bad(&|c| {
                let mut t = TenantConfig::named("a");
                t.weight = 0.0;
                c.tenants = vec![t];
            }),
            FlowConfigError::Weight { .. }
        ));
        assert!(matches!(
            bad(&|c| {
                let mut t = TenantConfig::named("a");
                t.band = Some("critical".into());
                t.max_band = Some("standard".into());
                c.tenants = vec![t];
            }),
            FlowConfigError::CeilingBelowBand { .. }
        ));
        assert!(matches!(
            bad(&|c| c.tenants = (0..MAX_TENANTS)
                .map(|i| TenantConfig::named(&format!("t{i}")))
                .collect()),
            FlowConfigError::TenantCount(_)
        ));
    }
}
