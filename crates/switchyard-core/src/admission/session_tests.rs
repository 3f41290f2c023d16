use super::*;
use crate::admission::progress_pair;

fn w(id: u64) -> WorkerId {
    WorkerId::new(id)
}

fn facts(id: u128, session: Option<u64>, tokens: u32, now_ms: f64) -> RequestFacts<'static> {
    RequestFacts {
        id: RequestId(id),
        session: session.map(SessionKey),
        context_tokens: tokens,
        uncached_tokens: tokens,
        class: Default::default(),
        eligible: &crate::types::Eligible::Every,
        now_ms,
        flow: Default::default(),
    }
}

fn strategy(config: SessionAwareConfig) -> SessionAwareStrategy {
    SessionAwareStrategy::new(config).unwrap()
}

fn dispatch(s: &mut SessionAwareStrategy, id: u128, worker: WorkerId, now: f64) {
    let (_, progress) = progress_pair();
    let mut out = Vec::new();
    s.on_event(
        &LifecycleEvent::Dispatched {
            id: RequestId(id),
            worker,
            progress,
        },
        now,
        &mut out,
    );
    assert!(out.is_empty());
}

fn complete(s: &mut SessionAwareStrategy, id: u128, context: u64, now: f64) -> Vec<MakeReady> {
    let mut out = Vec::new();
    s.on_event(
        &LifecycleEvent::Completed {
            id: RequestId(id),
            context_tokens: context,
        },
        now,
        &mut out,
    );
    out
}

fn reconcile(s: &mut SessionAwareStrategy, now: f64) -> Vec<MakeReady> {
    let mut out = Vec::new();
    s.on_event(&LifecycleEvent::Reconcile, now, &mut out);
    out
}

#[test]
fn a_peers_binding_sends_the_sessions_next_turn_to_that_worker() {
    let mut s = strategy(SessionAwareConfig::default());
    // Unknown here: the peer served the first turn.
    s.observe_remote_binding(SessionKey(5), w(2), 300, 0.0);
    assert_eq!(
        s.admit(&facts(1, Some(5), 400, 1.0)),
        Admission::Ready(Placement::Exact(w(2)))
    );
    // Known and quiet here: the peer's later turn re-pins it.
    dispatch(&mut s, 1, w(2), 1.0);
    complete(&mut s, 1, 450, 2.0);
    s.observe_remote_binding(SessionKey(5), w(3), 600, 3.0);
    assert_eq!(s.session_worker(SessionKey(5)), Some(w(3)));
    assert_eq!(s.resident_tokens(w(2)), 0);
    assert_eq!(s.counters().remote_bindings, 2);
}

#[test]
fn a_peers_binding_never_moves_a_turn_in_flight_here() {
    let mut s = strategy(SessionAwareConfig::default());
    assert!(matches!(
        s.admit(&facts(1, Some(5), 100, 0.0)),
        Admission::Ready(_)
    ));
    dispatch(&mut s, 1, w(1), 0.0);
    s.observe_remote_binding(SessionKey(5), w(2), 300, 1.0);
    assert_eq!(s.session_worker(SessionKey(5)), Some(w(1)));
    assert_eq!(s.counters().remote_bindings_ignored, 1);
}

/// One turn from admission to completion on `worker`.
fn turn(s: &mut SessionAwareStrategy, id: u128, session: u64, context: u64, worker: WorkerId) {
    assert!(matches!(
        s.admit(&facts(id, Some(session), context as u32, 0.0)),
        Admission::Ready(_)
    ));
    dispatch(s, id, worker, 0.0);
    assert!(complete(s, id, context, 0.0).is_empty());
}

#[test]
fn requests_without_a_session_bypass_and_leave_nothing_behind() {
    let mut s = strategy(Default::default());
    assert_eq!(s.admit(&facts(1, None, 100, 0.0)), Admission::Bypass);
    assert_eq!(s.sessions(), 0);
    assert_eq!(s.tracked_requests(), 0);
}

#[test]
fn a_second_concurrent_turn_waits_for_the_first_and_follows_it_to_its_worker() {
    let mut s = strategy(Default::default());
    assert_eq!(
        s.admit(&facts(1, Some(7), 100, 0.0)),
        Admission::Ready(Placement::Any)
    );
    assert_eq!(s.admit(&facts(2, Some(7), 150, 1.0)), Admission::Defer);
    dispatch(&mut s, 1, w(3), 2.0);
    let ready = complete(&mut s, 1, 140, 3.0);
    assert_eq!(
        ready,
        vec![MakeReady {
            id: RequestId(2),
            placement: Placement::Exact(w(3))
        }]
    );
    // A later turn after the session is quiet goes straight to its worker.
    dispatch(&mut s, 2, w(3), 4.0);
    assert!(complete(&mut s, 2, 300, 5.0).is_empty());
    assert_eq!(
        s.admit(&facts(3, Some(7), 320, 6.0)),
        Admission::Ready(Placement::Exact(w(3)))
    );
}

#[test]
fn an_aborted_turn_releases_the_next_one_and_commits_no_context() {
    let mut s = strategy(Default::default());
    turn(&mut s, 1, 7, 100, w(1));
    s.admit(&facts(2, Some(7), 500, 0.0));
    assert_eq!(s.admit(&facts(3, Some(7), 600, 0.0)), Admission::Defer);
    let mut out = Vec::new();
    s.on_event(&LifecycleEvent::Aborted { id: RequestId(2) }, 1.0, &mut out);
    assert_eq!(out.len(), 1);
    assert_eq!(out[0].id, RequestId(3));
    assert_eq!(s.worker_usage(w(1)), Some(100 + 100));
}

#[test]
fn strict_affinity_waits_for_a_busy_worker_and_soft_goes_elsewhere() {
    let mut strict = strategy(SessionAwareConfig {
        affinity: Affinity::Strict,
        ..Default::default()
    });
    let mut soft = strategy(Default::default());
    let id = RequestId(1);
    assert_eq!(
        strict.on_unavailable(id, w(1), Unavailable::Busy),
        Fallback::Wait
    );
    assert_eq!(
        soft.on_unavailable(id, w(1), Unavailable::Busy),
        Fallback::Any
    );
    assert_eq!(
        strict.on_unavailable(id, w(1), Unavailable::Invalid),
        Fallback::Any
    );
}

#[test]
fn a_pinned_worker_that_is_not_eligible_is_not_asked_for() {
    let mut s = strategy(Default::default());
    turn(&mut s, 1, 7, 100, w(1));
    let eligible = crate::types::Eligible::Only(vec![w(2)]);
    let f = RequestFacts {
        eligible: &eligible,
        ..facts(2, Some(7), 100, 0.0)
    };
    assert_eq!(s.admit(&f), Admission::Ready(Placement::Any));
    dispatch(&mut s, 2, w(2), 0.0);
    complete(&mut s, 2, 200, 0.0);
    assert_eq!(s.session_worker(SessionKey(7)), Some(w(2)));
    assert_eq!(s.worker_usage(w(1)), Some(0));
    assert_eq!(s.worker_usage(w(2)), Some(300));
}

#[test]
fn under_pressure_idle_sessions_pause_smallest_first_and_resume_best_fit() {
    let mut s = strategy(Default::default());
    s.observe_kv(
        w(1),
        KvUsage {
            capacity_tokens: 10_000,
            used_tokens: None,
        },
    );
    // Footprints 1100 + 2100 + 3100 + 3600 = 9900 > 0.95 × 10000.
    turn(&mut s, 1, 1, 1000, w(1));
    turn(&mut s, 2, 2, 2000, w(1));
    turn(&mut s, 3, 3, 3000, w(1));
    turn(&mut s, 4, 4, 3500, w(1));
    assert_eq!(s.worker_usage(w(1)), Some(9_900));
    assert!(reconcile(&mut s, 10.0).is_empty());
    // 9900 > 9500: pause 1100 (→8800), then 2100 (→6700 ≤ 8000).
    assert!(s.is_paused(SessionKey(1)));
    assert!(s.is_paused(SessionKey(2)));
    assert!(!s.is_paused(SessionKey(3)));
    assert_eq!(s.worker_usage(w(1)), Some(6_700));
    // A paused session's next turn is deferred.
    assert_eq!(s.admit(&facts(5, Some(1), 1000, 11.0)), Admission::Defer);
    // Resume level (0.80 − 0.10) × 10000 = 7000: room 300, nothing fits.
    assert!(reconcile(&mut s, 15.0).is_empty());
    assert_eq!(s.paused_sessions(), 2);
    // Capacity returns: level 0.70 × 15000 = 10500, room 3800: best fit
    // is 2100, then room 1700: 1100 fits too.
    s.observe_kv(
        w(1),
        KvUsage {
            capacity_tokens: 15_000,
            used_tokens: None,
        },
    );
    let ready = reconcile(&mut s, 20.0);
    assert_eq!(s.counters().resumes, 2);
    assert_eq!(
        ready,
        vec![MakeReady {
            id: RequestId(5),
            placement: Placement::Exact(w(1))
        }]
    );
    assert_eq!(s.paused_sessions(), 0);
}

#[test]
fn running_sessions_are_marked_to_pause_when_their_turn_ends() {
    let mut s = strategy(Default::default());
    s.observe_kv(
        w(1),
        KvUsage {
            capacity_tokens: 1_000,
            used_tokens: Some(990),
        },
    );
    s.admit(&facts(1, Some(1), 400, 0.0));
    dispatch(&mut s, 1, w(1), 0.0);
    reconcile(&mut s, 1.0);
    assert_eq!(s.counters().marked, 1);
    assert!(!s.is_paused(SessionKey(1)));
    assert_eq!(s.admit(&facts(2, Some(1), 500, 2.0)), Admission::Defer);
    assert!(complete(&mut s, 1, 450, 3.0).is_empty());
    assert!(s.is_paused(SessionKey(1)));
}

#[test]
fn a_session_paused_past_the_resume_timeout_is_forced_back() {
    let mut s = strategy(SessionAwareConfig {
        resume_timeout_ms: 1_000.0,
        ..Default::default()
    });
    s.observe_kv(
        w(1),
        KvUsage {
            capacity_tokens: 1_000,
            used_tokens: Some(2_000),
        },
    );
    turn(&mut s, 1, 1, 100, w(1));
    reconcile(&mut s, 0.0);
    assert!(s.is_paused(SessionKey(1)));
    assert_eq!(s.admit(&facts(2, Some(1), 150, 10.0)), Admission::Defer);
    assert!(reconcile(&mut s, 999.0).is_empty() && s.is_paused(SessionKey(1)));
    let ready = reconcile(&mut s, 1_000.0);
    assert_eq!(ready.len(), 1);
    assert_eq!(s.counters().forced_resumes, 1);
}

#[test]
fn quiet_sessions_expire_and_the_cap_evicts_the_least_recent() {
    let mut s = strategy(SessionAwareConfig {
        max_sessions: 2,
        session_expiry_ms: 100.0,
        ..Default::default()
    });
    turn(&mut s, 1, 1, 10, w(1));
    turn(&mut s, 2, 2, 10, w(1));
    // Session 3 evicts session 1 (least recently active).
    assert!(matches!(
        s.admit(&facts(3, Some(3), 10, 1.0)),
        Admission::Ready(_)
    ));
    assert_eq!(s.counters().evicted, 1);
    assert!(s.session_worker(SessionKey(1)).is_none());
    // Session 4 evicts session 2, the only quiet one.
    assert!(matches!(
        s.admit(&facts(4, Some(4), 10, 1.0)),
        Admission::Ready(_)
    ));
    // Now 3 and 4 are busy: 5 cannot be retained and bypasses.
    assert_eq!(s.admit(&facts(5, Some(5), 10, 1.0)), Admission::Bypass);
    assert_eq!(s.counters().bypassed_full, 1);
    dispatch(&mut s, 3, w(1), 2.0);
    complete(&mut s, 3, 20, 2.0);
    dispatch(&mut s, 4, w(1), 2.0);
    complete(&mut s, 4, 20, 2.0);
    reconcile(&mut s, 50.0);
    assert_eq!(s.sessions(), 2);
    reconcile(&mut s, 102.0);
    assert_eq!(s.sessions(), 0);
    assert_eq!(s.worker_usage(w(1)), Some(0));
    assert_eq!(s.counters().expired, 2);
}

#[test]
fn duplicate_stale_and_unknown_events_are_harmless() {
    let mut s = strategy(Default::default());
    let mut out = Vec::new();
    s.on_event(&LifecycleEvent::Aborted { id: RequestId(9) }, 0.0, &mut out);
    s.on_event(
        &LifecycleEvent::Completed {
            id: RequestId(9),
            context_tokens: 5,
        },
        0.0,
        &mut out,
    );
    dispatch(&mut s, 9, w(1), 0.0);
    turn(&mut s, 1, 1, 10, w(1));
    assert!(complete(&mut s, 1, 99, 0.0).is_empty());
    dispatch(&mut s, 1, w(2), 0.0);
    assert!(out.is_empty());
    assert_eq!(s.worker_usage(w(1)), Some(110));
    assert_eq!(s.counters().stale_events, 5);
}

#[test]
fn bad_settings_are_refused() {
    let bad = |c: SessionAwareConfig| SessionAwareStrategy::new(c).unwrap_err();
    assert!(matches!(
        bad(SessionAwareConfig {
            pause_target: 0.96,
            ..Default::default()
        }),
        SessionConfigError::TargetAboveThreshold { .. }
    ));
    assert!(matches!(
        bad(SessionAwareConfig {
            pause_threshold: 1.5,
            ..Default::default()
        }),
        SessionConfigError::Fraction { .. }
    ));
    assert!(matches!(
        bad(SessionAwareConfig {
            resume_hysteresis: 0.80,
            ..Default::default()
        }),
        SessionConfigError::Hysteresis(_)
    ));
    assert!(matches!(
        bad(SessionAwareConfig {
            resume_timeout_ms: f64::NAN,
            ..Default::default()
        }),
        SessionConfigError::Duration { .. }
    ));
    assert!(matches!(
        bad(SessionAwareConfig {
            max_sessions: 0,
            ..Default::default()
        }),
        SessionConfigError::MaxSessions
    ));
}

#[test]
fn the_config_rejects_unknown_keys_and_fills_defaults() {
    let parsed: SessionAwareConfig = serde_json::from_str(r#"{"affinity":"strict"}"#).unwrap();
    assert_eq!(parsed.affinity, Affinity::Strict);
    assert_eq!(parsed.pause_threshold, 0.95);
    assert!(serde_json::from_str::<SessionAwareConfig>(r#"{"pause_treshold":0.9}"#).is_err());
}

fn of_tenant(mut f: RequestFacts<'static>, tenant: u16) -> RequestFacts<'static> {
    f.flow.tenant = TenantId(tenant);
    f
}

/// A completed turn of `session` for `tenant` at `now`.
fn tenant_turn(s: &mut SessionAwareStrategy, id: u128, session: u64, tenant: u16, now: f64) {
    let admitted = s.admit(&of_tenant(facts(id, Some(session), 10, now), tenant));
    assert!(matches!(admitted, Admission::Ready(_)), "{admitted:?}");
    dispatch(s, id, w(1), now);
    assert!(complete(s, id, 10, now).is_empty());
}

#[test]
fn a_tenant_at_its_cap_evicts_its_own_oldest_session_never_anothers() {
    let mut s = strategy(SessionAwareConfig {
        max_sessions: 100,
        max_sessions_per_tenant: 2,
        ..Default::default()
    });
    tenant_turn(&mut s, 1, 1, 1, 0.0);
    // Tenant 2 floods: each new session past its cap evicts its own.
    for i in 0..20u64 {
        tenant_turn(&mut s, 100 + u128::from(i), 100 + i, 2, 1.0 + i as f64);
    }
    assert_eq!(s.sessions(), 3);
    assert_eq!(
        s.session_worker(SessionKey(1)),
        Some(w(1)),
        "tenant 1's kept"
    );
    assert_eq!(s.session_worker(SessionKey(119)), Some(w(1)));
    assert_eq!(s.session_worker(SessionKey(117)), None);
    assert_eq!(s.counters().evicted_tenant, 18);
    assert_eq!(s.counters().evicted, 0);
    // With both of its sessions busy, its next new session bypasses.
    let busy = |id: u128, session: u64| of_tenant(facts(id, Some(session), 10, 30.0), 2);
    assert!(matches!(s.admit(&busy(200, 118)), Admission::Ready(_)));
    assert!(matches!(s.admit(&busy(201, 119)), Admission::Ready(_)));
    assert_eq!(s.admit(&busy(202, 300)), Admission::Bypass);
    assert_eq!(s.counters().bypassed_tenant_full, 1);
    // The default tenant is bounded by max_sessions alone.
    for i in 0..5u64 {
        tenant_turn(&mut s, 400 + u128::from(i), 400 + i, 0, 40.0);
    }
    assert_eq!(s.sessions(), 8);
}
