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
        Proc { child, url }
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
    let p: Vec<&str> = prefill.iter().map(|p| p.url.as_str()).collect();
    let d: Vec<&str> = decode.iter().map(|p| p.url.as_str()).collect();
    let (p, d) = (p.join(","), d.join(","));
    let mut a = vec!["router", "--port", "0", "--decode", &d];
    if !p.is_empty() {
        a.extend(["--prefill", &p]);
    }
    a.extend(extra);
    Proc::start(&a, "disagg serving", &[])
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
    let out = Command::new("pgrep").args(["-P", &up.pid().to_string()]).output().unwrap();
    let children: Vec<String> = String::from_utf8_lossy(&out.stdout).split_whitespace().map(String::from).collect();
    assert_eq!(children.len(), 5, "2 prefill + 2 decode workers and a router");
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
        // Long generations on both decode workers, then SIGKILL one of them.
        let tasks: Vec<_> = (0..6)
            .map(|i| {
                let (c, base) = (c.clone(), r.url.clone());
                tokio::spawn(async move {
                    let body = json!({"model": "smollm2-135m-instruct", "prompt": prompt(i), "max_tokens": 400,
                                      "temperature": 0, "ignore_eos": true});
                    complete(&c, &base, body).await
                })
            })
            .collect();
        tokio::time::sleep(Duration::from_millis(1500)).await;
        d2.child.kill().unwrap();
        d2.child.wait().unwrap();
        let mut failed = 0;
        for t in tasks {
            let (status, v) = t.await.unwrap();
            if status != 200 {
                failed += 1;
                let msg = v["error"]["message"].as_str().unwrap();
                assert!(msg.contains("decode worker"), "a clear reason: {msg}");
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
    // No prefill worker at all: with a threshold, short prompts still work.
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
        // A long prompt needs a prefill worker, and there is none: a clear 503.
        let body = json!({"model": "smollm2-135m-instruct", "prompt": prompt(3), "max_tokens": 4, "temperature": 0});
        let (status, v) = complete(&c, &r.url, body).await;
        assert_eq!(status, 503, "{v}");
        assert!(v["error"]["message"].as_str().unwrap().contains("no prefill worker"), "{v}");
    });
}

#[test]
fn a_worker_of_another_kv_layout_is_refused() {
    let d = decode();
    let mut a = vec!["prefill", "--block-size", "32"];
    a.extend(WORKER);
    let p = Proc::start(&a, "prefill worker ready", &[]);
    let out = Command::new(env!("CARGO_BIN_EXE_disagg"))
        .args(["router", "--port", "0", "--decode", &d.url, "--prefill", &p.url])
        .stdout(Stdio::null())
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("refused") && err.contains("KV layout"), "{err}");
}
