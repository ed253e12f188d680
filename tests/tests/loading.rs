//! Model loading: every supported GGUF tensor type, Hugging Face directories, and
//! clear errors for missing, corrupt or unsupported models.

use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};

use disagg_tests::{data_dir, test_options};
use engine::load::{cpu_engine, EngineOptions};
use engine::sampling::SamplingParams;
use engine::scheduler::run_to_completion;
use engine::tokenizer::ChatMessage;
use engine::EngineError;
use kernels::cpu::matmul::MatmulMode;
use kernels::quant::{dequantize_row, quantize_row, GgmlType};
use kernels::KvDtype;

fn temp_path(name: &str) -> PathBuf {
    static N: AtomicUsize = AtomicUsize::new(0);
    let dir =
        std::env::temp_dir().join(format!("disagg-test-{}-{}", std::process::id(), N.fetch_add(1, Ordering::Relaxed)));
    std::fs::create_dir_all(&dir).unwrap();
    dir.join(name)
}

fn opts_for(path: &std::path::Path) -> EngineOptions {
    EngineOptions { model: path.display().to_string(), ..test_options() }
}

fn load_err(opts: &EngineOptions) -> EngineError {
    match cpu_engine(opts) {
        Ok(_) => panic!("loading {} should fail", opts.model),
        Err(e) => e,
    }
}

// --- A minimal GGUF writer -------------------------------------------------------

enum V {
    Str(&'static str),
    U32(u32),
    F32(f32),
    Bool(bool),
    Strs(Vec<String>),
    I32s(Vec<i32>),
}

fn put_str(b: &mut Vec<u8>, s: &str) {
    b.extend((s.len() as u64).to_le_bytes());
    b.extend(s.as_bytes());
}

struct Tensor {
    name: String,
    dims: Vec<u64>,
    type_id: u32,
    data: Vec<u8>,
}

fn gguf(meta: &[(&str, V)], tensors: &[Tensor]) -> Vec<u8> {
    let mut b = Vec::new();
    b.extend(b"GGUF");
    b.extend(3u32.to_le_bytes());
    b.extend((tensors.len() as u64).to_le_bytes());
    b.extend((meta.len() as u64).to_le_bytes());
    for (k, v) in meta {
        put_str(&mut b, k);
        match v {
            V::Str(s) => {
                b.extend(8u32.to_le_bytes());
                put_str(&mut b, s);
            }
            V::U32(x) => {
                b.extend(4u32.to_le_bytes());
                b.extend(x.to_le_bytes());
            }
            V::F32(x) => {
                b.extend(6u32.to_le_bytes());
                b.extend(x.to_le_bytes());
            }
            V::Bool(x) => {
                b.extend(7u32.to_le_bytes());
                b.push(*x as u8);
            }
            V::Strs(v) => {
                b.extend(9u32.to_le_bytes());
                b.extend(8u32.to_le_bytes());
                b.extend((v.len() as u64).to_le_bytes());
                for s in v {
                    put_str(&mut b, s);
                }
            }
            V::I32s(v) => {
                b.extend(9u32.to_le_bytes());
                b.extend(5u32.to_le_bytes());
                b.extend((v.len() as u64).to_le_bytes());
                for x in v {
                    b.extend(x.to_le_bytes());
                }
            }
        }
    }
    let mut offset = 0u64;
    for t in tensors {
        put_str(&mut b, &t.name);
        b.extend((t.dims.len() as u32).to_le_bytes());
        for d in &t.dims {
            b.extend(d.to_le_bytes());
        }
        b.extend(t.type_id.to_le_bytes());
        b.extend(offset.to_le_bytes());
        offset += (t.data.len() as u64).div_ceil(32) * 32;
    }
    while b.len() % 32 != 0 {
        b.push(0);
    }
    for t in tensors {
        b.extend(&t.data);
        while b.len() % 32 != 0 {
            b.push(0);
        }
    }
    b
}

/// GPT-2's byte-to-character map, so that a 256-token byte-level vocabulary works.
fn byte_vocab() -> Vec<String> {
    let printable = |b: u32| (33..=126).contains(&b) || (161..=172).contains(&b) || (174..=255).contains(&b);
    let mut n = 0;
    (0..256u32)
        .map(|b| {
            if printable(b) {
                char::from_u32(b).unwrap().to_string()
            } else {
                n += 1;
                char::from_u32(255 + n).unwrap().to_string()
            }
        })
        .collect()
}

const HIDDEN: usize = 64;
const FFN: usize = 96;
const VOCAB: usize = 256;

fn tiny_meta(arch: &'static str) -> Vec<(&'static str, V)> {
    vec![
        ("general.architecture", V::Str(arch)),
        ("general.name", V::Str("tiny")),
        ("llama.block_count", V::U32(2)),
        ("llama.context_length", V::U32(128)),
        ("llama.embedding_length", V::U32(HIDDEN as u32)),
        ("llama.feed_forward_length", V::U32(FFN as u32)),
        ("llama.attention.head_count", V::U32(4)),
        ("llama.attention.head_count_kv", V::U32(2)),
        ("llama.rope.freq_base", V::F32(10000.0)),
        ("llama.attention.layer_norm_rms_epsilon", V::F32(1e-5)),
        ("tokenizer.ggml.model", V::Str("gpt2")),
        ("tokenizer.ggml.pre", V::Str("default")),
        ("tokenizer.ggml.tokens", V::Strs(byte_vocab())),
        ("tokenizer.ggml.token_type", V::I32s(vec![1; VOCAB])),
        ("tokenizer.ggml.merges", V::Strs(vec![])),
        ("tokenizer.ggml.eos_token_id", V::U32(0)),
        ("tokenizer.ggml.add_bos_token", V::Bool(false)),
    ]
}

/// Deterministic weights in [-scale, scale].
fn weights(n: usize, seed: u64, scale: f32) -> Vec<f32> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            ((x >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * scale
        })
        .collect()
}

/// The tensors of a tiny Llama with matrices stored as `ty`; with `dequantized`, the
/// matrices hold the F32 values that `ty` represents instead (the same function).
fn tiny_tensors(ty: GgmlType, dequantized: bool) -> Vec<Tensor> {
    let (qd, kvd) = (4 * 16, 2 * 16);
    let mut seed = 1;
    let mut matrix = |name: String, rows: usize, cols: usize| {
        seed += 1;
        let w = weights(rows * cols, seed, 0.3);
        let q: Vec<u8> = w.chunks(cols).flat_map(|r| quantize_row(ty, r)).collect();
        let (type_id, data) = if dequantized {
            let rb = ty.row_bytes(cols).unwrap();
            let mut f = vec![0f32; rows * cols];
            for r in 0..rows {
                dequantize_row(ty, &q[r * rb..(r + 1) * rb], &mut f[r * cols..(r + 1) * cols]);
            }
            (0, f.iter().flat_map(|v| v.to_le_bytes()).collect())
        } else {
            let id = match ty {
                GgmlType::F32 => 0,
                GgmlType::F16 => 1,
                GgmlType::Q4_0 => 2,
                GgmlType::Q4_1 => 3,
                GgmlType::Q8_0 => 8,
                GgmlType::BF16 => 30,
            };
            (id, q)
        };
        Tensor { name, dims: vec![cols as u64, rows as u64], type_id, data }
    };
    let norm = |name: String| Tensor {
        name,
        dims: vec![HIDDEN as u64],
        type_id: 0,
        data: weights(HIDDEN, 99, 0.5).iter().map(|v| v + 1.0).flat_map(|v| v.to_le_bytes()).collect(),
    };
    let mut t = vec![matrix("token_embd.weight".into(), VOCAB, HIDDEN), norm("output_norm.weight".into())];
    for l in 0..2 {
        t.push(norm(format!("blk.{l}.attn_norm.weight")));
        t.push(norm(format!("blk.{l}.ffn_norm.weight")));
        t.push(matrix(format!("blk.{l}.attn_q.weight"), qd, HIDDEN));
        t.push(matrix(format!("blk.{l}.attn_k.weight"), kvd, HIDDEN));
        t.push(matrix(format!("blk.{l}.attn_v.weight"), kvd, HIDDEN));
        t.push(matrix(format!("blk.{l}.attn_output.weight"), HIDDEN, qd));
        t.push(matrix(format!("blk.{l}.ffn_gate.weight"), FFN, HIDDEN));
        t.push(matrix(format!("blk.{l}.ffn_up.weight"), FFN, HIDDEN));
        t.push(matrix(format!("blk.{l}.ffn_down.weight"), HIDDEN, FFN));
    }
    t
}

fn write(name: &str, bytes: &[u8]) -> PathBuf {
    let p = temp_path(name);
    std::fs::write(&p, bytes).unwrap();
    p
}

#[test]
fn every_supported_gguf_type_loads_and_computes_the_function_it_stores() {
    let prompt: Vec<u32> = b"hello, tiny model".iter().map(|b| *b as u32).collect();
    for ty in [GgmlType::F32, GgmlType::F16, GgmlType::BF16, GgmlType::Q8_0, GgmlType::Q4_0, GgmlType::Q4_1] {
        let stored = write("m.gguf", &gguf(&tiny_meta("llama"), &tiny_tensors(ty, false)));
        let plain = write("m.gguf", &gguf(&tiny_meta("llama"), &tiny_tensors(ty, true)));
        let mut o = opts_for(&stored);
        o.cpu_matmul = MatmulMode::F32;
        o.kv_dtype = KvDtype::F32;
        let a = cpu_engine(&o).unwrap().score(&prompt).unwrap();
        let b = cpu_engine(&EngineOptions { model: plain.display().to_string(), ..o.clone() })
            .unwrap()
            .score(&prompt)
            .unwrap();
        let worst = a.iter().zip(&b).map(|(x, y)| (x - y).abs()).fold(0f32, f32::max);
        assert!(worst < 1e-4, "{ty:?}: logits differ from the dequantized F32 model by {worst}");
        // The default (Q8) path generates from it too.
        let mut core = cpu_engine(&opts_for(&stored)).unwrap();
        let sp = SamplingParams { max_tokens: Some(5), ignore_eos: true, ..SamplingParams::greedy() };
        let out = run_to_completion(&mut core, vec![(prompt.clone(), sp)], 0).unwrap();
        assert_eq!(out[0].output_ids.len(), 5, "{ty:?}");
    }
}

#[test]
fn hugging_face_directory_matches_transformers() {
    #[derive(serde::Deserialize)]
    struct Case {
        name: String,
        text: String,
        prompt_ids: Vec<u32>,
        greedy_ids: Vec<u32>,
        last_logits: Vec<f32>,
    }
    #[derive(serde::Deserialize)]
    struct Fixture {
        cases: Vec<Case>,
        chat_example: String,
    }
    let fx: Fixture =
        serde_json::from_str(&std::fs::read_to_string(data_dir().join("tiny_hf_reference.json")).unwrap()).unwrap();
    let dir = data_dir().join("tiny_hf");
    let mut o = opts_for(&dir);
    o.cpu_matmul = MatmulMode::F32;
    o.kv_dtype = KvDtype::F32;
    let mut core = cpu_engine(&o).unwrap();
    let chat =
        core.tokenizer.apply_chat_template(&[ChatMessage { role: "user".into(), content: "hi".into() }], true).unwrap();
    assert_eq!(chat, fx.chat_example);
    for c in &fx.cases {
        assert_eq!(core.tokenizer.encode(&c.text).unwrap(), c.prompt_ids, "{}", c.name);
        let got = core.score(&c.prompt_ids).unwrap();
        let worst = got.iter().zip(&c.last_logits).map(|(g, w)| (g - w).abs()).fold(0f32, f32::max);
        // bf16 weights are exact in f32; only summation order differs.
        assert!(worst < 1e-3, "{}: logits differ by {worst}", c.name);
        let sp = SamplingParams { max_tokens: Some(c.greedy_ids.len()), ignore_eos: true, ..SamplingParams::greedy() };
        let out = run_to_completion(&mut core, vec![(c.prompt_ids.clone(), sp)], 0).unwrap();
        assert_eq!(out[0].output_ids, c.greedy_ids, "{}", c.name);
    }
}

#[test]
fn missing_corrupt_and_unsupported_models_are_clear_errors() {
    let msg = |e: EngineError| e.to_string();
    let e = msg(load_err(&opts_for(std::path::Path::new("/nonexistent/model.gguf"))));
    assert!(e.contains("not found") && e.contains(".gguf"), "{e}");

    let e = msg(load_err(&opts_for(&write("junk.gguf", b"this is not a model file at all"))));
    assert!(e.contains("not a valid GGUF"), "{e}");

    let full = gguf(&tiny_meta("llama"), &tiny_tensors(GgmlType::Q4_1, false));
    let e = msg(load_err(&opts_for(&write("cut.gguf", &full[..full.len() - 100]))));
    assert!(e.contains("truncated") || e.contains("end of the file"), "{e}");
    let e = msg(load_err(&opts_for(&write("cut2.gguf", &full[..200]))));
    assert!(e.contains("not a valid GGUF"), "{e}");

    let e = load_err(&opts_for(&write("arch.gguf", &gguf(&tiny_meta("gpt2"), &tiny_tensors(GgmlType::F32, false)))));
    assert!(matches!(e, EngineError::Unsupported(_)) && e.to_string().contains("architecture 'gpt2'"), "{e}");

    let mut t = tiny_tensors(GgmlType::F32, false);
    t[2].type_id = 12; // Q4_K
    t[2].data = vec![0; 144 * 2]; // keeps the file self-consistent
    let e = load_err(&opts_for(&write("q4k.gguf", &gguf(&tiny_meta("llama"), &t))));
    assert!(matches!(e, EngineError::Unsupported(_)), "{e}");
    assert!(e.to_string().contains("Q4_K") && e.to_string().contains("Q4_1"), "{e}");

    let mut t = tiny_tensors(GgmlType::F32, false);
    t.retain(|t| t.name != "blk.1.ffn_down.weight");
    let e = msg(load_err(&opts_for(&write("missing.gguf", &gguf(&tiny_meta("llama"), &t)))));
    assert!(e.contains("blk.1.ffn_down.weight"), "{e}");

    let dir = temp_path("dir");
    std::fs::create_dir_all(&dir).unwrap();
    let e = msg(load_err(&opts_for(&dir)));
    assert!(e.contains("config.json"), "{e}");
}
