//! GPU tests of the tensor-core kernels (feature `cuda`): implicit-GEMM convolution forward / grad-input /
//! grad-weight on all 23 distinct ResNet-152 convolutions and on awkward shapes, and the matmul in its three
//! layouts, each against FP32 candle ops on the same (rounded) inputs, outputs poisoned with NaN before every
//! launch, under every tile variant the GPU runs. Run by scripts/gpu-test.sh with the default (multi-threaded) harness: every test passes its kernel
//! policy as a value and poisons outputs in a scope of its own thread.
#![cfg(feature = "cuda")]

use anyhow::{Context, Result};
use candle_core::{DType, Device, Tensor, Var};
use integration_tests::check_rel as check;
use kernels::cuda::loader::tiles_for;
use kernels::ops::conv::{conv2d_grad_input, conv2d_grad_weight, Conv2dParams};
use kernels::ops::conv_nhwc::{conv_nhwc_dgrad, conv_nhwc_fwd, conv_nhwc_wgrad};
use kernels::ops::linear::{matmul, matmul_bias};
use kernels::shapes::{resnet152_convs, ConvShape};
use kernels::variants::{Tile, PORTABLE_TILES};
use kernels::{Autotuner, GemmLayout, KernelPolicy, Tuning};
use std::sync::Arc;

/// The per-shape choice (None: autotuned) and every tile variant the device runs (the wgmma ones on compute
/// capability 9.0).
fn tiles() -> Vec<Option<Tile>> {
    let dev = cuda().and_then(|d| Ok(d.as_cuda_device()?.clone()));
    let all = match &dev {
        Ok(d) => tiles_for(d),
        Err(_) => &PORTABLE_TILES[..],
    };
    std::iter::once(None).chain(all.iter().copied().map(Some)).collect()
}

fn cuda() -> Result<Device> {
    Device::new_cuda(0).context("no CUDA device 0")
}

/// The custom kernels with `tile` forced, or autotuned (in memory) for None.
fn policy(tile: Option<Tile>) -> KernelPolicy {
    let tuning = match tile {
        Some(t) => Tuning::Forced(t),
        None => Tuning::Autotune(Arc::new(Autotuner::in_memory())),
    };
    KernelPolicy::custom().with_tuning(tuning)
}

fn tol(dt: DType) -> f64 {
    // Inputs are exact in both paths (rounded once); the kernels accumulate in FP32 and round the output once
    // (bf16: 2^-9 relative, f16: 2^-12), the split-K sum adds FP32 rounding only.
    if dt == DType::BF16 {
        6e-3
    } else {
        1e-3
    }
}

/// (n, h, w, c) input, (ko, k, k, c) weight, (n, p, q, ko) output gradient: random, rounded to `dt`.
fn conv_inputs(s: &ConvShape, n: usize, dt: DType, dev: &Device) -> Result<(Tensor, Tensor, Tensor)> {
    let oh = s.out_hw();
    let x = Tensor::randn(0f32, 1.0, (n, s.hw, s.hw, s.c_in), dev)?.to_dtype(dt)?;
    let scale = 1.0 / ((s.c_in * s.k * s.k) as f64).sqrt();
    let w = (Tensor::randn(0f32, 1.0, (s.c_out, s.k, s.k, s.c_in), dev)? * scale)?.to_dtype(dt)?;
    let dy = Tensor::randn(0f32, 1.0, (n, oh, oh, s.c_out), dev)?.to_dtype(dt)?;
    Ok((x, w, dy))
}

/// FP32 references through candle's NCHW ops (our forward-conv backward, itself tested against candle's).
fn conv_reference(s: &ConvShape, x: &Tensor, w: &Tensor, dy: &Tensor) -> Result<(Tensor, Tensor, Tensor)> {
    let nchw = |t: &Tensor| -> Result<Tensor> { Ok(t.to_dtype(DType::F32)?.permute((0, 3, 1, 2))?.contiguous()?) };
    let nhwc = |t: Tensor| -> Result<Tensor> { Ok(t.permute((0, 2, 3, 1))?.contiguous()?) };
    let (xn, wn, dyn_) = (nchw(x)?, nchw(w)?, nchw(dy)?);
    let p = Conv2dParams { stride: s.stride, padding: s.pad };
    let y = nhwc(xn.conv2d(&wn, s.pad, s.stride, 1, 1)?)?;
    let dx = nhwc(conv2d_grad_input(&dyn_, &wn, p, (s.hw, s.hw))?)?;
    let dw = nhwc(conv2d_grad_weight(&xn, &dyn_, p, s.k)?)?;
    Ok((y, dx, dw))
}

/// Forward, grad-input and grad-weight of `s` under `p` against the FP32 references, outputs NaN-poisoned.
fn check_conv(s: &ConvShape, n: usize, dt: DType, dev: &Device, p: &KernelPolicy, tag: &str) -> Result<String> {
    let _poison = kernels::cuda::poison_outputs();
    let (x, w, dy) = conv_inputs(s, n, dt, dev)?;
    let (y_ref, dx_ref, dw_ref) = conv_reference(s, &x, &w, &dy)?;
    let what = format!("{s} n{n} {dt:?} {tag}");
    let y = conv_nhwc_fwd(&x, &w, s.stride, s.pad, p)?;
    let ef = check(&format!("fwd {what}"), &y, &y_ref, tol(dt))?;
    let dx = conv_nhwc_dgrad(&dy, &w, s.stride, s.pad, (s.hw, s.hw), p)?;
    let ed = check(&format!("dgrad {what}"), &dx, &dx_ref, tol(dt))?;
    let dw = conv_nhwc_wgrad(&dy, &x, s.k, s.stride, s.pad, p)?;
    let eg = check(&format!("wgrad {what}"), &dw, &dw_ref, tol(dt))?;
    Ok(format!("{what}: rel err fwd {ef:.1e} dgrad {ed:.1e} wgrad {eg:.1e}"))
}

/// Every distinct ResNet-152 convolution (batch 2), both dtypes, every tile variant.
#[test]
fn conv_resnet152_shapes_match_reference() -> Result<()> {
    let dev = cuda()?;
    for (s, _) in resnet152_convs() {
        for dt in [DType::BF16, DType::F16] {
            for tile in tiles() {
                let tag = tile.map_or("auto", |t| t.name);
                println!("{}", check_conv(&s, 2, dt, &dev, &policy(tile), tag)?);
            }
        }
    }
    Ok(())
}

/// Shapes that are no tile multiple: odd channel counts (scalar loads), channel counts below and not
/// multiple of the 32-wide k-tile (counter wrap-around inside a tile), odd sizes with stride 2, batch 1, and a
/// larger batch where many 128x128 tiles run.
#[test]
fn conv_awkward_shapes_match_reference() -> Result<()> {
    let dev = cuda()?;
    let sh = |c_in, c_out, k, stride, hw| ConvShape { c_in, c_out, k, stride, pad: k / 2, hw };
    let cases = [
        (sh(3, 64, 7, 2, 37), 3),     // stem, odd size
        (sh(5, 24, 3, 1, 9), 2),      // 5 channels: scalar loads
        (sh(8, 8, 3, 1, 5), 1),       // 8 channels: several (r, s) per 32-wide k-tile
        (sh(24, 40, 3, 2, 15), 2),    // 24 channels, stride 2, odd size
        (sh(40, 72, 1, 2, 7), 1),     // strided 1x1, odd size
        (sh(16, 200, 1, 1, 13), 3),   // N not a tile multiple
        (sh(264, 136, 3, 1, 6), 2),   // K and N not tile multiples
        (sh(64, 64, 3, 1, 56), 1),    // batch 1, full-size layer1 conv
        (sh(256, 256, 3, 1, 14), 32), // many tiles
        (sh(3, 16, 3, 1, 8), 1),      // 3 channels, 3x3
        // The TMA im2col paths (channels multiples of 64): partial pixel tiles, stride 2 with odd sizes, output
        // channels below / not a multiple of the 128 / 256-wide tiles, 5x5 taps, a strided 1x1, and C = 192
        // (grad-input's flipped weight panels run past C into the next tap: those columns must never be stored).
        (sh(64, 72, 3, 2, 15), 3),  // stride 2, odd size, Ko = 72
        (sh(128, 64, 3, 1, 7), 5),  // M = 245: the last pixel column runs past the batch
        (sh(64, 64, 5, 1, 9), 2),   // 25 taps, padding 2
        (sh(64, 128, 1, 2, 9), 3),  // strided 1x1 (no padding)
        (sh(192, 64, 3, 1, 10), 2), // C = 192
        (sh(64, 128, 3, 2, 15), 2), // strided grad-input by phase class, odd size (classes of 8 and 7 rows)
    ];
    for (s, n) in cases {
        for dt in [DType::BF16, DType::F16] {
            for tile in tiles() {
                let tag = tile.map_or("auto", |t| t.name);
                println!("{}", check_conv(&s, n, dt, &dev, &policy(tile), tag)?);
            }
        }
    }
    // Fewer than 8 input channels go through explicit im2col + the TMA GEMM on a wgmma device; with a tiny buffer
    // budget the rows go one image per chunk (grad-weight: one partial product per chunk, summed by sum_rows).
    let tiny = KernelPolicy { im2col_budget: 1, ..policy(None) };
    for (s, n) in [(sh(3, 64, 7, 2, 37), 3), (sh(5, 24, 3, 1, 9), 2)] {
        println!("{}", check_conv(&s, n, DType::BF16, &dev, &tiny, "im2col, one image per chunk")?);
    }
    Ok(())
}

/// The differentiable op: gradients of sum(conv(x, w)^2 / 2) through conv2d_nhwc vs the FP32 reference path.
#[test]
fn conv2d_nhwc_autograd_matches_reference() -> Result<()> {
    let dev = cuda()?;
    let s = ConvShape { c_in: 32, c_out: 48, k: 3, stride: 2, pad: 1, hw: 11 };
    let (x, w, _) = conv_inputs(&s, 3, DType::BF16, &dev)?;
    let (xv, wv) = (Var::from_tensor(&x)?, Var::from_tensor(&w)?);
    let y = kernels::conv2d_nhwc(xv.as_tensor(), wv.as_tensor(), s.stride, s.pad, &policy(None))?;
    let loss = (y.to_dtype(DType::F32)?.sqr()?.sum_all()? * 0.5)?;
    let g = loss.backward()?;
    let (x32, w32) = (Var::from_tensor(&x.to_dtype(DType::F32)?)?, Var::from_tensor(&w.to_dtype(DType::F32)?)?);
    let y32 = kernels::conv2d_nhwc_reference(x32.as_tensor(), w32.as_tensor(), s.stride, s.pad)?;
    // The reference backward sees the FP32 output; ours the bf16-rounded one: loosen by one rounding.
    let g32 = (y32.sqr()?.sum_all()? * 0.5)?.backward()?;
    check("autograd y", &y, &y32, 6e-3)?;
    check("autograd dx", g.get(xv.as_tensor()).context("no dx")?, g32.get(x32.as_tensor()).context("no dx")?, 1e-2)?;
    check("autograd dw", g.get(wv.as_tensor()).context("no dw")?, g32.get(w32.as_tensor()).context("no dw")?, 1e-2)?;
    Ok(())
}

fn matmul_reference(a: &Tensor, b: &Tensor, layout: GemmLayout) -> Result<Tensor> {
    let (a, b) = (a.to_dtype(DType::F32)?, b.to_dtype(DType::F32)?);
    Ok(match layout {
        GemmLayout::Nt => a.matmul(&b.t()?)?,
        GemmLayout::Nn => a.matmul(&b)?,
        GemmLayout::Tn => a.t()?.matmul(&b)?,
    })
}

/// Matmul in the three layouts on tile multiples, non-multiples, vectors and scalars-only shapes; with bias.
#[test]
fn matmul_matches_reference() -> Result<()> {
    let dev = cuda()?;
    let cases = [
        (1, 1, 1),
        (37, 53, 71),    // scalar loads
        (200, 136, 264), // vec, no tile multiple
        (128, 1000, 2048),
        (1000, 2048, 128),
        (256, 256, 4096), // long K: split-K
        (8, 8, 8),
        (1024, 1024, 1024),
        (2304, 2048, 520), // more tiles than SMs: x256's persistent blocks take several, K not a multiple of 64
    ];
    for (m, n, k) in cases {
        for dt in [DType::BF16, DType::F16] {
            for tile in tiles() {
                let p = policy(tile);
                let _poison = kernels::cuda::poison_outputs();
                for layout in [GemmLayout::Nt, GemmLayout::Nn, GemmLayout::Tn] {
                    let (ash, bsh) = match layout {
                        GemmLayout::Nt => ((m, k), (n, k)),
                        GemmLayout::Nn => ((m, k), (k, n)),
                        GemmLayout::Tn => ((k, m), (k, n)),
                    };
                    let a = Tensor::randn(0f32, 1.0, ash, &dev)?.to_dtype(dt)?;
                    let b = Tensor::randn(0f32, 1.0, bsh, &dev)?.to_dtype(dt)?;
                    let what = format!("{layout:?} {m}x{n}x{k} {dt:?} {}", tile.map_or("auto", |t| t.name));
                    let e = check(&what, &matmul(&a, &b, layout, &p)?, &matmul_reference(&a, &b, layout)?, tol(dt))?;
                    if layout == GemmLayout::Nt {
                        let bias = Tensor::randn(0f32, 1.0, n, &dev)?.to_dtype(dt)?;
                        let want = matmul_reference(&a, &b, layout)?.broadcast_add(&bias.to_dtype(DType::F32)?)?;
                        check(&format!("{what} +bias"), &matmul_bias(&a, &b, &bias, &p)?, &want, tol(dt))?;
                    }
                    println!("matmul {what}: rel err {e:.1e}");
                }
            }
        }
    }
    Ok(())
}

/// kernels::linear with the custom matmul: output and the three gradients vs candle in FP32.
#[test]
fn linear_custom_autograd_matches_reference() -> Result<()> {
    let dev = cuda()?;
    let (m, n, k) = (24, 1000, 2048);
    let x = Tensor::randn(0f32, 1.0, (m, k), &dev)?.to_dtype(DType::BF16)?;
    let w = (Tensor::randn(0f32, 1.0, (n, k), &dev)? * 0.02)?.to_dtype(DType::BF16)?;
    let b = Tensor::randn(0f32, 1.0, n, &dev)?.to_dtype(DType::BF16)?;
    let (xv, wv, bv) = (Var::from_tensor(&x)?, Var::from_tensor(&w)?, Var::from_tensor(&b)?);
    let y = kernels::linear(xv.as_tensor(), wv.as_tensor(), bv.as_tensor(), &KernelPolicy::custom())?;
    let g = (y.to_dtype(DType::F32)?.sqr()?.sum_all()? * 0.5)?.backward()?;
    let f = |t: &Tensor| -> Result<Var> { Ok(Var::from_tensor(&t.to_dtype(DType::F32)?)?) };
    let (x32, w32, b32) = (f(&x)?, f(&w)?, f(&b)?);
    let y32 = x32.as_tensor().matmul(&w32.as_tensor().t()?)?.broadcast_add(b32.as_tensor())?;
    let g32 = (y32.sqr()?.sum_all()? * 0.5)?.backward()?;
    check("linear y", &y, &y32, 6e-3)?;
    for (name, ours, want) in [("dx", &xv, &x32), ("dw", &wv, &w32), ("db", &bv, &b32)] {
        let a = g.get(ours.as_tensor()).with_context(|| format!("no {name}"))?;
        let r = g32.get(want.as_tensor()).with_context(|| format!("no {name}"))?;
        check(&format!("linear {name}"), a, r, 1e-2)?;
    }
    Ok(())
}
