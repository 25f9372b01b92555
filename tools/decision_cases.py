"""What :mod:`decision_table` (the chooser's decisions, no GPU) and :mod:`ab_constants` (a chooser constant's A/B on
a GPU) share: the batches they go through (every benchmark's grid, one tuple a batch) and a chooser constant set to
another value. Importing it sets nothing: the GPU and the interpreter both use it."""
from __future__ import annotations

import ast
import sys

import torch

from fdlib.bench import harness, qlen, ragged, serving


def paged_cap(lens, page: int) -> int:
    """L_max of a batch's table: its longest row's pages (as the ragged bench builds it), or the longest row."""
    return max(max(-(-L // page) for L in lens), 1) * page if page else max(max(lens), 1)


def cases():
    """(label, B, H_q, H_kv, D, dtype, lengths, page, q_len, kv) of every case, lengths host ints."""
    g = harness.DEFAULT_GRID
    for dt in g["dtypes"]:
        for (hq, hk) in g["heads"]:
            for B in g["B"]:
                for L in g["L"]:
                    for page in (0, 16):
                        yield f"dense {dt} B={B} {hq}:{hk} L={L}", B, hq, hk, 128, dt, [L] * B, page, 1, None
    g = harness.HEADS_SWEEP
    for D in g["D"]:
        for (hq, hk) in g["heads"]:
            for B in g["B"]:
                for L in g["L"]:
                    for page in (0, 16):
                        yield f"heads D={D} B={B} {hq}:{hk} L={L}", B, hq, hk, D, "float16", [L] * B, page, 1, None
    g = qlen.QLEN_GRID
    for B, L in g["shapes"]:
        for k in g["qlens"]:
            for page in (0, 16):
                yield f"qlen B={B} 32:8 L={L} q_len={k}", B, 32, 8, 128, "float16", [L] * B, page, k, None
    g = ragged.RAGGED_GRID
    shapes = [(dt, b, hq, hk, d, m, dist) for dt in g["dtypes"] for (hq, hk) in g["heads"] for d in g["D"]
              for b in g["B"] for m in g["means"] for dist in g["dists"]]
    for i, (dt, B, hq, hk, D, m, dist) in enumerate(shapes):
        lens = ragged.draw_lengths(dist, B, m, i)
        for page in (0, 16):
            yield f"ragged {dt} B={B} {hq}:{hk} {dist}:{m} seed={i}", B, hq, hk, D, dt, lens, page, 1, None
    for text in ab_ragged_cases():
        for i, case in enumerate(text.split(",")):
            shape, page = ragged.parse_case(case)
            lens = ragged.case_lengths(shape["dist"], shape["B"], shape["mean"], i)
            yield (f"ab {case} seed={i}", shape["B"], shape["H_q"], shape["H_kv"], 128, "float16", lens, page, 1,
                   None)
    for i, (name, B, hq, hk, law) in enumerate(serving.CASES):
        lens = serving.draw_case_lengths(law, B, i)
        for page in (0, 16):
            yield f"serving {name}", B, hq, hk, 128, "bfloat16", lens, page, 1, None
            for kv in ((torch.float8_e4m3fn, "tensor", "tensor"), (torch.float8_e4m3fn, "head", "head"),
                       (torch.int8, "token", "token")):
                yield (f"serving {name} kv={str(kv[0])[6:]}/{kv[1]}", B, hq, hk, 128, "bfloat16", lens, page, 1, kv)


def ab_ragged_cases() -> list[str]:
    """The --cases of tools/ab_ragged.py runs: its default, gpu_common.sh's kernel grid, the persistent grid, the
    device-lengths grids."""
    kernel_grid = ",".join(f"{c}:{page}" for page in (0, 16) for c in (
        "8:32:8:constant:1024 8:32:8:uniform:8192 8:32:8:zipf:32768 32:32:8:constant:8192 32:32:8:uniform:1024 "
        "32:32:8:zipf:8192 32:32:8:uniform:32768 128:32:8:constant:1024 128:32:8:zipf:1024 128:32:8:uniform:8192 "
        "32:32:32:zipf:1024 32:32:32:constant:8192").split())
    lmax = ",".join(f"{B}:32:{hk}:{dist}:{mean}:{page}" for page in (0, 16) for B in (8, 32, 128) for hk in (8, 32)
                    for dist in ("constant", "uniform", "zipf") for mean in (1024, 8192))
    return [
        "128:32:8:uniform:1024:16,32:32:8:uniform:8192:16,128:32:32:constant:1024:16,128:32:8:constant:1024:0",
        kernel_grid,
        "64:32:8:constant:512:0,128:32:8:constant:512:0,256:32:8:constant:1024:0,64:32:32:constant:2048:0,"
        "128:32:32:constant:1024:0,64:32:8:constant:4096:0",
        "32:32:8:uniform:16384:16,8:32:8:onelong:131072:16,128:32:8:zipf:2048:16,256:32:8:uniform:1024:16,"
        "1:32:8:constant:131072:16,48:64:8:uniform:8192:16,32:32:8:uniform:16384:0,8:32:8:onelong:131072:0,"
        "32:32:8:constant:8192:0,1:32:8:constant:8192:0",
        lmax,
    ]


def parse_set(text: str) -> tuple[str, object]:
    """(NAME, VALUE) of ``NAME=VALUE``, VALUE a Python literal."""
    name, eq, value = text.partition("=")
    if not eq or not name.isidentifier():
        raise SystemExit(f"--set: expected NAME=VALUE (e.g. TWO_STAGE_SPLITS=1000000), got {text!r}")
    try:
        return name, ast.literal_eval(value)
    except (ValueError, SyntaxError):
        raise SystemExit(f"--set {name}: expected a Python literal after '=', got {value!r}") from None


def holders(name: str) -> list:
    """Every fdlib module holding ``name`` (a module that imported it by name holds its own copy)."""
    mods = [m for k, m in list(sys.modules.items()) if k.startswith("fdlib") and hasattr(m, name)]
    if not mods:
        raise SystemExit(f"--set: no fdlib module has {name}")
    return mods


class constant:
    """``with constant(NAME, VALUE):`` NAME at VALUE in every fdlib module holding it, restored on the way out."""

    def __init__(self, name, value):
        self.mods, self.name, self.value = holders(name), name, value
        self.kept = [getattr(m, name) for m in self.mods]

    def __enter__(self):
        for m in self.mods:
            setattr(m, self.name, self.value)
        _forget()

    def __exit__(self, *exc):
        for m, v in zip(self.mods, self.kept):
            setattr(m, self.name, v)
        _forget()


def _forget() -> None:
    """Drop what was worked out under one setting: the cost model's cached explanations and the remembered
    plans and calls (no plan made under one setting serves the other)."""
    from fdlib import api, costmodel
    costmodel._explain.cache_clear()
    api.clear_plans()
