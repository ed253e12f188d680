//! Disaggregation inside one process: a prompt prefilled by one engine (exporting its
//! KV layer by layer) and decoded by another (importing it into reserved blocks) gives
//! the same tokens as one engine doing both.

use std::sync::{Arc, Mutex};

use disagg_tests::{engine, test_options};
use engine::sampling::SamplingParams;
use engine::scheduler::{run_to_completion, EngineCore, KvChunk, RequestOutput};
use kernels::cpu::CpuBackend;

fn prompt(n: usize) -> Vec<u32> {
    (0..n).map(|i| 100 + (i as u32 * 37) % 5000).collect()
}

/// Reserves blocks for `prompt` on `d` (taking what its prefix cache has), prefills it
/// on `p`, moves the KV `d` lacks into `d`, decodes there; returns all tokens, the
/// chunks moved and the blocks `d` had cached.
fn disaggregated(
    p: &mut EngineCore<CpuBackend>,
    d: &mut EngineCore<CpuBackend>,
    prompt: Vec<u32>,
    params: SamplingParams,
) -> (Vec<u32>, Vec<KvChunk>, usize) {
    let res = d.reserve(7, prompt.clone(), params.clone()).unwrap();
    let chunks = Arc::new(Mutex::new(Vec::new()));
    let sink = chunks.clone();
    let skip = res.cached_blocks;
    p.add_exporting(1, prompt.clone(), params.clone(), Box::new(move |c| sink.lock().unwrap().push(c)), skip).unwrap();
    let mut first: Option<RequestOutput> = None;
    while p.has_work() {
        for o in p.step() {
            assert!(o.finish.is_some(), "an exporting request ends after its first token");
            first = Some(o);
        }
    }
    assert_eq!(p.stats().kv_blocks_used, 0, "the prefill engine freed its blocks");
    let first = first.expect("a first token");
    let chunks = std::mem::take(&mut *chunks.lock().unwrap());
    for c in &chunks {
        d.import_kv(7, c).unwrap();
    }
    let out = d.activate(7, first.new_token_ids[0], first.logprobs.first().cloned(), first.cached_tokens).unwrap();
    let mut ids = out.new_token_ids.clone();
    let mut done = out.finish.is_some();
    while !done {
        for o in d.step() {
            ids.extend(&o.new_token_ids);
            done |= o.finish.is_some();
        }
    }
    assert_eq!(d.stats().kv_blocks_used, 0, "the decode engine freed its blocks");
    (ids, chunks, skip)
}

#[test]
fn prefill_here_decode_there_equals_one_engine() {
    // Chunked prefill on the exporting side (budget 48 tokens, block size 16), so blocks
    // become final over several steps and the last block is partial.
    let mut popts = test_options();
    popts.max_batched_tokens = 48;
    popts.max_num_seqs = 8;
    let mut p = engine(&popts);
    let mut d = engine(&test_options());
    let mut one = engine(&test_options());
    let n_layers = p.model.cfg.n_layers;
    for (len, params) in [
        (150, SamplingParams { max_tokens: Some(12), ..SamplingParams::greedy() }),
        (33, SamplingParams { max_tokens: Some(10), temperature: 0.9, seed: Some(5), ..SamplingParams::default() }),
        (
            16,
            SamplingParams {
                max_tokens: Some(8),
                temperature: 0.7,
                top_p: 0.9,
                seed: Some(11),
                presence_penalty: 0.5,
                ..SamplingParams::default()
            },
        ),
    ] {
        let expect = run_to_completion(&mut one, vec![(prompt(len), params.clone())], 1).unwrap().remove(0);
        let (ids, chunks, skip) = disaggregated(&mut p, &mut d, prompt(len), params);
        assert_eq!(ids, expect.output_ids, "prompt of {len} tokens");
        // Each prompt is a prefix of the one before: the decode engine has its full
        // blocks cached (bar the last block, which always moves) and takes only the rest.
        assert_eq!(skip, if len == 150 { 0 } else { (len - 1) / 16 }, "prompt of {len} tokens");
        // Every (layer, block) not cached exactly once, each layer in block order.
        let n_blocks = len.div_ceil(16);
        for l in 0..n_layers as u32 {
            let mut next = skip as u32;
            for c in chunks.iter().filter(|c| c.layer == l) {
                assert_eq!(c.first_block, next, "layer {l}");
                next += c.n_blocks;
            }
            assert_eq!(next as usize, n_blocks, "layer {l}");
        }
        if len == 150 {
            assert!(chunks.iter().filter(|c| c.layer == 0).count() >= 3, "blocks leave as prefill chunks finish");
        }
    }
}

/// With FP8 (E4M3) caches on both engines, the KV moves as stored, one byte per element
/// (half of f16's chunk bytes), and the decode engine continues exactly as one engine
/// with an FP8 cache does; the transfer layout names the type by that size.
#[test]
fn an_fp8_cache_moves_as_stored() {
    use kernels::KvDtype;
    let mut opts = test_options();
    opts.kv_dtype = KvDtype::Fp8;
    let (mut p, mut d, mut one) = (engine(&opts), engine(&opts), engine(&opts));
    let params = SamplingParams { max_tokens: Some(10), ..SamplingParams::greedy() };
    let expect = run_to_completion(&mut one, vec![(prompt(70), params.clone())], 1).unwrap().remove(0);
    let (ids, chunks, skip) = disaggregated(&mut p, &mut d, prompt(70), params);
    assert_eq!(skip, 0);
    assert_eq!(ids, expect.output_ids, "decoded after the FP8 KV moved");
    let shape = d.kv_shape();
    assert_eq!(shape.dtype, KvDtype::Fp8);
    let layout = rpc::transfer_layout(&shape);
    assert_eq!(layout.dtype_bytes, 1);
    assert_eq!(KvDtype::from_bytes(layout.dtype_bytes), Some(KvDtype::Fp8));
    let per_block = 2 * shape.block_size * shape.n_kv_heads * shape.head_dim;
    for c in &chunks {
        assert_eq!(c.data.len(), c.n_blocks as usize * per_block, "layer {}: one byte per element", c.layer);
    }
    // An FP8 engine's tokens are its own: the f16 engine's may differ, but the KV did move.
    assert_eq!(chunks.iter().map(|c| c.n_blocks as usize).sum::<usize>(), 70usize.div_ceil(16) * shape.n_layers);
}

#[test]
fn reservations_are_bounded_and_aborts_free_them() {
    let mut opts = test_options();
    opts.kv_cache_mib = 4;
    let mut d = engine(&opts);
    let total = d.stats().kv_blocks_total;
    let long = prompt(16 * (total - 1));
    d.reserve(1, long.clone(), SamplingParams::greedy()).unwrap();
    assert_eq!(d.stats().kv_blocks_used, total - 1);
    let e = d.reserve(2, prompt(40), SamplingParams::greedy()).unwrap_err();
    assert!(matches!(e, engine::EngineError::Busy(_)), "{e}");
    assert!(e.to_string().contains("free KV blocks"), "{e}");
    // A chunk outside the reservation or of the wrong size is refused, never written.
    let bytes = d.kv_shape().block_bytes_per_layer();
    let bad = KvChunk { layer: 0, first_block: (total - 1) as u32, n_blocks: 1, data: vec![0; bytes] };
    assert!(d.import_kv(1, &bad).is_err());
    let bad = KvChunk { layer: 0, first_block: 0, n_blocks: 1, data: vec![0; bytes - 1] };
    assert!(d.import_kv(1, &bad).is_err());
    assert!(d.import_kv(9, &KvChunk { layer: 0, first_block: 0, n_blocks: 1, data: vec![0; bytes] }).is_err());
    assert!(d.abort(1));
    assert_eq!(d.stats().kv_blocks_used, 0);
    assert!(!d.has_work());
}

#[test]
fn activated_requests_and_running_ones_make_progress_when_blocks_run_out() {
    // 11 blocks. R runs and grows; A holds 5 blocks from a transfer. Both must finish
    // (someone is preempted and recomputed), and every block comes back.
    let mut opts = test_options();
    opts.kv_cache_mib = 4;
    let mut d = engine(&opts);
    let total = d.stats().kv_blocks_total;
    assert_eq!(total, 11);
    let r_params = SamplingParams { max_tokens: Some(60), ignore_eos: true, ..SamplingParams::greedy() };
    d.add_request(1, prompt(80), r_params).unwrap();
    d.step();
    let a_params = SamplingParams { max_tokens: Some(30), ignore_eos: true, ..SamplingParams::greedy() };
    // Another prompt than R's, so nothing comes from the prefix cache.
    let other: Vec<u32> = prompt(80).iter().map(|t| t + 1).collect();
    d.reserve(2, other, a_params).unwrap();
    let bytes = d.kv_shape().block_bytes_per_layer();
    for layer in 0..d.model.cfg.n_layers as u32 {
        d.import_kv(2, &KvChunk { layer, first_block: 0, n_blocks: 5, data: vec![0; 5 * bytes] }).unwrap();
    }
    d.activate(2, 100, None, 0).unwrap();
    let mut done = std::collections::HashSet::new();
    for _ in 0..2000 {
        if !d.has_work() {
            break;
        }
        for o in d.step() {
            if o.finish.is_some() {
                done.insert(o.id);
            }
        }
    }
    assert_eq!(done.len(), 2, "both requests finished");
    assert!(d.stats().preemptions > 0, "blocks ran out, as intended");
    assert_eq!(d.stats().kv_blocks_used, 0);
}
