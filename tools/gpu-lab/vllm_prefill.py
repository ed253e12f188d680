# vLLM 0.26.0's long prefill with only the timed prompt inside the profiler's range, so
# that Nsight Compute times its kernels one by one and they can be set beside ours
# (tools/gpu-lab/ncu_step.py). Same model and chunking as the peer's bench_long.py:
# Llama-3.1-8B shape, dummy bf16 weights, max_num_batched_tokens 16384, no prefix cache.
# Warm-up, torch.compile and graph capture run before the range opens.
#
# On the GPU machine, with vLLM staged (../shared/tools/vllm-peer/stage.sh):
#   VLLM_ENABLE_V1_MULTIPROCESSING=0 VLLM_ALLOW_LONG_MAX_MODEL_LEN=1 ncu --profile-from-start off \
#     --metrics gpu__time_duration.sum --cache-control none --clock-control none --csv \
#     --page raw --print-units base --log-file vllm32k.csv python3 tools/gpu-lab/vllm_prefill.py 32768
#   python3 tools/gpu-lab/ncu_step.py vllm32k.csv --all --classes
# Ours, a prompt of the same length in the same steps (two steps of 16k). The first step
# over --min-us is the bench's untimed warm-up prompt, the same shapes as the timed one:
# that is the one summed, and --launch-count only has to reach past it:
#   DISAGG_CUDA_GRAPHS=0 ncu --metrics gpu__time_duration.sum --cache-control none \
#     --clock-control none --launch-count 6000 --csv --page raw --print-units base \
#     --log-file ours32k.csv $D bench engine --device cuda:0 --model random:llama3-8b --json \
#     --kv-cache-mib 20000 --max-num-seqs 1 --context 64 --gen-tokens 8 --batch 1 \
#     --prompt-tokens 32768 --repeat 1 --prefill-first --prefill-chunk 16384
#   python3 tools/gpu-lab/ncu_step.py ours32k.csv --min-us 3000 --steps 2 --classes
# Without ncu the script prints the prefill's wall time (a check that it ran as the peer's).
import json, os, random, sys, time

import torch
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt

plen = int(sys.argv[1]) if len(sys.argv) > 1 else 32768
os.makedirs("/tmp/llama8b", exist_ok=True)
json.dump({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
           "intermediate_size": 14336, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
           "num_hidden_layers": 32, "vocab_size": 128256, "max_position_embeddings": 131072,
           "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "torch_dtype": "bfloat16",
           "tie_word_embeddings": False, "bos_token_id": 128000, "eos_token_id": 128001, "hidden_act": "silu"},
          open("/tmp/llama8b/config.json", "w"))
llm = LLM(model="/tmp/llama8b", load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16",
          max_model_len=131072 + 256, gpu_memory_utilization=0.9, enable_prefix_caching=False, seed=0,
          max_num_batched_tokens=16384)
rnd = random.Random(1)
sp = SamplingParams(max_tokens=1, min_tokens=1, ignore_eos=True, temperature=0, detokenize=False)


def prompt(n):
    return [TokensPrompt(prompt_token_ids=[rnd.randrange(1000, 120000) for _ in range(n)])]


# Warm-up at the same length: every shape the timed prompt takes has run once.
llm.generate(prompt(plen), sp, use_tqdm=False)
p = prompt(plen)
torch.cuda.synchronize()
torch.cuda.cudart().cudaProfilerStart()
t = time.perf_counter()
llm.generate(p, sp, use_tqdm=False)
torch.cuda.synchronize()
dt = time.perf_counter() - t
torch.cuda.cudart().cudaProfilerStop()
print("RESULT " + json.dumps({"prompt_tokens": plen, "prefill_s": round(dt, 4)}), flush=True)
