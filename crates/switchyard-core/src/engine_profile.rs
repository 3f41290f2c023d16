//! [`EngineProfile`]: an engine's timing as measured on it — the
//! coefficients of the timing model's prefill and decode curves (the
//! simulated engine's `TimingConfig`, the router's
//! [`crate::estimate::EstimatorConfig`]), the KV capacity, and how well
//! each curve fits what was measured — in one file format (TOML) that
//! `switchyard calibrate` writes and `sim-worker`, `replay` and `serve`
//! read (`--engine-profile`).
//!
//! The fit is least squares of a quadratic ([`fit_quadratic`]), the form
//! both curves take: prefill model ms against the uncached tokens of a
//! step, decode model ms against the KV usage (0..=1) of a decode-only
//! step; besides them, a straight line of the decode step against the
//! sequences it runs (its slope: `decode_per_sequence_ms`).

use serde::{Deserialize, Serialize};

/// See the module documentation.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EngineProfile {
    /// The model the engine served when it was measured.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    /// Prefill ms `[a, b, c]` in `a·T² + b·T + c` (`T` uncached tokens).
    pub prefill: [f64; 3],
    /// Decode-step ms `[a, b, c]` in `a·u² + b·u + c` (`u` KV usage).
    pub decode: [f64; 3],
    /// Lower bound of a decode step (ms).
    pub decode_floor_ms: f64,
    /// What each running sequence adds to a step, ms (sampling, streaming
    /// and the engine's other per-sequence work; 0 when not measured).
    #[serde(default)]
    pub decode_per_sequence_ms: f64,
    /// Tokens per KV block, when the engine reported it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub block_size: Option<usize>,
    /// Device KV blocks, when the engine reported them.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub num_blocks: Option<usize>,
    /// How the curves were measured and how well they fit (absent in a
    /// profile written by hand).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fit: Option<ProfileFit>,
}

/// What `calibrate` measured for each curve.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ProfileFit {
    /// The workers measured (comma-separated: several were measured side
    /// by side).
    pub worker: String,
    /// The prefill curve's fit (x: uncached prompt tokens).
    pub prefill: CurveFit,
    /// The decode curve's fit (x: KV usage).
    pub decode: CurveFit,
    /// The per-sequence line's fit (x: sequences decoding), when measured.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sequences: Option<CurveFit>,
}

/// A quadratic fitted to samples: their count and range, and its error.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CurveFit {
    /// Samples fitted.
    pub samples: usize,
    /// The least and greatest x sampled.
    pub x_min: f64,
    /// See `x_min`.
    pub x_max: f64,
    /// Root-mean-square residual, ms.
    pub rms_error_ms: f64,
    /// The largest residual over its sample's value.
    pub max_relative_error: f64,
}

/// A profile that cannot be used.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ProfileError {
    /// Not TOML of this shape.
    #[error("not an engine profile: {0}")]
    Parse(String),
    /// A coefficient or the floor is not finite, the floor negative, or a
    /// capacity zero.
    #[error("engine profile: {0}")]
    Invalid(&'static str),
}

impl EngineProfile {
    /// Parses and checks a profile.
    pub fn from_toml(text: &str) -> Result<Self, ProfileError> {
        let profile: Self = toml::from_str(text).map_err(|e| ProfileError::Parse(e.to_string()))?;
        profile.validate()?;
        Ok(profile)
    }

    /// The profile as TOML.
    pub fn to_toml(&self) -> String {
        toml::to_string(self).expect("a profile of numbers and strings serializes")
    }

    /// Checks ranges.
    pub fn validate(&self) -> Result<(), ProfileError> {
        if !self
            .prefill
            .iter()
            .chain(&self.decode)
            .all(|c| c.is_finite())
        {
            return Err(ProfileError::Invalid("the coefficients must be finite"));
        }
        if !(self.decode_floor_ms.is_finite() && self.decode_floor_ms >= 0.0) {
            return Err(ProfileError::Invalid(
                "decode_floor_ms must be a finite number >= 0",
            ));
        }
        if !(self.decode_per_sequence_ms.is_finite() && self.decode_per_sequence_ms >= 0.0) {
            return Err(ProfileError::Invalid(
                "decode_per_sequence_ms must be a finite number >= 0",
            ));
        }
        if self.block_size == Some(0) || self.num_blocks == Some(0) {
            return Err(ProfileError::Invalid(
                "block_size and num_blocks must be positive",
            ));
        }
        Ok(())
    }
}

/// The least-squares quadratic `[a, b, c]` (`a·x² + b·x + c`) through
/// `points`, with its [`CurveFit`]; `None` for fewer than three distinct
/// x or any value not finite.
pub fn fit_quadratic(points: &[(f64, f64)]) -> Option<([f64; 3], CurveFit)> {
    if points
        .iter()
        .any(|(x, y)| !(x.is_finite() && y.is_finite()))
    {
        return None;
    }
    let mut xs: Vec<f64> = points.iter().map(|p| p.0).collect();
    xs.sort_by(f64::total_cmp);
    xs.dedup();
    if xs.len() < 3 {
        return None;
    }
    let (x_min, x_max) = (xs[0], xs[xs.len() - 1]);
    // Fitted on x scaled to 0..=1, so that x⁴ of thousands of tokens does
    // not swamp the normal equations.
    let scale = x_max.abs().max(x_min.abs()).max(f64::MIN_POSITIVE);
    let rows = points.iter().map(|&(x, y)| {
        let s = x / scale;
        (vec![s * s, s, 1.0], y)
    });
    let [a, b, c] = <[f64; 3]>::try_from(least_squares(rows, 3)?).ok()?;
    let coefficients = [a / (scale * scale), b / scale, c];
    let eval = |x: f64| coefficients[0] * x * x + coefficients[1] * x + coefficients[2];
    Some((coefficients, curve_fit(points, (x_min, x_max), eval)))
}

/// How well `eval` describes `points` (x within `range`).
fn curve_fit(points: &[(f64, f64)], range: (f64, f64), eval: impl Fn(f64) -> f64) -> CurveFit {
    let residuals: Vec<(f64, f64)> = points.iter().map(|&(x, y)| (eval(x) - y, y)).collect();
    residual_fit(&residuals, range)
}

/// The fit of `residuals` (`(modeled − measured, measured)` per sample),
/// x within `range`.
fn residual_fit(residuals: &[(f64, f64)], range: (f64, f64)) -> CurveFit {
    let (mut squares, mut worst) = (0.0, 0.0f64);
    for &(r, y) in residuals {
        squares += r * r;
        if y != 0.0 {
            worst = worst.max((r / y).abs());
        }
    }
    CurveFit {
        samples: residuals.len(),
        x_min: range.0,
        x_max: range.1,
        rms_error_ms: (squares / residuals.len() as f64).sqrt(),
        max_relative_error: worst,
    }
}

/// The least-squares solution of `rows` (`(x, y)`: `x · solution ≈ y`,
/// each `x` of `width` terms) by the normal equations; `None` when they
/// are singular.
fn least_squares(rows: impl Iterator<Item = (Vec<f64>, f64)>, width: usize) -> Option<Vec<f64>> {
    let mut m = vec![vec![0.0f64; width + 1]; width];
    for (x, y) in rows {
        for i in 0..width {
            for j in 0..width {
                m[i][j] += x[i] * x[j];
            }
            m[i][width] += x[i] * y;
        }
    }
    solve(m)
}

/// Solves the square system of augmented rows `m` by Gaussian
/// elimination with partial pivoting; `None` when singular.
fn solve(mut m: Vec<Vec<f64>>) -> Option<Vec<f64>> {
    let n = m.len();
    for col in 0..n {
        let pivot = (col..n).max_by(|&i, &j| m[i][col].abs().total_cmp(&m[j][col].abs()))?;
        if m[pivot][col].abs() < 1e-12 {
            return None;
        }
        m.swap(col, pivot);
        let pivot_row = m[col].clone();
        for (r, row) in m.iter_mut().enumerate() {
            if r != col {
                let f = row[col] / pivot_row[col];
                for (v, p) in row.iter_mut().zip(&pivot_row).skip(col) {
                    *v -= f * p;
                }
            }
        }
    }
    Some((0..n).map(|i| m[i][n] / m[i][i]).collect())
}

/// A decode step's fit: `a·u² + b·u + c + s·n` ms at KV usage `u` with
/// `n` sequences decoding.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct DecodeFit {
    /// `[a, b, c]`.
    pub curve: [f64; 3],
    /// `s`: ms per sequence (never negative: a fit that would make it so
    /// is the usage curve alone).
    pub per_sequence_ms: f64,
    /// The fit over usage (x: KV usage).
    pub usage: CurveFit,
    /// The same fit over the sequences (x: sequences decoding).
    pub sequences: CurveFit,
}

/// The least-squares decode step through `samples` (`(usage, sequences,
/// ms)`); `None` for fewer than three distinct usages, two distinct
/// sequence counts, or a value not finite.
pub fn fit_decode(samples: &[(f64, f64, f64)]) -> Option<DecodeFit> {
    if samples
        .iter()
        .any(|&(u, n, y)| !(u.is_finite() && n.is_finite() && y.is_finite()))
    {
        return None;
    }
    let distinct = |f: fn(&(f64, f64, f64)) -> f64| {
        let mut v: Vec<f64> = samples.iter().map(f).collect();
        v.sort_by(f64::total_cmp);
        v.dedup();
        v
    };
    let (usages, counts) = (distinct(|p| p.0), distinct(|p| p.1));
    if usages.len() < 3 || counts.len() < 2 {
        return None;
    }
    let n_scale = counts[counts.len() - 1].abs().max(f64::MIN_POSITIVE);
    let rows = samples
        .iter()
        .map(|&(u, n, y)| (vec![u * u, u, 1.0, n / n_scale], y));
    let solution = least_squares(rows, 4)?;
    let (mut curve, mut per_sequence_ms) = (
        [solution[0], solution[1], solution[2]],
        solution[3] / n_scale,
    );
    if per_sequence_ms < 0.0 {
        let points: Vec<(f64, f64)> = samples.iter().map(|&(u, _, y)| (u, y)).collect();
        curve = fit_quadratic(&points)?.0;
        per_sequence_ms = 0.0;
    }
    let [a, b, c] = curve;
    let eval = |u: f64, n: f64| a * u * u + b * u + c + per_sequence_ms * n;
    let residuals: Vec<(f64, f64)> = samples
        .iter()
        .map(|&(u, n, y)| (eval(u, n) - y, y))
        .collect();
    let fit_over = |range: (f64, f64)| residual_fit(&residuals, range);
    Some(DecodeFit {
        curve,
        per_sequence_ms,
        usage: fit_over((usages[0], usages[usages.len() - 1])),
        sequences: fit_over((counts[0], counts[counts.len() - 1])),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn the_default_curves_are_recovered_from_their_own_samples() {
        let curve = crate::estimate::DEFAULT_PREFILL_CURVE;
        let prefill: Vec<(f64, f64)> = [64u64, 256, 1024, 2048, 4096, 8192]
            .iter()
            .map(|&t| {
                let t = t as f64;
                (t, curve[0] * t * t + curve[1] * t + curve[2])
            })
            .collect();
        let (p, fit) = fit_quadratic(&prefill).unwrap();
        for (got, want) in p.iter().zip(curve) {
            assert!((got - want).abs() <= want.abs() * 1e-6, "{p:?}");
        }
        assert!(fit.rms_error_ms < 1e-6 && fit.samples == 6);
        assert_eq!((fit.x_min, fit.x_max), (64.0, 8192.0));
    }

    #[test]
    fn a_decode_step_is_fitted_over_usage_and_sequences_together() {
        // Batch sweeps at low usage and a usage sweep at four sequences,
        // where the usage of a batch grows with its size: the slope over
        // the sequences alone would take in the usage's part.
        let truth = |u: f64, n: f64| -10.0 * u * u + 40.0 * u + 12.0 + 0.5 * n;
        let mut samples = Vec::new();
        for n in [1.0, 4.0, 16.0, 32.0] {
            let u = 0.01 * n;
            samples.push((u, n, truth(u, n)));
        }
        for u in [0.1, 0.3, 0.5, 0.7, 0.85] {
            samples.push((u, 4.0, truth(u, 4.0)));
        }
        let fit = fit_decode(&samples).unwrap();
        for (got, want) in fit.curve.iter().zip([-10.0, 40.0, 12.0]) {
            assert!((got - want).abs() < 1e-6, "{fit:?}");
        }
        assert!((fit.per_sequence_ms - 0.5).abs() < 1e-9, "{fit:?}");
        assert!(fit.usage.rms_error_ms < 1e-6);
        assert_eq!((fit.sequences.x_min, fit.sequences.x_max), (1.0, 32.0));
        // A step that falls with more sequences is not a negative cost.
        let falling: Vec<_> = samples
            .iter()
            .map(|&(u, n, _)| (u, n, 20.0 + 5.0 * u - 0.2 * n))
            .collect();
        assert_eq!(fit_decode(&falling).unwrap().per_sequence_ms, 0.0);
        let two_usages = [(0.1, 1.0, 13.0), (0.1, 4.0, 15.0), (0.2, 4.0, 17.0)];
        assert!(fit_decode(&two_usages).is_none());
    }

    #[test]
    fn a_profile_without_a_per_sequence_cost_reads_as_zero() {
        let old = "prefill = [0.0, 0.02, 30.0]\ndecode = [0.0, 10.0, 5.0]\ndecode_floor_ms = 1.0\n";
        assert_eq!(
            EngineProfile::from_toml(old)
                .unwrap()
                .decode_per_sequence_ms,
            0.0
        );
    }

    #[test]
    fn too_few_distinct_points_or_a_non_finite_one_fit_nothing() {
        assert!(fit_quadratic(&[(1.0, 1.0), (1.0, 2.0), (2.0, 3.0)]).is_none());
        assert!(fit_quadratic(&[(1.0, 1.0), (2.0, f64::NAN), (3.0, 3.0)]).is_none());
        assert!(fit_quadratic(&[]).is_none());
    }

    #[test]
    fn a_profile_round_trips_through_toml() {
        let profile = EngineProfile {
            model: Some("tiny".into()),
            prefill: [1e-6, 0.02, 30.0],
            decode: [-10.0, 40.0, 8.0],
            decode_floor_ms: 2.0,
            decode_per_sequence_ms: 0.25,
            block_size: Some(16),
            num_blocks: Some(512),
            fit: Some(ProfileFit {
                worker: "http://127.0.0.1:8000".into(),
                prefill: CurveFit {
                    samples: 24,
                    x_min: 64.0,
                    x_max: 4096.0,
                    rms_error_ms: 0.4,
                    max_relative_error: 0.02,
                },
                decode: CurveFit {
                    samples: 6,
                    x_min: 0.1,
                    x_max: 0.9,
                    rms_error_ms: 0.2,
                    max_relative_error: 0.03,
                },
                sequences: Some(CurveFit {
                    samples: 12,
                    x_min: 1.0,
                    x_max: 32.0,
                    rms_error_ms: 0.5,
                    max_relative_error: 0.04,
                }),
            }),
        };
        let text = profile.to_toml();
        assert_eq!(EngineProfile::from_toml(&text).unwrap(), profile);
    }

    #[test]
    fn a_bad_profile_is_refused_with_why() {
        let ok = "prefill = [0.0, 0.02, 30.0]\ndecode = [0.0, 10.0, 5.0]\ndecode_floor_ms = 1.0\n";
        assert!(EngineProfile::from_toml(ok).is_ok());
        for (bad, why) in [
            (ok.replace("30.0", "nan"), "finite"),
            (
                ok.replace("decode_floor_ms = 1.0", "decode_floor_ms = -1.0"),
                ">= 0",
            ),
            (format!("{ok}num_blocks = 0\n"), "positive"),
            (format!("{ok}decode_per_sequence_ms = -0.5\n"), ">= 0"),
            (format!("{ok}colour = 1\n"), "unknown field"),
            ("prefill = [1.0]".to_owned(), "not an engine profile"),
        ] {
            let err = EngineProfile::from_toml(&bad).unwrap_err().to_string();
            assert!(err.contains(why), "{bad:?}: {err}");
        }
    }

    proptest! {
        #[test]
        fn a_quadratic_is_recovered_from_noisy_samples_within_the_noise(
            a in -1e-5f64..1e-5,
            b in 0.0f64..0.1,
            c in 1.0f64..100.0,
            noise in proptest::collection::vec(-1.0f64..1.0, 24),
        ) {
            // Relative noise of at most 0.1% of each value.
            let xs = (0..24).map(|i| 64.0 * (i + 1) as f64 * 5.0);
            let points: Vec<(f64, f64)> = xs
                .zip(&noise)
                .map(|(x, n)| {
                    let y = a * x * x + b * x + c;
                    (x, y * (1.0 + 1e-3 * n))
                })
                .collect();
            let (fitted, fit) = fit_quadratic(&points).unwrap();
            let x_max = points.last().unwrap().0;
            let y_max = points.iter().map(|p| p.1.abs()).fold(0.0, f64::max);
            // Compared with the true curve over the sampled range, where
            // the fit is meant to hold: within the noise's size.
            for (x, _) in &points {
                let got = fitted[0] * x * x + fitted[1] * x + fitted[2];
                let want = a * x * x + b * x + c;
                prop_assert!((got - want).abs() <= 2e-3 * y_max, "{fitted:?} at {x}");
            }
            prop_assert!(fit.rms_error_ms <= 1e-3 * y_max);
            prop_assert!(fit.x_max == x_max);
        }
    }
}
