//! Kernel benchmark (feature `cuda`), one section each:
//! - `convs`: every distinct ResNet-152 convolution at batch N (forward, grad-input, grad-weight) on our
//!   implicit-GEMM kernels and on candle's;
//! - `matmul`: our GEMM against cuBLAS (candle's matmul) at 8192^3 and at the FC layer's shapes;
//! - `pool`: max-pool (NCHW, NHWC) of the stem (and its backward of two gradients from the offsets), the stem's
//!   BatchNorm + ReLU + max-pool in one launch (forward and backward) against the separate passes, the NHWC
//!   global average pool, forward and backward, and the stem's explicit im2col (both kernels);
//! - `bn`: the channels-last BatchNorm(+ReLU) passes on ResNet's first and last BatchNorm shapes;
//! - `optim`: the multi-tensor kernels over ResNet-152's parameters (gradient gather + unscale + sum of squares,
//!   SGD, AdamW) and the fused step's conv weight conversions (FP32 (k, c, r, s) <-> bf16/f16 (k, r, s, c)).
//!
//! Prints tables and writes JSON (`--json PATH`) that scripts/kernels-bench.sh joins with cuDNN's figures
//! (scripts/torch_conv_shapes.py) from the same run. Times are GPU times between two CUDA events around
//! `--iters` back-to-back runs after 3 warm-up runs, as scripts/torch_conv_shapes.py times cuDNN; `--wall` times
//! the host instead (synchronise, run, synchronise). cudarc's per-allocation event tracking is off, as in the
//! trainer (one stream). Memory-bound kernels are reported in GB/s of the bytes they must move.

use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, Tensor};
use clap::{Parser, ValueEnum};
use kernels::cuda::conv::conv_tile_applies;
use kernels::cuda::loader::tiles_for;
use kernels::ops::avgpool::GlobalAvgPoolNhwcBackward;
use kernels::ops::batchnorm::{BnGrad, BnStats};
use kernels::ops::conv_nhwc::{conv_nhwc_dgrad, conv_nhwc_fwd, conv_nhwc_wgrad};
use kernels::ops::im2col::{im2col_nhwc, Im2colKernel};
use kernels::ops::linear::{matmul, matmul_bias};
use kernels::ops::maxpool::{
    max_pool2d_nhwc_backward_offsets_sum, MaxPool2d, MaxPool2dBackward, MaxPool2dNhwcBackward,
    MaxPool2dNhwcBackwardOffsets, MaxPool2dNhwcOffsets,
};
use kernels::shapes::resnet152_convs;
use kernels::variants::{tile_by_name, TILES};
use kernels::{Autotuner, ConvGeom, GemmLayout, KernelPolicy, Tuning};
use serde::Serialize;
use serde_json::{json, Value};
use std::sync::Arc;
use std::time::Instant;

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Section {
    Convs,
    Matmul,
    Pool,
    Bn,
    Optim,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Dt {
    Bf16,
    #[value(alias = "fp16")]
    F16,
}

/// Benchmarks our CUDA kernels against candle's / cuBLAS (see the file header).
#[derive(Debug, Parser)]
#[command(name = "kernels-bench")]
struct Args {
    /// Batch size of the convolution, pool and BatchNorm shapes (and M of the FC matmuls).
    #[arg(long, default_value_t = 128, value_parser = clap::value_parser!(u64).range(1..))]
    batch: u64,
    #[arg(long, value_enum, default_value_t = Dt::Bf16)]
    dtype: Dt,
    /// Timed runs per measurement (after 3 warm-up runs).
    #[arg(long, default_value_t = 20, value_parser = clap::value_parser!(u64).range(1..))]
    iters: u64,
    /// Sections to run (comma-separated; default: all).
    #[arg(long, value_enum, value_delimiter = ',', default_values_t = [Section::Convs, Section::Matmul, Section::Pool, Section::Bn, Section::Optim])]
    only: Vec<Section>,
    /// Skip candle's convolutions (slow: ~1.4 s per ResNet-152 step).
    #[arg(long)]
    no_candle: bool,
    /// Also time every tile variant on every convolution and on the large matmuls.
    #[arg(long)]
    variants: bool,
    /// Host wall-clock timing instead of CUDA events.
    #[arg(long)]
    wall: bool,
    /// Force one tile (`t64`, `x256`, ...) instead of the autotuned choice (for profiling).
    #[arg(long)]
    tile: Option<String>,
    /// Keep the convolutions whose printed name contains this text (e.g. "256-> 256 k3 s1 hw 14").
    #[arg(long)]
    filter: Option<String>,
    /// Write the figures as JSON here.
    #[arg(long)]
    json: Option<std::path::PathBuf>,
}

/// Times closures on one device: GPU time between CUDA events (or host time with `--wall`).
struct Timer {
    dev: Device,
    iters: usize,
    wall: bool,
}

impl Timer {
    /// Mean milliseconds of `f` over `iters` back-to-back runs after 3 warm-up runs.
    fn ms(&self, iters: usize, mut f: impl FnMut() -> candle_core::Result<Tensor>) -> Result<f64> {
        for _ in 0..3 {
            f()?;
        }
        self.dev.synchronize()?;
        if self.wall {
            let t = Instant::now();
            for _ in 0..iters {
                f()?;
            }
            self.dev.synchronize()?;
            return Ok(t.elapsed().as_secs_f64() * 1e3 / iters as f64);
        }
        let stream = self.dev.as_cuda_device()?.cuda_stream();
        let timing = Some(candle_core::cuda_backend::cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT);
        let start = stream.record_event(timing).context("CUDA event")?;
        for _ in 0..iters {
            f()?;
        }
        let end = stream.record_event(timing).context("CUDA event")?;
        Ok(start.elapsed_ms(&end).context("CUDA event")? as f64 / iters as f64)
    }
    fn time(&self, f: impl FnMut() -> candle_core::Result<Tensor>) -> Result<f64> {
        self.ms(self.iters, f)
    }
}

fn tflops(flop: f64, ms: f64) -> f64 {
    flop / ms / 1e9
}

/// Milliseconds of the three passes of one implementation; None for a pass not run.
#[derive(Debug, Serialize)]
struct Passes {
    name: String,
    fwd_ms: Option<f64>,
    dgrad_ms: Option<f64>,
    wgrad_ms: Option<f64>,
}

impl Passes {
    fn new(name: &str, f: f64, d: f64, g: f64) -> Self {
        let o = |v: f64| (!v.is_nan()).then_some(v);
        Self { name: name.into(), fwd_ms: o(f), dgrad_ms: o(d), wgrad_ms: o(g) }
    }
}

fn main() {
    let args = Args::parse();
    if let Err(e) = run(&args) {
        eprintln!("kernels-bench: {}", trainer::one_line(&e));
        std::process::exit(1);
    }
}

fn run(a: &Args) -> Result<()> {
    let dev = Device::new_cuda(0)?;
    // SAFETY: all device work below is issued from this thread on candle's one stream (see trainer::train).
    unsafe { dev.as_cuda_device()?.disable_event_tracking() };
    kernels::cuda::keep_pool_memory(dev.as_cuda_device()?)?;
    let dt = match a.dtype {
        Dt::Bf16 => DType::BF16,
        Dt::F16 => DType::F16,
    };
    let tuning = match &a.tile {
        Some(name) => {
            let Some(t) = tile_by_name(name) else {
                let names: Vec<&str> = TILES.iter().map(|t| t.name).collect();
                bail!("--tile {name}: not one of {}", names.join(", "));
            };
            Tuning::Forced(t)
        }
        None => Tuning::Autotune(Arc::new(Autotuner::in_memory())),
    };
    let policy = KernelPolicy::custom().with_tuning(tuning);
    let timer = Timer { dev: dev.clone(), iters: a.iters as usize, wall: a.wall };
    let batch = a.batch as usize;
    let mut out = json!({ "batch": batch, "dtype": format!("{dt:?}"), "policy": policy.describe() });
    if a.only.contains(&Section::Convs) {
        out["convs"] = convs(a, &timer, &dev, dt, &policy)?;
    }
    if a.only.contains(&Section::Matmul) {
        out["matmul"] = matmuls(a, &timer, &dev, dt, &policy)?;
    }
    if a.only.contains(&Section::Pool) {
        out["pool"] = pools(&timer, &dev, dt, batch)?;
    }
    if a.only.contains(&Section::Bn) {
        out["batchnorm"] = batchnorms(&timer, &dev, dt, batch)?;
        out["fused_bn"] = fused_bn(&timer, &dev, dt, batch, &policy)?;
    }
    if a.only.contains(&Section::Optim) {
        out["optim"] = optims(&timer, &dev, dt)?;
    }
    if let Some(path) = &a.json {
        std::fs::write(path, serde_json::to_string(&out)? + "\n")
            .with_context(|| format!("--json {}", path.display()))?;
    }
    Ok(())
}

fn convs(a: &Args, timer: &Timer, dev: &Device, dt: DType, policy: &KernelPolicy) -> Result<Value> {
    println!("ResNet-152 convolutions, batch {}, {:?}, channels-last; TFLOP/s (ms)", a.batch, dt);
    println!(
        "{:<28} {:>3} | {:>14} {:>14} {:>14} | {:>14} {:>14} {:>14}",
        "shape", "x", "fwd ours", "dgrad ours", "wgrad ours", "fwd candle", "dgrad candle", "wgrad candle"
    );
    let mut rows = Vec::new();
    let mut tot = [0f64; 6];
    let mut flop_total = 0f64;
    let n = a.batch as usize;
    for (shape, count) in resnet152_convs() {
        if a.filter.as_ref().is_some_and(|f| !shape.to_string().contains(f.as_str())) {
            continue;
        }
        let (ci, co, k, st, pd, hw) = (shape.c_in, shape.c_out, shape.k, shape.stride, shape.pad, shape.hw);
        let oh = shape.out_hw();
        let flop = shape.flops(n);
        let x = Tensor::randn(0f32, 1.0, (n, hw, hw, ci), dev)?.to_dtype(dt)?;
        let w =
            (Tensor::randn(0f32, 1.0, (co, k, k, ci), dev)? * (1.0 / ((ci * k * k) as f64).sqrt()))?.to_dtype(dt)?;
        let dy = Tensor::randn(0f32, 1.0, (n, oh, oh, co), dev)?.to_dtype(dt)?;
        let passes = |p: &KernelPolicy| -> Result<(f64, f64, f64)> {
            let f = timer.time(|| conv_nhwc_fwd(&x, &w, st, pd, p))?;
            // The stem's input needs no gradient.
            let d = if ci % 8 == 0 { timer.time(|| conv_nhwc_dgrad(&dy, &w, st, pd, (hw, hw), p))? } else { f64::NAN };
            let g = timer.time(|| conv_nhwc_wgrad(&dy, &x, k, st, pd, p))?;
            Ok((f, d, g))
        };
        let (f, d, g) = passes(policy)?;
        let mut variants = Vec::new();
        let mut vline = Vec::new();
        if a.variants {
            let geom = ConvGeom { n, h: hw, w: hw, c: ci, ko: co, r: k, stride: st, pad: pd };
            for &t in tiles_for(dev.as_cuda_device()?) {
                if !conv_tile_applies(t, &geom) {
                    continue; // a TMA tile with no pass of its own for this shape
                }
                let (vf, vd, vg) = passes(&policy.clone().with_tuning(Tuning::Forced(t)))?;
                let tf = |ms: f64| if ms.is_nan() { "-".to_string() } else { format!("{:.0}", tflops(flop, ms)) };
                vline.push(format!("{} {}/{}/{}", t.name, tf(vf), tf(vd), tf(vg)));
                variants.push(Passes::new(t.name, vf, vd, vg));
            }
        }
        let (cf, cd, cg) = if a.no_candle {
            (f64::NAN, f64::NAN, f64::NAN)
        } else {
            let xn = x.permute((0, 3, 1, 2))?.contiguous()?;
            let wn = w.permute((0, 3, 1, 2))?.contiguous()?;
            let dyn_ = dy.permute((0, 3, 1, 2))?.contiguous()?;
            let it = timer.iters.min(3);
            let cf = timer.ms(it, || xn.conv2d(&wn, pd, st, 1, 1))?;
            // candle's own backward (candle-core backprop.rs, Op::Conv2D).
            let out_size = (oh - 1) * st + (k - 1) + 1 - 2 * pd;
            let cd = if ci % 8 == 0 {
                timer.ms(it, || dyn_.conv_transpose2d(&wn, pd, hw - out_size, st, 1))?
            } else {
                f64::NAN
            };
            let xt = xn.transpose(0, 1)?;
            let gt = dyn_.transpose(0, 1)?;
            let cg = timer.ms(it, || xt.conv2d(&gt, pd, 1, st, 1)?.transpose(0, 1))?;
            (cf, cd, cg)
        };
        let cell = |ms: f64| {
            if ms.is_nan() {
                format!("{:>14}", "-")
            } else {
                format!("{:>6.0} ({:>5.2})", tflops(flop, ms), ms)
            }
        };
        println!(
            "{:<28} {:>3} | {} {} {} | {} {} {}",
            shape.to_string(),
            count,
            cell(f),
            cell(d),
            cell(g),
            cell(cf),
            cell(cd),
            cell(cg)
        );
        if !vline.is_empty() {
            println!("{:<32} variants fwd/dgrad/wgrad TFLOP/s: {}", "", vline.join(" | "));
        }
        for (i, v) in [f, d, g, cf, cd, cg].iter().enumerate() {
            if !v.is_nan() {
                tot[i] += v * count as f64;
            }
        }
        flop_total += flop * count as f64;
        rows.push(json!({
            "cin": ci, "cout": co, "k": k, "stride": st, "pad": pd, "hw": hw, "count": count,
            "gflop": flop / 1e9,
            "ours": Passes::new("auto", f, d, g),
            "candle": Passes::new("candle", cf, cd, cg),
            "variants": variants,
        }));
    }
    let ours = tot[0] + tot[1] + tot[2];
    println!(
        "total ours: fwd {:.1} ms, dgrad {:.1} ms, wgrad {:.1} ms = {:.1} ms per step = {:.0} TFLOP/s mean \
         (stem dgrad not needed)",
        tot[0],
        tot[1],
        tot[2],
        ours,
        tflops(3.0 * flop_total, ours)
    );
    if !a.no_candle {
        let c = tot[3] + tot[4] + tot[5];
        println!(
            "total candle: fwd {:.1} ms, dgrad {:.1} ms, wgrad {:.1} ms = {:.1} ms = {:.0} TFLOP/s mean",
            tot[3],
            tot[4],
            tot[5],
            c,
            tflops(3.0 * flop_total, c)
        );
    }
    Ok(Value::Array(rows))
}

fn matmuls(a: &Args, timer: &Timer, dev: &Device, dt: DType, policy: &KernelPolicy) -> Result<Value> {
    println!("\nmatmul {dt:?}: TFLOP/s ours vs cuBLAS (candle's matmul)");
    let b = a.batch as usize;
    let cases: [(&str, usize, usize, usize, GemmLayout); 5] = [
        ("8192^3 NT", 8192, 8192, 8192, GemmLayout::Nt),
        ("8192^3 NN", 8192, 8192, 8192, GemmLayout::Nn),
        ("fc fwd 128x1000x2048 (+bias)", b, 1000, 2048, GemmLayout::Nt),
        ("fc dgrad 128x2048x1000", b, 2048, 1000, GemmLayout::Nn),
        ("fc wgrad 1000x2048x128", 1000, 2048, b, GemmLayout::Tn),
    ];
    let mut rows = Vec::new();
    for (name, m, n, k, layout) in cases {
        let (ash, bsh) = match layout {
            GemmLayout::Nt => ((m, k), (n, k)),
            GemmLayout::Nn => ((m, k), (k, n)),
            GemmLayout::Tn => ((k, m), (k, n)),
        };
        let x = Tensor::randn(0f32, 1.0, ash, dev)?.to_dtype(dt)?;
        let y = Tensor::randn(0f32, 1.0, bsh, dev)?.to_dtype(dt)?;
        let bias = Tensor::randn(0f32, 1.0, n, dev)?.to_dtype(dt)?;
        let flop = 2.0 * (m * n * k) as f64;
        let with_bias = name.contains("bias");
        let ours = if with_bias {
            timer.time(|| matmul_bias(&x, &y, &bias, policy))?
        } else {
            timer.time(|| matmul(&x, &y, layout, policy))?
        };
        let cublas = match layout {
            GemmLayout::Nt if with_bias => timer.time(|| x.matmul(&y.t()?)?.broadcast_add(&bias))?,
            GemmLayout::Nt => timer.time(|| x.matmul(&y.t()?))?,
            GemmLayout::Nn => timer.time(|| x.matmul(&y))?,
            GemmLayout::Tn => timer.time(|| x.t()?.matmul(&y))?,
        };
        println!(
            "{:<30} ours {:>6.0} TFLOP/s ({:.3} ms)  cuBLAS {:>6.0} TFLOP/s ({:.3} ms)  ratio {:.2}",
            name,
            tflops(flop, ours),
            ours,
            tflops(flop, cublas),
            cublas,
            cublas / ours
        );
        if a.variants && m * n >= 1 << 20 {
            let mut line = Vec::new();
            for &t in tiles_for(dev.as_cuda_device()?) {
                let p = policy.clone().with_tuning(Tuning::Forced(t));
                let v = timer.time(|| matmul(&x, &y, layout, &p))?;
                line.push(format!("{} {:.0}", t.name, tflops(flop, v)));
            }
            println!("{:<30} variants TFLOP/s: {}", "", line.join(" | "));
        }
        rows.push(json!({ "name": name, "m": m, "n": n, "k": k, "ours_ms": ours, "cublas_ms": cublas }));
    }
    Ok(Value::Array(rows))
}

/// One memory-bound measurement: milliseconds and GB/s of the bytes it must move.
fn mem_row(what: &str, ms: f64, bytes: f64) -> Value {
    let gbs = bytes / ms / 1e6;
    println!("{what:<58} {ms:>8.3} ms {gbs:>7.0} GB/s");
    json!({ "name": what, "ms": ms, "bytes": bytes, "gb_per_s": gbs })
}

fn pools(timer: &Timer, dev: &Device, dt: DType, n: usize) -> Result<Value> {
    println!("\npooling {dt:?} (GB/s of the bytes each pass must move)");
    let es = dt.size_in_bytes() as f64;
    let (c, h, oh) = (64, 112, 56);
    let p = MaxPool2d { kernel: 3, stride: 2, padding: 1 };
    let (nx, ny) = ((n * c * h * h) as f64, (n * c * oh * oh) as f64);
    let mut rows = Vec::new();
    let x = Tensor::randn(0f32, 1.0, (n, c, h, h), dev)?.to_dtype(dt)?;
    let g = Tensor::randn(0f32, 1.0, (n, c, oh, oh), dev)?.to_dtype(dt)?;
    let tag = format!("{n}x{c}x{h}x{h} k3 s2 p1");
    rows.push(mem_row(
        &format!("maxpool nchw {tag} fwd"),
        timer.time(|| kernels::max_pool2d(&x, 3, 2, 1))?,
        (nx + ny) * es,
    ));
    let bwd = MaxPool2dBackward(p);
    rows.push(mem_row(
        &format!("maxpool nchw {tag} bwd"),
        timer.time(|| x.apply_op2_no_bwd(&g, &bwd))?,
        (2.0 * nx + ny) * es,
    ));
    let x = x.permute((0, 2, 3, 1))?.contiguous()?;
    let g = g.permute((0, 2, 3, 1))?.contiguous()?;
    rows.push(mem_row(
        &format!("maxpool nhwc {tag} fwd"),
        timer.time(|| kernels::max_pool2d_nhwc(&x, 3, 2, 1))?,
        (nx + ny) * es,
    ));
    let bwd = MaxPool2dNhwcBackward(p);
    rows.push(mem_row(
        &format!("maxpool nhwc {tag} bwd"),
        timer.time(|| x.apply_op2_no_bwd(&g, &bwd))?,
        (2.0 * nx + ny) * es,
    ));
    // The training step's stem pool: the offsets once, then the backward of the sum of two gradients (the first
    // block's main path and shortcut) in one pass, against the add and the one-gradient pass it replaces.
    let off = x.apply_op1_no_bwd(&MaxPool2dNhwcOffsets(p))?;
    let g2 = Tensor::randn(0f32, 1.0, g.dims(), dev)?.to_dtype(dt)?;
    let bwd_o = MaxPool2dNhwcBackwardOffsets { pool: p, in_hw: (h, h) };
    rows.push(mem_row(
        &format!("maxpool nhwc {tag} bwd of g1 + g2 from offsets, one pass"),
        timer.time(|| max_pool2d_nhwc_backward_offsets_sum(&off, &g, &g2, bwd_o))?,
        (nx + 2.0 * ny) * es + ny,
    ));
    rows.push(mem_row(
        &format!("maxpool nhwc {tag} bwd of g1 + g2 from offsets, add first"),
        timer.time(|| off.apply_op2_no_bwd(&(&g + &g2)?, &bwd_o))?,
        (nx + 4.0 * ny) * es + ny,
    ));
    // The stem's BatchNorm + ReLU + max-pool with its offsets in one launch (the default forward), against
    // the cooperative BatchNorm + ReLU, the pool and the offsets pass it replaces (x here is the conv output).
    {
        use kernels::ops::batchnorm::{batch_norm_train, batch_norm_train_relu_max_pool, Running, TrainBn};
        let var = |v: f32| candle_core::Var::from_tensor(&(Tensor::ones(c, DType::F32, dev)? * v as f64)?);
        let (rm, rv) = (var(0.0)?, var(1.0)?);
        let nb = candle_core::Var::from_tensor(&Tensor::new(0i64, dev)?)?;
        let (weight, bias) = (Tensor::ones(c, DType::F32, dev)?, Tensor::zeros(c, DType::F32, dev)?);
        let bn = || TrainBn {
            weight: weight.clone(),
            bias: bias.clone(),
            eps: 1e-5,
            running: Running { mean: &rm, var: &rv, num_batches_tracked: &nb, momentum: 0.1 },
        };
        rows.push(mem_row(
            &format!("stem bn+relu+maxpool nhwc {tag} + offsets, one launch"),
            timer.time(|| Ok(batch_norm_train_relu_max_pool(&x, None, &bn(), p)?.1))?,
            (2.0 * nx + ny) * es + ny,
        ));
        rows.push(mem_row(
            "  separate: bn+relu, maxpool fwd, offsets",
            timer.time(|| {
                let (_, a) = batch_norm_train(&x, &bn(), true)?;
                a.apply_op1_no_bwd(&MaxPool2dNhwcOffsets(p))?;
                a.apply_op1_no_bwd(&kernels::ops::maxpool::MaxPool2dNhwc(p))
            })?,
            (5.0 * nx + ny) * es + ny,
        ));
        // Its backward: the pool's backward of g1 + g2 from the offsets inside the BatchNorm + ReLU backward,
        // against the one-pass pool backward of the sum and the cooperative BatchNorm backward.
        use kernels::ops::batchnorm::{batch_norm_train_backward, batch_norm_train_relu_max_pool_backward, BnGrad};
        let (stats, _, off) = batch_norm_train_relu_max_pool(&x, None, &bn(), p)?;
        let op = BnGrad { relu: true, stats, weight: weight.clone(), bias: bias.clone(), sums: None };
        let g2 = Tensor::randn(0f32, 1.0, g.dims(), dev)?.to_dtype(dt)?;
        rows.push(mem_row(
            &format!("stem maxpool bwd (g1 + g2) + bn+relu bwd nhwc {tag}, one launch"),
            timer.time(|| Ok(batch_norm_train_relu_max_pool_backward(&x, &off, (&g, Some(&g2)), &op, p)?.1))?,
            // x twice, dx once, g1 + g2 and the offsets in both passes
            3.0 * nx * es + 2.0 * (2.0 * ny * es + ny),
        ));
        let bwd_o = MaxPool2dNhwcBackwardOffsets { pool: p, in_hw: (h, h) };
        rows.push(mem_row(
            "  separate: maxpool bwd of g1 + g2, bn+relu bwd",
            timer.time(|| {
                let ga = max_pool2d_nhwc_backward_offsets_sum(&off, &g, &g2, bwd_o)?;
                Ok(batch_norm_train_backward(&x, &ga, &op)?.1)
            })?,
            (nx + 2.0 * ny) * es + ny + 5.0 * nx * es,
        ));
    }
    // The stem's explicit im2col (7x7, stride 2, padding 3 over 3 channels at 224: K' = 152 columns a pixel), both
    // kernels (16-bit dtypes only).
    if dt != DType::F32 {
        let xi = Tensor::randn(0f32, 1.0, (n, 224, 224, 3), dev)?.to_dtype(dt)?;
        let bytes = ((n * 112 * 112 * 152) as f64 + (n * 224 * 224 * 3) as f64) * es;
        for kernel in [Im2colKernel::Rows, Im2colKernel::Gather] {
            rows.push(mem_row(
                &format!("im2col {n}x224x224x3 k7 s2 p3 ({kernel:?})"),
                timer.time(|| im2col_nhwc(&xi, 7, 2, 3, kernel))?,
                bytes,
            ));
        }
    }
    let (hw, c) = (7, 2048);
    let x = Tensor::randn(0f32, 1.0, (n, hw, hw, c), dev)?.to_dtype(dt)?;
    let dy = Tensor::randn(0f32, 1.0, (n, c), dev)?.to_dtype(dt)?;
    let (big, small) = ((n * hw * hw * c) as f64, (n * c) as f64);
    rows.push(mem_row(
        &format!("avgpool nhwc {n}x{hw}x{hw}x{c} fwd"),
        timer.time(|| kernels::global_avg_pool_nhwc(&x))?,
        (big + small) * es,
    ));
    let bwd = GlobalAvgPoolNhwcBackward { h: hw, w: hw };
    rows.push(mem_row(
        &format!("avgpool nhwc {n}x{hw}x{hw}x{c} bwd"),
        timer.time(|| dy.apply_op1_no_bwd(&bwd))?,
        (big + small) * es,
    ));
    Ok(Value::Array(rows))
}

fn batchnorms(timer: &Timer, dev: &Device, dt: DType, n: usize) -> Result<Value> {
    println!("\nBatchNorm+ReLU nhwc {dt:?} (GB/s of the bytes each pass must move)");
    let mut rows = Vec::new();
    for (h, c) in [(56, 64), (56, 256), (7, 2048)] {
        let dims = (n, h, h, c);
        let x = Tensor::randn(0f32, 1.0, dims, dev)?.to_dtype(dt)?;
        let dy = Tensor::randn(0f32, 1.0, dims, dev)?.to_dtype(dt)?;
        let w = Tensor::ones(c, DType::F32, dev)?;
        let b = Tensor::zeros(c, DType::F32, dev)?;
        let stats = x.apply_op1_no_bwd(&BnStats { eps: 1e-5 })?;
        let grad = BnGrad { relu: true, stats: stats.clone(), weight: w.clone(), bias: b.clone(), sums: None };
        let sums = x.apply_op2_no_bwd(&dy, &grad)?;
        let grad_dx = BnGrad { sums: Some(sums), ..grad.clone() };
        let bytes = (n * h * h * c * dt.size_in_bytes()) as f64;
        let tag = format!("{n}x{h}x{h}x{c}");
        rows.push(mem_row(
            &format!("bn {tag} stats (1 read of x: one pass)"),
            timer.time(|| x.apply_op1_no_bwd(&BnStats { eps: 1e-5 }))?,
            bytes,
        ));
        rows.push(mem_row(
            &format!("bn {tag} fwd: stats + apply (2 reads, 1 write)"),
            timer.time(|| Ok(kernels::batch_norm_nhwc_train(&x, &w, &b, 1e-5, true)?.0))?,
            3.0 * bytes,
        ));
        rows.push(mem_row(
            &format!("bn {tag} bwd sums (x, dy)"),
            timer.time(|| x.apply_op2_no_bwd(&dy, &grad))?,
            2.0 * bytes,
        ));
        rows.push(mem_row(
            &format!("bn {tag} bwd dx (x, dy, dx)"),
            timer.time(|| x.apply_op2_no_bwd(&dy, &grad_dx))?,
            3.0 * bytes,
        ));
    }
    Ok(Value::Array(rows))
}

/// `kernels.bn_stats = "fused"`: each fused BatchNorm reduction against the kernels it replaces, on ResNet-152
/// shapes at batch `n`: the block-output gradient joined with its BatchNorm's backward sums (memory-bound: GB/s of
/// the bytes it must move), the moments in the forward convolution's epilogue and the sums in the grad-input's
/// epilogue (ms: the convolution with its epilogue reduction against the convolution plus the separate pass).
fn fused_bn(timer: &Timer, dev: &Device, dt: DType, n: usize, policy: &KernelPolicy) -> Result<Value> {
    use kernels::ops::batchnorm::{batch_stats_from_partials, join_grad_sums, Running};
    println!(
        "
fused BatchNorm reductions (kernels.bn_stats = \"fused\") {dt:?}"
    );
    let mut rows = Vec::new();
    let ms_row = |what: &str, fused: f64, separate: f64| -> Value {
        println!("{what:<58} {fused:>8.3} ms fused, {separate:>8.3} ms separate ({:.2}x)", separate / fused);
        json!({ "name": what, "fused_ms": fused, "separate_ms": separate })
    };
    let params = |c: usize| -> Result<kernels::BnParams> {
        let stats = Tensor::cat(&[Tensor::zeros((1, c), DType::F32, dev)?, Tensor::ones((2, c), DType::F32, dev)?], 0)?;
        Ok(kernels::BnParams {
            stats,
            weight: Tensor::ones(c, DType::F32, dev)?,
            bias: Tensor::zeros(c, DType::F32, dev)?,
        })
    };
    // The block output's gradient and its last BatchNorm's sums: layer3's (14 x 14 x 1024) and layer1's.
    for (h, c) in [(14, 1024), (56, 256)] {
        let r = |s: f64| -> candle_core::Result<Tensor> {
            (Tensor::randn(0f32, 1.0, (n, h, h, c), dev)? + s)?.to_dtype(dt)
        };
        let (a, b, y, z) = (r(0.0)?, r(0.0)?, r(0.0)?.relu()?, r(0.5)?);
        let p = params(c)?;
        let bytes = (n * h * h * c * dt.size_in_bytes()) as f64;
        let grad =
            BnGrad { relu: false, stats: p.stats.clone(), weight: p.weight.clone(), bias: p.bias.clone(), sums: None };
        rows.push(mem_row(
            &format!("join {n}x{h}x{h}x{c}: relu grad + bwd sums (4 reads, 1 write)"),
            timer.time(|| Ok(join_grad_sums(&a, Some(&b), &y, &z, &p)?.0))?,
            5.0 * bytes,
        ));
        rows.push(mem_row(
            "  separate: add_relu_grad + bwd sums (5 reads, 1 write)",
            timer.time(|| {
                let g = kernels::add_relu_grad(&a, &b, &y)?;
                z.apply_op2_no_bwd(&g, &grad)
            })?,
            6.0 * bytes,
        ));
    }
    // The moments in the forward epilogue, and the sums in the grad-input epilogue: a 1x1 (GEMM) and a 3x3.
    for (h, c, ko, k) in [(56, 64, 256, 1), (14, 256, 256, 3)] {
        let pad = k / 2;
        let x = Tensor::randn(0f32, 1.0, (n, h, h, c), dev)?.to_dtype(dt)?;
        let w = (Tensor::randn(0f32, 1.0, (ko, k, k, c), dev)? * 0.05)?.to_dtype(dt)?;
        let fused = policy.clone().with_fused_bn_reductions(true);
        let running = |c: usize| -> Result<(candle_core::Var, candle_core::Var, candle_core::Var)> {
            Ok((
                candle_core::Var::from_tensor(&Tensor::zeros(c, DType::F32, dev)?)?,
                candle_core::Var::from_tensor(&Tensor::ones(c, DType::F32, dev)?)?,
                candle_core::Var::from_tensor(&Tensor::new(0i64, dev)?)?,
            ))
        };
        let (m, v, t) = running(ko)?;
        let run = Running { mean: &m, var: &v, num_batches_tracked: &t, momentum: 0.1 };
        let rows_out = n * h * h;
        let tag = format!("{n}x{h}x{h}x{c} -> {ko} k{k}");
        let f = timer.time(|| {
            let (y, part) = kernels::conv2d_nhwc_forward_stats(&x, &w, 1, pad, &fused)?;
            match part {
                Some(part) => batch_stats_from_partials(&part, rows_out, ko, 1e-5, &run),
                None => kernels::ops::batchnorm::batch_stats(&y, 1e-5, &run),
            }
        })?;
        let sep = timer.time(|| {
            let y = kernels::conv2d_nhwc_forward(&x, &w, 1, pad, policy)?;
            kernels::ops::batchnorm::batch_stats(&y, 1e-5, &run)
        })?;
        rows.push(ms_row(&format!("conv fwd {tag} + BatchNorm moments"), f, sep));
        // Grad-input of the same conv into a BatchNorm + ReLU over x's shape.
        let dy = Tensor::randn(0f32, 1.0, (n, h, h, ko), dev)?.to_dtype(dt)?;
        let p = params(c)?;
        let f =
            timer.time(|| Ok(kernels::conv2d_nhwc_grad_input_sums(&dy, &w, (1, pad, (h, h)), &fused, &x, &p)?.1))?;
        let grad =
            BnGrad { relu: true, stats: p.stats.clone(), weight: p.weight.clone(), bias: p.bias.clone(), sums: None };
        let sep = timer.time(|| {
            let dx = kernels::conv2d_nhwc_grad_input(&dy, &w, 1, pad, (h, h), policy)?;
            x.apply_op2_no_bwd(&dx, &grad)
        })?;
        rows.push(ms_row(&format!("conv dgrad {tag} + BatchNorm bwd sums"), f, sep));
    }
    // What the epilogues cost the convolutions themselves: every distinct ResNet-152 conv, plain against its
    // STATS forward (the partials, no finaliser) and its grad-input with the BatchNorm sums (GSUMS and the
    // finaliser; a strided grad-input: plus the sums pass), without the passes they save; the totals weigh each
    // shape by how often the network runs it.
    println!("per conv, epilogue variant against the plain kernel (ms; x = occurrences):");
    let fused = policy.clone().with_fused_bn_reductions(true);
    let mut tot = [0f64; 4];
    for (shape, count) in resnet152_convs() {
        let (ci, co, k, st, pd, hw) = (shape.c_in, shape.c_out, shape.k, shape.stride, shape.pad, shape.hw);
        if ci % 8 != 0 {
            continue; // the stem: no TMA path
        }
        let oh = shape.out_hw();
        let x = Tensor::randn(0f32, 1.0, (n, hw, hw, ci), dev)?.to_dtype(dt)?;
        let w = (Tensor::randn(0f32, 1.0, (co, k, k, ci), dev)? * 0.05)?.to_dtype(dt)?;
        let dy = Tensor::randn(0f32, 1.0, (n, oh, oh, co), dev)?.to_dtype(dt)?;
        let fp = timer.time(|| kernels::conv2d_nhwc_forward(&x, &w, st, pd, policy))?;
        let fs = timer.time(|| Ok(kernels::conv2d_nhwc_forward_stats(&x, &w, st, pd, &fused)?.0))?;
        let dp = timer.time(|| kernels::conv2d_nhwc_grad_input(&dy, &w, st, pd, (hw, hw), policy))?;
        let p = params(ci)?;
        let ds =
            timer.time(|| Ok(kernels::conv2d_nhwc_grad_input_sums(&dy, &w, (st, pd, (hw, hw)), &fused, &x, &p)?.0))?;
        let c = count as f64;
        for (t, v) in tot.iter_mut().zip([fp, fs, dp, ds]) {
            *t += c * v;
        }
        println!(
            "{:<28} x{count:<3} fwd {fp:>7.3} stats {fs:>7.3} ({:+5.1}%) | dgrad {dp:>7.3} gsums {ds:>7.3} ({:+5.1}%)",
            shape.to_string(),
            100.0 * (fs / fp - 1.0),
            100.0 * (ds / dp - 1.0)
        );
        rows.push(json!({ "name": format!("epilogue cost {shape}"), "count": count, "fwd_ms": fp, "fwd_stats_ms": fs,
            "dgrad_ms": dp, "dgrad_gsums_ms": ds }));
    }
    println!(
        "network total: fwd {:.2} ms, with stats {:.2} ms; dgrad {:.2} ms, with sums {:.2} ms",
        tot[0], tot[1], tot[2], tot[3]
    );
    Ok(Value::Array(rows))
}

/// The multi-tensor kernels over ResNet-152's parameters (FP32 masters of a fresh model, random gradients) and the
/// fused step's conv weight conversions, in GB/s of the bytes each must move.
fn optims(timer: &Timer, dev: &Device, dt: DType) -> Result<Value> {
    use kernels::cuda::optim::{adamw_step, gather_scaled, sgd_step, DeviceDecision, SgdParam};
    println!(
        "
multi-tensor kernels over ResNet-152's parameters, {dt:?} conversions (GB/s of the bytes moved)"
    );
    let cfg = resnet::ResNetConfig { arch: resnet::Arch::ResNet152, ..Default::default() };
    let model = resnet::ResNet::new(cfg, dev)?;
    let params: Vec<(String, candle_core::Var)> = model.store().trainable();
    let grads: Vec<Tensor> =
        params.iter().map(|(_, v)| Tensor::randn(0f32, 1.0, v.dims(), dev)).collect::<candle_core::Result<_>>()?;
    let n: usize = params.iter().map(|(_, v)| v.elem_count()).sum();
    let f4 = 4.0 * n as f64;
    let mut rows = Vec::new();
    let (flat, _) = gather_scaled(&grads, 1.0 / 1024.0)?;
    rows.push(mem_row(
        &format!("gather + unscale + sum of squares, {} tensors, {n} floats", grads.len()),
        timer.time(|| Ok(gather_scaled(&grads, 1.0 / 1024.0)?.0))?,
        2.0 * f4,
    ));
    let sgd: Vec<SgdParam> =
        params.iter().map(|(_, v)| SgdParam { tensor: v.as_tensor(), weight_decay: 1e-4, lr_mult: 1.0 }).collect();
    let (m, v) = (Tensor::zeros(n, DType::F32, dev)?, Tensor::zeros(n, DType::F32, dev)?);
    // The device-side decision the trainer uses: a finite norm, no clipping; the step state for AdamW's t.
    let norm_sq = Tensor::new(1.0f32, dev)?;
    let decision = DeviceDecision { norm_sq: &norm_sq, clip: 0.0 };
    let ctl = Tensor::new(&[1f32, 0.0, 10.0], dev)?;
    let lr = Tensor::new(&[1e-6f32], dev)?;
    rows.push(mem_row(
        "SGD, momentum + Nesterov + weight decay (p, g, m read; p, m written)",
        timer.time(|| {
            sgd_step(&sgd, &flat, &m, decision, &lr, 0.9, true, None)?;
            Ok(flat.clone())
        })?,
        5.0 * f4,
    ));
    rows.push(mem_row(
        "AdamW (p, g, m, v read; p, m, v written)",
        timer.time(|| {
            adamw_step(&sgd, &flat, &m, &v, decision, &ctl, &lr, (0.9, 0.999, 1e-8), None)?;
            Ok(flat.clone())
        })?,
        7.0 * f4,
    ));
    // The fused softmax cross-entropy of the step's head: ResNet-152's logits at batch 256, in the conversion dtype
    // (logits read, f32 gradient written).
    let (n_rows, classes) = (256usize, 1000usize);
    let logits = Tensor::randn(0f32, 1.0, (n_rows, classes), dev)?.to_dtype(dt)?;
    let labels = Tensor::new((0..n_rows as u32).map(|i| (i * 7) % classes as u32).collect::<Vec<_>>(), dev)?;
    rows.push(mem_row(
        &format!("softmax cross-entropy fwd + bwd, {n_rows} x {classes}"),
        timer.time(|| Ok(kernels::ops::xent::softmax_xent(&logits, &labels, 0.1, 1.0)?.1))?,
        (n_rows * classes) as f64 * (dt.size_in_bytes() + 4) as f64,
    ));
    let convs: Vec<Tensor> = params.iter().filter(|(_, v)| v.rank() == 4).map(|(_, v)| v.as_tensor().clone()).collect();
    let refs: Vec<&Tensor> = convs.iter().collect();
    let nc: usize = convs.iter().map(|w| w.elem_count()).sum();
    let (f4c, lpc) = (4.0 * nc as f64, (dt.size_in_bytes() * nc) as f64);
    rows.push(mem_row(
        &format!("conv weights FP32 -> {dt:?} (k, r, s, c), {} tensors", convs.len()),
        timer.time(|| Ok(kernels::ops::weights::conv_weights_krsc(&refs, dt)?.swap_remove(0)))?,
        f4c + lpc,
    ));
    // The update that also writes the step's conv weights (what the trainer runs): the bytes above plus the
    // low-precision copy of every conv weight.
    let kept = kernels::cuda::optim::ConvWeights::new(&refs, dt)?;
    rows.push(mem_row(
        &format!("SGD as above, writing the {dt:?} (k, r, s, c) conv weights too"),
        timer.time(|| {
            sgd_step(&sgd, &flat, &m, decision, &lr, 0.9, true, Some(&kept))?;
            Ok(flat.clone())
        })?,
        5.0 * f4 + lpc,
    ));
    let lp = kernels::ops::weights::conv_weights_krsc(&refs, dt)?;
    rows.push(mem_row(
        &format!("conv grad-weights {dt:?} (k, r, s, c) -> FP32, {} tensors", lp.len()),
        timer.time(|| Ok(kernels::ops::weights::conv_grads_kcrs(&lp)?.swap_remove(0)))?,
        f4c + lpc,
    ));
    Ok(Value::Array(rows))
}
