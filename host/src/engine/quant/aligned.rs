//! Buffers whose elements start on a 64-byte cache line.
//!
//! The k-quant kernel loads activations 64 bytes at a time, one load per multiply. From a
//! malloc'd buffer (16-byte aligned) every such load straddles two cache lines and costs two:
//! measured here, 3.2 against 5.1 G `vpdpwssd`/s with L1-resident operands. (The f32 kernels,
//! bound by dequantizing, measured the same either way.)

/// One cache line of `N` values of `T` (`N · size_of::<T>() = 64`).
#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct Line<T: Copy, const N: usize>([T; N]);

/// `len` values, the first on a cache-line boundary.
pub(super) struct Aligned<T: Copy, const N: usize> {
    lines: Vec<Line<T, N>>,
    len: usize,
}

impl<T: Copy + Default, const N: usize> Aligned<T, N> {
    const WHOLE_LINE: () = assert!(N * std::mem::size_of::<T>() == 64);

    pub(super) fn zeroed(len: usize) -> Self {
        let () = Self::WHOLE_LINE;
        Self {
            lines: vec![Line([T::default(); N]); len.div_ceil(N)],
            len,
        }
    }

    pub(super) fn as_slice(&self) -> &[T] {
        // SAFETY: a `Line` is exactly N values with no padding (its size, 64, equals its
        // alignment), so the lines are `lines.len() · N ≥ len` contiguous values.
        unsafe { std::slice::from_raw_parts(self.lines.as_ptr().cast(), self.len) }
    }

    pub(super) fn as_mut_slice(&mut self) -> &mut [T] {
        // SAFETY: as in `as_slice`.
        unsafe { std::slice::from_raw_parts_mut(self.lines.as_mut_ptr().cast(), self.len) }
    }
}
