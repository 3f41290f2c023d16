//! The agent workload's specification: determinism, shared kind prefixes,
//! prompts that grow by answers and tool outputs, sub-agents forked from
//! their parent's context, the context cap, heavy-tailed tool outputs,
//! and chat messages that tokenize to the very prompts the simulator
//! replays.

use super::*;
use proptest::prelude::*;
use std::sync::OnceLock;

/// The bundled tokenizer and its agent vocabulary, loaded once.
fn bundled() -> &'static (Tokenizer, Arc<AgentVocabulary>) {
    static BUNDLED: OnceLock<(Tokenizer, Arc<AgentVocabulary>)> = OnceLock::new();
    BUNDLED.get_or_init(|| {
        let tokenizer = Tokenizer::bundled().expect("the bundled tokenizer loads");
        let vocabulary =
            AgentVocabulary::from_tokenizer(&tokenizer).expect("Qwen3's template composes");
        (tokenizer, Arc::new(vocabulary))
    })
}

/// Short sessions that still take every path: several kinds, tool
/// outputs, fan-outs (often), a cap that ends some sessions.
fn small() -> AgenticConfig {
    AgenticConfig {
        sessions: 40,
        kinds: [60, 90, 120]
            .into_iter()
            .map(|prefix_tokens| AgentKind {
                prefix_tokens,
                weight: 1.0,
            })
            .collect(),
        task_tokens: LogNormal {
            median: 20.0,
            sigma: 0.5,
            min: 5.0,
            max: 80.0,
        },
        calls: LogNormal {
            median: 6.0,
            sigma: 0.6,
            min: 1.0,
            max: 20.0,
        },
        assistant_tokens: LogNormal {
            median: 12.0,
            sigma: 0.5,
            min: 2.0,
            max: 40.0,
        },
        tool_output_tokens: LogNormal {
            median: 30.0,
            sigma: 1.2,
            min: 1.0,
            max: 600.0,
        },
        fan_out: FanOut {
            probability: 0.3,
            calls: LogNormal {
                median: 3.0,
                sigma: 0.5,
                min: 1.0,
                max: 6.0,
            },
            task_tokens: LogNormal::fixed(10.0),
            ..FanOut::default()
        },
        context_cap_tokens: 1_500,
        ..AgenticConfig::default()
    }
}

fn plans(config: AgenticConfig, vocabulary: &AgentVocabulary) -> Vec<AgentSession> {
    config.validate().expect("a valid config");
    agent_sessions(config, vocabulary).collect()
}

fn sessions(config: AgenticConfig, vocabulary: &Arc<AgentVocabulary>) -> Vec<Session> {
    config.validate().expect("a valid config");
    agentic(config, Arc::clone(vocabulary))
        .map(Result::unwrap)
        .collect()
}

/// Every session of `plans`, sub-agents included, depth first.
fn all(plans: &[AgentSession]) -> Vec<&AgentSession> {
    fn walk<'a>(plan: &'a AgentSession, out: &mut Vec<&'a AgentSession>) {
        out.push(plan);
        for call in &plan.calls {
            for child in &call.spawn {
                walk(child, out);
            }
        }
    }
    let mut out = Vec::new();
    for plan in plans {
        walk(plan, &mut out);
    }
    out
}

fn percentile(sorted: &[u32], p: f64) -> u32 {
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}

#[test]
fn the_same_seed_gives_the_same_requests_and_another_seed_other_ones() {
    let vocabulary = Arc::new(AgentVocabulary::synthetic(512));
    let first = sessions(small(), &vocabulary);
    assert_eq!(first.len(), 40);
    assert_eq!(sessions(small(), &vocabulary), first);
    let other = sessions(AgenticConfig { seed: 1, ..small() }, &vocabulary);
    assert_ne!(other, first);
    // Not only the times: the prompts differ too.
    assert_ne!(
        other[0].turns[0].prompt.tokens(),
        first[0].turns[0].prompt.tokens()
    );
    // Arrivals are in order; ids are unique, sub-agents included.
    assert!(first.windows(2).all(|w| w[0].arrival_ms <= w[1].arrival_ms));
    let mut ids = Vec::new();
    for s in &first {
        ids.push(s.id);
        ids.extend(
            s.all_turns()
                .iter()
                .flat_map(|t| t.spawn.iter().map(|c| c.id)),
        );
    }
    let distinct: std::collections::BTreeSet<_> = ids.iter().collect();
    assert_eq!(distinct.len(), ids.len());
}

#[test]
fn every_session_of_a_kind_opens_with_the_kinds_prefix() {
    let (_, vocabulary) = bundled();
    let config = small();
    let plans = plans(config.clone(), vocabulary);
    let rendered: Vec<Session> = plans.iter().map(|p| vocabulary.session(p)).collect();
    let glue = |after, before| vocabulary.glue(after, before).len();
    let opening = glue(None, Some(Role::System));
    let mut firsts: Vec<Option<Vec<u32>>> = vec![None; config.kinds.len()];
    for (plan, session) in plans.iter().zip(&rendered) {
        let prefix = opening
            + config.kinds[plan.kind].prefix_tokens as usize
            + glue(Some(Role::System), Some(Role::User));
        let tokens = session.turns[0].prompt.tokens();
        match &firsts[plan.kind] {
            None => firsts[plan.kind] = Some(tokens[..prefix].to_vec()),
            Some(first) => assert_eq!(&tokens[..prefix], &first[..]),
        }
        // Every call of the session, and of its sub-agents, opens with it.
        for turn in session.all_turns() {
            assert_eq!(turn.prompt.tokens()[..prefix], tokens[..prefix]);
        }
    }
    // Each kind was drawn, and kinds' prefixes differ from their first
    // content token on.
    let firsts: Vec<Vec<u32>> = firsts.into_iter().map(Option::unwrap).collect();
    for (i, a) in firsts.iter().enumerate() {
        for b in &firsts[i + 1..] {
            assert_ne!(a[opening..opening + 16], b[opening..opening + 16]);
        }
    }
    // Sessions of one kind differ after it: their tasks are their own.
    let kind = plans[0].kind;
    let prefix = opening
        + config.kinds[kind].prefix_tokens as usize
        + glue(Some(Role::System), Some(Role::User));
    let same: Vec<Vec<u32>> = plans
        .iter()
        .zip(&rendered)
        .filter(|(p, _)| p.kind == kind)
        .map(|(_, s)| s.turns[0].prompt.tokens()[prefix..].to_vec())
        .collect();
    assert!(same.len() >= 2);
    assert_ne!(same[0], same[1]);
}

#[test]
fn each_call_extends_the_previous_prompt_with_its_answer_and_a_tool_output() {
    let (_, vocabulary) = bundled();
    let plans = plans(small(), vocabulary);
    let mut checked = 0;
    for plan in all(&plans) {
        let session = vocabulary.session(plan);
        for (k, pair) in session.turns.windows(2).enumerate() {
            let (before, after) = (pair[0].prompt.tokens(), pair[1].prompt.tokens());
            let answer = vocabulary.content_ids(&plan.messages[plan.calls[k].prompt_messages]);
            assert_eq!(answer.len(), pair[0].output_tokens as usize);
            let context = [before.clone(), answer].concat();
            assert_eq!(after[..context.len()], context[..]);
            // The rest is the template's text around a tool output.
            let tool = plan.messages[plan.calls[k].prompt_messages + 1];
            assert_eq!(tool.role, Role::Tool);
            assert!(after.len() > context.len() + tool.tokens as usize);
            checked += 1;
        }
    }
    assert!(checked > 100, "{checked}");
}

#[test]
fn sub_agents_start_together_from_the_parents_context() {
    let (_, vocabulary) = bundled();
    let config = small();
    let plans = plans(config.clone(), vocabulary);
    let mut fan_outs = 0;
    for plan in all(&plans) {
        let session = vocabulary.session(plan);
        for (call, turn) in plan.calls.iter().zip(&session.turns) {
            if call.spawn.is_empty() {
                continue;
            }
            fan_outs += 1;
            assert!(call.spawn.len() <= config.fan_out.max_agents as usize);
            // The sub-agents are the tool: no gap of the parent's own.
            assert_eq!(call.pause_ms, 0.0);
            let answer = vocabulary.content_ids(&plan.messages[call.prompt_messages]);
            let context = [turn.prompt.tokens(), answer].concat();
            let mut firsts = Vec::new();
            for (child, rendered) in call.spawn.iter().zip(&turn.spawn) {
                // Together: each arrives the moment the answer ends.
                assert_eq!(child.arrival_ms, 0.0);
                assert_eq!(rendered.arrival_ms, 0.0);
                assert_eq!(child.kind, plan.kind);
                assert_eq!(
                    child.messages[..=call.prompt_messages],
                    plan.messages[..=call.prompt_messages]
                );
                assert_eq!(child.messages[call.prompt_messages + 1].role, Role::User);
                let first = rendered.turns[0].prompt.tokens();
                assert_eq!(first[..context.len()], context[..]);
                firsts.push(first[context.len()..].to_vec());
                // Sub-agents do not fan out again.
                assert!(child.calls.iter().all(|c| c.spawn.is_empty()));
            }
            // Each has a task of its own.
            for (i, a) in firsts.iter().enumerate() {
                for b in &firsts[i + 1..] {
                    assert_ne!(a, b);
                }
            }
        }
    }
    assert!(fan_outs >= 5, "{fan_outs}");
}

#[test]
fn the_chat_messages_tokenize_to_the_prompts_the_simulator_replays() {
    let (tokenizer, vocabulary) = bundled();
    let plans = plans(
        AgenticConfig {
            sessions: 6,
            ..small()
        },
        vocabulary,
    );
    for plan in &plans {
        vocabulary
            .check(tokenizer, plan)
            .unwrap_or_else(|e| panic!("session {}: {e}", plan.id));
    }
    // The roles: the kind's system message, the task, then answers and
    // tool outputs in turn.
    let messages = vocabulary.messages(&plans[0], plans[0].calls.len() - 1);
    let roles: Vec<&str> = messages.iter().map(|m| m.role.as_str()).collect();
    assert_eq!(roles[..2], ["system", "user"]);
    for pair in roles[2..].chunks(2) {
        assert_eq!(pair, ["assistant", "tool"]);
    }
    // Text is words: what a chat client would send.
    assert!(messages[1].content.starts_with(' '));
    assert!(messages[1]
        .content
        .bytes()
        .all(|b| b == b' ' || b.is_ascii_lowercase()));
}

#[test]
fn the_default_workload_checks_against_the_template_too() {
    let (tokenizer, vocabulary) = bundled();
    let plan = agent_sessions(AgenticConfig::default(), vocabulary)
        .next()
        .unwrap();
    // Its first calls (each some thousands of tokens): the default sizes
    // change nothing the template sees.
    let first = AgentSession {
        calls: plan.calls[..plan.calls.len().min(3)].to_vec(),
        ..plan
    };
    vocabulary.check(tokenizer, &first).unwrap();
}

#[test]
fn tool_outputs_are_heavy_tailed() {
    let vocabulary = AgentVocabulary::synthetic(64);
    let plans = plans(AgenticConfig::default(), &vocabulary);
    let mut sizes: Vec<u32> = all(&plans)
        .iter()
        .flat_map(|p| {
            p.messages
                .iter()
                .filter(|m| m.role == Role::Tool)
                .map(|m| m.tokens)
        })
        .collect();
    sizes.sort_unstable();
    assert!(sizes.len() > 5_000, "{}", sizes.len());
    let (p50, p99, max) = (
        percentile(&sizes, 0.5),
        percentile(&sizes, 0.99),
        *sizes.last().unwrap(),
    );
    // Log-normal with sigma 1.5: p99/p50 = e^(2.326 * 1.5), about 33; a
    // light tail (sigma 0.3) would give 2.
    let ratio = f64::from(p99) / f64::from(p50);
    assert!((20.0..50.0).contains(&ratio), "p50 {p50} p99 {p99}");
    // Some reach tens of thousands of tokens.
    assert!(max >= 20_000, "{max}");
}

#[test]
fn the_defaults_give_about_the_published_calls_per_session_and_answer_length() {
    let (_, vocabulary) = bundled();
    let plans = plans(AgenticConfig::default(), vocabulary);
    let calls: Vec<&AgentCall> = all(&plans).iter().flat_map(|p| &p.calls).collect();
    let per_session = calls.len() as f64 / plans.len() as f64;
    let mean_output = calls
        .iter()
        .map(|c| f64::from(c.output_tokens))
        .sum::<f64>()
        / calls.len() as f64;
    let mut prompts: Vec<u32> = calls.iter().map(|c| c.prompt_tokens).collect();
    prompts.sort_unstable();
    let mean_prompt = prompts.iter().map(|&p| f64::from(p)).sum::<f64>() / prompts.len() as f64;
    let sub_agents = all(&plans).len() - plans.len();
    let fan_outs = calls.iter().filter(|c| !c.spawn.is_empty()).count();
    let capped = plans
        .iter()
        .filter(|p| {
            let last = p.calls.last().unwrap();
            u64::from(last.prompt_tokens) + u64::from(last.output_tokens) > 150_000
        })
        .count();
    // The figures docs/simulator.md quotes ("Agent workloads").
    eprintln!(
        "{} sessions, {} calls ({per_session:.1} a session, sub-agents' included), {fan_outs} \
         fan-outs into {sub_agents} sub-agents; prompt tokens mean {mean_prompt:.0}, p50 {}, \
         p90 {}, p99 {}, max {}; answer tokens mean {mean_output:.0}; {capped} sessions \
         reach 150K tokens",
        plans.len(),
        calls.len(),
        percentile(&prompts, 0.5),
        percentile(&prompts, 0.9),
        percentile(&prompts, 0.99),
        prompts.last().unwrap(),
    );
    // Azure's Copilot totals: 9.3M calls over 301K sessions, about 31.
    assert!((26.0..36.0).contains(&per_session), "{per_session}");
    // Mooncake's tool-agent trace: mean output 182 tokens.
    assert!((160.0..200.0).contains(&mean_output), "{mean_output}");
    assert!(fan_outs > 0 && sub_agents >= 2 * fan_outs);
    assert!(*prompts.last().unwrap() <= 200_000);
}

#[test]
fn sessions_of_a_kind_hold_one_copy_of_its_system_message() {
    let vocabulary = Arc::new(AgentVocabulary::synthetic(512));
    let config = small();
    let kinds: Vec<usize> = plans(config.clone(), &vocabulary)
        .iter()
        .map(|p| p.kind)
        .collect();
    let rendered = sessions(config, &vocabulary);
    let first_piece = |s: &Session| match &s.turns[0].prompt {
        PromptSpec::Pieces { pieces, .. } => Arc::clone(&pieces[0]),
        other => panic!("{other:?}"),
    };
    let a = kinds.iter().position(|&k| k == kinds[0]).unwrap();
    let b = kinds
        .iter()
        .skip(a + 1)
        .position(|&k| k == kinds[0])
        .unwrap()
        + a
        + 1;
    assert!(Arc::ptr_eq(
        &first_piece(&rendered[a]),
        &first_piece(&rendered[b])
    ));
}

#[test]
fn a_config_names_what_is_wrong_with_it() {
    assert_eq!(AgenticConfig::default().validate(), Ok(()));
    let field = |config: AgenticConfig| match config.validate() {
        Err(AgenticConfigError::Invalid { field, .. }) => field,
        Ok(()) => "ok",
    };
    let d = AgenticConfig::default;
    assert_eq!(
        field(AgenticConfig {
            sessions_per_sec: 0.0,
            ..d()
        }),
        "sessions_per_sec"
    );
    assert_eq!(
        field(AgenticConfig {
            kinds: Vec::new(),
            ..d()
        }),
        "kinds"
    );
    assert_eq!(
        field(AgenticConfig {
            tool_output_tokens: LogNormal {
                min: 0.0,
                ..d().tool_output_tokens
            },
            ..d()
        }),
        "tool_output_tokens"
    );
    assert_eq!(
        field(AgenticConfig {
            tool_gap_s: LogNormal {
                sigma: -1.0,
                ..d().tool_gap_s
            },
            ..d()
        }),
        "tool_gap_s"
    );
    assert_eq!(
        field(AgenticConfig {
            fan_out: FanOut {
                probability: 1.5,
                ..FanOut::default()
            },
            ..d()
        }),
        "fan_out.probability"
    );
    assert_eq!(
        field(AgenticConfig {
            fan_out: FanOut {
                min_agents: 5,
                max_agents: 4,
                ..FanOut::default()
            },
            ..d()
        }),
        "fan_out"
    );
    // A cap below the first call: the longest prefix (10,000), task
    // (4,000) and answer (2,000), with the template's text.
    assert_eq!(
        field(AgenticConfig {
            context_cap_tokens: 16_000,
            ..d()
        }),
        "context_cap_tokens"
    );
}

#[test]
fn a_config_reads_from_its_serialized_form_with_defaults_for_what_is_left_out() {
    let config: AgenticConfig =
        serde_json::from_str(r#"{"sessions": 7, "fan_out": {"probability": 0.5}}"#).unwrap();
    assert_eq!(config.sessions, 7);
    assert_eq!(config.fan_out.probability, 0.5);
    assert_eq!(config.fan_out.max_agents, FanOut::default().max_agents);
    assert_eq!(config.kinds, AgenticConfig::default().kinds);
    assert!(serde_json::from_str::<AgenticConfig>(r#"{"session": 7}"#).is_err());
    // The seed is the tools' `--seed`, not the file's.
    assert!(serde_json::from_str::<AgenticConfig>(r#"{"seed": 3}"#).is_err());
    // A distribution is given whole.
    assert!(serde_json::from_str::<AgenticConfig>(r#"{"calls": {"median": 3}}"#).is_err());
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    #[test]
    fn no_context_passes_the_cap(
        seed in any::<u64>(),
        cap in 20_000u32..250_000,
        tool_median in 20.0f64..6_000.0,
        tool_sigma in 0.0f64..2.5,
        calls_median in 1.0f64..80.0,
        fan_out in 0.0f64..0.5,
    ) {
        let vocabulary = Arc::new(AgentVocabulary::synthetic(64));
        let config = AgenticConfig {
            sessions: 4,
            seed,
            tool_output_tokens: LogNormal {
                median: tool_median,
                sigma: tool_sigma,
                min: 1.0,
                max: 60_000.0,
            },
            calls: LogNormal { median: calls_median, sigma: 1.0, min: 1.0, max: 400.0 },
            fan_out: FanOut { probability: fan_out, ..FanOut::default() },
            context_cap_tokens: cap,
            ..AgenticConfig::default()
        };
        prop_assert!(config.validate().is_ok());
        let plans: Vec<AgentSession> = agent_sessions(config.clone(), &vocabulary).collect();
        for plan in all(&plans) {
            prop_assert!(!plan.calls.is_empty());
            let session = vocabulary.session(plan);
            for (call, turn) in plan.calls.iter().zip(&session.turns) {
                // The plan's count is the rendered prompt's.
                prop_assert_eq!(turn.prompt.len(), call.prompt_tokens);
                prop_assert!(
                    u64::from(call.prompt_tokens) + u64::from(call.output_tokens)
                        <= u64::from(cap)
                );
            }
        }
    }
}
