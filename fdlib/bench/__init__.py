"""The benchmark harness behind ``python -m fdlib.bench`` (run ``python -m fdlib.bench --help``).

From a notebook::

    from fdlib.bench import run_benchmark, load_results, plot_results, format_table
    res = run_benchmark(quick=True)                  # live (tiny shapes in the interpreter)
    res = load_results("results/h200/", kind="bench")  # or the newest recorded GPU run
    print(format_table(res)); plot_results(res)

Pieces: :mod:`.timing` (eager / CUDA-graph timing, L2 handling), :mod:`.methods` (fdlib methods and SDPA
peers), :mod:`.ceiling` (the measured read ceiling), :mod:`.harness` (shapes, correctness, the run and the
splits sweep), :mod:`.report` (tables, files, plots).
"""
from .harness import run_benchmark, run_sweep, shape_grid  # noqa: F401
from .report import device_slug, format_table, load_results, plot_results, write_results  # noqa: F401

__all__ = ["run_benchmark", "run_sweep", "shape_grid", "format_table", "load_results", "plot_results",
           "write_results", "device_slug"]
