//! `disagg bench …`: benchmarks that print JSON.

use std::time::Instant;

use clap::{Args, Subcommand};
use engine::load::cpu_engine;
use engine::sampling::SamplingParams;
use engine::scheduler::EngineCore;
use kernels::Backend;
use serde_json::json;

use crate::EngineArgs;

#[derive(Subcommand, Debug)]
pub enum BenchCmd {
    /// Engine throughput: prefill of one prompt, decode at several batch sizes.
    Engine(EngineBenchArgs),
    /// Gateway overhead: the same streaming load through HTTP and straight into the
    /// engine, at several concurrency levels.
    Serve(crate::bench_serve::ServeBenchArgs),
    /// KV-transfer throughput on loopback against a plain TCP copy of the same bytes.
    Transfer(crate::bench_transfer::TransferBenchArgs),
    /// Router decision latency with a large KV index, and a multi-turn workload over
    /// `disagg up` comparing routing policies.
    Routing(crate::bench_routing::RoutingBenchArgs),
}

#[derive(Args, Debug)]
pub struct EngineBenchArgs {
    #[command(flatten)]
    engine: EngineArgs,
    /// Prompt length for the prefill measurement.
    #[arg(long, default_value_t = 512)]
    prompt_tokens: usize,
    /// Tokens decoded per sequence in the decode measurements.
    #[arg(long, default_value_t = 128)]
    gen_tokens: usize,
    /// Decode batch sizes.
    #[arg(long, value_delimiter = ',', default_value = "1,8,32")]
    batch: Vec<usize>,
    /// Prompt length of each sequence in the decode measurements (its context).
    #[arg(long, default_value_t = 8)]
    context: usize,
    /// Repetitions of each measurement (the median is reported).
    #[arg(long, default_value_t = 3)]
    repeat: usize,
    /// Time from the first run on: without the untimed run of each timed shape (the
    /// prefill, and each batch at its context) that otherwise comes first, as in the
    /// peers' scripts, so that first-use work (CUDA graph capture, buffers growing)
    /// falls into the timed runs, as it did before this flag existed.
    #[arg(long)]
    no_warmup: bool,
    /// Time the prefill before the decode batches, as before this flag existed. By
    /// default it comes after them, in the peers' order (`../shared/tools/vllm-peer`:
    /// decode batches 1, 16, 64, then the 8k prefill): on the H200 a batch-1 decode timed
    /// right after 8k prefills ran 1.5–2% slower than the same batch timed later.
    #[arg(long)]
    prefill_first: bool,
    /// Prefill the timed prompt in steps of at most this many tokens (chunked prefill, as
    /// vLLM's `max_num_batched_tokens`; the peers' long-context script uses 16384); the
    /// prefill time is then up to the prompt's first token. Default: the whole prompt in
    /// one step. (The bench sets the step budget itself: not with --max-batched-tokens.)
    #[arg(long)]
    prefill_chunk: Option<usize>,
    /// Also time a mixed step in each decode batch: once the batch decodes, a new
    /// request's prompt of this many tokens is prefilled in one step beside it. Reported
    /// per batch as `mixed_step_ms`: that step's time (the two step calls around it, less
    /// one whole-batch decode step, as asynchronous scheduling returns a step's work in
    /// the next call).
    #[arg(long)]
    mixed_prompt_tokens: Option<usize>,
    /// Print JSON (the only output format; accepted for symmetry with other commands).
    #[arg(long)]
    json: bool,
}

pub fn run(cmd: BenchCmd) -> anyhow::Result<()> {
    match cmd {
        BenchCmd::Engine(a) => engine_bench(a),
        BenchCmd::Serve(a) => crate::bench_serve::run(a),
        BenchCmd::Transfer(a) => crate::bench_transfer::run(a),
        BenchCmd::Routing(a) => crate::bench_routing::run(a),
    }
}

/// The `p` quantile (nearest rank) of `v`; NaN when empty.
pub fn pct(mut v: Vec<f64>, p: f64) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(|a, b| a.total_cmp(b));
    v[((v.len() - 1) as f64 * p).round() as usize]
}

/// Distinct pseudo-random token ids for seed `seed` (clear of the special tokens).
pub fn random_ids(seed: u64, n: usize) -> Vec<u32> {
    let mut x = 0x2545_F491_4F6C_DD1Du64 ^ seed.wrapping_mul(0x9E37_79B9);
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            200 + (x % 40_000) as u32
        })
        .collect()
}

pub fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

/// Deterministic pseudo-random prompt ids (avoiding the special tokens at the start of
/// the vocabulary).
fn prompt(n: usize, salt: u64, vocab: usize) -> Vec<u32> {
    let mut x = 0x9E37_79B9_7F4A_7C15u64 ^ salt;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (100 + x % (vocab as u64 - 100)) as u32
        })
        .collect()
}

fn engine_bench(a: EngineBenchArgs) -> anyhow::Result<()> {
    // (Warnings on stderr, e.g. a CUDA graph capture that failed; `DISAGG_LOG` as the
    // servers take it. The JSON goes to stdout.)
    crate::serve::init_logging();
    if a.repeat == 0 {
        anyhow::bail!("--repeat must be at least 1 (the median of that many runs is reported)");
    }
    if a.batch.is_empty() || a.batch.contains(&0) {
        anyhow::bail!("--batch takes decode batch sizes of at least 1, e.g. --batch 1,8,32");
    }
    if a.context == 0 || a.prompt_tokens == 0 {
        anyhow::bail!("--context and --prompt-tokens must be at least 1 token");
    }
    if a.gen_tokens < 2 {
        anyhow::bail!("--gen-tokens must be at least 2: the prefill gives the first token, decode steps the rest");
    }
    let mut opts = a.engine.options()?;
    let max_batch = a.batch.iter().copied().max().unwrap_or(1);
    opts.max_num_seqs = opts.max_num_seqs.max(max_batch);
    // Decode is timed over the steps where the whole batch decodes, so every prompt of a
    // batch must be prefilled before the first ones finish: big enough prefill chunks,
    // at least a whole prompt beside the decode rows of the rest of the batch (else a long
    // prompt takes two steps and 16 prompts of 32k outlast 16 generated tokens).
    let batch_prompts = (max_batch * a.context).min(16384).max(a.context + max_batch);
    let step_floor = opts.max_num_seqs.max(batch_prompts);
    let prefill_step = match a.prefill_chunk {
        Some(_) if a.engine.max_batched_tokens.is_some() => {
            anyhow::bail!("give --prefill-chunk or --max-batched-tokens, not both: the bench sets the step budget")
        }
        Some(0) => anyhow::bail!("--prefill-chunk must be at least 1 token"),
        Some(n) if n < step_floor && n < a.prompt_tokens => anyhow::bail!(
            "--prefill-chunk {n} is below the {step_floor} tokens a step takes here (--max-num-seqs {}, and a \
             decode batch's prompt beside its other rows, {batch_prompts}); raise it, or lower those flags",
            opts.max_num_seqs
        ),
        Some(n) => n.min(a.prompt_tokens),
        None => opts.max_batched_tokens.max(a.prompt_tokens),
    };
    opts.max_batched_tokens = prefill_step.max(step_floor);
    match a.mixed_prompt_tokens {
        Some(0) => anyhow::bail!("--mixed-prompt-tokens must be at least 1 token"),
        Some(n) if a.prefill_chunk.is_some() && n + max_batch > opts.max_batched_tokens => anyhow::bail!(
            "--mixed-prompt-tokens {n} beside a batch of {max_batch} needs steps of {} tokens, more than the \
             {} that --prefill-chunk leaves; raise the chunk or shorten the prompt",
            n + max_batch,
            opts.max_batched_tokens
        ),
        Some(n) => {
            // The mixed prompt in one step beside the largest batch, as one more sequence.
            opts.max_batched_tokens = opts.max_batched_tokens.max(n + max_batch);
            opts.max_num_seqs = opts.max_num_seqs.max(max_batch + 1);
        }
        None => {}
    }
    let t_load = Instant::now();
    match opts.device {
        engine::load::Device::Cpu => bench_core(a, opts.clone(), cpu_engine(&opts)?, t_load),
        engine::load::Device::Cuda(_) => bench_core(a, opts.clone(), engine::load::cuda_engine(&opts)?, t_load),
    }
}

fn bench_core<B: Backend>(
    a: EngineBenchArgs,
    opts: engine::load::EngineOptions,
    mut core: engine::scheduler::EngineCore<B>,
    t_load: Instant,
) -> anyhow::Result<()> {
    let load_s = t_load.elapsed().as_secs_f64();
    let vocab = core.model.cfg.vocab;
    let mut next_id = 0u64;
    let greedy = |n: usize| SamplingParams { max_tokens: Some(n), ignore_eos: true, ..SamplingParams::greedy() };

    // Warm up caches, page in weights, start the threads.
    run_batch(&mut core, &mut next_id, vec![(prompt(64, 99, vocab), greedy(8))], None)?;
    // A mixed step's new prompt, one token out (its salts apart from every other prompt's,
    // so that no prefix of it is cached).
    let mixed = |salt: u64| a.mixed_prompt_tokens.map(|n| (prompt(n, 1 << 40 | salt, vocab), greedy(1)));

    // Prefill: one prompt of `prompt_tokens` in one step; time that step (after an
    // untimed one, unless --no-warmup). Before the decode batches with --prefill-first,
    // else after them.
    // (The last timed prompt's steps up to its first token are kept: 1 unless chunked.)
    let mut prefill_steps = 0;
    let mut time_prefill =
        |core: &mut engine::scheduler::EngineCore<B>, next_id: &mut u64| -> anyhow::Result<Vec<f64>> {
            if !a.no_warmup {
                run_batch(core, next_id, vec![(prompt(a.prompt_tokens, 98, vocab), greedy(1))], None)?;
            }
            let mut prefill = Vec::new();
            for r in 0..a.repeat {
                let p = prompt(a.prompt_tokens, r as u64, vocab);
                let t = run_batch(core, next_id, vec![(p, greedy(1))], None)?;
                prefill.push(a.prompt_tokens as f64 / t.first_step_s);
                prefill_steps = t.first_steps;
            }
            Ok(prefill)
        };
    let mut prefill = if a.prefill_first { time_prefill(&mut core, &mut next_id)? } else { Vec::new() };
    // Decode: `b` sequences with a `context`-token prompt, `gen_tokens` each; time the
    // steps in which all `b` decode (none prefilling, none finished yet).
    let mut decode = Vec::new();
    for &b in &a.batch {
        let mut rates = Vec::new();
        let mut step_ms = Vec::new();
        let mut first_tokens_s = Vec::new();
        let mut mixed_ms = Vec::new();
        let mut ops = OpTimes::new();
        let mut op_steps = 0;
        let (mut timed_replayed, mut timed_captured) = (0, 0);
        if !a.no_warmup {
            // Untimed: a run like the timed ones (the same batch, context and tokens), so
            // that every step shape they take has run twice before (a CUDA backend runs a
            // decode shape's first step op by op and captures its second). Four tokens
            // left too few whole-batch steps where the prompts' first tokens come far
            // apart (b8 at 32k on the H200: a timed step captured its graph).
            let reqs = (0..b).map(|i| (prompt(a.context, 500 + i as u64, vocab), greedy(a.gen_tokens + 1))).collect();
            run_batch(&mut core, &mut next_id, reqs, mixed(b as u64))?;
        }
        let s0 = core.stats();
        for r in 0..a.repeat {
            let reqs = (0..b)
                .map(|i| (prompt(a.context, 1000 + (r * b + i) as u64, vocab), greedy(a.gen_tokens + 1)))
                .collect();
            let t = run_batch(&mut core, &mut next_id, reqs, mixed(((r as u64 + 1) << 20) | b as u64))?;
            if t.full_steps == 0 {
                anyhow::bail!(
                    "batch {b}: no step had all {b} sequences decoding (the first finished before the last was \
                     prefilled); raise --gen-tokens or --max-batched-tokens"
                );
            }
            let ms = t.full_steps_s * 1e3 / t.full_steps as f64;
            rates.push(b as f64 / (ms * 1e-3));
            step_ms.push(ms);
            first_tokens_s.push(t.first_step_s);
            if a.mixed_prompt_tokens.is_some() {
                let Some(w) = t.mixed_window_s else {
                    anyhow::bail!(
                        "batch {b}: the mixed prompt was not prefilled in one step beside the whole batch; raise \
                         --gen-tokens"
                    );
                };
                mixed_ms.push(w * 1e3 - ms);
            }
            for (op, (secs, calls)) in t.full_step_ops {
                add_op(&mut ops, op, secs, calls);
            }
            op_steps += t.full_steps;
            timed_replayed += t.full_replayed;
            timed_captured += t.full_captured;
        }
        let s1 = core.stats();
        // The GPU's time between two steps' forward passes (sampling, copies, and waiting
        // for the host unless async scheduling hid it), a mean per gap.
        let gap_us = ops.get(kernels::cuda::STEP_GAP_OP).map(|(s, n)| s * 1e6 / (*n).max(1) as f64);
        decode.push(json!({
            "batch": b,
            "tokens_per_s": median(rates),
            "ms_per_step": median(step_ms),
            // Until every sequence had its first token: the batch's prefill steps (with
            // a step budget below the batch's prompts, later prompts prefill beside the
            // decoding of earlier ones).
            "first_tokens_s": median(first_tokens_s),
            "mixed_step_ms": (!mixed_ms.is_empty()).then(|| median(mixed_ms)),
            "gpu_gap_us_per_step": gap_us,
            // The timed runs' decode-only steps (the batch's and its tail's as sequences
            // finish), those replayed from a CUDA graph and those that captured one (the
            // rest ran op by op; zeros on the CPU); and the same for the steps that
            // `ms_per_step` times (every sequence decoding).
            "graph_steps": {
                "decode_only": s1.decode_only_steps - s0.decode_only_steps,
                "replayed": s1.graph_replays - s0.graph_replays,
                "captured": s1.graph_captures - s0.graph_captures,
                "timed": op_steps,
                "timed_replayed": timed_replayed,
                "timed_captured": timed_captured,
            },
            // Per-op time of the timed steps (DISAGG_CUDA_PROFILE; every op synchronized), and
            // on CUDA always the GPU's time between steps.
            "op_us_per_step": ops.iter().map(|(op, (s, n))| json!({"op": op, "us": s * 1e6 / op_steps.max(1) as f64, "calls_per_step": *n as f64 / op_steps.max(1) as f64})).collect::<Vec<_>>(),
        }));
    }
    if !a.prefill_first {
        prefill = time_prefill(&mut core, &mut next_id)?;
    }
    let w_bytes = core.model.weight_bytes as f64;
    let b1 = decode.iter().find(|d| d["batch"] == 1).map(|d| d["ms_per_step"].as_f64().unwrap_or(0.0));
    // KV read per decode step at batch 1: the average context over the measured steps.
    let kv = core.kv_shape();
    let kv_token_bytes = (kv.n_layers * 2 * kv.n_kv_heads * kv.head_dim * kv.dtype.bytes()) as f64;
    let kv_b1 = (a.context as f64 + a.gen_tokens as f64 / 2.0) * kv_token_bytes;
    let copy_bw = core.backend().copy_bandwidth_gbps();
    let read_bw = core.backend().read_bandwidth_gbps();
    let c = &core.model.cfg;
    // As the PyTorch peer counts them: every matrix once per token bar the embedding,
    // plus causal attention.
    let (qd, kvd) = (c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim);
    let layer_params = (qd + 2 * kvd) * c.hidden + c.hidden * qd + 3 * c.ffn * c.hidden;
    let params = (c.n_layers * layer_params + c.vocab * c.hidden) as f64;
    let s = a.prompt_tokens as f64;
    let prefill_flops = 2.0 * params * s + 2.0 * (c.n_layers * c.n_heads * c.head_dim) as f64 * s * s;
    let prefill_tok_s = median(prefill.clone());
    let profile: Vec<serde_json::Value> = core
        .backend()
        .op_profile()
        .into_iter()
        .map(|(op, secs, calls)| json!({"op": op, "seconds": secs, "calls": calls, "us_per_call": secs * 1e6 / calls.max(1) as f64}))
        .collect();
    let out = json!({
        "bench": "engine",
        "model": core.model.cfg.name,
        "model_arg": opts.model,
        "backend": core.backend().describe(),
        "threads": opts.resolved_threads(),
        "kv_dtype": format!("{:?}", opts.kv_dtype).to_lowercase(),
        "load_s": load_s,
        "weight_bytes_per_step": core.model.weight_bytes,
        "prefill": {"prompt_tokens": a.prompt_tokens, "tokens_per_s": median(prefill), "steps": prefill_steps},
        "decode": decode,
        "decode_b1_weight_gb_per_s": b1.map(|ms| w_bytes / (ms * 1e-3) / 1e9),
        "decode_context": a.context,
        "decode_b1_weight_kv_gb_per_s": b1.map(|ms| (w_bytes + kv_b1) / (ms * 1e-3) / 1e9),
        "copy_gb_per_s": copy_bw,
        "decode_b1_frac_of_copy_bw": b1.zip(copy_bw).map(|(ms, bw)| (w_bytes + kv_b1) / (ms * 1e-3) / 1e9 / bw),
        "read_gb_per_s": read_bw,
        "decode_b1_frac_of_read_bw": b1.zip(read_bw).map(|(ms, bw)| (w_bytes + kv_b1) / (ms * 1e-3) / 1e9 / bw),
        "prefill_tflops": prefill_flops / (s / prefill_tok_s) / 1e12,
        "op_profile": profile,
        "repeat": a.repeat,
        "warmup": !a.no_warmup,
        "prefill_first": a.prefill_first,
        "prefill_chunk": a.prefill_chunk,
        "mixed_prompt_tokens": a.mixed_prompt_tokens,
        "stats": core.stats(),
    });
    println!("{}", serde_json::to_string_pretty(&out)?);
    Ok(())
}

/// Per-op time and calls (`Backend::op_profile`), summed over steps.
type OpTimes = std::collections::BTreeMap<&'static str, (f64, u64)>;

fn add_op(ops: &mut OpTimes, op: &'static str, secs: f64, calls: u64) {
    let e = ops.entry(op).or_default();
    e.0 += secs;
    e.1 += calls;
}

struct Timing {
    /// Time until every sequence had its first token, and the steps that ran tokens in it.
    first_step_s: f64,
    first_steps: usize,
    /// Steps in which every sequence of the batch decoded one token, and their time.
    full_steps: usize,
    full_steps_s: f64,
    /// The backend's per-op time in those steps, when it records it.
    full_step_ops: OpTimes,
    /// How many of those steps the backend replayed from a CUDA graph, and how many
    /// captured one (the rest ran op by op).
    full_replayed: u64,
    full_captured: u64,
    /// With a mixed prompt: the step call that prefilled it beside the whole batch and
    /// the call after it, seconds.
    mixed_window_s: Option<f64>,
}

/// Runs a batch to completion; times the first step (all prefills) and the rest. With
/// `mixed`, that request joins after the batch's first whole decode step.
fn run_batch<B: Backend>(
    core: &mut EngineCore<B>,
    next_id: &mut u64,
    reqs: Vec<(Vec<u32>, SamplingParams)>,
    mut mixed: Option<(Vec<u32>, SamplingParams)>,
) -> anyhow::Result<Timing> {
    let n = reqs.len();
    for (p, s) in reqs {
        core.add_request(*next_id, p, s)?;
        *next_id += 1;
    }
    let t0 = Instant::now();
    let mut started = 0;
    let mut first_step_s = None;
    let mut first_steps = 0;
    let (mut full_steps, mut full_steps_s) = (0, 0.0);
    let (mut full_replayed, mut full_captured) = (0, 0);
    let mut ops = OpTimes::new();
    // (The mixed prompt's length once it joined; the call that prefilled it.)
    let (mut mixed_len, mut mixed_dt, mut mixed_window_s) = (None, None, None);
    while core.has_work() {
        if full_steps >= 1 {
            if let Some((p, s)) = mixed.take() {
                mixed_len = Some(p.len());
                core.add_request(*next_id, p, s)?;
                *next_id += 1;
            }
        }
        let before = core.backend().op_profile();
        let graphs_before = core.backend().graph_counts();
        let tokens_before = core.stats().forward_tokens;
        let ts = Instant::now();
        let outs = core.step();
        let dt = ts.elapsed().as_secs_f64();
        let ran = core.stats().forward_tokens - tokens_before;
        if let Some(d) = mixed_dt.take() {
            mixed_window_s = Some(d + dt);
        } else if mixed_window_s.is_none() && mixed_len.is_some_and(|m| ran == (n + m) as u64) {
            mixed_dt = Some(dt);
        }
        // (Steps that ran tokens: with asynchronous scheduling the first token comes back
        // from the step call after its prefill's last.)
        if first_step_s.is_none() && ran > 0 {
            first_steps += 1;
        }
        // Whole-batch decode: every sequence output a later token, and the step computed
        // one token per sequence (not a preempted sequence's recompute).
        let one_each = ran == n as u64;
        if first_step_s.is_some() && one_each && outs.len() == n && outs.iter().all(|o| o.completion_tokens > 1) {
            full_steps += 1;
            full_steps_s += dt;
            let g = core.backend().graph_counts();
            full_replayed += g.replayed - graphs_before.replayed;
            full_captured += g.captured - graphs_before.captured;
            for (op, secs, calls) in core.backend().op_profile() {
                let (s0, c0) = before.iter().find(|b| b.0 == op).map_or((0.0, 0), |b| (b.1, b.2));
                add_op(&mut ops, op, secs - s0, calls - c0);
            }
        }
        started += outs.iter().filter(|o| o.completion_tokens == 1).count();
        if first_step_s.is_none() && started == n {
            first_step_s = Some(t0.elapsed().as_secs_f64());
        }
    }
    Ok(Timing {
        first_step_s: first_step_s.unwrap_or(0.0),
        first_steps,
        full_steps,
        full_steps_s,
        full_step_ops: ops,
        full_replayed,
        full_captured,
        mixed_window_s,
    })
}
