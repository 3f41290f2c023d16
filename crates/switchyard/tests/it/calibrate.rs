//! `switchyard calibrate` against a sim-worker whose timing is known: a
//! profile of non-default coefficients, given with `--engine-profile`,
//! comes back from the live worker's answers within 5% each — the
//! per-sequence cost of a decode step too, fitted with the usage curve
//! (a bigger batch also holds more of the cache).

use crate::support::{machine_alone, scratch_file, sim_worker_with};
use switchyard_commands::calibrate::{calibrate, CalibrateArgs};

/// The known timing: every term large beside what a client adds to the
/// engine's step on loopback (about a millisecond of HTTP and scheduling,
/// which the prefill constant takes in): at 4096 tokens the square term is
/// 134 ms, the linear one 205 ms.
const KNOWN: &str = "prefill = [8e-6, 0.05, 80.0]\ndecode = [-10.0, 40.0, 12.0]\ndecode_floor_ms = 2.0\ndecode_per_sequence_ms = 1.0\n";

#[tokio::test]
async fn a_sim_worker_of_known_timing_is_calibrated_to_its_coefficients_within_5_percent() {
    // Timed to the millisecond: nothing else runs beside it.
    let _machine = machine_alone().await;
    let profile = scratch_file("calibrate-known.toml", KNOWN.as_bytes());
    let profile = profile.display().to_string();
    let worker = sim_worker_with(
        0,
        &[
            "--engine-profile",
            &profile,
            "--num-blocks",
            "1024",
            "--block-size",
            "16",
        ],
    );
    let args = CalibrateArgs {
        workers: vec![worker.base.clone()],
        model: None,
        out: "unused.toml".into(),
        repeats: 3,
        min_prompt_tokens: 256,
        max_prompt_tokens: 4096,
        prompt_sizes: 6,
        decode_batch: 4,
        decode_tokens: 32,
        batch_sizes: vec![1, 4, 16, 32],
        usages: vec![0.1, 0.3, 0.5, 0.7, 0.85],
        num_blocks: None,
        block_size: None,
        seed: 1,
    };
    let calibration = calibrate(&args).await.unwrap();
    assert_eq!(
        calibration.prefill_samples.len(),
        6 * 3,
        "each repeat a sample"
    );
    assert_eq!(calibration.decode_samples.len(), 5 * 3);
    assert_eq!(calibration.sequence_samples.len(), 4 * 3);
    let fitted = calibration.profile;
    assert_eq!(fitted.model.as_deref(), Some("switchyard-sim"));
    assert_eq!(
        (fitted.num_blocks, fitted.block_size),
        (Some(1024), Some(16))
    );
    let close = |got: [f64; 3], want: [f64; 3], what: &str| {
        for (i, (g, w)) in got.iter().zip(want).enumerate() {
            assert!(
                (g - w).abs() <= 0.05 * w.abs(),
                "{what} coefficient {i}: fitted {g}, set {w} (all: {got:?})"
            );
        }
    };
    close(fitted.prefill, [8e-6, 0.05, 80.0], "prefill");
    close(fitted.decode, [-10.0, 40.0, 12.0], "decode");
    close([fitted.decode_per_sequence_ms; 3], [1.0; 3], "per-sequence");
    let fit = fitted.fit.expect("calibrate reports its fit");
    assert_eq!((fit.prefill.x_min, fit.prefill.x_max), (256.0, 4096.0));
    assert!(fit.decode.x_min < 0.2 && fit.decode.x_max > 0.75, "{fit:?}");
}
