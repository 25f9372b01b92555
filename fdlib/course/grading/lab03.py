r"""Checks for Lab 03: the tile update inside the split-KV (stage-1) kernel.

``lab03.tile_update(q, k, v, valid, m, l, acc, qk_scale, FP32_DOT)`` is a ``@triton.jit`` function with the
contract of :func:`fdlib.kernels.tile.tile_update`: for query rows q ``[G, D]``, a tile of keys k and values
v ``[N, D]`` and ``valid [N]`` (False for keys past the split's end), it returns the state after the tile:

.. math::
    s_{gj} = \text{qk\_scale}\; q_g\cdot k_j\ (-\infty\ \text{where not valid}),\quad
    m' = \max(m, \max_j s_{gj}),\quad \alpha = 2^{m-m'},\quad p_{gj} = 2^{s_{gj}-m'}\\
    \ell' = \alpha\,\ell + \sum_j p_{gj},\qquad \tilde O' = \alpha\,\tilde O + \sum_j p_{gj}\,v_j

Scores are in base-2 units (``qk_scale`` = scale·log2 e already), all state is float32.

Most checks run fdlib's real stage-1 kernel with the learner's function injected
(:func:`fdlib.kernels.stage1.run_stage1` ``tile_update_fn=``), then fdlib's stage 2, and compare with
:func:`fdlib.reference_attention` (float64). A few call the function once on one tile through a small
harness kernel, to test states the stage-1 kernel never produces (a fully masked tile).

An untouched stub (the exercise cell as shipped, :data:`STUB`) is recognised by comparing its code with the
stub's (comments and docstring aside) and reported as a TODO (:mod:`fdlib.course.grading.triton_exercise`).
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from fdlib import runtime
from fdlib.kernels.config import INTERPRETER_CONFIG, TileConfig, tile_config
from fdlib.kernels.stage1 import run_stage1
from fdlib.kernels.stage2 import run_stage2
from fdlib.kernels.tile import LOG2E
from fdlib.reference import reference_attention

from .core import TOL, assert_close, check_case, randn
from .triton_exercise import launch, triton_stub

NAME = "lab03.tile_update"

STUB = triton_stub(NAME, '''
@exercise("lab03.tile_update")
@triton.jit
def tile_update(q, k, v, valid, m, l, acc, qk_scale, FP32_DOT: tl.constexpr):
    """(m, l, acc) after one more tile of keys: online softmax in base 2, all state float32.

    q [G, D] (G query heads of one KV head); k, v [N, D] (one tile of N keys); valid [N] (False for keys
    past the end of the split: their score must be -inf); m, l [G] and acc [G, D]: the state so far
    (m = -inf, l = 0, acc = 0 before the first tile). qk_scale = scale * log2(e), so 2^(qk_scale * q.k)
    = e^(scale * q.k): use tl.exp2, not tl.exp. FP32_DOT (a tl.constexpr): for float32 inputs, do the
    products in exact float32, tl.dot(a, b, input_precision="ieee"); otherwise tl.dot(a, b) is fine.
    Returns (m_new, l_new, acc_new).
    """
    # TODO: scores s [G, N] (tl.dot, tl.trans), -inf where not valid; m_new = max(m, row max of s);
    #       alpha = 2^(m - m_new) and p = 2^(s - m_new) (careful when m_new is -inf: use 0 instead);
    #       l = alpha * l + sum(p); acc = alpha * acc + p @ v.
    return m, l, acc
''')


# ---------------------------------------------------------------------------------------------- tiles
def _cfg() -> TileConfig:
    """The interpreter's 16-key tiles here; on a GPU the compiled tiles for these small shapes."""
    return INTERPRETER_CONFIG if INTERPRETER_CONFIG == tile_config() else tile_config(64, 256)


# ---------------------------------------------------------------------------------------------- stage 1 + stage 2
def split_kv_problem(gen, *, B, H_q, H_kv, D, L_max, splits, lengths=None, dtype=torch.float32, spread=1.0,
                     k_ramp=0.0):
    """Seeded inputs for a stage-1 launch of ``splits`` splits: (q, k, v, lens, scale, chunk, cfg) on the
    kernels' device. chunk = BLOCK_N·⌈⌈L_max/splits⌉/BLOCK_N⌉ keys, splits not capped by the tiles (so splits
    past a sequence's end, which must come back empty, can be asked for)."""
    q = randn(gen, B, H_q, D, scale=spread)
    k = randn(gen, B, L_max, H_kv, D, scale=spread)
    if k_ramp:     # later keys score higher: the running max grows tile after tile
        k = k + k_ramp * torch.linspace(0, 1, L_max)[None, :, None, None] * q.mean(1).sign()[:, None, None, :]
    v = randn(gen, B, L_max, H_kv, D)
    dev = runtime.DEVICE
    q, k, v = (t.to(dtype).to(dev) for t in (q, k, v))
    lens = torch.full((B,), L_max, dtype=torch.int32) if lengths is None else torch.tensor(lengths, dtype=torch.int32)
    cfg = _cfg()
    chunk = triton.cdiv(triton.cdiv(L_max, splits), cfg.BLOCK_N) * cfg.BLOCK_N
    return q, k, v, lens.to(dev), 1.0 / math.sqrt(D), chunk, cfg


def _split_kv(impl, gen, *, B, H_q, H_kv, D, L_max, splits, lengths=None, dtype=torch.float32, spread=1.0,
              k_ramp=0.0, lse_tol=1e-4, check_partials=False):
    """Stage 1 with the learner's tile update (split i covers keys [i·chunk, (i+1)·chunk), see
    :func:`split_kv_problem`), then fdlib's stage 2; compare out/lse (and optionally every split's partial)
    with the float64 reference."""
    q, k, v, lens, scale, chunk, cfg = split_kv_problem(gen, B=B, H_q=H_q, H_kv=H_kv, D=D, L_max=L_max,
                                                        splits=splits, lengths=lengths, dtype=dtype,
                                                        spread=spread, k_ramp=k_ramp)
    dev = q.device
    o_part, lse_part = launch("stage 1 with your tile_update", lambda: run_stage1(
        q, k, v, lens, scale=scale, chunk=chunk, splits=splits, cfg=cfg, tile_update_fn=impl))
    atol, rtol = TOL[dtype]
    if check_partials:
        for i in range(splits):
            a, b = i * chunk, min((i + 1) * chunk, L_max)
            n_i = (lens.cpu().long() - a).clamp(0, max(b - a, 0))
            if b > a:
                ro, rl = reference_attention(q, k[:, a:b], v[:, a:b], n_i, scale)
            else:
                ro, rl = torch.zeros(B, H_q, D, dtype=torch.float64), torch.full((B, H_q), float("-inf"))
            assert_close(o_part[:, :, i], ro, f"partial O of split {i} (keys {a}..{b - 1})", 2e-5 if dtype ==
                         torch.float32 else 2e-3, 2e-5 if dtype == torch.float32 else 2e-3)
            assert_close(lse_part[:, :, i], rl, f"partial lse of split {i} (keys {a}..{b - 1})", lse_tol, 1e-5)
    out = torch.empty(B, H_q, D, dtype=dtype, device=dev)
    lse = torch.empty(B, H_q, dtype=torch.float32, device=dev)
    run_stage2(o_part, lse_part, out, lse)
    ref_o, ref_lse = reference_attention(q, k, v, lens, scale)
    assert_close(out, ref_o, f"out (after stage 2, {splits} splits of {chunk} keys)", atol, rtol)
    assert_close(lse, ref_lse, "lse", lse_tol, 1e-5)


# ---------------------------------------------------------------------------------------------- one tile
@triton.jit
def _one_tile_kernel(Q, K, V, VALID, M, L, ACC, M_OUT, L_OUT, ACC_OUT, qk_scale,
                     BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                     FP32_DOT: tl.constexpr, TILE_UPDATE: tl.constexpr):
    """Load one tile and one state, call TILE_UPDATE once, store the new state."""
    g = tl.arange(0, BLOCK_G)
    n = tl.arange(0, BLOCK_N)
    d = tl.arange(0, BLOCK_D)
    q = tl.load(Q + g[:, None] * BLOCK_D + d[None, :])
    k = tl.load(K + n[:, None] * BLOCK_D + d[None, :])
    v = tl.load(V + n[:, None] * BLOCK_D + d[None, :])
    valid = tl.load(VALID + n) != 0
    m = tl.load(M + g)
    l = tl.load(L + g)
    acc = tl.load(ACC + g[:, None] * BLOCK_D + d[None, :])
    m, l, acc = TILE_UPDATE(q, k, v, valid, m, l, acc, qk_scale, FP32_DOT)
    tl.store(M_OUT + g, m)
    tl.store(L_OUT + g, l)
    tl.store(ACC_OUT + g[:, None] * BLOCK_D + d[None, :], acc)


def _one_tile(impl, q, k, v, valid, m, l, acc, qk_scale):
    """(m, ℓ, Õ) from the learner's function on one tile (float32 inputs, FP32_DOT=True)."""
    dev = runtime.DEVICE
    G, D = q.shape
    N = k.shape[0]
    outs = [torch.full_like(m, float("nan")), torch.full_like(l, float("nan")), torch.full_like(acc, float("nan"))]
    args = [t.contiguous().to(dev) for t in (q, k, v, valid.to(torch.int32), m, l, acc)]
    outs = [t.to(dev) for t in outs]
    launch("your tile_update", lambda: _one_tile_kernel[(1,)](
        *args, *outs, qk_scale, BLOCK_G=G, BLOCK_N=N, BLOCK_D=D, FP32_DOT=True, TILE_UPDATE=impl))
    return [t.cpu() for t in outs]


def _ref_tile(q, k, v, valid, m, l, acc, qk_scale):
    """The same update in float64 (base 2)."""
    q, k, v, m, l, acc = (t.double() for t in (q, k, v, m, l, acc))
    s = (q @ k.T) * qk_scale
    s = s.masked_fill(~valid[None, :], float("-inf"))
    m_new = torch.maximum(m, s.amax(1))
    ref = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
    alpha, p = torch.exp2(m - ref), torch.exp2(s - ref[:, None])
    return m_new, l * alpha + p.sum(1), acc * alpha[:, None] + p @ v


def _tile_case(impl, gen, *, valid, state="empty", spread=1.0, m_shift=0.0, qk_scale=None, G=16, N=16, D=32,
               tol=2e-5):
    q, k, v = randn(gen, G, D, scale=spread), randn(gen, N, D, scale=spread), randn(gen, N, D)
    valid = torch.as_tensor(valid, dtype=torch.bool)
    qk = (1.0 / math.sqrt(D)) * LOG2E if qk_scale is None else qk_scale
    if state == "empty":
        m, l, acc = torch.full((G,), float("-inf")), torch.zeros(G), torch.zeros(G, D)
    else:          # a state that has seen some earlier keys, with its max shifted by m_shift
        m = randn(gen, G) + m_shift
        l = torch.rand(G, generator=gen) * 3 + 0.5
        acc = randn(gen, G, D)
    got = _one_tile(impl, q, k, v, valid, m, l, acc, qk)
    ref = _ref_tile(q, k, v, valid, m, l, acc, qk)
    for g, r, nm in zip(got, ref, ("m", "ℓ", "Õ")):
        assert_close(g, r, f"state after the tile: {nm}", tol, tol)


# ---------------------------------------------------------------------------------------------- the checks
@check_case(NAME, "one tile from the empty state (m=−inf, ℓ=0, Õ=0): 16 rows, 16 keys, D=32, float32", points=2)
def _tile_first(impl, gen):
    _tile_case(impl, gen, valid=[True] * 16)


@check_case(NAME, "one tile after earlier keys: the old ℓ and Õ are rescaled by 2^(m − m_new)", points=2)
def _tile_rescale(impl, gen):
    _tile_case(impl, gen, valid=[True] * 16, state="seen", m_shift=-3.0)
    _tile_case(impl, gen, valid=[True] * 16, state="seen", m_shift=3.0)


@check_case(NAME, "a partly masked tile (keys past the end score −inf) and a fully masked one (no NaN)")
def _tile_masked(impl, gen):
    _tile_case(impl, gen, valid=[True] * 5 + [False] * 11, state="seen")
    _tile_case(impl, gen, valid=[False] * 16, state="seen")
    _tile_case(impl, gen, valid=[False] * 16, state="empty")


@check_case(NAME, "huge logits on one tile (|score| ~ 1e4, old max 1e4 below or above): no overflow")
def _tile_huge(impl, gen):
    _tile_case(impl, gen, valid=[True] * 16, state="seen", spread=30.0, m_shift=-1e4, qk_scale=LOG2E, tol=1e-4)
    _tile_case(impl, gen, valid=[True] * 16, state="seen", spread=30.0, m_shift=1e4, qk_scale=LOG2E, tol=1e-4)


@check_case(NAME, "stage 1 + stage 2: L=64 in 2 splits of 32 keys, group 4 (H_q=8, H_kv=2), D=32, float32", points=2)
def _s1_basic(impl, gen):
    _split_kv(impl, gen, B=1, H_q=8, H_kv=2, D=32, L_max=64, splits=2)


@check_case(NAME, "ragged lengths 0, 1, 37, 50 (not multiples of the 16-key tile), 2 splits")
def _s1_ragged(impl, gen):
    _split_kv(impl, gen, B=4, H_q=4, H_kv=1, D=32, L_max=50, splits=2, lengths=[0, 1, 37, 50])


@check_case(NAME, "more splits than tiles: L=40 in 8 splits; splits past the end are empty (O=0, lse=−inf)")
def _s1_many(impl, gen):
    _split_kv(impl, gen, B=2, H_q=2, H_kv=2, D=16, L_max=40, splits=8, lengths=[40, 9], check_partials=True)


@check_case(NAME, "GQA group 3 (H_q=6, H_kv=2), head dim 80, lengths 45 and 20")
def _s1_gqa3(impl, gen):
    _split_kv(impl, gen, B=2, H_q=6, H_kv=2, D=80, L_max=45, splits=2, lengths=[45, 20])


@check_case(NAME, "group 1 (H_q = H_kv = 2), float16 inputs (float32 state), L=70 in 3 splits")
def _s1_fp16(impl, gen):
    _split_kv(impl, gen, B=1, H_q=2, H_kv=2, D=32, L_max=70, splits=3, dtype=torch.float16)


@check_case(NAME, "the max grows tile after tile (L=96 in one split: every tile must rescale ℓ and Õ)")
def _s1_growing(impl, gen):
    _split_kv(impl, gen, B=1, H_q=4, H_kv=1, D=16, L_max=96, splits=1, k_ramp=3.0)


@check_case(NAME, "huge logits (|score| ~ 1e4) across tiles and splits: no overflow, no NaN")
def _s1_huge(impl, gen):
    _split_kv(impl, gen, B=1, H_q=2, H_kv=1, D=16, L_max=48, splits=2, spread=30.0, lse_tol=5e-2)
