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
        /// Folder for sweep.csv, sweep.png and sweep.svg (default: runs/sweep-<config name>).
        #[arg(long)]
        out: Option<PathBuf>,
    },
    /// Input pipeline throughput: img/s of decode, augment, collate, host-to-device (CUDA) and in total.
    DataBench {
        #[command(flatten)]
        cfg: ConfigArgs,
        /// Loader threads (default: data.workers; 0 = one per core).
        #[arg(long)]
        workers: Option<usize>,
        /// Batches to load (0: one epoch).
        #[arg(long, default_value_t = 20)]
        batches: usize,
    },
    /// Pack data.train_dir (and data.val_dir) into shards for data.kind = "packed" (data.dir = OUT).
    Prepare {
        #[command(flatten)]
        cfg: ConfigArgs,
        #[arg(long)]
        out: PathBuf,
        /// Longest side of the stored images (default: data.pack_max_side).
        #[arg(long)]
        max_side: Option<usize>,
        /// JPEG quality of re-encoded images (default: data.pack_quality).
        #[arg(long)]
        quality: Option<usize>,
        /// Shard size in MiB.
        #[arg(long, default_value_t = 1024)]
        shard_mib: u64,
    },
    /// Start one process per GPU with torchrun's environment: trainer launch --nproc-per-node 8 -- --config F.
    Launch(LaunchArgs),
    /// Diagnostic: rendezvous with the other ranks (from torchrun/Slurm/launch variables), print what this rank
    /// received, barrier, and exit.
    #[command(hide = true)]
    DistCheck(DistCheckArgs),
}

#[derive(Args)]
struct LaunchArgs {
    /// Processes (GPUs) on this node.
    #[arg(long, default_value_t = 1)]
    nproc_per_node: usize,
    /// Nodes in the job (run `trainer launch` once on each).
    #[arg(long, default_value_t = 1)]
    nnodes: usize,
    /// Index of this node, 0..nnodes; node 0 hosts rank 0.
    #[arg(long, default_value_t = 0)]
    node_rank: usize,
    /// Address of node 0, reachable from every node.
    #[arg(long, default_value = "127.0.0.1")]
    master_addr: String,
    /// Rendezvous port on node 0 (0: a free port, one node only).
    #[arg(long, default_value_t = trainer::dist::env::DEFAULT_MASTER_PORT)]
    master_port: u16,
    /// Seconds the other ranks get to exit on their own after one fails, before they are killed.
    #[arg(long, default_value_t = 10.0)]
    grace: f64,
    /// Kill every rank after this many seconds (0: no limit).
    #[arg(long, default_value_t = 0.0)]
    timeout: f64,
    /// Arguments of each rank's `trainer` (after `--`).
    #[arg(last = true, required = true, value_name = "TRAINER_ARGS")]
    args: Vec<std::ffi::OsString>,
}

#[derive(Args)]
struct DistCheckArgs {
    /// Rendezvous and barrier timeout in seconds.
    #[arg(long, default_value_t = 60.0)]
    timeout: f64,
    /// Seconds to watch for failed ranks between the two barriers.
    #[arg(long, default_value_t = 0.0)]
    hold: f64,
    /// This rank exits right after the first barrier with --exit-code, as a crash would.
    #[arg(long)]
    fail_rank: Option<usize>,
    #[arg(long, default_value_t = 3)]
    exit_code: i32,
    /// These ranks hang after the first barrier (comma-separated).
    #[arg(long, value_delimiter = ',')]
    hang_ranks: Vec<usize>,
    /// Also test NCCL: rank 0's payload is an NCCL unique id, every rank opens a communicator on cuda:LOCAL_RANK
    /// and all-reduces a tensor, checking the sum (a build with the `nccl` feature).
    #[arg(long)]
    nccl: bool,
}

/// Seconds from a flag, checked.
fn seconds(flag: &str, s: f64) -> Result<std::time::Duration> {
    std::time::Duration::try_from_secs_f64(s).map_err(|_| anyhow::anyhow!("{flag} {s}: not a number of seconds >= 0"))
}

fn main() {
    // Rust ignores SIGPIPE, so printing into a closed pipe (`trainer info | head -3`) would panic; a command-line
    // tool should end quietly instead, as with the default action.
    #[cfg(unix)]
    // SAFETY: called before any other thread exists; SIG_DFL is a valid disposition for SIGPIPE.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
    if let Err(e) = run() {
        // One line: the chain of contexts, outermost first.
        eprintln!("error: {}", trainer::one_line(&e));
        // With RUST_BACKTRACE or RUST_LIB_BACKTRACE set: every cause in full, with the backtrace where one was
        // captured (where on the device a failure came from).
        if ["RUST_BACKTRACE", "RUST_LIB_BACKTRACE"].iter().any(|v| std::env::var(v).is_ok_and(|s| s != "0")) {
            eprintln!("{e:?}");
        }
        // 75 when this rank stopped because another failed (trainer launch then names the other).
        std::process::exit(trainer::dist::exit_code(&e));
    }
}

fn run() -> Result<()> {
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        // --help and --version print as clap writes them.
        Err(e) if !e.use_stderr() => e.exit(),
        Err(e) => {
            // A usage error in one line, as every other error (clap's own text adds the usage and a hint).
            // Its first paragraph (the message, and the arguments it lists on the lines under it).
            let text = e.render().to_string();
            let first: Vec<&str> = text.lines().take_while(|l| !l.trim().is_empty()).map(str::trim).collect();
            eprintln!("error: {} (see --help)", first.join(" ").trim_start_matches("error: "));
            std::process::exit(2);
        }
    };
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
        Some(Command::Launch(a)) => launch(a),
        Some(Command::DistCheck(a)) => trainer::dist::check(&trainer::dist::CheckOptions {
            timeout: seconds("--timeout", a.timeout)?,
            hold: seconds("--hold", a.hold)?,
            fail_rank: a.fail_rank,
            exit_code: a.exit_code,
            hang_ranks: a.hang_ranks,
            nccl: a.nccl,
        }),
        Some(Command::DataBench { cfg, workers, batches }) => data_bench(cfg, workers, batches),
        Some(Command::Prepare { cfg, out, max_side, quality, shard_mib }) => {
            prepare(cfg, out, max_side, quality, shard_mib)
        }
    }
}

fn data_bench(c: ConfigArgs, workers: Option<usize>, batches: usize) -> Result<()> {
    let (cfg, _) = c.load()?;
    let r = trainer::databench::data_bench(&cfg, workers, batches)?;
    trainer::databench::print_result(&r);
    println!("DATA_BENCH_JSON {}", serde_json::to_string(&r)?);
    Ok(())
}

fn prepare(c: ConfigArgs, out: PathBuf, max_side: Option<usize>, quality: Option<usize>, shard_mib: u64) -> Result<()> {
    let (mut cfg, _) = c.load()?;
    // The flags go through the same checks as the config keys.
    if let Some(m) = max_side {
        cfg.data.pack_max_side = m;
    }
    if let Some(q) = quality {
        cfg.data.pack_quality = q;
    }
    cfg.validate().context("prepare")?;
    if shard_mib == 0 {
        bail!("--shard-mib must be at least 1");
    }
    let opts = trainer::databench::pack_options(&cfg, shard_mib);
    trainer::databench::prepare(&cfg, &out, &opts)?;
    println!("packed into {}: set data.kind = \"packed\" and data.dir = \"{}\"", out.display(), out.display());
    if cfg.data.val_dir.is_empty() {
        println!(
            "note: no validation split was packed (data.val_dir is empty); training reads {}/val too: set \
             data.val_dir and run prepare again",
            out.display()
        );
    }
    Ok(())
}

fn launch(a: LaunchArgs) -> Result<()> {
    let program = std::env::current_exe().context("cannot find the trainer executable to launch")?;
    let timeout = seconds("--timeout", a.timeout)?;
    trainer::dist::launch(&trainer::dist::LaunchOptions {
        nproc_per_node: a.nproc_per_node,
        nnodes: a.nnodes,
        node_rank: a.node_rank,
        master_addr: a.master_addr,
        master_port: a.master_port,
        grace: seconds("--grace", a.grace)?,
        timeout: (!timeout.is_zero()).then_some(timeout),
        program,
        args: a.args,
    })?;
    Ok(())
}

fn train(a: TrainArgs) -> Result<()> {
    let (mut cfg, path) = a.cfg.load()?;
    // Under a launcher (trainer launch, torchrun, Slurm) this process is one rank of a data-parallel run, even at
    // world size 1 (which then runs the NCCL path with nothing to sum).
    let dist = trainer::dist::DistEnv::from_process_env()?;
    let launched = dist.source != trainer::dist::EnvSource::Single;
    if launched {
        if trainer::config::parse_device(&cfg.device) == Some(None) {
            bail!(
                "device = \"{}\": data-parallel training ({}) runs one rank per CUDA GPU; set device = \"cuda\"",
                cfg.device,
                dist.describe()
            );
        }
        if !cfg!(feature = "nccl") {
            bail!(
                "{}: data-parallel training needs a trainer built with NCCL (cargo feature `nccl`, see the README)",
                dist.describe()
            );
        }
        // Each rank trains on the GPU of its LOCAL_RANK.
        cfg.device = format!("cuda:{}", dist.local_rank);
    }
    let rank0 = dist.rank == 0;
    let stem = path.file_stem().and_then(|s| s.to_str()).unwrap_or("run").to_string();
    let run_dir = a.run_dir.unwrap_or_else(|| PathBuf::from("runs").join(stem));
    if !a.resume {
        if let Some(done) = trainer::checkpoint::finished_work(&run_dir) {
            let what = if done.ends_with("model.safetensors") { "a finished model" } else { "checkpoints" };
            bail!(
                "run directory {} already holds {what} ({}): pass --resume to continue it, or --run-dir for a new run",
                run_dir.display(),
                done.display()
            );
        }
    }
    if rank0 {
        // The file itself is written by the training loop, once a resume has accepted its checkpoint.
        eprintln!("# resolved config ({})\n{}", path.display(), cfg.to_toml());
    }
    let s = if launched {
        train_data_parallel(&cfg, &run_dir, a.resume, &dist)?
    } else {
        trainer::train::train(&cfg, &run_dir, a.resume)?
    };
    if !rank0 {
        return Ok(());
    }
    eprintln!(
        "done: {} steps, {}{}; run directory {}",
        s.steps,
        if s.losses.is_empty() {
            "none taken by this process".to_string()
        } else {
            format!("last loss {:.4}", s.last_loss)
        },
        s.val.map(|v| format!(", val top1 {:.2}% top5 {:.2}%", v.top1, v.top5)).unwrap_or_default(),
        s.run_dir.display()
    );
    Ok(())
}

/// One rank of a data-parallel run: the rendezvous (rank 0 hands out the NCCL id), a watchdog that ends this
/// process when another rank fails (exit code 75, naming that rank; finished checkpoints are complete files),
/// the NCCL communicator on this rank's GPU, then the training loop.
fn train_data_parallel(
    cfg: &Config,
    run_dir: &std::path::Path,
    resume: bool,
    env: &trainer::dist::DistEnv,
) -> Result<trainer::train::Summary> {
    #[cfg(feature = "nccl")]
    {
        use trainer::dist::{nccl, rendezvous, Options};
        if env.rank == 0 {
            eprintln!(
                "{}",
                trainer::dist::batch_summary(cfg.train.batch_size, env.world_size, cfg.train.grad_accum, cfg.optim.lr)
            );
        }
        let mut id_error = None;
        let (id, mut group) = rendezvous(
            env,
            || {
                nccl::unique_id().unwrap_or_else(|e| {
                    id_error = Some(e);
                    Vec::new()
                })
            },
            &Options::default(),
        )?;
        if let Some(e) = id_error {
            return Err(e);
        }
        let me = env.rank;
        let stall = std::time::Duration::from_secs_f64(cfg.train.stall_timeout_s);
        group.on_failure(Some(stall), move |e| {
            eprintln!("error: rank {me}: {e}; stopping this rank (the finished checkpoints are intact)");
            std::process::exit(trainer::dist::PEER_FAILED_EXIT_CODE);
        })?;
        // The communicator queues its all-reduces on candle's stream for this thread and device, the stream the
        // training loop (same thread, same device) queues every kernel on.
        let device = trainer::train::select_device(&cfg.device)?;
        let comm = nccl::NcclComm::new(&device, &id, env.rank, env.world_size)?;
        let ranks = trainer::train::Ranks {
            collective: Box::new(comm),
            local_world_size: env.local_world_size.unwrap_or(env.world_size),
            progress: Some(group.progress()),
        };
        let summary = trainer::train::train_ranks(cfg, run_dir, resume, Some(ranks))?;
        group.barrier(Options::default().timeout)?;
        group.close();
        Ok(summary)
    }
    #[cfg(not(feature = "nccl"))]
    {
        let _ = (cfg, run_dir, resume);
        bail!("{}: data-parallel training needs a trainer built with NCCL (cargo feature `nccl`)", env.describe())
    }
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
    // A trainer checkpoint (a damaged one is its own error), or plain weights in torchvision format.
    if trainer::checkpoint::is_checkpoint(&ckpt) {
        let l = trainer::checkpoint::load(&ckpt)?;
        l.check_model(&ckpt, &cfg)?;
        resnet::weights::load_tensors(&model, &l.model, false)
            .map_err(|m| anyhow::anyhow!("{}: {m}", ckpt.display()))?;
    } else {
        resnet::weights::load_into(&model, &ckpt, false)?;
    }
    let val = trainer::data::open(&cfg.data, trainer::data::Split::Val, cfg.seed, cfg.model.num_classes)?;
    let r = trainer::train::validate(&model, val, &cfg, trainer::train::precision(&cfg), "evaluation")?;
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
    // The kernels as they resolve on the configured device (info itself opens none).
    let cuda = config::parse_device(&cfg.device).is_some_and(|d| d.is_some());
    let policy = cfg.kernels.policy(cuda, cfg.amp.dtype)?;
    println!("kernels on {} in {}: {}", cfg.device, cfg.amp.dtype, policy.describe());
    if cuda && !cfg!(feature = "cuda") {
        println!("note: this trainer was built without CUDA; a run on {} needs `--features cuda`", cfg.device);
    }
    let (engine, note) = cfg.kernels.step_engine(policy.channels_last(), cfg.amp.dtype, cuda)?;
    match note {
        Some(note) => println!("step: {engine} ({note})"),
        None => println!("step: {engine}"),
    }
    if engine == config::StepEngine::Fused && cuda && cfg.amp.dtype != resnet::Precision::F32 {
        if cfg.kernels.weights_in_optimizer() {
            println!(
                "conv weights: kept in {} (k, r, s, c) and written by the optimizer's update \
                 (kernels.weights_in_optimizer)",
                cfg.amp.dtype
            );
        } else {
            println!(
                "conv weights: cast and permuted at the start of each step (kernels.weights_in_optimizer = false)"
            );
        }
    }
    if cfg.kernels.recompute != config::RecomputeChoice::None {
        println!("recompute: {} (kernels.recompute; the fused step only)", cfg.kernels.recompute.name());
    }
    let bn = cfg.kernels.bn_stats;
    if bn != config::BnStatsChoice::Pass {
        let what = match bn {
            config::BnStatsChoice::Forward => "moments in the conv epilogues",
            config::BnStatsChoice::Backward => "backward sums with the gradients that make them",
            config::BnStatsChoice::Auto if !cfg.kernels.autotune => {
                "moments in the conv epilogues, backward sums with the gradients that make them (kernels.autotune \
                 is off: nothing is timed, every epilogue runs)"
            }
            config::BnStatsChoice::Auto => {
                "moments in the conv epilogues, backward sums with the gradients that make them, each conv shape \
                 where timed faster on first use"
            }
            _ => "moments in the conv epilogues, backward sums with the gradients that make them",
        };
        println!("bn_stats: {} (kernels.bn_stats; the fused step on CUDA: {what})", bn.name());
    }
    let graph = cfg.kernels.graph;
    match (
        graph,
        trainer::graphs::unsupported(cuda && cfg!(feature = "cuda"), engine == config::StepEngine::Fused, false, false),
    ) {
        (config::GraphChoice::Off, _) => println!("graph: off (kernels.graph = \"off\")"),
        (_, Some(why)) => println!("graph: off (kernels.graph = \"{}\"; {why})", graph.name()),
        (_, None) => println!(
            "graph: on (kernels.graph = \"{}\"): each batch shape's second step is captured as one CUDA graph and \
             replayed after (one process; data-parallel runs eagerly)",
            graph.name()
        ),
    }
    if policy.channels_last() {
        println!("layout: channels-last (kernels.conv = \"custom\"); shapes below are (n, c, h, w)");
    }
    for s in model.stage_shapes(cfg.train.batch_size, cfg.data.image_size) {
        println!("  {:<8} {:?}", s.name, s.shape);
    }
    let trainable: usize = model.store().trainable().iter().map(|(_, v)| v.elem_count()).sum();
    println!("parameters: {}", model.store().num_parameters());
    println!("trainable: {trainable}");
    let buckets = model.grad_buckets((cfg.train.bucket_mb * 1e6).max(1.0) as usize).len();
    println!(
        "data-parallel gradient all-reduce: {buckets} bucket(s) of about {} MB (train.bucket_mb), {} (train.grad_allreduce)",
        match cfg.train.bucket_mb {
            mb if (1e-3..1e6).contains(&mb) => format!("{mb}"),
            mb => format!("{mb:e}"),
        },
        match cfg.train.grad_allreduce {
            config::GradAllreduce::Fp32 => "fp32",
            config::GradAllreduce::Bf16 => "bf16",
        }
    );
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
    let dtypes = if dtypes.is_empty() {
        vec![cfg.amp.dtype]
    } else {
        let parse = |d: &String| resnet::Precision::ALL.into_iter().find(|p| p.as_str() == d);
        dtypes
            .iter()
            .map(|d| parse(d).ok_or_else(|| anyhow::anyhow!("--dtypes: `{d}` is not one of fp32, bf16, fp16")))
            .collect::<Result<Vec<_>>>()?
    };
    let sizes = if batch_sizes.is_empty() { vec![cfg.train.batch_size] } else { batch_sizes };
    if sizes.contains(&0) || steps == 0 {
        bail!("--batch-sizes and --steps must be at least 1");
    }
    let cuda = config::parse_device(&cfg.device).is_some_and(|d| d.is_some());
    let kernels: Vec<String> = dtypes
        .iter()
        .map(|&d| Ok(format!("{d}: {}", cfg.kernels.policy(cuda, d)?.describe())))
        .collect::<Result<_>>()?;
    eprintln!(
        "bench: {} at {}x{} on {}, {warmup} warm-up + {steps} timed steps; kernels {}",
        cfg.model.arch,
        cfg.data.image_size,
        cfg.data.image_size,
        cfg.device,
        kernels.join("; ")
    );
    trainer::bench::print_header();
    let mut failed = 0;
    for d in &dtypes {
        for &bs in &sizes {
            let r = trainer::bench::bench_one(&cfg, *d, bs, warmup, steps, phases);
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
    // Each result is printed and sweep.csv rewritten with every row so far, so that a sweep cut short (a process
    // killed for memory) keeps what it measured.
    let csv = out.join("sweep.csv");
    let mut so_far: Vec<trainer::bench::BenchResult> = Vec::new();
    let mut csv_error = None;
    let mut show = |r: &trainer::bench::BenchResult| {
        trainer::bench::print_row(r);
        so_far.push(r.clone());
        if let Err(e) = trainer::bench::write_csv(&so_far, &csv) {
            csv_error.get_or_insert(e);
        }
    };
    let mut rows: Vec<trainer::bench::BenchResult> = if max {
        let start = batch_sizes.first().copied().unwrap_or(cfg.train.batch_size);
        trainer::bench::sweep_max(&cfg, cfg.amp.dtype, start, granularity, warmup, steps, show)
    } else {
        batch_sizes
            .iter()
            .map(|&bs| {
                let r = trainer::bench::bench_one(&cfg, cfg.amp.dtype, bs, warmup, steps, false);
                show(&r);
                r
            })
            .collect()
    };
    if let Some(e) = csv_error {
        return Err(e);
    }
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
    let title = format!("batch-size sweep: {} {} on {}", cfg.model.arch, cfg.amp.dtype, cfg.device);
    match trainer::plot::sweep_plot(&plot_rows, &title, &out.join("sweep.png")) {
        Ok(_) => println!("wrote {}/sweep.csv, sweep.png and sweep.svg", out.display()),
        Err(e) => {
            println!("wrote {}/sweep.csv", out.display());
            eprintln!("warning: no sweep plot: {e:#}");
        }
    }
    // Out of memory (or past the kernels' index range) is what a sweep looks for; any other failure is the run's.
    let failed: Vec<&trainer::bench::BenchResult> =
        rows.iter().filter(|r| r.error.is_some() && !trainer::bench::too_large(r)).collect();
    if let Some(first) = failed.first() {
        bail!(
            "{} sweep configuration(s) failed; batch {}: {}",
            failed.len(),
            first.batch_size,
            first.error.as_deref().unwrap_or_default()
        );
    }
    Ok(())
}
