//! The variant table: every implementation a convolution or GEMM launch can take, as data. Entry 0 is the
//! built-in path (candle's convolution, cuBLAS through candle's matmul); the others are block tiles of our
//! tensor-core kernels, each naming the `kernels/` modules that instantiate it and the architecture it needs.
//! The autotuner chooses among the tiles a device runs ([`tiles_for_arch`]); benchmarks and tests force one
//! through [`crate::Tuning::Forced`].
//!
//! Development variants the autotuner never picked on any ResNet-152 shape on the H200 (the mma.sync 256x128,
//! 128x256 and 64-deep tiles) live in `kernels/dev/` and are not built into the shipped binary.

/// The kernel family of a tile, which fixes its launch path and the architecture it needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Family {
    /// `mma.sync` with a cp.async ring (sm_80+).
    MmaSync,
    /// Warpgroup MMA (`wgmma`) with a cp.async ring (sm_90a only).
    Wgmma,
    /// Warp-specialised persistent kernel: TMA producer, two wgmma consumer warpgroups (sm_90a only).
    Tma,
}

/// The architecture a variant needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Arch {
    /// Any device: candle's own kernels.
    Any,
    /// Compute capability 8.0 or newer (PTX JIT-compiled for the device).
    Sm80,
    /// Compute capability 9.0 exactly (sm_90a SASS: H100/H200).
    Sm90a,
}

impl Arch {
    pub fn name(self) -> &'static str {
        match self {
            Arch::Any => "any",
            Arch::Sm80 => "sm_80+",
            Arch::Sm90a => "sm_90a",
        }
    }
}

/// A block tile of the tensor-core kernels (the `t128` / `x256` / ... part of a kernel name) and the modules
/// (paths under `kernels/` without `.cu`) that instantiate its convolution and GEMM kernels.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Tile {
    pub name: &'static str,
    pub bm: usize,
    pub bn: usize,
    /// k-tile depth (values of the reduction dimension per pipeline stage)
    pub bk: usize,
    pub threads: u32,
    /// Dynamic shared memory in bytes.
    pub smem: u32,
    pub family: Family,
    pub conv_module: &'static str,
    pub gemm_module: &'static str,
}

impl Tile {
    pub fn arch(&self) -> Arch {
        match self.family {
            Family::MmaSync => Arch::Sm80,
            Family::Wgmma | Family::Tma => Arch::Sm90a,
        }
    }
    pub fn is_tma(&self) -> bool {
        self.family == Family::Tma
    }
}

const MMA_CONV: &str = "conv/01_implicit_gemm";
const MMA_GEMM: &str = "gemm/01_mma_cp_async";
const WGMMA_CONV: &str = "conv/04_wgmma";
const WGMMA_GEMM: &str = "gemm/04_wgmma";
const TMA_CONV: &str = "conv/05_tma_wgmma";
const TMA_GEMM: &str = "gemm/05_tma_wgmma";

const fn mma(name: &'static str, bm: usize, bn: usize, threads: u32, stages: u32) -> Tile {
    Tile {
        name,
        bm,
        bn,
        bk: 32,
        threads,
        smem: stages * ((bm + bn) * 32 * 2) as u32,
        family: Family::MmaSync,
        conv_module: MMA_CONV,
        gemm_module: MMA_GEMM,
    }
}

const fn wgmma(name: &'static str, bn: usize, stages: u32) -> Tile {
    Tile {
        name,
        bm: 128,
        bn,
        bk: 64,
        threads: 256,
        smem: stages * ((128 + bn) * 64 * 2) as u32 + 1024,
        family: Family::Wgmma,
        conv_module: WGMMA_CONV,
        gemm_module: WGMMA_GEMM,
    }
}

/// Dynamic shared memory of one TMA kernel layout (`ig::TmaCfg`): alignment slack, `stages` stages of A (128 x 64)
/// and B (`bn` x 64), `epi` bytes of epilogue staging, `zbufs` z chunks of 128 rows x `zw` columns, and two
/// barriers per stage and per z buffer.
const fn tma_layout(bn: usize, stages: usize, epi: usize, zbufs: usize, zw: usize) -> usize {
    1024 + stages * (128 + bn) * 64 * 2 + epi + zbufs * 128 * zw * 2 + 2 * stages * 8 + 2 * zbufs * 8
}

const fn max3(a: usize, b: usize, c: usize) -> usize {
    let m = if a > b { a } else { b };
    if m > c {
        m
    } else {
        c
    }
}

/// A tile of the TMA kernel: 128 x `bn` x 64, 384 threads (a producer and two consumer warpgroups), `stages`
/// stages. Every kernel of the tile is launched with the largest of its layouts (`ig::TmaLaunch`): the plain one
/// (the stages and the epilogue staging buffer `ig::TMA_EPI_BYTES`, 64 x 128 outputs per consumer warpgroup), the
/// backward-sums one (fewer stages, a ring of z chunks beside the staging) and the join's (its store in place in
/// its ring of residual-gradient chunks: no staging).
const fn tma(name: &'static str, bn: usize, stages: usize) -> Tile {
    const EPI: usize = 2 * 64 * 128 * 2;
    let zw = if bn == 256 { 64 } else { bn };
    let plain = tma_layout(bn, stages, EPI, 0, zw);
    let (sums, join) = match bn {
        256 => (tma_layout(bn, 3, EPI, 3, zw), tma_layout(bn, 3, 0, 5, zw)),
        128 => (tma_layout(bn, 4, EPI, 2, zw), tma_layout(bn, 4, 0, 3, zw)),
        _ => (tma_layout(bn, 6, EPI, 2, zw), tma_layout(bn, 7, 0, 3, zw)),
    };
    Tile {
        name,
        bm: 128,
        bn,
        bk: 64,
        threads: 384,
        smem: max3(plain, sums, join) as u32,
        family: Family::Tma,
        conv_module: TMA_CONV,
        gemm_module: TMA_GEMM,
    }
}

/// 128x128x32, 8 warps of 64x32, 4 stages: the portable (sm_80) tile.
pub const T128: Tile = mma("t128", 128, 128, 256, 4);
/// 64x64x32, 4 warps of 32x32, 4 stages: the only tile with scalar loads and (matmul) split-K; its module also
/// holds the split-K reductions.
pub const T64: Tile = mma("t64", 64, 64, 128, 4);
/// 128x128x64 on wgmma, 2 warpgroups of 64x128, 5 stages.
pub const W128: Tile = wgmma("w128", 128, 5);
/// The same with 3 stages: 97 KiB, two blocks per SM.
pub const W128S3: Tile = wgmma("w128s3", 128, 3);
/// 128x256x64 on wgmma, 2 warpgroups of 64x256, 4 stages.
pub const W256: Tile = wgmma("w256", 256, 4);
/// TMA 128x256x64, 4 stages.
pub const X256: Tile = tma("x256", 256, 4);
/// TMA 128x128x64, 6 stages: twice the tiles of `x256`, for shapes whose last wave of 128x256 tiles would leave
/// SMs idle.
pub const X128: Tile = tma("x128", 128, 6);
/// TMA 128x64x64, 8 stages: GEMMs 64 wide (the 64-channel layers), where the wider tiles would multiply zeros.
pub const X64: Tile = tma("x64", 64, 8);

/// What a variant computes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum OpKind {
    Conv,
    Gemm,
}

/// One entry of [`VARIANTS`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Variant {
    /// candle's convolution and matmul (cuBLAS on CUDA): what runs where our kernels do not apply.
    Builtin,
    Tile(Tile),
}

impl Variant {
    pub fn name(&self) -> &'static str {
        match self {
            Variant::Builtin => "builtin",
            Variant::Tile(t) => t.name,
        }
    }
    /// The modules that hold the variant's kernels ("candle" for the built-in path).
    pub fn modules(&self) -> (&'static str, &'static str) {
        match self {
            Variant::Builtin => ("candle", "candle"),
            Variant::Tile(t) => (t.conv_module, t.gemm_module),
        }
    }
    pub fn tile(&self) -> Option<Tile> {
        match self {
            Variant::Builtin => None,
            Variant::Tile(t) => Some(*t),
        }
    }
    pub fn arch(&self) -> Arch {
        match self {
            Variant::Builtin => Arch::Any,
            Variant::Tile(t) => t.arch(),
        }
    }
    /// Every variant computes convolutions (all three passes) and GEMMs.
    pub fn ops(&self) -> &'static [OpKind] {
        &[OpKind::Conv, OpKind::Gemm]
    }
}

/// The variant table; entry 0 is the built-in path.
pub const VARIANTS: [Variant; 9] = [
    Variant::Builtin,
    Variant::Tile(T128),
    Variant::Tile(T64),
    Variant::Tile(W128),
    Variant::Tile(W128S3),
    Variant::Tile(W256),
    Variant::Tile(X256),
    Variant::Tile(X128),
    Variant::Tile(X64),
];

/// Every tile of the table.
pub const TILES: [Tile; 8] = [T128, T64, W128, W128S3, W256, X256, X128, X64];
/// The tiles that run on any sm_80+ GPU (mma.sync).
pub const PORTABLE_TILES: [Tile; 2] = [T128, T64];

/// The tiles the autotuner may try on a device: all of them on compute capability 9.0, else the portable ones.
pub fn tiles_for_arch(sm90a: bool) -> &'static [Tile] {
    if sm90a {
        &TILES
    } else {
        &PORTABLE_TILES
    }
}

/// The tile named `name` (`t64`, `x256`, ...).
pub fn tile_by_name(name: &str) -> Option<Tile> {
    TILES.iter().copied().find(|t| t.name == name)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table_is_consistent() {
        assert_eq!(VARIANTS[0], Variant::Builtin);
        let tiles: Vec<Tile> = VARIANTS[1..].iter().filter_map(Variant::tile).collect();
        assert_eq!(tiles, TILES.to_vec());
        for (i, t) in TILES.iter().enumerate() {
            assert!(TILES[..i].iter().all(|u| u.name != t.name), "duplicate tile {}", t.name);
            assert_eq!(tile_by_name(t.name), Some(*t));
            // 227 KiB of dynamic shared memory per block on sm_90, 163 KiB on sm_80.
            let limit = if t.arch() == Arch::Sm90a { 227 * 1024 } else { 163 * 1024 };
            assert!(t.smem <= limit, "{} needs {} bytes of shared memory", t.name, t.smem);
            assert!(t.conv_module.starts_with("conv/") && t.gemm_module.starts_with("gemm/"));
        }
        assert!(PORTABLE_TILES.iter().all(|t| t.arch() == Arch::Sm80));
        assert_eq!(tiles_for_arch(false), &PORTABLE_TILES);
        assert_eq!(tile_by_name("t256"), None);
    }

    /// The sizes the kernels were measured with (kernels/gemm/*.cu, `ig::TmaCfg`).
    #[test]
    fn shared_memory_sizes() {
        assert_eq!(T128.smem, 4 * (128 + 128) * 32 * 2);
        assert_eq!(T64.smem, 4 * (64 + 64) * 32 * 2);
        assert_eq!(W128.smem, 5 * (128 + 128) * 64 * 2 + 1024);
        assert_eq!(W256.smem, 4 * (128 + 256) * 64 * 2 + 1024);
        // ig::TmaLaunch (static_asserted there too): the join layouts are the largest of x256 and x128, the plain
        // one of x64.
        assert_eq!(X256.smem, 1024 + 3 * (128 + 256) * 64 * 2 + 5 * 128 * 64 * 2 + 2 * 3 * 8 + 2 * 5 * 8);
        assert_eq!(X256.smem, 230_528);
        assert_eq!(X128.smem, 230_512);
        assert_eq!(X64.smem, 230_528);
        // The plain layouts fit in them.
        assert!(tma_layout(256, 4, 2 * 64 * 128 * 2, 0, 64) <= 230_528);
        // So do the joins with the sums of the BatchNorm before (ig::TmaCfg's JOIN_SUMS, static_asserted there
        // too): `stages` stages, a 4 KB hand-over, `zb` b chunks and two z3 chunks of 128 x 64, and the barriers
        // (stages, b ring, the statistics warps' two, the z tile's slot, zjoined per b chunk, z3 full per z3 chunk).
        let joinsw = |bn: usize, stages: usize, zb: usize| {
            tma_layout(bn, stages, 4096, zb + 2, 64) - 2 * 2 * 8 + 16 + 8 + 8 * (zb + 2)
        };
        assert!(joinsw(256, 2, 5) <= X256.smem as usize);
        assert!(joinsw(128, 3, 5) <= X128.smem as usize);
        assert!(joinsw(64, 5, 4) <= X64.smem as usize);
    }
}
