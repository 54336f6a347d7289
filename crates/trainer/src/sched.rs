//! Learning-rate schedules, evaluated per optimizer step: linear warm-up, then cosine, step, multistep or constant.

use crate::config::{SchedName, SchedSection};

#[derive(Debug, Clone)]
pub struct Schedule {
    pub cfg: SchedSection,
    pub base_lr: f64,
    pub steps_per_epoch: usize,
    pub total_steps: usize,
}

impl Schedule {
    pub fn new(cfg: &SchedSection, base_lr: f64, steps_per_epoch: usize, total_steps: usize) -> Self {
        Self { cfg: cfg.clone(), base_lr, steps_per_epoch: steps_per_epoch.max(1), total_steps: total_steps.max(1) }
    }

    /// Learning rate for optimizer step `step` (0-based).
    pub fn lr(&self, step: usize) -> f64 {
        let c = &self.cfg;
        let warmup = (c.warmup_epochs * self.steps_per_epoch as f64).round() as usize;
        if step < warmup {
            let f = c.warmup_start_factor + (1.0 - c.warmup_start_factor) * step as f64 / warmup as f64;
            return self.base_lr * f;
        }
        let epoch = step / self.steps_per_epoch;
        match c.name {
            SchedName::Cosine => {
                let span = self.total_steps.saturating_sub(warmup).max(1) as f64;
                let t = ((step - warmup) as f64 / span).min(1.0);
                c.min_lr + (self.base_lr - c.min_lr) * 0.5 * (1.0 + (std::f64::consts::PI * t).cos())
            }
            SchedName::Step => self.base_lr * c.gamma.powi((epoch / c.step_epochs.max(1)) as i32),
            SchedName::MultiStep => {
                self.base_lr * c.gamma.powi(c.milestones.iter().filter(|&&m| epoch >= m).count() as i32)
            }
            SchedName::Constant => self.base_lr,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sched(name: SchedName) -> SchedSection {
        SchedSection { name, ..Default::default() }
    }

    #[test]
    fn warmup_then_cosine() {
        let s = Schedule::new(
            &SchedSection { warmup_epochs: 1.0, warmup_start_factor: 0.1, ..sched(SchedName::Cosine) },
            1.0,
            10,
            110,
        );
        assert!((s.lr(0) - 0.1).abs() < 1e-12);
        assert!((s.lr(5) - 0.55).abs() < 1e-12);
        assert!((s.lr(10) - 1.0).abs() < 1e-12);
        assert!((s.lr(60) - 0.5).abs() < 1e-12);
        assert!(s.lr(110).abs() < 1e-12);
    }

    #[test]
    fn step_and_multistep() {
        let s = Schedule::new(&SchedSection { step_epochs: 2, gamma: 0.5, ..sched(SchedName::Step) }, 1.0, 10, 100);
        assert_eq!((s.lr(19), s.lr(20), s.lr(45)), (1.0, 0.5, 0.25));
        let s = Schedule::new(
            &SchedSection { milestones: vec![3, 5], gamma: 0.1, ..sched(SchedName::MultiStep) },
            1.0,
            10,
            100,
        );
        assert_eq!(s.lr(29), 1.0);
        assert!((s.lr(30) - 0.1).abs() < 1e-12 && (s.lr(55) - 0.01).abs() < 1e-12);
        let s = Schedule::new(&sched(SchedName::Constant), 0.3, 10, 100);
        assert_eq!(s.lr(99), 0.3);
    }
}
