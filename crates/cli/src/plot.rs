//! SVG figures in the style of the papers' evaluation plots: for each metric, one group of
//! bars per flow and one bar per run (e.g. alone / with a competitor / with a policy), with
//! the scenario's description as title and a shared legend of the runs.
//!
//! Two figures per scenario: latency (median and 99th percentile of the flows that care
//! about each message) and throughput (goodput of bandwidth flows, message rate of
//! throughput flows). The SVG backend writes text as `<text>` elements, so no font is read
//! when the figure is made; the viewer picks a sans-serif face.

use std::fs;
use std::ops::Range;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use justitia_core::flow::FlowClass;
use justitia_sim::{FlowReport, ScenarioReport};
use plotters::chart::MeshStyle;
use plotters::coord::ranged1d::{DefaultFormatting, KeyPointHint};
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};

use crate::backend::Backend;

/// Bar colours, one per run in scenario order (Okabe-Ito: distinct for colour-blind readers
/// and in greyscale print).
const PALETTE: [RGBColor; 8] = [
    RGBColor(0, 114, 178),
    RGBColor(230, 159, 0),
    RGBColor(0, 158, 115),
    RGBColor(213, 94, 0),
    RGBColor(204, 121, 167),
    RGBColor(86, 180, 233),
    RGBColor(240, 228, 66),
    RGBColor(0, 0, 0),
];

pub(crate) const FONT: &str = "sans-serif";
// Sizes as plotters takes them; it writes 1/1.24 of each into the SVG.
pub(crate) const TITLE_SIZE: u32 = 22;
pub(crate) const TEXT_SIZE: u32 = 17;
pub(crate) const SMALL_SIZE: u32 = 14;
/// A generous average glyph width of the sans-serif faces, as a fraction of the size given
/// to plotters (0.58 of the size written into the SVG), used to wrap and space text: SVG
/// cannot be asked how wide text will be.
const GLYPH_WIDTH: f64 = 0.47;

const BAR_WIDTH_PX: u32 = 24;
const GROUP_GAP_PX: u32 = 36;
const MIN_PANEL_WIDTH_PX: u32 = 380;
const MIN_FIGURE_WIDTH_PX: u32 = 760;
/// Wider figures do not fit a page or a screen; their bars get thinner instead.
const MAX_FIGURE_WIDTH_PX: u32 = 1400;
const PANEL_HEIGHT_PX: u32 = 420;
const Y_LABEL_AREA_PX: u32 = 70;

/// One metric over the flows that have it: `values[group][run]`.
#[derive(Clone, Debug, PartialEq)]
pub struct Panel {
    /// The panel's caption.
    pub title: String,
    /// The y axis label, with its unit.
    pub y_label: String,
    /// One group of bars per flow, by flow name.
    pub groups: Vec<String>,
    /// The value of each flow in each run; `None` when the flow did not run in that run.
    pub values: Vec<Vec<Option<f64>>>,
}

impl Panel {
    /// The runs that have at least one bar in this panel, in scenario order.
    pub fn runs_with_bars(&self) -> Vec<usize> {
        let runs = self.values.iter().map(Vec::len).max().unwrap_or(0);
        (0..runs)
            .filter(|&run| {
                self.values
                    .iter()
                    .any(|per_run| per_run.get(run).is_some_and(Option::is_some))
            })
            .collect()
    }
}

/// One SVG file: panels side by side under a shared title and legend.
#[derive(Clone, Debug, PartialEq)]
pub struct Figure {
    /// What follows the scenario's name in the file name (`latency`, `throughput`).
    pub kind: &'static str,
    /// The panels, left to right.
    pub panels: Vec<Panel>,
}

/// Writes every figure the simulated report has data for into `dir` and returns their
/// paths.
pub fn write_figures(report: &ScenarioReport, dir: &Path) -> Result<Vec<PathBuf>> {
    write_figures_on(report, dir, &Backend::Simulator)
}

/// Writes every figure the report has data for into `dir`, titled with the backend it ran
/// on, and returns their paths.
pub fn write_figures_on(
    report: &ScenarioReport,
    dir: &Path,
    backend: &Backend,
) -> Result<Vec<PathBuf>> {
    figures(report)
        .iter()
        .map(|figure| {
            let path = dir.join(format!("{}-{}.svg", report.scenario, figure.kind));
            let svg = render_svg_on(report, figure, backend)
                .with_context(|| format!("drawing {}", path.display()))?;
            fs::write(&path, svg).with_context(|| format!("writing {}", path.display()))?;
            Ok(path)
        })
        .collect()
}

/// The figures of a report; figures and panels without data are left out.
pub fn figures(report: &ScenarioReport) -> Vec<Figure> {
    // Latency is shown for the flows that care about each message; the latency of a 1 MB
    // transfer would only squash their bars.
    let latency_flows = |f: &FlowReport| f.class != FlowClass::Bandwidth && f.latency.is_some();
    let latency = Figure {
        kind: "latency",
        panels: vec![
            panel(
                report,
                "median latency",
                "latency (µs)",
                latency_flows,
                |f| f.latency.map(|l| l.p50_us),
            ),
            panel(
                report,
                "99th-percentile latency",
                "latency (µs)",
                latency_flows,
                |f| f.latency.map(|l| l.p99_us),
            ),
        ],
    };
    let throughput = Figure {
        kind: "throughput",
        panels: vec![
            panel(
                report,
                "bandwidth flows",
                "goodput (Gb/s)",
                |f| f.class == FlowClass::Bandwidth,
                |f| Some(f.gbps),
            ),
            panel(
                report,
                "throughput flows",
                "message rate (M msgs/s)",
                |f| f.class == FlowClass::Throughput,
                |f| Some(f.msgs_per_sec / 1e6),
            ),
        ],
    };
    [latency, throughput]
        .into_iter()
        .map(|mut figure| {
            figure.panels.retain(|p| !p.groups.is_empty());
            figure
        })
        .filter(|figure| !figure.panels.is_empty())
        .collect()
}

/// A panel of the flows that pass `include` in any run, in order of first appearance.
fn panel(
    report: &ScenarioReport,
    title: &str,
    y_label: &str,
    include: impl Fn(&FlowReport) -> bool,
    value: impl Fn(&FlowReport) -> Option<f64>,
) -> Panel {
    let mut groups: Vec<String> = Vec::new();
    for flow in report.runs.iter().flat_map(|r| &r.flows) {
        if include(flow) && !groups.contains(&flow.name) {
            groups.push(flow.name.clone());
        }
    }
    let values = groups
        .iter()
        .map(|name| {
            report
                .runs
                .iter()
                .map(|run| run.flow(name).and_then(&value))
                .collect()
        })
        .collect();
    Panel {
        title: title.to_string(),
        y_label: y_label.to_string(),
        groups,
        values,
    }
}

fn text_width_px(text: &str, size: u32) -> u32 {
    (text.chars().count() as f64 * f64::from(size) * GLYPH_WIDTH).ceil() as u32
}

/// Splits `text` at spaces into lines of at most `width_px`.
pub(crate) fn wrap(text: &str, size: u32, width_px: u32) -> Vec<String> {
    let mut lines: Vec<String> = Vec::new();
    let mut line = String::new();
    for word in text.split_whitespace() {
        let candidate = if line.is_empty() {
            word.to_string()
        } else {
            format!("{line} {word}")
        };
        if !line.is_empty() && text_width_px(&candidate, size) > width_px {
            lines.push(std::mem::replace(&mut line, word.to_string()));
        } else {
            line = candidate;
        }
    }
    if !line.is_empty() {
        lines.push(line);
    }
    lines
}

/// A value with three significant figures at most, as printed on a bar.
fn bar_label(v: f64) -> String {
    if v >= 100.0 {
        format!("{v:.0}")
    } else if v >= 10.0 {
        format!("{v:.1}")
    } else {
        format!("{v:.2}")
    }
}

fn panel_width_px(panel: &Panel, runs: usize) -> u32 {
    let groups = u32::try_from(panel.groups.len()).unwrap_or(u32::MAX);
    let runs = u32::try_from(runs).unwrap_or(u32::MAX);
    let bars = groups
        .saturating_mul(
            runs.saturating_mul(BAR_WIDTH_PX)
                .saturating_add(GROUP_GAP_PX),
        )
        .saturating_add(Y_LABEL_AREA_PX + 30);
    bars.max(MIN_PANEL_WIDTH_PX)
}

/// Places legend entries (a swatch and a name) in centred rows, wrapping when a row is
/// full: the position of each entry and the number of rows.
fn legend_layout(names: &[&str], width_px: u32) -> (Vec<(i32, i32)>, u32) {
    const MARGIN: u32 = 20;
    let usable = width_px.saturating_sub(2 * MARGIN);
    let mut rows: Vec<Vec<(usize, u32)>> = vec![Vec::new()];
    let mut row_width = 0;
    for (i, name) in names.iter().enumerate() {
        let entry = LEGEND_SWATCH_PX + 6 + text_width_px(name, TEXT_SIZE) + 24;
        if row_width > 0 && row_width + entry > usable {
            rows.push(Vec::new());
            row_width = 0;
        }
        if let Some(row) = rows.last_mut() {
            row.push((i, row_width));
        }
        row_width += entry;
    }
    let mut places = vec![(0, 0); names.len()];
    for (r, row) in rows.iter().enumerate() {
        let used = row.last().map_or(0, |&(i, x)| {
            x + LEGEND_SWATCH_PX + 6 + text_width_px(names[i], TEXT_SIZE)
        });
        let left = MARGIN + usable.saturating_sub(used) / 2;
        for &(i, x) in row {
            places[i] = ((left + x) as i32, (r as u32 * LEGEND_ROW_PX) as i32);
        }
    }
    (places, rows.len() as u32)
}

const LEGEND_SWATCH_PX: u32 = 14;
const LEGEND_ROW_PX: u32 = 24;

/// The drawing area of an SVG figure.
pub(crate) type Area<'a> = DrawingArea<SVGBackend<'a>, plotters::coord::Shift>;

/// How a legend entry's swatch is drawn.
pub(crate) enum Swatch {
    /// A short line, as a line series is drawn.
    Line(RGBColor),
    /// A line with a gap in its middle, as a dashed series is drawn.
    Dashed(RGBColor),
    /// A filled square, as a bar or a shaded span is drawn.
    Area(RGBColor),
}

/// The top of a figure: its title, the notes under it and a legend, centred on the
/// figure's width. Every figure lays its header out alike, so they read as one set.
pub(crate) struct Header {
    width: u32,
    title: Vec<String>,
    subtitle: Vec<String>,
    entries: Vec<(String, Swatch)>,
    /// Where each legend entry sits, from the legend's top left.
    places: Vec<(i32, i32)>,
    legend_top: u32,
    height: u32,
}

impl Header {
    /// Lays out a header `width` wide: `title` wrapped to the width, the `subtitle` lines
    /// as given, and a legend of `entries`.
    pub(crate) fn new(
        width: u32,
        title: &str,
        subtitle: Vec<String>,
        entries: Vec<(String, Swatch)>,
    ) -> Self {
        let title = wrap(title, TITLE_SIZE, width - 40);
        let names: Vec<&str> = entries.iter().map(|(n, _)| n.as_str()).collect();
        let (places, legend_rows) = legend_layout(&names, width);
        let title_px = 16 + title.len() as u32 * (TITLE_SIZE + 6);
        let legend_top = title_px + subtitle.len() as u32 * (SMALL_SIZE + 4) + 12;
        let height = legend_top + legend_rows * LEGEND_ROW_PX + 8;
        Header {
            width,
            title,
            subtitle,
            entries,
            places,
            legend_top,
            height,
        }
    }

    /// The header's height in pixels.
    pub(crate) fn height(&self) -> u32 {
        self.height
    }

    /// Draws the header into `area`, the top `height()` pixels of the figure.
    pub(crate) fn draw(&self, area: &Area<'_>) -> Result<()> {
        let centre = (self.width / 2) as i32;
        let centred = Pos::new(HPos::Center, VPos::Top);
        let title_style = (FONT, TITLE_SIZE).into_font().color(&BLACK).pos(centred);
        for (i, line) in self.title.iter().enumerate() {
            let y = 12 + i as i32 * (TITLE_SIZE + 6) as i32;
            area.draw(&Text::new(line.as_str(), (centre, y), &title_style))?;
        }
        let title_px = 16 + self.title.len() as u32 * (TITLE_SIZE + 6);
        let note_style = (FONT, SMALL_SIZE)
            .into_font()
            .color(&RGBColor(90, 90, 90))
            .pos(centred);
        for (i, line) in self.subtitle.iter().enumerate() {
            let y = title_px as i32 + i as i32 * (SMALL_SIZE + 4) as i32;
            area.draw(&Text::new(line.as_str(), (centre, y), &note_style))?;
        }
        let legend_style = (FONT, TEXT_SIZE)
            .into_font()
            .color(&BLACK)
            .pos(Pos::new(HPos::Left, VPos::Center));
        let half = (LEGEND_SWATCH_PX / 2) as i32;
        for ((name, swatch), (x, y)) in self.entries.iter().zip(&self.places) {
            let y = self.legend_top as i32 + y + half;
            let (x0, x1) = (*x, x + 2 * half);
            match swatch {
                Swatch::Line(c) => {
                    area.draw(&PathElement::new(vec![(x0, y), (x1, y)], c.stroke_width(3)))?
                }
                Swatch::Dashed(c) => {
                    for (a, b) in [(x0, x0 + 5), (x1 - 5, x1)] {
                        area.draw(&PathElement::new(vec![(a, y), (b, y)], c.stroke_width(3)))?;
                    }
                }
                Swatch::Area(c) => area.draw(&Rectangle::new(
                    [(x0, y - half), (x1, y + half)],
                    c.filled(),
                ))?,
            }
            area.draw(&Text::new(name.as_str(), (x1 + 6, y), &legend_style))?;
        }
        Ok(())
    }
}

/// The grid and label style every chart of the figures shares: one light line between
/// bold ones, labels and axis descriptions in the figures' sizes.
pub(crate) fn house_mesh<'m, 'a, 'b, X: Ranged, Y: Ranged, DB: DrawingBackend>(
    mesh: &'m mut MeshStyle<'a, 'b, X, Y, DB>,
) -> &'m mut MeshStyle<'a, 'b, X, Y, DB> {
    mesh.max_light_lines(1)
        .light_line_style(RGBColor(240, 240, 240))
        .bold_line_style(RGBColor(215, 215, 215))
        .label_style((FONT, SMALL_SIZE + 1))
        .axis_desc_style((FONT, TEXT_SIZE))
}

/// The top of a chart's y axis: `headroom` times the largest finite value, or 1 when there
/// is none above zero (an empty chart still gets an axis).
pub(crate) fn y_max(values: impl IntoIterator<Item = f64>, headroom: f64) -> f64 {
    let top = values
        .into_iter()
        .filter(|v| v.is_finite())
        .fold(0.0_f64, f64::max);
    if top > 0.0 {
        top * headroom
    } else {
        1.0
    }
}

/// Draws a figure of a simulated report and returns the SVG text.
pub fn render_svg(report: &ScenarioReport, figure: &Figure) -> Result<String> {
    render_svg_on(report, figure, &Backend::Simulator)
}

/// Draws a figure, its subtitle naming the backend, and returns the SVG text.
pub fn render_svg_on(
    report: &ScenarioReport,
    figure: &Figure,
    backend: &Backend,
) -> Result<String> {
    // Runs without a bar in a panel (e.g. the competitor alone in a latency panel) take no
    // place in it, and no legend entry unless another panel shows them; colours follow the
    // run's place in the scenario so that a run looks the same in every panel and figure.
    let per_panel: Vec<Vec<usize>> = figure.panels.iter().map(Panel::runs_with_bars).collect();
    let shown: Vec<usize> = (0..report.runs.len())
        .filter(|run| per_panel.iter().any(|runs| runs.contains(run)))
        .collect();
    let natural: Vec<u32> = figure
        .panels
        .iter()
        .zip(&per_panel)
        .map(|(p, runs)| panel_width_px(p, runs.len()))
        .collect();
    let width = natural
        .iter()
        .sum::<u32>()
        .clamp(MIN_FIGURE_WIDTH_PX, MAX_FIGURE_WIDTH_PX);
    // Panels share out the figure's width in proportion to what they need.
    let total = natural.iter().sum::<u32>().max(1);
    let widths: Vec<u32> = natural.iter().map(|w| w * width / total).collect();

    let subtitle = backend.subtitle(report);
    let entries = shown
        .iter()
        .map(|&run| {
            (
                report.runs[run].variant.clone(),
                Swatch::Area(PALETTE[run % PALETTE.len()]),
            )
        })
        .collect();
    let header = Header::new(width, &report.description, vec![subtitle], entries);
    let height = header.height() + PANEL_HEIGHT_PX;

    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (width, height)).into_drawing_area();
        root.fill(&WHITE)?;
        let (top, body) = root.split_vertically(header.height());
        header.draw(&top)?;

        let mut rest = body;
        for ((panel, panel_width), runs) in figure.panels.iter().zip(&widths).zip(&per_panel) {
            let (area, right) = rest.split_horizontally(*panel_width);
            draw_panel(&area, panel, runs)?;
            rest = right;
        }
        root.present()?;
    }
    Ok(svg)
}

/// The x axis of a bar panel: group `g` spans `[g, g + 1)` and its tick, which carries the
/// flow's name, sits at its centre.
struct FlowAxis {
    groups: usize,
}

impl Ranged for FlowAxis {
    type FormatOption = DefaultFormatting;
    type ValueType = f64;

    fn map(&self, value: &f64, limit: (i32, i32)) -> i32 {
        let span = f64::from(limit.1 - limit.0);
        limit.0 + (value / self.groups.max(1) as f64 * span).round() as i32
    }

    fn key_points<Hint: KeyPointHint>(&self, _hint: Hint) -> Vec<f64> {
        // Every flow is named, however crowded: a missing name makes its bars unreadable.
        (0..self.groups).map(|g| g as f64 + 0.5).collect()
    }

    fn range(&self) -> Range<f64> {
        0.0..self.groups as f64
    }
}

fn draw_panel(area: &Area<'_>, panel: &Panel, shown: &[usize]) -> Result<()> {
    let groups = panel.groups.len();
    // Headroom for the value printed on the tallest bar.
    let y_max = y_max(panel.values.iter().flatten().flatten().copied(), 1.15);
    let mut chart = ChartBuilder::on(area)
        .caption(&panel.title, (FONT, TEXT_SIZE + 1))
        .margin(12)
        .x_label_area_size(48)
        .y_label_area_size(Y_LABEL_AREA_PX)
        .build_cartesian_2d(FlowAxis { groups }, 0.0..y_max)?;
    let names = &panel.groups;
    let flow_name = |x: &f64| {
        // Ticks sit at group centres, so flooring finds the group.
        names
            .get(x.floor().max(0.0) as usize)
            .cloned()
            .unwrap_or_default()
    };
    house_mesh(&mut chart.configure_mesh())
        .disable_x_mesh()
        .x_desc("flow")
        .y_desc(panel.y_label.as_str())
        .x_label_formatter(&flow_name)
        .draw()?;

    // The bars of a group fill 80% of its width; a run that lacks the flow leaves a gap, so
    // a run's bar is at the same place in every group.
    let slot = 0.8 / shown.len().max(1) as f64;
    let bars: Vec<(f64, f64, usize)> = panel
        .values
        .iter()
        .enumerate()
        .flat_map(|(g, per_run)| {
            shown.iter().enumerate().filter_map(move |(place, &run)| {
                per_run
                    .get(run)
                    .copied()
                    .flatten()
                    .filter(|v| v.is_finite())
                    .map(|v| (g as f64 + 0.1 + place as f64 * slot, v, run))
            })
        })
        .collect();
    chart.draw_series(bars.iter().map(|&(x, v, run)| {
        Rectangle::new(
            [(x, 0.0), (x + slot * 0.92, v)],
            PALETTE[run % PALETTE.len()].filled(),
        )
    }))?;
    // Values are printed on the bars only where they fit above a bar.
    let plot_px = f64::from(area.dim_in_pixel().0.saturating_sub(Y_LABEL_AREA_PX + 24));
    let bar_px = plot_px * slot / groups.max(1) as f64;
    if bar_px >= f64::from(text_width_px("0.00", SMALL_SIZE)) {
        let style = (FONT, SMALL_SIZE)
            .into_font()
            .color(&BLACK)
            .pos(Pos::new(HPos::Center, VPos::Bottom));
        chart.draw_series(
            bars.iter()
                .map(|&(x, v, _)| Text::new(bar_label(v), (x + slot * 0.46, v), style.clone())),
        )?;
    }
    Ok(())
}

#[cfg(test)]
pub(crate) mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;
    use justitia_sim::{LatencyReport, RunReport};
    use std::collections::BTreeMap;

    fn flow(name: &str, class: FlowClass, gbps: f64, p50: Option<f64>) -> FlowReport {
        FlowReport {
            name: name.into(),
            class,
            app: class.as_str().into(),
            messages: 10,
            msgs_per_sec: 2e6,
            gbps,
            latency: p50.map(|p50_us| LatencyReport {
                samples: 10,
                p50_us,
                p99_us: p50_us * 2.0,
                p999_us: p50_us * 3.0,
                mean_us: p50_us,
                max_us: p50_us * 4.0,
            }),
        }
    }

    fn run(variant: &str, flows: Vec<FlowReport>) -> RunReport {
        RunReport {
            variant: variant.into(),
            policy: "native".into(),
            flows,
            utilisation: 0.5,
            jain_bandwidth: None,
            policy_figures: BTreeMap::new(),
            fabric_figures: BTreeMap::new(),
            events: 1,
            series: Default::default(),
            wall_seconds: 0.0,
        }
    }

    fn report() -> ScenarioReport {
        ScenarioReport {
            scenario: "s".into(),
            description: "a latency flow against a bandwidth flow, which is a long description that has to wrap onto a second line of the title".into(),
            profile: "IB-56".into(),
            seed: 1,
            duration_ms: 10.0,
            warmup_ms: 1.0,
            runs: vec![
                run("alone", vec![flow("lat", FlowClass::Latency, 0.1, Some(1.3))]),
                run(
                    "with bw",
                    vec![
                        flow("lat", FlowClass::Latency, 0.1, Some(2.4)),
                        flow("bw", FlowClass::Bandwidth, 47.0, Some(180.0)),
                    ],
                ),
            ],
        }
    }

    #[test]
    fn figures_group_flows_by_metric_and_leave_gaps() {
        let figures = figures(&report());
        assert_eq!(figures.len(), 2);
        let latency = &figures[0];
        assert_eq!(latency.kind, "latency");
        // The bandwidth flow's transfer latency stays out of the latency figure.
        assert_eq!(latency.panels[0].groups, vec!["lat"]);
        assert_eq!(latency.panels[0].values, vec![vec![Some(1.3), Some(2.4)]]);
        assert_eq!(latency.panels[1].values, vec![vec![Some(2.6), Some(4.8)]]);
        let throughput = &figures[1];
        // No throughput-class flow, so only the bandwidth panel.
        assert_eq!(throughput.panels.len(), 1);
        assert_eq!(throughput.panels[0].groups, vec!["bw"]);
        assert_eq!(throughput.panels[0].values, vec![vec![None, Some(47.0)]]);
    }

    /// The text of every `<text>` element.
    pub(crate) fn texts(svg: &str) -> Vec<String> {
        svg.split("<text")
            .skip(1)
            .filter_map(|t| {
                let body = &t[t.find('>')? + 1..];
                Some(body[..body.find("</text>")?].trim().to_string())
            })
            .collect()
    }

    #[test]
    fn svg_has_title_axes_legend_and_values() {
        let report = report();
        let svg = render_svg(&report, &figures(&report)[0]).unwrap();
        let texts = texts(&svg);
        // The long title wraps onto two lines that together say all of it.
        assert_eq!(
            format!("{} {}", texts[0], texts[1]),
            report.description,
            "{texts:?}"
        );
        for text in [
            "median latency",
            "99th-percentile latency",
            "latency (µs)",
            "flow",
            "alone",
            "with bw",
            "lat",
            "2.40",
        ] {
            assert!(
                texts.iter().any(|t| t == text),
                "{text} missing from {texts:?}"
            );
        }
    }

    #[test]
    fn long_text_wraps_and_short_text_does_not() {
        assert_eq!(wrap("one two", 20, 400), vec!["one two"]);
        let lines = wrap(&"word ".repeat(40), 20, 300);
        assert!(lines.len() > 1);
        assert!(lines.iter().all(|l| text_width_px(l, 20) <= 300));
    }

    #[test]
    fn legend_wraps_to_new_rows() {
        let owned: Vec<String> = (0..8).map(|i| format!("run number {i}")).collect();
        let names: Vec<&str> = owned.iter().map(String::as_str).collect();
        let (places, rows) = legend_layout(&names, 720);
        assert_eq!(places.len(), 8);
        assert!(rows > 1);
        assert!(places.iter().all(|&(x, _)| x < 720));
    }

    #[test]
    fn bar_labels_keep_three_figures() {
        assert_eq!(bar_label(1.234), "1.23");
        assert_eq!(bar_label(47.66), "47.7");
        assert_eq!(bar_label(180.4), "180");
    }
}
