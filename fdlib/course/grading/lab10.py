r"""Checks for Lab 10: the KV cache appended in place, at each sequence's own length.

* ``lab10.append_kv(k_cache, v_cache, lengths, k_new, v_new, real)``: a preallocated cache ``[B, L_max, H_kv,
  D]`` holds :math:`L_b` = ``lengths[b]`` keys of sequence b at positions :math:`0 \dots L_b - 1`. A step brings
  q_len new tokens a sequence, ``k_new``/``v_new`` ``[B, q_len, H_kv, D]``, of which the first :math:`p_b` may be left
  padding (``real[b, t]`` False; ``real`` None: no padding). Each real token goes to the next free position of
  its own sequence:

  .. math:: \text{token } t \ (t \ge p_b) \ \to\ \text{position } L_b + t - p_b, \qquad
            L_b \mathrel{+}= q_\text{len} - p_b

  in place (the cache and ``lengths`` are written, nothing is returned). Positions before :math:`L_b` are not
  touched; nothing after the new length is ever read, so what lies there does not matter.

The checks compare with the same rule written as loops (:func:`append_reference`) and name the usual causes of a
mismatch: tokens appended at the longest length instead of each sequence's own, padding written into the cache
before it is skipped, lengths advanced twice or by the padded count.
"""
from __future__ import annotations

import torch

from .core import CheckFailure, call, check_case, exercise_stub, randn

APPEND = "lab10.append_kv"

APPEND_STUB = exercise_stub(APPEND, '''
@exercise("lab10.append_kv")
def append_kv(k_cache, v_cache, lengths, k_new, v_new, real=None):
    """Append each sequence's new tokens to a preallocated cache, in place, at that sequence's own length.

    k_cache, v_cache: [B, L_max, H_kv, D]; sequence b holds lengths[b] keys at positions 0 .. lengths[b]-1.
    lengths: [B] int32, advanced in place. k_new, v_new: [B, q_len, H_kv, D], q_len new tokens a sequence,
    in order. real: None (every new token is real) or bool [B, q_len], False for left padding (the first p_b
    tokens of b).
    Real token t of sequence b goes to position lengths[b] + t - p_b; then lengths[b] += q_len - p_b.
    Returns None.
    """
    # TODO: p = q_len - real.sum(1); for the real (b, t) pairs (real.nonzero), the position lengths[b] + t - p[b];
    #       write k_new/v_new there with one indexed assignment each; then lengths += real.sum(1).
    todo("lab10.append_kv")
''')


# ---------------------------------------------------------------------------------------------- reference
def append_reference(k_cache, v_cache, lengths, k_new, v_new, real=None):
    """The rule as loops, on copies: (k_cache, v_cache, lengths) after the append."""
    k, v, lens = k_cache.clone(), v_cache.clone(), lengths.clone()
    B, T = k_new.shape[:2]
    for b in range(B):
        pos = int(lens[b])
        for t in range(T):
            if real is None or bool(real[b, t]):
                k[b, pos], v[b, pos] = k_new[b, t], v_new[b, t]
                pos += 1
        lens[b] = pos
    return k, v, lens


def _pads(real, B, T) -> list[int]:
    return [0] * B if real is None else [int(T - real[b].sum()) for b in range(B)]


def _diagnose(b, got_k, k_new, old, pads, T) -> str:
    """Why sequence b's keys are wrong: where its first real new token went, or what lies at its length."""
    L, p = int(old[b]), pads[b]
    first = k_new[b, p]
    found = [j for j in range(got_k.shape[1]) if torch.equal(got_k[b, j], first)]
    longest = int(old.max())
    if found and found[0] != L:
        j = found[0]
        if j == longest != L:
            return (f"its first real new token is at cache position {j}, the longest sequence's length; each sequence "
                    f"appends at its own length ({L} here)")
        if p and j == L + p and not any(torch.equal(got_k[b, L + i], k_new[b, t]) for i in range(p) for t in range(p)):
            return (f"its first real new token is at cache position {j} = length {L} + {p}, not {L}: the pad tokens "
                    f"were skipped but still counted, leaving {p} empty positions; real token t goes to "
                    f"L_b + t - p_b, not L_b + t")
        if p and j == L + p:
            return (f"its first real new token is at cache position {j} = length {L} + {p} pad tokens, not {L}: the "
                    f"padding was written into the cache; skip the {p} pad tokens before writing (token t goes to "
                    f"L_b + t - p_b)")
        return f"its first real new token is at cache position {j}, expected {L} (its length before the step)"
    if p and any(torch.equal(got_k[b, L], k_new[b, t]) for t in range(p)):
        return (f"position {L} (its length) holds a pad token: skip the {p} pad tokens before writing (token t "
                f"goes to L_b + t - p_b)")
    if not found:
        return f"its first real new token (t = {p}) is nowhere in the cache"
    return "its new tokens are not in order after its first one"


def _append_case(impl, gen, B, T, H_kv, D, L_max, lens, pads, dtype=torch.float32, with_mask=True):
    k = randn(gen, B, L_max, H_kv, D, dtype=dtype)
    v = randn(gen, B, L_max, H_kv, D, dtype=dtype)
    k_new = randn(gen, B, T, H_kv, D, dtype=dtype)
    v_new = randn(gen, B, T, H_kv, D, dtype=dtype)
    real = None
    if with_mask:
        real = torch.arange(T)[None, :] >= torch.tensor(pads)[:, None]              # zeros, then ones
    lengths = torch.tensor(lens, dtype=torch.int32)
    old = lengths.clone()
    want_k, want_v, want_l = append_reference(k, v, lengths, k_new, v_new, real)
    ptrs = (k.data_ptr(), v.data_ptr(), lengths.data_ptr())
    what = f"append_kv(B={B}, q_len={T}, lengths {lens}, pad tokens {pads if with_mask else 'none (real=None)'})"
    args = {"k_cache": k, "v_cache": v, "lengths": lengths, "k_new": k_new, "v_new": v_new, "real": real}
    out = call(impl, args, outputs=("k_cache", "v_cache", "lengths"))
    if out is not None and not isinstance(out, torch.Tensor):
        raise CheckFailure(f"{what}: expected None (the cache and lengths are written in place), got "
                           f"{type(out).__name__}")
    if (k.data_ptr(), v.data_ptr(), lengths.data_ptr()) != ptrs:
        raise CheckFailure(f"{what}: the cache or lengths tensors were replaced; write into them in place")
    if lengths.dtype != torch.int32:
        raise CheckFailure(f"{what}: lengths changed dtype to {lengths.dtype}; keep int32 (add in place)")
    pads_ = _pads(real, B, T)
    for b in range(B):
        L = int(old[b])
        if not (torch.equal(k[b, :L], want_k[b, :L]) and torch.equal(v[b, :L], want_v[b, :L])):
            j = next(j for j in range(L) if not (torch.equal(k[b, j], want_k[b, j])
                                                 and torch.equal(v[b, j], want_v[b, j])))
            raise CheckFailure(f"{what}: sequence {b}: position {j} changed, but it held one of the {L} keys "
                               f"already in the cache (write from position lengths[b] = {L} on)")
    for b in range(B):
        n = int(want_l[b])
        if not torch.equal(k[b, :n], want_k[b, :n]):
            raise CheckFailure(f"{what}: sequence {b}'s keys 0..{n - 1} are wrong: "
                               f"{_diagnose(b, k, k_new, old, pads_, T)}")
        if not torch.equal(v[b, :n], want_v[b, :n]):
            raise CheckFailure(f"{what}: sequence {b}'s values 0..{n - 1} are wrong (its keys are right: write "
                               f"v_new where k_new goes)")
    if not torch.equal(lengths, want_l):
        got, want = lengths.tolist(), want_l.tolist()
        real_n = [T - p for p in pads_]
        if got == [o + 2 * n for o, n in zip(old.tolist(), real_n)]:
            cause = "they were advanced twice: add each sequence's number of real tokens once"
        elif got == [o + T for o in old.tolist()] and any(pads_):
            cause = "they were advanced by q_len, padding included: add q_len - p_b (the real tokens)"
        elif got == old.tolist():
            cause = "they were not advanced: add each sequence's number of real tokens in place"
        else:
            cause = "each sequence advances by its number of real tokens, q_len - p_b"
        raise CheckFailure(f"{what}: lengths after the step {got}, expected {want}: {cause}")


@check_case(APPEND, "a prompt of 6 tokens, left-padded by 0, 3 and 5, into caches holding 4, 0 and 9 keys",
            points=2)
def _a_main(impl, gen):
    _append_case(impl, gen, B=3, T=6, H_kv=2, D=8, L_max=40, lens=[4, 0, 9], pads=[0, 3, 5])


@check_case(APPEND, "a decode step (q_len = 1, real=None) on ragged lengths 7, 1, 12, 3", points=2)
def _a_decode(impl, gen):
    _append_case(impl, gen, B=4, T=1, H_kv=2, D=16, L_max=32, lens=[7, 1, 12, 3], pads=[0] * 4, with_mask=False)


@check_case(APPEND, "a first prompt into an empty cache: lengths 0, pads 2 and 0; then three decode steps")
def _a_empty(impl, gen):
    _append_case(impl, gen, B=2, T=5, H_kv=1, D=8, L_max=24, lens=[0, 0], pads=[2, 0])
    for lens in ([3, 5], [4, 6], [5, 7]):
        _append_case(impl, gen, B=2, T=1, H_kv=1, D=8, L_max=24, lens=lens, pads=[0, 0], with_mask=False)


@check_case(APPEND, "a verify step of q_len = 4 tokens without padding (real all True), bf16 cache, GQA heads")
def _a_verify(impl, gen):
    _append_case(impl, gen, B=2, T=4, H_kv=4, D=8, L_max=30, lens=[11, 20], pads=[0, 0], dtype=torch.bfloat16)
