"""llama.cpp (through llama-cpp-python) under the protocol of `switchyard bench engine`.

A 512-token prompt from the same text, then 128 greedy decode steps, a fresh context per run,
2 threads, median of RUNS. Prints one JSON line.

    python llama_cpp_bench.py MODEL.gguf TEXT RUNS
"""
import json
import statistics
import sys
import time

import llama_cpp
import numpy as np
from llama_cpp import Llama

# Some VMs report AMX but fault on AMX instructions; llama.cpp's extra (repacking) buffer
# types use them, so they are turned off. The plain CPU kernels still use AVX-512.
_default_params = llama_cpp.llama_model_default_params


def _params():
    p = _default_params()
    p.use_extra_bufts = False
    return p


llama_cpp.llama_model_default_params = _params
llama_cpp.llama.llama_cpp.llama_model_default_params = _params

PROMPT_TOKENS = 512
DECODE_TOKENS = 128

path, text_path, runs = sys.argv[1], sys.argv[2], int(sys.argv[3])
llm = Llama(model_path=path, n_ctx=1024, n_threads=2, n_threads_batch=2, n_batch=512,
            n_ubatch=512, verbose=False, logits_all=False)
with open(text_path, encoding="utf-8", errors="replace") as f:
    text = f.read()
tokens = llm.tokenize(text.encode(), add_bos=False)[:PROMPT_TOKENS]


def argmax_last():
    ptr = llama_cpp.llama_get_logits_ith(llm._ctx.ctx, -1)
    return int(np.argmax(np.ctypeslib.as_array(ptr, shape=(llm.n_vocab(),))))


def once(n_decode):
    llm.reset()
    t0 = time.perf_counter()
    llm.eval(tokens)
    t1 = time.perf_counter()
    nxt = argmax_last()
    t2 = time.perf_counter()
    for _ in range(n_decode):
        llm.eval([nxt])
        nxt = argmax_last()
    t3 = time.perf_counter()
    return len(tokens) / (t1 - t0), n_decode / (t3 - t2)


once(4)  # warm-up
pp, tg = [], []
for _ in range(runs):
    a, b = once(DECODE_TOKENS)
    pp.append(a)
    tg.append(b)
print(json.dumps({"engine": "llama.cpp", "model": path,
                  "prompt_tokens_per_s": statistics.median(pp),
                  "decode_tokens_per_s": statistics.median(tg),
                  "prompt_runs": pp, "decode_runs": tg}))
