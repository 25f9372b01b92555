"""fdlib.hf given the same inputs as HF's sdpa with its DynamicCache (left-padded prompts, then decode steps)
gives the same logits, with and without explicit ``position_ids``; the comparison is sharp enough to see
positions that differ (float32, Triton's interpreter on the CPU)."""
from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install -e '.[hf]')")

import fdlib.hf  # noqa: E402
from fdlib import runtime  # noqa: E402
from fdlib.hf import DecodeCache, cache_kwarg  # noqa: E402
from hf_steps import max_rel_err, teacher_forced  # noqa: E402

pytestmark = pytest.mark.skipif(runtime.MODE == "gpu", reason="the float32 CPU comparison (tests/test_hf.py has "
                                "the bf16 GPU one)")
LENGTHS, STEPS = [40, 20, 50], 4


@pytest.fixture(scope="module")
def case():
    fdlib.hf.register()
    torch.manual_seed(21)
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                   max_position_embeddings=256, pad_token_id=0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    g = torch.Generator().manual_seed(22)
    T = max(LENGTHS)
    ids = torch.zeros(len(LENGTHS), T, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, n in enumerate(LENGTHS):
        ids[b, T - n:] = torch.randint(3, 128, (n,), generator=g)
        mask[b, T - n:] = 1
    forced = torch.randint(3, 128, (len(LENGTHS), STEPS), generator=g)
    return model, ids, mask, forced


def run(case, impl, positions):
    model, ids, mask, forced = case
    cache = (DecodeCache(model.config, len(LENGTHS), max(LENGTHS) + STEPS, dtype=torch.float32) if impl == "fdlib"
             else transformers.DynamicCache(config=model.config))
    return teacher_forced(model, impl, cache, ids, mask, forced, positions, key=cache_kwarg(model))


@pytest.mark.parametrize("positions", ["none", "mask"])
def test_same_inputs_same_logits_as_sdpa(case, positions):
    """Every step's last-token logits within 1e-5 (of their max) of sdpa's with HF's DynamicCache, when both are
    given the same positions: none (derived from the cache, as generate() does) or counted over real tokens."""
    err = max_rel_err(run(case, "fdlib", positions), run(case, "sdpa", positions))
    assert float(err.max()) < 1e-5, f"positions={positions}: step errors {err.tolist()}"


def test_the_comparison_sees_a_difference_in_positions(case):
    """Decode steps given positions that do not continue the prompt's (hf_steps' "mixed": what comparing fdlib
    fed explicit positions with a generate() that derived its own amounts to) differ far beyond the tolerance
    at every decode step, on sdpa alone and across fdlib and sdpa; the prompt's own logits do not."""
    mixed, want = run(case, "sdpa", "mixed"), run(case, "sdpa", "none")
    assert float(max_rel_err(mixed, want)[0]) < 1e-5
    assert float(max_rel_err(mixed, want)[1:].min()) > 1e-3
    assert float(max_rel_err(run(case, "fdlib", "mixed"), want)[1:].min()) > 1e-3
