//! Reused f32 buffers for a forward pass's intermediates (norms, projection outputs, the gated
//! activations).
//!
//! A 512-row prefill of Qwen2.5 1.5B allocated about 120 MB of intermediates a layer, each one
//! zeroed by `vec![0.0; n]` on the engine thread while the other compute threads waited: 3.4 GB
//! of `memset` a prompt, 4–5% of the step's samples on two cores. A buffer taken here keeps
//! what it last held, so every user writes each element before it reads one (the kernels
//! write every output: `quant::tests` starts their outputs as NaN to hold them to it).

use std::ops::{Deref, DerefMut};
use std::sync::Mutex;

/// At most this many buffers wait to be reused. A layer has about seven live at once, so a
/// step's pattern reuses every one; more only pile up after an odd step.
const KEEP: usize = 12;

#[derive(Default)]
pub struct Buffers {
    free: Mutex<Vec<Vec<f32>>>,
}

/// A buffer of `len` floats whose contents are whatever they last were; back to its pool when
/// dropped.
pub struct Buf<'a> {
    v: Vec<f32>,
    len: usize,
    home: &'a Buffers,
}

impl Buffers {
    /// The smallest free buffer that holds `len` floats, or else the largest grown to `len`
    /// (its new part zeroed, once), or a new one.
    pub fn take(&self, len: usize) -> Buf<'_> {
        let mut free = self.free.lock().unwrap_or_else(|e| e.into_inner());
        let fits = (0..free.len())
            .filter(|&i| free[i].len() >= len)
            .min_by_key(|&i| free[i].len());
        let pick = fits.or_else(|| (0..free.len()).max_by_key(|&i| free[i].len()));
        let mut v = pick.map(|i| free.swap_remove(i)).unwrap_or_default();
        drop(free);
        if v.len() < len {
            v.resize(len, 0.0);
        }
        Buf { v, len, home: self }
    }

    /// Frees every waiting buffer (an idle engine need not hold a prefill's worth of them).
    pub fn release(&self) {
        self.free.lock().unwrap_or_else(|e| e.into_inner()).clear();
    }
}

impl Deref for Buf<'_> {
    type Target = [f32];
    fn deref(&self) -> &[f32] {
        &self.v[..self.len]
    }
}

impl DerefMut for Buf<'_> {
    fn deref_mut(&mut self) -> &mut [f32] {
        &mut self.v[..self.len]
    }
}

impl Drop for Buf<'_> {
    fn drop(&mut self) {
        let mut free = self.home.free.lock().unwrap_or_else(|e| e.into_inner());
        if free.len() < KEEP {
            free.push(std::mem::take(&mut self.v));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buffers_come_back_whole_and_the_best_fit_is_reused() {
        let pool = Buffers::default();
        let (mut a, mut b) = (pool.take(100), pool.take(10));
        a.fill(1.0);
        b.fill(2.0);
        let (pa, pb) = (a.as_ptr(), b.as_ptr());
        drop((a, b));
        // 8 fits both: the smaller is taken. 50 fits only the larger, whose old contents
        // are kept (nothing is zeroed on reuse).
        let c = pool.take(8);
        assert_eq!((c.as_ptr(), c.len()), (pb, 8));
        let d = pool.take(50);
        assert_eq!((d.as_ptr(), &d[..3]), (pa, &[1.0; 3][..]));
        // Nothing free fits 200: a new buffer, its growth zeroed.
        let e = pool.take(200);
        assert!(e.iter().all(|&x| x == 0.0));
        drop((c, d, e));
        pool.release();
        assert!(pool.free.lock().unwrap().is_empty());
    }
}
