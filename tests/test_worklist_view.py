"""Lab 06's work-list picture and explorer draw fdlib.worklist's list: one bar per item in launch order, its height
the piece's keys, its colour its row's; the same picture on every run."""
from __future__ import annotations

import io

import pytest

from fdlib import worklist
from fdlib.course.timeline import SEQUENCE_COLORS
from fdlib.course.worklist_view import draw_work_list, items_of

matplotlib = pytest.importorskip("matplotlib")
matplotlib.use("Agg")
from matplotlib.colors import to_hex  # noqa: E402

LENGTHS, CHUNK, S, N = [700, 90, 0, 300, 300, 1500, 17, 260], 64, 4, 16


def _png(fig) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()


def test_items_of_reads_a_buffer_back():
    items = worklist.work_list(LENGTHS, CHUNK, S, N)
    buf = worklist.encode(items, S) + [-1] * 5                 # room past the count is not read
    assert items_of(buf, LENGTHS, CHUNK, S, N) == items


def test_the_bars_are_the_list():
    import matplotlib.pyplot as plt
    fig = draw_work_list(LENGTHS, CHUNK, S, N)
    left, right = fig.axes[:2]
    items = worklist.work_list(LENGTHS, CHUNK, S, N)
    bars = right.patches
    assert [round(p.get_x() + p.get_width() / 2) for p in bars] == list(range(len(items)))
    assert [p.get_height() for p in bars] == [it.end - it.start for it in items]
    assert [to_hex(p.get_facecolor()) for p in bars] == [SEQUENCE_COLORS[it.b % len(SEQUENCE_COLORS)]
                                                          for it in items]
    assert [p.get_height() for p in left.patches] == LENGTHS
    for ax in (left, right):
        assert "keys" in ax.get_ylabel() and ax.get_xlabel() and ax.get_title()
    assert "no device" in fig._suptitle.get_text()
    plt.close(fig)


def test_the_picture_is_the_same_on_every_run():
    import matplotlib.pyplot as plt
    a, b = draw_work_list(LENGTHS, CHUNK, S, N), draw_work_list(LENGTHS, CHUNK, S, N)
    assert _png(a) == _png(b)
    plt.close(a), plt.close(b)


def test_the_explorer_draws_the_histogram_it_is_set_to():
    pytest.importorskip("ipywidgets")
    from fdlib.course.explorer_model import ragged_lengths
    from fdlib.course.worklist_view import worklist_explorer
    w = worklist_explorer(B=8, L=512, dist="uniform", chunk=64, S=4)
    for key, value in (("dist", "zipf"), ("B", 32), ("S", 8), ("chunk", 128)):
        w.controls[key].value = value
        c = {k: x.value for k, x in w.controls.items()}
        assert w.lengths == ragged_lengths(c["dist"], c["B"], c["L"], 0)
        assert w.items == worklist.work_list(w.lengths, c["chunk"], c["S"], 16)
        assert w.image.value[:4] == b"\x89PNG" and f"{len(w.items)} items" in w.readout.value
    with pytest.raises(ValueError, match="dist"):
        worklist_explorer(dist="gauss")


def test_the_explorer_leaves_the_notebooks_figures_alone():
    """The explorer draws into its own Figure: pyplot's backend and open figures are as they were."""
    pytest.importorskip("ipywidgets")
    import matplotlib.pyplot as plt
    from fdlib.course import worklist_view
    backend, figures = matplotlib.get_backend(), plt.get_fignums()
    matplotlib.use("svg")
    try:
        worklist_view._CLS = None                 # build the widget class anew, as a fresh kernel does
        worklist_view.worklist_explorer(B=4, L=256)
        assert matplotlib.get_backend() == "svg" and plt.get_fignums() == figures
    finally:
        matplotlib.use(backend)


def test_the_explorer_shows_pieces_sized_by_the_batch():
    """budget > 0: the explorer draws the list ``method="worklist"`` runs (fdlib.worklist's balanced mode): one
    long row among short ones is cut into about its share of the budget, unlike budget 0."""
    pytest.importorskip("ipywidgets")
    from fdlib.course.worklist_view import worklist_explorer
    ex = worklist_explorer(B=8, L=1024, dist="zipf", chunk=16, S=16, N=16, budget=0)
    by_row = list(ex.items)
    ex.controls["budget"].value = 8
    assert ex.items == worklist.work_list(ex.lengths, 16, 16, 16, 8) != by_row
    assert "budget of 8 items" in ex._fig.texts[0].get_text()


def test_the_readout_names_the_bound_that_sets_the_room():
    """The readout's "room for X = n" is true arithmetic: budget + B where that is the smaller bound, else B·S
    (fdlib.worklist.capacity), and the list fits in it."""
    pytest.importorskip("ipywidgets")
    import re
    from fdlib.course.worklist_view import worklist_explorer
    ex = worklist_explorer(B=32, L=1024, dist="zipf", chunk=64, S=4, N=16, budget=0)
    for B, budget in ((32, 0), (32, 32), (8, 32), (8, 4), (1, 64)):
        ex.controls["B"].value, ex.controls["budget"].value = B, budget
        m = re.search(r"(\d+) items \(room for (budget \+ B|B·S) = (\d+)\)", ex.readout.value)
        assert m, ex.readout.value
        said = budget + B if m[2] == "budget + B" else B * 4
        assert int(m[3]) == said == worklist.capacity(B, 4, budget) and int(m[1]) <= said, (B, budget, m[0])


def test_the_programs_axis_has_whole_numbers():
    """Program i is a whole number: the launch-order axis never ticks 2.5."""
    import matplotlib.pyplot as plt
    from fdlib.course.explorer_model import ragged_lengths
    lengths = ragged_lengths("zipf", 8, 1024, 0)
    items = worklist.work_list(lengths, 64, 4, 16, 32)
    fig = draw_work_list(lengths, 64, 4, 16, items)
    fig.canvas.draw()
    right = fig.axes[1]
    assert right.get_xlabel().startswith("program i")
    ticks = [x for x in right.get_xticks() if right.get_xlim()[0] <= x <= right.get_xlim()[1]]
    assert len(ticks) >= 3 and all(float(x).is_integer() for x in ticks), ticks
    plt.close(fig)
