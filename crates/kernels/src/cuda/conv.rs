//! Implicit-GEMM convolution launchers over channels-last tensors (`kernels/conv/01_implicit_gemm.cu`,
//! `04_wgmma.cu`, `05_tma_wgmma.cu`): forward, grad-input (one launch per stride phase class) and grad-weight
//! (split-K on the cp.async tiles; transposed for few output channels), on the tile the caller's [`Tuning`]
//! picks. Few input channels take the explicit im2col path ([`super::im2col`]). 1x1 stride-1 convolutions are
//! plain GEMMs over channels-last rows on the TMA tiles.

use super::autotune::{choose, pick, split_k};
use super::common::{blocks, reduce_cfg, GemmShape, BK};
use super::im2col::{im2col_applies, im2col_conv};
use super::loader::{function, has_wgmma, sm_count, tiles_for};
use super::tma::{conv_corners, tma_gemm, tma_im2col_map, tma_map, tma_run, BnAddrs, Epi};
use super::{aligned_range, alloc_out, i32_of, suffix};
use crate::geom::{ConvGeom, ConvPass, GemmLayout};
use crate::policy::Tuning;
use crate::variants::{Tile, T64, W128, W256, X128, X256, X64};
use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{CudaView, DevicePtr, DeviceRepr, PushKernelArg, ValidAsZeroBits};
use candle_core::cuda_backend::{CudaDType, CudaDevice, WrapErr};
use candle_core::{CudaStorage, Layout, Result, Shape, WithDType};
use half::{bf16, f16};

/// The convolution geometry as the kernels take it (`ig::Shape`), with every flat index they form checked to fit
/// an i32.
pub(crate) fn gemm_shape(g: &ConvGeom, op: &str) -> Result<GemmShape> {
    let f = |v: usize, w: &str| i32_of(v, op, w);
    // Every flat index the kernels form from these stays below the largest tensor, checked here.
    f(g.n * g.h * g.w * g.c, "input size")?;
    f(g.n * g.p() * g.q() * g.ko, "output size")?;
    f(g.ko * g.r * g.r * g.c, "weight size")?;
    Ok(GemmShape {
        batch: f(g.n, "n")?,
        h: f(g.h, "h")?,
        w: f(g.w, "w")?,
        c: f(g.c, "c")?,
        ko: f(g.ko, "ko")?,
        r: f(g.r, "r")?,
        s: f(g.r, "s")?,
        p: f(g.p(), "p")?,
        q: f(g.q(), "q")?,
        stride: f(g.stride, "stride")?,
        pad: f(g.pad, "pad")?,
        ..Default::default()
    })
}

/// Whether tile variant `tile` has its own kernel for at least one pass of `g`: all tiles do, except the TMA
/// tiles (`x256`, `x128`, `x64`), which take the passes [`tma_conv_applies`] accepts (a forced TMA tile runs
/// `w256` / `w128` on the others).
pub fn conv_tile_applies(tile: Tile, g: &ConvGeom) -> bool {
    !tile.is_tma() || [ConvPass::Fwd, ConvPass::Dgrad, ConvPass::Wgrad].iter().any(|&p| tma_conv_applies(g, p))
}

/// Whether the TMA kernels run pass `pass` of `g`: the 1x1 stride-1 unpadded convolutions as plain GEMMs;
/// otherwise through im2col tensor maps, which need the im2col source's channels (C; Ko for grad-input) to be a
/// multiple of 64 (a 64-deep k-tile stays within one filter tap); the strided grad-input runs per phase class.
pub fn tma_conv_applies(g: &ConvGeom, pass: ConvPass) -> bool {
    g.is_plain()
        || match pass {
            ConvPass::Fwd | ConvPass::Wgrad => g.c.is_multiple_of(64) && g.ko.is_multiple_of(8),
            ConvPass::Dgrad => g.pad < g.r && g.ko.is_multiple_of(64) && g.c.is_multiple_of(8),
        }
}

/// The cp.async wgmma tile a TMA tile falls back to on the passes it does not run.
fn tma_fallback(tile: Tile) -> Tile {
    match tile {
        X256 => W256,
        X128 | X64 => W128,
        t => t,
    }
}

/// One pass of `g` on a TMA tile through im2col tensor maps (kernels/conv/05_tma_wgmma.cu): `a` / `b` are the
/// pass's operands as [`conv_storage`] takes them (Fwd: x, w; Dgrad: dy, w; Wgrad: dy, x), `out` the result. The
/// strided grad-input runs one launch per phase class of `classes` that has taps (`out` is zeroed beforehand
/// when some class has none); `transposed` grad-weight writes dw^T (see [`wgrad_transposed`]); `stats` (forward
/// only): the BatchNorm moments of `out` go to the partials at that address (conv_fwd_stats_*).
#[allow(clippy::too_many_arguments)]
fn tma_conv<T: CudaDType + DeviceRepr + WithDType>(
    dev: &CudaDevice,
    tile: Tile,
    pass: ConvPass,
    g: &ConvGeom,
    classes: &[(usize, GemmShape)],
    transposed: bool,
    a: &CudaView<T>,
    b: &CudaView<T>,
    out: &CudaView<T>,
    epi: Epi,
    op: &str,
) -> Result<()> {
    let sfx = suffix(T::DTYPE, op)?;
    match (epi, pass) {
        (Epi::Plain, _) | (Epi::Moments { .. }, ConvPass::Fwd) => {}
        (Epi::GradSums { .. }, ConvPass::Dgrad) if g.stride == 1 => {}
        _ => candle_core::bail!("{op} (cuda): no {epi:?} epilogue for this pass"),
    }
    let stream = dev.cuda_stream();
    let (pa, ga) = a.device_ptr(&stream);
    let (pb, gb) = b.device_ptr(&stream);
    let (dt, p, q, rsc) = (T::DTYPE, g.p(), g.q(), g.r * g.r * g.c);
    let x_dims = (g.n, g.h, g.w, g.c);
    let (lo, up) = conv_corners(g.r, g.pad);
    let func = |name: &str| function(dev, tile.conv_module, &format!("conv_{name}_{}_tma_{sfx}", tile.name), tile.smem);
    let base = gemm_shape(g, op)?;
    match pass {
        // y[npq][ko] = im2col(x)[npq][(r, s, c)] . w[ko][(r, s, c)]
        ConvPass::Fwd => {
            let ma = tma_im2col_map(pa, dt, x_dims, lo, up, g.stride, 128, op)?;
            let mb = tma_map(pb, dt, rsc, g.ko, tile.bn as u32, op)?;
            let name = if epi == Epi::Plain { "fwd" } else { "fwd_stats" };
            tma_run(dev, tile, (&func, name), (&ma, &mb), (g.n * p * q, g.ko, rsc), base, out, None, true, epi, op)?;
        }
        // dx[nhw][c] = im2col(dy, padding r - 1 - pad)[nhw][(r', s', k)] . w[k][flipped (r', s')][c]
        ConvPass::Dgrad if g.stride == 1 => {
            let (lo, up) = conv_corners(g.r, g.r - 1 - g.pad);
            let ma = tma_im2col_map(pa, dt, (g.n, p, q, g.ko), lo, up, 1, 128, op)?;
            let mb = tma_map(pb, dt, rsc, g.ko, 64, op)?;
            let mnk = (g.n * g.h * g.w, g.c, g.r * g.r * g.ko);
            let name = if epi == Epi::Plain { "dgrad" } else { "dgrad_gsums" };
            tma_run(dev, tile, (&func, name), (&ma, &mb), mnk, base, out, None, true, epi, op)?;
        }
        // Per phase class: dx[(n, hh, ww)][c] = im2col(dy, class corners)[..][(i', j', k)] . w[k][class tap][c],
        // stored to dx pixel (n, hh * stride + ph, ww * stride + pw).
        ConvPass::Dgrad => {
            let mb = tma_map(pb, dt, rsc, g.ko, 64, op)?;
            for (m, sh) in classes.iter().filter(|(_, sh)| sh.k > 0) {
                let (tr, ts) = (sh.tr as usize, sh.ts as usize);
                // The class's window corners over dy: hh + (ph + pad - r0) / stride - (tr - 1), walked for mh rows.
                let corner = |ph: i32, r0: i32, t: usize, mh: i32, size: usize| {
                    let lo = (ph + g.pad as i32 - r0) / g.stride as i32 - (t as i32 - 1);
                    (lo, mh - size as i32 + lo)
                };
                let (lh, uh) = corner(sh.ph, sh.r0, tr, sh.mh, p);
                let (lw, uw) = corner(sh.pw, sh.s0, ts, sh.mw, q);
                let ma = tma_im2col_map(pa, dt, (g.n, p, q, g.ko), (lh, lw), (uh, uw), 1, 128, op)?;
                let mnk = (*m, g.c, tr * ts * g.ko);
                tma_run(dev, tile, (&func, "dgrads"), (&ma, &mb), mnk, *sh, out, None, false, Epi::Plain, op)?;
            }
        }
        // Transposed (Ko <= 64, see wgrad_transposed): dw^T[(r, s, c)][ko] = im2col(x)^T[..][npq] . dy[npq][ko]
        ConvPass::Wgrad if transposed => {
            let ma = tma_im2col_map(pb, dt, x_dims, lo, up, g.stride, 64, op)?;
            let mb = tma_map(pa, dt, g.ko, g.n * p * q, 64, op)?;
            tma_run(
                dev,
                tile,
                (&func, "wgradt"),
                (&ma, &mb),
                (rsc, g.ko, g.n * p * q),
                base,
                out,
                None,
                true,
                Epi::Plain,
                op,
            )?;
        }
        // dw[ko][(r, s, c)] = dy[npq][ko]^T . im2col(x)[npq][(r, s, c)]
        ConvPass::Wgrad => {
            let ma = tma_map(pa, dt, g.ko, g.n * p * q, 64, op)?;
            let mb = tma_im2col_map(pb, dt, x_dims, lo, up, g.stride, 64, op)?;
            tma_run(
                dev,
                tile,
                (&func, "wgrad"),
                (&ma, &mb),
                (g.ko, rsc, g.n * p * q),
                base,
                out,
                None,
                true,
                Epi::Plain,
                op,
            )?;
        }
    }
    drop((ga, gb));
    Ok(())
}

/// Whether grad-weight runs transposed, dw^T[(r, s, c)][ko] = im2col(x)^T . dy (conv_wgradt_*, or a TN GEMM of x
/// and dy for a 1x1), followed by a transposing copy of the small result: few output channels (Ko <= 64, which
/// would fill half of the TMA tiles' 128 rows) and at least 128 rows of R*S*C, on the TMA path of a wgmma device.
pub fn wgrad_transposed(dev: &CudaDevice, g: &ConvGeom) -> bool {
    g.ko <= 64
        && g.ko.is_multiple_of(8)
        && g.c.is_multiple_of(8)
        && g.r * g.r * g.c >= 128
        && tma_conv_applies(g, ConvPass::Wgrad)
        && has_wgmma(dev)
}

/// One pass of a channels-last convolution, as [`conv_storage`] runs it.
#[derive(Debug, Clone, Copy)]
pub struct ConvLaunch<'a> {
    pub geom: ConvGeom,
    pub pass: ConvPass,
    /// Grad-weight only: compute dw^T, shape (r, r, c, ko) (see [`wgrad_transposed`]).
    pub transposed: bool,
    pub tuning: &'a Tuning,
    /// Byte budget of the few-channel im2col buffer.
    pub im2col_budget: usize,
    /// BatchNorm reductions in the epilogue, when the pass runs on a TMA tile: the forward's moments
    /// (`Epi::Moments`) or a grad-input's backward sums (`Epi::GradSums`, plain or stride-1 passes), with the
    /// flag set when they were written.
    pub stats: Option<StatsOut<'a>>,
    /// A 1x1 stride-1 forward or grad-weight whose activation operand is relu(bn(z)) of the tensor given, with
    /// this BatchNorm, normalised inside the TMA GEMM ([`Epi::BnReluIn`]); the caller checked that it applies.
    pub bn_in: Option<BnAddrs>,
}

/// The epilogue reduction asked of a pass ([`Epi`]: where its partials go, [`super::tma::stats_partials_len`] or
/// [`super::tma::grad_sums_partials_len`] floats), and `wrote`, set when the launch that ran wrote them (a TMA
/// tile on a pass that has the epilogue: the others, and the few-channel im2col path, leave the reduction to a
/// separate pass).
#[derive(Debug, Clone, Copy)]
pub struct StatsOut<'a> {
    pub epi: Epi,
    pub wrote: &'a std::sync::atomic::AtomicBool,
}

impl ConvLaunch<'_> {
    pub fn op_name(&self) -> &'static str {
        match self.pass {
            ConvPass::Fwd => "conv2d_nhwc_fwd",
            ConvPass::Dgrad => "conv2d_nhwc_dgrad",
            ConvPass::Wgrad => "conv2d_nhwc_wgrad",
        }
    }
}

/// Runs `cl` on two candle storages of one dtype (bf16 or f16): Fwd (x, w) -> y (n, p, q, ko); Dgrad (dy, w) ->
/// dx (n, h, w, c); Wgrad (dy, x) -> dw (ko, r, r, c), or dw^T (r, r, c, ko) when `transposed`.
pub fn conv_storage(
    cl: &ConvLaunch,
    s1: &CudaStorage,
    l1: &Layout,
    s2: &CudaStorage,
    l2: &Layout,
) -> Result<(CudaStorage, Shape)> {
    let op = cl.op_name();
    if s1.dtype() != s2.dtype() {
        candle_core::bail!("{op} (cuda): operands are {:?} and {:?}", s1.dtype(), s2.dtype());
    }
    cuda_float!(s1.dtype(), op, [BF16: bf16, F16: f16], |T| conv_t::<T>(cl, s1, l1, s2, l2))
}

/// What every pass needs: device, tile candidates, the two operand views, the kernel-name suffix.
struct Pass<'a, T> {
    cl: &'a ConvLaunch<'a>,
    dev: &'a CudaDevice,
    sms: usize,
    v1: CudaView<'a, T>,
    v2: CudaView<'a, T>,
    sfx: &'static str,
    base: GemmShape,
    /// The TMA tiles take this pass (see [`tma_conv_applies`]).
    tma_ok: bool,
    op: &'static str,
}

impl<T: CudaDType + DeviceRepr + WithDType + ValidAsZeroBits + 'static> Pass<'_, T> {
    fn key(&self) -> String {
        format!("{} {:?} {}", self.op, self.cl.geom, self.sfx)
    }
    /// The key of a forward or grad-input pick: with an epilogue, `tag` (`+bn-epilogue`, `+join`), its own key;
    /// without, `plain`. Both carry the suffix, so that files written before the split (whose plain entries may
    /// have been timed with the epilogue in the TMA candidates only) are not read back.
    fn key_epi(&self, tag: Option<&str>) -> String {
        format!("{} {}", self.key(), tag.unwrap_or("plain"))
    }
    /// The autotuner's candidates: every tile of the device, the TMA ones only where they take the pass.
    fn candidates(&self) -> Vec<Tile> {
        tiles_for(self.dev).iter().copied().filter(|t| !t.is_tma() || self.tma_ok).collect()
    }
    fn tma_tiles(&self) -> Vec<Tile> {
        tiles_for(self.dev).iter().copied().filter(|t| t.is_tma()).collect()
    }
    fn pick(&self, vec: bool, cands: &[Tile], heuristic: Tile, run: impl FnMut(Tile) -> Result<()>) -> Result<Tile> {
        pick(self.dev, self.cl.tuning, || self.key(), vec, cands, heuristic, run)
    }
    /// The tile of a forward or grad-input pass that may carry an epilogue (`tag`: the one the caller asked for,
    /// where the TMA tiles take the pass; None: the plain pass). With the epilogue only the TMA tiles are candidates,
    /// under their own key: a cp.async tile leaves the reduction to a separate pass that the timing does not see,
    /// so it used to win shapes unfairly (dropping the epilogue), and the shared key then carried that pick to
    /// runs without epilogues (a ResNet-152 bf16 step on an H200 ran cp.async convolutions after a first run with
    /// `bn_stats = "fused"` had filled the autotune file). Whether the epilogue pays is
    /// [`super::autotune::epilogue_pays`]'s question, not the tile's. The joined store ([`Epi::Join`]) likewise
    /// runs on the TMA tiles only, under `+join` (with the sums of the BatchNorm before, [`Epi::JoinSums`], under
    /// `+join-sums`).
    fn pick_epi(
        &self,
        tag: Option<&str>,
        vec: bool,
        heuristic: Tile,
        run: impl FnMut(Tile) -> Result<()>,
    ) -> Result<Tile> {
        if tag.is_some() {
            let heuristic = if heuristic.is_tma() {
                heuristic
            } else if heuristic.bn <= 64 {
                X64
            } else {
                X128
            };
            return pick(self.dev, self.cl.tuning, || self.key_epi(tag), vec, &self.tma_tiles(), heuristic, run);
        }
        pick(self.dev, self.cl.tuning, || self.key_epi(None), vec, &self.candidates(), heuristic, run)
    }

    /// Few input channels (the RGB stem): explicit im2col + the TMA GEMM, on the TMA tiles only.
    fn im2col(&self) -> Result<(CudaStorage, Shape)> {
        let g = &self.cl.geom;
        let (len, shape) = match self.cl.pass {
            ConvPass::Fwd => (g.n * g.p() * g.q() * g.ko, Shape::from((g.n, g.p(), g.q(), g.ko))),
            _ => (g.ko * g.r * g.r * g.c, Shape::from((g.ko, g.r, g.r, g.c))),
        };
        let out = alloc_out::<T>(self.dev, len)?;
        let budget = self.cl.im2col_budget;
        let run = |tile: Tile| im2col_conv(self.dev, tile, budget, self.cl.pass, g, &self.v1, &self.v2, &out, self.op);
        let mut run = run;
        let tile = self.pick(true, &self.tma_tiles(), X64, &mut run)?;
        run(tile)?;
        Ok((CudaStorage::wrap_cuda_slice(out, self.dev.clone()), shape))
    }

    /// A 1x1 stride-1 pass whose activation operand is relu(bn(z)) ([`Epi::BnReluIn`], or with the forward's
    /// moments [`Epi::BnReluInMoments`]): the TMA GEMM in `layout` (NT forward: A = z; TN grad-weight: B = z) on a
    /// TMA tile (tuned under its own key; a forced or heuristic cp.async tile stands for the TMA tile of its width).
    fn bn_relu_in_gemm(
        &self,
        epi: Epi,
        layout: GemmLayout,
        (m, n, k): (usize, usize, usize),
        a: &CudaView<T>,
        b: &CudaView<T>,
        out: &CudaView<T>,
    ) -> Result<()> {
        let (g, op, dev) = (&self.cl.geom, self.op, self.dev);
        if !g.is_plain() || !has_wgmma(dev) {
            candle_core::bail!("{op} (cuda): a normalised operand needs a 1x1 stride-1 pass on a TMA tile");
        }
        let heuristic = if n <= 64 { X64 } else { X128 };
        let run = |tile: Tile| {
            let tile = if tile.is_tma() { tile } else { heuristic };
            tma_gemm(dev, tile, layout, (m, n, k), a, b, out, None, epi, op)
        };
        let mut run = run;
        let moments = matches!(epi, Epi::BnReluInMoments { .. });
        let key = || format!("{} bnin{}", self.key(), if moments { "+bn-epilogue" } else { "" });
        let tile = pick(dev, self.cl.tuning, key, true, &self.tma_tiles(), heuristic, &mut run)?;
        run(tile)
    }

    fn fwd(&self) -> Result<(CudaStorage, Shape)> {
        let (g, op, dev) = (&self.cl.geom, self.op, self.dev);
        if let Some(bn) = self.cl.bn_in {
            // 1x1, stride 1: y[npq][ko] = relu(bn(z))[npq][c] w[ko][c]^T, with the moments of y when asked (always
            // a TMA tile here: they are written).
            let (m, n, k) = (g.n * g.p() * g.q(), g.ko, g.c);
            let y = alloc_out::<T>(dev, m * n)?;
            let epi = match self.cl.stats {
                Some(StatsOut { epi: Epi::Moments { part }, wrote }) => {
                    wrote.store(true, std::sync::atomic::Ordering::Relaxed);
                    Epi::BnReluInMoments { bn, part }
                }
                _ => Epi::BnReluIn { bn },
            };
            self.bn_relu_in_gemm(epi, GemmLayout::Nt, (m, n, k), &self.v1, &self.v2, &y.as_view())?;
            return Ok((CudaStorage::wrap_cuda_slice(y, dev.clone()), Shape::from((g.n, g.p(), g.q(), g.ko))));
        }
        let (m, n, k) = (g.n * g.p() * g.q(), g.ko, g.r * g.r * g.c);
        let vec = g.c % 8 == 0;
        let sh = GemmShape {
            m: i32_of(m, op, "M")?,
            n: i32_of(n, op, "N")?,
            k: i32_of(k, op, "K")?,
            ldb: k as i32,
            ldc: n as i32,
            k_split: i32_of(k.div_ceil(BK) * BK, op, "K")?,
            ..self.base
        };
        let y = alloc_out::<T>(dev, m * n)?;
        let stream = dev.cuda_stream();
        let stats = self.cl.stats.filter(|s| matches!(s.epi, Epi::Moments { .. }));
        let part = stats.map_or(Epi::Plain, |s| s.epi);
        let mut run = |tile: Tile| -> Result<()> {
            if tile.is_tma() && self.tma_ok {
                if let Some(s) = stats {
                    s.wrote.store(true, std::sync::atomic::Ordering::Relaxed);
                }
                if g.is_plain() {
                    // 1x1, stride 1: y[npq][ko] = x[npq][c] w[ko][c]^T
                    return tma_gemm(
                        dev,
                        tile,
                        GemmLayout::Nt,
                        (m, n, k),
                        &self.v1,
                        &self.v2,
                        &y.as_view(),
                        None,
                        part,
                        op,
                    );
                }
                return tma_conv(dev, tile, ConvPass::Fwd, g, &[], false, &self.v1, &self.v2, &y.as_view(), part, op);
            }
            if let Some(s) = stats {
                s.wrote.store(false, std::sync::atomic::Ordering::Relaxed);
            }
            let tile = tma_fallback(tile);
            let name = format!("conv_fwd_{}_{}_{}", tile.name, if vec { "vec" } else { "scalar" }, self.sfx);
            let f = function(dev, tile.conv_module, &name, tile.smem)?;
            let mut b = stream.launch_builder(&f);
            b.arg(&self.v1).arg(&self.v2).arg(&y).arg(&sh);
            // SAFETY: (x, w, y, shape) as conv_fwd_* takes them; x holds n*h*w*c, w ko*r*r*c, y m*n.
            unsafe { b.launch(blocks(tile, m, n, 1, op)?) }.w()?;
            Ok(())
        };
        let tag = (stats.is_some() && self.tma_ok).then_some("+bn-epilogue");
        let tile = self.pick_epi(tag, vec, choose(m, n, self.sms, false), &mut run)?;
        run(tile)?;
        Ok((CudaStorage::wrap_cuda_slice(y, dev.clone()), Shape::from((g.n, g.p(), g.q(), g.ko))))
    }

    /// The stride phase classes (h % stride, w % stride) of the grad-input: (rows, shape) each (see DgradA in
    /// igemm.cuh).
    fn dgrad_classes(&self) -> Result<Vec<(usize, GemmShape)>> {
        let (g, op) = (&self.cl.geom, self.op);
        let st = g.stride;
        let mut classes = Vec::new();
        for ph in 0..st.min(g.h) {
            for pw in 0..st.min(g.w) {
                let r0 = (ph + g.pad) % st;
                let s0 = (pw + g.pad) % st;
                let tr = if r0 < g.r { (g.r - r0).div_ceil(st) } else { 0 };
                let ts = if s0 < g.r { (g.r - s0).div_ceil(st) } else { 0 };
                let (mh, mw) = ((g.h - ph).div_ceil(st), (g.w - pw).div_ceil(st));
                let (m, k) = (g.n * mh * mw, tr * ts * g.ko);
                let sh = GemmShape {
                    m: i32_of(m, op, "M")?,
                    n: i32_of(g.c, op, "N")?,
                    k: i32_of(k, op, "K")?,
                    ldc: g.c as i32,
                    k_split: i32_of(k.div_ceil(BK).max(1) * BK, op, "K")?,
                    ph: ph as i32,
                    pw: pw as i32,
                    mh: mh as i32,
                    mw: mw as i32,
                    r0: r0 as i32,
                    s0: s0 as i32,
                    tr: tr as i32,
                    ts: ts as i32,
                    ..self.base
                };
                classes.push((m, sh));
            }
        }
        Ok(classes)
    }

    fn dgrad(&self) -> Result<(CudaStorage, Shape)> {
        let (g, op, dev) = (&self.cl.geom, self.op, self.dev);
        if g.c % 8 != 0 || g.ko % 8 != 0 {
            candle_core::bail!("{op} (cuda): channels {} -> {} must be multiples of 8", g.c, g.ko);
        }
        let classes = self.dgrad_classes()?;
        // Phase classes without taps (a strided 1x1: 3 of 4) are zeros: one memset here, and the TMA path skips
        // them (the other kernels write their zeros too).
        let len = g.n * g.h * g.w * g.c;
        let dx = if classes.iter().any(|(_, sh)| sh.k == 0) {
            dev.alloc_zeros::<T>(len)?
        } else {
            alloc_out::<T>(dev, len)?
        };
        let stream = dev.cuda_stream();
        // The backward sums in the epilogue: the plain and stride-1 passes (the strided one scatters its rows).
        // The joined store: the plain pass (a 1x1 stride-1 GEMM).
        let gsums = self.cl.stats.filter(|s| match s.epi {
            Epi::GradSums { .. } => g.is_plain() || g.stride == 1,
            Epi::Join { .. } | Epi::JoinSums { .. } => g.is_plain(),
            _ => false,
        });
        let epi = gsums.map_or(Epi::Plain, |s| s.epi);
        let mut run = |tile: Tile| -> Result<()> {
            if let Some(s) = self.cl.stats {
                s.wrote.store(tile.is_tma() && self.tma_ok && gsums.is_some(), std::sync::atomic::Ordering::Relaxed);
            }
            if tile.is_tma() && self.tma_ok {
                if g.is_plain() {
                    // 1x1, stride 1: dx[nhw][c] = dy[nhw][ko] w[ko][c]
                    let mnk = (g.n * g.h * g.w, g.c, g.ko);
                    return tma_gemm(dev, tile, GemmLayout::Nn, mnk, &self.v1, &self.v2, &dx.as_view(), None, epi, op);
                }
                return tma_conv(
                    dev,
                    tile,
                    ConvPass::Dgrad,
                    g,
                    &classes,
                    false,
                    &self.v1,
                    &self.v2,
                    &dx.as_view(),
                    epi,
                    op,
                );
            }
            let tile = tma_fallback(tile);
            let name = format!("conv_dgrad_{}_vec_{}", tile.name, self.sfx);
            let f = function(dev, tile.conv_module, &name, tile.smem)?;
            for (m, sh) in &classes {
                let mut b = stream.launch_builder(&f);
                b.arg(&self.v1).arg(&self.v2).arg(&dx).arg(sh);
                // SAFETY: (dy, w, dx, shape) as conv_dgrad_* takes them; the classes partition dx's rows.
                unsafe { b.launch(blocks(tile, *m, g.c, 1, op)?) }.w()?;
            }
            Ok(())
        };
        let m_class = classes.first().map_or(0, |c| c.0);
        let tag = match (gsums.is_some() && self.tma_ok, epi) {
            (false, _) => None,
            (true, Epi::Join { .. }) => Some("+join"),
            (true, Epi::JoinSums { .. }) => Some("+join-sums"),
            (true, _) => Some("+bn-epilogue"),
        };
        let tile = self.pick_epi(tag, true, choose(m_class, g.c, self.sms, false), &mut run)?;
        run(tile)?;
        Ok((CudaStorage::wrap_cuda_slice(dx, dev.clone()), Shape::from((g.n, g.h, g.w, g.c))))
    }

    /// dw^T[(r, s, c)][ko] = im2col(x)^T . dy, on the TMA tiles only.
    fn wgrad_transposed(&self) -> Result<(CudaStorage, Shape)> {
        let (g, op, dev) = (&self.cl.geom, self.op, self.dev);
        let (m, n, k) = (g.r * g.r * g.c, g.ko, g.n * g.p() * g.q());
        let dwt = alloc_out::<T>(dev, m * n)?;
        let mut run = |tile: Tile| -> Result<()> {
            let tile = if tile.is_tma() { tile } else { X64 };
            if g.is_plain() {
                // 1x1, stride 1: dw^T[c][ko] = x[npq][c]^T dy[npq][ko]
                return tma_gemm(
                    dev,
                    tile,
                    GemmLayout::Tn,
                    (m, n, k),
                    &self.v2,
                    &self.v1,
                    &dwt.as_view(),
                    None,
                    Epi::Plain,
                    op,
                );
            }
            tma_conv(dev, tile, ConvPass::Wgrad, g, &[], true, &self.v1, &self.v2, &dwt.as_view(), Epi::Plain, op)
        };
        let tile = self.pick(true, &self.tma_tiles(), X64, &mut run)?;
        run(tile)?;
        Ok((CudaStorage::wrap_cuda_slice(dwt, dev.clone()), Shape::from((g.r, g.r, g.c, g.ko))))
    }

    fn wgrad(&self) -> Result<(CudaStorage, Shape)> {
        let (g, op, dev) = (&self.cl.geom, self.op, self.dev);
        let (m, n, k) = (g.ko, g.r * g.r * g.c, g.n * g.p() * g.q());
        let vec = g.c % 8 == 0 && g.ko % 8 == 0;
        let dw = alloc_out::<T>(dev, m * n)?;
        if let Some(bn) = self.cl.bn_in {
            // 1x1, stride 1: dw[ko][c] = dy[npq][ko]^T relu(bn(z))[npq][c]
            self.bn_relu_in_gemm(Epi::BnReluIn { bn }, GemmLayout::Tn, (m, n, k), &self.v1, &self.v2, &dw.as_view())?;
            return Ok((CudaStorage::wrap_cuda_slice(dw, dev.clone()), Shape::from((g.ko, g.r, g.r, g.c))));
        }
        let stream = dev.cuda_stream();
        let mut run = |tile: Tile| -> Result<()> {
            if tile.is_tma() && self.tma_ok {
                if g.is_plain() {
                    // 1x1, stride 1: dw[ko][c] = dy[npq][ko]^T x[npq][c]
                    return tma_gemm(
                        dev,
                        tile,
                        GemmLayout::Tn,
                        (m, n, k),
                        &self.v1,
                        &self.v2,
                        &dw.as_view(),
                        None,
                        Epi::Plain,
                        op,
                    );
                }
                return tma_conv(
                    dev,
                    tile,
                    ConvPass::Wgrad,
                    g,
                    &[],
                    false,
                    &self.v1,
                    &self.v2,
                    &dw.as_view(),
                    Epi::Plain,
                    op,
                );
            }
            let tile = tma_fallback(tile);
            let (k_split, splits) = split_k(tile, m, n, k, self.sms);
            i32_of(splits * m * n, op, "split-K workspace")?;
            let sh = GemmShape {
                m: i32_of(m, op, "M")?,
                n: i32_of(n, op, "N")?,
                k: i32_of(k, op, "K")?,
                lda: g.ko as i32,
                ldc: n as i32,
                k_split: i32_of(k_split, op, "k_split")?,
                ..self.base
            };
            let name = format!("conv_wgrad_{}_{}_{}", tile.name, if vec { "vec" } else { "scalar" }, self.sfx);
            let f = function(dev, tile.conv_module, &name, tile.smem)?;
            // SAFETY: every (z, row < M, col < N) element is written by the block that owns its tile.
            let ws = unsafe { dev.alloc::<f32>(splits * m * n)? };
            let mut b = stream.launch_builder(&f);
            b.arg(&self.v1).arg(&self.v2).arg(&ws).arg(&sh);
            // SAFETY: (dy, x, ws, shape) as conv_wgrad_* takes them; ws holds splits*m*n floats.
            unsafe { b.launch(blocks(tile, m, n, splits, op)?) }.w()?;
            let r = function(dev, T64.conv_module, &format!("conv_splitk_reduce_{}", self.sfx), T64.smem)?;
            let mut b = stream.launch_builder(&r);
            let (mn, sp) = (i32_of(m * n, op, "M*N")?, splits as i32);
            b.arg(&ws).arg(&dw).arg(&mn).arg(&sp);
            // SAFETY: (ws, out, mn, splits) as conv_splitk_reduce_* takes them.
            unsafe { b.launch(reduce_cfg(m * n)) }.w()?;
            Ok(())
        };
        let tile = self.pick(vec, &self.candidates(), choose(m, n, self.sms, true), &mut run)?;
        run(tile)?;
        Ok((CudaStorage::wrap_cuda_slice(dw, dev.clone()), Shape::from((g.ko, g.r, g.r, g.c))))
    }
}

fn conv_t<T: CudaDType + DeviceRepr + WithDType + ValidAsZeroBits + 'static>(
    cl: &ConvLaunch,
    s1: &CudaStorage,
    l1: &Layout,
    s2: &CudaStorage,
    l2: &Layout,
) -> Result<(CudaStorage, Shape)> {
    let op = cl.op_name();
    let g = cl.geom;
    let dev = &s1.device;
    let (a0, a1) = aligned_range(l1, op, "first input")?;
    let (b0, b1) = aligned_range(l2, op, "second input")?;
    let pass = Pass {
        cl,
        dev,
        sms: sm_count(dev)?,
        v1: s1.as_cuda_slice::<T>()?.slice(a0..a1),
        v2: s2.as_cuda_slice::<T>()?.slice(b0..b1),
        sfx: suffix(T::DTYPE, op)?,
        base: gemm_shape(&g, op)?,
        tma_ok: tma_conv_applies(&g, cl.pass),
        op,
    };
    if cl.pass != ConvPass::Dgrad && im2col_applies(dev, g.c, g.ko) {
        return pass.im2col();
    }
    match cl.pass {
        ConvPass::Fwd => pass.fwd(),
        ConvPass::Dgrad => pass.dgrad(),
        ConvPass::Wgrad if cl.transposed => pass.wgrad_transposed(),
        ConvPass::Wgrad => pass.wgrad(),
    }
}
