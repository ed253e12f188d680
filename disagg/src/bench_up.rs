//! `disagg bench serve --mode up`: the same streaming load against `disagg serve` and
//! against `disagg up` (router, prefill and decode workers as processes), one after
//! the other on the same machine; client-side TTFT and inter-token latency.

use std::time::Instant;

use futures::StreamExt;
use serde_json::json;

use crate::bench::{median, pct, random_ids};
use crate::bench_serve::ServeBenchArgs;
use crate::cluster::{spawn_role, stop_all, url_in};

/// Distinct pseudo-random prompts of `n` tokens.
fn prompt_ids(i: usize, n: usize) -> Vec<u32> {
    random_ids(i as u64, n)
}

struct Timing {
    ttft: f64,
    itl: Vec<f64>,
    tokens: usize,
}

async fn one(
    c: &reqwest::Client,
    url: &str,
    model: &str,
    i: usize,
    prompt_tokens: usize,
    max_tokens: usize,
) -> anyhow::Result<Timing> {
    let body = json!({"model": model, "prompt": prompt_ids(i, prompt_tokens), "max_tokens": max_tokens,
                      "temperature": 0, "ignore_eos": true, "stream": true});
    let t0 = Instant::now();
    let r = c
        .post(format!("{url}/v1/completions"))
        .header("content-type", "application/json")
        .body(body.to_string())
        .send()
        .await?;
    anyhow::ensure!(r.status().is_success(), "HTTP {}: {}", r.status(), r.text().await.unwrap_or_default());
    let mut s = r.bytes_stream();
    let (mut buf, mut stamps) = (Vec::new(), Vec::new());
    while let Some(chunk) = s.next().await {
        let chunk = chunk?;
        let now = Instant::now();
        buf.extend_from_slice(&chunk);
        while let Some(data) = crate::sse::next_data(&mut buf) {
            if data == "[DONE]" {
                continue;
            }
            let v: serde_json::Value = serde_json::from_str(&data)?;
            anyhow::ensure!(v.get("error").is_none(), "stream error: {v}");
            if v["choices"][0]["text"].is_string() {
                stamps.push(now);
            }
        }
    }
    anyhow::ensure!(!stamps.is_empty(), "no tokens");
    Ok(Timing {
        ttft: (stamps[0] - t0).as_secs_f64() * 1e3,
        itl: stamps.windows(2).map(|w| (w[1] - w[0]).as_secs_f64() * 1e3).collect(),
        tokens: stamps.len(),
    })
}

async fn level(
    url: &str,
    model: &str,
    c: usize,
    n: usize,
    prompt_tokens: usize,
    max_tokens: usize,
    salt: usize,
) -> anyhow::Result<serde_json::Value> {
    let client = reqwest::Client::builder().pool_max_idle_per_host(256).tcp_nodelay(true).build()?;
    let t0 = Instant::now();
    let sem = std::sync::Arc::new(tokio::sync::Semaphore::new(c));
    let tasks: Vec<_> = (0..n)
        .map(|i| {
            let (client, url, sem, model) = (client.clone(), url.to_string(), sem.clone(), model.to_string());
            tokio::spawn(async move {
                let _p = sem.acquire().await?;
                one(&client, &url, &model, salt + i, prompt_tokens, max_tokens).await
            })
        })
        .collect();
    let mut all = Vec::new();
    for t in tasks {
        all.push(t.await??);
    }
    let secs = t0.elapsed().as_secs_f64();
    let ttft: Vec<f64> = all.iter().map(|t| t.ttft).collect();
    let itl: Vec<f64> = all.iter().flat_map(|t| t.itl.iter().copied()).collect();
    let tokens: usize = all.iter().map(|t| t.tokens).sum();
    Ok(json!({
        "concurrency": c, "requests": n,
        "ttft_ms_p50": pct(ttft.clone(), 0.5), "ttft_ms_p90": pct(ttft.clone(), 0.9), "ttft_ms_p99": pct(ttft, 0.99),
        "itl_ms_p50": pct(itl.clone(), 0.5), "itl_ms_p90": pct(itl.clone(), 0.9), "itl_ms_p99": pct(itl.clone(), 0.99),
        "itl_ms_median_of_all": median(if itl.is_empty() { vec![f64::NAN] } else { itl }),
        "output_tokens_per_s": tokens as f64 / secs,
    }))
}

pub fn run(a: ServeBenchArgs) -> anyhow::Result<()> {
    let e = &a.engine;
    let opts = e.options()?;
    engine::load::resolve(&opts.model)?;
    let cores = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    let mut results = serde_json::Map::new();
    for mode in ["serve", "up"] {
        let mut args: Vec<String> = vec![mode.into(), "--port".into(), "0".into()];
        if mode == "serve" {
            args.extend(e.to_args(if e.threads > 0 { e.threads } else { cores }));
        } else {
            args.extend(["--prefill".into(), a.prefill.to_string(), "--decode".into(), a.decode.to_string()]);
            args.extend(e.to_args(e.threads));
        }
        let (p, line) = spawn_role(mode, &args, "disagg serving", std::time::Duration::from_secs(300))?;
        let mut procs = vec![p];
        let url = url_in(&line)?;
        let r = rt.block_on(async {
            // Warm up, then each level with fresh prompts.
            level(&url, &e.model, 1, 1, 64, 4, 1_000_000).await?;
            let mut levels = Vec::new();
            for (k, &c) in a.concurrency.iter().enumerate() {
                let n = a.requests.unwrap_or(c.max(4));
                levels.push(level(&url, &e.model, c, n, a.prompt_tokens, a.max_tokens, k * 10_000).await?);
            }
            Ok::<_, anyhow::Error>(levels)
        });
        stop_all(&mut procs);
        results.insert(mode.into(), json!(r?));
    }
    let out = json!({
        "bench": "serve --mode up",
        "prompt_tokens": a.prompt_tokens,
        "max_tokens": a.max_tokens,
        "prefill_workers": a.prefill,
        "decode_workers": a.decode,
        "cores": cores,
        "results": results,
    });
    println!("{}", serde_json::to_string_pretty(&out)?);
    Ok(())
}
