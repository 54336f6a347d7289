//! Expensive buffers kept for reuse instead of freed: a [`Lent`] item goes back to its [`Spares`] when dropped.
//!
//! The CUDA input feed stages batches through page-locked host buffers with a device twin (`kernels::input::Slot`).
//! Freeing one waits for the GPU (its events, and `cuMemFreeHost` synchronises the device), and a feed used to free
//! its slots as soon as its loader ran dry: each of an epoch's last steps then waited about a whole step for the
//! GPU (the H100 run of 2026-12-05: ~95 ms on the last two steps of every epoch). Lent slots return here instead,
//! with no wait, and the next epoch's feed (or validation's) takes them again without allocating.

use std::sync::{Arc, Mutex};

/// Items waiting to be lent again.
pub struct Spares<T> {
    items: Mutex<Vec<T>>,
}

impl<T> Default for Spares<T> {
    fn default() -> Self {
        Self { items: Mutex::new(Vec::new()) }
    }
}

impl<T> Spares<T> {
    /// A kept item for which `fits` holds, or a new one from `make`; either way lent, so it comes back on drop.
    pub fn lend<E>(
        self: &Arc<Self>,
        fits: impl Fn(&T) -> bool,
        make: impl FnOnce() -> Result<T, E>,
    ) -> Result<Lent<T>, E> {
        let kept = self.items.lock().ok().and_then(|mut v| {
            let i = v.iter().position(&fits)?;
            Some(v.swap_remove(i))
        });
        let item = match kept {
            Some(t) => t,
            None => make()?,
        };
        Ok(Lent { item: Some(item), home: self.clone() })
    }

    /// How many items are kept (not lent).
    pub fn kept(&self) -> usize {
        self.items.lock().map(|v| v.len()).unwrap_or(0)
    }
}

/// An item of a [`Spares`]; dropping it hands it back.
pub struct Lent<T> {
    item: Option<T>,
    home: Arc<Spares<T>>,
}

impl<T> std::ops::Deref for Lent<T> {
    type Target = T;
    fn deref(&self) -> &T {
        self.item.as_ref().expect("a lent item is present until dropped")
    }
}

impl<T> std::ops::DerefMut for Lent<T> {
    fn deref_mut(&mut self) -> &mut T {
        self.item.as_mut().expect("a lent item is present until dropped")
    }
}

impl<T> Drop for Lent<T> {
    fn drop(&mut self) {
        if let (Some(t), Ok(mut v)) = (self.item.take(), self.home.items.lock()) {
            v.push(t);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    type R = Result<Vec<u8>, String>;

    #[test]
    fn dropped_items_come_back_and_are_lent_again() {
        let spares = Arc::new(Spares::<Vec<u8>>::default());
        let a = spares.lend(|_| true, || R::Ok(vec![0; 16])).unwrap();
        let ptr = a.as_ptr();
        assert_eq!(spares.kept(), 0);
        drop(a);
        assert_eq!(spares.kept(), 1);
        let mut made = false;
        let b = spares
            .lend(
                |v| v.len() >= 8,
                || {
                    made = true;
                    R::Ok(vec![0; 8])
                },
            )
            .unwrap();
        assert!(!made, "a kept item that fits is reused");
        assert_eq!(b.as_ptr(), ptr);
        assert_eq!(spares.kept(), 0);
    }

    #[test]
    fn items_that_do_not_fit_stay_kept_and_errors_pass_through() {
        let spares = Arc::new(Spares::<Vec<u8>>::default());
        drop(spares.lend(|_| true, || R::Ok(vec![0; 4])).unwrap());
        let big = spares.lend(|v| v.len() >= 64, || R::Ok(vec![0; 64])).unwrap();
        assert_eq!(big.len(), 64);
        assert_eq!(spares.kept(), 1, "the small item stays kept");
        let err = spares.lend(|v| v.len() >= 1024, || R::Err("no memory".into())).err();
        assert_eq!(err.as_deref(), Some("no memory"));
        drop(big);
        assert_eq!(spares.kept(), 2);
    }

    #[test]
    fn items_come_back_from_other_threads() {
        let spares = Arc::new(Spares::<Vec<u8>>::default());
        let lent: Vec<_> = (0..3).map(|_| spares.lend(|_| false, || R::Ok(vec![1; 4])).unwrap()).collect();
        std::thread::spawn(move || drop(lent)).join().unwrap();
        assert_eq!(spares.kept(), 3);
    }
}
