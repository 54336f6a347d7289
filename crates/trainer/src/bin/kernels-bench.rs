//! Kernel benchmark (feature `cuda`): every distinct ResNet-152 convolution at batch N (forward, grad-input,
//! grad-weight) on our implicit-GEMM kernels and on candle's, and our matmul against cuBLAS (candle's matmul)
//! at 8192^3 and at the FC layer's shapes. Prints TFLOP/s tables and writes JSON (`--json PATH`) that
//! scripts/kernels-bench.sh joins with cuDNN's figures (scripts/torch_conv_shapes.py) from the same run.
//!
//! usage: kernels-bench [--batch 128] [--dtype bf16|f16] [--iters 20] [--no-candle] [--variants] [--wall]
//!                      [--only-matmul | --no-matmul] [--filter SHAPE-SUBSTRING] [--json PATH]
//! Times are GPU times between two CUDA events around `--iters` back-to-back runs after 3 warm-up runs, as
//! scripts/torch_conv_shapes.py times cuDNN; `--wall` times the host instead (synchronise, run, synchronise).
//! cudarc's per-allocation event tracking is off, as in the trainer (one stream).
//! `--tile t128` forces one tile variant instead of the autotuned choice (for profiling; `--variants` resets it).
//! `--filter "256-> 256 k3 s1 hw 14"` keeps the shapes whose printed name contains the text (for profiling one).

use candle_core::{DType, Device, Result, Tensor};
use kernels::cuda_gemm::{self, GemmLayout, TILES};
use kernels::shapes::resnet152_convs;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

/// `--wall`: host wall-clock timing instead of CUDA events.
static WALL: AtomicBool = AtomicBool::new(false);

struct Args {
    batch: usize,
    dtype: DType,
    iters: usize,
    candle: bool,
    variants: bool,
    only_matmul: bool,
    no_matmul: bool,
    filter: Option<String>,
    json: Option<String>,
}

fn parse() -> std::result::Result<Args, String> {
    let mut a = Args {
        batch: 128,
        dtype: DType::BF16,
        iters: 20,
        candle: true,
        variants: false,
        only_matmul: false,
        no_matmul: false,
        filter: None,
        json: None,
    };
    let mut it = std::env::args().skip(1);
    while let Some(k) = it.next() {
        let mut val = |name: &str| it.next().ok_or_else(|| format!("{name} needs a value"));
        match k.as_str() {
            "--batch" => a.batch = val("--batch")?.parse().map_err(|e| format!("--batch: {e}"))?,
            "--iters" => a.iters = val("--iters")?.parse().map_err(|e| format!("--iters: {e}"))?,
            "--dtype" => {
                a.dtype = match val("--dtype")?.as_str() {
                    "bf16" => DType::BF16,
                    "f16" | "fp16" => DType::F16,
                    other => return Err(format!("--dtype {other}: expected bf16 or f16")),
                }
            }
            "--no-candle" => a.candle = false,
            "--wall" => WALL.store(true, Ordering::Relaxed),
            "--variants" => a.variants = true,
            "--only-matmul" => a.only_matmul = true,
            "--no-matmul" => a.no_matmul = true,
            "--filter" => a.filter = Some(val("--filter")?),
            "--tile" => {
                let name = val("--tile")?;
                let t = TILES.iter().find(|t| t.name == name).ok_or_else(|| {
                    format!("--tile {name}: not one of {:?}", TILES.iter().map(|t| t.name).collect::<Vec<_>>())
                })?;
                cuda_gemm::set_forced_tile(Some(*t));
            }
            "--json" => a.json = Some(val("--json")?),
            other => return Err(format!("unknown argument {other} (see the header of kernels-bench.rs)")),
        }
    }
    if a.batch == 0 || a.iters == 0 {
        return Err("--batch and --iters must be positive".into());
    }
    Ok(a)
}

/// Mean milliseconds of `f` over `iters` back-to-back runs after 3 warm-up runs: the GPU time between CUDA events
/// recorded before and after them (as torch.cuda.Event in scripts/torch_conv_shapes.py), or with `--wall` the host
/// time from a synchronised start to a synchronised end.
fn time_ms(dev: &Device, iters: usize, mut f: impl FnMut() -> Result<Tensor>) -> Result<f64> {
    for _ in 0..3 {
        f()?;
    }
    dev.synchronize()?;
    if WALL.load(Ordering::Relaxed) {
        let t = Instant::now();
        for _ in 0..iters {
            f()?;
        }
        dev.synchronize()?;
        return Ok(t.elapsed().as_secs_f64() * 1e3 / iters as f64);
    }
    let stream = dev.as_cuda_device()?.cuda_stream();
    let timing = Some(candle_core::cuda_backend::cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT);
    let err =
        |e: candle_core::cuda_backend::cudarc::driver::DriverError| candle_core::Error::Msg(format!("CUDA event: {e}"));
    let start = stream.record_event(timing).map_err(err)?;
    for _ in 0..iters {
        f()?;
    }
    let end = stream.record_event(timing).map_err(err)?;
    Ok(start.elapsed_ms(&end).map_err(err)? as f64 / iters as f64)
}

fn tflops(flop: f64, ms: f64) -> f64 {
    flop / ms / 1e9
}

fn main() {
    let args = match parse() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("kernels-bench: {e}");
            std::process::exit(2);
        }
    };
    if let Err(e) = run(&args) {
        eprintln!("kernels-bench: {}", e.to_string().lines().next().unwrap_or("error"));
        std::process::exit(1);
    }
}

fn run(a: &Args) -> Result<()> {
    let dev = Device::new_cuda(0)?;
    // SAFETY: all device work below is issued from this thread on candle's one stream (see trainer::train).
    unsafe { dev.as_cuda_device()?.disable_event_tracking() };
    let dt = a.dtype;
    let mut json = Vec::new();
    if !a.only_matmul {
        println!("ResNet-152 convolutions, batch {}, {:?}, channels-last; TFLOP/s (ms)", a.batch, dt);
        println!(
            "{:<28} {:>3} | {:>14} {:>14} {:>14} | {:>14} {:>14} {:>14}",
            "shape", "x", "fwd ours", "dgrad ours", "wgrad ours", "fwd candle", "dgrad candle", "wgrad candle"
        );
        let mut tot = [0f64; 6];
        let mut flop_total = 0f64;
        for (shape, count) in resnet152_convs() {
            if a.filter.as_ref().is_some_and(|f| !shape.to_string().contains(f.as_str())) {
                continue;
            }
            let n = a.batch;
            let (ci, co, k, st, pd, hw) = (shape.c_in, shape.c_out, shape.k, shape.stride, shape.pad, shape.hw);
            let oh = shape.out_hw();
            let flop = shape.flops(n);
            let x = Tensor::randn(0f32, 1.0, (n, hw, hw, ci), &dev)?.to_dtype(dt)?;
            let w = (Tensor::randn(0f32, 1.0, (co, k, k, ci), &dev)? * (1.0 / ((ci * k * k) as f64).sqrt()))?
                .to_dtype(dt)?;
            let dy = Tensor::randn(0f32, 1.0, (n, oh, oh, co), &dev)?.to_dtype(dt)?;
            let f = time_ms(&dev, a.iters, || cuda_gemm::conv_nhwc_fwd(&x, &w, st, pd))?;
            let d = if ci % 8 == 0 {
                time_ms(&dev, a.iters, || cuda_gemm::conv_nhwc_dgrad(&dy, &w, st, pd, (hw, hw)))?
            } else {
                f64::NAN // the stem's input needs no gradient
            };
            let g = time_ms(&dev, a.iters, || cuda_gemm::conv_nhwc_wgrad(&dy, &x, k, st, pd))?;
            let mut variants = Vec::new();
            let mut vline = Vec::new();
            if a.variants {
                let geom = cuda_gemm::ConvGeom { n, h: hw, w: hw, c: ci, ko: co, r: k, stride: st, pad: pd };
                for &t in cuda_gemm::tiles_for(dev.as_cuda_device()?) {
                    if !cuda_gemm::conv_tile_applies(t, &geom) {
                        continue; // a TMA tile (x256, x128) with no pass of its own for this shape
                    }
                    cuda_gemm::set_forced_tile(Some(t));
                    let vf = time_ms(&dev, a.iters, || cuda_gemm::conv_nhwc_fwd(&x, &w, st, pd))?;
                    let vd = if ci % 8 == 0 {
                        time_ms(&dev, a.iters, || cuda_gemm::conv_nhwc_dgrad(&dy, &w, st, pd, (hw, hw)))?
                    } else {
                        f64::NAN
                    };
                    let vg = time_ms(&dev, a.iters, || cuda_gemm::conv_nhwc_wgrad(&dy, &x, k, st, pd))?;
                    cuda_gemm::set_forced_tile(None);
                    variants.push(serde_like(t.name, vf, vd, vg, flop));
                    let tf = |ms: f64| if ms.is_nan() { "-".to_string() } else { format!("{:.0}", tflops(flop, ms)) };
                    vline.push(format!("{} {}/{}/{}", t.name, tf(vf), tf(vd), tf(vg)));
                }
            }
            let (cf, cd, cg) = if a.candle {
                let xn = x.permute((0, 3, 1, 2))?.contiguous()?;
                let wn = w.permute((0, 3, 1, 2))?.contiguous()?;
                let dyn_ = dy.permute((0, 3, 1, 2))?.contiguous()?;
                let it = a.iters.min(3);
                let cf = time_ms(&dev, it, || xn.conv2d(&wn, pd, st, 1, 1))?;
                // candle's own backward (candle-core backprop.rs, Op::Conv2D).
                let out_size = (oh - 1) * st + (k - 1) + 1 - 2 * pd;
                let cd = if ci % 8 == 0 {
                    time_ms(&dev, it, || dyn_.conv_transpose2d(&wn, pd, hw - out_size, st, 1))?
                } else {
                    f64::NAN
                };
                let xt = xn.transpose(0, 1)?;
                let gt = dyn_.transpose(0, 1)?;
                let cg = time_ms(&dev, it, || xt.conv2d(&gt, pd, 1, st, 1)?.transpose(0, 1))?;
                (cf, cd, cg)
            } else {
                (f64::NAN, f64::NAN, f64::NAN)
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
            json.push(format!(
                "{{\"cin\":{ci},\"cout\":{co},\"k\":{k},\"stride\":{st},\"pad\":{pd},\"hw\":{hw},\"count\":{count},\
                 \"gflop\":{:.4},\"ours\":{},\"candle\":{},\"variants\":[{}]}}",
                flop / 1e9,
                serde_like("auto", f, d, g, flop),
                serde_like("candle", cf, cd, cg, flop),
                variants.join(",")
            ));
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
        if a.candle {
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
    }

    if a.no_matmul {
        return write_json(a, &json, &[]);
    }
    println!("\nmatmul {:?}: TFLOP/s ours vs cuBLAS (candle's matmul)", dt);
    let mut mm = Vec::new();
    let cases: [(&str, usize, usize, usize, GemmLayout); 5] = [
        ("8192^3 NT", 8192, 8192, 8192, GemmLayout::Nt),
        ("8192^3 NN", 8192, 8192, 8192, GemmLayout::Nn),
        ("fc fwd 128x1000x2048 (+bias)", a.batch, 1000, 2048, GemmLayout::Nt),
        ("fc dgrad 128x2048x1000", a.batch, 2048, 1000, GemmLayout::Nn),
        ("fc wgrad 1000x2048x128", 1000, 2048, a.batch, GemmLayout::Tn),
    ];
    for (name, m, n, k, layout) in cases {
        let (ash, bsh) = match layout {
            GemmLayout::Nt => ((m, k), (n, k)),
            GemmLayout::Nn => ((m, k), (k, n)),
            GemmLayout::Tn => ((k, m), (k, n)),
        };
        let x = Tensor::randn(0f32, 1.0, ash, &dev)?.to_dtype(dt)?;
        let y = Tensor::randn(0f32, 1.0, bsh, &dev)?.to_dtype(dt)?;
        let bias = Tensor::randn(0f32, 1.0, n, &dev)?.to_dtype(dt)?;
        let flop = 2.0 * (m * n * k) as f64;
        let ours = if name.contains("bias") {
            time_ms(&dev, a.iters, || cuda_gemm::matmul_bias(&x, &y, &bias))?
        } else {
            time_ms(&dev, a.iters, || cuda_gemm::matmul(&x, &y, layout))?
        };
        let cublas = match layout {
            GemmLayout::Nt if name.contains("bias") => {
                time_ms(&dev, a.iters, || x.matmul(&y.t()?)?.broadcast_add(&bias))?
            }
            GemmLayout::Nt => time_ms(&dev, a.iters, || x.matmul(&y.t()?))?,
            GemmLayout::Nn => time_ms(&dev, a.iters, || x.matmul(&y))?,
            GemmLayout::Tn => time_ms(&dev, a.iters, || x.t()?.matmul(&y))?,
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
            for &t in cuda_gemm::tiles_for(dev.as_cuda_device()?) {
                cuda_gemm::set_forced_tile(Some(t));
                let v = time_ms(&dev, a.iters, || cuda_gemm::matmul(&x, &y, layout));
                cuda_gemm::set_forced_tile(None);
                line.push(format!("{} {:.0}", t.name, tflops(flop, v?)));
            }
            println!("{:<30} variants TFLOP/s: {}", "", line.join(" | "));
        }
        mm.push(format!(
            "{{\"name\":\"{name}\",\"m\":{m},\"n\":{n},\"k\":{k},\"ours_ms\":{ours:.5},\"cublas_ms\":{cublas:.5}}}"
        ));
    }
    write_json(a, &json, &mm)
}

fn write_json(a: &Args, convs: &[String], mm: &[String]) -> Result<()> {
    if let Some(path) = &a.json {
        let body = format!(
            "{{\"batch\":{},\"dtype\":\"{:?}\",\"convs\":[{}],\"matmul\":[{}]}}\n",
            a.batch,
            a.dtype,
            convs.join(","),
            mm.join(",")
        );
        std::fs::write(path, body).map_err(|e| candle_core::Error::Msg(format!("--json {path}: {e}")))?;
    }
    Ok(())
}

/// {"name":..,"fwd_ms":..,"dgrad_ms":..,"wgrad_ms":..} with null for passes not run.
fn serde_like(name: &str, f: f64, d: f64, g: f64, _flop: f64) -> String {
    let v = |x: f64| if x.is_nan() { "null".to_string() } else { format!("{x:.5}") };
    format!("{{\"name\":\"{name}\",\"fwd_ms\":{},\"dgrad_ms\":{},\"wgrad_ms\":{}}}", v(f), v(d), v(g))
}
