//! The `trainer` binary: kill -9 then --resume ends where an uninterrupted run ends; bad inputs give one-line errors.

mod common;
use common::{step_losses, TempDir, TINY};
use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_trainer");

fn trainer(args: &[&str]) -> Output {
    Command::new(BIN).args(args).output().expect("run trainer")
}

fn write_config(dir: &Path, extra: &str) -> String {
    let p = dir.join("tiny.toml");
    std::fs::write(&p, format!("{TINY}\n{extra}")).unwrap();
    p.display().to_string()
}

/// Asserts a failure with one `error:` line on stderr that contains every `needle`, and no panic.
fn assert_error(out: &Output, needles: &[&str]) {
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "expected failure, stderr: {err}");
    assert_eq!(out.status.code(), Some(1), "exit code, stderr: {err}");
    assert!(!err.contains("panicked"), "panic: {err}");
    let line = err.lines().find(|l| l.starts_with("error:")).unwrap_or_else(|| panic!("no error line in: {err}"));
    for n in needles {
        assert!(line.contains(n), "`{n}` not in: {line}");
    }
}

#[test]
fn kill_9_then_resume_matches_uninterrupted_run() {
    let dir = TempDir::new("kill9");
    // 3 epochs of 4 steps, a checkpoint every 2 steps.
    let cfg = write_config(dir.path(), "");
    let sets = ["--set", "train.epochs=3", "--set", "checkpoint.every_steps=2", "--set", "checkpoint.every_epochs=0"];
    let full = dir.path().join("full");
    let out =
        Command::new(BIN).args(["--config", &cfg, "--run-dir", full.to_str().unwrap()]).args(sets).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));

    let cut = dir.path().join("cut");
    let mut child = Command::new(BIN)
        .args(["--config", &cfg, "--run-dir", cut.to_str().unwrap()])
        .args(sets)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    // Kill once a mid-run checkpoint (step 6 or later, i.e. inside epoch 2) is on disk.
    let t0 = Instant::now();
    loop {
        let latest = trainer::checkpoint::latest(&cut.join("checkpoints"));
        if latest.is_some_and(|p| p.file_name().unwrap().to_str().unwrap() >= "step-000000006") {
            break;
        }
        assert!(child.try_wait().unwrap().is_none(), "training finished before it could be killed");
        assert!(t0.elapsed() < Duration::from_secs(600), "no checkpoint appeared");
        std::thread::sleep(Duration::from_millis(20));
    }
    child.kill().unwrap(); // SIGKILL
    child.wait().unwrap();
    let out = Command::new(BIN)
        .args(["--config", &cfg, "--run-dir", cut.to_str().unwrap(), "--resume"])
        .args(sets)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let (a, b) = (step_losses(&full), step_losses(&cut));
    assert_eq!(a.len(), 12);
    assert_eq!(a, b, "resumed losses differ from the uninterrupted run");
    // The final weights are identical too.
    let wa = std::fs::read(full.join("model.safetensors")).unwrap();
    let wb = std::fs::read(cut.join("model.safetensors")).unwrap();
    assert!(wa == wb, "final weights differ");
    // Without --resume the run directory is protected.
    let out = Command::new(BIN).args(["--config", &cfg, "--run-dir", cut.to_str().unwrap()]).output().unwrap();
    assert_error(&out, &["already holds checkpoints", "--resume"]);
}

/// A run directory whose only checkpoint is the best one (no periodic checkpoints kept) is protected like any
/// other, and `--resume` continues from that checkpoint; a refused resume leaves the run's config.toml as it was.
#[test]
fn best_only_runs_are_protected_and_resumable() {
    let dir = TempDir::new("bestonly");
    let cfg = write_config(dir.path(), "");
    let run = dir.path().join("run");
    let r = run.to_str().unwrap();
    let sets = ["--set", "checkpoint.every_epochs=0", "--set", "train.epochs=1"];
    let out = Command::new(BIN).args(["--config", &cfg, "--run-dir", r]).args(sets).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let best = run.join("checkpoints").join("best.safetensors");
    assert!(best.is_file());
    // As a run killed after its best checkpoint, before the final one and the final model.
    for p in trainer::checkpoint::list(&run.join("checkpoints")) {
        std::fs::remove_file(p).unwrap();
    }
    std::fs::remove_file(run.join("model.safetensors")).unwrap();
    let before = std::fs::read(&best).unwrap();
    let out = Command::new(BIN).args(["--config", &cfg, "--run-dir", r]).args(sets).output().unwrap();
    assert_error(&out, &["already holds checkpoints", "best.safetensors", "--resume"]);
    assert!(std::fs::read(&best).unwrap() == before, "the best checkpoint was overwritten");
    // A resume the checkpoint refuses (another architecture) changes nothing in the run directory.
    let config_before = std::fs::read(run.join("config.toml")).unwrap();
    let out = Command::new(BIN)
        .args(["--config", &cfg, "--run-dir", r, "--resume", "--set", "model.arch=\"resnet34\""])
        .args(sets)
        .output()
        .unwrap();
    assert_error(&out, &["best.safetensors", "resnet18", "resnet34"]);
    assert!(std::fs::read(run.join("config.toml")).unwrap() == config_before, "a refused resume rewrote config.toml");
    // Resuming continues from the best checkpoint (two epochs now: one more to train).
    let resume_two_epochs = || {
        let sets = ["--set", "checkpoint.every_epochs=0", "--set", "train.epochs=2"];
        Command::new(BIN).args(["--config", &cfg, "--run-dir", r, "--resume"]).args(sets).output().unwrap()
    };
    let out = resume_two_epochs();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(err.contains("resuming from the best one") && err.contains("(epoch 2, step 4)"), "{err}");
    // Resumed again, the finished run takes no step and says so.
    let out = resume_two_epochs();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success() && err.contains("has finished this run") && err.contains("none taken by this process"),
        "{err}"
    );
    // eval holds a checkpoint to the config's architecture, as --resume does.
    let out = trainer(&[
        "eval",
        "--config",
        &cfg,
        "--set",
        "model.arch=\"resnet34\"",
        "--checkpoint",
        best.to_str().unwrap(),
    ]);
    assert_error(&out, &["best.safetensors", "checkpoint is resnet18", "resnet34"]);
    // A --resume into a directory that does not exist fails without creating it.
    let gone = dir.path().join("gone");
    let out = trainer(&["--config", &cfg, "--run-dir", gone.to_str().unwrap(), "--resume"]);
    assert_error(&out, &["no checkpoint"]);
    assert!(!gone.exists(), "a failed --resume created {}", gone.display());
}

/// Usage errors (clap's) are one line naming the argument, exit code 2; --help still prints the usage.
#[test]
fn usage_errors_are_one_line() {
    for (args, want) in [
        (vec!["--bogus"], "unexpected argument '--bogus'"),
        (vec!["eval", "--config", "x.toml"], "--checkpoint"),
        (vec!["frobnicate"], "'frobnicate'"),
        (vec!["bench", "--config", "x.toml", "--batch-sizes", "99999999999999999999"], "--batch-sizes"),
    ] {
        let out = trainer(&args);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
        assert_eq!(err.lines().count(), 1, "{args:?}: {err}");
        assert!(err.starts_with("error: ") && err.contains(want) && err.contains("(see --help)"), "{err}");
    }
    let out = trainer(&["--help"]);
    assert!(out.status.success() && String::from_utf8_lossy(&out.stdout).contains("Usage:"));
}

#[test]
fn bad_configs_name_the_culprit() {
    let dir = TempDir::new("badcfg");
    let cfg = write_config(dir.path(), "");
    let run = dir.path().join("run");
    let r = run.to_str().unwrap();
    // (extra args, substrings the error line must hold)
    let cases: Vec<(Vec<&str>, Vec<&str>)> = vec![
        (vec!["--set", "train.nope=1"], vec!["train.nope"]),
        (vec!["--set", "train.batch_size=abc"], vec!["batch_size"]),
        (vec!["--set", "model.arch=resnet19"], vec!["model.arch", "resnet19"]),
        (vec!["--set", "train.batch_size=0"], vec!["train.batch_size"]),
        (vec!["--set", "optim.lr=-1"], vec!["optim.lr"]),
        // At least 286 GiB at 8 px: refused before anything is allocated.
        (vec!["--set", "train.batch_size=1000000"], vec!["train.batch_size = 1000000", "would run out of memory"]),
        // Evaluation: 1,000,000 validation images in one batch at 8 px, at least 61 GiB; refused before the
        // first epoch, not at its end.
        (
            vec!["--set", "data.num_samples=10000000", "--set", "train.eval_batch_size=1000000"],
            vec!["train.eval_batch_size = 1000000", "evaluation", "would run out of memory"],
        ),
        (vec!["--set", "train"], vec!["--set", "key=value"]),
        (
            vec![
                "--set",
                "data.kind=\"cifar10\"",
                "--set",
                "data.dir=\"/nonexistent/cifar\"",
                "--set",
                "model.num_classes=10",
            ],
            vec!["/nonexistent/cifar"],
        ),
        (
            vec![
                "--set",
                "data.kind=\"imagefolder\"",
                "--set",
                "data.train_dir=\"/nonexistent/train\"",
                "--set",
                "data.val_dir=\"/nonexistent/val\"",
            ],
            vec!["/nonexistent/train"],
        ),
        (vec!["--set", "model.init_from=\"/nonexistent/w.safetensors\""], vec!["/nonexistent/w.safetensors"]),
        (vec!["--set", "device=\"tpu\""], vec!["device", "tpu"]),
        (vec!["--set", "kernels.conv=\"winograd\""], vec!["kernels.conv", "winograd", "custom"]),
        (vec!["--set", "kernels.matmul=\"cutlass\""], vec!["kernels.matmul", "cutlass", "cublas, custom"]),
        (vec!["--set", "kernels.autotune_cache=\"\""], vec!["kernels.autotune_cache", "empty"]),
        (vec!["--set", "kernels.autotune=\"yes\""], vec!["kernels.autotune"]),
        (vec!["--resume"], vec!["no checkpoint"]),
    ];
    for (extra, needles) in cases {
        let mut args = vec!["--config", cfg.as_str(), "--run-dir", r];
        args.extend(extra.iter());
        let out = trainer(&args);
        assert_error(&out, &needles);
        // A refused run leaves no run directory behind.
        assert!(!run.exists(), "{extra:?} left {}", run.display());
    }
    assert_error(&trainer(&["--config", "/nonexistent/x.toml"]), &["/nonexistent/x.toml", "not found"]);
    let bad = dir.path().join("bad.toml");
    std::fs::write(&bad, "[train]\nbatchsize = 3\n").unwrap();
    assert_error(&trainer(&["--config", bad.to_str().unwrap()]), &["bad.toml", "batchsize"]);
    std::fs::write(&bad, "[train\n").unwrap();
    assert_error(&trainer(&["--config", bad.to_str().unwrap()]), &["bad.toml"]);
    if !cfg!(feature = "cuda") {
        assert_error(&trainer(&["--config", &cfg, "--run-dir", r, "--set", "device=\"cuda\""]), &["without CUDA"]);
    }
}

#[test]
fn bad_files_name_the_file() {
    let dir = TempDir::new("badfiles");
    let cfg = write_config(dir.path(), "");
    // A corrupt JPEG in an image folder: stop and name it, or skip it when asked.
    for split in ["train", "val"] {
        for class in ["a", "b"] {
            let d = dir.path().join(split).join(class);
            std::fs::create_dir_all(&d).unwrap();
            for i in 0..4 {
                let img = image::RgbImage::from_fn(12, 12, |x, y| {
                    image::Rgb([(x * 20) as u8, (y * 20) as u8, if class == "a" { 0 } else { 255 }])
                });
                img.save(d.join(format!("{i}.png"))).unwrap();
            }
        }
    }
    let broken = dir.path().join("train/a/broken.jpg");
    std::fs::write(&broken, b"\xff\xd8\xff\xe0 definitely not a jpeg").unwrap();
    let folder = ["--set", "data.kind=\"imagefolder\"", "--set", "model.num_classes=2", "--set", "train.epochs=1"];
    let td = format!("data.train_dir=\"{}\"", dir.path().join("train").display());
    let vd = format!("data.val_dir=\"{}\"", dir.path().join("val").display());
    let run = dir.path().join("run1");
    let mut args = vec!["--config", cfg.as_str(), "--run-dir", run.to_str().unwrap(), "--set", &td, "--set", &vd];
    args.extend(folder);
    assert_error(&trainer(&args), &["broken.jpg"]);
    let run2 = dir.path().join("run2");
    args[3] = run2.to_str().unwrap();
    args.extend(["--set", "data.on_corrupt=\"skip\""]);
    let out = trainer(&args);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(String::from_utf8_lossy(&out.stderr).contains("broken.jpg"), "no warning naming the skipped file");

    // A truncated checkpoint and a foreign file given to `eval`.
    let ck = trainer::checkpoint::latest(&run2.join("checkpoints")).unwrap();
    let bytes = std::fs::read(&ck).unwrap();
    let cut = dir.path().join("truncated.safetensors");
    std::fs::write(&cut, &bytes[..bytes.len() / 2]).unwrap();
    let mut eval =
        vec!["eval", "--config", cfg.as_str(), "--checkpoint", cut.to_str().unwrap(), "--set", &td, "--set", &vd];
    eval.extend(folder);
    assert_error(&trainer(&eval), &["truncated.safetensors"]);
    let foreign = dir.path().join("foreign.safetensors");
    std::fs::write(&foreign, b"PK\x03\x04 a zip file").unwrap();
    eval[4] = foreign.to_str().unwrap();
    assert_error(&trainer(&eval), &["foreign.safetensors"]);
    // A good checkpoint evaluates.
    eval[4] = ck.to_str().unwrap();
    let out = trainer(&eval);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(String::from_utf8_lossy(&out.stdout).contains("top1"));
    // Weights of another architecture for init_from: one error listing the tensors.
    let w = run2.join("model.safetensors");
    let out = trainer(&[
        "--config",
        &cfg,
        "--run-dir",
        dir.path().join("run3").to_str().unwrap(),
        "--set",
        "model.arch=resnet34",
        "--set",
        &format!("model.init_from=\"{}\"", w.display()),
    ]);
    assert_error(&out, &["model.safetensors", "missing", "layer1.2"]);
}

#[test]
fn info_prints_stages_and_parameter_count() {
    let dir = TempDir::new("info");
    let cfg = write_config(dir.path(), "");
    let out = trainer(&[
        "info",
        "--config",
        &cfg,
        "--set",
        "model.arch=resnet152",
        "--set",
        "model.num_classes=1000",
        "--set",
        "model.stem=imagenet",
        "--set",
        "data.image_size=224",
        "--set",
        "data.val_resize=256",
        "--set",
        "train.batch_size=2",
    ]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(text.contains("parameters: 60192808"), "{text}");
    // ResNet-152's 240.8 MB of FP32 gradient in buckets of at least 25 MB (a parameter is never split).
    assert!(
        text.contains("data-parallel gradient all-reduce: 9 bucket(s) of about 25 MB (train.bucket_mb), fp32"),
        "{text}"
    );
    assert!(text.contains("layer4   [2, 2048, 7, 7]"), "{text}");
    assert!(!text.contains("layout: channels-last"), "{text}");
    // Channels-last: same (n, c, h, w) description, and the layout is said.
    let out = trainer(&["info", "--config", &cfg, "--set", "kernels.conv=\"custom\""]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(text.contains("layout: channels-last"), "{text}");
    assert!(text.contains("layer4   [16, 512, 1, 1]"), "{text}");
    assert!(!text.contains("recompute:"), "{text}");
    let out = trainer(&["info", "--config", &cfg, "--set", "kernels.recompute=\"relu+conv\""]);
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("recompute: relu+conv (kernels.recompute; the fused step only)")
    );
    // The fused step on CUDA in bf16 reads the conv weights the optimizer keeps (said only there; the environment's
    // A/B switch, where set, decides over the config).
    assert!(!text.contains("conv weights:"), "{text}");
    if trainer::config::weights_in_optimizer_env().is_none() {
        let on_cuda = ["--set", "device=\"cuda:0\"", "--set", "amp.dtype=\"bf16\"", "--set", "kernels.conv=\"custom\""];
        let out = trainer(&[&["info", "--config", &cfg][..], &on_cuda[..]].concat());
        let kept = String::from_utf8_lossy(&out.stdout);
        assert!(
            kept.contains("conv weights: kept in bf16 (k, r, s, c) and written by the optimizer's update"),
            "{kept}"
        );
        let off = ["--set", "kernels.weights_in_optimizer=false"];
        let out = trainer(&[&["info", "--config", &cfg][..], &on_cuda[..], &off[..]].concat());
        let cast = String::from_utf8_lossy(&out.stdout);
        assert!(cast.contains("conv weights: cast and permuted at the start of each step"), "{cast}");
    }
    // CUDA graphs: "auto" by default, off on the CPU with the reason.
    assert!(text.contains("graph: off (kernels.graph = \"auto\"; CUDA graphs need a CUDA device)"), "{text}");
    let out = trainer(&["info", "--config", &cfg, "--set", "kernels.graph=\"off\""]);
    let off = String::from_utf8_lossy(&out.stdout);
    assert!(off.contains("graph: off (kernels.graph = \"off\")"), "{off}");
    // Both BatchNorm reductions in the kernels next to them by default ("fused"); "pass" prints nothing.
    assert!(
        text.contains(
            "bn_stats: fused (kernels.bn_stats; the fused step on CUDA: moments in the conv epilogues, backward sums \
             with the gradients that make them)"
        ),
        "{text}"
    );
    let out = trainer(&["info", "--config", &cfg, "--set", "kernels.bn_stats=\"pass\""]);
    let pass = String::from_utf8_lossy(&out.stdout);
    assert!(!pass.contains("bn_stats:"), "{pass}");
    let out = trainer(&["info", "--config", &cfg, "--set", "kernels.bn_stats=\"forward\""]);
    let fwd = String::from_utf8_lossy(&out.stdout);
    assert!(
        fwd.contains("bn_stats: forward (kernels.bn_stats; the fused step on CUDA: moments in the conv epilogues)"),
        "{fwd}"
    );
    let out = trainer(&["info", "--config", &cfg, "--set", "kernels.bn_stats=\"auto\""]);
    let auto = String::from_utf8_lossy(&out.stdout);
    assert!(auto.contains("bn_stats: auto (kernels.bn_stats;") && auto.contains("where timed faster"), "{auto}");
    let out =
        trainer(&["info", "--config", &cfg, "--set", "kernels.bn_stats=\"auto\"", "--set", "kernels.autotune=false"]);
    let auto = String::from_utf8_lossy(&out.stdout);
    assert!(auto.contains("nothing is timed, every epilogue runs"), "{auto}");
    // The kernels "auto" resolves to, for the configured device and dtype (info opens no device).
    let out = trainer(&["info", "--config", &cfg]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("kernels on cpu in fp32: conv fwdconv, matmul cublas, "), "{text}");
    let out = trainer(&[
        "info",
        "--config",
        &cfg,
        "--set",
        "device=\"cuda:0\"",
        "--set",
        "amp.dtype=\"bf16\"",
        "--set",
        "kernels.autotune_cache=\"off\"",
    ]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(
        text.contains("kernels on cuda:0 in bf16: conv custom, matmul custom, tiles autotuned (in memory)"),
        "{text}"
    );
    assert!(text.contains("layout: channels-last"), "{text}");
}

#[test]
fn bench_and_sweep_on_the_cpu() {
    let dir = TempDir::new("bench");
    let cfg = write_config(dir.path(), "");
    let out = trainer(&[
        "bench",
        "--config",
        &cfg,
        "--dtypes",
        "fp32,bf16",
        "--batch-sizes",
        "2,4",
        "--warmup",
        "1",
        "--steps",
        "1",
    ]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(text.lines().filter(|l| l.starts_with("BENCH_JSON")).count(), 4, "{text}");
    assert!(text.lines().any(|l| l.starts_with("resnet18") && l.contains("bf16")), "{text}");
    assert_error(&trainer(&["bench", "--config", &cfg, "--dtypes", "fp8"]), &["fp8"]);
    // The bench builds the config's model: kernels.conv = "custom" runs it channels-last.
    let out = trainer(&[
        "bench",
        "--config",
        &cfg,
        "--set",
        "kernels.conv=\"custom\"",
        "--set",
        "kernels.matmul=\"custom\"",
        "--batch-sizes",
        "2",
        "--warmup",
        "1",
        "--steps",
        "2",
        "--phases",
    ]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains(": conv custom, matmul custom, "), "{err}");
    let json = text.lines().find_map(|l| l.strip_prefix("BENCH_JSON ")).expect("BENCH_JSON line");
    assert!(json.contains("\"img_per_s\":") && !json.contains("\"img_per_s\":null"), "{json}");
    // --phases: four phase times per step, each positive, together no more than the measured step time.
    let v: serde_json::Value = serde_json::from_str(json).unwrap();
    let phases = v["phases_ms"].as_object().unwrap_or_else(|| panic!("no phases_ms in {json}"));
    assert_eq!(phases.len(), 4, "{json}");
    let sum: f64 = phases.values().map(|x| x.as_f64().unwrap()).sum();
    assert!(phases.values().all(|x| x.as_f64().unwrap() > 0.0), "{json}");
    assert!(sum <= v["step_ms"].as_f64().unwrap() * 1.001, "{json}");
    assert!(text.contains("phases, ms per step"), "{text}");

    let sweep = dir.path().join("sweep");
    let out = trainer(&[
        "sweep",
        "--config",
        &cfg,
        "--batch-sizes",
        "2,4",
        "--warmup",
        "1",
        "--steps",
        "1",
        "--out",
        sweep.to_str().unwrap(),
    ]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(text.contains("largest batch that fits: 4"), "{text}");
    let csv = std::fs::read_to_string(sweep.join("sweep.csv")).unwrap();
    assert_eq!(csv.lines().count(), 3, "{csv}");
    assert!(csv.starts_with("arch,dtype,batch_size,img_per_s"));
    assert!(sweep.join("sweep.png").is_file());
    assert!(text.contains("sweep.png and sweep.svg"), "{text}");
    let svg = std::fs::read_to_string(sweep.join("sweep.svg")).expect("sweep.svg next to sweep.png");
    assert!(svg.contains("throughput (img/s)") && svg.contains("peak device memory (GiB)"), "axis labels missing");
    assert_error(&trainer(&["sweep", "--config", &cfg]), &["--batch-sizes"]);
    // A failure other than running out of memory ends `--max` there and fails the command, its row kept.
    let failed = dir.path().join("sweep-failed");
    let out = trainer(&[
        "sweep",
        "--config",
        &cfg,
        "--set",
        "device=\"cuda\"",
        "--max",
        "--batch-sizes",
        "4",
        "--steps",
        "1",
        "--out",
        failed.to_str().unwrap(),
    ]);
    assert_error(&out, &["1 sweep configuration(s) failed", "batch 4"]);
    let csv = std::fs::read_to_string(failed.join("sweep.csv")).unwrap();
    assert_eq!(csv.lines().count(), 2, "{csv}");
}

/// A small JPEG folder (2 classes, `n` images each, train and val) for the input-pipeline commands.
fn jpeg_folder(root: &Path, n: u32) {
    for split in ["train", "val"] {
        for (c, class) in ["cat", "dog"].iter().enumerate() {
            let d = root.join(split).join(class);
            std::fs::create_dir_all(&d).unwrap();
            for i in 0..n {
                let img = image::RgbImage::from_fn(40 + i, 30, |x, y| {
                    image::Rgb([(x * 6) as u8, (y * 8 + i * 9) as u8, if c == 0 { 20 } else { 230 }])
                });
                img.save(d.join(format!("{i}.jpg"))).unwrap();
            }
        }
    }
}

#[test]
fn data_bench_prepare_and_packed_training() {
    let dir = TempDir::new("databench");
    jpeg_folder(dir.path(), 6);
    let cfg = write_config(dir.path(), "");
    let td = format!("data.train_dir=\"{}\"", dir.path().join("train").display());
    let vd = format!("data.val_dir=\"{}\"", dir.path().join("val").display());
    let folder = ["--set", "data.kind=\"imagefolder\"", "--set", "model.num_classes=2", "--set", &td, "--set", &vd];
    let augment = ["--set", "data.augment=\"standard\"", "--set", "train.batch_size=4"];

    let mut args = vec!["data-bench", "--config", cfg.as_str(), "--workers", "2", "--batches", "5"];
    args.extend(folder);
    args.extend(augment);
    let out = trainer(&args);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    for want in ["decode", "augment", "collate", "normalise", "total", "cores"] {
        assert!(stdout.contains(want), "`{want}` not in {stdout}");
    }
    let json = stdout.lines().find_map(|l| l.strip_prefix("DATA_BENCH_JSON ")).expect("DATA_BENCH_JSON line");
    let r: serde_json::Value = serde_json::from_str(json).unwrap();
    // 5 batches of 4 over a 12-image epoch: the next epoch continues.
    assert_eq!((r["images"].as_u64(), r["batches"].as_u64(), r["workers"].as_u64()), (Some(20), Some(5), Some(2)));
    assert!(r["total_img_per_s"].as_f64().unwrap() > 0.0 && r["decode_img_per_s"].as_f64().unwrap() > 0.0);
    assert!(r["h2d_img_per_s"].is_null(), "no host-to-device figure on the CPU");

    // Pack, bench the pack, train from it.
    let packed = dir.path().join("packed");
    let mut args = vec!["prepare", "--config", cfg.as_str(), "--out", packed.to_str().unwrap(), "--max-side", "32"];
    args.extend(folder);
    let out = trainer(&args);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(packed.join("train/index.bin").is_file() && packed.join("val/shard-00000.bin").is_file());
    let pd = format!("data.dir=\"{}\"", packed.display());
    let pk = ["--set", "data.kind=\"packed\"", "--set", &pd, "--set", "model.num_classes=2"];
    let mut args = vec!["data-bench", "--config", cfg.as_str(), "--batches", "3"];
    args.extend(pk);
    args.extend(augment);
    let out = trainer(&args);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let run = dir.path().join("run");
    let mut args = vec!["--config", cfg.as_str(), "--run-dir", run.to_str().unwrap(), "--set", "train.epochs=1"];
    args.extend(pk);
    args.extend(augment);
    let out = trainer(&args);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(run.join("model.safetensors").is_file());

    // A truncated shard: one error line naming it.
    let shard = packed.join("train/shard-00000.bin");
    let bytes = std::fs::read(&shard).unwrap();
    std::fs::write(&shard, &bytes[..bytes.len() / 2]).unwrap();
    let mut args = vec!["data-bench", "--config", cfg.as_str()];
    args.extend(pk);
    assert_error(&trainer(&args), &["shard-00000.bin", "truncated"]);
    // Bad values of the data keys name the key and the allowed values.
    let cases: [(&str, &[&str]); 5] = [
        ("data.kind=\"foo\"", &["data.kind = \"foo\" is not one of synthetic, shapes, cifar10, imagefolder, packed"]),
        ("data.augment=\"heavy\"", &["data.augment = \"heavy\" is not one of none, standard"]),
        ("data.on_corrupt=\"ignore\"", &["data.on_corrupt = \"ignore\" is not one of error, skip"]),
        ("data.kind=3", &["data.kind"]),
        ("data.pack_quality=0", &["data.pack_quality"]),
    ];
    for (set, needles) in cases {
        assert_error(&trainer(&["data-bench", "--config", &cfg, "--set", set]), needles);
    }
    assert_error(&trainer(&["prepare", "--config", &cfg, "--out", "/tmp/x"]), &["data.train_dir"]);
}
