//! Many tenants in one workload: each tenant's sessions carry its flow
//! (tenant, band, TTFT budget), and the tenants' streams merge into one in
//! arrival order.

use super::{PromptSpec, Session, SessionStream};
use crate::trace::TraceError;
use switchyard_core::admission::{Band, TenantId};

/// Who sends a session and how urgent it is, for flow control. The
/// default: the default tenant, in its own band, without a deadline.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SessionFlow {
    /// The tenant, as the run's flow policy numbers it.
    pub tenant: TenantId,
    /// The band its turns ask for; `None`: the tenant's own.
    pub band: Option<Band>,
    /// Each turn's time-to-first-token budget, ms.
    pub ttft_budget_ms: Option<u32>,
}

/// `stream` as tenant `flow.tenant`'s: every session carries `flow`, and
/// with a `salt` other than 0 its prompts are made distinct from every
/// other salt's (tenants do not share system prompts or documents). A
/// Mooncake prompt's hash ids and a random prompt's seed are salted;
/// literal token prompts (ShareGPT, synthetic, agentic) are kept as they
/// are. Spawned sessions carry the flow too.
pub fn for_tenant(stream: SessionStream, flow: SessionFlow, salt: u64) -> SessionStream {
    Box::new(stream.map(move |s| {
        s.map(|mut s| {
            set_flow(&mut s, flow);
            if salt != 0 {
                s.for_each_turn_mut(&mut |turn| salt_prompt(&mut turn.prompt, salt));
            }
            s
        })
    }))
}

fn set_flow(session: &mut Session, flow: SessionFlow) {
    session.flow = flow;
    for turn in &mut session.turns {
        for child in &mut turn.spawn {
            set_flow(child, flow);
        }
    }
}

fn salt_prompt(prompt: &mut PromptSpec, salt: u64) {
    // A multiplicative spread keeps salted ids apart from the trace's own
    // (small, dense) ids and from other salts'.
    let offset = salt.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    match prompt {
        PromptSpec::Mooncake { hash_ids, .. } => {
            let salted: Box<[u64]> = hash_ids.iter().map(|h| h ^ offset).collect();
            *hash_ids = salted;
        }
        PromptSpec::Random { seed, .. } => *seed ^= offset,
        PromptSpec::Tokens(_) | PromptSpec::Pieces { .. } => {}
    }
}

/// The sessions of every stream in one stream, in first-arrival order
/// (ties: the earlier stream first), renumbered `0, 1, ...` (spawned
/// sessions numbered after their parent) so that ids stay unique. The first error of any stream ends the merged stream with
/// that error.
pub fn merge(streams: Vec<SessionStream>) -> SessionStream {
    let mut heads: Vec<(SessionStream, Option<Session>)> =
        streams.into_iter().map(|s| (s, None)).collect();
    let mut next_id = 0u64;
    let mut failed = false;
    Box::new(std::iter::from_fn(move || {
        if failed {
            return None;
        }
        for (stream, head) in heads.iter_mut() {
            if head.is_none() {
                match stream.next() {
                    Some(Ok(s)) => *head = Some(s),
                    Some(Err(e)) => {
                        failed = true;
                        return Some(Err::<Session, TraceError>(e));
                    }
                    None => {}
                }
            }
        }
        let (_, head) = heads
            .iter_mut()
            .filter(|(_, h)| h.is_some())
            .min_by(|a, b| {
                let (a, b) = (a.1.as_ref().unwrap(), b.1.as_ref().unwrap());
                a.arrival_ms.total_cmp(&b.arrival_ms)
            })?;
        let mut session = head.take()?;
        session.renumber(&mut next_id);
        Some(Ok(session))
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::workload::Turn;

    fn one(id: u64, at: f64, hash: u64) -> Session {
        Session {
            id,
            arrival_ms: at,
            think_time_ms: 0.0,
            turns: vec![Turn::new(
                PromptSpec::Mooncake {
                    hash_ids: vec![hash].into(),
                    tokens: 16,
                },
                1,
            )],
            flow: SessionFlow::default(),
        }
    }

    fn stream(sessions: Vec<Session>) -> SessionStream {
        Box::new(sessions.into_iter().map(Ok))
    }

    #[test]
    fn streams_merge_in_arrival_order_with_fresh_ids() {
        let a = stream(vec![one(0, 0.0, 1), one(1, 10.0, 2), one(2, 30.0, 3)]);
        let b = stream(vec![one(0, 5.0, 4), one(1, 10.0, 5)]);
        let merged: Vec<Session> = merge(vec![a, b]).map(Result::unwrap).collect();
        let at: Vec<f64> = merged.iter().map(|s| s.arrival_ms).collect();
        assert_eq!(at, vec![0.0, 5.0, 10.0, 10.0, 30.0]);
        let ids: Vec<u64> = merged.iter().map(|s| s.id).collect();
        assert_eq!(ids, vec![0, 1, 2, 3, 4]);
        // A tie goes to the earlier stream.
        assert_eq!(merged[2].turns[0].prompt, one(0, 0.0, 2).turns[0].prompt);
    }

    #[test]
    fn merged_ids_number_spawned_sessions_after_their_parent() {
        let mut parent = one(0, 0.0, 1);
        parent.turns[0].spawn = vec![one(1, 0.0, 2), one(2, 0.0, 3)];
        let a = stream(vec![parent]);
        let b = stream(vec![one(0, 5.0, 4)]);
        let merged: Vec<Session> = merge(vec![a, b]).map(Result::unwrap).collect();
        let spawned: Vec<u64> = merged[0].turns[0].spawn.iter().map(|s| s.id).collect();
        assert_eq!((merged[0].id, spawned, merged[1].id), (0, vec![1, 2], 3));
        // A tenant's flow reaches its spawned sessions.
        let flow = SessionFlow {
            tenant: TenantId(2),
            ..SessionFlow::default()
        };
        let tagged: Vec<Session> = for_tenant(stream(merged), flow, 0)
            .map(Result::unwrap)
            .collect();
        assert_eq!(tagged[0].turns[0].spawn[1].flow, flow);
    }

    #[test]
    fn a_tenants_sessions_carry_its_flow_and_salted_prompts() {
        let flow = SessionFlow {
            tenant: TenantId(3),
            band: Some(Band(2)),
            ttft_budget_ms: Some(500),
        };
        let plain: Vec<Session> = for_tenant(stream(vec![one(0, 0.0, 7)]), flow, 0)
            .map(Result::unwrap)
            .collect();
        let salted: Vec<Session> = for_tenant(stream(vec![one(0, 0.0, 7)]), flow, 1)
            .map(Result::unwrap)
            .collect();
        assert_eq!(plain[0].flow, flow);
        assert_eq!(plain[0].turns, one(0, 0.0, 7).turns);
        assert_ne!(salted[0].turns[0].prompt, plain[0].turns[0].prompt);
        let other: Vec<Session> = for_tenant(stream(vec![one(0, 0.0, 7)]), flow, 2)
            .map(Result::unwrap)
            .collect();
        assert_ne!(salted[0].turns[0].prompt, other[0].turns[0].prompt);
    }

    #[test]
    fn an_error_ends_the_merged_stream() {
        let bad: SessionStream = Box::new(
            vec![Err(TraceError::Malformed {
                line: 1,
                reason: "x".into(),
            })]
            .into_iter(),
        );
        let merged: Vec<_> = merge(vec![stream(vec![one(0, 0.0, 1)]), bad]).collect();
        assert_eq!(merged.len(), 1);
        assert!(merged[0].is_err());
    }
}
