//! The OpenAI-compatible gateway end to end, through a real socket: the official
//! `openai` Python SDK, raw HTTP for the error cases, 200 concurrent streams, client
//! disconnects, and malformed input.

use std::time::Duration;

use disagg_tests::{engine, python_with_openai, test_options, TestServer};
use engine::sampling::SamplingParams;
use engine::scheduler::run_to_completion;
use futures::StreamExt;
use router::GatewayConfig;
use serde_json::{json, Value};

const MODEL: &str = "smollm2-135m-instruct";

fn server(max_in_flight: usize, api_key: Option<&str>) -> TestServer {
    let mut o = test_options();
    o.threads = 2;
    o.max_num_seqs = 64;
    let cfg = GatewayConfig { api_key: api_key.map(str::to_string), ..GatewayConfig::default() };
    TestServer::start(&o, cfg, max_in_flight)
}

/// Greedy ids and text of `prompt` straight from an engine (what `disagg generate` prints).
fn direct(prompt: Vec<u32>, max_tokens: usize) -> (Vec<u32>, String) {
    let mut core = engine(&test_options());
    let sp = SamplingParams { max_tokens: Some(max_tokens), ..SamplingParams::greedy() };
    let d = run_to_completion(&mut core, vec![(prompt, sp)], 0).unwrap().remove(0);
    (d.output_ids, d.text)
}

async fn post(client: &reqwest::Client, url: &str, body: impl Into<reqwest::Body>) -> (u16, Value) {
    let r = client.post(url).header("content-type", "application/json").body(body).send().await.unwrap();
    let status = r.status().as_u16();
    let bytes = r.bytes().await.unwrap();
    let v = serde_json::from_slice(&bytes)
        .unwrap_or_else(|_| panic!("status {status}: body is not JSON: {:?}", String::from_utf8_lossy(&bytes)));
    (status, v)
}

fn assert_error_shape(v: &Value) {
    let e = &v["error"];
    assert!(e["message"].is_string(), "{v}");
    assert!(e["type"].is_string(), "{v}");
    assert!(e.get("param").is_some() && e.get("code").is_some(), "{v}");
}

#[test]
fn the_openai_sdk_works_and_agrees_with_generate() {
    let py = python_with_openai();
    let srv = server(1024, None);
    let script = disagg_tests::data_dir().join("openai_sdk_check.py");
    let out = std::process::Command::new(py).arg(script).arg(format!("{}/v1", srv.url)).arg(MODEL).output().unwrap();
    assert!(out.status.success(), "SDK script failed: {}", String::from_utf8_lossy(&out.stderr));
    let r: Value = serde_json::from_slice(&out.stdout).unwrap();

    // Chat, plain and streamed, equal to the engine's own greedy answer.
    let tok = &srv.engine.tokenizer;
    let chat_prompt = tok
        .encode(
            &tok.apply_chat_template(
                &[engine::tokenizer::ChatMessage {
                    role: "user".into(),
                    content: "What is 2+2? Answer briefly.".into(),
                }],
                true,
            )
            .unwrap(),
        )
        .unwrap();
    let (ids, text) = direct(chat_prompt.clone(), 24);
    assert_eq!(r["chat"]["text"], text);
    assert_eq!(r["chat"]["role"], "assistant");
    assert_eq!(r["chat"]["object"], "chat.completion");
    assert_eq!(r["chat"]["usage"]["prompt_tokens"], chat_prompt.len());
    assert_eq!(r["chat"]["usage"]["completion_tokens"], ids.len());
    assert_eq!(r["chat"]["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    assert_eq!(r["chat_stream"]["text"], text);
    assert_eq!(r["chat_stream"]["finish"], r["chat"]["finish"]);
    // The same prompt again: its full blocks (bar the last token's) come from the
    // prefix cache, and usage says so.
    let mut again = r["chat"]["usage"].clone();
    again["prompt_tokens_details"]["cached_tokens"] = json!((chat_prompt.len() - 1) / 16 * 16);
    assert_eq!(r["chat_stream"]["usage"], again);
    assert_eq!(r["chat_stream"]["roles"], json!(["assistant"]));
    assert!(!r["chat_parts"]["text"].as_str().unwrap().is_empty());

    // n = 3 seeded samples: three choices, each with logprobs that fit together.
    let n = r["chat_n"].as_array().unwrap();
    assert_eq!(n.len(), 3);
    for (i, c) in n.iter().enumerate() {
        assert_eq!(c["index"], i);
        let lps = c["logprobs"].as_array().unwrap();
        assert!(!lps.is_empty());
        for l in lps {
            assert_eq!(l["top"].as_array().unwrap().len(), 2);
            let bytes: Vec<u8> = l["bytes"].as_array().unwrap().iter().map(|b| b.as_u64().unwrap() as u8).collect();
            assert_eq!(String::from_utf8_lossy(&bytes), l["token"].as_str().unwrap());
            assert!(l["logprob"].as_f64().unwrap() <= 0.0);
        }
    }

    // Completions: text prompt, token-id prompt (streamed), stop string, echo with n.
    let (_, ctext) = direct(vec![504, 3575, 282, 4649, 314], 16);
    assert_eq!(r["completion"]["text"], ctext);
    assert_eq!(r["completion"]["finish"], "length");
    assert_eq!(r["completion"]["usage"]["prompt_tokens"], 5);
    assert_eq!(r["completion_stream_ids"]["text"], ctext);
    let nl = ctext.find('\n').unwrap();
    assert_eq!(r["completion_stop"]["text"], ctext[..nl]);
    assert_eq!(r["completion_stop"]["finish"], "stop");
    let multi = r["completion_multi"].as_array().unwrap();
    assert_eq!(multi.len(), 4);
    assert!(multi[0]["text"].as_str().unwrap().starts_with("Hello"));
    assert!(multi[2]["text"].as_str().unwrap().starts_with("The capital of France is Paris"));
    let lp = &r["completion_logprobs"];
    assert_eq!(lp["tokens"].as_array().unwrap().len(), 3);
    assert_eq!(lp["text_offset"][0], 0);
    assert_eq!(r["models"], json!([MODEL]));

    // Errors as the SDK sees them.
    assert_eq!(r["errors"]["bad_model"]["status"], 404);
    assert_eq!(r["errors"]["bad_temperature"]["status"], 400);
    assert_eq!(r["errors"]["bad_temperature"]["body"]["param"], "temperature");
    assert_eq!(r["errors"]["tools"]["status"], 400);
    srv.wait_idle();
}

#[test]
fn error_cases_have_openai_shape_and_status() {
    let srv = server(1024, None);
    let client = reqwest::Client::new();
    let chat = format!("{}/v1/chat/completions", srv.url);
    let msgs = json!([{"role": "user", "content": "hi"}]);
    let cases: Vec<(&str, String, u16, Option<&str>)> = vec![
        ("not json", "{oops".into(), 422, None),
        ("invalid utf-8", String::from_utf8_lossy(b"{\"model\": \"\xff\xfe\"}").into_owned(), 400, None),
        (
            "wrong type",
            json!({"model": MODEL, "messages": msgs, "temperature": "hot"}).to_string(),
            400,
            Some("temperature"),
        ),
        ("out of range", json!({"model": MODEL, "messages": msgs, "top_p": 7}).to_string(), 400, Some("top_p")),
        (
            "huge number",
            json!({"model": MODEL, "messages": msgs, "max_tokens": 1e300}).to_string(),
            400,
            Some("max_tokens"),
        ),
        (
            "too many tokens",
            json!({"model": MODEL, "messages": msgs, "max_tokens": 100000}).to_string(),
            400,
            Some("max_tokens"),
        ),
        (
            "unknown field",
            json!({"model": MODEL, "messages": msgs, "frobnicate": 1}).to_string(),
            400,
            Some("frobnicate"),
        ),
        (
            "unsupported",
            json!({"model": MODEL, "messages": msgs, "response_format": {"type": "json_object"}}).to_string(),
            400,
            Some("response_format"),
        ),
        ("unknown model", json!({"model": "gpt-5", "messages": msgs}).to_string(), 404, Some("model")),
        ("missing messages", json!({"model": MODEL}).to_string(), 400, Some("messages")),
        (
            "missing model beside a bad value",
            json!({"messages": msgs, "max_tokens": -1}).to_string(),
            400,
            Some("model"),
        ),
        (
            "user turn without content",
            json!({"model": MODEL, "messages": [{"role": "user"}]}).to_string(),
            400,
            Some("messages[0].content"),
        ),
        (
            "bad role",
            json!({"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]}).to_string(),
            400,
            Some("messages[0].role"),
        ),
        ("n too large", json!({"model": MODEL, "messages": msgs, "n": 1000}).to_string(), 400, Some("n")),
        (
            "logprobs too many",
            json!({"model": MODEL, "messages": msgs, "logprobs": true, "top_logprobs": 50}).to_string(),
            400,
            Some("top_logprobs"),
        ),
        (
            "logit bias id",
            json!({"model": MODEL, "messages": msgs, "logit_bias": {"99999999": 1}}).to_string(),
            400,
            Some("logit_bias"),
        ),
        ("empty stop", json!({"model": MODEL, "messages": msgs, "stop": [""]}).to_string(), 400, Some("stop")),
    ];
    srv.rt.block_on(async {
        for (name, body, status, param) in cases {
            let (st, v) = post(&client, &chat, body).await;
            assert_eq!(st, status, "{name}: {v}");
            assert_error_shape(&v);
            if let Some(p) = param {
                assert_eq!(v["error"]["param"], p, "{name}: {v}");
            }
        }
        // 413: a body over the limit (4 MiB by default).
        let big = format!("{{\"model\":\"{MODEL}\",\"prompt\":\"{}\"}}", "a".repeat(5 << 20));
        let (st, v) = post(&client, &format!("{}/v1/completions", srv.url), big).await;
        assert_eq!(st, 413, "{v}");
        assert_error_shape(&v);
        // A prompt longer than the context.
        let long = json!({"model": MODEL, "prompt": vec![100u32; 9000]}).to_string();
        let (st, v) = post(&client, &format!("{}/v1/completions", srv.url), long).await;
        assert_eq!(st, 400, "{v}");
        assert!(v["error"]["message"].as_str().unwrap().contains("context length"), "{v}");
        assert_eq!(v["error"]["param"], "prompt", "{v}");
        // In a chat request the messages are the prompt.
        let long = json!({"model": MODEL, "messages": [{"role": "user", "content": "hello ".repeat(9000)}]});
        let (st, v) = post(&client, &chat, long.to_string()).await;
        assert_eq!(st, 400, "{v}");
        assert!(v["error"]["message"].as_str().unwrap().contains("context length"), "{v}");
        assert_eq!(v["error"]["param"], "messages", "{v}");
        // An empty prompt names the prompt too.
        let empty = json!({"model": MODEL, "prompt": ""}).to_string();
        let (st, v) = post(&client, &format!("{}/v1/completions", srv.url), empty).await;
        assert_eq!(st, 400, "{v}");
        assert_eq!(v["error"]["param"], "prompt", "{v}");
        // Unknown route and method.
        let r = client.get(format!("{}/v2/nothing", srv.url)).send().await.unwrap();
        assert_eq!(r.status().as_u16(), 404);
        assert_error_shape(&serde_json::from_slice(&r.bytes().await.unwrap()).unwrap());
        let r = client.delete(format!("{}/v1/models", srv.url)).send().await.unwrap();
        assert_eq!(r.status().as_u16(), 405);
    });
    srv.wait_idle();
}

#[test]
fn api_key_is_required_when_configured() {
    let srv = server(1024, Some("s3cret"));
    let client = reqwest::Client::new();
    srv.rt.block_on(async {
        let models = format!("{}/v1/models", srv.url);
        for auth in [None, Some("Bearer wrong"), Some("Bearer s3cre"), Some("s3cret")] {
            let mut rq = client.get(&models);
            if let Some(a) = auth {
                rq = rq.header("authorization", a);
            }
            let r = rq.send().await.unwrap();
            assert_eq!(r.status().as_u16(), 401, "{auth:?}");
            let v: Value = serde_json::from_slice(&r.bytes().await.unwrap()).unwrap();
            assert_eq!(v["error"]["code"], "invalid_api_key");
        }
        let r = client.get(&models).header("authorization", "Bearer s3cret").send().await.unwrap();
        assert_eq!(r.status().as_u16(), 200);
        // Health and metrics stay open for probes and scrapers.
        assert_eq!(client.get(format!("{}/health", srv.url)).send().await.unwrap().status().as_u16(), 200);
        assert_eq!(client.get(format!("{}/metrics", srv.url)).send().await.unwrap().status().as_u16(), 200);
    });
}

/// Reads an SSE completion stream to the end; returns the concatenated text.
async fn stream_text(client: &reqwest::Client, url: &str, body: Value) -> String {
    let r = client.post(url).body(body.to_string()).send().await.unwrap();
    assert_eq!(r.status().as_u16(), 200);
    let mut buf = Vec::new();
    let mut s = r.bytes_stream();
    while let Some(chunk) = s.next().await {
        buf.extend_from_slice(&chunk.unwrap());
    }
    let text = String::from_utf8(buf).unwrap();
    let mut out = String::new();
    let mut done = false;
    for line in text.lines().filter_map(|l| l.strip_prefix("data: ")) {
        if line == "[DONE]" {
            done = true;
            continue;
        }
        let v: Value = serde_json::from_str(line).unwrap();
        if let Some(t) = v["choices"][0]["text"].as_str() {
            out.push_str(t);
        }
    }
    assert!(done, "stream ended without [DONE]");
    out
}

#[test]
fn two_hundred_concurrent_streams_get_their_own_answers() {
    let srv = server(1024, None);
    let prompts: Vec<String> = (0..20).map(|i| format!("Item {i}: the number {} is", i * 37 + 11)).collect();
    // What each prompt must produce, from a separate engine.
    let mut core = engine(&test_options());
    let reqs = prompts
        .iter()
        .map(|p| {
            (core.tokenizer.encode(p).unwrap(), SamplingParams { max_tokens: Some(12), ..SamplingParams::greedy() })
        })
        .collect();
    let want: Vec<String> = run_to_completion(&mut core, reqs, 0).unwrap().into_iter().map(|c| c.text).collect();
    let client = reqwest::Client::new();
    let url = format!("{}/v1/completions", srv.url);
    let got = srv.rt.block_on(async {
        let tasks: Vec<_> = (0..200)
            .map(|k| {
                let (client, url, p) = (client.clone(), url.clone(), prompts[k % 20].clone());
                tokio::spawn(async move {
                    let body = json!({"model": MODEL, "prompt": p, "max_tokens": 12, "temperature": 0, "stream": true});
                    (k, stream_text(&client, &url, body).await)
                })
            })
            .collect();
        futures::future::join_all(tasks).await
    });
    assert_eq!(got.len(), 200);
    for r in got {
        let (k, text) = r.unwrap();
        assert_eq!(text, want[k % 20], "stream {k} got another request's text");
    }
    srv.wait_idle();
    assert_eq!(srv.engine.stats().kv_blocks_used, 0);
}

#[test]
fn a_disconnecting_client_frees_its_blocks() {
    let srv = server(1024, None);
    let client = reqwest::Client::new();
    let url = format!("{}/v1/completions", srv.url);
    srv.rt.block_on(async {
        for stream in [true, false] {
            let body = json!({"model": MODEL, "prompt": "Count forever:", "max_tokens": 4000, "ignore_eos": true, "stream": stream});
            let req = client.post(&url).body(body.to_string()).send();
            if stream {
                let r = req.await.unwrap();
                let mut s = r.bytes_stream();
                for _ in 0..3 {
                    s.next().await.unwrap().unwrap();
                }
                assert!(srv.engine.stats().kv_blocks_used > 0);
                drop(s);
            } else {
                // Give up on a non-streaming request while it is generating.
                let _ = tokio::time::timeout(Duration::from_millis(300), req).await;
                assert!(srv.engine.stats().kv_blocks_used > 0 || srv.engine.in_flight() > 0);
            }
            let t0 = std::time::Instant::now();
            while srv.engine.stats().kv_blocks_used > 0 || srv.engine.in_flight() > 0 {
                assert!(t0.elapsed() < Duration::from_secs(2), "blocks not freed after disconnect: {:?}", srv.engine.stats());
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        }
    });
}

#[test]
fn over_capacity_is_429_and_others_are_unharmed() {
    let srv = server(2, None);
    let client = reqwest::Client::new();
    let url = format!("{}/v1/completions", srv.url);
    srv.rt.block_on(async {
        let long = json!({"model": MODEL, "prompt": "Go:", "max_tokens": 200, "ignore_eos": true, "temperature": 0});
        let a = tokio::spawn({
            let (c, u, b) = (client.clone(), url.clone(), long.to_string());
            async move { post(&c, &u, b).await }
        });
        let b = tokio::spawn({
            let (c, u, b) = (client.clone(), url.clone(), long.to_string());
            async move { post(&c, &u, b).await }
        });
        while srv.engine.in_flight() < 2 {
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        let (st, v) = post(&client, &url, long.to_string()).await;
        assert_eq!(st, 429, "{v}");
        assert_error_shape(&v);
        for h in [a, b] {
            let (st, v) = h.await.unwrap();
            assert_eq!(st, 200, "{v}");
            assert_eq!(v["usage"]["completion_tokens"], 200);
        }
    });
    srv.wait_idle();
}

#[test]
fn tokenize_detokenize_health_and_metrics() {
    let srv = server(1024, None);
    let client = reqwest::Client::new();
    srv.rt.block_on(async {
        let (st, v) =
            post(&client, &format!("{}/tokenize", srv.url), json!({"prompt": "The capital of France is"}).to_string())
                .await;
        assert_eq!(st, 200);
        assert_eq!(v["tokens"], json!([504, 3575, 282, 4649, 314]));
        assert_eq!(v["count"], 5);
        let (st, v) = post(
            &client,
            &format!("{}/tokenize", srv.url),
            json!({"messages": [{"role": "user", "content": "hi"}]}).to_string(),
        )
        .await;
        assert_eq!(st, 200);
        assert_eq!(v["tokens"][0], 1);
        let (st, v) = post(
            &client,
            &format!("{}/detokenize", srv.url),
            json!({"tokens": [504, 3575, 282, 4649, 314]}).to_string(),
        )
        .await;
        assert_eq!(st, 200);
        assert_eq!(v["prompt"], "The capital of France is");
        let (st, v) =
            post(&client, &format!("{}/detokenize", srv.url), json!({"tokens": [99999999]}).to_string()).await;
        assert_eq!(st, 400, "{v}");
        let r = client.get(format!("{}/health", srv.url)).send().await.unwrap();
        assert_eq!(r.status().as_u16(), 200);
        // One request, then the histograms and counters show it.
        let (st, _) = post(
            &client,
            &format!("{}/v1/completions", srv.url),
            json!({"model": MODEL, "prompt": "Hi", "max_tokens": 5, "ignore_eos": true}).to_string(),
        )
        .await;
        assert_eq!(st, 200);
        let m = client.get(format!("{}/metrics", srv.url)).send().await.unwrap().text().await.unwrap();
        for name in [
            "disagg:time_to_first_token_seconds_count",
            "disagg:inter_token_latency_seconds_count",
            "disagg:e2e_request_latency_seconds_count",
            "disagg:prompt_tokens_total",
            "disagg:generation_tokens_total",
            "disagg:num_requests_running",
            "disagg:num_requests_waiting",
            "disagg:kv_cache_usage_perc",
        ] {
            assert!(m.contains(name), "metrics lack {name}");
        }
        let line = m.lines().find(|l| l.starts_with("disagg:generation_tokens_total")).unwrap();
        assert!(line.ends_with(" 5"), "{line}");
        let line = m.lines().find(|l| l.starts_with("disagg:e2e_request_latency_seconds_count")).unwrap();
        assert!(line.ends_with(" 1"), "{line}");
    });
    srv.wait_idle();
}

#[test]
fn health_is_503_until_the_model_is_loaded() {
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().unwrap();
    rt.block_on(async {
        let state = router::AppState::new(GatewayConfig::default());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        tokio::spawn(router::serve(listener, state.clone(), std::future::pending()));
        let client = reqwest::Client::new();
        for path in ["/health", "/v1/models"] {
            let r = client.get(format!("{url}{path}")).send().await.unwrap();
            assert_eq!(r.status().as_u16(), 503, "{path}");
            assert!(r.headers().contains_key("retry-after"));
            let v: Value = serde_json::from_slice(&r.bytes().await.unwrap()).unwrap();
            assert_error_shape(&v);
        }
        let (st, v) =
            post(&client, &format!("{url}/v1/completions"), json!({"model": MODEL, "prompt": "x"}).to_string()).await;
        assert_eq!(st, 503, "{v}");
    });
}
