//! The CPU backend: packed quantized weights, SIMD kernels chosen at run time, a
//! persistent thread pool, and the paged KV cache in host memory.

pub mod isa;
pub mod matmul;
pub mod ops;
pub mod packed;
pub mod pool;

use std::cell::UnsafeCell;

use attn::{
    flash_attention, merge_partials, partial_len, two_pass_task, AttnScratch, AttnTask, ATTN_QUERY_TILE, SEGMENT,
};
pub use isa::Isa;
use matmul::{matmul, Input, MatmulMode, OutSpec, Q8Acts, SendPtr};
use ops::{f32_to_kv, kv_to_f32, rms_norm_rows, rope_head, silu_mul_rows};
pub use packed::{PackedKind, PackedMatrix, TILE_ROWS};
pub use pool::ThreadPool;

use crate::backend::{AttnShape, Backend, KvShape, Rope, StepBatch, WeightPart};
use crate::quant::GgmlType;
use crate::KernelError;

/// Defines `$name(isa, args…)`, which runs the `#[inline(always)]` function `$body`
/// inside a copy compiled for the ISA, so its plain-Rust loops (and `mul_add`) are
/// vectorised for that ISA instead of calling libm. The second form names the callee per
/// ISA (AVX-512, AVX2, scalar), e.g. a generic kernel with that ISA's lane type.
macro_rules! isa_variants {
    ($vis:vis fn $name:ident => $body:ident ( $($arg:ident : $ty:ty),* $(,)? )) => {
        isa_variants!($vis fn $name => {$body} {$body} {$body} ($($arg: $ty),*));
    };
    ($vis:vis fn $name:ident => {$($b512:tt)*} {$($b2:tt)*} {$($bs:tt)*} ( $($arg:ident : $ty:ty),* $(,)? )) => {
        #[allow(clippy::too_many_arguments)]
        $vis fn $name(isa: Isa, $($arg: $ty),*) {
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx512f,avx512bw,avx512vl,fma,f16c")]
                #[allow(clippy::too_many_arguments)]
                unsafe fn avx512($($arg: $ty),*) {
                    $($b512)*($($arg),*)
                }
                #[target_feature(enable = "avx2,fma,f16c")]
                #[allow(clippy::too_many_arguments)]
                unsafe fn avx2($($arg: $ty),*) {
                    $($b2)*($($arg),*)
                }
                // SAFETY: `isa` is above Scalar only when the CPU has these features.
                match isa {
                    Isa::Avx512 => return unsafe { avx512($($arg),*) },
                    Isa::Avx2 => return unsafe { avx2($($arg),*) },
                    Isa::Scalar => {}
                }
            }
            $($bs)*($($arg),*)
        }
    };
}

mod attn;

isa_variants!(fn rms_norm_isa => rms_norm_rows(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]));
isa_variants!(fn silu_mul_isa => silu_mul_rows(gu: &[f32], ff: usize, out: &mut [f32]));
isa_variants!(fn two_pass_attention_isa => two_pass_task(
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
));

/// A weight matrix of one or more packed parts stacked by rows.
pub struct CpuLinear {
    pub rows: usize,
    pub cols: usize,
    /// (first output row, matrix)
    pub parts: Vec<(usize, PackedMatrix)>,
}

impl CpuLinear {
    pub fn n_bytes(&self) -> usize {
        self.parts.iter().map(|(_, p)| p.n_bytes()).sum()
    }

    pub fn dequantize_row(&self, r: usize, out: &mut [f32]) {
        let (r0, part) = self.parts.iter().rev().find(|(r0, _)| *r0 <= r).expect("row in range");
        part.dequantize_row(r - r0, out);
    }
}

/// The KV cache: per layer, keys then values, each `[block][kv_head][slot][head_dim]`.
pub struct CpuKv {
    pub shape: KvShape,
    /// Per layer; u64 storage keeps f16/f32 elements aligned.
    layers: Vec<Vec<u64>>,
}

impl CpuKv {
    fn half_bytes(&self) -> usize {
        self.shape.n_blocks
            * self.shape.block_size
            * self.shape.n_kv_heads
            * self.shape.head_dim
            * self.shape.dtype.bytes()
    }

    fn layer_bytes(&self, layer: usize) -> &[u8] {
        let v = &self.layers[layer];
        // SAFETY: plain integers viewed as bytes.
        unsafe { std::slice::from_raw_parts(v.as_ptr() as *const u8, v.len() * 8) }
    }

    fn layer_bytes_mut(&mut self, layer: usize) -> &mut [u8] {
        let v = &mut self.layers[layer];
        // SAFETY: as above.
        unsafe { std::slice::from_raw_parts_mut(v.as_mut_ptr() as *mut u8, v.len() * 8) }
    }

    /// Bytes of one block's keys (or values) in one layer.
    fn block_bytes_half(&self) -> usize {
        self.shape.block_bytes_per_layer() / 2
    }

    /// Byte offset of (block, head, slot-in-block) inside the K (or V) half of a layer.
    #[inline]
    fn offset(&self, block: usize, head: usize, off: usize) -> usize {
        let s = &self.shape;
        ((block * s.n_kv_heads + head) * s.block_size + off) * s.head_dim * s.dtype.bytes()
    }

    /// Copies keys and values of one block of one layer out as f32, `[kv_head][slot][dim]`
    /// each (for tests and, later, transfers).
    pub fn read_block(&self, layer: usize, block: usize, k: &mut [f32], v: &mut [f32]) {
        let s = self.shape;
        let n = s.n_kv_heads * s.block_size * s.head_dim;
        let es = s.dtype.bytes();
        let base = self.offset(block, 0, 0);
        let bytes = self.layer_bytes(layer);
        kv_to_f32(s.dtype, &bytes[base..base + n * es], &mut k[..n]);
        let vb = self.half_bytes() + base;
        kv_to_f32(s.dtype, &bytes[vb..vb + n * es], &mut v[..n]);
    }
}

/// Scratch that each pool thread owns (indexed by thread id).
struct PerThread<T>(Vec<UnsafeCell<T>>);
// SAFETY: thread `i` of a pool run touches only element `i`.
unsafe impl<T: Send> Sync for PerThread<T> {}
impl<T> PerThread<T> {
    /// # Safety
    /// Only the pool thread `tid` may call this with `tid`, once at a time.
    #[allow(clippy::mut_from_ref)]
    unsafe fn get(&self, tid: usize) -> &mut T {
        &mut *self.0[tid].get()
    }
}

pub struct CpuBackend {
    pool: ThreadPool,
    isa: Isa,
    mode: MatmulMode,
    q8: Q8Acts,
    attn_scratch: PerThread<AttnScratch>,
    /// The attention kernel: the flash kernel (default) or the two-pass kernel before it.
    flash_attn: bool,
    /// Whether decode rows may be split into tasks per segment (`DISAGG_CPU_ATTN_SPLIT`),
    /// and the split tasks' segment states (see `attn::AttnTask`).
    attn_split: bool,
    attn_partials: Vec<f32>,
    /// cos/sin per token of the current step: `[token][head_dim/2]` each.
    rope_cos: Vec<f32>,
    rope_sin: Vec<f32>,
    /// Deferred sampling ([`Backend::sample_rows_deferred`]): allowed
    /// (`DISAGG_ASYNC_SCHEDULING=1`, or [`CpuBackend::set_defer_sampling`]), the samples not
    /// read yet (oldest first), and this step's ids with the fed rows filled in (empty
    /// when the step has none).
    defer: bool,
    deferred: std::collections::VecDeque<Vec<u32>>,
    fed_ids: Vec<u32>,
}

impl CpuBackend {
    /// A backend with `n_threads` threads, the ISA from [`Isa::current`] and the matmul
    /// mode from the environment.
    pub fn new(n_threads: usize) -> Self {
        Self::with_options(n_threads, Isa::current(), MatmulMode::from_env())
    }

    pub fn with_options(n_threads: usize, isa: Isa, mode: MatmulMode) -> Self {
        let pool = ThreadPool::new(n_threads);
        let n = pool.n_threads();
        CpuBackend {
            pool,
            isa: isa.min(Isa::best_supported()),
            mode,
            q8: Q8Acts::default(),
            attn_scratch: PerThread((0..n).map(|_| UnsafeCell::new(AttnScratch::default())).collect()),
            flash_attn: attn::flash_enabled(),
            attn_split: std::env::var(crate::env::CPU_ATTN_SPLIT).map_or(true, |v| v != "0"),
            attn_partials: Vec::new(),
            rope_cos: Vec::new(),
            rope_sin: Vec::new(),
            defer: std::env::var(crate::env::ASYNC_SCHEDULING).is_ok_and(|v| v == "1"),
            deferred: Default::default(),
            fed_ids: Vec::new(),
        }
    }

    /// Allows deferred sampling, so that an engine on this backend schedules
    /// asynchronously (off by default: a CPU step runs on the host, so there is nothing
    /// to overlap; tests turn it on to check the engine's async path).
    pub fn set_defer_sampling(&mut self, on: bool) {
        self.defer = on;
    }

    /// Chooses the attention kernel: the flash kernel (`true`, the default unless
    /// `DISAGG_CPU_FLASH_ATTN=0`) or the two-pass kernel before it (tests compare both).
    pub fn set_flash_attention(&mut self, on: bool) {
        self.flash_attn = on;
    }

    pub fn n_threads(&self) -> usize {
        self.pool.n_threads()
    }

    pub fn isa(&self) -> Isa {
        self.isa
    }

    pub fn pool(&self) -> &ThreadPool {
        &self.pool
    }

    /// Computes this step's rotary cos/sin tables (once per step, shared by all layers).
    fn prepare_rope(&mut self, batch: &StepBatch, rope: &Rope) {
        let half = rope.inv_freq.len();
        self.rope_cos.resize(batch.n_tokens * half, 0.0);
        self.rope_sin.resize(batch.n_tokens * half, 0.0);
        for span in batch.seqs {
            for (i, row) in span.rows.clone().enumerate() {
                let pos = (span.pos0 + i) as f32;
                for (j, f) in rope.inv_freq.iter().enumerate() {
                    // The angle is rounded to f32 as the float references compute it.
                    let angle = (pos * f) as f64;
                    self.rope_cos[row * half + j] = angle.cos() as f32;
                    self.rope_sin[row * half + j] = angle.sin() as f32;
                }
            }
        }
    }
}

impl Backend for CpuBackend {
    type Linear = CpuLinear;
    type Vector = Vec<f32>;
    type Act = Vec<f32>;
    type Kv = CpuKv;

    fn describe(&self) -> String {
        format!(
            "cpu threads={} isa={} matmul={}",
            self.pool.n_threads(),
            self.isa.name(),
            match self.mode {
                MatmulMode::Q8 => "q8",
                MatmulMode::F32 => "f32",
            }
        )
    }

    fn linear(&self, parts: &[WeightPart]) -> Result<CpuLinear, KernelError> {
        let cols = parts.first().map(|p| p.cols).unwrap_or(0);
        if parts.iter().any(|p| p.cols != cols) {
            return Err(KernelError::Shape("stacked matrices must have the same number of columns".into()));
        }
        // Merge runs of parts of the same type into one packed matrix: fewer passes.
        let mut out = Vec::new();
        let mut row = 0;
        let mut i = 0;
        while i < parts.len() {
            let ty: GgmlType = parts[i].ty;
            let mut j = i;
            let mut bytes = Vec::new();
            let mut rows = 0;
            while j < parts.len() && parts[j].ty == ty {
                bytes.extend_from_slice(parts[j].bytes);
                rows += parts[j].rows;
                j += 1;
            }
            out.push((row, PackedMatrix::from_ggml(ty, rows, cols, &bytes)?));
            row += rows;
            i = j;
        }
        Ok(CpuLinear { rows: row, cols, parts: out })
    }

    fn vector(&self, v: &[f32]) -> Vec<f32> {
        v.to_vec()
    }

    fn act(&self, len: usize) -> Result<Vec<f32>, KernelError> {
        Ok(vec![0.0; len])
    }

    fn kv_shape(&self, kv: &CpuKv) -> KvShape {
        kv.shape
    }

    fn kv_export(&mut self, kv: &CpuKv, layer: usize, blocks: &[u32], out: &mut Vec<u8>) {
        let half = kv.block_bytes_half();
        let (k0, bytes) = (0, kv.layer_bytes(layer));
        out.reserve(blocks.len() * 2 * half);
        for &b in blocks {
            let o = kv.offset(b as usize, 0, 0);
            out.extend_from_slice(&bytes[k0 + o..k0 + o + half]);
            let v = kv.half_bytes() + o;
            out.extend_from_slice(&bytes[v..v + half]);
        }
    }

    fn kv_import(&mut self, kv: &mut CpuKv, layer: usize, blocks: &[u32], data: &[u8]) {
        let half = kv.block_bytes_half();
        assert_eq!(data.len(), blocks.len() * 2 * half, "KV import of {} blocks", blocks.len());
        let vh = kv.half_bytes();
        let offsets: Vec<usize> = blocks.iter().map(|&b| kv.offset(b as usize, 0, 0)).collect();
        let bytes = kv.layer_bytes_mut(layer);
        for (o, src) in offsets.into_iter().zip(data.chunks_exact(2 * half)) {
            bytes[o..o + half].copy_from_slice(&src[..half]);
            bytes[vh + o..vh + o + half].copy_from_slice(&src[half..]);
        }
    }

    fn kv_cache(&self, shape: KvShape) -> Result<CpuKv, KernelError> {
        let per_layer = shape.n_blocks * shape.block_bytes_per_layer();
        let words = per_layer.div_ceil(8);
        let mut layers = Vec::with_capacity(shape.n_layers);
        for _ in 0..shape.n_layers {
            let mut v = Vec::new();
            v.try_reserve_exact(words).map_err(|_| {
                KernelError::OutOfMemory(format!(
                    "KV cache of {} MiB does not fit in host memory; lower --kv-cache-mib",
                    shape.total_bytes() >> 20
                ))
            })?;
            v.resize(words, 0u64);
            layers.push(v);
        }
        Ok(CpuKv { shape, layers })
    }

    fn begin_step(&mut self, tokens: &[u32], batch: &StepBatch, _: &Rope, _: &AttnShape, _: &[u32]) {
        self.fed_ids.clear();
        if !batch.fed.is_empty() {
            let last = self.deferred.back().expect("fed tokens without a deferred sample");
            self.fed_ids.extend_from_slice(tokens);
            for f in batch.fed {
                self.fed_ids[f.row as usize] = last[f.from as usize];
            }
        }
    }

    fn embed(&mut self, table: &CpuLinear, ids: &[u32], out: &mut Vec<f32>) {
        let dim = table.cols;
        let ids = if self.fed_ids.is_empty() { ids } else { &self.fed_ids[..] };
        for (t, &id) in ids.iter().enumerate() {
            table.dequantize_row(id as usize, &mut out[t * dim..(t + 1) * dim]);
        }
    }

    fn rms_norm(&mut self, x: &Vec<f32>, w: &Vec<f32>, eps: f32, n_tokens: usize, out: &mut Vec<f32>) {
        let dim = w.len();
        let isa = self.isa;
        let rows_per_task = 64;
        let n_tasks = n_tokens.div_ceil(rows_per_task);
        let optr = SendPtr(out.as_mut_ptr());
        self.pool.run(n_tasks, |task, _| {
            let (r0, r1) = (task * rows_per_task, ((task + 1) * rows_per_task).min(n_tokens));
            // SAFETY: tasks write disjoint row ranges of `out`.
            let o = unsafe { std::slice::from_raw_parts_mut(optr.get().add(r0 * dim), (r1 - r0) * dim) };
            rms_norm_isa(isa, &x[r0 * dim..r1 * dim], w, eps, o);
        });
    }

    fn matmul(&mut self, w: &CpuLinear, x: &Vec<f32>, n_tokens: usize, out: &mut Vec<f32>, accumulate: bool) {
        let needs_q8 = self.mode == MatmulMode::Q8 && w.parts.iter().any(|(_, p)| p.kind.is_quantized());
        if needs_q8 {
            self.q8.quantize(&self.pool, self.isa, x, n_tokens, w.cols);
        }
        let input = Input { x, q8: needs_q8.then_some(&self.q8), n_tokens };
        for (row0, part) in &w.parts {
            matmul(
                &self.pool,
                self.isa,
                self.mode,
                part,
                &input,
                OutSpec { out: &mut out[..], ld: w.rows, col0: *row0, accumulate },
            );
        }
    }

    fn rope_write_kv(
        &mut self,
        qkv: &mut Vec<f32>,
        layer: usize,
        batch: &StepBatch,
        rope: &Rope,
        attn: &AttnShape,
        kv: &mut CpuKv,
    ) {
        if layer == 0 {
            self.prepare_rope(batch, rope);
        }
        let (hd, qd, kvd, w) = (attn.head_dim, attn.q_dim(), attn.kv_dim(), attn.qkv_dim());
        let half = hd / 2;
        let dtype = kv.shape.dtype;
        let es = dtype.bytes();
        let v_base = kv.half_bytes();
        // Tasks: runs of up to 32 tokens of one sequence; each owns its rows of `qkv`
        // and its tokens' KV slots.
        let mut tasks = Vec::new();
        for (s, span) in batch.seqs.iter().enumerate() {
            let mut i = 0;
            while i < span.rows.len() {
                let n = (span.rows.len() - i).min(32);
                tasks.push((s, i, i + n));
                i += n;
            }
        }
        let qkv_ptr = SendPtr(qkv.as_mut_ptr());
        let kv_bytes = kv.layer_bytes_mut(layer);
        let (kv_ptr, kv_len) = (SendPtr(kv_bytes.as_mut_ptr()), kv_bytes.len());
        let (cos_all, sin_all) = (&self.rope_cos, &self.rope_sin);
        let kv_ref = &*kv;
        self.pool.run(tasks.len(), |task, _| {
            let (s, i0, i1) = tasks[task];
            let span = &batch.seqs[s];
            for i in i0..i1 {
                let row = span.rows.start + i;
                let pos = span.pos0 + i;
                let (cos, sin) = (&cos_all[row * half..(row + 1) * half], &sin_all[row * half..(row + 1) * half]);
                // SAFETY: each task owns the `qkv` rows and KV slots of its tokens.
                let r = unsafe { std::slice::from_raw_parts_mut(qkv_ptr.get().add(row * w), w) };
                for h in 0..attn.n_heads + attn.n_kv_heads {
                    rope_head(&mut r[h * hd..(h + 1) * hd], cos, sin, rope.interleaved);
                }
                let slot = batch.slot(s, pos);
                let (block, off) = (slot / batch.block_size, slot % batch.block_size);
                for h in 0..attn.n_kv_heads {
                    let at = kv_ref.offset(block, h, off);
                    assert!(v_base + at + hd * es <= kv_len);
                    // SAFETY: in bounds (asserted) and owned by this task (see above).
                    let (kd, vd) = unsafe {
                        (
                            std::slice::from_raw_parts_mut(kv_ptr.get().add(at), hd * es),
                            std::slice::from_raw_parts_mut(kv_ptr.get().add(v_base + at), hd * es),
                        )
                    };
                    f32_to_kv(dtype, &r[qd + h * hd..qd + (h + 1) * hd], kd);
                    f32_to_kv(dtype, &r[qd + kvd + h * hd..qd + kvd + (h + 1) * hd], vd);
                }
            }
        });
    }

    fn attention(
        &mut self,
        qkv: &Vec<f32>,
        layer: usize,
        batch: &StepBatch,
        attn: &AttnShape,
        kv: &mut CpuKv,
        out: &mut Vec<f32>,
    ) {
        let (isa, flash) = (self.isa, self.flash_attn);
        // Tasks: (sequence, query tile, kv head). With the flash kernel, when these would
        // leave threads idle (under 90% of the pool busy, counting tasks as equal), a
        // decode row whose context spans several segments becomes a task per segment
        // (`groups`: the first task of each such split and its count): the same bits,
        // more tasks.
        let n_tiles: usize = batch.seqs.iter().map(|sp| sp.rows.len().div_ceil(ATTN_QUERY_TILE)).sum();
        let (n_unsplit, threads) = (n_tiles * attn.n_kv_heads, self.pool.n_threads());
        let busy = n_unsplit as f64 / (threads * n_unsplit.div_ceil(threads)).max(1) as f64;
        let may_split = flash && self.attn_split && busy < 0.9;
        let g = attn.n_heads / attn.n_kv_heads;
        let (mut tasks, mut groups, mut n_partial) = (Vec::new(), Vec::new(), 0);
        for (s, span) in batch.seqs.iter().enumerate() {
            let n = span.rows.len();
            for tile in 0..n.div_ceil(ATTN_QUERY_TILE) {
                let t0 = tile * ATTN_QUERY_TILE;
                let n_seg = (span.pos0 + (t0 + ATTN_QUERY_TILE).min(n)).div_ceil(SEGMENT);
                let split = may_split && n_seg > 1 && n - t0 == 1;
                for kvh in 0..attn.n_kv_heads {
                    if !split {
                        tasks.push(AttnTask { s, tile, kvh, split: None });
                        continue;
                    }
                    groups.push((tasks.len(), n_seg));
                    for seg in 0..n_seg {
                        tasks.push(AttnTask { s, tile, kvh, split: Some((seg, n_partial)) });
                        n_partial += partial_len(g, attn.head_dim);
                    }
                }
            }
        }
        self.attn_partials.resize(n_partial, 0.0);
        let optr = SendPtr(out.as_mut_ptr());
        let pptr = SendPtr(self.attn_partials.as_mut_ptr());
        let scratch = &self.attn_scratch;
        let bytes = kv.layer_bytes(layer);
        self.pool.run(tasks.len(), |task, tid| {
            let t = tasks[task];
            // SAFETY: thread `tid` is the only user of its scratch during this run.
            let sc = unsafe { scratch.get(tid) };
            if flash {
                flash_attention(isa, batch, attn, kv, bytes, qkv, optr, pptr, t, sc);
            } else {
                two_pass_attention_isa(isa, batch, attn, kv, bytes, qkv, optr, t.s, t.tile, t.kvh, sc);
            }
        });
        merge_partials(batch, attn, &tasks, &groups, &self.attn_partials, out);
    }

    fn silu_mul(&mut self, gu: &Vec<f32>, n_tokens: usize, ff: usize, out: &mut Vec<f32>) {
        let isa = self.isa;
        let rows_per_task = 16;
        let n_tasks = n_tokens.div_ceil(rows_per_task);
        let optr = SendPtr(out.as_mut_ptr());
        self.pool.run(n_tasks, |task, _| {
            let (r0, r1) = (task * rows_per_task, ((task + 1) * rows_per_task).min(n_tokens));
            // SAFETY: tasks write disjoint row ranges.
            let o = unsafe { std::slice::from_raw_parts_mut(optr.get().add(r0 * ff), (r1 - r0) * ff) };
            silu_mul_isa(isa, &gu[r0 * 2 * ff..r1 * 2 * ff], ff, o);
        });
    }

    fn gather_rows(&mut self, x: &Vec<f32>, rows: &[u32], dim: usize, out: &mut Vec<f32>) {
        for (i, &r) in rows.iter().enumerate() {
            let r = r as usize;
            out[i * dim..(i + 1) * dim].copy_from_slice(&x[r * dim..(r + 1) * dim]);
        }
    }

    fn to_host(&mut self, x: &Vec<f32>, out: &mut [f32]) {
        out.copy_from_slice(&x[..out.len()]);
    }

    fn defers_sampling(&self) -> bool {
        self.defer
    }

    fn sample_rows_deferred(&mut self, x: &Vec<f32>, dim: usize, rows: usize) {
        assert!(self.defer, "deferred sampling is off");
        self.deferred.push_back((0..rows).map(|r| crate::backend::argmax(&x[r * dim..(r + 1) * dim])).collect());
    }

    fn collect_sampled(&mut self, out: &mut Vec<u32>) {
        *out = self.deferred.pop_front().expect("no deferred sample to collect");
    }
}
