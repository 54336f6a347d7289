//! Reading a small result back to the host without waiting for the work queued after it: the training step's
//! report (loss, gradient norm, skip flag, loss scale) is copied into pinned host memory on the compute stream
//! at the end of step k, and read once that copy is done, while step k + 1 still runs. (candle's `to_vec1`
//! synchronises the whole stream, which would wait for step k + 1 as well.)

use candle_core::cuda_backend::cudarc::driver::{sys, CudaEvent, PinnedHostSlice};
use candle_core::cuda_backend::{CudaDevice, WrapErr};
use candle_core::{DType, Result, Tensor};

/// A pinned host buffer for one FP32 readback at a time.
pub struct HostReadback {
    pinned: PinnedHostSlice<f32>,
    len: usize,
    /// Recorded on the stream right after the copy: `read` waits for it. (The pinned slice's own event is recorded
    /// only while cudarc manages several streams; with one stream `read` would not wait and could see the values
    /// of an earlier copy: on the H200, 2026-12-05, a replayed step's report read as the previous one's or zeros.)
    done: CudaEvent,
}

impl HostReadback {
    /// A buffer for up to `capacity` FP32 values, pinned in the context of `dev`.
    pub fn new(dev: &CudaDevice, capacity: usize) -> Result<Self> {
        let ctx = dev.cuda_stream().context().clone();
        // SAFETY: the buffer is written by the copies of `queue` before `read` returns any of it.
        let pinned = unsafe { ctx.alloc_pinned::<f32>(capacity.max(1)) }.w()?;
        // Blocking sync: `read` sleeps until the copy is done. Without the flag cuEventSynchronize busy-waits,
        // whatever the context's scheduling flag: on the H100 (2026-12-05) the training thread then took a whole
        // core for the ~90 ms of every step, a core the data loader's workers share.
        let done = ctx.new_event(Some(sys::CUevent_flags::CU_EVENT_BLOCKING_SYNC)).w()?;
        Ok(Self { pinned, len: 0, done })
    }

    /// Queues the copy of `t` (contiguous FP32 on a CUDA device, at most the capacity) into the buffer, on the
    /// stream of `t`'s device, after everything queued there so far.
    pub fn queue(&mut self, t: &Tensor) -> Result<()> {
        if t.dtype() != DType::F32 || t.elem_count() > self.pinned.len() {
            candle_core::bail!(
                "readback: {} {:?} values into a buffer of {} f32",
                t.elem_count(),
                t.dtype(),
                self.pinned.len()
            );
        }
        let (st, l) = t.storage_and_layout();
        let (o0, o1) =
            l.contiguous_offsets().ok_or_else(|| candle_core::Error::Msg("readback: not contiguous".into()))?;
        let candle_core::Storage::Cuda(cs) = &*st else { candle_core::bail!("readback: not on a CUDA device") };
        let src = cs.as_cuda_slice::<f32>()?.slice(o0..o1);
        let stream = cs.device.cuda_stream();
        stream.memcpy_dtoh(&src, &mut self.pinned).w()?;
        // `read` waits for this event only, not for the work queued after it.
        self.done.record(&stream).w()?;
        self.len = o1 - o0;
        Ok(())
    }

    /// The values of the last [`Self::queue`]d tensor, once their copy has run (the work queued after it may
    /// still be running).
    pub fn read(&self) -> Result<Vec<f32>> {
        self.done.synchronize().w()?;
        Ok(self.pinned.as_slice().w()?[..self.len].to_vec())
    }
}
