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
//! step.

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
    /// The worker measured.
    pub worker: String,
    /// The prefill curve's fit (x: uncached prompt tokens).
    pub prefill: CurveFit,
    /// The decode curve's fit (x: KV usage).
    pub decode: CurveFit,
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
    let mut m = [[0.0f64; 4]; 3];
    for &(x, y) in points {
        let s = x / scale;
        let row = [s * s, s, 1.0];
        for i in 0..3 {
            for j in 0..3 {
                m[i][j] += row[i] * row[j];
            }
            m[i][3] += row[i] * y;
        }
    }
    let [a, b, c] = solve3(m)?;
    let coefficients = [a / (scale * scale), b / scale, c];
    let eval = |x: f64| coefficients[0] * x * x + coefficients[1] * x + coefficients[2];
    let (mut squares, mut worst) = (0.0, 0.0f64);
    for &(x, y) in points {
        let r = eval(x) - y;
        squares += r * r;
        if y != 0.0 {
            worst = worst.max((r / y).abs());
        }
    }
    let fit = CurveFit {
        samples: points.len(),
        x_min,
        x_max,
        rms_error_ms: (squares / points.len() as f64).sqrt(),
        max_relative_error: worst,
    };
    Some((coefficients, fit))
}

/// Solves the 3×3 system of augmented rows `m` by Gaussian elimination
/// with partial pivoting; `None` when singular.
fn solve3(mut m: [[f64; 4]; 3]) -> Option<[f64; 3]> {
    for col in 0..3 {
        let pivot = (col..3).max_by(|&i, &j| m[i][col].abs().total_cmp(&m[j][col].abs()))?;
        if m[pivot][col].abs() < 1e-12 {
            return None;
        }
        m.swap(col, pivot);
        let pivot_row = m[col];
        for (r, row) in m.iter_mut().enumerate() {
            if r != col {
                let f = row[col] / pivot_row[col];
                for (v, p) in row.iter_mut().zip(pivot_row).skip(col) {
                    *v -= f * p;
                }
            }
        }
    }
    Some([m[0][3] / m[0][0], m[1][3] / m[1][1], m[2][3] / m[2][2]])
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
