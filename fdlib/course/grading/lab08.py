r"""Checks for Lab 08: several query tokens per sequence, and the merge across GPUs.

* ``lab08.causal_limits(cache_seqlens, q_len) -> [B, q_len] int64``: how many keys query token t of
  sequence b sees when the q_len new tokens are already the last q_len entries of the cache:

  .. math:: n_{b,t} = \max(0,\ L_b - q_\text{len} + 1 + t), \qquad t = 0 \dots q_\text{len} - 1

  (query t sees keys 0 … L_b − q_len + t: ``flash_attn_with_kvcache``'s bottom-right causal rule).
* ``lab08.verify_attention(q, k_cache, v_cache, cache_seqlens, scale) -> (out, lse)``: decode attention for
  ``q [B, q_len, H_q, D]`` with that rule, in float64 on the CPU: out ``[B, q_len, H_q, D]``, lse
  ``[B, q_len, H_q]``; a row that sees no key gives 0 and −∞. Graded against one-token decode
  (:func:`fdlib.reference_attention`) of each query token over its first n_{b,t} keys.
* ``lab08.cross_rank_merge(o, lse, group) -> (out, lse)``: every rank of a ``torch.distributed`` group holds
  the partial (O_rank, lse_rank) of its slice of the keys; return the merge over all ranks (the same on every rank):

  .. math:: \text{lse} = \log \sum_\text{rank} e^{\text{lse}_\text{rank}}, \qquad
            O = \sum_\text{rank} e^{\text{lse}_\text{rank} - \text{lse}}\, O_\text{rank}

  Graded on 2 CPU processes with the gloo backend (:func:`run_on_gloo`: forked with torch.multiprocessing,
  so a function defined in a notebook cell reaches the children as it is).
"""
from __future__ import annotations

import math
import os
import sys
import tempfile
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from fdlib.online_softmax import merge_lse
from fdlib.reference import reference_attention

from .core import (CheckFailure, LearnerError, TodoError, assert_close, call, check_case, exercise_stub,
                   expect_tensor, expect_tuple, randn, with_likely_cause)

LIMITS = "lab08.causal_limits"
VERIFY = "lab08.verify_attention"
MERGE = "lab08.cross_rank_merge"

LIMITS_STUB = exercise_stub(LIMITS, '''
@exercise("lab08.causal_limits")
def causal_limits(cache_seqlens, q_len):
    """How many keys each new query token sees: an int64 tensor [B, q_len].

    cache_seqlens: [B] lengths L_b, the q_len new tokens included (they are the cache's last q_len entries).
    Query t (t = 0 .. q_len-1) of sequence b sees keys 0 .. L_b - q_len + t; a sequence shorter than that
    leaves early queries nothing to see (0, never negative).
    """
    # TODO: one line with torch.arange(q_len) and broadcasting; clamp at 0.
    todo("lab08.causal_limits")
''')

VERIFY_STUB = exercise_stub(VERIFY, '''
@exercise("lab08.verify_attention")
def verify_attention(q, k_cache, v_cache, cache_seqlens, scale):
    """Decode attention for q_len query tokens per sequence (speculative decoding's verify step), in float64.

    q: [B, q_len, H_q, D]; k_cache, v_cache: [B, L_max, H_kv, D] (H_q = group * H_kv, query head h reads
    KV head h // group); cache_seqlens: [B]; scale: multiplies q.k. Query t of sequence b sees keys
    0 .. L_b - q_len + t. Returns (out [B, q_len, H_q, D], lse [B, q_len, H_q]), both float64 on the CPU;
    a row that sees no key gives out = 0 and lse = -inf (no NaN).
    """
    # TODO: scores s[b, t, h, j] in float64, a mask from the per-row key limits (causal_limits), a stable
    #       softmax (subtract the row max, but not -inf), then P @ V and lse = log-sum-exp of the scores.
    todo("lab08.verify_attention")
''')

MERGE_STUB = exercise_stub(MERGE, '''
@exercise("lab08.cross_rank_merge")
def cross_rank_merge(o, lse, group=None):
    """Merge the partials of every rank of a torch.distributed process group; the same result on every rank.

    o: [B, H_q, D] float32, this rank's normalised output over its slice of the keys (0 where it saw none);
    lse: [B, H_q] float32, log-sum-exp of its scores (-inf where it saw no key). group: pass it to every
    collective (None: the default group). Returns (out [B, H_q, D], lse [B, H_q]) over all ranks' keys;
    a row that no rank saw gives 0 and -inf.
    """
    # TODO: collect every rank's (o, lse) (dist.all_gather into lists of dist.get_world_size(group) tensors),
    #       stack them, and merge them as in Lab 02 (weights e^(lse_rank - max), the max made finite).
    todo("lab08.cross_rank_merge")
''')


# ---------------------------------------------------------------------------------------------- references
def limits_reference(lens, q_len: int) -> torch.Tensor:
    """n[b, t] = max(0, L_b - q_len + 1 + t), written as loops (independent of any tensor trick)."""
    rows = [[max(0, int(L) - q_len + 1 + t) for t in range(q_len)] for L in lens.tolist()]
    return torch.tensor(rows, dtype=torch.int64).reshape(len(rows), q_len)


def verify_reference(q, k, v, lens, scale=None):
    """(out [B, T, H_q, D], lse [B, T, H_q]) in float64: query t is one-token decode over its first n[b, t] keys."""
    T = q.shape[1]
    n = limits_reference(lens.cpu(), T)
    outs, lses = zip(*(reference_attention(q[:, t], k, v, n[:, t], scale) for t in range(T)))
    return torch.stack(outs, 1), torch.stack(lses, 1)


# ---------------------------------------------------------------------------------------------- causal_limits
def _limits_case(impl, lens, q_len, dtype=torch.int32):
    lens_t = torch.tensor(lens, dtype=dtype)
    what = f"causal_limits(cache_seqlens={lens}, q_len={q_len})"
    got = expect_tensor(call(impl, {"cache_seqlens": lens_t, "q_len": q_len}), what, shape=(len(lens), q_len))
    if got.is_floating_point() or got.dtype == torch.bool:
        raise CheckFailure(f"{what}: expected an integer tensor (int64), got {got.dtype}")
    want = limits_reference(lens_t, q_len)
    if not torch.equal(got.cpu().long(), want):
        bad = (got.cpu().long() != want).nonzero()[0].tolist()
        raise CheckFailure(f"{what}: at [b, t] = {bad} got {int(got[tuple(bad)])}, expected {int(want[tuple(bad)])} "
                           f"(query t sees keys 0 .. L_b - q_len + t); expected\n{want.tolist()}\ngot\n"
                           f"{got.cpu().long().tolist()}")
    return got


@check_case(LIMITS, "lengths 10, 7, 5 and q_len = 4: query t sees L_b - q_len + 1 + t keys", points=2)
def _l_main(impl, gen):
    _limits_case(impl, [10, 7, 5], 4)
    lens = torch.randint(8, 5000, (6,), generator=gen).tolist()
    _limits_case(impl, lens, 7)


@check_case(LIMITS, "q_len = 1 is plain decode: the lengths themselves")
def _l_one(impl, gen):
    _limits_case(impl, [1, 9, 300], 1)


@check_case(LIMITS, "sequences shorter than q_len (0, 1, 3 with q_len = 4): early queries see 0 keys, never < 0")
def _l_short(impl, gen):
    _limits_case(impl, [0, 1, 3, 4], 4)


@check_case(LIMITS, "int64 lengths in, an int64 [B, q_len] tensor out; q_len = 16")
def _l_dtype(impl, gen):
    got = _limits_case(impl, [16, 40], 16, dtype=torch.int64)
    if got.dtype != torch.int64:
        raise CheckFailure(f"expected dtype torch.int64 (counts of keys), got {got.dtype}")


# ---------------------------------------------------------------------------------------------- verify_attention
def _verify_case(impl, gen, B, T, H_q, H_kv, D, L, lens, dtype=torch.float64, q_scale=1.0, scale=None):
    scale = D ** -0.5 if scale is None else scale
    q = randn(gen, B, T, H_q, D, dtype=dtype, scale=q_scale)
    k = randn(gen, B, L, H_kv, D, dtype=dtype)
    v = randn(gen, B, L, H_kv, D, dtype=dtype)
    lens_t = torch.tensor(lens, dtype=torch.int32)
    what = f"verify_attention(B={B}, q_len={T}, H_q={H_q}, H_kv={H_kv}, D={D}, lens={lens}, {dtype})"
    got = expect_tuple(call(impl, {"q": q, "k_cache": k, "v_cache": v, "cache_seqlens": lens_t, "scale": scale}),
                       what, 2, "out, lse")
    out = expect_tensor(got[0], f"{what}: out", shape=(B, T, H_q, D), dtype=torch.float64)
    lse = expect_tensor(got[1], f"{what}: lse", shape=(B, T, H_q), dtype=torch.float64)
    ref_o, ref_l = verify_reference(q, k, v, lens_t, scale)
    n = limits_reference(lens_t, T)
    if bool(torch.isnan(out).any()):
        b, t = (int(i) for i in torch.isnan(out).nonzero()[0][:2])
        raise CheckFailure(f"{what}: out has NaN at sequence {b}, query {t} (it sees {int(n[b, t])} keys); a row "
                           f"with no key must give 0, not NaN")
    for t in range(T):
        assert_close(out[:, t], ref_o[:, t], f"{what}: out of query token t={t} (sees {n[:, t].tolist()} keys)",
                     1e-9, 1e-9)
        assert_close(lse[:, t], ref_l[:, t], f"{what}: lse of query token t={t} (sees {n[:, t].tolist()} keys)",
                     1e-9, 1e-9)


@check_case(VERIFY, "q_len = 4, GQA 8:2, ragged lengths 37, 12, 4: causal among the new tokens", points=2)
def _v_main(impl, gen):
    _verify_case(impl, gen, B=3, T=4, H_q=8, H_kv=2, D=16, L=37, lens=[37, 12, 4])


@check_case(VERIFY, "q_len = 1 is one-token decode (fdlib.reference_attention); q_len = 16 on a longer cache")
def _v_one(impl, gen):
    _verify_case(impl, gen, B=2, T=1, H_q=4, H_kv=4, D=8, L=20, lens=[20, 3])
    _verify_case(impl, gen, B=2, T=16, H_q=4, H_kv=1, D=8, L=50, lens=[50, 17])


@check_case(VERIFY, "sequences shorter than q_len (0, 1, 2 with q_len = 3): rows with no key give 0 and -inf, no NaN")
def _v_short(impl, gen):
    _verify_case(impl, gen, B=4, T=3, H_q=2, H_kv=1, D=8, L=9, lens=[0, 1, 2, 9])


@check_case(VERIFY, "group 3 (H_q = 6, H_kv = 2), D = 80, fp16 inputs; logits of ±1000s (e^s overflows float64)")
def _v_odd(impl, gen):
    _verify_case(impl, gen, B=2, T=5, H_q=6, H_kv=2, D=80, L=23, lens=[23, 9], dtype=torch.float16)
    _verify_case(impl, gen, B=2, T=2, H_q=2, H_kv=2, D=16, L=12, lens=[12, 5], scale=300.0)


# ---------------------------------------------------------------------------------------------- gloo runner
class GlooRunError(RuntimeError):
    """A forked rank failed or the group timed out; the message says which rank and why."""


def _rank_entry(rank, world, store, out_dir, fn, args, timeout_s):
    """Body of one forked rank: a gloo group over a file store, fn(rank, world, *args), the result saved."""
    sys.stdout = sys.stderr = open(os.devnull, "w")   # the parent's streams (e.g. a notebook's) are not ours
    torch.set_num_threads(1)
    path = os.path.join(out_dir, f"rank{rank}.pt")
    try:
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=timeout_s))
        try:
            res = {"ok": fn(rank, world, *args)}
        finally:
            dist.destroy_process_group()
    except (TodoError, NotImplementedError) as e:
        res = {"todo": str(e) or "implement this exercise"}
    except CheckFailure as e:
        res = {"fail": str(e)}
    except BaseException as e:  # noqa: BLE001 - reported by the parent as a ❌ line
        tb = [f for f in traceback.extract_tb(e.__traceback__) if "fdlib/course/grading" not in f.filename
              and "site-packages" not in f.filename]
        where = f" (in {tb[-1].name}, line {tb[-1].lineno}: {(tb[-1].line or '').strip()})" if tb else ""
        res = {"error": f"{type(e).__name__}: {e}"[:500] + where}
    try:
        torch.save(res, path)
    except Exception as e:  # noqa: BLE001 - e.g. an unpicklable return value
        torch.save({"error": f"the result could not be saved: {type(e).__name__}: {e}"[:300]}, path)


def run_on_gloo(fn, world: int = 2, args=(), timeout_s: float = 60.0) -> list:
    """Run ``fn(rank, world, *args)`` in ``world`` forked CPU processes joined in a gloo process group; return
    each rank's return value (list by rank). Raises :class:`TodoError` if a rank hit a TODO stub,
    :class:`CheckFailure` if a rank's check failed, :class:`GlooRunError` for anything else (an exception,
    a hang past ``timeout_s``)."""
    if not (dist.is_available() and dist.is_gloo_available()):
        raise GlooRunError("this PyTorch has no torch.distributed gloo backend")
    if "fork" not in mp.get_all_start_methods():
        raise GlooRunError("these checks fork processes (the learner's function must reach them as it is); "
                           "this platform cannot fork")
    with tempfile.TemporaryDirectory(prefix="fdlib-gloo-") as tmp:
        store = os.path.join(tmp, "store")
        ctx = mp.start_processes(_rank_entry, args=(world, store, tmp, fn, args, max(5.0, timeout_s - 5)),
                                 nprocs=world, join=False, start_method="fork")
        t0 = time.monotonic()
        try:
            while not ctx.join(timeout=0.1):
                if time.monotonic() - t0 > timeout_s:
                    raise GlooRunError(f"the {world} ranks did not finish within {timeout_s:g} s (does every rank "
                                       f"call the same collectives, in the same order?)")
        except mp.ProcessExitedException as e:
            raise GlooRunError(f"a rank process died: {e}") from None
        except mp.ProcessRaisedException as e:
            raise GlooRunError(f"a rank raised: {str(e).strip().splitlines()[-1]}") from None
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
        results = []
        for r in range(world):
            path = os.path.join(tmp, f"rank{r}.pt")
            if not os.path.exists(path):
                raise GlooRunError(f"rank {r} ended without a result")
            results.append(torch.load(path, weights_only=False))
    for r, res in enumerate(results):
        if "todo" in res:
            raise TodoError(res["todo"])
    for r, res in enumerate(results):
        if "fail" in res:
            raise CheckFailure(f"rank {r}: {res['fail']}")
        if "error" in res:
            raise LearnerError(f"rank {r}: your function raised {res['error']}")
    return [res["ok"] for res in results]


# ---------------------------------------------------------------------------------------------- cross_rank_merge
def _merge_rank(rank, world, impl, o_all, lse_all):
    """One rank: call the learner's merge on this rank's partial (inputs must come back unchanged)."""
    o, lse = o_all[rank].clone(), lse_all[rank].clone()
    got = call(impl, {"o": o, "lse": lse}, {"group": dist.group.WORLD})
    if isinstance(got, (tuple, list)):
        got = tuple(t.detach().cpu() if isinstance(t, torch.Tensor) else t for t in got)
    return got


def _merge_case(impl, o_all, lse_all, what, want=None):
    """Every rank's result vs the float64 lse merge of the stacked partials (or ``want``); all ranks agree."""
    world = o_all.shape[0]
    B, H_q, D = o_all.shape[1:]
    results = run_on_gloo(_merge_rank, world, (impl, o_all, lse_all))
    ref_o, ref_l = want if want is not None else merge_lse(o_all.double(), lse_all.double(), dim=0)
    for r, got in enumerate(results):
        w = f"{what}, rank {r} of {world}"
        out, lse = expect_tuple(got, w, 2, "out, lse")
        expect_tensor(out, f"{w}: out", shape=(B, H_q, D))
        expect_tensor(lse, f"{w}: lse", shape=(B, H_q))
        try:
            assert_close(out, ref_o, f"{w}: out", 1e-5, 1e-5)
            assert_close(lse, ref_l, f"{w}: lse", 1e-5, 1e-6)
        except CheckFailure as e:
            raise CheckFailure(with_likely_cause(str(e), (out, lse), _merge_mistakes(o_all, lse_all, r))) from None
    return results


def _merge_mistakes(o_all, lse_all, rank) -> list:
    """[(why, (out, lse))]: what the known wrong merges return on these partials (None: says nothing of it)."""
    weights = "weigh each rank's O_rank by e^(lse_rank − m) / Σ e^(lse − m) over all ranks, m the largest lse_rank"
    ref_o, ref_l = merge_lse(o_all.double(), lse_all.double(), dim=0)
    nobody = torch.isneginf(lse_all).all(0)
    nan_rows = torch.where(nobody[..., None], torch.full_like(ref_o, math.nan), ref_o)
    w = torch.exp(lse_all.float())                                  # no max subtracted: overflows at lse ~ 89
    no_max = (w[..., None] * o_all.float()).sum(0) / w.sum(0)[..., None]
    return [
        ("out is this rank's own partial: nothing combined the ranks; gather every rank's (O_rank, lse_rank) "
         "with dist.all_gather, or all-reduce the weighted sums", (o_all[rank], None)),
        (f"out is the plain average of the ranks' partials, as if each had seen as many keys: {weights}, so a "
         f"rank whose keys weigh more counts more", (o_all.double().mean(0), None)),
        ("lse is the largest lse_rank: the merged lse is m + log Σ_rank e^(lse_rank − m)",
         (None, lse_all.double().amax(0))),
        ("lse is the mean of the lse_rank: the merged lse is m + log Σ_rank e^(lse_rank − m)",
         (None, lse_all.double().mean(0))),
        ("rows that no rank saw (every lse_rank = −inf) come out NaN, e^(−inf − (−inf)) or 0/0: use m = 0 where "
         "the largest lse_rank is −inf, and return out = 0, lse = −inf where the weights sum to 0",
         (nan_rows, None) if bool(nobody.any()) else None),
        ("the weights e^(lse_rank) overflow float32 (inf/inf = NaN) for large lse: subtract the largest lse_rank "
         "before exponentiating", (no_max, None) if bool(torch.isinf(w).any()) else None),
    ]


@check_case(MERGE, "2 ranks on gloo, random partials (B = 3, H_q = 4, D = 16): the lse-weighted merge on every rank",
            timeout_s=90, points=2)
def _m_main(impl, gen):
    o = randn(gen, 2, 3, 4, 16)
    lse = randn(gen, 2, 3, 4, scale=3.0)
    _merge_case(impl, o, lse, "random partials")


@check_case(MERGE, "a rank with nothing to read for some rows (lse = -inf), and rows no rank saw: 0 and -inf, no NaN",
            timeout_s=90)
def _m_empty(impl, gen):
    o = randn(gen, 2, 2, 3, 8)
    lse = randn(gen, 2, 2, 3)
    lse[1, 0, :2] = -math.inf            # rank 1 saw no key of these rows
    lse[0, 1, 1] = -math.inf             # rank 0 saw none of this one
    lse[:, 1, 2] = -math.inf             # nobody saw this row
    o = torch.where(torch.isneginf(lse)[..., None], torch.zeros_like(o), o)
    _merge_case(impl, o, lse, "empty partials")


@check_case(MERGE, "lse of +1000 and -1000 (e^lse over- and underflows float32): weights relative to the max",
            timeout_s=90)
def _m_large(impl, gen):
    o = randn(gen, 2, 1, 4, 8)
    lse = torch.tensor([[[1000.0, -1000.0, 88.0, 5.0]], [[999.0, -1001.0, 95.0, -300.0]]])
    _merge_case(impl, o, lse, "large |lse|")


def _slice_rank(rank, world, impl, q, k, v, lens, bounds):
    """One rank: the float64 reference partial of its key slice (float32 in), merged by the learner's function."""
    a, b = bounds[rank], bounds[rank + 1]
    local = (lens.long() - a).clamp(0, b - a)
    o, lse = reference_attention(q, k[:, a:b], v[:, a:b], local)
    got = call(impl, {"o": o.float(), "lse": lse.float()}, {"group": dist.group.WORLD})
    if isinstance(got, (tuple, list)):
        got = tuple(t.detach().cpu() if isinstance(t, torch.Tensor) else t for t in got)
    return got


@check_case(MERGE, "two key slices [0, 13) and [13, 37) of real caches (a sequence only on rank 0, GQA 4:2): "
                   "merged = attention over the whole cache", timeout_s=90)
def _m_slices(impl, gen):
    B, L, H_q, H_kv, D = 3, 37, 4, 2, 16
    q, k, v = randn(gen, B, H_q, D), randn(gen, B, L, H_kv, D), randn(gen, B, L, H_kv, D)
    lens = torch.tensor([37, 9, 20])
    results = run_on_gloo(_slice_rank, 2, (impl, q, k, v, lens, [0, 13, L]))
    ref_o, ref_l = reference_attention(q, k, v, lens)
    for r, got in enumerate(results):
        w = f"attention over slices [0, 13) and [13, 37), lengths {lens.tolist()}, rank {r}"
        out, lse = expect_tuple(got, w, 2, "out, lse")
        expect_tensor(out, f"{w}: out", shape=(B, H_q, D))
        assert_close(out, ref_o, f"{w}: out", 2e-5, 2e-5)
        assert_close(lse, ref_l, f"{w}: lse", 2e-5, 1e-6)
