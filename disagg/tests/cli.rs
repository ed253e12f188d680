//! The `disagg` command line as users run it: the JSON contract of `generate`, and
//! clear errors for bad flags.

use std::process::Command;

fn disagg(args: &[&str]) -> (i32, String, String) {
    disagg_with(args, &[])
}

fn disagg_with(args: &[&str], env: &[(&str, &str)]) -> (i32, String, String) {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_disagg"));
    cmd.args(args).env("DISAGG_THREADS", "1").envs(env.iter().copied());
    let out = cmd.output().expect("runs");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into(),
        String::from_utf8_lossy(&out.stderr).into(),
    )
}

#[test]
fn generate_json_has_the_contract_fields() {
    let (code, out, err) = disagg(&["generate", "--prompt", "The capital of France is", "--max-tokens", "8", "--json"]);
    assert_eq!(code, 0, "{err}");
    let v: serde_json::Value = serde_json::from_str(out.trim()).expect("one JSON object");
    assert_eq!(v["prompt_ids"], serde_json::json!([504, 3575, 282, 4649, 314]));
    assert_eq!(v["output_ids"].as_array().unwrap().len(), 8);
    assert!(v["text"].as_str().unwrap().starts_with(" Paris"), "{v}");
    assert_eq!(v["finish_reason"], "length");

    // The same through --prompt-ids, with logprobs.
    let (code, out2, err) = disagg(&[
        "generate",
        "--prompt-ids",
        "504,3575,282,4649,314",
        "--max-tokens",
        "8",
        "--logprobs",
        "2",
        "--json",
    ]);
    assert_eq!(code, 0, "{err}");
    let w: serde_json::Value = serde_json::from_str(out2.trim()).unwrap();
    assert_eq!(w["output_ids"], v["output_ids"]);
    let lp = w["logprobs"].as_array().unwrap();
    assert_eq!(lp.len(), 8);
    assert_eq!(lp[0]["top_logprobs"].as_array().unwrap().len(), 2);
    assert_eq!(lp[0]["token_id"], v["output_ids"][0]);
}

#[test]
fn logits_out_writes_the_last_prompt_position() {
    // The file a reference implementation compares against (tools/random_reference.py):
    // vocab × f32 at the prompt's last position, whose argmax is the greedy first token.
    let path = std::env::temp_dir().join(format!("disagg-logits-{}.f32", std::process::id()));
    let p = path.to_str().unwrap();
    let (code, out, err) = disagg(&[
        "generate",
        "--model",
        "random:smollm2-135m",
        "--prompt-ids",
        "1,2,3,500,7000",
        "--max-tokens",
        "1",
        "--json",
        "--logits-out",
        p,
    ]);
    assert_eq!(code, 0, "{err}");
    let v: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    let bytes = std::fs::read(&path).unwrap();
    let _ = std::fs::remove_file(&path);
    let logits: Vec<f32> = bytes.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect();
    assert_eq!(logits.len(), 49152, "one logit per vocabulary entry");
    assert!(logits.iter().all(|x| x.is_finite()));
    assert_eq!(serde_json::json!(kernels::backend::argmax(&logits)), v["output_ids"][0]);
    let (code, _, err) = disagg(&["generate", "--prompt-ids", "1", "--logits-out", "/nonexistent-dir/x.f32"]);
    assert_ne!(code, 0);
    assert!(err.contains("--logits-out"), "{err}");
}

#[test]
fn chat_prompts_use_the_template() {
    let (code, out, err) = disagg(&["generate", "--chat", "--prompt", "What is 2+2?", "--max-tokens", "32", "--json"]);
    assert_eq!(code, 0, "{err}");
    let v: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    // <|im_start|>system … <|im_start|>assistant\n
    assert_eq!(v["prompt_ids"][0], 1);
    assert!(v["text"].as_str().unwrap().contains('4'), "{v}");
    assert_eq!(v["finish_reason"], "stop");
}

#[test]
fn bad_flags_say_what_to_change() {
    let cases: &[(&[&str], &str)] = &[
        (&["generate", "--prompt", "x", "--temperature", "-1"], "temperature"),
        (&["generate", "--prompt", "x", "--top-p", "0"], "top_p"),
        (&["generate", "--prompt", "x", "--model", "/no/such/model.gguf"], "not found"),
        (&["generate", "--prompt", "x", "--device", "cuda:0"], "--device"),
        (&["generate", "--prompt", "x", "--kv-dtype", "int3"], "--kv-dtype"),
        (&["generate", "--prompt", "x", "--max-batched-tokens", "4", "--max-num-seqs", "8"], "--max-batched-tokens"),
        (&["generate", "--prompt-ids", "1,2,999999", "--max-tokens", "2"], "out of range"),
        (&["generate", "--prompt", "x", "--max-tokens", "100000"], "max_tokens"),
        (&["generate", "--prompt", "x", "--gpu-memory-utilization", "0.9"], "on the CPU use --kv-cache-mib"),
        (&["generate", "--prompt", "x", "--model", "random:gpt5"], "random:llama3-8b"),
        (&["bench", "routing", "--workers", "65"], "--workers"),
        (&["bench", "routing", "--blocks", "0"], "--blocks"),
        // Zero counts in the benches are refused before anything loads (they panicked).
        (&["bench", "engine", "--repeat", "0"], "--repeat"),
        (&["bench", "engine", "--batch", "1,0"], "--batch"),
        (&["bench", "engine", "--gen-tokens", "1"], "--gen-tokens"),
        (&["bench", "engine", "--context", "0"], "--context"),
        (&["bench", "transfer", "--repeat", "0"], "--repeat"),
        (&["bench", "serve", "--concurrency", "0"], "--concurrency"),
        (&["bench", "serve", "--max-tokens", "0"], "--max-tokens"),
    ];
    for (args, needle) in cases {
        let (code, _, err) = disagg(args);
        assert_eq!(code, 1, "{args:?} should fail");
        assert!(err.contains(needle), "{args:?}: {err:?} should mention {needle}");
        assert!(!err.contains("panicked"), "{args:?}: {err}");
    }
}

#[test]
fn an_unknown_gateway_spin_is_a_clear_error() {
    // Checked before the model loads, so `serve` neither listens nor loads.
    let (code, _, err) = disagg_with(&["serve", "--port", "0"], &[("DISAGG_GATEWAY_SPIN", "yes")]);
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("DISAGG_GATEWAY_SPIN=yes") && err.contains("give 1"), "{err}");
}

#[test]
fn an_unknown_allocator_is_a_clear_error() {
    let (code, _, err) = disagg_with(&["generate", "--prompt", "hi"], &[("DISAGG_ALLOCATOR", "glibc")]);
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("DISAGG_ALLOCATOR=glibc") && err.contains("system"), "{err}");
}

#[test]
fn bench_serve_accounts_for_every_request() {
    // A small run: every HTTP request's gateway timing is found, the slowest request's
    // parts add up to the reported maximum, and the scheduler figures are there (Linux).
    // It runs on glibc's malloc, the other allocator (the other tests run on mimalloc),
    // and with the gateway's spinning task (DISAGG_GATEWAY_SPIN=1; a CPU engine's gateway
    // does not spin by default).
    let (code, out, err) = disagg_with(
        &[
            "bench",
            "serve",
            "--concurrency",
            "2",
            "--requests",
            "4",
            "--rounds",
            "2",
            "--no-level-warmup",
            "--max-tokens",
            "4",
            "--json",
        ],
        &[("DISAGG_ALLOCATOR", "system"), ("DISAGG_GATEWAY_SPIN", "1")],
    );
    assert_eq!(code, 0, "{err}");
    let v: serde_json::Value = serde_json::from_str(out.trim()).expect("one JSON object");
    assert_eq!(v["allocator"], "system");
    assert_eq!(v["gateway_spin"], true);
    let level = &v["levels"][0];
    assert_eq!(level["requests_measured"], 8);
    assert_eq!(level["matched_timings"], 8);
    // The CPU replays no step from a graph.
    let g = &level["engine_graph_steps"];
    assert_eq!(
        (g["replayed"]["http"].as_u64(), g["captured"]["direct"].as_u64(), g["held"].as_u64()),
        (Some(0), Some(0), Some(0)),
        "{g}"
    );
    let gw = &level["gateway_overhead_ms"];
    let f = |x: &serde_json::Value| x.as_f64().unwrap_or_else(|| panic!("not a number: {x} in {gw}"));
    for (slowest, max, first_part) in
        [("slowest_e2e", "e2e_max", "out"), ("slowest_first_token", "first_token_max", "first_out")]
    {
        let s = &gw[slowest];
        assert!(s["index"].as_u64().unwrap() < 8, "{s}");
        let parts = f(&s["in"]) + f(&s[first_part]);
        assert!((parts - f(&gw[max])).abs() < 1e-6, "{slowest}: {s} against {max} {}", gw[max]);
        assert!(f(&s["send_to_handler"]) >= 0.0);
        // "in" is waiting for the body, parse and checks, tokenization and submission.
        let in_parts = ["in_body_read", "in_parse", "in_tokenize", "in_submit"];
        assert!(in_parts.iter().all(|k| f(&s[k]) >= 0.0), "{s}");
        let sum: f64 = in_parts.iter().map(|k| f(&s[k])).sum();
        assert!((sum - f(&s["in"])).abs() < 1e-6, "{slowest}: the parts of in add to {sum}: {s}");
        if cfg!(target_os = "linux") {
            // The handler's thread did some work there, and no more than the wall time.
            let u = &s["in_thread"];
            let cpu = f(&u["cpu_ms"]);
            assert!(cpu >= 0.0 && cpu <= f(&s["in"]) - f(&s["in_body_read"]) + 0.01, "{s}");
            assert!(u["minor_faults"].is_u64() && u["involuntary_switches"].is_u64(), "{s}");
        }
    }
    // Each output's time in the gateway is the engine's hand-off, the handler's wake and
    // its shaping of the bytes.
    for s in [&gw["slowest_e2e"], &gw["slowest_first_token"]] {
        for out in ["out", "first_out"] {
            let parts = ["_send", "_wake", "_format"].map(|p| f(&s[format!("{out}{p}").as_str()]));
            assert!(parts.iter().all(|&v| v >= 0.0), "{s}");
            let sum: f64 = parts.iter().sum();
            assert!((sum - f(&s[out])).abs() < 1e-6, "the parts of {out} add to {sum}: {s}");
        }
    }
    for k in ["out_send", "first_out_send", "out_wake", "first_out_wake", "out_format", "first_out_format"] {
        assert!(f(&gw[format!("{k}_p99").as_str()]) >= 0.0 && f(&gw[format!("{k}_max").as_str()]) >= 0.0, "{k}: {gw}");
    }
    for k in ["in_preempted", "in_blocked", "in_page_faulted"] {
        assert!(gw[k].as_u64().is_some_and(|n| n <= 8), "{k}: {gw}");
    }
    if cfg!(target_os = "linux") {
        for k in ["cpu_us_per_token", "run_queue_wait_us_per_token"] {
            assert!(f(&level[k]["gateway"]) >= 0.0 && f(&level[k]["load_generator"]) >= 0.0, "{k}: {}", level[k]);
        }
        assert!(f(&level["cpu_us_per_token"]["gateway"]) > 0.0, "the gateway ran: {}", level["cpu_us_per_token"]);
    }
}

#[test]
fn bench_engine_times_prefill_and_decode_in_either_order() {
    // By default the prefill is timed after the decode batches (the peers' order);
    // --prefill-first times it before them. Both report every batch and the prefill.
    for first in [false, true] {
        let mut args = vec![
            "bench",
            "engine",
            "--batch",
            "1,2",
            "--gen-tokens",
            "4",
            "--context",
            "16",
            "--prompt-tokens",
            "32",
            "--repeat",
            "1",
            "--json",
        ];
        if first {
            args.push("--prefill-first");
        }
        let (code, out, err) = disagg(&args);
        assert_eq!(code, 0, "{err}");
        let v: serde_json::Value = serde_json::from_str(out.trim()).expect("one JSON object");
        assert_eq!(v["prefill_first"], first, "{v}");
        assert_eq!(v["prefill"]["prompt_tokens"], 32, "{v}");
        assert!(v["prefill"]["tokens_per_s"].as_f64().is_some_and(|t| t > 0.0), "{v}");
        let decode = v["decode"].as_array().expect("decode batches");
        let batches: Vec<u64> = decode.iter().map(|d| d["batch"].as_u64().unwrap()).collect();
        assert_eq!(batches, [1, 2], "{v}");
        assert!(decode.iter().all(|d| d["ms_per_step"].as_f64().is_some_and(|m| m > 0.0 && m.is_finite())), "{v}");
        assert!(decode.iter().all(|d| d["first_tokens_s"].as_f64().is_some_and(|s| s > 0.0 && s.is_finite())), "{v}");
        // The timed runs' decode-only steps are counted (four tokens after the first),
        // none of them from a graph on the CPU; the whole-batch steps that ms_per_step
        // times are among them.
        for d in decode {
            let g = &d["graph_steps"];
            let (all, timed) = (g["decode_only"].as_u64().unwrap_or(0), g["timed"].as_u64().unwrap_or(0));
            assert!(all >= 4 && (1..=all).contains(&timed), "{v}");
            assert_eq!((g["replayed"].as_u64(), g["captured"].as_u64()), (Some(0), Some(0)), "{v}");
            assert_eq!((g["timed_replayed"].as_u64(), g["timed_captured"].as_u64()), (Some(0), Some(0)), "{v}");
        }
        assert_eq!(v["prefill"]["steps"], 1, "the whole prompt in one step: {v}");
    }
}

#[test]
fn bench_engine_prefills_in_chunks_when_asked() {
    // --prefill-chunk 12: the 32-token prompt takes steps of 12, 12 and 8 tokens.
    let args = ["bench", "engine", "--batch", "1", "--gen-tokens", "2", "--context", "8", "--prompt-tokens", "32"];
    let args = [&args[..], &["--max-num-seqs", "2"]].concat();
    let (code, out, err) = disagg(&[&args[..], &["--repeat", "1", "--prefill-chunk", "12", "--json"]].concat());
    assert_eq!(code, 0, "{err}");
    let v: serde_json::Value = serde_json::from_str(out.trim()).expect("one JSON object");
    assert_eq!(v["prefill_chunk"], 12, "{v}");
    assert_eq!(v["prefill"]["steps"], 3, "{v}");
    assert!(v["prefill"]["tokens_per_s"].as_f64().is_some_and(|t| t > 0.0), "{v}");
    // A chunk of no tokens is refused with what to change.
    let (code, _, err) = disagg(&[&args[..], &["--prefill-chunk", "0"]].concat());
    assert_ne!(code, 0);
    assert!(err.contains("--prefill-chunk must be at least 1"), "{err}");
    // Nor one smaller than a step must take (here the 8-token prompts of the decode batch).
    let (code, _, err) = disagg(&[&args[..], &["--prefill-chunk", "4"]].concat());
    assert_ne!(code, 0);
    assert!(err.contains("--prefill-chunk 4 is below the 9 tokens a step takes"), "{err}");
    // And the step budget is the bench's to set.
    let (code, _, err) = disagg(&[&args[..], &["--prefill-chunk", "12", "--max-batched-tokens", "64"]].concat());
    assert_ne!(code, 0);
    assert!(err.contains("give --prefill-chunk or --max-batched-tokens, not both"), "{err}");
}

#[test]
fn bench_engine_times_a_mixed_step_when_asked() {
    // A 48-token prompt joins each decode batch once it decodes: one step prefills it
    // beside the batch's decode rows, and costs more than a step of those rows alone.
    let args = ["bench", "engine", "--gen-tokens", "8", "--context", "8", "--prompt-tokens", "16", "--repeat", "1"];
    let (code, out, err) = disagg(&[&args[..], &["--batch", "1,2", "--mixed-prompt-tokens", "48", "--json"]].concat());
    assert_eq!(code, 0, "{err}");
    let v: serde_json::Value = serde_json::from_str(out.trim()).expect("one JSON object");
    assert_eq!(v["mixed_prompt_tokens"], 48, "{v}");
    let decode = v["decode"].as_array().expect("decode batches");
    assert_eq!(decode.len(), 2, "{v}");
    for d in decode {
        let step = d["ms_per_step"].as_f64().unwrap();
        assert!(d["mixed_step_ms"].as_f64().is_some_and(|m| m > step && m.is_finite()), "{v}");
    }
    // Without the flag: none.
    let (code, out, err) = disagg(&[&args[..], &["--batch", "1", "--json"]].concat());
    assert_eq!(code, 0, "{err}");
    let v: serde_json::Value = serde_json::from_str(out.trim()).expect("one JSON object");
    assert!(v["decode"][0]["mixed_step_ms"].is_null() && v["mixed_prompt_tokens"].is_null(), "{v}");
    // A prompt of no tokens is refused with what to change, as is one that the prefill
    // chunk's steps cannot hold beside the batch.
    let (code, _, err) = disagg(&[&args[..], &["--mixed-prompt-tokens", "0"]].concat());
    assert_ne!(code, 0);
    assert!(err.contains("--mixed-prompt-tokens must be at least 1"), "{err}");
    // (Steps of 64 here: the chunk of 16 is raised to --max-num-seqs.)
    let chunked = ["--batch", "2", "--prefill-chunk", "16", "--mixed-prompt-tokens", "100"];
    let (code, _, err) = disagg(&[&args[..], &chunked].concat());
    assert_ne!(code, 0);
    assert!(err.contains("needs steps of 102 tokens, more than the 64 that --prefill-chunk leaves"), "{err}");
}
