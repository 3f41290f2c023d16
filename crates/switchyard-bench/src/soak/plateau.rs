//! The plateau criterion and memory probes shared by both soak modes.
//!
//! A run's samples are split into quarters by position; memory has
//! plateaued when the mean of the last quarter is within a tolerance (5%)
//! of the mean of the second quarter. The first quarter is warm-up (caches
//! filling, tables growing to their working size) and is not judged.

use serde::Serialize;

/// Relative tolerance of the plateau criterion.
pub const PLATEAU_TOLERANCE: f64 = 0.05;

/// Fewest samples the criterion is computed on (two per quarter).
pub const MIN_SAMPLES: usize = 8;

/// The verdict on one series of memory samples.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct Plateau {
    /// Mean of the second quarter of the samples.
    pub second_quarter_mean: f64,
    /// Mean of the last quarter.
    pub last_quarter_mean: f64,
    /// `last_quarter_mean / second_quarter_mean`.
    pub ratio: f64,
    /// Whether `|ratio − 1| <= tolerance`.
    pub pass: bool,
}

/// Judges `series` (in sampling order); `None` with fewer than
/// [`MIN_SAMPLES`] samples or a second quarter that averages zero.
pub fn plateau(series: &[f64], tolerance: f64) -> Option<Plateau> {
    let n = series.len();
    if n < MIN_SAMPLES {
        return None;
    }
    let mean = |s: &[f64]| s.iter().sum::<f64>() / s.len() as f64;
    let second = mean(&series[n / 4..n / 2]);
    let last = mean(&series[n - n / 4..]);
    if second <= 0.0 || !second.is_finite() || !last.is_finite() {
        return None;
    }
    let ratio = last / second;
    Some(Plateau {
        second_quarter_mean: second,
        last_quarter_mean: last,
        ratio,
        pass: (ratio - 1.0).abs() <= tolerance,
    })
}

/// Resident set size of process `pid` (`None`: this process) in bytes, from
/// `/proc/PID/statm` (resident pages × the page size from the auxiliary
/// vector). `None` where the OS does not say.
pub fn statm_rss_bytes(pid: Option<u32>) -> Option<u64> {
    let dir = pid.map_or_else(|| "self".to_owned(), |p| p.to_string());
    let statm = std::fs::read_to_string(format!("/proc/{dir}/statm")).ok()?;
    let pages: u64 = statm.split_whitespace().nth(1)?.parse().ok()?;
    Some(pages * page_size())
}

/// The page size, from this process's auxiliary vector (`AT_PAGESZ`);
/// 4096 if it cannot be read.
fn page_size() -> u64 {
    const AT_PAGESZ: u64 = 6;
    let Ok(auxv) = std::fs::read("/proc/self/auxv") else {
        return 4096;
    };
    auxv.chunks_exact(16)
        .find_map(|pair| {
            let key = u64::from_ne_bytes(pair[..8].try_into().ok()?);
            let value = u64::from_ne_bytes(pair[8..].try_into().ok()?);
            (key == AT_PAGESZ).then_some(value)
        })
        .filter(|&size| size > 0)
        .unwrap_or(4096)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_flat_series_after_warm_up_passes() {
        // Warm-up growth in the first quarter is not judged.
        let mut series = vec![10.0, 50.0, 80.0, 100.0];
        series.extend([100.0; 12]);
        let p = plateau(&series, PLATEAU_TOLERANCE).unwrap();
        assert_eq!(p.ratio, 1.0);
        assert!(p.pass);
    }

    #[test]
    fn steady_growth_fails_and_reports_the_ratio() {
        let series: Vec<f64> = (1..=16).map(|i| 100.0 + 10.0 * f64::from(i)).collect();
        let p = plateau(&series, PLATEAU_TOLERANCE).unwrap();
        // Second quarter: samples 5..=8 → mean 165; last: 13..=16 → mean 245.
        assert_eq!(p.second_quarter_mean, 165.0);
        assert_eq!(p.last_quarter_mean, 245.0);
        assert!((p.ratio - 245.0 / 165.0).abs() < 1e-12);
        assert!(!p.pass);
    }

    #[test]
    fn growth_just_inside_the_tolerance_passes_and_just_outside_fails() {
        let series = |last: f64| {
            let mut s = vec![100.0; 12];
            s.extend([last; 4]);
            s
        };
        assert!(plateau(&series(104.9), PLATEAU_TOLERANCE).unwrap().pass);
        assert!(!plateau(&series(105.1), PLATEAU_TOLERANCE).unwrap().pass);
        // A drop beyond the tolerance is not a plateau either.
        assert!(!plateau(&series(94.0), PLATEAU_TOLERANCE).unwrap().pass);
    }

    #[test]
    fn too_few_or_empty_samples_give_no_verdict() {
        assert_eq!(plateau(&[1.0; 7], PLATEAU_TOLERANCE), None);
        assert_eq!(plateau(&[0.0; 16], PLATEAU_TOLERANCE), None);
    }

    #[test]
    fn this_process_has_a_resident_set() {
        assert!(statm_rss_bytes(None).is_some_and(|b| b > 0));
        assert!(page_size().is_power_of_two());
    }
}
