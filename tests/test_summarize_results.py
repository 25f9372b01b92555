"""tools/summarize_results.py: the helpers behind SUMMARY.md's lines on the planner's runs, on small records made
here (not on the committed results, which change with every run)."""
import importlib.util
from pathlib import Path

import pytest

PATH = Path(__file__).resolve().parents[1] / "tools" / "summarize_results.py"


@pytest.fixture(scope="module")
def tool():
    spec = importlib.util.spec_from_file_location("summarize_results", PATH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def rec(method, us, kernel=None, splits=None, **shape):
    return {"method": method, "graph_us": us, "kernel": kernel, "splits": splits, "status": "ok", **shape}


def test_vs_fastest_takes_the_paths_that_ran(tool):
    m = {"auto": rec("auto", 10.2), "split": rec("split", 10.0), "unified": rec("unified", 12.0)}
    assert tool.vs_fastest(m) == pytest.approx(1.02)
    m["persistent"] = rec("persistent", 5.1)
    assert tool.vs_fastest(m) == pytest.approx(2.0)


def test_moved_names_each_shape_whose_plan_changed(tool):
    old = {"a": {"auto": rec("auto", 10.0, "unified", 16)}, "b": {"auto": rec("auto", 20.0, "split", 4)},
           "c": {"cudnn": rec("cudnn", 9.0)}}
    new = {"a": {"auto": rec("auto", 11.0, "unified", 11)}, "b": {"auto": rec("auto", 20.0, "split", 4)},
           "c": {"auto": rec("auto", 1.0, "unified", 1)}}
    line = tool.moved(new, old, lambda k: f"shape {k}")
    assert line.startswith("auto's plan differs from the earlier run's on 1 of 2 shapes: ")
    assert "shape a unified@16 10.0 -> unified@11 11.0 µs" in line and "shape b" not in line
    assert line.endswith(f"geometric mean {(1.1 * 1.0) ** 0.5:.3f}")


def test_grid_records_keeps_timed_successes(tool):
    shape = {"dtype": "float16", "B": 1, "H_q": 32, "H_kv": 8, "L": 512}
    res = {"records": [rec("auto", 5.0, **shape), {**rec("split", None, **shape)},
                       {**rec("unified", 4.0, **shape), "status": "FAIL"}]}
    assert list(tool.grid_records(res)[("float16", 1, 32, 8, 512)]) == ["auto"]
