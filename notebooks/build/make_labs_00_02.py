"""Build notebooks 00-02 from this script, execute them, and store their outputs.

    python notebooks/build/make_labs_00_02.py            # build + execute (about a minute each on a laptop CPU)
    python notebooks/build/make_labs_00_02.py --no-run   # build only, without outputs

Cells tagged ``machine`` (the runtime line, timings) are executed but their outputs are cleared before saving,
so no machine names or paths end up in the repository. Exercise cells (tag ``exercise``) keep their stub in
metadata ``fdlib.stub`` so ``fdlib.grading.notebook_tools.reset_exercise`` can put it back.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path
from textwrap import dedent

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

HERE = Path(__file__).resolve().parent
NB_DIR = HERE.parent
CHECK = "# NBVAL_CHECK_OUTPUT\n"


def md(text):
    return new_markdown_cell(dedent(text).strip("\n"))


def code(src, tags=(), checked=False):
    src = dedent(src).strip("\n")
    cell = new_code_cell((CHECK if checked else "") + src)
    if tags:
        cell.metadata["tags"] = list(tags)
    return cell


def exercise(name, src):
    src = dedent(src).strip("\n")
    cell = code(src, tags=["exercise"])
    cell.metadata["fdlib"] = {"exercise": name, "stub": src}
    return cell


def describe_cell():
    return code("import fdlib\nprint(fdlib.describe())", tags=["machine"])


def questions(items):
    cells = [md("## Check your understanding")]
    for q, a in items:
        cells.append(md(f"**{q}**\n\n<details><summary>Show the answer</summary>\n\n{dedent(a).strip()}\n\n</details>"))
    return cells


PLOT_SETUP = """
import matplotlib
import matplotlib.pyplot as plt
matplotlib.rcParams.update({"figure.dpi": 72, "savefig.dpi": 72, "figure.figsize": (7, 3.6)})
"""

# ================================================================================================ 00 welcome
def lab00():
    return [
        md("""
        # 00 · Welcome: Flash-Decoding, from scratch

        During **decode**, a language model produces one token at a time: each step, one query vector per head
        attends to the whole **KV cache** of the sequence so far. This course builds the kernel that makes that fast,
        one idea per lab:

        | Lab | What you build | The idea |
        |-----|----------------|----------|
        | 01 | naive decode attention | decode reads every byte of the KV cache to do ~1 FLOP per byte: it is memory-bound, and a B×H grid leaves most SMs idle |
        | 02 | online softmax and the merge of partial states | attention over a block of keys is summarised by (m, ℓ, Õ); states merge exactly, in any order |
        | 03 | the split-KV kernel (Triton, stage 1) | cut the sequence into splits so that B×H_kv×splits programs fill the GPU |
        | 04 | the two-stage reduction (stage 2) | merge the splits' partial results with log-sum-exp |
        | 05 | the adaptive unified kernel | a cost model picks the split count; one launch maps and reduces |

        Everything the notebooks use lives in the small library `fdlib`, which is also a real decode-attention
        library (`fdlib.decode_attention(...)`).

        Every notebook starts by saying where its kernels run:
        """),
        describe_cell(),
        md("""
        With an NVIDIA GPU, the Triton kernels are compiled and timed for real. Without one, Triton's **interpreter**
        runs the same kernels on the CPU (much slower), and the labs use small shapes so each notebook runs in about a
        minute. `fdlib.runtime.INTERPRET` tells you which mode you are in; set `FDLIB_INTERPRET=1` before starting
        Jupyter to force the interpreter on a GPU machine (handy for debugging with `print`).
        """),
        code("""
        from fdlib import runtime
        print("interpreter mode:", runtime.INTERPRET)
        """, tags=["machine"]),
        md("""
        ## How to work through a lab

        1. Read the explanation, then find the **exercise cell**: a function with a stub body that calls `todo(...)`.
           Replace the body with your implementation and run the cell.
        2. Run the **check cell** right after it. It prints one line per check:
           `✅ name` or `❌ name: what went wrong` (max error, where, expected vs got, shapes and dtypes).
           An untouched stub prints `📝 TODO: ...`.
        3. Later cells call `use("labNN.name")`: your function if it passes its checks, otherwise the reference
           solution, so the rest of the notebook always runs.

        Here is what a check looks like on the reference solution of Lab 01:
        """),
        code("""
        from fdlib.grading import *
        result = check("lab01.naive_attention", impl="solution")
        """, checked=True),
        md("""
        ## Grading from the command line

        The same checks run under pytest:

        * `./course test` runs the whole test suite; its graders check the reference solutions in `labsolutions/`
          (so it tells you the course itself is sound);
        * `./course test --grade-notebooks` grades **your** exercise cells instead: it runs the cells tagged
          `exercise` of `notebooks/NN_*.ipynb` (save the notebook first) and prints a per-lab scorecard.

        ## Stuck? Reveal a solution

        * Every exercise has hints in collapsed *Hint* cells below it.
        * `show_solution("lab01.naive_attention")` prints the reference solution without touching your notebook.
        * `reveal_solution(path, name)` writes the reference solution into the exercise cell of a notebook file, and
          `reset_exercise(path, name)` puts the original stub back. Both first save your version to
          `notebooks/.backups/NN_topic.<timestamp>.ipynb`, so nothing you wrote is ever lost. Reload the notebook in
          JupyterLab afterwards (*File → Reload Notebook from Disk*).
        """),
        code("""
        from fdlib.grading.notebook_tools import reset_exercise, reveal_solution
        # reveal_solution("01_naive_decode.ipynb", "lab01.naive_attention")
        # reset_exercise("01_naive_decode.ipynb", "lab01.naive_attention")
        print(reveal_solution.__doc__.strip())
        """, checked=True),
        md("Ready? Open **01_naive_decode.ipynb**."),
    ]


# ================================================================================================ 01 naive decode
NAIVE_STUB = '''
@exercise("lab01.naive_attention")
def naive_attention(q, k_cache, v_cache, cache_seqlens, scale):
    """Decode attention, the obvious way.

    q [B, H_q, D]; k_cache, v_cache [B, L_max, H_kv, D]; cache_seqlens [B] (int32); scale: a float.
    Returns (out [B, H_q, D] in q's dtype, lse [B, H_q] float32). Query head h reads KV head h // group.
    Keys at positions >= cache_seqlens[b] are ignored; a sequence of length 0 gives out = 0, lse = -inf.
    """
    todo("lab01.naive_attention")
'''


def lab01():
    cells = [
        md("""
        # 01 · Naive decode attention

        One decode step of one layer: for each sequence b and query head h, a single query vector q attends to the
        L = `cache_seqlens[b]` keys and values in the cache. With group = H_q / H_kv (grouped-query attention, GQA),
        query head h reads KV head h_kv = ⌊h / group⌋:

        $$ s_j = \\text{scale}\\; q\\cdot k_j,\\qquad
           O = \\sum_{j<L} \\frac{e^{s_j}}{\\sum_{i<L} e^{s_i}}\\, v_j,\\qquad
           \\text{lse} = \\log \\sum_{j<L} e^{s_j} $$

        Shapes (the course's notation): q `[B, H_q, D]`, caches `[B, L_max, H_kv, D]` (token-major, as a serving
        engine stores them), `cache_seqlens` `[B]`.
        """),
        describe_cell(),
        code(dedent("""
        import math
        import torch
        import fdlib
        from fdlib import runtime
        from fdlib.grading import *
        """) + PLOT_SETUP),
        md("""
        ## Exercise: `lab01.naive_attention`

        Write it in plain PyTorch: scores, mask, softmax, weighted sum. Compute in **float32** whatever the input dtype
        (`q.float()`), return `out` in q's dtype and `lse` in float32. Make length-0 sequences give `out = 0` and
        `lse = -inf` (not NaN).
        """),
        exercise("lab01.naive_attention", NAIVE_STUB),
        code('check("lab01.naive_attention")'),
        md("""
        <details><summary>Hint 1: GQA</summary>

        `k_cache.repeat_interleave(group, dim=2)` turns `[B, L, H_kv, D]` into `[B, L, H_q, D]` with head h holding
        KV head h // group. `torch.einsum("bhd,blhd->bhl", q, k)` then gives the scores.
        </details>

        <details><summary>Hint 2: masking and empty rows</summary>

        Set the scores of keys at positions `>= cache_seqlens[b]` to `-inf`. `torch.logsumexp` of an all-`-inf` row
        is `-inf`; `torch.softmax` of it is NaN, so compute `p = exp(s - lse)` with the `-inf` rows' lse replaced by 0.
        </details>

        Still stuck? `show_solution("lab01.naive_attention")` prints the reference solution.
        """),
        md("From here on, the notebook uses your function if it passes, else the reference:"),
        code('attention = use("lab01.naive_attention")'),
        code("""
        gen = torch.Generator().manual_seed(0)
        B, H_q, H_kv, D, L_max = 2, 8, 2, 64, 100
        q = torch.randn(B, H_q, D, generator=gen)
        k_cache = torch.randn(B, L_max, H_kv, D, generator=gen)
        v_cache = torch.randn(B, L_max, H_kv, D, generator=gen)
        cache_seqlens = torch.tensor([100, 37], dtype=torch.int32)
        out, lse = attention(q, k_cache, v_cache, cache_seqlens, 1 / math.sqrt(D))
        ref_out, ref_lse = fdlib.reference_attention(q, k_cache, v_cache, cache_seqlens)
        print("out", tuple(out.shape), out.dtype, "| lse", tuple(lse.shape), lse.dtype)
        print("matches the float64 reference:", torch.allclose(out.double(), ref_out, atol=1e-5))
        """, checked=True),
        md("""
        ## Bytes and FLOPs of one decode step

        Per layer, a decode step must read the whole KV cache once; compared with that, q and the output are tiny:

        * KV bytes = 2 · B · H_kv · L · D · bytes_per_element (K and V)
        * FLOPs = 4 · B · H_q · L · D (q·k: 2·D per key and head; p·v: 2·D per key and head)

        so the **arithmetic intensity** is FLOPs / bytes = 4·H_q / (2·H_kv·bytes) = 2·group / bytes: for fp16,
        **group FLOP/byte**, i.e. 1 FLOP/byte without GQA and 8 with group 8. A GPU needs hundreds of FLOPs per byte
        to be compute-bound; decode is firmly **memory-bound**, so its speed is set by how fast the cache streams in.
        """),
        md("""
        The cell below puts numbers on it for one layer of a Llama-3-8B-like model. The lower bound on the step
        time is KV bytes / bandwidth, with two bandwidths: the H200's datasheet peak (from `fdlib.gpus`) and the
        read ceiling that the course's benchmark **measured** on an H200 (from `results/h200`, provenance printed).
        """),
        code("""
        import json
        from pathlib import Path
        from fdlib.gpus import PRESETS
        RESULTS = Path(fdlib.__file__).resolve().parent.parent / "results" / "h200"
        bench = json.loads((RESULTS / "bench-float16.json").read_text())
        prov = bench["provenance"]
        BW_DATASHEET = PRESETS["H200"].bandwidth_tbs * 1e12          # bytes/s
        BW_MEASURED = bench["ceiling"]["tbs"] * 1e12                  # bytes/s, read ceiling measured in the run
        print(f"H200 datasheet bandwidth {BW_DATASHEET / 1e12:.2f} TB/s; read ceiling {BW_MEASURED / 1e12:.2f} TB/s "
              f"recorded on {prov['device']} {prov['date_utc'][:10]} (python -m fdlib.bench)")

        def decode_step(B, H_q, H_kv, L, D, bytes_per=2):
            kv_bytes = 2 * B * H_kv * L * D * bytes_per
            flops = 4 * B * H_q * L * D
            return kv_bytes, flops, flops / kv_bytes

        # One layer of a Llama-3-8B-like model (H_q=32, H_kv=8, D=128), fp16, one sequence of 32k tokens.
        for name, H_kv in (("multi-head (group 1)", 32), ("GQA (group 4)", 8)):
            kv_bytes, flops, ai = decode_step(B=1, H_q=32, H_kv=H_kv, L=32768, D=128)
            print(f"{name:20s} KV {kv_bytes / 2**20:5.1f} MiB | {flops / 1e9:4.2f} GFLOP | {ai:.1f} FLOP/byte | "
                  f"≥ {kv_bytes / BW_DATASHEET * 1e6:5.1f} µs (datasheet), ≥ {kv_bytes / BW_MEASURED * 1e6:5.1f} µs (measured ceiling)")
        """, checked=True),
        md("""
        ## The roofline

        A kernel with intensity I (FLOP/byte) can at best reach min(peak FLOP/s, bandwidth · I). The **ridge point**
        peak / bandwidth is where the two limits meet; below it a kernel is memory-bound. The cell uses the H200's
        datasheet figures (HBM bandwidth, dense fp16 tensor-core peak) and also draws the measured read ceiling.
        Decode sits far left of the ridge; prefill (attention of N queries over N keys) has an intensity that grows
        with N.
        """),
        code("""
        import numpy as np
        BW, PEAK = BW_DATASHEET, 989.5e12                # H200 datasheet: bytes/s, dense fp16 tensor-core FLOP/s
        I = np.logspace(-1, 4, 200)
        attainable = np.minimum(PEAK, BW * I)
        N = 4096                                         # prefill: 4096 tokens, causal, fp16, no GQA
        prefill_ai = (4 * N * N * 128 / 2) / (2 * 4 * N * 128)
        points = {"decode, group 1": 1.0, "decode, group 8": 8.0, f"prefill, N={N}": prefill_ai}
        print(f"ridge point: {PEAK / BW:.0f} FLOP/byte")
        for name, ai in points.items():
            print(f"{name:18s} intensity {ai:7.1f} FLOP/byte -> at most {min(PEAK, BW * ai) / 1e12:6.1f} TFLOP/s")
        fig, ax = plt.subplots()
        ax.loglog(I, attainable / 1e12, color="black", label=f"roofline, datasheet {BW / 1e12:.1f} TB/s")
        ax.loglog(I, np.minimum(PEAK, BW_MEASURED * I) / 1e12, color="gray", ls="--",
                  label=f"measured read ceiling {BW_MEASURED / 1e12:.2f} TB/s ({prov['date_utc'][:10]})")
        for (name, ai), c in zip(points.items(), ("tab:red", "tab:orange", "tab:blue")):
            ax.plot(ai, min(PEAK, BW * ai) / 1e12, "o", color=c, label=name)
        ax.set_xlabel("arithmetic intensity (FLOP/byte)")
        ax.set_ylabel("attainable throughput (TFLOP/s)")
        ax.set_title(f"Roofline of one H200 - analytic model (datasheet {BW / 1e12:.1f} TB/s, {PEAK / 1e12:.0f} TFLOP/s fp16;\\n"
                     f"dashed: read ceiling recorded on {prov['device']} {prov['date_utc'][:10]})", fontsize=10)
        ax.legend(loc="lower right", fontsize=8)
        ax.grid(True, which="both", alpha=0.3)
        plt.show()
        """, checked=False),
        md("""
        ## Why a B×H grid leaves most of the GPU idle

        The obvious GPU kernel gives one program (thread block) to each (sequence, head) pair: a grid of B × H programs.
        In long-context decode the batch is often small. With B = 1 and H = 32 heads there are **32 programs**, and one
        program runs on one SM, so on an A100 (108 SMs) or an H200 (132 SMs) most SMs have nothing to do while the 32
        busy ones each stream a long slice of the cache. The memory system can only be saturated if (almost) every SM
        is issuing loads. `fdlib.occupancy.schedule` does the wave arithmetic:
        """),
        code("""
        from fdlib import occupancy
        from fdlib.gpus import PRESETS
        gpus = [PRESETS["A100 SXM4 80GB"], PRESETS["H200"]]
        for gpu in gpus:
            s = occupancy.schedule(programs=1 * 32, programs_per_sm=1, sms=gpu.sms)
            print(f"{gpu.name:15s} B=1, H=32: {s.programs} programs on {gpu.sms} SMs -> {s.waves} wave, "
                  f"{s.busy_sms_first_wave} SMs busy, {gpu.sms - s.busy_sms_first_wave} idle "
                  f"({s.utilization:.0%} of SMs in use)")
        """, checked=True),
        code("""
        from matplotlib.colors import ListedColormap
        fig, axes = plt.subplots(len(gpus), 1, figsize=(7, 4.2))
        cols = 22
        for ax, gpu in zip(axes, gpus):
            s = occupancy.schedule(programs=32, programs_per_sm=1, sms=gpu.sms)
            busy = occupancy.placement(s)[0] > 0             # first (only) wave
            rows = -(-gpu.sms // cols)
            grid = np.ma.masked_invalid(np.full(rows * cols, np.nan))
            grid[:gpu.sms] = busy
            ax.pcolormesh(grid.reshape(rows, cols), cmap=ListedColormap(["lightgray", "tab:green"]), vmin=0, vmax=1,
                          edgecolors="white", linewidth=1.5)
            ax.set_aspect("equal"); ax.invert_yaxis()
            ax.set_xticks([]); ax.set_yticks([])
            ax.set_xlabel(f"one tile per SM, {cols} SMs per row", fontsize=9)
            ax.set_title(f"{gpu.name}: {busy.sum()} of {gpu.sms} SMs busy (green), {gpu.sms - busy.sum()} idle (gray)",
                         fontsize=10)
        fig.suptitle("B×H grid, B=1, H=32: one tile per SM - analytic model (fdlib.occupancy)", fontsize=10)
        plt.tight_layout()
        plt.show()
        """),
        md("""
        ### Explore it

        The explorer below is the same wave model with sliders (it comes back in Labs 03 and 05). It starts at this
        lab's kernel: one program per query head (GQA packing off), one split. Move **B** and **H_q** to see when the
        B×H grid fills the GPU by itself; move **splits** to preview Lab 03.
        """),
        code("""
        from fdlib.explorer import explorer
        explorer(B=1, H_q=32, H_kv=32, L=32768, splits=1, gpu="H200", gqa=False)
        """, tags=["machine"]),
        md("""
        Lab 03 fixes this by cutting the sequence into **splits**: B × H_kv × splits programs, each streaming its own
        slice, with the partial results merged afterwards. Merging partial softmaxes exactly is what Lab 02 is about.

        ## How long does the naive version take here?

        A quick timing of `fdlib.decode_attention(method="naive")` (the PyTorch version of this lab) on this machine.
        Numbers depend on your device, so this output is not checked.
        """),
        code("""
        import time
        dev = runtime.DEVICE
        B, H_q, H_kv, D = 1, 32, 8, 128
        L = 4096 if runtime.INTERPRET else 32768
        qt = torch.randn(B, H_q, D, device=dev, dtype=torch.float16)
        kt = torch.randn(B, L, H_kv, D, device=dev, dtype=torch.float16)
        vt = torch.randn_like(kt)
        fdlib.decode_attention(qt, kt, vt, method="naive")
        if dev == "cuda": torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(5):
            fdlib.decode_attention(qt, kt, vt, method="naive")
        if dev == "cuda": torch.cuda.synchronize()
        dt = (time.perf_counter() - t0) / 5
        kv_bytes = 2 * B * H_kv * L * D * 2
        print(f"{runtime.describe()}\\nL={L}: {dt * 1e6:.0f} µs per step, {kv_bytes / dt / 1e9:.1f} GB/s effective")
        """, tags=["machine"]),
    ]
    cells += questions([
        ("Why is long-context decode slow even on a GPU with ~1000 TFLOP/s?",
         """Each step reads the whole KV cache (2·B·H_kv·L·D·bytes) to do only about group FLOPs per byte (fp16),
         far below the ridge point of a modern GPU (about 200 FLOP/byte for the H200, computed above). The step
         time is set by KV bytes / bandwidth; the tensor cores are almost idle."""),
        ("How does grouped-query attention change the arithmetic intensity of decode?",
         """The FLOPs depend on H_q, the bytes on H_kv: the intensity is multiplied by group = H_q/H_kv (and the
         cache shrinks by the same factor), as long as the kernel reads each KV tile once for all heads of its group."""),
        ("With B=1 and 32 heads on an H200, what fraction of SMs does a B×H grid use, and what does that cost?",
         """32 of 132 SMs (24%). A single SM cannot pull anywhere near the full HBM bandwidth, so the step runs at a
         fraction of the achievable bandwidth; splitting the sequence (Lab 03) creates enough programs to fill all SMs."""),
    ])
    return cells


# ================================================================================================ 02 online softmax
ONLINE_STUB = '''
@exercise("lab02.online_softmax")
def online_softmax(q, k, v, block, scale):
    """Attention of one query q [D] over keys k [L, D] and values v [L, D], `block` keys at a time.

    Returns State(m, l, o_tilde) (or a tuple): m = max_j s_j, l = sum_j exp(s_j - m),
    o_tilde = sum_j exp(s_j - m) v_j with s_j = scale * q . k_j. No keys (or only -inf scores): (-inf, 0, 0).
    """
    todo("lab02.online_softmax")
'''

MERGE_STUB = '''
@exercise("lab02.merge")
def merge(a, b):
    """The state of the union of two disjoint key sets. a, b: State(m [N], l [N], o_tilde [N, D])."""
    todo("lab02.merge")
'''


def lab02():
    cells = [
        md("""
        # 02 · Online softmax and the merge of partial states

        To split attention over many programs, each program must summarise its slice of keys J in a few numbers that
        can be combined later. Per query these are:

        * m = max_{j∈J} s_j, the **running max** (keeps every exponential ≤ 1, so nothing overflows);
        * ℓ = Σ_{j∈J} e^{s_j − m}, the softmax **denominator**, relative to m;
        * Õ = Σ_{j∈J} e^{s_j − m} v_j, the **unnormalised output**.

        The output is O = Õ / ℓ and the log-sum-exp is lse = m + log ℓ. An empty set is (−∞, 0, 0).

        When a new block of keys arrives with block max m_b, the new max is m' = max(m, m_b), and the old sums are
        rescaled by **e^(m − m')** ≤ 1:

        $$ \\ell' = \\ell\\,e^{m-m'} + \\sum_{j\\in b} e^{s_j-m'},\\qquad
           \\tilde O' = \\tilde O\\,e^{m-m'} + \\sum_{j\\in b} e^{s_j-m'} v_j $$

        Careful with −∞: if every score so far is −∞, then m − m' is −∞ − (−∞) = NaN. Use a finite reference (e.g. 0)
        when m' = −∞.
        """),
        describe_cell(),
        code(dedent("""
        import math
        import torch
        import fdlib
        from fdlib import runtime
        from fdlib.online_softmax import State
        from fdlib.grading import *
        """) + PLOT_SETUP),
        md("## Exercise 1: `lab02.online_softmax`"),
        exercise("lab02.online_softmax", ONLINE_STUB),
        code('check("lab02.online_softmax")'),
        md("""
        <details><summary>Hint</summary>

        Start from `m = torch.tensor(-inf)`, `l = torch.tensor(0.)`, `o = torch.zeros(D)`. For each block, compute
        the scores `s = (k_blk.float() @ q.float()) * scale`, the new max, the rescale factor `alpha = exp(m - ref)`
        and `p = exp(s - ref)` with `ref = m_new` if it is finite else 0. Then update l and o and set m = m_new.
        </details>

        ## Exercise 2: `lab02.merge`

        Two states over disjoint key sets A and B merge like a block update, with both sides rescaled:

        $$ m = \\max(m_A, m_B),\\quad \\ell = \\ell_A e^{m_A-m} + \\ell_B e^{m_B-m},\\quad
           \\tilde O = \\tilde O_A e^{m_A-m} + \\tilde O_B e^{m_B-m} $$

        States here hold N query rows: m, ℓ `[N]`, Õ `[N, D]`.
        """),
        exercise("lab02.merge", MERGE_STUB),
        code('check("lab02.merge")'),
        md("""
        <details><summary>Hint</summary>

        `m = torch.maximum(a.m, b.m)`; take `ref = where(isinf(m), 0, m)` so two empty states give exp(−∞) = 0 instead
        of NaN; `alpha = exp(a.m - ref)`, `beta = exp(b.m - ref)`; broadcast them over D with `[..., None]`.
        </details>
        """),
        code("""
        online_softmax = use("lab02.online_softmax")
        merge = use("lab02.merge")
        """),
        md("""
        ## Huge logits: the naive softmax overflows, the online one does not

        Logits in the hundreds do occur (large activations, no normalisation of q and k), and e^89 already
        overflows float32. The same three scores through a naive softmax and through your online softmax:
        """),
        code("""
        s = torch.tensor([1000.0, 1001.0, 999.0])
        v = torch.eye(3)
        naive = torch.exp(s) / torch.exp(s).sum()
        print("naive exp(s):", torch.exp(s).tolist(), "-> softmax", naive.tolist())
        # q = [1] and k_j = [s_j] (D = 1), so q·k_j = s_j; blocks of 2 keys
        state = online_softmax(torch.tensor([1.0]), s[:, None], v, 2, 1.0)
        O = state[2] / state[1]
        print("online: m =", float(state[0]), "| l =", round(float(state[1]), 6), "| O =", [round(x, 6) for x in O.tolist()])
        print("matches torch.softmax:", torch.allclose(O, torch.softmax(s, 0)))
        """, checked=True),
        md("""
        ## −∞ scores and empty blocks

        Masked keys score −∞. A block where every key is masked has m_b = −∞ and contributes nothing; if it comes
        first, the running max stays −∞ until a real key arrives. Nothing may become NaN.
        """),
        code("""
        D, L = 4, 12
        gen = torch.Generator().manual_seed(2)
        q = torch.rand(D, generator=gen) + 0.1          # positive, so a key of -inf entries scores exactly -inf
        k = torch.randn(L, D, generator=gen)
        v = torch.randn(L, D, generator=gen)
        k[:4] = float("-inf")                            # the whole first block (block = 4) is masked
        m, l, o = online_softmax(q, k, v, 4, 1.0)
        ref = torch.softmax(k[4:] @ q, 0) @ v[4:]
        print("m finite:", bool(torch.isfinite(m)), "| any NaN:", bool(torch.isnan(o).any()))
        print("equals attention over the unmasked keys:", torch.allclose(o / l, ref, atol=1e-6))
        print("no keys at all:", [t.tolist() for t in online_softmax(q, k[:0], v[:0], 4, 1.0)])
        """, checked=True),
        md("""
        ## Order and grouping do not matter

        The merge is **commutative** and **associative**: cut the keys into blocks any way, merge their states in any
        order and grouping, and you get the same (m, ℓ, Õ) up to rounding. This is what lets Flash-Decoding hand the
        blocks to different programs and merge their results afterwards.
        """),
        code("""
        import random
        from fdlib.online_softmax import block_state
        N, D, L = 3, 16, 80
        gen = torch.Generator().manual_seed(3)
        s = torch.randn(N, L, generator=gen) * 4
        v = torch.randn(N, L, D, generator=gen)
        cuts = [0, 7, 20, 21, 50, 80]
        blocks = [block_state(s[:, a:b], v[:, a:b]) for a, b in zip(cuts, cuts[1:])]
        exact = torch.einsum("nl,nld->nd", torch.softmax(s.double(), -1), v.double())   # float64, all keys at once

        def sequential(states):
            acc = states[0]
            for st in states[1:]:
                acc = merge(acc, st)
            return acc

        def tree(states):
            while len(states) > 1:
                states = [merge(*states[i:i + 2]) if i + 1 < len(states) else states[i] for i in range(0, len(states), 2)]
            return states[0]

        rng = random.Random(0)
        worst, spread, first = 0.0, 0.0, None
        for trial in range(20):
            order = blocks[:]
            rng.shuffle(order)
            for combine in (sequential, tree):
                st = combine(order)
                O = st.o_tilde / st.l[:, None]
                first = O if first is None else first
                worst = max(worst, float((O - exact).abs().max()))
                spread = max(spread, float((O - first).abs().max()))
        print(f"20 random orders x (sequential, tree): worst |O - exact| < 1e-5: {worst < 1e-5}; "
              f"orders agree to < 1e-5: {spread < 1e-5}")
        """, checked=True),
        md("## The running max and denominator, block by block"),
        code("""
        D, L, block = 16, 96, 8
        gen = torch.Generator().manual_seed(4)
        q = torch.randn(D, generator=gen)
        k = torch.randn(L, D, generator=gen) * torch.linspace(0.5, 2.0, L)[:, None]
        v = torch.randn(L, D, generator=gen)
        running = []
        for end in range(block, L + 1, block):
            st = online_softmax(q, k[:end], v[:end], block, D ** -0.5)
            running.append((end, float(st[0]), float(st[1])))
        ends, ms, ls = zip(*running)
        fig, ax1 = plt.subplots()
        ax1.step(ends, ms, where="post", color="tab:red", label="m (running max)")
        ax1.set_xlabel("keys processed (count)")
        ax1.set_ylabel("m (score units)", color="tab:red")
        ax2 = ax1.twinx()
        ax2.plot(ends, ls, "o-", color="tab:blue", label="ℓ (denominator)")
        ax2.set_ylabel("ℓ = Σ e^(s - m) (dimensionless)", color="tab:blue")
        ax1.set_title(f"Running m and ℓ over blocks of {block} keys - PyTorch on the CPU, float32")
        fig.tight_layout()
        plt.show()
        """),
        md("""
        Each time m jumps, ℓ drops: the old sum is rescaled by e^(m_old − m_new) < 1 before the new block is added.

        The Triton kernels of the next labs do exactly this arithmetic on tiles of keys (`fdlib.kernels.tile`), and
        `fdlib.online_softmax` has the PyTorch version (`block_state`, `merge`, `merge_lse`) used by the tests.
        """),
    ]
    cells += questions([
        ("Why keep m at all? Couldn't we just sum e^{s_j}?",
         """e^{s} overflows float32 for s > 88 (float16: s > 11). Measuring everything relative to the running max
         keeps every exponential in (0, 1], whatever the logits."""),
        ("How does the two-stage merge of Flash-Decoding stay exact and stable?",
         """Each split's (m, ℓ, Õ) (or (O, lse)) is an exact summary of its keys. Merging rescales each side by
         e^(m_i − m) ≤ 1 with m the larger max: no overflow, no approximation, and the merge is associative and
         commutative, so any split count and merge order give the same softmax up to rounding."""),
        ("What goes wrong when a block is entirely masked, and how is it handled?",
         """Its max is −∞; if the running max is −∞ too, e^(m − m') = e^(−∞ + ∞) is NaN. Using a finite reference
         (0) when the new max is −∞ makes the factors e^(−∞) = 0, so the empty block contributes nothing."""),
    ])
    return cells


LABS = {"00_welcome": lab00, "01_naive_decode": lab01, "02_online_softmax": lab02}


def build(name, labs=None) -> nbformat.NotebookNode:
    """The notebook ``name`` from its cell function in ``labs`` (this script's LABS by default)."""
    nb = new_notebook(cells=(labs or LABS)[name]())
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.metadata["language_info"] = {"name": "python"}
    for i, c in enumerate(nb.cells):
        c["id"] = f"{name[:2]}-{i:02d}"
    return nb


def execute(nb, name) -> float:
    from nbclient import NotebookClient
    t0 = time.time()
    NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(NB_DIR)}}).execute()
    return time.time() - t0


def scrub(nb) -> None:
    """Clear machine-dependent outputs and execution metadata."""
    for c in nb.cells:
        if c.cell_type != "code":
            continue
        c.metadata.pop("execution", None)
        if "machine" in c.metadata.get("tags", []):
            c.outputs = []
            c.execution_count = None
        merged = []   # one stream output per run of prints (check lines come from worker threads in chunks)
        for o in c.outputs:
            if merged and o.output_type == "stream" and merged[-1].output_type == "stream" \
                    and merged[-1].name == o.name:
                merged[-1].text += o.text
            else:
                merged.append(o)
        c.outputs = merged
    nb.metadata.pop("widgets", None)


def main(argv=None, labs=None):
    """Build, execute (unless --no-run), scrub and write the notebooks named in argv (default: all of ``labs``)."""
    labs = labs or LABS
    argv = sys.argv[1:] if argv is None else argv
    run = "--no-run" not in argv
    names = [a for a in argv if not a.startswith("--")] or list(labs)
    for name in names:
        nb = build(name, labs)
        if run:
            dt = execute(nb, name)
            print(f"{name}: executed in {dt:.1f} s")
        scrub(nb)
        nbformat.validate(nb)
        nbformat.write(nb, NB_DIR / f"{name}.ipynb")


if __name__ == "__main__":
    main()
