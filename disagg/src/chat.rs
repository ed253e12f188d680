//! `disagg chat`: talk to a running server from the terminal (streams the answers).

use std::io::{BufRead, Write};

use clap::Args;
use futures::StreamExt;
use serde_json::{json, Value};

#[derive(Args, Debug)]
pub struct ChatArgs {
    /// The server's base URL.
    #[arg(long, default_value = "http://127.0.0.1:8000")]
    url: String,
    /// The model name (default: the first one the server lists).
    #[arg(long)]
    model: Option<String>,
    #[arg(long, env = "DISAGG_API_KEY", hide_env_values = true)]
    api_key: Option<String>,
    #[arg(long)]
    system: Option<String>,
    #[arg(long, default_value_t = 512)]
    max_tokens: usize,
    #[arg(long, default_value_t = 0.7, allow_negative_numbers = true)]
    temperature: f32,
}

pub fn run(a: ChatArgs) -> anyhow::Result<()> {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    rt.block_on(chat(a))
}

async fn chat(a: ChatArgs) -> anyhow::Result<()> {
    let client = reqwest::Client::new();
    let auth = |rq: reqwest::RequestBuilder| match &a.api_key {
        Some(k) => rq.header("authorization", format!("Bearer {k}")),
        None => rq,
    };
    let base = a.url.trim_end_matches('/').to_string();
    let model = match &a.model {
        Some(m) => m.clone(),
        None => {
            let r = auth(client.get(format!("{base}/v1/models"))).send().await.map_err(|e| {
                anyhow::anyhow!("cannot reach {base}: {e}; start a server with `disagg serve` or pass --url")
            })?;
            let v: Value = serde_json::from_slice(&r.bytes().await?)?;
            v["data"][0]["id"].as_str().ok_or_else(|| anyhow::anyhow!("the server lists no model: {v}"))?.to_string()
        }
    };
    let mut messages: Vec<Value> = a.system.iter().map(|s| json!({"role": "system", "content": s})).collect();
    eprintln!("chatting with {model} at {base} (empty line or Ctrl-D to quit)");
    let stdin = std::io::stdin();
    loop {
        eprint!("> ");
        let mut line = String::new();
        if stdin.lock().read_line(&mut line)? == 0 || line.trim().is_empty() {
            return Ok(());
        }
        messages.push(json!({"role": "user", "content": line.trim_end()}));
        let body = json!({"model": model, "messages": messages, "max_tokens": a.max_tokens,
                          "temperature": a.temperature, "stream": true});
        let r = auth(client.post(format!("{base}/v1/chat/completions"))).body(body.to_string()).send().await?;
        if !r.status().is_success() {
            let v: Value = serde_json::from_slice(&r.bytes().await?).unwrap_or_default();
            eprintln!("error: {}", v["error"]["message"].as_str().unwrap_or("unknown error"));
            messages.pop();
            continue;
        }
        let mut answer = String::new();
        let mut buf = Vec::new();
        let mut s = r.bytes_stream();
        while let Some(chunk) = s.next().await {
            buf.extend_from_slice(&chunk?);
            while let Some(data) = crate::sse::next_data(&mut buf) {
                if data == "[DONE]" {
                    continue;
                }
                let v: Value = serde_json::from_str(&data)?;
                if let Some(t) = v["choices"][0]["delta"]["content"].as_str() {
                    print!("{t}");
                    std::io::stdout().flush()?;
                    answer.push_str(t);
                }
            }
        }
        println!();
        messages.push(json!({"role": "assistant", "content": answer}));
    }
}
