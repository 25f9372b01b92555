"""Does a non-finite value in a token written to an 8-bit cache survive the fused append (fdlib.hf.append)?
For each 8-bit dtype and scale kind, write one token of D values holding a NaN (or +inf) at d = 3 and print what
the cache then holds for that token: the stored value at d = 3, whether any dequantized value of the token is
non-finite, and its scale. A 16-bit cache keeps the NaN, and that sequence's output becomes NaN.
    python tools/probe_nan_kv8.py"""
import torch

from fdlib.hf.append import append_kv8

dev = "cuda" if torch.cuda.is_available() else "cpu"
H, D = 2, 16
for dtype in (torch.float8_e4m3fn, torch.int8):
    for token in (True, False):
        for bad in (float("nan"), float("inf")):
            k = torch.randn(1, H, 1, D, device=dev).half()
            k[0, 0, 0, 3] = bad
            out = torch.zeros(4, H, D, device=dev, dtype=dtype)
            out2 = torch.zeros_like(out)
            s = torch.zeros(4, H, device=dev) if token else torch.full((H,), 0.01, device=dev)
            s2 = s.clone()
            append_kv8(k, k.clone(), torch.tensor([2], device=dev), None, out, out2, s, s2, token)
            sc = s[2, 0] if token else s[0]
            deq = out[2, 0].float() * sc
            print(f"{str(dtype):22s} {'token' if token else 'head ':5s} {bad!s:4s}: stored[3]={out[2, 0, 3].float().item()!s:6s}"
                  f" scale={sc.item():.4g} dequantized non-finite: {int((~torch.isfinite(deq)).sum())} of {D}")
