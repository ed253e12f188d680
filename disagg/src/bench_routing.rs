//! `disagg bench routing`: the router's decision latency with a large index, and a
//! synthetic multi-turn workload over `disagg up` comparing routing policies.
//!
//! Decision latency: a cluster of `--workers` decode workers (added without
//! processes), whose index holds `--blocks` block hashes from conversations of
//! `--conversation-tokens` tokens spread over the workers; each decision is what a
//! request gets — hashing its prompt (a stored conversation plus new tokens), the
//! index lookup, scoring every worker, the choice — timed one by one.
//!
//! Workload (`--workload`): for each policy, `disagg up` with `--prefill`×`--decode`
//! workers; `--sessions` conversations run side by side, each `--turns` turns in order.
//! Turn 1 sends `--first-tokens` tokens; each later turn resends the previous prompt
//! plus `--answer-tokens` tokens standing for the answer (a re-tokenized answer often
//! differs from the generated ids, so fresh ids are used) and `--turn-tokens` new
//! ones. Reports, per policy, the prefix hit rate (cached prompt tokens over prompt
//! tokens, from each response's usage), client-side TTFT p50/p90 and throughput.

use std::time::{Duration, Instant};

use clap::Args;
use futures::StreamExt;
use serde_json::json;

use crate::bench::{pct, random_ids as ids};
use crate::cluster::{spawn_role, stop_all, url_in};
use crate::EngineArgs;

#[derive(Args, Debug)]
pub struct RoutingBenchArgs {
    #[command(flatten)]
    pub engine: EngineArgs,
    /// Block hashes in the index (decision latency).
    #[arg(long, default_value_t = 1_000_000)]
    pub blocks: usize,
    /// Workers indexed (decision latency).
    #[arg(long, default_value_t = 16)]
    pub workers: usize,
    /// Tokens of each stored conversation (decision latency).
    #[arg(long, default_value_t = 4096)]
    pub conversation_tokens: usize,
    /// New tokens after the stored conversation in each routed prompt.
    #[arg(long, default_value_t = 256)]
    pub new_tokens: usize,
    /// Decisions timed.
    #[arg(long, default_value_t = 20_000)]
    pub decisions: usize,
    /// Also run the multi-turn workload over `disagg up`.
    #[arg(long)]
    pub workload: bool,
    /// Policies compared by the workload (`kv-aware-approx`: kv-aware without KV
    /// events, predicting from routing decisions).
    #[arg(long, value_delimiter = ',', default_value = "kv-aware,round-robin")]
    pub policies: Vec<String>,
    #[arg(long, default_value_t = 2)]
    pub prefill: usize,
    #[arg(long, default_value_t = 2)]
    pub decode: usize,
    #[arg(long, default_value_t = 20)]
    pub sessions: usize,
    #[arg(long, default_value_t = 10)]
    pub turns: usize,
    #[arg(long, default_value_t = 256)]
    pub first_tokens: usize,
    #[arg(long, default_value_t = 200)]
    pub turn_tokens: usize,
    #[arg(long, default_value_t = 8)]
    pub answer_tokens: usize,
    /// Print JSON (the only output format).
    #[arg(long)]
    json: bool,
}

fn decision_latency(a: &RoutingBenchArgs) -> anyhow::Result<serde_json::Value> {
    use engine::handle::KvEventBatch;
    use engine::prefix::{block_hashes, HashSalt};
    use engine::scheduler::{CacheTier, KvEvent};
    use router::cluster::{Cluster, Compat, Role, RoutingOptions};
    anyhow::ensure!(a.workers >= 1 && a.workers <= router::kv_index::MAX_WORKERS, "--workers: 1 to 64");
    let bs = a.engine.block_size;
    anyhow::ensure!(a.conversation_tokens >= bs, "--conversation-tokens must cover at least one block");
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    let _guard = rt.enter();
    let model = "bench-model".to_string();
    let compat =
        Compat { model: model.clone(), kv_layout: proto::v1::KvLayout { block_size: bs as u32, ..Default::default() } };
    let cluster = Cluster::new(0, RoutingOptions::default());
    let mut slots = Vec::new();
    for w in 0..a.workers {
        let worker = cluster
            .add_unchecked(&format!("http://10.0.0.{w}:1"), Role::Decode, &compat)
            .map_err(|e| anyhow::anyhow!(e))?;
        slots.push(worker.slot().expect("indexed"));
    }
    let salt = HashSalt::new(&model, None);
    let per_conv = a.conversation_tokens / bs;
    let n_conv = a.blocks.div_ceil(per_conv);
    let t_fill = Instant::now();
    let mut convs = Vec::with_capacity(n_conv);
    {
        let mut ix = cluster.index.lock().unwrap();
        let mut per_worker: Vec<Vec<u64>> = vec![Vec::new(); a.workers];
        for c in 0..n_conv {
            let t = ids(c as u64, a.conversation_tokens);
            per_worker[c % a.workers].extend(block_hashes(salt, bs, &t));
            convs.push(t);
        }
        for (w, hashes) in per_worker.into_iter().enumerate() {
            let events = vec![KvEvent::Stored { tier: CacheTier::Device, hashes }];
            ix.apply(slots[w], &KvEventBatch { seq: 0, snapshot: true, events }).map_err(|e| anyhow::anyhow!("{e}"))?;
        }
    }
    let indexed = cluster.index.lock().unwrap().len();
    let fill_s = t_fill.elapsed().as_secs_f64();
    let params = engine::sampling::SamplingParams::greedy();
    let prompts: Vec<Vec<u32>> = (0..256)
        .map(|i| {
            let c = (i * 7919) % n_conv;
            convs[c].iter().copied().chain(ids(1_000_000 + i as u64, a.new_tokens)).collect()
        })
        .collect();
    // Warm up, then time each decision; check they go where the conversation lives.
    let mut right = 0;
    for (i, p) in prompts.iter().enumerate() {
        let (d, _) = cluster.decide(p, &params, None).expect("a worker");
        right += usize::from(d == format!("http://10.0.0.{}:1", ((i * 7919) % n_conv) % a.workers));
    }
    let mut us = Vec::with_capacity(a.decisions);
    for i in 0..a.decisions {
        let p = &prompts[i % prompts.len()];
        let t = Instant::now();
        let r = cluster.decide(p, &params, None);
        us.push(t.elapsed().as_secs_f64() * 1e6);
        std::hint::black_box(r);
    }
    Ok(json!({
        "indexed_blocks": indexed, "workers": a.workers, "index_fill_s": fill_s,
        "prompt_tokens": a.conversation_tokens + a.new_tokens, "block_size": bs,
        "decisions": a.decisions, "to_the_worker_holding_the_prefix": format!("{right}/{}", prompts.len()),
        "decision_us_p50": pct(us.clone(), 0.5), "decision_us_p90": pct(us.clone(), 0.9),
        "decision_us_p99": pct(us.clone(), 0.99), "decision_us_max": pct(us, 1.0),
    }))
}

struct Turn {
    ttft_ms: f64,
    prompt: usize,
    cached: usize,
    tokens: usize,
}

async fn turn(
    c: &reqwest::Client,
    url: &str,
    model: &str,
    session: usize,
    prompt: &[u32],
    max_tokens: usize,
) -> anyhow::Result<Turn> {
    let body = json!({"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                      "ignore_eos": true, "stream": true, "stream_options": {"include_usage": true},
                      "user": format!("session-{session}")});
    let t0 = Instant::now();
    let r = c
        .post(format!("{url}/v1/completions"))
        .header("content-type", "application/json")
        .body(body.to_string())
        .send()
        .await?;
    anyhow::ensure!(r.status().is_success(), "HTTP {}: {}", r.status(), r.text().await.unwrap_or_default());
    let mut s = r.bytes_stream();
    let (mut buf, mut first, mut tokens, mut usage) = (Vec::new(), None, 0, None);
    while let Some(chunk) = s.next().await {
        buf.extend_from_slice(&chunk?);
        while let Some(data) = crate::sse::next_data(&mut buf) {
            if data == "[DONE]" {
                continue;
            }
            let v: serde_json::Value = serde_json::from_str(&data)?;
            anyhow::ensure!(v.get("error").is_none(), "stream error: {v}");
            if v["choices"][0]["text"].is_string() {
                first.get_or_insert_with(Instant::now);
                tokens += 1;
            }
            if v["usage"].is_object() {
                usage = Some(v["usage"].clone());
            }
        }
    }
    let u = usage.ok_or_else(|| anyhow::anyhow!("no usage chunk"))?;
    Ok(Turn {
        ttft_ms: (first.ok_or_else(|| anyhow::anyhow!("no tokens"))? - t0).as_secs_f64() * 1e3,
        prompt: u["prompt_tokens"].as_u64().unwrap_or(0) as usize,
        cached: u["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap_or(0) as usize,
        tokens,
    })
}

async fn session(
    c: reqwest::Client,
    url: String,
    model: String,
    s: usize,
    a: (usize, usize, usize, usize, usize),
) -> anyhow::Result<Vec<Turn>> {
    let (turns, first, grow, answer, max_tokens) = a;
    let mut prompt = ids(s as u64 * 1000, first);
    let mut out = Vec::new();
    for t in 0..turns {
        out.push(turn(&c, &url, &model, s, &prompt, max_tokens).await?);
        prompt.extend(ids(s as u64 * 1000 + 2 * t as u64 + 1, answer));
        prompt.extend(ids(s as u64 * 1000 + 2 * t as u64 + 2, grow));
    }
    Ok(out)
}

fn workload(a: &RoutingBenchArgs, policy: &str) -> anyhow::Result<serde_json::Value> {
    let e = &a.engine;
    let (routing, approx) = match policy.strip_suffix("-approx") {
        Some(p) => (p, true),
        None => (policy, false),
    };
    let mut args: Vec<String> = vec!["up".into(), "--port".into(), "0".into(), "--routing".into(), routing.into()];
    if approx {
        args.push("--no-kv-events".into());
    }
    args.extend(["--prefill".into(), a.prefill.to_string(), "--decode".into(), a.decode.to_string()]);
    args.extend(e.to_args(e.threads));
    let (p, line) = spawn_role("up", &args, "disagg serving", Duration::from_secs(300))?;
    let mut procs = vec![p];
    let url = url_in(&line)?;
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    let r = rt.block_on(async {
        let client = reqwest::Client::builder().pool_max_idle_per_host(64).tcp_nodelay(true).build()?;
        let t0 = Instant::now();
        let shape = (a.turns, a.first_tokens, a.turn_tokens, a.answer_tokens, a.answer_tokens);
        let tasks: Vec<_> = (0..a.sessions)
            .map(|s| tokio::spawn(session(client.clone(), url.clone(), e.model.clone(), s, shape)))
            .collect();
        let mut all = Vec::new();
        for t in tasks {
            all.extend(t.await??);
        }
        Ok::<_, anyhow::Error>((all, t0.elapsed().as_secs_f64()))
    });
    stop_all(&mut procs);
    let (all, secs) = r?;
    let prompt: usize = all.iter().map(|t| t.prompt).sum();
    let cached: usize = all.iter().map(|t| t.cached).sum();
    let tokens: usize = all.iter().map(|t| t.tokens).sum();
    let ttft: Vec<f64> = all.iter().map(|t| t.ttft_ms).collect();
    // Turns after the first: where a cache can help.
    let later: Vec<&Turn> = all.iter().filter(|t| t.prompt > a.first_tokens).collect();
    let later_rate = later.iter().map(|t| t.cached).sum::<usize>() as f64
        / later.iter().map(|t| t.prompt).sum::<usize>().max(1) as f64;
    Ok(json!({
        "policy": policy, "requests": all.len(), "seconds": secs,
        "prefix_hit_rate": cached as f64 / prompt.max(1) as f64, "prefix_hit_rate_after_turn_1": later_rate,
        "prompt_tokens": prompt, "cached_tokens": cached, "computed_prompt_tokens": prompt - cached,
        "ttft_ms_p50": pct(ttft.clone(), 0.5), "ttft_ms_p90": pct(ttft, 0.9),
        "requests_per_s": all.len() as f64 / secs, "prompt_tokens_per_s": prompt as f64 / secs,
        "output_tokens_per_s": tokens as f64 / secs,
    }))
}

pub fn run(a: RoutingBenchArgs) -> anyhow::Result<()> {
    anyhow::ensure!(a.blocks >= 1 && a.decisions >= 1, "--blocks and --decisions must be at least 1");
    if a.workload {
        anyhow::ensure!(
            a.decode >= 1 && a.sessions >= 1 && a.turns >= 1 && a.first_tokens >= 1 && a.answer_tokens >= 1,
            "--decode, --sessions, --turns, --first-tokens and --answer-tokens must be at least 1 for --workload"
        );
    }
    let mut out = serde_json::Map::new();
    out.insert("decision".into(), decision_latency(&a)?);
    if a.workload {
        let opts = a.engine.options()?;
        engine::load::resolve(&opts.model)?;
        let mut runs = Vec::new();
        for p in &a.policies {
            let base = p.strip_suffix("-approx").unwrap_or(p);
            base.parse::<router::cluster::Policy>().map_err(|e| anyhow::anyhow!("--policies: {e}"))?;
            runs.push(workload(&a, p)?);
        }
        out.insert(
            "workload".into(),
            json!({"prefill": a.prefill, "decode": a.decode, "sessions": a.sessions, "turns": a.turns,
                   "first_tokens": a.first_tokens, "turn_tokens": a.turn_tokens, "answer_tokens": a.answer_tokens,
                   "runs": runs}),
        );
    }
    println!("{}", serde_json::to_string_pretty(&serde_json::Value::Object(out))?);
    Ok(())
}
