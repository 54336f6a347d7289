//! `trainer`: train, evaluate, inspect, benchmark and sweep ResNets from a TOML config.

use anyhow::{bail, Context, Result};
use clap::{Args, Parser, Subcommand};
use std::path::PathBuf;
use trainer::config::{self, Config};

#[derive(Parser)]
#[command(name = "trainer", version, about = "ResNet training on candle", args_conflicts_with_subcommands = true)]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
    #[command(flatten)]
    train: TrainArgs,
}

#[derive(Args, Clone)]
struct ConfigArgs {
    /// Config file, or a bare name found in configs/ (e.g. resnet152.toml).
    #[arg(long, short)]
    config: Option<String>,
    /// Override a key: --set train.batch_size=64 (repeatable).
    #[arg(long = "set", value_name = "KEY=VALUE")]
    set: Vec<String>,
}

impl ConfigArgs {
    fn load(&self) -> Result<(Config, PathBuf)> {
        let Some(name) = &self.config else { bail!("--config is required (e.g. --config quickstart.toml)") };
        let path = config::resolve_path(name)?;
        Ok((Config::load(&path, &self.set)?, path))
    }
}

#[derive(Args, Clone)]
struct TrainArgs {
    #[command(flatten)]
    cfg: ConfigArgs,
    /// Run directory (default: runs/<config name>).
    #[arg(long)]
    run_dir: Option<PathBuf>,
    /// Continue from the latest checkpoint in the run directory.
    #[arg(long)]
    resume: bool,
}

#[derive(Subcommand)]
enum Command {
    /// Train (the default command).
    Train(TrainArgs),
    /// Evaluate a checkpoint (or torchvision-format weights) on the validation set.
    Eval {
        #[command(flatten)]
        cfg: ConfigArgs,
        #[arg(long)]
        checkpoint: PathBuf,
    },
    /// Print the model summary: stage output shapes and the parameter count.
    Info {
        #[command(flatten)]
        cfg: ConfigArgs,
    },
    /// Time training steps on synthetic data made on the device: img/s, step ms, peak memory.
    Bench {
        #[command(flatten)]
        cfg: ConfigArgs,
        /// Comma-separated dtypes (default: amp.dtype of the config).
        #[arg(long, value_delimiter = ',')]
        dtypes: Vec<String>,
        /// Comma-separated batch sizes (default: train.batch_size of the config).
        #[arg(long, value_delimiter = ',')]
        batch_sizes: Vec<usize>,
        #[arg(long, default_value_t = 3)]
        warmup: usize,
        #[arg(long, default_value_t = 10)]
        steps: usize,
        /// Also time the step's phases (forward, backward, gradient gathering, optimizer), synchronizing the
        /// device between them.
        #[arg(long)]
        phases: bool,
    },
    /// img/s and peak memory per batch size; --max searches for the largest batch that fits.
    Sweep {
        #[command(flatten)]
        cfg: ConfigArgs,
        /// Comma-separated batch sizes; with --max, the first is where the search starts.
        #[arg(long, value_delimiter = ',')]
        batch_sizes: Vec<usize>,
        /// Double the batch until it no longer fits, then bisect to --granularity.
        #[arg(long)]
        max: bool,
        #[arg(long, default_value_t = 16)]
        granularity: usize,
        #[arg(long, default_value_t = 2)]
        warmup: usize,
        #[arg(long, default_value_t = 5)]
        steps: usize,
        /// Folder for sweep.csv and sweep.png (default: runs/sweep-<config name>).
        #[arg(long)]
        out: Option<PathBuf>,
    },
}

fn main() {
    if let Err(e) = run() {
        // One line: the chain of contexts, outermost first.
        eprintln!("error: {}", trainer::one_line(&e));
        std::process::exit(1);
    }
}

fn run() -> Result<()> {
    let cli = Cli::parse();
    match cli.command {
        None => train(cli.train),
        Some(Command::Train(a)) => train(a),
        Some(Command::Eval { cfg, checkpoint }) => eval(cfg, checkpoint),
        Some(Command::Info { cfg }) => info(cfg),
        Some(Command::Bench { cfg, dtypes, batch_sizes, warmup, steps, phases }) => {
            bench(cfg, dtypes, batch_sizes, warmup, steps, phases)
        }
        Some(Command::Sweep { cfg, batch_sizes, max, granularity, warmup, steps, out }) => {
            sweep(cfg, batch_sizes, max, granularity, warmup, steps, out)
        }
    }
}

fn train(a: TrainArgs) -> Result<()> {
    let (cfg, path) = a.cfg.load()?;
    let stem = path.file_stem().and_then(|s| s.to_str()).unwrap_or("run").to_string();
    let run_dir = a.run_dir.unwrap_or_else(|| PathBuf::from("runs").join(stem));
    if !a.resume && trainer::checkpoint::latest(&run_dir.join("checkpoints")).is_some() {
        bail!(
            "run directory {} already holds checkpoints: pass --resume to continue it, or --run-dir for a new run",
            run_dir.display()
        );
    }
    std::fs::create_dir_all(&run_dir).with_context(|| format!("cannot create run directory {}", run_dir.display()))?;
    let text = cfg.to_toml();
    eprintln!("# resolved config ({})\n{text}", path.display());
    std::fs::write(run_dir.join("config.toml"), &text)
        .with_context(|| format!("cannot write {}/config.toml", run_dir.display()))?;
    let s = trainer::train::train(&cfg, &run_dir, a.resume)?;
    eprintln!(
        "done: {} steps, last loss {:.4}{}; run directory {}",
        s.steps,
        s.last_loss,
        s.val.map(|v| format!(", val top1 {:.2}% top5 {:.2}%", v.top1, v.top5)).unwrap_or_default(),
        s.run_dir.display()
    );
    Ok(())
}

/// The config's model without `model.init_from` (eval loads its own weights; info needs none).
fn bare_model(cfg: &Config, device: &candle_core::Device) -> Result<resnet::ResNet> {
    let cfg = Config { model: config::ModelSection { init_from: String::new(), ..cfg.model.clone() }, ..cfg.clone() };
    trainer::train::build_model(&cfg, device)
}

fn eval(c: ConfigArgs, ckpt: PathBuf) -> Result<()> {
    let (cfg, _) = c.load()?;
    let device = trainer::train::select_device(&cfg.device)?;
    let model = bare_model(&cfg, &device)?;
    // A trainer checkpoint, or plain weights in torchvision format.
    match trainer::checkpoint::load(&ckpt) {
        Ok(l) => resnet::weights::load_tensors(&model, &l.model, false)
            .map_err(|m| anyhow::anyhow!("{}: {m}", ckpt.display()))?,
        Err(_) => resnet::weights::load_into(&model, &ckpt, false)?,
    };
    let val = trainer::data::open(&cfg.data, trainer::data::Split::Val, cfg.seed, cfg.model.num_classes)?;
    let r = trainer::train::validate(&model, val, &cfg, trainer::train::precision(&cfg))?;
    println!(
        "{}: {} images, loss {:.4}, top1 {:.2}%, top5 {:.2}%, {:.1} img/s",
        ckpt.display(),
        r.samples,
        r.loss,
        r.top1,
        r.top5,
        r.img_per_s
    );
    Ok(())
}

fn info(c: ConfigArgs) -> Result<()> {
    let (cfg, _) = c.load()?;
    let model = bare_model(&cfg, &candle_core::Device::Cpu)?;
    println!(
        "model: {} ({} stem, {} classes) at {}x{}",
        cfg.model.arch, cfg.model.stem, cfg.model.num_classes, cfg.data.image_size, cfg.data.image_size
    );
    if model.config.channels_last {
        println!("layout: channels-last (kernels.conv = \"custom\"); shapes below are (n, c, h, w)");
    }
    for s in model.stage_shapes(cfg.train.batch_size, cfg.data.image_size) {
        println!("  {:<8} {:?}", s.name, s.shape);
    }
    let trainable: usize = model.store().trainable().iter().map(|(_, v)| v.elem_count()).sum();
    println!("parameters: {}", model.store().num_parameters());
    println!("trainable: {trainable}");
    Ok(())
}

fn bench(
    c: ConfigArgs,
    dtypes: Vec<String>,
    batch_sizes: Vec<usize>,
    warmup: usize,
    steps: usize,
    phases: bool,
) -> Result<()> {
    let (cfg, _) = c.load()?;
    let dtypes = if dtypes.is_empty() { vec![cfg.amp.dtype.clone()] } else { dtypes };
    for d in &dtypes {
        if resnet::Precision::parse(d).is_none() {
            bail!("--dtypes: `{d}` is not one of fp32, bf16, fp16");
        }
    }
    let sizes = if batch_sizes.is_empty() { vec![cfg.train.batch_size] } else { batch_sizes };
    if sizes.contains(&0) || steps == 0 {
        bail!("--batch-sizes and --steps must be at least 1");
    }
    eprintln!(
        "bench: {} at {}x{} on {}, kernels.conv = {:?}, kernels.matmul = {:?}, {warmup} warm-up + {steps} timed steps",
        cfg.model.arch, cfg.data.image_size, cfg.data.image_size, cfg.device, cfg.kernels.conv, cfg.kernels.matmul
    );
    trainer::bench::print_header();
    let mut failed = 0;
    for d in &dtypes {
        for &bs in &sizes {
            let r = trainer::bench::bench_one(&cfg, d, bs, warmup, steps, phases);
            trainer::bench::print_row(&r);
            println!("BENCH_JSON {}", serde_json::to_string(&r)?);
            failed += usize::from(r.error.is_some() && !r.oom);
        }
    }
    if failed > 0 {
        bail!("{failed} benchmark configuration(s) failed");
    }
    Ok(())
}

fn sweep(
    c: ConfigArgs,
    batch_sizes: Vec<usize>,
    max: bool,
    granularity: usize,
    warmup: usize,
    steps: usize,
    out: Option<PathBuf>,
) -> Result<()> {
    let (cfg, path) = c.load()?;
    if batch_sizes.is_empty() && !max {
        bail!("sweep needs --batch-sizes 64,128,... and/or --max");
    }
    if batch_sizes.contains(&0) || steps == 0 {
        bail!("--batch-sizes and --steps must be at least 1");
    }
    let stem = path.file_stem().and_then(|s| s.to_str()).unwrap_or("run").to_string();
    let out = out.unwrap_or_else(|| PathBuf::from("runs").join(format!("sweep-{stem}")));
    std::fs::create_dir_all(&out).with_context(|| format!("cannot create {}", out.display()))?;
    trainer::bench::print_header();
    let show = |r: &trainer::bench::BenchResult| trainer::bench::print_row(r);
    let mut rows: Vec<trainer::bench::BenchResult> = if max {
        let start = batch_sizes.first().copied().unwrap_or(cfg.train.batch_size);
        trainer::bench::sweep_max(&cfg, &cfg.amp.dtype, start, granularity, warmup, steps, show)
    } else {
        batch_sizes
            .iter()
            .map(|&bs| {
                let r = trainer::bench::bench_one(&cfg, &cfg.amp.dtype, bs, warmup, steps, false);
                show(&r);
                r
            })
            .collect()
    };
    rows.sort_by_key(|r| r.batch_size);
    if let Some(best) = rows.iter().filter(|r| r.img_per_s.is_some()).map(|r| r.batch_size).max() {
        println!("largest batch that fits: {best}");
    }
    trainer::bench::write_csv(&rows, &out.join("sweep.csv"))?;
    let plot_rows: Vec<trainer::plot::SweepRow> = rows
        .iter()
        .map(|r| trainer::plot::SweepRow {
            batch_size: r.batch_size,
            img_per_s: r.img_per_s,
            peak_gib: r.peak_gib,
            oom: r.oom,
        })
        .collect();
    let title = format!("{} {} on {}", cfg.model.arch, cfg.amp.dtype, cfg.device);
    if let Err(e) = trainer::plot::sweep_plot(&plot_rows, &title, &out.join("sweep.png")) {
        eprintln!("warning: no sweep plot: {e:#}");
    }
    println!("wrote {}/sweep.csv and sweep.png", out.display());
    Ok(())
}
