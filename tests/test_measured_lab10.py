"""Lab 10's "what the GPU shows" views on a synthetic results file (tests/data/lab10/generate.json, the schema of
fdlib.bench.generate, made-up numbers) and on a real --quick file: their tables and captions say what the file
says; no file gives a note, not a traceback."""
from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import pytest  # noqa: E402

from fdlib.course.measured import show_measured  # noqa: E402
from fdlib.course.measured.lab10 import GENERATE, best_rows, move_gains, show  # noqa: E402

DATA = Path(__file__).parent / "data" / "lab10"


def _shown(name, results_dir=DATA):
    import matplotlib.pyplot as plt
    shown = show_measured(name, results_dir=results_dir, show=False)
    plt.close(shown.figure)
    return shown


def test_generate_table_is_the_files_records():
    data = json.loads((DATA / GENERATE).read_text())
    shown = _shown("generate")
    ok = [r for r in data["records"] if r["status"] == "ok"]
    assert len(shown.table) == len(ok) + 1
    row = next(r for r in shown.table if r[:2] == ["B=1, 128k", "fdlib_compiled"])
    assert row[2:] == ["10.00", "100.0", "8.00", "80%", "5.00"]
    assert shown.caption.startswith("tests/data/lab10/generate.json: recorded on Synthetic GPU, 2026-12-06 00:00 "
                                    "UTC; ")
    assert "read ceiling 4.50 TB/s measured in the same run" in shown.caption
    assert "B=1, 128k: fdlib_compiled 5.00× HF default, 80% of the bound" in shown.caption
    assert "Not run: B=8, 128k (every variant): needs ~130.0 GiB beside the weights, 60.0 GiB free." in shown.caption
    ax = shown.figure.get_axes()[0]
    assert ax.get_yscale() == "log" and len(ax.patches) == 6 * 2   # six variants, two cases that ran


def test_moves_are_the_ratios_of_the_steps():
    data = json.loads((DATA / GENERATE).read_text())
    gains = {(g["context"], g["move"]): g["gain"] for g in move_gains(data)}
    assert gains[(131072, "the cache in place")] == pytest.approx(0.5)           # 50 ms -> 100 ms: slower
    assert gains[(131072, "the kernel with lengths")] == pytest.approx(100 / 16)
    assert gains[(8192, "one captured graph")] == pytest.approx(9 / 5)
    assert gains[(8192, "fused small kernels")] == pytest.approx(5 / 4)
    table = _shown("moves").table
    assert ["B=1, 128k", "the cache in place", "hf_dynamic", "hf_static", "0.50×"] in table
    assert [r["variant"] for r in best_rows(data)] == ["fdlib_compiled", "fdlib_compiled"]


def test_step_profile_rows_add_up_to_the_span():
    shown = _shown("step_profile")
    assert shown.table[0] == ["step", "span ms", "cat", "attention", "gemm", "cache write", "elementwise", "gaps"]
    hf = shown.table[1]
    assert hf[:3] == ["B=1, 128k: hf_dynamic", "49.00", "40.00 (82%)"]
    assert "torch.profiler" in shown.caption and "gaps: the time no kernel runs" in shown.caption


def test_no_file_gives_a_note(tmp_path, capsys):
    assert show("generate", results_dir=tmp_path) is None
    out = capsys.readouterr().out
    assert "No recorded GPU run to show yet" in out and "generate.json" in out and "Traceback" not in out
    with pytest.raises(FileNotFoundError, match="generate.json"):
        _shown("generate", tmp_path)


def test_a_quick_cpu_file_is_shown(tmp_path):
    """The views read what the benchmark writes: a --quick CPU run (GPU-only rows skipped, no bound)."""
    pytest.importorskip("transformers")
    from fdlib.bench.__main__ import main
    assert main(["--generate", "--quick", "--batches", "1", "--contexts", "20", "--steps", "1", "--warmup-steps",
                 "0", "--no-ceiling", "--variants", "hf_dynamic,hf_static,fdlib_eager", "--profile", "--out",
                 str(tmp_path), "--name", "generate", "--no-progress"]) == 0
    gen = _shown("generate", tmp_path)
    assert [r[1] for r in gen.table[1:]] == ["hf_dynamic", "hf_static", "fdlib_eager"]
    assert "CPU wall clock" in gen.caption and "read ceiling not measured" in gen.caption
    assert [r[1] for r in _shown("moves", tmp_path).table[1:]] == ["the cache in place", "the kernel with lengths"]
    assert [r[0] for r in _shown("step_profile", tmp_path).table[1:]] == ["B=1, 20: hf_dynamic", "B=1, 20: fdlib_eager"]


# ---------------------------------------------------------------------------------------------- the recorded run
def _recorded():
    """The committed run the lesson's default views read (results/h200, else the newest device folder)."""
    from fdlib.course.measured.lab10 import findings
    try:
        return findings()
    except FileNotFoundError:
        pytest.skip("no recorded generate run is committed")


def _says_profile(f) -> None:
    """Section 2: 'HF's default step is mostly gaps ... Its cat costs more than its attention, but both are small
    beside the gaps. fdlib's captured step has few gaps left: its time goes mostly to the matrix products (GEMMs),
    then to the small elementwise kernels and the attention'; a step is 'more than a thousand' launches."""
    for key, per in f["shares"].items():
        hf, graph = per["hf_dynamic"], per["fdlib_graph"]
        assert f["largest"][key]["hf_dynamic"] == "gaps" and hf["gaps"] > 0.5
        assert hf["cat"] > hf["attention"] and max(hf["cat"], hf["attention"]) < hf["gaps"] / 5
        assert f["largest"][key]["fdlib_graph"] == "gemm" and graph["gaps"] < 0.1
        rest = sorted((c for c in graph if c not in ("gemm", "gaps")), key=graph.get, reverse=True)
        assert rest[:2] == ["elementwise", "attention"]
        assert min(f["kernels"][key]["hf_dynamic"], f["kernels"][key]["fdlib_graph"]) > 1000


def _says_moves(f) -> None:
    """Section 3: 'each of the three moves makes the step faster, and the captured graph gains the most ... The
    compiled step runs about half as many kernels as the captured one, yet it is slower: its cache writes take a far
    larger share of the step, and its longest kernel is a copy'."""
    for key, g in f["gains"].items():
        three = {m: g[m] for m in ("the cache in place", "the kernel with lengths", "one captured graph")}
        assert min(three.values()) > 1 and max(g, key=g.get) == "one captured graph"
        assert g["fused small kernels"] < 1
        k, sh = f["kernels"][key], f["shares"][key]
        assert 0.4 < k["fdlib_compiled"] / k["fdlib_graph"] < 0.6
        assert sh["fdlib_compiled"]["cache write"] > 5 * sh["fdlib_graph"]["cache write"]
        assert "copy" in f["top"][key]["fdlib_compiled"]["name"]


def _says_steps(f) -> None:
    """Section 4: 'fdlib's captured step is the fastest, several times faster than HF's default, and reaches more
    than half of the bound. HF's static cache, compiled, beats fdlib's eager step'."""
    for per in f["steps"].values():
        ms = {v: r["ms_per_step"] for v, r in per.items()}
        assert min(ms, key=ms.get) == "fdlib_graph"
        assert per["fdlib_graph"]["vs_hf_default"] > 3 and 0.5 < per["fdlib_graph"]["frac_of_bound"] < 1
        assert ms["hf_static_compiled"] < ms["fdlib_eager"]


def test_what_the_lesson_says_of_the_recorded_run_holds():
    f = _recorded()
    assert f["cases"] and f["shares"]
    _says_profile(f)
    _says_moves(f)
    _says_steps(f)


def test_the_statements_can_fail():
    """The same checks on the synthetic file (made-up numbers that say otherwise) fail."""
    from fdlib.course.measured.lab10 import findings
    f = findings(DATA)
    for says in (_says_moves, _says_steps):
        with pytest.raises(AssertionError):
            says(f)
