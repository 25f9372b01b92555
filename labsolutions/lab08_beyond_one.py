"""Lab 08 reference solutions: the causal key limits of q_len query tokens, their attention in float64, and the
merge of (O, lse) partials across the ranks of a process group."""
import torch

from fdlib.grading import solution


@solution("lab08.causal_limits")
def causal_limits(cache_seqlens, q_len):
    """n[b, t] = max(0, L_b - q_len + 1 + t): query t sees keys 0 .. L_b - q_len + t."""
    t = torch.arange(q_len, device=cache_seqlens.device)
    return (cache_seqlens.long()[:, None] - q_len + 1 + t[None, :]).clamp_min(0)          # [B, q_len]


@solution("lab08.verify_attention")
def verify_attention(q, k_cache, v_cache, cache_seqlens, scale):
    """Masked attention of q [B, q_len, H_q, D] over the cache in float64: query t sees its first n[b, t] keys."""
    B, T, H_q, D = q.shape
    L, H_kv = k_cache.shape[1], k_cache.shape[2]
    group = H_q // H_kv
    q64 = q.double().cpu().reshape(B, T, H_kv, group, D)
    k64, v64 = k_cache.double().cpu(), v_cache.double().cpu()
    s = torch.einsum("bthgd,blhd->bthgl", q64, k64) * scale                  # [B, T, H_kv, group, L]
    n = causal_limits(cache_seqlens.cpu(), T)                               # [B, T] keys each query sees
    seen = torch.arange(L)[None, None, :] < n[:, :, None]                   # [B, T, L]
    s = s.masked_fill(~seen[:, :, None, None, :], float("-inf"))
    lse = torch.logsumexp(s, dim=-1)                                        # -inf where nothing is seen
    m = torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)        # a finite reference point
    p = torch.exp(s - m[..., None])                                         # softmax weights (0 where masked)
    v64 = v64.masked_fill(~(torch.arange(L)[None, :] < cache_seqlens.cpu()[:, None])[:, :, None, None], 0.0)
    out = torch.einsum("bthgl,blhd->bthgd", p, v64)
    return out.reshape(B, T, H_q, D), lse.reshape(B, T, H_q)


@solution("lab08.cross_rank_merge")
def cross_rank_merge(o, lse, group=None):
    """All-gather every rank's (o, lse), then Lab 02's merge of the stacked partials on every rank."""
    import torch.distributed as dist
    from fdlib.online_softmax import merge_lse
    world = dist.get_world_size(group)
    os_ = [torch.empty_like(o) for _ in range(world)]
    lses = [torch.empty_like(lse) for _ in range(world)]
    dist.all_gather(os_, o.contiguous(), group=group)
    dist.all_gather(lses, lse.contiguous(), group=group)
    return merge_lse(torch.stack(os_), torch.stack(lses), dim=0)            # the same on every rank
