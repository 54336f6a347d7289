//! Model crate tests: parameter counts, shapes, BatchNorm and max-pool numerics, gradients, weights IO.

use candle_core::{DType, Device, Tensor, D};
use resnet::weights;
use resnet::{Arch, Precision, ResNet, ResNetConfig, Stem};

fn cfg(arch: Arch, classes: usize, stem: Stem) -> ResNetConfig {
    ResNetConfig { arch, num_classes: classes, stem, zero_init_residual: false, seed: 7 }
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
    let y = bn.forward(&x, &Ctx { train: true, act: DType::F32 }).unwrap();
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
    let y = bn.forward(&x, &Ctx { train: false, act: DType::F32 }).unwrap();
    let y: Vec<f32> = y.flatten_all().unwrap().to_vec1().unwrap();
    let e0 = |v: f32| 2.0 * (v - rm[0]) / (rv[0] + eps).sqrt() + 1.0;
    assert!((y[0] - e0(1.0)).abs() < 1e-5);
    let rm2: Vec<f32> = bn.running_mean.tensor().to_vec1().unwrap();
    assert_eq!(rm, rm2);
    // Low-precision input: statistics in FP32, output in the input dtype.
    let yb = bn.forward(&x.to_dtype(DType::BF16).unwrap(), &Ctx { train: true, act: DType::BF16 }).unwrap();
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
        // Finite differences on a few inputs (random inputs have no ties).
        let loss_at = |xs: &[f32]| -> f64 {
            let (o, _) = naive_maxpool(xs, dims, k, s, p);
            o.iter().zip(&gv).map(|(a, b)| (*a as f64) * (*b as f64)).sum()
        };
        for i in [0, xv.len() / 3, xv.len() - 1, w - 1, (h - 1) * w] {
            let mut xp = xv.clone();
            xp[i] += 1e-3;
            let mut xm = xv.clone();
            xm[i] -= 1e-3;
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
    let x = Tensor::randn(0f32, 1., (4, 3, 64, 64), &dev).unwrap();
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
                let l = loss_fn(&m).to_scalar::<f32>().unwrap() as f64;
                l
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
    std::fs::remove_dir_all(dir).ok();
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
