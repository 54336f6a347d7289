//! The data-parallel training loop on the CPU: ranks run as threads of this test, joined by a test-only stand-in
//! for NCCL's sum all-reduce (the trainer itself uses NCCL; this double exists so that the loop's sharding,
//! weighting, empty last batches, rank-0-only writing and cross-world-size resume can be checked without GPUs).
//!
//! With frozen BatchNorm statistics (`finetune.bn_frozen`, so no per-rank batch statistics), N ranks at batch b
//! must train exactly what one process trains at batch N x b, up to the order of floating-point sums.

mod common;
use candle_core::{Device, Tensor};
use common::{step_losses, tiny, TempDir};
use std::collections::HashMap;
use std::path::Path;
use std::sync::{Arc, Condvar, Mutex};
use trainer::config::Config;
use trainer::dist::Collective;
use trainer::train::{self, Summary};

/// One round of the stand-in all-reduce: ranks add their values; the last to arrive publishes the sum; the round
/// resets once every rank has taken it.
#[derive(Default)]
struct Round {
    sum: Vec<f32>,
    arrived: usize,
    result: Option<Arc<Vec<f32>>>,
    taken: usize,
}

struct ThreadGroup {
    rank: usize,
    world: usize,
    shared: Arc<(Mutex<Round>, Condvar)>,
}

fn thread_group(world: usize) -> Vec<ThreadGroup> {
    let shared = Arc::new((Mutex::new(Round::default()), Condvar::new()));
    (0..world).map(|rank| ThreadGroup { rank, world, shared: shared.clone() }).collect()
}

impl Collective for ThreadGroup {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world
    }

    fn all_reduce_sum(&self, t: &Tensor) -> anyhow::Result<()> {
        let mine: Vec<f32> = t.flatten_all()?.to_vec1()?;
        let (m, cv) = &*self.shared;
        let mut r = m.lock().unwrap();
        // Wait for the previous round to be fully taken.
        while r.result.is_some() {
            r = cv.wait(r).unwrap();
        }
        if r.arrived == 0 {
            r.sum = mine;
        } else {
            anyhow::ensure!(
                r.sum.len() == mine.len(),
                "ranks reduce different lengths: {} vs {}",
                r.sum.len(),
                mine.len()
            );
            r.sum.iter_mut().zip(&mine).for_each(|(a, b)| *a += b);
        }
        r.arrived += 1;
        if r.arrived == self.world {
            r.result = Some(Arc::new(std::mem::take(&mut r.sum)));
            cv.notify_all();
        }
        while r.result.is_none() {
            r = cv.wait(r).unwrap();
        }
        let sum = r.result.clone().unwrap();
        r.taken += 1;
        if r.taken == self.world {
            *r = Round::default();
            cv.notify_all();
        }
        drop(r);
        t.slice_set(&Tensor::from_vec(sum.to_vec(), t.shape(), t.device())?, 0, 0)?;
        Ok(())
    }
}

fn ranks(g: ThreadGroup) -> train::Ranks {
    let local_world_size = g.world;
    train::Ranks { collective: Box::new(g), local_world_size }
}

/// Runs `world` ranks of `cfg` in `dir` (threads, one shared run directory); rank 0's summary.
fn run_ranks(cfg: &Config, dir: &Path, world: usize, resume: bool) -> Summary {
    let handles: Vec<_> = thread_group(world)
        .into_iter()
        .map(|g| {
            let (cfg, dir) = (cfg.clone(), dir.to_path_buf());
            std::thread::spawn(move || train::train_ranks(&cfg, &dir, resume, Some(ranks(g))))
        })
        .collect();
    let mut summaries: Vec<Summary> = handles.into_iter().map(|h| h.join().unwrap().unwrap()).collect();
    summaries.swap_remove(0)
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
    for (k, va) in a {
        let vb = &b[k];
        let worst = va.iter().zip(vb).map(|(x, y)| (x - y).abs()).fold(0f32, f32::max);
        assert!(worst <= tol, "{k}: differs by {worst} (tolerance {tol})");
    }
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
    assert_losses_close(&step_losses(dp.path()), &step_losses(single.path()));
    assert_close(
        &weights(&dp.path().join("model.safetensors")),
        &weights(&single.path().join("model.safetensors")),
        2e-5,
    );
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

#[test]
fn a_run_saved_by_two_ranks_resumes_in_one_process() {
    // Two ranks stop after 4 steps (mid-epoch 2); one process at the same global batch continues from their
    // checkpoint and ends where an uninterrupted single-process run ends.
    let (single, dp) = (TempDir::new("dpr-single"), TempDir::new("dpr-two"));
    train::train(&config(16, &[]), single.path(), false).unwrap();
    run_ranks(&config(8, &["train.max_steps=4", "checkpoint.every_steps=2"]), dp.path(), 2, false);
    let resumed = train::train(&config(16, &[]), dp.path(), true).unwrap();
    assert_eq!(resumed.steps, 6);
    assert_losses_close(&step_losses(dp.path()), &step_losses(single.path()));
    assert_close(
        &weights(&dp.path().join("model.safetensors")),
        &weights(&single.path().join("model.safetensors")),
        2e-5,
    );
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

/// Runs 2 ranks with `--resume` expecting both to fail; rank 0's error.
fn run_ranks_err(cfg: &Config, dir: &Path, world: usize) -> String {
    let handles: Vec<_> = thread_group(world)
        .into_iter()
        .map(|g| {
            let (cfg, dir) = (cfg.clone(), dir.to_path_buf());
            std::thread::spawn(move || train::train_ranks(&cfg, &dir, true, Some(ranks(g))))
        })
        .collect();
    let mut errs: Vec<String> =
        handles.into_iter().map(|h| format!("{:#}", h.join().unwrap().err().expect("resume should fail"))).collect();
    errs.swap_remove(0)
}
