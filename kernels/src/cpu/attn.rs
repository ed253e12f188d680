//! Causal attention over the paged KV cache on the CPU.
//!
//! One task is a tile of up to [`ATTN_QUERY_TILE`] tokens of one sequence × the query
//! heads of one KV head (their rows share every key and value read). The default kernel
//! ([`flash_task`]) walks the sequence's keys once, in chunks of up to [`KEY_CHUNK`],
//! with an online softmax (FlashAttention's running maximum and sum), so nothing grows
//! with the context but the cache itself:
//! - scores: the rows lie on the SIMD lanes (the query transposed once per task), each
//!   key's elements broadcast in turn: no horizontal sums, and every score is one chain of
//!   multiply-adds in the order of the head dimension, whatever the tile (batch
//!   invariance: a token's output does not depend on the tile it falls in). A decode
//!   step's few rows (one token's heads of one KV head) would leave most lanes idle, so
//!   there the chunk's keys are transposed and lie on the lanes, each score computed in
//!   the same order;
//! - the softmax: the rows on the lanes too, so its `exp` runs a vector at a time;
//! - the values: rows in groups of eight, each accumulating two vectors of head
//!   dimensions (a key a row may not see is skipped, not weighted by zero);
//! - segments: each row's state restarts every [`SEGMENT`] keys and the segments' states
//!   merge in order, so a long decode row can run as a task per segment ([`AttnTask`],
//!   merged by [`merge_partials`]) when a step has too few tasks for the threads.
//!
//! `DISAGG_CPU_FLASH_ATTN=0` selects the kernel before it ([`two_pass_task`]): scores of
//! every key first, then the softmax, then the values, a dot product per score.

use super::matmul::SendPtr;
use super::ops::{dot16, exp_f32, kv_to_f32};
use super::{CpuKv, Isa};
use crate::backend::{AttnShape, StepBatch};
use crate::KvDtype;

/// Query tokens handled together by one attention task (they share each K/V block load).
pub(super) const ATTN_QUERY_TILE: usize = 16;

/// Keys per step of the flash kernel (at most; a chunk never crosses a cache block).
const KEY_CHUNK: usize = 16;

/// Keys per segment of the flash kernel: each row's softmax state is computed per
/// segment from scratch and the segments' states merged in order, so that a decode row
/// of a long context can be split into tasks of one segment each (its threads sharing
/// the work) with the same bits as a prompt tile that runs its segments in turn.
pub(super) const SEGMENT: usize = 512;

/// One flash attention task: a tile's rows of one sequence × one KV head, over every
/// segment of its keys, or over one segment whose state goes to the partials
/// (`split: Some((segment, offset))`, merged by [`merge_partials`]).
#[derive(Clone, Copy, Debug)]
pub(super) struct AttnTask {
    pub s: usize,
    pub tile: usize,
    pub kvh: usize,
    pub split: Option<(usize, usize)>,
}

/// Floats of one split task's state in the partials: per row its maximum, its sum and
/// its output row so far.
pub(super) fn partial_len(n_rows: usize, head_dim: usize) -> usize {
    n_rows * (2 + head_dim)
}

/// Query rows (tokens × heads) per SIMD vector of the rows-on-lanes kernels.
const LANES: usize = 16;

/// Keys per register tile of the rows-on-lanes score kernel.
const KEY_TILE: usize = 8;

/// Most query rows for which a chunk's scores and softmax put the keys on the lanes
/// instead (a decode step's rows: one token's heads of one KV head), which costs a
/// transpose of the chunk's keys but leaves no lane idle. Both forms compute each score
/// and each softmax step with the same operations in the same order: the same bits.
const MAX_ROWS_KEYS_ON_LANES: usize = 8;

/// Per-thread scratch of the attention tasks.
#[derive(Default)]
pub(super) struct AttnScratch {
    /// Two-pass kernel: every score of the tile's rows.
    scores: Vec<f32>,
    /// One chunk of keys or values as f32, `[key][dim]`.
    kbuf: Vec<f32>,
    /// Flash kernel, few rows: the chunk's keys transposed, `[dim][key]`.
    kt: Vec<f32>,
    /// Flash kernel: the scaled queries, `[dim][row]`.
    q: Vec<f32>,
    /// The chunk's scores, then its probabilities, `[key][row]`.
    s: Vec<f32>,
    /// The output rows so far (not yet divided by the sum), `[row][dim]`.
    o: Vec<f32>,
    /// Per row: the running maximum, the running sum, this chunk's rescale factor.
    m: Vec<f32>,
    l: Vec<f32>,
    alpha: Vec<f32>,
    /// Per row: the last key position it may see.
    last: Vec<u32>,
    /// The merged state of the segments before the current one: maxima, sums, rows.
    am: Vec<f32>,
    al: Vec<f32>,
    ao: Vec<f32>,
}

/// Whether [`online_softmax`] skips the selects on chunks every row sees whole
/// (`DISAGG_CPU_SOFTMAX_FAST`, default on; the bits are the same either way). Read once
/// per process, at the first attention.
static FAST_SOFTMAX: std::sync::LazyLock<bool> =
    std::sync::LazyLock::new(|| std::env::var(crate::env::CPU_SOFTMAX_FAST).map_or(true, |v| v != "0"));

/// Whether the attention uses [`flash_task`] (`DISAGG_CPU_FLASH_ATTN`, default on).
pub(super) fn flash_enabled() -> bool {
    std::env::var(crate::env::CPU_FLASH_ATTN).map_or(true, |v| v != "0")
}

/// Sixteen f32 lanes: one AVX-512 register, two AVX2 registers, or an array. The flash
/// kernel's register tiles are written with these, because the compiler, left to itself,
/// vectorized the score tile across the head dimension (with gathers) instead of across
/// its rows.
trait F32x16: Copy {
    /// Whether 27 values of this type fit in the registers (AVX-512's 32).
    const MANY_REGISTERS: bool = false;
    /// # Safety
    /// `p` must be valid for reading 16 f32 values.
    unsafe fn load(p: *const f32) -> Self;
    /// # Safety
    /// `p` must be valid for writing 16 f32 values.
    unsafe fn store(self, p: *mut f32);
    fn splat(x: f32) -> Self;
    /// 16 f16 values (little-endian) as f32, exactly.
    ///
    /// # Safety
    /// `p` must be valid for reading 32 bytes.
    #[inline(always)]
    unsafe fn load_f16(p: *const u8) -> Self {
        let mut x = [0f32; 16];
        for (i, x) in x.iter_mut().enumerate() {
            *x = half::f16::from_bits(u16::from_le_bytes([*p.add(2 * i), *p.add(2 * i + 1)])).to_f32();
        }
        Self::load(x.as_ptr())
    }
    /// `self · b + c`, each lane rounded once.
    fn mul_add(self, b: Self, c: Self) -> Self;
    fn mul(self, b: Self) -> Self;
    /// Writes the 16 × 16 block at `src` (rows `ss` apart) transposed to `dst` (rows
    /// `ds` apart).
    ///
    /// # Safety
    /// Both blocks must be valid, and not overlap.
    #[inline(always)]
    unsafe fn transpose16(src: *const f32, ss: usize, dst: *mut f32, ds: usize) {
        for i in 0..16 {
            for j in 0..16 {
                *dst.add(j * ds + i) = *src.add(i * ss + j);
            }
        }
    }
}

/// Lanes as an array (the scalar ISA).
#[derive(Clone, Copy)]
struct Array16([f32; 16]);

impl F32x16 for Array16 {
    #[inline(always)]
    unsafe fn load(p: *const f32) -> Self {
        Array16(*(p as *const [f32; 16]))
    }
    #[inline(always)]
    unsafe fn store(self, p: *mut f32) {
        *(p as *mut [f32; 16]) = self.0;
    }
    #[inline(always)]
    fn splat(x: f32) -> Self {
        Array16([x; 16])
    }
    #[inline(always)]
    fn mul_add(self, b: Self, c: Self) -> Self {
        Array16(std::array::from_fn(|l| self.0[l].mul_add(b.0[l], c.0[l])))
    }
    #[inline(always)]
    fn mul(self, b: Self) -> Self {
        Array16(std::array::from_fn(|l| self.0[l] * b.0[l]))
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::F32x16;
    use std::arch::x86_64::*;

    /// One AVX-512 register. Used only by [`super::flash_attention`]'s AVX-512 entry,
    /// which runs only where the CPU has AVX-512 (so the intrinsics below are sound).
    #[derive(Clone, Copy)]
    pub(super) struct Avx512(__m512);

    impl F32x16 for Avx512 {
        const MANY_REGISTERS: bool = true;
        #[inline(always)]
        unsafe fn load(p: *const f32) -> Self {
            Avx512(_mm512_loadu_ps(p))
        }
        #[inline(always)]
        unsafe fn store(self, p: *mut f32) {
            _mm512_storeu_ps(p, self.0)
        }
        #[inline(always)]
        fn splat(x: f32) -> Self {
            // SAFETY: see the type's doc.
            Avx512(unsafe { _mm512_set1_ps(x) })
        }
        #[inline(always)]
        unsafe fn load_f16(p: *const u8) -> Self {
            Avx512(_mm512_cvtph_ps(_mm256_loadu_si256(p as *const __m256i)))
        }
        #[inline(always)]
        fn mul_add(self, b: Self, c: Self) -> Self {
            // SAFETY: see the type's doc.
            Avx512(unsafe { _mm512_fmadd_ps(self.0, b.0, c.0) })
        }
        #[inline(always)]
        fn mul(self, b: Self) -> Self {
            // SAFETY: see the type's doc.
            Avx512(unsafe { _mm512_mul_ps(self.0, b.0) })
        }
        /// In four rounds of shuffles: 32-bit pairs, 64-bit pairs, then 128-bit lanes twice.
        #[inline(always)]
        unsafe fn transpose16(src: *const f32, ss: usize, dst: *mut f32, ds: usize) {
            let r: [__m512; 16] = std::array::from_fn(|i| _mm512_loadu_ps(src.add(i * ss)));
            let mut t = [_mm512_setzero_ps(); 16];
            for k in 0..8 {
                t[2 * k] = _mm512_unpacklo_ps(r[2 * k], r[2 * k + 1]);
                t[2 * k + 1] = _mm512_unpackhi_ps(r[2 * k], r[2 * k + 1]);
            }
            // u[4k + c], 128-bit lane L: column 4L + c, rows 4k..4k + 4.
            let pd = _mm512_castps_pd;
            let ps = _mm512_castpd_ps;
            let mut u = [_mm512_setzero_ps(); 16];
            for k in 0..4 {
                let b = 4 * k;
                u[b] = ps(_mm512_unpacklo_pd(pd(t[b]), pd(t[b + 2])));
                u[b + 1] = ps(_mm512_unpackhi_pd(pd(t[b]), pd(t[b + 2])));
                u[b + 2] = ps(_mm512_unpacklo_pd(pd(t[b + 1]), pd(t[b + 3])));
                u[b + 3] = ps(_mm512_unpackhi_pd(pd(t[b + 1]), pd(t[b + 3])));
            }
            let mut w = [_mm512_setzero_ps(); 16];
            for h in 0..2 {
                for i in 0..4 {
                    let b = 8 * h;
                    w[b + i] = _mm512_shuffle_f32x4::<0x88>(u[b + i], u[b + 4 + i]);
                    w[b + 4 + i] = _mm512_shuffle_f32x4::<0xdd>(u[b + i], u[b + 4 + i]);
                }
            }
            for i in 0..8 {
                _mm512_storeu_ps(dst.add(i * ds), _mm512_shuffle_f32x4::<0x88>(w[i], w[8 + i]));
                _mm512_storeu_ps(dst.add((8 + i) * ds), _mm512_shuffle_f32x4::<0xdd>(w[i], w[8 + i]));
            }
        }
    }

    /// Two AVX2 registers. Used only by [`super::flash_attention`]'s AVX2 entry, which
    /// runs only where the CPU has AVX2 and FMA.
    #[derive(Clone, Copy)]
    pub(super) struct Avx2([__m256; 2]);

    impl F32x16 for Avx2 {
        #[inline(always)]
        unsafe fn load(p: *const f32) -> Self {
            Avx2([_mm256_loadu_ps(p), _mm256_loadu_ps(p.add(8))])
        }
        #[inline(always)]
        unsafe fn store(self, p: *mut f32) {
            _mm256_storeu_ps(p, self.0[0]);
            _mm256_storeu_ps(p.add(8), self.0[1]);
        }
        #[inline(always)]
        fn splat(x: f32) -> Self {
            // SAFETY: see the type's doc.
            let v = unsafe { _mm256_set1_ps(x) };
            Avx2([v, v])
        }
        /// (The AVX2 entry enables F16C too.)
        #[inline(always)]
        unsafe fn load_f16(p: *const u8) -> Self {
            Avx2([
                _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i)),
                _mm256_cvtph_ps(_mm_loadu_si128(p.add(16) as *const __m128i)),
            ])
        }
        #[inline(always)]
        fn mul_add(self, b: Self, c: Self) -> Self {
            // SAFETY: see the type's doc.
            unsafe { Avx2([_mm256_fmadd_ps(self.0[0], b.0[0], c.0[0]), _mm256_fmadd_ps(self.0[1], b.0[1], c.0[1])]) }
        }
        #[inline(always)]
        fn mul(self, b: Self) -> Self {
            // SAFETY: see the type's doc.
            unsafe { Avx2([_mm256_mul_ps(self.0[0], b.0[0]), _mm256_mul_ps(self.0[1], b.0[1])]) }
        }
    }
}

isa_variants!(pub(super) fn flash_attention =>
    // [`flash_task`] with the ISA's lanes, compiled for that ISA.
    {flash_task::<x86::Avx512>} {flash_task::<x86::Avx2>} {flash_task::<Array16>} (
    batch: &StepBatch,
    attn: &AttnShape,
    kv: &CpuKv,
    bytes: &[u8],
    qkv: &[f32],
    out: SendPtr<f32>,
    partials: SendPtr<f32>,
    task: AttnTask,
    sc: &mut AttnScratch,
));

/// One flash attention task: query rows of `ATTN_QUERY_TILE` tokens × the query heads
/// of KV head `kvh`, over all keys each token may see (or one segment of them), in one
/// pass over the cache.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn flash_task<V: F32x16>(
    batch: &StepBatch,
    attn: &AttnShape,
    kv: &CpuKv,
    bytes: &[u8],
    qkv: &[f32],
    out: SendPtr<f32>,
    partials: SendPtr<f32>,
    task: AttnTask,
    sc: &mut AttnScratch,
) {
    let AttnTask { s, tile, kvh, split } = task;
    let span = &batch.seqs[s];
    let hd = attn.head_dim;
    let g = attn.n_heads / attn.n_kv_heads;
    let (qd, w) = (attn.q_dim(), attn.qkv_dim());
    let bs = batch.block_size;
    let t0 = tile * ATTN_QUERY_TILE;
    let nt = (span.rows.len() - t0).min(ATTN_QUERY_TILE);
    let pos_first = span.pos0 + t0;
    let n_ctx = pos_first + nt; // keys visible to the last token of the tile
    let n_rows = nt * g; // row r: token r / g, head r % g
    let np = n_rows.next_multiple_of(LANES);
    let dtype = kv.shape.dtype;
    let es = dtype.bytes();
    let v_base = kv.half_bytes();

    // The queries, scaled; padding rows are zero (their results are never written).
    sc.q.clear();
    sc.q.resize(np * hd, 0.0);
    for r in 0..n_rows {
        let (i, h) = (r / g, r % g);
        let at = (span.rows.start + t0 + i) * w + (kvh * g + h) * hd;
        for (d, &x) in qkv[at..at + hd].iter().enumerate() {
            sc.q[d * np + r] = x * attn.scale;
        }
    }
    sc.last.clear();
    sc.last.extend((0..np).map(|r| if r < n_rows { (pos_first + r / g) as u32 } else { (n_ctx - 1) as u32 }));
    sc.alpha.resize(np, 0.0);
    sc.s.resize(KEY_CHUNK * np, 0.0);
    sc.kbuf.resize(KEY_CHUNK * hd, 0.0);
    let keys_on_lanes = n_rows <= MAX_ROWS_KEYS_ON_LANES;
    let fast = *FAST_SOFTMAX;
    if keys_on_lanes {
        sc.kt.resize(hd * KEY_CHUNK, 0.0);
    }

    let segments = match split {
        Some((seg, _)) => seg..seg + 1,
        None => 0..n_ctx.div_ceil(SEGMENT),
    };
    let first = segments.start;
    for seg in segments {
        // This segment's state, from scratch.
        sc.m.clear();
        sc.m.resize(np, f32::NEG_INFINITY);
        sc.l.clear();
        sc.l.resize(np, 0.0);
        sc.o.clear();
        sc.o.resize(np * hd, 0.0);
        let end = ((seg + 1) * SEGMENT).min(n_ctx);
        let mut j0 = seg * SEGMENT;
        while j0 < end {
            let (blk, off) = (j0 / bs, j0 % bs);
            let n_in = (bs - off).min(KEY_CHUNK).min(end - j0);
            let at = kv.offset(span.block_table[blk] as usize, kvh, off);
            to_f32::<V>(dtype, &bytes[at..at + n_in * hd * es], &mut sc.kbuf[..n_in * hd]);
            if keys_on_lanes {
                transpose_keys::<V>(&sc.kbuf, hd, &mut sc.kt);
                few_rows_softmax::<V>(
                    &sc.q,
                    np,
                    &sc.kt,
                    hd,
                    n_rows,
                    j0,
                    n_in,
                    &sc.last,
                    &mut sc.m,
                    &mut sc.l,
                    &mut sc.alpha,
                    &mut sc.s,
                );
            } else {
                scores_on_lanes::<V>(&sc.q, np, &sc.kbuf, hd, n_in, &mut sc.s);
                online_softmax(&mut sc.s, np, j0, n_in, &sc.last, &mut sc.m, &mut sc.l, &mut sc.alpha, fast);
            }
            let at = v_base + at;
            to_f32::<V>(dtype, &bytes[at..at + n_in * hd * es], &mut sc.kbuf[..n_in * hd]);
            let c = ChunkValues { p: &sc.s, np, alpha: &sc.alpha, v: &sc.kbuf, j0, n_in, last: &sc.last };
            accumulate_values::<V>(&mut sc.o, hd, &c, n_rows);
            j0 += n_in;
        }
        if let Some((_, offset)) = split {
            // SAFETY: the task's own part of the partials, sized by `partial_len`.
            let dst = unsafe { std::slice::from_raw_parts_mut(partials.get().add(offset), partial_len(n_rows, hd)) };
            for (r, d) in dst.chunks_exact_mut(2 + hd).enumerate() {
                d[0] = sc.m[r];
                d[1] = sc.l[r];
                d[2..].copy_from_slice(&sc.o[r * hd..(r + 1) * hd]);
            }
            return;
        }
        if seg == first {
            std::mem::swap(&mut sc.am, &mut sc.m);
            std::mem::swap(&mut sc.al, &mut sc.l);
            std::mem::swap(&mut sc.ao, &mut sc.o);
        } else {
            for r in 0..n_rows {
                let (m, l, o) = (sc.m[r], sc.l[r], &sc.o[r * hd..(r + 1) * hd]);
                merge_state(&mut sc.am[r], &mut sc.al[r], &mut sc.ao[r * hd..(r + 1) * hd], m, l, o);
            }
        }
    }

    for r in 0..n_rows {
        let (i, h) = (r / g, r % g);
        let row = span.rows.start + t0 + i;
        let inv = 1.0 / sc.al[r];
        // SAFETY: this task alone writes the heads of `kvh` for its tile's rows.
        let orow = unsafe { std::slice::from_raw_parts_mut(out.get().add(row * qd + (kvh * g + h) * hd), hd) };
        for (o, &x) in orow.iter_mut().zip(&sc.ao[r * hd..(r + 1) * hd]) {
            *o = x * inv;
        }
    }
}

/// Merges a segment's state (maximum `m`, sum `l`, output row `o`) into the state of the
/// segments before it, which has seen key 0 (so its maximum is finite). A segment with
/// no key the row may see (maximum −∞) changes nothing.
#[inline(always)]
fn merge_state(am: &mut f32, al: &mut f32, ao: &mut [f32], m: f32, l: f32, o: &[f32]) {
    if m == f32::NEG_INFINITY {
        return;
    }
    let mx = if m > *am { m } else { *am };
    let (ca, cb) = (exp_f32(*am - mx), exp_f32(m - mx));
    *al = l.mul_add(cb, *al * ca);
    for (a, &b) in ao.iter_mut().zip(o) {
        *a = b.mul_add(cb, *a * ca);
    }
    *am = mx;
}

/// Finishes the split tasks: for each group of tasks that split one tile (one decode
/// row's heads of one KV head; `groups`: its first task's index, and how many), merges
/// the segments' states in order, as [`flash_task`] merges them in turn, and writes the
/// output rows.
pub(super) fn merge_partials(
    batch: &StepBatch,
    attn: &AttnShape,
    tasks: &[AttnTask],
    groups: &[(usize, usize)],
    partials: &[f32],
    out: &mut [f32],
) {
    let (hd, g, qd) = (attn.head_dim, attn.n_heads / attn.n_kv_heads, attn.q_dim());
    if groups.is_empty() {
        return;
    }
    let mut acc = vec![0f32; 2 + hd];
    for &(first, n) in groups {
        let AttnTask { s, tile, kvh, .. } = tasks[first];
        let span = &batch.seqs[s];
        let t0 = tile * ATTN_QUERY_TILE;
        let nt = (span.rows.len() - t0).min(ATTN_QUERY_TILE);
        for r in 0..nt * g {
            let state = |t: &AttnTask| {
                let (_, offset) = t.split.expect("a split task");
                &partials[offset + r * (2 + hd)..offset + (r + 1) * (2 + hd)]
            };
            acc.copy_from_slice(state(&tasks[first]));
            for t in &tasks[first + 1..first + n] {
                let b = state(t);
                let (head, rest) = acc.split_at_mut(2);
                let (am, al) = head.split_at_mut(1);
                merge_state(&mut am[0], &mut al[0], rest, b[0], b[1], &b[2..]);
            }
            let (i, h) = (r / g, r % g);
            let row = span.rows.start + t0 + i;
            let inv = 1.0 / acc[1];
            for (o, &x) in out[row * qd + (kvh * g + h) * hd..][..hd].iter_mut().zip(&acc[2..]) {
                *o = x * inv;
            }
        }
    }
}

/// Scores of a chunk's `n_in` keys (`k`: `[key][dim]`, rows past `n_in` finite or
/// masked later) against every row of `q` (`[dim][row]`, `np` rows), into `s`
/// (`[key][row]`). Each step broadcasts one key element onto a vector of 16 rows.
#[inline(always)]
fn scores_on_lanes<V: F32x16>(q: &[f32], np: usize, k: &[f32], hd: usize, n_in: usize, s: &mut [f32]) {
    let nv = np / LANES;
    assert!(q.len() >= hd * np && k.len() >= KEY_CHUNK * hd && s.len() >= KEY_CHUNK * np);
    for k0 in (0..n_in).step_by(KEY_TILE) {
        let mut v = 0;
        while v < nv {
            // Three row vectors (24 accumulators) where the registers hold them: a tile
            // of 16 tokens × 3 heads per KV head is one such tile.
            let rv = match nv - v {
                3 if V::MANY_REGISTERS => 3,
                1 => 1,
                _ => 2,
            };
            match rv {
                3 => scores_tile::<V, 3>(q, np, v, k, k0, hd, s),
                2 => scores_tile::<V, 2>(q, np, v, k, k0, hd, s),
                _ => scores_tile::<V, 1>(q, np, v, k, k0, hd, s),
            }
            v += rv;
        }
    }
}

/// [`scores_on_lanes`] for keys `k0..k0 + KEY_TILE` and row vectors `v0..v0 + RV`: the
/// `KEY_TILE × RV` accumulators stay in registers over the head dimension.
#[inline(always)]
fn scores_tile<V: F32x16, const RV: usize>(
    q: &[f32],
    np: usize,
    v0: usize,
    k: &[f32],
    k0: usize,
    hd: usize,
    s: &mut [f32],
) {
    debug_assert!(k0 + KEY_TILE <= KEY_CHUNK && (v0 + RV) * LANES <= np);
    let mut acc = [[V::splat(0.0); RV]; KEY_TILE];
    for d in 0..hd {
        // SAFETY: d < hd and (v0 + RV) * LANES <= np, so within q (asserted by the caller).
        let qv: [V; RV] = std::array::from_fn(|x| unsafe { V::load(q.as_ptr().add(d * np + (v0 + x) * LANES)) });
        for (kk, a) in acc.iter_mut().enumerate() {
            // SAFETY: k0 + kk < KEY_CHUNK and d < hd: within k (asserted by the caller).
            let kd = V::splat(unsafe { *k.get_unchecked((k0 + kk) * hd + d) });
            for (ax, qx) in a.iter_mut().zip(&qv) {
                *ax = kd.mul_add(*qx, *ax);
            }
        }
    }
    for (kk, a) in acc.iter().enumerate() {
        for (x, ax) in a.iter().enumerate() {
            let at = (k0 + kk) * np + (v0 + x) * LANES;
            assert!(at + LANES <= s.len());
            // SAFETY: in bounds (asserted).
            unsafe { ax.store(s.as_mut_ptr().add(at)) };
        }
    }
}

/// [`kv_to_f32`], with f16 converted in line by the kernel's lanes (not a call per chunk).
#[inline(always)]
fn to_f32<V: F32x16>(dtype: KvDtype, src: &[u8], out: &mut [f32]) {
    if dtype != KvDtype::F16 {
        return kv_to_f32(dtype, src, out);
    }
    assert!(src.len() >= 2 * out.len());
    let full = out.len() - out.len() % LANES;
    for i in (0..full).step_by(LANES) {
        // SAFETY: i + 16 <= out.len(), and src holds 2 bytes per output (asserted).
        unsafe { V::load_f16(src.as_ptr().add(2 * i)).store(out.as_mut_ptr().add(i)) };
    }
    if full < out.len() {
        kv_to_f32(dtype, &src[2 * full..], &mut out[full..]);
    }
}

/// Scores of rows `0..R` (`q`: `[dim][row]`) against the chunk's 16 key slots (`kt`:
/// `[dim][key]`), one chain of multiply-adds per row as in [`scores_tile`].
#[inline(always)]
fn few_rows_scores<V: F32x16, const R: usize>(
    q: &[f32],
    np: usize,
    kt: &[f32],
    hd: usize,
    out: &mut [[f32; KEY_CHUNK]; MAX_ROWS_KEYS_ON_LANES],
) {
    let mut acc = [V::splat(0.0); R];
    for d in 0..hd {
        // SAFETY: d < hd: within kt (asserted by the caller).
        let kd = unsafe { V::load(kt.as_ptr().add(d * KEY_CHUNK)) };
        for (x, a) in acc.iter_mut().enumerate() {
            // SAFETY: d < hd and x < R <= np: within q (asserted by the caller).
            let qd = unsafe { *q.get_unchecked(d * np + x) };
            *a = V::splat(qd).mul_add(kd, *a);
        }
    }
    for (a, o) in acc.iter().zip(out.iter_mut()) {
        // SAFETY: `o` holds 16 values.
        unsafe { a.store(o.as_mut_ptr()) };
    }
}

/// `kt[d][key] = k[key][d]` for the chunk's 16 key slots (slots past the chunk's keys
/// hold stale finite values; their scores are masked).
#[inline(always)]
fn transpose_keys<V: F32x16>(k: &[f32], hd: usize, kt: &mut [f32]) {
    assert!(k.len() >= KEY_CHUNK * hd && kt.len() >= hd * KEY_CHUNK);
    let full = hd - hd % LANES;
    for d0 in (0..full).step_by(LANES) {
        // SAFETY: rows 0..16 of columns d0..d0 + 16 of k, and rows d0..d0 + 16 of kt (16
        // wide), are in bounds (asserted); the buffers are distinct.
        unsafe { V::transpose16(k.as_ptr().add(d0), hd, kt.as_mut_ptr().add(d0 * KEY_CHUNK), KEY_CHUNK) };
    }
    for d in full..hd {
        for j in 0..KEY_CHUNK {
            kt[d * KEY_CHUNK + j] = k[j * hd + d];
        }
    }
}

/// [`scores_on_lanes`] and [`online_softmax`] for a chunk with few rows, the keys on
/// the lanes (`kt`: `[dim][key]`): each row's 16 scores are one vector, a chain of
/// multiply-adds over the head dimension as in [`scores_tile`]; its maximum, `exp` and
/// sum then follow the key order as [`online_softmax`] does, and its probabilities go
/// to `s` (`[key][row]`) for [`accumulate_values`].
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn few_rows_softmax<V: F32x16>(
    q: &[f32],
    np: usize,
    kt: &[f32],
    hd: usize,
    n_rows: usize,
    j0: usize,
    n_in: usize,
    last: &[u32],
    m: &mut [f32],
    l: &mut [f32],
    alpha: &mut [f32],
    s: &mut [f32],
) {
    assert!(q.len() >= hd * np && kt.len() >= hd * KEY_CHUNK && s.len() >= KEY_CHUNK * np);
    assert!(n_rows <= MAX_ROWS_KEYS_ON_LANES && MAX_ROWS_KEYS_ON_LANES <= np);
    // The rows' chains side by side (a row alone would wait on each multiply-add's
    // latency); rows past `n_rows` are padding.
    let mut scores = [[0f32; KEY_CHUNK]; MAX_ROWS_KEYS_ON_LANES];
    match n_rows {
        0..=1 => few_rows_scores::<V, 1>(q, np, kt, hd, &mut scores),
        2 => few_rows_scores::<V, 2>(q, np, kt, hd, &mut scores),
        3..=4 => few_rows_scores::<V, 4>(q, np, kt, hd, &mut scores),
        _ => few_rows_scores::<V, 8>(q, np, kt, hd, &mut scores),
    }
    for (r, sc) in scores.iter().enumerate().take(n_rows) {
        let (m_old, lim) = (m[r], last[r]);
        let mut mx = m_old;
        for (jj, &v) in sc[..n_in].iter().enumerate() {
            let v = if (j0 + jj) as u32 <= lim { v } else { f32::NEG_INFINITY };
            mx = if v > mx { v } else { mx };
        }
        let e: [f32; KEY_CHUNK] = std::array::from_fn(|jj| exp_f32(sc[jj] - mx));
        let mut sum = 0f32;
        for (jj, &e) in e[..n_in].iter().enumerate() {
            let p = if (j0 + jj) as u32 <= lim { e } else { 0.0 };
            s[jj * np + r] = p;
            sum += p;
        }
        let ea = exp_f32(m_old - mx);
        let a = if m_old == f32::NEG_INFINITY { 0.0 } else { ea };
        alpha[r] = a;
        l[r] = l[r].mul_add(a, sum);
        m[r] = mx;
    }
}

/// The online softmax of one chunk, the rows on the lanes: each row's maximum moves to
/// cover the chunk's keys it may see (`last`), its sum so far is rescaled by `alpha`
/// (= exp(old maximum − new), also returned for the output rows), and the chunk's
/// scores in `s` become probabilities (0 for keys a row may not see).
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn online_softmax(
    s: &mut [f32],
    np: usize,
    j0: usize,
    n_in: usize,
    last: &[u32],
    m: &mut [f32],
    l: &mut [f32],
    alpha: &mut [f32],
    fast: bool,
) {
    let j_last = (j0 + n_in - 1) as u32;
    for v in (0..np).step_by(LANES) {
        if fast && last[v..v + LANES].iter().all(|&lim| lim >= j_last) {
            softmax_lanes_whole(s, np, v, n_in, m, l, alpha);
        } else {
            softmax_lanes_masked(s, np, v, j0, n_in, last, m, l, alpha);
        }
    }
}

/// [`online_softmax`] for the 16 rows from `v`, where every row sees every key of the
/// chunk (all but a tile's diagonal chunks): the operations of
/// [`softmax_lanes_masked`] without its selects.
#[inline(always)]
fn softmax_lanes_whole(
    s: &mut [f32],
    np: usize,
    v: usize,
    n_in: usize,
    m: &mut [f32],
    l: &mut [f32],
    alpha: &mut [f32],
) {
    let m_old: [f32; LANES] = m[v..v + LANES].try_into().unwrap();
    let mut mx = m_old;
    for jj in 0..n_in {
        let sv: &[f32; LANES] = s[jj * np + v..jj * np + v + LANES].try_into().unwrap();
        for x in 0..LANES {
            mx[x] = if sv[x] > mx[x] { sv[x] } else { mx[x] };
        }
    }
    let mut sum = [0f32; LANES];
    for jj in 0..n_in {
        let sv: &mut [f32; LANES] = (&mut s[jj * np + v..jj * np + v + LANES]).try_into().unwrap();
        for x in 0..LANES {
            let p = exp_f32(sv[x] - mx[x]);
            sv[x] = p;
            sum[x] += p;
        }
    }
    fold_chunk_lanes(v, &m_old, &mx, &sum, m, l, alpha);
}

/// The end of [`online_softmax`] for the 16 rows from `v`: each row's rescale factor
/// `alpha` (exp of its old maximum − the new, `m_old` − `mx`), its sum `l` rescaled plus
/// the chunk's `sum`, and its new maximum. Until a row has seen a key of the segment its
/// maximum is −∞ (and exp of −∞ − −∞ is NaN): its sum and output are 0 then, and 0
/// keeps them so. On local arrays, so that the lanes vectorize (a loop over the slices
/// stayed scalar: their bounds checks).
#[inline(always)]
fn fold_chunk_lanes(
    v: usize,
    m_old: &[f32; LANES],
    mx: &[f32; LANES],
    sum: &[f32; LANES],
    m: &mut [f32],
    l: &mut [f32],
    alpha: &mut [f32],
) {
    let mut a = [0f32; LANES];
    for x in 0..LANES {
        let e = exp_f32(m_old[x] - mx[x]);
        a[x] = if m_old[x] == f32::NEG_INFINITY { 0.0 } else { e };
    }
    let lv: &mut [f32; LANES] = (&mut l[v..v + LANES]).try_into().unwrap();
    for x in 0..LANES {
        lv[x] = lv[x].mul_add(a[x], sum[x]);
    }
    alpha[v..v + LANES].copy_from_slice(&a);
    m[v..v + LANES].copy_from_slice(mx);
}

/// [`online_softmax`] for the 16 rows from `v`, each row over the keys it may see.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn softmax_lanes_masked(
    s: &mut [f32],
    np: usize,
    v: usize,
    j0: usize,
    n_in: usize,
    last: &[u32],
    m: &mut [f32],
    l: &mut [f32],
    alpha: &mut [f32],
) {
    let lastv: [u32; LANES] = last[v..v + LANES].try_into().unwrap();
    let m_old: [f32; LANES] = m[v..v + LANES].try_into().unwrap();
    let mut mx = m_old;
    for jj in 0..n_in {
        let j = (j0 + jj) as u32;
        let sv: &[f32; LANES] = s[jj * np + v..jj * np + v + LANES].try_into().unwrap();
        for x in 0..LANES {
            // Selects, not branches, so that the lanes vectorize.
            let v = if j <= lastv[x] { sv[x] } else { f32::NEG_INFINITY };
            mx[x] = if v > mx[x] { v } else { mx[x] };
        }
    }
    let mut sum = [0f32; LANES];
    for jj in 0..n_in {
        let j = (j0 + jj) as u32;
        let sv: &mut [f32; LANES] = (&mut s[jj * np + v..jj * np + v + LANES]).try_into().unwrap();
        for x in 0..LANES {
            let p = if j <= lastv[x] { exp_f32(sv[x] - mx[x]) } else { 0.0 };
            sv[x] = p;
            sum[x] += p;
        }
    }
    fold_chunk_lanes(v, &m_old, &mx, &sum, m, l, alpha);
}

/// A chunk's probabilities and values, as the output rows take them.
struct ChunkValues<'a> {
    /// Probabilities, `[key][row]`, `np` rows.
    p: &'a [f32],
    np: usize,
    /// Per row: the factor for its output so far.
    alpha: &'a [f32],
    /// Values, `[key][dim]`.
    v: &'a [f32],
    /// The chunk's first key position and its number of keys.
    j0: usize,
    n_in: usize,
    /// Per row: the last key position it may see.
    last: &'a [u32],
}

/// `o[r] = o[r] · alpha[r] + Σ_key p[key][r] · v[key]` for the rows `0..n_rows`, over
/// the keys each row may see (in groups of up to eight rows sharing each value load; a
/// group may run into the padding rows, whose results are never written).
///
/// A key a row may not see is skipped, not multiplied by its zero probability: its
/// value may be infinite (an f16 cache holds ±inf past 65504), and 0 · inf would make
/// the row NaN, where the row alone (a decode step) never reads that key. Only a chunk
/// on a tile's diagonal has such keys; there each row takes its visible keys (a prefix
/// of the chunk) alone, with the same operations.
#[inline(always)]
fn accumulate_values<V: F32x16>(o: &mut [f32], hd: usize, c: &ChunkValues, n_rows: usize) {
    let (np, n_in) = (c.np, c.n_in);
    assert!(o.len() >= np * hd && c.p.len() >= n_in * np && c.v.len() >= n_in * hd);
    assert!(c.alpha.len() >= np && c.last.len() >= np && n_in > 0);
    let mut r0 = 0;
    while r0 < n_rows {
        let r = match n_rows - r0 {
            5.. => 8,
            3..=4 => 4,
            n => n,
        };
        if c.last[r0..r0 + r].iter().all(|&l| l as usize >= c.j0 + n_in - 1) {
            match r {
                8 => values_tile::<V, 8>(o, hd, c, n_in, r0),
                4 => values_tile::<V, 4>(o, hd, c, n_in, r0),
                2 => values_tile::<V, 2>(o, hd, c, n_in, r0),
                _ => values_tile::<V, 1>(o, hd, c, n_in, r0),
            }
        } else {
            for x in r0..r0 + r {
                let visible = (c.last[x] as usize + 1).saturating_sub(c.j0).min(n_in);
                values_tile::<V, 1>(o, hd, c, visible, x);
            }
        }
        r0 += r;
    }
}

/// [`accumulate_values`] for rows `r0..r0 + R` and the chunk's first `n_keys` keys, two
/// or one vectors of 16 head dimensions at a time (then the dimensions past the last
/// multiple of 16 one by one).
#[inline(always)]
fn values_tile<V: F32x16, const R: usize>(o: &mut [f32], hd: usize, c: &ChunkValues, n_keys: usize, r0: usize) {
    debug_assert!(r0 + R <= c.np && n_keys <= c.n_in);
    let full = hd - hd % LANES;
    // Two vectors of dimensions at a time where they fit: each probability, broadcast
    // once, feeds two multiply-adds.
    let mut d0 = 0;
    while d0 + 2 * LANES <= full {
        values_block::<V, R, 2>(o, hd, c, n_keys, r0, d0);
        d0 += 2 * LANES;
    }
    if d0 < full {
        values_block::<V, R, 1>(o, hd, c, n_keys, r0, d0);
    }
    for d in full..hd {
        for x in 0..R {
            let mut a = o[(r0 + x) * hd + d] * c.alpha[r0 + x];
            for jj in 0..n_keys {
                a = c.p[jj * c.np + r0 + x].mul_add(c.v[jj * hd + d], a);
            }
            o[(r0 + x) * hd + d] = a;
        }
    }
}

/// [`values_tile`] for dimensions `d0..d0 + 16 W`: `R × W` accumulators.
#[inline(always)]
fn values_block<V: F32x16, const R: usize, const W: usize>(
    o: &mut [f32],
    hd: usize,
    c: &ChunkValues,
    n_keys: usize,
    r0: usize,
    d0: usize,
) {
    let (p, np, v) = (c.p, c.np, c.v);
    let mut acc = [[V::splat(0.0); W]; R];
    for (x, a) in acc.iter_mut().enumerate() {
        let at = (r0 + x) * hd + d0;
        assert!(at + W * LANES <= o.len());
        let ax = V::splat(c.alpha[r0 + x]);
        for (w, aw) in a.iter_mut().enumerate() {
            // SAFETY: in bounds (asserted).
            *aw = unsafe { V::load(o.as_ptr().add(at + w * LANES)) }.mul(ax);
        }
    }
    for jj in 0..n_keys {
        let mut vv = [V::splat(0.0); W];
        for (w, vw) in vv.iter_mut().enumerate() {
            // SAFETY: jj < n_in and d0 + W * LANES <= hd: within v (asserted by the caller).
            *vw = unsafe { V::load(v.as_ptr().add(jj * hd + d0 + w * LANES)) };
        }
        for (x, a) in acc.iter_mut().enumerate() {
            // SAFETY: jj < n_in and r0 + x < np: within p (asserted by the caller).
            let px = V::splat(unsafe { *p.get_unchecked(jj * np + r0 + x) });
            for (aw, vw) in a.iter_mut().zip(&vv) {
                *aw = px.mul_add(*vw, *aw);
            }
        }
    }
    for (x, a) in acc.iter().enumerate() {
        for (w, aw) in a.iter().enumerate() {
            // SAFETY: as for the load above.
            unsafe { aw.store(o.as_mut_ptr().add((r0 + x) * hd + d0 + w * LANES)) };
        }
    }
}

#[allow(clippy::needless_range_loop)]
/// One attention task of the kernel before [`flash_task`] (`DISAGG_CPU_FLASH_ATTN=0`):
/// the same rows, in two passes over the cache blocks (scores of every key, then
/// values), each block converted to f32 once for all rows.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
pub(super) fn two_pass_task(
    batch: &StepBatch,
    attn: &AttnShape,
    kv: &CpuKv,
    bytes: &[u8],
    qkv: &[f32],
    out: SendPtr<f32>,
    s: usize,
    tile: usize,
    kvh: usize,
    sc: &mut AttnScratch,
) {
    let span = &batch.seqs[s];
    let hd = attn.head_dim;
    let g = attn.n_heads / attn.n_kv_heads;
    let (qd, w) = (attn.q_dim(), attn.qkv_dim());
    let bs = batch.block_size;
    let t0 = tile * ATTN_QUERY_TILE;
    let nt = (span.rows.len() - t0).min(ATTN_QUERY_TILE);
    let pos_first = span.pos0 + t0;
    let n_ctx = pos_first + nt; // keys visible to the last row of the tile
    let n_rows = nt * g;
    sc.scores.resize(n_rows * n_ctx, 0.0);
    sc.kbuf.resize(bs * hd, 0.0);
    let dtype = kv.shape.dtype;
    let es = dtype.bytes();
    let v_base = kv.half_bytes();
    let q_at = |i: usize, h: usize| {
        let row = span.rows.start + t0 + i;
        row * w + (kvh * g + h) * hd
    };

    // Pass 1: scores.
    for blk in 0..n_ctx.div_ceil(bs) {
        let first = blk * bs;
        let n_in = (n_ctx - first).min(bs);
        let at = kv.offset(span.block_table[blk] as usize, kvh, 0);
        kv_to_f32(dtype, &bytes[at..at + n_in * hd * es], &mut sc.kbuf[..n_in * hd]);
        for i in 0..nt {
            let limit = (pos_first + i + 1).min(first + n_in);
            for h in 0..g {
                let q = &qkv[q_at(i, h)..q_at(i, h) + hd];
                let srow = &mut sc.scores[(i * g + h) * n_ctx..(i * g + h + 1) * n_ctx];
                for j in first..limit {
                    srow[j] = dot16(q, &sc.kbuf[(j - first) * hd..(j - first + 1) * hd]) * attn.scale;
                }
            }
        }
    }
    // Softmax numerators and sums, per row in key order.
    let mut sums = [0f32; ATTN_QUERY_TILE * 8];
    let mut sums_big;
    let sums: &mut [f32] = if n_rows <= sums.len() {
        &mut sums[..n_rows]
    } else {
        sums_big = vec![0f32; n_rows];
        &mut sums_big
    };
    for i in 0..nt {
        let n_keys = pos_first + i + 1;
        for h in 0..g {
            let srow = &mut sc.scores[(i * g + h) * n_ctx..(i * g + h) * n_ctx + n_keys];
            let max = srow.iter().fold(f32::NEG_INFINITY, |m, v| m.max(*v));
            let mut sum = 0f32;
            for v in srow.iter_mut() {
                *v = exp_f32(*v - max);
                sum += *v;
            }
            sums[i * g + h] = sum;
        }
    }
    // Pass 2: weighted values.
    for i in 0..nt {
        for h in 0..g {
            let o = out.get();
            let row = span.rows.start + t0 + i;
            // SAFETY: this task alone writes the heads of `kvh` for its tile's rows.
            let orow = unsafe { std::slice::from_raw_parts_mut(o.add(row * qd + (kvh * g + h) * hd), hd) };
            orow.fill(0.0);
        }
    }
    for blk in 0..n_ctx.div_ceil(bs) {
        let first = blk * bs;
        let n_in = (n_ctx - first).min(bs);
        let at = v_base + kv.offset(span.block_table[blk] as usize, kvh, 0);
        kv_to_f32(dtype, &bytes[at..at + n_in * hd * es], &mut sc.kbuf[..n_in * hd]);
        for i in 0..nt {
            let limit = (pos_first + i + 1).min(first + n_in);
            let row = span.rows.start + t0 + i;
            for h in 0..g {
                let srow = &sc.scores[(i * g + h) * n_ctx..(i * g + h + 1) * n_ctx];
                // SAFETY: as above.
                let orow = unsafe { std::slice::from_raw_parts_mut(out.get().add(row * qd + (kvh * g + h) * hd), hd) };
                for j in first..limit {
                    let p = srow[j];
                    let v = &sc.kbuf[(j - first) * hd..(j - first + 1) * hd];
                    for (o, vv) in orow.iter_mut().zip(v) {
                        *o = p.mul_add(*vv, *o);
                    }
                }
            }
        }
    }
    for i in 0..nt {
        let row = span.rows.start + t0 + i;
        for h in 0..g {
            let inv = 1.0 / sums[i * g + h];
            // SAFETY: as above.
            let orow = unsafe { std::slice::from_raw_parts_mut(out.get().add(row * qd + (kvh * g + h) * hd), hd) };
            for o in orow.iter_mut() {
                *o *= inv;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The softmax's two forms on a chunk every row sees whole give the same bits: rows
    /// that have seen no key yet (maximum −∞), scores of ±inf and NaN, a row whose
    /// maximum moves and one whose does not.
    #[test]
    fn whole_chunk_softmax_equals_the_masked_form() {
        let (np, n_in, j0) = (2 * LANES, KEY_CHUNK, 32);
        let mut seed = 0x9e37_79b9_u32;
        let mut rnd = move || {
            seed ^= seed << 13;
            seed ^= seed >> 17;
            seed ^= seed << 5;
            (seed as f32 / u32::MAX as f32 - 0.5) * 20.0
        };
        let mut s: Vec<f32> = (0..n_in * np).map(|_| rnd()).collect();
        s[3 * np + 1] = f32::INFINITY;
        s[5 * np + 2] = f32::NEG_INFINITY;
        s[7 * np + 4] = f32::NAN;
        let m: Vec<f32> =
            (0..np).map(|r| if r % 3 == 0 { f32::NEG_INFINITY } else { rnd() + 5.0 * (r % 2) as f32 }).collect();
        let l: Vec<f32> = (0..np).map(|r| if r % 3 == 0 { 0.0 } else { 1.0 + rnd().abs() }).collect();
        // Every row sees past the chunk's last key.
        let last: Vec<u32> = (0..np).map(|r| (j0 + n_in - 1 + r % 4) as u32).collect();
        let run = |fast: bool| {
            let (mut s, mut m, mut l, mut alpha) = (s.clone(), m.clone(), l.clone(), vec![0f32; np]);
            online_softmax(&mut s, np, j0, n_in, &last, &mut m, &mut l, &mut alpha, fast);
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            (bits(&s), bits(&m), bits(&l), bits(&alpha))
        };
        let (whole, masked) = (run(true), run(false));
        assert!(whole == masked, "the whole-chunk form changed bits");
        // The inputs reach the cases named above.
        assert!(whole.2.iter().any(|&b| f32::from_bits(b).is_nan()) && whole.3.contains(&0));
    }
}
