//! The scheduler's tests, by role; the fixtures they share are here.

mod preempt;
mod restore;
mod spec_decode;
mod step;

use super::*;
use crate::checkpoints::CheckpointPolicy;
use crate::config::Preemption;
use crate::device::{AheadDevice, Effect, ScriptedDevice, SyncDevice};
use crate::lease::{LeaseError, LeaseRef, LeasedKv};
use crate::restore::{RestoreError, RestoreOutput};
use crate::slots::SlotId;
use crate::timing::TimingConfig;
use switchyard_core::hashing::DEFAULT_SEED;

fn config() -> EngineConfig {
    EngineConfig {
        block_size: 16,
        num_blocks: 256,
        ..EngineConfig::default()
    }
}

fn request(id: u128, prompt: Vec<u32>, max_tokens: u32) -> NewRequest {
    NewRequest {
        id: RequestId(id),
        prompt,
        max_tokens,
        hash_seed: DEFAULT_SEED,
        lora_name: None,
    }
}

fn run_to_end<D: DeviceLayer>(engine: &mut Engine<D>) -> Vec<StepReport> {
    let mut reports = Vec::new();
    for _ in 0..10_000 {
        if !engine.has_work() {
            return reports;
        }
        let mut report = StepReport::default();
        engine.step(&mut report).unwrap();
        reports.push(report);
    }
    panic!("engine did not drain");
}

fn observations<D: DeviceLayer>(engine: &mut Engine<D>) -> Vec<Observation> {
    let mut out = Vec::new();
    engine.drain_observations(&mut out);
    out
}

/// Two requests of 40 prompt tokens and `max_tokens` outputs, both
/// admitted and prefilled by one step.
fn two_running(cfg: EngineConfig, max_tokens: u32) -> Engine<ScriptedDevice> {
    let mut engine = Engine::new(cfg, ScriptedDevice::new(TimingConfig::default())).unwrap();
    engine
        .add_request(request(1, (0..40).collect(), max_tokens))
        .unwrap();
    engine
        .add_request(request(2, (1_000..1_040).collect(), max_tokens))
        .unwrap();
    let mut report = StepReport::default();
    engine.step(&mut report).unwrap();
    assert_eq!(engine.running_len(), 2);
    engine.device_mut().log.clear();
    engine
}

fn finished_outputs(reports: &[StepReport]) -> Vec<(RequestId, usize)> {
    let mut out: Vec<_> = reports
        .iter()
        .flat_map(|r| r.finished.iter().map(|f| (f.request, f.output_tokens)))
        .collect();
    out.sort();
    out
}
