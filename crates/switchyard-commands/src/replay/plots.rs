//! SVG plots of a replay: TTFT CDF per policy, hit rate per policy against
//! the references, per-worker load over time, and with `--tenants` each
//! tenant's TTFT, queue wait and shed requests per policy.

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
    let with_tenants = outcomes.iter().any(|(_, o)| !o.report.tenants.is_empty());
    let tenant_plot: Option<(&str, PlotFn)> = with_tenants.then_some(("tenants.svg", tenants));
    for (name, plot) in plots.into_iter().chain(tenant_plot) {
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

/// Per tenant (a group of bars) and policy (a bar): TTFT p90 as the bar,
/// p50 as a black tick on it, and above it the queue wait p90 and the
/// requests shed. Log-scaled: one tenant's milliseconds and another's
/// minutes share the axis.
fn tenants(path: &Path, _: &ReplayReport, outcomes: &[(String, SimOutcome)]) -> PlotResult<()> {
    draw_tenants(path, outcomes)
}

fn draw_tenants(path: &Path, outcomes: &[(String, SimOutcome)]) -> PlotResult<()> {
    let names: Vec<&String> = {
        let mut all: Vec<&String> = outcomes
            .iter()
            .flat_map(|(_, o)| o.report.tenants.keys())
            .collect();
        all.sort();
        all.dedup();
        all
    };
    let policies = outcomes.len().max(1);
    let root = SVGBackend::new(
        path,
        (160 + 180 * names.len() as u32 * policies.min(4) as u32, 560),
    )
    .into_drawing_area();
    root.fill(&WHITE)?;
    // Per tenant, per policy: its figures (a policy may lack a tenant).
    let table: Vec<Vec<Option<&switchyard_sim::report::TenantFigures>>> = names
        .iter()
        .map(|t| {
            outcomes
                .iter()
                .map(|(_, o)| o.report.tenants.get(*t))
                .collect()
        })
        .collect();
    let figures = |g: usize| table[g].iter().copied().enumerate();
    let top = outcomes
        .iter()
        .flat_map(|(_, o)| o.report.tenants.values())
        .map(|f| f.ttft_p90_ms)
        .fold(1.0f64, f64::max);
    let mut chart = ChartBuilder::on(&root)
        .caption(
            "TTFT p90 per tenant and policy (bar; tick: p50; above: queue wait p90, shed)",
            ("sans-serif", 16),
        )
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d(0.0..names.len() as f64, (0.5..top * 20.0).log_scale())?;
    chart
        .configure_mesh()
        .disable_x_mesh()
        .x_labels(0)
        .y_desc("time to first token (ms, log scale)")
        .draw()?;
    let width = 0.8 / policies as f64;
    let bar = |g: usize, i: usize| g as f64 + 0.1 + i as f64 * width;
    for (g, t) in names.iter().enumerate() {
        chart.draw_series(figures(g).filter_map(|(i, f)| {
            let f = f?;
            let x = bar(g, i);
            Some(Rectangle::new(
                [(x, 0.5), (x + width * 0.9, f.ttft_p90_ms.max(0.5))],
                color(i).filled(),
            ))
        }))?;
        chart.draw_series(figures(g).filter_map(|(i, f)| {
            let f = f?;
            let x = bar(g, i);
            let y = f.ttft_p50_ms.max(0.5);
            Some(PathElement::new(
                vec![(x, y), (x + width * 0.9, y)],
                BLACK.stroke_width(2),
            ))
        }))?;
        let small = ("sans-serif", 11)
            .into_font()
            .color(&BLACK)
            .pos(Pos::new(HPos::Center, VPos::Bottom));
        chart.draw_series(figures(g).filter_map(|(i, f)| {
            let f = f?;
            Some(Text::new(
                format!("wait {:.0} ms, shed {}", f.wait_p90_ms, f.shed),
                (bar(g, i) + width * 0.45, f.ttft_p90_ms.max(0.5) * 1.3),
                small.clone(),
            ))
        }))?;
        let label = ("sans-serif", 14)
            .into_font()
            .color(&BLACK)
            .pos(Pos::new(HPos::Center, VPos::Top));
        chart.draw_series(std::iter::once(Text::new(
            t.to_string(),
            (g as f64 + 0.5, 0.5),
            label,
        )))?;
    }
    for (i, (name, _)) in outcomes.iter().enumerate() {
        chart
            .draw_series(std::iter::empty::<Rectangle<(f64, f64)>>())?
            .label(name.as_str())
            .legend(move |(x, y)| Rectangle::new([(x, y - 5), (x + 14, y + 5)], color(i).filled()));
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .position(SeriesLabelPosition::UpperRight)
        .draw()?;
    root.present()?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use switchyard_sim::report::TenantFigures;

    #[test]
    fn the_tenant_plot_draws_every_tenant_of_every_policy_with_its_wait_and_shed() {
        let figures = |p90, wait, shed| TenantFigures {
            ttft_p50_ms: p90 / 3.0,
            ttft_p90_ms: p90,
            wait_p90_ms: wait,
            shed,
            ..TenantFigures::default()
        };
        let mut fair = SimOutcome::default();
        fair.report
            .tenants
            .insert("chat".into(), figures(150.0, 0.0, 0));
        fair.report
            .tenants
            .insert("batch".into(), figures(9_000.0, 8_800.0, 12));
        // A policy without one of the tenants still draws the others.
        let mut fifo = SimOutcome::default();
        fifo.report
            .tenants
            .insert("chat".into(), figures(18_000.0, 17_500.0, 0));
        let dir = std::env::temp_dir().join(format!("switchyard-plot-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("tenants.svg");
        draw_tenants(&path, &[("ttft".into(), fair), ("ttft+fifo".into(), fifo)]).unwrap();
        let svg = std::fs::read_to_string(&path).unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
        for text in [
            "chat",
            "batch",
            "ttft+fifo",
            "wait 0 ms, shed 0",
            "wait 8800 ms, shed 12",
            "wait 17500 ms, shed 0",
        ] {
            assert!(svg.contains(text), "{text:?} is not drawn");
        }
    }
}
