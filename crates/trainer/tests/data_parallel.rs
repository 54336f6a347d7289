//! The data-parallel training loop on the CPU: ranks run as threads of this test, joined by a test-only stand-in
//! for NCCL's sum all-reduce (the trainer itself uses NCCL; this double exists so that the loop's sharding,
//! weighting, empty last batches, rank-0-only writing and cross-world-size resume can be checked without GPUs).
//!
//! With frozen BatchNorm statistics (`finetune.bn_frozen`, so no per-rank batch statistics), N ranks at batch b
//! must train exactly what one process trains at batch N x b, up to the order of floating-point sums.

mod common;
use candle_core::{DType, Device, Tensor};
use common::thread_group;
use common::{step_losses, tiny, TempDir};
use std::collections::HashMap;
use std::path::Path;
use trainer::config::Config;
use trainer::train::{self, Summary};

/// Runs `world` ranks of `cfg` in `dir` (threads, one shared run directory); every rank's result, rank order.
fn spawn_ranks(cfg: &Config, dir: &Path, world: usize, resume: bool) -> Vec<anyhow::Result<Summary>> {
    let handles: Vec<_> = thread_group(world)
        .into_iter()
        .map(|g| {
            let (cfg, dir) = (cfg.clone(), dir.to_path_buf());
            std::thread::spawn(move || train::train_ranks(&cfg, &dir, resume, Some(g.ranks())))
        })
        .collect();
    handles.into_iter().map(|h| h.join().unwrap()).collect()
}

/// [`spawn_ranks`] that must succeed: rank 0's summary.
fn run_ranks(cfg: &Config, dir: &Path, world: usize, resume: bool) -> Summary {
    let mut all: Vec<Summary> = spawn_ranks(cfg, dir, world, resume).into_iter().map(|r| r.unwrap()).collect();
    all.swap_remove(0)
}

fn weights(path: &Path) -> HashMap<String, Vec<f32>> {
    candle_core::safetensors::load(path, &Device::Cpu)
        .unwrap()
        .into_iter()
        .map(|(k, t)| (k, t.flatten_all().unwrap().to_dtype(candle_core::DType::F32).unwrap().to_vec1().unwrap()))
        .collect()
}

fn assert_close(a: &HashMap<String, Vec<f32>>, b: &HashMap<String, Vec<f32>>, tol: f32) {
    assert_eq!(a.len(), b.len());
    let mut worst: Vec<(f32, &String)> =
        a.iter().map(|(k, va)| (va.iter().zip(&b[k]).map(|(x, y)| (x - y).abs()).fold(0f32, f32::max), k)).collect();
    worst.sort_by(|x, y| y.0.total_cmp(&x.0));
    assert!(worst[0].0 <= tol, "differences above the tolerance {tol}: {:?}", &worst[..worst.len().min(5)]);
}

/// Two runs in `a` and `b` logged the same step losses and ended with the same weights (within `tol`).
fn assert_runs_match(a: &Path, b: &Path, tol: f32) {
    assert_losses_close(&step_losses(a), &step_losses(b));
    assert_close(&weights(&a.join("model.safetensors")), &weights(&b.join("model.safetensors")), tol);
}

fn assert_losses_close(a: &[(u64, f64)], b: &[(u64, f64)]) {
    assert_eq!(a.len(), b.len(), "{a:?} vs {b:?}");
    for ((sa, la), (sb, lb)) in a.iter().zip(b) {
        assert_eq!(sa, sb);
        assert!((la - lb).abs() <= 1e-4 * lb.abs().max(1.0), "step {sa}: loss {la} vs {lb}");
    }
}

/// 33 samples: global batches of 16, 16 and 1, so rank 1's last batch is empty (it joins the all-reduce with
/// zeros) and the single process's last batch holds one sample.
fn config(batch: usize, extra: &[&str]) -> Config {
    let bs = format!("train.batch_size={batch}");
    let mut o = vec!["finetune.bn_frozen=true", "data.num_samples=33", "train.epochs=2", bs.as_str()];
    o.extend_from_slice(extra);
    tiny(&o)
}

#[test]
fn two_ranks_train_what_one_process_trains_at_twice_the_batch() {
    let (single, dp) = (TempDir::new("dp-single"), TempDir::new("dp-two"));
    let s1 = train::train(&config(16, &[]), single.path(), false).unwrap();
    let s2 = run_ranks(&config(8, &[]), dp.path(), 2, false);
    assert_eq!(s1.steps, 6);
    assert_eq!(s2.steps, 6);
    // Rank 0 logs the loss over the global batch: the single process's loss, step by step.
    assert_runs_match(dp.path(), single.path(), 2e-5);
    // Only rank 0 wrote: one record per step, each epoch's checkpoint once, the validation of both epochs.
    let text = std::fs::read_to_string(dp.path().join("metrics.jsonl")).unwrap();
    let kinds: Vec<String> = text
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap()["kind"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(kinds.iter().filter(|k| *k == "step").count(), 6, "{kinds:?}");
    assert_eq!(kinds.iter().filter(|k| *k == "epoch").count(), 2, "{kinds:?}");
    let v1 = s1.val.unwrap();
    let v2 = s2.val.unwrap();
    assert!((v1.loss - v2.loss).abs() <= 1e-4, "val loss {} vs {}", v1.loss, v2.loss);
    // Every epoch's images counted once over the ranks.
    let epochs: Vec<serde_json::Value> = text
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .filter(|v| v["kind"] == "epoch")
        .collect();
    assert!(epochs.iter().all(|e| e["complete"] == true));
}

/// The fused step with the gradient all-reduce in buckets started during the backward (here ~50 KB each, so
/// every larger parameter is a bucket of its own): two ranks train what one process trains at twice the batch.
/// The test's all-reduce stand-in finishes a started bucket only at the join, so reading a bucket early would
/// show. Rank 1's last batch is empty: it starts the same buckets from zeros after its (skipped) backward.
#[test]
fn bucketed_all_reduce_during_the_fused_backward_trains_like_one_process() {
    let fused = ["kernels.conv=\"custom\"", "kernels.step=\"fused\"", "train.bucket_mb=0.05"];
    let (single, dp) = (TempDir::new("dpb-single"), TempDir::new("dpb-two"));
    let s1 = train::train(&config(16, &fused), single.path(), false).unwrap();
    let s2 = run_ranks(&config(8, &fused), dp.path(), 2, false);
    assert_eq!((s1.steps, s2.steps), (6, 6));
    assert_runs_match(dp.path(), single.path(), 2e-5);
}

/// With gradient accumulation the earlier micro-batches' sums join the last one's buckets: the fused step with
/// overlapped buckets trains what the autograd path (buckets after the backward) trains, over two ranks.
#[test]
fn bucketed_all_reduce_adds_the_accumulated_micro_batches() {
    let run = |step: &str, dir: &TempDir| {
        let step = format!("kernels.step=\"{step}\"");
        let o = ["kernels.conv=\"custom\"", step.as_str(), "train.bucket_mb=0.5", "train.grad_accum=2"];
        run_ranks(&config(4, &o), dir.path(), 2, false)
    };
    let (fused, autograd) = (TempDir::new("dpa-fused"), TempDir::new("dpa-autograd"));
    let (a, b) = (run("fused", &fused), run("autograd", &autograd));
    assert_eq!(a.steps, b.steps);
    assert_runs_match(fused.path(), autograd.path(), 5e-5);
}

#[test]
fn bf16_gradient_all_reduce_trains_close_to_fp32() {
    // train.grad_allreduce = "bf16" rounds each rank's weighted gradient to bf16 before the sum: the run stays
    // within bf16 rounding of the FP32 all-reduce's (and visibly differs from it, so the path is taken).
    let (fp32, bf16) = (TempDir::new("dp-ar32"), TempDir::new("dp-ar16"));
    run_ranks(&config(8, &[]), fp32.path(), 2, false);
    run_ranks(&config(8, &["train.grad_allreduce=\"bf16\""]), bf16.path(), 2, false);
    let (a, b) = (weights(&fp32.path().join("model.safetensors")), weights(&bf16.path().join("model.safetensors")));
    let worst = a
        .iter()
        .map(|(k, v)| v.iter().zip(&b[k]).map(|(x, y)| (x - y).abs()).fold(0f32, f32::max))
        .fold(0f32, f32::max);
    // Bound: bf16 keeps 8 bits (relative 2^-9); with lr 0.05 and momentum 0.9 over 6 steps the weights drift by
    // up to ~1e-2 of a unit gradient.
    assert!(worst > 0.0 && worst < 1e-2, "bf16 all-reduce moved the weights by {worst}");
    let (la, lb) = (step_losses(fp32.path()), step_losses(bf16.path()));
    assert_eq!(la.len(), lb.len());
    assert!(la.iter().zip(&lb).all(|((_, x), (_, y))| (x - y).abs() < 1e-2), "{la:?} vs {lb:?}");
}

#[test]
fn a_run_saved_by_two_ranks_resumes_in_one_process() {
    // Two ranks stop after 4 steps (mid-epoch 2); one process at the same global batch continues from their
    // checkpoint and ends where an uninterrupted single-process run ends.
    let (single, dp) = (TempDir::new("dpr-single"), TempDir::new("dpr-two"));
    train::train(&config(16, &[]), single.path(), false).unwrap();
    run_ranks(&config(8, &["train.max_steps=4", "checkpoint.every_steps=2"]), dp.path(), 2, false);
    let resumed = train::train(&config(16, &[]), dp.path(), true).unwrap();
    assert_eq!(resumed.steps, 6);
    assert_runs_match(dp.path(), single.path(), 2e-5);
    // The reverse at another global batch: a checkpoint 2 steps into an epoch of global batch 16 resumes at
    // global batch 8 four micro-batches in, and refuses global batch 12 (32 samples are not whole batches of 12).
    let three = TempDir::new("dpr-three");
    train::train(&config(16, &["train.max_steps=4", "checkpoint.every_steps=2"]), three.path(), false).unwrap();
    let e = run_ranks_err(&config(6, &[]), three.path(), 2);
    assert!(e.contains("not a whole number of global batches of 6 x 2 rank(s)"), "{e}");
    let s = run_ranks(&config(4, &[]), three.path(), 2, true);
    // Epoch 2 had 16 of 33 samples done: 17 left in global batches of 8 -> 3 more steps.
    assert_eq!(s.steps, 7);
}

/// [`spawn_ranks`] with `--resume` where every rank must fail: rank 0's error.
fn run_ranks_err(cfg: &Config, dir: &Path, world: usize) -> String {
    let errs: Vec<String> = spawn_ranks(cfg, dir, world, true)
        .into_iter()
        .map(|r| format!("{:#}", r.expect_err("resume should fail")))
        .collect();
    errs[0].clone()
}

/// Synchronised BatchNorm in training, end to end (fp32 fused step on the CPU): 2 ranks at batch 8 train what one
/// rank trains at batch 16, over two epochs of two global batches. The reference is the synchronised path at
/// world size 1, whose statistics are combined in f32 like the two ranks'. Training amplifies the rounding
/// differences between the runs (a 16-image sum against two 8-image sums): an earlier version of this test
/// demanded every weight within 5e-5 after 3 steps and failed when the loss kernel's rounding changed. So the
/// weights are judged by their relative L2 error, which must also be far below that of two ranks with per-rank
/// statistics. The exact check of the synchronised step against the plain one, uneven and idle ranks included,
/// is `synced_step_gradients_sum_to_the_single_process_gradients`.
#[test]
fn sync_batchnorm_over_two_ranks_trains_like_one_process() {
    let cfg = |bs: usize, sync: bool| {
        let bs = format!("train.batch_size={bs}");
        let sync = format!("train.sync_bn={sync}");
        tiny(&[
            "kernels.conv=\"custom\"",
            "kernels.step=\"fused\"",
            sync.as_str(),
            "data.kind=\"synthetic\"",
            "data.num_samples=32",
            "data.image_size=16",
            "data.val_resize=16",
            "train.epochs=2",
            "optim.lr=0.01",
            bs.as_str(),
        ])
    };
    let (single, dp, unsynced) = (TempDir::new("sbn-single"), TempDir::new("sbn-ranks"), TempDir::new("sbn-off"));
    run_ranks(&cfg(16, true), single.path(), 1, false);
    run_ranks(&cfg(8, true), dp.path(), 2, false);
    run_ranks(&cfg(8, false), unsynced.path(), 2, false);
    // Weights and the running statistics (which follow the global batch on every rank): the synchronised ranks
    // end within rounding of the one-process run, and far closer to it than ranks with per-rank statistics.
    let one = weights(&single.path().join("model.safetensors"));
    // (relative L2 over all tensors together, the worst single tensor's)
    let errs = |w: &HashMap<String, Vec<f32>>| {
        let (mut num, mut den, mut worst) = (0f64, 0f64, (0f64, String::new()));
        for (k, a) in &one {
            let n: f64 = a.iter().zip(&w[k]).map(|(x, y)| ((x - y) as f64).powi(2)).sum();
            let d: f64 = a.iter().map(|x| (*x as f64).powi(2)).sum();
            (num, den) = (num + n, den + d);
            let e = (n / d.max(1e-30)).sqrt();
            if e > worst.0 {
                worst = (e, k.clone());
            }
        }
        ((num / den).sqrt(), worst)
    };
    let synced = errs(&weights(&dp.path().join("model.safetensors")));
    let off = errs(&weights(&unsynced.path().join("model.safetensors")));
    eprintln!(
        "sync BN, 2 ranks vs 1 (relative L2 of all weights, worst tensor): {synced:?}; per-rank statistics: {off:?}"
    );
    // Measured: 8.2e-5 (worst tensor 1.7e-2, a BatchNorm bias near zero) against 1.3e-2 (1.2) per rank; on a
    // 2-core AVX2 EPYC (2026-12-05) 1.3e-4 (3.0e-2) against 1.3e-2 (1.17).
    assert!(synced.0 < 5e-4, "synchronised ranks differ from one process: {synced:?}");
    // Step losses: at every step the synchronised ranks come within 2e-3 (relative) of the one-process run, and at
    // least 20x closer than the per-rank statistics do. Rounding differences (the statistics summed per rank, then
    // across ranks) grow over the steps and by machine: 1.2e-7 at step 1 and 9e-4 at step 4 on a 2-core AVX2 EPYC
    // (2026-12-05), where per-rank statistics are 1.1e-2 and 0.36 away.
    let (one_l, dp_l, off_l) = (step_losses(single.path()), step_losses(dp.path()), step_losses(unsynced.path()));
    assert!(one_l.len() == dp_l.len() && one_l.len() == off_l.len() && !one_l.is_empty(), "{one_l:?} {dp_l:?}");
    for ((&(s, l1), &(sd, ld)), &(so, lo)) in one_l.iter().zip(&dp_l).zip(&off_l) {
        assert!(s == sd && s == so, "steps {s} / {sd} / {so}");
        let (d, d_off) = ((ld - l1).abs() / l1.abs().max(1.0), (lo - l1).abs() / l1.abs().max(1.0));
        assert!(
            d <= 2e-3 && d * 20.0 <= d_off.max(1e-5),
            "step {s}: loss {ld} vs {l1} ({d:.1e}); per-rank {lo} ({d_off:.1e})"
        );
    }
    assert!(synced.0 * 20.0 < off.0 && synced.1 .0 * 10.0 < off.1 .0, "synchronised {synced:?} vs per-rank {off:?}");
}

#[test]
fn sync_batchnorm_needs_the_fused_step() {
    let cfg = tiny(&["train.sync_bn=true"]);
    let model = train::build_model(&cfg, &Device::Cpu).unwrap();
    let e = train::StepRunner::new(&cfg, model).err().unwrap().to_string();
    assert!(e.starts_with("train.sync_bn = true needs the fused step, but this run takes autograd"), "{e}");
}

/// How close the synchronised ranks' gradients must come to the single process's.
#[derive(Clone, Copy)]
enum GradTol {
    /// Median and worst relative L2 error over the parameters.
    Fixed(f64, f64),
    /// In a low-precision dtype: the median error at most this many times the median error of the single process
    /// itself against FP32 (the same step with `kernels.conv = "custom"` in FP32, on the same device): ranks of
    /// 5, 4 and 3 images round their activations differently from one process of 12, so the two bf16 results
    /// differ by about bf16's own error; a wrong weighting or a missing sum is off by ~1. (Used by the CUDA tests.)
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    TimesOwnError(f64),
}

/// The explicit step with synchronised BatchNorm, compared directly (no training): 4 ranks with 5, 4, 3 and 0
/// images compute, once weighted by their share of the images and summed, the gradients one process computes on
/// all 12 (within `tol`); every rank, the idle one included, ends with the single process's running statistics
/// (below `tol_running`).
fn synced_step_matches_one_process(
    cfg: &Config,
    device: &Device,
    prec: resnet::Precision,
    tol: GradTol,
    tol_running: f64,
) {
    let (n, size) = (12usize, cfg.data.image_size);
    // Fixed pseudo-random images (a run is reproducible).
    let pixels: Vec<f32> =
        (0..n * 3 * size * size).map(|i| ((i as f32 * 12.9898).sin() * 43758.547).fract() * 2.0).collect();
    let label_values: Vec<u32> = (0..n as u32).map(|i| (i * 7) % 4).collect();
    // Each rank (a thread) makes its tensors on a device of its own, as the trainer's ranks (processes) do: on
    // CUDA a CudaDevice of its own (candle's per-thread stream, its own cuBLAS handle, which must not be shared
    // by threads running at once).
    let x = Tensor::from_vec(pixels.clone(), (n, 3, size, size), device).unwrap().to_dtype(prec.act_dtype()).unwrap();
    let labels = Tensor::new(label_values.as_slice(), device).unwrap();
    let named = |m: &resnet::ResNet, grads: &HashMap<candle_core::TensorId, Tensor>| {
        m.store()
            .trainable()
            .into_iter()
            .map(|(k, v)| {
                let g = grads[&v.as_tensor().id()].flatten_all().unwrap().to_dtype(DType::F32).unwrap();
                (k, g.to_vec1::<f32>().unwrap())
            })
            .collect::<HashMap<String, Vec<f32>>>()
    };
    let running = |m: &resnet::ResNet| {
        m.store()
            .snapshot()
            .unwrap()
            .into_iter()
            .filter(|(k, _)| k.contains("running_"))
            .map(|(k, t)| (k, t.flatten_all().unwrap().to_dtype(DType::F32).unwrap().to_vec1::<f32>().unwrap()))
            .collect::<HashMap<String, Vec<f32>>>()
    };
    let single = train::build_model(cfg, device).unwrap();
    let o = single.train_step_explicit(&x, &labels, 0.0, 1.0, prec).unwrap();
    let want = named(&single, &o.grads);
    let want_running = running(&single);
    // The single process in FP32 (the same initial weights: the seed is the config's), for GradTol::TimesOwnError.
    let want_f32 = matches!(tol, GradTol::TimesOwnError(_)).then(|| {
        let mut cfg32 = cfg.clone();
        cfg32.kernels.conv = kernels::ConvChoice::Custom;
        let m = train::build_model(&cfg32, device).unwrap();
        let x32 = x.to_dtype(DType::F32).unwrap();
        let o = m.train_step_explicit(&x32, &labels, 0.0, 1.0, resnet::Precision::F32).unwrap();
        named(&m, &o.grads)
    });

    // Rank r takes images [starts[r], starts[r + 1]); the 4th rank has none.
    let starts = [0usize, 5, 9, 12, 12];
    let handles: Vec<_> = thread_group(4)
        .into_iter()
        .map(|g| {
            let cfg = cfg.clone();
            let (pixels, label_values) = (pixels.clone(), label_values.clone());
            std::thread::spawn(move || {
                let device = train::select_device(&cfg.device).unwrap();
                let x =
                    Tensor::from_vec(pixels, (n, 3, size, size), &device).unwrap().to_dtype(prec.act_dtype()).unwrap();
                let labels = Tensor::new(label_values.as_slice(), &device).unwrap();
                let m = train::build_model(&cfg, &device).unwrap();
                let (a, b) = (starts[g.rank], starts[g.rank + 1]);
                if a == b {
                    m.sync_bn_idle_step(&g).unwrap();
                    return (0, None, running(&m));
                }
                let (xr, lr) = (x.narrow(0, a, b - a).unwrap(), labels.narrow(0, a, b - a).unwrap());
                let args = resnet::step::StepArgs { sync: Some(&g), ..resnet::step::StepArgs::new(0.0, 1.0, prec) };
                let o = m.train_step_explicit_with(&xr, &lr, args).unwrap();
                (b - a, Some(named(&m, &o.grads)), running(&m))
            })
        })
        .collect();
    let results: Vec<_> = handles.into_iter().map(|h| h.join().unwrap()).collect();
    let mut got: HashMap<String, Vec<f32>> = HashMap::new();
    for (count, grads, _) in &results {
        let Some(grads) = grads else { continue };
        let w = *count as f32 / n as f32;
        for (k, g) in grads {
            let acc = got.entry(k.clone()).or_insert_with(|| vec![0.0; g.len()]);
            acc.iter_mut().zip(g).for_each(|(a, v)| *a += w * v);
        }
    }
    let rel = |a: &[f32], b: &[f32]| {
        let num: f64 = a.iter().zip(b).map(|(x, y)| ((x - y) as f64).powi(2)).sum();
        let den: f64 = b.iter().map(|y| (*y as f64).powi(2)).sum();
        (num / den.max(1e-30)).sqrt()
    };
    // The per-rank statistics differ from the single process's by rounding, which can flip the ReLU mask of a
    // pre-activation within an ulp of 0; one flipped element moves the sums of its layer and those upstream by up
    // to ~1e-2 here. So: most parameters within `tol`, none beyond `tol_worst` (a wrong weighting is off by ~1
    // everywhere).
    let median_worst = |reference: &HashMap<String, Vec<f32>>, of: &HashMap<String, Vec<f32>>| {
        let mut errs: Vec<(f64, String)> = reference.iter().map(|(k, w)| (rel(&of[k], w), k.clone())).collect();
        errs.sort_by(|a, b| a.0.total_cmp(&b.0));
        (errs[errs.len() / 2].clone(), errs[errs.len() - 1].clone(), errs[errs.len().saturating_sub(5)..].to_vec())
    };
    let (median, worst, five) = median_worst(&want, &got);
    eprintln!("synced step, {prec:?}: gradient relative L2 error median {median:?}, worst {worst:?}");
    eprintln!("  worst five: {five:?}");
    match (tol, &want_f32) {
        (GradTol::Fixed(tol, tol_worst), _) => assert!(
            median.0 < tol && worst.0 < tol_worst,
            "gradients differ (relative L2): median {median:?}, worst {worst:?}"
        ),
        (GradTol::TimesOwnError(times), Some(f32_grads)) => {
            let (own_median, own_worst, _) = median_worst(f32_grads, &want);
            eprintln!(
                "  the single process's own {prec:?} error against FP32: median {own_median:?}, worst {own_worst:?}"
            );
            assert!(
                median.0 <= times * own_median.0,
                "gradients differ (relative L2): median {median:?} against the single process's own error {own_median:?}"
            );
        }
        (GradTol::TimesOwnError(_), None) => unreachable!("the FP32 reference runs for this tolerance"),
    }
    for (_, _, r) in &results {
        let mut worst: Vec<(f64, &String)> = want_running.iter().map(|(k, w)| (rel(&r[k], w), k)).collect();
        worst.sort_by(|a, b| b.0.total_cmp(&a.0));
        assert!(worst[0].0 < tol_running, "running statistics differ: {:?}", &worst[..3]);
    }
}

#[test]
fn synced_step_gradients_sum_to_the_single_process_gradients() {
    let cfg = tiny(&["kernels.conv=\"custom\"", "kernels.step=\"fused\"", "data.image_size=16", "data.val_resize=16"]);
    synced_step_matches_one_process(&cfg, &Device::Cpu, resnet::Precision::F32, GradTol::Fixed(1e-4, 5e-2), 1e-5);
}

/// The same on the GPU in bf16 (the CUDA build of this test binary, run by scripts/gpu-step.sh): the ranks are
/// threads on one GPU, each with a candle device of its own (its own stream and cuBLAS handle). bf16 activations
/// round differently per batch composition: the H100 run of 2026-12-05 measured the ranks 0.21 (median relative
/// L2) from the single process both with one shared device and with one device per rank, the size of bf16's own
/// error on this model (the fused-vs-autograd tests see 0.15-0.5 per parameter against FP32), hence a tolerance
/// relative to the single process's own error against FP32.
#[cfg(feature = "cuda")]
#[test]
fn synced_step_on_cuda_in_bf16() {
    let cfg = tiny(&[
        "device=\"cuda\"",
        "kernels.step=\"fused\"",
        "amp.dtype=\"bf16\"",
        "data.image_size=32",
        "data.val_resize=32",
    ]);
    let device = train::select_device(&cfg.device).unwrap();
    // Running statistics: bf16 holds 8 significant bits (~4e-3), and batches of 5, 4 and 3 images take other
    // conv tiles than one of 12, so the activations the statistics come from differ by rounding: 1.7e-3 (relative
    // L2, layer4.1.bn2.running_mean) on the H200 on 2026-12-05. Per-rank statistics would be ~10x further off.
    synced_step_matches_one_process(&cfg, &device, resnet::Precision::Bf16, GradTol::TimesOwnError(2.0), 5e-3);
}

/// The same on the GPU in FP32 (`kernels.conv = "custom"`: "auto" takes candle's NCHW convolution in FP32, which
/// the fused step does not run), so that a failure of the bf16 test above can be told apart (the
/// synchronisation's plumbing on CUDA, or bf16 rounding per batch composition). FP32 convolutions on CUDA go
/// through candle and cuDNN, whose FP32 math on the H100/H200 uses TF32 tensor cores (10-bit mantissa) with
/// algorithms chosen per batch size: the H200 run of 2026-12-05 measured the ranks 3.9e-3 (median relative L2)
/// and 7.0e-3 (worst) from the single process, hence 1e-2 and 3e-2; a wrong weighting is off by ~1.
#[cfg(feature = "cuda")]
#[test]
fn synced_step_on_cuda_in_f32() {
    let cfg = tiny(&[
        "device=\"cuda\"",
        "kernels.step=\"fused\"",
        "kernels.conv=\"custom\"",
        "data.image_size=32",
        "data.val_resize=32",
    ]);
    let device = train::select_device(&cfg.device).unwrap();
    synced_step_matches_one_process(&cfg, &device, resnet::Precision::F32, GradTol::Fixed(1e-2, 3e-2), 5e-3);
}
