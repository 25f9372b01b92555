"""``python -m fdlib.bench --generate``: refused without a GPU unless --quick; a quick CPU run times the tiny
model's variants that run on a CPU, checks their logits against HF's default, writes a loadable file marked as
CPU numbers; the targets and the table from records."""
from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("transformers", reason="transformers is not installed (pip install -e '.[hf]')")

from fdlib import runtime  # noqa: E402
from fdlib.bench.__main__ import main  # noqa: E402
from fdlib.bench.generate import GPU_ONLY, format_generate_table, targets  # noqa: E402

cpu_only = pytest.mark.skipif(runtime.MODE == "gpu", reason="checks the CPU behaviour")


@cpu_only
def test_refused_without_a_gpu_and_bad_variants(tmp_path, capsys):
    assert main(["--generate", "--out", str(tmp_path), "--no-progress"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err
    assert main(["--generate", "--quick", "--variants", "hf_dynamic,vllm", "--out", str(tmp_path)]) == 2
    assert "variants: unknown ['vllm']" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


@cpu_only
def test_quick_cpu_run_writes_cpu_numbers(tmp_path):
    assert main(["--generate", "--quick", "--batches", "2", "--contexts", "20", "--steps", "1", "--warmup-steps",
                 "0", "--no-ceiling", "--out", str(tmp_path), "--name", "g", "--no-progress"]) == 0
    res = json.loads((tmp_path / "g.json").read_text())
    assert res["kind"] == "generate" and res["provenance"]["mode"] == "interpreter"
    assert res["provenance"]["transformers"] and res["provenance"]["command"].startswith("python -m fdlib.bench")
    assert res["settings"]["numbers"].startswith("CPU")
    recs = {r["variant"]: r for r in res["records"]}
    assert set(recs) == {"hf_dynamic", "hf_static", "hf_static_compiled", "fdlib_eager", "fdlib_graph"}
    for name, r in recs.items():
        if name in GPU_ONLY:
            assert r["status"] == "skipped" and "CUDA" in r["reason"]
            continue
        assert r["status"] == "ok", r
        assert r["ms_per_step"] > 0 and r["tokens_per_s"] == pytest.approx(2e3 / r["ms_per_step"])
        assert r["logits_reference"] == "hf_dynamic" and r["logits_err"] < 1e-5 and r["argmax_agree"] == 1.0
        assert r["bound_ms"] is None   # no GPU ceiling, no bound
    assert recs["fdlib_eager"]["lengths_after"] == 20 + 1 + 0 + 1   # the first step, no warmup, one timed step
    assert "| 2 | 20 | fdlib_eager |" in (tmp_path / "g.md").read_text()
    assert main(["--generate", "--quick", "--out", str(tmp_path), "--name", "g", "--no-progress"]) == 2   # no overwrite


def test_targets_and_table_from_records():
    """fdlib_graph's targets: ≥ 7× hf_dynamic at (1, 128k), ≥ 1.3× hf_static_compiled at 128k, ≥ 85% of the
    bound; each decided only where the run has the peers."""
    recs = [dict(B=1, context=131072, variant="fdlib_graph", status="ok", ms_per_step=8.0, tokens_per_s=125.0,
                 bound_ms=7.2, frac_of_bound=0.9, vs_hf_default=8.1, vs_hf_static_compiled=1.2, logits_err=1e-3,
                 bytes_per_step=1),
            dict(B=8, context=8192, variant="fdlib_graph", status="ok", ms_per_step=5.0, tokens_per_s=1600.0,
                 bound_ms=4.0, frac_of_bound=0.8, logits_err=1e-3, bytes_per_step=1),
            dict(B=8, context=131072, variant="fdlib_graph", status="skipped", reason="memory")]
    got = {(t["B"], t["context"], t["target"].split("×")[-1].strip() if "×" in t["target"] else "bound"): t["met"]
           for t in targets(recs)}
    assert got == {(1, 131072, "hf_dynamic tokens/s"): True, (1, 131072, "hf_static_compiled tokens/s"): False,
                   (1, 131072, "bound"): True, (8, 8192, "bound"): False}
    res = dict(provenance=dict(device="NVIDIA H200", mode="gpu", torch="t", triton="t", transformers="5.17.0",
                               date_utc="d", command="c"),
               settings=dict(numbers="GPU"), ceiling=dict(tbs=4.6), records=recs, targets=targets(recs),
               model=dict(shape="s", dtype="bfloat16", weight_bytes_per_step=15e9))
    table = format_generate_table(res)
    assert "| 1 | 131072 | fdlib_graph | 8.00 | 125.0 | 7.20 | 90% | 8.10 | 1.20 | 1.0e-03 |" in table
    assert "| 8 | 131072 | fdlib_graph | skipped: memory" in table
    assert "| 1 | 131072 | ≥ 1.3× hf_static_compiled tokens/s | 1.20× | no |" in table


@pytest.mark.skipif(not (torch.cuda.is_available() and runtime.MODE == "gpu"), reason="needs a CUDA GPU")
@pytest.mark.gpu
def test_quick_gpu_run_has_every_variant(tmp_path):
    """On a GPU, --quick runs every variant (CUDA graphs and torch.compile included) and the logits agree (float32
    model; fdlib's fp32 tl.dot may use TF32, hence 1e-2)."""
    assert main(["--generate", "--quick", "--batches", "2", "--contexts", "40", "--variants",
                 "hf_dynamic,hf_static,hf_static_compiled,fdlib_eager,fdlib_graph,fdlib_compiled",
                 "--out", str(tmp_path), "--name", "g", "--no-progress"]) == 0
    res = json.loads((tmp_path / "g.json").read_text())
    for r in res["records"]:
        assert r["status"] == "ok", r
        assert r["logits_err"] < 1e-2, r
    graph = next(r for r in res["records"] if r["variant"] == "fdlib_graph")
    assert graph["replay_vs_eager_err"] < 1e-3
