//! The GGML block layouts this engine multiplies natively, and their scalar dequantization.
//!
//! These are the reference for every SIMD kernel (the tests compare both with candle's own
//! dequantizer) and the path for single rows (embedding lookups, the GPU upload).
//!
//! | format | elements | bytes | layout |
//! |---|---|---|---|
//! | Q4_0 | 32 | 18 | d f16, 16 B nibbles; w = (q - 8)·d |
//! | Q4_1 | 32 | 20 | d, m f16, 16 B nibbles; w = q·d + m |
//! | Q5_0 | 32 | 22 | d, qh u32, 16 B nibbles; w = (q | h<<4 - 16)·d |
//! | Q5_1 | 32 | 24 | d, m, qh u32, 16 B nibbles; w = (q | h<<4)·d + m |
//! | Q8_0 | 32 | 34 | d, 32 × i8; w = q·d |
//! | Q4_K | 256 | 144 | d, dmin f16, 12 B of 6-bit scales/mins, 128 B nibbles |
//! | Q5_K | 256 | 176 | as Q4_K plus 32 B of fifth bits |
//! | Q6_K | 256 | 210 | 128 B low nibbles, 64 B high 2 bits, 16 × i8 scales, d f16 |

use half::f16;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q8_0,
    Q4K,
    Q5K,
    Q6K,
}

impl Format {
    /// Weights per block.
    pub fn block_elems(self) -> usize {
        if self.is_k() {
            256
        } else {
            32
        }
    }

    pub fn block_bytes(self) -> usize {
        match self {
            Format::Q4_0 => 18,
            Format::Q4_1 => 20,
            Format::Q5_0 => 22,
            Format::Q5_1 => 24,
            Format::Q8_0 => 34,
            Format::Q4K => 144,
            Format::Q5K => 176,
            Format::Q6K => 210,
        }
    }

    /// The 256-element "k-quant" formats, multiplied with 16-bit integer activations.
    pub fn is_k(self) -> bool {
        matches!(self, Format::Q4K | Format::Q5K | Format::Q6K)
    }
}

pub(super) fn f16_at(b: &[u8], i: usize) -> f32 {
    f16::from_le_bytes([b[i], b[i + 1]]).to_f32()
}

/// The eight 6-bit (scale, min) pairs of a Q4_K / Q5_K block, from its 12 packed bytes.
#[inline]
pub(super) fn k4_scales_mins(s: &[u8]) -> ([u8; 8], [u8; 8]) {
    let mut sc = [0u8; 8];
    let mut mn = [0u8; 8];
    for j in 0..4 {
        sc[j] = s[j] & 63;
        mn[j] = s[j + 4] & 63;
        sc[j + 4] = (s[j + 8] & 0xF) | ((s[j] >> 6) << 4);
        mn[j + 4] = (s[j + 8] >> 4) | ((s[j + 4] >> 6) << 4);
    }
    (sc, mn)
}

/// The 4-bit (Q4_K) or 5-bit (Q5_K) quants of a block in element order: 32-byte chunk `c`
/// holds sub-block `2c` in its low nibbles and `2c + 1` in its high ones; Q5_K's fifth bit of
/// element `32 s + l` is bit `s` of `qh[l]`.
pub(super) fn k45_values(format: Format, b: &[u8]) -> [u8; 256] {
    let (qh, qs) = match format {
        Format::Q5K => (Some(&b[16..48]), &b[48..176]),
        _ => (None, &b[16..144]),
    };
    std::array::from_fn(|i| {
        let (sub, l) = (i / 32, i % 32);
        let nib = (qs[32 * (sub / 2) + l] >> (4 * (sub % 2))) & 0xF;
        nib | qh.map_or(0, |h| ((h[l] >> sub) & 1) << 4)
    })
}

/// The 6-bit quants of a Q6_K block in element order, as `q - 32`.
pub(super) fn q6k_values(b: &[u8]) -> [i8; 256] {
    let (ql, qh) = (&b[0..128], &b[128..192]);
    let mut out = [0i8; 256];
    for half in 0..2 {
        let (ql, qh) = (&ql[64 * half..], &qh[32 * half..]);
        let o = &mut out[128 * half..];
        for l in 0..32 {
            let h = qh[l];
            o[l] = ((ql[l] & 0xF) | ((h & 3) << 4)) as i8 - 32;
            o[l + 32] = ((ql[l + 32] & 0xF) | (((h >> 2) & 3) << 4)) as i8 - 32;
            o[l + 64] = ((ql[l] >> 4) | (((h >> 4) & 3) << 4)) as i8 - 32;
            o[l + 96] = ((ql[l + 32] >> 4) | (((h >> 6) & 3) << 4)) as i8 - 32;
        }
    }
    out
}

/// The 5-bit quants (0..32) of a Q5_0 / Q5_1 block from its `qh` word and 16 nibble bytes.
fn q5_values(qh: &[u8], qs: &[u8]) -> [u8; 32] {
    let h = u32::from_le_bytes([qh[0], qh[1], qh[2], qh[3]]);
    std::array::from_fn(|j| {
        let (nib, bit) = match j < 16 {
            true => (qs[j] & 0xF, (h >> j) & 1),
            false => (qs[j - 16] >> 4, (h >> j) & 1),
        };
        nib | (bit as u8) << 4
    })
}

/// Dequantizes one block `b` of `format` into `o` (`block_elems` long).
pub fn dequantize_block(format: Format, b: &[u8], o: &mut [f32]) {
    match format {
        // Each form mirrors GGML's own arithmetic, so the results are bit-identical to it.
        Format::Q4_0 => {
            let d = f16_at(b, 0);
            for (j, &q) in b[2..18].iter().enumerate() {
                o[j] = ((q & 0xF) as i32 - 8) as f32 * d;
                o[j + 16] = ((q >> 4) as i32 - 8) as f32 * d;
            }
        }
        Format::Q4_1 => {
            let (d, m) = (f16_at(b, 0), f16_at(b, 2));
            for (j, &q) in b[4..20].iter().enumerate() {
                o[j] = (q & 0xF) as f32 * d + m;
                o[j + 16] = (q >> 4) as f32 * d + m;
            }
        }
        Format::Q5_0 => {
            let d = f16_at(b, 0);
            for (o, q) in o.iter_mut().zip(q5_values(&b[2..6], &b[6..22])) {
                *o = (q as i32 - 16) as f32 * d;
            }
        }
        Format::Q5_1 => {
            let (d, m) = (f16_at(b, 0), f16_at(b, 2));
            for (o, q) in o.iter_mut().zip(q5_values(&b[4..8], &b[8..24])) {
                *o = q as f32 * d + m;
            }
        }
        Format::Q8_0 => {
            let d = f16_at(b, 0);
            for (o, &q) in o.iter_mut().zip(&b[2..34]) {
                *o = q as i8 as f32 * d;
            }
        }
        Format::Q4K | Format::Q5K => {
            let (d, dmin) = (f16_at(b, 0), f16_at(b, 2));
            let (sc, mn) = k4_scales_mins(&b[4..16]);
            let q = k45_values(format, b);
            for sub in 0..8 {
                let (dl, ml) = (d * sc[sub] as f32, dmin * mn[sub] as f32);
                for l in 32 * sub..32 * sub + 32 {
                    o[l] = dl * q[l] as f32 - ml;
                }
            }
        }
        Format::Q6K => {
            let d = f16_at(b, 208);
            let q = q6k_values(b);
            for (i, (o, q)) in o.iter_mut().zip(q).enumerate() {
                *o = d * (b[192 + i / 16] as i8) as f32 * q as f32;
            }
        }
    }
}
