//! Prefix caching in the engine: a cached prefix is not computed again and changes
//! nothing in the output; the host tier gives back the very bytes it took; the router's
//! hashes and index agree with the engine's cache.

use disagg_tests::{engine, test_options};
use engine::prefix::{block_hashes, HashSalt};
use engine::sampling::SamplingParams;
use engine::scheduler::{run_to_completion, CacheTier, EngineCore, KvEvent};
use kernels::cpu::CpuBackend;

fn tokens(n: usize, seed: u32) -> Vec<u32> {
    (0..n as u32).map(|i| 100 + (i.wrapping_mul(37).wrapping_add(seed.wrapping_mul(7919))) % 5000).collect()
}

fn greedy(n: usize) -> SamplingParams {
    SamplingParams { max_tokens: Some(n), ignore_eos: true, ..SamplingParams::greedy() }
}

/// Runs one request alone; returns (output ids, cached tokens, tokens computed).
fn run(core: &mut EngineCore<CpuBackend>, prompt: &[u32], params: SamplingParams, id: u64) -> (Vec<u32>, usize, u64) {
    let before = core.stats().forward_tokens;
    core.add_request(id, prompt.to_vec(), params).unwrap();
    let (mut ids, mut cached) = (Vec::new(), 0);
    while core.has_work() {
        for o in core.step() {
            ids.extend(&o.new_token_ids);
            cached = o.cached_tokens;
        }
    }
    (ids, cached, core.stats().forward_tokens - before)
}

#[test]
fn a_shared_prefix_is_computed_once_and_changes_nothing() {
    let mut warm = engine(&test_options());
    let mut cold = engine(&engine::load::EngineOptions { prefix_caching: false, ..test_options() });
    let prefix = tokens(1000, 1);
    let a: Vec<u32> = prefix.iter().copied().chain(tokens(40, 2)).collect();
    let b: Vec<u32> = prefix.iter().copied().chain(tokens(50, 3)).collect();
    let (_, cached_a, _) = run(&mut warm, &a, greedy(8), 1);
    assert_eq!(cached_a, 0);
    let (ids, cached, computed) = run(&mut warm, &b, greedy(8), 2);
    // 62 full blocks of the prefix (992 tokens) come from the cache: the prompt's
    // other 58 tokens are prefilled, then 7 decode steps of one token.
    assert_eq!(cached, 992);
    assert_eq!(computed, (b.len() - 992 + 7) as u64);
    let (cold_ids, cold_cached, cold_computed) = run(&mut cold, &b, greedy(8), 1);
    assert_eq!(ids, cold_ids, "greedy output with the cached prefix equals a cold run");
    assert_eq!((cold_cached, cold_computed), (0, (b.len() + 7) as u64));
    let s = warm.stats();
    assert_eq!(s.kv_blocks_used, 0, "cached blocks are free");
    assert!(s.kv_blocks_cached >= 62);
    assert_eq!((s.prefix_cache_queries, s.prefix_cache_hits), ((a.len() + b.len()) as u64, 992));
    // The very same prompt again: everything but its last block's worth is reused.
    let (ids2, cached2, _) = run(&mut warm, &b, greedy(8), 3);
    assert_eq!((ids2, cached2), (cold_ids, (b.len() - 1) / 16 * 16));
}

#[test]
fn cache_salts_keep_tenants_apart() {
    let mut core = engine(&test_options());
    let p = tokens(200, 4);
    let salted = |s: &str| SamplingParams { cache_salt: Some(s.into()), ..greedy(2) };
    assert_eq!(run(&mut core, &p, salted("a"), 1).1, 0);
    assert_eq!(run(&mut core, &p, salted("b"), 2).1, 0, "another tenant shares nothing");
    assert_eq!(run(&mut core, &p, greedy(2), 3).1, 0, "nor does an unsalted request");
    assert_eq!(run(&mut core, &p, salted("a"), 4).1, 192, "the same tenant does");
}

#[test]
fn host_tier_offload_and_reload_are_bit_identical() {
    // 11 device blocks, a host tier of 22.
    let mut opts = test_options();
    opts.kv_cache_mib = 4;
    opts.host_cache_mib = 8;
    let mut core = engine(&opts);
    assert_eq!(core.stats().kv_blocks_total, 11);
    core.record_kv_events(true);
    let a = tokens(100, 5);
    let (first, _, _) = run(&mut core, &a, greedy(4), 1);
    let hashes = block_hashes(core.hash_salt(None), 16, &a);
    assert_eq!(hashes.len(), 6);
    let original: Vec<Vec<u8>> = hashes.iter().map(|h| core.cached_block_kv(*h).expect("cached")).collect();
    // Two other prompts need the device blocks: A's go to the host tier.
    run(&mut core, &tokens(150, 6), greedy(2), 2);
    run(&mut core, &tokens(150, 7), greedy(2), 3);
    for h in &hashes {
        assert!(core.cached_block_kv(*h).is_none(), "evicted from the device tier");
        assert!(core.host_has(*h), "kept in the host tier");
    }
    let events = core.take_kv_events();
    let host_stored: Vec<u64> = events
        .iter()
        .filter_map(|e| match e {
            KvEvent::Stored { tier: CacheTier::Host, hashes } => Some(hashes.clone()),
            _ => None,
        })
        .flatten()
        .collect();
    assert!(hashes.iter().all(|h| host_stored.contains(h)), "offloads are announced");
    // A again: its 6 full blocks come back from the host; only 4 tokens are computed
    // for the prompt, then 3 decode steps.
    let (again, cached, computed) = run(&mut core, &a, greedy(4), 4);
    assert_eq!(again, first);
    assert_eq!((cached, computed), (96, 4 + 3));
    for (h, bytes) in hashes.iter().zip(&original) {
        assert_eq!(core.cached_block_kv(*h).as_ref(), Some(bytes), "block {h:x} reloaded bit for bit");
    }
    assert_eq!(core.stats().kv_blocks_used, 0);
}

#[test]
fn router_hashes_and_index_follow_the_engine_cache() {
    let mut opts = test_options();
    opts.kv_cache_mib = 4;
    let mut core = engine(&opts);
    core.record_kv_events(true);
    let mut ix = router::kv_index::KvIndex::new();
    let slot = ix.add_worker("decode:w").unwrap();
    let snap = engine::handle::KvEventBatch { seq: 0, snapshot: true, events: core.kv_snapshot() };
    ix.apply(slot, &snap).unwrap();
    // The router salts with the model identity the worker reports.
    let salt = HashSalt::new(&core.model.cfg.identity(), None);
    let prompts: Vec<Vec<u32>> = (0..4).map(|i| tokens(90, 10 + i)).collect();
    for (i, p) in prompts.iter().enumerate() {
        run(&mut core, p, greedy(2), i as u64 + 1);
        let b = engine::handle::KvEventBatch { seq: i as u64 + 1, snapshot: false, events: core.take_kv_events() };
        ix.apply(slot, &b).unwrap();
        // After every request (and its evictions), the index says exactly what the
        // engine holds, for every prompt so far, computed from the router's side.
        for q in &prompts[..=i] {
            let h = block_hashes(salt, 16, q);
            let held = h.iter().take_while(|h| core.cached_block_kv(**h).is_some()).count();
            assert_eq!(ix.overlaps(&h).device[slot] as usize, held, "after request {i}");
        }
    }
    // 11 blocks cannot hold 4 × 5 full blocks: the first prompt was evicted.
    assert_eq!(ix.overlaps(&block_hashes(salt, 16, &prompts[0])).device[slot], 0);
    assert!(ix.overlaps(&block_hashes(salt, 16, &prompts[3])).device[slot] > 0);
}

#[test]
fn requests_sharing_a_prefix_in_one_batch_finish_alike() {
    // Many concurrent requests with one system prompt: shared blocks are reference
    // counted; the results equal one-at-a-time runs, and every block comes back.
    let mut core = engine(&test_options());
    let sys = tokens(64, 20);
    let reqs: Vec<(Vec<u32>, SamplingParams)> =
        (0..6).map(|i| (sys.iter().copied().chain(tokens(10 + i, 30 + i as u32)).collect(), greedy(6))).collect();
    // Warm the cache with the system prompt, then run them together.
    run(&mut core, &sys, greedy(1), 100);
    let hits = core.stats().prefix_cache_hits;
    let together = run_to_completion(&mut core, reqs.clone(), 1).unwrap();
    assert_eq!(core.stats().prefix_cache_hits - hits, 6 * 64, "each took the system prompt from the cache");
    let mut cold = engine(&engine::load::EngineOptions { prefix_caching: false, ..test_options() });
    for (i, (p, sp)) in reqs.into_iter().enumerate() {
        let (ids, _, _) = run(&mut cold, &p, sp, 50 + i as u64);
        assert_eq!(together[i].output_ids, ids, "request {i}");
    }
    assert_eq!(core.stats().kv_blocks_used, 0);
}
