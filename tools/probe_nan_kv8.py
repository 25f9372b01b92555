"""Does a non-finite value in a token written to an 8-bit cache survive the fused append (fdlib.hf.append), and does
it reach the decode output as a 16-bit cache's does?

1. For each 8-bit dtype and scale kind, write one token of D values holding a NaN (or +inf, -inf) at d = 3 and
   print what the cache then holds for it: the stored byte and value at d = 3, the scale, how many of its
   dequantized values are not finite, and (int8 with fixed scales, which has no NaN) the position recorded in
   ``nonfinite_from``. Wanted: dequantized NaN (per-token scales: the scale NaN, all D values; e4m3 with a fixed
   scale: the byte 0x7F at d = 3), or the position 2 recorded.
2. For each dtype and granularity, a DecodeCache of 2 sequences: a prompt, then a decode step whose token of
   sequence 1 holds a NaN (or +inf) in KV head 0's K (or V); print, per sequence, which query heads' outputs
   are not finite, for the 8-bit cache and a 16-bit one, and whether sequence 0's output is bitwise that of the
   same run with the value 0. Wanted: 8-bit heads [0, 1] of sequence 1 (KV head 0's two query heads), the
   16-bit cache's a subset, sequence 0 "same".
    python tools/probe_nan_kv8.py"""
import torch
import transformers

from fdlib.hf import DecodeCache
from fdlib.hf.append import append_kv8
from fdlib.hf.attention import decode
from fdlib.hf.kv8 import ALL_FINITE

dev = "cuda" if torch.cuda.is_available() else "cpu"
H, D = 2, 16
print("1. the append")
for dtype in (torch.float8_e4m3fn, torch.int8):
    for token in (True, False):
        for bad in (float("nan"), float("inf"), -float("inf")):
            k = torch.randn(1, H, 1, D, device=dev).half()
            k[0, 0, 0, 3] = bad
            out = torch.zeros(4, H, D, device=dev, dtype=dtype)
            out2 = torch.zeros_like(out)
            s = torch.zeros(4, H, device=dev) if token else torch.full((H,), 0.01, device=dev)
            s2 = s.clone()
            nf = torch.full((1, H), ALL_FINITE, dtype=torch.int32, device=dev)
            append_kv8(k, k.clone(), torch.tensor([2], device=dev), None, out, out2, s, s2, token,
                       torch.tensor([2], device=dev), nf)
            sc = s[2, 0] if token else s[0]
            deq = out[2, 0].float() * sc
            mark = f" nonfinite_from={int(nf[0, 0])}" if dtype == torch.int8 and not token else ""
            print(f"{str(dtype):22s} {'token' if token else 'head ':5s} {bad!s:4s}: "
                  f"stored[3]=0x{int(out[2, 0, 3].view(torch.uint8)):02x} ({out[2, 0, 3].float().item()!s:6s})"
                  f" scale={sc.item():.4g} dequantized non-finite: {int((~torch.isfinite(deq)).sum())} of {D}{mark}")

print("2. decode (sequence 1's token of the decode step bad in KV head 0)")
cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=D)


def run(kv_dtype, granularity, which, bad):
    g = torch.Generator().manual_seed(5)
    c = DecodeCache(cfg, 2, 16, device=dev, dtype=torch.float16, kv_dtype=kv_dtype,
                    **({} if kv_dtype is None else dict(granularity=granularity)))
    outs = []
    for T in (5, 1):
        q = torch.randn(2, 4, T, D, generator=g).half().to(dev)
        kv = [torch.randn(2, H, T, D, generator=g).half().to(dev) for _ in range(2)]
        if T == 1:
            kv[which][1, 0, 0, 3] = bad
        c.update(*kv, 0)
        c._awaiting = None
        c.begin_step(2, T)
        c.write(0, *kv)
        if T == 1:
            outs.append(decode(c, 0, q))
    return outs[-1]


for kv_dtype in (torch.float8_e4m3fn, torch.int8):
    for granularity in ("token", "head", "tensor"):
        for which in (0, 1):
            for bad in (float("nan"), float("inf")):
                got, clean = run(kv_dtype, granularity, which, bad), run(kv_dtype, granularity, which, 0.0)
                ref = run(None, None, which, bad)
                heads = [(~torch.isfinite(o[1, 0])).any(-1).nonzero().flatten().tolist() for o in (got, ref)]
                same = "same" if torch.equal(got[0].view(torch.int16), clean[0].view(torch.int16)) else "CHANGED"
                print(f"{str(kv_dtype):22s} {granularity:6s} {'KV'[which]} {bad!s:4s}: non-finite heads of "
                      f"sequence 1: 8-bit {heads[0]}, 16-bit {heads[1]}; sequence 0: {same}")
