"""Build notebooks 03-04 from this script, execute them, and store their outputs.

    python notebooks/build/make_labs_03_04.py            # build + execute (under a minute each on a laptop CPU)
    python notebooks/build/make_labs_03_04.py --no-run   # build only, without outputs

Same conventions as ``make_labs_00_02.py`` (whose cell helpers this script uses): cells tagged ``machine`` are
executed but their outputs cleared; exercise cells keep their stub in metadata ``fdlib.stub``. The stubs are the
graders' own (``fdlib.grading.lab03.STUB``, ``lab04.STUB``), so the grader recognises an untouched one.
"""
from __future__ import annotations

import sys
from pathlib import Path
from textwrap import dedent


HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parents[1]))

from make_labs_00_02 import (  # noqa: E402
    PLOT_SETUP, code, describe_cell, exercise, md, questions,
)
from make_labs_00_02 import main as build_main  # noqa: E402

IMPORTS = dedent("""
import math
import torch
import triton
import triton.language as tl
import fdlib
from fdlib import runtime
from fdlib.grading import *
""") + PLOT_SETUP

RECORDED = """
import json
from pathlib import Path
RESULTS = Path(fdlib.__file__).resolve().parent.parent / "results" / "h200"

def provenance(data):
    p = data["provenance"]
    return f"recorded on {p['device']}, {p['date_utc'][:10]}, `{p['command'].split(' --out')[0]}`"
"""


def recorded_code(src):
    """A code cell that first defines RESULTS (results/h200) and provenance(data)."""
    return code(RECORDED.strip("\n") + "\n\n" + dedent(src).strip("\n"))


def _stub(module) -> str:
    return module.STUB.strip("\n")


# ================================================================================================ 03 split-KV
def lab03():
    from fdlib.grading import lab03 as grader
    cells = [
        md("""
        # 03 · The split-KV kernel (stage 1, in Triton)

        Lab 01 ended with a problem: one decode step has one query token per sequence and head, so a kernel with
        one program per (sequence, KV head) launches only B × H_kv programs. With B = 1 and H_kv = 8, that is 8
        programs for 132 SMs. Lab 02 gave the way out: attention over any slice of the keys is summarised exactly by
        a small state, and states merge.

        **Flash-Decoding** cuts each sequence's KV cache into `splits` slices of `chunk` keys:

        * the grid is **B × H_kv × splits**; program (b, h_kv, i) handles keys [i·chunk, min((i+1)·chunk, L_b)) of
          sequence b for the `group` query heads of KV head h_kv (GQA: each K/V tile is loaded once for all of them);
        * each program streams its slice through on-chip memory (SRAM), one tile of BLOCK_N keys at a time,
          keeping the running state (m, ℓ, Õ) of Lab 02 in registers: that is the **tile update** you write here;
        * at the end it writes its split's partial result **(O_i = Õ/ℓ, lse_i = m + log ℓ)** to global memory.
          A split that starts past the sequence's end writes the empty result (O_i = 0, lse_i = −∞).

        Lab 04 writes stage 2, which merges the partials of each (b, h). `chunk` is a multiple of BLOCK_N
        (`fdlib.kernels.config.chunk_for`), so only a sequence's last tile is partial.
        """),
        describe_cell(),
        code(IMPORTS),
        md("""
        ## How the sequence is cut

        A ragged batch of three sequences (lengths 200, 130 and 40) in 4 splits of 64 keys (4 tiles of 16 keys each,
        the interpreter's BLOCK_N). Each colour is one split, i.e. one program per KV head. Sequence 1 ends inside
        split 2 (its last tile is partial: the tail mask) and leaves split 3 empty; sequence 2 leaves three splits
        empty. Empty programs still run: they write lse = −∞, which stage 2 weighs by e^(−∞) = 0.
        """),
        code("""
        from fdlib.kernels.config import chunk_for
        lengths, BLOCK_N, want_splits = [200, 130, 40], 16, 4
        chunk, splits = chunk_for(max(lengths), want_splits, BLOCK_N)
        L_max = max(lengths)
        colors = plt.cm.tab10.colors
        fig, ax = plt.subplots(figsize=(8, 3.2))
        for b, L in enumerate(lengths):
            for i in range(splits):
                a, e = i * chunk, min((i + 1) * chunk, L_max)
                used = max(0, min(e, L) - a)
                if used:
                    ax.barh(b, used, left=a, height=0.6, color=colors[i], edgecolor="black", lw=0.6)
                    if used >= 24:
                        ax.text(a + used / 2, b, f"({b}, h, {i})", ha="center", va="center", fontsize=8)
                if used < e - a:    # keys past the end: masked (in the partial tile) or an empty split
                    ax.barh(b, e - a - used, left=a + used, height=0.6, color="white", edgecolor=colors[i],
                            hatch="///", lw=0.6)
                    if not used and e - a >= 32:
                        ax.text((a + e) / 2, b, "empty: lse=−∞", ha="center", va="center", fontsize=7, color="0.3")
            ax.plot([L, L], [b - 0.4, b + 0.4], color="red", lw=2)
        for x in range(0, L_max + 1, BLOCK_N):
            ax.axvline(x, color="0.5", lw=0.4, ls=":", zorder=0)
        for i in range(splits + 1):
            ax.axvline(min(i * chunk, L_max), color="black", lw=1.2, zorder=0)
        ax.set_yticks(range(len(lengths)), [f"b={b}, L={L}" for b, L in enumerate(lengths)])
        ax.invert_yaxis()
        ax.set_xlabel(f"key position (tokens); dotted: {BLOCK_N}-key tiles, solid: split boundaries")
        ax.set_ylabel("sequence")
        ax.set_title(f"{splits} splits of {chunk} keys: program (b, h_kv, split) per box; red: sequence end "
                     "- schematic, no device", fontsize=10)
        plt.tight_layout()
        plt.show()
        print(f"chunk = {chunk} keys, splits = {splits}, programs = B × H_kv × splits = 3 × H_kv × {splits}")
        """),
        md("""
        ## Exercise: `lab03.tile_update`

        Inside the stage-1 kernel (`fdlib.kernels.stage1`), each program loops over its slice one tile at a time
        and calls a `@triton.jit` function with the state so far:

        ```python
        for n0 in range(start, end, BLOCK_N):
            pos = n0 + tl.arange(0, BLOCK_N)
            valid = pos < end                              # the tail mask
            k = tl.load(..., mask=valid[:, None] & ..., other=0.0)
            v = tl.load(..., mask=valid[:, None] & ..., other=0.0)
            m, l, acc = TILE_UPDATE(q, k, v, valid, m, l, acc, qk_scale, FP32_DOT)
        ```

        Write that function: Lab 02's online-softmax step on a [G, N] tile of scores. Two differences from Lab 02:

        * **base 2**: `qk_scale` = scale · log₂e, so 2^(qk_scale · q·k) = e^(scale · q·k). The kernels keep m in
          base-2 units and use `tl.exp2`, one hardware instruction (the `lse` written afterwards is converted back
          to natural log: (m + log₂ ℓ) · ln 2);
        * **masking**: keys past the split's end were loaded as zeros; their score must be −∞ (`tl.where`), or
          they would count as score 0.

        `tl.dot(a, b)` is the matrix product of two blocks (at least 16 × 16 on a GPU: the group is padded to 16
        rows); `tl.trans(k)` transposes, `tl.max(x, 1)` / `tl.sum(x, 1)` reduce along a row, and `x[:, None]`
        broadcasts. The check runs fdlib's real stage-1 kernel with **your** function inside, then stage 2, and
        compares with the float64 reference; in the interpreter a `print` inside works for debugging.
        """),
        exercise("lab03.tile_update", _stub(grader)),
        code('check("lab03.tile_update")'),
        md("""
        <details><summary>Hint 1: the scores</summary>

        `s = tl.dot(q, tl.trans(k))` gives [G, N]; for FP32_DOT use
        `tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")`. Then
        `s = tl.where(valid[None, :], s * qk_scale, float("-inf"))`.
        </details>

        <details><summary>Hint 2: the update</summary>

        `m_new = tl.maximum(m, tl.max(s, 1))`; `m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)`;
        `alpha = tl.exp2(m - m_ref)`; `p = tl.exp2(s - m_ref[:, None])`; `l = l * alpha + tl.sum(p, 1)`;
        `acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)` (with FP32_DOT: `tl.dot(p, v.to(tl.float32),
        input_precision="ieee")`). Return `m_new, l, acc`.
        </details>

        Still stuck? `show_solution("lab03.tile_update")` prints the reference solution.
        """),
        md("""
        ## Your tile update inside the real kernel

        `run_stage1` launches the grid (B, H_kv, splits) and returns the partials; `tile_update_fn=` injects the tile
        update (yours if it passed, else the reference). The short sequence's splits past its end come back empty.
        """),
        code('tile_update_fn = use("lab03.tile_update")'),
        code("""
        from fdlib.kernels.config import tile_config
        from fdlib.kernels.stage1 import run_stage1
        from fdlib.kernels.stage2 import run_stage2
        dev = runtime.DEVICE
        gen = torch.Generator().manual_seed(0)
        B, H_q, H_kv, D = 3, 8, 2, 64
        lengths = [200, 130, 40]
        q = torch.randn(B, H_q, D, generator=gen).to(dev)
        k_cache = torch.randn(B, max(lengths), H_kv, D, generator=gen).to(dev)
        v_cache = torch.randn(B, max(lengths), H_kv, D, generator=gen).to(dev)
        lens = torch.tensor(lengths, dtype=torch.int32, device=dev)
        cfg = tile_config(D, max(lengths), q.element_size())
        chunk, splits = chunk_for(max(lengths), 4, cfg.BLOCK_N)
        o_part, lse_part = run_stage1(q, k_cache, v_cache, lens, D ** -0.5, chunk, splits, cfg,
                                      tile_update_fn=tile_update_fn)
        print("O_part", tuple(o_part.shape), "| lse_part", tuple(lse_part.shape))
        print("splits with lse = -inf (empty), per sequence:",
              [[i for i in range(splits) if lse_part[b, 0, i] == float("-inf")] for b in range(B)])
        out = torch.empty(B, H_q, D, device=dev)
        lse = torch.empty(B, H_q, device=dev)
        run_stage2(o_part, lse_part, out, lse)
        ref_out, ref_lse = fdlib.reference_attention(q, k_cache, v_cache, lens)
        print("stage 1 + stage 2 match the float64 reference:",
              torch.allclose(out.cpu().double(), ref_out, atol=1e-4), torch.allclose(lse.cpu().double(), ref_lse, atol=1e-4))
        """, checked=True),
        md("""
        The same kernels behind the public entry point: `fdlib.decode_attention(method="split", num_splits=...)`
        runs stage 1 and stage 2 (with fdlib's own tile update). Any split count gives the same result up to rounding:
        """),
        code("""
        q16, k16, v16 = (t.half() for t in (q, k_cache, v_cache))
        ref_out, _ = fdlib.reference_attention(q16, k16, v16, lens)
        for s in (1, 2, 4, 8, 13):
            o = fdlib.decode_attention(q16, k16, v16, lens, method="split", num_splits=s)
            err = (o.cpu().double() - ref_out).abs().max().item()
            print(f"num_splits={s:2d}: max |out - reference| < 2e-3: {err < 2e-3}")
        """, checked=True),
        md("""
        ## Occupancy: splits → programs → waves over the SMs

        With one split, a long-context decode step on an H200 (B = 1, H_q = 32, H_kv = 8, L = 128 Ki tokens) launches
        8 programs: 8 SMs stream the whole cache while 124 idle. With 16 splits, 128 programs fill 128 of 132 SMs in
        one wave. The numbers come from `fdlib.explorer.summary` (an occupancy model of an H200; no GPU needed):
        """),
        code("""
        from fdlib import explorer
        for s in (1, 16):
            summ = explorer.summary(B=1, H_q=32, H_kv=8, L=131072, splits=s, gpu="H200", unified=False)
            print(f"{s:2d} split(s): {summ.programs:3d} stage-1 programs, {summ.waves} wave, "
                  f"busy SMs: {summ.busy_text()}, SM utilization {summ.utilization:.1%}")
        """, checked=True),
        md("""
        Move the **splits** slider (and batch, heads, length) in the explorer below. The top row shows the SMs of
        the first waves and the tail wave; the bottom plot shows the predicted time per decode step against splits,
        with the cost model's choice (Lab 05) and, where they exist, recorded H200 measurements. More splits than
        SMs can hold start a second **wave**: the slowest wave sets the time, and a small tail wave wastes most of
        the GPU. (Without ipywidgets, use `explorer.draw(...)`, which returns the same picture.)
        """),
        code("""
        explorer.explorer(B=1, H_q=32, H_kv=8, L=131072, splits=1, unified=False)
        """, tags=["machine"]),
        md("""
        ## Measured: time against splits

        On a GPU the next cell times the two-stage kernel of this lab and the next (`fdlib.decode_attention(method=
        "split")`, bfloat16) at several split counts with `explorer.measure` (eager `triton.testing.do_bench`, L2
        flushed between runs). Without one it plots the sweep recorded on an H200 by the course's benchmark command
        (`python -m fdlib.bench --sweep-splits`: the unified kernel of Lab 05, fp16, CUDA-graph timings), with its
        provenance. Both kernels run the same stage-1 programs, so the shape of the curve is the same.
        """),
        recorded_code("""
        sweep = json.loads((RESULTS / "sweep-fp16.json").read_text())
        shapes = [(1, 32, 8, 8192), (1, 32, 8, 32768), (1, 32, 8, 131072)]
        fig, ax = plt.subplots()
        if runtime.MODE == "gpu":
            name = torch.cuda.get_device_name()
            for B_, Hq_, Hkv_, L_ in shapes:
                pts = explorer.measure(B_, Hq_, Hkv_, L_, [1, 2, 4, 8, 16, 32, 64, 128], unified=False)
                ax.plot(*zip(*pts), "o-", label=f"B={B_}, L={L_}")
            ax.set_title(f"Two-stage kernel, time vs splits - live on {name}, eager (do_bench)", fontsize=10)
            dtype_name = "bf16"
        else:
            for row in sweep["sweep"]:
                if (row["B"], row["H_q"], row["H_kv"], row["L"]) in shapes:
                    pts = [(p["splits"], p["us"]) for p in row["points"] if p["status"] == "ok"]
                    ax.plot(*zip(*pts), "o-", label=f"B={row['B']}, L={row['L']}")
                    best = row["best"]
                    ax.plot(best["splits"], best["us"], "k*", ms=12)
            ax.set_title(f"Unified kernel, time vs splits (★ best) - recorded on {sweep['provenance']['device']} "
                         f"{sweep['provenance']['date_utc'][:10]}, CUDA-graph timings", fontsize=10)
            print(provenance(sweep).replace("`", ""))
            dtype_name = "fp16"
        ax.set_xscale("log", base=2); ax.set_yscale("log")
        ax.set_xlabel("splits (KV sequence cut into this many slices)")
        ax.set_ylabel("time per decode step (µs)")
        ax.legend(title=f"H_q=32, H_kv=8, D=128, {dtype_name}", fontsize=8)
        ax.grid(True, which="both", alpha=0.3)
        plt.tight_layout()
        plt.show()
        """),
        md("""
        From 1 to 8 splits every doubling roughly halves the time: 8, 16, 32, 64 programs, and the SMs that were
        idle now stream their share of the cache. Around 16 splits (128 programs, one per SM) the GPU is full and
        the curve flattens: the best count sits there. Past it, more splits only add waves, partial results and merge
        work, and the time creeps back up; a split count that leaves a partly empty second wave (e.g. 24 splits:
        192 programs on 132 SMs) can even be slower than a larger one that fills it. Lab 04 looks at that cost.
        """),
    ]
    cells += questions([
        ("Why does one decode step with B = 1 and H_kv = 8 leave an H200 mostly idle without splits?",
         """The grid has B × H_kv = 8 programs and one program runs on one SM, so 8 of 132 SMs stream the whole KV
         cache while 124 do nothing. Decode is memory-bound, and 8 SMs cannot pull more than a small fraction of the
         HBM bandwidth."""),
        ("What does a stage-1 program write, and why is that enough to get the exact result later?",
         """Its split's partial (O_i = Õ/ℓ, lse_i = m + log ℓ) for each query head of its group. Together these are
         the state of Lab 02 (m and ℓ are folded into lse), and states merge exactly: stage 2 recovers the softmax
         over all keys with weights e^(lse_i − lse)."""),
        ("Why must masked keys get the score −∞ rather than being loaded as zeros and left alone?",
         """A zero key gives the score 0, which counts as a real key with weight 2^(0 − m): it would add to ℓ and,
         since its V was loaded as 0 too, pull the output toward 0 (it could even raise m if all real scores are
         negative). −∞ gives weight 2^(−∞) = 0."""),
        ("What happens with more splits than tiles, or splits past a short sequence's end?",
         """fdlib never launches more splits than there are tiles of the longest sequence (chunk_for), but shorter
         sequences of a ragged batch get empty splits. An empty program runs no tile update and writes O = 0,
         lse = −∞, which stage 2 weighs by 0."""),
        ("Why tl.exp2 and a qk_scale that includes log₂ e?",
         """e^x = 2^(x·log₂ e). Folding log₂ e into the scale once lets every exponential be a single exp2 instruction;
         m and ℓ are then in base 2, and lse = (m + log₂ ℓ)·ln 2 converts back to the natural log."""),
    ])
    return cells


# ================================================================================================ 04 reduction
def lab04():
    from fdlib.grading import lab04 as grader
    cells = [
        md("""
        # 04 · The two-stage reduction (stage 2, in Triton)

        Stage 1 leaves, for every sequence b and query head h, `splits` partial results (O_i, lse_i): the normalised
        output and the log-sum-exp of split i. Stage 2 merges them, one program per (b, h) on a grid (B, H_q):

        $$ \\text{lse} = \\log\\sum_i e^{\\text{lse}_i},\\qquad
           O = \\sum_i e^{\\text{lse}_i - \\text{lse}}\\; O_i $$

        This is Lab 02's merge in another form: with lse_i = m_i + log ℓ_i and O_i = Õ_i/ℓ_i, the weight
        e^(lse_i − lse) = ℓ_i e^(m_i) / Σ_j ℓ_j e^(m_j) is split i's share of the softmax denominator. To stay
        stable, subtract the largest lse_i before exponentiating (lse values of 10⁴ are possible), and stream the
        splits in blocks with a running max, exactly like the tile update. Empty splits (lse_i = −∞) weigh
        e^(−∞) = 0; a row whose splits are all empty (a sequence of length 0) gives O = 0 and lse = −∞.
        """),
        describe_cell(),
        code(IMPORTS),
        md("""
        ## Exercise: `lab04.stage2_kernel`

        Write the whole kernel. `fdlib.kernels.stage2.run_stage2(o_part, lse_part, out, lse, kernel=...)` launches it
        on the grid (B, H_q) with the strides of the partials (`O_PART [B, H_q, splits, D]` and
        `LSE_PART [B, H_q, splits]`, float32) and of the outputs, `BLOCK_D` = D rounded up to a power of two (mask
        d < D) and **BLOCK_S = min(next power of two ≥ splits, 8192 / BLOCK_D)**: for D = 128 at most 64, so with
        more than 64 splits one block does not hold them all and the kernel must loop over the splits.
        """),
        exercise("lab04.stage2_kernel", _stub(grader)),
        code('check("lab04.stage2_kernel")'),
        md("""
        <details><summary>Hint 1: loads</summary>

        `offs_s = tl.arange(0, BLOCK_S)`, `offs_d = tl.arange(0, BLOCK_D)`. In the loop
        `for s0 in range(0, n_splits, BLOCK_S)`: `split = s0 + offs_s`, `mask_s = split < n_splits`;
        `lse_i = tl.load(LSE_PART + b*stride_lb + h*stride_lh + split, mask=mask_s, other=float("-inf"))` and
        `o_i = tl.load(O_PART + b*stride_pb + h*stride_ph + split[:, None]*stride_ps + offs_d[None, :],
        mask=mask_s[:, None] & (offs_d < D)[None, :], other=0.0)`.
        </details>

        <details><summary>Hint 2: the running merge</summary>

        Start with `m = float("-inf")`, `den = 0.0`, `acc = tl.zeros([BLOCK_D], dtype=tl.float32)`. Per block:
        `m_new = tl.maximum(m, tl.max(lse_i, 0))`, `m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)`,
        `alpha = tl.exp(m - m_ref)`, `w = tl.exp(lse_i - m_ref)`, `den = den * alpha + tl.sum(w, 0)`,
        `acc = acc * alpha + tl.sum(w[:, None] * o_i, 0)`, `m = m_new`. After the loop: out = acc / den and
        lse = m + log(den), with den = 0 (all empty) giving out = 0 and lse = −inf.
        </details>

        Still stuck? `show_solution("lab04.stage2_kernel")` prints the reference solution.
        """),
        code('stage2 = use("lab04.stage2_kernel")'),
        md("## Stage 1 (fdlib) + your stage 2 on a ragged batch, one sequence empty"),
        code("""
        from fdlib.kernels.config import chunk_for, tile_config
        from fdlib.kernels.stage1 import run_stage1
        from fdlib.kernels.stage2 import run_stage2
        dev = runtime.DEVICE
        gen = torch.Generator().manual_seed(0)
        B, H_q, H_kv, D = 3, 8, 2, 64
        lengths = [150, 0, 37]
        q = torch.randn(B, H_q, D, generator=gen).half().to(dev)
        k_cache = torch.randn(B, max(lengths), H_kv, D, generator=gen).half().to(dev)
        v_cache = torch.randn(B, max(lengths), H_kv, D, generator=gen).half().to(dev)
        lens = torch.tensor(lengths, dtype=torch.int32, device=dev)
        cfg = tile_config(D, max(lengths), 2)
        ref_out, ref_lse = fdlib.reference_attention(q, k_cache, v_cache, lens)
        for want in (1, 3, 10):
            chunk, splits = chunk_for(max(lengths), want, cfg.BLOCK_N)
            o_part, lse_part = run_stage1(q, k_cache, v_cache, lens, D ** -0.5, chunk, splits, cfg)
            out = torch.empty(B, H_q, D, dtype=q.dtype, device=dev)
            lse = torch.empty(B, H_q, device=dev)
            run_stage2(o_part, lse_part, out, lse, kernel=stage2)
            ok = torch.allclose(out.cpu().double(), ref_out, atol=2e-3) and torch.allclose(lse.cpu().double(), ref_lse, atol=1e-4)
            print(f"{splits:2d} splits: matches the reference {ok}; empty sequence: out = 0 {bool((out[1] == 0).all())}, "
                  f"lse = -inf {bool(torch.isinf(lse[1]).all())}")
        """, checked=True),
        md("""
        ## What the reduction costs

        Stage 1 writes B·H_q·splits partials of D + 1 float32 values (O_i and lse_i); stage 2 reads them back. That
        traffic grows linearly with splits, while the KV cache (2·B·H_kv·L·D·2 bytes in fp16) is read once whatever
        the split count:
        """),
        code("""
        def reduction_bytes(B, H_q, splits, D):
            return 2 * B * H_q * splits * (D + 1) * 4          # written by stage 1 + read by stage 2

        def kv_bytes(B, H_kv, L, D, elem=2):
            return 2 * B * H_kv * L * D * elem

        B, H_q, H_kv, D = 1, 32, 8, 128
        for L in (4096, 131072):
            print(f"L = {L}: KV cache {kv_bytes(B, H_kv, L, D) / 2**20:.0f} MiB")
            for s in (1, 16, 64, 256):
                r = reduction_bytes(B, H_q, s, D)
                print(f"   {s:3d} splits: partials {r / 2**20:6.2f} MiB = {r / kv_bytes(B, H_kv, L, D):6.2%} of the KV bytes")
        """, checked=True),
        code("""
        import numpy as np
        splits_axis = np.array([1, 2, 4, 8, 16, 32, 64, 128, 256])
        fig, ax = plt.subplots()
        for L, c in ((4096, "tab:orange"), (32768, "tab:green"), (131072, "tab:blue")):
            ax.axhline(kv_bytes(B, H_kv, L, D) / 2**20, color=c, ls="--", label=f"KV cache, L={L}")
        ax.plot(splits_axis, reduction_bytes(B, H_q, splits_axis, D) / 2**20, "ko-", label="partials (write + read)")
        ax.set_xscale("log", base=2); ax.set_yscale("log")
        ax.set_xlabel("splits")
        ax.set_ylabel("bytes moved per decode step (MiB)")
        ax.set_title("Reduction traffic vs KV traffic, B=1, H_q=32, H_kv=8, D=128, fp16 - analytic", fontsize=10)
        ax.legend(fontsize=8)
        ax.grid(True, which="both", alpha=0.3)
        plt.tight_layout()
        plt.show()
        """),
        md("""
        In bytes the reduction is cheap for long caches (16 splits: 0.1% of a 128 Ki-token cache) and only matters
        for short caches cut very finely (256 splits of a 4 Ki-token cache: half as many bytes as the cache). Its
        other costs are a second kernel launch, whose fixed cost matters when the whole step takes only microseconds
        (CUDA graphs, used in the timings below, shrink but do not remove it), stage 2's serial loop over the splits,
        and stage 1's tail: stage 2 cannot start before the last stage-1 program ends. Here is what an H200
        recorded for one sequence: no split, two-stage (`split`) and the unified kernel of Lab 05 (which merges
        inside the same launch), the last two each at the split count fdlib chose:
        """),
        recorded_code("""
        bench = json.loads((RESULTS / "bench-float16.json").read_text())
        print(provenance(bench).replace("`", ""))
        rows = {}
        for r in bench["records"]:
            if r["B"] == 1 and r["method"] in ("split1", "split", "unified") and r["status"] == "ok":
                rows.setdefault((r["H_q"], r["H_kv"], r["L"]), {})[r["method"]] = r
        print("CUDA-graph µs per decode step, B=1, D=128, fp16")
        print(f"{'H_q:H_kv':>8} {'L':>7} | {'1 split':>8} | {'split (stage 1+2)':>19} | {'unified':>17} | unified/split")
        for (H_q, H_kv, L), m in sorted(rows.items()):
            sp, un = m["split"], m["unified"]
            print(f"{H_q:>5}:{H_kv:<2} {L:7d} | {m['split1']['graph_us']:8.1f} | {sp['graph_us']:7.1f} ({sp['splits']:3d} splits) | "
                  f"{un['graph_us']:5.1f} ({un['splits']:3d} splits) | {un['graph_us'] / sp['graph_us']:.3f}")
        """),
        md("""
        Read the last column: under CUDA-graph replay the second launch costs little, so the two paths are close.
        With 8 KV heads the two-stage path is even a few per cent faster on the shortest caches; with 32 KV heads
        the unified kernel wins at short caches; at long caches, where streaming the cache dominates, the two are
        equal. And both beat the single split, by the widest margin with few KV heads and long caches: the case
        splitting was made for.

        ## The "too many splits" pitfall

        Splitting pays while it fills idle SMs. Past that point each extra split adds work without adding
        bandwidth: more programs than the GPU holds at once (a second, third... **wave**, with a partly empty tail),
        more partials to write and read, more merge work in stage 2, and a fixed start-up cost (load q, set up the
        state) per program. The recorded sweep shows it: time relative to the best split count rises past the best
        on every shape, and steeply for large batches, which already filled the GPU with one split.
        """),
        recorded_code("""
        sweep = json.loads((RESULTS / "sweep-fp16.json").read_text())
        fig, ax = plt.subplots()
        for row in sweep["sweep"]:
            if row["H_kv"] == 8 and (row["B"], row["L"]) in ((1, 32768), (4, 32768), (16, 8192), (64, 2048)):
                pts = [(p["splits"], p["us"] / row["best"]["us"]) for p in row["points"] if p["status"] == "ok"]
                ax.plot(*zip(*pts), "o-", ms=4, label=f"B={row['B']}, L={row['L']} (best {row['best']['splits']})")
        ax.axhline(1, color="black", lw=0.8)
        ax.set_xscale("log", base=2); ax.set_yscale("log")
        ax.set_xlabel("splits")
        ax.set_ylabel("time / best time (ratio)")
        ax.set_title(f"Too many splits: time vs splits, H_q=32, H_kv=8, D=128, fp16, unified kernel\\n"
                     f"recorded on {sweep['provenance']['device']} {sweep['provenance']['date_utc'][:10]}, "
                     "CUDA-graph timings", fontsize=9)
        ax.legend(fontsize=8)
        ax.grid(True, which="both", alpha=0.3)
        ax.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))
        ax.yaxis.set_minor_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}" if v in (2, 3, 5) else ""))
        plt.tight_layout()
        plt.show()
        print(provenance(sweep).replace("`", ""))
        """),
        code("""
        from fdlib import explorer
        for s in (16, 256):
            summ = explorer.summary(B=1, H_q=32, H_kv=8, L=32768, splits=s, gpu="H200", unified=False)
            print("\\n".join(summ.lines()[2:6]), end="\\n\\n")
        """),
        md("""
        ## Why prefill does not need any of this

        In prefill (processing a prompt of T tokens), every token is a query. FlashAttention gives each program a
        block of BLOCK_M queries, so the grid is B × H × ⌈T / BLOCK_M⌉: for one 4096-token prompt that is already
        far more programs than SMs, and each program does a lot of compute per byte. The sequence dimension of the
        *queries* fills the GPU; only decode, with one query, has to split the *keys*.
        """),
        code("""
        from fdlib import occupancy
        from fdlib.gpus import PRESETS
        h200 = PRESETS["H200"]
        B, H, T, BLOCK_M = 1, 32, 4096, 128
        prefill = occupancy.schedule(programs=B * H * math.ceil(T / BLOCK_M), programs_per_sm=1, sms=h200.sms)
        decode = occupancy.schedule(programs=B * 8, programs_per_sm=1, sms=h200.sms)
        print(f"prefill, T={T}: {prefill.programs} programs = B×H×⌈T/{BLOCK_M}⌉ on {h200.sms} SMs -> {prefill.waves} waves, "
              f"{prefill.utilization:.0%} of SMs in use")
        print(f"decode, 1 split: {decode.programs} programs on {h200.sms} SMs -> {decode.utilization:.0%} of SMs in use")
        """, checked=True),
        md("""
        ## The same idea elsewhere: split-K in matrix multiplication

        A GEMM C = A·B of shape M × N × K gives one program per output tile of C: ⌈M/BM⌉·⌈N/BN⌉ programs. When M and
        N are small and K is large (e.g. M = N = 256, K = 65536 with 128 × 128 tiles: 4 programs on 132 SMs), most
        of the GPU idles, exactly like decode with B × H_kv programs. **Split-K** cuts the K dimension into slices,
        each program computes a partial C tile over its slice, and a reduction adds the partial tiles (a second
        kernel, or atomics). Flash-Decoding is split-K for attention: the KV length is the reduction dimension, and
        because softmax is not a plain sum, its partials carry lse so that they can be merged with the right
        weights.
        """),
    ]
    cells += questions([
        ("How does the two-stage merge stay exact and numerically stable?",
         """Each (O_i, lse_i) is an exact summary of its split; weights e^(lse_i − lse) reproduce the softmax over all
         keys. Subtracting the largest lse_i before exponentiating keeps every weight in (0, 1], so nothing overflows
         even when the lse_i differ by 10⁴; empty splits (−∞) get weight 0."""),
        ("Why must a stage-2 kernel loop over the splits instead of loading them in one block?",
         """The launcher caps BLOCK_S at 8192 / BLOCK_D splits (64 for D = 128) to keep the [BLOCK_S, BLOCK_D] tile in
         registers; with more splits than that, one block does not hold them all. A running max and rescale over
         blocks (as in the tile update) handles any count."""),
        ("Why does time go up again with too many splits?",
         """Once the programs fill the GPU, more splits add waves (with a partly idle tail), per-program start-up
         work, partials written and read, and a longer merge, without adding bandwidth. Large batches fill the GPU
         with one split, so for them any split is overhead."""),
        ("Why does prefill not need split-KV?",
         """Prefill has T queries per sequence; FlashAttention's grid B × H × ⌈T/BLOCK_M⌉ already has far more programs
         than SMs (1024 for one 4096-token prompt with 32 heads), and each does much compute per byte."""),
        ("What is split-K in GEMM, and how is Flash-Decoding like it?",
         """When an M × N output has too few tiles to fill the GPU, split the K (reduction) dimension across programs
         and sum their partial tiles afterwards. Flash-Decoding splits attention's reduction dimension (the keys); its
         partials are merged with log-sum-exp weights instead of a plain sum."""),
    ])
    return cells


LABS = {"03_split_kv": lab03, "04_two_stage_reduction": lab04}


def main(argv=None):
    build_main(argv, LABS)


if __name__ == "__main__":
    main()
