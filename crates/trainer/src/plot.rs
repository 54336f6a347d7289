//! Plots: training curves from `metrics.jsonl`, and throughput / peak memory of a batch-size sweep.
//!
//! Every plot is drawn twice from the same description and written as a pair: a PNG (plotters' bitmap backend,
//! encoded with `image`) and an SVG with the same name next to it (`curves.png` and `curves.svg`), whose text is
//! real SVG `<text>`. Text is laid out, and rasterised into the PNG, with a font compiled into the binary
//! ([`FONT_BYTES`]: a Latin subset of DejaVu Sans, see `crates/trainer/assets/fonts/README.md`), so titles, axis
//! labels with units, tick labels and legends are there on every machine, with or without installed fonts, and a
//! plot looks the same wherever it is drawn.

use anyhow::{anyhow, bail, Context, Result};
use plotters::coord::Shift;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};
use plotters::style::{register_font, FontStyle};
use serde::Deserialize;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

/// Size of every plot, in pixels (PNG) or user units (SVG).
pub const WIDTH: u32 = 1400;
pub const HEIGHT: u32 = 600;

/// The font all plot text uses: DejaVu Sans cut down to ASCII and Latin-1 (licence beside it).
pub const FONT_BYTES: &[u8] = include_bytes!("../assets/fonts/DejaVuSans-subset.ttf");

/// The family [`FONT_BYTES`] is registered under. It is also written as the SVG `font-family`, so an SVG viewer
/// uses DejaVu Sans where installed (the metrics the layout was made with) and its own sans-serif elsewhere.
const FAMILY: &str = "DejaVu Sans, sans-serif";

/// Registers the bundled font with plotters, once per process.
fn font() -> Result<()> {
    static REGISTERED: OnceLock<bool> = OnceLock::new();
    if *REGISTERED.get_or_init(|| register_font(FAMILY, FontStyle::Normal, FONT_BYTES).is_ok()) {
        Ok(())
    } else {
        bail!("the plot font compiled into the trainer (assets/fonts/DejaVuSans-subset.ttf) is not a valid font")
    }
}

fn text(size: u32) -> TextStyle<'static> {
    (FAMILY, size).into_font().color(&BLACK)
}

/// The SVG written next to the PNG `png`: same folder and name, extension `svg`.
pub fn svg_path(png: &Path) -> PathBuf {
    png.with_extension("svg")
}

/// The two files of one plot.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PlotFiles {
    pub png: PathBuf,
    pub svg: PathBuf,
}

#[derive(Debug, Deserialize)]
struct StepRecord {
    step: u64,
    epoch: Option<u64>,
    /// NaN or inf losses are written as null by serde_json.
    loss: Option<f64>,
    #[serde(default)]
    skipped: bool,
}

#[derive(Debug, Deserialize)]
struct EpochRecord {
    epoch: u64,
    train_loss: Option<f64>,
    val_loss: Option<f64>,
    val_top1: Option<f64>,
    val_top5: Option<f64>,
}

#[derive(Debug, Default)]
struct Metrics {
    steps: Vec<StepRecord>,
    epochs: Vec<EpochRecord>,
}

fn read_metrics(path: &Path) -> Result<Metrics> {
    let body = std::fs::read_to_string(path).with_context(|| format!("reading metrics file {}", path.display()))?;
    let mut m = Metrics::default();
    for (i, line) in body.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() {
            continue;
        }
        let at = || format!("metrics file {} line {}", path.display(), i + 1);
        let value: serde_json::Value = serde_json::from_str(line).with_context(|| format!("{}: not JSON", at()))?;
        let kind =
            value.get("kind").and_then(|k| k.as_str()).ok_or_else(|| anyhow!("{}: no string field \"kind\"", at()))?;
        match kind {
            "step" => m.steps.push(serde_json::from_value(value).with_context(|| format!("{}: step record", at()))?),
            "epoch" => m.epochs.push(serde_json::from_value(value).with_context(|| format!("{}: epoch record", at()))?),
            _ => {}
        }
    }
    if m.steps.is_empty() && m.epochs.is_empty() {
        bail!("metrics file {} has no step or epoch records", path.display());
    }
    Ok(m)
}

/// A named set of points drawn as a line, markers or both.
struct Series {
    label: &'static str,
    color: RGBColor,
    points: Vec<(f64, f64)>,
    line: bool,
    markers: bool,
}

impl Series {
    fn new(label: &'static str, color: RGBColor, points: Vec<(f64, f64)>, line: bool, markers: bool) -> Self {
        let points = points.into_iter().filter(|(x, y)| x.is_finite() && y.is_finite()).collect();
        Self { label, color, points, line, markers }
    }
}

struct Panel<'a> {
    caption: String,
    /// Axis descriptions, with the unit in brackets.
    x_desc: &'a str,
    y_desc: &'a str,
    series: Vec<Series>,
    /// Fixed x range; otherwise [`x_axis_range`] of the panel's data.
    x_range: Option<(f64, f64)>,
    /// Fixed y range; otherwise the data's, padded.
    y_range: Option<(f64, f64)>,
    /// x values are log2 of the quantity; labels show 2^x.
    x_log2: bool,
    /// Red crosses: x positions (at the bottom of the panel unless a y is given) of failed runs or skipped steps.
    failures: Vec<(f64, Option<f64>)>,
    failure_label: &'a str,
    /// Where the legend goes: the corner the curves usually leave free.
    legend: SeriesLabelPosition,
    /// Written in the middle of the panel, instead of a legend, when it has nothing to draw.
    empty_note: &'a str,
}

/// Axis tick text: at most 6 significant digits, no trailing zeros ("2000", "1.5", "0.25").
fn tick(v: f64) -> String {
    if v == 0.0 || !v.is_finite() {
        return format!("{}", if v.is_finite() { 0.0 } else { v });
    }
    let decimals = (5 - v.abs().log10().floor() as i32).clamp(0, 12) as usize;
    let s = format!("{v:.decimals$}");
    let s = if s.contains('.') { s.trim_end_matches('0').trim_end_matches('.') } else { &s };
    if s == "-0" {
        "0".into()
    } else {
        s.to_string()
    }
}

/// x range of a panel. x is a whole number (step, epoch, log2 of a batch size) and only whole numbers get tick
/// labels, so every range holds at least one: a log2 axis gets half a doubling either side (a single batch size
/// gets a tick), a linear one 3% either side and a width of at least 2.
fn x_axis_range(xs: impl Iterator<Item = f64>, log2: bool) -> (f64, f64) {
    let (lo, hi) = padded_range(xs, 0.0);
    let pad = if log2 { 0.5 } else { ((hi - lo) * 0.03).max((2.0 - (hi - lo)) / 2.0) };
    (lo - pad, hi + pad)
}

/// x of everything drawn in panel `p`.
fn panel_xs<'a>(p: &'a Panel) -> impl Iterator<Item = f64> + 'a {
    p.series.iter().flat_map(|s| s.points.iter().map(|(x, _)| *x)).chain(p.failures.iter().map(|f| f.0))
}

/// Padded [lo, hi] of `values`, never empty, `(0, 1)` when there are none.
fn padded_range(values: impl Iterator<Item = f64>, pad_frac: f64) -> (f64, f64) {
    let (lo, hi) = values.fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), v| (lo.min(v), hi.max(v)));
    if !lo.is_finite() || !hi.is_finite() {
        return (0.0, 1.0);
    }
    let span = if hi > lo { hi - lo } else { lo.abs().max(1.0) };
    (lo - span * pad_frac, hi + span * pad_frac)
}

fn draw_panel<DB: DrawingBackend>(area: &DrawingArea<DB, Shift>, p: &Panel) -> Result<()>
where
    DB::ErrorType: 'static,
{
    let err =
        |what: &str, e: DrawingAreaErrorKind<DB::ErrorType>| anyhow!("drawing {what} of panel {:?}: {e}", p.caption);
    let (x0, x1) = p.x_range.unwrap_or_else(|| x_axis_range(panel_xs(p), p.x_log2));
    let (y0, y1) = p.y_range.unwrap_or_else(|| {
        let ys = p.series.iter().flat_map(|s| s.points.iter().map(|(_, y)| *y));
        let ys = ys.chain(p.failures.iter().filter_map(|f| f.1));
        padded_range(ys, 0.05)
    });
    let mut chart = ChartBuilder::on(area)
        .margin(12)
        .caption(&p.caption, text(20))
        .x_label_area_size(50)
        .y_label_area_size(75)
        .build_cartesian_2d(x0..x1, y0..y1)
        .map_err(|e| err("axes", e))?;

    // x ticks only at whole numbers: there is no step 2.5, and on a log2 axis 2^5.5 would read as a batch size of 45
    // that was never run.
    let x_label = |x: &f64| match ((x - x.round()).abs() < 1e-9, p.x_log2) {
        (false, _) => String::new(),
        (true, true) => tick(2f64.powf(x.round())),
        (true, false) => tick(x.round()),
    };
    // At most as many labels as whole numbers in range, so plotters steps by 1, 2, 5, 10, ...
    let whole_numbers = (x1.floor() - x0.ceil()).max(0.0) as usize + 1;
    let plain_label = |v: &f64| tick(*v);
    let mut mesh = chart.configure_mesh();
    mesh.light_line_style(RGBColor(235, 235, 235))
        .x_desc(p.x_desc)
        .y_desc(p.y_desc)
        .label_style(text(14))
        .axis_desc_style(text(15))
        .y_label_formatter(&plain_label)
        .x_labels(whole_numbers.clamp(1, if p.x_log2 { 12 } else { 10 }))
        .x_label_formatter(&x_label);
    mesh.draw().map_err(|e| err("mesh", e))?;

    let mut labelled = false;
    for s in p.series.iter().filter(|s| !s.points.is_empty()) {
        labelled = true;
        let color = s.color;
        let as_line = s.line && s.points.len() > 1;
        if as_line {
            let anno = chart
                .draw_series(LineSeries::new(s.points.iter().copied(), color.stroke_width(2)))
                .map_err(|e| err(s.label, e))?;
            anno.label(s.label).legend(move |(x, y)| PathElement::new([(x, y), (x + 20, y)], color.stroke_width(2)));
        }
        if s.markers || !as_line {
            let anno = chart
                .draw_series(s.points.iter().map(|&pt| Circle::new(pt, 4, color.filled())))
                .map_err(|e| err(s.label, e))?;
            if !as_line {
                anno.label(s.label).legend(move |(x, y)| Circle::new((x + 10, y), 4, color.filled()));
            }
        }
    }
    if !p.failures.is_empty() {
        let at = p
            .failures
            .iter()
            .map(|&(x, y)| Cross::new((x, y.unwrap_or(y0 + (y1 - y0) * 0.04)), 7, RED.stroke_width(3)));
        let anno = chart.draw_series(at).map_err(|e| err(p.failure_label, e))?;
        anno.label(p.failure_label).legend(|(x, y)| Cross::new((x + 10, y), 6, RED.stroke_width(3)));
        labelled = true;
    }
    if !labelled {
        let centre = ((x0 + x1) / 2.0, (y0 + y1) / 2.0);
        let note = Text::new(p.empty_note, centre, text(16).pos(Pos::new(HPos::Center, VPos::Center)));
        chart.plotting_area().draw(&note).map_err(|e| err("note", e))?;
        return Ok(());
    }
    chart
        .configure_series_labels()
        .label_font(text(14))
        .background_style(WHITE.mix(0.85))
        .border_style(RGBColor(180, 180, 180))
        .position(p.legend.clone())
        .draw()
        .map_err(|e| err("legend", e))?;
    Ok(())
}

/// Draws the title and two panels side by side on `root`.
fn draw_figure<DB: DrawingBackend>(root: DrawingArea<DB, Shift>, title: &str, left: &Panel, right: &Panel) -> Result<()>
where
    DB::ErrorType: 'static,
{
    let draw_err = |e: DrawingAreaErrorKind<DB::ErrorType>| anyhow!("{e}");
    root.fill(&WHITE).map_err(draw_err)?;
    let body = root.margin(8, 0, 0, 0).titled(title, text(24)).map_err(draw_err)?;
    let (l, r) = body.split_horizontally(WIDTH / 2);
    draw_panel(&l, left)?;
    draw_panel(&r, right)?;
    root.present().map_err(draw_err)
}

/// Draws the figure as SVG and as PNG, then writes `out_png` and the SVG beside it ([`svg_path`]). Nothing is
/// written when drawing fails.
fn render(out_png: &Path, title: &str, left: &Panel, right: &Panel) -> Result<PlotFiles> {
    if out_png.extension().is_none_or(|e| !e.eq_ignore_ascii_case("png")) {
        bail!("plot {}: the file name must end in .png (the SVG goes next to it)", out_png.display());
    }
    font()?;
    let files = PlotFiles { png: out_png.to_path_buf(), svg: svg_path(out_png) };
    let mut svg = String::new();
    draw_figure(SVGBackend::with_string(&mut svg, (WIDTH, HEIGHT)).into_drawing_area(), title, left, right)
        .with_context(|| format!("plotting {}", files.svg.display()))?;
    let mut rgb = vec![0u8; WIDTH as usize * HEIGHT as usize * 3];
    draw_figure(BitMapBackend::with_buffer(&mut rgb, (WIDTH, HEIGHT)).into_drawing_area(), title, left, right)
        .with_context(|| format!("plotting {}", files.png.display()))?;
    if let Some(dir) = out_png.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).with_context(|| format!("creating folder {} for a plot", dir.display()))?;
    }
    image::save_buffer_with_format(
        &files.png,
        &rgb,
        WIDTH,
        HEIGHT,
        image::ExtendedColorType::Rgb8,
        image::ImageFormat::Png,
    )
    .with_context(|| format!("writing plot {}", files.png.display()))?;
    std::fs::write(&files.svg, svg).with_context(|| format!("writing plot {}", files.svg.display()))?;
    Ok(files)
}

/// Loss (train and val) and accuracy (val top-1/top-5, in percent) against step (or epoch, when there are no step
/// records), from the records of `metrics_jsonl` (step and epoch records; other kinds are ignored). Writes
/// `out_png` and the same plot as SVG next to it.
pub fn training_curves(metrics_jsonl: &Path, out_png: &Path) -> Result<PlotFiles> {
    let m = read_metrics(metrics_jsonl)?;
    // Title: the run folder and file name, not the whole path.
    let parts: Vec<_> = metrics_jsonl.iter().map(|c| c.to_string_lossy()).collect();
    let source = parts[parts.len().saturating_sub(2)..].join("/");
    draw_training_curves(&m, &source, out_png)
}

/// x of each epoch record: the last step logged in that epoch, else an estimate from the mean steps per epoch;
/// plain epoch numbers when no steps were logged.
fn epoch_positions(m: &Metrics) -> Vec<f64> {
    if m.steps.is_empty() {
        return m.epochs.iter().map(|e| e.epoch as f64).collect();
    }
    let mut last_step = std::collections::BTreeMap::<u64, u64>::new();
    for s in &m.steps {
        if let Some(e) = s.epoch {
            let v = last_step.entry(e).or_insert(s.step);
            *v = (*v).max(s.step);
        }
    }
    let (first_epoch, last_epoch) = match (last_step.keys().next(), last_step.keys().next_back()) {
        (Some(&a), Some(&b)) => (a, b),
        _ => (0, 0),
    };
    let max_step = m.steps.iter().map(|s| s.step).max().unwrap_or(0) as f64;
    let per_epoch = max_step / (last_epoch - first_epoch + 1) as f64;
    m.epochs
        .iter()
        .map(|e| match last_step.get(&e.epoch) {
            Some(&s) => s as f64,
            None => (e.epoch as f64 - first_epoch as f64 + 1.0) * per_epoch,
        })
        .collect()
}

fn draw_training_curves(m: &Metrics, source: &str, out_png: &Path) -> Result<PlotFiles> {
    let ex = epoch_positions(m);
    let x_desc = if m.steps.is_empty() { "epoch" } else { "optimizer step" };
    let per_epoch = |f: fn(&EpochRecord) -> Option<f64>| -> Vec<(f64, f64)> {
        m.epochs.iter().zip(&ex).filter_map(|(e, &x)| f(e).map(|y| (x, y))).collect()
    };
    let step_loss: Vec<(f64, f64)> = m.steps.iter().filter_map(|s| s.loss.map(|l| (s.step as f64, l))).collect();
    let skipped: Vec<(f64, Option<f64>)> =
        m.steps.iter().filter(|s| s.skipped).map(|s| (s.step as f64, s.loss.filter(|l| l.is_finite()))).collect();
    let mut loss = Panel {
        caption: "loss".into(),
        x_desc,
        y_desc: "cross-entropy loss (nats)",
        series: vec![
            Series::new("train, logged steps", RGBColor(150, 190, 230), step_loss, true, false),
            Series::new("train, epoch mean", RGBColor(31, 119, 180), per_epoch(|e| e.train_loss), true, true),
            Series::new("validation", RGBColor(255, 127, 14), per_epoch(|e| e.val_loss), true, true),
        ],
        x_range: None,
        y_range: None,
        x_log2: false,
        failures: skipped,
        failure_label: "skipped step (non-finite gradients)",
        legend: SeriesLabelPosition::UpperRight,
        empty_note: "no finite loss in the metrics",
    };
    let (top1, top5) = (per_epoch(|e| e.val_top1), per_epoch(|e| e.val_top5));
    // The trainer logs accuracies in percent. The axis ends at 100 or a little above the best value, so that the
    // first epochs of a 1000-class run are not a flat line at the bottom.
    let best = top1.iter().chain(&top5).map(|p| p.1).fold(0.0, f64::max);
    let top = if top1.is_empty() && top5.is_empty() { 100.0 } else { (best * 1.1).clamp(1.0, 100.0) };
    let mut acc = Panel {
        caption: "validation accuracy".into(),
        x_desc,
        y_desc: "accuracy (%)",
        series: vec![
            Series::new("top-1", RGBColor(44, 160, 44), top1, true, true),
            Series::new("top-5", RGBColor(148, 103, 189), top5, true, true),
        ],
        x_range: None,
        y_range: Some((0.0, top)),
        x_log2: false,
        failures: Vec::new(),
        failure_label: "",
        legend: SeriesLabelPosition::LowerRight,
        empty_note: "no validation accuracy in the metrics",
    };
    // One x range for both panels, so that a step sits at the same place in each.
    let xs: Vec<f64> = panel_xs(&loss).chain(panel_xs(&acc)).collect();
    let shared = x_axis_range(xs.into_iter(), false);
    (loss.x_range, acc.x_range) = (Some(shared), Some(shared));
    let title = format!("training curves: {source}");
    render(out_png, &title, &loss, &acc)
}

/// One batch size of a sweep; `oom` rows ran out of memory (their numbers, if any, are where they stopped).
#[derive(Debug, Clone, PartialEq)]
pub struct SweepRow {
    pub batch_size: usize,
    pub img_per_s: Option<f64>,
    pub peak_gib: Option<f64>,
    pub oom: bool,
}

/// img/s and peak GiB against batch size (log2 axis), two panels; rows with `oom` marked with red crosses.
/// Writes `out_png` and the same plot as SVG next to it.
pub fn sweep_plot(rows: &[SweepRow], title: &str, out_png: &Path) -> Result<PlotFiles> {
    if rows.is_empty() {
        bail!("sweep plot {}: no rows", out_png.display());
    }
    if let Some(r) = rows.iter().find(|r| r.batch_size == 0) {
        bail!("sweep plot {}: batch size 0 in row {r:?}", out_png.display());
    }
    let mut rows = rows.to_vec();
    rows.sort_by_key(|r| r.batch_size);
    let x = |r: &SweepRow| (r.batch_size as f64).log2();
    let ok = |f: fn(&SweepRow) -> Option<f64>| -> Vec<(f64, f64)> {
        rows.iter().filter(|r| !r.oom).filter_map(|r| f(r).map(|y| (x(r), y))).collect()
    };
    let failed = |f: fn(&SweepRow) -> Option<f64>| -> Vec<(f64, Option<f64>)> {
        rows.iter().filter(|r| r.oom).map(|r| (x(r), f(r))).collect()
    };
    let (speed, mem) = (ok(|r| r.img_per_s), ok(|r| r.peak_gib));
    let speed_top = speed.iter().map(|p| p.1).fold(0.0, f64::max);
    let fails_mem = failed(|r| r.peak_gib);
    let mem_top = mem.iter().map(|p| p.1).chain(fails_mem.iter().filter_map(|f| f.1)).fold(0.0, f64::max);
    let x_desc = "batch size (images per step, log2 scale)";
    let left = Panel {
        caption: "throughput".into(),
        x_desc,
        y_desc: "throughput (img/s)",
        x_range: None,
        y_range: Some((0.0, speed_top.max(1e-9) * 1.1)),
        series: vec![Series::new("throughput", RGBColor(31, 119, 180), speed, true, true)],
        x_log2: true,
        failures: failed(|_| None),
        failure_label: "out of memory",
        legend: SeriesLabelPosition::UpperLeft,
        empty_note: "no measurements",
    };
    let right = Panel {
        caption: "peak memory".into(),
        x_desc,
        y_desc: "peak device memory (GiB)",
        x_range: None,
        y_range: Some((0.0, mem_top.max(1e-9) * 1.1)),
        series: vec![Series::new("peak memory", RGBColor(148, 103, 189), mem, true, true)],
        x_log2: true,
        failures: fails_mem,
        failure_label: "out of memory",
        legend: SeriesLabelPosition::UpperLeft,
        empty_note: "no measurements",
    };
    render(out_png, title, &left, &right)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    fn temp_dir(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("trainer-plot-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).expect("temp dir");
        d
    }

    /// Removes a test's folder unless TRAINER_KEEP_TEST_PLOTS is set (to look at the plots).
    fn cleanup(dir: &Path) {
        if std::env::var_os("TRAINER_KEEP_TEST_PLOTS").is_none() {
            let _ = std::fs::remove_dir_all(dir);
        }
    }

    /// The contents of the SVG's `<text>` elements, unescaped and trimmed, in document order.
    fn svg_texts(svg: &Path) -> Vec<String> {
        let body = std::fs::read_to_string(svg).unwrap_or_else(|e| panic!("reading {}: {e}", svg.display()));
        assert!(body.starts_with("<svg") && body.trim_end().ends_with("</svg>"), "{} is not an SVG", svg.display());
        let dims = format!(r#"width="{WIDTH}" height="{HEIGHT}""#);
        assert!(body.contains(&dims), "{} lacks {dims}", svg.display());
        let mut out = Vec::new();
        let mut rest = body.as_str();
        while let Some(open) = rest.find("<text") {
            let after = &rest[open..];
            let start = after.find('>').expect("unterminated <text") + 1;
            let end = after.find("</text>").expect("no </text>");
            let t = after[start..end].trim();
            let t = t.replace("&lt;", "<").replace("&gt;", ">").replace("&quot;", "\"").replace("&apos;", "'");
            out.push(t.replace("&amp;", "&"));
            rest = &after[end..];
        }
        out
    }

    /// Asserts every string of `want` is the whole text of some `<text>` element of `texts`.
    fn assert_texts(texts: &[String], want: &[&str], what: &Path) {
        let have: HashSet<&str> = texts.iter().map(String::as_str).collect();
        let missing: Vec<&&str> = want.iter().filter(|w| !have.contains(**w)).collect();
        assert!(missing.is_empty(), "{}: no text {missing:?} among {texts:?}", what.display());
    }

    /// Decodes `png` and checks its size, that it is not blank, that it has the series colours `colours`, and that
    /// it has text: dark, anti-aliased (many grey levels) pixels in the title band at the top, where nothing else is
    /// drawn.
    fn check_png(png: &Path, colours: &[RGBColor]) {
        let img = image::open(png).unwrap_or_else(|e| panic!("decoding {}: {e}", png.display())).to_rgb8();
        assert_eq!(img.dimensions(), (WIDTH, HEIGHT), "{}", png.display());
        let all: HashSet<[u8; 3]> = img.pixels().map(|p| p.0).collect();
        assert!(all.len() > 16, "{} is (nearly) blank: {} colours", png.display(), all.len());
        for c in colours {
            assert!(all.contains(&[c.0, c.1, c.2]), "{}: no pixel of series colour {c:?}", png.display());
        }
        let title_band: Vec<[u8; 3]> =
            (0..40).flat_map(|y| (0..WIDTH).map(move |x| (x, y))).map(|(x, y)| img.get_pixel(x, y).0).collect();
        let dark = title_band.iter().filter(|p| p.iter().all(|&v| v < 80)).count();
        let greys: HashSet<&[u8; 3]> = title_band.iter().filter(|p| p[0] == p[1] && p[1] == p[2]).collect();
        assert!(
            dark > 60 && greys.len() > 20,
            "{}: no title text ({dark} dark pixels, {} greys)",
            png.display(),
            greys.len()
        );
    }

    fn write_metrics(dir: &Path) -> PathBuf {
        let mut lines = Vec::new();
        for epoch in 0..4u64 {
            for i in 0..10u64 {
                let step = epoch * 10 + i + 1;
                let loss = 2.3 * (-(step as f64) / 25.0).exp() + 0.1;
                lines.push(format!(
                    r#"{{"kind":"step","step":{step},"epoch":{epoch},"loss":{loss},"lr":0.1,"loss_scale":65536.0,"skipped":{},"img_per_s":1234.5}}"#,
                    step == 13
                ));
            }
            lines.push(r#"{"kind":"telemetry","t_s":1.0,"power_w":600.0}"#.to_string());
            let val = if epoch == 1 { "null".to_string() } else { format!("{}", 1.0 / (epoch + 1) as f64) };
            lines.push(format!(
                r#"{{"kind":"epoch","epoch":{epoch},"train_loss":{},"val_loss":{val},"val_top1":{},"val_top5":{},"img_per_s":1200.0}}"#,
                1.5 / (epoch + 1) as f64,
                if epoch == 1 { "null".to_string() } else { format!("{}", 40.0 + 10.0 * epoch as f64) },
                60.0 + 8.0 * epoch as f64
            ));
        }
        let path = dir.join("metrics.jsonl");
        std::fs::write(&path, lines.join("\n") + "\n").expect("write metrics");
        path
    }

    #[test]
    fn tick_labels_are_short() {
        let cases = [(2000.0, "2000"), (1.5, "1.5"), (0.25, "0.25"), (0.0, "0"), (10.0, "10"), (0.1 + 0.2, "0.3")];
        for (v, want) in cases {
            assert_eq!(tick(v), want, "{v}");
        }
        assert_eq!(tick(-12.5), "-12.5");
        assert_eq!(tick(123456789.0), "123456789");
    }

    #[test]
    fn bundled_font_registers_and_measures_text() {
        font().expect("bundled font");
        let (w, h) = text(14).font.box_size("accuracy (%)").expect("layout with the bundled font");
        assert!((60..140).contains(&w) && (8..30).contains(&h), "box of \"accuracy (%)\" at 14 px: {w}x{h}");
        // Latin-1 is in the subset, and kerning (the legacy kern table) survived the cut: "AV" is narrower than
        // "A" plus "V".
        let width = |s: &str| text(40).font.box_size(s).expect(s).0;
        assert!(width("AV") < width("A") + width("V"), "no kerning");
        assert!(width("é") > 0 && width("µ") > 0);
    }

    #[test]
    fn training_curves_svg_and_png_have_text() {
        let dir = temp_dir("curves");
        let metrics = write_metrics(&dir);
        let out = dir.join("sub/curves.png");
        let files = training_curves(&metrics, &out).expect("plot");
        assert_eq!(files, PlotFiles { png: out.clone(), svg: dir.join("sub/curves.svg") });

        let texts = svg_texts(&files.svg);
        let title = format!("training curves: {}/metrics.jsonl", dir.file_name().unwrap().to_string_lossy());
        let want = [
            title.as_str(),
            // Panel captions, axis descriptions with units.
            "loss",
            "validation accuracy",
            "optimizer step",
            "cross-entropy loss (nats)",
            "accuracy (%)",
            // Legend entries.
            "train, logged steps",
            "train, epoch mean",
            "validation",
            "skipped step (non-finite gradients)",
            "top-1",
            "top-5",
            // Tick labels: steps on x, loss and percent on y.
            "0",
            "10",
            "20",
            "30",
            "40",
            // (5, 15, 25, 35 only occur on the step axis, 0.5 and 1.5 only on the loss axis.)
            "5",
            "15",
            "25",
            "35",
            "0.5",
            "1.5",
            "1",
            "2",
            "80",
        ];
        assert_texts(&texts, &want, &files.svg);
        assert_eq!(texts.iter().filter(|t| *t == "optimizer step").count(), 2, "x axis of both panels");
        let numbers = texts.iter().filter(|t| t.parse::<f64>().is_ok()).count();
        assert!(numbers >= 20, "only {numbers} tick labels: {texts:?}");
        let svg = std::fs::read_to_string(&files.svg).unwrap();
        assert!(svg.contains(r#"font-family="DejaVu Sans, sans-serif""#));

        // Curves: train per step, train per epoch, val, top-1, top-5; the skipped step's cross.
        let series = [(150, 190, 230), (31, 119, 180), (255, 127, 14), (44, 160, 44), (148, 103, 189)];
        let mut colours: Vec<RGBColor> = series.iter().map(|&(r, g, b)| RGBColor(r, g, b)).collect();
        colours.push(RED);
        check_png(&files.png, &colours);
        cleanup(&dir);
    }

    #[test]
    fn epoch_only_metrics_plot_against_epoch() {
        let dir = temp_dir("epochs");
        let path = dir.join("m.jsonl");
        std::fs::write(
            &path,
            r#"{"kind":"epoch","epoch":1,"train_loss":2.0,"val_loss":null,"val_top1":null,"val_top5":null,"img_per_s":1.0}"#,
        )
        .expect("write");
        let m = read_metrics(&path).expect("metrics");
        assert_eq!(epoch_positions(&m), vec![1.0]);
        let files = training_curves(&path, &dir.join("e.png")).expect("single-epoch plot");
        let texts = svg_texts(&files.svg);
        assert_texts(&texts, &["epoch", "train, epoch mean", "accuracy (%)"], &files.svg);
        assert!(!texts.iter().any(|t| t == "optimizer step" || t == "validation"), "{texts:?}");
        // No validation: the accuracy panel says so instead of showing an empty legend. Epoch ticks are whole.
        assert_texts(&texts, &["no validation accuracy in the metrics", "0", "1", "2", "100"], &files.svg);
        assert!(!texts.iter().any(|t| t == "0.5" || t == "1.01"), "fractional epoch ticks: {texts:?}");
        check_png(&files.png, &[RGBColor(31, 119, 180)]);
        cleanup(&dir);
    }

    #[test]
    fn bad_metrics_give_one_line_errors_naming_the_file() {
        let dir = temp_dir("bad");
        let cases: [(&str, &[u8], &str); 7] = [
            ("empty.jsonl", b"", "no step or epoch records"),
            ("other.jsonl", b"{\"kind\":\"telemetry\"}\n", "no step or epoch records"),
            ("garbage.jsonl", b"{\"kind\":\"step\",\"step\":1}\nnot json\n", "line 2: not JSON"),
            ("truncated.jsonl", b"{\"kind\":\"step\",\"step\":1}\n{\"kind\":\"ep", "line 2: not JSON"),
            ("binary.jsonl", b"\x89PNG\r\n\x1a\n\xff\xfe", "stream did not contain valid UTF-8"),
            ("nokind.jsonl", b"{\"step\":1}\n", "line 1: no string field \"kind\""),
            ("nostep.jsonl", b"{\"kind\":\"step\",\"loss\":1.0}\n", "line 1: step record"),
        ];
        let out = dir.join("x.png");
        for (name, body, expect) in cases {
            let path = dir.join(name);
            std::fs::write(&path, body).expect("write");
            let e = format!("{:#}", training_curves(&path, &out).expect_err(name));
            assert!(e.contains(&path.display().to_string()) && e.contains(expect), "{name}: {e}");
            assert!(!e.contains('\n'), "{name}: not one line: {e}");
        }
        let missing = dir.join("missing.jsonl");
        let e = format!("{:#}", training_curves(&missing, &out).expect_err("missing"));
        assert!(e.contains(&missing.display().to_string()) && !e.contains('\n'), "{e}");
        assert!(!out.exists() && !svg_path(&out).exists(), "a failed plot wrote files");
        cleanup(&dir);
    }

    fn sweep_rows() -> Vec<SweepRow> {
        let mut rows: Vec<SweepRow> = [32usize, 64, 128, 256]
            .iter()
            .map(|&b| SweepRow {
                batch_size: b,
                img_per_s: Some(2000.0 * (1.0 - (-(b as f64) / 64.0).exp())),
                peak_gib: Some(4.0 + b as f64 * 0.25),
                oom: false,
            })
            .collect();
        rows.push(SweepRow { batch_size: 512, img_per_s: None, peak_gib: Some(139.5), oom: true });
        rows.push(SweepRow { batch_size: 1024, img_per_s: None, peak_gib: None, oom: true });
        rows.reverse();
        rows
    }

    #[test]
    fn sweep_svg_and_png_have_text() {
        let dir = temp_dir("sweep");
        let out = dir.join("sweep.png");
        let files = sweep_plot(&sweep_rows(), "batch-size sweep: resnet50 bf16 on cuda:0", &out).expect("sweep");
        assert_eq!(files.svg, dir.join("sweep.svg"));
        let texts = svg_texts(&files.svg);
        let want = [
            "batch-size sweep: resnet50 bf16 on cuda:0",
            "throughput",
            "peak memory",
            "batch size (images per step, log2 scale)",
            "throughput (img/s)",
            "peak device memory (GiB)",
            "out of memory",
            // Batch sizes on the log2 axis, img/s and GiB on y.
            "32",
            "64",
            "128",
            "256",
            "512",
            "1024",
            "0",
            "1000",
            "2000",
            "100",
        ];
        assert_texts(&texts, &want, &files.svg);
        for b in ["32", "64", "128", "256", "512", "1024"] {
            assert_eq!(texts.iter().filter(|t| *t == b).count(), 2, "batch size {b} on both x axes: {texts:?}");
        }
        check_png(&files.png, &[RGBColor(31, 119, 180), RGBColor(148, 103, 189), RED]);

        // One row, all OOM: still plots with text; no rows or batch size 0: errors naming the file.
        let one = [SweepRow { batch_size: 16, img_per_s: Some(10.0), peak_gib: Some(1.0), oom: false }];
        let files = sweep_plot(&one, "one", &dir.join("one.png")).expect("one row");
        let texts = svg_texts(&files.svg);
        assert_texts(&texts, &["one", "16", "throughput", "peak memory"], &files.svg);
        assert_eq!(texts.iter().filter(|t| *t == "16").count(), 2, "one batch-size tick per panel: {texts:?}");
        check_png(&files.png, &[RGBColor(31, 119, 180)]);
        let all_oom = [SweepRow { batch_size: 8, img_per_s: None, peak_gib: None, oom: true }];
        let files = sweep_plot(&all_oom, "oom", &dir.join("oom.png")).expect("all oom");
        assert_texts(&svg_texts(&files.svg), &["oom", "out of memory"], &files.svg);
        check_png(&files.png, &[RED]);
        let e = sweep_plot(&[], "none", &dir.join("none.png")).expect_err("no rows").to_string();
        assert!(e.contains("none.png") && e.contains("no rows"), "{e}");
        let zero = [SweepRow { batch_size: 0, img_per_s: None, peak_gib: None, oom: false }];
        let e = sweep_plot(&zero, "zero", &dir.join("zero.png")).expect_err("batch 0").to_string();
        assert!(e.contains("zero.png") && e.contains("batch size 0"), "{e}");
        let e = sweep_plot(&one, "svg", &dir.join("svg.svg")).expect_err("not .png").to_string();
        assert!(e.contains("svg.svg") && e.contains(".png"), "{e}");
        assert!(!dir.join("none.png").exists() && !dir.join("zero.svg").exists() && !dir.join("svg.svg").exists());
        cleanup(&dir);
    }
}
