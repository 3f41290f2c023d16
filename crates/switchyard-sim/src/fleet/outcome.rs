//! The figures a run ends with.

use super::{SimOutcome, Simulation};
use crate::replicas::ReplicaStats;
use crate::report::{
    coefficient_of_variation, Latency, PolicyReport, SpecFigures, SsmFigures, TenantFigures,
};
use std::collections::BTreeMap;
use switchyard_core::admission::{FlowPolicy, TenantId};

impl Simulation {
    /// Figures per named tenant (and the default one, when it sent
    /// anything); none when the run names no tenant.
    fn tenant_figures(&mut self) -> BTreeMap<String, TenantFigures> {
        if self.config.admission.flow.tenants.is_empty() {
            return BTreeMap::new();
        }
        let Ok(policy) = FlowPolicy::new(self.config.admission.flow.clone()) else {
            return BTreeMap::new();
        };
        let mut out = BTreeMap::new();
        for i in 0..policy.tenant_count() {
            let mut tally = self
                .tenants
                .get_mut(i)
                .map(std::mem::take)
                .unwrap_or_default();
            let named = self
                .config
                .admission
                .flow
                .tenants
                .iter()
                .any(|t| t.name == policy.tenant_name(TenantId(i as u16)));
            if named || tally.completed + tally.errors + tally.shed > 0 {
                let name = policy.tenant_name(TenantId(i as u16)).to_owned();
                out.insert(name, tally.figures(self.config.tenant_window_ms.is_some()));
            }
        }
        out
    }

    pub(super) fn outcome(mut self) -> SimOutcome {
        let makespan_ms = (self.last_completion - self.first_arrival.unwrap_or(0.0)).max(1e-9);
        let served: Vec<f64> = self
            .workers
            .iter()
            .map(|w| w.served_tokens as f64)
            .collect();
        let report = PolicyReport {
            ttft_ms: Latency::of(&mut self.ttft),
            itl_ms: Latency::of(&mut self.itl),
            e2e_ms: Latency::of(&mut self.e2e),
            queue_ms: Latency::of(&mut self.queue),
            hit_rate: self.cached_tokens as f64 / self.prompt_tokens.max(1) as f64,
            predicted_hit_rate: self.predicted_tokens as f64 / self.prompt_tokens.max(1) as f64,
            throughput_rps: self.completed as f64 / (makespan_ms / 1000.0),
            output_tokens_per_sec: self.output_tokens as f64 / (makespan_ms / 1000.0),
            load_cv: coefficient_of_variation(&served),
            preemptions: self
                .workers
                .iter()
                .map(|w| w.engine.counters().preemptions)
                .sum(),
            completed: self.completed,
            errors: self.errors,
            shed: self.shed.len() as u64,
            sessions_completed: self.sessions_completed,
            makespan_s: makespan_ms / 1000.0,
            engine_steps: self.workers.iter().map(|w| w.engine.counters().steps).sum(),
            transfers: self.transfers,
            transfer_bytes: self.transfer_bytes,
            transfer_fallbacks: self.transfer_fallbacks,
            spec_decode: self.config.engine.spec_decode.map(|_| {
                let mut f = SpecFigures::default();
                for w in &self.workers {
                    let c = w.engine.counters();
                    f.draft_tokens_proposed += c.draft_tokens_proposed;
                    f.draft_tokens_accepted += c.draft_tokens_accepted;
                    f.rollbacks += c.spec_rollbacks;
                    f.rollback_blocks += c.spec_rollback_blocks;
                    f.fallbacks += c.spec_fallbacks;
                }
                f.acceptance =
                    f.draft_tokens_accepted as f64 / f.draft_tokens_proposed.max(1) as f64;
                f
            }),
            adapters: self.config.adapters.map(|_| self.adapter_figures),
            dp_routing: self.config.dp.map(|dp| dp.routing.name()),
            dp: self.dp.as_ref().map(|dp| super::DpFigures {
                size: dp.config.size,
                requests_per_rank: dp.requests_per_rank.clone(),
                idle_while_queued_share: dp.idle_ms() / makespan_ms,
            }),
            bursts: self.bursts.figures(),
            failures: self.failure_figures(),
            responses_unknown: self.chain_broken,
            tenants: self.tenant_figures(),
            ssm: self.config.engine.hybrid.map(|_| {
                let mut f = SsmFigures::default();
                let mut unusable = 0;
                for w in &self.workers {
                    let c = w.engine.counters();
                    f.checkpoints += c.ssm_checkpoints;
                    f.evictions += c.ssm_checkpoint_evictions;
                    f.resumes += c.ssm_resumes;
                    unusable += c.ssm_unusable_hit_tokens;
                }
                f.unusable_hit_share = unusable as f64 / self.prompt_tokens.max(1) as f64;
                f
            }),
        };
        let decisions = self.decisions.max(1) as f64;
        let replicas = ReplicaStats {
            replicas: self.replicas.len(),
            sync: self.config.replicas.sync,
            sync_delay_ms: self.config.replicas.sync_delay_ms,
            routed_per_replica: self.replicas.iter().map(|r| r.routed).collect(),
            remote_applied: self
                .replicas
                .iter()
                .map(|r| r.dispatcher.router().remote().counters().applied)
                .sum(),
            remote_ignored: self
                .replicas
                .iter()
                .map(|r| r.dispatcher.router().remote().counters().ignored)
                .sum(),
            view_error_requests: self.view_error_sum / decisions,
            excess_requests: self.excess_sum / decisions,
        };
        SimOutcome {
            report,
            timeline: self.timeline,
            ttft_samples_ms: self.ttft,
            replicas,
            shed: self.shed,
        }
    }
}
