"""A model's last-token logits over a prompt and then one forced token at a time, the same inputs for every
attention implementation and cache: what the fdlib.hf tests compare (tests/test_hf.py, test_hf_positions.py)."""
from __future__ import annotations

import torch


def positions_from_mask(mask: torch.Tensor) -> torch.Tensor:
    """Each column's position counted over the real tokens before it (left padding not counted; pads get 0)."""
    return (mask.long().cumsum(1) - 1).clamp_min(0)


def teacher_forced(model, impl: str, cache, ids, mask, forced, positions: str = "none", key=None):
    """Last-token logits ``[n + 1, B, vocab]``: the prompt ``ids`` (with its 2D ``mask``), then each column of
    ``forced`` ``[B, n]`` as one decode step (the mask grown by one column), through ``impl`` and ``cache``.

    ``positions``: ``"none"`` passes no ``position_ids`` (the model derives them from the cache, as
    ``generate()`` does), ``"mask"`` passes :func:`positions_from_mask` to every call, and ``"mixed"`` passes
    none with the prompt and :func:`positions_from_mask` with the decode steps: for a left-padded row its new
    tokens then sit closer to the prompt than they are (rotary embeddings see relative positions, so a shift of
    a whole row changes nothing, but this does)."""
    model.set_attn_implementation(impl)
    kw = {key or "past_key_values": cache, "use_cache": True}
    m, outs = mask, []

    def pos(m, T):
        if positions == "none" or (positions == "mixed" and T > 1 and m is mask):
            return None
        return positions_from_mask(m)[:, -T:]
    with torch.no_grad():
        outs.append(model(input_ids=ids, attention_mask=m, position_ids=pos(m, ids.shape[1]), **kw).logits[:, -1])
        for i in range(forced.shape[1]):
            m = torch.cat([m, torch.ones_like(m[:, :1])], 1)
            outs.append(model(input_ids=forced[:, i:i + 1], attention_mask=m, position_ids=pos(m, 1),
                              **kw).logits[:, -1])
    return torch.stack(outs)


def max_rel_err(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """Per step: max over rows of max |got - want| / max |want| (logits ``[steps, B, vocab]``)."""
    got, want = got.float(), want.float()
    return ((got - want).abs().amax(-1) / want.abs().amax(-1)).amax(-1)
