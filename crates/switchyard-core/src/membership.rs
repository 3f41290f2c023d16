//! Live discovery's decision: what one discovery source (a watched file,
//! a DNS name) must change in the worker table to make it hold the
//! source's desired set. Pure: the driver reads its table, calls
//! [`plan`], and carries the plan out through its own add and drain.
//!
//! Ownership is the one rule that matters: a source drains only workers it
//! added itself (its `owned` set). A desired worker whose name another
//! holds — a worker from the flags, the config file or the admin API,
//! another source's, or this source's own still draining — is a conflict:
//! skipped now, retried at the next pass, never taken over.
//!
//! Workers are keyed by name; `S` is what the source says of one (its
//! URL and options): a worker whose `S` changed at its source is drained
//! and added again in its new form once the old has left.

use std::collections::{BTreeMap, BTreeSet};

/// A source's workers by name.
pub type WorkerSet<S> = BTreeMap<String, S>;

/// What one pass must do, in this order: drain, then add.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Plan<S> {
    /// Owned workers to add to the table.
    pub add: Vec<S>,
    /// Owned workers to drain and remove (by name): gone from the source,
    /// or changed there (the new form is added once the old has left).
    pub drain: Vec<String>,
    /// Desired names another holds: left alone.
    pub conflicts: Vec<String>,
}

impl<S> Default for Plan<S> {
    fn default() -> Self {
        Self {
            add: Vec::new(),
            drain: Vec::new(),
            conflicts: Vec::new(),
        }
    }
}

/// The plan that takes `owned` (the source's workers now in the table and
/// not draining) to `desired`, leaving every name in `others` (the
/// table's other workers, draining ones included) alone.
///
/// Guarantees: `drain ⊆ owned`; no added name is in `others` or `owned`;
/// applying the plan leaves the source owning exactly the desired workers
/// it can hold — those not in `others`, and not changed in place (those
/// follow once their old form has drained).
pub fn plan<S: Clone + PartialEq>(
    owned: &WorkerSet<S>,
    desired: &WorkerSet<S>,
    others: &BTreeSet<String>,
) -> Plan<S> {
    let mut out = Plan::default();
    for (name, spec) in owned {
        if desired.get(name) != Some(spec) {
            out.drain.push(name.clone());
        }
    }
    for (name, spec) in desired {
        if owned.contains_key(name) {
            continue;
        }
        if others.contains(name) {
            out.conflicts.push(name.clone());
        } else {
            out.add.push(spec.clone());
        }
    }
    out
}

/// `workers` (by name) as a set, at most `limit` of them (the first by
/// name): the set and how many were dropped. A repeated name keeps its
/// first entry and counts as dropped.
pub fn capped<S>(
    workers: impl IntoIterator<Item = (String, S)>,
    limit: usize,
) -> (WorkerSet<S>, usize) {
    let mut all = WorkerSet::new();
    let mut dropped = 0usize;
    for (name, spec) in workers {
        match all.entry(name) {
            std::collections::btree_map::Entry::Vacant(slot) => {
                slot.insert(spec);
            }
            std::collections::btree_map::Entry::Occupied(_) => dropped += 1,
        }
    }
    while all.len() > limit {
        all.pop_last();
        dropped += 1;
    }
    (all, dropped)
}

#[cfg(test)]
#[path = "membership_tests.rs"]
mod tests;
