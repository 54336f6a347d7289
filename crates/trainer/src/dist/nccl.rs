//! NCCL collectives for data-parallel training (cargo feature `nccl`): one communicator per rank, built from the
//! unique id that rank 0 hands out through the rendezvous ([`super::rendezvous`]), and an in-place sum all-reduce
//! of a contiguous CUDA tensor. We write no collectives of our own: every reduction is NCCL's.
//!
//! The communicator runs on a stream of its own, beside the stream candle queues every kernel on (the compute
//! stream), so that a started gradient bucket's all-reduce overlaps the rest of the backward. Events order the
//! two: each all-reduce waits for the compute stream's work queued before it; `join` (and every blocking
//! all-reduce) makes the compute stream's later work wait for the communicator's.

use anyhow::{anyhow, bail, Result};
use candle_core::cuda_backend::cudarc::driver::sys::CUdeviceptr;
use candle_core::cuda_backend::cudarc::driver::{CudaEvent, CudaStream, DevicePtrMut, DeviceSlice, SyncOnDrop};
use candle_core::{DType, Device, Tensor};
use cudarc::nccl::safe::{Comm, Id, ReduceOp};
use std::sync::Arc;

/// A fresh NCCL unique id (rank 0 makes it; the rendezvous carries it to the others) as its 128 bytes.
pub fn unique_id() -> Result<Vec<u8>> {
    let id = Id::new().map_err(|e| anyhow!("ncclGetUniqueId failed: {e:?}"))?;
    Ok(id.internal().iter().map(|&c| c as u8).collect())
}

/// A rank's NCCL communicator, on a stream of its own next to its device's compute stream.
pub struct NcclComm {
    comm: Comm,
    /// The communicator's stream.
    stream: Arc<CudaStream>,
    /// candle's stream: every kernel of the step.
    compute: Arc<CudaStream>,
    /// Recorded on the compute stream before each all-reduce (its input is written there).
    ready: CudaEvent,
    /// Recorded on the communicator's stream at a join.
    done: CudaEvent,
}

impl NcclComm {
    /// Joins the group of `world` ranks as `rank` on `device` (a CUDA device) with the id from [`unique_id`].
    /// Blocks until every rank has joined (ncclCommInitRank).
    pub fn new(device: &Device, id: &[u8], rank: usize, world: usize) -> Result<Self> {
        let Device::Cuda(dev) = device else { bail!("NCCL needs a CUDA device, got {device:?}") };
        let bytes: [u8; 128] =
            id.try_into().map_err(|_| anyhow!("NCCL unique id: {} bytes, expected 128", id.len()))?;
        let id = Id::uninit(bytes.map(|b| b as std::ffi::c_char));
        let compute = dev.cuda_stream();
        let ctx = compute.context().clone();
        // A second stream puts cudarc in multi-stream mode, where its event tracking would record events for every
        // buffer of every launch. The ordering between the two streams is ours (the events below; the buffers an
        // all-reduce touches live until the compute stream has joined it), and candle queues everything else on
        // the one compute stream, so the tracking stays off.
        // SAFETY: no other stream of this context touches candle's buffers; see above.
        unsafe { ctx.disable_event_tracking() };
        let failed = |what: &str, e| anyhow!("{what} for NCCL failed: {e:?}");
        let stream = ctx.new_stream().map_err(|e| failed("a CUDA stream", e))?;
        let ready = ctx.new_event(None).map_err(|e| failed("a CUDA event", e))?;
        let done = ctx.new_event(None).map_err(|e| failed("a CUDA event", e))?;
        let comm = Comm::from_rank(stream.clone(), rank, world, id)
            .map_err(|e| anyhow!("ncclCommInitRank (rank {rank} of {world}) failed: {e:?}"))?;
        Ok(Self { comm, stream, compute, ready, done })
    }

    /// Sums `t` over all ranks, in place (every rank ends with the sum). `t`: contiguous f32 or bf16 on this
    /// communicator's device; the compute stream's later work sees the sum (no host synchronisation).
    pub fn all_reduce_sum(&self, t: &Tensor) -> Result<()> {
        <Self as super::Collective>::all_reduce_sum(self, t)
    }

    /// Queues the in-place sum of `t` on the communicator's stream, after the compute stream's work so far.
    fn start(&self, t: &Tensor) -> Result<()> {
        let events = |e| anyhow!("ordering the NCCL stream after the compute stream failed: {e:?}");
        self.ready.record(&self.compute).map_err(events)?;
        self.stream.wait(&self.ready).map_err(events)?;
        let len = t.elem_count();
        let what = "all-reduce: the tensor";
        let failed = |e| anyhow!("ncclAllReduce of {len} {:?} elements failed: {e:?}", t.dtype());
        match t.dtype() {
            DType::F32 => {
                let addr = kernels::cuda::addr_of::<f32>(t, len, what).map_err(|e| anyhow!("{e}"))?;
                let mut buf = Raw::<f32>::new(addr, len, &self.stream);
                self.comm.all_reduce_in_place(&mut buf, &ReduceOp::Sum).map_err(failed)?;
            }
            DType::BF16 => {
                let addr = kernels::cuda::addr_of::<half::bf16>(t, len, what).map_err(|e| anyhow!("{e}"))?;
                let mut buf = Raw::<half::bf16>::new(addr, len, &self.stream);
                self.comm.all_reduce_in_place(&mut buf, &ReduceOp::Sum).map_err(failed)?;
            }
            other => bail!("all-reduce: dtype {other:?} (f32 and bf16 only)"),
        }
        Ok(())
    }
}

impl super::Collective for NcclComm {
    fn rank(&self) -> usize {
        self.comm.rank()
    }

    fn world_size(&self) -> usize {
        self.comm.world_size()
    }

    fn all_reduce_sum(&self, t: &Tensor) -> Result<()> {
        self.start(t)?;
        self.join()
    }

    fn start_all_reduce_sum(&self, t: &Tensor) -> Result<()> {
        self.start(t)
    }

    fn join(&self) -> Result<()> {
        let events = |e| anyhow!("ordering the compute stream after the NCCL stream failed: {e:?}");
        self.done.record(&self.stream).map_err(events)?;
        self.compute.wait(&self.done).map_err(events)
    }
}

/// A device range given by address and length, for NCCL calls on memory that candle owns (its tensors hand out
/// shared slices only). Valid while the tensor it was taken from is alive and not resized: the caller holds it.
struct Raw<'a, T> {
    ptr: CUdeviceptr,
    len: usize,
    stream: &'a Arc<CudaStream>,
    _t: std::marker::PhantomData<T>,
}

impl<'a, T> Raw<'a, T> {
    fn new(ptr: CUdeviceptr, len: usize, stream: &'a Arc<CudaStream>) -> Self {
        Self { ptr, len, stream, _t: std::marker::PhantomData }
    }
}

impl<T> DeviceSlice<T> for Raw<'_, T> {
    fn len(&self) -> usize {
        self.len
    }

    fn stream(&self) -> &Arc<CudaStream> {
        self.stream
    }
}

impl<T> DevicePtrMut<T> for Raw<'_, T> {
    fn device_ptr_mut<'a>(&'a mut self, _stream: &'a CudaStream) -> (CUdeviceptr, SyncOnDrop<'a>) {
        // The communicator's stream, ordered against the compute stream by NcclComm's events.
        (self.ptr, SyncOnDrop::Sync(None))
    }
}
