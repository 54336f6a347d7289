//! The network input from uint8 HWC images: dtype conversion, ImageNet normalisation, per-sample horizontal flip
//! and the model's layout (NCHW, or NHWC for channels-last models) in one op. CPU reference here; on CUDA one
//! kernel (`kernels/data/01_u8_to_input.cu`), plus [`Slot`]: pinned host staging, an asynchronous copy on a
//! second stream and the conversion on the compute stream, so the upload overlaps the training step.

use candle_core::{CpuStorage, CustomOp1, CustomOp2, DType, Layout, Result, Shape, Tensor};
use half::{bf16, f16};

/// ImageNet channel means and standard deviations of pixels scaled to [0, 1] (torchvision's).
pub const MEAN: [f32; 3] = [0.485, 0.456, 0.406];
pub const STD: [f32; 3] = [0.229, 0.224, 0.225];

/// Memory layout of the network input.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum InputLayout {
    /// (n, 3, h, w)
    Nchw,
    /// (n, h, w, 3): channels-last models
    Nhwc,
}

/// The normalised value of byte `p` in channel `c`: `(p / 255 - mean[c]) / std[c]` in f32 (the CUDA kernel's formula).
#[inline]
pub fn normalize_value(p: u8, c: usize) -> f32 {
    (p as f32 / 255.0 - MEAN[c]) / STD[c]
}

/// CPU reference. `src`: (n, h, w, 3) u8; `flips[b] != 0` mirrors sample b horizontally. Returns f32 values in
/// `layout` order: (n, 3, h, w) or (n, h, w, 3). Each value is [`normalize_value`], looked up in a 3 x 256 table.
pub fn u8_to_input_ref(src: &[u8], flips: &[u8], n: usize, h: usize, w: usize, layout: InputLayout) -> Vec<f32> {
    let lut: [[f32; 256]; 3] = std::array::from_fn(|c| std::array::from_fn(|p| normalize_value(p as u8, c)));
    let plane = h * w;
    let mut out = vec![0f32; n * 3 * plane];
    for b in 0..n {
        let flip = flips.get(b).is_some_and(|&f| f != 0);
        for y in 0..h {
            let row = &src[(b * h + y) * w * 3..][..w * 3];
            // `$pixels`: the row's source pixels in output order (mirrored when flipped); a macro so that both
            // orders compile to straight loops.
            macro_rules! emit {
                ($pixels:expr) => {
                    match layout {
                        InputLayout::Nchw => {
                            for (c, lut) in lut.iter().enumerate() {
                                let o = &mut out[(b * 3 + c) * plane + y * w..][..w];
                                for (v, p) in o.iter_mut().zip($pixels) {
                                    *v = lut[p[c] as usize];
                                }
                            }
                        }
                        InputLayout::Nhwc => {
                            let o = &mut out[(b * h + y) * w * 3..][..w * 3];
                            for (v, p) in o.chunks_exact_mut(3).zip($pixels) {
                                v[0] = lut[0][p[0] as usize];
                                v[1] = lut[1][p[1] as usize];
                                v[2] = lut[2][p[2] as usize];
                            }
                        }
                    }
                };
            }
            if flip {
                emit!(row.chunks_exact(3).rev())
            } else {
                emit!(row.chunks_exact(3))
            }
        }
    }
    out
}

fn check_args(src: &Tensor, flips: &Tensor) -> Result<(usize, usize, usize)> {
    let (n, h, w, c) = src.dims4()?;
    if c != 3 || src.dtype() != DType::U8 {
        candle_core::bail!("u8_to_input: images must be (n, h, w, 3) u8, got {:?} {:?}", src.dims(), src.dtype());
    }
    if flips.dims() != [n] || flips.dtype() != DType::U8 {
        candle_core::bail!("u8_to_input: flips must be ({n}) u8, got {:?} {:?}", flips.dims(), flips.dtype());
    }
    Ok((n, h, w))
}

fn check_dtype(dtype: DType) -> Result<()> {
    match dtype {
        DType::F32 | DType::BF16 | DType::F16 => Ok(()),
        other => candle_core::bail!("u8_to_input: unsupported output dtype {other:?} (f32, bf16, f16)"),
    }
}

/// The input tensor from uint8 images on any device. `src`: (n, h, w, 3) u8, `flips`: (n) u8 on the same device.
/// Returns a (n, 3, h, w) tensor of `dtype` whose memory is NCHW, or NHWC (a permuted view) for
/// `InputLayout::Nhwc`, which a channels-last model's `permute((0, 2, 3, 1))` turns back without a copy.
pub fn u8_to_input(src: &Tensor, flips: &Tensor, dtype: DType, layout: InputLayout) -> Result<Tensor> {
    let (n, h, w) = check_args(src, flips)?;
    check_dtype(dtype)?;
    let op = U8ToInput { n, h, w, dtype, layout };
    let out = src.contiguous()?.apply_op2_no_bwd(&flips.contiguous()?, &op)?;
    to_logical(out, layout)
}

/// (n, 3, h, w) logical view of the op's output.
fn to_logical(out: Tensor, layout: InputLayout) -> Result<Tensor> {
    match layout {
        InputLayout::Nchw => Ok(out),
        InputLayout::Nhwc => out.permute((0, 3, 1, 2)),
    }
}

struct U8ToInput {
    n: usize,
    h: usize,
    w: usize,
    dtype: DType,
    layout: InputLayout,
}

impl U8ToInput {
    fn out_shape(&self) -> Shape {
        match self.layout {
            InputLayout::Nchw => Shape::from((self.n, 3, self.h, self.w)),
            InputLayout::Nhwc => Shape::from((self.n, self.h, self.w, 3)),
        }
    }
}

fn u8_slice<'a>(s: &'a CpuStorage, l: &Layout, what: &str) -> Result<&'a [u8]> {
    let CpuStorage::U8(v) = s else { candle_core::bail!("u8_to_input: {what} is not u8") };
    let Some((a, b)) = l.contiguous_offsets() else { candle_core::bail!("u8_to_input: {what} is not contiguous") };
    Ok(&v[a..b])
}

impl CustomOp2 for U8ToInput {
    fn name(&self) -> &'static str {
        "u8_to_input"
    }

    fn cpu_fwd(&self, s1: &CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout) -> Result<(CpuStorage, Shape)> {
        let src = u8_slice(s1, l1, "images")?;
        let flips = u8_slice(s2, l2, "flips")?;
        let v = u8_to_input_ref(src, flips, self.n, self.h, self.w, self.layout);
        let storage = match self.dtype {
            DType::F32 => CpuStorage::F32(v),
            DType::BF16 => CpuStorage::BF16(v.into_iter().map(bf16::from_f32).collect()),
            DType::F16 => CpuStorage::F16(v.into_iter().map(f16::from_f32).collect()),
            other => candle_core::bail!("u8_to_input: unsupported output dtype {other:?}"),
        };
        Ok((storage, self.out_shape()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        use candle_core::cuda_backend::cudarc::driver::DevicePtr;
        let dev = s1.device.clone();
        let stream = dev.cuda_stream();
        let Some((a, _)) = l1.contiguous_offsets() else { candle_core::bail!("u8_to_input: images not contiguous") };
        let (ptr, _guard) = s1.as_cuda_slice::<u8>()?.device_ptr(&stream);
        let out = cuda::launch(&dev, ptr + a as u64, s2, l2, self.n, self.h, self.w, self.dtype, self.layout)?;
        Ok((out, self.out_shape()))
    }
}

/// The kernel applied to `flips` with the images read from a raw device address (a [`Slot`]'s buffer).
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
struct U8ToInputRaw {
    src: u64,
    op: U8ToInput,
}

impl CustomOp1 for U8ToInputRaw {
    fn name(&self) -> &'static str {
        "u8_to_input"
    }

    fn cpu_fwd(&self, _s: &CpuStorage, _l: &Layout) -> Result<(CpuStorage, Shape)> {
        candle_core::bail!("u8_to_input: a staged device buffer needs CUDA flips")
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, s: &candle_core::CudaStorage, l: &Layout) -> Result<(candle_core::CudaStorage, Shape)> {
        let o = &self.op;
        let out = cuda::launch(&s.device, self.src, s, l, o.n, o.h, o.w, o.dtype, o.layout)?;
        Ok((out, o.out_shape()))
    }
}

#[cfg(feature = "cuda")]
pub use cuda::Slot;

#[cfg(feature = "cuda")]
mod cuda {
    use super::{check_dtype, to_logical, InputLayout, U8ToInput, U8ToInputRaw};
    use crate::cuda::ptx;
    use candle_core::cuda_backend::cudarc::driver::{
        sys, CudaEvent, CudaSlice, CudaStream, DevicePtr, LaunchConfig, PinnedHostSlice, PushKernelArg,
    };
    use candle_core::cuda_backend::{CudaDevice, WrapErr};
    use candle_core::{CudaStorage, DType, Layout, Result, Tensor};
    use std::sync::Arc;

    const MODULE: &str = "data/01_u8_to_input";

    fn i32_arg(v: usize, what: &str) -> Result<i32> {
        i32::try_from(v).map_err(|_| candle_core::Error::Msg(format!("u8_to_input (cuda): {what} = {v} exceeds i32")))
    }

    /// Launches `u8_to_input_{dtype}` on the device's stream: `src` is the device address of (n, h, w, 3) u8,
    /// `flips` (n) u8. Returns the output storage ((n, 3, h, w) or (n, h, w, 3) of `dtype`).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn launch(
        dev: &CudaDevice,
        src: u64,
        flips: &CudaStorage,
        fl: &Layout,
        n: usize,
        h: usize,
        w: usize,
        dtype: DType,
        layout: InputLayout,
    ) -> Result<CudaStorage> {
        let stream = dev.cuda_stream();
        let Some((fa, fb)) = fl.contiguous_offsets() else { candle_core::bail!("u8_to_input: flips not contiguous") };
        if fb - fa != n {
            candle_core::bail!("u8_to_input (cuda): {} flips for {n} images", fb - fa);
        }
        let flips = flips.as_cuda_slice::<u8>()?.slice(fa..fb);
        let len = n * 3 * h * w;
        let (ni, hi, wi) = (i32_arg(n, "n")?, i32_arg(h, "h")?, i32_arg(w, "w")?);
        let nhwc = i32::from(layout == InputLayout::Nhwc);
        let pixels = n * h * w;
        let blocks = pixels.div_ceil(256).clamp(1, 1 << 16) as u32;
        let cfg = LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
        let (suffix, out) = match dtype {
            DType::F32 => {
                // SAFETY: the kernel writes all n*3*h*w elements.
                let out = unsafe { dev.alloc::<f32>(len)? };
                ("f32", CudaStorage::wrap_cuda_slice(out, dev.clone()))
            }
            DType::BF16 => {
                // SAFETY: as above.
                let out = unsafe { dev.alloc::<half::bf16>(len)? };
                ("bf16", CudaStorage::wrap_cuda_slice(out, dev.clone()))
            }
            DType::F16 => {
                // SAFETY: as above.
                let out = unsafe { dev.alloc::<half::f16>(len)? };
                ("f16", CudaStorage::wrap_cuda_slice(out, dev.clone()))
            }
            other => candle_core::bail!("u8_to_input (cuda): unsupported output dtype {other:?}"),
        };
        let out_ptr = match dtype {
            DType::F32 => out.as_cuda_slice::<f32>()?.device_ptr(&stream).0,
            DType::BF16 => out.as_cuda_slice::<half::bf16>()?.device_ptr(&stream).0,
            _ => out.as_cuda_slice::<half::f16>()?.device_ptr(&stream).0,
        };
        let func = dev.get_or_load_custom_func(&format!("u8_to_input_{suffix}"), MODULE, ptx::DATA_01_U8_TO_INPUT)?;
        let mut b = func.builder();
        b.arg(&src);
        b.arg(&flips);
        b.arg(&out_ptr);
        b.arg(&ni);
        b.arg(&hi);
        b.arg(&wi);
        b.arg(&nhwc);
        // SAFETY: arguments match u8_to_input_* (src, flips, out, n, h, w, nhwc); src holds n*h*w*3 bytes (the
        // callers' contract), flips n bytes, out n*3*h*w elements of the dtype.
        unsafe { b.launch(cfg) }.w()?;
        Ok(out)
    }

    /// One batch's way to the GPU: page-locked host memory, a device buffer of the same size and two events.
    /// [`Slot::stage`] (any thread) waits until the GPU is done with the slot's previous batch, copies the bytes
    /// into pinned memory and queues the host-to-device copy on `copy_stream`; [`Slot::convert`] (the training
    /// thread) makes the compute stream wait for that copy and launches the conversion, after which the slot can
    /// be staged again. The copy runs on the copy engine while the compute stream runs the training step.
    pub struct Slot {
        pinned: PinnedHostSlice<u8>,
        buf: CudaSlice<u8>,
        /// Recorded on the copy stream after the copy of the staged batch.
        copied: CudaEvent,
        /// Recorded on the compute stream after the conversion that read `buf` (so `pinned` was read too).
        free: CudaEvent,
        len: usize,
        copy_stream: Arc<CudaStream>,
    }

    impl Slot {
        /// A slot of `capacity` bytes; `copy_stream` is the stream its copies run on (shared by the slots of one
        /// feeder: [`Slot::copy_stream`]).
        pub fn new(copy_stream: &Arc<CudaStream>, capacity: usize) -> Result<Self> {
            let ctx = copy_stream.context().clone();
            // SAFETY: written in full by `stage` before any read (`convert` reads only `len` staged bytes).
            let pinned = unsafe { ctx.alloc_pinned::<u8>(capacity.max(1)) }.w()?;
            // SAFETY: as above, on the device.
            let buf = unsafe { copy_stream.alloc::<u8>(capacity.max(1)) }.w()?;
            let copied = ctx.new_event(None).w()?;
            // Blocking sync: the staging thread sleeps instead of spinning while it waits for the GPU.
            let free = ctx.new_event(Some(sys::CUevent_flags::CU_EVENT_BLOCKING_SYNC)).w()?;
            // The allocation is stream-ordered on the copy stream; the compute stream first touches `buf` after
            // waiting for `copied`, recorded after a copy queued behind the allocation.
            Ok(Self { pinned, buf, copied, free, len: 0, copy_stream: copy_stream.clone() })
        }

        /// A new non-blocking stream for host-to-device copies on `dev`'s context.
        pub fn copy_stream(dev: &CudaDevice) -> Result<Arc<CudaStream>> {
            dev.cuda_stream().context().new_stream().w()
        }

        pub fn capacity(&self) -> usize {
            self.pinned.len()
        }

        /// Whether the slot's memory belongs to `dev`'s context (a slot kept for reuse serves only its own device).
        pub fn serves(&self, dev: &CudaDevice) -> bool {
            Arc::ptr_eq(self.copy_stream.context(), dev.cuda_stream().context())
        }

        /// Waits until the GPU no longer reads this slot, copies `bytes` into its pinned memory and queues their
        /// copy to the device on the copy stream.
        pub fn stage(&mut self, bytes: &[u8]) -> Result<()> {
            if bytes.len() > self.capacity() {
                candle_core::bail!("u8_to_input: {} bytes do not fit a {}-byte slot", bytes.len(), self.capacity());
            }
            // The previous conversion out of `buf`, and the previous copy out of `pinned` (`free` covers it when a
            // conversion followed; a slot handed back staged but never converted has only `copied`).
            self.free.synchronize().w()?;
            self.copied.synchronize().w()?;
            let host = self.pinned.as_mut_slice().w()?;
            host[..bytes.len()].copy_from_slice(bytes);
            let host: &[u8] = &host[..bytes.len()];
            let mut dst = self.buf.slice_mut(0..bytes.len());
            // A plain slice of page-locked memory: cuMemcpyHtoDAsync returns at once and the copy engine runs it.
            self.copy_stream.memcpy_htod(host, &mut dst).w()?;
            self.copied.record(&self.copy_stream).w()?;
            self.len = bytes.len();
            Ok(())
        }

        /// On `dev`'s compute stream: waits for the staged copy, then converts the staged (n, h, w, 3) images with
        /// `flips` ((n) u8 on `dev`) into the (n, 3, h, w) input (see [`super::u8_to_input`]).
        pub fn convert(
            &mut self,
            dev: &CudaDevice,
            flips: &Tensor,
            (n, h, w): (usize, usize, usize),
            dtype: DType,
            layout: InputLayout,
        ) -> Result<Tensor> {
            check_dtype(dtype)?;
            if n * h * w * 3 != self.len {
                candle_core::bail!("u8_to_input: {n}x{h}x{w}x3 images but {} bytes staged", self.len);
            }
            let stream = dev.cuda_stream();
            stream.wait(&self.copied).w()?;
            let src = self.buf.device_ptr(&stream).0;
            let op = U8ToInputRaw { src, op: U8ToInput { n, h, w, dtype, layout } };
            let out = flips.apply_op1_no_bwd(&op)?;
            self.free.record(&stream).w()?;
            to_logical(out, layout)
        }
    }

    impl Drop for Slot {
        fn drop(&mut self) {
            // No copy into `buf` or conversion out of it may still run when they are freed.
            let _ = self.copied.synchronize();
            let _ = self.free.synchronize();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    fn images(n: usize, h: usize, w: usize) -> Vec<u8> {
        (0..n * h * w * 3).map(|i| (i * 37 % 251) as u8).collect()
    }

    #[test]
    fn reference_values_layouts_and_flip() {
        // Two 1x2 images: pixel values picked by hand.
        let src = [0u8, 255, 51, 255, 0, 102, 10, 20, 30, 40, 50, 60];
        let flips = [0u8, 1];
        let v = u8_to_input_ref(&src, &flips, 2, 1, 2, InputLayout::Nchw);
        let e = |p: f32, c: usize| (p / 255.0 - MEAN[c]) / STD[c];
        let want = [
            // image 0, not flipped: R plane [0, 255], G [255, 0], B [51, 102]
            e(0.0, 0),
            e(255.0, 0),
            e(255.0, 1),
            e(0.0, 1),
            e(51.0, 2),
            e(102.0, 2),
            // image 1, flipped: R [40, 10], G [50, 20], B [60, 30]
            e(40.0, 0),
            e(10.0, 0),
            e(50.0, 1),
            e(20.0, 1),
            e(60.0, 2),
            e(30.0, 2),
        ];
        assert_eq!(v, want);
        assert!((v[0] + 0.485 / 0.229).abs() < 1e-6);
        assert!((v[2] - (1.0 - 0.456) / 0.224).abs() < 1e-6);
        let nhwc = u8_to_input_ref(&src, &flips, 2, 1, 2, InputLayout::Nhwc);
        let want_nhwc = [want[0], want[2], want[4], want[1], want[3], want[5], want[6], want[8], want[10]];
        assert_eq!(nhwc[..9], want_nhwc);
    }

    #[test]
    fn op_matches_reference_in_every_dtype_and_layout() -> Result<()> {
        let (n, h, w) = (3, 5, 7);
        let raw = images(n, h, w);
        let flips = [1u8, 0, 1];
        let src = Tensor::from_slice(&raw, (n, h, w, 3), &Device::Cpu)?;
        let fl = Tensor::from_slice(&flips, n, &Device::Cpu)?;
        let nchw = u8_to_input_ref(&raw, &flips, n, h, w, InputLayout::Nchw);
        for layout in [InputLayout::Nchw, InputLayout::Nhwc] {
            for dtype in [DType::F32, DType::BF16, DType::F16] {
                let t = u8_to_input(&src, &fl, dtype, layout)?;
                assert_eq!((t.dims(), t.dtype()), (&[n, 3, h, w][..], dtype));
                // Logical (n, 3, h, w) values equal the NCHW reference rounded to the dtype.
                let got: Vec<f32> = t.to_dtype(DType::F32)?.flatten_all()?.to_vec1()?;
                let want: Vec<f32> =
                    Tensor::new(nchw.as_slice(), &Device::Cpu)?.to_dtype(dtype)?.to_dtype(DType::F32)?.to_vec1()?;
                assert_eq!(got, want, "{dtype:?} {layout:?}");
                if layout == InputLayout::Nhwc {
                    // NHWC in memory: the model's permute back is contiguous.
                    assert!(t.permute((0, 2, 3, 1))?.is_contiguous());
                }
            }
        }
        let bad = Tensor::from_slice(&raw[..n * h * w], (n, h, w, 1), &Device::Cpu)?;
        assert!(u8_to_input(&bad, &fl, DType::F32, InputLayout::Nchw).is_err());
        assert!(u8_to_input(&src, &fl, DType::U8, InputLayout::Nchw).is_err());
        Ok(())
    }
}

/// CUDA against the CPU reference (run with `--features cuda` on a GPU machine; `trainer data-bench` on a CUDA
/// device checks the same on a real batch).
#[cfg(all(test, feature = "cuda"))]
mod cuda_tests {
    use super::*;
    use candle_core::Device;

    #[test]
    fn kernel_and_slot_match_the_reference() -> Result<()> {
        let Ok(gpu) = Device::new_cuda(0) else { return Ok(()) };
        // Awkward sizes: not multiples of the block.
        let (n, h, w) = (3, 37, 29);
        let raw: Vec<u8> = (0..n * h * w * 3).map(|i| (i * 131 % 256) as u8).collect();
        let flips = [0u8, 1, 1];
        let cpu = |dtype, layout| -> Result<Vec<f32>> {
            let s = Tensor::from_slice(&raw, (n, h, w, 3), &Device::Cpu)?;
            let f = Tensor::from_slice(&flips, n, &Device::Cpu)?;
            u8_to_input(&s, &f, dtype, layout)?.to_dtype(DType::F32)?.flatten_all()?.to_vec1()
        };
        let Device::Cuda(dev) = &gpu else { unreachable!() };
        let copy = Slot::copy_stream(dev)?;
        let mut slot = Slot::new(&copy, raw.len() + 7)?;
        for layout in [InputLayout::Nchw, InputLayout::Nhwc] {
            for dtype in [DType::F32, DType::BF16, DType::F16] {
                let want = cpu(dtype, layout)?;
                let s = Tensor::from_slice(&raw, (n, h, w, 3), &gpu)?;
                let f = Tensor::from_slice(&flips, n, &gpu)?;
                let got: Vec<f32> =
                    u8_to_input(&s, &f, dtype, layout)?.to_dtype(DType::F32)?.flatten_all()?.to_vec1()?;
                assert_eq!(got, want, "op {dtype:?} {layout:?}");
                // Twice through the same slot: the second staging waits for the first conversion.
                for _ in 0..2 {
                    slot.stage(&raw)?;
                    let t = slot.convert(dev, &f, (n, h, w), dtype, layout)?;
                    let got: Vec<f32> = t.to_dtype(DType::F32)?.flatten_all()?.to_vec1()?;
                    assert_eq!(got, want, "slot {dtype:?} {layout:?}");
                }
            }
        }
        Ok(())
    }
}
