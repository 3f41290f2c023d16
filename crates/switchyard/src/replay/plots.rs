//! SVG plots of a replay: TTFT CDF per policy, hit rate per policy against
//! the references, and per-worker load over time.

use super::ReplayReport;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};
use std::path::{Path, PathBuf};
use switchyard_sim::fleet::SimOutcome;

const PALETTE: [RGBColor; 8] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
    RGBColor(127, 127, 127),
];

fn color(i: usize) -> RGBColor {
    PALETTE[i % PALETTE.len()]
}

type PlotResult<T> = Result<T, Box<dyn std::error::Error>>;

/// Draws one plot into a file.
type PlotFn = fn(&Path, &ReplayReport, &[(String, SimOutcome)]) -> PlotResult<()>;

/// Writes every plot into `dir`; returns their paths.
pub(super) fn write_all(
    dir: &Path,
    report: &ReplayReport,
    outcomes: &[(String, SimOutcome)],
) -> anyhow::Result<Vec<PathBuf>> {
    let plots: [(&str, PlotFn); 3] = [
        ("ttft_cdf.svg", ttft_cdf),
        ("hit_rate.svg", hit_rate),
        ("worker_load.svg", worker_load),
    ];
    let mut written = Vec::new();
    for (name, plot) in plots {
        let path = dir.join(name);
        plot(&path, report, outcomes)
            .map_err(|e| anyhow::anyhow!("plotting {}: {e}", path.display()))?;
        written.push(path);
    }
    Ok(written)
}

fn ttft_cdf(path: &Path, _: &ReplayReport, outcomes: &[(String, SimOutcome)]) -> PlotResult<()> {
    let root = SVGBackend::new(path, (900, 560)).into_drawing_area();
    root.fill(&WHITE)?;
    // Log-scaled x: TTFT spans milliseconds to minutes under load.
    let max = outcomes
        .iter()
        .filter_map(|(_, o)| o.ttft_samples_ms.last().copied())
        .fold(1.0f64, f64::max);
    let min = outcomes
        .iter()
        .filter_map(|(_, o)| o.ttft_samples_ms.first().copied())
        .fold(max, f64::min)
        .max(0.1);
    let mut chart = ChartBuilder::on(&root)
        .caption("TTFT CDF per policy", ("sans-serif", 22))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(50)
        .build_cartesian_2d((min..max * 1.05).log_scale(), 0.0..1.0)?;
    chart
        .configure_mesh()
        .x_desc("time to first token (ms, log scale)")
        .y_desc("fraction of requests")
        .draw()?;
    for (i, (name, o)) in outcomes.iter().enumerate() {
        let n = o.ttft_samples_ms.len().max(1) as f64;
        // At most ~2,000 points per curve keeps the SVG small.
        let stride = (o.ttft_samples_ms.len() / 2000).max(1);
        let points = o
            .ttft_samples_ms
            .iter()
            .enumerate()
            .filter(|(k, _)| k % stride == 0)
            .map(|(k, &t)| (t.max(min), (k + 1) as f64 / n));
        chart
            .draw_series(LineSeries::new(points, color(i).stroke_width(2)))?
            .label(name.as_str())
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 18, y)], color(i).stroke_width(2))
            });
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .position(SeriesLabelPosition::LowerRight)
        .draw()?;
    root.present()?;
    Ok(())
}

fn hit_rate(
    path: &Path,
    report: &ReplayReport,
    outcomes: &[(String, SimOutcome)],
) -> PlotResult<()> {
    let root = SVGBackend::new(path, (900, 560)).into_drawing_area();
    root.fill(&WHITE)?;
    let n = outcomes.len();
    let top = report.bound_hit_rate.max(0.05) * 1.15;
    let mut chart = ChartBuilder::on(&root)
        .caption(
            "Engine prefix hit rate per policy (dashed: infinite cache; dotted: pooled LRU)",
            ("sans-serif", 18),
        )
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(50)
        .build_cartesian_2d(0.0..n as f64, 0.0..top)?;
    // Every bar carries its own label above it (an axis of numbers would
    // pick "nice" ticks and skip bars); neighbours alternate between two
    // heights so long names do not run into each other.
    chart
        .configure_mesh()
        .disable_x_mesh()
        .x_labels(0)
        .y_desc("cached prompt tokens / prompt tokens")
        .draw()?;
    let label = ("sans-serif", 13)
        .into_font()
        .color(&BLACK)
        .pos(Pos::new(HPos::Center, VPos::Bottom));
    chart.draw_series(outcomes.iter().enumerate().map(|(i, (name, o))| {
        let lift = if i % 2 == 0 { 0.01 } else { 0.05 } * top;
        Text::new(
            format!("{name} {:.3}", o.report.hit_rate),
            (i as f64 + 0.5, o.report.hit_rate + lift),
            label.clone(),
        )
    }))?;
    chart.draw_series(outcomes.iter().enumerate().map(|(i, (_, o))| {
        Rectangle::new(
            [(i as f64 + 0.15, 0.0), (i as f64 + 0.85, o.report.hit_rate)],
            color(i).filled(),
        )
    }))?;
    chart.draw_series(DashedLineSeries::new(
        [
            (0.0, report.bound_hit_rate),
            (n as f64, report.bound_hit_rate),
        ],
        8,
        6,
        BLACK.stroke_width(2),
    ))?;
    chart.draw_series(DashedLineSeries::new(
        [
            (0.0, report.pooled_lru_hit_rate),
            (n as f64, report.pooled_lru_hit_rate),
        ],
        2,
        4,
        BLACK.stroke_width(2),
    ))?;
    root.present()?;
    Ok(())
}

fn worker_load(path: &Path, _: &ReplayReport, outcomes: &[(String, SimOutcome)]) -> PlotResult<()> {
    let cols = 2;
    let rows = outcomes.len().div_ceil(cols).max(1);
    let root = SVGBackend::new(path, (1000, 260 * rows as u32)).into_drawing_area();
    root.fill(&WHITE)?;
    let panels = root.split_evenly((rows, cols));
    for ((name, o), panel) in outcomes.iter().zip(panels.iter()) {
        let t = &o.timeline;
        let buckets = t.tokens.iter().map(Vec::len).max().unwrap_or(0).max(1);
        let per_sec = 1000.0 / t.bucket_ms;
        let top = t
            .tokens
            .iter()
            .flatten()
            .map(|&v| v as f64 * per_sec)
            .fold(1.0, f64::max);
        let secs = buckets as f64 * t.bucket_ms / 1000.0;
        let mut chart = ChartBuilder::on(panel)
            .caption(format!("{name}: tokens/s per worker"), ("sans-serif", 15))
            .margin(8)
            .x_label_area_size(28)
            .y_label_area_size(56)
            .build_cartesian_2d(0.0..secs, 0.0..top * 1.05)?;
        chart.configure_mesh().x_desc("simulated s").draw()?;
        for (w, row) in t.tokens.iter().enumerate() {
            let points = row
                .iter()
                .enumerate()
                .map(|(b, &v)| (b as f64 * t.bucket_ms / 1000.0, v as f64 * per_sec));
            chart.draw_series(LineSeries::new(points, color(w).stroke_width(1)))?;
        }
    }
    root.present()?;
    Ok(())
}
