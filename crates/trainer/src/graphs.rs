//! CUDA graphs for the fused training step (`kernels.graph`, issue #14): a step of a fixed shape is captured once
//! as one graph ([`kernels::cuda::graph`]) and replayed every step after, one launch instead of ~1,700.
//!
//! The life of a batch shape (the shapes of a step's micro-batches):
//! 1. its first step runs eagerly with candle's upload cache on ("warm": the kernels are autotuned, the optimizer
//!    state is made, candle's layout uploads are cached);
//! 2. its second step is captured: the step reads its inputs from buffers the plan owns (each step's batch is
//!    copied into them), its learning rate from the device, and copies its report into a buffer the plan owns;
//!    the capture queues nothing, so the graph is then launched for that step;
//! 3. every later step of the shape copies its batch in and launches the graph.
//!
//! One shape is captured (the first seen twice: the full batch); other shapes, such as an epoch's last, smaller
//! batch, run eagerly without disturbing the graph. A graph has the addresses of the model's tensors, the
//! optimizer's state, the loss-scale state and the learning rate baked in: when any of them moves (a resumed
//! optimizer, a reloaded scale) the plan is dropped and the shape warms up again. A capture that fails turns
//! graphs off for the run with a one-line note (under "on": an error naming the cause), and the step runs eagerly.

use crate::config::GraphChoice;
use std::collections::HashMap;

/// One micro-batch as a captured step sees it: images shape, strides (the memory layout: the device feed's
/// channels-last batches are NCHW views of NHWC memory) and dtype, labels shape and dtype, sample count.
pub type MicroShape = (Vec<usize>, Vec<usize>, String, Vec<usize>, String, usize);

/// What a captured step depends on besides device memory: the micro-batches' shapes and dtypes (images, labels,
/// sample count each), and the host values baked into its kernels.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct StepKey {
    pub micro: Vec<MicroShape>,
    /// Host settings that kernels take as arguments (label smoothing, clipping, recompute level, loss-scale rule),
    /// as bits.
    pub host: Vec<u64>,
}

/// What to do with a step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    /// Run it eagerly; `warm`: under candle's upload cache, as the warm-up of a shape to be captured next time.
    Eager { warm: bool },
    /// Capture it (then launch the graph once for it).
    Capture,
    /// Launch the captured graph.
    Replay,
}

/// When to warm up, capture and replay, per [`StepKey`] (no device work: tested on the CPU).
#[derive(Debug, Default)]
pub struct Policy {
    /// Eager steps seen per shape since the last reset.
    seen: HashMap<StepKey, u32>,
    /// The shape that has a graph.
    captured: Option<StepKey>,
    /// Why graphs are off for the rest of the run.
    disabled: Option<String>,
}

impl Policy {
    /// The action for the next step of shape `key`.
    pub fn next(&mut self, key: &StepKey) -> Action {
        if self.disabled.is_some() {
            return Action::Eager { warm: false };
        }
        match &self.captured {
            Some(k) if k == key => return Action::Replay,
            Some(_) => return Action::Eager { warm: false },
            None => {}
        }
        let n = self.seen.entry(key.clone()).or_insert(0);
        *n += 1;
        if *n == 1 {
            Action::Eager { warm: true }
        } else {
            Action::Capture
        }
    }

    /// The capture of `key` succeeded.
    pub fn captured(&mut self, key: &StepKey) {
        self.captured = Some(key.clone());
    }

    /// The graph no longer matches the step's buffers: drop it, and warm every shape up again.
    pub fn reset(&mut self) {
        self.captured = None;
        self.seen.clear();
    }

    /// Graphs are off for the rest of the run, because of `why`.
    pub fn disable(&mut self, why: String) {
        self.captured = None;
        self.disabled = Some(why);
    }

    pub fn disabled(&self) -> Option<&str> {
        self.disabled.as_deref()
    }

    /// The shape that has a graph.
    pub fn captured_key(&self) -> Option<&StepKey> {
        self.captured.as_ref()
    }
}

/// A step's graph state: the choice, the policy and (CUDA) the captured plan.
pub struct Graphs {
    pub choice: GraphChoice,
    pub policy: Policy,
    /// Steps replayed from a graph, captured, and run eagerly while graphs were on (for the run's summary and
    /// the tests).
    pub replayed: u64,
    pub captures: u64,
    #[cfg(feature = "cuda")]
    plan: Option<cuda::Plan>,
    /// An eager step ran since the last replay: the pools are trimmed before the next one.
    #[cfg(feature = "cuda")]
    eager_since_replay: bool,
}

impl Graphs {
    pub fn new(choice: GraphChoice) -> Self {
        Self {
            choice,
            policy: Policy::default(),
            replayed: 0,
            captures: 0,
            #[cfg(feature = "cuda")]
            plan: None,
            #[cfg(feature = "cuda")]
            eager_since_replay: false,
        }
    }

    /// The captured graph's nodes by kind ("no graph" without one).
    pub fn nodes(&self) -> String {
        #[cfg(feature = "cuda")]
        if let Some(p) = &self.plan {
            return p.graph.nodes.to_string();
        }
        "no graph".into()
    }
}

/// Why this runner cannot use graphs (None: it can): `cuda` device, the `fused` engine, data-parallel
/// (`collective`), `bench --phases` (`phases`).
pub fn unsupported(cuda: bool, fused: bool, collective: bool, phases: bool) -> Option<&'static str> {
    if !cuda {
        Some("CUDA graphs need a CUDA device")
    } else if !fused {
        Some("CUDA graphs need the fused step (kernels.step)")
    } else if collective {
        Some("CUDA graphs are not used in data-parallel training (its collectives run on their own stream)")
    } else if phases {
        Some("CUDA graphs are not used while timing the step's phases (bench --phases)")
    } else {
        None
    }
}

/// Copies `src` into `dst`, two tensors of one shape, dtype and memory layout, whole: through the order of
/// dimensions in which both are contiguous (a graph's input buffer is a copy of the batch it was captured with, so
/// a channels-last batch, an NCHW view of NHWC memory, goes in as NHWC). A different shape, dtype or layout is an
/// error naming both.
pub fn copy_into(dst: &candle_core::Tensor, src: &candle_core::Tensor) -> candle_core::Result<()> {
    if dst.dims() != src.dims() || dst.dtype() != src.dtype() || dst.stride() != src.stride() {
        candle_core::bail!(
            "CUDA graph input: a batch of {:?} {:?} (strides {:?}) for a buffer of {:?} {:?} (strides {:?})",
            src.dims(),
            src.dtype(),
            src.stride(),
            dst.dims(),
            dst.dtype(),
            dst.stride()
        );
    }
    // The dimensions from the largest stride to the smallest: the order the memory holds them in.
    let mut order: Vec<usize> = (0..dst.rank()).collect();
    order.sort_by_key(|&d| std::cmp::Reverse(dst.stride()[d]));
    let (d, s) = (dst.permute(order.clone())?, src.permute(order)?);
    if !d.is_contiguous() || !s.is_contiguous() {
        candle_core::bail!("CUDA graph input: strides {:?} are no permutation of a dense layout", src.stride());
    }
    // On CUDA one device-to-device memcpy (candle's slice_set runs an element-wise copy kernel at half that rate).
    #[cfg(feature = "cuda")]
    if d.device().is_cuda() {
        return kernels::cuda::graph::copy_dense(&d, &s);
    }
    d.slice_set(&s, 0, 0)
}

/// The graph path of [`crate::train::StepRunner::step_async`]: Some(report) when this step was replayed from a
/// graph (or captured and launched), None when it is to run eagerly ([`crate::train::StepRunner::queue_step`];
/// a warm-up step is queued here under the upload cache and its report returned).
#[cfg(feature = "cuda")]
pub fn graph_step(
    runner: &mut crate::train::StepRunner,
    micro: &[crate::train::Batch],
    lr_dev: Option<&candle_core::Tensor>,
) -> anyhow::Result<Option<candle_core::Tensor>> {
    cuda::graph_step(runner, micro, lr_dev)
}

#[cfg(feature = "cuda")]
mod cuda {
    use super::{Action, StepKey};
    use crate::config::{GraphChoice, StepEngine};
    use crate::train::{Batch, StepRunner};
    use anyhow::{bail, Result};
    use candle_core::{Device, Tensor};
    use kernels::cuda::graph::{self, StepGraph};

    /// A captured step: the graph, the buffers it reads its batch from and writes its report to, and the
    /// addresses it has baked in.
    pub(super) struct Plan {
        pub(super) graph: StepGraph,
        inputs: Vec<Batch>,
        report: Tensor,
        fingerprint: Vec<u64>,
    }

    fn key(runner: &StepRunner, micro: &[Batch]) -> StepKey {
        let s = &runner.scaler;
        StepKey {
            micro: micro
                .iter()
                .map(|b| {
                    let i = &b.images;
                    let l = &b.labels;
                    (
                        i.dims().to_vec(),
                        i.stride().to_vec(),
                        i.dtype().as_str().to_string(),
                        l.dims().to_vec(),
                        l.dtype().as_str().into(),
                        b.n,
                    )
                })
                .collect(),
            host: [
                runner.label_smoothing,
                runner.clip_grad_norm,
                runner.recompute as u8 as f64,
                f64::from(u8::from(s.enabled)),
                s.growth_factor,
                s.backoff_factor,
                s.growth_interval as f64,
                s.min_scale,
                s.max_scale,
                runner.precision as u8 as f64,
            ]
            .iter()
            .map(|v| v.to_bits())
            .collect(),
        }
    }

    /// The device addresses a graph bakes in: every tensor of the model, the optimizer's state, the loss-scale
    /// state and the learning rate.
    fn fingerprint(runner: &mut StepRunner, lr_dev: &Tensor) -> Result<Vec<u64>> {
        let mut out = Vec::new();
        for (_, e) in runner.model.store().entries() {
            out.push(graph::base_addr(e.param.var().as_tensor())?);
        }
        for t in runner.opt.persistent_state() {
            out.push(graph::base_addr(&t)?);
        }
        out.push(graph::base_addr(&runner.device_state()?)?);
        out.push(graph::base_addr(lr_dev)?);
        Ok(out)
    }

    pub(super) fn graph_step(
        runner: &mut StepRunner,
        micro: &[Batch],
        lr_dev: Option<&Tensor>,
    ) -> Result<Option<Tensor>> {
        let Device::Cuda(dev) = runner.model.device().clone() else {
            if runner.graphs.choice == GraphChoice::On {
                bail!("kernels.graph = \"on\": CUDA graphs need a CUDA device");
            }
            return Ok(None);
        };
        if runner.graphs.choice == GraphChoice::Off {
            return Ok(None);
        }
        let why = super::unsupported(
            true,
            runner.engine == StepEngine::Fused,
            runner.collective.is_some(),
            runner.phases.is_some(),
        );
        if let Some(why) = why {
            if runner.graphs.choice == GraphChoice::On {
                bail!("kernels.graph = \"on\": {why}");
            }
            if runner.graphs.plan.take().is_some() {
                // Timing phases after a capture (bench --phases): the graph's memory goes back for eager steps.
                runner.graphs.policy.reset();
                graph::trim_graph_memory(&dev)?;
            }
            return Ok(None);
        }
        let Some(lr_dev) = lr_dev else { return Ok(None) };
        let k = key(runner, micro);
        // A plan whose baked-in addresses moved is dropped: its shape warms up again.
        if runner.graphs.plan.is_some() {
            let now = fingerprint(runner, lr_dev)?;
            if runner.graphs.plan.as_ref().is_some_and(|p| p.fingerprint != now) {
                runner.graphs.plan = None;
                runner.graphs.policy.reset();
                graph::trim_graph_memory(&dev)?;
            }
        }
        match runner.graphs.policy.next(&k) {
            Action::Eager { warm } => {
                if runner.graphs.plan.is_some() && !runner.graphs.eager_since_replay {
                    // The graph keeps its memory between replays: give it back for this eager step.
                    graph::trim_graph_memory(&dev)?;
                }
                runner.graphs.eager_since_replay = true;
                if !warm {
                    return Ok(None);
                }
                let _cache = graph::upload_cache(&dev);
                Ok(Some(runner.queue_step(micro, (f64::NAN, Some(lr_dev)))?))
            }
            Action::Replay => {
                let plan = runner.graphs.plan.as_ref().expect("a replayed shape has a plan");
                if runner.graphs.eager_since_replay {
                    // The eager steps' memory goes back to the driver for the graph's.
                    kernels::cuda::release_pool_memory(&dev)?;
                    runner.graphs.eager_since_replay = false;
                }
                for (dst, src) in plan.inputs.iter().zip(micro) {
                    super::copy_into(&dst.images, &src.images)?;
                    super::copy_into(&dst.labels, &src.labels)?;
                }
                plan.graph.launch()?;
                if runner.graphs.replayed == 0 && std::env::var_os("TRAINER_GRAPH_DEBUG").is_some() {
                    dev.cuda_stream().synchronize().map_err(|e| anyhow::anyhow!("{e:?}"))?;
                    eprintln!("graph debug: report after the first replay {:?}", plan.report.to_vec1::<f32>()?);
                }
                runner.graphs.replayed += 1;
                // Read back (a copy queued behind the launch) before the next launch rewrites it.
                Ok(Some(plan.report.clone()))
            }
            Action::Capture => match capture(runner, &dev, micro, lr_dev) {
                Ok(report) => Ok(Some(report)),
                Err(e) if crate::train::is_oom(&e) => Err(e.into()),
                Err(e) => {
                    let why = format!("{e}").lines().next().unwrap_or_default().to_string();
                    if runner.graphs.choice == GraphChoice::On {
                        bail!("kernels.graph = \"on\": the CUDA graph capture failed: {why}");
                    }
                    eprintln!("note: the CUDA graph capture failed ({why}): the step runs without a graph");
                    runner.graphs.policy.disable(why);
                    Ok(None)
                }
            },
        }
    }

    /// Captures the step for `micro`'s shape and launches it once for `micro`; returns the step's report.
    fn capture(
        runner: &mut StepRunner,
        dev: &candle_core::CudaDevice,
        micro: &[Batch],
        lr_dev: &Tensor,
    ) -> candle_core::Result<Tensor> {
        let err = |e: anyhow::Error| candle_core::Error::Msg(format!("{e:#}"));
        // The buffers the graph reads its batch from, filled with this step's batch.
        let inputs = micro
            .iter()
            .map(|b| Ok(Batch { images: b.images.copy()?, labels: b.labels.copy()?, n: b.n }))
            .collect::<candle_core::Result<Vec<_>>>()?;
        let report = Tensor::zeros(crate::train::REPORT_MAX, candle_core::DType::F32, runner.model.device())?;
        // The loss-scale state up to date before the capture (an upload inside it would be a new buffer).
        runner.device_state().map_err(err)?;
        // The eager warm-up's memory goes back to the driver, for the graph's own.
        kernels::cuda::release_pool_memory(dev)?;
        let graph = graph::capture(dev, || {
            let r = runner.queue_step(&inputs, (f64::NAN, Some(lr_dev))).map_err(err)?;
            report.slice_set(&r, 0, 0)
        })?;
        let fingerprint = fingerprint(runner, lr_dev).map_err(err)?;
        let k = key(runner, micro);
        graph.launch()?;
        if std::env::var_os("TRAINER_GRAPH_DEBUG").is_some() {
            // Diagnosis of the owed GPU test: what the first launch wrote, read after a full synchronisation.
            dev.cuda_stream().synchronize().map_err(|e| candle_core::Error::Msg(format!("{e:?}")))?;
            eprintln!("graph debug: {}; report after the first launch {:?}", graph.nodes, report.to_vec1::<f32>()?);
        }
        runner.graphs.captures += 1;
        runner.graphs.policy.captured(&k);
        runner.graphs.eager_since_replay = false;
        let out = report.clone();
        runner.graphs.plan = Some(Plan { graph, inputs, report, fingerprint });
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::{unsupported, Action, Policy, StepKey};

    fn key(n: usize) -> StepKey {
        StepKey {
            micro: vec![(vec![n, 3, 8, 8], vec![192, 64, 8, 1], "bf16".into(), vec![n], "u32".into(), n)],
            host: vec![0],
        }
    }

    /// A graph's input buffer takes a batch of its own layout whole: contiguous, or a channels-last NCHW view of
    /// NHWC memory (the device feed's batches, on which the first replay from a JPEG folder failed); another
    /// layout or shape is refused with both named.
    #[test]
    fn graph_inputs_take_batches_of_their_layout() {
        use candle_core::{DType, Device, Tensor};
        let dev = Device::Cpu;
        let nhwc =
            |seed: f32| Tensor::arange(0f32, 2.0 * 4.0 * 5.0 * 3.0, &dev).unwrap().affine(1.0, seed as f64).unwrap();
        let view = |t: Tensor| t.reshape((2, 4, 5, 3)).unwrap().permute((0, 3, 1, 2)).unwrap();
        let dst = view(nhwc(0.0)).copy().unwrap();
        assert!(!dst.is_contiguous());
        let src = view(nhwc(100.0));
        super::copy_into(&dst, &src).unwrap();
        assert_eq!(
            dst.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
            src.flatten_all().unwrap().to_vec1::<f32>().unwrap()
        );
        assert_eq!(dst.stride(), src.stride(), "the buffer keeps its layout");
        let plain = Tensor::zeros((2, 3, 4, 5), DType::F32, &dev).unwrap();
        super::copy_into(&plain, &src.contiguous().unwrap()).unwrap();
        assert_eq!(
            plain.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
            src.flatten_all().unwrap().to_vec1::<f32>().unwrap()
        );
        let e = super::copy_into(&plain, &src).unwrap_err().to_string();
        assert!(e.starts_with("CUDA graph input: a batch of [2, 3, 4, 5] F32 (strides [60, 1, 15, 3])"), "{e}");
        let labels = Tensor::new(&[1u32, 2], &dev).unwrap();
        let e = super::copy_into(&labels, &Tensor::new(&[1u32, 2, 3], &dev).unwrap()).unwrap_err().to_string();
        assert!(e.contains("a batch of [3] U32"), "{e}");
    }

    #[test]
    fn a_shape_warms_up_then_is_captured_then_replayed() {
        let (full, last) = (key(16), key(10));
        let mut p = Policy::default();
        assert_eq!(p.next(&full), Action::Eager { warm: true });
        assert_eq!(p.next(&full), Action::Capture);
        p.captured(&full);
        assert_eq!(p.next(&full), Action::Replay);
        assert_eq!(p.next(&full), Action::Replay);
        // Another shape (the epoch's last batch) runs eagerly and never takes the graph's place.
        for _ in 0..3 {
            assert_eq!(p.next(&last), Action::Eager { warm: false });
        }
        assert_eq!(p.next(&full), Action::Replay);
        assert_eq!(p.captured_key(), Some(&full));
    }

    #[test]
    fn the_first_shape_seen_twice_is_captured() {
        // An epoch of one batch: the last (smaller) batch comes second and third, so it is the one captured.
        let (full, last) = (key(16), key(10));
        let mut p = Policy::default();
        assert_eq!(p.next(&full), Action::Eager { warm: true });
        assert_eq!(p.next(&last), Action::Eager { warm: true });
        assert_eq!(p.next(&last), Action::Capture);
        p.captured(&last);
        assert_eq!(p.next(&full), Action::Eager { warm: false });
        assert_eq!(p.next(&last), Action::Replay);
    }

    #[test]
    fn a_reset_warms_up_again_and_a_failure_turns_graphs_off() {
        let k = key(16);
        let mut p = Policy::default();
        p.next(&k);
        assert_eq!(p.next(&k), Action::Capture);
        p.captured(&k);
        p.reset();
        assert_eq!(p.captured_key(), None);
        assert_eq!(p.next(&k), Action::Eager { warm: true });
        assert_eq!(p.next(&k), Action::Capture);
        // A failed capture: eager from then on, whatever the shape.
        p.disable("cuStreamBeginCapture: not supported".into());
        assert_eq!(p.disabled(), Some("cuStreamBeginCapture: not supported"));
        for _ in 0..3 {
            assert_eq!(p.next(&k), Action::Eager { warm: false });
        }
        // The host settings are part of the key: a different clipping threshold is a different step.
        let mut q = Policy::default();
        let other = StepKey { host: vec![1], ..k.clone() };
        q.next(&k);
        assert_eq!(q.next(&other), Action::Eager { warm: true });
    }

    #[test]
    fn unsupported_names_the_reason() {
        assert_eq!(unsupported(true, true, false, false), None);
        assert_eq!(unsupported(false, true, false, false), Some("CUDA graphs need a CUDA device"));
        assert_eq!(unsupported(true, false, false, false), Some("CUDA graphs need the fused step (kernels.step)"));
        assert!(unsupported(true, true, true, false).unwrap().contains("data-parallel"));
        assert!(unsupported(true, true, false, true).unwrap().contains("bench --phases"));
    }
}
