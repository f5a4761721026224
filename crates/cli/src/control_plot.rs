//! The control figure, `<scenario>-control.svg`: how Justitia's loop steered each run that
//! has one, in the simulator or, on real verbs, as justitiad's metrics said it while the
//! run went (`justitia run --daemon-metrics`). Per run, two panels over time: above, SafeUtil and every bandwidth
//! and throughput flow's goodput (Gb/s); below, Current99 and Target99 (us, the reference
//! probe's post-to-completion p99). Every host that runs a loop adds its lines (most runs
//! have one: the host the flows post from). Spans in unattainable-target mode are shaded in both.
//!
//! Long runs are drawn from at most [`MAX_POINTS`] points per line: samples are averaged in
//! equal buckets (a bucket is shaded when any of its samples was unattainable), which keeps
//! the file small without moving a rate.

use std::fs;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use justitia_sim::series::{Mode, RunSeries};
use justitia_sim::{RunReport, ScenarioReport};
use plotters::element::DashedPathElement;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};

use crate::backend::Backend;
use crate::plot::{house_mesh, wrap, y_max, Area, Header, Swatch, FONT, SMALL_SIZE, TEXT_SIZE};

/// Most points drawn per line.
pub const MAX_POINTS: usize = 1_500;

const WIDTH_PX: u32 = 1_000;
const CAPTION_PX: u32 = 30;
const RATE_PANEL_PX: u32 = 300;
const LATENCY_PANEL_PX: u32 = 220;
const Y_LABEL_AREA_PX: u32 = 70;

/// Flow colours (Okabe-Ito without black and reddish purple, which the loop's own lines
/// use), in order of the flow's first appearance in the scenario.
const FLOW_COLOURS: [RGBColor; 6] = [
    RGBColor(0, 114, 178),
    RGBColor(230, 159, 0),
    RGBColor(0, 158, 115),
    RGBColor(213, 94, 0),
    RGBColor(86, 180, 233),
    RGBColor(240, 228, 66),
];
const SAFE_UTIL: RGBColor = RGBColor(0, 0, 0);
const LATENCY: RGBColor = RGBColor(204, 121, 167);
const UNATTAINABLE: RGBColor = RGBColor(228, 228, 228);

/// Writes `<dir>/<scenario>-control.svg` if some run of the report has a control loop.
pub fn write_control_figure(
    report: &ScenarioReport,
    dir: &Path,
    backend: &Backend,
) -> Result<Option<PathBuf>> {
    let Some(svg) = render_control_svg(report, backend)? else {
        return Ok(None);
    };
    let path = dir.join(format!("{}-control.svg", report.scenario));
    fs::write(&path, svg).with_context(|| format!("writing {}", path.display()))?;
    Ok(Some(path))
}

/// The runs with a control loop, in scenario order.
fn controlled(report: &ScenarioReport) -> Vec<&RunReport> {
    report
        .runs
        .iter()
        .filter(|r| !r.series.controls.is_empty() && !r.series.t_ms.is_empty())
        .collect()
}

/// The flows drawn: bandwidth and throughput flows of the controlled runs, by name, in
/// order of first appearance (a flow keeps its colour across runs).
fn drawn_flows(runs: &[&RunReport]) -> Vec<String> {
    let mut names: Vec<String> = Vec::new();
    for flow in runs.iter().flat_map(|r| &r.series.flows) {
        if flow.class.is_resource_hungry() && !names.contains(&flow.name) {
            names.push(flow.name.clone());
        }
    }
    names
}

/// Averages `values` in buckets of `bucket` samples.
fn decimate(values: &[f64], bucket: usize) -> Vec<f64> {
    values
        .chunks(bucket.max(1))
        .map(|c| c.iter().sum::<f64>() / c.len() as f64)
        .collect()
}

/// Averages the known values of each bucket; `None` for a bucket without any.
fn decimate_known(values: &[Option<f64>], bucket: usize) -> Vec<Option<f64>> {
    values
        .chunks(bucket.max(1))
        .map(|c| {
            let known: Vec<f64> = c.iter().flatten().copied().collect();
            (!known.is_empty()).then(|| known.iter().sum::<f64>() / known.len() as f64)
        })
        .collect()
}

/// What one run's panels show, already decimated.
struct RunLines {
    /// Sample times (end of each bucket), ms.
    t_ms: Vec<f64>,
    /// (colour index, values) per drawn flow.
    flows: Vec<(usize, Vec<f64>)>,
    /// Per host that runs a loop (drawn alike; usually one).
    controls: Vec<ControlLines>,
    /// Bucket spans (start ms, end ms) in unattainable mode.
    unattainable: Vec<(f64, f64)>,
}

struct ControlLines {
    safe_util: Vec<f64>,
    current99: Vec<Option<f64>>,
    target99: Vec<Option<f64>>,
}

fn run_lines(series: &RunSeries, flows: &[String]) -> RunLines {
    let n = series.t_ms.len();
    let bucket = n.div_ceil(MAX_POINTS).max(1);
    let t_ms: Vec<f64> = series
        .t_ms
        .chunks(bucket)
        .filter_map(|c| c.last().copied())
        .collect();
    let flow_lines = series
        .flows
        .iter()
        .filter_map(|f| {
            let colour = flows.iter().position(|name| *name == f.name)?;
            Some((colour, decimate(&f.gbps, bucket)))
        })
        .collect();
    let controls = series
        .controls
        .iter()
        .map(|c| ControlLines {
            safe_util: decimate(&c.safe_util_gbps, bucket),
            current99: decimate_known(&c.current99_us, bucket),
            target99: decimate_known(&c.target99_us, bucket),
        })
        .collect();
    let mut unattainable: Vec<(f64, f64)> = Vec::new();
    let modes: Vec<bool> = series
        .controls
        .iter()
        .fold(vec![false; n], |mut any, c| {
            for (a, m) in any.iter_mut().zip(&c.mode) {
                *a |= *m == Mode::Unattainable;
            }
            any
        })
        .chunks(bucket)
        .map(|c| c.iter().any(|&u| u))
        .collect();
    let step = series.interval_ms * bucket as f64;
    for (i, &u) in modes.iter().enumerate() {
        if !u {
            continue;
        }
        let end = t_ms[i];
        match unattainable.last_mut() {
            Some((_, last_end)) if (end - step - *last_end).abs() < step * 1e-6 => {
                *last_end = end;
            }
            _ => unattainable.push((end - step, end)),
        }
    }
    RunLines {
        t_ms,
        flows: flow_lines,
        controls,
        unattainable,
    }
}

/// Draws the control figure; `None` when no run has a control loop.
pub fn render_control_svg(report: &ScenarioReport, backend: &Backend) -> Result<Option<String>> {
    let runs = controlled(report);
    if runs.is_empty() {
        return Ok(None);
    }
    let flows = drawn_flows(&runs);
    let mut entries: Vec<(String, Swatch)> = flows
        .iter()
        .enumerate()
        .map(|(i, name)| {
            (
                format!("{name} goodput"),
                Swatch::Line(FLOW_COLOURS[i % FLOW_COLOURS.len()]),
            )
        })
        .collect();
    entries.push(("SafeUtil".into(), Swatch::Line(SAFE_UTIL)));
    entries.push(("Current99".into(), Swatch::Line(LATENCY)));
    entries.push(("Target99".into(), Swatch::Dashed(LATENCY)));
    let any_unattainable = runs.iter().any(|r| {
        r.series
            .controls
            .iter()
            .flat_map(|c| &c.mode)
            .any(|m| *m == Mode::Unattainable)
    });
    if any_unattainable {
        entries.push((
            "unattainable-target mode".into(),
            Swatch::Area(UNATTAINABLE),
        ));
    }

    let interval = runs.first().map_or(0.0, |r| r.series.interval_ms);
    let subtitle = match backend {
        Backend::Simulator => format!(
            "simulated: RNIC profile {}, {} ms per run, seed {}; sampled every {} ms; latency is the reference probe's post-to-completion p99",
            report.profile, report.duration_ms, report.seed, interval
        ),
        Backend::Verbs { device } => format!(
            "real verbs on {device}: justitiad's metrics read every {interval} ms while each run went ({} ms; with --repeat, its last repeat); latency is the daemon's reference probe's post-to-completion p99",
            report.duration_ms
        ),
    };
    let time_axis = match backend {
        Backend::Simulator => "simulated time (ms)",
        Backend::Verbs { .. } => "time (ms)",
    };
    let header = Header::new(
        WIDTH_PX,
        &format!("{}: control loop", report.description),
        wrap(&subtitle, SMALL_SIZE, WIDTH_PX - 40),
        entries,
    );
    let per_run = CAPTION_PX + RATE_PANEL_PX + LATENCY_PANEL_PX;
    let height = header.height() + per_run * runs.len() as u32;

    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (WIDTH_PX, height)).into_drawing_area();
        root.fill(&WHITE)?;
        let (top, mut body) = root.split_vertically(header.height());
        header.draw(&top)?;
        let centred = Pos::new(HPos::Center, VPos::Top);
        for run in &runs {
            let (area, rest) = body.split_vertically(per_run);
            body = rest;
            let (caption, panels) = area.split_vertically(CAPTION_PX);
            let (rate_area, latency_area) = panels.split_vertically(RATE_PANEL_PX);
            caption.draw(&Text::new(
                format!("run: {} (policy {})", run.variant, run.policy),
                ((WIDTH_PX / 2) as i32, 8),
                (FONT, TEXT_SIZE + 1).into_font().color(&BLACK).pos(centred),
            ))?;
            let lines = run_lines(&run.series, &flows);
            draw_rates(&rate_area, report.duration_ms, &lines)?;
            draw_latency(&latency_area, report.duration_ms, &lines, time_axis)?;
        }
        root.present()?;
    }
    Ok(Some(svg))
}

fn shade<DB: DrawingBackend>(
    chart: &mut ChartContext<
        '_,
        DB,
        Cartesian2d<plotters::coord::types::RangedCoordf64, plotters::coord::types::RangedCoordf64>,
    >,
    spans: &[(f64, f64)],
    y_max: f64,
) -> Result<()>
where
    DB::ErrorType: 'static,
{
    chart
        .draw_series(
            spans
                .iter()
                .map(|&(a, b)| Rectangle::new([(a, 0.0), (b, y_max)], UNATTAINABLE.filled())),
        )
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    Ok(())
}

fn draw_rates(area: &Area<'_>, duration_ms: f64, lines: &RunLines) -> Result<()> {
    let y_max = y_max(
        lines
            .flows
            .iter()
            .flat_map(|(_, v)| v)
            .chain(lines.controls.iter().flat_map(|c| &c.safe_util))
            .copied(),
        1.1,
    );
    let mut chart = ChartBuilder::on(area)
        .margin(10)
        .margin_right(36)
        .x_label_area_size(36)
        .y_label_area_size(Y_LABEL_AREA_PX)
        .build_cartesian_2d(0.0..duration_ms, 0.0..y_max)?;
    shade(&mut chart, &lines.unattainable, y_max)?;
    house_mesh(&mut chart.configure_mesh())
        .y_desc("rate (Gb/s)")
        .draw()?;
    for (colour, values) in &lines.flows {
        let colour = FLOW_COLOURS[colour % FLOW_COLOURS.len()];
        chart.draw_series(LineSeries::new(
            lines.t_ms.iter().copied().zip(values.iter().copied()),
            colour.stroke_width(2),
        ))?;
    }
    for control in &lines.controls {
        chart.draw_series(LineSeries::new(
            lines
                .t_ms
                .iter()
                .copied()
                .zip(control.safe_util.iter().copied()),
            SAFE_UTIL.stroke_width(3),
        ))?;
    }
    Ok(())
}

fn draw_latency(
    area: &Area<'_>,
    duration_ms: f64,
    lines: &RunLines,
    time_axis: &str,
) -> Result<()> {
    let y_max = y_max(
        lines
            .controls
            .iter()
            .flat_map(|c| c.current99.iter().chain(&c.target99))
            .flatten()
            .copied(),
        1.15,
    );
    let mut chart = ChartBuilder::on(area)
        .margin(10)
        .margin_right(36)
        .x_label_area_size(44)
        .y_label_area_size(Y_LABEL_AREA_PX)
        .build_cartesian_2d(0.0..duration_ms, 0.0..y_max)?;
    shade(&mut chart, &lines.unattainable, y_max)?;
    house_mesh(&mut chart.configure_mesh())
        .x_desc(time_axis)
        .y_desc("p99 (µs)")
        .draw()?;
    for control in &lines.controls {
        for segment in known_segments(&lines.t_ms, &control.current99) {
            chart.draw_series(LineSeries::new(segment, LATENCY.stroke_width(2)))?;
        }
        for segment in known_segments(&lines.t_ms, &control.target99) {
            chart.draw_series(std::iter::once(DashedPathElement::new(
                segment,
                8,
                6,
                LATENCY.stroke_width(2),
            )))?;
        }
    }
    Ok(())
}

/// Runs of consecutive known values as point lists (a line is not drawn across a gap).
fn known_segments(t_ms: &[f64], values: &[Option<f64>]) -> Vec<Vec<(f64, f64)>> {
    let mut segments: Vec<Vec<(f64, f64)>> = Vec::new();
    let mut current = Vec::new();
    for (&t, v) in t_ms.iter().zip(values) {
        match v {
            Some(v) if v.is_finite() => current.push((t, *v)),
            _ => {
                if !current.is_empty() {
                    segments.push(std::mem::take(&mut current));
                }
            }
        }
    }
    if !current.is_empty() {
        segments.push(current);
    }
    segments
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;
    use justitia_core::flow::FlowClass;
    use justitia_sim::series::{ControlSeries, FlowSeries};
    use std::collections::BTreeMap;

    fn run(policy: &str, samples: usize, unattainable: Vec<usize>) -> RunReport {
        let t_ms: Vec<f64> = (1..=samples).map(|i| i as f64 * 0.5).collect();
        let controls = if policy == "justitia" {
            vec![ControlSeries {
                host: "a".into(),
                safe_util_gbps: vec![24.0; samples],
                current99_us: (0..samples).map(|i| (i > 0).then_some(3.0)).collect(),
                target99_us: vec![Some(2.5); samples],
                mode: (0..samples)
                    .map(|i| {
                        if unattainable.contains(&i) {
                            Mode::Unattainable
                        } else {
                            Mode::Normal
                        }
                    })
                    .collect(),
            }]
        } else {
            Vec::new()
        };
        RunReport {
            variant: format!("with {policy}"),
            policy: policy.into(),
            flows: Vec::new(),
            utilisation: 0.5,
            jain_bandwidth: None,
            policy_figures: BTreeMap::new(),
            fabric_figures: BTreeMap::new(),
            events: 1,
            series: RunSeries {
                interval_ms: 0.5,
                t_ms,
                flows: vec![
                    FlowSeries {
                        name: "lat".into(),
                        class: FlowClass::Latency,
                        gbps: vec![0.1; samples],
                        mops: vec![0.3; samples],
                    },
                    FlowSeries {
                        name: "bw".into(),
                        class: FlowClass::Bandwidth,
                        gbps: vec![23.0; samples],
                        mops: vec![0.003; samples],
                    },
                ],
                controls,
            },
            wall_seconds: 0.0,
        }
    }

    fn report(runs: Vec<RunReport>) -> ScenarioReport {
        ScenarioReport {
            scenario: "s".into(),
            description: "a test".into(),
            profile: "IB-56".into(),
            seed: 1,
            duration_ms: 10.0,
            warmup_ms: 1.0,
            runs,
        }
    }

    #[test]
    fn no_control_loop_no_figure() {
        let r = report(vec![run("native", 20, vec![])]);
        assert!(render_control_svg(&r, &Backend::Simulator)
            .unwrap()
            .is_none());
    }

    #[test]
    fn the_figure_names_its_lines_and_shows_unattainable_spans() {
        let r = report(vec![
            run("native", 20, vec![]),
            run("justitia", 20, vec![3, 4, 9]),
        ]);
        let svg = render_control_svg(&r, &Backend::Simulator)
            .unwrap()
            .unwrap();
        let texts = crate::plot::tests::texts(&svg);
        for text in [
            "a test: control loop",
            "bw goodput",
            "SafeUtil",
            "Current99",
            "Target99",
            "unattainable-target mode",
            "run: with justitia (policy justitia)",
        ] {
            assert!(texts.iter().any(|t| t == text), "{text} missing: {texts:?}");
        }
        // The latency flow's own goodput is not a line of the rate panel.
        assert!(!texts.iter().any(|t| t == "lat goodput"));
        assert!(!texts.iter().any(|t| t.contains("with native")));
    }

    #[test]
    fn unattainable_samples_merge_into_spans() {
        let lines = run_lines(&run("justitia", 20, vec![3, 4, 9]).series, &["bw".into()]);
        // Samples 3 and 4 end at 2.0 and 2.5 ms, so cover (1.5, 2.5]; sample 9 (4.5, 5.0].
        assert_eq!(lines.unattainable, vec![(1.5, 2.5), (4.5, 5.0)]);
        assert_eq!(lines.flows.len(), 1);
        assert_eq!(lines.flows[0].0, 0);
    }

    #[test]
    fn long_runs_are_averaged_into_buckets() {
        let lines = run_lines(
            &run("justitia", 4 * MAX_POINTS, vec![]).series,
            &["bw".into()],
        );
        assert_eq!(lines.t_ms.len(), MAX_POINTS);
        assert_eq!(lines.t_ms[0], 2.0);
        assert_eq!(decimate(&[1.0, 3.0, 5.0, 7.0, 9.0], 2), vec![2.0, 6.0, 9.0]);
        assert_eq!(
            decimate_known(&[None, Some(2.0), None, None], 2),
            vec![Some(2.0), None]
        );
    }

    #[test]
    fn gaps_split_lines() {
        let segments = known_segments(
            &[1.0, 2.0, 3.0, 4.0],
            &[Some(1.0), None, Some(3.0), Some(4.0)],
        );
        assert_eq!(
            segments,
            vec![vec![(1.0, 1.0)], vec![(3.0, 3.0), (4.0, 4.0)]]
        );
    }
}
