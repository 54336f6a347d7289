//! CUDA graphs for a fixed-shape piece of work (the training step): [`capture`] records everything a closure
//! queues on the device's stream into one graph, which [`StepGraph::launch`] then replays with a single launch.
//!
//! What makes a step replayable:
//! - Every buffer the step keeps between launches (parameters, optimizer state, the loss-scale state, the
//!   learning rate, the inputs, the report) exists before the capture and is written in place; everything the
//!   closure allocates is allocated and freed inside it (cudarc allocates with `cuMemAllocAsync`, which a capture
//!   records as graph memory nodes at addresses fixed for the graph's lifetime).
//! - Values that change from step to step are read from device memory (the learning rate, the loss scale, the
//!   step count), never passed as kernel arguments from the host.
//! - Host-to-device copies inside the capture read host memory that stays unchanged while the graph lives:
//!   candle's own small layout uploads come from its upload cache (turned on for the warm-up step and the capture,
//!   [`upload_cache`]); the multi-tensor tables of our kernels are copied from pinned buffers that the graph keeps
//!   ([`htod`]).
//! - Nothing waits for the device or reads it back during the capture, and no kernel is autotuned there (the
//!   warm-up step, run eagerly on the same shapes first, does that).
//!
//! A capture that fails (an operation a capture does not allow, an upload candle has not cached) leaves nothing
//! queued: the caller runs the step eagerly instead.

use candle_core::cuda_backend::cudarc::driver::{result, sys, CudaGraph, CudaSlice, DevicePtrMut, DeviceRepr};
use candle_core::cuda_backend::{CudaDevice, WrapErr};
use candle_core::{DType, Result, Tensor};
use std::cell::RefCell;

/// Page-locked host memory that a captured copy reads at every replay.
struct Pinned {
    ptr: *mut std::ffi::c_void,
}

impl Drop for Pinned {
    fn drop(&mut self) {
        // SAFETY: `ptr` came from cuMemHostAlloc and is freed once; the graph that reads it is dropped first
        // (field order of StepGraph).
        unsafe {
            let _ = result::free_host(self.ptr);
        }
    }
}

thread_local! {
    /// While this thread captures: the pinned sources of the captured host-to-device copies.
    static CAPTURING: RefCell<Option<Vec<Pinned>>> = const { RefCell::new(None) };
}

/// A captured step: replay it with [`Self::launch`].
pub struct StepGraph {
    // Dropped before `_sources`: the graph's copies read them.
    graph: CudaGraph,
    _sources: Vec<Pinned>,
    /// The graph's nodes by kind.
    pub nodes: NodeCounts,
}

/// The nodes of a captured graph by kind: kernels are the launches a replay makes on the device; memory nodes are
/// the stream-ordered allocations and frees the capture recorded (no work at replay, the addresses are fixed).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct NodeCounts {
    pub kernels: usize,
    pub memsets: usize,
    pub copies: usize,
    pub alloc_free: usize,
    pub other: usize,
}

impl NodeCounts {
    pub fn total(&self) -> usize {
        self.kernels + self.memsets + self.copies + self.alloc_free + self.other
    }
}

impl std::fmt::Display for NodeCounts {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} nodes ({} kernels, {} memsets, {} copies, {} allocations and frees, {} other)",
            self.total(),
            self.kernels,
            self.memsets,
            self.copies,
            self.alloc_free,
            self.other
        )
    }
}

impl StepGraph {
    /// Queues one replay of the captured work on the stream it was captured on.
    pub fn launch(&self) -> Result<()> {
        self.graph.launch().w()
    }
}

/// Whether the calling thread is inside [`capture`].
pub fn capturing() -> bool {
    CAPTURING.with(|c| c.borrow().is_some())
}

/// Device address and byte length of `t`, a contiguous CUDA tensor of any dtype the step's inputs take.
fn dense_bytes(t: &Tensor, what: &str) -> Result<(u64, usize)> {
    let n = t.elem_count();
    let addr = match t.dtype() {
        DType::BF16 => super::addr_of::<half::bf16>(t, n, what)?,
        DType::F16 => super::addr_of::<half::f16>(t, n, what)?,
        DType::F32 => super::addr_of::<f32>(t, n, what)?,
        DType::U32 => super::addr_of::<u32>(t, n, what)?,
        DType::U8 => super::addr_of::<u8>(t, n, what)?,
        d => candle_core::bail!("{what}: dtype {d:?} is not copied whole (bf16, f16, f32, u32, u8 only)"),
    };
    Ok((addr, n * t.dtype().size_in_bytes()))
}

/// Copies `src` over `dst`, two contiguous CUDA tensors of one dtype and element count, with one device-to-device
/// memcpy on the device's stream (a memcpy node when captured). A captured step's input batch goes into the
/// graph's buffer this way: candle's `slice_set` ran a generic element copy (`copy2d`), 160 us for ResNet-152's
/// 77 MB bf16 batch on the H100 (ktrace 2026-12-05), half the copy engine's rate.
pub fn copy_dense(dst: &Tensor, src: &Tensor) -> Result<()> {
    if dst.dtype() != src.dtype() || dst.elem_count() != src.elem_count() {
        candle_core::bail!("copy_dense: {:?} {:?} into {:?} {:?}", src.dims(), src.dtype(), dst.dims(), dst.dtype());
    }
    let (d, bytes) = dense_bytes(dst, "copy_dense destination")?;
    let (s, _) = dense_bytes(src, "copy_dense source")?;
    let candle_core::Device::Cuda(dev) = dst.device() else { candle_core::bail!("copy_dense: not a CUDA tensor") };
    if bytes == 0 {
        return Ok(());
    }
    let stream = dev.cuda_stream();
    // SAFETY: d and s address `bytes` bytes each (checked: same dtype and element count, both contiguous) of live
    // device buffers on this device, the copy queued on the stream that orders every other use of them.
    unsafe { result::memcpy_dtod_async(d, s, bytes, stream.cu_stream()) }.w()
}

/// Copies `src` into `dst` on the stream of `dev`: a plain asynchronous copy, or inside [`capture`] a copy from a
/// pinned buffer that the graph keeps, so that every replay copies the same values.
pub fn htod<T: DeviceRepr + Copy>(dev: &CudaDevice, src: &[T], dst: &mut CudaSlice<T>) -> Result<()> {
    let stream = dev.cuda_stream();
    if !capturing() {
        return stream.memcpy_htod(src, dst).w();
    }
    if dst.len() < src.len() {
        candle_core::bail!("graph upload: {} values into a buffer of {}", src.len(), dst.len());
    }
    let bytes = std::mem::size_of_val(src);
    // SAFETY: a fresh page-locked allocation of `bytes` (at least 1) bytes, filled from `src` before the copy
    // that reads it is queued; it lives as long as the graph (pushed below).
    let pinned = unsafe { result::malloc_host(bytes.max(1), 0) }.w()?;
    let keep = Pinned { ptr: pinned };
    let host = unsafe {
        std::ptr::copy_nonoverlapping(src.as_ptr(), pinned as *mut T, src.len());
        std::slice::from_raw_parts(pinned as *const T, src.len())
    };
    let (dptr, _sync) = dst.device_ptr_mut(&stream);
    // SAFETY: `host` holds `src.len()` values in pinned memory that outlives the graph; `dst` holds at least that
    // many (checked above).
    unsafe { result::memcpy_htod_async(dptr, host, stream.cu_stream()) }.w()?;
    CAPTURING.with(|c| c.borrow_mut().as_mut().map(|v| v.push(keep)));
    Ok(())
}

/// Turns on candle's upload cache for as long as the guard lives: candle's small host-to-device copies (the
/// layouts of strided ops) are then served from device copies kept by content, so that a capture of work that
/// ran once under the same guard needs no upload. (The cache only grows with the distinct layouts of the step.)
pub fn upload_cache(dev: &CudaDevice) -> UploadCache {
    UploadCache { _guard: Box::new(dev.enable_cuda_graph_htod_cache()) }
}

/// [`upload_cache`]'s guard: the cache stays on while it lives.
#[must_use = "the upload cache is on while the guard lives"]
pub struct UploadCache {
    _guard: Box<dyn std::any::Any>,
}

/// Captures everything `work` queues on `dev`'s stream into a graph, without running it (relaxed capture mode).
/// On error the capture is ended, the stream drained and the errors the capture's drops recorded are cleared:
/// nothing is queued and the caller may run the work eagerly.
pub fn capture(dev: &CudaDevice, work: impl FnOnce() -> Result<()>) -> Result<StepGraph> {
    let stream = dev.cuda_stream();
    let ctx = stream.context().clone();
    if capturing() {
        candle_core::bail!("CUDA graph capture inside a capture");
    }
    let _cache = upload_cache(dev);
    // One stream: the per-buffer events that order several streams are not needed, and waiting inside a capture
    // on an event recorded before it is not allowed.
    let tracking = ctx.is_event_tracking();
    // SAFETY: everything the capture queues runs on this one stream.
    unsafe { ctx.disable_event_tracking() };
    CAPTURING.with(|c| *c.borrow_mut() = Some(Vec::new()));
    // Relaxed: the pinned buffers of the captured copies are allocated inside the capture (cuMemHostAlloc, which
    // the stricter modes refuse as a potentially synchronising call); nothing of it is queued on the stream.
    let begun = stream.begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED).w();
    let worked = begun.and_then(|()| work());
    // Always ended, so that the stream leaves capture mode whatever happened.
    let ended = stream.end_capture(sys::CUgraphInstantiate_flags(0)).w();
    let sources = CAPTURING.with(|c| c.borrow_mut().take()).unwrap_or_default();
    if tracking {
        // SAFETY: restores the state found on entry.
        unsafe { ctx.enable_event_tracking() };
    }
    // Errors that drops inside the capture could only record (a free the capture refused).
    let recorded = ctx.check_err().w();
    if worked.is_err() || recorded.is_err() || ended.is_err() {
        // Leave nothing behind for the eager step that follows: let the stream drain and clear what the failed
        // capture's drops recorded.
        let _ = stream.synchronize();
        let _ = ctx.check_err();
    }
    worked?;
    recorded?;
    let graph = ended?.ok_or_else(|| candle_core::Error::Msg("CUDA graph capture recorded nothing".into()))?;
    let nodes = graph_nodes(&graph)?;
    graph.upload().w()?;
    Ok(StepGraph { graph, _sources: sources, nodes })
}

fn graph_nodes(g: &CudaGraph) -> Result<NodeCounts> {
    use sys::CUgraphNodeType as T;
    let mut n: usize = 0;
    // SAFETY: the graph is alive; a null node array asks for the count only.
    unsafe { sys::cuGraphGetNodes(g.cu_graph(), std::ptr::null_mut(), &mut n) }.result().w()?;
    let mut nodes: Vec<sys::CUgraphNode> = vec![std::ptr::null_mut(); n];
    // SAFETY: `nodes` holds room for the `n` nodes the graph has; the call writes at most that many.
    unsafe { sys::cuGraphGetNodes(g.cu_graph(), nodes.as_mut_ptr(), &mut n) }.result().w()?;
    let mut counts = NodeCounts::default();
    for node in &nodes[..n.min(nodes.len())] {
        let mut t = T::CU_GRAPH_NODE_TYPE_EMPTY;
        // SAFETY: a node of the live graph, listed above.
        unsafe { sys::cuGraphNodeGetType(*node, &mut t) }.result().w()?;
        match t {
            T::CU_GRAPH_NODE_TYPE_KERNEL => counts.kernels += 1,
            T::CU_GRAPH_NODE_TYPE_MEMSET => counts.memsets += 1,
            T::CU_GRAPH_NODE_TYPE_MEMCPY => counts.copies += 1,
            T::CU_GRAPH_NODE_TYPE_MEM_ALLOC | T::CU_GRAPH_NODE_TYPE_MEM_FREE => counts.alloc_free += 1,
            _ => counts.other += 1,
        }
    }
    Ok(counts)
}

/// Returns the memory that graphs of `dev`'s device hold but are not using to the driver (after the stream is
/// idle), so that eager work between replays can use it; the next replay maps it again.
pub fn trim_graph_memory(dev: &CudaDevice) -> Result<()> {
    let stream = dev.cuda_stream();
    stream.synchronize().w()?;
    let ctx = stream.context();
    // SAFETY: the device handle is the context's; trimming only releases memory no graph is using.
    unsafe { sys::cuDeviceGraphMemTrim(ctx.cu_device()) }.result().w()
}

/// Device address of the storage under `t` (a CUDA tensor of any dtype) at its first element: what a captured
/// graph has baked in for that tensor.
pub fn base_addr(t: &Tensor) -> Result<u64> {
    use candle_core::cuda_backend::cudarc::driver::DevicePtr;
    let (st, l) = t.storage_and_layout();
    let candle_core::Storage::Cuda(cs) = &*st else { candle_core::bail!("base_addr: not a CUDA tensor") };
    let stream = cs.device.cuda_stream();
    let (p, size) = match t.dtype() {
        DType::F32 => (cs.as_cuda_slice::<f32>()?.device_ptr(&stream).0, 4),
        DType::F16 => (cs.as_cuda_slice::<half::f16>()?.device_ptr(&stream).0, 2),
        DType::BF16 => (cs.as_cuda_slice::<half::bf16>()?.device_ptr(&stream).0, 2),
        DType::F64 => (cs.as_cuda_slice::<f64>()?.device_ptr(&stream).0, 8),
        DType::I64 => (cs.as_cuda_slice::<i64>()?.device_ptr(&stream).0, 8),
        DType::U32 => (cs.as_cuda_slice::<u32>()?.device_ptr(&stream).0, 4),
        DType::U8 => (cs.as_cuda_slice::<u8>()?.device_ptr(&stream).0, 1),
        other => candle_core::bail!("base_addr: dtype {other:?}"),
    };
    Ok(p + (l.start_offset() * size) as u64)
}

/// Writes `values` into the first elements of `t` (a contiguous FP32 CUDA tensor) in place, ordered on the stream
/// after the work queued so far: how the host hands a captured step its learning rate.
pub fn write_f32(t: &Tensor, values: &[f32]) -> Result<()> {
    if t.dtype() != DType::F32 || t.elem_count() < values.len() || !t.is_contiguous() {
        candle_core::bail!("write_f32: {} values into {:?} {:?}", values.len(), t.dims(), t.dtype());
    }
    let (st, l) = t.storage_and_layout();
    let candle_core::Storage::Cuda(cs) = &*st else { candle_core::bail!("write_f32: not a CUDA tensor") };
    let stream = cs.device.cuda_stream();
    let slice = cs.as_cuda_slice::<f32>()?;
    let view = slice.slice(l.start_offset()..l.start_offset() + values.len());
    let (dptr, _sync) = {
        use candle_core::cuda_backend::cudarc::driver::DevicePtr;
        view.device_ptr(&stream)
    };
    // SAFETY: the view holds values.len() floats; the pageable source is staged before the call returns.
    unsafe { result::memcpy_htod_async(dptr, values, stream.cu_stream()) }.w()
}
