//! Dynamic loss scaling with torch.amp.GradScaler's semantics (scale, backoff on inf/NaN, growth every N clean steps).

use crate::config::AmpSection;
use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LossScaler {
    pub enabled: bool,
    pub scale: f64,
    pub growth_factor: f64,
    pub backoff_factor: f64,
    pub growth_interval: usize,
    /// Clean steps since the last change of scale.
    pub growth_tracker: usize,
    pub min_scale: f64,
    pub max_scale: f64,
}

impl LossScaler {
    /// A scaler from the config; `enabled` is decided by the caller (amp.loss_scaling and the dtype).
    pub fn new(cfg: &AmpSection, enabled: bool) -> Self {
        Self {
            enabled,
            scale: if enabled { cfg.init_scale } else { 1.0 },
            growth_factor: cfg.growth_factor,
            backoff_factor: cfg.backoff_factor,
            growth_interval: cfg.growth_interval,
            growth_tracker: 0,
            min_scale: cfg.min_scale,
            max_scale: cfg.max_scale,
        }
    }

    /// A scaler's values as a run can have them (a checkpoint's are checked before a resume takes them): a finite
    /// positive scale, growth >= 1, backoff in (0, 1], an interval of at least one step, bounds >= 0 (0: none).
    pub fn check(&self) -> Result<(), String> {
        let finite_pos = |v: f64| v.is_finite() && v > 0.0;
        let ok = finite_pos(self.scale)
            && self.growth_factor.is_finite()
            && self.growth_factor >= 1.0
            && finite_pos(self.backoff_factor)
            && self.backoff_factor <= 1.0
            && self.growth_interval >= 1
            && self.min_scale.is_finite()
            && self.min_scale >= 0.0
            && self.max_scale.is_finite()
            && self.max_scale >= 0.0
            && (self.min_scale == 0.0 || self.max_scale == 0.0 || self.min_scale <= self.max_scale);
        if ok {
            Ok(())
        } else {
            Err(format!(
                "has a loss scaler no run has (scale {}, growth {}, backoff {}, interval {}, bounds [{}, {}])",
                self.scale,
                self.growth_factor,
                self.backoff_factor,
                self.growth_interval,
                self.min_scale,
                self.max_scale
            ))
        }
    }

    /// The scaler a resume continues with: this (the config's) scaler's settings and on/off, with the
    /// checkpoint's scale and growth tracker when both scale (as GradScaler.load_state_dict restores them); when
    /// only this one scales, it starts fresh at its initial scale.
    pub fn resumed_from(&self, saved: &LossScaler) -> LossScaler {
        if self.enabled && saved.enabled {
            LossScaler { scale: saved.scale, growth_tracker: saved.growth_tracker, ..self.clone() }
        } else {
            self.clone()
        }
    }

    /// The factor the loss is multiplied by this step (1 when disabled).
    pub fn scale(&self) -> f64 {
        if self.enabled {
            self.scale
        } else {
            1.0
        }
    }

    /// Updates the scale after a step: inf/NaN found -> backoff and reset; else count, and grow at the interval.
    /// The rule in f64 on the host: the reference that the device's FP32 rule ([`Self::update_f32`], which
    /// training runs) is tested against; the trainer's own copy follows the device ([`Self::set_from_report`]).
    pub fn update(&mut self, found_inf: bool) {
        if !self.enabled {
            return;
        }
        if found_inf {
            self.scale *= self.backoff_factor;
            self.growth_tracker = 0;
        } else {
            self.growth_tracker += 1;
            if self.growth_tracker >= self.growth_interval {
                self.scale *= self.growth_factor;
                self.growth_tracker = 0;
            }
        }
        if self.min_scale > 0.0 {
            self.scale = self.scale.max(self.min_scale);
        }
        if self.max_scale > 0.0 {
            self.scale = self.scale.min(self.max_scale);
        }
    }
}

/// The per-step state the device keeps, so that a step needs no host decision: FP32 [loss scale, growth tracker,
/// optimizer steps taken]. The update kernels read it (the scale to unscale with, AdamW's step count) and
/// [`LossScaler::update_on_device`] advances it after each step.
pub const DEVICE_STATE_LEN: usize = 3;
/// The report [`LossScaler::update_on_device`] writes per step: [scale used, found inf (0/1), scale, growth
/// tracker, steps taken after the step].
pub const REPORT_LEN: usize = 5;

impl LossScaler {
    /// The device state for this scaler and `steps` optimizer steps taken.
    pub fn device_state(&self, steps: u64, device: &candle_core::Device) -> candle_core::Result<candle_core::Tensor> {
        let v = [self.scale() as f32, self.growth_tracker as f32, steps as f32];
        candle_core::Tensor::new(&v, device)
    }

    /// The scaler's update of [`Self::update`], in FP32 on the device state `ctl` after a step whose unscaled
    /// gradient has the sum of squares `norm_sq` (not finite: found inf, the step was skipped). Returns the new
    /// state (on CUDA `ctl` itself, updated in place by one kernel, `kernels/optim/01_multi_tensor.cu`) and the
    /// step's report ([`REPORT_LEN`] values). Nothing is read back to the host.
    pub fn update_on_device(
        &self,
        ctl: &candle_core::Tensor,
        norm_sq: &candle_core::Tensor,
    ) -> candle_core::Result<(candle_core::Tensor, candle_core::Tensor)> {
        #[cfg(feature = "cuda")]
        if ctl.device().is_cuda() {
            let out = candle_core::Tensor::zeros(REPORT_LEN, candle_core::DType::F32, ctl.device())?;
            let rule = kernels::cuda::optim::AmpRule {
                enabled: self.enabled,
                growth: self.growth_factor,
                backoff: self.backoff_factor,
                interval: self.growth_interval,
                min_scale: self.min_scale,
                max_scale: self.max_scale,
            };
            kernels::cuda::optim::amp_update(ctl, &norm_sq.reshape(1)?, &out, &rule)?;
            return Ok((ctl.clone(), out));
        }
        let c = ctl.to_vec1::<f32>()?;
        let n = norm_sq.to_dtype(candle_core::DType::F32)?.flatten_all()?.to_vec1::<f32>()?[0];
        let (state, report) = self.update_f32([c[0], c[1], c[2]], n);
        let dev = ctl.device();
        Ok((candle_core::Tensor::new(&state, dev)?, candle_core::Tensor::new(&report, dev)?))
    }

    /// The FP32 rule of `amp_update_f32` (the CUDA kernel), on the host: (new state, report).
    pub fn update_f32(&self, [scale, tracker, steps]: [f32; 3], norm_sq: f32) -> ([f32; 3], [f32; REPORT_LEN]) {
        let inf = !norm_sq.is_finite();
        let (mut s, mut t) = (scale, tracker);
        let steps_after = if inf { steps } else { steps + 1.0 };
        if self.enabled {
            if inf {
                s *= self.backoff_factor as f32;
                t = 0.0;
            } else {
                t += 1.0;
                if t >= self.growth_interval as f32 {
                    s *= self.growth_factor as f32;
                    t = 0.0;
                }
            }
            if self.min_scale > 0.0 {
                s = s.max(self.min_scale as f32);
            }
            if self.max_scale > 0.0 {
                s = s.min(self.max_scale as f32);
            }
        }
        ([s, t, steps_after], [scale, if inf { 1.0 } else { 0.0 }, s, t, steps_after])
    }

    /// Takes the scale and growth tracker a step's report says (the device's state after the step).
    pub fn set_from_report(&mut self, report: &[f32]) {
        if self.enabled {
            self.scale = report[2] as f64;
            self.growth_tracker = report[3] as usize;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scaler(interval: usize) -> LossScaler {
        LossScaler::new(&AmpSection { init_scale: 1024.0, growth_interval: interval, ..Default::default() }, true)
    }

    #[test]
    fn scripted_overflow_sequence() {
        let mut s = scaler(3);
        // (found_inf, expected scale after the update, expected tracker)
        let script = [
            (false, 1024.0, 1),
            (false, 1024.0, 2),
            (false, 2048.0, 0),
            (true, 1024.0, 0),
            (false, 1024.0, 1),
            (true, 512.0, 0),
            (true, 256.0, 0),
            (false, 256.0, 1),
            (false, 256.0, 2),
            (false, 512.0, 0),
        ];
        for (i, (inf, scale, tracker)) in script.into_iter().enumerate() {
            s.update(inf);
            assert_eq!((s.scale, s.growth_tracker), (scale, tracker), "after update {i}");
        }
    }

    /// The FP32 device rule (the CUDA kernel's, on the host) follows the scripted sequence of the f64 rule, and
    /// counts only the steps taken.
    #[test]
    fn device_rule_matches_the_host_rule() {
        let mut host = scaler(3);
        host.min_scale = 64.0;
        let dev = host.clone();
        let mut state = [host.scale as f32, 0.0, 7.0];
        for (i, inf) in
            [false, false, false, true, false, true, true, true, true, false, false, false].into_iter().enumerate()
        {
            let used = state[0];
            let (next, report) = dev.update_f32(state, if inf { f32::INFINITY } else { 2.5 });
            host.update(inf);
            assert_eq!((next[0] as f64, next[1] as usize), (host.scale, host.growth_tracker), "after update {i}");
            assert_eq!(report, [used, if inf { 1.0 } else { 0.0 }, next[0], next[1], next[2]]);
            assert_eq!(next[2], state[2] + if inf { 0.0 } else { 1.0 });
            state = next;
        }
        let (_, r) = dev.update_f32(state, f32::NAN);
        assert_eq!(r[1], 1.0, "NaN is found like inf");
        let off = LossScaler::new(&AmpSection::default(), false);
        let (next, _) = off.update_f32([1.0, 0.0, 0.0], f32::INFINITY);
        assert_eq!(next, [1.0, 0.0, 0.0]);
    }

    #[test]
    fn clamps_and_disabled() {
        let mut s = scaler(1);
        s.min_scale = 256.0;
        s.max_scale = 2048.0;
        for _ in 0..5 {
            s.update(false);
        }
        assert_eq!(s.scale, 2048.0);
        for _ in 0..10 {
            s.update(true);
        }
        assert_eq!(s.scale, 256.0);
        let mut d = LossScaler::new(&AmpSection::default(), false);
        d.update(true);
        assert_eq!(d.scale(), 1.0);
    }

    /// A resume keeps the config's settings and the checkpoint's scale and tracker when both scale; a checkpoint
    /// that did not scale gives a fresh scaler; values no run has are refused.
    #[test]
    fn resume_and_check() {
        let cfg = AmpSection { growth_factor: 4.0, ..AmpSection::default() };
        let now = LossScaler::new(&cfg, true);
        let saved = LossScaler { scale: 8.0, growth_tracker: 3, ..LossScaler::new(&AmpSection::default(), true) };
        let r = now.resumed_from(&saved);
        assert_eq!((r.scale, r.growth_tracker, r.growth_factor), (8.0, 3, 4.0));
        let off = LossScaler::new(&AmpSection::default(), false);
        assert_eq!(now.resumed_from(&off), now);
        assert_eq!(off.resumed_from(&saved), off);
        assert!(saved.check().is_ok() && off.check().is_ok());
        for bad in [
            LossScaler { scale: f64::NAN, ..saved.clone() },
            LossScaler { scale: -1.0, ..saved.clone() },
            LossScaler { growth_factor: 0.0, ..saved.clone() },
            LossScaler { backoff_factor: 5.0, ..saved.clone() },
            LossScaler { growth_interval: 0, ..saved.clone() },
            LossScaler { min_scale: 100.0, max_scale: 10.0, ..saved.clone() },
        ] {
            let e = bad.check().unwrap_err();
            assert!(e.contains("loss scaler"), "{e}");
        }
    }
}
