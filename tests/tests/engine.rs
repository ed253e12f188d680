//! Engine behaviour on the embedded model: batching, chunking and preemption do not
//! change results; cancellation frees KV blocks at once; sampling parameters do what
//! they say; bad requests are clear errors.

use disagg_tests::{engine, reference, test_options};
use engine::sampling::SamplingParams;
use engine::scheduler::{run_to_completion, Completed, EngineCore, FinishReason};
use engine::EngineError;
use kernels::cpu::CpuBackend;

fn greedy(n: usize) -> SamplingParams {
    SamplingParams { max_tokens: Some(n), ignore_eos: true, logprobs: Some(3), ..SamplingParams::greedy() }
}

fn prompts() -> Vec<Vec<u32>> {
    reference().cases.into_iter().map(|c| c.prompt_ids).collect()
}

/// Tokens and the exact bits of every reported logprob.
fn fingerprint(c: &Completed) -> (Vec<u32>, Vec<u32>) {
    let bits = c
        .logprobs
        .iter()
        .flat_map(|l| std::iter::once(l.logprob).chain(l.top.iter().map(|t| t.1)))
        .map(f32::to_bits)
        .collect();
    (c.output_ids.clone(), bits)
}

fn run(core: &mut EngineCore<CpuBackend>, reqs: Vec<(Vec<u32>, SamplingParams)>) -> Vec<Completed> {
    let out = run_to_completion(core, reqs, 1).unwrap();
    assert_eq!(core.stats().kv_blocks_used, 0, "KV blocks leaked");
    assert!(!core.has_work());
    out
}

#[test]
fn batched_decoding_equals_one_at_a_time() {
    let mut core = engine(&test_options());
    let ps = prompts();
    let alone: Vec<_> = ps.iter().map(|p| fingerprint(&run(&mut core, vec![(p.clone(), greedy(24))])[0])).collect();
    let batched = run(&mut core, ps.iter().map(|p| (p.clone(), greedy(24))).collect());
    for (i, b) in batched.iter().enumerate() {
        assert_eq!(fingerprint(b), alone[i], "prompt {i}: batched output differs from alone (tokens or logprob bits)");
    }
}

#[test]
fn stats_count_decode_only_steps() {
    // One short prompt, 5 tokens: a prefill step (it samples the first) and 4 steps
    // that decode one token each.
    let mut core = engine(&test_options());
    run(&mut core, vec![(prompts()[0].clone(), greedy(5))]);
    let s = core.stats();
    assert_eq!((s.steps, s.decode_only_steps), (5, 4), "{s:?}");
    // Under a 7-token budget a longer prompt takes several prefill steps, none decode-only.
    let mut opts = test_options();
    opts.max_batched_tokens = 7;
    opts.max_num_seqs = 4;
    let mut core = engine(&opts);
    let p = prompts().into_iter().find(|p| p.len() > 14).expect("a prompt of over 14 tokens");
    let prefill_steps = p.len().div_ceil(7) as u64;
    run(&mut core, vec![(p, greedy(3))]);
    let s = core.stats();
    assert_eq!((s.steps, s.decode_only_steps), (prefill_steps + 2, 2), "{s:?}");
}

#[test]
fn handle_stats_include_the_step_of_each_delivered_output() {
    // Through the engine thread: as soon as a request's last output arrives, the stats
    // already count the step that produced it (benchmarks read them right then).
    let h = engine::handle::EngineHandle::spawn(engine(&test_options()), 16);
    for round in 1..=8u64 {
        let mut st = h.submit(prompts()[0].clone(), greedy(3)).unwrap();
        while st.blocking_next().is_some() {}
        assert!(st.error().is_none(), "{:?}", st.error());
        let s = h.stats();
        // Per request: a prefill step (it samples the first token) and two decode steps.
        assert_eq!((s.steps, s.decode_only_steps), (3 * round, 2 * round), "{s:?}");
        assert!(s.step_s > 0.0, "{s:?}");
    }
}

/// One stream item: new token ids, new text, finish reason.
type Item = (Vec<u32>, String, Option<FinishReason>);

/// Every prompt of `prompts()` submitted at once through `h`, the `i`-th with `params(i)`,
/// and the items each stream yields, in order; fails when a stream stops for 60 s.
fn stream_all(
    rt: &tokio::runtime::Runtime,
    h: &engine::handle::EngineHandle,
    params: impl Fn(usize) -> SamplingParams,
) -> Vec<Vec<Item>> {
    rt.block_on(async {
        let jobs: Vec<_> = prompts()
            .into_iter()
            .enumerate()
            .map(|(i, p)| {
                let (h, params) = (h.clone(), params(i));
                tokio::spawn(async move {
                    let mut st = h.submit(p, params).unwrap();
                    let mut items = Vec::new();
                    while let Some(i) = st.next().await {
                        items.push((i.out.new_token_ids.clone(), i.out.new_text.clone(), i.out.finish.clone()));
                    }
                    assert!(st.error().is_none(), "{:?}", st.error());
                    items
                })
            })
            .collect();
        let mut all = Vec::new();
        for j in jobs {
            let within = tokio::time::timeout(std::time::Duration::from_secs(60), j).await;
            all.push(within.expect("outputs stopped arriving").unwrap());
        }
        all
    })
}

#[test]
fn async_scheduling_through_the_engine_thread_delivers_every_output() {
    // The engine thread (EngineHandle, as `serve` runs it) with deferred sampling. Once
    // every token a request asked for has been sampled, the next call of step() only
    // reads the last step's tokens: it runs no step but returns outputs, often the
    // requests' last ones, which must still reach their streams (they were once dropped
    // as "nothing scheduled", and the requests never finished). The same items as
    // without async scheduling, sent by the engine thread and by a delivery task.
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let run = |defer: bool, task: bool| {
        let mut core = engine(&test_options());
        core.backend_mut().set_defer_sampling(defer);
        let h = engine::handle::EngineHandle::spawn(core, 64);
        if task {
            h.deliver_on(rt.handle());
        }
        let outs = stream_all(&rt, &h, |i| SamplingParams { logprobs: None, ..greedy(3 + 4 * i) });
        let s = h.stats();
        assert_eq!(s.async_steps > 0, defer, "{s:?}");
        assert_eq!(s.kv_blocks_used, 0, "KV blocks leaked: {s:?}");
        h.shutdown();
        outs
    };
    let want = run(false, false);
    assert!(want.iter().all(|items| items.last().is_some_and(|i| i.2.is_some())), "every request finished");
    for task in [false, true] {
        assert_eq!(run(true, task), want, "async scheduling, delivery task {task}");
    }
}

#[test]
fn outputs_through_a_delivery_task_arrive_whole_and_in_order() {
    // The same concurrent requests with outputs sent by the engine thread and by a task
    // on a runtime (`deliver_on`, called twice: one task): the same tokens and text,
    // item by item in order; and with the task, a stream dropped part-way still frees
    // its blocks (through the abort its drop sends).
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let run = |task: bool| {
        let h = engine::handle::EngineHandle::spawn(engine(&test_options()), 64);
        if task {
            h.deliver_on(rt.handle());
            h.deliver_on(rt.handle());
        }
        let outs = stream_all(&rt, &h, |_| greedy(12));
        // A long request dropped after its first outputs.
        rt.block_on(async {
            let mut st = h.submit(prompts()[0].clone(), greedy(500)).unwrap();
            for _ in 0..3 {
                let next = tokio::time::timeout(std::time::Duration::from_secs(60), st.next()).await;
                next.expect("outputs stopped arriving").expect("an output");
            }
        });
        // The outputs went through the task (or not at all through one).
        assert_eq!(h.delivered_batches() > 0, task, "batches sent on by a delivery task");
        let t0 = std::time::Instant::now();
        while h.stats().kv_blocks_used > 0 || h.in_flight() > 0 {
            assert!(t0.elapsed().as_secs() < 10, "a dropped stream kept its blocks: {:?}", h.stats());
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        h.shutdown();
        outs
    };
    let (direct, task) = (run(false), run(true));
    assert_eq!(direct.len(), prompts().len());
    for (i, (a, b)) in direct.iter().zip(&task).enumerate() {
        assert!(a.last().is_some_and(|l| l.2.is_some()), "request {i} did not finish");
        assert_eq!(a.iter().map(|x| x.0.len()).sum::<usize>(), 12);
        assert_eq!(a, b, "request {i}: outputs differ through the delivery task");
    }
}

#[test]
fn step_outputs_go_out_by_delivery_priority() {
    // The same requests, arriving in three waves of different lengths, on two engines:
    // one returns each step's outputs in row order (oldest request first), the other by
    // delivery priority. Every step gives the same outputs; by priority they are the
    // row order stably sorted by (a request's first text, its last output, the rest).
    let waves: Vec<Vec<(u64, usize)>> = vec![vec![(0, 2), (1, 6)], vec![(2, 3), (3, 5)], vec![(4, 4)]];
    let mut cores = [engine(&test_options()), engine(&test_options())];
    cores[0].set_priority_order(false);
    cores[1].set_priority_order(true);
    let ps = prompts();
    let mut texted = std::collections::HashSet::new();
    let (mut mixed, mut steps) = (0, 0);
    for wave in waves.iter().map(Some).chain(std::iter::repeat_n(None, 12)) {
        for core in cores.iter_mut() {
            for &(id, n) in wave.into_iter().flatten() {
                core.add_request(id, ps[id as usize % ps.len()].clone(), greedy(n)).unwrap();
            }
        }
        if !cores[0].has_work() {
            break;
        }
        let rows = cores[0].step();
        let by_prio = cores[1].step();
        steps += 1;
        let key = |o: &engine::scheduler::RequestOutput| {
            if !texted.contains(&o.id) && !o.new_text.is_empty() {
                0
            } else if o.finish.is_some() {
                1
            } else {
                2
            }
        };
        let keys: Vec<u8> = rows.iter().map(key).collect();
        mixed += keys.windows(2).any(|w| w[0] > w[1]) as usize;
        let mut want: Vec<(u8, &engine::scheduler::RequestOutput)> = keys.iter().copied().zip(&rows).collect();
        want.sort_by_key(|w| w.0);
        let want: Vec<_> = want.iter().map(|w| (w.1.id, &w.1.new_token_ids, &w.1.new_text)).collect();
        let got: Vec<_> = by_prio.iter().map(|o| (o.id, &o.new_token_ids, &o.new_text)).collect();
        assert_eq!(got, want, "step {steps}: outputs by priority");
        texted.extend(rows.iter().filter(|o| !o.new_text.is_empty()).map(|o| o.id));
    }
    assert!(!cores[0].has_work() && !cores[1].has_work());
    assert!(mixed >= 2, "only {mixed} steps had a later-priority output ahead of an earlier one in row order");
    for core in &cores {
        assert_eq!(core.stats().kv_blocks_used, 0, "KV blocks leaked");
    }
}

#[test]
fn chunked_prefill_equals_whole_prefill() {
    let ps = prompts();
    let reqs = || ps.iter().map(|p| (p.clone(), greedy(8))).collect::<Vec<_>>();
    let whole = run(&mut engine(&test_options()), reqs());
    let mut opts = test_options();
    opts.max_batched_tokens = 7;
    opts.max_num_seqs = 4;
    let mut core = engine(&opts);
    let chunked = run(&mut core, reqs());
    for (w, c) in whole.iter().zip(&chunked) {
        assert_eq!(fingerprint(w), fingerprint(c));
    }
    // Under a 7-token budget the prompts can only have been prefilled in chunks.
    let prompt_tokens: usize = ps.iter().map(Vec::len).sum();
    assert!(ps.iter().any(|p| p.len() > 7));
    assert!(core.stats().steps as usize >= prompt_tokens / 7, "prompts were not chunked: {:?}", core.stats());
}

#[test]
fn preempted_sequences_recompute_to_the_same_tokens() {
    let ps: Vec<_> = prompts().into_iter().take(6).collect();
    // Greedy and seeded sampling both: recomputation must not disturb the random stream.
    let params = |i: usize| {
        if i.is_multiple_of(2) {
            greedy(40)
        } else {
            SamplingParams {
                max_tokens: Some(40),
                ignore_eos: true,
                temperature: 0.9,
                seed: Some(i as u64),
                ..Default::default()
            }
        }
    };
    let reqs = || ps.iter().enumerate().map(|(i, p)| (p.clone(), params(i))).collect::<Vec<_>>();
    let calm = run(&mut engine(&test_options()), reqs());
    let mut opts = test_options();
    // 4 MiB holds 11 blocks of 16 tokens: far less than six sequences of ~70 tokens.
    opts.kv_cache_mib = 4;
    let mut tight = engine(&opts);
    assert_eq!(tight.cfg.n_blocks, 11);
    let squeezed = run(&mut tight, reqs());
    assert!(tight.stats().preemptions > 0, "the small cache caused no preemption");
    for (i, (a, b)) in calm.iter().zip(&squeezed).enumerate() {
        assert_eq!(fingerprint(a), fingerprint(b), "sequence {i} changed after preemption");
    }
}

#[test]
fn cancellation_frees_blocks_at_once() {
    let mut core = engine(&test_options());
    let ps = prompts();
    for (i, p) in ps.iter().take(3).enumerate() {
        core.add_request(i as u64, p.clone(), greedy(100)).unwrap();
    }
    for _ in 0..5 {
        core.step();
    }
    let used = core.stats().kv_blocks_used;
    assert!(used > 0);
    let own = ps[1].len().div_ceil(16);
    assert!(core.abort(1));
    let after = core.stats().kv_blocks_used;
    assert!(after < used && used - after >= own, "abort freed {} blocks, expected at least {own}", used - after);
    assert!(!core.abort(1), "aborting twice is a no-op");
    // The others keep going and finish normally.
    let mut finished = 0;
    while core.has_work() {
        finished += core.step().iter().filter(|o| o.finish.is_some()).count();
    }
    assert_eq!(finished, 2);
    assert_eq!(core.stats().kv_blocks_used, 0);
    // A waiting request can be cancelled too.
    core.add_request(9, ps[0].clone(), greedy(4)).unwrap();
    assert!(core.abort(9));
    assert!(!core.has_work());
}

#[test]
fn seeded_sampling_is_reproducible_and_seeds_differ() {
    let mut core = engine(&test_options());
    let p = prompts()[0].clone();
    let sp = |seed| SamplingParams {
        max_tokens: Some(24),
        temperature: 1.0,
        seed: Some(seed),
        ignore_eos: true,
        ..Default::default()
    };
    let a = run(&mut core, vec![(p.clone(), sp(7))]).remove(0).output_ids;
    // Same seed, this time batched with other requests.
    let b = run(&mut core, vec![(p.clone(), sp(8)), (p.clone(), sp(7)), (p.clone(), sp(9))]);
    assert_eq!(b[1].output_ids, a);
    assert!(b[0].output_ids != a || b[2].output_ids != a, "different seeds gave the same sample");
}

#[test]
fn filters_that_leave_one_candidate_are_greedy() {
    let mut core = engine(&test_options());
    let p = prompts()[1].clone();
    let g = run(&mut core, vec![(p.clone(), greedy(16))]).remove(0).output_ids;
    let base = SamplingParams {
        max_tokens: Some(16),
        temperature: 1.5,
        seed: Some(3),
        ignore_eos: true,
        ..Default::default()
    };
    for (name, sp) in [
        ("top_k=1", SamplingParams { top_k: 1, ..base.clone() }),
        ("top_p=1e-6", SamplingParams { top_p: 1e-6, ..base.clone() }),
        ("min_p=1", SamplingParams { min_p: 1.0, ..base.clone() }),
    ] {
        assert_eq!(run(&mut core, vec![(p.clone(), sp)]).remove(0).output_ids, g, "{name}");
    }
}

#[test]
fn stop_strings_stop_tokens_and_lengths() {
    let mut core = engine(&test_options());
    let p = prompts()[0].clone(); // "The capital of France is"
    let free = run(&mut core, vec![(p.clone(), greedy(32))]).remove(0);
    assert_eq!(free.finish, Some(FinishReason::Length));
    assert_eq!(free.output_ids.len(), 32);
    // Stop at the first newline: the text up to it, without it.
    let nl = free.text.find('\n').expect("the continuation has a newline");
    let sp = SamplingParams { stop: vec!["\n".into()], ..greedy(32) };
    let stopped = run(&mut core, vec![(p.clone(), sp)]).remove(0);
    assert_eq!(stopped.finish, Some(FinishReason::Stop));
    assert_eq!(stopped.text, free.text[..nl]);
    // A stop string spanning tokens, and one that never appears.
    let span = &free.text[nl - 3..nl + 2];
    let sp = SamplingParams { stop: vec!["never appears".into(), span.into()], ..greedy(32) };
    let stopped = run(&mut core, vec![(p.clone(), sp)]).remove(0);
    assert_eq!(stopped.text, free.text[..nl - 3]);
    // A stop token id: generation ends with it.
    let third = free.output_ids[2];
    let sp = SamplingParams { stop_token_ids: vec![third], ..greedy(32) };
    let stopped = run(&mut core, vec![(p.clone(), sp)]).remove(0);
    assert_eq!(stopped.finish, Some(FinishReason::Stop));
    assert_eq!(*stopped.output_ids.last().unwrap(), third);
    assert!(stopped.output_ids.len() <= 3);
}

#[test]
fn end_of_sequence_ends_generation_and_min_tokens_defers_it() {
    let r = reference();
    let chat = r.cases.iter().find(|c| c.name == "chat_default_system").unwrap();
    let mut core = engine(&test_options());
    let eos = core.tokenizer.eos_ids.clone();
    let sp = SamplingParams { max_tokens: Some(64), ..SamplingParams::greedy() };
    let done = run(&mut core, vec![(chat.prompt_ids.clone(), sp.clone())]).remove(0);
    assert_eq!(done.finish, Some(FinishReason::Stop));
    assert!(eos.contains(done.output_ids.last().unwrap()));
    assert!(!done.text.contains("<|im_end|>"), "special tokens are not in the text: {:?}", done.text);
    assert!(done.text.contains('4'), "{:?}", done.text);
    let n = done.output_ids.len();
    let sp = SamplingParams { min_tokens: n + 5, ..sp };
    let longer = run(&mut core, vec![(chat.prompt_ids.clone(), sp)]).remove(0);
    assert!(longer.output_ids.len() >= n + 5);
    assert!(longer.output_ids[..n + 4].iter().all(|t| !eos.contains(t)));
}

#[test]
fn penalties_and_logit_bias_change_the_choice() {
    let mut core = engine(&test_options());
    // A prompt that invites repetition.
    let p = core.tokenizer.encode("one two one two one two one two one two").unwrap();
    let distinct = |c: &Completed| {
        let mut v = c.output_ids.clone();
        v.sort();
        v.dedup();
        v.len()
    };
    let plain = run(&mut core, vec![(p.clone(), greedy(24))]).remove(0);
    for sp in [
        SamplingParams { frequency_penalty: 2.0, ..greedy(24) },
        SamplingParams { presence_penalty: 2.0, ..greedy(24) },
        SamplingParams { repetition_penalty: 3.0, ..greedy(24) },
    ] {
        let pen = run(&mut core, vec![(p.clone(), sp.clone())]).remove(0);
        assert!(
            distinct(&pen) > distinct(&plain),
            "{sp:?}: {} distinct tokens vs {}",
            distinct(&pen),
            distinct(&plain)
        );
    }
    let target = core.tokenizer.encode(" banana").unwrap()[0];
    let sp = SamplingParams { logit_bias: vec![(target, 100.0)], ..greedy(3) };
    let biased = run(&mut core, vec![(p, sp)]).remove(0);
    assert_eq!(biased.output_ids, vec![target; 3]);
}

#[test]
fn logprobs_are_the_models_distribution() {
    let mut core = engine(&test_options());
    let p = prompts()[0].clone();
    let logits = core.score(&p).unwrap();
    let sp = SamplingParams { logprobs: Some(5), ..greedy(2) };
    let done = run(&mut core, vec![(p, sp)]).remove(0);
    let lp = &done.logprobs[0];
    let max = logits.iter().fold(f32::NEG_INFINITY, |a, b| a.max(*b)) as f64;
    let lse = max + logits.iter().map(|l| (*l as f64 - max).exp()).sum::<f64>().ln();
    assert_eq!(lp.top.len(), 5);
    assert_eq!(lp.token, lp.top[0].0, "greedy picks the most likely token");
    assert_eq!(lp.logprob, lp.top[0].1);
    for w in lp.top.windows(2) {
        assert!(w[0].1 >= w[1].1, "top logprobs are sorted");
    }
    for (t, l) in &lp.top {
        let want = logits[*t as usize] as f64 - lse;
        assert!((*l as f64 - want).abs() < 1e-4, "token {t}: {l} vs {want}");
    }
    assert!(lp.top.iter().map(|(_, l)| (*l as f64).exp()).sum::<f64>() <= 1.0 + 1e-6);
}

fn invalid(core: &mut EngineCore<CpuBackend>, prompt: Vec<u32>, sp: SamplingParams, needle: &str) {
    match core.add_request(99, prompt, sp) {
        Err(EngineError::InvalidRequest(m)) => assert!(m.contains(needle), "message {m:?} should mention {needle:?}"),
        other => panic!("expected an InvalidRequest mentioning {needle:?}, got {other:?}"),
    }
    assert!(!core.has_work());
    assert_eq!(core.stats().kv_blocks_used, 0);
}

#[test]
fn bad_requests_are_clear_errors() {
    let mut opts = test_options();
    opts.max_model_len = 64;
    let mut core = engine(&opts);
    let p = vec![100u32; 10];
    let g = SamplingParams::greedy;
    invalid(&mut core, p.clone(), SamplingParams { temperature: -1.0, ..g() }, "temperature");
    invalid(&mut core, p.clone(), SamplingParams { temperature: f32::NAN, ..g() }, "temperature");
    invalid(&mut core, p.clone(), SamplingParams { top_p: 0.0, ..g() }, "top_p");
    invalid(&mut core, p.clone(), SamplingParams { top_p: 1.5, ..g() }, "top_p");
    invalid(&mut core, p.clone(), SamplingParams { top_k: -5, ..g() }, "top_k");
    invalid(&mut core, p.clone(), SamplingParams { min_p: 2.0, ..g() }, "min_p");
    invalid(&mut core, p.clone(), SamplingParams { repetition_penalty: 0.0, ..g() }, "repetition_penalty");
    invalid(&mut core, p.clone(), SamplingParams { presence_penalty: 3.0, ..g() }, "presence_penalty");
    invalid(&mut core, p.clone(), SamplingParams { frequency_penalty: -2.5, ..g() }, "frequency_penalty");
    invalid(&mut core, p.clone(), SamplingParams { logprobs: Some(21), ..g() }, "logprobs");
    invalid(&mut core, p.clone(), SamplingParams { max_tokens: Some(0), ..g() }, "max_tokens");
    invalid(&mut core, p.clone(), SamplingParams { stop: vec![String::new()], ..g() }, "stop");
    invalid(&mut core, p.clone(), SamplingParams { logit_bias: vec![(1 << 30, 1.0)], ..g() }, "logit_bias");
    invalid(&mut core, p.clone(), SamplingParams { logit_bias: vec![(5, 1000.0)], ..g() }, "logit_bias");
    invalid(&mut core, p.clone(), SamplingParams { stop_token_ids: vec![u32::MAX], ..g() }, "stop_token_ids");
    invalid(&mut core, p.clone(), SamplingParams { min_tokens: 9, max_tokens: Some(3), ..g() }, "min_tokens");
    invalid(&mut core, vec![], g(), "empty");
    invalid(&mut core, vec![100, 49152], g(), "out of range");
    invalid(&mut core, vec![100; 70], g(), "context length");
    invalid(&mut core, p.clone(), SamplingParams { max_tokens: Some(60), ..g() }, "max_tokens");
    // The engine still works afterwards.
    let ok = run(&mut core, vec![(p, SamplingParams { max_tokens: Some(3), ..g() })]);
    assert_eq!(ok[0].output_ids.len(), 3);
}

#[test]
fn async_scheduling_gives_the_same_outputs() {
    // Deferred sampling on the CPU backend drives the engine's async path: plain-greedy
    // steps leave their tokens for the next call, which launches decode-only steps before
    // reading them. Every kind of request, ended by length, end token, stop string and
    // stop token, must come out the same as without it, with and without preemption.
    let r = reference();
    let chat = r.cases.iter().find(|c| c.name == "chat_default_system").unwrap().prompt_ids.clone();
    let ps: Vec<_> = prompts().into_iter().take(5).collect();
    let mut reqs: Vec<(Vec<u32>, SamplingParams)> = Vec::new();
    for (i, p) in ps.iter().enumerate() {
        reqs.push((p.clone(), SamplingParams { logprobs: None, ..greedy(12 + 5 * i) }));
    }
    // Ends at its end token (the engine computes one token past it and drops it).
    reqs.push((chat.clone(), SamplingParams { max_tokens: Some(64), ..SamplingParams::greedy() }));
    // Its end token masked for a while (edits: sampled on the host), then plain.
    reqs.push((chat.clone(), SamplingParams { max_tokens: Some(64), min_tokens: 3, ..SamplingParams::greedy() }));
    reqs.push((ps[0].clone(), SamplingParams { stop: vec!["\n".into()], logprobs: None, ..greedy(40) }));
    reqs.push((ps[1].clone(), greedy(10))); // logprobs: never deferred
    let seeded = SamplingParams { temperature: 0.8, seed: Some(5), ..SamplingParams { logprobs: None, ..greedy(20) } };
    reqs.push((ps[2].clone(), seeded));
    reqs.push((ps[3].clone(), SamplingParams { presence_penalty: 0.5, logprobs: None, ..greedy(20) }));
    let full = |c: &Completed| (fingerprint(c), c.text.clone(), c.finish.clone());
    for kv_mib in [64, 4] {
        let mut opts = test_options();
        opts.kv_cache_mib = kv_mib;
        opts.max_num_seqs = 8; // some wait, and join mid-run
        let mut sync = engine(&opts);
        sync.backend_mut().set_defer_sampling(false); // (whatever DISAGG_ASYNC_SCHEDULING says)
        let want = run(&mut sync, reqs.clone());
        let mut asyn = engine(&opts);
        asyn.backend_mut().set_defer_sampling(true);
        let got = run(&mut asyn, reqs.clone());
        for (i, (a, b)) in want.iter().zip(&got).enumerate() {
            assert_eq!(full(a), full(b), "request {i} ({kv_mib} MiB of KV) differs with async scheduling");
        }
        assert_eq!(want[5].finish, Some(FinishReason::Stop), "the chat request ends at its end token");
        let (s, a) = (sync.stats(), asyn.stats());
        assert_eq!(s.async_steps, 0, "{s:?}");
        // (A step overlaps only when all its rows are plain greedy: here, once the others
        // are done.)
        assert!(a.async_steps > 0, "no step overlapped: {a:?}");
        if kv_mib == 4 {
            assert!(s.preemptions > 0 && a.preemptions > 0, "the small cache caused no preemption: {s:?} {a:?}");
        }
    }
}

#[test]
fn async_scheduling_survives_cancellation_mid_flight() {
    // A request cancelled while its token is on its way loses nothing else: the others
    // finish as they would have, and every block comes back.
    let ps = prompts();
    let sp = |n| SamplingParams { logprobs: None, ..greedy(n) };
    let alone: Vec<_> = {
        let mut core = engine(&test_options());
        [0, 2].iter().map(|&i| run(&mut core, vec![(ps[i].clone(), sp(20))]).remove(0).output_ids).collect()
    };
    let mut core = engine(&test_options());
    core.backend_mut().set_defer_sampling(true);
    for (i, p) in ps.iter().take(3).enumerate() {
        core.add_request(i as u64, p.clone(), sp(20)).unwrap();
    }
    let mut got: std::collections::HashMap<u64, Vec<u32>> = Default::default();
    for _ in 0..5 {
        for o in core.step() {
            got.entry(o.id).or_default().extend(o.new_token_ids);
        }
    }
    assert!(core.stats().async_steps > 0);
    assert!(core.abort(1));
    while core.has_work() {
        for o in core.step() {
            assert_ne!(o.id, 1, "an output after cancellation");
            got.entry(o.id).or_default().extend(o.new_token_ids);
        }
    }
    assert_eq!(got[&0], alone[0]);
    assert_eq!(got[&2], alone[1]);
    let s = core.stats();
    assert_eq!(s.kv_blocks_used, 0, "KV blocks leaked");
    // All greedy: every decode step but the first overlapped (19 of each sequence's 20
    // tokens come from decode steps; the last step's token is read without one).
    assert!(s.async_steps >= 17, "{s:?}");
}
