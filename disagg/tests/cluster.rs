//! The disaggregated cluster as real processes on loopback: `disagg up`, and the roles
//! started one by one (`disagg prefill`, `disagg decode`, `disagg router`) where a test
//! needs to kill or break one of them.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use proto::v1::decode_worker_client::DecodeWorkerClient;
use proto::v1::prefill_worker_client::PrefillWorkerClient;
use proto::v1::WorkerInfoRequest;
use serde_json::{json, Value};

/// A `disagg` process, killed when dropped.
struct Proc {
    child: Child,
    url: String,
    /// The /metrics URL when the ready line names one.
    metrics: Option<String>,
}

impl Proc {
    /// Starts `disagg ARGS` and waits for the line containing `marker`.
    fn start(args: &[&str], marker: &str, env: &[(&str, &str)]) -> Proc {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_disagg"));
        cmd.args(args).stdin(Stdio::null()).stdout(Stdio::piped());
        if std::env::var_os("DISAGG_TEST_LOGS").is_none() {
            cmd.stderr(Stdio::null());
        }
        for (k, v) in env {
            cmd.env(k, v);
        }
        let mut child = cmd.spawn().expect("disagg starts");
        let out = child.stdout.take().unwrap();
        let (tx, rx) = mpsc::channel();
        let m = marker.to_string();
        std::thread::spawn(move || {
            for line in BufReader::new(out).lines().map_while(Result::ok) {
                if line.contains(&m) {
                    let _ = tx.send(line);
                }
            }
        });
        let line = match rx.recv_timeout(Duration::from_secs(240)) {
            Ok(l) => l,
            Err(_) => {
                let _ = child.kill();
                panic!("disagg {args:?} was not ready (no {marker:?} line)");
            }
        };
        let url = line
            .split_whitespace()
            .find(|w| w.starts_with("http://"))
            .expect("an address in the ready line")
            .trim_end_matches("/v1")
            .to_string();
        let metrics =
            line.split_whitespace().find(|w| w.ends_with("/metrics)")).map(|w| w.trim_end_matches(')').to_string());
        Proc { child, url, metrics }
    }

    fn pid(&self) -> u32 {
        self.child.id()
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = Command::new("kill").args(["-TERM", &self.child.id().to_string()]).stderr(Stdio::null()).status();
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

const WORKER: &[&str] = &["--port", "0", "--threads", "1", "--kv-cache-mib", "64"];

fn prefill(env: &[(&str, &str)]) -> Proc {
    let mut a = vec!["prefill"];
    a.extend(WORKER);
    Proc::start(&a, "prefill worker ready", env)
}

fn decode() -> Proc {
    let mut a = vec!["decode"];
    a.extend(WORKER);
    Proc::start(&a, "decode worker ready", &[])
}

fn router(prefill: &[&Proc], decode: &[&Proc], extra: &[&str]) -> Proc {
    router_with_env(prefill, decode, extra, &[])
}

fn router_with_env(prefill: &[&Proc], decode: &[&Proc], extra: &[&str], env: &[(&str, &str)]) -> Proc {
    let p: Vec<&str> = prefill.iter().map(|p| p.url.as_str()).collect();
    let d: Vec<&str> = decode.iter().map(|p| p.url.as_str()).collect();
    let (p, d) = (p.join(","), d.join(","));
    let mut a = vec!["router", "--port", "0", "--decode", &d];
    if !p.is_empty() {
        a.extend(["--prefill", &p]);
    }
    a.extend(extra);
    Proc::start(&a, "disagg serving", env)
}

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap()
}

/// Distinct prompts of 5 to ~400 tokens (several KV blocks, and chunked prefill).
fn prompt(i: usize) -> String {
    let topics = ["the sea", "a lighthouse", "mountains", "a city at night", "winter", "trains"];
    let mut p = format!("Story {i}: write about {} and the number {i}.", topics[i % topics.len()]);
    if i % 8 == 3 {
        p.push_str(&" Describe every detail of the scene, the light, the sounds.".repeat(30));
    }
    p
}

async fn complete(c: &reqwest::Client, base: &str, body: Value) -> (u16, Value) {
    let r = c
        .post(format!("{base}/v1/completions"))
        .header("content-type", "application/json")
        .body(body.to_string())
        .send()
        .await
        .expect("request sent");
    let status = r.status().as_u16();
    let text = r.text().await.unwrap();
    (status, serde_json::from_str(&text).unwrap_or_else(|_| panic!("JSON body: {text}")))
}

/// Greedy token ids for prompts `0..n`, `concurrency` at a time.
async fn greedy_ids(base: &str, n: usize, concurrency: usize) -> Vec<Vec<u64>> {
    let c = reqwest::Client::new();
    let sem = std::sync::Arc::new(tokio::sync::Semaphore::new(concurrency));
    let tasks: Vec<_> = (0..n)
        .map(|i| {
            let (c, base, sem) = (c.clone(), base.to_string(), sem.clone());
            tokio::spawn(async move {
                let _permit = sem.acquire().await.unwrap();
                let body = json!({"model": "smollm2-135m-instruct", "prompt": prompt(i), "max_tokens": 12,
                                  "temperature": 0, "return_token_ids": true});
                let (status, v) = complete(&c, &base, body).await;
                assert_eq!(status, 200, "{v}");
                v["choices"][0]["token_ids"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|t| t.as_u64().unwrap())
                    .collect::<Vec<u64>>()
            })
        })
        .collect();
    let mut out = Vec::new();
    for t in tasks {
        out.push(t.await.unwrap());
    }
    out
}

/// Streams a completion; signals `started` at its first token. Returns the completion
/// tokens (from the usage chunk, 0 without one) and the error event's message, if the
/// stream ended with one.
async fn stream_events(
    c: &reqwest::Client,
    base: &str,
    body: Value,
    started: &tokio::sync::Semaphore,
) -> (usize, Option<String>) {
    use futures::StreamExt;
    let r = c
        .post(format!("{base}/v1/completions"))
        .header("content-type", "application/json")
        .body(body.to_string())
        .send()
        .await
        .expect("request sent");
    assert_eq!(r.status().as_u16(), 200);
    let (mut s, mut buf, mut tokens, mut first) = (r.bytes_stream(), Vec::new(), 0, false);
    while let Some(chunk) = s.next().await {
        buf.extend_from_slice(&chunk.expect("stream readable"));
        while let Some(end) = buf.windows(2).position(|w| w == b"\n\n") {
            let ev: Vec<u8> = buf.drain(..end + 2).collect();
            let line = String::from_utf8_lossy(&ev).trim().to_string();
            let Some(data) = line.strip_prefix("data: ") else { continue };
            if data == "[DONE]" {
                return (tokens, None);
            }
            let v: Value = serde_json::from_str(data).unwrap();
            if let Some(e) = v.get("error") {
                return (tokens, Some(e["message"].as_str().unwrap_or_default().to_string()));
            }
            if let Some(n) = v["usage"]["completion_tokens"].as_u64() {
                tokens = n as usize;
            } else if v["choices"][0]["text"].is_string() && !first {
                first = true;
                started.add_permits(1);
            }
        }
    }
    (tokens, Some("the stream ended without [DONE]".into()))
}

async fn blocks_used(url: &str, role: &str) -> u32 {
    let info = match role {
        "decode" => DecodeWorkerClient::connect(url.to_string()).await.unwrap().info(WorkerInfoRequest {}).await,
        _ => PrefillWorkerClient::connect(url.to_string()).await.unwrap().info(WorkerInfoRequest {}).await,
    };
    info.unwrap().into_inner().kv_blocks_used
}

/// Waits until a worker holds no KV blocks (aborts are asynchronous).
async fn until_no_blocks(url: &str, role: &str) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let n = blocks_used(url, role).await;
        if n == 0 {
            return;
        }
        assert!(Instant::now() < deadline, "{role} worker {url} still holds {n} KV blocks");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[test]
fn up_gives_the_same_tokens_as_serve_at_1_and_64_concurrent() {
    let up = Proc::start(
        &["up", "--port", "0", "--prefill", "2", "--decode", "2", "--threads", "1", "--kv-cache-mib", "128"],
        "disagg serving",
        &[],
    );
    let serve =
        Proc::start(&["serve", "--port", "0", "--threads", "1", "--kv-cache-mib", "128"], "disagg serving", &[]);
    let rt = rt();
    let expect = rt.block_on(greedy_ids(&serve.url, 64, 8));
    let one = rt.block_on(greedy_ids(&up.url, 8, 1));
    assert_eq!(one, expect[..8], "one at a time");
    let many = rt.block_on(greedy_ids(&up.url, 64, 64));
    assert_eq!(many, expect, "64 concurrent");
    drop(serve);
    // Ctrl-C (SIGTERM here) stops every process `up` started.
    let children = children_of(up.pid());
    let etcd = Command::new("etcd").arg("--version").stdout(Stdio::null()).status().is_ok();
    assert_eq!(children.len(), 5 + etcd as usize, "2 prefill + 2 decode workers, a router (and a private etcd)");
    drop(up);
    for c in children {
        let alive = Command::new("kill").args(["-0", &c]).stderr(Stdio::null()).status().unwrap().success();
        assert!(!alive, "process {c} started by `disagg up` is still running");
    }
}

#[test]
fn a_killed_decode_worker_fails_its_requests_clearly_and_the_rest_keep_serving() {
    let p = prefill(&[]);
    let d1 = decode();
    let mut d2 = decode();
    let r = router(&[&p], &[&d1, &d2], &[]);
    let rt = rt();
    rt.block_on(async {
        let c = reqwest::Client::new();
        // Streaming generations on both decode workers; once every stream has tokens,
        // SIGKILL one worker.
        let started = std::sync::Arc::new(tokio::sync::Semaphore::new(0));
        let tasks: Vec<_> = (0..6)
            .map(|i| {
                let (c, base, started) = (c.clone(), r.url.clone(), started.clone());
                tokio::spawn(async move {
                    let body = json!({"model": "smollm2-135m-instruct", "prompt": prompt(i), "max_tokens": 400,
                                      "temperature": 0, "ignore_eos": true, "stream": true,
                                      "stream_options": {"include_usage": true}});
                    stream_events(&c, &base, body, &started).await
                })
            })
            .collect();
        let all = tokio::time::timeout(Duration::from_secs(120), started.acquire_many(6)).await;
        all.expect("every stream started").unwrap().forget();
        d2.child.kill().unwrap();
        d2.child.wait().unwrap();
        let mut failed = 0;
        for t in tasks {
            let (tokens, error) = t.await.unwrap();
            match error {
                Some(msg) => {
                    failed += 1;
                    assert!(msg.contains("decode worker"), "a clear reason: {msg}");
                }
                None => assert_eq!(tokens, 400, "a stream on the survivor completes"),
            }
        }
        assert!(failed > 0, "requests on the killed worker failed");
        // New requests go to the survivor and succeed.
        for i in 0..4 {
            let body =
                json!({"model": "smollm2-135m-instruct", "prompt": prompt(i), "max_tokens": 4, "temperature": 0});
            let (status, v) = complete(&c, &r.url, body).await;
            assert_eq!(status, 200, "{v}");
        }
        until_no_blocks(&d1.url, "decode").await;
        until_no_blocks(&p.url, "prefill").await;
    });
}

/// A transfer that breaks (cut or corrupted) fails the request with the reason and
/// frees the blocks on both sides.
fn broken_transfer(fault: &str, expect: &str) {
    let p = prefill(&[("DISAGG_KV_FAULT", fault)]);
    let d = decode();
    let r = router(&[&p], &[&d], &[]);
    let rt = rt();
    rt.block_on(async {
        let c = reqwest::Client::new();
        // Long enough for several ranges per layer (the fault hits the second).
        let body = json!({"model": "smollm2-135m-instruct", "prompt": prompt(3), "max_tokens": 4, "temperature": 0});
        let (status, v) = complete(&c, &r.url, body).await;
        assert_eq!(status, 503, "{v}");
        let msg = v["error"]["message"].as_str().unwrap();
        assert!(msg.contains(expect), "{msg}");
        until_no_blocks(&d.url, "decode").await;
        until_no_blocks(&p.url, "prefill").await;
    });
}

#[test]
fn a_cut_transfer_fails_cleanly_and_frees_both_sides() {
    broken_transfer("cut", "KV transfer");
}

#[test]
fn a_corrupted_block_is_caught_by_its_checksum() {
    broken_transfer("corrupt", "checksum");
}

#[test]
fn short_prompts_are_prefilled_on_the_decode_worker() {
    // No prefill worker at all: short prompts (below the threshold) and, as a fallback,
    // long ones are prefilled on the decode worker.
    let d = decode();
    let r = router(&[], &[&d], &["--local-prefill-below", "64"]);
    let rt = rt();
    rt.block_on(async {
        let c = reqwest::Client::new();
        let body = json!({"model": "smollm2-135m-instruct", "prompt": "The capital of France is", "max_tokens": 4,
                          "temperature": 0});
        let (status, v) = complete(&c, &r.url, body).await;
        assert_eq!(status, 200, "{v}");
        assert!(v["choices"][0]["text"].as_str().unwrap().starts_with(" Paris"), "{v}");
        // A long prompt would go to a prefill worker; with none, the decode worker
        // prefills it itself rather than failing the request.
        let body = json!({"model": "smollm2-135m-instruct", "prompt": prompt(3), "max_tokens": 4, "temperature": 0});
        let (status, v) = complete(&c, &r.url, body).await;
        assert_eq!(status, 200, "{v}");
    });
}

/// Starts a router over `d` and `p`, which must fail; returns its error output.
fn router_refusal(d: &Proc, p: &Proc) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_disagg"))
        .args(["router", "--port", "0", "--decode", &d.url, "--prefill", &p.url])
        .stdout(Stdio::null())
        .output()
        .unwrap();
    assert!(!out.status.success());
    String::from_utf8_lossy(&out.stderr).into_owned()
}

#[test]
fn a_worker_serving_another_model_is_refused() {
    let d = decode();
    let tiny = concat!(env!("CARGO_MANIFEST_DIR"), "/../tests/data/tiny_hf");
    let p = Proc::start(
        &["prefill", "--port", "0", "--threads", "1", "--kv-cache-mib", "8", "--model", tiny],
        "prefill worker ready",
        &[],
    );
    let err = router_refusal(&d, &p);
    assert!(err.contains("refused") && err.contains("serves model"), "{err}");
}

#[test]
fn a_worker_of_another_kv_layout_is_refused() {
    let d = decode();
    let mut a = vec!["prefill", "--block-size", "32"];
    a.extend(WORKER);
    let p = Proc::start(&a, "prefill worker ready", &[]);
    let err = router_refusal(&d, &p);
    assert!(err.contains("refused") && err.contains("KV layout"), "{err}");
}

/// A private etcd on loopback for one test, restartable on the same ports and data.
struct Etcd {
    child: Option<Child>,
    dir: std::path::PathBuf,
    client: u16,
    peer: u16,
}

impl Etcd {
    fn start() -> Option<Etcd> {
        if Command::new("etcd").arg("--version").stdout(Stdio::null()).status().is_err() {
            assert!(
                std::env::var_os("CI").is_none(),
                "etcd is not installed; .ci/run installs etcd-server (apt) before the tests"
            );
            eprintln!("etcd not installed: skipping the discovery test");
            return None;
        }
        let port = || std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let (client, peer) = (port(), port());
        let dir = std::env::temp_dir().join(format!("disagg-test-etcd-{}-{client}", std::process::id()));
        let mut e = Etcd { child: None, dir, client, peer };
        e.run();
        Some(e)
    }

    fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.client)
    }

    fn run(&mut self) {
        let c = self.url();
        let p = format!("http://127.0.0.1:{}", self.peer);
        let child = Command::new("etcd")
            .args(["--name", "t", "--data-dir"])
            .arg(&self.dir)
            .args(["--listen-client-urls", &c, "--advertise-client-urls", &c])
            .args(["--listen-peer-urls", &p, "--initial-advertise-peer-urls", &p])
            .args(["--initial-cluster", &format!("t={p}")])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("etcd starts");
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(15);
        while std::net::TcpStream::connect(("127.0.0.1", self.client)).is_err() {
            assert!(Instant::now() < deadline, "etcd did not start");
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// The registered worker addresses of `role`.
    fn registered(&self, role: &str) -> Vec<String> {
        let out = Command::new("etcdctl")
            .env("ETCDCTL_API", "3")
            .args(["--endpoints", &self.url(), "get", "--prefix", "--keys-only", &format!("/disagg/workers/{role}/")])
            .output()
            .expect("etcdctl runs");
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .filter(|l| !l.is_empty())
            .map(|l| l.trim_start_matches(&format!("/disagg/workers/{role}/")).to_string())
            .collect()
    }
}

impl Drop for Etcd {
    fn drop(&mut self) {
        self.kill();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn with_etcd(role: &str, etcd: &Etcd, extra: &[&str]) -> Proc {
    let mut a = vec![role, "--etcd"];
    let url = etcd.url();
    a.push(&url);
    a.extend(WORKER);
    a.extend(extra);
    Proc::start(&a, &format!("{role} worker ready"), &[])
}

/// A counter from a worker's /metrics (0 when absent).
async fn counter(metrics_url: &str, name: &str) -> u64 {
    let text = reqwest::get(metrics_url).await.unwrap().text().await.unwrap();
    text.lines()
        .find_map(|l| l.strip_prefix(name).and_then(|r| r.strip_prefix(' ')))
        .map(|v| v.trim().parse::<f64>().unwrap() as u64)
        .unwrap_or(0)
}

/// How many requests a decode worker has served, from its /metrics.
async fn served(metrics_url: &str) -> u64 {
    counter(metrics_url, "disagg:decode_requests_total").await
}

fn metrics_url(p: &Proc) -> String {
    p.metrics.clone().expect("started with --metrics-port")
}

#[test]
fn workers_found_through_etcd_join_leave_and_survive_an_etcd_restart() {
    let Some(mut etcd) = Etcd::start() else { return };
    let p = with_etcd("prefill", &etcd, &[]);
    let d1 = with_etcd("decode", &etcd, &[]);
    let url = etcd.url();
    let r = Proc::start(&["router", "--port", "0", "--etcd", &url], "disagg serving", &[]);
    let rt = rt();
    let c = reqwest::Client::new();
    let ok = |i: usize| {
        let (c, base) = (c.clone(), r.url.clone());
        async move {
            let body =
                json!({"model": "smollm2-135m-instruct", "prompt": prompt(i), "max_tokens": 2, "temperature": 0});
            complete(&c, &base, body).await
        }
    };
    rt.block_on(async {
        assert_eq!(ok(0).await.0, 200);
        // A decode worker that joins is used within 2 s.
        let mut d2 = with_etcd("decode", &etcd, &["--metrics-port", "0"]);
        let m2 = metrics_url(&d2);
        let joined = Instant::now();
        let mut i = 1;
        while served(&m2).await == 0 {
            assert!(joined.elapsed() < Duration::from_secs(2), "the new decode worker was not used within 2 s");
            let (s, v) = ok(i).await;
            assert_eq!(s, 200, "{v}");
            i += 1;
        }
        // etcd restarted while serving: requests keep flowing, workers re-register.
        etcd.kill();
        for j in 0..3 {
            let (s, v) = ok(100 + j).await;
            assert_eq!(s, 200, "while etcd is down: {v}");
        }
        etcd.run();
        let back = Instant::now();
        while etcd.registered("decode").len() < 2 || etcd.registered("prefill").is_empty() {
            assert!(back.elapsed() < Duration::from_secs(10), "workers did not re-register");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        assert_eq!(ok(200).await.0, 200);
        // A worker killed with SIGKILL leaves etcd once its lease expires (TTL 3 s, then
        // etcd's periodic expiry check and the revocation through its log), and the
        // router keeps serving from the rest. (6 s was once too short on a loaded 2-core
        // CI machine, right after the etcd restart above.)
        d2.child.kill().unwrap();
        d2.child.wait().unwrap();
        let gone = Instant::now();
        while etcd.registered("decode").len() > 1 {
            assert!(gone.elapsed() < Duration::from_secs(12), "the dead worker's lease did not expire");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        for j in 0..4 {
            let (s, v) = ok(300 + j).await;
            assert_eq!(s, 200, "{v}");
        }
        until_no_blocks(&d1.url, "decode").await;
        until_no_blocks(&p.url, "prefill").await;
    });
}

#[test]
fn full_decode_workers_queue_requests_and_bad_worker_calls_are_refused() {
    use proto::v1::{DecodeRequest, KvLayout, PrefillRequest};
    let p = prefill(&[]);
    // Room for one long prompt at a time (12 MiB: 33 blocks; the prompt needs ~24).
    let d =
        Proc::start(&["decode", "--port", "0", "--threads", "1", "--kv-cache-mib", "12"], "decode worker ready", &[]);
    let r = router(&[&p], &[&d], &[]);
    let rt = rt();
    rt.block_on(async {
        let c = reqwest::Client::new();
        let tasks: Vec<_> = (0..2)
            .map(|i| {
                let (c, base) = (c.clone(), r.url.clone());
                tokio::spawn(async move {
                    let body = json!({"model": "smollm2-135m-instruct", "prompt": prompt(8 * i + 3), "max_tokens": 24,
                                      "temperature": 0, "ignore_eos": true});
                    complete(&c, &base, body).await
                })
            })
            .collect();
        for t in tasks {
            let (status, v) = t.await.unwrap();
            assert_eq!(status, 200, "the second request waits for blocks instead of failing: {v}");
        }
        until_no_blocks(&d.url, "decode").await;

        // Malformed calls straight to the workers.
        let mut dc = DecodeWorkerClient::connect(d.url.clone()).await.unwrap();
        let e = dc.generate(DecodeRequest { prompt_ids: vec![], ..Default::default() }).await.unwrap_err();
        assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e:?}");
        let bad = DecodeRequest { prompt_ids: vec![5, 4_000_000], prefill: p.url.clone(), ..Default::default() };
        let e = dc.generate(bad).await.unwrap_err();
        assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e:?}");
        assert!(e.message().contains("out of range"), "{e:?}");
        let mut pc = PrefillWorkerClient::connect(p.url.clone()).await.unwrap();
        let e = pc.prefill(PrefillRequest { prompt_ids: vec![5, 6], ..Default::default() }).await.unwrap_err();
        assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e:?}");
        let other = KvLayout { n_layers: 2, block_size: 16, n_kv_heads: 3, head_dim: 64, dtype_bytes: 2 };
        let req = PrefillRequest {
            prompt_ids: vec![5, 6],
            kv_layout: Some(other),
            kv_target: "127.0.0.1:9".into(),
            ..Default::default()
        };
        let e = pc.prefill(req).await.unwrap_err();
        assert_eq!(e.code(), tonic::Code::FailedPrecondition, "{e:?}");
        assert!(e.message().contains("incompatible KV layout"), "{e:?}");
        // A receiver that cannot be reached fails the call (and stops the prefill).
        let ours = KvLayout { n_layers: 30, ..other };
        let req = PrefillRequest {
            prompt_ids: (0..2000).map(|i| 100 + i % 3000).collect(),
            kv_layout: Some(ours),
            kv_target: "127.0.0.1:9".into(),
            ..Default::default()
        };
        let e = pc.prefill(req).await.unwrap_err();
        assert_eq!(e.code(), tonic::Code::Unavailable, "{e:?}");
        assert!(e.message().contains("KV transfer to 127.0.0.1:9"), "{e:?}");
        until_no_blocks(&p.url, "prefill").await;
    });
}

#[test]
fn requests_waiting_for_kv_blocks_are_admitted_in_arrival_order() {
    // Room for one long prompt at a time (as above): the later requests wait at the
    // router, and must get the blocks first come, first served (polling let a later
    // request take freed blocks first, and an early one could wait out the limit).
    // The head's attempt keeps its turn until answered (a long admit grace): on a
    // loaded 2-core machine a refusal can take longer than the default 50 ms.
    let p = prefill(&[]);
    let d =
        Proc::start(&["decode", "--port", "0", "--threads", "1", "--kv-cache-mib", "12"], "decode worker ready", &[]);
    let r = router_with_env(&[&p], &[&d], &[], &[("DISAGG_ROUTER_ADMIT_GRACE_MS", "30000")]);
    let rt = rt();
    rt.block_on(async {
        let c = reqwest::Client::new();
        let done = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let mut tasks = Vec::new();
        for i in 0..5 {
            let (c, base, done) = (c.clone(), r.url.clone(), done.clone());
            tasks.push(tokio::spawn(async move {
                let body = json!({"model": "smollm2-135m-instruct", "prompt": prompt(8 * i + 3), "max_tokens": 16,
                                  "temperature": 0, "ignore_eos": true});
                let (status, v) = complete(&c, &base, body).await;
                (status, v, done.fetch_add(1, std::sync::atomic::Ordering::SeqCst))
            }));
            tokio::time::sleep(Duration::from_millis(300)).await;
        }
        let mut order = Vec::new();
        for t in tasks {
            let (status, v, rank) = t.await.unwrap();
            assert_eq!(status, 200, "{v}");
            order.push(rank);
        }
        assert_eq!(order, (0..5).collect::<Vec<_>>(), "finishing rank of each request, in arrival order");
        until_no_blocks(&d.url, "decode").await;
    });
}

#[test]
fn one_trace_follows_a_request_through_router_decode_and_prefill() {
    let rt = rt();
    let collector = disagg_tests::Collector::default();
    let spans = collector.0.clone();
    let endpoint = collector.start(&rt);
    let env = [("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint.as_str())];
    let mut a = vec!["prefill"];
    a.extend(WORKER);
    let p = Proc::start(&a, "prefill worker ready", &env);
    let mut a = vec!["decode"];
    a.extend(WORKER);
    let d = Proc::start(&a, "decode worker ready", &env);
    let r = Proc::start(&["router", "--port", "0", "--decode", &d.url, "--prefill", &p.url], "disagg serving", &env);
    rt.block_on(async {
        let body = json!({"model": "smollm2-135m-instruct", "prompt": prompt(0), "max_tokens": 4, "temperature": 0});
        let (status, v) = complete(&reqwest::Client::new(), &r.url, body).await;
        assert_eq!(status, 200, "{v}");
    });
    // Stopping the processes flushes their exporters.
    drop(r);
    drop(d);
    drop(p);
    let deadline = Instant::now() + Duration::from_secs(10);
    let by_name = |name: &str| spans.lock().unwrap().iter().find(|s| s.name == name).cloned();
    while ["request", "decode_worker", "prefill_worker"].iter().any(|n| by_name(n).is_none()) {
        assert!(
            Instant::now() < deadline,
            "spans: {:?}",
            spans.lock().unwrap().iter().map(|s| s.name.clone()).collect::<Vec<_>>()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    let (req, dec, pre) =
        (by_name("request").unwrap(), by_name("decode_worker").unwrap(), by_name("prefill_worker").unwrap());
    assert_eq!(dec.trace_id, req.trace_id, "the decode worker's span is in the router's trace");
    assert_eq!(pre.trace_id, req.trace_id, "the prefill worker's span is in the router's trace");
    assert_eq!(dec.parent_span_id, req.span_id, "decode_worker is a child of request");
    assert_eq!(pre.parent_span_id, dec.span_id, "prefill_worker is a child of decode_worker");
    let all = spans.lock().unwrap().clone();
    let kids = |parent: &Vec<u8>| {
        let mut n: Vec<String> = all.iter().filter(|s| &s.parent_span_id == parent).map(|s| s.name.clone()).collect();
        n.sort();
        n
    };
    assert_eq!(kids(&dec.span_id), ["decode", "kv_wait", "prefill_worker"]);
    assert_eq!(kids(&pre.span_id), ["kv_transfer", "prefill"]);
}

/// `disagg up` with one prefill and one decode worker, ready (its stdout read on); with
/// its base URL.
fn start_up(stderr: Stdio) -> (Child, String) {
    let mut up = Command::new(env!("CARGO_BIN_EXE_disagg"))
        .args(["up", "--port", "0", "--threads", "1", "--kv-cache-mib", "64"])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(stderr)
        .spawn()
        .unwrap();
    let out = up.stdout.take().unwrap();
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(out).lines().map_while(Result::ok) {
            if line.contains("disagg serving") {
                let _ = tx.send(line);
            }
        }
    });
    let line = rx.recv_timeout(Duration::from_secs(240)).expect("up is ready");
    let url = line.split_whitespace().find(|w| w.starts_with("http://")).expect("an address").trim_end_matches("/v1");
    (up, url.to_string())
}

/// The pid of `up`'s child whose command line contains `what`.
fn child_matching(up: u32, what: &str) -> Option<String> {
    let kids = Command::new("pgrep").args(["-P", &up.to_string(), "-f", what]).output().unwrap();
    String::from_utf8_lossy(&kids.stdout).split_whitespace().next().map(String::from)
}

/// The pids of `pid`'s child processes.
fn children_of(pid: u32) -> Vec<String> {
    let out = Command::new("pgrep").args(["-P", &pid.to_string()]).output().unwrap();
    String::from_utf8_lossy(&out.stdout).split_whitespace().map(String::from).collect()
}

#[test]
fn up_stops_everything_when_its_router_dies() {
    let log = std::env::temp_dir().join(format!("disagg-up-{}.log", std::process::id()));
    let (mut up, _) = start_up(std::fs::File::create(&log).unwrap().into());
    let router = child_matching(up.id(), "disagg router").expect("a router");
    let all = children_of(up.id());
    Command::new("kill").args(["-KILL", &router]).status().unwrap();
    let deadline = Instant::now() + Duration::from_secs(15);
    let status = loop {
        if let Some(s) = up.try_wait().unwrap() {
            break s;
        }
        if Instant::now() > deadline {
            let _ = up.kill();
            panic!("`disagg up` did not stop after its router died");
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    assert!(!status.success());
    let err = std::fs::read_to_string(&log).unwrap();
    let _ = std::fs::remove_file(&log);
    assert!(err.contains("router") && err.contains("exited") && err.contains("stopped the cluster"), "{err}");
    for c in all {
        let alive = Command::new("kill").args(["-0", &c]).stderr(Stdio::null()).status().unwrap().success();
        assert!(!alive, "process {c} outlived `disagg up`");
    }
}

#[test]
fn up_starts_a_dead_worker_again_at_its_address() {
    let log = std::env::temp_dir().join(format!("disagg-up-restart-{}.log", std::process::id()));
    let (mut up, url) = start_up(std::fs::File::create(&log).unwrap().into());
    let prefill = child_matching(up.id(), "disagg prefill").expect("a prefill worker");
    let decode = child_matching(up.id(), "disagg decode").expect("a decode worker");
    Command::new("kill").args(["-KILL", &prefill]).status().unwrap();
    // `up` says so and starts it again; the rest of the cluster stays as it was.
    let deadline = Instant::now() + Duration::from_secs(120);
    let again = loop {
        let err = std::fs::read_to_string(&log).unwrap();
        if let Some(line) = err.lines().find(|l| l.contains("prefill-0 started again")) {
            break line.to_string();
        }
        assert!(up.try_wait().unwrap().is_none(), "`disagg up` stopped after a worker died: {err}");
        assert!(Instant::now() < deadline, "the prefill worker was not started again: {err}");
        std::thread::sleep(Duration::from_millis(100));
    };
    let err = std::fs::read_to_string(&log).unwrap();
    assert!(err.contains(&format!("prefill-0 (pid {prefill}) exited")), "{err}");
    let restarted = child_matching(up.id(), "disagg prefill").expect("a prefill worker again");
    assert_ne!(restarted, prefill);
    assert_eq!(child_matching(up.id(), "disagg decode").as_deref(), Some(decode.as_str()));
    let worker = again.split_whitespace().find(|w| w.starts_with("http://")).expect("its address").to_string();
    rt().block_on(async {
        // Requests succeed, and the router sends prefills to the new worker again (the
        // router sees it healthy within a poll; until then the decode worker prefills).
        let c = reqwest::Client::new();
        let deadline = Instant::now() + Duration::from_secs(60);
        for i in 0.. {
            let body = json!({"model": "smollm2-135m-instruct", "prompt": prompt(i), "max_tokens": 2});
            let (status, v) = complete(&c, &url, body).await;
            assert_eq!(status, 200, "{v}");
            let mut p = PrefillWorkerClient::connect(worker.clone()).await.unwrap();
            if p.info(WorkerInfoRequest {}).await.unwrap().into_inner().prefix_cache_queries > 0 {
                break;
            }
            assert!(Instant::now() < deadline, "no prefill reached the restarted worker at {worker}");
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    });
    assert!(up.try_wait().unwrap().is_none(), "`disagg up` still runs");
    let _ = Command::new("kill").args(["-TERM", &up.id().to_string()]).status();
    let _ = up.wait();
    let _ = std::fs::remove_file(&log);
}

#[test]
fn up_stops_when_a_worker_keeps_dying_soon_after_its_start() {
    let log = std::env::temp_dir().join(format!("disagg-up-loop-{}.log", std::process::id()));
    let (mut up, _) = start_up(std::fs::File::create(&log).unwrap().into());
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut last = String::new();
    // Kill the decode worker as soon as each new one appears: four exits in a row.
    let status = loop {
        if let Some(s) = up.try_wait().unwrap() {
            break s;
        }
        match child_matching(up.id(), "disagg decode") {
            Some(pid) if pid != last => {
                Command::new("kill").args(["-KILL", &pid]).status().unwrap();
                last = pid;
            }
            _ => {}
        }
        if Instant::now() > deadline {
            let _ = up.kill();
            panic!("`disagg up` kept starting a worker that dies at once: {}", std::fs::read_to_string(&log).unwrap());
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(!status.success());
    let err = std::fs::read_to_string(&log).unwrap();
    let _ = std::fs::remove_file(&log);
    assert_eq!(err.matches("decode-0 (pid").count(), 4, "{err}");
    assert!(err.contains("its last 4 exits each came within 60 s of its start"), "{err}");
    assert!(err.contains("stopped the cluster"), "{err}");
}

#[test]
fn a_killed_up_takes_its_processes_with_it() {
    // SIGKILL leaves `up` no chance to stop anything: its children must go by themselves.
    let (mut up, _) = start_up(Stdio::null());
    let all = children_of(up.id());
    assert!(all.len() >= 3, "a prefill and a decode worker and a router: {all:?}");
    up.kill().unwrap();
    up.wait().unwrap();
    // (A child that ended but that no one reaped yet is a zombie: gone for this purpose.)
    let running = |pid: &str| {
        std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .is_ok_and(|st| st.rsplit_once(')').is_some_and(|(_, rest)| !rest.trim_start().starts_with('Z')))
    };
    let deadline = Instant::now() + Duration::from_secs(20);
    for c in all {
        while running(&c) {
            if Instant::now() > deadline {
                let _ = Command::new("kill").args(["-KILL", &c]).status();
                panic!("process {c} outlived a killed `disagg up`");
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

/// Sends raw bytes as a gRPC message (to test what malformed input gets).
#[derive(Default)]
struct RawCodec;
struct Raw;

impl tonic::codec::Codec for RawCodec {
    type Encode = Vec<u8>;
    type Decode = Vec<u8>;
    type Encoder = Raw;
    type Decoder = Raw;
    fn encoder(&mut self) -> Raw {
        Raw
    }
    fn decoder(&mut self) -> Raw {
        Raw
    }
}

impl tonic::codec::Encoder for Raw {
    type Item = Vec<u8>;
    type Error = tonic::Status;
    fn encode(&mut self, item: Vec<u8>, dst: &mut tonic::codec::EncodeBuf<'_>) -> Result<(), tonic::Status> {
        use bytes::BufMut;
        dst.put_slice(&item);
        Ok(())
    }
}

impl tonic::codec::Decoder for Raw {
    type Item = Vec<u8>;
    type Error = tonic::Status;
    fn decode(&mut self, src: &mut tonic::codec::DecodeBuf<'_>) -> Result<Option<Vec<u8>>, tonic::Status> {
        use bytes::Buf;
        let v = src.chunk().to_vec();
        src.advance(v.len());
        Ok(Some(v))
    }
}

#[test]
fn undecodable_grpc_messages_are_invalid_argument() {
    let p = prefill(&[]);
    let d = decode();
    rt().block_on(async {
        for (url, path) in [
            (&d.url, "/disagg.v1.DecodeWorker/Generate"),
            (&p.url, "/disagg.v1.PrefillWorker/Prefill"),
            (&d.url, "/disagg.v1.DecodeWorker/Info"),
        ] {
            let ch = tonic::transport::Channel::from_shared(url.clone()).unwrap().connect().await.unwrap();
            let mut g = tonic::client::Grpc::new(ch);
            g.ready().await.unwrap();
            let path = tonic::codegen::http::uri::PathAndQuery::from_static(path);
            let req = tonic::Request::new(vec![0xff, 0xff, 0xff]);
            let code = if path.path().ends_with("Generate") {
                g.server_streaming(req, path, RawCodec).await.err().map(|e| e.code())
            } else {
                g.unary(req, path, RawCodec).await.err().map(|e| e.code())
            };
            assert_eq!(code, Some(tonic::Code::InvalidArgument), "{url}");
        }
    });
}

/// Token ids for turn `t` of conversation `c`: each turn resends the previous prompt
/// and adds ~100 tokens.
fn conversation(c: u32, t: usize) -> Vec<u32> {
    (0..300 + 100 * t as u32).map(|i| 300 + (i * 7 + c * 1013) % 20_000).collect()
}

#[test]
fn a_conversation_stays_on_the_decode_worker_that_caches_it() {
    let start = |role: &str| {
        let mut a = vec![role];
        a.extend(WORKER);
        a.extend(["--metrics-port", "0"]);
        Proc::start(&a, &format!("{role} worker ready"), &[])
    };
    let p = start("prefill");
    let (d0, d1) = (start("decode"), start("decode"));
    // Suffixes shorter than 200 tokens are prefilled on the decode worker, from its
    // cache; the first turn (300 tokens) goes through the prefill worker.
    let r = router(&[&p], &[&d0, &d1], &["--local-prefill-below", "200"]);
    let rt = rt();
    let mut home = [0; 2];
    rt.block_on(async {
        let c = reqwest::Client::new();
        // Conversation 0 names its session; conversation 1 relies on KV events alone.
        for (conv, user) in [(0u32, Some("session-0")), (1, None)] {
            let before = [served(&metrics_url(&d0)).await, served(&metrics_url(&d1)).await];
            for t in 0..5 {
                let prompt = conversation(conv, t);
                let mut body = json!({"model": "smollm2-135m-instruct", "prompt": prompt, "max_tokens": 3,
                                      "temperature": 0});
                if let Some(u) = user {
                    body["user"] = json!(u);
                }
                let (status, v) = complete(&c, &r.url, body).await;
                assert_eq!(status, 200, "{v}");
                let cached = v["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap() as usize;
                if t == 0 {
                    assert_eq!(cached, 0, "conversation {conv}: nothing cached yet");
                } else {
                    // Everything but the new tokens (down to a block boundary).
                    let previous = conversation(conv, t - 1).len();
                    assert_eq!(cached, previous / 16 * 16, "conversation {conv}, turn {t}: {v}");
                }
                // KV events reach the router asynchronously.
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            let after = [served(&metrics_url(&d0)).await, served(&metrics_url(&d1)).await];
            let counts = [after[0] - before[0], after[1] - before[1]];
            assert!(counts.contains(&5) && counts.contains(&0), "conversation {conv} moved: {counts:?}");
            home[conv as usize] = if counts[0] == 5 { 0 } else { 1 };
        }
        // Its later turns were prefilled on that decode worker, from its own cache.
        let local = "disagg:decode_local_prefills_total";
        assert_eq!(counter(&metrics_url(&d0), local).await + counter(&metrics_url(&d1), local).await, 8);
    });
    // Both started on a tie, broken round-robin in list order: conversation 0 on d0,
    // conversation 1 on d1.
    assert_eq!(home, [0, 1]);
    // A new router, knowing nothing of the conversations, learns the workers' caches
    // from their KV event snapshots: the next turn of conversation 1 (no session key)
    // still goes to d1, where it is cached (without that knowledge, a tie would send
    // it to d0).
    drop(r);
    let r = router(&[&p], &[&d0, &d1], &["--local-prefill-below", "200"]);
    rt.block_on(async {
        tokio::time::sleep(Duration::from_millis(500)).await;
        let ds = [&d0, &d1];
        let before = served(&metrics_url(ds[home[1]])).await;
        let body = json!({"model": "smollm2-135m-instruct", "prompt": conversation(1, 5), "max_tokens": 3,
                          "temperature": 0});
        let (status, v) = complete(&reqwest::Client::new(), &r.url, body).await;
        assert_eq!(status, 200, "{v}");
        assert_eq!(
            served(&metrics_url(ds[home[1]])).await,
            before + 1,
            "the restarted router kept the conversation home"
        );
    });
}
