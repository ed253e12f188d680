//! CUDA ops against the CPU ops on the same inputs. The GPU tests exist only with
//! `DISAGG_TEST_CUDA=1` (the GPU machine): without it this binary lists and runs just
//! the no-driver check, so CI never reports a GPU test as passed. Tolerances: these
//! ops are f32 on both sides; the GPU sums in another order (block reduction) and uses
//! its own exp/rsqrt, so a few ulp.

use kernels::cpu::ops::{rms_norm_rows, silu_mul_rows};
use kernels::cuda::CudaDevice;

fn gpu() -> CudaDevice {
    CudaDevice::open(0).expect("DISAGG_TEST_CUDA is set: cuda:0 must open")
}

fn main() {
    use libtest_mimic::{Arguments, Trial};
    let mut tests = vec![Trial::test("without_a_driver_asking_for_cuda_is_a_clear_error", || {
        without_a_driver_asking_for_cuda_is_a_clear_error();
        Ok(())
    })];
    if std::env::var_os(kernels::env::TEST_CUDA).is_some() {
        let gpu_tests: [(&str, fn()); 14] = [
            (
                "greedy_argmax_takes_the_first_maximum_in_every_form",
                greedy_argmax_takes_the_first_maximum_in_every_form,
            ),
            ("fp8_cache_attention_matches_cpu_and_the_f16_kernel", fp8_cache_attention_matches_cpu_and_the_f16_kernel),
            ("qkv_gemv_with_rope_equals_the_separate_ops", qkv_gemv_with_rope_equals_the_separate_ops),
            ("attention_with_rope_equals_the_separate_ops", attention_with_rope_equals_the_separate_ops),
            (
                "prenormed_gemvs_match_the_gemvs_that_norm_themselves",
                prenormed_gemvs_match_the_gemvs_that_norm_themselves,
            ),
            ("mlp_residual_matches_cpu_fused_or_not", mlp_residual_matches_cpu_fused_or_not),
            ("split_k_down_and_its_norm_match_the_unsplit_ops", split_k_down_and_its_norm_match_the_unsplit_ops),
            ("rope_write_kv_matches_cpu", rope_write_kv_matches_cpu),
            ("fused_gemv_matches_cpu_norm_matmul_silu", fused_gemv_matches_cpu_norm_matmul_silu),
            ("bf16_matmul_matches_cpu_with_and_without_gemv", bf16_matmul_matches_cpu_with_and_without_gemv),
            ("attention_kernels_match_cpu_on_a_paged_cache", attention_kernels_match_cpu_on_a_paged_cache),
            ("rms_norm_matches_cpu", rms_norm_matches_cpu),
            ("silu_mul_matches_cpu", silu_mul_matches_cpu),
            ("embedding_gathers_rows_exactly_and_refuses_bad_ids", embedding_gathers_rows_exactly_and_refuses_bad_ids),
        ];
        tests.extend(gpu_tests.into_iter().map(|(name, f)| {
            Trial::test(name, move || {
                f();
                Ok(())
            })
        }));
    }
    libtest_mimic::run(&Arguments::from_args(), tests).exit();
}

fn data(n: usize, seed: u32) -> Vec<f32> {
    let mut x = seed.wrapping_mul(2654435761).wrapping_add(1);
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            (x as f32 / u32::MAX as f32) * 4.0 - 2.0
        })
        .collect()
}

fn max_rel(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| (x - y).abs() / y.abs().max(1e-3)).fold(0.0, worst32)
}

fn without_a_driver_asking_for_cuda_is_a_clear_error() {
    if std::env::var_os(kernels::env::TEST_CUDA).is_some() {
        return; // the GPU machine: covered by the tests below
    }
    // On machines without libcuda the error names the device and what to use.
    if let Err(e) = CudaDevice::open(0) {
        let m = e.to_string();
        assert!(m.contains("cuda:0") || m.contains("CUDA"), "{m}");
    }
}

fn rms_norm_matches_cpu() {
    let d = gpu();
    for (n, dim) in [(1, 576), (7, 4096), (33, 5120)] {
        let x = data(n * dim, 1);
        let w = data(dim, 2);
        let mut want = vec![0f32; n * dim];
        for r in 0..n {
            rms_norm_rows(&x[r * dim..(r + 1) * dim], &w, 1e-5, &mut want[r * dim..(r + 1) * dim]);
        }
        let (dx, dw) = (d.upload(&x).unwrap(), d.upload(&w).unwrap());
        let mut out = d.zeros(n * dim).unwrap();
        d.rms_norm(&dx, &dw, 1e-5, n, dim, &mut out).unwrap();
        let got = d.download(&out).unwrap();
        let err = max_rel(&got, &want);
        println!("rms_norm n={n} dim={dim}: max rel err {err:e} on {}", d.describe());
        assert!(err < 1e-5, "rms_norm n={n} dim={dim}: {err}");
    }
}

fn silu_mul_matches_cpu() {
    let d = gpu();
    let (n, ff) = (9, 1536);
    let gu = data(n * 2 * ff, 3);
    let mut want = vec![0f32; n * ff];
    for r in 0..n {
        silu_mul_rows(&gu[r * 2 * ff..(r + 1) * 2 * ff], ff, &mut want[r * ff..(r + 1) * ff]);
    }
    let dgu = d.upload(&gu).unwrap();
    // Both kernels: 4 columns per thread on a (columns, rows) grid, one element per thread.
    for rows4 in [true, false] {
        let mut out = d.zeros(n * ff).unwrap();
        d.silu_mul(&dgu, n, ff, &mut out, rows4).unwrap();
        let err = max_rel(&d.download(&out).unwrap(), &want);
        println!("silu_mul (rows4 {rows4}): max rel err {err:e}");
        assert!(err < 1e-5, "silu_mul: {err}");
    }
}

fn embedding_gathers_rows_exactly_and_refuses_bad_ids() {
    let d = gpu();
    let (vocab, dim) = (1000, 64);
    let table = data(vocab * dim, 4);
    let ids = [0u32, 999, 5, 5, 512];
    let dt = d.upload(&table).unwrap();
    let mut out = d.zeros(ids.len() * dim).unwrap();
    d.embed(&dt, &ids, dim, &mut out).unwrap();
    let got = d.download(&out).unwrap();
    for (r, &id) in ids.iter().enumerate() {
        assert_eq!(&got[r * dim..(r + 1) * dim], &table[id as usize * dim..(id as usize + 1) * dim]);
    }
    assert!(d.embed(&dt, &[1000], dim, &mut out).is_err(), "an id outside the table is refused");
}

/// The device's greedy sample (`sample_rows` with plain greedy rows: the argmax kernels)
/// against the host's (`kernels::backend::argmax`), exactly: the first index of the
/// largest value, NaN never winning, 0 for a row with nothing above -inf. Each of the four
/// forms (one block or several per row, 4- or 16-byte loads), at 1, 5 and 64 rows (on 132
/// SMs 64, 53 and 5 blocks a row where split, fewer where a row is short), over a Llama-3
/// vocabulary, one not a multiple of 4 (three rows in four misaligned for the 16-byte
/// loads) and one under a block's 1,024 values. Among NaNs, a row's maximum is in its last
/// value alone (the 16-byte loads' tail), in its first and last, either side of a chunk
/// edge, or anywhere two to four times; or a row holds only -inf and NaN.
fn greedy_argmax_takes_the_first_maximum_in_every_form() {
    use kernels::{Backend, SampleSpec, SampledRow};
    let mut be = kernels::cuda::CudaBackend::new(0, true).expect("cuda:0 opens");
    let greedy = SampleSpec { temperature: 0.0, top_k: 0, top_p: 1.0, min_p: 0.0, u: 0.0, edits: &[], logprobs: None };
    let mut x = 0x2545_f491_4f6c_dd1du64;
    let mut next = move |n: usize| {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        (x % n as u64) as usize
    };
    let mut checked = 0;
    for dim in [128_256usize, 4_099, 1_000] {
        for rows in [1usize, 5, 64] {
            let mut logits = data(rows * dim, (dim + rows) as u32);
            let mut want = vec![0u32; rows];
            for (r, row) in logits.chunks_mut(dim).enumerate() {
                for _ in 0..dim / 50 {
                    row[next(dim)] = f32::NAN;
                }
                match r % 6 {
                    // Nothing above -inf: token 0.
                    0 if rows > 1 => {
                        row.iter_mut().for_each(|v| *v = if next(3) == 0 { f32::NAN } else { f32::NEG_INFINITY })
                    }
                    // The maximum in the last value alone (the 16-byte loads' tail).
                    1 => row[dim - 1] = 9.0,
                    // In the first value and in the last.
                    2 => (row[0], row[dim - 1]) = (9.0, 9.0),
                    // Either side of an edge of the chunks and quads (the split forms'
                    // chunks of dim / 64, dim / 53 and dim / 5, rounded to 4).
                    3 => {
                        let edge = dim.div_ceil([64, 53, 5][next(3)]).next_multiple_of(4) - next(2);
                        row[edge.min(dim - 2)] = 9.0;
                        row[edge.min(dim - 2) + 1] = 9.0;
                    }
                    // Anywhere, up to four times.
                    _ => (0..2 + next(3)).for_each(|_| row[next(dim)] = 9.0),
                }
                want[r] = kernels::backend::argmax(row);
            }
            for (split, vec) in [(false, false), (false, true), (true, false), (true, true)] {
                be.set_argmax_split(split);
                be.set_argmax_vec(vec);
                let mut buf = be.device().upload(&logits).unwrap();
                let mut out: Vec<SampledRow> = Vec::new();
                let specs = vec![greedy.clone(); rows];
                assert!(be.sample_rows(&mut buf, dim, &specs, &mut out), "sampled on the device");
                let got: Vec<u32> = out.iter().map(|o| o.token.expect("a greedy row's token")).collect();
                assert_eq!(got, want, "dim {dim}, {rows} rows, split {split}, 16-byte loads {vec}");
                checked += rows;
            }
        }
    }
    println!("greedy argmax: {checked} rows equal to the host's rule in all four forms");
}

/// Both CUDA attention kernels, whole and split-K, against the CPU backend's attention,
/// on the same paged f16 cache (shuffled block tables) for a mixed step: a prefill chunk
/// over a cached prefix, a fresh prompt whose length is not a multiple of the tile, and
/// one decode row; a decode row reaching past its step's prompt; then a decode-only step
/// (the flash kernel's warps split the keys). Tolerances: the per-token kernel computes in f32 like the CPU (a few
/// ulp, 1e-4 of the value range here); the flash kernel rounds q·scale and the
/// probabilities to f16 (2⁻¹¹ relative), measured at ~1e-3 and held to 5e-3 of the
/// value range. Blocks of 16 tokens and of 12 (the flash loads' division path).
fn attention_kernels_match_cpu_on_a_paged_cache() {
    use kernels::{AttnShape, Backend, KvDtype, KvShape, Rope, StepBatch};
    // Every case runs and prints; the failures are listed together at the end.
    let mut failed: Vec<String> = Vec::new();
    for ((n_heads, n_kv, hd), bs) in [
        ((32usize, 8usize, 128usize), 16usize),
        ((24, 8, 128), 16),
        ((16, 4, 64), 16),
        ((9, 3, 64), 16),
        ((32, 8, 128), 12),
    ] {
        let attn = AttnShape { n_heads, n_kv_heads: n_kv, head_dim: hd, scale: 1.0 / (hd as f32).sqrt() };
        let n_blocks = 96 * 16 / bs;
        let shape =
            KvShape { n_layers: 1, n_blocks, block_size: bs, n_kv_heads: n_kv, head_dim: hd, dtype: KvDtype::F16 };
        // Cache contents: random f16 values in [-2, 2), in the transfer layout.
        let blocks: Vec<u32> = (0..shape.n_blocks as u32).collect();
        let vals = data(shape.n_blocks * shape.block_bytes_per_layer() / 2, 11);
        let bytes: Vec<u8> = vals.iter().flat_map(|v| half::f16::from_f32(*v).to_le_bytes()).collect();
        // (And a decode row with a longer context than the step's prompt.)
        for seqs in MIXED_THEN_DECODE.into_iter().chain([LONG_DECODE_BESIDE_A_PROMPT]) {
            let tables = shuffled_tables(shape.n_blocks, seqs, bs);
            let spans = spans_of(seqs, &tables);
            let n_tokens = spans.last().map_or(0, |s| s.rows.end);
            let batch = StepBatch { n_tokens, seqs: &spans, block_size: bs, fed: &[] };
            let qkv = data(n_tokens * attn.qkv_dim(), 12);
            let rope = Rope { interleaved: false, inv_freq: vec![1.0; hd / 2] };
            let tokens = vec![0u32; n_tokens];

            let (want, range) = cpu_attention(shape, &bytes, &qkv, &batch, &attn);

            let mut be = kernels::cuda::CudaBackend::new(0, true).expect("cuda:0 opens");
            // The driver's count of keys-on-M blocks resident in clusters, which the split
            // count uses: whole clusters, never more than the blocks resident alone.
            if let Some(r) = be.km_cluster_residency(hd) {
                println!("keys-on-M d{hd}: blocks resident {} alone, in clusters of 2.. : {:?}", r[0], &r[2..]);
                if r.iter().enumerate().skip(2).any(|(s, &n)| n == 0 || n % s != 0 || n > r[0]) {
                    failed.push(format!("keys-on-M d{hd}: cluster residency {r:?}"));
                }
            }
            let mut gkv = be.kv_cache(shape).unwrap();
            be.kv_import(&mut gkv, 0, &blocks, &bytes);
            let dq = be.device().upload(&qkv).unwrap();
            // Each kernel whole and split into key chunks (this step's few tiles split);
            // the flash kernel with every switch on, and with each switched off in turn:
            // ldmatrix fragments (else scalar shared loads), tiles loaded with hoisted
            // (lean) addresses (else per chunk), the decode form's warps merged by all
            // threads (else warp 0), the bare ex2 (else exp2f), 32-bit shared addresses
            // (else generic pointers), the prefill form held to 3 blocks per SM, masks
            // only on edge tiles (else on all), warpgroup MMAs on sm_90 (else mma.sync),
            // one table read per key pair (else per key), the warp-specialized prefill
            // kernel on sm_90 (else one warpgroup per block), its consumers free (else
            // taking turns); and the decode-only step on
            // the keys-on-M kernel (with every switch on; the cases that switch one off
            // test the flash kernel's decode form), its splits merged in the kernel as
            // thread block clusters (sm_90) and by attention_merge, its first tiles asked
            // for before waiting for the kernel before and after, the cluster merge's loads
            // in one round and in turn, q's and the block tables' loads all first and each
            // as used, its wait before q's and the first tables' loads and after, the
            // barrier after the merge relaxed and not: the same bits. Split, the
            // mixed step's decode row takes the keys-on-M kernel in a launch of its own
            // (with clusters; without, the step is not split).
            #[derive(Clone, Copy, PartialEq)]
            struct Flash {
                on: bool,
                ldsm: bool,
                lean: bool,
                wide: bool,
                fast_exp: bool,
                smem32: bool,
                occ3: bool,
                mask_edge: bool,
                wgmma: bool,
                pair: bool,
                km: bool,
                cluster: bool,
                early: bool,
                bulk: bool,
                lazy: bool,
                merge_ilp: bool,
                batch: bool,
                wait: bool,
                relaxed: bool,
                pp: bool,
                turns: bool,
                pp_lean: bool,
                split: bool,
            }
            let all = Flash {
                on: true,
                ldsm: true,
                lean: true,
                wide: true,
                fast_exp: true,
                smem32: true,
                occ3: true,
                mask_edge: true,
                wgmma: true,
                pair: true,
                km: true,
                cluster: true,
                early: true,
                bulk: true,
                lazy: true,
                merge_ilp: true,
                batch: true,
                wait: true,
                relaxed: true,
                pp: true,
                turns: false,
                pp_lean: true,
                split: false,
            };
            let sa = Flash { km: false, ..all };
            let cases = [
                Flash { on: false, ..all },
                all,
                Flash { cluster: false, ..all },
                Flash { early: false, ..all },
                // The engine's default tile loads (cp.async, a tile's entries first).
                Flash { bulk: false, ..all },
                Flash { lazy: false, ..all },
                Flash { merge_ilp: false, ..all },
                Flash { batch: false, ..all },
                // DISAGG_CUDA_KM_BATCH_LOADS=0's tile loads (cp.async, each entry as used).
                Flash { bulk: false, batch: false, ..all },
                // Waiting before q's and the first tiles' table loads, and after.
                Flash { wait: false, ..all },
                Flash { bulk: false, wait: false, ..all },
                Flash { relaxed: false, ..all },
                sa,
                Flash { ldsm: false, ..sa },
                Flash { lean: false, ..sa },
                Flash { wide: false, ..sa },
                Flash { fast_exp: false, ..sa },
                Flash { smem32: false, ..sa },
                Flash { pp: false, ..sa },
                Flash { turns: true, ..sa },
                Flash { pp_lean: false, ..sa },
                Flash { occ3: false, pp: false, ..sa },
                Flash { mask_edge: false, ..sa },
                Flash { wgmma: false, ..sa },
                Flash { pair: false, ..sa },
                Flash { split: true, ..all },
                Flash { split: true, cluster: false, ..all },
            ];
            let decode = seqs.iter().all(|s| s.1 == 1);
            // (which pair below, chunk, bits) of each pair's first case
            let mut same_refs: Vec<(usize, usize, Vec<u32>)> = Vec::new();
            // ((early tiles, bulk copies, the cluster merge's one round of loads, q's and the
            // tables' loads first, the wait before them, the relaxed exit barrier), merged in
            // clusters, splits, the outputs)
            type Merged = ((bool, bool, bool, bool, bool, bool), bool, usize, Vec<f32>);
            let mut merged: Vec<Merged> = Vec::new();
            // The bits of the cluster merge and attention_merge are compared at the same
            // splits: split counts that assume clusters as resident as single blocks,
            // which the two then share (counting the clusters that fit, the cluster
            // merge may take fewer splits), any count of them in clusters whatever the
            // default's floor (`DISAGG_CUDA_ATTN_CLUSTER_FROM`).
            be.set_cluster_waves(false);
            let floor = be.attn_cluster_from();
            be.set_attn_cluster_from(2);
            for (f, chunk) in cases.iter().flat_map(|f| [(f, 0), (f, 64)]) {
                let flash = f.on;
                be.set_flash(flash);
                be.set_flash_ldmatrix(f.ldsm);
                be.set_flash_lean_loads(f.lean);
                be.set_flash_wide_merge(f.wide);
                be.set_flash_fast_exp(f.fast_exp);
                be.set_flash_smem32(f.smem32);
                be.set_flash_occ3(f.occ3);
                be.set_flash_mask_edge(f.mask_edge);
                be.set_flash_wgmma(f.wgmma);
                be.set_flash_pair_loads(f.pair);
                be.set_decode_km(f.km);
                be.set_attn_cluster(f.cluster);
                be.set_km_early(f.early);
                be.set_km_bulk(f.bulk);
                be.set_flash_lazy_rescale(f.lazy);
                be.set_flash_merge_ilp(f.merge_ilp);
                be.set_km_batch_loads(f.batch);
                be.set_km_wait_first(f.wait);
                be.set_cluster_relaxed_exit(f.relaxed);
                be.set_flash_warp_spec(f.pp);
                be.set_flash_pp_turns(f.turns);
                be.set_flash_pp_lean(f.pp_lean);
                be.set_mixed_split(f.split);
                be.set_attn_chunk(chunk);
                be.begin_step(&tokens, &batch, &rope, &attn, &[]);
                // The decode-only step (one token per sequence) takes the keys-on-M
                // kernel exactly when it is on.
                let km_ran = be.step_flash_kernel().starts_with("flash_decode_km");
                if km_ran != (flash && f.km && seqs.iter().all(|s| s.1 == 1)) {
                    failed.push(format!("{n_heads}/{n_kv} heads, {n_tokens} rows: kernel {}", be.step_flash_kernel()));
                }
                // The mixed step takes the warp-specialized kernel exactly when it is on
                // (with the warpgroup-MMA form it replaces: sm_90, head_dim 128).
                let pp_ran = be.step_flash_kernel().starts_with("flash_attn_pp");
                let pp_want = flash && f.pp && f.wgmma && f.ldsm && f.fast_exp && f.smem32;
                if pp_ran != (pp_want && !decode && hd == 128 && be.device().wgmma)
                    || (pp_ran && be.step_flash_kernel().starts_with("flash_attn_ppg") == f.pp_lean)
                {
                    failed.push(format!("{n_heads}/{n_kv} heads, {n_tokens} rows: kernel {}", be.step_flash_kernel()));
                }
                // Split exactly where asked on the mixed step, with clusters: its one-row spans.
                let part = be.step_km_part();
                let one_row = seqs.iter().filter(|s| s.1 == 1).count();
                let want_part = f.split && f.cluster && !decode && be.km_cluster_residency(hd).is_some();
                if part.is_some() != want_part
                    || part.is_some_and(|(k, n, s)| n != one_row || !k.starts_with("flash_decode_km_f16") || s > 16)
                {
                    failed.push(format!("{n_heads}/{n_kv} heads, {n_tokens} rows, split: keys-on-M launch {part:?}"));
                }
                let mut out = be.act(n_tokens * attn.q_dim()).unwrap();
                be.attention(&dq, 0, &batch, &attn, &mut gkv, &mut out);
                let mut got = vec![0f32; n_tokens * attn.q_dim()];
                be.to_host(&out, &mut got);
                let err = max_abs(&got, &want) / range;
                if let Some((k, n, s)) = part {
                    println!(
                        "{n_heads}/{n_kv} heads, {n_tokens} rows, chunk {chunk}: split, {n} rows on {k}, {s} splits"
                    );
                }
                // Pairs of cases whose bits must be equal, per chunk: skipping the products
                // with 1 (`all` against the kernels rescaling on every tile); the producer's
                // lean copy loop (`sa` against the general loop).
                let bits: Vec<u32> = got.iter().map(|v| v.to_bits()).collect();
                let pairs = [
                    (all, Flash { lazy: false, ..all }, "lazy rescale"),
                    (sa, Flash { pp_lean: false, ..sa }, "general producer loop"),
                ];
                for (i, (first, second, what)) in pairs.iter().enumerate() {
                    if f == first {
                        same_refs.push((i, chunk, bits.clone()));
                    } else if f == second {
                        let same = same_refs.iter().any(|(j, c, b)| (*j, *c) == (i, chunk) && *b == bits);
                        println!(
                            "{n_heads}/{n_kv} heads, {n_tokens} rows, chunk {chunk}: {what} bit-identical: {same}"
                        );
                        if !same {
                            failed.push(format!("{n_heads}/{n_kv} heads, chunk {chunk}: {what} changed bits"));
                        }
                    }
                }
                println!(
                    "attention {n_heads}/{n_kv} heads, head_dim {hd}, block {bs}, {} rows, flash {flash} (ldmatrix {}, lean loads {}, wide merge {}, fast exp {}, 32-bit shared addresses {}, 3 per SM {}, edge masks {}, wgmma {}, pair loads {}, keys on M {}), kernel {}, split chunk {chunk}: {} splits{}: max |GPU − CPU| / range = {err:.2e}",
                    n_tokens, f.ldsm, f.lean, f.wide, f.fast_exp, f.smem32, f.occ3, f.mask_edge, f.wgmma, f.pair, f.km,
                    be.step_flash_kernel(),
                    be.step_splits(), if be.step_cluster() { " merged in clusters" } else { "" }
                );
                // The decode step's split keys-on-M runs: in clusters where the GPU has
                // them (sm_90) and the switch is on, else through attention_merge.
                if flash && f.km && decode && chunk > 0 {
                    let want_cluster = f.cluster && be.device().km_cluster_max >= be.step_splits();
                    if be.step_splits() < 2 || be.step_cluster() != want_cluster {
                        failed.push(format!(
                            "{n_heads}/{n_kv} heads: {} splits, in clusters {}",
                            be.step_splits(),
                            be.step_cluster()
                        ));
                    }
                    let key = (f.early, f.bulk, f.merge_ilp, f.batch, f.wait, f.relaxed);
                    merged.push((key, be.step_cluster(), be.step_splits(), got.clone()));
                }
                if err.is_nan() || err >= if flash { 5e-3 } else { 1e-4 } {
                    failed.push(format!(
                        "{n_heads}/{n_kv} heads, head_dim {hd}, block {bs}, {n_tokens} rows, flash {flash}, wgmma {}, \
                         keys on M {}, chunk {chunk}: {err:.2e}",
                        f.wgmma, f.km
                    ));
                }
            }
            // The cluster merge against attention_merge, the first tiles before the wait
            // against after it, bulk copies against cp.async, the cluster merge's one round
            // of loads against a round trip per split, q's and the tables' loads first against
            // in turn, the wait before q's and the tables' loads against after them, the relaxed
            // exit barrier against release/acquire: the same splits, the same bits.
            if let [((true, true, true, true, true, true), true, s1, a), rest @ ..] = &merged[..] {
                for ((early, bulk, ilp, batch, wait, relaxed), cluster, s2, b) in rest {
                    let diff = a.iter().zip(b).filter(|(x, y)| x.to_bits() != y.to_bits()).count();
                    println!(
                        "{n_heads}/{n_kv} heads: against every switch on ({s1} splits), \
                         clusters {cluster}, early tiles {early}, bulk copies {bulk}, merge in one round {ilp}, \
                         loads first {batch}, wait first {wait}, relaxed exit {relaxed} ({s2} splits): {diff} of {} outputs differ",
                        a.len()
                    );
                    if s1 != s2 || diff > 0 {
                        failed.push(format!(
                            "{n_heads}/{n_kv} heads: clusters {cluster}, early {early}, bulk {bulk}, ilp {ilp}, \
                             batch {batch}, wait {wait}, relaxed {relaxed}: {diff} differ"
                        ));
                    }
                }
            } else if decode && be.device().km_cluster_max > 0 {
                failed.push(format!("{n_heads}/{n_kv} heads: the cluster merge did not run ({} runs)", merged.len()));
            }
            be.set_cluster_waves(true);
            be.set_attn_cluster_from(floor);
            be.set_attn_cluster(true);
            be.set_km_early(true);
            be.set_km_bulk(true);
            be.set_mixed_split(true);
            if let Err(e) = attention_residual_case(&mut be, &dq, &batch, &attn, &mut gkv, &want, &tokens, &rope) {
                failed.push(format!("{n_heads}/{n_kv} heads, head_dim {hd}, block {bs}: {e}"));
            }
        }
    }
    assert!(failed.is_empty(), "attention beyond tolerance:\n{}", failed.join("\n"));
}

/// An FP8 (E4M3) cache holding random values: every step's attention against the CPU
/// backend's on the same bytes, and against the same flash kernel's on an f16 cache of
/// the same values (E4M3 → f16 is exact). The decode-only step takes the FP8 keys-on-M
/// kernel, whole and split (merged in clusters and by attention_merge, first tiles asked
/// for before the wait or after it, bulk copies or cp.async): its MMAs take the f16
/// kernel's products, a score's 16 per MMA in another order, so it is held to 1e-3 of the
/// range of the f16 kernel's (a score rounding otherwise moves a probability by an f16
/// ulp). A mixed step (a prefill chunk over a cached prefix, a fresh prompt, a decode
/// row), and the decode step with the keys-on-M kernel off, take the f16 flash kernels
/// over an f16 copy of the step's blocks: the f16 cache's bits. Split (`set_mixed_split`),
/// the mixed step's decode row takes the FP8 keys-on-M kernel in a launch of its own
/// (1e-3 of the range of the f16 kernel's) and the copy holds only the other rows' blocks
/// (their bits unchanged where the split count is). All within the flash tolerance of the
/// CPU's; with the copy switched off, the per-token kernel (`attention_fp8`, whole and
/// split: 1e-4 of the range, as for f16). Blocks of 16 and 12.
fn fp8_cache_attention_matches_cpu_and_the_f16_kernel() {
    use kernels::cpu::ops::{e4m3_to_f32, f32_to_e4m3};
    use kernels::{AttnShape, Backend, KvDtype, KvShape, Rope, StepBatch};
    let mut failed: Vec<String> = Vec::new();
    for ((n_heads, n_kv, hd), bs) in [((32usize, 8usize, 128usize), 16usize), ((9, 3, 64), 16), ((32, 8, 128), 12)] {
        let attn = AttnShape { n_heads, n_kv_heads: n_kv, head_dim: hd, scale: 1.0 / (hd as f32).sqrt() };
        let n_blocks = 96 * 16 / bs;
        let shape8 =
            KvShape { n_layers: 1, n_blocks, block_size: bs, n_kv_heads: n_kv, head_dim: hd, dtype: KvDtype::Fp8 };
        let shape16 = KvShape { dtype: KvDtype::F16, ..shape8 };
        let blocks: Vec<u32> = (0..n_blocks as u32).collect();
        // Random values in [-2, 2) stored as E4M3; the f16 cache holds the same values.
        let b8: Vec<u8> = data(n_blocks * shape8.block_bytes_per_layer(), 11).iter().map(|v| f32_to_e4m3(*v)).collect();
        let b16: Vec<u8> = b8.iter().flat_map(|b| half::f16::from_f32(e4m3_to_f32(*b)).to_le_bytes()).collect();
        // (And a decode row with a longer context than the step's prompt.)
        for seqs in MIXED_THEN_DECODE.into_iter().chain([LONG_DECODE_BESIDE_A_PROMPT]) {
            let tables = shuffled_tables(n_blocks, seqs, bs);
            let spans = spans_of(seqs, &tables);
            let n_tokens = spans.last().map_or(0, |s| s.rows.end);
            let batch = StepBatch { n_tokens, seqs: &spans, block_size: bs, fed: &[] };
            let qkv = data(n_tokens * attn.qkv_dim(), 12);
            let rope = Rope { interleaved: false, inv_freq: vec![1.0; hd / 2] };
            let tokens = vec![0u32; n_tokens];
            let decode = seqs.iter().all(|s| s.1 == 1);
            // The longest context of all rows, and of the prompts' (a split step's flash
            // launch chunks its keys by the latter).
            let ctx = |one_row: bool| seqs.iter().filter(|s| one_row || s.1 > 1).map(|s| s.0 + s.1).max();
            let same_ctx = ctx(true) == ctx(false);

            let (want, range) = cpu_attention(shape8, &b8, &qkv, &batch, &attn);

            // The f16 flash kernels' outputs on the same values, whole and split, keys on
            // M on and off: (chunk, kernel, splits, outputs).
            let mut be16 = kernels::cuda::CudaBackend::new(0, true).expect("cuda:0 opens");
            // (The reference: one launch for every row, whatever DISAGG_CUDA_MIXED_SPLIT says.)
            be16.set_mixed_split(false);
            let mut g16 = be16.kv_cache(shape16).unwrap();
            be16.kv_import(&mut g16, 0, &blocks, &b16);
            let dq16 = be16.device().upload(&qkv).unwrap();
            let mut f16_runs: Vec<(usize, &str, usize, Vec<f32>)> = Vec::new();
            for (km, chunk) in [(true, 0usize), (true, 64), (false, 0), (false, 64)] {
                be16.set_decode_km(km);
                be16.set_attn_chunk(chunk);
                be16.begin_step(&tokens, &batch, &rope, &attn, &[]);
                let mut out = be16.act(n_tokens * attn.q_dim()).unwrap();
                be16.attention(&dq16, 0, &batch, &attn, &mut g16, &mut out);
                let mut got = vec![0f32; n_tokens * attn.q_dim()];
                be16.to_host(&out, &mut got);
                f16_runs.push((chunk, be16.step_flash_kernel(), be16.step_splits(), got));
            }

            let mut be = kernels::cuda::CudaBackend::new(0, true).expect("cuda:0 opens");
            let mut g8 = be.kv_cache(shape8).unwrap();
            be.kv_import(&mut g8, 0, &blocks, &b8);
            // The cache's bytes come back as they went in.
            let mut back = Vec::new();
            be.kv_export(&g8, 0, &blocks, &mut back);
            assert!(back == b8, "FP8 cache export");
            let dq = be.device().upload(&qkv).unwrap();
            // (keys on M, clusters, early tiles, bulk copies, the f16 copy, split steps)
            let cases = [
                (true, true, true, true, true, false),
                (true, false, true, true, true, false),
                (true, true, false, true, true, false),
                (true, true, true, false, true, false),
                (false, true, true, true, true, false),
                (true, true, true, true, false, false),
                (true, true, true, true, true, true),
                (true, true, false, false, true, true),
                (true, false, true, true, true, true),
                (true, true, true, true, false, true),
            ];
            // The rows of one-row spans (a split step's keys-on-M launch takes them).
            let one_row: Vec<usize> = spans.iter().filter(|s| s.rows.len() == 1).map(|s| s.rows.start).collect();
            for ((km, cluster, early, bulk, copy, split), chunk) in cases.iter().flat_map(|c| [(*c, 0usize), (*c, 64)])
            {
                be.set_decode_km(km);
                be.set_attn_cluster(cluster);
                be.set_km_early(early);
                be.set_km_bulk(bulk);
                be.set_fp8_f16_copy(copy);
                be.set_mixed_split(split);
                be.set_attn_chunk(chunk);
                be.begin_step(&tokens, &batch, &rope, &attn, &[]);
                let kernel = be.step_flash_kernel();
                let km_ran = kernel.starts_with("flash_decode_km_fp8");
                let copied = be.step_fp8_copy();
                if km_ran != (km && decode) || copied != (!km_ran && copy) || (!km_ran && !copied && !kernel.is_empty())
                {
                    failed.push(format!(
                        "{n_heads}/{n_kv} heads, {n_tokens} rows, km {km}, copy {copy}: kernel '{kernel}', copied {copied}"
                    ));
                }
                // Split where asked, on a step that prefills beside one-row spans, with
                // the keys-on-M kernel and its clusters.
                let part = be.step_km_part();
                let want_part = split && km && cluster && copy && !decode && be.km_cluster_residency(hd).is_some();
                if part.is_some() != want_part
                    || part
                        .is_some_and(|(k, n, s)| n != one_row.len() || !k.starts_with("flash_decode_km_fp8") || s > 16)
                {
                    failed.push(format!(
                        "{n_heads}/{n_kv} heads, {n_tokens} rows, split {split}, km {km}, clusters {cluster}: keys-on-M \
                         launch {part:?}"
                    ));
                }
                let km_rows: &[usize] = if part.is_some() { &one_row } else { &[] };
                let mut out = be.act(n_tokens * attn.q_dim()).unwrap();
                be.attention(&dq, 0, &batch, &attn, &mut g8, &mut out);
                let mut got = vec![0f32; n_tokens * attn.q_dim()];
                be.to_host(&out, &mut got);
                let err = max_abs(&got, &want) / range;
                let mut note = String::new();
                if km_ran || copied {
                    // The same kernel on the f16 cache: the keys-on-M kernel within 1e-3 of
                    // the range (its splits may differ: more FP8 blocks fit an SM), the
                    // f16 kernels over the copy the same bits.
                    let k16 = kernel.replace("_fp8_", "_f16_");
                    match f16_runs.iter().find(|(c, k, _, _)| *c == chunk && **k == k16) {
                        Some((_, _, s16, b)) => {
                            // (A split step's keys-on-M rows are held to 1e-3, as that
                            // kernel is; its other rows keep their bits where their key
                            // chunks are the f16 run's: the same split count, and one split
                            // or the same longest context.)
                            let q = attn.q_dim();
                            let chunks = be.step_splits() == *s16 && (*s16 == 1 || same_ctx);
                            let exact = |i: &usize| !km_rows.contains(&(i / q)) && chunks;
                            let diff = b
                                .iter()
                                .zip(&got)
                                .enumerate()
                                .filter(|(i, (x, y))| x.to_bits() != y.to_bits() && (km_rows.is_empty() || exact(i)))
                                .count();
                            let e16 = max_abs(&got, b) / range;
                            note = format!(
                                ", {diff} outputs differ from {k16}'s on the f16 cache ({s16} splits), by ≤ {e16:.2e} of \
                                 the range{}",
                                part.map_or(String::new(), |(k, n, s)| format!("; {n} rows on {k}, {s} splits"))
                            );
                            if e16.is_nan() || e16 > 1e-3 || (copied && diff > 0) {
                                failed.push(format!(
                                    "{n_heads}/{n_kv} heads, block {bs}, {n_tokens} rows, chunk {chunk}, kernel {kernel}: \
                                     {diff} outputs differ from the f16 cache's, by {e16:.2e}"
                                ));
                            }
                        }
                        None => failed.push(format!("{n_heads}/{n_kv} heads, chunk {chunk}: no f16 run of {k16}")),
                    }
                }
                println!(
                    "FP8 cache, {n_heads}/{n_kv} heads, head_dim {hd}, block {bs}, {n_tokens} rows, keys on M {km}, \
                     clusters {cluster}, early {early}, bulk {bulk}, f16 copy {copy}, chunk {chunk}: kernel '{kernel}', \
                     {} splits{}: max |GPU − CPU| / range = {err:.2e}{note}",
                    be.step_splits(),
                    if be.step_cluster() { " merged in clusters" } else { "" },
                );
                if err.is_nan() || err >= if km_ran || copied { 5e-3 } else { 1e-4 } {
                    failed.push(format!(
                        "{n_heads}/{n_kv} heads, block {bs}, {n_tokens} rows, kernel '{kernel}', chunk {chunk}: {err:.2e}"
                    ));
                }
            }
        }
    }
    assert!(failed.is_empty(), "FP8 cache attention:\n{}", failed.join("\n"));
}

/// The attention with the output projection and its residual add (`attention_residual`),
/// whole and split into 64-key chunks: the flash kernel (split, its merge) writing the
/// GEMM's bf16 input itself gives the same bits as writing f32 and a cast (the same
/// values, rounded once, into the same GEMM); both match x + W_o · bf16(the CPU
/// attention) to the attention's error (held to 1e-2 of Σ|w·a|). The mixed step runs the
/// prefill form; the decode-only step the keys-on-M kernel and the flash kernel's decode
/// form, its warps merged by all threads and by warp 0.
#[allow(clippy::too_many_arguments)]
fn attention_residual_case(
    be: &mut kernels::cuda::CudaBackend,
    dq: &cudarc::driver::CudaSlice<f32>,
    batch: &kernels::StepBatch,
    attn: &kernels::AttnShape,
    gkv: &mut kernels::cuda::CudaKv,
    want: &[f32],
    tokens: &[u32],
    rope: &kernels::Rope,
) -> Result<(), String> {
    use kernels::quant::GgmlType;
    use kernels::{Backend, WeightPart};
    let (rows, cols, n) = (96usize, attn.q_dim(), batch.n_tokens);
    let wo = data(rows * cols, 13);
    let bytes: Vec<u8> = wo.iter().flat_map(|v| v.to_le_bytes()).collect();
    let lin = be.linear(&[WeightPart { ty: GgmlType::F32, rows, cols, bytes: &bytes }]).unwrap();
    let x0 = data(n * rows, 14);
    let bf = |v: f32| half::bf16::from_f32(v).to_f64();
    let (mut reference, mut scale) = (vec![0f64; n * rows], vec![0f64; n * rows]);
    for t in 0..n {
        for r in 0..rows {
            let (mut s, mut a) = (x0[t * rows + r] as f64, 0f64);
            for c in 0..cols {
                let p = bf(wo[r * cols + c]) * bf(want[t * cols + c]);
                s += p;
                a += p.abs();
            }
            reference[t * rows + r] = s;
            scale[t * rows + r] = a;
        }
    }
    be.set_flash(true);
    be.set_flash_mask_edge(true);
    be.set_flash_wgmma(true);
    be.set_flash_pair_loads(true);
    for chunk in [0, 64] {
        be.set_attn_chunk(chunk);
        // (keys on M, wide merge, a mixed step split: its decode rows' launch writing the
        // bf16 output too)
        for (km, wide, split) in [(true, true, false), (false, true, false), (false, false, false), (true, true, true)]
        {
            be.set_decode_km(km);
            be.set_flash_wide_merge(wide);
            be.set_mixed_split(split);
            // (A split step's flash launch splits by its prompts' context alone: not checked.)
            let splits = (!split).then_some(chunk > 0);
            attention_residual_pair(be, dq, batch, attn, gkv, &x0, &lin, &reference, &scale, tokens, rope, splits)
                .map_err(|e| format!("chunk {chunk}, keys on M {km}, wide merge {wide}, split {split}: {e}"))?;
        }
    }
    be.set_flash_wide_merge(true);
    be.set_mixed_split(true);
    Ok(())
}

/// One form of `attention_residual_case`: the result with the bf16 output and without.
#[allow(clippy::too_many_arguments)]
fn attention_residual_pair(
    be: &mut kernels::cuda::CudaBackend,
    dq: &cudarc::driver::CudaSlice<f32>,
    batch: &kernels::StepBatch,
    attn: &kernels::AttnShape,
    gkv: &mut kernels::cuda::CudaKv,
    x0: &[f32],
    lin: &kernels::cuda::CudaLinear,
    reference: &[f64],
    scale: &[f64],
    tokens: &[u32],
    rope: &kernels::Rope,
    split: Option<bool>,
) -> Result<(), String> {
    use kernels::Backend;
    let (rows, cols, n) = (reference.len() / batch.n_tokens, attn.q_dim(), batch.n_tokens);
    let mut runs: Vec<Vec<f32>> = Vec::new();
    for on in [true, false] {
        be.set_attn_bf16(on);
        be.begin_step(tokens, batch, rope, attn, &[]);
        if split.is_some_and(|s| s != (be.step_splits() > 1)) {
            return Err(format!("{} key splits", be.step_splits()));
        }
        let mut x = be.device().upload(x0).unwrap();
        let mut out = be.act(n * cols).unwrap();
        be.attention_residual(dq, 0, batch, attn, gkv, &mut out, lin, &mut x, None);
        let mut got = vec![0f32; n * rows];
        be.to_host(&x, &mut got);
        let err = (0..n * rows).map(|i| (got[i] as f64 - reference[i]).abs() / scale[i].max(1e-6)).fold(0f64, worst64);
        println!(
            "attention_residual {n} rows, → {rows}, {}, {} splits, flash output to bf16 {on}: max |err| / Σ|w·a| = {err:.2e}",
            be.step_flash_kernel(),
            be.step_splits()
        );
        if err.is_nan() || err >= 1e-2 {
            return Err(format!("attention_residual, bf16 output {on}: {err:.2e}"));
        }
        runs.push(got);
    }
    if runs[0] != runs[1] {
        return Err("the flash kernel's bf16 output changed the result".into());
    }
    Ok(())
}

/// RoPE on q and k in place and the k/v write into the paged cache, both CUDA forms (the
/// grouped kernel at 1, 3, 8 and the default heads per thread, over two layers of a step so
/// the second reads the first's cos/sin; one block per token) against the CPU backend, for
/// an f16 and an f32 cache and both pair layouts, 8/2 and 32/8 heads (groups of 3 KV heads
/// starting past head 0), on a mixed step whose last token sits at position 30,000 (large
/// angles). Both sides take the angle in f32 and cos/sin in f64 and round
/// each product and sum of the rotation on its own (no FMA), so they agree to the last
/// bit unless the two f64 sincos differ in a last place that survives rounding to f32:
/// q and k are held to 1e-6 of the value range, the f16 cache to its rounding (2⁻¹¹
/// relative, held to 1e-3 of the range).
fn rope_write_kv_matches_cpu() {
    for (n_heads, n_kv) in [(8usize, 2usize), (32, 8)] {
        rope_write_kv_case(n_heads, n_kv);
    }
}

fn rope_write_kv_case(n_heads: usize, n_kv: usize) {
    use kernels::{AttnShape, Backend, KvDtype, KvShape, Rope, StepBatch};
    let hd = 128usize;
    let attn = AttnShape { n_heads, n_kv_heads: n_kv, head_dim: hd, scale: 1.0 };
    let inv_freq: Vec<f32> = (0..hd / 2).map(|i| 500000f32.powf(-2.0 * i as f32 / hd as f32)).collect();
    let seqs = [(37usize, 100usize), (0, 70), (30000, 1)];
    // Block tables: the rows of this step own distinct blocks; earlier positions of the
    // long sequence map to block 0 (RoPE never reads them).
    let mut next = 1u32;
    let tables: Vec<Vec<u32>> = seqs
        .iter()
        .map(|&(p0, n)| {
            (0..(p0 + n).div_ceil(16))
                .map(|b| {
                    if (b + 1) * 16 > p0 {
                        next += 1;
                        next - 1
                    } else {
                        0
                    }
                })
                .collect()
        })
        .collect();
    let n_blocks = next as usize;
    let spans = spans_of(&seqs, &tables);
    let n_tokens = spans.last().map_or(0, |s| s.rows.end);
    let batch = StepBatch { n_tokens, seqs: &spans, block_size: 16, fed: &[] };
    let blocks: Vec<u32> = (0..n_blocks as u32).collect();
    let qkv = data(n_tokens * attn.qkv_dim(), 21);
    let tokens = vec![0u32; n_tokens];
    let as_f32 = |bytes: &[u8], dtype: KvDtype| -> Vec<f32> {
        match dtype {
            KvDtype::F16 => bytes.chunks(2).map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32()).collect(),
            KvDtype::F32 => bytes.chunks(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect(),
            KvDtype::Fp8 => bytes.iter().map(|b| kernels::cpu::ops::e4m3_to_f32(*b)).collect(),
        }
    };
    for dtype in [KvDtype::F16, KvDtype::F32, KvDtype::Fp8] {
        for interleaved in [false, true] {
            let rope = Rope { interleaved, inv_freq: inv_freq.clone() };
            let shape = KvShape { n_layers: 2, n_blocks, block_size: 16, n_kv_heads: n_kv, head_dim: hd, dtype };
            let mut cpu = kernels::cpu::CpuBackend::new(2);
            let mut ckv = cpu.kv_cache(shape).unwrap();
            let mut want_q = qkv.clone();
            cpu.begin_step(&tokens, &batch, &rope, &attn, &[]);
            cpu.rope_write_kv(&mut want_q, 0, &batch, &rope, &attn, &mut ckv);
            let mut want_kv = Vec::new();
            cpu.kv_export(&ckv, 0, &blocks, &mut want_kv);
            let want_kv = as_f32(&want_kv, dtype);
            let range = want_q.iter().fold(0f32, |m, v| m.max(v.abs()));
            // (grouped kernel, heads per thread): one, three (at 8/2 heads groups of 3, 3, 2
            // q heads and one of 2 KV heads; at 32/8 KV groups of 3, 3, 2 from heads 0, 3,
            // 6), eight, the default (eight); a block per token.
            for (pairs, group) in [(true, Some(1)), (true, Some(3)), (true, Some(8)), (true, None), (false, None)] {
                let mut be = kernels::cuda::CudaBackend::new(0, true).expect("cuda:0 opens");
                be.set_rope_pairs(pairs);
                be.set_rope_group(group);
                let mut gkv = be.kv_cache(shape).unwrap();
                be.begin_step(&tokens, &batch, &rope, &attn, &[]);
                // Two layers of one step: the grouped kernel's second launch reads the cos/sin
                // its first wrote.
                for layer in 0..2 {
                    assert_eq!(be.rope_cs_ready(), pairs && layer > 0);
                    let mut dq = be.device().upload(&qkv).unwrap();
                    be.rope_write_kv(&mut dq, layer, &batch, &rope, &attn, &mut gkv);
                    let mut got_q = vec![0f32; qkv.len()];
                    be.to_host(&dq, &mut got_q);
                    let mut got_kv = Vec::new();
                    be.kv_export(&gkv, layer, &blocks, &mut got_kv);
                    let got_kv = as_f32(&got_kv, dtype);
                    let (eq, ekv) = (max_abs(&got_q, &want_q) / range, max_abs(&got_kv, &want_kv) / range);
                    println!(
                        "rope + KV write, {n_heads}/{n_kv} heads, {dtype:?} cache, interleaved {interleaved}, grouped \
                         {pairs}, {group:?} heads per thread, layer {layer}: q|k {eq:.2e}, cache {ekv:.2e} of the range"
                    );
                    assert!(eq < 1e-6, "q|k after RoPE: {eq}");
                    // FP8: the same rounding as the CPU's, so the same bytes.
                    let tol = match dtype {
                        KvDtype::F16 => 1e-3,
                        KvDtype::F32 => 1e-6,
                        KvDtype::Fp8 => 0.0,
                    };
                    assert!(ekv <= tol, "cache: {ekv}");
                    // The written slots hold the rotated keys: not all zero.
                    assert!(got_kv.iter().filter(|v| **v != 0.0).count() > n_tokens * n_kv * hd);
                }
            }
        }
    }
}

/// A form of [`attention_with_rope_equals_the_separate_ops`]: its six switches, in the
/// order the comment above its table names them.
type RopeForm = (bool, bool, Option<usize>, bool, bool, bool);

/// A decode step on the keys-on-M kernel with RoPE and the KV write in the attention
/// kernel (`norm_qkv_rope` leaving them to it) gives the same bits as `rope_write_kv` then
/// the attention: the attention's output and every byte of the f16 cache, for both pair
/// layouts, 32/8 heads at head_dim 128 and 9/3 at 64, unsplit and split into 64-key
/// chunks, over sequences whose new key lies in the kernel's first loads (contexts of 4
/// and 100 keys) and past them (700, 1,000), also with the row's k, v and the RoPE
/// frequencies asked for beside q (`DISAGG_CUDA_KM_KV_EARLY`); and the switch decides which
/// ran. Likewise a prefill step on the warp-specialized kernel (32/8 heads, head_dim 128)
/// whose q the kernel rotates as it loads it, after `rope_write_k_f16` rotated and stored only k: 171 new
/// rows from position 0 (a partial last tile) and 40 after a past of 300 keys. The
/// prefill step runs two layers: the second's grouped RoPE kernel (one, three or eight
/// heads per thread; q's skipped, or rotated before the attention) reads the cos/sin the
/// first wrote (and `DISAGG_CUDA_ROPE_K_ROUND`'s loop form makes them again); every form
/// gives the bits of the block-per-token RoPE before the attention in both layers.
fn attention_with_rope_equals_the_separate_ops() {
    use kernels::quant::GgmlType;
    use kernels::{AttnShape, Backend, KvDtype, KvShape, Rope, StepBatch, WeightPart};
    let (eps, hidden, bs) = (1e-5f32, 256usize, 16usize);
    for (n_heads, n_kv, hd, prefill, dtype) in [
        (32usize, 8usize, 128usize, false, KvDtype::F16),
        (9, 3, 64, false, KvDtype::F16),
        (32, 8, 128, true, KvDtype::F16),
        (32, 8, 128, false, KvDtype::Fp8),
        (9, 3, 64, false, KvDtype::Fp8),
    ] {
        let attn = AttnShape { n_heads, n_kv_heads: n_kv, head_dim: hd, scale: 1.0 / (hd as f32).sqrt() };
        let rows = attn.qkv_dim();
        let w: Vec<u8> = data(rows * hidden, 61).iter().flat_map(|x| x.to_le_bytes()).collect();
        let nw = data(hidden, 63);
        let inv_freq: Vec<f32> = (0..hd / 2).map(|i| 500000f32.powf(-2.0 * i as f32 / hd as f32)).collect();
        // (first new position, new rows): decode, four sequences with one new token each
        // at positions 3, 99, 699, 999; or a prefill step. Disjoint tables.
        let seqs: &[(usize, usize)] =
            if prefill { &[(0, 171), (300, 40)] } else { &[(3, 1), (99, 1), (699, 1), (999, 1)] };
        let mut tables = Vec::new();
        let mut next = 0u32;
        for &(p, r) in seqs {
            let nb = (p + r).div_ceil(bs) as u32;
            tables.push((next..next + nb).rev().collect::<Vec<u32>>());
            next += nb;
        }
        let mut spans: Vec<kernels::SeqSpan> = Vec::new();
        for (&(p, r), t) in seqs.iter().zip(&tables) {
            let row0 = spans.last().map_or(0, |s: &kernels::SeqSpan| s.rows.end);
            spans.push(kernels::SeqSpan { rows: row0..row0 + r, pos0: p, block_table: t });
        }
        let n: usize = seqs.iter().map(|s| s.1).sum();
        let batch = StepBatch { n_tokens: n, seqs: &spans, block_size: bs, fed: &[] };
        let x = data(n * hidden, 62);
        let n_layers = if prefill { 2 } else { 1 };
        let shape =
            KvShape { n_layers, n_blocks: next as usize, block_size: bs, n_kv_heads: n_kv, head_dim: hd, dtype };
        let blocks: Vec<u32> = (0..next).collect();
        // The past: random keys and values; the new tokens' slots get overwritten.
        let es = dtype.bytes();
        let past_vals = data(shape.n_blocks * shape.block_bytes_per_layer() / es, 64);
        let past: Vec<u8> = if dtype == KvDtype::Fp8 {
            past_vals.iter().map(|v| kernels::cpu::ops::f32_to_e4m3(*v)).collect()
        } else {
            past_vals.iter().flat_map(|v| half::f16::from_f32(*v).to_le_bytes()).collect()
        };
        let mut be = kernels::cuda::CudaBackend::new(0, true).expect("cuda:0 opens");
        be.set_flash(true);
        be.set_decode_km(true);
        let lin = be.linear(&[WeightPart { ty: GgmlType::F32, rows, cols: hidden, bytes: &w }]).unwrap();
        let (dx, dnw) = (be.device().upload(&x).unwrap(), be.vector(&nw));
        let (mut dh, mut dqkv, mut out) =
            (be.act(n * hidden).unwrap(), be.act(n * rows).unwrap(), be.act(n * attn.q_dim()).unwrap());
        let tokens = vec![0u32; n];
        for interleaved in [false, true] {
            let rope = Rope { interleaved, inv_freq: inv_freq.clone() };
            for chunk in [0usize, 64] {
                let mut runs: Vec<(Vec<f32>, Vec<u8>)> = Vec::new();
                // (RoPE in the attention, rope_write_k_f16's grouped form, heads per thread,
                // grouped RoPE before the attention, the keys-on-M kernel's loads first (after
                // its wait) and relaxed exit barrier, its row's k, v and frequencies asked for
                // beside q); the last, a block per token, is the reference.
                let forms: &[RopeForm] = if prefill {
                    &[
                        (true, true, None, true, false, false),
                        (true, true, Some(3), true, false, false),
                        (true, true, Some(1), true, false, false),
                        (true, false, None, true, false, false),
                        (false, true, None, true, false, false),
                        (false, true, Some(1), true, false, false),
                        (false, true, None, false, false, false),
                    ]
                } else {
                    &[
                        (true, true, None, true, false, false),
                        (true, true, None, true, true, false),
                        (true, true, None, true, true, true),
                        (false, true, None, true, false, false),
                        (false, true, None, false, false, false),
                    ]
                };
                for &(fused, round, group, pairs, loads_first, kv_early) in forms {
                    be.set_attn_rope(fused);
                    be.set_pp_rope(fused);
                    be.set_rope_k_round(round);
                    be.set_rope_group(group);
                    be.set_rope_pairs(pairs);
                    be.set_km_batch_loads(loads_first);
                    be.set_km_wait_first(loads_first);
                    be.set_cluster_relaxed_exit(loads_first);
                    be.set_km_kv_early(kv_early);
                    be.set_attn_chunk(chunk);
                    let mut kv = be.kv_cache(shape).unwrap();
                    for layer in 0..n_layers {
                        be.kv_import(&mut kv, layer, &blocks, &past);
                    }
                    be.begin_step(&tokens, &batch, &rope, &attn, &[]);
                    let kernel = if prefill { "flash_attn_pp" } else { "flash_decode_km" };
                    assert!(be.step_flash_kernel().starts_with(kernel), "{}", be.step_flash_kernel());
                    if prefill {
                        assert_eq!(be.attention_takes_q_rope(&kv, 0), fused);
                        assert!(!be.attention_takes_rope(&kv, 0, &attn));
                    } else {
                        assert_eq!((chunk > 0, be.attention_takes_rope(&kv, 0, &attn)), (be.step_splits() > 1, fused));
                        assert!(!be.attention_takes_q_rope(&kv, 0));
                    }
                    let (mut o, mut cache) = (Vec::new(), Vec::new());
                    for layer in 0..n_layers {
                        // The cos/sin table: written by the step's first grouped or loop RoPE launch.
                        assert_eq!(be.rope_cs_ready(), prefill && layer > 0 && (fused || pairs), "layer {layer}");
                        be.norm_qkv_rope(
                            &dx, &dnw, eps, &mut dh, &lin, &mut dqkv, layer, &batch, &rope, &attn, &mut kv,
                        );
                        be.attention(&dqkv, layer, &batch, &attn, &mut kv, &mut out);
                        let mut ol = vec![0f32; n * attn.q_dim()];
                        be.to_host(&out, &mut ol);
                        o.extend(ol);
                        let mut cl = Vec::new();
                        be.kv_export(&kv, layer, &blocks, &mut cl);
                        cache.extend(cl);
                    }
                    runs.push((o, cache));
                }
                let off = runs.last().unwrap();
                for (on, form) in runs.iter().zip(forms).take(runs.len() - 1) {
                    let diff = on.0.iter().zip(&off.0).filter(|(a, b)| a.to_bits() != b.to_bits()).count();
                    let cache_diff = on.1.iter().zip(&off.1).filter(|(a, b)| a != b).count();
                    let new_kv = on.1.iter().zip(past.iter().cycle()).filter(|(a, b)| a != b).count();
                    println!(
                        "attention with RoPE, {n_heads}/{n_kv} heads d{hd}, {dtype:?} cache, {} rows (prefill \
                         {prefill}, form {form:?}, {n_layers} layers), interleaved {interleaved}, chunk {chunk} ({} \
                         splits): {diff} of {} outputs and {cache_diff} cache bytes differ; {new_kv} cache bytes new",
                        n,
                        be.step_splits(),
                        on.0.len()
                    );
                    assert!(on.0.iter().all(|v| v.is_finite()));
                    assert_eq!(diff, 0, "attention output: RoPE in the kernel against before it");
                    assert_eq!(cache_diff, 0, "cache: RoPE in the kernel against before it");
                    // The new tokens' k and v (es bytes each) replaced the past's: most bytes differ.
                    let new_max = 2 * es * n * n_kv * hd * n_layers;
                    assert!(new_kv > n * n_kv * hd * n_layers && new_kv <= new_max, "{new_kv} cache bytes new");
                }
            }
        }
    }
}

/// A one-token step's QKV GEMV with RoPE and the KV write in its epilogue
/// (`norm_qkv_rope` fused) gives the same bits as the GEMV then `rope_write_kv` (the
/// separate ops, each tested against the CPU above): q|k|v and every byte of the f16
/// cache, for both pair layouts, head_dim 128 (32/8 heads over 4,096) and 64 (9/3 over
/// 576), at positions 5 and 30,000; and the fused kernel is what ran (or not, with
/// the switch off or an f32 cache).
fn qkv_gemv_with_rope_equals_the_separate_ops() {
    use kernels::quant::GgmlType;
    use kernels::{AttnShape, Backend, KvDtype, KvShape, Rope, StepBatch, WeightPart};
    let eps = 1e-5f32;
    for (n_heads, n_kv, hd, hidden) in [(32usize, 8usize, 128usize, 4096usize), (9, 3, 64, 576)] {
        let attn = AttnShape { n_heads, n_kv_heads: n_kv, head_dim: hd, scale: 1.0 };
        let rows = attn.qkv_dim();
        let w: Vec<u8> = data(rows * hidden, 41).iter().flat_map(|x| x.to_le_bytes()).collect();
        let (x, nw) = (data(hidden, 42), data(hidden, 43));
        let inv_freq: Vec<f32> = (0..hd / 2).map(|i| 500000f32.powf(-2.0 * i as f32 / hd as f32)).collect();
        for interleaved in [false, true] {
            let rope = Rope { interleaved, inv_freq: inv_freq.clone() };
            for pos in [5usize, 30000] {
                // One sequence; its new token in block 3 of a 4-block cache (slot pos % 16).
                let table: Vec<u32> = (0..=pos / 16).map(|b| if b == pos / 16 { 3 } else { 0 }).collect();
                let spans = [kernels::SeqSpan { rows: 0..1, pos0: pos, block_table: &table }];
                let batch = StepBatch { n_tokens: 1, seqs: &spans, block_size: 16, fed: &[] };
                let mut runs: Vec<(Vec<f32>, Vec<u8>)> = Vec::new();
                for (fused, dtype) in [(true, KvDtype::F16), (false, KvDtype::F16), (true, KvDtype::F32)] {
                    let mut be = kernels::cuda::CudaBackend::new(0, true).expect("cuda:0 opens");
                    // (The fused kernel needs the one-token GEMV in its pipelined form; the
                    // separate ops here are the GEMV and rope_write_kv, not the RoPE that
                    // the keys-on-M attention kernel can take over.)
                    be.set_gemv_max_tokens(1);
                    be.set_gemv_pipe(true);
                    be.set_gemv_rope(fused);
                    be.set_attn_rope(false);
                    let lin = be.linear(&[WeightPart { ty: GgmlType::F32, rows, cols: hidden, bytes: &w }]).unwrap();
                    let shape =
                        KvShape { n_layers: 1, n_blocks: 4, block_size: 16, n_kv_heads: n_kv, head_dim: hd, dtype };
                    let mut kv = be.kv_cache(shape).unwrap();
                    let (dx, dnw) = (be.device().upload(&x).unwrap(), be.vector(&nw));
                    let (mut dh, mut dqkv) = (be.act(hidden).unwrap(), be.act(rows).unwrap());
                    be.begin_step(&[0], &batch, &rope, &attn, &[]);
                    let takes = be.fuses_qkv_rope(&lin, 1, &kv, 0, &attn);
                    assert_eq!(takes, fused && dtype == KvDtype::F16, "fused kernel taken: switch {fused}, {dtype:?}");
                    be.norm_qkv_rope(&dx, &dnw, eps, &mut dh, &lin, &mut dqkv, 0, &batch, &rope, &attn, &mut kv);
                    let mut q = vec![0f32; rows];
                    be.to_host(&dqkv, &mut q);
                    // Every block: the token's slot in block 3, nothing written elsewhere.
                    let mut cache = Vec::new();
                    be.kv_export(&kv, 0, &[0, 1, 2, 3], &mut cache);
                    runs.push((q, cache));
                }
                let (fused, separate) = (&runs[0], &runs[1]);
                let diff = fused.0.iter().zip(&separate.0).filter(|(a, b)| a.to_bits() != b.to_bits()).count();
                let cache_diff = fused.1.iter().zip(&separate.1).filter(|(a, b)| a != b).count();
                let block = fused.1.len() / 4;
                assert!(fused.1[..3 * block].iter().all(|b| *b == 0), "a write outside the token's block");
                let written = fused.1[3 * block..].chunks(2).filter(|b| b != &[0, 0]).count();
                println!(
                    "QKV GEMV + RoPE, {n_heads}/{n_kv} heads d{hd}, interleaved {interleaved}, position {pos}: \
                     {diff} of {rows} q|k|v values and {cache_diff} cache bytes differ; {written} cache values written"
                );
                assert!(fused.0.iter().all(|v| v.is_finite()));
                assert_eq!(diff, 0, "q|k|v: fused against separate");
                assert_eq!(cache_diff, 0, "cache: fused against separate");
                // The token's k and v: 2 × n_kv × hd values, nearly all nonzero.
                assert!(written > n_kv * hd && written <= 2 * n_kv * hd, "{written} cache values written");
                // The f32 cache (separate ops) holds the same q|k|v.
                assert_eq!(runs[2].0, fused.0, "q|k|v with an f32 cache");
            }
        }
    }
}

/// A one-token chain in which each residual GEMV leaves the next norm's inputs (x · weight,
/// sums of x²) and the normed GEMV after it takes them — gate/up (NormSilu), QKV with RoPE
/// and the KV write, and, through the gathered logit row, the output head — against the
/// same chain with `DISAGG_CUDA_GEMV_PRENORM=0` (each GEMV computes its norm, as the other
/// tests check against the CPU): the residual stream after a producing GEMV has the same
/// bits; what a prenormed GEMV writes differs by float rounding only (the scale applied
/// after the dot product instead of before, the squares summed in another order): held to
/// 1e-5 of the largest |value| (f16 cache values: 2e-3). The prenormed path must have run
/// three times with the switch on, never with it off. The prenormed chain again with two
/// loads per row in flight everywhere (`set_gemv_deep(false)`; by default its three
/// residual GEMVs, over ff = 2,304 columns (two groups of four loads and a tail), keep four
/// and, at 4,096 wide, its QKV three, where the GPU's SMs leave room) gives every value's
/// bits of the first.
fn prenormed_gemvs_match_the_gemvs_that_norm_themselves() {
    use kernels::quant::GgmlType;
    use kernels::{AttnShape, Backend, KvDtype, KvShape, Rope, StepBatch, WeightPart};
    let eps = 1e-5f32;
    let bytes = |v: &[f32]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
    let worst = |a: &[f32], b: &[f32]| {
        let top = b.iter().fold(0f32, |m, v| m.max(v.abs()));
        a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0f32, worst32) / top
    };
    for (n_heads, n_kv, hd, hidden) in [(9usize, 3usize, 64usize, 576usize), (32, 8, 128, 4096)] {
        let (ff, vocab) = (2304usize, 1000usize);
        let attn = AttnShape { n_heads, n_kv_heads: n_kv, head_dim: hd, scale: 1.0 };
        let q_rows = attn.qkv_dim();
        let (wgu, wd, wq, wh) =
            (data(2 * ff * hidden, 61), data(hidden * ff, 62), data(q_rows * hidden, 63), data(vocab * hidden, 64));
        let x0 = data(hidden, 65);
        let norms: Vec<Vec<f32>> = (0..4).map(|i| data(hidden, 70 + i)).collect();
        let inv_freq: Vec<f32> = (0..hd / 2).map(|i| 500000f32.powf(-2.0 * i as f32 / hd as f32)).collect();
        let rope = Rope { interleaved: false, inv_freq };
        let table = [2u32];
        let spans = [kernels::SeqSpan { rows: 0..1, pos0: 7, block_table: &table }];
        let batch = StepBatch { n_tokens: 1, seqs: &spans, block_size: 16, fed: &[] };
        // (x after the first residual GEMV, x after the second, q|k|v, cache, x at the end, logits)
        type Run = (Vec<f32>, Vec<f32>, Vec<f32>, Vec<f32>, Vec<f32>, Vec<f32>);
        let mut runs: Vec<Run> = Vec::new();
        for (prenorm, deep) in [(true, true), (false, true), (true, false)] {
            let mut be = kernels::cuda::CudaBackend::new(0, true).expect("cuda:0 opens");
            be.set_gemv_max_tokens(1);
            be.set_gemv_pipe(true);
            be.set_gemv_rope(true);
            be.set_gemv_prenorm(prenorm);
            be.set_gemv_deep(deep);
            // (The QKV trigger's bit 4, on by default, keeps the QKV GEMV at two loads per
            // row: off here, so the deep QKV kernel runs where it fits; run 3 has two loads
            // everywhere.)
            be.set_qkv_trigger(0);
            let lin = |be: &kernels::cuda::CudaBackend, rows: usize, cols: usize, w: &[f32]| {
                let b = bytes(w);
                be.linear(&[WeightPart { ty: GgmlType::F32, rows, cols, bytes: &b }]).unwrap()
            };
            let (gate_up, down) = (lin(&be, 2 * ff, hidden, &wgu), lin(&be, hidden, ff, &wd));
            let (qkv_w, head) = (lin(&be, q_rows, hidden, &wq), lin(&be, vocab, hidden, &wh));
            let dn: Vec<_> = norms.iter().map(|n| be.vector(n)).collect();
            let shape = KvShape {
                n_layers: 1,
                n_blocks: 4,
                block_size: 16,
                n_kv_heads: n_kv,
                head_dim: hd,
                dtype: KvDtype::F16,
            };
            let mut kv = be.kv_cache(shape).unwrap();
            let mut dx = be.device().upload(&x0).unwrap();
            let (mut h, mut gu, mut act) = (be.act(hidden).unwrap(), be.act(2 * ff).unwrap(), be.act(ff).unwrap());
            let (mut dqkv, mut sel, mut logits) =
                (be.act(q_rows).unwrap(), be.act(hidden).unwrap(), be.act(vocab).unwrap());
            be.begin_step(&[0], &batch, &rope, &attn, &[0]);
            let host =
                |be: &mut kernels::cuda::CudaBackend, v: &<kernels::cuda::CudaBackend as Backend>::Act, n: usize| {
                    let mut out = vec![0f32; n];
                    be.to_host(v, &mut out);
                    out
                };
            // 1. Leaves norm 1's inputs. 2. Takes them (gate/up), leaves norm 2's.
            be.mlp_residual(&mut dx, &dn[0], eps, 1, &mut h, &gate_up, &mut gu, ff, &mut act, &down, Some(&dn[1]));
            let x1 = host(&mut be, &dx, hidden);
            be.mlp_residual(&mut dx, &dn[1], eps, 1, &mut h, &gate_up, &mut gu, ff, &mut act, &down, Some(&dn[2]));
            let x2 = host(&mut be, &dx, hidden);
            // 3. QKV + RoPE + KV write takes norm 2's.
            be.norm_qkv_rope(&dx, &dn[2], eps, &mut h, &qkv_w, &mut dqkv, 0, &batch, &rope, &attn, &mut kv);
            let q = host(&mut be, &dqkv, q_rows);
            let mut cache = Vec::new();
            be.kv_export(&kv, 0, &[2], &mut cache);
            let cache: Vec<f32> = cache.chunks(2).map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32()).collect();
            // 4. Nothing prepared for this gate/up (norm's own); leaves norm 3's, which the
            //    output head takes through the gathered row.
            be.mlp_residual(&mut dx, &dn[2], eps, 1, &mut h, &gate_up, &mut gu, ff, &mut act, &down, Some(&dn[3]));
            let x3 = host(&mut be, &dx, hidden);
            be.gather_rows(&dx, &[0], hidden, &mut sel);
            be.norm_matmul(&sel, &dn[3], eps, 1, &mut h, &head, &mut logits);
            let lg = host(&mut be, &logits, vocab);
            assert_eq!(be.prenormed_gemvs(), if prenorm { 3 } else { 0 }, "prenormed GEMVs, switch {prenorm}");
            // Deep: the three residual GEMVs that leave the norm inputs (hidden / 16 blocks
            // over ff columns) and the prenormed QKV GEMV (q_rows / 16 over hidden) where
            // they fit; none without prenorm (those kernels do not run then).
            let sms = be.sm_count();
            let fits = 3 * u64::from(kernels::cuda::deep_gemv_fits(hidden / 16, ff, 4, sms))
                + u64::from(kernels::cuda::deep_gemv_fits(q_rows / 16, hidden, 3, sms));
            // (At 576 wide the residual GEMVs' 36 blocks fit any GPU of 18 SMs or more, and
            // 576 columns are too few for the QKV's: the deep kernels always run here.)
            assert!(hidden != 576 || fits == 3, "the deep kernels' coverage: {fits} of 4 fit");
            let deep_want = if deep && prenorm { fits } else { 0 };
            assert_eq!(be.deep_gemvs(), deep_want, "deep GEMVs, switches {prenorm} {deep}");
            runs.push((x1, x2, q, cache, x3, lg));
        }
        let bits = |r: &Run| {
            let (a, b, c, d, e, f) = r;
            [a, b, c, d, e, f].iter().flat_map(|v| v.iter().map(|x| x.to_bits())).collect::<Vec<u32>>()
        };
        let same = bits(&runs[2]) == bits(&runs[0]);
        println!(
            "prenormed GEMVs, {hidden} wide, two loads in flight: every value's bits {}",
            if same { "equal the deep kernels'" } else { "DIFFER" }
        );
        assert!(same, "the deep GEMVs changed bits");
        let (on, off) = (&runs[0], &runs[1]);
        assert!(on.0.iter().chain(&on.5).all(|v| v.is_finite()));
        let errs = [
            worst(&on.1, &off.1),
            worst(&on.2, &off.2),
            worst(&on.3, &off.3),
            worst(&on.4, &off.4),
            worst(&on.5, &off.5),
        ];
        println!(
            "prenormed GEMVs, {hidden} wide: x after the first residual GEMV {} the self-normed chain's; largest \
             difference / largest |value|: x {:.2e}, q|k|v {:.2e}, cache {:.2e}, x {:.2e}, logits {:.2e}",
            if on.0 == off.0 { "equals" } else { "DIFFERS from" },
            errs[0],
            errs[1],
            errs[2],
            errs[3],
            errs[4]
        );
        assert!(on.0 == off.0, "the producing GEMV changed the residual stream");
        assert!(errs[0] < 1e-5 && errs[1] < 1e-5 && errs[3] < 1e-5 && errs[4] < 1e-5, "{errs:?}");
        assert!(errs[2] < 2e-3, "cache: {}", errs[2]);
    }
}

/// The step's sequences, (cached positions, new rows) each, as consecutive row spans
/// over their block tables.
/// Steps of (cached positions, rows): mixed (prefill tiles; 770 keys run the
/// warp-specialized kernel's three-stage ring round twice), then decode only.
const MIXED_THEN_DECODE: [&[(usize, usize)]; 2] =
    [&[(37, 100), (700, 70), (500, 1)], &[(500, 1), (37, 1), (0, 1), (900, 1)]];

/// A mixed step whose decode row reaches further than its prompt: a split step's
/// keys-on-M launch must take its own rows' longest context.
const LONG_DECODE_BESIDE_A_PROMPT: &[(usize, usize)] = &[(20, 40), (1200, 1)];

/// The CPU backend's attention over a one-layer cache of `bytes` (every block, in the
/// transfer layout) for `batch`'s rows of `qkv`, and the largest |output| (the range the
/// GPU's errors are measured against).
fn cpu_attention(
    shape: kernels::KvShape,
    bytes: &[u8],
    qkv: &[f32],
    batch: &kernels::StepBatch,
    attn: &kernels::AttnShape,
) -> (Vec<f32>, f32) {
    use kernels::Backend;
    let mut cpu = kernels::cpu::CpuBackend::new(2);
    let mut ckv = cpu.kv_cache(shape).unwrap();
    let blocks: Vec<u32> = (0..shape.n_blocks as u32).collect();
    cpu.kv_import(&mut ckv, 0, &blocks, bytes);
    let mut want = vec![0f32; batch.n_tokens * attn.q_dim()];
    cpu.attention(&qkv.to_vec(), 0, batch, attn, &mut ckv, &mut want);
    let range = want.iter().fold(0f32, |m, v| m.max(v.abs()));
    (want, range)
}

/// Block tables for `seqs` (cached positions, rows) with blocks of `bs`: disjoint runs of
/// a fixed shuffle of the `n_blocks` blocks.
fn shuffled_tables(n_blocks: usize, seqs: &[(usize, usize)], bs: usize) -> Vec<Vec<u32>> {
    let mut perm: Vec<u32> = (0..n_blocks as u32).collect();
    let mut x = 12345u64;
    for i in (1..perm.len()).rev() {
        x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        perm.swap(i, (x >> 33) as usize % (i + 1));
    }
    let mut at = 0;
    seqs.iter()
        .map(|&(p0, n)| {
            let nb = (p0 + n).div_ceil(bs);
            at += nb;
            perm[at - nb..at].to_vec()
        })
        .collect()
}

fn spans_of<'a>(seqs: &[(usize, usize)], tables: &'a [Vec<u32>]) -> Vec<kernels::SeqSpan<'a>> {
    let mut row = 0;
    seqs.iter()
        .zip(tables)
        .map(|(&(p0, n), table)| {
            row += n;
            kernels::SeqSpan { rows: row - n..row, pos0: p0, block_table: table }
        })
        .collect()
}

/// The larger error, NaN if either is (`f32::max` would drop a NaN, and a kernel that
/// writes NaN must fail its test).
fn worst32(m: f32, v: f32) -> f32 {
    if m.is_nan() || v.is_nan() {
        f32::NAN
    } else {
        m.max(v)
    }
}

fn worst64(m: f64, v: f64) -> f64 {
    if m.is_nan() || v.is_nan() {
        f64::NAN
    } else {
        m.max(v)
    }
}

fn max_abs(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, worst32)
}

/// bf16 weights times f32 activations, against an f64 sum over the same bf16-rounded
/// weights: the GEMV kernel (≤ 8 tokens) reads f32 activations, so only its f32 sums
/// differ (held to 1e-5 of the row scale); cuBLAS (the cast path: more tokens, a width
/// not a multiple of 8, or the GEMV off) rounds the activations to bf16 (2⁻⁹ relative
/// each, held to 1e-2). With `accumulate` the product is added to what `out` held.
fn bf16_matmul_matches_cpu_with_and_without_gemv() {
    use kernels::quant::GgmlType;
    use kernels::{Backend, WeightPart};
    let mut be = kernels::cuda::CudaBackend::new(0, true).expect("cuda:0 opens");
    // 1000-wide rows end in a short 256-column step.
    // The skinny GEMM (sm_90) takes 2–8 tokens of the 4096- and 576-wide rows.
    for (rows, cols) in [(1000usize, 4096usize), (300, 1000), (37, 264), (40, 12), (300, 576)] {
        let w = data(rows * cols, 5);
        let w_bf16: Vec<f32> = w.iter().map(|v| half::bf16::from_f32(*v).to_f32()).collect();
        let bytes: Vec<u8> = w.iter().flat_map(|v| v.to_le_bytes()).collect();
        let lin = be.linear(&[WeightPart { ty: GgmlType::F32, rows, cols, bytes: &bytes }]).unwrap();
        for n in [1usize, 2, 3, 5, 8, 9, 17, 33, 64] {
            let x = data(n * cols, 6 + n as u32);
            let prior = data(n * rows, 99);
            let mut want = vec![0f32; n * rows];
            let mut scale = vec![0f32; n * rows];
            for t in 0..n {
                for r in 0..rows {
                    let (mut s, mut a) = (0f64, 0f64);
                    for c in 0..cols {
                        let p = w_bf16[r * cols + c] as f64 * x[t * cols + c] as f64;
                        s += p;
                        a += p.abs();
                    }
                    want[t * rows + r] = s as f32;
                    scale[t * rows + r] = a as f32;
                }
            }
            let dx = be.device().upload(&x).unwrap();
            // The GEMV (one token: with and without software-pipelined loads), cuBLAS, and
            // the skinny GEMM (sm_90; elsewhere the switch stays off and cuBLAS runs again).
            for (gemv, pipe, skinny) in [(8usize, true, false), (8, false, false), (0, true, false), (0, true, true)] {
                be.set_gemv_max_tokens(gemv);
                be.set_gemv_pipe(pipe);
                be.set_skinny(skinny);
                for accumulate in [false, true] {
                    let mut out = be.device().upload(&prior).unwrap();
                    be.matmul(&lin, &dx, n, &mut out, accumulate);
                    let mut got = vec![0f32; n * rows];
                    be.to_host(&out, &mut got);
                    let err = (0..n * rows)
                        .map(|i| {
                            let base = if accumulate { prior[i] } else { 0.0 };
                            ((got[i] - base - want[i]).abs() / scale[i].max(1e-3)) as f64
                        })
                        .fold(0f64, worst64);
                    let by_gemv = gemv >= n && cols % 8 == 0;
                    println!(
                        "matmul {rows}×{cols}, {n} tokens, gemv {by_gemv} (pipelined {pipe}), skinny switch {skinny}, accumulate {accumulate}: max |err| / Σ|w·x| = {err:.2e}"
                    );
                    assert!(
                        err < if by_gemv { 1e-5 } else { 1e-2 },
                        "{rows}×{cols}, {n} tokens, gemv {by_gemv}: {err}"
                    );
                }
            }
        }
    }
}

/// The decode step's fused GEMVs against the CPU ops they replace: RMSNorm then the
/// matmul (`norm_matmul`), and RMSNorm, the gate/up matmul, then SiLU·gate
/// (`norm_matmul_silu`), with f64 sums over the same bf16-rounded weights. Tolerance: the
/// f32 sums and the norm's own f32 reduction (1e-5 of Σ|w·h|; SiLU·gate scales the error
/// of g by at most ~1.1 and multiplies by u, so 1e-4 of |silu(g)|·Σ|w·h| + |u|-scaled
/// terms is held as 1e-4 of the product of the two row scales). More tokens than the GEMV
/// takes fall back to the unfused ops (also checked).
fn fused_gemv_matches_cpu_norm_matmul_silu() {
    let mut be = kernels::cuda::CudaBackend::new(0, true).expect("cuda:0 opens");
    // 576 and 2048 (the fused RMSNorm→bf16 kernel's first one or two float4 slots per
    // thread), 4096 (Llama-3-8B), 5000 (a last slot partly filled) and 8200 (past its
    // 8192 limit: the f32 norm and a cast; still a multiple of 8, so the GEMV takes it).
    for hidden in [576usize, 2048, 4096, 5000, 8200] {
        // One token with and without the GEMV's software-pipelined loads; past the GEMV,
        // RMSNorm straight to the bf16 GEMM input (its weights loaded after the row's sum or
        // first) or f32 and a cast.
        for (pipe, norm_cast, w_first) in
            [(true, true, false), (true, true, true), (false, true, false), (true, false, false)]
        {
            be.set_gemv_pipe(pipe);
            be.set_norm_cast(norm_cast);
            be.set_norm_weights_first(w_first);
            println!("GEMV pipelined {pipe}, RMSNorm to bf16 {norm_cast} (weights first {w_first}):");
            fused_gemv_case(&mut be, hidden);
        }
    }
}

/// The whole SwiGLU block with its residual add (`mlp_residual`) past the GEMV: SiLU·gate
/// writing the down projection's bf16 input itself gives the same bits as SiLU·gate in
/// f32 and a cast (the same f32 values, rounded once, into the same GEMM), and both match
/// an f64 reference over the bf16-rounded weights and GEMM inputs (the GPU's f32 sums
/// may round an input to the neighbouring bf16: held to 1e-2 of Σ|w·a|). The gate/up GEMM
/// writing bf16 (SiLU·gate reading it) matches the reference with those values rounded
/// too. One token takes the GEMV kernels instead (also checked against the reference).
fn mlp_residual_matches_cpu_fused_or_not() {
    use kernels::quant::GgmlType;
    use kernels::{Backend, WeightPart};
    let mut be = kernels::cuda::CudaBackend::new(0, true).expect("cuda:0 opens");
    let (hidden, ff, eps) = (512usize, 1024usize, 1e-5f32);
    let bf = |v: f64| half::bf16::from_f64(v).to_f64();
    let bytes = |v: &[f32]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
    let (wgu, wd) = (data(2 * ff * hidden, 41), data(hidden * ff, 42));
    let (bgu, bd) = (bytes(&wgu), bytes(&wd));
    let gate_up = be.linear(&[WeightPart { ty: GgmlType::F32, rows: 2 * ff, cols: hidden, bytes: &bgu }]).unwrap();
    let down = be.linear(&[WeightPart { ty: GgmlType::F32, rows: hidden, cols: ff, bytes: &bd }]).unwrap();
    let nw = data(hidden, 43);
    let dnw = be.vector(&nw);
    for n in [1usize, 12, 40] {
        let x = data(n * hidden, 50 + n as u32);
        // The reference: bf16 GEMM inputs past the GEMV (the GEMV reads f32 activations),
        // and with `gu_out` the gate/up GEMM's output rounded to bf16 as well.
        let gemm_in = |v: f64| if n == 1 { v } else { bf(v) };
        let reference = |gu_out: bool| {
            let (mut want, mut scale) = (x.iter().map(|&v| v as f64).collect::<Vec<f64>>(), vec![0f64; n * hidden]);
            for t in 0..n {
                let mut h = vec![0f32; hidden];
                rms_norm_rows(&x[t * hidden..(t + 1) * hidden], &nw, eps, &mut h);
                let dot = |r: usize| {
                    let v = (0..hidden).map(|c| bf(wgu[r * hidden + c] as f64) * gemm_in(h[c] as f64)).sum::<f64>();
                    if gu_out {
                        bf(v)
                    } else {
                        v
                    }
                };
                let a: Vec<f64> = (0..ff)
                    .map(|j| {
                        let (g, u) = (dot(j), dot(ff + j));
                        gemm_in(g / (1.0 + (-g).exp()) * u)
                    })
                    .collect();
                for r in 0..hidden {
                    for (j, aj) in a.iter().enumerate() {
                        let p = bf(wd[r * ff + j] as f64) * aj;
                        want[t * hidden + r] += p;
                        scale[t * hidden + r] += p.abs();
                    }
                }
            }
            (want, scale)
        };
        let (exact, rounded) = (reference(false), reference(true));
        let mut runs: Vec<Vec<f32>> = Vec::new();
        // SiLU·gate to bf16 from f32 gate/up values, from bf16 ones (past the GEMV: n > 1
        // here takes cuBLAS), and the f32 SiLU·gate then a cast.
        for (fused, gu16) in [(true, false), (true, true), (false, false)] {
            be.set_silu_bf16(fused);
            be.set_gu_bf16(gu16);
            let (want, scale) = if gu16 && n > 1 { &rounded } else { &exact };
            let mut dx = be.device().upload(&x).unwrap();
            let (mut h, mut gu, mut act) =
                (be.act(n * hidden).unwrap(), be.act(n * 2 * ff).unwrap(), be.act(n * ff).unwrap());
            be.mlp_residual(&mut dx, &dnw, eps, n, &mut h, &gate_up, &mut gu, ff, &mut act, &down, None);
            let mut got = vec![0f32; n * hidden];
            be.to_host(&dx, &mut got);
            let err = (0..n * hidden).map(|i| (got[i] as f64 - want[i]).abs() / scale[i].max(1e-6)).fold(0f64, worst64);
            println!(
                "mlp_residual {hidden}→{ff}→{hidden}, {n} tokens, SiLU·gate to bf16 {fused}, gate/up in bf16 {gu16}: \
                 max |err| / Σ|w·a| = {err:.2e}"
            );
            assert!(err < 1e-2, "mlp_residual, {n} tokens, fused {fused}, gate/up in bf16 {gu16}: {err}");
            runs.push(got);
        }
        assert!(runs[0] == runs[2], "{n} tokens: SiLU·gate to bf16 changed the result");
        // bf16 gate/up values are the GEMV's own at one token, rounded past it.
        assert!(
            (runs[0] == runs[1]) == (n == 1),
            "{n} tokens: gate/up in bf16 ran where it should not, or did not run"
        );
    }
    be.set_silu_bf16(true);
    be.set_gu_bf16(true);
}

/// The down projection split over K by the backend (`set_splitk_norm`), its partials added
/// to the residual by one kernel that also writes the next RMSNorm's bf16 output, against
/// one cuBLAS GEMM and the norm's own launch: x within f32 reordering, the norm the
/// following GEMM reads equal in bits to what `rms_norm_bf16_rows` writes from that x,
/// and the skipped norm counted only where the split ran.
fn split_k_down_and_its_norm_match_the_unsplit_ops() {
    use kernels::quant::GgmlType;
    use kernels::{Backend, WeightPart};
    let mut be = kernels::cuda::CudaBackend::new(0, true).expect("cuda:0 opens");
    // ff 14,336: from 9 tokens, 4 slices of 3,584 up to 64 tokens and 2 up to 128; none past
    // 128 or on the skinny GEMM's 8.
    let (hidden, ff, out_rows, eps) = (512usize, 14336usize, 384usize, 1e-5f32);
    let bytes = |v: &[f32]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
    let lin = |be: &kernels::cuda::CudaBackend, rows: usize, cols: usize, seed: u32| {
        let b = bytes(&data(rows * cols, seed).iter().map(|v| v / 64.0).collect::<Vec<f32>>());
        be.linear(&[WeightPart { ty: GgmlType::F32, rows, cols, bytes: &b }]).unwrap()
    };
    let (gate_up, down, next) =
        (lin(&be, 2 * ff, hidden, 81), lin(&be, hidden, ff, 82), lin(&be, out_rows, hidden, 83));
    let (n1, n2) = (be.vector(&data(hidden, 84)), be.vector(&data(hidden, 85)));
    for (n, split) in [(12usize, true), (40, true), (64, true), (100, true), (200, false), (8, false)] {
        let x0 = data(n * hidden, 90 + n as u32);
        // (x after the MLP, the next GEMM on the norm of x, the same from a copy of x)
        let mut runs: Vec<(Vec<f32>, Vec<f32>)> = Vec::new();
        for from in [0usize, 9] {
            be.set_splitk_norm(from);
            let taken = be.splitk_norms();
            let mut dx = be.device().upload(&x0).unwrap();
            let (mut h, mut gu, mut act) =
                (be.act(n * hidden).unwrap(), be.act(n * 2 * ff).unwrap(), be.act(n * ff).unwrap());
            let mut y = be.act(n * out_rows).unwrap();
            be.mlp_residual(&mut dx, &n1, eps, n, &mut h, &gate_up, &mut gu, ff, &mut act, &down, Some(&n2));
            be.norm_matmul(&dx, &n2, eps, n, &mut h, &next, &mut y);
            let skipped = be.splitk_norms() - taken;
            assert_eq!(skipped, u64::from(from > 0 && split), "{n} tokens, split-K from {from}: norms skipped");
            // The same norm and GEMM from a copy of x: the norm's own launch.
            let mut xs = vec![0f32; n * hidden];
            be.to_host(&dx, &mut xs);
            let dcopy = be.device().upload(&xs).unwrap();
            let mut y2 = be.act(n * out_rows).unwrap();
            be.norm_matmul(&dcopy, &n2, eps, n, &mut h, &next, &mut y2);
            let (mut a, mut b) = (vec![0f32; n * out_rows], vec![0f32; n * out_rows]);
            be.to_host(&y, &mut a);
            be.to_host(&y2, &mut b);
            assert!(
                a == b,
                "{n} tokens, split-K from {from}: the norm written with x differs from rms_norm_bf16_rows'"
            );
            runs.push((xs, a));
        }
        let top = runs[0].0.iter().fold(0f32, |m, v| m.max(v.abs()));
        let dx = runs[0].0.iter().zip(&runs[1].0).map(|(a, b)| (a - b).abs()).fold(0f32, worst32) / top;
        println!("split-K down, {n} tokens (split {split}): x differs by {dx:.2e} of its range from one GEMM");
        if split {
            assert!(dx < 1e-5, "{n} tokens: split-K x off by {dx:.2e} of the range");
        } else {
            assert!(runs[0] == runs[1], "{n} tokens: the unsplit path changed");
        }
    }
}

fn fused_gemv_case(be: &mut kernels::cuda::CudaBackend, hidden: usize) {
    use kernels::quant::GgmlType;
    use kernels::{Backend, WeightPart};
    let (ff, eps) = (1536usize, 1e-5f32);
    let bf = |v: &[f32]| v.iter().map(|x| half::bf16::from_f32(*x).to_f32()).collect::<Vec<f32>>();
    let bytes = |v: &[f32]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
    let (wq, wgu) = (data(hidden * hidden, 21), data(2 * ff * hidden, 22));
    let (wq_b, wgu_b) = (bf(&wq), bf(&wgu));
    let (bq, bgu) = (bytes(&wq), bytes(&wgu));
    let q = be.linear(&[WeightPart { ty: GgmlType::F32, rows: hidden, cols: hidden, bytes: &bq }]).unwrap();
    let gu = be.linear(&[WeightPart { ty: GgmlType::F32, rows: 2 * ff, cols: hidden, bytes: &bgu }]).unwrap();
    let nw = data(hidden, 23);
    let dnw = be.vector(&nw);
    be.set_gemv_max_tokens(8);
    for n in [1usize, 4, 8, 12] {
        let x = data(n * hidden, 30 + n as u32);
        let mut h = vec![0f32; n * hidden];
        for r in 0..n {
            rms_norm_rows(&x[r * hidden..(r + 1) * hidden], &nw, eps, &mut h[r * hidden..(r + 1) * hidden]);
        }
        // Row r of W times token t of h, and Σ|w·h| (the error scale).
        let dot = |w: &[f32], r: usize, t: usize| {
            let (mut s, mut a) = (0f64, 0f64);
            for c in 0..hidden {
                let p = w[r * hidden + c] as f64 * h[t * hidden + c] as f64;
                s += p;
                a += p.abs();
            }
            (s, a)
        };
        let dx = be.device().upload(&x).unwrap();
        let mut dh = be.act(n * hidden).unwrap();
        let mut dgu = be.act(n * 2 * ff).unwrap();
        // norm_matmul
        let mut out = be.act(n * hidden).unwrap();
        be.norm_matmul(&dx, &dnw, eps, n, &mut dh, &q, &mut out);
        let mut got = vec![0f32; n * hidden];
        be.to_host(&out, &mut got);
        let mut err = 0f64;
        for t in 0..n {
            for r in 0..hidden {
                let (s, a) = dot(&wq_b, r, t);
                err = worst64(err, (got[t * hidden + r] as f64 - s).abs() / a);
            }
        }
        // The GEMV takes rows whose width is a multiple of 8 (else cuBLAS on bf16 inputs).
        let fused = n <= 8 && hidden.is_multiple_of(8);
        println!("norm_matmul {hidden} wide, {n} tokens (fused {fused}): max |err| / Σ|w·h| = {err:.2e}");
        assert!(err < if fused { 1e-5 } else { 1e-2 }, "norm_matmul, {n} tokens: {err}");
        // norm_matmul_silu
        let mut act = be.act(n * ff).unwrap();
        be.norm_matmul_silu(&dx, &dnw, eps, n, &mut dh, &gu, &mut dgu, ff, &mut act);
        let mut got = vec![0f32; n * ff];
        be.to_host(&act, &mut got);
        let mut err = 0f64;
        for t in 0..n {
            for r in 0..ff {
                let ((g, ga), (u, ua)) = (dot(&wgu_b, r, t), dot(&wgu_b, ff + r, t));
                let want = g / (1.0 + (-g).exp()) * u;
                let scale = (ga * (u.abs() + ua)).max(1e-6);
                err = worst64(err, (got[t * ff + r] as f64 - want).abs() / scale);
            }
        }
        println!("norm_matmul_silu {hidden} wide, {n} tokens (fused {fused}): max |err| / scale = {err:.2e}");
        assert!(err < if fused { 1e-4 } else { 1e-2 }, "norm_matmul_silu, {n} tokens: {err}");
    }
}
