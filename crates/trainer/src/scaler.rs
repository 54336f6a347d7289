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

    /// The factor the loss is multiplied by this step (1 when disabled).
    pub fn scale(&self) -> f64 {
        if self.enabled {
            self.scale
        } else {
            1.0
        }
    }

    /// Updates the scale after a step: inf/NaN found -> backoff and reset; else count, and grow at the interval.
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
}
