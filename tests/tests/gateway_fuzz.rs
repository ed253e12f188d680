//! Malformed and random input against every JSON endpoint: no crash, no hang, every
//! answer a success or a well-formed OpenAI error (never a 5xx), and the engine idle
//! and healthy afterwards.

use std::time::Duration;

use disagg_tests::{test_options, TestServer};
use router::GatewayConfig;
use serde_json::{json, Value};

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// A JSON value of a random kind, including hostile ones.
fn random_value(r: &mut Rng, depth: u32) -> Value {
    match r.below(if depth > 2 { 9 } else { 11 }) {
        0 => Value::Null,
        1 => json!(r.below(2) == 0),
        2 => json!(r.next() as i64),
        3 => json!(-(r.below(1000) as i64)),
        4 => json!(f64::from_bits(r.next() & 0x7fef_ffff_ffff_ffff)),
        5 => json!("x".repeat(r.below(300) as usize)),
        6 => json!("\u{0}\u{fffd}😀<|im_end|>"),
        7 => json!(r.below(100_000)),
        8 => json!(1e300),
        9 => Value::Array((0..r.below(4)).map(|_| random_value(r, depth + 1)).collect()),
        _ => {
            let mut m = serde_json::Map::new();
            for k in ["role", "content", "type", "text", "include_usage", "zz"] {
                if r.below(2) == 0 {
                    m.insert(k.into(), random_value(r, depth + 1));
                }
            }
            Value::Object(m)
        }
    }
}

fn base(endpoint: &str) -> Value {
    match endpoint {
        "/v1/chat/completions" => {
            json!({"model": "smollm2-135m-instruct", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
        }
        "/v1/completions" => {
            json!({"model": "smollm2-135m-instruct", "prompt": "hi", "max_tokens": 4})
        }
        "/tokenize" => json!({"prompt": "hi"}),
        _ => json!({"tokens": [1, 2, 3]}),
    }
}

const FIELDS: &[&str] = &[
    "model",
    "messages",
    "prompt",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "n",
    "stop",
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "logprobs",
    "top_logprobs",
    "logit_bias",
    "user",
    "stream",
    "stream_options",
    "echo",
    "tokens",
    "min_tokens",
    "stop_token_ids",
    "ignore_eos",
    "tools",
    "response_format",
    "suffix",
    "best_of",
    "bogus",
];

fn case(r: &mut Rng, endpoint: &str) -> Vec<u8> {
    let valid = base(endpoint).to_string().into_bytes();
    match r.below(8) {
        // Random bytes.
        0 => (0..r.below(400)).map(|_| r.next() as u8).collect(),
        // A valid body cut short.
        1 => valid[..r.below(valid.len() as u64) as usize].to_vec(),
        // Invalid UTF-8 inside a string.
        2 => {
            let mut v = valid.clone();
            let at = v.iter().position(|b| *b == b'h').unwrap_or(0);
            v.splice(at..at, [0xff, 0xfe, 0xc3]);
            v
        }
        // Deep nesting.
        3 => {
            let d = 1 + r.below(5000) as usize;
            format!("{{\"model\":{}{}}}", "[".repeat(d), "]".repeat(d)).into_bytes()
        }
        // Numbers past every range.
        4 => {
            let f = FIELDS[r.below(FIELDS.len() as u64) as usize];
            let n = ["1e400", "-1e400", "18446744073709551616", "-9223372036854775809", "NaN", "0.0000001", "-0"]
                [r.below(7) as usize];
            let s = base(endpoint).to_string();
            format!("{{\"{f}\":{n},{}", &s[1..]).into_bytes()
        }
        // One to three fields replaced by random values.
        _ => {
            let mut v = base(endpoint);
            for _ in 0..1 + r.below(3) {
                let f = FIELDS[r.below(FIELDS.len() as u64) as usize];
                v[f] = random_value(r, 0);
            }
            v.to_string().into_bytes()
        }
    }
}

#[test]
fn malformed_requests_get_well_formed_answers() {
    let mut o = test_options();
    o.threads = 2;
    o.max_model_len = 128;
    let srv = TestServer::start(&o, GatewayConfig::default(), 1024);
    let client = reqwest::Client::builder().timeout(Duration::from_secs(60)).build().unwrap();
    let endpoints = ["/v1/chat/completions", "/v1/completions", "/tokenize", "/detokenize"];
    let mut rng = Rng(0x5eed_1234_abcd_9876);
    let mut bodies: Vec<(String, Vec<u8>)> = Vec::new();
    for i in 0..600 {
        let ep = endpoints[i % endpoints.len()];
        bodies.push((ep.to_string(), case(&mut rng, ep)));
    }
    // Strings of 10 MB (over the body limit) on every endpoint.
    for ep in endpoints {
        bodies.push((ep.to_string(), format!("{{\"prompt\":\"{}\"}}", "a".repeat(10 << 20)).into_bytes()));
    }
    let results = srv.rt.block_on(async {
        let mut out = Vec::new();
        for chunk in bodies.chunks(8) {
            let futs =
                chunk.iter().map(|(ep, body)| {
                    let (client, url) = (client.clone(), format!("{}{ep}", srv.url));
                    let body = body.clone();
                    async move {
                        let shown = String::from_utf8_lossy(&body[..body.len().min(300)]).into_owned();
                        let r =
                            client.post(&url).body(body.clone()).send().await.unwrap_or_else(|e| {
                                panic!("{url}: no answer ({e}) to {shown:?} ({} bytes)", body.len())
                            });
                        let status = r.status().as_u16();
                        let ct = r
                            .headers()
                            .get("content-type")
                            .map(|h| h.to_str().unwrap_or("").to_string())
                            .unwrap_or_default();
                        let bytes = r.bytes().await.expect("body arrives");
                        (url, body, status, ct, bytes)
                    }
                });
            out.extend(futures::future::join_all(futs).await);
        }
        out
    });
    let mut by_status = std::collections::BTreeMap::new();
    for (url, body, status, ct, bytes) in results {
        *by_status.entry(status).or_insert(0) += 1;
        let shown = String::from_utf8_lossy(&body[..body.len().min(200)]).into_owned();
        assert!(status < 500, "{url} answered {status} to {shown:?}");
        if ct.starts_with("text/event-stream") {
            assert_eq!(status, 200);
            assert!(String::from_utf8_lossy(&bytes).contains("data: [DONE]"), "{url}: stream without [DONE]");
            continue;
        }
        let v: Value = serde_json::from_slice(&bytes).unwrap_or_else(|_| panic!("{url}: non-JSON answer to {shown:?}"));
        if status != 200 {
            let e = &v["error"];
            assert!(e["message"].is_string() && e["type"].is_string(), "{url}: {v} for {shown:?}");
        }
    }
    eprintln!("statuses: {by_status:?}");
    assert!(by_status.len() >= 3, "the cases should hit several outcomes: {by_status:?}");
    // The four 10 MB bodies were read (drained) and answered, not cut off.
    assert!(by_status.get(&413).copied().unwrap_or(0) >= 4, "{by_status:?}");
    let ok =
        srv.rt.block_on(async { client.get(format!("{}/health", srv.url)).send().await.unwrap().status().as_u16() });
    assert_eq!(ok, 200);
    srv.wait_idle();
}
