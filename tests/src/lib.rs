//! Helpers shared by the integration tests in tests/tests/: reading tensors back to the host and comparing them
//! with a reference. Every comparison fails loudly on a shape mismatch and on a non-finite value where the
//! reference is finite.

use anyhow::{ensure, Result};
use candle_core::{DType, Device, Tensor};

/// A CPU f32 tensor of standard normal values from a fixed `seed` (splitmix64 + Box-Muller), the same on every
/// run and machine. candle's CPU `randn` draws from an unseeded generator, so a test fed by it sees a new input each
/// run: fine where two paths are compared bit for bit, not where a rare input can meet a difference of convention
/// (see `explicit_step_matches_autograd_*` in tests/tests/step.rs).
pub fn seeded_randn(shape: &[usize], seed: u64) -> Tensor {
    let mut state = seed;
    let mut next = move || {
        state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        // 53 random bits as a uniform in (0, 1]: never 0, so the logarithm below is finite.
        ((z ^ (z >> 31)) >> 11) as f64 / (1u64 << 53) as f64 + f64::EPSILON / 2.0
    };
    let n: usize = shape.iter().product();
    let v: Vec<f32> = (0..n)
        .map(|_| {
            let (u1, u2) = (next(), next());
            ((-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()) as f32
        })
        .collect();
    Tensor::from_vec(v, shape, &Device::Cpu).expect("seeded_randn: shape matches its length")
}

/// A tensor's values on the host as f32, row-major.
pub fn host_f32(t: &Tensor) -> Result<Vec<f32>> {
    Ok(t.to_device(&Device::Cpu)?.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?)
}

/// [`host_f32`] for tests that unwrap.
pub fn flat(t: &Tensor) -> Vec<f32> {
    host_f32(t).expect("tensor to host")
}

/// ‖a − b‖₂ / ‖b‖₂ in f64 (`b` the reference).
pub fn rel_l2(a: &[f32], b: &[f32]) -> f64 {
    assert_eq!(a.len(), b.len(), "rel_l2: {} vs {} values", a.len(), b.len());
    let (mut num, mut den) = (0f64, 0f64);
    for (&p, &q) in a.iter().zip(b) {
        num += (p as f64 - q as f64).powi(2);
        den += (q as f64).powi(2);
    }
    (num / den.max(1e-300)).sqrt()
}

/// [`rel_l2`] of two tensors of one shape.
pub fn rel_err(a: &Tensor, b: &Tensor) -> Result<f64> {
    ensure!(a.dims() == b.dims(), "rel_err: shape {:?} vs reference {:?}", a.dims(), b.dims());
    Ok(rel_l2(&host_f32(a)?, &host_f32(b)?))
}

/// How many values of two tensors of one shape differ in their bits (compared as f64, which holds every f32,
/// bf16, f16 and integer value exactly): 0 for results equal bit for bit.
pub fn bits_differ(a: &Tensor, b: &Tensor) -> Result<usize> {
    ensure!(a.dims() == b.dims(), "bits_differ: shape {:?} vs {:?}", a.dims(), b.dims());
    let f64s = |t: &Tensor| -> Result<Vec<f64>> { Ok(t.to_dtype(DType::F64)?.flatten_all()?.to_vec1::<f64>()?) };
    let (x, y) = (f64s(a)?, f64s(b)?);
    Ok(x.iter().zip(&y).filter(|(p, q)| p.to_bits() != q.to_bits()).count())
}

/// max |a − b| / max(1, max |b|): the largest error relative to the reference's scale.
pub fn max_err(a: &Tensor, b: &Tensor) -> Result<f32> {
    ensure!(a.dims() == b.dims(), "max_err: shape {:?} vs reference {:?}", a.dims(), b.dims());
    let (x, y) = (host_f32(a)?, host_f32(b)?);
    let scale = y.iter().fold(1f32, |m, v| m.max(v.abs()));
    Ok(x.iter().zip(&y).map(|(p, q)| (p - q).abs()).fold(0f32, f32::max) / scale)
}

/// Element-wise check `|got − want| <= atol + rtol·|want|`, NaN only where the reference has NaN; returns the
/// largest absolute difference.
pub fn assert_close(what: &str, got: &Tensor, want: &Tensor, atol: f32, rtol: f32) -> Result<f32> {
    ensure!(got.dims() == want.dims(), "{what}: shape {:?} vs reference {:?}", got.dims(), want.dims());
    ensure!(got.dtype() == want.dtype(), "{what}: dtype {:?} vs reference {:?}", got.dtype(), want.dtype());
    let (g, w) = (host_f32(got)?, host_f32(want)?);
    let mut bad = Vec::new();
    let mut max_diff = 0f32;
    for (i, (&a, &b)) in g.iter().zip(&w).enumerate() {
        let ok = if b.is_nan() {
            a.is_nan()
        } else {
            let d = (a - b).abs();
            if d.is_finite() {
                max_diff = max_diff.max(d);
            }
            d <= atol + rtol * b.abs()
        };
        if !ok {
            bad.push((i, a, b));
        }
    }
    ensure!(
        bad.is_empty(),
        "{what}: {} of {} elements differ (atol {atol}, rtol {rtol}); first (index, got, want): {:?}",
        bad.len(),
        g.len(),
        &bad[..bad.len().min(8)]
    );
    Ok(max_diff)
}

/// Relative L2 error ‖got − want‖ / ‖want‖ and the largest |got − want| / max|want|; fails on any non-finite
/// output (a poisoned element a kernel did not write) or an error above `tol` (4·`tol` for the largest one).
pub fn check_rel(what: &str, got: &Tensor, want: &Tensor, tol: f64) -> Result<f64> {
    ensure!(got.dims() == want.dims(), "{what}: shape {:?} vs reference {:?}", got.dims(), want.dims());
    let (g, w) = (host_f32(got)?, host_f32(want)?);
    let bad = g.iter().filter(|v| !v.is_finite()).count();
    ensure!(bad == 0, "{what}: {bad} of {} outputs are not finite (unwritten?)", g.len());
    let maxd = g.iter().zip(&w).map(|(&a, &b)| (a as f64 - b as f64).abs()).fold(0f64, f64::max);
    let maxw = w.iter().map(|&b| (b as f64).abs()).fold(0f64, f64::max);
    let rel = rel_l2(&g, &w);
    let rel_max = maxd / maxw.max(1e-30);
    ensure!(
        rel <= tol && rel_max <= 4.0 * tol,
        "{what}: relative L2 error {rel:.2e}, max error {rel_max:.2e} of max |ref| (bound {tol:.0e})"
    );
    Ok(rel)
}

/// Freezes every BatchNorm of `m` (`finetune.bn_frozen`) at running statistics moved off their (0, 1) initial
/// values: in the range of real statistics, so that most units stay alive, and with no channel of mean 0. With
/// frozen statistics a conv output of exact zeros (a dead input patch) would otherwise normalise to exactly 0 with a
/// zero bias, and at a pre-activation of exactly 0 the block-output ReLU gradient differs by convention (candle's
/// autograd passes it, the explicit step masks it from the saved output, as PyTorch does).
pub fn freeze_bn_at_test_stats(m: &resnet::ResNet) -> Result<()> {
    let dev = m.device().clone();
    let names: Vec<String> = m.store().snapshot()?.into_keys().filter(|k| k.ends_with("running_mean")).collect();
    for (i, name) in names.iter().enumerate() {
        let entry = |n: &str| m.store().get(n).ok_or_else(|| anyhow::anyhow!("no buffer {n}"));
        let rm = entry(name)?.param.var().clone();
        let rv = entry(&name.replace("running_mean", "running_var"))?.param.var().clone();
        let c = rm.dim(0)?;
        let mean: Vec<f32> = (0..c).map(|j| ((j + i) % 7) as f32 * 0.05 - 0.137).collect();
        let var: Vec<f32> = (0..c).map(|j| 0.5 + ((j + 2 * i) % 5) as f32 * 0.2).collect();
        rm.set(&Tensor::from_vec(mean, c, &dev)?)?;
        rv.set(&Tensor::from_vec(var, c, &dev)?)?;
    }
    m.freeze_bn_stats(true);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn comparisons_catch_differences() {
        let d = Device::Cpu;
        let a = Tensor::new(&[1f32, 2.0, 3.0], &d).unwrap();
        let b = Tensor::new(&[1f32, 2.0, 3.5], &d).unwrap();
        assert_eq!(rel_err(&a, &a).unwrap(), 0.0);
        assert!((rel_err(&a, &b).unwrap() - 0.5 / (1.0f64 + 4.0 + 12.25).sqrt()).abs() < 1e-9);
        assert!((max_err(&a, &b).unwrap() - 0.5 / 3.5).abs() < 1e-6);
        assert!(assert_close("x", &a, &b, 0.1, 0.0).is_err());
        assert!(assert_close("x", &a, &b, 0.5, 0.0).is_ok());
        assert!(check_rel("x", &a, &b, 1e-3).is_err());
        let nan = Tensor::new(&[1f32, f32::NAN, 3.0], &d).unwrap();
        assert!(check_rel("x", &nan, &a, 1.0).unwrap_err().to_string().contains("not finite"));
        let short = Tensor::new(&[1f32, 2.0], &d).unwrap();
        assert!(rel_err(&a, &short).is_err());
    }
}
