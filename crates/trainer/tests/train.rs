//! End-to-end training on the CPU: overfitting, learning, optimizers, fine-tuning and mixed precision.

mod common;
use common::{tiny, TempDir};
use trainer::train;

#[test]
fn overfits_one_batch() {
    let dir = TempDir::new("overfit");
    // One batch of 16 samples seen 30 times: the loss must collapse.
    let cfg = tiny(&[
        "data.num_samples=16",
        "train.epochs=30",
        "optim.lr=0.02",
        "optim.weight_decay=0",
        "checkpoint.every_epochs=0",
    ]);
    let s = train::train(&cfg, dir.path(), false).unwrap();
    assert_eq!(s.steps, 30);
    let first = s.losses[0];
    assert!(s.last_loss < 0.1 * first && s.last_loss < 0.2, "loss {first} -> {}", s.last_loss);
}

#[test]
fn learns_generated_data_and_writes_run_folder() {
    let dir = TempDir::new("learn");
    let cfg = tiny(&["data.num_samples=192", "train.epochs=4", "sched.name=\"cosine\"", "sched.warmup_epochs=0.5"]);
    let s = train::train(&cfg, dir.path(), false).unwrap();
    let val = s.val.unwrap();
    let l = &s.losses;
    let median = |v: &[f64]| {
        let mut v = v.to_vec();
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    // Medians: a single spiky step at this tiny batch size must not decide the test.
    let (head, tail) = (median(&l[..12]), median(&l[l.len() - 12..]));
    eprintln!("train loss {head:.3} -> {tail:.3}, val top1 {:.1}%", val.top1);
    assert!(tail < 0.8 * head, "train loss did not fall: {head} -> {tail}");
    assert!(val.top1 > 45.0, "val top1 {} (chance 25%)", val.top1);
    // Run folder: metrics with step and epoch records, checkpoints, best, final weights, plot.
    let metrics = std::fs::read_to_string(dir.path().join("metrics.jsonl")).unwrap();
    let recs: Vec<serde_json::Value> = metrics.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    let epochs: Vec<_> = recs.iter().filter(|r| r["kind"] == "epoch").collect();
    assert_eq!(epochs.len(), 4);
    for k in ["train_loss", "val_loss", "val_top1", "val_top5", "img_per_s", "loader_img_per_s", "data_wait_s"] {
        assert!(epochs[3][k].is_number(), "{k}");
    }
    // The training thread's waits for the loader: per step and per epoch, within the epoch's time.
    let wait = epochs[3]["data_wait_s"].as_f64().unwrap();
    let epoch_s = 192.0 / epochs[3]["img_per_s"].as_f64().unwrap();
    assert!((0.0..=epoch_s * 1.5).contains(&wait), "waited {wait} s in an epoch of ~{epoch_s} s");
    let step = recs.iter().find(|r| r["kind"] == "step").unwrap();
    for k in ["step", "epoch", "loss", "lr", "loss_scale", "skipped", "img_per_s", "data_wait_ms"] {
        assert!(!step[k].is_null(), "{k}");
    }
    assert!(dir.path().join("checkpoints/best.safetensors").is_file());
    assert_eq!(trainer::checkpoint::list(&dir.path().join("checkpoints")).len(), 2, "keep_last = 2");
    assert!(dir.path().join("model.safetensors").is_file());
    assert!(dir.path().join("curves.png").is_file());
    let svg = std::fs::read_to_string(dir.path().join("curves.svg")).expect("curves.svg next to curves.png");
    for label in ["cross-entropy loss (nats)", "accuracy (%)", "top-1", "validation"] {
        assert!(svg.contains(&format!("{label}\n</text>")), "curves.svg lacks the text {label:?}");
    }
}

#[test]
fn adamw_grad_accum_clipping_and_smoothing_train() {
    adamw_grad_accum_clipping_and_smoothing("adamw", &[]);
}

/// The same on the explicit step (kernels.step = "fused", fp32 on the CPU): AdamW, gradient accumulation,
/// clipping, label smoothing and a multistep schedule.
#[test]
fn adamw_grad_accum_clipping_and_smoothing_train_on_the_fused_step() {
    adamw_grad_accum_clipping_and_smoothing("adamw-fused", &["kernels.conv=\"custom\"", "kernels.step=\"fused\""]);
}

fn adamw_grad_accum_clipping_and_smoothing(name: &str, extra: &[&str]) {
    let dir = TempDir::new(name);
    let mut sets = vec![
        "optim.name=\"adamw\"",
        "optim.lr=0.003",
        "optim.weight_decay=0.05",
        "optim.no_decay_bn_bias=true",
        "train.grad_accum=2",
        "train.batch_size=8",
        "train.clip_grad_norm=1.0",
        "train.label_smoothing=0.1",
        "sched.name=\"multistep\"",
        "sched.milestones=[1]",
        "train.epochs=3",
    ];
    sets.extend_from_slice(extra);
    let cfg = tiny(&sets);
    let s = train::train(&cfg, dir.path(), false).unwrap();
    // 64 samples / 8 per micro-batch / 2 per step = 4 steps per epoch.
    assert_eq!(s.steps, 12);
    assert!(s.losses.iter().all(|l| l.is_finite()));
    let grad_norms: Vec<f64> = std::fs::read_to_string(dir.path().join("metrics.jsonl"))
        .unwrap()
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|v| v["kind"] == "step")
        .map(|v| v["grad_norm"].as_f64().unwrap())
        .collect();
    assert_eq!(grad_norms.len(), 12);
    assert!(s.losses[8..].iter().sum::<f64>() < s.losses[..4].iter().sum::<f64>());
}

/// Checkpoint and `--resume` on the explicit step: a run of 2 epochs, and a run stopped after epoch 1 then
/// resumed to 2 epochs, log the same losses and end with the same weights (the FP32 masters are the ParamStore's
/// tensors, so the checkpoint files are those of the autograd path).
#[test]
fn fused_step_resumes_exactly() {
    let fused = ["kernels.conv=\"custom\"", "kernels.step=\"fused\"", "checkpoint.every_epochs=1"];
    let with = |epochs: &str| tiny(&[&fused[..], &[epochs]].concat());
    let (full, cut) = (TempDir::new("fused-full"), TempDir::new("fused-cut"));
    train::train(&with("train.epochs=2"), full.path(), false).unwrap();
    train::train(&with("train.epochs=1"), cut.path(), false).unwrap();
    train::train(&with("train.epochs=2"), cut.path(), true).unwrap();
    let (a, b) = (common::step_losses(full.path()), common::step_losses(cut.path()));
    assert_eq!(a.len(), 8, "{a:?}");
    assert_eq!(a, b, "resumed losses differ from the uninterrupted run");
    let wa = std::fs::read(full.path().join("model.safetensors")).unwrap();
    let wb = std::fs::read(cut.path().join("model.safetensors")).unwrap();
    assert!(wa == wb, "final weights differ");
}

#[test]
fn max_steps_stops_early() {
    let dir = TempDir::new("maxsteps");
    let s = train::train(&tiny(&["train.max_steps=3", "train.epochs=5"]), dir.path(), false).unwrap();
    assert_eq!(s.steps, 3);
}

#[test]
fn fine_tuning_freezes_and_replaces_the_head() {
    fine_tune("finetune", &[], "autograd");
}

/// The same fine-tuning on the explicit step (kernels.step = "fused", fp32 on the CPU): freezing, the head's
/// learning rate and frozen BatchNorm statistics work there too.
#[test]
fn fine_tuning_runs_on_the_fused_step() {
    fine_tune("finetune-fused", &["kernels.conv=\"custom\"", "kernels.step=\"fused\""], "fused");
}

fn fine_tune(name: &str, extra: &[&str], engine: &str) {
    let dir = TempDir::new(name);
    // Pretrain a 4-class model, then fine-tune it on 3 classes with the stem and layer1 frozen.
    let pre = train::train(&tiny(&["train.epochs=1"]), &dir.path().join("pre"), false).unwrap();
    let weights = pre.run_dir.join("model.safetensors");
    let init = format!("model.init_from=\"{}\"", weights.display());
    let mut sets = vec![
        "model.num_classes=3",
        &init,
        "finetune.freeze=[\"conv1\", \"bn1\", \"layer1\"]",
        "finetune.head_lr_mult=2",
        "optim.lr=0.005",
        "finetune.bn_frozen=true",
        "train.epochs=1",
    ];
    sets.extend_from_slice(extra);
    let cfg = tiny(&sets);
    let model = train::build_model(&cfg, &candle_core::Device::Cpu).unwrap();
    assert_eq!(model.store().get("fc.weight").unwrap().param.var().dims(), &[3, 512]);
    let trainable: Vec<String> = model.store().trainable().into_iter().map(|(n, _)| n).collect();
    assert!(trainable.iter().all(|n| !n.starts_with("layer1.") && !n.starts_with("conv1") && !n.starts_with("bn1")));
    assert!(trainable.iter().any(|n| n == "fc.weight") && trainable.iter().any(|n| n.starts_with("layer2.")));
    let runner = train::StepRunner::new(&cfg, model).unwrap();
    assert_eq!(runner.opt.len(), trainable.len(), "no optimizer state for frozen parameters");
    assert_eq!(runner.engine.to_string(), engine);

    let before = resnet::weights::read_safetensors(&weights).unwrap();
    let s = train::train(&cfg, &dir.path().join("ft"), false).unwrap();
    let after = resnet::weights::read_safetensors(&s.run_dir.join("model.safetensors")).unwrap();
    let same = |k: &str| {
        before[k].flatten_all().unwrap().to_vec1::<f32>().unwrap()
            == after[k].flatten_all().unwrap().to_vec1::<f32>().unwrap()
    };
    assert!(same("conv1.weight") && same("layer1.1.conv2.weight") && same("bn1.weight"), "frozen tensors changed");
    assert!(same("layer2.0.bn1.running_mean"), "bn_frozen: running statistics changed");
    assert!(!same("layer2.0.conv1.weight"), "trainable tensors did not change");
    assert_eq!(after["fc.weight"].dims(), &[3, 512]);
}

#[test]
fn unknown_freeze_prefix_is_named() {
    let cfg = tiny(&["finetune.freeze=[\"layer9\"]"]);
    let e = train::build_model(&cfg, &candle_core::Device::Cpu).unwrap_err().to_string();
    assert!(e.contains("layer9"), "{e}");
}

#[test]
fn nan_loss_stops_and_keeps_the_last_good_checkpoint() {
    let dir = TempDir::new("nan");
    // Epoch 1 trains normally; from epoch 2 the learning rate is 5e7 and the loss blows up.
    let cfg = tiny(&["train.epochs=3", "sched.name=\"multistep\"", "sched.milestones=[1]", "sched.gamma=1e9"]);
    let e = train::train(&cfg, dir.path(), false).unwrap_err().to_string();
    assert!(
        (e.contains("loss became") || e.contains("gradient norm became")) && e.contains("last good checkpoint"),
        "{e}"
    );
    let ck = trainer::checkpoint::latest(&dir.path().join("checkpoints")).unwrap();
    assert!(e.contains(&ck.display().to_string()), "{e}");
    let loaded = trainer::checkpoint::load(&ck).unwrap();
    assert_eq!((loaded.state.epoch, loaded.state.step), (1, 4));
    assert!(loaded.model.values().all(|t| t
        .to_dtype(candle_core::DType::F32)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap()
        .iter()
        .all(|v| v.is_finite())));
}

/// `kernels.conv = "custom"` (and `kernels.matmul = "custom"`) is accepted, makes the model channels-last, and a
/// short CPU run trains with the losses of the NCHW model (same seed, data and order: same numbers up to
/// summation order).
#[test]
fn custom_kernels_train_channels_last_on_cpu() {
    let custom = tiny(&["kernels.conv=\"custom\"", "kernels.matmul=\"custom\"", "train.max_steps=4"]);
    use trainer::config::{ConvChoice, MatmulChoice};
    assert_eq!((custom.kernels.conv, custom.kernels.matmul), (ConvChoice::Custom, MatmulChoice::Custom));
    assert!(train::build_model(&custom, &candle_core::Device::Cpu).unwrap().config.channels_last());
    // "auto" (the default) on the CPU: candle's convolution, NCHW.
    let plain = tiny(&["train.max_steps=4"]);
    assert_eq!((plain.kernels.conv, plain.kernels.matmul), (ConvChoice::Auto, MatmulChoice::Auto));
    assert!(!train::build_model(&plain, &candle_core::Device::Cpu).unwrap().config.channels_last());
    for bad in ["kernels.conv=\"winograd\"", "kernels.matmul=\"cutlass\""] {
        let e = format!(
            "{:#}",
            trainer::config::Config::from_str_with(common::TINY, "tiny.toml", &[bad.into()]).unwrap_err()
        );
        let key = bad.split('=').next().unwrap();
        assert!(e.contains(key) && !e.contains('\n'), "{e}");
    }

    let (d1, d2) = (TempDir::new("custom-nhwc"), TempDir::new("custom-nchw"));
    let s = train::train(&custom, d1.path(), false).unwrap();
    let r = train::train(&plain, d2.path(), false).unwrap();
    assert_eq!(s.steps, 4);
    assert!(s.losses.iter().all(|l| l.is_finite()), "{:?}", s.losses);
    for (a, b) in s.losses.iter().zip(&r.losses) {
        assert!((a - b).abs() <= 1e-4 * b.abs().max(1.0), "channels-last losses {:?} vs NCHW {:?}", s.losses, r.losses);
    }
    assert!(d1.path().join("model.safetensors").is_file());
}

/// `kernels.step = "fused"` (the explicit step of resnet::step, here on the CPU in fp32) trains as autograd does:
/// the same losses over the first steps (same seed, data and order), and it learns the generated data. A config
/// it cannot run is refused naming the key, and bad values name the allowed ones.
#[test]
fn fused_step_trains_like_autograd() {
    let common_args = [
        "kernels.conv=\"custom\"",
        "data.num_samples=160",
        "train.epochs=3",
        "sched.name=\"cosine\"",
        "sched.warmup_epochs=0.5",
        "train.label_smoothing=0.1",
        "checkpoint.every_epochs=0",
    ];
    let with = |step: &str| tiny(&[&common_args[..], &[step]].concat());
    let (fused, autograd) = (with("kernels.step=\"fused\""), with("kernels.step=\"autograd\""));
    let (d1, d2) = (TempDir::new("step-fused"), TempDir::new("step-autograd"));
    let f = train::train(&fused, d1.path(), false).unwrap();
    let a = train::train(&autograd, d2.path(), false).unwrap();
    assert_eq!(f.steps, a.steps);
    // The first three losses: at 8x8 inputs layer4's BatchNorms normalise 16 values per channel, so once the two
    // engines' last-bit differences flip a ReLU there (seen at the fourth step), the runs part by ~1e-3 and then
    // drift apart as any two chaotic runs do; both must still learn (below).
    for (i, (x, y)) in f.losses.iter().zip(&a.losses).take(3).enumerate() {
        assert!((x - y).abs() <= 1e-3 * y.abs().max(1.0), "step {i}: fused {:?} vs autograd {:?}", f.losses, a.losses);
    }
    let (fv, av) = (f.val.unwrap(), a.val.unwrap());
    eprintln!("val top1: fused {:.1}%, autograd {:.1}%", fv.top1, av.top1);
    assert!(fv.top1 > 45.0, "fused val top1 {} (chance 25%)", fv.top1);
    assert!(d1.path().join("model.safetensors").is_file());

    // "fused" on the NCHW model, or in bf16 on the CPU: refused, naming the key.
    for args in
        [&["kernels.step=\"fused\""][..], &["kernels.step=\"fused\"", "kernels.conv=\"custom\"", "amp.dtype=\"bf16\""]]
    {
        let cfg = tiny(args);
        let e = format!("{:#}", train::train(&cfg, TempDir::new("step-bad").path(), false).unwrap_err());
        assert!(e.contains("kernels.step") && !e.contains('\n'), "{e}");
    }
    let e = format!(
        "{:#}",
        trainer::config::Config::from_str_with(common::TINY, "tiny.toml", &["kernels.step=\"turbo\"".into()])
            .unwrap_err()
    );
    assert!(e.contains("kernels.step = \"turbo\" is not one of auto, fused, autograd"), "{e}");
}

#[test]
fn recompute_needs_the_fused_step() {
    let cfg = tiny(&["kernels.recompute=\"relu\""]);
    let model = train::build_model(&cfg, &candle_core::Device::Cpu).unwrap();
    let e = train::StepRunner::new(&cfg, model).err().unwrap().to_string();
    assert!(e.starts_with("kernels.recompute = \"relu\" needs the fused step, but this run takes autograd"), "{e}");
    let e = trainer::config::Config::from_str_with(common::TINY, "t.toml", &["kernels.recompute=\"all\"".into()])
        .unwrap_err();
    assert_eq!(
        format!("{e:#}"),
        "--set kernels.recompute=\"all\": kernels.recompute = \"all\" is not one of none, relu, relu+conv"
    );
    // With the fused step it trains (the gradients equal the plain step's: tests/tests/step.rs).
    let dir = TempDir::new("recompute");
    let fused =
        ["kernels.recompute=\"relu+conv\"", "kernels.conv=\"custom\"", "kernels.step=\"fused\"", "train.epochs=1"];
    let s = train::train(&tiny(&fused), dir.path(), false).unwrap();
    assert!(s.last_loss.is_finite());
}

/// `kernels.graph`: "on" where graphs cannot run is one line naming the reason; "auto" (the default) and "off"
/// train on the CPU as before.
#[test]
fn graph_on_needs_cuda_and_the_fused_step() {
    for sets in [
        vec!["kernels.graph=\"on\""],
        vec!["kernels.graph=\"on\"", "kernels.conv=\"custom\"", "kernels.step=\"fused\""],
    ] {
        let cfg = tiny(&sets);
        let model = train::build_model(&cfg, &candle_core::Device::Cpu).unwrap();
        let e = train::StepRunner::new(&cfg, model).err().unwrap().to_string();
        assert_eq!(e, "kernels.graph = \"on\": CUDA graphs need a CUDA device");
    }
    for graph in ["auto", "off"] {
        let dir = TempDir::new("graph");
        let set = format!("kernels.graph=\"{graph}\"");
        let s = train::train(&tiny(&[set.as_str(), "train.epochs=1"]), dir.path(), false).unwrap();
        assert!(s.last_loss.is_finite());
    }
}

/// A device allocation that fails in a training step or a validation ends in one line naming the batch setting
/// that asked for the memory and what fits in less; any other failure keeps its cause under what was running.
#[test]
fn out_of_memory_names_the_batch_setting() {
    use train::{device_failure, HostPass};
    let cfg = tiny(&["train.batch_size=256"]);
    let oom = || anyhow::anyhow!("DriverError(CUDA_ERROR_OUT_OF_MEMORY, \"out of memory\")");
    let e = device_failure(oom(), "training step 13 (epoch 2)", "train.batch_size = 256", HostPass::Train, &cfg);
    let msg = trainer::one_line(&e);
    for want in [
        "out of GPU memory in training step 13 (epoch 2) at train.batch_size = 256",
        "train.grad_accum",
        "kernels.recompute",
        "trainer sweep --max",
        "CUDA_ERROR_OUT_OF_MEMORY",
    ] {
        assert!(msg.contains(want), "{want:?} missing from {msg:?}");
    }
    assert!(!msg.contains('\n'), "{msg:?}");
    let e = device_failure(oom(), "validation after epoch 1", "train.eval_batch_size = 512", HostPass::Eval, &cfg);
    let msg = trainer::one_line(&e);
    assert!(msg.starts_with("out of GPU memory in validation after epoch 1 at train.eval_batch_size = 512"), "{msg}");
    assert!(!msg.contains("recompute"), "{msg}");
    let e = device_failure(anyhow::anyhow!("a kernel failed"), "training step 3 (epoch 1)", "x", HostPass::Train, &cfg);
    assert_eq!(trainer::one_line(&e), "training step 3 (epoch 1): a kernel failed");
}
