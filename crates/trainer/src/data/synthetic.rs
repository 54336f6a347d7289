//! "synthetic": pseudo-random noise images, deterministic from (seed, split, index), for throughput runs.

use super::{mix_seed, transforms, DataError, Dataset, Split};
use image::RgbImage;
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

    fn get(&self, index: usize, _rng: &mut ChaCha8Rng) -> Result<(Vec<f32>, u32), DataError> {
        if index >= self.len {
            return Err(DataError::Loader(format!("{} is out of range (len {})", self.describe(index), self.len)));
        }
        let mut rng = ChaCha8Rng::seed_from_u64(mix_seed(&[self.seed, self.split as u64, index as u64, 0x5157]));
        let mut img = RgbImage::new(self.size, self.size);
        rng.fill_bytes(&mut img);
        Ok((transforms::normalize(&img), (index % self.num_classes) as u32))
    }

    fn describe(&self, index: usize) -> String {
        format!("synthetic {} #{index}", self.split.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn deterministic_and_split_dependent() {
        let rng = &mut ChaCha8Rng::seed_from_u64(0);
        let a = Synthetic::new(10, 4, 8, 7, Split::Train);
        let (x, y) = a.get(5, rng).unwrap();
        assert_eq!((x.len(), y), (3 * 64, 1));
        assert_eq!(a.get(5, rng).unwrap().0, x);
        assert_ne!(a.get(6, rng).unwrap().0, x);
        assert_ne!(Synthetic::new(10, 4, 8, 7, Split::Val).get(5, rng).unwrap().0, x);
        assert!(a.get(10, rng).is_err());
    }
}
