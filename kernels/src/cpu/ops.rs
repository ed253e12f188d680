//! Element-wise and attention ops of the CPU backend.
//!
//! Rules this module keeps (the same as the matmul's):
//! - The operations producing one token's results do not depend on the other tokens in
//!   the batch or on how a prompt was chunked, so batching never changes the output.
//! - Reductions use 16 lanes and a fixed tree, written in plain Rust that the compiler
//!   vectorises inside `#[target_feature]` wrappers; the result does not depend on the
//!   vector width.

use half::f16;

/// Sum of `a[i] * b[i]` in 16 lanes, reduced by a fixed tree.
#[inline(always)]
pub fn dot16(a: &[f32], b: &[f32]) -> f32 {
    debug_assert_eq!(a.len(), b.len());
    let mut acc = [0f32; 16];
    let (ca, cb) = (a.chunks_exact(16), b.chunks_exact(16));
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for l in 0..16 {
            acc[l] = x[l].mul_add(y[l], acc[l]);
        }
    }
    for (l, (x, y)) in ra.iter().zip(rb).enumerate() {
        acc[l] = x.mul_add(*y, acc[l]);
    }
    reduce16(acc)
}

#[inline(always)]
pub fn reduce16(mut acc: [f32; 16]) -> f32 {
    let mut w = 8;
    while w > 0 {
        for l in 0..w {
            acc[l] += acc[l + w];
        }
        w /= 2;
    }
    acc[0]
}

/// `out = x / sqrt(mean(x²) + eps) * w`, row by row.
#[inline(always)]
pub fn rms_norm_rows(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let dim = w.len();
    for (xr, or) in x.chunks_exact(dim).zip(out.chunks_exact_mut(dim)) {
        let ss = dot16(xr, xr);
        let scale = 1.0 / (ss / dim as f32 + eps).sqrt();
        for ((o, xv), wv) in or.iter_mut().zip(xr).zip(w) {
            *o = (xv * scale) * wv;
        }
    }
}

/// `out = silu(g) * u` where each row of `gu` is `[g (ff) | u (ff)]`.
#[inline(always)]
pub fn silu_mul_rows(gu: &[f32], ff: usize, out: &mut [f32]) {
    for (row, or) in gu.chunks_exact(2 * ff).zip(out.chunks_exact_mut(ff)) {
        let (g, u) = row.split_at(ff);
        for ((o, gv), uv) in or.iter_mut().zip(g).zip(u) {
            *o = gv / (1.0 + exp_f32(-gv)) * uv;
        }
    }
}

/// `e^x` for f32, branch-free so that it vectorises, within 2 ulp of the true value
/// over the range where the result is a normal number; 0 below, +inf above.
///
/// Cody–Waite range reduction `x = n·ln2 + r`, then a degree-6 polynomial for `e^r`
/// on `|r| ≤ ln2/2`, scaled by `2^n` through the exponent bits.
#[inline(always)]
pub fn exp_f32(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_145_75;
    const LN2_LO: f32 = 1.428_606_8e-6;
    // 1.5 · 2^23: adding it rounds |v| < 2^22 to an integer (ties to even) held in the low
    // bits of the sum, so `n` comes as a float and as bits without a float-to-int
    // conversion (Rust's saturating `as i32` kept this function from vectorizing).
    const ROUND: f32 = 12_582_912.0;
    let x = x.clamp(-87.5, 88.5);
    let t = x * LOG2E + ROUND;
    let n = t - ROUND;
    let r = n.mul_add(-LN2_LO, n.mul_add(-LN2_HI, x));
    // Taylor coefficients 1/k! (k = 6..2); good to ~1e-7 relative on |r| ≤ 0.347.
    let mut p = 1.0 / 720.0f32;
    p = p.mul_add(r, 1.0 / 120.0);
    p = p.mul_add(r, 1.0 / 24.0);
    p = p.mul_add(r, 1.0 / 6.0);
    p = p.mul_add(r, 0.5);
    p = p.mul_add(r, 1.0);
    p = p.mul_add(r, 1.0);
    // 2^n for n in [-127, 128): split in two factors so neither overflows.
    let ni = t.to_bits() as i32 - ROUND.to_bits() as i32;
    let n1 = ni / 2;
    let n2 = ni - n1;
    let s1 = f32::from_bits(((n1 + 127) as u32) << 23);
    let s2 = f32::from_bits(((n2 + 127) as u32) << 23);
    p * s1 * s2
}

/// Rotary position embedding of one head vector, in place.
/// `interleaved`: pairs are (2i, 2i+1) (GGUF's llama layout); otherwise (i, i + d/2)
/// (Hugging Face's layout).
#[inline(always)]
pub fn rope_head(x: &mut [f32], cos: &[f32], sin: &[f32], interleaved: bool) {
    let half = x.len() / 2;
    for i in 0..half {
        let (a, b) = if interleaved { (2 * i, 2 * i + 1) } else { (i, i + half) };
        let (x0, x1) = (x[a], x[b]);
        x[a] = x0 * cos[i] - x1 * sin[i];
        x[b] = x0 * sin[i] + x1 * cos[i];
    }
}

/// The element type of the KV cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KvDtype {
    F16,
    F32,
    /// FP8 E4M3 ("e4m3fn": no infinities, ±448 at most), unscaled (vLLM's
    /// `--kv-cache-dtype fp8` with k/v scales of 1): stored from f32 by rounding to
    /// nearest even and saturating to ±448, as the GPU's `cvt.rn.satfinite.e4m3x2.f32`
    /// does. Half the bytes of f16 per key and value.
    Fp8,
}

impl KvDtype {
    pub fn bytes(self) -> usize {
        match self {
            KvDtype::F16 => 2,
            KvDtype::F32 => 4,
            KvDtype::Fp8 => 1,
        }
    }

    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "f16" | "fp16" | "float16" => Some(Self::F16),
            "f32" | "fp32" | "float32" => Some(Self::F32),
            "fp8" | "fp8_e4m3" | "e4m3" => Some(Self::Fp8),
            _ => None,
        }
    }

    /// The type that a layout of `bytes` per element names (the KV-transfer layout
    /// carries the element size only; its one-byte type is FP8 E4M3).
    pub fn from_bytes(bytes: u32) -> Option<Self> {
        match bytes {
            1 => Some(Self::Fp8),
            2 => Some(Self::F16),
            4 => Some(Self::F32),
            _ => None,
        }
    }
}

/// FP8 E4M3 bits to f32 (exact): sign, 4 exponent bits (bias 7), 3 mantissa bits;
/// exponent 0 is subnormal (m · 2⁻⁹), and 0x7f / 0xff are NaN.
#[inline]
pub fn e4m3_to_f32(b: u8) -> f32 {
    let sign = if b & 0x80 != 0 { -1.0 } else { 1.0 };
    let (e, m) = ((b >> 3) & 0xf, b & 7);
    if e == 0xf && m == 7 {
        return f32::NAN;
    }
    let mag = if e == 0 { m as f32 / 512.0 } else { (8 + m) as f32 * f32::powi(2.0, e as i32 - 10) };
    sign * mag
}

/// f32 to FP8 E4M3 bits: round to nearest, ties to even; magnitudes past 448 (infinity
/// included) saturate to ±448; NaN stays NaN.
#[inline]
pub fn f32_to_e4m3(x: f32) -> u8 {
    let sign = if x.is_sign_negative() { 0x80u8 } else { 0 };
    let a = x.abs();
    if a.is_nan() {
        return sign | 0x7f;
    }
    if a >= 448.0 {
        return sign | 0x7e;
    }
    if a < 1.0 / 64.0 {
        // Subnormal steps of 2⁻⁹ (exact scaling); 8 steps is the smallest normal, 0x08.
        return sign | (a * 512.0).round_ties_even() as u8;
    }
    // Normal: keep 3 of f32's 23 mantissa bits, rounding the 20 dropped ones to even; a
    // carry moves into the exponent, as the bit pattern adds.
    let bits = a.to_bits();
    let r = bits + 0x7ffff + ((bits >> 20) & 1);
    let q = (r >> 20) - ((127 - 7) << 3);
    sign | (q.min(0x7e) as u8)
}

fn has_f16c() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        static F16C: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        *F16C.get_or_init(|| is_x86_feature_detected!("avx2") && is_x86_feature_detected!("f16c"))
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// Converts stored KV elements to f32 (exactly).
#[inline]
pub fn kv_to_f32(dtype: KvDtype, src: &[u8], out: &mut [f32]) {
    match dtype {
        KvDtype::F16 => {
            assert!(src.len() >= out.len() * 2);
            #[cfg(target_arch = "x86_64")]
            if has_f16c() {
                // SAFETY: the CPU has F16C/AVX2 (checked); bounds asserted above.
                unsafe { f16_to_f32_f16c(src.as_ptr(), out) };
                return;
            }
            for (o, c) in out.iter_mut().zip(src.chunks_exact(2)) {
                *o = f16::from_le_bytes([c[0], c[1]]).to_f32();
            }
        }
        KvDtype::F32 => {
            for (o, c) in out.iter_mut().zip(src.chunks_exact(4)) {
                *o = f32::from_ne_bytes([c[0], c[1], c[2], c[3]]);
            }
        }
        KvDtype::Fp8 => {
            let lut = e4m3_table();
            for (o, &c) in out.iter_mut().zip(src) {
                *o = lut[c as usize];
            }
        }
    }
}

/// All 256 FP8 E4M3 values as f32, made once.
fn e4m3_table() -> &'static [f32; 256] {
    static LUT: std::sync::OnceLock<[f32; 256]> = std::sync::OnceLock::new();
    LUT.get_or_init(|| std::array::from_fn(|i| e4m3_to_f32(i as u8)))
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,f16c")]
unsafe fn f16_to_f32_f16c(src: *const u8, out: &mut [f32]) {
    use std::arch::x86_64::*;
    let n = out.len();
    let mut i = 0;
    while i + 8 <= n {
        let h = _mm_loadu_si128(src.add(i * 2) as *const __m128i);
        _mm256_storeu_ps(out.as_mut_ptr().add(i), _mm256_cvtph_ps(h));
        i += 8;
    }
    while i < n {
        out[i] = f16::from_bits(u16::from_le_bytes([*src.add(2 * i), *src.add(2 * i + 1)])).to_f32();
        i += 1;
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,f16c")]
unsafe fn f32_to_f16_f16c(src: &[f32], dst: *mut u8) {
    use std::arch::x86_64::*;
    let n = src.len();
    let mut i = 0;
    while i + 8 <= n {
        let h = _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(_mm256_loadu_ps(src.as_ptr().add(i)));
        _mm_storeu_si128(dst.add(i * 2) as *mut __m128i, h);
        i += 8;
    }
    while i < n {
        let b = f16::from_f32(src[i]).to_le_bytes();
        *dst.add(2 * i) = b[0];
        *dst.add(2 * i + 1) = b[1];
        i += 1;
    }
}

/// Stores f32 values as KV elements (f16: round to nearest even, as F16C does).
#[inline]
pub fn f32_to_kv(dtype: KvDtype, src: &[f32], dst: &mut [u8]) {
    match dtype {
        KvDtype::F16 => {
            assert!(dst.len() >= src.len() * 2);
            #[cfg(target_arch = "x86_64")]
            if has_f16c() {
                // SAFETY: the CPU has F16C/AVX2 (checked); bounds asserted above.
                unsafe { f32_to_f16_f16c(src, dst.as_mut_ptr()) };
                return;
            }
            for (c, v) in dst.chunks_exact_mut(2).zip(src) {
                c.copy_from_slice(&f16::from_f32(*v).to_le_bytes());
            }
        }
        KvDtype::F32 => {
            for (c, v) in dst.chunks_exact_mut(4).zip(src) {
                c.copy_from_slice(&v.to_ne_bytes());
            }
        }
        KvDtype::Fp8 => {
            for (c, v) in dst.iter_mut().zip(src) {
                *c = f32_to_e4m3(*v);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exp_is_close_to_std() {
        let mut worst = 0f64;
        let mut x = -87.0f32;
        while x < 88.0 {
            let got = exp_f32(x) as f64;
            let want = (x as f64).exp();
            worst = worst.max(((got - want) / want).abs());
            x += 0.0137;
        }
        assert!(worst < 3e-7, "worst relative error {worst}");
        assert_eq!(exp_f32(-200.0), exp_f32(-87.5));
        assert!(exp_f32(-200.0) < 1e-37);
        assert_eq!(exp_f32(0.0), 1.0);
    }

    #[test]
    fn f16_conversions_match_the_software_reference() {
        // Normal, subnormal, overflowing, tie and special values, 8 at a time and a tail.
        let mut vals: Vec<f32> =
            vec![0.0, -0.0, 1.0, -2.5, 65504.0, 65520.0, 1e6, -1e6, 6e-8, 3e-8, 1e-5, 2049.0, 2051.0];
        vals.extend((0..1000).map(|i| ((i as f32) * 0.7311).sin() * 10f32.powi(i % 9 - 4)));
        vals.push(f32::INFINITY);
        let mut bytes = vec![0u8; vals.len() * 2];
        f32_to_kv(KvDtype::F16, &vals, &mut bytes);
        for (v, c) in vals.iter().zip(bytes.chunks_exact(2)) {
            assert_eq!(c, f16::from_f32(*v).to_le_bytes(), "{v}");
        }
        let mut back = vec![0f32; vals.len()];
        kv_to_f32(KvDtype::F16, &bytes, &mut back);
        for (b, c) in back.iter().zip(bytes.chunks_exact(2)) {
            assert_eq!(b.to_bits(), f16::from_le_bytes([c[0], c[1]]).to_f32().to_bits());
        }
    }

    #[test]
    fn e4m3_rounds_to_the_nearest_value_ties_to_even() {
        // Every finite E4M3 value, ascending (magnitudes 0x00..=0x7e, both signs).
        let decoded: Vec<f32> = (0u8..=0x7e).map(e4m3_to_f32).collect();
        assert_eq!(decoded[0x08], 1.0 / 64.0);
        assert_eq!(decoded[0x01], 1.0 / 512.0);
        assert_eq!(decoded[0x38], 1.0);
        assert_eq!(decoded[0x7e], 448.0);
        assert!(decoded.windows(2).all(|w| w[0] < w[1]), "monotonic");
        assert!(e4m3_to_f32(0x7f).is_nan() && e4m3_to_f32(0xff).is_nan());
        for b in 0u8..=0x7e {
            assert_eq!(f32_to_e4m3(decoded[b as usize]), b, "round trip of {}", decoded[b as usize]);
            assert_eq!(f32_to_e4m3(-decoded[b as usize]), b | 0x80);
        }
        // Midpoints tie to the even code; a hair either side goes to the nearer value.
        for b in 0u8..0x7e {
            let (lo, hi) = (decoded[b as usize], decoded[b as usize + 1]);
            let mid = (lo + hi) / 2.0;
            let even = if b % 2 == 0 { b } else { b + 1 };
            assert_eq!(f32_to_e4m3(mid), even, "tie between {lo} and {hi}");
            let below = f32::from_bits(mid.to_bits() - 1);
            let above = f32::from_bits(mid.to_bits() + 1);
            assert_eq!(f32_to_e4m3(below), b, "{below}");
            assert_eq!(f32_to_e4m3(above), b + 1, "{above}");
        }
        // Saturation and specials.
        assert_eq!(f32_to_e4m3(464.0), 0x7e);
        assert_eq!(f32_to_e4m3(1e9), 0x7e);
        assert_eq!(f32_to_e4m3(f32::INFINITY), 0x7e);
        assert_eq!(f32_to_e4m3(f32::NEG_INFINITY), 0xfe);
        assert_eq!(f32_to_e4m3(f32::NAN) & 0x7f, 0x7f);
        assert_eq!(f32_to_e4m3(1.0 / 1024.0), 0x00, "half the smallest subnormal ties to 0");
        assert_eq!(f32_to_e4m3(-0.0), 0x80);
        // Through the cache's conversions, against the nearest value by search.
        let vals: Vec<f32> = (0..5000).map(|i| ((i as f32) * 0.3711).sin() * 10f32.powi(i % 7 - 3)).collect();
        let mut bytes = vec![0u8; vals.len()];
        f32_to_kv(KvDtype::Fp8, &vals, &mut bytes);
        let mut back = vec![0f32; vals.len()];
        kv_to_f32(KvDtype::Fp8, &bytes, &mut back);
        for (v, b) in vals.iter().zip(&back) {
            let best = decoded.iter().map(|d| (d - v.abs()).abs()).fold(f32::INFINITY, f32::min);
            assert_eq!((b.abs() - v.abs()).abs(), best, "{v} stored as {b}");
            assert!(b.is_sign_negative() == v.is_sign_negative() || *b == 0.0);
        }
    }

    #[test]
    fn rope_rotates_pairs() {
        let mut x = vec![1.0, 0.0, 0.0, 1.0];
        rope_head(&mut x, &[0.0, 1.0], &[1.0, 0.0], true);
        assert_eq!(x, vec![0.0, 1.0, 0.0, 1.0]);
        let mut y = vec![1.0, 0.0, 0.0, 1.0];
        rope_head(&mut y, &[0.0, 1.0], &[1.0, 0.0], false);
        // pairs (0,2) and (1,3): (1,0) rotated by 90° -> (0,1); (0,1) by 0° stays.
        assert_eq!(y, vec![0.0, 0.0, 1.0, 1.0]);
    }
}
