//! PNG plots: training curves from `metrics.jsonl`, and throughput / peak memory of a batch-size sweep.
//!
//! Drawn with `plotters` into an RGB buffer and encoded with `image`. Text uses a TrueType font found at run time
//! (see [`FONT_CANDIDATES`], or `TRAINER_PLOT_FONT=/path/font.ttf`); without one the plot is still drawn, axes and
//! lines but no text, and the functions return a note saying so. A missing font never fails a run.

use anyhow::{anyhow, bail, Context, Result};
use plotters::coord::Shift;
use plotters::prelude::*;
use plotters::style::{register_font, FontStyle};
use serde::Deserialize;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

/// Size of every PNG written here.
pub const WIDTH: u32 = 1400;
pub const HEIGHT: u32 = 600;

/// Fonts tried in order (Debian/Ubuntu, Fedora, Arch, then other common families, macOS, Windows). When none
/// exists, the first `.ttf` found under `/usr/share/fonts` or `/usr/local/share/fonts` is used.
pub const FONT_CANDIDATES: &[&str] = &[
    "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/dejavu-sans-fonts/DejaVuSans.ttf",
    "/usr/share/fonts/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/TTF/DejaVuSans.ttf",
    "/usr/share/fonts/truetype/liberation/LiberationSans-Regular.ttf",
    "/usr/share/fonts/liberation-sans/LiberationSans-Regular.ttf",
    "/usr/share/fonts/truetype/noto/NotoSans-Regular.ttf",
    "/usr/share/fonts/noto/NotoSans-Regular.ttf",
    "/usr/share/fonts/truetype/freefont/FreeSans.ttf",
    "/System/Library/Fonts/Supplemental/Arial.ttf",
    "/Library/Fonts/Arial.ttf",
    "C:\\Windows\\Fonts\\arial.ttf",
];

/// The family name the loaded font is registered under. Deliberately not "sans-serif" (plotters' default), so
/// any text drawn with a default style fails loudly in the tests instead of depending on the machine.
const FAMILY: &str = "trainer-plot-sans";

/// The font in use, or the note explaining why plots carry no text. Looked up once per process.
fn font() -> &'static std::result::Result<PathBuf, String> {
    static FONT: OnceLock<std::result::Result<PathBuf, String>> = OnceLock::new();
    FONT.get_or_init(|| {
        let mut tried: Vec<PathBuf> = Vec::new();
        if let Some(p) = std::env::var_os("TRAINER_PLOT_FONT") {
            tried.push(PathBuf::from(p));
        }
        tried.extend(FONT_CANDIDATES.iter().map(PathBuf::from));
        for dir in ["/usr/share/fonts", "/usr/local/share/fonts"] {
            if let Some(p) = first_ttf(Path::new(dir), 4) {
                tried.push(p);
            }
        }
        for path in &tried {
            let Ok(bytes) = std::fs::read(path) else {
                continue;
            };
            // register_font wants 'static bytes; this happens once per process.
            let bytes: &'static [u8] = Box::leak(bytes.into_boxed_slice());
            if register_font(FAMILY, FontStyle::Normal, bytes).is_ok() {
                return Ok(path.clone());
            }
        }
        let note = "no usable TrueType font found (set TRAINER_PLOT_FONT or install fonts-dejavu-core): \
                    plots are drawn without text"
            .to_string();
        eprintln!("warning: {note}");
        Err(note)
    })
}

/// The font file plots use, if any.
pub fn font_path() -> Option<&'static Path> {
    font().as_ref().ok().map(PathBuf::as_path)
}

/// First `.ttf` file under `dir` (sorted, depth-limited), preferring names with "Sans".
fn first_ttf(dir: &Path, depth: usize) -> Option<PathBuf> {
    let mut entries: Vec<PathBuf> = std::fs::read_dir(dir).ok()?.filter_map(|e| e.ok().map(|e| e.path())).collect();
    entries.sort();
    let is_ttf = |p: &Path| p.extension().is_some_and(|e| e.eq_ignore_ascii_case("ttf"));
    let sans = entries.iter().find(|p| is_ttf(p) && p.to_string_lossy().contains("Sans"));
    if let Some(p) = sans.or_else(|| entries.iter().find(|p| is_ttf(p))) {
        return Some(p.clone());
    }
    if depth == 0 {
        return None;
    }
    entries.iter().filter(|p| p.is_dir()).find_map(|d| first_ttf(d, depth - 1))
}

fn text(size: u32) -> TextStyle<'static> {
    (FAMILY, size).into_font().color(&BLACK)
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
    x_desc: &'a str,
    y_desc: &'a str,
    series: Vec<Series>,
    /// Fixed y range; otherwise the data's, padded.
    y_range: Option<(f64, f64)>,
    /// x values are log2 of the quantity; labels show 2^x.
    x_log2: bool,
    /// Red crosses: x positions (at the bottom of the panel) of runs that failed.
    failures: Vec<(f64, Option<f64>)>,
    failure_label: &'a str,
    /// Where the legend goes: the corner the curves usually leave free.
    legend: SeriesLabelPosition,
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

/// Padded [lo, hi] of `values`, never empty, `(0, 1)` when there are none.
fn padded_range(values: impl Iterator<Item = f64>, pad_frac: f64) -> (f64, f64) {
    let (lo, hi) = values.fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), v| (lo.min(v), hi.max(v)));
    if !lo.is_finite() || !hi.is_finite() {
        return (0.0, 1.0);
    }
    let span = if hi > lo { hi - lo } else { lo.abs().max(1.0) };
    (lo - span * pad_frac, hi + span * pad_frac)
}

fn draw_panel<DB: DrawingBackend>(area: &DrawingArea<DB, Shift>, p: &Panel, with_text: bool) -> Result<()>
where
    DB::ErrorType: 'static,
{
    let err =
        |what: &str, e: DrawingAreaErrorKind<DB::ErrorType>| anyhow!("drawing {what} of panel {:?}: {e}", p.caption);
    let xs = p.series.iter().flat_map(|s| s.points.iter().map(|(x, _)| *x)).chain(p.failures.iter().map(|f| f.0));
    let (x0, x1) = padded_range(xs, 0.03);
    let (y0, y1) = p.y_range.unwrap_or_else(|| {
        let ys = p.series.iter().flat_map(|s| s.points.iter().map(|(_, y)| *y));
        let ys = ys.chain(p.failures.iter().filter_map(|f| f.1));
        padded_range(ys, 0.05)
    });
    let mut builder = ChartBuilder::on(area);
    builder.margin(12);
    if with_text {
        builder.caption(&p.caption, text(20)).x_label_area_size(45).y_label_area_size(65);
    } else {
        builder.x_label_area_size(8).y_label_area_size(8);
    }
    let mut chart = builder.build_cartesian_2d(x0..x1, y0..y1).map_err(|e| err("axes", e))?;

    let log2_label = |x: &f64| tick(2f64.powf(*x).round());
    let plain_label = |v: &f64| tick(*v);
    let mut mesh = chart.configure_mesh();
    mesh.light_line_style(RGBColor(235, 235, 235));
    if with_text {
        mesh.x_desc(p.x_desc)
            .y_desc(p.y_desc)
            .label_style(text(14))
            .axis_desc_style(text(15))
            .y_label_formatter(&plain_label);
        if p.x_log2 {
            mesh.x_labels(((x1 - x0).ceil() as usize + 1).clamp(2, 12)).x_label_formatter(&log2_label);
        } else {
            mesh.x_label_formatter(&plain_label);
        }
    } else {
        mesh.x_labels(0).y_labels(0);
    }
    mesh.draw().map_err(|e| err("mesh", e))?;

    for s in &p.series {
        let color = s.color;
        if s.line && s.points.len() > 1 {
            let anno = chart
                .draw_series(LineSeries::new(s.points.iter().copied(), color.stroke_width(2)))
                .map_err(|e| err(s.label, e))?;
            anno.label(s.label).legend(move |(x, y)| PathElement::new([(x, y), (x + 20, y)], color.stroke_width(2)));
        }
        if s.markers || s.points.len() == 1 {
            let anno = chart
                .draw_series(s.points.iter().map(|&pt| Circle::new(pt, 4, color.filled())))
                .map_err(|e| err(s.label, e))?;
            if !(s.line && s.points.len() > 1) {
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
    }
    if with_text {
        chart
            .configure_series_labels()
            .label_font(text(14))
            .background_style(WHITE.mix(0.85))
            .border_style(RGBColor(180, 180, 180))
            .position(p.legend.clone())
            .draw()
            .map_err(|e| err("legend", e))?;
    }
    Ok(())
}

/// Draws two panels side by side into `out_png`.
fn render(out_png: &Path, title: &str, left: &Panel, right: &Panel, with_text: bool) -> Result<()> {
    let mut buf = vec![0u8; WIDTH as usize * HEIGHT as usize * 3];
    {
        let root = BitMapBackend::with_buffer(&mut buf, (WIDTH, HEIGHT)).into_drawing_area();
        let draw_err = |e: DrawingAreaErrorKind<_>| anyhow!("drawing {}: {e}", out_png.display());
        root.fill(&WHITE).map_err(draw_err)?;
        let body = if with_text { root.titled(title, text(24)).map_err(draw_err)? } else { root.margin(8, 0, 0, 0) };
        let (l, r) = body.split_horizontally(WIDTH / 2);
        draw_panel(&l, left, with_text).with_context(|| format!("plotting {}", out_png.display()))?;
        draw_panel(&r, right, with_text).with_context(|| format!("plotting {}", out_png.display()))?;
        root.present().map_err(draw_err)?;
    }
    if let Some(dir) = out_png.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).with_context(|| format!("creating folder {} for a plot", dir.display()))?;
    }
    image::save_buffer_with_format(
        out_png,
        &buf,
        WIDTH,
        HEIGHT,
        image::ExtendedColorType::Rgb8,
        image::ImageFormat::Png,
    )
    .with_context(|| format!("writing plot {}", out_png.display()))
}

/// Loss (train and val) and accuracy (val top-1/top-5) against step (or epoch, when there are no step records),
/// from the records of `metrics_jsonl` (step and epoch records; other kinds are ignored).
/// Returns `Some(note)` when no font was found and the plot was drawn without text.
pub fn training_curves(metrics_jsonl: &Path, out_png: &Path) -> Result<Option<String>> {
    let with_text = font().is_ok();
    let m = read_metrics(metrics_jsonl)?;
    // Title: the run folder and file name, not the whole path.
    let parts: Vec<_> = metrics_jsonl.iter().map(|c| c.to_string_lossy()).collect();
    let source = parts[parts.len().saturating_sub(2)..].join("/");
    draw_training_curves(&m, &source, out_png, with_text)?;
    Ok(font().as_ref().err().cloned())
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

fn draw_training_curves(m: &Metrics, source: &str, out_png: &Path, with_text: bool) -> Result<()> {
    let ex = epoch_positions(m);
    let x_desc = if m.steps.is_empty() { "epoch" } else { "step" };
    let per_epoch = |f: fn(&EpochRecord) -> Option<f64>| -> Vec<(f64, f64)> {
        m.epochs.iter().zip(&ex).filter_map(|(e, &x)| f(e).map(|y| (x, y))).collect()
    };
    let step_loss: Vec<(f64, f64)> = m.steps.iter().filter_map(|s| s.loss.map(|l| (s.step as f64, l))).collect();
    let skipped: Vec<(f64, Option<f64>)> =
        m.steps.iter().filter(|s| s.skipped).map(|s| (s.step as f64, s.loss.filter(|l| l.is_finite()))).collect();
    let loss = Panel {
        caption: "loss".into(),
        x_desc,
        y_desc: "loss",
        series: vec![
            Series::new("train (step)", RGBColor(150, 190, 230), step_loss, true, false),
            Series::new("train (epoch)", RGBColor(31, 119, 180), per_epoch(|e| e.train_loss), true, true),
            Series::new("val", RGBColor(255, 127, 14), per_epoch(|e| e.val_loss), true, true),
        ],
        y_range: None,
        x_log2: false,
        failures: skipped,
        failure_label: "skipped step",
        legend: SeriesLabelPosition::UpperRight,
    };
    let (top1, top5) = (per_epoch(|e| e.val_top1), per_epoch(|e| e.val_top5));
    // Accuracies may be logged as fractions or as percentages.
    let acc_max = if top1.iter().chain(&top5).all(|p| p.1 <= 1.0) { 1.0 } else { 100.0 };
    let acc = Panel {
        caption: "validation accuracy".into(),
        x_desc,
        y_desc: "accuracy",
        series: vec![
            Series::new("top-1", RGBColor(44, 160, 44), top1, true, true),
            Series::new("top-5", RGBColor(148, 103, 189), top5, true, true),
        ],
        y_range: Some((0.0, acc_max)),
        x_log2: false,
        failures: Vec::new(),
        failure_label: "",
        legend: SeriesLabelPosition::LowerRight,
    };
    let title = format!("training curves: {source}");
    render(out_png, &title, &loss, &acc, with_text)
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
/// Returns `Some(note)` when no font was found and the plot was drawn without text.
pub fn sweep_plot(rows: &[SweepRow], title: &str, out_png: &Path) -> Result<Option<String>> {
    let with_text = font().is_ok();
    draw_sweep(rows, title, out_png, with_text)?;
    Ok(font().as_ref().err().cloned())
}

fn draw_sweep(rows: &[SweepRow], title: &str, out_png: &Path, with_text: bool) -> Result<()> {
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
    let floor = |pts: &[(f64, f64)]| Some((0.0, pts.iter().map(|p| p.1).fold(0.0, f64::max).max(1e-9) * 1.1));
    let fails_mem = failed(|r| r.peak_gib);
    let mem_top = mem.iter().map(|p| p.1).chain(fails_mem.iter().filter_map(|f| f.1)).fold(0.0, f64::max);
    let left = Panel {
        caption: "throughput".into(),
        x_desc: "batch size",
        y_desc: "img/s",
        y_range: floor(&speed),
        series: vec![Series::new("img/s", RGBColor(31, 119, 180), speed, true, true)],
        x_log2: true,
        failures: failed(|_| None),
        failure_label: "out of memory",
        legend: SeriesLabelPosition::UpperLeft,
    };
    let right = Panel {
        caption: "peak memory".into(),
        x_desc: "batch size",
        y_desc: "peak GiB",
        y_range: Some((0.0, mem_top.max(1e-9) * 1.1)),
        series: vec![Series::new("peak GiB", RGBColor(214, 39, 40), mem, true, true)],
        x_log2: true,
        failures: fails_mem,
        failure_label: "out of memory",
        legend: SeriesLabelPosition::UpperLeft,
    };
    render(out_png, title, &left, &right, with_text)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn temp_dir(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("trainer-plot-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).expect("temp dir");
        d
    }

    /// Removes a test's folder unless TRAINER_KEEP_TEST_PLOTS is set (to look at the PNGs).
    fn cleanup(dir: &Path) {
        if std::env::var_os("TRAINER_KEEP_TEST_PLOTS").is_none() {
            let _ = std::fs::remove_dir_all(dir);
        }
    }

    /// Decodes `png`, checks its size and that it has more than a handful of colours; returns the colour count.
    fn check_png(png: &Path) -> usize {
        let img = image::open(png).unwrap_or_else(|e| panic!("decoding {}: {e}", png.display())).to_rgb8();
        assert_eq!(img.dimensions(), (WIDTH, HEIGHT));
        let colours: std::collections::HashSet<[u8; 3]> = img.pixels().map(|p| p.0).collect();
        assert!(colours.len() > 3, "{} is (nearly) flat: {} colours", png.display(), colours.len());
        colours.len()
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
    fn a_font_exists_here_and_is_used() {
        // Not an assertion about every machine: reports what this one has.
        eprintln!("plot font: {:?}", font());
    }

    #[test]
    fn training_curves_png() {
        let dir = temp_dir("curves");
        let metrics = write_metrics(&dir);
        let out = dir.join("sub/curves.png");
        let note = training_curves(&metrics, &out).expect("plot");
        assert_eq!(note.is_some(), font_path().is_none());
        let with_font = check_png(&out);

        // The same without text: still a real plot, and no text drawn (any would fail for lack of the font family
        // in a process without one, and is caught here by drawing nothing that needs it).
        let m = read_metrics(&metrics).expect("metrics");
        let bare = dir.join("bare.png");
        draw_training_curves(&m, "x", &bare, false).expect("plot without text");
        let without = check_png(&bare);
        if font_path().is_some() {
            assert!(with_font > without, "text adds anti-aliased colours: {with_font} vs {without}");
        }
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
        training_curves(&path, &dir.join("e.png")).expect("single-epoch plot");
        check_png(&dir.join("e.png"));
        cleanup(&dir);
    }

    #[test]
    fn bad_metrics_errors_name_the_file() {
        let dir = temp_dir("bad");
        let cases = [
            ("empty.jsonl", "", "no step or epoch records"),
            ("other.jsonl", "{\"kind\":\"telemetry\"}\n", "no step or epoch records"),
            ("garbage.jsonl", "{\"kind\":\"step\",\"step\":1}\nnot json\n", "line 2: not JSON"),
            ("nokind.jsonl", "{\"step\":1}\n", "line 1: no string field \"kind\""),
            ("nostep.jsonl", "{\"kind\":\"step\",\"loss\":1.0}\n", "line 1: step record"),
        ];
        for (name, body, expect) in cases {
            let path = dir.join(name);
            std::fs::write(&path, body).expect("write");
            let e = format!("{:#}", training_curves(&path, &dir.join("x.png")).expect_err(name));
            assert!(e.contains(&path.display().to_string()) && e.contains(expect), "{name}: {e}");
        }
        let missing = dir.join("missing.jsonl");
        let e = format!("{:#}", training_curves(&missing, &dir.join("x.png")).expect_err("missing"));
        assert!(e.contains("missing.jsonl"), "{e}");
        assert!(!dir.join("x.png").exists());
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
    fn sweep_png() {
        let dir = temp_dir("sweep");
        let out = dir.join("sweep.png");
        let note = sweep_plot(&sweep_rows(), "resnet50 bf16 batch sweep", &out).expect("sweep plot");
        assert_eq!(note.is_some(), font_path().is_none());
        check_png(&out);
        draw_sweep(&sweep_rows(), "t", &dir.join("bare.png"), false).expect("sweep without text");
        check_png(&dir.join("bare.png"));
        // One row, all OOM, and no rows.
        let one = [SweepRow { batch_size: 8, img_per_s: Some(10.0), peak_gib: Some(1.0), oom: false }];
        sweep_plot(&one, "one", &dir.join("one.png")).expect("one row");
        check_png(&dir.join("one.png"));
        let all_oom = [SweepRow { batch_size: 8, img_per_s: None, peak_gib: None, oom: true }];
        sweep_plot(&all_oom, "oom", &dir.join("oom.png")).expect("all oom");
        let e = sweep_plot(&[], "none", &dir.join("none.png")).expect_err("no rows").to_string();
        assert!(e.contains("none.png") && e.contains("no rows"), "{e}");
        cleanup(&dir);
    }
}
