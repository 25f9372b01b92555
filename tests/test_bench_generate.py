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
from fdlib.bench.generate import (GPU_ONLY, LLAMA3_8B, TINY, config_record, format_generate_table,  # noqa: E402
                                  llama_config, targets)

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
    assert set(recs) == {"hf_dynamic", "hf_static", "hf_static_compiled", "fdlib_eager", "fdlib_graph",
                         "fdlib_compiled"}
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


def test_the_config_is_recorded_on_this_transformers():
    """The record of the full-size config names its rotary base wherever this transformers keeps it (5.x:
    ``rope_parameters``, not an attribute), the other keys as given; the same function the run calls."""
    for quick, shape in ((False, LLAMA3_8B), (True, TINY)):
        rec = config_record(llama_config(quick), shape)
        assert rec["rope_theta"] == shape["rope_theta"]
        assert {k: rec[k] for k in shape} == shape
    assert config_record(llama_config(False), ["no_such_key"])["no_such_key"] is None


@cpu_only
def test_quick_run_records_the_config_and_profiles_a_step(tmp_path, capsys):
    """--quick with --profile: the file records the model's config (rope_theta included) through the path the
    full-size run takes; one step of HF's default and of fdlib's eager step is profiled (CPU ops: the
    categories and the gaps add up to the span), written beside the results; a progress line per row."""
    assert main(["--generate", "--quick", "--batches", "1", "--contexts", "20", "--steps", "1", "--warmup-steps",
                 "0", "--no-ceiling", "--variants", "hf_dynamic,fdlib_eager,fdlib_graph", "--profile", "--out",
                 str(tmp_path), "--name", "p"]) == 0
    err = capsys.readouterr().err
    assert "[1/3" in err and "B=1 context=20 hf_dynamic:" in err and "[3/3" in err and "fdlib_graph: skipped" in err
    res = json.loads((tmp_path / "p.json").read_text())
    assert res["model"]["config"]["rope_theta"] == TINY["rope_theta"]
    assert [(p["variant"], p["context"]) for p in res["profiles"]] == [("hf_dynamic", 20), ("fdlib_eager", 20)]
    for p in res["profiles"]:
        s = p["summary"]
        assert s["kernels"] > 0 and s["span_ms"] > 0
        assert sum(s["ms"].values()) == pytest.approx(s["span_ms"], rel=1e-6)
    cats = {p["variant"]: p["summary"]["ms"] for p in res["profiles"]}
    assert cats["hf_dynamic"]["cat"] > 0 and cats["fdlib_eager"]["cat"] == 0   # DynamicCache concatenates
    prof = json.loads((tmp_path / "p-profile.json").read_text())
    assert prof["kind"] == "generate-profile" and prof["profiles"] == res["profiles"]
    assert "| 1 | 20 | hf_dynamic |" in (tmp_path / "p-profile.md").read_text()


@cpu_only
def test_budget_skips_the_rest_and_kv8_is_guarded(tmp_path, monkeypatch):
    """Cases run in the order given; a spent time budget records the cases left as skipped (a partial file is
    written after each case and removed once the results are); the 8-bit row is skipped with a reason where
    DecodeCache takes no kv_dtype."""
    import fdlib.bench.generate as gen
    monkeypatch.setattr(gen, "accepts_kv_dtype", lambda: False)
    assert main(["--generate", "--quick", "--cases", "1:20,1:24", "--steps", "1",
                 "--warmup-steps", "0", "--no-ceiling", "--variants", "hf_dynamic", "--kv-dtype", "float8_e4m3fn",
                 "--budget-s", "0", "--out", str(tmp_path), "--name", "b", "--no-progress"]) == 0
    res = json.loads((tmp_path / "b.json").read_text())
    assert res["settings"]["variants"] == ["hf_dynamic", "fdlib_graph_kv8"]
    assert res["settings"]["cases"] == [[1, 20], [1, 24]]
    assert [(r["context"], r["variant"]) for r in res["records"]] == [
        (20, "hf_dynamic"), (20, "fdlib_graph_kv8"), (24, "hf_dynamic"), (24, "fdlib_graph_kv8")]
    assert "DecodeCache takes no kv_dtype" in res["records"][1]["reason"] or "budget" in res["records"][1]["reason"]
    first = {r["variant"]: r for r in res["records"] if r["context"] == 20}
    assert first["hf_dynamic"]["status"] == "ok" or "budget" in first["hf_dynamic"]["reason"]
    later = [r for r in res["records"] if r["context"] == 24]
    assert later and all(r["status"] == "skipped" and "budget" in r["reason"] for r in later)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b.json", "b.md"]


@cpu_only
def test_kv8_row_fills_through_the_prefill_path(monkeypatch):
    """The 8-bit row's cache is filled by the cache's own prefill writes (an 8-bit cache quantizes there); on a
    16-bit cache that path leaves the same K/V and lengths as the direct copy."""
    import transformers
    from fdlib.bench.generate import fill_decode_cache
    from fdlib.hf import DecodeCache
    cfg = llama_config(True)
    caches = [DecodeCache(cfg, 2, 32, device="cpu", dtype=torch.float32) for _ in range(2)]
    fill_decode_cache(caches[0], 2, 20, seed=3)
    fill_decode_cache(caches[1], 2, 20, seed=3, through_prefill=True)
    for a, b in zip(caches[0].layers, caches[1].layers):
        assert torch.equal(a.keys[:, :20], b.keys[:, :20]) and torch.equal(a.values[:, :20], b.values[:, :20])
    assert caches[1].lengths.tolist() == [20, 20] and int(caches[1].columns) == 20
    assert transformers is not None


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


def test_profile_sorts_a_gpu_trace_by_kind():
    """A Chrome trace of one step (device kernels, their launches, the cache-update range): a cat launched inside
    the cache's update is the cat, rotary's small cat is elementwise, the idle time between kernels is the gaps;
    the categories add up to the span."""
    from fdlib.bench.stepprofile import CACHE_UPDATE, summarize, trace_spans

    def k(name, ts, dur, corr):
        return dict(ph="X", cat="kernel", name=name, ts=ts, dur=dur, args=dict(correlation=corr))

    def launch(ts, corr, cat="cuda_runtime"):
        return dict(ph="X", cat=cat, name="cudaLaunchKernel", ts=ts, dur=1, args=dict(correlation=corr))
    events = [dict(ph="X", cat="user_annotation", name=CACHE_UPDATE, ts=0, dur=5),
              launch(1, 1), launch(6, 2), launch(7, 3), launch(8, 4, "cuda_driver"), launch(9, 5),
              k("void at::native::CatArrayBatchedCopy<...>", 10, 50, 1),            # the cache's cat
              k("void at::native::CatArrayBatchedCopy<...>", 60, 2, 2),             # rotary's halves
              k("nvjet_tst_64x8_64x16_4x1_v_bz_TNT", 70, 20, 3),
              k("stage1_kernel", 90, 8, 4),
              k("void at::native::vectorized_elementwise_kernel<...>", 100, 4, 5)]
    s = summarize(trace_spans(dict(traceEvents=events), device=True))
    assert s["span_ms"] == pytest.approx(0.094)
    assert s["ms"]["cat"] == pytest.approx(0.050) and s["ms"]["gemm"] == pytest.approx(0.020)
    assert s["ms"]["attention"] == pytest.approx(0.008) and s["ms"]["elementwise"] == pytest.approx(0.006)
    assert s["ms"]["gaps"] == pytest.approx(0.010) and s["kernels"] == 5
    assert sum(s["ms"].values()) == pytest.approx(s["span_ms"])
    assert s["top"][0]["category"] == "cat" and s["top"][0]["ms"] == pytest.approx(0.050)
