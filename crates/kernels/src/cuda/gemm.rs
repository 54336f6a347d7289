//! GEMM launchers (`kernels/gemm/`): C = A B in the three operand layouts of [`GemmLayout`], optionally plus a
//! bias fused into the epilogue, on the tile the caller's [`Tuning`] picks. The TMA tiles go through
//! [`super::tma::tma_gemm`]; the cp.async tiles split K only on `t64` when even its blocks cannot fill the GPU.

use super::autotune::{choose, pick, split_k};
use super::common::{blocks, splitk_reduce, splitk_workspace, GemmShape, BK};
use super::loader::{function, sm_count, tiles_for};
use super::tma::{tma_gemm, Epi};
use super::{aligned_range, alloc_out, i32_of, suffix};
use crate::geom::GemmLayout;
use crate::policy::Tuning;
use crate::variants::{Tile, T64};
use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{CudaSlice, CudaView, DeviceRepr, PushKernelArg};
use candle_core::cuda_backend::{CudaDType, CudaDevice, WrapErr};
use candle_core::{CudaStorage, Layout, Result, WithDType};
use half::{bf16, f16};

/// A (storage, layout) operand.
pub type Arg<'a> = (&'a CudaStorage, &'a Layout);

/// C (m x n, row-major) = A B (+ bias, length n) with A, B in `layout` (Nt: a (m, k), b (n, k); Nn: a (m, k),
/// b (k, n); Tn: a (k, m), b (k, n)), contiguous and 16-byte aligned views.
#[allow(clippy::too_many_arguments)]
pub fn gemm<T: CudaDType + DeviceRepr + WithDType + 'static>(
    dev: &CudaDevice,
    tuning: &Tuning,
    layout: GemmLayout,
    (m, n, k): (usize, usize, usize),
    va: &CudaView<T>,
    vb: &CudaView<T>,
    bias: Option<&CudaView<T>>,
) -> Result<CudaSlice<T>> {
    let op = "matmul";
    let sms = sm_count(dev)?;
    let sfx = suffix(T::DTYPE, op)?;
    let tag = layout.tag();
    let (lda, ldb, vec) = match layout {
        GemmLayout::Nt => (k, k, k % 8 == 0),
        GemmLayout::Nn => (k, n, k % 8 == 0 && n % 8 == 0),
        GemmLayout::Tn => (m, n, m % 8 == 0 && n % 8 == 0),
    };
    i32_of(m * k, op, "A size")?;
    i32_of(k * n, op, "B size")?;
    i32_of(m * n, op, "C size")?;
    let base = GemmShape {
        m: i32_of(m, op, "M")?,
        n: i32_of(n, op, "N")?,
        k: i32_of(k, op, "K")?,
        lda: lda as i32,
        ldb: ldb as i32,
        ldc: n as i32,
        has_bias: bias.is_some() as i32,
        ..Default::default()
    };
    // SAFETY: written in full by the chosen kernel (and, with split-K, by the reduction).
    let c = alloc_out::<T>(dev, m * n)?;
    let stream = dev.cuda_stream();
    let mut run = |tile: Tile| -> Result<()> {
        if tile.is_tma() {
            return tma_gemm(dev, tile, layout, (m, n, k), va, vb, &c.as_view(), bias, Epi::Plain, op);
        }
        // Split-K only on the 64x64 tile, when even its blocks cannot fill the GPU.
        let (k_split, splits) = if tile == T64 && m.div_ceil(64) * n.div_ceil(64) < sms {
            split_k(tile, m, n, k, sms)
        } else {
            (k.div_ceil(BK).max(1) * BK, 1)
        };
        let split = splits > 1;
        if split {
            i32_of(splits * m * n, op, "split-K workspace")?;
        }
        let sh = GemmShape { k_split: i32_of(k_split, op, "k_split")?, ..base };
        let name = format!(
            "gemm_{tag}_{}_{}{}_{sfx}",
            tile.name,
            if vec { "vec" } else { "scalar" },
            if split { "_split" } else { "" }
        );
        let f = function(dev, tile.gemm_module, &name, tile.smem)?;
        let ws = splitk_workspace(dev, split.then_some(splits * m * n))?;
        let mut bld = stream.launch_builder(&f);
        bld.arg(va).arg(vb).arg(&c).arg(&*ws);
        match bias {
            Some(v) => bld.arg(v),
            None => bld.arg(va), // never read: has_bias = 0
        };
        bld.arg(&sh);
        // SAFETY: (a, b, c, ws, bias, shape) as gemm_* takes them; sizes checked above.
        unsafe { bld.launch(blocks(tile, m, n, splits, op)?) }.w()?;
        if split {
            splitk_reduce(dev, &ws, &c.as_view(), bias, (m, n, splits), op)?;
        }
        Ok(())
    };
    let key = || format!("matmul {tag} {m}x{n}x{k} {sfx}");
    let tile = pick(dev, tuning, key, vec, tiles_for(dev), choose(m, n, sms, false), &mut run)?;
    run(tile)?;
    Ok(c)
}

fn gemm_t<T: CudaDType + DeviceRepr + WithDType + 'static>(
    tuning: &Tuning,
    layout: GemmLayout,
    mnk: (usize, usize, usize),
    a: Arg,
    b: Arg,
    bias: Option<Arg>,
) -> Result<CudaStorage> {
    let op = "matmul";
    let dev = &a.0.device;
    let (a0, a1) = aligned_range(a.1, op, "A")?;
    let (b0, b1) = aligned_range(b.1, op, "B")?;
    let va = a.0.as_cuda_slice::<T>()?.slice(a0..a1);
    let vb = b.0.as_cuda_slice::<T>()?.slice(b0..b1);
    let vbias = match bias {
        Some((s, l)) => {
            let (o0, o1) = aligned_range(l, op, "bias")?;
            Some(s.as_cuda_slice::<T>()?.slice(o0..o1))
        }
        None => None,
    };
    let c = gemm(dev, tuning, layout, mnk, &va, &vb, vbias.as_ref())?;
    Ok(CudaStorage::wrap_cuda_slice(c, dev.clone()))
}

/// [`gemm`] on candle storages of one dtype (bf16 or f16).
pub fn gemm_storage(
    tuning: &Tuning,
    layout: GemmLayout,
    mnk: (usize, usize, usize),
    a: Arg,
    b: Arg,
    bias: Option<Arg>,
) -> Result<CudaStorage> {
    if a.0.dtype() != b.0.dtype() || bias.is_some_and(|(s, _)| s.dtype() != a.0.dtype()) {
        candle_core::bail!("matmul (cuda): operands of different dtypes");
    }
    cuda_float!(a.0.dtype(), "matmul", [BF16: bf16, F16: f16], |T| gemm_t::<T>(tuning, layout, mnk, a, b, bias))
}
