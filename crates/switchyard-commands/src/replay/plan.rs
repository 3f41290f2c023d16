//! `replay --plan --slo ttft_p90=MS[,itl_p90=MS]`: the smallest fleet that
//! meets the targets on the workload at its rate, with the same core and
//! engines as every other `replay` (an `--engine-profile` makes them
//! yours).
//!
//! The search assumes that a larger fleet does no worse: it doubles the
//! fleet (1, 2, 4, …, up to `--max-workers`) until one meets the targets,
//! then tries the sizes between the last miss and that one from the
//! smallest up, `--threads` simulations at a time, and stops at the first
//! that meets them. Every size simulated is in the table, `plan.json` and
//! `plan.svg` (each target's figure against the fleet size). With
//! `--plan-rates`, the search runs again at each multiple of the rate:
//! a table each, `plan.json`'s `rates`, and `plan-rates.svg` (the fleet
//! needed against the rate).

use super::{run_all, workload_name, ReplayArgs, WorkloadSource};
use plotters::prelude::*;
use serde::Serialize;
use std::collections::BTreeMap;
use std::time::Instant;
use switchyard_core::select::PolicyKind;
use switchyard_sim::fleet::FleetConfig;

/// `--slo`: the targets a fleet must meet.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct Slo {
    /// TTFT p90, ms.
    pub ttft_p90_ms: f64,
    /// Inter-token latency p90, ms, if targeted.
    pub itl_p90_ms: Option<f64>,
}

/// Parses `ttft_p90=MS[,itl_p90=MS]`.
pub fn parse_slo(text: &str) -> Result<Slo, String> {
    let (mut ttft, mut itl) = (None, None);
    for part in text.split(',') {
        let (key, value) = part
            .split_once('=')
            .ok_or_else(|| format!("expected KEY=MS in {part:?} (ttft_p90=MS[,itl_p90=MS])"))?;
        let ms: f64 = value
            .trim()
            .parse()
            .map_err(|_| format!("{value:?} is not a number of milliseconds"))?;
        if !(ms.is_finite() && ms > 0.0) {
            return Err(format!(
                "{key} must be a positive number of ms, got {value}"
            ));
        }
        match key.trim() {
            "ttft_p90" => ttft = Some(ms),
            "itl_p90" => itl = Some(ms),
            other => return Err(format!("unknown target {other:?}: ttft_p90 or itl_p90")),
        }
    }
    Ok(Slo {
        ttft_p90_ms: ttft.ok_or("a plan needs ttft_p90=MS")?,
        itl_p90_ms: itl,
    })
}

/// One fleet size simulated.
#[derive(Clone, Debug, Serialize)]
pub struct PlanRow {
    /// Workers.
    pub workers: usize,
    /// TTFT p50 and p90, ms.
    pub ttft_p50_ms: f64,
    /// See `ttft_p50_ms`.
    pub ttft_p90_ms: f64,
    /// Inter-token latency p90, ms.
    pub itl_p90_ms: f64,
    /// Engine prefix hit rate.
    pub hit_rate: f64,
    /// Whether it meets every target.
    pub met: bool,
}

/// One rate's search.
#[derive(Clone, Debug, Serialize)]
pub struct RatePlan {
    /// The multiple of `--rate-scale` (1: the rate itself).
    pub multiple: f64,
    /// The arrival-rate multiplier simulated.
    pub rate_scale: f64,
    /// The smallest fleet that met the targets (`None`: none up to the cap).
    pub workers: Option<usize>,
    /// Every size simulated, smallest first.
    pub rows: Vec<PlanRow>,
    /// Seconds of search.
    pub seconds: f64,
}

/// What `plan.json` holds: the first rate's plan at the top (as without
/// `--plan-rates`), every rate's in `rates`.
#[derive(Debug, Serialize)]
struct Plan<'a> {
    workload: String,
    rate_scale: f64,
    policy: PolicyKind,
    slo: Slo,
    /// The smallest fleet that met it (`None`: none up to the cap).
    workers: Option<usize>,
    rows: &'a [PlanRow],
    seconds: f64,
    rates: &'a [RatePlan],
}

/// Runs the search and writes its figures.
pub fn run(args: &ReplayArgs, source: &WorkloadSource, fleet: &FleetConfig) -> anyhow::Result<()> {
    let slo = args
        .slo
        .ok_or_else(|| anyhow::anyhow!("--plan needs --slo ttft_p90=MS[,itl_p90=MS]"))?;
    anyhow::ensure!(
        args.disagg.is_empty() && args.replicas.is_empty(),
        "--plan sizes aggregated fleets behind one router: not with --disagg or --replicas"
    );
    anyhow::ensure!(args.max_workers >= 1, "--max-workers must be positive");
    anyhow::ensure!(
        args.plan_rates.iter().all(|m| m.is_finite() && *m > 0.0),
        "--plan-rates must be positive multiples"
    );
    let policy = args
        .policies
        .first()
        .copied()
        .unwrap_or(PolicyKind::DEFAULT);
    let multiples = if args.plan_rates.is_empty() {
        vec![1.0]
    } else {
        args.plan_rates.clone()
    };
    let mut plans = Vec::with_capacity(multiples.len());
    for multiple in multiples {
        let mut at = args.clone();
        at.rate_scale = Some(args.rate_scale() * multiple);
        let plan = search(&at, source, fleet, policy, &slo, multiple)?;
        print_plan(&at, policy, &slo, &plan);
        plans.push(plan);
    }
    let first = &plans[0];
    std::fs::create_dir_all(&args.out)?;
    let json = args.out.join("plan.json");
    crate::stats::write_json(
        &json,
        &Plan {
            workload: workload_name(args),
            rate_scale: first.rate_scale,
            policy,
            slo,
            workers: first.workers,
            rows: &first.rows,
            seconds: first.seconds,
            rates: &plans,
        },
    )?;
    println!("wrote {}", json.display());
    let svg = args.out.join("plan.svg");
    draw(&svg, &slo, &first.rows)
        .map_err(|e| anyhow::anyhow!("plotting {}: {e}", svg.display()))?;
    println!("wrote {}", svg.display());
    if plans.len() > 1 {
        let svg = args.out.join("plan-rates.svg");
        draw_rates(&svg, args.max_workers, &plans)
            .map_err(|e| anyhow::anyhow!("plotting {}: {e}", svg.display()))?;
        println!("wrote {}", svg.display());
    }
    Ok(())
}

/// The search at `args`'s rate (see the module documentation).
fn search(
    args: &ReplayArgs,
    source: &WorkloadSource,
    fleet: &FleetConfig,
    policy: PolicyKind,
    slo: &Slo,
    multiple: f64,
) -> anyhow::Result<RatePlan> {
    let started = Instant::now();
    let threads = args
        .threads
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
        .max(1);
    let mut rows: BTreeMap<usize, PlanRow> = BTreeMap::new();
    let simulate = |sizes: Vec<usize>, rows: &mut BTreeMap<usize, PlanRow>| -> anyhow::Result<()> {
        let fleets = sizes
            .iter()
            .map(|&n| {
                let mut f = fleet.clone();
                f.workers = n;
                f.router.policy = policy;
                (format!("{n} workers"), f)
            })
            .collect();
        for (n, (_, outcome)) in sizes.iter().zip(run_all(args, source, fleets, None)?) {
            let r = &outcome.report;
            let met = r.errors == 0
                && r.ttft_ms.p90 <= slo.ttft_p90_ms
                && slo.itl_p90_ms.is_none_or(|itl| r.itl_ms.p90 <= itl);
            rows.insert(
                *n,
                PlanRow {
                    workers: *n,
                    ttft_p50_ms: r.ttft_ms.p50,
                    ttft_p90_ms: r.ttft_ms.p90,
                    itl_p90_ms: r.itl_ms.p90,
                    hit_rate: r.hit_rate,
                    met,
                },
            );
        }
        Ok(())
    };
    // Doubling, `threads` sizes at a time, until one meets the targets.
    let doubling: Vec<usize> = std::iter::successors(Some(1usize), |n| n.checked_mul(2))
        .take_while(|&n| n < args.max_workers)
        .chain(std::iter::once(args.max_workers))
        .collect();
    let met_in = |rows: &BTreeMap<usize, PlanRow>| rows.values().find(|r| r.met).map(|r| r.workers);
    for batch in doubling.chunks(threads) {
        simulate(batch.to_vec(), &mut rows)?;
        if met_in(&rows).is_some() {
            break;
        }
    }
    // Between the last miss and the first size that met them, from the
    // smallest up.
    if let Some(first) = met_in(&rows) {
        let below = rows
            .values()
            .filter(|r| !r.met && r.workers < first)
            .map(|r| r.workers)
            .max()
            .unwrap_or(0);
        let between: Vec<usize> = (below + 1..first).collect();
        for batch in between.chunks(threads) {
            simulate(batch.to_vec(), &mut rows)?;
            if rows.values().any(|r| r.met && r.workers < first) {
                break;
            }
        }
    }
    let rows: Vec<PlanRow> = rows.into_values().collect();
    Ok(RatePlan {
        multiple,
        rate_scale: args.rate_scale(),
        workers: rows.iter().find(|r| r.met).map(|r| r.workers),
        rows,
        seconds: started.elapsed().as_secs_f64(),
    })
}

fn print_plan(args: &ReplayArgs, policy: PolicyKind, slo: &Slo, plan: &RatePlan) {
    let (rows, workers, seconds) = (&plan.rows, plan.workers, plan.seconds);
    println!(
        "plan for {} at rate ×{}, policy {}: TTFT p90 ≤ {} ms{}",
        workload_name(args),
        args.rate_scale(),
        policy.name(),
        slo.ttft_p90_ms,
        slo.itl_p90_ms
            .map_or(String::new(), |itl| format!(", ITL p90 ≤ {itl} ms"))
    );
    println!(
        "{:>8} {:>10} {:>10} {:>9} {:>6} {:>5}",
        "workers", "ttft p50", "ttft p90", "itl p90", "hit", "met"
    );
    for r in rows {
        println!(
            "{:>8} {:>10.1} {:>10.1} {:>9.1} {:>6.3} {:>5}",
            r.workers,
            r.ttft_p50_ms,
            r.ttft_p90_ms,
            r.itl_p90_ms,
            r.hit_rate,
            if r.met { "yes" } else { "no" }
        );
    }
    match workers {
        Some(n) => println!("smallest fleet that meets it: {n} workers ({seconds:.1} s of search)"),
        None => println!(
            "no fleet up to --max-workers {} meets it ({seconds:.1} s of search)",
            args.max_workers
        ),
    }
}

/// The fleet needed against the rate: one point per multiple; a rate no
/// fleet up to the cap met is drawn at the cap, hollow.
fn draw_rates(
    path: &std::path::Path,
    max_workers: usize,
    plans: &[RatePlan],
) -> Result<(), Box<dyn std::error::Error>> {
    let root = SVGBackend::new(path, (900, 520)).into_drawing_area();
    root.fill(&WHITE)?;
    let max_x = plans.iter().map(|p| p.rate_scale).fold(0.0, f64::max) * 1.1;
    let max_y = plans
        .iter()
        .map(|p| p.workers.unwrap_or(max_workers))
        .max()
        .unwrap_or(1) as f64
        + 1.0;
    let mut chart = ChartBuilder::on(&root)
        .caption(
            "workers needed against the arrival rate",
            ("sans-serif", 18),
        )
        .margin(12)
        .x_label_area_size(36)
        .y_label_area_size(60)
        .build_cartesian_2d(0.0..max_x.max(1e-9), 0.0..max_y)?;
    chart
        .configure_mesh()
        .x_desc("arrival-rate multiplier")
        .y_desc("smallest fleet that meets the targets")
        .draw()?;
    let blue = RGBColor(31, 119, 180);
    let met: Vec<(f64, f64)> = plans
        .iter()
        .filter_map(|p| p.workers.map(|n| (p.rate_scale, n as f64)))
        .collect();
    chart.draw_series(LineSeries::new(met.clone(), blue.stroke_width(2)))?;
    chart.draw_series(met.into_iter().map(|p| Circle::new(p, 4, blue.filled())))?;
    chart.draw_series(
        plans
            .iter()
            .filter(|p| p.workers.is_none())
            .map(|p| Circle::new((p.rate_scale, max_workers as f64), 4, blue.stroke_width(2))),
    )?;
    root.present()?;
    Ok(())
}

/// A line of the plot: its name, its points and its colour.
type Series<'a> = (&'a str, Vec<(f64, f64)>, RGBColor);

/// Each target's figure over its target (1 is the line to stay under),
/// against the fleet size; log-scaled, as a fleet too small is minutes
/// over.
fn draw(
    path: &std::path::Path,
    slo: &Slo,
    rows: &[PlanRow],
) -> Result<(), Box<dyn std::error::Error>> {
    let root = SVGBackend::new(path, (900, 520)).into_drawing_area();
    root.fill(&WHITE)?;
    let mut series: Vec<Series<'_>> = vec![(
        "TTFT p90 / target",
        rows.iter()
            .map(|r| (r.workers as f64, r.ttft_p90_ms / slo.ttft_p90_ms))
            .collect(),
        RGBColor(31, 119, 180),
    )];
    if let Some(itl) = slo.itl_p90_ms {
        series.push((
            "ITL p90 / target",
            rows.iter()
                .map(|r| (r.workers as f64, r.itl_p90_ms / itl))
                .collect(),
            RGBColor(255, 127, 14),
        ));
    }
    let positive = |v: f64| v.max(1e-3);
    let top = series
        .iter()
        .flat_map(|s| s.1.iter().map(|p| p.1))
        .fold(2.0, f64::max);
    let bottom = series
        .iter()
        .flat_map(|s| s.1.iter().map(|p| positive(p.1)))
        .fold(0.5, f64::min);
    let max_x = rows.iter().map(|r| r.workers).max().unwrap_or(1) as f64;
    let mut chart = ChartBuilder::on(&root)
        .caption("SLO attainment against fleet size", ("sans-serif", 18))
        .margin(12)
        .x_label_area_size(36)
        .y_label_area_size(60)
        .build_cartesian_2d(0.5..max_x + 0.5, (bottom * 0.8..top * 1.2).log_scale())?;
    chart
        .configure_mesh()
        .x_desc("workers")
        .y_desc("figure / target (≤ 1 meets it)")
        .draw()?;
    chart.draw_series(LineSeries::new(
        [(0.5, 1.0), (max_x + 0.5, 1.0)],
        BLACK.stroke_width(1),
    ))?;
    for (name, points, colour) in series {
        let points: Vec<(f64, f64)> = points.into_iter().map(|(x, y)| (x, positive(y))).collect();
        chart
            .draw_series(LineSeries::new(points.clone(), colour.stroke_width(2)))?
            .label(name)
            .legend(move |(x, y)| PathElement::new([(x, y), (x + 16, y)], colour));
        chart.draw_series(
            points
                .into_iter()
                .map(|p| Circle::new(p, 3, colour.filled())),
        )?;
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()?;
    root.present()?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_slo_is_parsed_and_bad_ones_are_refused_with_why() {
        assert_eq!(
            parse_slo("ttft_p90=500").unwrap(),
            Slo {
                ttft_p90_ms: 500.0,
                itl_p90_ms: None
            }
        );
        assert_eq!(
            parse_slo("itl_p90=40, ttft_p90=250.5").unwrap(),
            Slo {
                ttft_p90_ms: 250.5,
                itl_p90_ms: Some(40.0)
            }
        );
        for (bad, why) in [
            ("itl_p90=40", "needs ttft_p90"),
            ("ttft_p90", "KEY=MS"),
            ("ttft_p90=fast", "not a number"),
            ("ttft_p90=-1", "positive"),
            ("ttft_p99=10", "unknown target"),
        ] {
            let err = parse_slo(bad).unwrap_err();
            assert!(err.contains(why), "{bad}: {err}");
        }
    }
}
