//! Mixed precision on the CPU: forced overflow skips steps bit-exactly, fp16/bf16 learn like fp32, the scaler
//! state survives checkpoint and resume.

mod common;
use candle_core::{DType, Device, Tensor};
use common::{step_losses, tiny, TempDir};
use trainer::train::{self, Batch, StepRunner};

fn batch(n: usize, size: usize, classes: u32) -> Batch {
    let images = Tensor::randn(0f32, 1.0, (n, 3, size, size), &Device::Cpu).unwrap();
    let labels = Tensor::new((0..n as u32).map(|i| i % classes).collect::<Vec<_>>(), &Device::Cpu).unwrap();
    Batch { images, labels, n }
}

fn snapshot(r: &StepRunner) -> Vec<(String, Vec<f32>)> {
    let mut v: Vec<(String, Vec<f32>)> = r
        .model
        .store()
        .snapshot()
        .unwrap()
        .into_iter()
        .map(|(k, t)| (format!("model.{k}"), t.flatten_all().unwrap().to_dtype(DType::F32).unwrap().to_vec1().unwrap()))
        .collect();
    for (k, t) in r.opt.state_tensors().unwrap() {
        v.push((format!("optim.{k}"), t.flatten_all().unwrap().to_vec1().unwrap()));
    }
    v
}

#[test]
fn forced_overflow_skips_steps_and_halves_the_scale() {
    let cfg = tiny(&["amp.dtype=\"fp16\""]);
    let model = train::build_model(&cfg, &Device::Cpu).unwrap();
    let mut r = StepRunner::new(&cfg, model).unwrap();
    assert!(r.scaler.enabled && r.scaler.scale == 1024.0);
    let b = batch(8, 8, 4);
    // One clean step creates optimizer state.
    let out = r.step(std::slice::from_ref(&b), 0.05).unwrap();
    assert!(!out.skipped, "clean fp16 step skipped");
    assert_eq!(r.opt.state_tensors().unwrap().len(), r.opt.len());
    // A huge scale overflows FP16 gradients: every step is skipped, nothing changes but the scale.
    // (A power of two: the device keeps the scale in FP32, as torch.amp.GradScaler's scale tensor is.)
    let huge = 2f64.powi(100);
    r.scaler.scale = huge;
    let before = snapshot(&r);
    let steps_before = r.opt.steps;
    // Running statistics of BatchNorm do move in a forward pass (as in PyTorch); compare everything else.
    let keep = |v: Vec<(String, Vec<f32>)>| {
        v.into_iter().filter(|(k, _)| !k.contains("running_") && !k.contains("num_batches")).collect::<Vec<_>>()
    };
    let before = keep(before);
    let mut scales = vec![];
    for _ in 0..3 {
        let out = r.step(std::slice::from_ref(&b), 0.05).unwrap();
        assert!(out.skipped, "overflowing step was applied");
        scales.push(out.loss_scale);
    }
    assert_eq!(scales, vec![huge, huge / 2.0, huge / 4.0]);
    assert_eq!(r.scaler.scale, huge / 8.0);
    assert_eq!(r.scaler.growth_tracker, 0);
    assert_eq!(r.opt.steps, steps_before);
    let after = keep(snapshot(&r));
    assert_eq!(before.len(), after.len());
    for ((k, a), (_, b)) in before.iter().zip(&after) {
        assert!(a == b, "{k} changed during skipped steps");
    }
}

#[test]
fn low_precision_learns_like_fp32() {
    let mut top1 = vec![];
    for dtype in ["fp32", "bf16", "fp16"] {
        let dir = TempDir::new(&format!("amp-{dtype}"));
        let cfg = tiny(&[
            "data.num_samples=192",
            "train.epochs=4",
            "sched.name=\"cosine\"",
            "sched.warmup_epochs=0.5",
            &format!("amp.dtype=\"{dtype}\""),
        ]);
        let s = train::train(&cfg, dir.path(), false).unwrap();
        top1.push(s.val.unwrap().top1);
    }
    eprintln!("val top1 fp32/bf16/fp16: {top1:?}");
    assert!(top1[0] > 45.0, "fp32 did not learn: {top1:?}");
    for t in &top1[1..] {
        assert!((t - top1[0]).abs() <= 15.0, "low precision far from fp32: {top1:?}");
    }
}

#[test]
fn scaler_state_survives_checkpoint_and_resume() {
    let full = TempDir::new("amp-full");
    let split = TempDir::new("amp-split");
    let o = ["amp.dtype=\"fp16\"", "amp.growth_interval=3", "amp.init_scale=256", "train.epochs=2"];
    let a = train::train(&tiny(&o), full.path(), false).unwrap();
    let mut first = o.to_vec();
    first.push("train.epochs=1");
    train::train(&tiny(&first), split.path(), false).unwrap();
    let ck =
        trainer::checkpoint::load(&trainer::checkpoint::latest(&split.path().join("checkpoints")).unwrap()).unwrap();
    assert!(ck.state.scaler.enabled);
    assert_eq!(ck.state.step, 4);
    // 4 clean steps at interval 3: grown once, one step counted since.
    assert_eq!((ck.state.scaler.scale, ck.state.scaler.growth_tracker), (512.0, 1));
    let b = train::train(&tiny(&o), split.path(), true).unwrap();
    assert_eq!(a.steps, b.steps);
    let scales = |d: &std::path::Path| -> Vec<f64> {
        std::fs::read_to_string(d.join("metrics.jsonl"))
            .unwrap()
            .lines()
            .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
            .filter(|v| v["kind"] == "step")
            .map(|v| v["loss_scale"].as_f64().unwrap())
            .collect()
    };
    assert_eq!(scales(full.path()), scales(split.path()));
    assert_eq!(step_losses(full.path()), step_losses(split.path()), "resumed run diverged from the uninterrupted one");
}

/// Steps queued ahead of their reports (the trainer reads step k's once step k + 1 is queued): the loss scale,
/// growth tracker and step count live on the device between them, the reports come back in order and equal those
/// of steps read one by one, and a report read out of order is refused.
#[test]
fn queued_steps_report_like_steps_read_one_by_one() {
    let cfg = tiny(&["amp.dtype=\"fp16\"", "amp.growth_interval=2"]);
    let runner = || StepRunner::new(&cfg, train::build_model(&cfg, &Device::Cpu).unwrap()).unwrap();
    let (mut one, mut queued) = (runner(), runner());
    let batches: Vec<Batch> = (0..3).map(|_| batch(8, 8, 4)).collect();
    let want: Vec<_> = batches.iter().map(|b| one.step(std::slice::from_ref(b), 0.05).unwrap()).collect();
    let p0 = queued.step_async(std::slice::from_ref(&batches[0]), 0.05).unwrap();
    let p1 = queued.step_async(std::slice::from_ref(&batches[1]), 0.05).unwrap();
    assert!(!queued.idle());
    let e = queued.resolve(p1).unwrap_err().to_string();
    assert!(e.contains("out of order"), "{e}");
    drop(p0);
    // Two steps in flight at most, as the trainer runs them, on a fresh runner.
    let mut queued = runner();
    let mut got = Vec::new();
    let mut in_flight = None;
    for b in &batches {
        let p = queued.step_async(std::slice::from_ref(b), 0.05).unwrap();
        if let Some(prev) = in_flight.replace(p) {
            got.push(queued.resolve(prev).unwrap());
        }
    }
    got.push(queued.resolve(in_flight.unwrap()).unwrap());
    assert!(queued.idle());
    for (i, (a, b)) in want.iter().zip(&got).enumerate() {
        assert_eq!((a.loss, a.correct, a.samples, a.skipped), (b.loss, b.correct, b.samples, b.skipped), "step {i}");
        assert_eq!((a.loss_scale, a.grad_norm), (b.loss_scale, b.grad_norm), "step {i}");
    }
    // Three clean steps at growth interval 2: the scale doubled once, one step counted since.
    assert_eq!((queued.scaler.scale, queued.scaler.growth_tracker, queued.opt.steps), (2048.0, 1, 3));
    assert_eq!(snapshot(&queued), snapshot(&one));
}
