//! GPU tests of the explicit training step (`resnet::step`, `kernels.step = "fused"`) against autograd on the same
//! batch, in bf16 and fp16 on our kernels: the loss and every parameter gradient (ResNet-18 with both stems,
//! ResNet-50, ResNet-152), then three optimizer steps through the trainer's StepRunner with the first fp16 step
//! skipped on overflow, comparing every parameter afterwards. Run by scripts/gpu-test.sh.
#![cfg(feature = "cuda")]

use anyhow::{ensure, Context, Result};
use candle_core::{DType, Device, Tensor};
use integration_tests::{bits_differ, host_f32, rel_err};
use kernels::KernelPolicy;
use resnet::{Arch, Precision, ResNet, ResNetConfig, Stem};

fn cuda() -> Result<Device> {
    Device::new_cuda(0).context("no CUDA device 0")
}

/// The gradients of an explicit step by parameter name, in the store's order of the trainable parameters.
fn named_grads(m: &ResNet, o: &resnet::step::StepOutput) -> Result<Vec<(String, Tensor)>> {
    m.store()
        .trainable()
        .into_iter()
        .map(|(n, v)| Ok((n.clone(), o.grads.get(&v.as_tensor().id()).with_context(|| n)?.clone())))
        .collect()
}

/// The step's parameter gradients (torchvision names) and the model's running statistics after it: what the
/// bit-for-bit step tests compare.
fn grads_and_running_stats(m: &ResNet, o: &resnet::step::StepOutput) -> Result<Vec<(String, Tensor)>> {
    let mut out = named_grads(m, o)?;
    out.extend(m.store().snapshot()?.into_iter().filter(|(k, _)| k.contains("running_")));
    Ok(out)
}

/// Two lists of named tensors, the same names in the same order, equal bit for bit; the first tensor that differs
/// is named with `what`.
fn ensure_same_bits(what: &str, got: &[(String, Tensor)], want: &[(String, Tensor)]) -> Result<()> {
    ensure!(want.len() == got.len(), "{what}: {} tensors against {}", got.len(), want.len());
    for ((name, e), (_, g)) in want.iter().zip(got) {
        let differ = bits_differ(g, e)?;
        ensure!(differ == 0, "{what}: {name} differs in {differ} of {} values", e.elem_count());
    }
    Ok(())
}

fn model(arch: Arch, stem: Stem, dev: &Device) -> Result<ResNet> {
    let c = ResNetConfig {
        arch,
        num_classes: 10,
        stem,
        zero_init_residual: false,
        seed: 23,
        kernels: KernelPolicy::custom(),
    };
    Ok(ResNet::new(c, dev)?)
}

/// Softmax cross-entropy with label smoothing as candle ops, so that autograd differentiates it (the fused loss
/// kernel of the explicit step, `resnet::step::softmax_cross_entropy`, computes its gradient itself and has no
/// backward: through it autograd made no gradient at all, and the comparisons failed with "no gradient for
/// bn1.bias" on the H200 on 2026-12-05).
fn xent(logits: &Tensor, labels: &Tensor, eps: f64) -> Result<Tensor> {
    let logits = logits.to_dtype(DType::F32)?;
    let (n, k) = logits.dims2()?;
    let m = logits.max_keepdim(1)?.detach();
    let s = logits.broadcast_sub(&m)?;
    let logp = s.broadcast_sub(&s.exp()?.sum_keepdim(1)?.log()?)?;
    let nll = logp.gather(&labels.unsqueeze(1)?, 1)?.sum_all()?;
    let uniform = logp.sum_all()?;
    Ok(((nll * (-(1.0 - eps) / n as f64))? + (uniform * (-eps / (n * k) as f64))?)?)
}

/// Autograd's loss and gradients (by parameter name) of `loss * scale`.
fn autograd(m: &ResNet, x: &Tensor, labels: &Tensor, p: Precision, scale: f64) -> Result<(f32, Vec<(String, Tensor)>)> {
    let logits = m.forward(x, true, p)?;
    let loss = xent(&logits, labels, 0.1)?;
    let grads = (&loss * scale)?.backward()?;
    let mut out = Vec::new();
    for (name, v) in m.store().trainable() {
        out.push((name.clone(), grads.get(v.as_tensor()).with_context(|| format!("no gradient for {name}"))?.clone()));
    }
    Ok((loss.to_scalar::<f32>()?, out))
}

/// The fused residual kernels (kernels/residual/01_fused.cu) against their CPU references, every output poisoned
/// first: bn_add_relu with a raw and a normalised residual, relu_grad and add_relu_grad, in f32/bf16/f16, with a
/// channel count that takes the 8-wide path (64) and one that does not (12), and an unaligned view.
#[test]
fn residual_kernels_match_cpu() -> Result<()> {
    let gpu = cuda()?;
    let _poison = kernels::cuda::poison_outputs();
    for c in [64usize, 12] {
        let shape = (3, 5, 7, c);
        let bn = |seed: f32, d: &Device| -> Result<kernels::BnParams> {
            let mean: Vec<f32> = (0..c).map(|i| 0.01 * i as f32 - seed).collect();
            let var: Vec<f32> = (0..c).map(|i| 0.5 + 0.02 * i as f32).collect();
            let inv: Vec<f32> = var.iter().map(|v| 1.0 / (v + 1e-5f32).sqrt()).collect();
            Ok(kernels::BnParams {
                stats: Tensor::from_vec([mean, var, inv].concat(), (3, c), d)?,
                weight: Tensor::from_vec((0..c).map(|i| 1.0 - 0.01 * i as f32).collect::<Vec<_>>(), c, d)?,
                bias: Tensor::from_vec((0..c).map(|i| seed + 0.003 * i as f32).collect::<Vec<_>>(), c, d)?,
            })
        };
        let (p_cpu, q_cpu, p_gpu, q_gpu) =
            (bn(0.2, &Device::Cpu)?, bn(-0.1, &Device::Cpu)?, bn(0.2, &gpu)?, bn(-0.1, &gpu)?);
        for dt in [DType::F32, DType::BF16, DType::F16] {
            let z = Tensor::randn(0f32, 1.5, shape, &Device::Cpu)?.to_dtype(dt)?;
            let r = Tensor::randn(0f32, 1.5, shape, &Device::Cpu)?.to_dtype(dt)?;
            let (zg, rg) = (z.to_device(&gpu)?, r.to_device(&gpu)?);
            for res in [false, true] {
                let want = kernels::bn_add_relu(&z, &r, &p_cpu, res.then_some(&q_cpu))?;
                let got = kernels::bn_add_relu(&zg, &rg, &p_gpu, res.then_some(&q_gpu))?;
                let e = integration_tests::max_err(&got, &want)?;
                // One rounding of the same FP32 expression: equal up to fma contraction (a unit in the last place).
                let tol = if dt == DType::F32 { 1e-5 } else { 1e-2 };
                ensure!(e <= tol, "bn_add_relu c={c} {dt:?} residual-bn={res}: max err {e:e}");
            }
            let y = kernels::bn_add_relu(&z, &r, &p_cpu, None)?;
            let yg = y.to_device(&gpu)?;
            let want = kernels::add_relu_grad(&z, &r, &y)?;
            let got = kernels::add_relu_grad(&zg, &rg, &yg)?;
            ensure!(integration_tests::max_err(&got, &want)? == 0.0, "add_relu_grad c={c} {dt:?} differs");
            let want = kernels::relu_grad(&z, &y)?;
            ensure!(
                integration_tests::max_err(&kernels::relu_grad(&zg, &yg)?, &want)? == 0.0,
                "relu_grad c={c} {dt:?}"
            );
            // A view starting off a 16-byte boundary takes the one-element path.
            let (zo, yo) = (zg.flatten_all()?.narrow(0, 1, 64)?, yg.flatten_all()?.narrow(0, 1, 64)?);
            let want = kernels::relu_grad(&z.flatten_all()?.narrow(0, 1, 64)?, &y.flatten_all()?.narrow(0, 1, 64)?)?;
            ensure!(
                integration_tests::max_err(&kernels::relu_grad(&zo, &yo)?, &want)? == 0.0,
                "relu_grad unaligned {dt:?}"
            );
        }
    }
    println!("residual kernels: bn_add_relu, relu_grad, add_relu_grad match the CPU (f32, bf16, f16; c = 64, 12)");
    Ok(())
}

/// The explicit step against autograd on the same batch, judged against an FP32 oracle.
///
/// In fp32 on the GPU (our BatchNorm, pooling and residual kernels; candle's convolutions) the two must agree
/// closely: loss to 1e-4, every gradient to 5e-3 relative L2 (a ReLU mask flipped by a last-bit difference moves a
/// few gradients by up to ~1e-3; the CPU test, tests/tests/step.rs, holds them to 1e-4). In bf16/fp16 the two paths round differently (the
/// fused kernels round once where autograd rounds each op), and gradients that are sums with heavy cancellation
/// (bn1.bias: rel err ~0.3 between two equally valid bf16 runs, 2026-12-03) move far relative to themselves, so the
/// bound is relative to the oracle: the fused gradient's error against the FP32 autograd gradient must stay
/// within 2.5 x autograd's own error at that precision (or 2e-2 bf16, 5e-3 fp16, whichever is larger). A wrong
/// kernel or schedule gives O(1) errors in fp32 and far above autograd's in low precision.
/// The per-step weight conversion (one multi-tensor launch: FP32 (k, c, r, s) -> bf16/f16 (k, r, s, c) views of one
/// flat buffer) against candle's cast + permute of each weight, bit for bit, with the stem's 3-channel 7x7, 1x1,
/// 3x3 and odd shapes; every view starts on a 128-byte boundary. Then the grad-weights' way back (one launch).
#[test]
fn conv_weights_krsc_matches_cast_and_permute() -> Result<()> {
    let gpu = cuda()?;
    let _poison = kernels::cuda::poison_outputs();
    let shapes = [(64, 3, 7, 7), (256, 64, 1, 1), (64, 64, 3, 3), (5, 7, 3, 3), (3, 1, 1, 1), (512, 256, 3, 3)];
    let masters: Vec<Tensor> = shapes
        .iter()
        .map(|&s| Tensor::randn(0f32, 1.0, s, &Device::Cpu)?.to_device(&gpu))
        .collect::<candle_core::Result<_>>()?;
    let refs: Vec<&Tensor> = masters.iter().collect();
    for dt in [DType::BF16, DType::F16] {
        let got = kernels::ops::weights::conv_weights_krsc(&refs, dt)?;
        ensure!(got.len() == masters.len(), "{dt:?}: {} outputs for {} weights", got.len(), masters.len());
        for (w, g) in masters.iter().zip(&got) {
            let want = w.to_dtype(dt)?.permute((0, 2, 3, 1))?.contiguous()?;
            ensure!(
                g.dims() == want.dims() && g.dtype() == dt,
                "{dt:?} {:?}: got {:?} {:?}",
                w.dims(),
                g.dims(),
                g.dtype()
            );
            ensure!(
                g.layout().start_offset() % 64 == 0,
                "{dt:?} {:?}: view at {}",
                w.dims(),
                g.layout().start_offset()
            );
            ensure!(integration_tests::max_err(g, &want)? == 0.0, "{dt:?} {:?}: differs from cast + permute", w.dims());
        }
        // And back (the grad-weights' conversion): FP32 (k, c, r, s) equal to the rounded masters.
        let back = kernels::ops::weights::conv_grads_kcrs(&got)?;
        for (w, b) in masters.iter().zip(&back) {
            let want = w.to_dtype(dt)?.to_dtype(DType::F32)?;
            ensure!(
                b.dims() == w.dims() && b.dtype() == DType::F32,
                "{dt:?} {:?}: back {:?} {:?}",
                w.dims(),
                b.dims(),
                b.dtype()
            );
            ensure!(integration_tests::max_err(b, &want)? == 0.0, "{dt:?} {:?}: the way back differs", w.dims());
        }
    }
    Ok(())
}

#[test]
fn fused_step_matches_autograd_on_cuda() -> Result<()> {
    let gpu = cuda()?;
    // (arch, stem, image size, batch). ResNet-152 at 96 px and batch 16: its layer4 BatchNorms then see 144 values
    // per channel; at 64 px and batch 8 (32 values) the low-precision losses of both paths landed 0.3-6% off FP32,
    // from run to run, which no loss bound separates from a bug.
    let cases = [
        (Arch::ResNet18, Stem::Cifar, 32, 8),
        (Arch::ResNet18, Stem::ImageNet, 64, 8),
        (Arch::ResNet50, Stem::ImageNet, 64, 8),
        (Arch::ResNet152, Stem::ImageNet, 96, 16),
    ];
    let grad = |out: &resnet::step::StepOutput, m: &ResNet, name: &str| -> Result<Tensor> {
        let v = m.store().get(name).context("parameter")?.param.var().clone();
        out.grads.get(&v.as_tensor().id()).cloned().with_context(|| format!("no gradient for {name}"))
    };
    for (arch, stem, size, n) in cases {
        // A fixed batch (seeded_randn) per case: drawn anew each run, about one run in fifteen put a gradient
        // past its ratio bound, on main's kernels and on bn-strided's alike (H100, 2026-12-06: autograd's own error
        // landed unusually close to FP32 in that draw), and the loss bound failed once too.
        let x = integration_tests::seeded_randn(&[n, 3, size, size], 1206 + size as u64).to_device(&gpu)?;
        let labels = Tensor::new((0..n as u32).map(|i| (i * 7 + 3) % 10).collect::<Vec<_>>().as_slice(), &gpu)?;
        let (loss32, g32) = autograd(&model(arch, stem, &gpu)?, &x, &labels, Precision::F32, 1.0)?;
        let m = model(arch, stem, &gpu)?;
        let out = m.train_step_explicit(&x, &labels, 0.1, 1.0, Precision::F32)?;
        let what = format!("{arch} {stem} {size}px");
        let lf = out.loss.to_scalar::<f32>()?;
        ensure!((lf - loss32).abs() <= 1e-4 * loss32.abs(), "{what} f32: loss {lf} vs autograd {loss32}");
        ensure!(out.grads.len() == g32.len(), "{what}: {} gradients for {} parameters", out.grads.len(), g32.len());
        let mut worst32 = (0.0, String::new());
        for (name, g_ref) in &g32 {
            let e = rel_err(&grad(&out, &m, name)?, g_ref)?;
            ensure!(e <= 5e-3, "{what} f32: grad {name} rel err {e:.2e} over 5e-3");
            if e > worst32.0 {
                worst32 = (e, name.clone());
            }
        }
        println!(
            "{what} f32: loss {lf:.6} vs autograd {loss32:.6}; worst gradient rel err {:.2e} ({})",
            worst32.0, worst32.1
        );
        // fp16 at a loss scale of 128: at 1024 ResNet-152's stem grad-weight (96 px, batch 16: 36,864 pixels per
        // sum) overflowed fp16 on the fused path, as it would in PyTorch's AMP (an fp16 dW, then the skipped step).
        for (p, base, scale) in [(Precision::Bf16, 2e-2, 1.0), (Precision::F16, 5e-3, 128.0)] {
            let what = format!("{what} {}", p.as_str());
            let (loss_a, ga) = autograd(&model(arch, stem, &gpu)?, &x, &labels, p, scale)?;
            let m = model(arch, stem, &gpu)?;
            let out = m.train_step_explicit(&x, &labels, 0.1, scale, p)?;
            let loss_f = out.loss.to_scalar::<f32>()?;
            let (ef, ea) = ((loss_f - loss32).abs(), (loss_a - loss32).abs());
            // Within 2.5 x autograd's distance from the FP32 loss, or within 4% of it. The loss of a freshly
            // initialised ResNet-152 hardly depends on its inner values, and bf16/fp16 move it by percents by
            // either path: on 2026-12-05 (H100/H200, one random batch each run) the fused bf16 loss landed 0.9%,
            // 1.5%, 2.4% and 2.9% off FP32 and autograd's 0.2%, 0.7%, 1.0% and 3.2%, so a bound of 2% (or 2.5 x
            // autograd's distance in a draw where autograd landed close) failed on noise. The gradients below carry
            // the comparison.
            ensure!(
                ef <= f32::max(2.5 * ea, 4e-2 * loss32.abs()),
                "{what}: loss {loss_f}, autograd {loss_a}, f32 {loss32}"
            );
            let mut worst = (0.0, 0.0, 0.0, String::new());
            for ((name, g_ref), (_, g_a)) in g32.iter().zip(&ga) {
                let g = (grad(&out, &m, name)? / scale)?;
                ensure!(host_f32(&g)?.iter().all(|v| v.is_finite()), "{what}: {name} gradient is not finite");
                let (ef, ea) = (rel_err(&g, g_ref)?, rel_err(&(g_a / scale)?, g_ref)?);
                let bound = f64::max(2.5 * ea, base);
                ensure!(
                    ef <= bound,
                    "{what}: grad {name} rel err {ef:.2e} vs f32 (autograd's {ea:.2e}, bound {bound:.1e})"
                );
                if ef / bound > worst.0 {
                    worst = (ef / bound, ef, ea, name.clone());
                }
            }
            println!(
                "{what}: loss {loss_f:.5} (autograd {loss_a:.5}, f32 {loss32:.5}); gradient closest to its bound: {} rel err {:.2e} vs f32 (autograd's {:.2e})",
                worst.3, worst.1, worst.2
            );
        }
    }
    Ok(())
}

/// `finetune.bn_frozen` on the fused step: every BatchNorm normalises with its running statistics (set away from
/// their initial values first) and leaves them unchanged; the loss and every gradient match autograd's in f32, and
/// the bf16 step stays within 2.5x autograd's error against f32 (ResNet-18, ImageNet stem, 64 px, batch 8).
#[test]
fn fused_step_with_frozen_batchnorm_matches_autograd_on_cuda() -> Result<()> {
    let gpu = cuda()?;
    let frozen = integration_tests::freeze_bn_at_test_stats;
    let x = integration_tests::seeded_randn(&[8, 3, 64, 64], 1207).to_device(&gpu)?;
    let labels = Tensor::new(&[3u32, 0, 9, 4, 1, 1, 7, 2], &gpu)?;
    let a = model(Arch::ResNet18, Stem::ImageNet, &gpu)?;
    frozen(&a)?;
    let (loss32, g32) = autograd(&a, &x, &labels, Precision::F32, 1.0)?;
    for p in [Precision::F32, Precision::Bf16] {
        let m = model(Arch::ResNet18, Stem::ImageNet, &gpu)?;
        frozen(&m)?;
        let before =
            host_f32(&m.store().get("layer2.0.bn1.running_mean").context("buffer")?.param.var().as_tensor().clone())?;
        let out = m.train_step_explicit(&x, &labels, 0.1, 1.0, p)?;
        let after =
            host_f32(&m.store().get("layer2.0.bn1.running_mean").context("buffer")?.param.var().as_tensor().clone())?;
        ensure!(before == after, "{}: frozen running statistics changed", p.as_str());
        let lf = out.loss.to_scalar::<f32>()?;
        let (ga_p, la_p) = if p == Precision::F32 {
            (g32.clone(), loss32)
        } else {
            let b = model(Arch::ResNet18, Stem::ImageNet, &gpu)?;
            frozen(&b)?;
            let (l, g) = autograd(&b, &x, &labels, p, 1.0)?;
            (g, l)
        };
        let tol_loss = if p == Precision::F32 {
            1e-4 * loss32.abs()
        } else {
            f32::max(2.5 * (la_p - loss32).abs(), 2e-2 * loss32.abs())
        };
        ensure!((lf - loss32).abs() <= tol_loss, "{}: loss {lf}, autograd {la_p}, f32 {loss32}", p.as_str());
        for ((name, g_ref), (_, g_a)) in g32.iter().zip(&ga_p) {
            let v = m.store().get(name).context("parameter")?.param.var().clone();
            let g = out.grads.get(&v.as_tensor().id()).with_context(|| format!("no gradient for {name}"))?;
            let (ef, ea) = (rel_err(g, g_ref)?, rel_err(g_a, g_ref)?);
            let bound = if p == Precision::F32 { 5e-3 } else { f64::max(2.5 * ea, 2e-2) };
            ensure!(
                ef <= bound,
                "{} bn_frozen: grad {name} rel err {ef:.2e} (autograd's {ea:.2e}, bound {bound:.1e})",
                p.as_str()
            );
        }
        println!("bn_frozen {}: loss {lf:.5} (autograd {la_p:.5}, f32 {loss32:.5})", p.as_str());
    }
    Ok(())
}

const RUNNER_TOML: &str = r#"
seed = 1
device = "cuda"
[model]
arch = "resnet18"
num_classes = 10
stem = "cifar"
[data]
kind = "synthetic"
image_size = 32
[train]
batch_size = 16
label_smoothing = 0.1
[optim]
name = "sgd"
lr = 0.1
momentum = 0.9
nesterov = true
weight_decay = 5e-4
no_decay_bn_bias = true
[amp]
dtype = "fp16"
init_scale = 1e9
backoff_factor = 1e-6
[kernels]
conv = "custom"
matmul = "custom"
autotune = false
"#;

/// Three optimizer steps (SGD, Nesterov, weight decay without BN/bias decay, label smoothing, fp16 with dynamic
/// loss scaling) through the trainer's StepRunner, fused and autograd from the same start: the first step
/// overflows at a 1e9 scale and is skipped by both, the scale drops to 1e3, the next two update. The parameters
/// afterwards are judged against an FP32 autograd runner that took the two updating batches: the fused run's
/// error may be at most 2.5 x the fp16 autograd run's (or 1e-2).
#[test]
fn fused_runner_matches_autograd_over_three_fp16_steps() -> Result<()> {
    let gpu = cuda()?;
    // The same three batches for every run.
    let mut batches = Vec::new();
    for i in 0..3u32 {
        let x = integration_tests::seeded_randn(&[16, 3, 32, 32], 1208 + i as u64).to_device(&gpu)?;
        let labels = Tensor::new((0..16u32).map(|j| (j * 7 + i) % 10).collect::<Vec<_>>().as_slice(), &gpu)?;
        batches.push((x, labels));
    }
    type Run = (Vec<bool>, Vec<(String, Tensor)>);
    let run = |step: &str, dtype: &str, from: usize| -> Result<Run> {
        let sets = [format!("kernels.step=\"{step}\""), format!("amp.dtype=\"{dtype}\"")];
        let cfg = trainer::config::Config::from_str_with(RUNNER_TOML, "gpu.toml", &sets)?;
        let model = trainer::train::build_model(&cfg, &gpu)?;
        let mut runner = trainer::train::StepRunner::new(&cfg, model)?;
        ensure!(runner.engine.to_string() == step, "kernels.step = {step} resolved to {}", runner.engine);
        let act = runner.precision.act_dtype();
        let mut skipped = Vec::new();
        for (x, labels) in &batches[from..] {
            let b = trainer::train::Batch { images: x.to_dtype(act)?, labels: labels.clone(), n: 16 };
            skipped.push(runner.step(&[b], 0.1)?.skipped);
        }
        let params = runner.model.store().trainable().into_iter().map(|(n, v)| (n, v.as_tensor().clone())).collect();
        Ok((skipped, params))
    };
    let (skip_f, params_f) = run("fused", "fp16", 0)?;
    let (skip_a, params_a) = run("autograd", "fp16", 0)?;
    let (_, params_32) = run("autograd", "fp32", 1)?;
    ensure!(skip_f == vec![true, false, false], "fused skipped {skip_f:?}");
    ensure!(skip_a == skip_f, "autograd skipped {skip_a:?}, fused {skip_f:?}");
    let mut worst = (0.0, 0.0, 0.0, String::new());
    for (((name, f), (_, a)), (_, r)) in params_f.iter().zip(&params_a).zip(&params_32) {
        // Errors of the update (parameter minus its start would be the same difference): against the fp32 run.
        let (ef, ea) = (rel_err(f, r)?, rel_err(a, r)?);
        let bound = f64::max(2.5 * ea, 1e-2);
        ensure!(ef <= bound, "{name}: fused rel err {ef:.2e} vs fp32 after 3 steps (autograd's {ea:.2e})");
        if ef / bound > worst.0 {
            worst = (ef / bound, ef, ea, name.clone());
        }
    }
    println!(
        "3 fp16 steps (first skipped) vs 2 fp32 steps: closest to its bound {} rel err {:.2e} (autograd's {:.2e})",
        worst.3, worst.1, worst.2
    );
    Ok(())
}

/// Four batches of 16 CIFAR-sized images and [`graph_replay_matches_eager_steps`]'s ten-step script: the
/// learning rate moving every step, the loss scale set to 1e9 from the host before step 4, step 7 a partial
/// batch.
#[allow(clippy::type_complexity)]
fn graph_script(gpu: &Device) -> Result<(Vec<(Tensor, Tensor)>, Vec<ScriptStep>)> {
    let mut batches = Vec::new();
    for i in 0..4u32 {
        let x = Tensor::randn(0f32, 1.0, (16, 3, 32, 32), &Device::Cpu)?.to_device(gpu)?;
        let labels = Tensor::new((0..16u32).map(|j| (j * 3 + i) % 10).collect::<Vec<_>>().as_slice(), gpu)?;
        batches.push((x, labels));
    }
    let script: Vec<ScriptStep> = (0..10)
        .map(|i| ScriptStep { full: i != 7, lr: 0.02 + 0.01 * i as f64, set_scale: (i == 4).then_some(1e9) })
        .collect();
    Ok((batches, script))
}

/// One step of [`graph_replay_matches_eager_steps`]'s script: a full (16) or partial (10) batch, the learning
/// rate, and a loss scale the host sets before it (with nothing in flight).
struct ScriptStep {
    full: bool,
    lr: f64,
    set_scale: Option<f64>,
}

/// Runs `script` through a StepRunner the way the trainer does (step k + 1 queued before step k's report is
/// read); returns every step's (loss, gradient norm, skipped, loss scale) and every model tensor afterwards.
#[allow(clippy::type_complexity)]
fn drive(
    runner: &mut trainer::train::StepRunner,
    batches: &[(Tensor, Tensor)],
    script: &[ScriptStep],
) -> Result<(Vec<(f64, f64, bool, f64)>, Vec<(String, Tensor)>)> {
    let act = runner.precision.act_dtype();
    let mut outs = Vec::new();
    let mut pending = None;
    for (i, s) in script.iter().enumerate() {
        if let Some(scale) = s.set_scale {
            if let Some(p) = pending.take() {
                outs.push(runner.resolve(p)?);
            }
            runner.scaler.scale = scale;
        }
        let (x, labels) = &batches[i % batches.len()];
        let n = if s.full { 16 } else { 10 };
        let b = trainer::train::Batch { images: x.narrow(0, 0, n)?.to_dtype(act)?, labels: labels.narrow(0, 0, n)?, n };
        let p = runner.step_async(&[b], s.lr)?;
        if let Some(prev) = pending.replace(p) {
            outs.push(runner.resolve(prev)?);
        }
    }
    if let Some(p) = pending {
        outs.push(runner.resolve(p)?);
    }
    let outs = outs.iter().map(|o| (o.loss, o.grad_norm, o.skipped, o.loss_scale)).collect();
    let tensors = runner
        .model
        .store()
        .entries()
        .into_iter()
        .map(|(n, e)| (n, e.param.var().as_tensor().copy()))
        .collect::<Vec<_>>();
    let tensors = tensors.into_iter().map(|(n, t)| Ok((n, t?))).collect::<Result<_>>()?;
    Ok((outs, tensors))
}

/// [`drive`] over a fresh fp16 StepRunner of [`RUNNER_TOML`] with the fused step, `kernels.graph = graph`, the loss
/// scale growing every step (x1000) and one more `--set` (`extra`): the reports, the model tensors afterwards, and
/// the runner's graph captures, replays and node counts (by kind).
#[allow(clippy::type_complexity)]
fn run_script(
    gpu: &Device,
    batches: &[(Tensor, Tensor)],
    script: &[ScriptStep],
    graph: &str,
    extra: &str,
) -> Result<(Vec<(f64, f64, bool, f64)>, Vec<(String, Tensor)>, u64, u64, String)> {
    // `extra`: one or more settings, separated by ';'.
    let mut sets = vec!["kernels.step=\"fused\"".to_string(), format!("kernels.graph=\"{graph}\"")];
    sets.extend(extra.split(';').map(str::to_string));
    sets.extend(["amp.growth_interval=1".to_string(), "amp.growth_factor=1000.0".into()]);
    let cfg = trainer::config::Config::from_str_with(RUNNER_TOML, "gpu.toml", &sets)?;
    let model = trainer::train::build_model(&cfg, gpu)?;
    let mut runner = trainer::train::StepRunner::new(&cfg, model)?;
    let (outs, tensors) = drive(&mut runner, batches, script)?;
    Ok((outs, tensors, runner.graphs.captures, runner.graphs.replayed, runner.graphs.nodes()))
}

/// `kernels.graph`: the fused step captured as a CUDA graph and replayed against the same steps run eagerly, for
/// SGD and AdamW in fp16 with dynamic loss scaling, over a script that changes the learning rate every step,
/// grows the loss scale every step until fp16 overflows (skips decided on the device inside replays), resets the
/// scale from the host (the graph's loss-scale buffer moves: the plan is dropped and captured again) and runs an
/// epoch's last, smaller batch eagerly between replays. Every step's report and every model tensor afterwards
/// (parameters and running statistics) must match; the graph runner must have captured twice and replayed
/// the other full steps.
#[test]
fn graph_replay_matches_eager_steps() -> Result<()> {
    let gpu = cuda()?;
    let (batches, script) = graph_script(&gpu)?;
    for optim in ["sgd", "adamw"] {
        let run = |graph: &str| run_script(&gpu, &batches, &script, graph, &format!("optim.name=\"{optim}\""));
        let (eager, eager_t, c0, r0, _) = run("off")?;
        let (graphed, graphed_t, captures, replayed, nodes) = run("on")?;
        ensure!(c0 == 0 && r0 == 0, "kernels.graph = off captured {c0} and replayed {r0}");
        // Steps 0 (warm-up), 1 (capture), 2-3 replayed; 4 (the scale moved: warm-up again), 5 (capture),
        // 6 replayed, 7 (the smaller batch: eager), 8-9 replayed.
        ensure!(captures == 2 && replayed == 5, "{optim}: {captures} captures, {replayed} replays (want 2 and 5)");
        for (i, (e, g)) in eager.iter().zip(&graphed).enumerate() {
            // Equal infinities (the norm of a skipped step) and NaNs count as the same.
            let same = |a: f64, b: f64| a == b || (a.is_nan() && b.is_nan()) || (a - b).abs() <= 1e-6 * a.abs();
            ensure!(
                same(e.0, g.0) && same(e.1, g.1) && e.2 == g.2 && same(e.3, g.3),
                "{optim} step {i}: eager (loss, norm, skipped, scale) {e:?}, graph {g:?}"
            );
        }
        ensure!(eager.len() == script.len(), "{} reports for {} steps", eager.len(), script.len());
        let skipped: Vec<usize> = eager.iter().enumerate().filter(|(_, o)| o.2).map(|(i, _)| i).collect();
        ensure!(
            skipped.iter().any(|&i| i == 2 || i == 3 || i == 6 || i >= 8),
            "{optim}: no replayed step skipped: {skipped:?}"
        );
        let mut worst = 0f64;
        for ((name, e), (_, g)) in eager_t.iter().zip(&graphed_t) {
            let d = if e.dtype() == DType::I64 {
                (e.to_dtype(DType::F64)? - g.to_dtype(DType::F64)?)?.abs()?.flatten_all()?.max(0)?.to_scalar::<f64>()?
            } else {
                rel_err(g, e)?
            };
            ensure!(d <= 1e-6, "{optim} {name}: graph vs eager rel err {d:.2e}");
            worst = worst.max(d);
        }
        println!(
            "graph vs eager, {optim}: {} steps, skipped {skipped:?}, {captures} captures ({nodes} nodes), {replayed} \
             replays, every tensor within rel err {worst:.1e}",
            script.len()
        );
    }
    Ok(())
}

/// `kernels.weights_in_optimizer`: the fused fp16 runner with the conv weights kept and written by the optimizer
/// against the same runner converting them every step, over [`graph_replay_matches_eager_steps`]' script (graph
/// captures and replays, skipped steps, a scale reset from the host, a partial batch run eagerly), for SGD and
/// AdamW: every step's report and every model tensor afterwards bit for bit, and the kept weights made only where
/// asked for.
#[test]
fn kept_conv_weights_give_the_same_run() -> Result<()> {
    let gpu = cuda()?;
    if let Some(v) = trainer::config::weights_in_optimizer_env() {
        println!("KERNELS_WEIGHTS_IN_OPTIMIZER={} in the environment decides over the config: skipped", u8::from(v));
        return Ok(());
    }
    let (batches, script) = graph_script(&gpu)?;
    for optim in ["sgd", "adamw"] {
        let run = |keep: bool| -> Result<_> {
            let sets: Vec<String> = vec![
                "kernels.step=\"fused\"".into(),
                "kernels.graph=\"on\"".into(),
                format!("optim.name=\"{optim}\""),
                format!("kernels.weights_in_optimizer={keep}"),
                "amp.growth_interval=1".into(),
                "amp.growth_factor=1000.0".into(),
            ];
            let cfg = trainer::config::Config::from_str_with(RUNNER_TOML, "gpu.toml", &sets)?;
            let model = trainer::train::build_model(&cfg, &gpu)?;
            let mut runner = trainer::train::StepRunner::new(&cfg, model)?;
            let (outs, tensors) = drive(&mut runner, &batches, &script)?;
            Ok((outs, tensors, runner.opt.conv_weights().is_some(), runner.graphs.replayed))
        };
        let (outs0, t0, kept0, rep0) = run(false)?;
        let (outs1, t1, kept1, rep1) = run(true)?;
        ensure!(!kept0 && kept1, "{optim}: conv weights kept: off {kept0}, on {kept1}");
        ensure!(rep0 == rep1 && rep1 > 0, "{optim}: replays off {rep0}, on {rep1}");
        for (i, (a, b)) in outs0.iter().zip(&outs1).enumerate() {
            let same = |x: f64, y: f64| x == y || (x.is_nan() && y.is_nan());
            ensure!(
                same(a.0, b.0) && same(a.1, b.1) && a.2 == b.2 && same(a.3, b.3),
                "{optim} step {i}: converted (loss, norm, skipped, scale) {a:?}, kept {b:?}"
            );
        }
        ensure_same_bits(&format!("{optim}: kept against converted"), &t1, &t0)?;
        println!(
            "kept conv weights, {optim}: {} steps ({rep1} replayed), reports and {} tensors bit for bit",
            outs1.len(),
            t1.len()
        );
    }
    Ok(())
}

/// `kernels.bn_stats = "fused"`: the BatchNorm moments computed in the epilogue of the TMA convolutions and 1x1
/// GEMMs (`conv_fwd_stats_*`, `gemm_nt_stats_*`) and combined by `batch_stats_from_partials`, against the
/// separate pass (`batch_stats`) over the same output, on every TMA tile, in bf16 and fp16, outputs and partials
/// poisoned with NaN first: the statistics and the running statistics within FP32 summation-order error (the
/// convolution's output within rounding of the plain kernel's, which may split K). Shapes: a 1x1 (GEMM), a 3x3, a strided 3x3, a
/// strided 1x1 downsample, channel counts of 64 / 256 / 1024 (below, at and above a tile's width) and row counts
/// that do not fill the last 128-row tile. Then the explicit step of ResNet-50 with the epilogue statistics
/// against the pass: loss and every gradient.
#[test]
fn epilogue_stats_match_the_pass() -> Result<()> {
    use kernels::ops::batchnorm::{batch_stats, batch_stats_from_partials, Running};
    use kernels::variants::{X128, X256, X64};
    use kernels::Tuning;
    let gpu = cuda()?;
    let _poison = kernels::cuda::poison_outputs();
    // (n, hw, c, ko, k, stride, pad)
    let shapes = [
        (3, 14, 256, 1024, 1, 1, 0),
        (2, 28, 64, 64, 3, 1, 1),
        (3, 15, 128, 128, 3, 2, 1),
        (2, 14, 256, 512, 1, 2, 0),
        (5, 7, 512, 2048, 1, 1, 0),
    ];
    let mut worst = 0f64;
    for dt in [DType::BF16, DType::F16] {
        for tile in [X256, X128, X64] {
            let policy = KernelPolicy::custom().with_tuning(Tuning::Forced(tile)).with_fused_bn_reductions(true);
            for &(n, hw, c, ko, k, stride, pad) in &shapes {
                let tag = format!("{dt:?} {} n{n} {hw}x{hw}x{c} -> {ko} k{k} s{stride}", tile.name);
                // Inputs of mean 1: each output channel has a mean of its own, away from zero.
                let x = (Tensor::randn(0f32, 1.0, (n, hw, hw, c), &gpu)? + 1.0)?.to_dtype(dt)?;
                let w = (Tensor::randn(0f32, 1.0, (ko, k, k, c), &gpu)? * (1.0 / ((c * k * k) as f64).sqrt()))?;
                let w = w.to_dtype(dt)?;
                let (y, part) = kernels::conv2d_nhwc_forward_stats(&x, &w, stride, pad, &policy)?;
                let part = part.with_context(|| format!("{tag}: no epilogue statistics"))?;
                // The plain kernel may split K where the stats kernel does not: the outputs agree to the rounding.
                let plain = kernels::conv2d_nhwc_forward(&x, &w, stride, pad, &policy)?;
                let e = integration_tests::max_err(&y, &plain)?;
                ensure!(e <= 1e-2, "{tag}: the stats kernel's output is {e:.2e} off the plain kernel's");
                let rows = y.elem_count() / ko;
                let running = |d: &Device| -> Result<(candle_core::Var, candle_core::Var, candle_core::Var)> {
                    Ok((
                        candle_core::Var::from_tensor(&Tensor::zeros(ko, DType::F32, d)?)?,
                        candle_core::Var::from_tensor(&Tensor::ones(ko, DType::F32, d)?)?,
                        candle_core::Var::from_tensor(&Tensor::new(0i64, d)?)?,
                    ))
                };
                let (m1, v1, t1) = running(&gpu)?;
                let (m2, v2, t2) = running(&gpu)?;
                let r1 = Running { mean: &m1, var: &v1, num_batches_tracked: &t1, momentum: 0.1 };
                let r2 = Running { mean: &m2, var: &v2, num_batches_tracked: &t2, momentum: 0.1 };
                let got = batch_stats_from_partials(&part, rows, ko, 1e-5, &r1)?;
                // The pass over this kernel's own output: only the FP32 summation order differs.
                let want = batch_stats(&y, 1e-5, &r2)?;
                let e = rel_err(&got, &want)?;
                ensure!(e <= 1e-5, "{tag}: statistics rel err {e:.2e}");
                for (name, a, b) in [("running_mean", &m1, &m2), ("running_var", &v1, &v2)] {
                    let e = rel_err(a.as_tensor(), b.as_tensor())?;
                    ensure!(e <= 1e-5, "{tag}: {name} rel err {e:.2e}");
                }
                ensure!(t1.as_tensor().to_scalar::<i64>()? == 1, "{tag}: num_batches_tracked not counted");
                worst = worst.max(e);
            }
        }
    }
    println!("epilogue statistics vs the pass: worst rel err {worst:.1e} (statistics and running statistics)");

    // The whole explicit step, ResNet-50 at 64 px, bf16: the epilogue statistics against the pass, on one batch,
    // each against the FP32 step. Statistics that differ by ~1e-7 flip bf16 roundings, and a bf16 ResNet-50 step
    // at this size amplifies those: the H200 run of 2026-12-05 measured losses 2.7066 (epilogue) and 2.7447
    // (pass), and the fused and autograd bf16 steps of fused_step_matches_autograd_on_cuda differ by as much. So
    // the epilogue's distance to FP32 must be of the size of the pass's own.
    let x = integration_tests::seeded_randn(&[8, 3, 64, 64], 1211).to_device(&gpu)?;
    let labels = Tensor::new((0..8u32).collect::<Vec<_>>().as_slice(), &gpu)?;
    let step = |conv: bool, prec: Precision| -> Result<(f32, Vec<(String, Tensor)>)> {
        let mut m = model(Arch::ResNet50, Stem::ImageNet, &gpu)?;
        // TMA tiles forced: on the tuner's tiles these small shapes make no epilogue moments (the two runs were
        // then the same computation).
        let tiles = m.config.kernels.clone().with_tuning(Tuning::Forced(X256));
        m.config.kernels = tiles.with_fused_bn_reductions(conv);
        let o = m.train_step_explicit_with(&x, &labels, resnet::step::StepArgs::new(0.1, 1.0, prec))?;
        Ok((o.loss.to_scalar::<f32>()?, named_grads(&m, &o)?))
    };
    let (la, ga) = step(true, Precision::Bf16)?;
    let (lb, gb) = step(false, Precision::Bf16)?;
    let (l32, g32) = step(false, Precision::F32)?;
    let median = |of: &[(String, Tensor)]| -> Result<f64> {
        let mut e = of.iter().zip(&g32).map(|((_, a), (_, r))| rel_err(a, r)).collect::<Result<Vec<f64>>>()?;
        e.sort_by(f64::total_cmp);
        Ok(e[e.len() / 2])
    };
    let (ea, eb) = (median(&ga)?, median(&gb)?);
    println!(
        "ResNet-50 step, epilogue statistics vs the pass (bf16, TMA tiles): loss {la} vs {lb} (FP32 {l32}); median \
         gradient rel err against FP32 {ea:.2e} vs {eb:.2e}"
    );
    // The loss of a freshly initialised net hardly depends on its inner values; bf16 moves it by up to ~1% here
    // (the H100 run of 2026-12-05: 2.6984 epilogue, 2.6874 pass, 2.6869 FP32; the fused and autograd bf16 steps
    // differ by 0.6%), so its bound is loose, and the median gradient error carries the comparison.
    ensure!(
        (la - l32).abs() <= (2.0 * (lb - l32).abs()).max(1e-2 * l32.abs()),
        "loss {la} with epilogue statistics, {lb} with the pass, {l32} in FP32"
    );
    ensure!(
        ea <= 2.0 * eb,
        "median gradient rel err against FP32: {ea:.2e} with epilogue statistics, {eb:.2e} with the pass"
    );
    Ok(())
}

/// `kernels.bn_stats = "fused"`, backward: the block output's ReLU gradient joined with the residual gradient and
/// its last BatchNorm's backward sums in one pass (`join_grad_sums`, `bn_nhwc_join_sum_{1,2}_v8_*`) against the
/// two kernels it replaces (`add_relu_grad` / `relu_grad`, then the sums pass of `BnGrad`): the gradient and the
/// sums must be equal bit for bit (the same rounding, chunks and summation order), with and without the shortcut
/// operand, in f32, bf16 and fp16, for 64, 256 and 2048 channels and a row count that leaves a ragged last chunk;
/// outputs poisoned first.
#[test]
fn joined_relu_grad_sums_match_the_two_passes() -> Result<()> {
    use kernels::ops::batchnorm::{join_grad_sums, BnGrad};
    let gpu = cuda()?;
    let _poison = kernels::cuda::poison_outputs();
    for dt in [DType::F32, DType::BF16, DType::F16] {
        for (rows, c) in [(3 * 28 * 28 + 5, 64usize), (2 * 14 * 14, 256), (7 * 7 * 3, 2048)] {
            let r = |seed: f32| -> Result<Tensor> {
                Ok((Tensor::randn(0f32, 1.0, (rows, c), &gpu)? + seed as f64)?.to_dtype(dt)?)
            };
            let (a, b, z) = (r(0.0)?, r(0.0)?, r(0.5)?);
            // A ReLU output: about half of it zero.
            let y = r(0.0)?.relu()?;
            let mean: Vec<f32> = (0..c).map(|i| 0.5 + 0.001 * i as f32).collect();
            let var: Vec<f32> = (0..c).map(|i| 1.0 + 0.01 * (i % 7) as f32).collect();
            let inv: Vec<f32> = var.iter().map(|v| 1.0 / (v + 1e-5f32).sqrt()).collect();
            let p = kernels::BnParams {
                stats: Tensor::from_vec([mean, var, inv].concat(), (3, c), &gpu)?,
                weight: Tensor::from_vec((0..c).map(|i| 1.0 - 0.001 * i as f32).collect::<Vec<_>>(), c, &gpu)?,
                bias: Tensor::from_vec((0..c).map(|i| 0.01 * i as f32).collect::<Vec<_>>(), c, &gpu)?,
            };
            for two in [true, false] {
                let tag = format!("{dt:?} {rows}x{c} two={two}");
                let (g, sums) = join_grad_sums(&a, two.then_some(&b), &y, &z, &p)?;
                let want_g = if two { kernels::add_relu_grad(&a, &b, &y)? } else { kernels::relu_grad(&a, &y)? };
                let op = BnGrad {
                    relu: false,
                    stats: p.stats.clone(),
                    weight: p.weight.clone(),
                    bias: p.bias.clone(),
                    sums: None,
                };
                let want_sums = z.apply_op2_no_bwd(&want_g, &op)?;
                let same = |x: &Tensor, w: &Tensor| -> Result<bool> {
                    Ok(host_f32(x)?.iter().zip(host_f32(w)?).all(|(p, q)| p.to_bits() == q.to_bits()))
                };
                ensure!(same(&g, &want_g)?, "{tag}: the joined gradient differs from relu_grad's");
                ensure!(same(&sums, &want_sums)?, "{tag}: the joined sums differ from the sums pass's");
            }
        }
    }
    println!("joined ReLU gradient + BatchNorm sums: equal bit for bit to the two passes (f32, bf16, fp16)");
    Ok(())
}

/// The rel err of backward sums (2, c) against the sums pass (`BnGrad`, with or without the ReLU) of the
/// BatchNorm `p` over its input z and output gradient g.
fn sums_vs_pass(sums: &Tensor, z: &Tensor, g: &Tensor, p: &kernels::BnParams, relu: bool) -> Result<f64> {
    let op = kernels::ops::batchnorm::BnGrad {
        relu,
        stats: p.stats.clone(),
        weight: p.weight.clone(),
        bias: p.bias.clone(),
        sums: None,
    };
    rel_err(sums, &z.apply_op2_no_bwd(g, &op)?)
}

/// `kernels.bn_stats = "fused"`, backward: the BatchNorm + ReLU backward sums computed in the epilogue of the
/// grad-input passes (`gemm_nn_gsums_*` for 1x1, `conv_dgrad_gsums_*` for stride-1 convolutions; on x128 and x64
/// their statistics-warps kernels `*_gsumsw_*`, as these outputs go through map C) against the sums pass (`BnGrad`
/// with the ReLU) over the same (z, dx), on every TMA tile, in bf16 and fp16, partials poisoned first; a strided
/// 3x3 (whose grad-input scatters its rows) must leave the sums to the pass.
#[test]
fn grad_input_epilogue_sums_match_the_pass() -> Result<()> {
    use kernels::ops::conv_nhwc::conv_nhwc_dgrad_sums;
    use kernels::variants::{X128, X256, X64};
    use kernels::Tuning;
    let gpu = cuda()?;
    let _poison = kernels::cuda::poison_outputs();
    // (n, h, c, ko, k, stride, pad): dx is (n, h, h, c), dy (n, h / stride, h / stride, ko).
    let shapes =
        [(3, 14, 256, 1024, 1, 1, 0), (2, 28, 64, 64, 3, 1, 1), (5, 7, 512, 2048, 1, 1, 0), (2, 14, 128, 128, 3, 2, 1)];
    let mut worst = 0f64;
    for dt in [DType::BF16, DType::F16] {
        for tile in [X256, X128, X64] {
            let policy = KernelPolicy::custom().with_tuning(Tuning::Forced(tile));
            for &(n, h, c, ko, k, stride, pad) in &shapes {
                let tag = format!("{dt:?} {} n{n} {h}x{h}x{c} <- {ko} k{k} s{stride}", tile.name);
                let p_hw = (h + 2 * pad - k) / stride + 1;
                let dy = Tensor::randn(0f32, 1.0, (n, p_hw, p_hw, ko), &gpu)?.to_dtype(dt)?;
                let w = (Tensor::randn(0f32, 1.0, (ko, k, k, c), &gpu)? * (1.0 / ((ko * k * k) as f64).sqrt()))?;
                let w = w.to_dtype(dt)?;
                let z = (Tensor::randn(0f32, 1.0, (n, h, h, c), &gpu)? + 0.3)?.to_dtype(dt)?;
                let mean: Vec<f32> = (0..c).map(|i| 0.3 + 0.001 * i as f32).collect();
                let var: Vec<f32> = (0..c).map(|i| 1.0 + 0.01 * (i % 5) as f32).collect();
                let inv: Vec<f32> = var.iter().map(|v| 1.0 / (v + 1e-5f32).sqrt()).collect();
                let p = kernels::BnParams {
                    stats: Tensor::from_vec([mean, var, inv].concat(), (3, c), &gpu)?,
                    weight: Tensor::from_vec((0..c).map(|i| 1.0 - 0.001 * i as f32).collect::<Vec<_>>(), c, &gpu)?,
                    bias: Tensor::from_vec((0..c).map(|i| 0.02 * (i % 7) as f32 - 0.05).collect::<Vec<_>>(), c, &gpu)?,
                };
                let (dx, sums) = conv_nhwc_dgrad_sums(&dy, &w, stride, pad, (h, h), &policy, &z, &p)?;
                if stride != 1 && k != 1 {
                    ensure!(sums.is_none(), "{tag}: a strided grad-input claimed epilogue sums");
                    continue;
                }
                let sums = sums.with_context(|| format!("{tag}: no epilogue sums"))?;
                let e = sums_vs_pass(&sums, &z, &dx, &p, true)?;
                ensure!(e <= 1e-4, "{tag}: backward sums rel err {e:.2e} against the pass");
                worst = worst.max(e);
            }
        }
    }
    println!("grad-input epilogue sums vs the pass: worst rel err {worst:.1e}");
    Ok(())
}

/// `kernels.bn_stats = "auto"`: a convolution shape's first launch times its BatchNorm reduction in the epilogue
/// against the plain kernel and the pass and remembers one choice per (shape, direction), which that launch and
/// every later one follow: epilogue partials exactly where the autotuner says `epilogue`. The epilogue exists on
/// the TMA tiles only, so a pass asked for it is tuned over the TMA tiles under its own key; a shape whose pass
/// still ran on a cp.async tile (forced, or no TMA path) must remember no epilogue choice and return no partials
/// (before the separate key the H100 picked cp.async for a 1x1 at batch 8). Forward moments of a 1x1 and a 3x3,
/// grad-input sums of the same two, bf16, at batch 8 and 32; at least one pass of each direction must have taken
/// a TMA tile (and so been timed); the sums, whichever way they came, within 1e-4 of the pass.
#[test]
fn auto_epilogue_choice_is_timed_once_and_followed() -> Result<()> {
    use kernels::ops::batchnorm::BnGrad;
    use kernels::ops::conv_nhwc::conv_nhwc_dgrad_sums;
    use kernels::{Autotuner, Tuning};
    use std::sync::Arc;
    let gpu = cuda()?;
    let tuner = Arc::new(Autotuner::in_memory());
    let policy = KernelPolicy {
        bn_epilogue_by_timing: true,
        ..KernelPolicy::custom().with_tuning(Tuning::Autotune(tuner.clone())).with_fused_bn_reductions(true)
    };
    // The remembered choices whose key holds `what` and `geom` (tiles: "conv2d_nhwc_fwd ConvGeom { .. }";
    // epilogues: "epilogue moments ConvGeom { .. }").
    let chosen = |what: &str, geom: &str| -> Vec<&'static str> {
        tuner.choices().into_iter().filter(|(k, _)| k.contains(what) && k.contains(geom)).map(|(_, v)| v).collect()
    };
    // Whether the pass `op` of `geom`, asked for its epilogue, runs on a TMA tile ("x256", "x128", "x64"): its
    // tile under the epilogue's own key ("... +bn-epilogue"; the plain pass that the timing runs has another).
    let on_tma = |op: &str, geom: &str| -> Result<bool> {
        let epi: Vec<&str> = tuner
            .choices()
            .into_iter()
            .filter(|(k, _)| k.contains(&format!("{op} ")) && k.contains(geom) && k.ends_with(" +bn-epilogue"))
            .map(|(_, v)| v)
            .collect();
        match epi[..] {
            [t] => Ok(t.starts_with('x')),
            ref v => anyhow::bail!("{op} {geom}: {} tile choices remembered, expected 1", v.len()),
        }
    };
    let dt = DType::BF16;
    let (mut timed_fwd, mut timed_bwd) = (0, 0);
    // (n, hw, c, ko, k, pad)
    for &(n, hw, c, ko, k, pad) in &[(8, 28, 256, 512, 1, 0), (8, 28, 128, 128, 3, 1), (32, 28, 256, 512, 1, 0)] {
        let tag = format!("n{n} {hw}x{hw}x{c} -> {ko} k{k}");
        let geom = format!("ConvGeom {{ n: {n}, h: {hw}, w: {hw}, c: {c}, ko: {ko}, r: {k}, stride: 1, pad: {pad} }}");
        let x = (Tensor::randn(0f32, 1.0, (n, hw, hw, c), &gpu)? + 1.0)?.to_dtype(dt)?;
        let w = (Tensor::randn(0f32, 1.0, (ko, k, k, c), &gpu)? * (1.0 / ((c * k * k) as f64).sqrt()))?.to_dtype(dt)?;
        let mut got = Vec::new();
        for _ in 0..2 {
            got.push(kernels::conv2d_nhwc_forward_stats(&x, &w, 1, pad, &policy)?.1.is_some());
        }
        let tma = on_tma("conv2d_nhwc_fwd", &geom)?;
        let c_fwd = chosen("\tepilogue moments ", &geom);
        if tma {
            let [v] = c_fwd[..] else { anyhow::bail!("{tag}: {} forward choices remembered, expected 1", c_fwd.len()) };
            println!("{tag}: forward moments: {v} (launches took the epilogue: {got:?})");
            ensure!(got == vec![v == "epilogue"; 2], "{tag}: launches {got:?} against the remembered `{v}`");
            timed_fwd += 1;
        } else {
            println!("{tag}: forward on a cp.async tile: no epilogue (launches took it: {got:?})");
            ensure!(c_fwd.is_empty() && got == [false; 2], "{tag}: cp.async forward: {c_fwd:?} remembered, {got:?}");
        }

        // Grad-input of the same conv with the sums of a BatchNorm + ReLU over z (x's shape).
        let dy = Tensor::randn(0f32, 1.0, (n, hw, hw, ko), &gpu)?.to_dtype(dt)?;
        let z = (Tensor::randn(0f32, 1.0, (n, hw, hw, c), &gpu)? + 0.3)?.to_dtype(dt)?;
        let inv = 1.0 / (1.0f32 + 1e-5).sqrt();
        let p = kernels::BnParams {
            stats: Tensor::from_vec([vec![0.3f32; c], vec![1.0; c], vec![inv; c]].concat(), (3, c), &gpu)?,
            weight: Tensor::ones(c, DType::F32, &gpu)?,
            bias: Tensor::zeros(c, DType::F32, &gpu)?,
        };
        let mut took = Vec::new();
        for _ in 0..2 {
            let (dx, sums) = conv_nhwc_dgrad_sums(&dy, &w, 1, pad, (hw, hw), &policy, &z, &p)?;
            took.push(sums.is_some());
            let op = BnGrad {
                relu: true,
                stats: p.stats.clone(),
                weight: p.weight.clone(),
                bias: p.bias.clone(),
                sums: None,
            };
            let want = z.apply_op2_no_bwd(&dx, &op)?;
            if let Some(s) = sums {
                let e = rel_err(&s, &want)?;
                ensure!(e <= 1e-4, "{tag}: backward sums rel err {e:.2e} against the pass");
            }
        }
        let tma = on_tma("conv2d_nhwc_dgrad", &geom)?;
        let c_bwd = chosen("\tepilogue sums ", &geom);
        if tma {
            let [v] = c_bwd[..] else {
                anyhow::bail!("{tag}: {} backward choices remembered, expected 1", c_bwd.len())
            };
            println!("{tag}: backward sums: {v} (launches took the epilogue: {took:?})");
            ensure!(took == vec![v == "epilogue"; 2], "{tag}: launches {took:?} against the remembered `{v}`");
            timed_bwd += 1;
        } else {
            println!("{tag}: grad-input on a cp.async tile: no epilogue (launches took it: {took:?})");
            ensure!(
                c_bwd.is_empty() && took == [false; 2],
                "{tag}: cp.async grad-input: {c_bwd:?} remembered, {took:?}"
            );
        }
    }
    ensure!(timed_fwd > 0 && timed_bwd > 0, "no shape took a TMA tile (forward {timed_fwd}, grad-input {timed_bwd})");
    Ok(())
}

/// `kernels.bn_cooperative`: the fused step with one cooperative launch per BatchNorm pass (forward and
/// backward) against the three launches, over [`graph_script`]'s ten fp16 SGD steps, eagerly and replayed from a
/// CUDA graph (the cooperative launches captured as graph nodes): every step's report and every model tensor
/// afterwards (parameters, running statistics, num_batches_tracked) equal bit for bit.
#[test]
fn cooperative_batchnorm_step_matches_and_replays() -> Result<()> {
    let gpu = cuda()?;
    let (batches, script) = graph_script(&gpu)?;
    let run =
        |graph: &str, coop: bool| run_script(&gpu, &batches, &script, graph, &format!("kernels.bn_cooperative={coop}"));
    let (base, base_t, ..) = run("off", false)?;
    let (_, _, _, _, split_nodes) = run("on", false)?;
    for graph in ["off", "on"] {
        let before = kernels::cuda::bn::cooperative_launches();
        let (outs, tensors, captures, replayed, nodes) = run(graph, true)?;
        let launched = kernels::cuda::bn::cooperative_launches() - before;
        ensure!(launched > 0, "graph {graph}: no cooperative launch (the one-launch path was not taken)");
        let same = |a: f64, b: f64| a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan());
        for (i, (e, g)) in base.iter().zip(&outs).enumerate() {
            ensure!(
                same(e.0, g.0) && same(e.1, g.1) && e.2 == g.2 && same(e.3, g.3),
                "graph {graph}, step {i}: three launches (loss, norm, skipped, scale) {e:?}, one {g:?}"
            );
        }
        for ((name, e), (_, g)) in base_t.iter().zip(&tensors) {
            let differ = bits_differ(g, e)?;
            ensure!(differ == 0, "graph {graph}: {name} differs in {differ} of {} values", e.elem_count());
        }
        if graph == "on" {
            ensure!(captures == 2 && replayed == 5, "{captures} captures, {replayed} replays (want 2 and 5)");
        }
        println!(
            "cooperative BatchNorm, graph {graph}: {} steps and {} tensors bit for bit with the three launches; \
             {captures} captures ({nodes} nodes, {split_nodes} with three launches), {replayed} replays, {launched} \
             cooperative launches queued from the host",
            script.len(),
            tensors.len()
        );
    }
    Ok(())
}

/// One explicit ResNet-50 training step over (x, labels) with the fused BatchNorm reductions, `tile` forced (so
/// that every conv that can runs its epilogue), in `prec`, with the cooperative BatchNorm launches or the separate
/// ones (`coop`): the loss, and the gradients and running statistics. The compact shortcut gradient (cooperative
/// only) is off: another kernel sums it, equal only to rounding.
fn fused_reductions_step(
    gpu: &Device,
    (x, labels): (&Tensor, &Tensor),
    tile: kernels::variants::Tile,
    prec: Precision,
    coop: bool,
) -> Result<(f32, Vec<(String, Tensor)>)> {
    let mut m = model(Arch::ResNet50, Stem::ImageNet, gpu)?;
    let policy = m.config.kernels.clone().with_tuning(kernels::Tuning::Forced(tile)).with_fused_bn_reductions(true);
    m.config.kernels = KernelPolicy { bn_cooperative: coop, compact_shortcut_grad: false, ..policy };
    let o = m.train_step_explicit_with(x, labels, resnet::step::StepArgs::new(0.1, 1.0, prec))?;
    let out = grads_and_running_stats(&m, &o)?;
    Ok((o.loss.to_scalar::<f32>()?, out))
}

/// `kernels.bn_stats = "fused"` with `kernels.bn_cooperative = true`: a cooperative forward whose conv ran on a
/// tile with the moments epilogue takes those moments and skips its own moments pass. A ResNet-50 step (64 px,
/// batch 8, bf16; TMA tiles forced, so that every conv that can makes the moments: with the tuner's choices these
/// small shapes run on cp.async tiles, which make none) must give the loss, every gradient and every running
/// statistic bit for bit as the separate launches do (the epilogue's moments, their finaliser, the normalisation).
#[test]
fn cooperative_batchnorm_takes_the_epilogue_moments() -> Result<()> {
    use kernels::variants::X256;
    let gpu = cuda()?;
    let x = Tensor::randn(0f32, 1.0, (8, 3, 64, 64), &Device::Cpu)?.to_device(&gpu)?;
    let labels = Tensor::new((0..8u32).collect::<Vec<_>>().as_slice(), &gpu)?;
    let step = |coop: bool| fused_reductions_step(&gpu, (&x, &labels), X256, Precision::Bf16, coop);
    let (lb, base) = step(false)?;
    let before = kernels::cuda::bn::cooperative_launches_from_moments();
    let (lc, coop) = step(true)?;
    let from_moments = kernels::cuda::bn::cooperative_launches_from_moments() - before;
    ensure!(from_moments > 0, "no cooperative forward took epilogue moments");
    ensure!(lb.to_bits() == lc.to_bits(), "loss {lc} cooperative, {lb} with the separate launches");
    ensure_same_bits("cooperative against the separate launches", &coop, &base)?;
    println!(
        "cooperative BatchNorm with epilogue moments, ResNet-50 step: loss and {} tensors (gradients, running \
         statistics) bit for bit with the separate launches; {from_moments} cooperative forwards took epilogue moments",
        base.len()
    );
    Ok(())
}

/// `kernels.bn_stats = "fused"` with `kernels.bn_cooperative = true`, backward: a BatchNorm whose backward sums'
/// partials came from the grad-input's epilogue (on x128 the statistics warps' `*_gsumsw_*` kernels) reduces them
/// and makes dz in one cooperative launch (`bn_nhwc_train_bwd_v8` with `have_sums`) instead of the finaliser and
/// the dx pass. A ResNet-50 step (64 px, batch 8, bf16 and fp16, tile x128 forced so that the epilogues run) must
/// give the loss, every gradient and every running statistic bit for bit as the separate launches do.
#[test]
fn cooperative_batchnorm_takes_the_epilogue_sums() -> Result<()> {
    use kernels::variants::X128;
    let gpu = cuda()?;
    let x = Tensor::randn(0f32, 1.0, (8, 3, 64, 64), &Device::Cpu)?.to_device(&gpu)?;
    let labels = Tensor::new((0..8u32).collect::<Vec<_>>().as_slice(), &gpu)?;
    for prec in [Precision::Bf16, Precision::F16] {
        let step = |coop: bool| fused_reductions_step(&gpu, (&x, &labels), X128, prec, coop);
        let (lb, base) = step(false)?;
        let before = kernels::cuda::bn::cooperative_launches_from_sums();
        let (lc, coop) = step(true)?;
        let from_sums = kernels::cuda::bn::cooperative_launches_from_sums() - before;
        ensure!(from_sums > 0, "{prec:?}: no cooperative backward took epilogue sums");
        ensure!(lb.to_bits() == lc.to_bits(), "{prec:?}: loss {lc} cooperative, {lb} with the separate launches");
        ensure_same_bits(&format!("{prec:?} cooperative against the separate launches"), &coop, &base)?;
        println!(
            "cooperative BatchNorm backward with epilogue sums, ResNet-50 {prec:?} step: loss and {} tensors \
             (gradients, running statistics) bit for bit with the separate launches; {from_sums} cooperative \
             backwards took epilogue sums",
            base.len()
        );
    }
    Ok(())
}

/// The BatchNorm + ReLU of a 1x1 convolution's input inside the TMA GEMM (`KernelPolicy::bn_apply_in_conv`:
/// `gemm_nt_bnin_*` for the forward, `gemm_tn_bnin_*` for the grad-weight, ig::bnin_a / bnin_b) against the
/// same convolution of the materialised relu(bn(z)) on the same tile: bit for bit in bf16 and fp16, every TMA
/// tile forced, bottleneck conv3 shapes with a row count that is not a multiple of 128 and a BatchNorm with
/// negative weights (a ReLU that zeroes about half); the grad-weight with its split-K. The forward with the
/// moments of its output (`gemm_nt_bnin_stats_*`, `conv2d_nhwc_forward_bn_relu_stats`) gives the same output and
/// the moment partials of `conv2d_nhwc_forward_stats` over the materialised input, bit for bit. The fused path
/// must have run (the launch counter).
#[test]
fn bn_relu_operand_matches_the_materialised_input() -> Result<()> {
    use kernels::variants::{X128, X256, X64};
    use kernels::Tuning;
    let gpu = cuda()?;
    for dt in [DType::BF16, DType::F16] {
        for (n, h, w, c, ko) in
            [(8usize, 14usize, 14usize, 256usize, 1024usize), (3, 7, 9, 64, 256), (4, 28, 28, 128, 512)]
        {
            let z = Tensor::randn(0.5f32, 2.0, (n, h, w, c), &Device::Cpu)?.to_dtype(dt)?.to_device(&gpu)?;
            let wt = (Tensor::randn(0f32, 1.0, (ko, 1, 1, c), &Device::Cpu)? * 0.1)?.to_dtype(dt)?.to_device(&gpu)?;
            let dy = Tensor::randn(0f32, 1.0, (n, h, w, ko), &Device::Cpu)?.to_dtype(dt)?.to_device(&gpu)?;
            let mean = Tensor::randn(0.5f32, 1.0, c, &Device::Cpu)?;
            let var = (Tensor::randn(0f32, 1.0, c, &Device::Cpu)?.sqr()? + 0.5)?;
            let invstd = (&var + 1e-5)?.sqrt()?.recip()?;
            let stats = Tensor::stack(&[mean, var, invstd], 0)?.to_device(&gpu)?;
            let p = kernels::BnParams {
                stats,
                weight: Tensor::randn(0f32, 1.0, c, &Device::Cpu)?.to_device(&gpu)?,
                bias: (Tensor::randn(0f32, 1.0, c, &Device::Cpu)? * 0.5)?.to_device(&gpu)?,
            };
            let op = kernels::ops::batchnorm::BnApply { relu: true, stats: p.stats.clone() };
            let x = z.apply_op3_no_bwd(&p.weight, &p.bias, &op)?;
            let zeros = host_f32(&x)?.iter().filter(|v| **v == 0.0).count();
            for tile in [X256, X128, X64] {
                let policy = KernelPolicy::custom().with_tuning(Tuning::Forced(tile));
                let what = format!("{dt:?} ({n}, {h}, {w}, {c}) -> {ko}, tile {}", tile.name);
                let before = kernels::bn_relu_in_launches();
                let y = kernels::conv2d_nhwc_forward_bn_relu(&z, &p, &wt, 1, 0, &policy)?;
                let y_ref = kernels::conv2d_nhwc_forward(&x, &wt, 1, 0, &policy)?;
                let dw = kernels::conv2d_nhwc_grad_weight_bn_relu(&dy, &z, &p, 1, 1, 0, &policy)?;
                let dw_ref = kernels::conv2d_nhwc_grad_weight(&dy, &x, 1, 1, 0, &policy)?;
                let (ys, part) = kernels::conv2d_nhwc_forward_bn_relu_stats(&z, &p, &wt, 1, 0, &policy)?;
                let (ys_ref, part_ref) = kernels::conv2d_nhwc_forward_stats(&x, &wt, 1, 0, &policy)?;
                let ran = kernels::bn_relu_in_launches() - before;
                ensure!(ran == 3, "{what}: {ran} of 3 passes normalised their operand in the kernel");
                let (dy_n, dw_n) = (bits_differ(&y, &y_ref)?, bits_differ(&dw, &dw_ref)?);
                ensure!(dy_n == 0, "{what}: forward differs in {dy_n} of {} values", y.elem_count());
                ensure!(dw_n == 0, "{what}: grad-weight differs in {dw_n} of {} values", dw.elem_count());
                let ys_n = bits_differ(&ys, &ys_ref)?;
                ensure!(ys_n == 0, "{what}: forward with moments differs in {ys_n} of {} values", ys.elem_count());
                let (Some(part), Some(part_ref)) = (part, part_ref) else {
                    anyhow::bail!("{what}: a forward on a TMA tile made no epilogue moments");
                };
                let part_n = bits_differ(&part, &part_ref)?;
                ensure!(part_n == 0, "{what}: moment partials differ in {part_n} of {} values", part.elem_count());
            }
            println!(
                "bn_relu operand, {dt:?} ({n}, {h}, {w}, {c}) -> {ko}: forward, forward + moments and grad-weight bit \
                 for bit on x256, x128, x64 ({:.0}% of the operand zeroed by the ReLU)",
                100.0 * zeros as f64 / x.elem_count() as f64
            );
        }
    }
    Ok(())
}

/// The explicit step with each bottleneck's conv3 input normalised inside the conv (`bn_apply_in_conv`:
/// "backward", the grad-weight only; "both", the forward too; and `kernels.recompute = "relu"`, whose conv3
/// grad-weight normalises z2 instead of recomputing the activation) against the step that makes and keeps that
/// activation: a ResNet-50 step (64 px, batch 8, bf16 and fp16, cooperative BatchNorm, TMA tiles forced so that
/// every conv3 takes the fused kernels) must give the loss, every gradient and every running statistic bit for
/// bit, with the fused passes counted as run (16 grad-weights; and 16 forwards with "both").
#[test]
fn bn_apply_in_conv_step_matches_bit_for_bit() -> Result<()> {
    use kernels::variants::X128;
    use kernels::{BnApplyInConv, Tuning};
    use resnet::step::Recompute;
    let gpu = cuda()?;
    let x = Tensor::randn(0f32, 1.0, (8, 3, 64, 64), &Device::Cpu)?.to_device(&gpu)?;
    let labels = Tensor::new((0..8u32).collect::<Vec<_>>().as_slice(), &gpu)?;
    for precision in [Precision::Bf16, Precision::F16] {
        let step = |bn_apply_in_conv: BnApplyInConv, recompute: Recompute| -> Result<(f32, Vec<(String, Tensor)>)> {
            let mut m = model(Arch::ResNet50, Stem::ImageNet, &gpu)?;
            let policy = m.config.kernels.clone().with_tuning(Tuning::Forced(X128));
            m.config.kernels = KernelPolicy { bn_cooperative: true, bn_apply_in_conv, ..policy };
            let args = resnet::step::StepArgs { recompute, ..resnet::step::StepArgs::new(0.1, 1.0, precision) };
            let o = m.train_step_explicit_with(&x, &labels, args)?;
            let out = grads_and_running_stats(&m, &o)?;
            Ok((o.loss.to_scalar::<f32>()?, out))
        };
        let (lb, base) = step(BnApplyInConv::Off, Recompute::None)?;
        for (mode, recompute, want) in [
            (BnApplyInConv::Backward, Recompute::None, 16),
            (BnApplyInConv::Both, Recompute::None, 32),
            (BnApplyInConv::Off, Recompute::Relu, 16),
        ] {
            let before = kernels::bn_relu_in_launches();
            let (lf, fused) = step(mode, recompute)?;
            let ran = kernels::bn_relu_in_launches() - before;
            let what = format!("{precision:?} {} recompute={recompute:?}", mode.name());
            // ResNet-50: 16 bottlenecks, a grad-weight each, and with "both" a forward each.
            ensure!(ran == want, "{what}: {ran} of {want} conv3 passes normalised their operand in the kernel");
            ensure!(lb.to_bits() == lf.to_bits(), "{what}: loss {lf} fused, {lb} materialised");
            ensure_same_bits(&what, &fused, &base)?;
            println!(
                "bn_apply_in_conv = {}, recompute {recompute:?}, ResNet-50 {precision:?} step: loss and {} tensors \
                 bit for bit with the kept activation; {ran} conv3 passes normalised their operand in the kernel",
                mode.name(),
                base.len()
            );
        }
    }
    Ok(())
}

/// The block-output join in a 1x1 grad-input's store (`gemm_nn_join_*`, ig::join_pair; `KernelPolicy::join_in_conv`)
/// against the plain grad-input on the same tile followed by the join as its own pass (the residual kernel gating
/// by a tensor made from the same mask): bit for bit in bf16 and fp16, every TMA tile forced, bottleneck conv1
/// shapes with row counts that are not a multiple of 128, one (K = 128) with two k-tiles, and a channel count that
/// is not a multiple of the tile (96), a shortcut gradient of either sign and about half of the mask off. The
/// epilogue must have run (true); channels that are not a multiple of 32, and a problem so small that the plain
/// pass could split K, must fall back (false) to the plain grad-input.
#[test]
fn joined_grad_input_matches_the_join() -> Result<()> {
    use kernels::variants::{X128, X256, X64};
    use kernels::Tuning;
    let gpu = cuda()?;
    for dt in [DType::BF16, DType::F16] {
        for (n, h, w, c, ko) in [
            (32usize, 28usize, 28usize, 256usize, 64usize),
            (16, 14, 14, 1024, 256),
            (16, 14, 14, 512, 128),
            (12, 28, 28, 96, 64),
            (32, 28, 28, 40, 16),
            (2, 5, 5, 256, 64),
        ] {
            let dy = Tensor::randn(0f32, 1.0, (n, h, w, ko), &Device::Cpu)?.to_dtype(dt)?.to_device(&gpu)?;
            let wt = (Tensor::randn(0f32, 1.0, (ko, 1, 1, c), &Device::Cpu)? * 0.2)?.to_dtype(dt)?.to_device(&gpu)?;
            let b = Tensor::randn(0f32, 1.0, (n, h, w, c), &Device::Cpu)?.to_dtype(dt)?.to_device(&gpu)?;
            let y = Tensor::randn(0f32, 1.0, (n, h, w, c), &Device::Cpu)?.relu()?.to_dtype(dt)?.to_device(&gpu)?;
            let mask = kernels::ops::batchnorm::relu_mask(&y)?;
            // The fold's conditions: c % 32 == 0 and at least 66 tiles of 128 x 256 (half the H100's / H200's 132 SMs).
            let fits = c % 32 == 0 && 2 * (n * h * w).div_ceil(128) * c.div_ceil(256) >= 132;
            for tile in [X256, X128, X64] {
                let policy = KernelPolicy::custom().with_tuning(Tuning::Forced(tile));
                let what = format!("{dt:?} ({n}, {h}, {w}, {ko}) -> {c}, tile {}", tile.name);
                let (g, joined) = kernels::conv2d_nhwc_grad_input_join(&dy, &wt, (h, w), &policy, &b, &mask)?;
                let dx = kernels::conv2d_nhwc_grad_input(&dy, &wt, 1, 0, (h, w), &policy)?;
                ensure!(joined == fits, "{what}: joined {joined}, expected {fits}");
                let want = if fits { kernels::ops::batchnorm::join_masked(&dx, &b, &mask)? } else { dx };
                let differ = bits_differ(&g, &want)?;
                ensure!(differ == 0, "{what}: differs in {differ} of {} values", want.elem_count());
            }
            println!(
                "joined grad-input, {dt:?} ({n}, {h}, {w}, {ko}) -> {c}: {} on x256, x128, x64",
                if fits { "bit for bit the grad-input + join" } else { "fell back to the plain grad-input" }
            );
        }
    }
    Ok(())
}

/// A step's loss, gradients and running statistics (named), and a launch count.
type CountedStep = (f32, Vec<(String, Tensor)>, u64);

/// One explicit ResNet-50 step over (x, labels) in `prec` under `policy` with the cooperative BatchNorm and the
/// block outputs' ReLU masks (what the joins need): the loss, the gradients and running statistics, and how far
/// `counter` (a thread's launch counter) moved.
fn join_step(
    gpu: &Device,
    (x, labels): (&Tensor, &Tensor),
    prec: Precision,
    policy: KernelPolicy,
    counter: fn() -> u64,
) -> Result<CountedStep> {
    let mut m = model(Arch::ResNet50, Stem::ImageNet, gpu)?;
    m.config.kernels = KernelPolicy { bn_cooperative: true, join_relu_mask: true, ..policy };
    let before = counter();
    let o = m.train_step_explicit_with(x, labels, resnet::step::StepArgs::new(0.1, 1.0, prec))?;
    let counted = counter() - before;
    Ok((o.loss.to_scalar::<f32>()?, grads_and_running_stats(&m, &o)?, counted))
}

/// The joined 1x1 grad-input that also takes the backward sums of the BatchNorm before (`gemm_nn_joinsw_*`,
/// ig::tma_join_sums_warps; `KernelPolicy::join_sums`): the joined output bit for bit the join kernel's, and the
/// partials, reduced, within 1e-4 of the sums pass (`BnGrad` without ReLU) over (z3, the joined g), in bf16 and
/// fp16, every TMA tile forced, partials poisoned first; shapes as `joined_grad_input_matches_the_join`'s (rows
/// not a multiple of 128, a channel count that is not a multiple of the tile); where the join falls back, no
/// partials.
#[test]
fn joined_grad_input_sums_match_the_pass() -> Result<()> {
    use kernels::variants::{X128, X256, X64};
    use kernels::Tuning;
    let gpu = cuda()?;
    let _poison = kernels::cuda::poison_outputs();
    let mut worst = 0f64;
    for dt in [DType::BF16, DType::F16] {
        for (n, h, w, c, ko) in [
            (32usize, 28usize, 28usize, 256usize, 64usize),
            (16, 14, 14, 1024, 256),
            (16, 14, 14, 512, 128),
            (12, 28, 28, 96, 64),
            (2, 5, 5, 256, 64),
        ] {
            let dy = Tensor::randn(0f32, 1.0, (n, h, w, ko), &gpu)?.to_dtype(dt)?;
            let wt = (Tensor::randn(0f32, 1.0, (ko, 1, 1, c), &gpu)? * 0.2)?.to_dtype(dt)?;
            let b = Tensor::randn(0f32, 1.0, (n, h, w, c), &gpu)?.to_dtype(dt)?;
            let y = Tensor::randn(0f32, 1.0, (n, h, w, c), &gpu)?.relu()?.to_dtype(dt)?;
            let mask = kernels::ops::batchnorm::relu_mask(&y)?;
            let z3 = (Tensor::randn(0f32, 1.0, (n, h, w, c), &gpu)? + 0.2)?.to_dtype(dt)?;
            let mean: Vec<f32> = (0..c).map(|i| 0.2 + 0.001 * i as f32).collect();
            let var: Vec<f32> = (0..c).map(|i| 1.0 + 0.01 * (i % 5) as f32).collect();
            let inv: Vec<f32> = var.iter().map(|v| 1.0 / (v + 1e-5f32).sqrt()).collect();
            let p = kernels::BnParams {
                stats: Tensor::from_vec([mean, var, inv].concat(), (3, c), &gpu)?,
                weight: Tensor::ones(c, DType::F32, &gpu)?,
                bias: Tensor::zeros(c, DType::F32, &gpu)?,
            };
            let fits = c % 32 == 0 && 2 * (n * h * w).div_ceil(128) * c.div_ceil(256) >= 132;
            for tile in [X256, X128, X64] {
                let policy = KernelPolicy::custom().with_tuning(Tuning::Forced(tile));
                let what = format!("{dt:?} ({n}, {h}, {w}, {ko}) -> {c}, tile {}", tile.name);
                let (g0, _) = kernels::conv2d_nhwc_grad_input_join(&dy, &wt, (h, w), &policy, &b, &mask)?;
                let before = kernels::join_sums_launches();
                let (g, joined, part) =
                    kernels::conv2d_nhwc_grad_input_join_sums(&dy, &wt, (h, w), &policy, &b, &mask, Some((&z3, &p)))?;
                let counted = kernels::join_sums_launches() - before;
                ensure!(joined == fits, "{what}: joined {joined}, expected {fits}");
                let differ = bits_differ(&g, &g0)?;
                ensure!(differ == 0, "{what}: joined values differ from the join's in {differ} values");
                let Some(part) = part else {
                    ensure!(!fits && counted == 0, "{what}: no partials from a join that ran");
                    continue;
                };
                ensure!(fits && counted == 1, "{what}: partials from a join that fell back ({counted} counted)");
                let sums = kernels::ops::batchnorm::grad_sums_from_partials(&part, n * h * w, c)?;
                let e = sums_vs_pass(&sums, &z3, &g, &p, false)?;
                ensure!(e <= 1e-4, "{what}: backward sums rel err {e:.2e} against the pass");
                worst = worst.max(e);
            }
        }
    }
    println!(
        "joined grad-input + sums of the BatchNorm before: joined values bit for bit, sums worst rel err {worst:.1e}"
    );
    Ok(())
}

/// The explicit step with the joined conv1 grad-inputs taking the block before's last BatchNorm sums
/// (`KernelPolicy::join_sums`, `kernels.bn_stats = "fused"`) against the same step with that BatchNorm's backward
/// taking its own sums: a ResNet-50 step (224 px, batch 16, bf16 and fp16, cooperative BatchNorm, joins folded,
/// TMA tile x128 forced). The forward is the same computation: the loss and every running statistic bit for bit,
/// and the 10 folds (`join_in_conv_step_matches_bit_for_bit`) all take the sums. The sums are added in another
/// order, and a low-precision dz rounded the other way now and then moves every gradient before it (a stem
/// BatchNorm's bias gradient, a sum with much cancellation, by percents between the two runs), so the gradients
/// are held to the FP32 explicit step: each within max(1.5 x the own-sums step's rel err, 2e-2 bf16 / 5e-3 fp16)
/// of FP32's, the bound of `fused_step_matches_autograd_on_cuda`.
#[test]
fn join_sums_step_matches_own_sums() -> Result<()> {
    use kernels::variants::X128;
    use kernels::Tuning;
    let gpu = cuda()?;
    let x = integration_tests::seeded_randn(&[16, 3, 224, 224], 1208).to_device(&gpu)?;
    let labels = Tensor::new((0..16u32).map(|i| i % 10).collect::<Vec<_>>().as_slice(), &gpu)?;
    let m32 = model(Arch::ResNet50, Stem::ImageNet, &gpu)?;
    let o32 = m32.train_step_explicit(&x, &labels, 0.1, 1.0, Precision::F32)?;
    let ref32: std::collections::HashMap<String, Tensor> = named_grads(&m32, &o32)?.into_iter().collect();
    for precision in [Precision::Bf16, Precision::F16] {
        let step = |join_sums_in_conv: bool| {
            let policy = KernelPolicy::custom().with_tuning(Tuning::Forced(X128)).with_fused_bn_reductions(true);
            let policy = KernelPolicy { join_in_conv: true, join_sums_in_conv, ..policy };
            join_step(&gpu, (&x, &labels), precision, policy, kernels::join_sums_launches)
        };
        let (lb, base, none) = step(false)?;
        let (ls, summed, taken) = step(true)?;
        let what = format!("{precision:?} join sums");
        ensure!(none == 0 && taken == 10, "{what}: {taken} of 10 joins took the sums ({none} with the switch off)");
        ensure!(lb.to_bits() == ls.to_bits(), "{what}: loss {ls} against {lb}");
        ensure!(base.len() == summed.len(), "{what}: {} tensors against {}", summed.len(), base.len());
        let floor = if precision == Precision::Bf16 { 2e-2 } else { 5e-3 };
        let (mut closest, mut stats) = ((0f64, 0f64, 0f64, String::new()), 0usize);
        for ((name, own), (_, got)) in base.iter().zip(&summed) {
            if name.contains("running_") {
                let differ = bits_differ(got, own)?;
                ensure!(differ == 0, "{what}: {name} differs in {differ} of {} values", own.elem_count());
                stats += 1;
                continue;
            }
            let r = ref32.get(name).with_context(|| format!("{what}: no FP32 gradient for {name}"))?;
            let (e, e_own) = (rel_err(got, r)?, rel_err(own, r)?);
            let bound = f64::max(1.5 * e_own, floor);
            ensure!(e <= bound, "{what}: {name} rel err {e:.2e} vs FP32 (own sums' {e_own:.2e}, bound {bound:.1e})");
            if e / bound > closest.0 {
                closest = (e / bound, e, e_own, name.clone());
            }
        }
        println!(
            "join sums, ResNet-50 {precision:?} step: loss and {stats} running statistics bit for bit; gradient \
             closest to its bound: {} rel err {:.2e} vs FP32 (own sums' {:.2e}); {taken} joins took the sums",
            closest.3, closest.1, closest.2
        );
    }
    Ok(())
}

/// The explicit step with the block-output joins folded into the conv1 grad-inputs (`join_in_conv`) against the
/// step with the joins as their own launches: a ResNet-50 step (224 px, batch 16, bf16 and fp16, cooperative
/// BatchNorm with the ReLU masks, TMA tile x128 forced) must give the loss, every gradient and every running
/// statistic bit for bit, with the folds counted: ResNet-50 has 12 identity bottlenecks; at this size layer4's
/// two have too few tiles (the plain pass could split K), so 10 fold.
#[test]
fn join_in_conv_step_matches_bit_for_bit() -> Result<()> {
    use kernels::variants::X128;
    use kernels::Tuning;
    let gpu = cuda()?;
    let x = Tensor::randn(0f32, 1.0, (16, 3, 224, 224), &Device::Cpu)?.to_device(&gpu)?;
    let labels = Tensor::new((0..16u32).map(|i| i % 10).collect::<Vec<_>>().as_slice(), &gpu)?;
    for precision in [Precision::Bf16, Precision::F16] {
        let step = |join_in_conv: bool| {
            let policy = KernelPolicy { join_in_conv, ..KernelPolicy::custom().with_tuning(Tuning::Forced(X128)) };
            join_step(&gpu, (&x, &labels), precision, policy, kernels::ops::conv_nhwc::joined_grad_inputs)
        };
        let (lb, base, none) = step(false)?;
        let (lf, folded, folds) = step(true)?;
        let what = format!("{precision:?} join_in_conv");
        ensure!(none == 0 && folds == 10, "{what}: {folds} of 10 joins folded ({none} with the switch off)");
        ensure!(lb.to_bits() == lf.to_bits(), "{what}: loss {lf} folded, {lb} as a pass");
        ensure_same_bits(&what, &folded, &base)?;
        println!(
            "join_in_conv, ResNet-50 {precision:?} step: loss and {} tensors bit for bit with the joins as a pass; \
             {folds} joins folded into conv1 grad-inputs",
            base.len()
        );
    }
    Ok(())
}
