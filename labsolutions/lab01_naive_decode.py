"""Lab 01 reference solution: naive decode attention."""
import math  # noqa: F401  (available to the solution, as in the notebook)

import torch

from fdlib.grading import solution


@solution("lab01.naive_attention")
def naive_attention(q, k_cache, v_cache, cache_seqlens, scale):
    """out [B, H_q, D] (q's dtype) and lse [B, H_q] (float32) of one query token per sequence."""
    B, H_q, D = q.shape
    L_max, H_kv = k_cache.shape[1], k_cache.shape[2]
    group = H_q // H_kv
    # Query head h reads KV head h // group: repeat each KV head `group` times along the head axis.
    k = k_cache.float().repeat_interleave(group, dim=2)          # [B, L_max, H_q, D]
    v = v_cache.float().repeat_interleave(group, dim=2)
    s = torch.einsum("bhd,blhd->bhl", q.float(), k) * scale      # scores [B, H_q, L_max]
    pos = torch.arange(L_max, device=q.device)
    valid = pos[None, :] < cache_seqlens.to(q.device).long()[:, None]   # [B, L_max]
    s = s.masked_fill(~valid[:, None, :], float("-inf"))
    lse = torch.logsumexp(s, dim=-1)                             # [B, H_q], -inf for empty rows
    m = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    p = torch.exp(s - m[..., None])                              # softmax weights (0 for masked keys)
    out = torch.einsum("bhl,blhd->bhd", p, v)
    return out.to(q.dtype), lse
