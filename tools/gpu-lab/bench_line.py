# One line from a `disagg bench engine --json` result on stdin, for the gpu-lab scripts:
# ms per decode step by batch (with how many timed steps were replayed from a graph), then
# unless --decode-only the copy bandwidth the run measured, b1's fraction of it and the
# prefill. A run that printed no JSON says so, with the end of what it printed.
#
#   python3 tools/gpu-lab/bench_line.py TAG [--decode-only] < result
import json
import sys

tag = sys.argv[1] if len(sys.argv) > 1 else ""
decode_only = "--decode-only" in sys.argv[2:]
txt = sys.stdin.read()
try:
    j = json.loads(txt[txt.index("{"):])
except ValueError:
    print(tag, "no JSON (the bench failed; run it without 2>/dev/null to see why):", txt[-400:])
    sys.exit(0)
parts = [
    "b%d %.4f ms (%d/%d)" % (d["batch"], d["ms_per_step"], d["graph_steps"]["timed_replayed"], d["graph_steps"]["timed"])
    for d in j["decode"]
]
if not decode_only:
    parts.append("copy %.1f GB/s" % (j.get("copy_gb_per_s") or 0))
    if j.get("decode_b1_frac_of_copy_bw"):
        parts.append("b1 %.4f of copy" % j["decode_b1_frac_of_copy_bw"])
    pf = j["prefill"]
    if pf.get("tokens_per_s"):
        parts.append("prefill %d: %.4f s, %.1f TFLOP/s" % (pf["prompt_tokens"], pf["prompt_tokens"] / pf["tokens_per_s"], j["prefill_tflops"]))
print(tag, " | ".join(parts))
