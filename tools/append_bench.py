"""The append cost of one decode step of an fdlib.hf.DecodeCache: writing every layer's new K and V (one token a
sequence) into a 16-bit cache (index_copy_) against quantizing them on append into an 8-bit one (one fused
kernel a layer), per kv_dtype and granularity. Times with CUDA events over a CUDA graph of the step's writes
(the way a captured decode step runs them), median of several runs; the ratio is each 8-bit variant's time over
the 16-bit one measured in the same run.

    python tools/append_bench.py                        # Llama-3-8B shapes: 32 layers, 8 KV heads, D = 128
    python tools/append_bench.py --B 1,8,64 --L 8192 --dtype bfloat16 --out results/<device>/append.md

Without a GPU it runs a tiny case in Triton's interpreter (wall-clock times, not meaningful): a smoke test.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import transformers  # noqa: E402

from fdlib import runtime  # noqa: E402
from fdlib.hf import DecodeCache  # noqa: E402

VARIANTS = [(None, None)] + [(d, g) for d in (torch.float8_e4m3fn, torch.int8) for g in ("tensor", "head", "token")]


def make_cache(cfg, B, L, dtype, kv_dtype, granularity):
    kw = {} if kv_dtype is None else dict(kv_dtype=kv_dtype, granularity=granularity)
    if granularity in ("tensor", "head"):
        kw.update(k_scale=0.02, v_scale=0.02)
    cache = DecodeCache(cfg, B, L, dtype=dtype, **kw)
    cache.set_lengths([L // 2] * B)
    return cache


def append_step(cache, k, v):
    """Layer 0 starts the step (slots, lengths) and every layer writes: a decode step's cache work, attention
    left out."""
    B = k.shape[0]
    for i in range(len(cache.layers)):
        if i == 0:
            cache.begin_step(B, 1, None)
        cache.write(i, k, v)


def time_variant(cache, k, v, gpu: bool, iters: int, reps: int) -> float:
    """Median µs of one step's appends."""
    L = cache.lengths[0].item()
    if not gpu:
        t0 = time.perf_counter()
        for _ in range(iters):
            cache.set_lengths([L] * k.shape[0])
            append_step(cache, k, v)
        return (time.perf_counter() - t0) * 1e6 / iters
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            cache.set_lengths([L] * k.shape[0])
            append_step(cache, k, v)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    cache.set_lengths([L] * k.shape[0])
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        append_step(cache, k, v)
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            cache.lengths.fill_(L)   # the graph's step appends at the same place every replay
            graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / iters)
    return statistics.median(times)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--B", default="1,8,64", help="batch sizes")
    ap.add_argument("--L", type=int, default=8192, help="max_cache_len")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--heads", default="32:8", help="H_q:H_kv")
    ap.add_argument("--D", type=int, default=128)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--out", help="also write the table (markdown) here")
    a = ap.parse_args(argv)
    gpu = runtime.MODE == "gpu" and torch.cuda.is_available()
    H_q, H_kv = (int(x) for x in a.heads.split(":"))
    Bs, L, layers, D, iters, reps = [int(x) for x in a.B.split(",")], a.L, a.layers, a.D, a.iters, a.reps
    if not gpu:
        Bs, L, layers, H_q, H_kv, D, iters, reps = [2], 16, 2, 4, 2, 16, 2, 1
    dtype = getattr(torch, a.dtype)
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=H_q * D, intermediate_size=128, head_dim=D,
                                   num_hidden_layers=layers, num_attention_heads=H_q, num_key_value_heads=H_kv)
    dev = runtime.DEVICE
    lines = [f"Append cost of one decode step ({layers} layers, H_kv={H_kv}, D={D}, {a.dtype} model, L_max={L}); "
             f"device: {torch.cuda.get_device_name() if gpu else 'CPU (interpreter: not a measurement)'}; "
             f"torch {torch.__version__}; {time.strftime('%Y-%m-%d')}; command: python tools/append_bench.py "
             f"{' '.join(sys.argv[1:] if argv is None else argv)}", "",
             "| B | kv | granularity | µs / step | vs 16-bit |", "|---|---|---|---|---|"]
    for B in Bs:
        g = torch.Generator(device=dev).manual_seed(B)
        k = torch.randn(B, H_kv, 1, D, generator=g, device=dev, dtype=dtype)
        v = torch.randn(B, H_kv, 1, D, generator=g, device=dev, dtype=dtype)
        base = None
        for kv_dtype, gran in VARIANTS:
            cache = make_cache(cfg, B, L, dtype, kv_dtype, gran)
            us = time_variant(cache, k, v, gpu, iters, reps)
            base = us if kv_dtype is None else base
            name = str(kv_dtype or dtype).replace("torch.", "")
            lines.append(f"| {B} | {name} | {gran or '-'} | {us:.1f} | {us / base:.2f}x |")
            del cache
    text = "\n".join(lines)
    print(text)
    if a.out:
        os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
        with open(a.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
