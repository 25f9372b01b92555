"""The error an 8-bit KV cache costs, measured on the CPU in float64: no GPU, no kernel, just the numbers.

For each dtype (float8_e4m3fn, int8) and scale granularity (tensor, head, token; and e4m3 with scale 1, as FlashInfer's
fp8 runs store it), on two kinds of data:

* ``N(0,1)``: K and V drawn from N(0, 1);
* ``outlier channels``: the same with OUTLIER_CHANNELS of each head's D channels (the same ones in every head and
  token) OUTLIER_SCALE times larger, as the K caches of real models have;

it quantizes K and V with :func:`fdlib.quantize_kv`, and measures in float64

* ``cache_rel_err``: ‖K̂ − K‖ / ‖K‖ and the same for V, the larger of the two (Frobenius norms);
* ``out_rel_err``: ‖O(K̂, V̂) − O(K, V)‖ / ‖O(K, V)‖, the attention output over the dequantized cache against the
  output over the unquantized one (q ~ N(0, 1), scale 1/√D, every sequence L keys);
* ``out_max_row_err``: the largest, over (b, h), of max_d |ΔO| / max_d |O| (the tests' per-row measure).

    python tools/quant_error.py        # writes results/cpu/quant-error.json and .md

This is CPU arithmetic on random data, not a GPU measurement: it says how far an 8-bit cache moves the output, not how
fast it is.
"""
from __future__ import annotations

import datetime as _dt
import json
import math
import os
import platform
import subprocess
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from fdlib import quant  # noqa: E402
from fdlib.reference import reference_attention  # noqa: E402

SETTINGS = dict(B=4, L=1024, H_q=32, H_kv=8, D=128, seed=0)
OUTLIER_CHANNELS, OUTLIER_SCALE = 4, 20.0
DATA = ("N(0,1)", "outlier channels")
DTYPES = {"float8_e4m3fn": torch.float8_e4m3fn, "int8": torch.int8}


def make(data: str, B: int, L: int, H_q: int, H_kv: int, D: int, seed: int):
    """q [B, H_q, D], K and V [B, L, H_kv, D] in float32 (``data``: see the module doc)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H_q, D, generator=g)
    k = torch.randn(B, L, H_kv, D, generator=g)
    v = torch.randn(B, L, H_kv, D, generator=g)
    if data == "outlier channels":
        channels = torch.randperm(D, generator=g)[:OUTLIER_CHANNELS]
        k[..., channels] *= OUTLIER_SCALE
        v[..., channels] *= OUTLIER_SCALE
    elif data != "N(0,1)":
        raise ValueError(f"data: expected one of {DATA}, got {data!r}")
    return q, k, v


def quantize(x, dtype, granularity):
    """:func:`fdlib.quantize_kv`, or ``"unit"``: scale 1, x clamped to ±448 and cast (e4m3 only)."""
    if granularity == "unit":
        return x.clamp(-quant.QMAX[dtype], quant.QMAX[dtype]).to(dtype), 1.0
    return quant.quantize_kv(x, dtype, granularity)


def measure(data: str, dtype, granularity: str, B: int, L: int, H_q: int, H_kv: int, D: int, seed: int) -> dict:
    """One row of the table (see the module doc)."""
    q, k, v = make(data, B, L, H_q, H_kv, D, seed)
    kd, vd = (quant.dequantize_kv(*quantize(x, dtype, granularity), torch.float64) for x in (k, v))
    k64, v64 = k.double(), v.double()
    cache_err = max(float((kd - k64).norm() / k64.norm()), float((vd - v64).norm() / v64.norm()))
    o_ref = reference_attention(q, k64, v64)[0]
    o = reference_attention(q, kd, vd)[0]
    row_err = (o - o_ref).abs().amax(-1) / o_ref.abs().amax(-1)
    return {"cache_rel_err": cache_err, "out_rel_err": float((o - o_ref).norm() / o_ref.norm()),
            "out_max_row_err": float(row_err.max())}


def rows(settings=SETTINGS):
    out = []
    for data in DATA:
        for name, dtype in DTYPES.items():
            for gran in (("unit",) if dtype == torch.float8_e4m3fn else ()) + quant.GRANULARITIES:
                out.append(dict(data=data, dtype=name, granularity=gran, **measure(data, dtype, gran, **settings)))
    return out


def provenance(command: str) -> dict:
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                                timeout=10).stdout.strip() or None
        dirty = bool(subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                                    capture_output=True, text=True, timeout=10).stdout.strip()) if commit else None
    except Exception:  # noqa: BLE001 - no git
        commit, dirty = None, None
    return {"device": "cpu", "arithmetic": "float64 on the CPU (no GPU, no kernel)", "torch": torch.__version__,
            "python": platform.python_version(), "git_commit": commit, "git_dirty": dirty,
            "date_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"), "command": command}


def markdown(res: dict) -> str:
    s = res["settings"]
    lines = ["# 8-bit KV caches: error against the unquantized cache (CPU, float64)", "",
             f"CPU float64 arithmetic, not a GPU measurement. `{res['provenance']['command']}` at commit "
             f"{res['provenance']['git_commit']}. B={s['B']}, L={s['L']}, {s['H_q']}:{s['H_kv']} heads, D={s['D']}, "
             f"seed {s['seed']}; q, K, V ~ N(0, 1); outlier channels: {res['outliers']['channels']} of D channels "
             f"{res['outliers']['scale']:g}x larger in K and V. Granularity `unit`: e4m3 with scale 1 (values clamped "
             f"to ±448). Errors are relative: cache ‖K̂−K‖/‖K‖ (the larger of K's and V's), output ‖Ô−O‖/‖O‖, and "
             f"the largest per-row max|ΔO|/max|O| over (b, h).", "",
             "| data | dtype | scales per | cache error | output error | worst row |", "|---|---|---|---|---|---|"]
    for r in res["rows"]:
        lines.append(f"| {r['data']} | {r['dtype']} | {r['granularity']} | {100 * r['cache_rel_err']:.2f}% | "
                     f"{100 * r['out_rel_err']:.2f}% | {100 * r['out_max_row_err']:.2f}% |")
    return "\n".join(lines) + "\n"


def main() -> int:
    command = "python tools/quant_error.py"
    res = {"schema": "fdlib.quant-error/1", "kind": "cpu-math", "provenance": provenance(command),
           "settings": SETTINGS, "outliers": {"channels": OUTLIER_CHANNELS, "scale": OUTLIER_SCALE},
           "rows": rows()}
    out = os.path.join(ROOT, "results", "cpu")
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "quant-error.json"), "w") as f:
        json.dump(res, f, indent=1)
        f.write("\n")
    with open(os.path.join(out, "quant-error.md"), "w") as f:
        f.write(markdown(res))
    print(markdown(res))
    assert all(math.isfinite(r["out_rel_err"]) for r in res["rows"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
