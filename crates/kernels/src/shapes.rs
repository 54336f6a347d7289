//! The distinct convolutions of a ResNet (torchvision v1.5, ImageNet stem), for tests and benchmarks.

/// One convolution shape: `c_in -> c_out`, `k x k` kernel, stride, padding, input height = width `hw`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ConvShape {
    pub c_in: usize,
    pub c_out: usize,
    pub k: usize,
    pub stride: usize,
    pub pad: usize,
    pub hw: usize,
}

impl ConvShape {
    pub fn out_hw(&self) -> usize {
        crate::geom::conv_out_size(self.hw, self.k, self.stride, self.pad)
    }
    /// FLOPs of the forward pass at batch `n` (2 per multiply-add).
    pub fn flops(&self, n: usize) -> f64 {
        2.0 * (n * self.out_hw() * self.out_hw() * self.c_out * self.k * self.k * self.c_in) as f64
    }
}

impl std::fmt::Display for ConvShape {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:4}->{:4} k{} s{} hw{:3}", self.c_in, self.c_out, self.k, self.stride, self.hw)
    }
}

/// Distinct convolutions of a ResNet with bottleneck blocks (`layers` per stage, e.g. [3, 8, 36, 3] for
/// ResNet-152) on `image` x `image` inputs, each with how often it occurs in one forward pass, most frequent
/// first (ties in shape order).
pub fn bottleneck_convs(layers: [usize; 4], image: usize) -> Vec<(ConvShape, usize)> {
    let mut all = Vec::new();
    let conv = |c_in, c_out, k, stride, hw| ConvShape { c_in, c_out, k, stride, pad: k / 2, hw };
    all.push(conv(3, 64, 7, 2, image));
    let mut hw = crate::geom::conv_out_size(image, 7, 2, 3); // stem conv
    hw = crate::geom::conv_out_size(hw, 3, 2, 1); // max-pool
    let mut c_in = 64;
    for (stage, &blocks) in layers.iter().enumerate() {
        let width = 64 << stage;
        let stride = if stage == 0 { 1 } else { 2 };
        for b in 0..blocks {
            let s = if b == 0 { stride } else { 1 };
            all.push(conv(c_in, width, 1, 1, hw));
            all.push(conv(width, width, 3, s, hw));
            let out = (hw - 1) / s + 1;
            all.push(conv(width, width * 4, 1, 1, out));
            if b == 0 {
                all.push(conv(c_in, width * 4, 1, s, hw));
            }
            c_in = width * 4;
            hw = out;
        }
    }
    let mut counts: std::collections::BTreeMap<ConvShape, usize> = Default::default();
    for c in all {
        *counts.entry(c).or_default() += 1;
    }
    let mut v: Vec<_> = counts.into_iter().collect();
    v.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
    v
}

/// ResNet-152's distinct convolutions at 224 x 224.
pub fn resnet152_convs() -> Vec<(ConvShape, usize)> {
    bottleneck_convs([3, 8, 36, 3], 224)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn resnet152_has_23_distinct_convs_and_155_in_all() {
        let v = resnet152_convs();
        assert_eq!(v.len(), 23, "{v:?}");
        // 1 stem + 50 blocks x 3 + 4 downsamples
        assert_eq!(v.iter().map(|(_, n)| n).sum::<usize>(), 155);
        let stem = ConvShape { c_in: 3, c_out: 64, k: 7, stride: 2, pad: 3, hw: 224 };
        assert!(v.contains(&(stem, 1)));
        // The most frequent: the 1x1 256->1024 conv ending each of layer3's 36 blocks at 14x14.
        assert_eq!(v[0], (ConvShape { c_in: 256, c_out: 1024, k: 1, stride: 1, pad: 0, hw: 14 }, 36));
        // Forward FLOPs of all convs at batch 1: torchvision's ResNet-152 is 11.5 GMACs = 23 GFLOP.
        let total: f64 = v.iter().map(|(s, n)| s.flops(1) * *n as f64).sum();
        assert!((22.5e9..23.5e9).contains(&total), "{total}");
    }
}
