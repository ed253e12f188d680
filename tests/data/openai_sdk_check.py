#!/usr/bin/env python3
"""Drives a disagg server through the official `openai` SDK and prints one JSON object
with what came back, for tests/tests/gateway.rs to check.

Usage: openai_sdk_check.py BASE_URL MODEL
"""
import json
import sys

import openai

base, model = sys.argv[1], sys.argv[2]
client = openai.OpenAI(base_url=base, api_key="unused", max_retries=0, timeout=120)
out = {"sdk_version": openai.__version__}
msgs = [{"role": "user", "content": "What is 2+2? Answer briefly."}]

r = client.chat.completions.create(model=model, messages=msgs, max_tokens=24, temperature=0)
out["chat"] = {"text": r.choices[0].message.content, "finish": r.choices[0].finish_reason,
               "role": r.choices[0].message.role, "usage": r.usage.model_dump(), "object": r.object}

text, finish, usage, roles = "", None, None, []
for ch in client.chat.completions.create(model=model, messages=msgs, max_tokens=24, temperature=0,
                                         stream=True, stream_options={"include_usage": True}):
    if ch.usage is not None:
        usage = ch.usage.model_dump()
    for c in ch.choices:
        if c.delta.role:
            roles.append(c.delta.role)
        text += c.delta.content or ""
        finish = c.finish_reason or finish
out["chat_stream"] = {"text": text, "finish": finish, "usage": usage, "roles": roles}

# Content parts and a system message.
r = client.chat.completions.create(model=model, max_completion_tokens=8, temperature=0, messages=[
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": [{"type": "text", "text": "Name a colour."}]}])
out["chat_parts"] = {"text": r.choices[0].message.content}

r = client.chat.completions.create(model=model, messages=msgs, max_tokens=6, temperature=0.9, seed=5, n=3,
                                   logprobs=True, top_logprobs=2)
out["chat_n"] = [{"index": c.index, "text": c.message.content,
                  "logprobs": [{"token": t.token, "logprob": t.logprob, "bytes": t.bytes,
                                "top": [(x.token, x.logprob) for x in t.top_logprobs]} for t in c.logprobs.content]}
                 for c in r.choices]

r = client.completions.create(model=model, prompt="The capital of France is", max_tokens=16, temperature=0)
out["completion"] = {"text": r.choices[0].text, "finish": r.choices[0].finish_reason, "usage": r.usage.model_dump()}

r = client.completions.create(model=model, prompt="The capital of France is", max_tokens=16, temperature=0, stop=["\n"])
out["completion_stop"] = {"text": r.choices[0].text, "finish": r.choices[0].finish_reason}

text = ""
for ch in client.completions.create(model=model, prompt=[504, 3575, 282, 4649, 314], max_tokens=16,
                                    temperature=0, stream=True):
    text += ch.choices[0].text
out["completion_stream_ids"] = {"text": text}

r = client.completions.create(model=model, prompt=["Hello", "The capital of France is"], max_tokens=4,
                              temperature=0, echo=True, n=2)
out["completion_multi"] = [{"index": c.index, "text": c.text} for c in r.choices]

r = client.completions.create(model=model, prompt="The capital of France is", max_tokens=3, temperature=0, logprobs=2)
lp = r.choices[0].logprobs
out["completion_logprobs"] = {"tokens": lp.tokens, "token_logprobs": lp.token_logprobs,
                              "top_logprobs": lp.top_logprobs, "text_offset": lp.text_offset}

out["models"] = [m.id for m in client.models.list().data]

errors = {}
for name, call in [
    ("bad_model", lambda: client.chat.completions.create(model="nope", messages=msgs)),
    ("bad_temperature", lambda: client.chat.completions.create(model=model, messages=msgs, temperature=-3)),
    ("tools", lambda: client.chat.completions.create(model=model, messages=msgs,
                                                      tools=[{"type": "function", "function": {"name": "f"}}])),
]:
    try:
        call()
        errors[name] = None
    except openai.APIStatusError as e:
        errors[name] = {"status": e.status_code, "body": e.body}
out["errors"] = errors
print(json.dumps(out))
