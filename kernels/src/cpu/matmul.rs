//! Matrix products `out[t] (+)= W · x[t]` for packed weights on the CPU.
//!
//! Two modes (see [`crate::env::CPU_MATMUL`]):
//! - `Q8` (default for quantized weights): each activation row is quantized once to
//!   blocks of 32 signed bytes with an f32 scale (like llama.cpp's Q8_1), and the kernels
//!   take integer dot products of weight and activation blocks (`vpdpbusd` on AVX-512
//!   VNNI, `pmaddubsw` on AVX2), scaling each block's sum in f32.
//! - `F32`: weights are dequantized block by block and multiplied with f32 activations.
//!   Float weights (F32/F16/BF16) always use this mode.
//!
//! Rules this module keeps:
//! - Batch invariance: the floating-point operations that produce `out[t][r]` are the
//!   same, in the same order, whatever the number of tokens in the call and wherever
//!   token `t` sits in it. So batched decoding and chunked prefill give bit-identical
//!   results to one token at a time.
//! - ISA invariance: the scalar, AVX2 and AVX-512 kernels give bit-identical results.
//! - Per output block: `acc = fma(float(isum), d_w * d_x, acc)` and, for Q4_1,
//!   `acc = fma(m_w, d_x * sum(q_x), acc)`; `isum` is the exact integer dot product.

use super::packed::{PackedKind, PackedMatrix, TILE_ROWS};
use super::pool::ThreadPool;
use super::Isa;
use crate::quant::QK;

/// How quantized weights meet activations. Float weights always use `F32`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MatmulMode {
    Q8,
    F32,
}

impl MatmulMode {
    pub fn from_env() -> MatmulMode {
        match std::env::var(crate::env::CPU_MATMUL).ok().as_deref() {
            Some("f32") => MatmulMode::F32,
            _ => MatmulMode::Q8,
        }
    }

    /// The mode actually used for a matrix of kind `kind`.
    pub fn for_kind(self, kind: PackedKind) -> MatmulMode {
        if kind.is_quantized() {
            self
        } else {
            MatmulMode::F32
        }
    }
}

/// Activations quantized to 8-bit blocks of 32, row by row.
#[derive(Default)]
pub struct Q8Acts {
    pub n_tokens: usize,
    pub nb: usize,
    /// `n_tokens × nb × 32` signed bytes.
    pub qs: Vec<i8>,
    /// Scale per block.
    pub d: Vec<f32>,
    /// Sum of the block's quantized values.
    pub sumq: Vec<i32>,
    /// `d * sumq` (the term Q4_1's minimum multiplies).
    pub s: Vec<f32>,
}

impl Q8Acts {
    /// Quantizes `n_tokens` rows of `cols` values each (`x` row-major).
    pub fn quantize(&mut self, pool: &ThreadPool, isa: Isa, x: &[f32], n_tokens: usize, cols: usize) {
        assert!(cols.is_multiple_of(QK) && x.len() >= n_tokens * cols);
        let nb = cols / QK;
        self.n_tokens = n_tokens;
        self.nb = nb;
        let n_blocks = n_tokens * nb;
        self.qs.resize(n_blocks * QK, 0);
        self.d.resize(n_blocks, 0.0);
        self.sumq.resize(n_blocks, 0);
        self.s.resize(n_blocks, 0.0);
        let qs = SendPtr(self.qs.as_mut_ptr());
        let d = SendPtr(self.d.as_mut_ptr());
        let sumq = SendPtr(self.sumq.as_mut_ptr());
        let s = SendPtr(self.s.as_mut_ptr());
        let rows_per_task = (4096 / cols).max(1);
        let n_tasks = n_tokens.div_ceil(rows_per_task);
        pool.run(n_tasks, |task, _| {
            let (r0, r1) = (task * rows_per_task, ((task + 1) * rows_per_task).min(n_tokens));
            let (b0, b1) = (r0 * nb, r1 * nb);
            // SAFETY: tasks cover disjoint row ranges of the four arrays, each sized above.
            let (qs, d, sumq, s) = unsafe {
                (
                    std::slice::from_raw_parts_mut(qs.get().add(b0 * QK), (b1 - b0) * QK),
                    std::slice::from_raw_parts_mut(d.get().add(b0), b1 - b0),
                    std::slice::from_raw_parts_mut(sumq.get().add(b0), b1 - b0),
                    std::slice::from_raw_parts_mut(s.get().add(b0), b1 - b0),
                )
            };
            quantize_blocks(isa, &x[r0 * cols..r1 * cols], qs, d, sumq, s);
        });
    }
}

fn quantize_blocks(isa: Isa, x: &[f32], qs: &mut [i8], d: &mut [f32], sumq: &mut [i32], s: &mut [f32]) {
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `isa` is only Avx2/Avx512 when the CPU supports AVX2.
        Isa::Avx2 | Isa::Avx512 => unsafe { quantize_blocks_avx2(x, qs, d, sumq, s) },
        _ => quantize_blocks_generic(x, qs, d, sumq, s),
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn quantize_blocks_avx2(x: &[f32], qs: &mut [i8], d: &mut [f32], sumq: &mut [i32], s: &mut [f32]) {
    use std::arch::x86_64::*;
    let abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fff_ffff));
    // packs_epi32/packs_epi16 interleave 128-bit lanes; this puts the bytes back in order.
    let unshuffle = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (b, xb) in x.chunks_exact(QK).enumerate() {
        let p = xb.as_ptr();
        let v = [_mm256_loadu_ps(p), _mm256_loadu_ps(p.add(8)), _mm256_loadu_ps(p.add(16)), _mm256_loadu_ps(p.add(24))];
        let a01 = _mm256_max_ps(_mm256_and_ps(v[0], abs_mask), _mm256_and_ps(v[1], abs_mask));
        let a23 = _mm256_max_ps(_mm256_and_ps(v[2], abs_mask), _mm256_and_ps(v[3], abs_mask));
        let m8 = _mm256_max_ps(a01, a23);
        let m4 = _mm_max_ps(_mm256_castps256_ps128(m8), _mm256_extractf128_ps::<1>(m8));
        let m2 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        let m1 = _mm_max_ss(m2, _mm_shuffle_ps::<1>(m2, m2));
        let amax = _mm_cvtss_f32(m1);
        // The same scalar arithmetic as the generic version, so results are identical.
        let db = amax / 127.0;
        let id = if db != 0.0 { 1.0 / db } else { 0.0 };
        let idv = _mm256_set1_ps(id);
        let q: [__m256i; 4] = std::array::from_fn(|i| {
            _mm256_cvtps_epi32(_mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(_mm256_mul_ps(
                v[i], idv,
            )))
        });
        let sum8 = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
        let sum4 = _mm_add_epi32(_mm256_castsi256_si128(sum8), _mm256_extracti128_si256::<1>(sum8));
        let sum2 = _mm_add_epi32(sum4, _mm_shuffle_epi32::<0b01_00_11_10>(sum4));
        let sum1 = _mm_add_epi32(sum2, _mm_shuffle_epi32::<0b10_11_00_01>(sum2));
        let sum = _mm_cvtsi128_si32(sum1);
        let packed = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
        let ordered = _mm256_permutevar8x32_epi32(packed, unshuffle);
        _mm256_storeu_si256(qs.as_mut_ptr().add(b * QK) as *mut __m256i, ordered);
        d[b] = db;
        sumq[b] = sum;
        s[b] = db * sum as f32;
    }
}

/// One block: `d = max|x| / 127`, `q = round_half_even(x / d)` (as `x * (1/d)`).
#[inline(always)]
fn quantize_blocks_generic(x: &[f32], qs: &mut [i8], d: &mut [f32], sumq: &mut [i32], s: &mut [f32]) {
    for (b, xb) in x.chunks_exact(QK).enumerate() {
        let mut amax = 0f32;
        for v in xb {
            amax = amax.max(v.abs());
        }
        let db = amax / 127.0;
        let id = if db != 0.0 { 1.0 / db } else { 0.0 };
        let qb = &mut qs[b * QK..(b + 1) * QK];
        let mut sum = 0i32;
        for (q, v) in qb.iter_mut().zip(xb) {
            let r = (v * id).round_ties_even() as i32;
            *q = r as i8;
            sum += r;
        }
        d[b] = db;
        sumq[b] = sum;
        s[b] = db * sum as f32;
    }
}

/// Blocks ahead the AVX-512 kernel prefetches weights (`DISAGG_CPU_PREFETCH`, 0 = off).
fn prefetch_distance() -> usize {
    static PF: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *PF.get_or_init(|| std::env::var(crate::env::CPU_PREFETCH).ok().and_then(|v| v.parse().ok()).unwrap_or(8))
}

/// A raw pointer that tasks of one `run` share; each writes a disjoint part.
#[derive(Clone, Copy)]
pub(crate) struct SendPtr<T>(pub(crate) *mut T);
// SAFETY: used only for disjoint writes from tasks of one `ThreadPool::run`.
unsafe impl<T> Send for SendPtr<T> {}
unsafe impl<T> Sync for SendPtr<T> {}
impl<T> SendPtr<T> {
    #[inline(always)]
    pub(crate) fn get(self) -> *mut T {
        self.0
    }
}

/// Where a matmul writes: `out[t * ld + col0 + r]` for output row `r` of token `t`,
/// added to what is there when `accumulate` (a fused residual add).
pub struct OutSpec<'a> {
    pub out: &'a mut [f32],
    pub ld: usize,
    pub col0: usize,
    pub accumulate: bool,
}

/// The input of a matmul: f32 rows, and their 8-bit quantization when the mode needs it.
pub struct Input<'a> {
    pub x: &'a [f32],
    pub q8: Option<&'a Q8Acts>,
    pub n_tokens: usize,
}

/// `out[t][r] (+)= Σ_k W[r][k] · x[t][k]` for all tokens and rows, on the pool.
pub fn matmul(pool: &ThreadPool, isa: Isa, mode: MatmulMode, w: &PackedMatrix, input: &Input, out: OutSpec) {
    let n_tokens = input.n_tokens;
    assert!(input.x.len() >= n_tokens * w.cols);
    assert!(n_tokens == 0 || out.out.len() >= (n_tokens - 1) * out.ld + out.col0 + w.rows);
    let mode = mode.for_kind(w.kind);
    if mode == MatmulMode::Q8 {
        let q8 = input.q8.expect("Q8 mode needs quantized activations");
        assert!(q8.n_tokens >= n_tokens && q8.nb == w.nb);
    }
    // Enough tasks per thread that dynamic hand-out evens out uneven cores; a tile is
    // at least ~0.3 µs of work, far above the cost of handing it out.
    let n_threads = pool.n_threads();
    let tiles_per_task = if n_threads == 1 { w.n_tiles } else { w.n_tiles.div_ceil(n_threads * 4).max(1) };
    let n_tasks = w.n_tiles.div_ceil(tiles_per_task);
    let ptr = SendPtr(out.out.as_mut_ptr());
    let (ld, col0, accumulate) = (out.ld, out.col0, out.accumulate);
    pool.run(n_tasks, |task, _| {
        let tile0 = task * tiles_per_task;
        let tile1 = (tile0 + tiles_per_task).min(w.n_tiles);
        for tile in tile0..tile1 {
            let valid = (w.rows - tile * TILE_ROWS).min(TILE_ROWS);
            let o = TileOut { ptr: ptr.get(), ld, col: col0 + tile * TILE_ROWS, accumulate, valid };
            match mode {
                MatmulMode::Q8 => q_tile(isa, w, tile, input.q8.unwrap(), n_tokens, &o),
                MatmulMode::F32 => f_tile(isa, w, tile, input.x, n_tokens, &o),
            }
        }
    });
}

/// Where one tile's results go.
pub(crate) struct TileOut {
    ptr: *mut f32,
    ld: usize,
    col: usize,
    accumulate: bool,
    valid: usize,
}

impl TileOut {
    /// Stores 16 accumulators of token `t`.
    #[inline(always)]
    unsafe fn store(&self, t: usize, acc: &[f32; TILE_ROWS]) {
        let o = self.ptr.add(t * self.ld + self.col);
        for (r, a) in acc.iter().enumerate().take(self.valid) {
            let p = o.add(r);
            *p = if self.accumulate { *p + *a } else { *a };
        }
    }
}

const K_Q4MIN: u8 = 0;
const K_Q4OFF8: u8 = 1;
const K_Q8OFF128: u8 = 2;

fn q_tile(isa: Isa, w: &PackedMatrix, tile: usize, xq: &Q8Acts, n_tokens: usize, o: &TileOut) {
    let mut t = 0;
    while t < n_tokens {
        let nt = match n_tokens - t {
            n if n >= 8 => 8,
            n if n >= 4 => 4,
            n if n >= 2 => 2,
            _ => 1,
        };
        macro_rules! go {
            ($f:ident) => {
                match (w.kind, nt) {
                    (PackedKind::Q4Min, 8) => $f::<K_Q4MIN, 8>(w, tile, xq, t, o),
                    (PackedKind::Q4Min, 4) => $f::<K_Q4MIN, 4>(w, tile, xq, t, o),
                    (PackedKind::Q4Min, 2) => $f::<K_Q4MIN, 2>(w, tile, xq, t, o),
                    (PackedKind::Q4Min, _) => $f::<K_Q4MIN, 1>(w, tile, xq, t, o),
                    (PackedKind::Q4Off8, 8) => $f::<K_Q4OFF8, 8>(w, tile, xq, t, o),
                    (PackedKind::Q4Off8, 4) => $f::<K_Q4OFF8, 4>(w, tile, xq, t, o),
                    (PackedKind::Q4Off8, 2) => $f::<K_Q4OFF8, 2>(w, tile, xq, t, o),
                    (PackedKind::Q4Off8, _) => $f::<K_Q4OFF8, 1>(w, tile, xq, t, o),
                    (PackedKind::Q8Off128, 8) => $f::<K_Q8OFF128, 8>(w, tile, xq, t, o),
                    (PackedKind::Q8Off128, 4) => $f::<K_Q8OFF128, 4>(w, tile, xq, t, o),
                    (PackedKind::Q8Off128, 2) => $f::<K_Q8OFF128, 2>(w, tile, xq, t, o),
                    (PackedKind::Q8Off128, _) => $f::<K_Q8OFF128, 1>(w, tile, xq, t, o),
                    _ => unreachable!("q_tile on a float matrix"),
                }
            };
        }
        // SAFETY: the SIMD variants run only when `isa` says the CPU has the features;
        // all pointers stay inside the tile, `xq` (checked sizes) and `o` (checked in
        // `matmul`).
        unsafe {
            match isa {
                #[cfg(target_arch = "x86_64")]
                Isa::Avx512 => go!(q_tile_avx512),
                #[cfg(target_arch = "x86_64")]
                Isa::Avx2 => go!(q_tile_avx2),
                _ => go!(q_tile_scalar),
            }
        }
        t += nt;
    }
}

/// The reference: plain loops over the packed layout.
unsafe fn q_tile_scalar<const KIND: u8, const NT: usize>(
    w: &PackedMatrix,
    tile: usize,
    xq: &Q8Acts,
    t0: usize,
    o: &TileOut,
) {
    let tb = w.tile(tile);
    let nb = w.nb;
    let mut acc = [[0f32; TILE_ROWS]; NT];
    for b in 0..nb {
        let (qs, doff, moff) = w.offsets(b);
        for (t, acc) in acc.iter_mut().enumerate() {
            let xi = (t0 + t) * nb + b;
            let x = &xq.qs[xi * QK..(xi + 1) * QK];
            for (lane, a) in acc.iter_mut().enumerate() {
                let mut isum = 0i32;
                for g in 0..8 {
                    for i in 0..4 {
                        let q = match KIND {
                            K_Q8OFF128 => tb[qs + g * 64 + lane * 4 + i] as i32,
                            _ => {
                                let byte = tb[qs + (g % 4) * 64 + lane * 4 + i];
                                if g < 4 {
                                    (byte & 0x0f) as i32
                                } else {
                                    (byte >> 4) as i32
                                }
                            }
                        };
                        isum += q * x[g * 4 + i] as i32;
                    }
                }
                match KIND {
                    K_Q4OFF8 => isum -= xq.sumq[xi] << 3,
                    K_Q8OFF128 => isum -= xq.sumq[xi] << 7,
                    _ => {}
                }
                let d = crate::quant::f16_at(tb, doff + lane * 2);
                let scale = d * xq.d[xi];
                *a = (isum as f32).mul_add(scale, *a);
                if KIND == K_Q4MIN {
                    let m = crate::quant::f16_at(tb, moff + lane * 2);
                    *a = m.mul_add(xq.s[xi], *a);
                }
            }
        }
    }
    for (t, a) in acc.iter().enumerate() {
        o.store(t0 + t, a);
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,fma,f16c")]
unsafe fn q_tile_avx512<const KIND: u8, const NT: usize>(
    w: &PackedMatrix,
    tile: usize,
    xq: &Q8Acts,
    t0: usize,
    o: &TileOut,
) {
    use std::arch::x86_64::*;
    let tb = w.tile(tile).as_ptr();
    let nb = w.nb;
    let mask = _mm512_set1_epi8(0x0f);
    // Eight slots whatever NT is; the unused ones are optimised away.
    let mut acc = [_mm512_setzero_ps(); 8];
    let xqs = xq.qs.as_ptr() as *const u8;
    let pf = prefetch_distance();
    for b in 0..nb {
        let (qs, doff, moff) = w.offsets(b);
        let q = tb.add(qs);
        if pf > 0 {
            // Stay ahead of the stream: the qs lines of a later block (possibly in the
            // next tile, which follows this one in memory) and its scale lines.
            let qsb = if KIND == K_Q8OFF128 { 512 } else { 256 };
            let ahead = q.wrapping_add(pf * qsb);
            for l in 0..qsb / 64 {
                _mm_prefetch::<_MM_HINT_T0>(ahead.wrapping_add(l * 64) as *const i8);
            }
            _mm_prefetch::<_MM_HINT_T0>(tb.add(doff).wrapping_add(pf * 32) as *const i8);
            if KIND == K_Q4MIN {
                _mm_prefetch::<_MM_HINT_T0>(tb.add(moff).wrapping_add(pf * 32) as *const i8);
            }
        }
        let mut wv = [_mm512_setzero_si512(); 8];
        if KIND == K_Q8OFF128 {
            for (g, v) in wv.iter_mut().enumerate() {
                *v = _mm512_loadu_si512(q.add(g * 64) as *const _);
            }
        } else {
            for j in 0..4 {
                let v = _mm512_loadu_si512(q.add(j * 64) as *const _);
                wv[j] = _mm512_and_si512(v, mask);
                wv[j + 4] = _mm512_and_si512(_mm512_srli_epi16::<4>(v), mask);
            }
        }
        let d = _mm512_cvtph_ps(_mm256_loadu_si256(tb.add(doff) as *const __m256i));
        let m = if KIND == K_Q4MIN {
            _mm512_cvtph_ps(_mm256_loadu_si256(tb.add(moff) as *const __m256i))
        } else {
            _mm512_setzero_ps()
        };
        // One token's update of its accumulator. Expanded once per token with a literal
        // index, so every accumulator stays in a register.
        macro_rules! token {
            ($t:literal) => {
                if $t < NT {
                    let xi = (t0 + $t) * nb + b;
                    let xp = xqs.add(xi * QK) as *const i32;
                    let mut s0 = _mm512_setzero_si512();
                    let mut s1 = _mm512_setzero_si512();
                    for g in (0..8).step_by(2) {
                        s0 = _mm512_dpbusd_epi32(s0, wv[g], _mm512_set1_epi32(xp.add(g).read_unaligned()));
                        s1 = _mm512_dpbusd_epi32(s1, wv[g + 1], _mm512_set1_epi32(xp.add(g + 1).read_unaligned()));
                    }
                    let mut isum = _mm512_add_epi32(s0, s1);
                    match KIND {
                        K_Q4OFF8 => isum = _mm512_sub_epi32(isum, _mm512_set1_epi32(*xq.sumq.get_unchecked(xi) << 3)),
                        K_Q8OFF128 => isum = _mm512_sub_epi32(isum, _mm512_set1_epi32(*xq.sumq.get_unchecked(xi) << 7)),
                        _ => {}
                    }
                    let scale = _mm512_mul_ps(d, _mm512_set1_ps(*xq.d.get_unchecked(xi)));
                    acc[$t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), scale, acc[$t]);
                    if KIND == K_Q4MIN {
                        acc[$t] = _mm512_fmadd_ps(m, _mm512_set1_ps(*xq.s.get_unchecked(xi)), acc[$t]);
                    }
                }
            };
        }
        token!(0);
        token!(1);
        token!(2);
        token!(3);
        token!(4);
        token!(5);
        token!(6);
        token!(7);
    }
    for (t, a) in acc.iter().enumerate().take(NT) {
        let optr = o.ptr.add((t0 + t) * o.ld + o.col);
        if o.valid == TILE_ROWS {
            let v = if o.accumulate { _mm512_add_ps(_mm512_loadu_ps(optr), *a) } else { *a };
            _mm512_storeu_ps(optr, v);
        } else {
            o.store(t0 + t, &std::mem::transmute::<__m512, [f32; 16]>(*a));
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q_tile_avx2<const KIND: u8, const NT: usize>(
    w: &PackedMatrix,
    tile: usize,
    xq: &Q8Acts,
    t0: usize,
    o: &TileOut,
) {
    use std::arch::x86_64::*;
    let tb = w.tile(tile).as_ptr();
    let nb = w.nb;
    let mask = _mm256_set1_epi8(0x0f);
    let ones = _mm256_set1_epi16(1);
    let flip = _mm256_set1_epi8(-128);
    let xqs = xq.qs.as_ptr() as *const u8;
    let mut result = [[0f32; TILE_ROWS]; NT];
    for half in 0..2 {
        let mut acc = [_mm256_setzero_ps(); NT];
        for b in 0..nb {
            let (qs, doff, moff) = w.offsets(b);
            let q = tb.add(qs + half * 32);
            let mut wv = [_mm256_setzero_si256(); 8];
            if KIND == K_Q8OFF128 {
                for (g, v) in wv.iter_mut().enumerate() {
                    // Back to signed bytes for the sign trick below.
                    *v = _mm256_xor_si256(_mm256_loadu_si256(q.add(g * 64) as *const __m256i), flip);
                }
            } else {
                for j in 0..4 {
                    let v = _mm256_loadu_si256(q.add(j * 64) as *const __m256i);
                    wv[j] = _mm256_and_si256(v, mask);
                    wv[j + 4] = _mm256_and_si256(_mm256_srli_epi16::<4>(v), mask);
                }
            }
            let d = _mm256_cvtph_ps(_mm_loadu_si128(tb.add(doff + half * 16) as *const __m128i));
            let m = if KIND == K_Q4MIN {
                _mm256_cvtph_ps(_mm_loadu_si128(tb.add(moff + half * 16) as *const __m128i))
            } else {
                _mm256_setzero_ps()
            };
            for (t, acc) in acc.iter_mut().enumerate() {
                let xi = (t0 + t) * nb + b;
                let xp = xqs.add(xi * QK) as *const i32;
                let mut isum;
                if KIND == K_Q8OFF128 {
                    // |w| · sign(x, w) keeps each pair sum within i16 (≤ 2·128·127).
                    isum = _mm256_setzero_si256();
                    for (g, wg) in wv.iter().enumerate() {
                        let x = _mm256_set1_epi32(xp.add(g).read_unaligned());
                        let p = _mm256_maddubs_epi16(_mm256_abs_epi8(*wg), _mm256_sign_epi8(x, *wg));
                        isum = _mm256_add_epi32(isum, _mm256_madd_epi16(p, ones));
                    }
                } else {
                    // 4-bit weights: eight pair sums of ≤ 2·15·127 fit an i16 lane.
                    let mut s16 = _mm256_setzero_si256();
                    for (g, wg) in wv.iter().enumerate() {
                        let x = _mm256_set1_epi32(xp.add(g).read_unaligned());
                        s16 = _mm256_add_epi16(s16, _mm256_maddubs_epi16(*wg, x));
                    }
                    isum = _mm256_madd_epi16(s16, ones);
                    if KIND == K_Q4OFF8 {
                        isum = _mm256_sub_epi32(isum, _mm256_set1_epi32(*xq.sumq.get_unchecked(xi) << 3));
                    }
                }
                let scale = _mm256_mul_ps(d, _mm256_set1_ps(*xq.d.get_unchecked(xi)));
                *acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), scale, *acc);
                if KIND == K_Q4MIN {
                    *acc = _mm256_fmadd_ps(m, _mm256_set1_ps(*xq.s.get_unchecked(xi)), *acc);
                }
            }
        }
        for (t, a) in acc.iter().enumerate() {
            _mm256_storeu_ps(result[t].as_mut_ptr().add(half * 8), *a);
        }
    }
    for (t, r) in result.iter().enumerate() {
        o.store(t0 + t, r);
    }
}

fn f_tile(isa: Isa, w: &PackedMatrix, tile: usize, x: &[f32], n_tokens: usize, o: &TileOut) {
    // SAFETY: as in `q_tile`.
    unsafe {
        match isa {
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => f_tile_avx512(w, tile, x, n_tokens, o),
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => f_tile_avx2(w, tile, x, n_tokens, o),
            _ => f_tile_generic(w, tile, x, n_tokens, o),
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,fma,f16c")]
unsafe fn f_tile_avx512(w: &PackedMatrix, tile: usize, x: &[f32], n_tokens: usize, o: &TileOut) {
    f_tile_generic(w, tile, x, n_tokens, o)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn f_tile_avx2(w: &PackedMatrix, tile: usize, x: &[f32], n_tokens: usize, o: &TileOut) {
    f_tile_generic(w, tile, x, n_tokens, o)
}

/// Float path: per block, the tile's 32×16 weights as f32, then one fused multiply-add
/// per weight and token, in column order. Written so that the compiler vectorises the
/// 16 lanes; the op order per lane does not depend on the vector width.
#[inline(always)]
unsafe fn f_tile_generic(w: &PackedMatrix, tile: usize, x: &[f32], n_tokens: usize, o: &TileOut) {
    const CHUNK: usize = 8;
    let tb = w.tile(tile);
    let cols = w.cols;
    let mut buf = [0f32; QK * TILE_ROWS];
    let mut t0 = 0;
    while t0 < n_tokens {
        let nt = (n_tokens - t0).min(CHUNK);
        let mut acc = [[0f32; TILE_ROWS]; CHUNK];
        for b in 0..w.nb {
            w.dequantize_tile_block(tb, b, &mut buf);
            for (t, acc) in acc.iter_mut().enumerate().take(nt) {
                let xs = &x[(t0 + t) * cols + b * QK..(t0 + t) * cols + (b + 1) * QK];
                for (k, xv) in xs.iter().enumerate() {
                    let wk = &buf[k * TILE_ROWS..(k + 1) * TILE_ROWS];
                    for lane in 0..TILE_ROWS {
                        acc[lane] = wk[lane].mul_add(*xv, acc[lane]);
                    }
                }
            }
        }
        for (t, a) in acc.iter().enumerate().take(nt) {
            o.store(t0 + t, a);
        }
        t0 += nt;
    }
}
