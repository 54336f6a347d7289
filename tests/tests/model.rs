//! Model crate tests: parameter counts, shapes, BatchNorm and max-pool numerics, gradients, weights IO.

use candle_core::{DType, Device, Tensor, D};
use kernels::ops::maxpool::{
    max_pool2d_nhwc_backward_offsets_sum, MaxPool2dNhwcBackwardOffsets, MaxPool2dNhwcBackwardOffsetsSum,
    MaxPool2dNhwcOffsets,
};
use resnet::weights;
use resnet::{Arch, Precision, ResNet, ResNetConfig, Stem};

fn cfg(arch: Arch, classes: usize, stem: Stem) -> ResNetConfig {
    ResNetConfig { arch, num_classes: classes, stem, zero_init_residual: false, seed: 7, kernels: Default::default() }
}

fn tmp(name: &str) -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("resnet-model-test-{}-{name}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d
}

#[test]
fn parameter_counts_match_torchvision() {
    let expected = [
        (Arch::ResNet18, 11_689_512),
        (Arch::ResNet34, 21_797_672),
        (Arch::ResNet50, 25_557_032),
        (Arch::ResNet101, 44_549_160),
        (Arch::ResNet152, 60_192_808),
    ];
    for (arch, n) in expected {
        let m = ResNet::new(cfg(arch, 1000, Stem::ImageNet), &Device::Cpu).unwrap();
        assert_eq!(m.store().num_parameters(), n, "{}", arch.name());
    }
}

#[test]
fn torchvision_key_names() {
    let m = ResNet::new(cfg(Arch::ResNet50, 1000, Stem::ImageNet), &Device::Cpu).unwrap();
    let names: Vec<String> = m.store().entries().into_iter().map(|(n, _)| n).collect();
    for k in [
        "conv1.weight",
        "bn1.running_mean",
        "bn1.num_batches_tracked",
        "layer3.4.conv2.weight",
        "layer1.0.downsample.0.weight",
        "layer1.0.downsample.1.running_var",
        "layer4.2.bn3.bias",
        "fc.weight",
        "fc.bias",
    ] {
        assert!(names.iter().any(|n| n == k), "missing {k}");
    }
    // torchvision resnet50's state_dict has 320 entries (params + buffers).
    assert_eq!(names.len(), 320);
}

#[test]
fn output_shapes_224_and_32() {
    let dev = Device::Cpu;
    let m = ResNet::new(cfg(Arch::ResNet18, 1000, Stem::ImageNet), &dev).unwrap();
    let x = Tensor::randn(0f32, 1., (1, 3, 224, 224), &dev).unwrap();
    assert_eq!(m.forward(&x, false, Precision::F32).unwrap().dims(), &[1, 1000]);
    let shapes = m.stage_shapes(1, 224);
    assert_eq!(shapes[0].shape, vec![1, 64, 56, 56]);
    assert_eq!(shapes[4].shape, vec![1, 512, 7, 7]);

    let m = ResNet::new(cfg(Arch::ResNet50, 10, Stem::Cifar), &dev).unwrap();
    let x = Tensor::randn(0f32, 1., (2, 3, 32, 32), &dev).unwrap();
    assert_eq!(m.forward(&x, true, Precision::F32).unwrap().dims(), &[2, 10]);
    let shapes = m.stage_shapes(2, 32);
    assert_eq!(shapes[1].shape, vec![2, 256, 32, 32]);
    assert_eq!(shapes[4].shape, vec![2, 2048, 4, 4]);
}

/// Hand-computed BatchNorm over a (2, 2, 1, 2) input, train then eval, running stats included.
#[test]
fn batchnorm_train_and_eval_numerics() {
    use resnet::layers::{BatchNorm2d, Builder, Ctx};
    let dev = Device::Cpu;
    let store = resnet::ParamStore::new(&dev);
    let bn = BatchNorm2d::new(&Builder::new(&store, 0).pp("bn"), 2, false).unwrap();
    store.set("bn.weight", &Tensor::new(&[2f32, 0.5], &dev).unwrap()).unwrap();
    store.set("bn.bias", &Tensor::new(&[1f32, -1.0], &dev).unwrap()).unwrap();
    // channel 0 values: 1, 2, 3, 6 (mean 3, biased var 3.5, unbiased 14/3); channel 1: 4, 4, 0, 8 (mean 4, var 8, unbiased 32/3)
    let x = Tensor::new(&[[[[1f32, 2.]], [[4., 4.]]], [[[3., 6.]], [[0., 8.]]]], &dev).unwrap();
    let y = bn.forward(&x, &Ctx::new(true, DType::F32)).unwrap();
    let y: Vec<f32> = y.flatten_all().unwrap().to_vec1().unwrap();
    let eps = 1e-5f32;
    let n0 = |v: f32| 2.0 * (v - 3.0) / (3.5 + eps).sqrt() + 1.0;
    let n1 = |v: f32| 0.5 * (v - 4.0) / (8.0 + eps).sqrt() - 1.0;
    let want = [n0(1.), n0(2.), n1(4.), n1(4.), n0(3.), n0(6.), n1(0.), n1(8.)];
    for (a, b) in y.iter().zip(want) {
        assert!((a - b).abs() < 1e-5, "{y:?} vs {want:?}");
    }
    let rm: Vec<f32> = bn.running_mean.tensor().to_vec1().unwrap();
    let rv: Vec<f32> = bn.running_var.tensor().to_vec1().unwrap();
    assert!((rm[0] - 0.3).abs() < 1e-6 && (rm[1] - 0.4).abs() < 1e-6, "{rm:?}");
    assert!((rv[0] - (0.9 + 0.1 * 14.0 / 3.0)).abs() < 1e-5, "{rv:?}");
    assert!((rv[1] - (0.9 + 0.1 * 32.0 / 3.0)).abs() < 1e-5, "{rv:?}");
    assert_eq!(bn.num_batches_tracked.tensor().to_scalar::<i64>().unwrap(), 1);
    // Eval uses the running statistics and leaves them alone.
    let y = bn.forward(&x, &Ctx::new(false, DType::F32)).unwrap();
    let y: Vec<f32> = y.flatten_all().unwrap().to_vec1().unwrap();
    let e0 = |v: f32| 2.0 * (v - rm[0]) / (rv[0] + eps).sqrt() + 1.0;
    assert!((y[0] - e0(1.0)).abs() < 1e-5);
    let rm2: Vec<f32> = bn.running_mean.tensor().to_vec1().unwrap();
    assert_eq!(rm, rm2);
    // Low-precision input: statistics in FP32, output in the input dtype.
    let yb = bn.forward(&x.to_dtype(DType::BF16).unwrap(), &Ctx::new(true, DType::BF16)).unwrap();
    assert_eq!(yb.dtype(), DType::BF16);
    assert_eq!(bn.running_mean.tensor().dtype(), DType::F32);
}

fn naive_maxpool(
    x: &[f32],
    (n, c, h, w): (usize, usize, usize, usize),
    k: usize,
    s: usize,
    p: usize,
) -> (Vec<f32>, Vec<usize>) {
    let oh = (h + 2 * p - k) / s + 1;
    let ow = (w + 2 * p - k) / s + 1;
    let mut out = vec![];
    let mut arg = vec![];
    for plane in 0..n * c {
        for oy in 0..oh {
            for ox in 0..ow {
                let mut best = f32::NEG_INFINITY;
                let mut bi = usize::MAX;
                for ky in 0..k {
                    for kx in 0..k {
                        let (yy, xx) = ((oy * s + ky) as isize - p as isize, (ox * s + kx) as isize - p as isize);
                        if yy >= 0 && xx >= 0 && (yy as usize) < h && (xx as usize) < w {
                            let i = plane * h * w + yy as usize * w + xx as usize;
                            if x[i] > best {
                                best = x[i];
                                bi = i;
                            }
                        }
                    }
                }
                out.push(best);
                arg.push(bi);
            }
        }
    }
    (out, arg)
}

#[test]
fn maxpool_forward_backward_against_reference() {
    let dev = Device::Cpu;
    for &(dims, k, s, p) in
        &[((2, 3, 7, 9), 3, 2, 1), ((1, 2, 8, 8), 3, 2, 1), ((1, 1, 5, 5), 2, 2, 0), ((2, 2, 6, 5), 3, 1, 1)]
    {
        let (n, c, h, w) = dims;
        let x = Tensor::randn(0f32, 1., (n, c, h, w), &dev).unwrap();
        let xv: Vec<f32> = x.flatten_all().unwrap().to_vec1().unwrap();
        let (want, arg) = naive_maxpool(&xv, dims, k, s, p);
        let var = candle_core::Var::from_tensor(&x).unwrap();
        let y = kernels::max_pool2d(var.as_tensor(), k, s, p).unwrap();
        let yv: Vec<f32> = y.flatten_all().unwrap().to_vec1().unwrap();
        assert_eq!(yv, want, "forward {dims:?} k{k} s{s} p{p}");
        // Backward with random upstream grads: each grad lands on its window's argmax.
        let g = Tensor::randn(0f32, 1., y.dims(), &dev).unwrap();
        let loss = (y * &g).unwrap().sum_all().unwrap();
        let grads = loss.backward().unwrap();
        let gx: Vec<f32> = grads.get(var.as_tensor()).unwrap().flatten_all().unwrap().to_vec1().unwrap();
        let gv: Vec<f32> = g.flatten_all().unwrap().to_vec1().unwrap();
        let mut want_g = vec![0f32; xv.len()];
        for (o, &i) in arg.iter().enumerate() {
            want_g[i] += gv[o];
        }
        for (a, b) in gx.iter().zip(&want_g) {
            assert!((a - b).abs() < 1e-6, "backward {dims:?}");
        }
        // Finite differences on a few inputs. A step that changes some window's argmax (two values within 1e-3 of
        // each other: random inputs have such near-ties now and then) straddles a kink of the max: the difference
        // is then no derivative, and that input is skipped (the exact check above covers it).
        let loss_at = |xs: &[f32]| -> f64 {
            let (o, _) = naive_maxpool(xs, dims, k, s, p);
            o.iter().zip(&gv).map(|(a, b)| (*a as f64) * (*b as f64)).sum()
        };
        for i in [0, xv.len() / 3, xv.len() - 1, w - 1, (h - 1) * w] {
            let mut xp = xv.clone();
            xp[i] += 1e-3;
            let mut xm = xv.clone();
            xm[i] -= 1e-3;
            if naive_maxpool(&xp, dims, k, s, p).1 != arg || naive_maxpool(&xm, dims, k, s, p).1 != arg {
                continue;
            }
            let fd = (loss_at(&xp) - loss_at(&xm)) / 2e-3;
            assert!((fd - gx[i] as f64).abs() < 1e-2, "fd {fd} vs {} at {i}", gx[i]);
        }
    }
}

#[test]
fn maxpool_low_precision_matches_f32() {
    let dev = Device::Cpu;
    let x = Tensor::randn(0f32, 1., (2, 4, 9, 9), &dev).unwrap().to_dtype(DType::BF16).unwrap();
    let a = kernels::max_pool2d(&x, 3, 2, 1).unwrap().to_dtype(DType::F32).unwrap();
    let b = kernels::max_pool2d(&x.to_dtype(DType::F32).unwrap(), 3, 2, 1).unwrap();
    let d = (a - b).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
    assert_eq!(d, 0.0);
    assert!(kernels::max_pool2d(&Tensor::zeros((2, 2), DType::F32, &dev).unwrap(), 3, 2, 1).is_err());
}

/// Gradient check of a tiny ResNet (BasicBlocks, train-mode BatchNorm) against central finite differences.
#[test]
fn tiny_resnet_gradients_match_finite_differences() {
    let dev = Device::Cpu;
    let m = ResNet::new(cfg(Arch::ResNet18, 5, Stem::ImageNet), &dev).unwrap();
    // A fixed input: drawn anew each run, a stem coordinate's ReLU or max-pool kink fell inside +-eps in two of the
    // checked coordinates at once about one run in many (CI, 2026-12-07), and the test failed at random.
    let x = integration_tests::seeded_randn(&[4, 3, 64, 64], 20261208);
    let labels = Tensor::new(&[0u32, 1, 2, 3], &dev).unwrap();
    let loss_fn = |m: &ResNet| -> Tensor {
        let logits = m.forward(&x, true, Precision::F32).unwrap();
        candle_nn_free_xent(&logits, &labels)
    };
    let loss = loss_fn(&m);
    let grads = loss.backward().unwrap();
    let names = [
        "conv1.weight",
        "layer1.0.conv2.weight",
        "layer2.0.downsample.0.weight",
        "layer3.1.bn2.weight",
        "layer4.1.conv1.weight",
        "fc.weight",
        "fc.bias",
    ];
    let mut checked = 0;
    let mut outliers = vec![];
    for name in names {
        let e = m.store().get(name).unwrap();
        let var = e.param.var().clone();
        let g: Vec<f32> = grads.get(var.as_tensor()).unwrap().flatten_all().unwrap().to_vec1().unwrap();
        let base: Vec<f32> = var.as_tensor().flatten_all().unwrap().to_vec1().unwrap();
        // The coordinate with the largest gradient, and one more, per tensor.
        let imax = g.iter().enumerate().max_by(|a, b| a.1.abs().total_cmp(&b.1.abs())).unwrap().0;
        for i in [imax, g.len() / 2] {
            let eps = 1e-3f32;
            let eval = |delta: f32| -> f64 {
                let mut v = base.clone();
                v[i] += delta;
                var.set(&Tensor::from_vec(v, var.dims(), &dev).unwrap()).unwrap();
                loss_fn(&m).to_scalar::<f32>().unwrap() as f64
            };
            let fd = (eval(eps) - eval(-eps)) / (2.0 * eps as f64);
            var.set(&Tensor::from_vec(base.clone(), var.dims(), &dev).unwrap()).unwrap();
            let an = g[i] as f64;
            // ReLU and max-pool kinks can fall inside +-eps for a coordinate: allow one outlier in all.
            let tol = 5e-2 * fd.abs().max(an.abs()) + 2e-3;
            if (fd - an).abs() > tol {
                outliers.push(format!("{name}[{i}]: finite difference {fd} vs backward {an}"));
            }
            checked += 1;
        }
    }
    assert_eq!(checked, 14);
    println!("finite differences: {checked} coordinates, outliers {outliers:?}");
    assert!(outliers.len() <= 1, "{outliers:?}");
}

/// Mean cross-entropy in FP32 without candle-nn (log-sum-exp form).
fn candle_nn_free_xent(logits: &Tensor, labels: &Tensor) -> Tensor {
    let l = logits.to_dtype(DType::F32).unwrap();
    let max = l.max_keepdim(D::Minus1).unwrap().detach();
    let shifted = l.broadcast_sub(&max).unwrap();
    let lse = shifted.exp().unwrap().sum_keepdim(D::Minus1).unwrap().log().unwrap();
    let logp = shifted.broadcast_sub(&lse).unwrap();
    let picked = logp.gather(&labels.unsqueeze(1).unwrap(), 1).unwrap();
    picked.mean_all().unwrap().neg().unwrap()
}

#[test]
fn save_load_round_trip_is_bit_exact() {
    let dev = Device::Cpu;
    let dir = tmp("roundtrip");
    let a = ResNet::new(cfg(Arch::ResNet18, 10, Stem::Cifar), &dev).unwrap();
    // Move the running stats off their initial values.
    a.forward(&Tensor::randn(0f32, 1., (2, 3, 16, 16), &dev).unwrap(), true, Precision::F32).unwrap();
    let path = dir.join("w.safetensors");
    weights::save(&a, &path).unwrap();
    let b = ResNet::new(ResNetConfig { seed: 99, ..cfg(Arch::ResNet18, 10, Stem::Cifar) }, &dev).unwrap();
    let r = weights::load_into(&b, &path, false).unwrap();
    assert_eq!(r.loaded, a.store().entries().len());
    let (sa, sb) = (a.store().snapshot().unwrap(), b.store().snapshot().unwrap());
    for (k, ta) in &sa {
        let tb = &sb[k];
        assert_eq!(ta.dtype(), tb.dtype(), "{k}");
        let (va, vb) = (
            ta.flatten_all().unwrap().to_dtype(DType::F64).unwrap(),
            tb.flatten_all().unwrap().to_dtype(DType::F64).unwrap(),
        );
        assert_eq!(va.to_vec1::<f64>().unwrap(), vb.to_vec1::<f64>().unwrap(), "{k}");
    }
    assert_eq!(b.store().get("bn1.num_batches_tracked").unwrap().param.tensor().to_scalar::<i64>().unwrap(), 1);
    std::fs::remove_dir_all(dir).ok();
}

#[test]
fn wrong_weights_are_named() {
    let dev = Device::Cpu;
    let dir = tmp("wrong");
    let a = ResNet::new(cfg(Arch::ResNet18, 10, Stem::Cifar), &dev).unwrap();
    let mut snap = a.store().snapshot().unwrap();
    snap.insert("layer2.0.conv1.weight".into(), Tensor::zeros((128, 64, 1, 1), DType::F32, &dev).unwrap());
    snap.remove("layer1.1.bn1.bias");
    snap.insert("extra.weight".into(), Tensor::zeros(3, DType::F32, &dev).unwrap());
    let path = dir.join("bad.safetensors");
    weights::save_tensors(&snap, &path).unwrap();
    let e = weights::load_into(&a, &path, false).unwrap_err().to_string();
    assert!(e.contains("bad.safetensors"), "{e}");
    assert!(e.contains("layer2.0.conv1.weight"), "{e}");
    assert!(e.contains("missing: layer1.1.bn1.bias"), "{e}");
    assert!(e.contains("unexpected: extra.weight"), "{e}");
    assert!(!e.contains('\n'), "one line: {e}");

    // A different head is rejected unless a new head is asked for.
    let b = ResNet::new(cfg(Arch::ResNet18, 7, Stem::Cifar), &dev).unwrap();
    let good = dir.join("good.safetensors");
    weights::save(&a, &good).unwrap();
    let e = weights::load_into(&b, &good, false).unwrap_err().to_string();
    assert!(e.contains("fc.weight"), "{e}");
    let fc_before = b.store().get("fc.weight").unwrap().param.tensor().to_vec2::<f32>().unwrap();
    let r = weights::load_into(&b, &good, true).unwrap();
    assert!(r.head_replaced);
    assert_eq!(b.store().get("fc.weight").unwrap().param.tensor().to_vec2::<f32>().unwrap(), fc_before);

    // Garbage and missing files name the file.
    let junk = dir.join("junk.safetensors");
    std::fs::write(&junk, b"not a safetensors file").unwrap();
    let e = weights::load_into(&a, &junk, false).unwrap_err().to_string();
    assert!(e.contains("junk.safetensors"), "{e}");
    let e = weights::load_into(&a, &dir.join("nope.safetensors"), false).unwrap_err().to_string();
    assert!(e.contains("nope.safetensors") && e.contains("no such file"), "{e}");

    // Values no model has: an integer where the model keeps floats, a float counter, inf, a negative variance;
    // FP16 weights are cast (torchvision files may hold them). A trainer checkpoint's names get a hint.
    let good_snap = a.store().snapshot().unwrap();
    let fc = good_snap["fc.weight"].clone();
    let cases: Vec<(&str, Tensor, &str)> = vec![
        (
            "fc.weight",
            fc.to_dtype(DType::I64).unwrap(),
            "fc.weight is I64 in the file, the model keeps it as floating point",
        ),
        (
            "bn1.num_batches_tracked",
            Tensor::new(1f32, &dev).unwrap(),
            "bn1.num_batches_tracked is F32 in the file, the model keeps it as an integer",
        ),
        ("fc.weight", (fc.ones_like().unwrap() / 0.0).unwrap(), "fc.weight holds inf"),
        (
            "bn1.running_var",
            (good_snap["bn1.running_var"].ones_like().unwrap() * -1.0).unwrap(),
            "bn1.running_var holds -1 (a variance below zero)",
        ),
    ];
    for (name, t, want) in cases {
        let mut snap = good_snap.clone();
        snap.insert(name.into(), t);
        let p = dir.join("odd.safetensors");
        weights::save_tensors(&snap, &p).unwrap();
        let e = weights::load_into(&a, &p, false).unwrap_err().to_string();
        assert!(e.contains("odd.safetensors") && e.contains(want), "{e}");
    }
    let mut snap = good_snap.clone();
    snap.insert("fc.weight".into(), fc.to_dtype(DType::F16).unwrap());
    weights::save_tensors(&snap, &dir.join("half.safetensors")).unwrap();
    weights::load_into(&a, &dir.join("half.safetensors"), false).unwrap();
    let prefixed: std::collections::BTreeMap<String, Tensor> =
        good_snap.iter().map(|(k, v)| (format!("model.{k}"), v.clone())).collect();
    weights::save_tensors(&prefixed, &dir.join("ckpt.safetensors")).unwrap();
    let e = weights::load_into(&a, &dir.join("ckpt.safetensors"), false).unwrap_err().to_string();
    assert!(e.contains("a trainer checkpoint?"), "{e}");
    std::fs::remove_dir_all(dir).ok();
}

/// Every conv output of one image, counted from the layers: ResNet-18 with the CIFAR stem at 8 px is 64 x 8 x 8
/// (stem) + 4 x 64 x 8 x 8 (layer1) + 5 x 128 x 4 x 4 (layer2 with its downsample) + 5 x 256 x 2 x 2 + 5 x 512.
#[test]
fn conv_output_elems_counts_every_conv() {
    let m = ResNet::new(cfg(Arch::ResNet18, 10, Stem::Cifar), &Device::Cpu).unwrap();
    assert_eq!(m.conv_output_elems(8), 4096 + 4 * 4096 + 5 * 2048 + 5 * 1024 + 5 * 512);
    // ImageNet stem at 64 px: the stem conv at 32 x 32, then the pool to 16.
    let m = ResNet::new(cfg(Arch::ResNet18, 10, Stem::ImageNet), &Device::Cpu).unwrap();
    assert_eq!(m.conv_output_elems(64), 64 * 32 * 32 + 4 * 64 * 256 + 5 * 128 * 64 + 5 * 256 * 16 + 5 * 512 * 4);
    // The largest: the stem conv's output; with the CIFAR stem a layer1 conv's (64 x 8 x 8, as the stem's).
    assert_eq!(m.max_conv_output_elems(64), 64 * 32 * 32);
    let m = ResNet::new(cfg(Arch::ResNet50, 10, Stem::Cifar), &Device::Cpu).unwrap();
    // Bottleneck: layer1's last conv and downsample make 256 channels at the stem's 8 x 8.
    assert_eq!(m.max_conv_output_elems(8), 256 * 8 * 8);
}

#[test]
fn zero_init_residual_and_frozen_params() {
    let dev = Device::Cpu;
    let m =
        ResNet::new(ResNetConfig { zero_init_residual: true, ..cfg(Arch::ResNet50, 10, Stem::Cifar) }, &dev).unwrap();
    let w: Vec<f32> = m.store().get("layer2.1.bn3.weight").unwrap().param.tensor().to_vec1().unwrap();
    assert!(w.iter().all(|v| *v == 0.0));
    let w: Vec<f32> = m.store().get("layer2.1.bn2.weight").unwrap().param.tensor().to_vec1().unwrap();
    assert!(w.iter().all(|v| *v == 1.0));
    let before = m.store().trainable().len();
    let n = m.store().freeze_prefixes(&["conv1".into(), "layer1".into()]);
    assert_eq!(m.store().trainable().len(), before - n);
    assert!(m.store().trainable().iter().all(|(k, _)| !k.starts_with("layer1.") && k != "conv1.weight"));
    // Frozen tensors get no gradient.
    let x = Tensor::randn(0f32, 1., (2, 3, 8, 8), &dev).unwrap();
    let loss = m.forward(&x, true, Precision::F32).unwrap().sqr().unwrap().sum_all().unwrap();
    let g = loss.backward().unwrap();
    assert!(g.get(m.store().get("conv1.weight").unwrap().param.var().as_tensor()).is_none());
    assert!(g.get(m.store().get("layer2.0.conv1.weight").unwrap().param.var().as_tensor()).is_some());
}

#[test]
fn low_precision_forward_on_cpu() {
    let dev = Device::Cpu;
    let m = ResNet::new(cfg(Arch::ResNet18, 10, Stem::Cifar), &dev).unwrap();
    let x = Tensor::randn(0f32, 1., (2, 3, 16, 16), &dev).unwrap();
    let f = m.forward(&x, false, Precision::F32).unwrap();
    for p in [Precision::Bf16, Precision::F16] {
        let y = m.forward(&x, false, p).unwrap();
        assert_eq!(y.dtype(), p.act_dtype());
        let d = (y.to_dtype(DType::F32).unwrap() - &f)
            .unwrap()
            .sqr()
            .unwrap()
            .sum_all()
            .unwrap()
            .sqrt()
            .unwrap()
            .to_scalar::<f32>()
            .unwrap();
        let n = f.sqr().unwrap().sum_all().unwrap().sqrt().unwrap().to_scalar::<f32>().unwrap();
        assert!(d / n < 5e-2, "{p:?}: relative error {}", d / n);
    }
}

/// The bar: a ResNet-152 forward + backward at 224x224, batch 2, on the CPU.
#[test]
fn resnet152_forward_backward_224_on_cpu() {
    let dev = Device::Cpu;
    let m = ResNet::new(cfg(Arch::ResNet152, 1000, Stem::ImageNet), &dev).unwrap();
    let x = Tensor::randn(0f32, 1., (2, 3, 224, 224), &dev).unwrap();
    let t = std::time::Instant::now();
    let logits = m.forward(&x, true, Precision::F32).unwrap();
    assert_eq!(logits.dims(), &[2, 1000]);
    let loss = candle_nn_free_xent(&logits, &Tensor::new(&[1u32, 2], &dev).unwrap());
    let grads = loss.backward().unwrap();
    let g = grads.get(m.store().get("conv1.weight").unwrap().param.var().as_tensor()).unwrap();
    assert!(g.abs().unwrap().sum_all().unwrap().to_scalar::<f32>().unwrap() > 0.0);
    eprintln!("resnet152 fwd+bwd batch 2 at 224: {:.1} s", t.elapsed().as_secs_f64());
}

// ---------------------------------------------------------------------------------------------------------------
// Channels-last (NHWC): the model against its NCHW twin, and the NHWC pooling ops against their NCHW/candle
// counterparts.
// ---------------------------------------------------------------------------------------------------------------

/// ‖a − b‖₂ / ‖b‖₂ (f64), after casting both to f32 on the CPU.
/// Relative L2 distance, computed in f64 (an f32 conversion first would turn 1e-16 differences of f64 results
/// into occasional 1-ulp f32 flips, ~5e-9 relative).
fn rel_l2(a: &Tensor, b: &Tensor) -> f64 {
    assert_eq!(a.dims(), b.dims());
    let f = |t: &Tensor| -> Vec<f64> { t.to_dtype(DType::F64).unwrap().flatten_all().unwrap().to_vec1().unwrap() };
    let (x, y) = (f(a), f(b));
    let num: f64 = x.iter().zip(&y).map(|(p, q)| (p - q).powi(2)).sum();
    let den: f64 = y.iter().map(|q| q.powi(2)).sum();
    (num / den.max(1e-300)).sqrt()
}

fn flat_f32(t: &Tensor) -> Vec<f32> {
    t.to_dtype(DType::F32).unwrap().flatten_all().unwrap().to_vec1().unwrap()
}

fn resnet18_layout(stem: Stem, channels_last: bool) -> ResNet {
    let kernels = if channels_last { kernels::KernelPolicy::custom() } else { kernels::KernelPolicy::default() };
    let c = ResNetConfig { seed: 11, kernels, ..cfg(Arch::ResNet18, 10, stem) };
    ResNet::new(c, &Device::Cpu).unwrap()
}

/// A channels-last ResNet-18 gives the NCHW model's logits, loss, parameter gradients and running statistics
/// (one training step, FP32), and then the same eval-mode logits; both stems, 2x3x32x32.
#[test]
fn channels_last_resnet18_matches_nchw() {
    let dev = Device::Cpu;
    for stem in [Stem::Cifar, Stem::ImageNet] {
        let (nchw, nhwc) = (resnet18_layout(stem, false), resnet18_layout(stem, true));
        assert!(nhwc.config.channels_last() && !nchw.config.channels_last());
        let x = Tensor::randn(0f32, 1., (2, 3, 32, 32), &dev).unwrap();
        let labels = Tensor::new(&[3u32, 8], &dev).unwrap();
        let step = |m: &ResNet| {
            let logits = m.forward(&x, true, Precision::F32).unwrap();
            let loss = candle_nn_free_xent(&logits, &labels);
            let grads = loss.backward().unwrap();
            (logits, loss, grads)
        };
        let ((la, lossa, ga), (lb, lossb, gb)) = (step(&nchw), step(&nhwc));
        let name = stem.name();
        assert_eq!(lb.dims(), &[2, 10]);
        let e = rel_l2(&lb, &la);
        assert!(e < 1e-4, "{name}: train-mode logits rel err {e:e}");
        assert!(rel_l2(&lossb, &lossa) < 1e-4, "{name}: loss {lossb} vs {lossa}");
        let mut worst = (0.0, String::new());
        for (pname, var) in nchw.store().trainable() {
            let vb = nhwc.store().get(&pname).unwrap().param.var().clone();
            assert_eq!(var.dims(), vb.dims(), "{name}: master weight {pname} keeps its torchvision shape");
            let (gra, grb) = (ga.get(var.as_tensor()).unwrap(), gb.get(vb.as_tensor()).unwrap());
            let e = rel_l2(grb, gra);
            if e > worst.0 {
                worst = (e, pname.clone());
            }
            assert!(e < 1e-4, "{name}: grad {pname} rel err {e:e}");
        }
        eprintln!("{name}: logits rel err {:.1e}, worst grad rel err {:.1e} ({})", rel_l2(&lb, &la), worst.0, worst.1);
        // Running statistics (and the batch counter) after the step, then eval-mode logits from them.
        let (sa, sb) = (nchw.store().snapshot().unwrap(), nhwc.store().snapshot().unwrap());
        for (k, ta) in sa.iter().filter(|(k, _)| k.contains("running_") || k.contains("num_batches")) {
            let tb = &sb[k];
            if ta.dtype() == DType::I64 {
                assert_eq!(ta.to_scalar::<i64>().unwrap(), tb.to_scalar::<i64>().unwrap(), "{name}: {k}");
            } else {
                let e = rel_l2(tb, ta);
                assert!(e < 1e-5, "{name}: {k} rel err {e:e}");
            }
        }
        assert_eq!(nhwc.store().get("bn1.num_batches_tracked").unwrap().param.tensor().to_scalar::<i64>().unwrap(), 1);
        let (ea, eb) =
            (nchw.forward(&x, false, Precision::F32).unwrap(), nhwc.forward(&x, false, Precision::F32).unwrap());
        let e = rel_l2(&eb, &ea);
        assert!(e < 1e-4, "{name}: eval logits rel err {e:e}");
        // Low precision runs too (autocast unchanged): bf16 eval logits close to the NCHW model's.
        let (ba, bb) =
            (nchw.forward(&x, false, Precision::Bf16).unwrap(), nhwc.forward(&x, false, Precision::Bf16).unwrap());
        assert_eq!(bb.dtype(), DType::BF16);
        let e = rel_l2(&bb, &ba);
        assert!(e < 2e-2, "{name}: bf16 eval logits rel err {e:e}");
    }
}

/// BatchNorm in channels-last mode equals NCHW BatchNorm on the permuted input (train then eval), running
/// statistics included, and frozen statistics stay frozen.
#[test]
fn channels_last_batchnorm_matches_nchw() {
    use resnet::layers::{BatchNorm2d, Builder, Ctx};
    let dev = Device::Cpu;
    let (sa, sb) = (resnet::ParamStore::new(&dev), resnet::ParamStore::new(&dev));
    let bna = BatchNorm2d::new(&Builder::new(&sa, 0).pp("bn"), 5, false).unwrap();
    let bnb = BatchNorm2d::new(&Builder::new(&sb, 0).pp("bn"), 5, false).unwrap();
    for s in [&sa, &sb] {
        s.set("bn.weight", &Tensor::new(&[1.5f32, 0.5, -1.0, 2.0, 1.0], &dev).unwrap()).unwrap();
        s.set("bn.bias", &Tensor::new(&[0.1f32, -0.2, 0.3, 0.0, 1.0], &dev).unwrap()).unwrap();
    }
    let x = (Tensor::randn(0f32, 1., (3, 5, 4, 6), &dev).unwrap() * 3.0).unwrap();
    let xl = x.permute((0, 2, 3, 1)).unwrap().contiguous().unwrap();
    let nchw = |train| Ctx::new(train, DType::F32);
    let nhwc = |train| Ctx { kernels: kernels::KernelPolicy::custom(), ..Ctx::new(train, DType::F32) };
    for train in [true, true, false] {
        let ya = bna.forward(&x, &nchw(train)).unwrap();
        let yb = bnb.forward(&xl, &nhwc(train)).unwrap();
        assert_eq!(yb.dims(), &[3, 4, 6, 5]);
        let e = rel_l2(&yb.permute((0, 3, 1, 2)).unwrap(), &ya);
        assert!(e < 1e-6, "train={train}: rel err {e:e}");
        for k in ["bn.running_mean", "bn.running_var"] {
            let (ta, tb) = (sa.get(k).unwrap().param.tensor(), sb.get(k).unwrap().param.tensor());
            assert!(rel_l2(&tb, &ta) < 1e-6, "{k}");
        }
    }
    assert_eq!(bnb.num_batches_tracked.tensor().to_scalar::<i64>().unwrap(), 2);
    // Frozen statistics: training mode uses and keeps the running statistics.
    bnb.stats_frozen.store(true, std::sync::atomic::Ordering::Relaxed);
    let before = flat_f32(&bnb.running_var.tensor());
    let y = bnb.forward(&xl, &nhwc(true)).unwrap();
    let y_eval = bnb.forward(&xl, &nhwc(false)).unwrap();
    assert_eq!(flat_f32(&y), flat_f32(&y_eval));
    assert_eq!(flat_f32(&bnb.running_var.tensor()), before);
    // Low precision: statistics in FP32, output in the input dtype.
    let yb = bnb.forward(&xl.to_dtype(DType::BF16).unwrap(), &Ctx { act: DType::BF16, ..nhwc(true) }).unwrap();
    assert_eq!(yb.dtype(), DType::BF16);
}

/// Pool inputs rich in ties: random normal, ReLU'd (many zeros), on a 0.25 grid, and constant.
fn tie_rich(dims: (usize, usize, usize, usize), variant: usize) -> Tensor {
    let t = Tensor::randn(0f32, 1., dims, &Device::Cpu).unwrap();
    match variant % 4 {
        0 => t,
        1 => t.relu().unwrap(),
        2 => ((t * 4.0).unwrap().round().unwrap() / 4.0).unwrap(),
        _ => t.ones_like().unwrap(),
    }
}

/// The NHWC max-pool equals the NCHW one on the permuted tensor, forward and backward, bit for bit (ties go to
/// the first maximum of the window in both), in f32, bf16, f16 and f64.
#[test]
fn maxpool_nhwc_matches_permuted_nchw() {
    let dev = Device::Cpu;
    let cases = [
        ((2, 3, 7, 9), 3, 2, 1),
        ((1, 4, 8, 8), 3, 2, 1),
        ((1, 2, 5, 5), 2, 2, 0),
        ((2, 5, 6, 5), 3, 1, 1),
        ((1, 3, 10, 10), 5, 3, 2),
        ((1, 1, 1, 1), 1, 1, 0),
        ((2, 3, 6, 7), 4, 1, 2),
    ];
    let mut variant = 0;
    for &(dims, k, s, p) in &cases {
        for dt in [DType::F32, DType::BF16, DType::F16, DType::F64] {
            variant += 1;
            let what = format!("{dims:?} k{k} s{s} p{p} {dt:?} variant {}", variant % 4);
            let x = tie_rich(dims, variant).to_dtype(dt).unwrap();
            let xl = x.permute((0, 2, 3, 1)).unwrap().contiguous().unwrap();
            let (va, vb) = (candle_core::Var::from_tensor(&x).unwrap(), candle_core::Var::from_tensor(&xl).unwrap());
            let ya = kernels::max_pool2d(va.as_tensor(), k, s, p).unwrap();
            let yb = kernels::max_pool2d_nhwc(vb.as_tensor(), k, s, p).unwrap();
            assert_eq!(yb.dtype(), dt);
            let ya_l = ya.permute((0, 2, 3, 1)).unwrap().contiguous().unwrap();
            assert_eq!(yb.dims(), ya_l.dims(), "{what}");
            assert_eq!(flat_f32(&yb), flat_f32(&ya_l), "forward {what}");
            let g = Tensor::randn(0f32, 1., ya.dims(), &dev).unwrap().to_dtype(dt).unwrap();
            let gl = g.permute((0, 2, 3, 1)).unwrap().contiguous().unwrap();
            let ga = (ya * &g).unwrap().sum_all().unwrap().backward().unwrap();
            let gb = (&yb * &gl).unwrap().sum_all().unwrap().backward().unwrap();
            let dxa = ga.get(va.as_tensor()).unwrap().permute((0, 2, 3, 1)).unwrap();
            let dxb = gb.get(vb.as_tensor()).unwrap();
            assert_eq!(flat_f32(dxb), flat_f32(&dxa), "backward {what}");
            // The training step's backward from the windows' stored argmax offsets: the same gradient bit for bit.
            let pool = kernels::MaxPool2d { kernel: k, stride: s, padding: p };
            let off = xl.apply_op1_no_bwd(&MaxPool2dNhwcOffsets(pool)).unwrap();
            assert_eq!((off.dtype(), off.dims()), (DType::U8, yb.dims()), "{what}");
            let bwd = MaxPool2dNhwcBackwardOffsets { pool, in_hw: (dims.2, dims.3) };
            let dxo = off.apply_op2_no_bwd(&gl, &bwd).unwrap();
            assert_eq!(flat_f32(&dxo), flat_f32(&dxa), "backward from offsets {what}");
            // The stem's backward of two gradients (the CPU reference of the fused CUDA pass): the one-gradient
            // op on their sum, whichever way it is called.
            let g2 = Tensor::randn(0f32, 1., gl.dims(), &dev).unwrap().to_dtype(dt).unwrap();
            let on_sum = off.apply_op2_no_bwd(&(&gl + &g2).unwrap(), &bwd).unwrap();
            let op3 = off.apply_op3_no_bwd(&gl, &g2, &MaxPool2dNhwcBackwardOffsetsSum(bwd)).unwrap();
            let wrapped = max_pool2d_nhwc_backward_offsets_sum(&off, &gl, &g2, bwd).unwrap();
            assert_eq!(flat_f32(&op3), flat_f32(&on_sum), "backward of a sum {what}");
            assert_eq!(flat_f32(&wrapped), flat_f32(&on_sum), "backward of a sum, wrapper {what}");
        }
    }
    // Gradients of two shapes are an error naming the op.
    let pool = kernels::MaxPool2d { kernel: 3, stride: 2, padding: 1 };
    let bwd = MaxPool2dNhwcBackwardOffsets { pool, in_hw: (8, 8) };
    let off = Tensor::zeros((1, 4, 4, 2), DType::U8, &dev).unwrap();
    let (g, g_bad) =
        (Tensor::ones((1, 4, 4, 2), DType::F32, &dev).unwrap(), Tensor::ones((1, 4, 4, 1), DType::F32, &dev).unwrap());
    let e = off.apply_op3_no_bwd(&g, &g_bad, &MaxPool2dNhwcBackwardOffsetsSum(bwd)).unwrap_err().to_string();
    assert!(e.contains("max_pool2d_nhwc_backward_offsets_sum: gradients of shapes"), "{e}");
    // Offsets that do not fit the pool are errors naming the op, not panics.
    let pool = kernels::MaxPool2d { kernel: 3, stride: 2, padding: 1 };
    let bwd = MaxPool2dNhwcBackwardOffsets { pool, in_hw: (8, 8) };
    let g = Tensor::ones((1, 4, 4, 2), DType::F32, &dev).unwrap();
    let bad = Tensor::full(9u8, (1, 4, 4, 2), &dev).unwrap();
    let e = bad.apply_op2_no_bwd(&g, &bwd).unwrap_err().to_string();
    assert!(e.contains("max_pool2d_nhwc_backward_offsets"), "{e}");
    let e = Tensor::zeros((1, 3, 4, 2), DType::U8, &dev).unwrap().apply_op2_no_bwd(&g, &bwd).unwrap_err().to_string();
    assert!(e.contains("expected [1, 4, 4, 2]"), "{e}");
    // Ties: on a constant input every window's gradient lands on its first (top-left, in-bounds) cell.
    let x = candle_core::Var::from_tensor(&Tensor::ones((1, 4, 4, 2), DType::F32, &dev).unwrap()).unwrap();
    let y = kernels::max_pool2d_nhwc(x.as_tensor(), 2, 2, 0).unwrap();
    let dx = y.sum_all().unwrap().backward().unwrap().get(x.as_tensor()).unwrap().clone();
    let dx = dx.permute((0, 3, 1, 2)).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
    let plane = [1., 0., 1., 0., 0., 0., 0., 0., 1., 0., 1., 0., 0., 0., 0., 0.];
    assert_eq!(dx, [plane, plane].concat());
    // NaNs propagate as in the NCHW op.
    let mut v = flat_f32(&tie_rich((1, 2, 5, 5), 2));
    v[7] = f32::NAN;
    let x = Tensor::from_vec(v, (1, 2, 5, 5), &dev).unwrap();
    let a = kernels::max_pool2d(&x, 3, 2, 1).unwrap().permute((0, 2, 3, 1)).unwrap();
    let b = kernels::max_pool2d_nhwc(&x.permute((0, 2, 3, 1)).unwrap(), 3, 2, 1).unwrap();
    let (a, b) = (flat_f32(&a), flat_f32(&b));
    assert!(b.iter().any(|v| v.is_nan()));
    assert!(a.iter().zip(&b).all(|(p, q)| p.to_bits() == q.to_bits() || (p.is_nan() && q.is_nan())));
    // Bad shapes and parameters are errors, not panics.
    assert!(kernels::max_pool2d_nhwc(&Tensor::zeros((2, 2), DType::F32, &dev).unwrap(), 3, 2, 1).is_err());
    assert!(kernels::max_pool2d_nhwc(&Tensor::zeros((1, 2, 2, 3), DType::F32, &dev).unwrap(), 5, 1, 0).is_err());
    assert!(kernels::max_pool2d_nhwc(&Tensor::zeros((1, 4, 4, 3), DType::F32, &dev).unwrap(), 2, 1, 2).is_err());
}

/// The NHWC global average pool against candle's mean over (h, w): forward and backward, in f32, f64 and bf16
/// (FP32 accumulation, output in the input dtype).
#[test]
fn avgpool_nhwc_matches_candle_mean() {
    let dev = Device::Cpu;
    for &(n, h, w, c) in &[(2, 7, 7, 64), (3, 4, 4, 5), (1, 1, 1, 1), (2, 3, 5, 7), (4, 1, 9, 2)] {
        let what = format!("{:?}", (n, h, w, c));
        let x = Tensor::randn(0f32, 1., (n, h, w, c), &dev).unwrap();
        let g = Tensor::randn(0f32, 1., (n, c), &dev).unwrap();
        for dt in [DType::F32, DType::F64] {
            let (x, g) = (x.to_dtype(dt).unwrap(), g.to_dtype(dt).unwrap());
            let (va, vb) = (candle_core::Var::from_tensor(&x).unwrap(), candle_core::Var::from_tensor(&x).unwrap());
            let ya = va.as_tensor().mean((1, 2)).unwrap();
            let yb = kernels::global_avg_pool_nhwc(vb.as_tensor()).unwrap();
            assert_eq!(yb.dims(), &[n, c], "{what}");
            assert_eq!(yb.dtype(), dt);
            let tol = if dt == DType::F64 { 1e-12 } else { 1e-6 };
            let e = rel_l2(&yb, &ya);
            assert!(e < tol, "forward {what} {dt:?}: rel err {e:e}");
            let ga = (ya * &g).unwrap().sum_all().unwrap().backward().unwrap();
            let gb = (yb * &g).unwrap().sum_all().unwrap().backward().unwrap();
            let (dxa, dxb) = (ga.get(va.as_tensor()).unwrap(), gb.get(vb.as_tensor()).unwrap());
            assert_eq!(dxb.dims(), &[n, h, w, c]);
            let e = rel_l2(dxb, dxa);
            assert!(e < tol, "backward {what} {dt:?}: rel err {e:e}");
        }
        // bf16: the FP32 mean of the bf16 values, rounded once; the gradient dy / (h w) rounded once.
        let xb = x.to_dtype(DType::BF16).unwrap();
        let yb = kernels::global_avg_pool_nhwc(&xb).unwrap();
        assert_eq!(yb.dtype(), DType::BF16);
        let want = xb.to_dtype(DType::F32).unwrap().mean((1, 2)).unwrap().to_dtype(DType::BF16).unwrap();
        let (got, want) = (flat_f32(&yb), flat_f32(&want));
        for (a, b) in got.iter().zip(&want) {
            // At most one bf16 ulp apart (summation order may differ from candle's).
            assert!((a - b).abs() <= b.abs() * 2f32.powi(-7) + 1e-6, "bf16 forward {what}: {a} vs {b}");
        }
        let gb = g.to_dtype(DType::BF16).unwrap();
        let dx = gb.apply_op1_no_bwd(&kernels::ops::avgpool::GlobalAvgPoolNhwcBackward { h, w }).unwrap();
        let gv = flat_f32(&gb);
        let want: Vec<f32> = (0..n * h * w * c)
            .map(|i| half::bf16::from_f32(gv[(i / (h * w * c)) * c + i % c] / (h * w) as f32).to_f32())
            .collect();
        assert_eq!(dx.dims(), &[n, h, w, c]);
        assert_eq!(flat_f32(&dx), want, "bf16 backward {what}");
    }
    assert!(kernels::global_avg_pool_nhwc(&Tensor::zeros((2, 3, 4), DType::F32, &dev).unwrap()).is_err());
    assert!(kernels::global_avg_pool_nhwc(&Tensor::zeros((2, 0, 4, 3), DType::F32, &dev).unwrap()).is_err());
}
