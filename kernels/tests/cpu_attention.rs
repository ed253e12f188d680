//! The CPU attention kernels (flash and two-pass, every ISA) against an f64 reference
//! over the same paged cache: prefill tiles, decode rows, chunked prefill on a cached
//! prefix, mixed batches; several head dims, GQA ratios, block sizes and cache types.
//! And batch invariance at the kernel: a token's output bits alone, in a chunk, or in
//! its whole prompt.

use kernels::cpu::matmul::MatmulMode;
use kernels::cpu::ops::{f32_to_kv, kv_to_f32};
use kernels::cpu::{CpuBackend, Isa};
use kernels::{AttnShape, Backend, KvDtype, KvShape, SeqSpan, StepBatch};
use rand_chacha::ChaCha8Rng;
use rand_core::{RngCore, SeedableRng};

struct Case {
    n_kv_heads: usize,
    group: usize,
    head_dim: usize,
    block_size: usize,
    dtype: KvDtype,
    /// Scales the queries: large values make scores of ±50 and more, where a softmax
    /// without its maximum would overflow.
    q_scale: f32,
    /// (cached positions before the step, rows in the step) per sequence.
    seqs: &'static [(usize, usize)],
}

fn uniform(rng: &mut ChaCha8Rng, n: usize, scale: f32) -> Vec<f32> {
    (0..n).map(|_| (rng.next_u32() as f32 / u32::MAX as f32 - 0.5) * 2.0 * scale).collect()
}

/// Runs `case` on the CPU backend and returns the worst error relative to the largest
/// |reference output|, and the output.
fn worst_error(case: &Case, isa: Isa, flash: bool, seed: u64) -> (f64, Vec<f32>) {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let (kvh, g, hd, bs) = (case.n_kv_heads, case.group, case.head_dim, case.block_size);
    let attn = AttnShape { n_heads: kvh * g, n_kv_heads: kvh, head_dim: hd, scale: 1.0 / (hd as f32).sqrt() };
    // Disjoint block tables, blocks in a scrambled order.
    let n_blocks: usize = case.seqs.iter().map(|&(p0, n)| (p0 + n).div_ceil(bs)).sum();
    let mut order: Vec<u32> = (0..n_blocks as u32).collect();
    for i in (1..order.len()).rev() {
        order.swap(i, rng.next_u32() as usize % (i + 1));
    }
    let mut tables = Vec::new();
    let mut at = 0;
    for &(p0, n) in case.seqs {
        let nb = (p0 + n).div_ceil(bs);
        tables.push(order[at..at + nb].to_vec());
        at += nb;
    }
    let shape = KvShape { n_layers: 1, n_blocks, block_size: bs, n_kv_heads: kvh, head_dim: hd, dtype: case.dtype };
    // The cache in the transfer layout (per block: keys then values, `[kv_head][slot][dim]`),
    // every slot filled (a slot past a sequence's length must not matter), and the values
    // as the cache holds them.
    let half = bs * kvh * hd;
    let mut bytes = vec![0u8; n_blocks * 2 * half * case.dtype.bytes()];
    let mut held = vec![0f32; n_blocks * 2 * half];
    let raw = uniform(&mut rng, held.len(), 1.0);
    f32_to_kv(case.dtype, &raw, &mut bytes);
    kv_to_f32(case.dtype, &bytes, &mut held);
    let n_tokens: usize = case.seqs.iter().map(|s| s.1).sum();
    let qkv = uniform(&mut rng, n_tokens * attn.qkv_dim(), case.q_scale);

    let mut cpu = CpuBackend::with_options(2, isa, MatmulMode::Q8);
    cpu.set_flash_attention(flash);
    let mut kv = cpu.kv_cache(shape).unwrap();
    cpu.kv_import(&mut kv, 0, &(0..n_blocks as u32).collect::<Vec<_>>(), &bytes);
    let mut spans = Vec::new();
    let mut row = 0;
    for (&(p0, n), table) in case.seqs.iter().zip(&tables) {
        spans.push(SeqSpan { rows: row..row + n, pos0: p0, block_table: table });
        row += n;
    }
    let batch = StepBatch { n_tokens, seqs: &spans, block_size: bs, fed: &[] };
    let mut out = vec![f32::NAN; n_tokens * attn.q_dim()];
    cpu.attention(&qkv, 0, &batch, &attn, &mut kv, &mut out);

    // The reference, in f64.
    let key = |table: &[u32], pos: usize, h: usize, v: bool| {
        let b = table[pos / bs] as usize;
        let at = b * 2 * half + if v { half } else { 0 } + (h * bs + pos % bs) * hd;
        &held[at..at + hd]
    };
    let mut want = vec![0f64; out.len()];
    for (span, &(p0, _)) in spans.iter().zip(case.seqs) {
        for (i, row) in span.rows.clone().enumerate() {
            let pos = p0 + i;
            for hq in 0..kvh * g {
                let h = hq / g;
                let q = &qkv[row * attn.qkv_dim() + hq * hd..][..hd];
                let scores: Vec<f64> = (0..=pos)
                    .map(|j| {
                        let k = key(span.block_table, j, h, false);
                        q.iter().zip(k).map(|(a, b)| *a as f64 * *b as f64).sum::<f64>() * attn.scale as f64
                    })
                    .collect();
                let max = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let e: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
                let sum: f64 = e.iter().sum();
                for (j, p) in e.iter().enumerate() {
                    let v = key(span.block_table, j, h, true);
                    for d in 0..hd {
                        want[row * attn.q_dim() + hq * hd + d] += p / sum * v[d] as f64;
                    }
                }
            }
        }
    }
    let range = want.iter().fold(0f64, |m, v| m.max(v.abs()));
    let err = out
        .iter()
        .zip(&want)
        .map(|(a, b)| if a.is_finite() { (*a as f64 - b).abs() / range } else { f64::INFINITY })
        .fold(0f64, f64::max);
    (err, out)
}

#[test]
fn cpu_attention_matches_an_f64_reference() {
    use KvDtype::*;
    let cases = [
        // SmolLM2's heads: a prompt of three tiles, a decode row, a chunk on a cached
        // prefix, and all three in one step.
        Case { n_kv_heads: 3, group: 3, head_dim: 64, block_size: 16, dtype: F16, q_scale: 1.0, seqs: &[(0, 40)] },
        Case { n_kv_heads: 3, group: 3, head_dim: 64, block_size: 16, dtype: F16, q_scale: 1.0, seqs: &[(300, 1)] },
        Case {
            n_kv_heads: 3,
            group: 3,
            head_dim: 64,
            block_size: 16,
            dtype: F16,
            q_scale: 1.0,
            seqs: &[(0, 23), (37, 1), (101, 33), (5, 1)],
        },
        // Llama's heads (GQA 4, head dim 128), f32 cache, blocks of 32 (two key chunks).
        Case {
            n_kv_heads: 2,
            group: 4,
            head_dim: 128,
            block_size: 32,
            dtype: F32,
            q_scale: 1.0,
            seqs: &[(70, 20), (90, 1)],
        },
        // Multi-head (a decode row of one head), blocks of 8, FP8.
        Case {
            n_kv_heads: 4,
            group: 1,
            head_dim: 64,
            block_size: 8,
            dtype: Fp8,
            q_scale: 1.0,
            seqs: &[(0, 17), (50, 1)],
        },
        // Eight heads per KV head (a decode row fills half a vector), a head dim that is
        // not a multiple of 16, blocks of 5.
        Case {
            n_kv_heads: 1,
            group: 8,
            head_dim: 40,
            block_size: 5,
            dtype: F16,
            q_scale: 1.0,
            seqs: &[(33, 2), (0, 9), (60, 1)],
        },
        // Few rows of several tokens (each row its own causal limit) in the keys-on-lanes
        // form: 3 tokens × 2 heads, 2 × 2, 1 × 2, and 5 tokens × 1 head.
        Case {
            n_kv_heads: 2,
            group: 2,
            head_dim: 64,
            block_size: 16,
            dtype: F16,
            q_scale: 1.0,
            seqs: &[(10, 3), (0, 2), (40, 1)],
        },
        Case { n_kv_heads: 3, group: 1, head_dim: 48, block_size: 16, dtype: F32, q_scale: 1.0, seqs: &[(27, 5)] },
        // Scores far from zero (|s| up to ~100): the running maximum must hold them.
        Case {
            n_kv_heads: 2,
            group: 3,
            head_dim: 64,
            block_size: 16,
            dtype: F32,
            q_scale: 25.0,
            seqs: &[(200, 18), (600, 1), (500, 30)],
        },
    ];
    // The first ISA's outputs, per kernel and case: the others must give the same bits.
    let mut first: Vec<Vec<f32>> = Vec::new();
    let isas = [Isa::Avx512, Isa::Avx2, Isa::Scalar].into_iter().filter(|i| *i <= Isa::best_supported());
    for isa in isas {
        for (k, flash) in [true, false].into_iter().enumerate() {
            for (n, case) in cases.iter().enumerate() {
                let (err, out) = worst_error(case, isa, flash, 7 + n as u64);
                let at = k * cases.len() + n;
                if first.len() <= at {
                    first.push(out);
                } else {
                    let same = first[at].iter().zip(&out).all(|(a, b)| a.to_bits() == b.to_bits());
                    assert!(same, "case {n} (flash {flash}): {isa:?} differs from the first ISA's bits");
                }
                // f32 sums of up to ~600 terms: measured ≤ 3e-6 of the range (the large scores).
                assert!(err < 1e-5, "case {n} ({isa:?}, flash {flash}): worst error {err:e} of the output range");
            }
        }
    }
}

/// Batch invariance: a token's attention output has the same bits whether its row comes
/// in a whole prompt's step, in a later chunk of it, or alone as a decode row (whose
/// keys past 512 are split into tasks per segment, merged after them).
#[test]
fn a_tokens_attention_does_not_depend_on_its_step() {
    // Blocks of 16, and of sizes that do not divide a segment (5) or exceed a chunk (32).
    for bs in [16, 5, 32] {
        token_rows_alone_and_in_the_prompt(bs);
    }
}

fn token_rows_alone_and_in_the_prompt(bs: usize) {
    let mut rng = ChaCha8Rng::seed_from_u64(99);
    let (kvh, g, hd, n): (usize, usize, usize, usize) = (3, 3, 64, 1100);
    let attn = AttnShape { n_heads: kvh * g, n_kv_heads: kvh, head_dim: hd, scale: 0.125 };
    let n_blocks = n.div_ceil(bs);
    let shape = KvShape { n_layers: 1, n_blocks, block_size: bs, n_kv_heads: kvh, head_dim: hd, dtype: KvDtype::F16 };
    let raw = uniform(&mut rng, n_blocks * 2 * bs * kvh * hd, 1.0);
    let mut bytes = vec![0u8; raw.len() * 2];
    f32_to_kv(KvDtype::F16, &raw, &mut bytes);
    let table: Vec<u32> = (0..n_blocks as u32).rev().collect();
    // The last token's value of KV head 0 is +inf in one dimension (an f16 cache holds
    // inf past 65504): no earlier token may see it, even in the last token's tile.
    let (last, half) = (n - 1, bs * kvh * hd);
    let at = (table[last / bs] as usize * 2 * half + half + (last % bs) * hd) * 2;
    bytes[at..at + 2].copy_from_slice(&half::f16::INFINITY.to_le_bytes());
    let qkv = uniform(&mut rng, n * attn.qkv_dim(), 3.0);
    let mut cpu = CpuBackend::new(2);
    let mut kv = cpu.kv_cache(shape).unwrap();
    cpu.kv_import(&mut kv, 0, &(0..n_blocks as u32).collect::<Vec<_>>(), &bytes);
    // Rows `first..first + len` of the prompt as one sequence of a step.
    let mut run = |first: usize, len: usize| {
        let spans = [SeqSpan { rows: 0..len, pos0: first, block_table: &table }];
        let batch = StepBatch { n_tokens: len, seqs: &spans, block_size: bs, fed: &[] };
        let rows = &qkv[first * attn.qkv_dim()..(first + len) * attn.qkv_dim()];
        let mut out = vec![0f32; len * attn.q_dim()];
        cpu.attention(&rows.to_vec(), 0, &batch, &attn, &mut kv, &mut out);
        out
    };
    let whole = run(0, n);
    let qd = attn.q_dim();
    assert!(whole[..(n - 1) * qd].iter().all(|x| x.is_finite()), "blocks of {bs}: a token saw a later token's value");
    for (first, len) in [(0, 7), (7, 1), (8, 30), (500, 40), (511, 1), (512, 1), (1024, 1), (1030, 69), (1098, 1)] {
        let part = run(first, len);
        let same = part.iter().zip(&whole[first * qd..(first + len) * qd]).all(|(a, b)| a.to_bits() == b.to_bits());
        assert!(
            same,
            "blocks of {bs}: rows {first}..{} alone differ from the same rows in the whole prompt",
            first + len
        );
    }
}
