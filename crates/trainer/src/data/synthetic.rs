//! "synthetic": pseudo-random noise images, deterministic from (seed, split, index), for throughput runs.

use super::{mix_seed, DataError, Dataset, Sample, Split, StageNanos};
use rand::{RngCore, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// Uniform noise images with labels `index % num_classes`; nothing to learn, no augmentation.
pub struct Synthetic {
    len: usize,
    num_classes: usize,
    size: u32,
    seed: u64,
    split: Split,
}

impl Synthetic {
    pub fn new(len: usize, num_classes: usize, image_size: usize, seed: u64, split: Split) -> Self {
        let size = u32::try_from(image_size).unwrap_or(u32::MAX);
        Self { len, num_classes: num_classes.max(1), size, seed, split }
    }
}

impl Dataset for Synthetic {
    fn len(&self) -> usize {
        self.len
    }

    fn num_classes(&self) -> usize {
        self.num_classes
    }

    fn image_size(&self) -> usize {
        self.size as usize
    }

    fn get(
        &self,
        index: usize,
        _rng: &mut ChaCha8Rng,
        out: &mut [u8],
        t: &mut StageNanos,
    ) -> Result<Sample, DataError> {
        if index >= self.len {
            return Err(DataError::Loader(format!("{} is out of range (len {})", self.describe(index), self.len)));
        }
        let t0 = std::time::Instant::now();
        let mut rng = ChaCha8Rng::seed_from_u64(mix_seed(&[self.seed, self.split as u64, index as u64, 0x5157]));
        rng.fill_bytes(out);
        t.decode += t0.elapsed().as_nanos() as u64;
        Ok(Sample { label: (index % self.num_classes) as u32, flip: false })
    }

    fn describe(&self, index: usize) -> String {
        format!("synthetic {} #{index}", self.split.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::data::test_util::get_one;

    #[test]
    fn deterministic_and_split_dependent() {
        let a = Synthetic::new(10, 4, 8, 7, Split::Train);
        let (x, s) = get_one(&a, 5, 0).unwrap();
        assert_eq!((x.len(), s.label, s.flip), (3 * 64, 1, false));
        assert_eq!(get_one(&a, 5, 1).unwrap().0, x);
        assert_ne!(get_one(&a, 6, 0).unwrap().0, x);
        assert_ne!(get_one(&Synthetic::new(10, 4, 8, 7, Split::Val), 5, 0).unwrap().0, x);
        assert!(get_one(&a, 10, 0).is_err());
    }
}
