//! `disagg bench serve`: what the gateway adds to each request.
//!
//! One process holds the engine, the gateway on a loopback socket and the load
//! generator, so every timestamp comes from the same clock. At each concurrency level
//! the same load (streaming completions, distinct prompts, fixed length) runs once
//! unmeasured (warm-up; unless `--requests` is given, its rate sets the request count so
//! that a run lasts `--min-run-s`) and then in `--rounds` rounds of two runs, in
//! alternating order:
//! through HTTP (reqwest client → axum gateway → engine) and straight into the engine
//! handle. Tokens/s are medians over rounds (an engine step's time varies from run to
//! run more than the gateway costs, so one run each cannot tell them apart); the
//! engine's idle time per run (wall time outside its steps) isolates what the path in
//! front of the engine costs in throughput. Per HTTP request, the gateway overhead is the client-observed time minus
//! the engine's own time for that request (matched by response id):
//! - e2e: (client send → `[DONE]` read) − (engine accepted → engine finished)
//! - first token: (client send → first token chunk read) − (engine accepted → first output)
//!
//! split into send → handler start, in the handler, and final bytes ready → `[DONE]`
//! read; the gateway's own delivery (engine output → its bytes ready) is given for a
//! request's first, second and last outputs with text. Before each level the client
//! opens its `concurrency` connections (timed apart: setup is per connection, not per
//! request). The engine runs on `--device` (on a GPU,
//! the gateway and the client have the host's cores to themselves, as in deployment).
//! Also reported: the gateway's and the load generator's CPU time per streamed token
//! and the engine steps each run took.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Instant;

use clap::Args;
use engine::handle::EngineHandle;
use engine::sampling::SamplingParams;
use futures::StreamExt;
use router::{AppState, GatewayConfig};
use serde_json::json;

use crate::bench::pct;
use crate::EngineArgs;

#[derive(Args, Debug)]
pub struct ServeBenchArgs {
    #[command(flatten)]
    pub engine: EngineArgs,
    /// Concurrent streams.
    #[arg(long, value_delimiter = ',', default_value = "1,64,256")]
    pub concurrency: Vec<usize>,
    /// Hold every CPU out of deep idle states for the run, as `disagg serve
    /// --cpu-latency-qos` does (Linux PM QoS, root only).
    #[arg(long)]
    pub cpu_latency_qos: bool,
    /// Tokens generated per request.
    #[arg(long, default_value_t = 32)]
    pub max_tokens: usize,
    /// Requests per run (default: twice the concurrency, at least 32, and raised after
    /// the level's warm-up until a run lasts `--min-run-s` at the warm-up's rate).
    #[arg(long)]
    pub requests: Option<usize>,
    /// Shortest run the default request count aims at, in seconds: runs of a fraction of
    /// a second measure the GPU's clock ramp and the load's start and drain, not the
    /// steady state (in-process mode, with the level warm-up).
    #[arg(long, default_value_t = 2.0)]
    pub min_run_s: f64,
    /// Skip each level's unmeasured warm-up pass (the same load straight into the
    /// engine, so that both measured runs meet only batch shapes it has seen; in-process
    /// mode).
    #[arg(long)]
    pub no_level_warmup: bool,
    /// Measured rounds per level, each one HTTP run and one direct run, in alternating
    /// order (HTTP first in even rounds); tokens/s are the medians over the rounds and
    /// latencies pool every round's requests (in-process mode).
    #[arg(long, default_value_t = 3)]
    pub rounds: usize,
    /// `in-process`: gateway overhead, gateway and engine in this process. `up`: the
    /// same streaming load against `disagg serve` and then `disagg up` processes,
    /// client-side TTFT and inter-token latency.
    #[arg(long, default_value = "in-process")]
    pub mode: String,
    /// Prefill workers (`--mode up`).
    #[arg(long, default_value_t = 1)]
    pub prefill: usize,
    /// Decode workers (`--mode up`).
    #[arg(long, default_value_t = 1)]
    pub decode: usize,
    /// Prompt length in tokens (`--mode up`).
    #[arg(long, default_value_t = 2048)]
    pub prompt_tokens: usize,
    /// Print JSON (the only output format).
    #[arg(long)]
    json: bool,
}

const TOPICS: &[&str] =
    &["the sea", "a lighthouse", "mountains", "a city at night", "winter", "a garden", "the moon", "trains"];

fn prompt_text(i: usize) -> String {
    format!("Write a short story about {} and the number {}.", TOPICS[i % TOPICS.len()], i)
}

struct ClientTiming {
    id: String,
    send: Instant,
    first: Option<Instant>,
    done: Instant,
    tokens: usize,
}

async fn http_request(
    client: &reqwest::Client,
    url: &str,
    model: &str,
    i: usize,
    max_tokens: usize,
) -> anyhow::Result<ClientTiming> {
    let body = json!({
        "model": model, "prompt": prompt_text(i), "max_tokens": max_tokens,
        "temperature": 0, "ignore_eos": true, "stream": true,
    });
    let send = Instant::now();
    let r = client.post(url).header("content-type", "application/json").body(body.to_string()).send().await?;
    anyhow::ensure!(r.status().is_success(), "HTTP {}", r.status());
    let mut s = r.bytes_stream();
    let (mut id, mut first, mut buf, mut tokens) = (String::new(), None, Vec::new(), 0usize);
    let mut done = None;
    let dbg = std::env::var("DISAGG_BENCH_DEBUG").is_ok();
    while let Some(chunk) = s.next().await {
        let chunk = chunk?;
        if dbg {
            eprintln!("{:.2}ms chunk of {} bytes", send.elapsed().as_secs_f64() * 1e3, chunk.len());
        }
        buf.extend_from_slice(&chunk);
        while let Some(data) = crate::sse::next_data(&mut buf) {
            if data == "[DONE]" {
                done = Some(Instant::now());
                continue;
            }
            let v: serde_json::Value = serde_json::from_str(&data)?;
            if id.is_empty() {
                id = v["id"].as_str().unwrap_or("").to_string();
            }
            if v["choices"][0]["text"].as_str().is_some_and(|t| !t.is_empty()) {
                first.get_or_insert_with(Instant::now);
                tokens += 1;
            }
        }
    }
    Ok(ClientTiming { id, send, first, done: done.unwrap_or_else(Instant::now), tokens })
}

struct DirectTiming {
    send: Instant,
    first: Instant,
    /// The first output that carried text (as the gateway's engine-side TTFT counts).
    first_text: Instant,
    done: Instant,
}

async fn direct_request(e: &EngineHandle, i: usize, max_tokens: usize) -> anyhow::Result<DirectTiming> {
    let send = Instant::now();
    let prompt = e.tokenizer.encode_prompt(&prompt_text(i))?;
    let sp = SamplingParams { max_tokens: Some(max_tokens), ignore_eos: true, ..SamplingParams::greedy() };
    let mut st = e.submit(prompt, sp).map_err(|x| anyhow::anyhow!("{x}"))?;
    let (mut first, mut first_text) = (None, None);
    while let Some(item) = st.next().await {
        first.get_or_insert(item.at);
        if !item.out.new_text.is_empty() {
            first_text.get_or_insert(item.at);
        }
        if item.out.finish.is_some() {
            break;
        }
    }
    let first = first.unwrap_or(send);
    Ok(DirectTiming { send, first, first_text: first_text.unwrap_or(first), done: Instant::now() })
}

/// `n` direct requests, `c` at a time, straight into the engine handle.
async fn direct_load(e: &EngineHandle, n: usize, c: usize, max_tokens: usize) -> Vec<anyhow::Result<DirectTiming>> {
    let e = e.clone();
    closed_loop(n, c, move |i| {
        let e = e.clone();
        async move { direct_request(&e, i, max_tokens).await }
    })
    .await
}

/// One measured run: wall time, the engine's time in steps, its steps and decode-only
/// steps, and those replayed from a CUDA graph or capturing one.
struct Run {
    wall_s: f64,
    step_s: f64,
    steps: u64,
    decode_only_steps: u64,
    graph_replays: u64,
    graph_captures: u64,
}

/// The median, the middle two averaged for an even count (NaN when empty).
fn median_of(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    match v.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => v[n / 2],
        n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}

/// Runs `n` jobs with at most `c` in flight; returns results in completion order.
async fn closed_loop<T, F, Fut>(n: usize, c: usize, job: F) -> Vec<T>
where
    F: Fn(usize) -> Fut + Clone + Send + 'static,
    Fut: std::future::Future<Output = T> + Send,
    T: Send + 'static,
{
    let next = Arc::new(AtomicUsize::new(0));
    let workers: Vec<_> = (0..c)
        .map(|_| {
            let (next, job) = (next.clone(), job.clone());
            tokio::spawn(async move {
                let mut out = Vec::new();
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    if i >= n {
                        return out;
                    }
                    out.push(job(i).await);
                }
            })
        })
        .collect();
    let mut all = Vec::with_capacity(n);
    for w in workers {
        all.extend(w.await.expect("worker"));
    }
    all
}

fn http_client() -> anyhow::Result<reqwest::Client> {
    Ok(reqwest::Client::builder().pool_max_idle_per_host(1024).tcp_nodelay(true).build()?)
}

/// `c` concurrent GET /health requests; each one's round trip in ms.
async fn health_round(client: &reqwest::Client, url: &str, c: usize) -> anyhow::Result<Vec<f64>> {
    let reqs = (0..c).map(|_| async move {
        let t = Instant::now();
        let r = client.get(url).send().await?;
        anyhow::ensure!(r.status().is_success(), "GET /health: HTTP {}", r.status());
        r.bytes().await?;
        Ok(t.elapsed().as_secs_f64() * 1e3)
    });
    futures::future::join_all(reqs).await.into_iter().collect()
}

/// The handler thread's use from a request's body read to its submission, where both ends
/// were measured on one thread.
fn in_usage(p: &router::InProbe) -> Option<router::ThreadUsage> {
    Some(p.usage_read?.until(&p.usage_submitted?))
}

/// Seconds so far of this process's threads on CPU and waiting on a run queue (runnable
/// but not running: other threads or processes held the CPU, or an idle CPU was slow to
/// wake), summed by thread name (`/proc/self/task/*/schedstat`, nanosecond resolution;
/// empty where absent).
fn thread_sched_s() -> std::collections::HashMap<String, (f64, f64)> {
    let mut out = std::collections::HashMap::new();
    let Ok(tasks) = std::fs::read_dir("/proc/self/task") else { return out };
    for t in tasks.flatten() {
        let p = t.path();
        let (Ok(name), Ok(stat)) =
            (std::fs::read_to_string(p.join("comm")), std::fs::read_to_string(p.join("schedstat")))
        else {
            continue;
        };
        let mut f = stat.split_whitespace().map(|x| x.parse::<f64>().ok());
        let (Some(Some(on_cpu)), Some(Some(waiting))) = (f.next(), f.next()) else { continue };
        let e: &mut (f64, f64) = out.entry(name.trim().to_string()).or_default();
        e.0 += on_cpu * 1e-9;
        e.1 += waiting * 1e-9;
    }
    out
}

pub fn run(a: ServeBenchArgs) -> anyhow::Result<()> {
    // Held for the whole run (system-wide, so also over `--mode up`'s processes).
    let _qos =
        a.cpu_latency_qos.then(|| crate::serve::hold_cpu_latency(crate::serve::CPU_DMA_LATENCY, 0)).transpose()?;
    anyhow::ensure!(
        !a.concurrency.is_empty() && !a.concurrency.contains(&0),
        "--concurrency takes stream counts of at least 1, e.g. --concurrency 1,64,256"
    );
    anyhow::ensure!(a.max_tokens >= 1, "--max-tokens must be at least 1");
    anyhow::ensure!(a.requests != Some(0), "--requests must be at least 1");
    match a.mode.as_str() {
        "in-process" => {}
        "up" => return crate::bench_up::run(a),
        m => anyhow::bail!("--mode must be in-process or up, got {m:?}"),
    }
    anyhow::ensure!(a.rounds >= 1, "--rounds {} measures nothing: give at least 1", a.rounds);
    anyhow::ensure!(
        a.min_run_s.is_finite() && a.min_run_s >= 0.0,
        "--min-run-s {} is not a duration: give seconds, 0 or more",
        a.min_run_s
    );
    let mut opts = a.engine.options()?;
    let max_c = a.concurrency.iter().copied().max().unwrap_or(1);
    opts.max_num_seqs = opts.max_num_seqs.max(max_c.min(256));
    opts.max_batched_tokens = opts.max_batched_tokens.max(opts.max_num_seqs);
    let spin =
        router::spin_default(matches!(opts.device, engine::load::Device::Cuda(_))).map_err(anyhow::Error::msg)?;
    let engine = engine::load::spawn_engine(&opts, 1 << 20)?;
    let backend = engine.backend.to_string();
    let model = opts.model.clone();
    // The gateway runs on its own runtime, as under `disagg serve`; the load generator
    // on another, so the gateway's tasks never queue behind the client's parsing.
    let server_rt = tokio::runtime::Builder::new_multi_thread().thread_name("gateway").enable_all().build()?;
    let cfg =
        GatewayConfig { served_model_name: model.clone(), record_timings: true, spin, ..GatewayConfig::default() };
    let state = AppState::new(cfg);
    // In the gateway's runtime, where a delivery task (DISAGG_OUTPUT_TASK=1) would run.
    server_rt.block_on(async { state.set_engine(engine.clone()) });
    let listener = server_rt.block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))?;
    let url = format!("http://{}/v1/completions", listener.local_addr()?);
    let health = format!("http://{}/health", listener.local_addr()?);
    server_rt.spawn(router::serve(listener, state.clone(), std::future::pending()));
    let rt = tokio::runtime::Builder::new_multi_thread().thread_name("load").enable_all().build()?;
    let levels = rt.block_on(async {
        let client = http_client()?;
        // Warm up both paths.
        http_request(&client, &url, &model, 0, 4).await?;
        direct_request(&engine, 0, 4).await?;
        let mut levels = Vec::new();
        for &c in &a.concurrency {
            let mut n = a.requests.unwrap_or((2 * c).max(32));
            // Open `c` connections first (as a client's pool holds them in steady state),
            // timing a /health round trip on each new connection and then on each reused
            // one: connection setup is per connection, not per request, and reported apart.
            // A client of its own per level, so its first round opens exactly `c` connections;
            // hyper hands a finished connection back to the pool asynchronously, hence the pauses.
            let client = http_client()?;
            let new_conn_ms = health_round(&client, &health, c).await?;
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
            let reused_conn_ms = health_round(&client, &health, c).await?;
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
            // The measured runs come after one unmeasured pass of the same load, so the
            // first of them does not pay alone for what a new batch shape costs once
            // (a CUDA graph capture, a cuBLAS plan).
            let warmup_s = if a.no_level_warmup {
                None
            } else {
                let t = Instant::now();
                direct_load(&engine, n, c, a.max_tokens).await.into_iter().collect::<Result<Vec<_>, _>>()?;
                let s = t.elapsed().as_secs_f64();
                if a.requests.is_none() {
                    n = n.max((a.min_run_s / s * n as f64).ceil() as usize);
                }
                Some(s)
            };
            state.timings.lock().unwrap().clear();
            let (mut http_runs, mut direct_runs): (Vec<Run>, Vec<Run>) = (Vec::new(), Vec::new());
            let (mut http, mut direct) = (Vec::new(), Vec::new());
            let mut cpu_s: std::collections::HashMap<String, (f64, f64)> = Default::default();
            for r in 0..a.rounds {
                for is_http in if r % 2 == 0 { [true, false] } else { [false, true] } {
                    let (cpu0, s0, t0) = (thread_sched_s(), engine.stats(), Instant::now());
                    if is_http {
                        http.extend(
                            closed_loop(n, c, {
                                let (client, url, model, mt) =
                                    (client.clone(), url.clone(), model.clone(), a.max_tokens);
                                move |i| {
                                    let (client, url, model) = (client.clone(), url.clone(), model.clone());
                                    async move { http_request(&client, &url, &model, i, mt).await }
                                }
                            })
                            .await,
                        );
                    } else {
                        direct.extend(direct_load(&engine, n, c, a.max_tokens).await);
                    }
                    let wall_s = t0.elapsed().as_secs_f64();
                    let s1 = engine.stats();
                    let run = Run {
                        wall_s,
                        step_s: s1.step_s - s0.step_s,
                        steps: s1.steps - s0.steps,
                        decode_only_steps: s1.decode_only_steps - s0.decode_only_steps,
                        graph_replays: s1.graph_replays - s0.graph_replays,
                        graph_captures: s1.graph_captures - s0.graph_captures,
                    };
                    if is_http {
                        http_runs.push(run);
                        for (name, v) in thread_sched_s() {
                            if let Some(v0) = cpu0.get(&name) {
                                let e = cpu_s.entry(name).or_default();
                                e.0 += v.0 - v0.0;
                                e.1 += v.1 - v0.1;
                            }
                        }
                    } else {
                        direct_runs.push(run);
                    }
                }
            }
            let http: Vec<ClientTiming> = http.into_iter().collect::<Result<_, _>>()?;
            let direct: Vec<DirectTiming> = direct.into_iter().collect::<Result<_, _>>()?;
            let timings: std::collections::HashMap<String, router::RequestTiming> =
                state.timings.lock().unwrap().drain(..).map(|t| (t.id.clone(), t)).collect();
            let (mut gw_e2e, mut gw_first, mut client_e2e_over, mut client_first_over, mut ttft) =
                (Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new());
            let (mut gw_in, mut gw_out, mut gw_in_read) = (Vec::new(), Vec::new(), Vec::new());
            // Inside "in" past the body read: parse and checks, tokenization, submission;
            // the time the handler's thread was off the CPU there, and how many requests
            // saw a forced switch, a blocking wait or a page fault there.
            let (mut gw_parse, mut gw_tokenize, mut gw_submit, mut gw_off_cpu) =
                (Vec::new(), Vec::new(), Vec::new(), Vec::new());
            let (mut in_preempted, mut in_blocked, mut in_faulted) = (0usize, 0usize, 0usize);
            // Engine output → gateway bytes ready, for a request's first and second
            // outputs with text (`out` above is its last).
            let (mut gw_first_out, mut gw_second_out) = (Vec::new(), Vec::new());
            // Of "first_out" and "out": engine output → handed to the request's stream (the
            // engine thread's loop over the step's outputs, or the delivery task); handed →
            // taken by the handler (its task's wake); taken → bytes ready (its shaping).
            let (mut gw_first_out_send, mut gw_out_send) = (Vec::new(), Vec::new());
            let (mut gw_first_out_wake, mut gw_out_wake) = (Vec::new(), Vec::new());
            let (mut gw_first_out_format, mut gw_out_format) = (Vec::new(), Vec::new());
            // Outside the gateway's handler: client send → handler start, and the
            // gateway's final bytes ready → the client has read `[DONE]`.
            let (mut wire_in, mut wire_out, mut engine_ttft) = (Vec::new(), Vec::new(), Vec::new());
            // The slowest request by in-gateway e2e and by first token: (ms, index).
            let (mut worst_e2e, mut worst_first) = ((f64::NEG_INFINITY, 0), (f64::NEG_INFINITY, 0));
            let ms = |a: Instant, b: Instant| b.saturating_duration_since(a).as_secs_f64() * 1e3;
            for (index, h) in http.iter().enumerate() {
                let Some(t) = timings.get(&h.id) else { continue };
                if let Some(p) = &t.in_probe {
                    gw_in_read.push(ms(t.arrival, p.body_read));
                    gw_parse.push(ms(p.body_read, p.parsed));
                    gw_tokenize.push(ms(p.parsed, p.tokenized));
                    gw_submit.push(ms(p.tokenized, t.submitted));
                    if let Some(u) = in_usage(p) {
                        gw_off_cpu.push((ms(p.body_read, t.submitted) - u.cpu_s * 1e3).max(0.0));
                        in_preempted += usize::from(u.involuntary_switches > 0);
                        in_blocked += usize::from(u.voluntary_switches > 0);
                        in_faulted += usize::from(u.minor_faults + u.major_faults > 0);
                    }
                }
                for (worst, v) in [(&mut worst_e2e, t.gateway_e2e_s()), (&mut worst_first, t.gateway_first_token_s())] {
                    if v * 1e3 > worst.0 {
                        *worst = (v * 1e3, index);
                    }
                }
                gw_in.push(ms(t.arrival, t.submitted));
                gw_out.push(ms(t.engine_finish, t.emit_finish));
                gw_first_out.push(ms(t.engine_first_text, t.emit_first_text));
                gw_first_out_send.push(ms(t.engine_first_text, t.sent_first_text));
                gw_out_send.push(ms(t.engine_finish, t.sent_finish));
                gw_first_out_wake.push(ms(t.sent_first_text, t.polled_first_text));
                gw_out_wake.push(ms(t.sent_finish, t.polled_finish));
                gw_first_out_format.push(ms(t.polled_first_text, t.emit_first_text));
                gw_out_format.push(ms(t.polled_finish, t.emit_finish));
                if let Some((at, emit)) = t.second_text {
                    gw_second_out.push(ms(at, emit));
                }
                gw_e2e.push(t.gateway_e2e_s() * 1e3);
                gw_first.push(t.gateway_first_token_s() * 1e3);
                wire_in.push(t.arrival.saturating_duration_since(h.send).as_secs_f64() * 1e3);
                wire_out.push(h.done.saturating_duration_since(t.emit_finish).as_secs_f64() * 1e3);
                engine_ttft.push(t.engine_first_text.duration_since(t.submitted).as_secs_f64() * 1e3);
                let client_e2e = h.done.duration_since(h.send).as_secs_f64();
                let engine_e2e = t.engine_finish.duration_since(t.submitted).as_secs_f64();
                client_e2e_over.push((client_e2e - engine_e2e) * 1e3);
                if let Some(f) = h.first {
                    ttft.push(f.duration_since(h.send).as_secs_f64() * 1e3);
                    let engine_first = t.engine_first_text.duration_since(t.submitted).as_secs_f64();
                    client_first_over.push((f.duration_since(h.send).as_secs_f64() - engine_first) * 1e3);
                }
            }
            // The slowest request split into its parts: which of them a stall sits in (ms;
            // `index`: its place in the pooled requests, rounds in order; "in" split into
            // waiting for the client's body, parse and checks, tokenization, submission,
            // and the thread's use from the body read to submission: its CPU time, page
            // faults and context switches; "first_out" and "out" split into the hand-off to
            // the stream ("_send"), the handler's wake ("_wake") and its shaping of the
            // bytes ("_format").
            let slowest = |index: usize| {
                let h = http.get(index)?;
                let t = timings.get(&h.id)?;
                let p = t.in_probe.as_ref();
                Some(json!({
                    "index": index,
                    "in": ms(t.arrival, t.submitted),
                    "in_body_read": p.map(|p| ms(t.arrival, p.body_read)),
                    "in_parse": p.map(|p| ms(p.body_read, p.parsed)),
                    "in_tokenize": p.map(|p| ms(p.parsed, p.tokenized)),
                    "in_submit": p.map(|p| ms(p.tokenized, t.submitted)),
                    "in_thread": p.and_then(in_usage).map(|u| json!({
                        "cpu_ms": u.cpu_s * 1e3, "minor_faults": u.minor_faults, "major_faults": u.major_faults,
                        "voluntary_switches": u.voluntary_switches, "involuntary_switches": u.involuntary_switches,
                    })),
                    "first_out": ms(t.engine_first_text, t.emit_first_text),
                    "first_out_send": ms(t.engine_first_text, t.sent_first_text),
                    "first_out_wake": ms(t.sent_first_text, t.polled_first_text),
                    "first_out_format": ms(t.polled_first_text, t.emit_first_text),
                    "out": ms(t.engine_finish, t.emit_finish),
                    "out_send": ms(t.engine_finish, t.sent_finish),
                    "out_wake": ms(t.sent_finish, t.polled_finish),
                    "out_format": ms(t.polled_finish, t.emit_finish),
                    "send_to_handler": ms(h.send, t.arrival),
                }))
            };
            let tokens = (n * a.max_tokens) as f64;
            // None (JSON null) where the threads' schedstat is not readable.
            let per_token_us = |v: f64| v * 1e6 / (tokens * a.rounds as f64);
            let cpu_us = |name: &str| Some(per_token_us(cpu_s.get(name)?.0));
            let wait_us = |name: &str| Some(per_token_us(cpu_s.get(name)?.1));
            let tok_s = |runs: &[Run]| runs.iter().map(|r| tokens / r.wall_s).collect::<Vec<f64>>();
            let (http_tok_s, direct_tok_s) = (median_of(tok_s(&http_runs)), median_of(tok_s(&direct_runs)));
            // The engine's wall time outside its steps, per run: what the path in front
            // of it (gateway or direct) leaves it waiting, apart from the step times'
            // run-to-run spread.
            let idle_ms = |runs: &[Run]| median_of(runs.iter().map(|r| (r.wall_s - r.step_s) * 1e3).collect());
            let sum = |runs: &[Run], f: fn(&Run) -> u64| runs.iter().map(f).sum::<u64>();
            let end = engine.stats();
            let direct_text_ttft: Vec<f64> =
                direct.iter().map(|d| d.first_text.duration_since(d.send).as_secs_f64() * 1e3).collect();
            let direct_ttft: Vec<f64> = direct.iter().map(|d| d.first.duration_since(d.send).as_secs_f64() * 1e3).collect();
            let direct_e2e: Vec<f64> = direct.iter().map(|d| d.done.duration_since(d.send).as_secs_f64() * 1e3).collect();
            let http_e2e: Vec<f64> = http.iter().map(|h| h.done.duration_since(h.send).as_secs_f64() * 1e3).collect();
            // How many requests the goal's 1 ms missed: a p99 over 1 ms from one stalled
            // request or from a tail shows here.
            let over_1ms = |v: &[f64]| v.iter().filter(|&&x| x > 1.0).count();
            let (gw_e2e_over_1ms, gw_first_over_1ms) = (over_1ms(&gw_e2e), over_1ms(&gw_first));
            // The rest of "first_out" and "out": the handler's wake (handed → taken from the
            // stream) and its shaping of the bytes (taken → ready); joined to
            // gateway_overhead_ms below (one json! of it all passes the macro's recursion
            // limit).
            let out_split = json!({
                "first_out_wake_p99": pct(gw_first_out_wake.clone(), 0.99),
                "first_out_wake_max": pct(gw_first_out_wake, 1.0),
                "first_out_format_p99": pct(gw_first_out_format.clone(), 0.99),
                "first_out_format_max": pct(gw_first_out_format, 1.0),
                "out_wake_p99": pct(gw_out_wake.clone(), 0.99), "out_wake_max": pct(gw_out_wake, 1.0),
                "out_format_p99": pct(gw_out_format.clone(), 0.99), "out_format_max": pct(gw_out_format, 1.0),
            });
            let mut level = json!({
                "concurrency": c,
                // Per run; latencies and chunk counts cover all rounds' requests.
                "requests": n,
                "requests_measured": n * a.rounds,
                "matched_timings": gw_e2e.len(),
                "gateway_overhead_ms": {
                    // (counts of requests, not ms: e2e_over_1ms, first_token_over_1ms)
                    "e2e_p50": pct(gw_e2e.clone(), 0.5), "e2e_p99": pct(gw_e2e.clone(), 0.99), "e2e_max": pct(gw_e2e, 1.0),
                    "first_token_p50": pct(gw_first.clone(), 0.5), "first_token_p99": pct(gw_first.clone(), 0.99),
                    "first_token_max": pct(gw_first.clone(), 1.0),
                    "e2e_over_1ms": gw_e2e_over_1ms, "first_token_over_1ms": gw_first_over_1ms,
                    "in_p50": pct(gw_in.clone(), 0.5), "in_p99": pct(gw_in, 0.99),
                    // The part of "in" spent waiting for the request body's bytes.
                    "in_body_read_p99": pct(gw_in_read.clone(), 0.99), "in_body_read_max": pct(gw_in_read, 1.0),
                    // The rest of "in", by part; the handler thread's time off the CPU in
                    // it; requests (counts) whose "in" saw a forced switch, a blocking wait,
                    // a page fault.
                    "in_parse_p99": pct(gw_parse.clone(), 0.99), "in_parse_max": pct(gw_parse, 1.0),
                    "in_tokenize_p99": pct(gw_tokenize.clone(), 0.99), "in_tokenize_max": pct(gw_tokenize, 1.0),
                    "in_submit_p99": pct(gw_submit.clone(), 0.99), "in_submit_max": pct(gw_submit, 1.0),
                    "in_off_cpu_p99": pct(gw_off_cpu.clone(), 0.99), "in_off_cpu_max": pct(gw_off_cpu, 1.0),
                    "in_preempted": in_preempted, "in_blocked": in_blocked, "in_page_faulted": in_faulted,
                    "out_p50": pct(gw_out.clone(), 0.5), "out_p99": pct(gw_out, 0.99),
                    "first_out_p50": pct(gw_first_out.clone(), 0.5), "first_out_p99": pct(gw_first_out, 0.99),
                    // The part of "first_out" and "out" before the output reached its
                    // stream (the rest: the handler's wake and formatting).
                    "first_out_send_p99": pct(gw_first_out_send.clone(), 0.99),
                    "first_out_send_max": pct(gw_first_out_send, 1.0),
                    "out_send_p99": pct(gw_out_send.clone(), 0.99), "out_send_max": pct(gw_out_send, 1.0),
                    "second_out_p50": pct(gw_second_out.clone(), 0.5), "second_out_p99": pct(gw_second_out, 0.99),
                    "slowest_e2e": slowest(worst_e2e.1), "slowest_first_token": slowest(worst_first.1),
                },
                "client_observed_overhead_ms": {
                    "e2e_p50": pct(client_e2e_over.clone(), 0.5), "e2e_p99": pct(client_e2e_over, 0.99),
                    "first_token_p50": pct(client_first_over.clone(), 0.5), "first_token_p99": pct(client_first_over, 0.99),
                    "send_to_handler_p50": pct(wire_in.clone(), 0.5), "send_to_handler_p99": pct(wire_in, 0.99),
                    "emitted_to_client_done_p50": pct(wire_out.clone(), 0.5), "emitted_to_client_done_p99": pct(wire_out, 0.99),
                },
                "health_round_trip_ms": {
                    "new_connection_p50": pct(new_conn_ms.clone(), 0.5), "new_connection_p99": pct(new_conn_ms, 0.99),
                    "reused_connection_p50": pct(reused_conn_ms.clone(), 0.5), "reused_connection_p99": pct(reused_conn_ms, 0.99),
                },
                // Engine accepted → first output with text (HTTP), submit → the same (direct).
                "engine_ttft_ms": {"http_p50": pct(engine_ttft.clone(), 0.5), "http_p99": pct(engine_ttft, 0.99),
                                   "direct_p50": pct(direct_text_ttft.clone(), 0.5), "direct_p99": pct(direct_text_ttft, 0.99)},
                "rounds": a.rounds,
                "http": {"tokens_per_s": http_tok_s, "tokens_per_s_runs": tok_s(&http_runs), "ttft_ms_p50": pct(ttft.clone(), 0.5), "ttft_ms_p99": pct(ttft, 0.99),
                         "e2e_ms_p50": pct(http_e2e.clone(), 0.5), "e2e_ms_p99": pct(http_e2e, 0.99),
                         "streamed_chunks_with_text": http.iter().map(|h| h.tokens).sum::<usize>()},
                "direct": {"tokens_per_s": direct_tok_s, "tokens_per_s_runs": tok_s(&direct_runs), "ttft_ms_p50": pct(direct_ttft.clone(), 0.5), "ttft_ms_p99": pct(direct_ttft, 0.99),
                           "e2e_ms_p50": pct(direct_e2e.clone(), 0.5), "e2e_ms_p99": pct(direct_e2e, 0.99)},
                "http_over_direct_tokens_per_s": http_tok_s / direct_tok_s,
                // Wall time of each run, and the engine's time in steps during it (the
                // rest it waited for requests); the warm-up pass's wall time (null: none).
                "wall_s": {"http": http_runs.iter().map(|r| r.wall_s).collect::<Vec<_>>(),
                           "direct": direct_runs.iter().map(|r| r.wall_s).collect::<Vec<_>>(), "warmup": warmup_s},
                "engine_step_s": {"http": http_runs.iter().map(|r| r.step_s).collect::<Vec<_>>(),
                                  "direct": direct_runs.iter().map(|r| r.step_s).collect::<Vec<_>>()},
                "engine_idle_ms_p50": {"http": idle_ms(&http_runs), "direct": idle_ms(&direct_runs)},
                // Engine steps the runs took in all, and those that decoded only (no prefill
                // rows): requests arriving together prefill together.
                "engine_steps": {"http": sum(&http_runs, |r| r.steps), "direct": sum(&direct_runs, |r| r.steps)},
                "engine_decode_only_steps": {
                    "http": sum(&http_runs, |r| r.decode_only_steps),
                    "direct": sum(&direct_runs, |r| r.decode_only_steps),
                },
                // Of those, the steps replayed from a CUDA graph and those that captured
                // one (the rest ran op by op: a shape's first step, or one dropped from
                // the graph cache; zeros on the CPU), and the engine's captured shapes at
                // the end (held; dropped to make room, since it started).
                "engine_graph_steps": {
                    "replayed": {"http": sum(&http_runs, |r| r.graph_replays), "direct": sum(&direct_runs, |r| r.graph_replays)},
                    "captured": {"http": sum(&http_runs, |r| r.graph_captures), "direct": sum(&direct_runs, |r| r.graph_captures)},
                    "held": end.graphs_held,
                    "dropped": end.graphs_dropped,
                },
                // On-CPU time of the gateway's and the load generator's threads during
                // the HTTP runs, per streamed token (Linux schedstat; null elsewhere).
                "cpu_us_per_token": {"gateway": cpu_us("gateway"), "load_generator": cpu_us("load")},
                // Their time runnable but not running, per streamed token: CPU taken by
                // other threads or processes, or slow wakes of idle CPUs.
                "run_queue_wait_us_per_token": {"gateway": wait_us("gateway"), "load_generator": wait_us("load")},
            });
            if let (Some(gw), Some(split)) = (level["gateway_overhead_ms"].as_object_mut(), out_split.as_object()) {
                gw.extend(split.clone());
            }
            levels.push(level);
        }
        Ok::<_, anyhow::Error>(levels)
    })?;
    let out = json!({
        "bench": "serve",
        "mode": "serve (aggregated, one process)",
        "model": model,
        "backend": backend,
        "max_tokens": a.max_tokens,
        "cpu_latency_qos": a.cpu_latency_qos,
        // The process's allocator (mimalloc; `DISAGG_ALLOCATOR=system`: glibc's).
        "allocator": crate::alloc::name(),
        // A gateway task kept a runtime worker awake while requests ran (DISAGG_GATEWAY_SPIN).
        "gateway_spin": spin,
        "levels": levels,
    });
    println!("{}", serde_json::to_string_pretty(&out)?);
    engine.shutdown();
    Ok(())
}
