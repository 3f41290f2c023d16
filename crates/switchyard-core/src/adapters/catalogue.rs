//! The adapter catalogue: which adapters a request may name as its
//! `model`, and the base model whose workers may serve each.
//!
//! Adapters come from two places:
//!
//! - **Configured** (`[[adapters]]`: name, path, base model): always
//!   known; only these does the router load on demand (an operator gave
//!   their path).
//! - **Learned** from what workers list (vLLM lists each loaded adapter as
//!   a model card with a `parent`, its base model), when consistent with
//!   the fleet: the parent is a configured model (or, with none
//!   configured, a base model on the same list), and the adapter's name is
//!   no base model's (a card never shadows a base model; a learned
//!   adapter whose name a worker later lists as a base model is
//!   forgotten). A learned adapter is served only where it is loaded.
//!
//! Bounded and expiring: at most [`MAX_LEARNED`] learned adapters and as
//! many base model names, at most [`MAX_CARDS`] cards read from one list;
//! a learned adapter or base name no worker has listed for
//! [`LEARNED_TTL_MS`] is forgotten ([`Catalogue::sweep`]). Whatever is
//! not kept is counted by why ([`Dropped`]).
//!
//! Sans-I/O: the driver reads a worker's list and gives its [`Card`]s and
//! the time ([`Catalogue::learn`]); the server's health rounds do, and a
//! simulator could.

use super::MAX_ADAPTER_NAME_BYTES;
use serde::{Deserialize, Serialize};
use std::collections::{HashMap, HashSet};

/// Adapters learned from workers' lists, at most (and base model names).
pub const MAX_LEARNED: usize = 1024;
/// Cards read from one worker's list, at most.
pub const MAX_CARDS: usize = 1024;
/// Longest adapter path kept (bytes).
pub const MAX_PATH_BYTES: usize = 4096;
/// How long a learned adapter (or a base model name) stays known after
/// the last worker listed it: a few health rounds.
pub const LEARNED_TTL_MS: f64 = 60_000.0;

/// One `[[adapters]]` table.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AdapterSpec {
    /// The name requests use as their `model`.
    pub name: String,
    /// What `/v1/load_lora_adapter` is given as `lora_path`.
    pub path: String,
    /// The base model it adapts (a model the workers list); `None`: any
    /// worker.
    #[serde(default)]
    pub base_model: Option<String>,
}

impl AdapterSpec {
    /// Checks lengths and emptiness.
    pub fn validate(&self) -> Result<(), String> {
        if self.name.is_empty() || self.name.len() > MAX_ADAPTER_NAME_BYTES {
            return Err(format!(
                "adapters: a name must have 1 to {MAX_ADAPTER_NAME_BYTES} bytes"
            ));
        }
        if self.path.is_empty() || self.path.len() > MAX_PATH_BYTES {
            return Err(format!(
                "adapters.{}: path must have 1 to {MAX_PATH_BYTES} bytes",
                self.name
            ));
        }
        Ok(())
    }
}

/// One model card of a worker's list, as far as the catalogue reads it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Card<'a> {
    /// Its `id` (`None`: absent or not a string).
    pub id: Option<&'a str>,
    /// Its `parent`: the base model, for an adapter; `None` for a base
    /// model.
    pub parent: Option<&'a str>,
}

/// Why something a worker listed was not kept, or was forgotten.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Dropped {
    /// An adapter card without a usable id (absent, empty, too long).
    Invalid,
    /// A card named as a base model, or a learned adapter whose name a
    /// worker came to list as a base model.
    Shadow,
    /// An adapter whose parent is no base model of the fleet.
    UnknownBase,
    /// A new adapter while [`MAX_LEARNED`] are learned.
    Learned,
    /// A new base model name while [`MAX_LEARNED`] are known.
    Base,
    /// A learned adapter no worker listed for [`LEARNED_TTL_MS`].
    Expired,
}

impl Dropped {
    /// Every reason, in declaration order (a reason's index is `as usize`).
    pub const ALL: [Dropped; 6] = [
        Dropped::Invalid,
        Dropped::Shadow,
        Dropped::UnknownBase,
        Dropped::Learned,
        Dropped::Base,
        Dropped::Expired,
    ];

    /// Its label in metrics.
    pub fn label(self) -> &'static str {
        match self {
            Dropped::Invalid => "invalid",
            Dropped::Shadow => "shadow",
            Dropped::UnknownBase => "unknown_base",
            Dropped::Learned => "learned",
            Dropped::Base => "base",
            Dropped::Expired => "expired",
        }
    }
}

/// What one worker's list taught ([`Catalogue::learn`]).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Learnt {
    /// The catalogue's adapters the worker has loaded.
    pub loaded: Vec<String>,
    /// Adapters learned from it for the first time.
    pub new: Vec<String>,
}

/// How a request's `model` routes.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Resolved {
    /// The adapter it names.
    pub adapter: Option<String>,
    /// The model whose workers may serve it (the base model of an adapter).
    pub eligible_model: Option<String>,
}

#[derive(Clone, Debug)]
struct Entry {
    path: Box<str>,
    base: Option<Box<str>>,
}

/// An adapter learned from a worker's list.
#[derive(Clone, Debug)]
struct Learned {
    /// Its base model, as the first worker that listed it said.
    base: Box<str>,
    /// When a worker last listed it (ms).
    seen_ms: f64,
}

/// The catalogue (see the module docs).
#[derive(Clone, Debug, Default)]
pub struct Catalogue {
    configured: HashMap<Box<str>, Entry>,
    /// The configured models' names (`[[models]]`), when any.
    base_models: HashSet<Box<str>>,
    learned: HashMap<Box<str>, Learned>,
    /// Base model names workers list, and when last listed (ms).
    bases: HashMap<Box<str>, f64>,
    dropped: [u64; Dropped::ALL.len()],
}

impl Catalogue {
    /// A catalogue of the configured adapters (already validated).
    pub fn new(specs: &[AdapterSpec]) -> Self {
        let configured = specs
            .iter()
            .map(|s| {
                let entry = Entry {
                    path: s.path.as_str().into(),
                    base: s.base_model.as_deref().map(Into::into),
                };
                (s.name.as_str().into(), entry)
            })
            .collect();
        Self {
            configured,
            ..Self::default()
        }
    }

    /// The same catalogue, knowing the configured models (`[[models]]`
    /// names): a learned adapter's parent must be one of them.
    pub fn with_base_models<'a>(mut self, names: impl IntoIterator<Item = &'a str>) -> Self {
        self.base_models = names.into_iter().map(Into::into).collect();
        self
    }

    /// Whether no adapter is known, configured or learned (then no
    /// worker's slots matter).
    pub fn is_empty(&self) -> bool {
        self.configured.is_empty() && self.learned.is_empty()
    }

    /// The path a load of `name` is given: only a configured adapter's
    /// (a learned one is never loaded by the router).
    pub fn path_of(&self, name: &str) -> Option<Box<str>> {
        self.configured.get(name).map(|e| e.path.clone())
    }

    /// The base model of adapter `name` (`Some(None)`: a configured
    /// adapter of any model); `None`: not an adapter.
    fn base_of(&self, name: &str) -> Option<Option<&str>> {
        if let Some(e) = self.configured.get(name) {
            return Some(e.base.as_deref());
        }
        self.learned.get(name).map(|l| Some(&*l.base))
    }

    /// Every adapter a request may name, by name: the configured ones and
    /// those learned, each with its base model when it has one.
    pub fn listed(&self) -> Vec<(String, Option<String>)> {
        let mut out: Vec<(String, Option<String>)> = self
            .configured
            .iter()
            .map(|(name, e)| (name.to_string(), e.base.as_deref().map(str::to_owned)))
            .collect();
        out.extend(
            self.learned
                .iter()
                .filter(|(name, _)| !self.configured.contains_key(&**name))
                .map(|(name, l)| (name.to_string(), Some(l.base.to_string()))),
        );
        out.sort();
        out
    }

    /// How a request for `model` routes.
    pub fn resolve(&self, model: Option<&str>) -> Resolved {
        let Some(model) = model else {
            return Resolved::default();
        };
        match self.base_of(model) {
            Some(base) => Resolved {
                adapter: Some(model.to_owned()),
                eligible_model: base.map(str::to_owned),
            },
            None => Resolved {
                adapter: None,
                eligible_model: Some(model.to_owned()),
            },
        }
    }

    /// Learns one worker's list, read at `now_ms`: the adapters it has
    /// loaded (for the core's [`super::AdapterTable`]) and those learned
    /// from it for the first time, by the rules of the module docs.
    pub fn learn(&mut self, cards: &[Card<'_>], now_ms: f64) -> Learnt {
        let cards = &cards[..cards.len().min(MAX_CARDS)];
        // This worker's base models: cards without a parent.
        let own_bases: Vec<&str> = cards
            .iter()
            .filter(|c| c.parent.is_none())
            .filter_map(|c| c.id)
            .filter(|id| !id.is_empty() && id.len() <= MAX_ADAPTER_NAME_BYTES)
            .collect();
        self.saw_bases(&own_bases, now_ms);
        let mut learnt = Learnt::default();
        for card in cards {
            let Some(parent) = card.parent else {
                continue;
            };
            let Some(name) = card
                .id
                .filter(|id| !id.is_empty() && id.len() <= MAX_ADAPTER_NAME_BYTES)
            else {
                self.drop(Dropped::Invalid);
                continue;
            };
            if self.configured.contains_key(name) {
                learnt.loaded.push(name.to_owned());
                continue;
            }
            if self.is_base(name) {
                self.drop(Dropped::Shadow);
                continue;
            }
            let consistent = match self.base_models.is_empty() {
                true => own_bases.contains(&parent),
                false => self.base_models.contains(parent),
            };
            if !consistent {
                self.drop(Dropped::UnknownBase);
                continue;
            }
            let full = self.learned.len() >= MAX_LEARNED;
            match self.learned.get_mut(name) {
                // First writer's base; every listing keeps it alive.
                Some(known) => known.seen_ms = now_ms,
                None if full => {
                    self.drop(Dropped::Learned);
                    continue;
                }
                None => {
                    let learned = Learned {
                        base: parent.into(),
                        seen_ms: now_ms,
                    };
                    self.learned.insert(name.into(), learned);
                    learnt.new.push(name.to_owned());
                }
            }
            learnt.loaded.push(name.to_owned());
        }
        learnt
    }

    /// Records base model names a worker lists; a learned adapter of the
    /// same name is forgotten (a base model is never shadowed).
    fn saw_bases(&mut self, names: &[&str], now_ms: f64) {
        for &name in names {
            let full = self.bases.len() >= MAX_LEARNED;
            match self.bases.get_mut(name) {
                Some(seen) => *seen = now_ms,
                None if full => self.drop(Dropped::Base),
                None => {
                    self.bases.insert(name.into(), now_ms);
                }
            }
        }
        for &name in names {
            if self.learned.remove(name).is_some() {
                self.drop(Dropped::Shadow);
            }
        }
    }

    /// Whether `name` is a base model: configured, or listed by a worker.
    fn is_base(&self, name: &str) -> bool {
        self.base_models.contains(name) || self.bases.contains_key(name)
    }

    /// Forgets learned adapters and base names no worker has listed for
    /// [`LEARNED_TTL_MS`] at `now_ms`: the adapters forgotten (counted
    /// [`Dropped::Expired`]), whose holders-only marks the caller clears.
    pub fn sweep(&mut self, now_ms: f64) -> Vec<Box<str>> {
        let fresh = |seen: f64| now_ms - seen < LEARNED_TTL_MS;
        self.bases.retain(|_, seen| fresh(*seen));
        let expired: Vec<Box<str>> = self
            .learned
            .iter()
            .filter(|(_, l)| !fresh(l.seen_ms))
            .map(|(name, _)| name.clone())
            .collect();
        for name in &expired {
            self.learned.remove(name);
            self.drop(Dropped::Expired);
        }
        expired
    }

    fn drop(&mut self, why: Dropped) {
        self.dropped[why as usize] += 1;
    }

    /// What was dropped for `why` since the catalogue was made.
    pub fn dropped(&self, why: Dropped) -> u64 {
        self.dropped[why as usize]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A list's cards: `(id, parent)`.
    fn cards<'a>(list: &[(Option<&'a str>, Option<&'a str>)]) -> Vec<Card<'a>> {
        list.iter()
            .map(|&(id, parent)| Card { id, parent })
            .collect()
    }

    #[test]
    fn a_model_naming_an_adapter_routes_among_its_base_models_workers() {
        let mut a = Catalogue::new(&[AdapterSpec {
            name: "sql".into(),
            path: "/adapters/sql".into(),
            base_model: Some("base".into()),
        }]);
        assert_eq!(
            a.resolve(Some("sql")),
            Resolved {
                adapter: Some("sql".into()),
                eligible_model: Some("base".into())
            }
        );
        assert_eq!(a.resolve(Some("base")).adapter, None);
        assert_eq!(a.resolve(None), Resolved::default());
        // Learned from a worker's list: name and parent.
        let list = cards(&[
            (Some("base"), None),
            (Some("chat"), Some("base")),
            (Some(""), Some("base")),
            (None, Some("base")),
        ]);
        let learnt = a.learn(&list, 0.0);
        assert_eq!(
            (learnt.loaded, learnt.new),
            (vec!["chat".into()], vec!["chat".into()])
        );
        assert_eq!(
            a.resolve(Some("chat")).eligible_model.as_deref(),
            Some("base")
        );
        assert_eq!(a.dropped(Dropped::Invalid), 2);
        // Known now: listed again, it is loaded there, not new.
        let learnt = a.learn(&list, 0.0);
        assert_eq!((learnt.loaded, learnt.new), (vec!["chat".into()], vec![]));
        assert_eq!(
            a.listed(),
            [
                ("chat".to_owned(), Some("base".to_owned())),
                ("sql".to_owned(), Some("base".to_owned()))
            ]
        );
        // Only a configured adapter has a path the router loads.
        assert_eq!(a.path_of("sql").as_deref(), Some("/adapters/sql"));
        assert_eq!(a.path_of("chat"), None);
    }

    #[test]
    fn a_card_that_would_shadow_a_base_model_or_name_no_base_is_not_learned() {
        let mut a = Catalogue::default();
        // Worker 1 serves "base"; worker 2 lists an "adapter" named
        // "base" (of its own "other"): requests for "base" must not follow it.
        a.learn(&cards(&[(Some("base"), None)]), 0.0);
        let poison = cards(&[(Some("other"), None), (Some("base"), Some("other"))]);
        assert_eq!(a.learn(&poison, 0.0), Learnt::default());
        assert_eq!(a.resolve(Some("base")).adapter, None);
        assert_eq!(a.dropped(Dropped::Shadow), 1);
        // Nor a card whose parent the worker does not serve.
        let orphan = cards(&[(Some("other"), None), (Some("x"), Some("elsewhere"))]);
        assert_eq!(a.learn(&orphan, 0.0), Learnt::default());
        assert_eq!(a.dropped(Dropped::UnknownBase), 1);
        // A learned adapter whose name a worker later lists as a base
        // model is forgotten: the base wins.
        a.learn(
            &cards(&[(Some("base"), None), (Some("sql"), Some("base"))]),
            0.0,
        );
        assert!(a.resolve(Some("sql")).adapter.is_some());
        a.learn(&cards(&[(Some("sql"), None)]), 0.0);
        assert_eq!(a.resolve(Some("sql")).adapter, None);
        assert_eq!(a.dropped(Dropped::Shadow), 2);

        // With [[models]] tables, a parent must be one of them.
        let mut a = Catalogue::default().with_base_models(["qwen"]);
        let list = cards(&[
            (Some("llama"), None),
            (Some("a"), Some("llama")),
            (Some("b"), Some("qwen")),
            (Some("qwen"), Some("llama")),
        ]);
        assert_eq!(a.learn(&list, 0.0).loaded, ["b"]);
        assert_eq!(a.dropped(Dropped::UnknownBase), 1);
        assert_eq!(a.dropped(Dropped::Shadow), 1);
    }

    #[test]
    fn what_no_worker_lists_any_more_is_forgotten() {
        let mut a = Catalogue::default();
        let list = cards(&[(Some("base"), None), (Some("chat"), Some("base"))]);
        a.learn(&list, 0.0);
        // Listed again within the expiry: kept.
        let later = LEARNED_TTL_MS / 2.0;
        a.learn(&list, later);
        assert!(a.sweep(LEARNED_TTL_MS).is_empty());
        assert!(a.resolve(Some("chat")).adapter.is_some());
        // Then never again.
        let expired = a.sweep(later + LEARNED_TTL_MS);
        assert_eq!(expired, vec![Box::<str>::from("chat")]);
        assert_eq!(a.resolve(Some("chat")).adapter, None);
        assert!(a.is_empty());
        assert_eq!(a.dropped(Dropped::Expired), 1);
        assert!(!a.is_base("base"), "base names expire too");
    }

    #[test]
    fn learning_is_bounded_and_every_refusal_counted() {
        let mut a = Catalogue::default();
        let names: Vec<String> = (0..MAX_LEARNED + 10).map(|i| format!("a{i}")).collect();
        let mut list = vec![Card {
            id: Some("base"),
            parent: None,
        }];
        list.extend(names.iter().map(|n| Card {
            id: Some(n),
            parent: Some("base"),
        }));
        let learnt = a.learn(&list, 0.0);
        // One list is read up to MAX_CARDS cards, the base's included.
        assert_eq!(learnt.new.len(), MAX_CARDS.min(MAX_LEARNED + 1) - 1);
        assert!(a.listed().len() <= MAX_LEARNED);
        // Another worker's list of new names: only up to the cap.
        let more: Vec<String> = (0..20).map(|i| format!("b{i}")).collect();
        let mut list = vec![Card {
            id: Some("base"),
            parent: None,
        }];
        list.extend(more.iter().map(|n| Card {
            id: Some(n),
            parent: Some("base"),
        }));
        let learnt = a.learn(&list, 0.0);
        assert_eq!(a.listed().len(), MAX_LEARNED);
        assert_eq!(
            learnt.new.len() as u64 + a.dropped(Dropped::Learned),
            20,
            "each new name is learned or counted"
        );
    }
}
