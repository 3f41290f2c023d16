//! Fan-out bursts: the sessions one turn spawns start together from its
//! context, so their first prompts share a prefix no other request may
//! hold yet. Whether the fleet computed that shared prefix once is what
//! placing a burst well buys; this module counts it.
//!
//! A burst's shared prefix is the common prefix of its sessions' first
//! prompts, in whole blocks (a burst sharing less than one block is not
//! counted). A member *computed* the prefix when its first call found
//! fewer of its tokens cached than the prefix holds; a burst computed it
//! **once** when at most one member did (none: the spawning worker still
//! held it). A burst is **quiet** when it started while no engine had a
//! request waiting for room: the fleet below its busy threshold, where a
//! second prefill is capacity lost rather than a queue avoided.

use crate::report::BurstFigures;
use crate::workload::Session;
use rustc_hash::FxHashMap;

/// What each burst's first calls found cached. Only bursts with a member
/// still to report are held; a complete one is folded into the figures.
#[derive(Default)]
pub(super) struct Bursts {
    /// Open bursts, by a number of their own.
    open: FxHashMap<u64, Tally>,
    /// The burst of each member whose first call has not ended yet.
    of: FxHashMap<u64, u64>,
    next: u64,
    /// Complete bursts' figures; `None` until a burst opens.
    done: Option<BurstFigures>,
}

struct Tally {
    shared_tokens: u64,
    quiet: bool,
    members: u32,
    reported: u32,
    computing: u32,
}

impl Bursts {
    /// Sessions spawned together: a burst when there are two or more and
    /// their first prompts share at least one whole block.
    pub(super) fn open(&mut self, members: &[Session], block_size: u32, quiet: bool) {
        if members.len() < 2 || block_size == 0 {
            return;
        }
        let shared = shared_prefix(members);
        let shared_tokens = shared - shared % u64::from(block_size);
        if shared_tokens == 0 {
            return;
        }
        let burst = self.next;
        self.next += 1;
        self.open.insert(
            burst,
            Tally {
                shared_tokens,
                quiet,
                members: members.len() as u32,
                reported: 0,
                computing: 0,
            },
        );
        self.done.get_or_insert_with(BurstFigures::default);
        for m in members {
            self.of.insert(m.id, burst);
        }
    }

    /// `session`'s first call ended with `cached_tokens` of its prompt
    /// found cached (nothing when `session` is not a burst's member).
    pub(super) fn first_call_ended(&mut self, session: u64, cached_tokens: u64) {
        let Some(burst) = self.of.remove(&session) else {
            return;
        };
        let Some(t) = self.open.get_mut(&burst) else {
            return;
        };
        t.reported += 1;
        if cached_tokens < t.shared_tokens {
            t.computing += 1;
        }
        if t.reported < t.members {
            return;
        }
        let t = self.open.remove(&burst).expect("just read");
        let f = self.done.get_or_insert_with(BurstFigures::default);
        let once = t.computing <= 1;
        f.bursts += 1;
        f.once += u64::from(once);
        f.quiet += u64::from(t.quiet);
        f.quiet_once += u64::from(t.quiet && once);
        f.shared_tokens += t.shared_tokens;
        f.computed_tokens += t.shared_tokens * u64::from(t.computing);
    }

    /// `session` ended; a member whose first call never ended (shed or
    /// failed) leaves its burst uncounted.
    pub(super) fn forget(&mut self, session: u64) {
        if let Some(burst) = self.of.remove(&session) {
            self.open.remove(&burst);
        }
    }

    /// The figures, over bursts whose every member's first call ended;
    /// `None` when the run had no burst.
    pub(super) fn figures(&self) -> Option<BurstFigures> {
        self.done.clone()
    }
}

/// The length of the common prefix of `members`' first prompts.
fn shared_prefix(members: &[Session]) -> u64 {
    let mut prompts = members
        .iter()
        .filter_map(|m| m.turns.first())
        .map(|t| t.prompt.tokens());
    let Some(first) = prompts.next() else {
        return 0;
    };
    let mut shared = first.len();
    for p in prompts {
        shared = first
            .iter()
            .zip(&p)
            .take(shared)
            .take_while(|(a, b)| a == b)
            .count();
    }
    shared as u64
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::workload::{PromptSpec, SessionFlow, Turn};

    fn member(id: u64, prompt: Vec<u32>) -> Session {
        Session {
            id,
            arrival_ms: 0.0,
            think_time_ms: 0.0,
            turns: vec![Turn::new(PromptSpec::Tokens(prompt.into()), 8)],
            flow: SessionFlow::default(),
        }
    }

    /// Three members sharing 40 tokens, then their own task.
    fn burst_of_three() -> Vec<Session> {
        (0..3)
            .map(|i| {
                let mut p: Vec<u32> = (0..40).collect();
                p.extend([1000 + i as u32; 10]);
                member(i, p)
            })
            .collect()
    }

    #[test]
    fn the_shared_prefix_is_counted_in_whole_blocks_and_a_burst_needs_two_members_and_one_block() {
        let mut b = Bursts::default();
        b.open(&burst_of_three(), 16, true);
        assert_eq!(b.open.values().next().unwrap().shared_tokens, 32);
        b.open(&burst_of_three()[..1], 16, true);
        b.open(&burst_of_three(), 64, true);
        assert_eq!(
            b.open.len(),
            1,
            "one member, or less than a block shared: no burst"
        );
    }

    #[test]
    fn a_burst_computed_once_when_at_most_one_member_missed_the_shared_prefix() {
        let mut b = Bursts::default();
        b.open(&burst_of_three(), 16, true);
        b.first_call_ended(0, 0);
        b.first_call_ended(1, 32);
        b.first_call_ended(2, 48);
        let f = b.figures().expect("a burst");
        assert_eq!((f.bursts, f.once, f.quiet, f.quiet_once), (1, 1, 1, 1));
        assert_eq!((f.shared_tokens, f.computed_tokens), (32, 32));

        let mut b = Bursts::default();
        b.open(&burst_of_three(), 16, false);
        b.first_call_ended(0, 0);
        b.first_call_ended(1, 16);
        b.first_call_ended(2, 32);
        let f = b.figures().expect("a burst");
        assert_eq!((f.bursts, f.once, f.quiet, f.quiet_once), (1, 0, 0, 0));
        assert_eq!(f.computed_tokens, 64, "two members computed it");
    }

    #[test]
    fn a_burst_with_a_member_that_never_ran_is_not_counted_and_others_are_untouched() {
        let mut b = Bursts::default();
        b.open(&burst_of_three(), 16, true);
        b.first_call_ended(0, 0);
        b.forget(1);
        b.first_call_ended(2, 0);
        b.first_call_ended(7, 0);
        assert_eq!(b.figures().expect("a burst opened").bursts, 0);
        assert!(b.of.is_empty(), "nothing is kept for ended members");
        assert!(b.open.is_empty(), "nor for a burst that cannot complete");
        assert_eq!(Bursts::default().figures(), None);
    }
}
