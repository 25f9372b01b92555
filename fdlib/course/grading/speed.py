r"""``./course grade --speed``: how fast the learner's kernels run on a GPU, next to fdlib's own.

Three pipelines, each with one piece of the learner's (one that passes all its checks) and the rest fdlib's:

* stage 1 with the learner's ``lab03.tile_update``, then fdlib's stage 2;
* fdlib's stage 1, then the learner's ``lab04.stage2_kernel``;
* the unified kernel with the learner's ``lab05.take_ticket``.

Each runs on one fixed decode shape, :data:`SHAPE` (B=1, H_q=32, H_kv=8, L=131072, D=128, fp16: the course's
running example, a 512 MiB KV cache, far larger than the L2), with the split count fdlib chooses for it. The
learner's result must match fdlib's (output tolerance of the checks) before it is timed. Times are medians
of ``triton.testing.do_bench`` with the L2 flushed before each run (:func:`fdlib.bench.timing.time_eager`);
the speed is the effective bandwidth, KV bytes / time, shown as a fraction of the read ceiling measured in the
same run (:func:`fdlib.bench.ceiling.measure_ceiling`), as ``python -m fdlib.bench`` reports it.

Without a CUDA GPU nothing is timed: the Triton interpreter's times say nothing about a GPU.
:func:`measure` takes the timer and the ceiling as arguments, so everything but the timing itself is tested on
the CPU (``tests/test_grade_command.py``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

from fdlib import runtime
from fdlib.bench.ceiling import measure_ceiling
from fdlib.bench.timing import free_memory, time_eager
from fdlib.kernels.config import chunk_for, tile_config
from fdlib.kernels.stage1 import run_stage1
from fdlib.kernels.stage2 import run_stage2
from fdlib.kernels.unified import run_unified
from fdlib.splits import choose_splits

from .core import TOL, CheckFailure, assert_close

TILE, STAGE2, TICKET = "lab03.tile_update", "lab04.stage2_kernel", "lab05.take_ticket"


@dataclass(frozen=True)
class Shape:
    B: int
    H_q: int
    H_kv: int
    L: int
    D: int
    dtype: torch.dtype = torch.float16

    @property
    def kv_bytes(self) -> int:
        """Bytes of K and V the kernels read: 2·B·L·H_kv·D·elem."""
        return 2 * self.B * self.L * self.H_kv * self.D * self.dtype.itemsize

    def __str__(self) -> str:
        return (f"B={self.B}, H_q={self.H_q}, H_kv={self.H_kv}, L={self.L}, D={self.D}, "
                f"{str(self.dtype).removeprefix('torch.')}")


SHAPE = Shape(B=1, H_q=32, H_kv=8, L=131072, D=128)


@dataclass
class Timing:
    label: str
    exercise: str
    yours_us: float | None = None
    fdlib_us: float | None = None
    note: str = ""            # why "yours" was not timed


@dataclass
class Problem:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    lens: torch.Tensor
    scale: float
    chunk: int
    splits: int
    cfg: object


def problem(shape: Shape, device, seed: int = 0) -> Problem:
    """Seeded inputs of ``shape`` on ``device``, with the split count and tiles fdlib would use."""
    g = torch.Generator(device=device).manual_seed(seed)      # drawn where they live: 512 MiB of KV on a GPU
    s = shape
    q, k, v = (torch.randn(*dims, generator=g, device=device, dtype=s.dtype)
               for dims in ((s.B, s.H_q, s.D), (s.B, s.L, s.H_kv, s.D), (s.B, s.L, s.H_kv, s.D)))
    lens = torch.full((s.B,), s.L, dtype=torch.int32, device=device)
    cfg = tile_config(s.D, s.L, s.dtype.itemsize, rows=s.B * s.H_kv)
    chunk, splits = chunk_for(s.L, choose_splits(s.B, s.H_q, s.H_kv, s.D, s.dtype, s.L), cfg.BLOCK_N)
    return Problem(q, k, v, lens, 1.0 / math.sqrt(s.D), chunk, splits, cfg)


def pipelines(p: Problem) -> list[tuple[str, str, Callable[[Callable | None], Callable[[], tuple]]]]:
    """(label, exercise, make) per pipeline: ``make(piece)`` is a zero-argument launch returning (out, lse), with
    the learner's ``piece`` in it (None: fdlib's own)."""
    out = torch.empty_like(p.q)
    lse = torch.empty(p.q.shape[:2], dtype=torch.float32, device=p.q.device)

    def split(tile=None, stage2=None):
        def run():
            o_part, lse_part = run_stage1(p.q, p.k, p.v, p.lens, scale=p.scale, chunk=p.chunk, splits=p.splits,
                                          cfg=p.cfg, tile_update_fn=tile)
            run_stage2(o_part, lse_part, out, lse, kernel=stage2)
            return out, lse
        return run

    def unified(ticket=None):
        def run():
            run_unified(p.q, p.k, p.v, p.lens, scale=p.scale, chunk=p.chunk, splits=p.splits, cfg=p.cfg, out=out,
                        lse=lse, ticket_fn=ticket)
            return out, lse
        return run

    return [("stage 1 with your tile_update, then fdlib's stage 2", TILE, lambda f: split(tile=f)),
            ("fdlib's stage 1, then your stage-2 kernel", STAGE2, lambda f: split(stage2=f)),
            ("the unified kernel with your take_ticket", TICKET, lambda f: unified(ticket=f))]


def measure(learner: dict, shape: Shape, device, timer: Callable[[Callable], float]) -> tuple[Problem, list[Timing]]:
    """Time each pipeline with fdlib's piece and, where ``learner`` has a passing one, with the learner's.
    ``timer(fn)`` returns µs. The learner's version must give fdlib's result first."""
    p = problem(shape, device)
    atol, rtol = TOL[shape.dtype]
    rows = []
    for label, name, make in pipelines(p):
        row = Timing(label, name)
        out, lse = make(None)()
        ref_out, ref_lse = out.clone(), lse.clone()
        row.fdlib_us = timer(make(None))
        out.fill_(float("nan")), lse.fill_(float("nan"))     # the learner's run must write them itself
        mine = learner.get(name)
        if mine is None:
            row.note = f"{name} is not timed: it does not pass all its checks yet"
        else:
            try:
                run = make(mine)
                got_out, got_lse = (t.clone() for t in run())
                assert_close(got_out, ref_out, "out", atol, rtol)
                assert_close(got_lse, ref_lse, "lse", 1e-3, 1e-5)
                row.yours_us = timer(run)
            except CheckFailure as e:
                row.note = f"{name} is not timed: on this shape its result differs from fdlib's: {e}"
            except Exception as e:  # noqa: BLE001 - the learner's kernel failed to compile or launch here
                row.note = f"{name} is not timed: it raised {type(e).__name__}: {' '.join(str(e).split())[:300]}"
        rows.append(row)
    return p, rows


def table(shape: Shape, p: Problem, rows: list[Timing], ceiling_tbs: float, device_name: str) -> list[str]:
    """The speed lines: µs, effective TB/s (KV bytes / time) and % of the read ceiling, yours and fdlib's."""
    def cell(us):
        if us is None:
            return f"{'-':>29s}"
        tbs = shape.kv_bytes / us / 1e6
        share = f"{tbs / ceiling_tbs:5.0%}" if ceiling_tbs else "    ?"
        return f"{us:9.1f} µs {tbs:5.2f} TB/s {share}"
    lines = [f"Speed on {device_name}: {shape}, {p.splits} splits of {p.chunk} keys; KV cache "
             f"{shape.kv_bytes / 2**20:.0f} MiB; read ceiling "
             + (f"{ceiling_tbs:.2f} TB/s (measured now)" if ceiling_tbs else "not measured (every tile failed)"),
             f"  {'':52s} {'yours':>29s}   {'fdlib':>29s}"]
    for r in rows:
        lines.append(f"  {r.label:52s} {cell(r.yours_us)}   {cell(r.fdlib_us)}")
    lines += [f"    {r.note}" for r in rows if r.note]
    lines.append("  (median of do_bench with the L2 flushed before each run; TB/s = KV bytes / time)")
    return lines


def report_lines(learner: dict) -> list[str]:
    """The ``--speed`` section: timed on a CUDA GPU, a one-line skip anywhere else."""
    if runtime.MODE != "gpu" or not torch.cuda.is_available():
        return ["Speed: skipped: no CUDA GPU here (kernels run in Triton's interpreter, whose times say nothing "
                "about a GPU). Run ./course grade --speed on a machine with an NVIDIA GPU."]
    ceiling = measure_ceiling()["tbs"]
    p, rows = measure(learner, SHAPE, runtime.DEVICE, time_eager)
    del p.k, p.v
    free_memory()
    return table(SHAPE, p, rows, ceiling, torch.cuda.get_device_name())
