//! Tenants and bands through the dispatcher: strict priority, concurrency
//! caps released when requests end, shedding, deadlines.

use super::tests::{dispatcher_with, place, submission};
use super::*;
use crate::admission::{Band, FlowConfig, TenantConfig, TenantId};

/// One worker; 5,000 prompt tokens make it busy (half of 8,192).
fn busy_fleet(flow: FlowConfig) -> Dispatcher {
    let mut config = DispatcherConfig::default();
    config.router.busy_threshold = Some(0.5);
    config.admission.flow = flow;
    dispatcher_with(config, false, 1)
}

fn big(d: &Dispatcher, tenant: Option<&str>, band: Option<&str>, now: f64) -> Submission {
    Submission {
        prompt_tokens: 5_000,
        flow: d.flows().resolve(tenant, band, None, 0, now).unwrap(),
        ..Submission::default()
    }
}

fn stats(d: &Dispatcher, tenant: u16, band: u8) -> crate::admission::FlowStats {
    d.flow_counters()
        .into_iter()
        .find(|s| s.tenant.0 == tenant && s.band.0 == band)
        .unwrap()
}

#[test]
fn a_waiting_request_of_a_higher_band_is_placed_first() {
    let mut d = busy_fleet(FlowConfig::default());
    let first = big(&d, None, Some("standard"), 0.0);
    let _ = place(&mut d, 1, first, 0.0);
    // The default tenant's ceiling is its own band: set the flows as a
    // tenant allowed the critical band would resolve them.
    let low = big(&d, None, Some("standard"), 0.0);
    let mut high = big(&d, None, None, 1.0);
    high.flow.band = Band(0);
    assert!(d
        .submit(RequestId(2), low, 0.0)
        .unwrap()
        .1
        .dispatch
        .is_empty());
    assert!(d
        .submit(RequestId(3), high, 1.0)
        .unwrap()
        .1
        .dispatch
        .is_empty());
    let fx = d.finish(RequestId(1), 5_010, 100.0);
    let sent: Vec<_> = fx.dispatch.iter().map(|s| s.id).collect();
    assert_eq!(sent, vec![RequestId(3)]);
    let fx = d.finish(RequestId(3), 5_010, 200.0);
    assert_eq!(fx.dispatch[0].id, RequestId(2));
}

#[test]
fn a_tenant_at_its_cap_waits_until_one_of_its_requests_ends() {
    let mut capped = TenantConfig::named("capped");
    capped.max_concurrency = Some(1);
    let mut d = dispatcher_with(
        DispatcherConfig {
            admission: crate::admission::AdmissionConfig {
                flow: FlowConfig {
                    tenants: vec![capped],
                    ..FlowConfig::default()
                },
                ..Default::default()
            },
            ..DispatcherConfig::default()
        },
        false,
        2,
    );
    let s = |d: &Dispatcher, first| Submission {
        flow: d
            .flows()
            .resolve(Some("capped"), None, None, 0, 0.0)
            .unwrap(),
        ..submission(first, 4)
    };
    let one = s(&d, 0);
    let _ = place(&mut d, 1, one, 0.0);
    let (_, fx) = d.submit(RequestId(2), s(&d, 100), 0.0).unwrap();
    assert!(
        fx.dispatch.is_empty(),
        "idle workers, but the tenant is at its cap"
    );
    // Another tenant is not held back.
    let _ = place(&mut d, 3, submission(200, 4), 0.0);
    let fx = d.abort(RequestId(1), 10.0);
    assert_eq!(fx.dispatch.len(), 1);
    assert_eq!(fx.dispatch[0].id, RequestId(2));
    assert_eq!(d.admission().queue().in_flight(TenantId(1)), 1);
    let _ = d.finish(RequestId(2), 100, 20.0);
    assert_eq!(d.admission().queue().in_flight(TenantId(1)), 0);
}

#[test]
fn a_sheddable_request_no_worker_takes_is_shed_at_once_with_a_retry_after() {
    let mut d = busy_fleet(FlowConfig::default());
    let first = big(&d, None, None, 0.0);
    let _ = place(&mut d, 1, first, 0.0);
    let shed = big(&d, None, Some("sheddable"), 1.0);
    let (_, fx) = d.submit(RequestId(2), shed, 1.0).unwrap();
    assert!(fx.dispatch.is_empty());
    assert_eq!(
        fx.shed,
        vec![Shed {
            id: RequestId(2),
            reason: ShedReason::Overload,
            retry_after_ms: 1_000,
        }]
    );
    assert!(!d.is_known(RequestId(2)));
    assert!(d.admission().queue().is_empty(), "it never waits");
    assert_eq!(stats(&d, 0, 2).counters.shed, 1);
}

#[test]
fn a_sheddable_request_behind_waiting_requests_is_shed_without_a_route() {
    let mut d = busy_fleet(FlowConfig::default());
    let first = big(&d, None, None, 0.0);
    let _ = place(&mut d, 1, first, 0.0);
    let waits = big(&d, None, None, 0.0);
    let _ = d.submit(RequestId(2), waits, 0.0).unwrap();
    let small = Submission {
        flow: d
            .flows()
            .resolve(None, Some("sheddable"), None, 0, 0.0)
            .unwrap(),
        ..submission(50, 1)
    };
    let (_, fx) = d.submit(RequestId(3), small, 1.0).unwrap();
    assert_eq!(fx.shed.len(), 1);
    assert_eq!(fx.counts.decisions, 0, "shed before any routing");
    assert_eq!(d.admission().queue().len(), 1);
}

#[test]
fn a_sheddable_request_a_worker_takes_is_placed() {
    let mut d = busy_fleet(FlowConfig::default());
    let s = Submission {
        flow: d
            .flows()
            .resolve(None, Some("sheddable"), None, 0, 0.0)
            .unwrap(),
        ..submission(0, 4)
    };
    let sent = place(&mut d, 1, s, 0.0);
    assert_eq!(sent.id, RequestId(1));
    assert_eq!(stats(&d, 0, 2).counters.dispatched, 1);
}

fn with_deadline(d: &Dispatcher, prompt_tokens: u32, budget_ms: &str, now: f64) -> Submission {
    Submission {
        prompt_tokens,
        flow: d
            .flows()
            .resolve(None, None, Some(budget_ms), 0, now)
            .unwrap(),
        ..Submission::default()
    }
}

#[test]
fn with_refuse_late_a_deadline_the_estimate_cannot_meet_is_shed_at_submit() {
    let flow = FlowConfig {
        refuse_late: true,
        ..FlowConfig::default()
    };
    let mut d = busy_fleet(flow);
    let estimate = d.estimator().config().model_ms(5_000);
    assert!(estimate > 2.0, "the model needs time for 5,000 tokens");
    let (_, fx) = d
        .submit(RequestId(1), with_deadline(&d, 5_000, "1", 0.0), 0.0)
        .unwrap();
    assert_eq!(fx.shed.len(), 1);
    assert_eq!(fx.shed[0].reason, ShedReason::Late);
    assert_eq!(stats(&d, 0, 1).counters.late, 1);
    // A deadline it can meet is placed.
    let budget = format!("{}", estimate.ceil() as u64 + 10);
    let two = with_deadline(&d, 5_000, &budget, 0.0);
    let sent = place(&mut d, 2, two, 0.0);
    assert_eq!(sent.id, RequestId(2));
}

#[test]
fn without_refuse_late_a_deadline_only_orders() {
    let mut d = busy_fleet(FlowConfig::default());
    let first = big(&d, None, None, 0.0);
    let _ = place(&mut d, 1, first, 0.0);
    let _ = d
        .submit(RequestId(2), with_deadline(&d, 5_000, "5000", 0.0), 0.0)
        .unwrap();
    let (_, fx) = d
        .submit(RequestId(3), with_deadline(&d, 5_000, "1", 0.0), 0.0)
        .unwrap();
    assert!(fx.shed.is_empty(), "not refused");
    let fx = d.finish(RequestId(1), 5_000, 100.0);
    assert_eq!(
        fx.dispatch[0].id,
        RequestId(3),
        "the earlier deadline first"
    );
    let s = stats(&d, 0, 1);
    assert_eq!(s.counters.missed_deadline, 1);
}

#[test]
fn with_refuse_late_a_waiting_request_is_shed_once_its_deadline_cannot_be_met() {
    let flow = FlowConfig {
        refuse_late: true,
        ..FlowConfig::default()
    };
    let mut d = busy_fleet(flow);
    // A long prefill keeps the worker busy (its load decays over its
    // expected prefill time, much longer than this test's clock).
    let first = Submission {
        prompt_tokens: 200_000,
        ..big(&d, None, None, 0.0)
    };
    let _ = place(&mut d, 1, first, 0.0);
    let estimate = d.estimator().config().model_ms(5_000);
    assert!(d.estimator().config().model_ms(200_000) > 10.0 * estimate);
    let budget = estimate.ceil() + 500.0;
    let s = with_deadline(&d, 5_000, &format!("{budget}"), 0.0);
    let (_, fx) = d.submit(RequestId(2), s, 0.0).unwrap();
    assert!(fx.shed.is_empty() && fx.dispatch.is_empty(), "it waits");
    // The driver is woken when it becomes late.
    let wake = d.next_wakeup_ms();
    assert!(wake <= budget - estimate + 1e-6, "{wake}");
    assert!(d.tick(wake.min(budget - estimate - 1.0)).shed.is_empty());
    let fx = d.tick(budget - estimate + 1.0);
    assert_eq!(fx.shed.len(), 1);
    assert_eq!(fx.shed[0].reason, ShedReason::Late);
    assert!(!d.is_known(RequestId(2)));
    assert_eq!(d.admission().queue().len(), 0);
}

#[test]
fn reserved_capacity_places_a_top_band_request_where_a_lower_band_one_waits() {
    let flow = FlowConfig {
        reserve_for_top_band: 0.5,
        ..FlowConfig::default()
    };
    let mut d = busy_fleet(flow);
    // 3,000 of 8,192 batched tokens: under the busy threshold (4,096),
    // over the lower bands' half of it (2,048).
    let load = Submission {
        prompt_tokens: 3_000,
        flow: Flow {
            band: Band(0),
            ..Flow::default()
        },
        ..Submission::default()
    };
    let _ = place(&mut d, 1, load, 0.0);
    let standard = Submission {
        prompt_tokens: 10,
        flow: d.flows().resolve(None, None, None, 0, 0.0).unwrap(),
        ..Submission::default()
    };
    assert_eq!(standard.flow.band, Band(1));
    let (_, fx) = d.submit(RequestId(2), standard, 0.0).unwrap();
    assert!(
        fx.dispatch.is_empty(),
        "the standard band finds the worker busy"
    );
    let critical = Submission {
        prompt_tokens: 10,
        flow: Flow {
            band: Band(0),
            ..Flow::default()
        },
        ..Submission::default()
    };
    let sent = place(&mut d, 3, critical, 0.0);
    assert_eq!(sent.id, RequestId(3));
    assert_eq!(
        d.admission().queue().len(),
        1,
        "the standard request still waits"
    );
}

/// One worker, busy at 4,096 prompt tokens; `reserve` of it held back
/// for light tenants. A "noisy" tenant fills it with a 5,000-token request
/// and queues three of 2,500 behind (a light tenant was served just
/// before when `light_first`); then the big one ends. Returns the
/// dispatcher and how many of the three were placed.
fn noisy_backlog(reserve: f64, light_first: bool) -> (Dispatcher, usize) {
    let flow = FlowConfig {
        tenants: vec![TenantConfig::named("light"), TenantConfig::named("noisy")],
        reserve_for_light_tenants: reserve,
        ..FlowConfig::default()
    };
    let mut d = busy_fleet(flow);
    let of = |d: &Dispatcher, tenant, tokens| Submission {
        prompt_tokens: tokens,
        flow: d.flows().resolve(Some(tenant), None, None, 0, 0.0).unwrap(),
        ..Submission::default()
    };
    if light_first {
        let light = of(&d, "light", 10);
        let _ = place(&mut d, 100, light, 0.0);
        let _ = d.finish(RequestId(100), 20, 1.0);
    }
    let first = of(&d, "noisy", 5_000);
    let _ = place(&mut d, 1, first, 1.0);
    for id in 2..=4 {
        let s = of(&d, "noisy", 2_500);
        let (_, fx) = d.submit(RequestId(id), s, 1.0).unwrap();
        assert!(fx.dispatch.is_empty(), "the worker is busy");
    }
    let fx = d.finish(RequestId(1), 5_010, 2.0);
    (d, fx.dispatch.len())
}

#[test]
fn a_tenant_over_its_share_leaves_the_light_tenants_reserve_free() {
    // Without a reserve the backlog fills the worker to the threshold: two
    // of 2,500 tokens fit under 4,096.
    let (_, placed) = noisy_backlog(0.0, true);
    assert_eq!(placed, 2);
    // With half held back, a backlogged tenant stops at 2,048: one fits.
    let (mut d, placed) = noisy_backlog(0.5, true);
    assert_eq!(placed, 1);
    // A light tenant's request (nothing else of it waiting) may use the
    // reserve at once, while the noisy tenant's two still wait.
    let light = Submission {
        prompt_tokens: 10,
        flow: d
            .flows()
            .resolve(Some("light"), None, None, 0, 3.0)
            .unwrap(),
        ..Submission::default()
    };
    let sent = place(&mut d, 101, light, 3.0);
    assert_eq!(sent.id, RequestId(101));
    assert_eq!(d.admission().queue().len(), 2);
}

#[test]
fn a_tenant_alone_is_not_held_back_by_the_light_tenants_reserve() {
    // No other tenant was served within the active window: the reserve
    // keeps nothing idle.
    let (_, placed) = noisy_backlog(0.5, false);
    assert_eq!(placed, 2);
}

#[test]
fn a_reserve_without_a_busy_threshold_is_refused() {
    let mut config = DispatcherConfig::default();
    config.admission.flow.reserve_for_top_band = 0.2;
    assert!(matches!(
        Dispatcher::new(config.clone(), None),
        Err(DispatcherConfigError::ReserveWithoutBusyThreshold { .. })
    ));
    config.router.busy_threshold = Some(0.8);
    assert!(Dispatcher::new(config.clone(), None).is_ok());
    config.router.busy_threshold = None;
    config.admission.flow.reserve_for_top_band = 0.0;
    config.admission.flow.reserve_for_light_tenants = 0.3;
    assert!(matches!(
        Dispatcher::new(config, None),
        Err(DispatcherConfigError::ReserveWithoutBusyThreshold {
            what: "reserve_for_light_tenants",
            ..
        })
    ));
}

#[test]
fn a_capped_tenants_waiting_request_does_not_get_a_sheddable_one_shed() {
    let mut capped = TenantConfig::named("capped");
    capped.max_concurrency = Some(1);
    let mut d = busy_fleet(FlowConfig {
        tenants: vec![capped],
        ..FlowConfig::default()
    });
    let s = |d: &Dispatcher, first| Submission {
        flow: d
            .flows()
            .resolve(Some("capped"), None, None, 0, 0.0)
            .unwrap(),
        ..submission(first, 4)
    };
    let one = s(&d, 0);
    let _ = place(&mut d, 1, one, 0.0);
    let two = s(&d, 100);
    assert!(d
        .submit(RequestId(2), two, 0.0)
        .unwrap()
        .1
        .dispatch
        .is_empty());
    // The worker has room; only the cap holds request 2 back.
    let shed = Submission {
        flow: d
            .flows()
            .resolve(None, Some("sheddable"), None, 0, 0.0)
            .unwrap(),
        ..submission(200, 4)
    };
    let sent = place(&mut d, 3, shed, 0.0);
    assert_eq!(sent.id, RequestId(3));
}

#[test]
fn one_tenants_backlog_cannot_fill_the_queue_for_another() {
    let mut config = DispatcherConfig::default();
    config.router.busy_threshold = Some(0.5);
    config.admission.queue.default_limits.max_requests = 3;
    config.admission.flow = FlowConfig {
        tenants: vec![TenantConfig::named("noisy"), TenantConfig::named("quiet")],
        ..FlowConfig::default()
    };
    let mut d = dispatcher_with(config, false, 1);
    let first = big(&d, Some("noisy"), None, 0.0);
    let _ = place(&mut d, 1, first, 0.0);
    // The worker is busy: noisy's next three wait, its fourth is refused.
    for id in 2..=4 {
        let s = big(&d, Some("noisy"), None, 0.0);
        assert!(d.submit(RequestId(id), s, 0.0).is_ok(), "{id}");
    }
    let s = big(&d, Some("noisy"), None, 0.0);
    assert!(matches!(
        d.submit(RequestId(5), s, 0.0),
        Err(Refused::Full { .. })
    ));
    // The quiet tenant still has its own room. It joins at noisy's
    // virtual time (no banked credit), so it goes second: after noisy's
    // head (a tie goes to the lower tenant id), before noisy's others.
    let s = big(&d, Some("quiet"), None, 1.0);
    assert!(d.submit(RequestId(6), s, 1.0).is_ok());
    let fx = d.finish(RequestId(1), 5_010, 100.0);
    assert_eq!(fx.dispatch[0].id, RequestId(2));
    let fx = d.finish(RequestId(2), 5_010, 200.0);
    assert_eq!(fx.dispatch[0].id, RequestId(6));
    let noisy = d.flows().tenant(Some("noisy")).0;
    assert_eq!(stats(&d, noisy, 1).counters.refused, 1);
}
