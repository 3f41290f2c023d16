//! Which workers may take a request: those in the router (healthy, not
//! removed) that serve its model and are not draining, and, in a
//! prefill/decode-disaggregated fleet, those of the half's pool
//! ([`Role`]). The answer is an [`Eligible`]: every worker (the common
//! case, made without allocating: this runs under the routing lock for
//! every request), these workers, or none (the request waits or ends; it
//! is never placed elsewhere).
//!
//! A driver describes its workers as [`Candidate`]s; the server from its
//! worker table, a simulator from its engines.

use crate::types::{Eligible, WorkerId};
use serde::{Deserialize, Serialize};

/// A worker's part in a prefill/decode-disaggregated fleet.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Role {
    /// Prefill halves only.
    Prefill,
    /// Decode halves only.
    Decode,
    /// Either half, or whole requests (a worker of a fleet that is not
    /// split).
    #[default]
    Both,
}

impl Role {
    /// Its name in specs, admin answers and metrics.
    pub fn label(self) -> &'static str {
        match self {
            Role::Prefill => "prefill",
            Role::Decode => "decode",
            Role::Both => "both",
        }
    }

    /// Whether a worker of this role is in `pool` (`Prefill` or `Decode`;
    /// `Both` is every worker).
    pub fn in_pool(self, pool: Role) -> bool {
        self == pool || self == Role::Both || pool == Role::Both
    }
}

impl std::str::FromStr for Role {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "prefill" => Ok(Role::Prefill),
            "decode" => Ok(Role::Decode),
            "both" => Ok(Role::Both),
            other => Err(format!(
                "role must be prefill, decode or both, got {other:?}"
            )),
        }
    }
}

/// One worker as eligibility reads it.
#[derive(Clone, Copy, Debug)]
pub struct Candidate<'a> {
    /// Its id.
    pub id: WorkerId,
    /// The models it lists (empty: not known yet, taken as any).
    pub models: &'a [String],
    /// In the router: healthy and not removed.
    pub in_router: bool,
    /// Draining: takes nothing new.
    pub draining: bool,
    /// Its part in a disaggregated fleet.
    pub role: Role,
}

impl Candidate<'_> {
    fn serves(&self, model: Option<&str>) -> bool {
        match model {
            None => true,
            Some(m) => self.models.is_empty() || self.models.iter().any(|x| x == m),
        }
    }

    /// May take a new request for `model`.
    fn takes(&self, model: Option<&str>) -> bool {
        self.in_router && !self.draining && self.serves(model)
    }
}

/// No worker in the router serves the model the request names (and none
/// is draining: a draining worker's model is still known).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct UnknownModel;

/// The workers that may take a request for `model`: [`Eligible::Every`]
/// when every worker in the router may, else the list (empty when only
/// draining workers serve it); [`UnknownModel`] when none serves it.
pub fn eligible_for<'a, I>(workers: I, model: Option<&str>) -> Result<Eligible, UnknownModel>
where
    I: IntoIterator<Item = Candidate<'a>> + Clone,
{
    // One pass to count, so that the common case allocates nothing.
    let (mut all, mut serving, mut any_draining) = (0usize, 0usize, false);
    for w in workers.clone().into_iter().filter(|w| w.in_router) {
        all += 1;
        any_draining |= w.draining;
        serving += usize::from(w.takes(model));
    }
    if serving == 0 && all > 0 && model.is_some() && !any_draining {
        return Err(UnknownModel);
    }
    if serving == all && !any_draining {
        return Ok(Eligible::Every);
    }
    let mut eligible = Vec::with_capacity(serving);
    eligible.extend(workers.into_iter().filter(|w| w.takes(model)).map(|w| w.id));
    Ok(Eligible::Only(eligible))
}

/// [`eligible_for`] restricted to the workers in `pool` (`Prefill` or
/// `Decode`, and the `Both` ones; `Both`: no restriction). A pool with
/// none up is an empty list: nothing may take that half.
pub fn eligible_in<'a, I>(
    workers: I,
    model: Option<&str>,
    pool: Role,
) -> Result<Eligible, UnknownModel>
where
    I: IntoIterator<Item = Candidate<'a>> + Clone,
{
    let eligible = eligible_for(workers.clone(), model)?;
    if pool == Role::Both {
        return Ok(eligible);
    }
    // The eligible workers are those that take the model (when every
    // worker may, every one does), so one pass keeps those of the pool.
    Ok(Eligible::Only(
        workers
            .into_iter()
            .filter(|w| w.takes(model) && w.role.in_pool(pool))
            .map(|w| w.id)
            .collect(),
    ))
}

/// Whether the fleet is disaggregated: at least one registered worker has
/// role `prefill` and one role `decode` (up or not: a pool whose workers
/// are all down fails its halves rather than sending whole requests to
/// workers set up for one half).
pub fn disaggregated<'a, I>(workers: I) -> bool
where
    I: IntoIterator<Item = Candidate<'a>> + Clone,
{
    let has = |role| workers.clone().into_iter().any(|w| w.role == role);
    has(Role::Prefill) && has(Role::Decode)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Workers `1..`, each in the router, serving `models`, of role Both.
    struct Fleet {
        models: Vec<Vec<String>>,
        draining: Vec<bool>,
        in_router: Vec<bool>,
        roles: Vec<Role>,
    }

    impl Fleet {
        fn new(workers: &[&[&str]]) -> Self {
            let n = workers.len();
            Self {
                models: workers
                    .iter()
                    .map(|m| m.iter().map(|s| s.to_string()).collect())
                    .collect(),
                draining: vec![false; n],
                in_router: vec![true; n],
                roles: vec![Role::Both; n],
            }
        }

        fn candidates(&self) -> impl Iterator<Item = Candidate<'_>> + Clone {
            (0..self.models.len()).map(|i| Candidate {
                id: WorkerId::new(i as u64 + 1),
                models: &self.models[i],
                in_router: self.in_router[i],
                draining: self.draining[i],
                role: self.roles[i],
            })
        }

        fn eligible_for(&self, model: Option<&str>) -> Result<Eligible, UnknownModel> {
            eligible_for(self.candidates(), model)
        }

        fn eligible_in(&self, model: Option<&str>, pool: Role) -> Result<Eligible, UnknownModel> {
            eligible_in(self.candidates(), model, pool)
        }

        fn disaggregated(&self) -> bool {
            disaggregated(self.candidates())
        }
    }

    #[test]
    fn every_worker_serving_the_model_means_any_worker() {
        let f = Fleet::new(&[&["m"], &["m"]]);
        assert_eq!(f.eligible_for(Some("m")), Ok(Eligible::Every));
        assert_eq!(f.eligible_for(None), Ok(Eligible::Every));
    }

    #[test]
    fn only_workers_serving_the_model_are_eligible() {
        let f = Fleet::new(&[&["m"], &["n"]]);
        assert_eq!(
            f.eligible_for(Some("n")),
            Ok(Eligible::one(WorkerId::new(2)))
        );
        assert_eq!(f.eligible_for(Some("x")), Err(UnknownModel));
    }

    #[test]
    fn a_draining_worker_takes_nothing_new() {
        let mut f = Fleet::new(&[&["m"]]);
        f.draining[0] = true;
        assert_eq!(f.eligible_for(Some("m")), Ok(Eligible::none()));
    }

    #[test]
    fn a_pool_is_its_roles_workers_and_the_both_ones() {
        let mut f = Fleet::new(&[&[], &[], &[]]);
        assert!(!f.disaggregated());
        assert_eq!(f.eligible_in(None, Role::Both), Ok(Eligible::Every));
        f.roles[0] = Role::Prefill;
        assert!(!f.disaggregated(), "a prefill worker alone is not a split");
        f.roles[1] = Role::Decode;
        assert!(f.disaggregated());
        let sorted = |e: Eligible| {
            let mut v = e.listed().expect("a pool is a list").to_vec();
            v.sort();
            v
        };
        assert_eq!(
            sorted(f.eligible_in(None, Role::Prefill).unwrap()),
            vec![WorkerId::new(1), WorkerId::new(3)]
        );
        assert_eq!(
            sorted(f.eligible_in(None, Role::Decode).unwrap()),
            vec![WorkerId::new(2), WorkerId::new(3)]
        );
        f.roles[2] = Role::Decode;
        f.in_router[0] = false;
        assert_eq!(
            f.eligible_in(None, Role::Prefill),
            Ok(Eligible::none()),
            "no prefill worker up: nothing may take a prefill"
        );
        assert_eq!("decode".parse::<Role>(), Ok(Role::Decode));
        assert!("primary".parse::<Role>().is_err());
    }
}
