//! The fused channels-last BatchNorm op (kernels::batch_norm_nhwc_train, CPU reference) against BatchNorm2d's
//! candle composition in FP32: forward (y, batch mean, biased batch variance) and backward (dx, dweight, dbias),
//! with and without the fused ReLU, f32 exactly-enough and bf16/f16 loosely.

use candle_core::{DType, Device, Tensor, Var};
use integration_tests::{flat, max_err};

const EPS: f64 = 1e-5;

/// BatchNorm2d's training-mode math as candle ops in FP32 over (rows, c): y, mean, biased var.
fn composed(x: &Tensor, w: &Tensor, b: &Tensor, relu: bool) -> (Tensor, Tensor, Tensor) {
    let c = *x.dims().last().unwrap();
    let x = x.to_dtype(DType::F32).unwrap().reshape(((), c)).unwrap();
    let mean = x.mean_keepdim(0).unwrap();
    let xc = x.broadcast_sub(&mean).unwrap();
    let var = xc.sqr().unwrap().mean_keepdim(0).unwrap();
    let inv = (var.clone() + EPS).unwrap().sqrt().unwrap().recip().unwrap();
    let mut y = xc
        .broadcast_mul(&inv)
        .unwrap()
        .broadcast_mul(&w.reshape((1, c)).unwrap())
        .unwrap()
        .broadcast_add(&b.reshape((1, c)).unwrap())
        .unwrap();
    if relu {
        y = y.relu().unwrap();
    }
    (y, mean.flatten_all().unwrap(), var.flatten_all().unwrap())
}

struct Case {
    dims: Vec<usize>,
    relu: bool,
}

fn cases() -> Vec<Case> {
    let shapes: [&[usize]; 6] = [&[2, 1], &[1, 1, 2, 3], &[3, 5, 5, 24], &[2, 3, 4, 13], &[4, 4, 4, 1], &[2, 7, 7, 40]];
    let mut v = Vec::new();
    for s in shapes {
        for relu in [false, true] {
            v.push(Case { dims: s.to_vec(), relu });
        }
    }
    v
}

/// Random per-channel affine parameters (weight of both signs and one zero) and an input with a per-channel offset.
fn inputs(dims: &[usize]) -> (Tensor, Tensor, Tensor, Tensor) {
    let dev = Device::Cpu;
    let c = *dims.last().unwrap();
    let offs = (Tensor::randn(0f32, 3.0, c, &dev).unwrap()).reshape((1, c)).unwrap();
    let x = Tensor::randn(0f32, 2.0, dims, &dev).unwrap();
    let x = x.reshape(((), c)).unwrap().broadcast_add(&offs).unwrap().reshape(dims).unwrap();
    let mut w = flat(&Tensor::randn(0f32, 1.0, c, &dev).unwrap());
    if c > 2 {
        w[1] = 0.0;
    }
    let w = Tensor::from_vec(w, c, &dev).unwrap();
    let b = Tensor::randn(0f32, 0.5, c, &dev).unwrap();
    let dy = Tensor::randn(0f32, 1.0, dims, &dev).unwrap();
    (x, w, b, dy)
}

/// (y, mean, var, dx, dw, db) of the fused op on x in `dt` (weight/bias FP32).
fn run_fused(x: &Tensor, w: &Tensor, b: &Tensor, dy: &Tensor, relu: bool, dt: DType) -> [Tensor; 6] {
    let (xv, wv, bv) = (
        Var::from_tensor(&x.to_dtype(dt).unwrap()).unwrap(),
        Var::from_tensor(w).unwrap(),
        Var::from_tensor(b).unwrap(),
    );
    let (y, mean, var) =
        kernels::batch_norm_nhwc_train(xv.as_tensor(), wv.as_tensor(), bv.as_tensor(), EPS, relu).unwrap();
    assert_eq!(y.dtype(), dt);
    assert_eq!((mean.dtype(), var.dtype()), (DType::F32, DType::F32));
    let loss = y.to_dtype(DType::F32).unwrap().mul(dy).unwrap().sum_all().unwrap();
    let g = loss.backward().unwrap();
    assert!(g.get(&mean).is_none() && g.get(&var).is_none());
    let dx = g.get(xv.as_tensor()).unwrap().clone();
    let (dw, db) = (g.get(wv.as_tensor()).unwrap().clone(), g.get(bv.as_tensor()).unwrap().clone());
    assert_eq!(dx.dtype(), dt);
    assert_eq!((dw.dtype(), db.dtype()), (DType::F32, DType::F32));
    [y, mean, var, dx, dw, db]
}

/// The same quantities from the candle composition in FP32 (autograd through candle's ops).
fn run_composed(x: &Tensor, w: &Tensor, b: &Tensor, dy: &Tensor, relu: bool) -> [Tensor; 6] {
    let (xv, wv, bv) = (Var::from_tensor(x).unwrap(), Var::from_tensor(w).unwrap(), Var::from_tensor(b).unwrap());
    let (y, mean, var) = composed(xv.as_tensor(), wv.as_tensor(), bv.as_tensor(), relu);
    let y = y.reshape(x.dims()).unwrap();
    let loss = y.mul(dy).unwrap().sum_all().unwrap();
    let g = loss.backward().unwrap();
    let dx = g.get(xv.as_tensor()).unwrap().clone();
    let (dw, db) = (g.get(wv.as_tensor()).unwrap().clone(), g.get(bv.as_tensor()).unwrap().clone());
    [y, mean.detach(), var.detach(), dx, dw, db]
}

/// max(1, max |weight| / sqrt(var + eps)): the largest per-channel gain of the normalisation.
fn max_gain(w: &Tensor, var: &Tensor) -> f32 {
    flat(w).iter().zip(flat(var)).fold(1f32, |m, (w, v)| m.max(w.abs() / (v + EPS as f32).sqrt()))
}

const NAMES: [&str; 6] = ["y", "mean", "var", "dx", "dweight", "dbias"];

/// f32: the fused op equals the composition to FP32 rounding, forward and backward, on every shape.
#[test]
fn batchnorm_nhwc_f32_matches_composition() {
    for case in &cases() {
        let (x, w, b, dy) = inputs(&case.dims);
        let got = run_fused(&x, &w, &b, &dy, case.relu, DType::F32);
        let want = run_composed(&x, &w, &b, &dy, case.relu);
        for (k, (g, r)) in got.iter().zip(&want).enumerate() {
            // dx = a * (g - mean(g) - xhat * mean(g * xhat)) with a = weight * invstd: its rounding error scales with
            // a (large where a channel's variance is small; two-row batches have dx ~ 0, all of it cancellation).
            let e =
                if NAMES[k] == "dx" { max_err(g, r).unwrap() / max_gain(&w, &want[2]) } else { max_err(g, r).unwrap() };
            assert!(e < 2e-5, "{:?} relu={} {}: max err {e:e}", case.dims, case.relu, NAMES[k]);
        }
    }
}

/// bf16/f16 inputs: the fused op (FP32 statistics, y and dx rounded once) stays close to the f32 composition on
/// the same rounded input and output gradient.
#[test]
fn batchnorm_nhwc_low_precision_close_to_f32() {
    for case in &cases() {
        let (x, w, b, dy) = inputs(&case.dims);
        for dt in [DType::BF16, DType::F16] {
            // The reference sees the same rounded input and output gradient (the op's backward receives dy in dt).
            let round = |t: &Tensor| t.to_dtype(dt).unwrap().to_dtype(DType::F32).unwrap();
            let (xr, dyr) = (round(&x), round(&dy));
            let got = run_fused(&xr, &w, &b, &dyr, case.relu, dt);
            let want = run_composed(&xr, &w, &b, &dyr, case.relu);
            let tol = if dt == DType::BF16 { 2e-2 } else { 4e-3 };
            for (k, (g, r)) in got.iter().zip(&want).enumerate() {
                let e = max_err(g, r).unwrap();
                assert!(e < tol, "{:?} relu={} {dt:?} {}: max err {e:e}", case.dims, case.relu, NAMES[k]);
            }
        }
    }
}

/// The fused ReLU equals relu() after the op without it, and its gradient is masked where y == 0.
#[test]
fn batchnorm_nhwc_fused_relu_matches_separate() {
    let (x, w, b, dy) = inputs(&[3, 4, 4, 8]);
    let fused = run_fused(&x, &w, &b, &dy, true, DType::F32);
    let xv = Var::from_tensor(&x).unwrap();
    let (y, _, _) = kernels::batch_norm_nhwc_train(xv.as_tensor(), &w, &b, EPS, false).unwrap();
    let y = y.relu().unwrap();
    assert_eq!(flat(&y), flat(&fused[0]));
    let g = y.mul(&dy).unwrap().sum_all().unwrap().backward().unwrap();
    let e = max_err(&fused[3], g.get(xv.as_tensor()).unwrap()).unwrap();
    assert!(e < 1e-6, "dx max err {e:e}");
}

/// Bad arguments are rejected.
#[test]
fn batchnorm_nhwc_rejects_bad_arguments() {
    let dev = Device::Cpu;
    let x = Tensor::zeros((2, 3, 3, 4), DType::F32, &dev).unwrap();
    let w = Tensor::ones(4, DType::F32, &dev).unwrap();
    assert!(kernels::batch_norm_nhwc_train(&x, &w.narrow(0, 0, 3).unwrap(), &w, EPS, false).is_err());
    assert!(kernels::batch_norm_nhwc_train(&x, &w.to_dtype(DType::BF16).unwrap(), &w, EPS, false).is_err());
    assert!(kernels::batch_norm_nhwc_train(&x.to_dtype(DType::F64).unwrap(), &w, &w, EPS, false).is_err());
    assert!(kernels::batch_norm_nhwc_train(&Tensor::zeros(4, DType::F32, &dev).unwrap(), &w, &w, EPS, false).is_err());
    // A strided input is made contiguous.
    let xt = Tensor::randn(0f32, 1.0, (4, 3, 3, 2), &dev).unwrap().permute((3, 1, 2, 0)).unwrap();
    let (y, _, _) = kernels::batch_norm_nhwc_train(&xt, &w, &w, EPS, false).unwrap();
    let (yc, _, _) = kernels::batch_norm_nhwc_train(&xt.contiguous().unwrap(), &w, &w, EPS, false).unwrap();
    assert_eq!(flat(&y), flat(&yc));
}

/// BatchNorm2d in channels-last training mode with the fused op (forced on the CPU) equals its candle composition:
/// output, ReLU-fused output, gradients of the input, weight and bias, running statistics and the batch counter.
#[test]
fn batchnorm2d_fused_matches_composed() {
    use resnet::layers::{BatchNorm2d, Builder, Ctx};
    let dev = Device::Cpu;
    let (x, w, b, dy) = inputs(&[3, 4, 6, 5]);
    // (y, dx, dweight, dbias, running_mean, running_var, num_batches_tracked) of two steps, the second with ReLU.
    let run = |fused: bool| {
        let store = resnet::ParamStore::new(&dev);
        let bn = BatchNorm2d::new(&Builder::new(&store, 0).pp("bn"), 5, false).unwrap();
        store.set("bn.weight", &w).unwrap();
        store.set("bn.bias", &b).unwrap();
        let kernels = kernels::KernelPolicy { fused_batchnorm_on_cpu: fused, ..kernels::KernelPolicy::custom() };
        let ctx = Ctx { train: true, act: DType::F32, kernels };
        let mut out = Vec::new();
        for relu in [false, true] {
            let xv = Var::from_tensor(&x).unwrap();
            let y =
                if relu { bn.forward_relu(xv.as_tensor(), &ctx) } else { bn.forward(xv.as_tensor(), &ctx) }.unwrap();
            let g = y.mul(&dy).unwrap().sum_all().unwrap().backward().unwrap();
            out.push(y.clone());
            for t in [xv.as_tensor(), bn.weight.var().as_tensor(), bn.bias.var().as_tensor()] {
                out.push(g.get(t).unwrap().clone());
            }
        }
        out.push(bn.running_mean.tensor());
        out.push(bn.running_var.tensor());
        assert_eq!(bn.num_batches_tracked.tensor().to_scalar::<i64>().unwrap(), 2);
        out
    };
    let (fused, composed) = (run(true), run(false));
    for (i, (f, c)) in fused.iter().zip(&composed).enumerate() {
        let e = max_err(f, c).unwrap();
        assert!(e < 1e-5, "output {i}: max err {e:e}");
    }
}

/// The stem's BatchNorm + ReLU + 3x3/2/1 max-pool op (kernels::ops::batchnorm::batch_norm_train_relu_max_pool,
/// its CPU path) against the candle composition and a max-pool by hand: y within 1e-5 of each window's maximum of
/// relu(bn(x)), every offset naming a cell of its window that holds that maximum, the running statistics updated
/// with the unbiased variance; a tensor that is not (n, h, w, c) is a one-line error.
#[test]
fn stem_bn_relu_max_pool_matches_composition() {
    use kernels::ops::batchnorm::{batch_norm_train_relu_max_pool, Running, TrainBn};
    use kernels::MaxPool2d;
    let pool = MaxPool2d { kernel: 3, stride: 2, padding: 1 };
    let diff = |a: &[f32], b: &[f32]| a.iter().zip(b).fold(0f32, |m, (p, q)| m.max((p - q).abs()));
    for (n, h, w, c) in [(2, 7, 9, 16), (1, 8, 8, 8), (3, 5, 4, 24)] {
        let x = (Tensor::randn(0f32, 2.0, (n, h, w, c), &Device::Cpu).unwrap() + 0.5).unwrap();
        let wt = Tensor::randn(0f32, 1.0, c, &Device::Cpu).unwrap();
        let bt = Tensor::randn(0f32, 0.5, c, &Device::Cpu).unwrap();
        let (rm, rv) =
            (Var::zeros(c, DType::F32, &Device::Cpu).unwrap(), Var::ones(c, DType::F32, &Device::Cpu).unwrap());
        let nb = Var::from_tensor(&Tensor::new(0i64, &Device::Cpu).unwrap()).unwrap();
        let running = Running { mean: &rm, var: &rv, num_batches_tracked: &nb, momentum: 0.1 };
        let bn = TrainBn { weight: wt.clone(), bias: bt.clone(), eps: EPS, running };
        let (stats, y, off) = batch_norm_train_relu_max_pool(&x, None, &bn, pool).unwrap();
        let (oh, ow) = ((h - 1) / 2 + 1, (w - 1) / 2 + 1);
        assert_eq!(y.dims(), &[n, oh, ow, c]);
        assert_eq!(off.dims(), &[n, oh, ow, c]);
        assert_eq!(off.dtype(), DType::U8);
        let (a, mean, var) = composed(&x, &wt, &bt, true);
        let a = flat(&a);
        let (y, off) = (flat(&y), off.flatten_all().unwrap().to_vec1::<u8>().unwrap());
        for (i, (&yv, &o)) in y.iter().zip(&off).enumerate() {
            let (ch, pix) = (i % c, i / c);
            let (img, oy, ox) = (pix / (oh * ow), pix / ow % oh, pix % ow);
            let cell = |ky: usize, kx: usize| -> Option<f32> {
                let (iy, ix) = ((2 * oy + ky).checked_sub(1)?, (2 * ox + kx).checked_sub(1)?);
                (iy < h && ix < w).then(|| a[((img * h + iy) * w + ix) * c + ch])
            };
            let max = (0..9).filter_map(|k| cell(k / 3, k % 3)).fold(f32::NEG_INFINITY, f32::max);
            assert!((yv - max).abs() <= 1e-5, "{:?} y[{i}] = {yv}, window maximum {max}", (n, h, w, c));
            let at = cell(o as usize / 3, o as usize % 3);
            assert!(
                o < 9 && at.is_some_and(|v| (v - max).abs() <= 1e-5),
                "{:?} offset[{i}] = {o} names {at:?}, window maximum {max}",
                (n, h, w, c)
            );
        }
        let s = flat(&stats);
        assert!(diff(&s[..c], &flat(&mean)) < 1e-5 && diff(&s[c..2 * c], &flat(&var)) < 1e-4);
        let rows = (n * h * w) as f32;
        let want_rv: Vec<f32> = flat(&var).iter().map(|v| 0.9 + 0.1 * v * rows / (rows - 1.0)).collect();
        assert!(diff(&flat(rm.as_tensor()), &flat(&mean).iter().map(|m| 0.1 * m).collect::<Vec<_>>()) < 1e-6);
        assert!(diff(&flat(rv.as_tensor()), &want_rv) < 1e-5);
        assert_eq!(nb.as_tensor().to_scalar::<i64>().unwrap(), 1);
    }
    let (rm, rv) = (Var::zeros(4, DType::F32, &Device::Cpu).unwrap(), Var::ones(4, DType::F32, &Device::Cpu).unwrap());
    let nb = Var::from_tensor(&Tensor::new(0i64, &Device::Cpu).unwrap()).unwrap();
    let running = Running { mean: &rm, var: &rv, num_batches_tracked: &nb, momentum: 0.1 };
    let ones = Tensor::ones(4, DType::F32, &Device::Cpu).unwrap();
    let bn = TrainBn { weight: ones.clone(), bias: ones.zeros_like().unwrap(), eps: EPS, running };
    let flat3 = Tensor::zeros((6, 5, 4), DType::F32, &Device::Cpu).unwrap();
    let e = batch_norm_train_relu_max_pool(&flat3, None, &bn, pool).unwrap_err().to_string();
    assert!(e.contains("(n, h, w, c)") && !e.contains('\n'), "{e}");
}

/// The backward of the stem's BatchNorm + ReLU + max-pool (kernels::ops::batchnorm::
/// batch_norm_train_relu_max_pool_backward, its CPU path: the pool's backward of g1 + g2 from the offsets, then
/// the BatchNorm + ReLU backward) against candle's autograd through the composition (BatchNorm in FP32 candle
/// ops, ReLU, the NHWC max-pool op with its own backward), for the loss sum(pool(relu(bn(x))) * (g1 + g2)): dx,
/// dweight and dbias; mis-shaped gradients are one-line errors.
#[test]
fn stem_bn_relu_max_pool_backward_matches_autograd() {
    use kernels::ops::batchnorm::{
        batch_norm_train_relu_max_pool, batch_norm_train_relu_max_pool_backward, BnGrad, Running, TrainBn,
    };
    use kernels::MaxPool2d;
    let pool = MaxPool2d { kernel: 3, stride: 2, padding: 1 };
    let cpu = Device::Cpu;
    let diff = |a: &[f32], b: &[f32]| a.iter().zip(b).fold(0f32, |m, (p, q)| m.max((p - q).abs()));
    for (n, h, w, c) in [(2, 7, 9, 16), (1, 8, 8, 8), (3, 5, 4, 24)] {
        let x = (Tensor::randn(0f32, 2.0, (n, h, w, c), &cpu).unwrap() + 0.5).unwrap();
        let (wt, bt) = (Tensor::randn(0f32, 1.0, c, &cpu).unwrap(), Tensor::randn(0f32, 0.5, c, &cpu).unwrap());
        let (oh, ow) = ((h - 1) / 2 + 1, (w - 1) / 2 + 1);
        let g1 = Tensor::randn(0f32, 1.0, (n, oh, ow, c), &cpu).unwrap();
        let g2 = Tensor::randn(0f32, 1.0, (n, oh, ow, c), &cpu).unwrap();
        let (rm, rv) = (Var::zeros(c, DType::F32, &cpu).unwrap(), Var::ones(c, DType::F32, &cpu).unwrap());
        let nb = Var::from_tensor(&Tensor::new(0i64, &cpu).unwrap()).unwrap();
        let running = Running { mean: &rm, var: &rv, num_batches_tracked: &nb, momentum: 0.1 };
        let bn = TrainBn { weight: wt.clone(), bias: bt.clone(), eps: EPS, running };
        let (stats, _, off) = batch_norm_train_relu_max_pool(&x, None, &bn, pool).unwrap();
        let op = BnGrad { relu: true, stats, weight: wt.clone(), bias: bt.clone(), sums: None };
        let (sums, dx) = batch_norm_train_relu_max_pool_backward(&x, &off, (&g1, Some(&g2)), &op, pool).unwrap();
        assert_eq!(sums.dims(), &[2, c]);
        assert_eq!(dx.dims(), x.dims());

        let (xv, wv, bv) =
            (Var::from_tensor(&x).unwrap(), Var::from_tensor(&wt).unwrap(), Var::from_tensor(&bt).unwrap());
        let xs = xv.as_tensor().reshape(((), c)).unwrap();
        let mean = xs.mean_keepdim(0).unwrap();
        let xc = xs.broadcast_sub(&mean).unwrap();
        let var = xc.sqr().unwrap().mean_keepdim(0).unwrap();
        let inv = (var + EPS).unwrap().sqrt().unwrap().recip().unwrap();
        let y = xc
            .broadcast_mul(&inv)
            .unwrap()
            .broadcast_mul(&wv.as_tensor().reshape((1, c)).unwrap())
            .unwrap()
            .broadcast_add(&bv.as_tensor().reshape((1, c)).unwrap())
            .unwrap()
            .relu()
            .unwrap()
            .reshape((n, h, w, c))
            .unwrap();
        let pooled = kernels::ops::maxpool::max_pool2d_nhwc(&y, 3, 2, 1).unwrap();
        let loss = (pooled * (&g1 + &g2).unwrap()).unwrap().sum_all().unwrap();
        let grads = loss.backward().unwrap();
        let (gx, gw, gb) = (grads.get(&xv).unwrap(), grads.get(&wv).unwrap(), grads.get(&bv).unwrap());
        let s = flat(&sums);
        let scale = flat(gx).iter().fold(1f32, |m, v| m.max(v.abs()));
        let what = format!("{:?}", (n, h, w, c));
        assert!(diff(&flat(&dx), &flat(gx)) <= 1e-4 * scale, "{what}: dx {}", diff(&flat(&dx), &flat(gx)));
        assert!(diff(&s[c..], &flat(gw)) <= 1e-3, "{what}: dweight {}", diff(&s[c..], &flat(gw)));
        assert!(diff(&s[..c], &flat(gb)) <= 1e-3, "{what}: dbias {}", diff(&s[..c], &flat(gb)));

        let bad = Tensor::zeros((n, oh + 1, ow, c), DType::F32, &cpu).unwrap();
        let e = batch_norm_train_relu_max_pool_backward(&x, &off, (&g1, Some(&bad)), &op, pool).unwrap_err();
        let e = e.to_string();
        assert!(e.contains("second grad") && !e.contains('\n'), "{e}");
    }
}
