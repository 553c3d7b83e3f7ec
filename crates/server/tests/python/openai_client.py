"""Drives a running Switchyard server with the official OpenAI Python client and parses its
/metrics with the Prometheus client's text-format parser. Arguments: base URL, model name,
expected prompt token counts as JSON ({"completion": n, "chat": n}). Exits non-zero on the
first failed check."""
import json
import sys
import urllib.request

from openai import OpenAI
from prometheus_client.parser import text_string_to_metric_families

base, model, expected = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
client = OpenAI(base_url=base + "/v1", api_key="unused")
PROMPT = "The capital of France is"


def check(cond, what):
    if not cond:
        print("FAILED:", what, file=sys.stderr)
        sys.exit(1)


def metric(name, **labels):
    text = urllib.request.urlopen(base + "/metrics").read().decode()
    total = 0.0
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                total += s.value
    return total


before = metric("switchyard_requests_total", model=model, route="completions", status="200")
gen_before = metric("switchyard_generation_tokens_total", model=model)

# Completion, not streamed.
c = client.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0.8, seed=11)
check(c.object == "text_completion", "completion object")
check(c.usage.prompt_tokens == expected["completion"], f"prompt tokens {c.usage.prompt_tokens} != {expected['completion']}")
check(c.usage.completion_tokens == 8 or c.choices[0].finish_reason == "stop", "completion tokens")
check(c.usage.total_tokens == c.usage.prompt_tokens + c.usage.completion_tokens, "total tokens")

# The same request streamed gives the same text.
parts, usage = [], None
for chunk in client.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0.8, seed=11,
                                       stream=True, stream_options={"include_usage": True}):
    if chunk.choices:
        parts.append(chunk.choices[0].text)
    if chunk.usage:
        usage = chunk.usage
check("".join(parts) == c.choices[0].text, f"streamed {''.join(parts)!r} != {c.choices[0].text!r}")
check(usage is not None and usage.completion_tokens == c.usage.completion_tokens, "streamed usage")

# Chat, not streamed and streamed.
msgs = [{"role": "user", "content": "Name a color."}]
r = client.chat.completions.create(model=model, messages=msgs, max_tokens=12, temperature=0, seed=1)
check(r.choices[0].message.role == "assistant", "chat role")
check(len(r.choices[0].message.content) > 0, "chat content")
check(r.usage.prompt_tokens == expected["chat"], f"chat prompt tokens {r.usage.prompt_tokens} != {expected['chat']}")
text = ""
for chunk in client.chat.completions.create(model=model, messages=msgs, max_tokens=12, temperature=0, seed=1, stream=True):
    if chunk.choices and chunk.choices[0].delta.content:
        text += chunk.choices[0].delta.content
check(text == r.choices[0].message.content, f"chat streamed {text!r} != {r.choices[0].message.content!r}")

# Chat log-probabilities: one per generated token.
lp = client.chat.completions.create(model=model, messages=msgs, max_tokens=5, temperature=0, logprobs=True)
check(len(lp.choices[0].logprobs.content) == lp.usage.completion_tokens, "chat logprobs count")
check(all(t.logprob <= 0 for t in lp.choices[0].logprobs.content), "logprobs are log-probabilities")

# Unknown model: the client raises NotFoundError with the server's message.
try:
    client.completions.create(model="no-such-model", prompt="x")
    check(False, "unknown model accepted")
except Exception as e:  # openai.NotFoundError
    check(getattr(e, "status_code", None) == 404, f"unknown model status {e}")

# Metrics moved: two completions requests answered 200, tokens counted.
after = metric("switchyard_requests_total", model=model, route="completions", status="200")
check(after - before == 2, f"requests_total moved by {after - before}")
gen_after = metric("switchyard_generation_tokens_total", model=model)
check(gen_after - gen_before >= 2 * c.usage.completion_tokens, "generation tokens counted")
check(metric("switchyard_time_to_first_token_seconds_count", model=model) >= 5, "ttft histogram")
check(metric("switchyard_memory_bytes", model=model, category="weights") > 0, "memory gauge")
print("ok")
