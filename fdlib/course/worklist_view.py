"""What a work list does to a ragged batch, drawn: each row cut into its pieces, and the pieces in launch order.

* :func:`draw_work_list` -- a matplotlib figure of two panels for lengths and a plan (chunk, S, tiles of
  N = BLOCK_N keys; the arguments of :func:`fdlib.worklist.work_list`):
  left, every row's keys cut into its n(L) pieces (:mod:`fdlib.worklist`); right, the items in the order the
  launch's programs take them, longest rows first, each bar a piece's keys in its row's colour;
* :func:`worklist_explorer` -- the same picture for a length histogram (constant, uniform or Zipf-like lengths of
  mean L, as the SM-occupancy explorer draws them), redrawn as sliders move.

Everything here is the Python model; no kernel runs, so the picture is the same on every machine.
"""
from __future__ import annotations

import io

from .. import worklist
from .explorer import DIST_OPTIONS as DISTS
from .explorer_model import ragged_lengths
from .timeline import SEQUENCE_COLORS

__all__ = ["draw_work_list", "worklist_explorer", "items_of"]

LEGEND_ROWS = 8
"""A legend names each row up to this many rows; beyond, colours only repeat."""
LABELLED_ROWS = 16
"""Up to this many rows, each row's tick and piece count are written; beyond, they would overlap."""


def items_of(buf, lengths, chunk: int, S: int, N: int) -> list[worklist.Item]:
    """The items of a work-list buffer ``[count, b·S + j, ...]`` (a kernel's output), with their keys."""
    buf = [int(x) for x in buf]
    out = []
    for code in buf[1:1 + buf[0]]:
        b, j = divmod(code, S)
        L = int(lengths[b])
        c, n = worklist.piece_keys(L, chunk, S, N), worklist.pieces(L, chunk, S, N)
        out.append(worklist.piece(b, j, L, c, n))
    return out


def _color(b: int) -> str:
    return SEQUENCE_COLORS[b % len(SEQUENCE_COLORS)]


def draw_work_list(lengths, chunk: int, S: int, N: int, items=None, fig=None, title: str | None = None):
    """The figure: left, rows b in batch order, each bar a row's keys cut at its pieces' ends (white lines), the
    count n(L_b) above it; right, programs i = 0, 1, ... in launch order, bar i the keys of item i, coloured by its
    row. ``items``: the list to draw (default: :func:`fdlib.worklist.work_list`, the model). Returns the figure."""
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    lengths = [int(L) for L in lengths]
    items = worklist.work_list(lengths, chunk, S, N) if items is None else list(items)
    if fig is None:
        fig = plt.figure(figsize=(9.5, 3.4))
    fig.clear()
    left, right = fig.subplots(1, 2, gridspec_kw={"width_ratios": [1, 1.6]})
    B = len(lengths)
    top = max(max(lengths, default=0), 1)
    for b, L in enumerate(lengths):
        left.bar(b, L, width=0.8, color=_color(b), edgecolor="none")
        for it in items:
            if it.b == b and it.j > 0:                       # a cut between two pieces of the row
                left.plot([b - 0.4, b + 0.4], [it.start, it.start], color="white", linewidth=1.2)
        n = sum(1 for it in items if it.b == b)
        if B <= LABELLED_ROWS:
            left.annotate(str(n), (b, L), xytext=(0, 2), textcoords="offset points", ha="center", va="bottom",
                          fontsize=8, color="0.3")
    left.set_xlabel("row b (batch order)")
    left.set_ylabel("keys of the row (white: cuts)")
    left.set_title("rows cut into pieces" + (" (the number: n(L))" if B <= LABELLED_ROWS else ""), fontsize=9.5)
    left.set_ylim(0, top * 1.12)
    left.grid(axis="x", visible=False)
    if B <= LABELLED_ROWS:
        left.set_xticks(range(B))
    for i, it in enumerate(items):
        right.bar(i, max(it.end - it.start, 0), width=0.8, color=_color(it.b), edgecolor="none")
    empty = [i for i, it in enumerate(items) if it.end == it.start]
    if empty:                                                # an empty row's piece: no keys, still a program
        right.plot(empty, [0] * len(empty), linestyle="none", marker="x", color="0.25", markersize=5,
                   clip_on=False, label="empty row: no keys, one program")
    right.set_xlabel("program i (launch order)")
    right.set_ylabel("keys in the piece")
    right.set_title(f"the work list: {len(items)} items, longest rows first", fontsize=9.5)
    right.set_xlim(-0.7, max(len(items), 1) - 0.3)
    right.xaxis.set_major_locator(MaxNLocator(integer=True))     # programs are whole numbers
    right.grid(axis="x", visible=False)
    from matplotlib.patches import Patch
    handles = [Patch(facecolor=_color(b), label=f"row {b}: L={L}") for b, L in enumerate(lengths)] \
        if B <= LEGEND_ROWS else [Patch(facecolor=_color(0), label="colour: row b")]
    if empty:
        handles += right.get_legend_handles_labels()[0]
    right.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0, fontsize=8)
    fig.suptitle(title or f"The work list of {B} rows: chunk = {chunk} keys, S = {S}, BLOCK_N = {N} keys "
                          f"(the Python model, no device)", fontsize=10.5)
    return fig


# ---------------------------------------------------------------------------------------------- the widget
B_OPTIONS = [1, 2, 4, 8, 16, 32, 64]
L_OPTIONS = [64, 128, 256, 512, 1024, 2048, 4096, 8192]
CHUNK_OPTIONS = [16, 32, 64, 128, 256, 512]
S_OPTIONS = [1, 2, 4, 8, 16]
BUDGET_OPTIONS = [0, 4, 8, 16, 32, 64]
"""Items a batch's pieces are sized to (:func:`fdlib.worklist.balanced_chunk`); 0: each row cut by its own length."""


def room_text(B: int, S: int, budget: int) -> str:
    """The list's room as the readout states it: ``budget + B = n`` where that is the smaller bound, else
    ``B·S = n`` (:func:`fdlib.worklist.capacity`)."""
    room = worklist.capacity(B, S, budget)
    return f"{'budget + B' if budget and room == budget + B else 'B·S'} = {room}"


def _make_class():
    import ipywidgets as W
    from matplotlib.figure import Figure     # not pyplot: the notebook's own figures and backend stay as they are

    class WorkListExplorer(W.VBox):
        """Sliders (B, mean L, histogram, chunk, S) and the figure of :func:`draw_work_list`; ``lengths`` and
        ``items`` hold what is drawn."""

        def __init__(self, B=8, L=1024, dist="uniform", chunk=64, S=4, N=16, seed=0, budget=0):
            ragged_lengths(dist, 1, 1)               # ValueError naming dist unless it is a histogram
            style, lay = {"description_width": "135px"}, W.Layout(width="405px")   # every label whole
            pick = lambda opts, v: sorted(set(opts) | {v})           # noqa: E731
            self.N, self.seed = int(N), int(seed)
            self.controls = {
                "B": W.SelectionSlider(options=pick(B_OPTIONS, B), value=B, description="batch B", style=style,
                                       layout=lay),
                "L": W.SelectionSlider(options=pick(L_OPTIONS, L), value=L, description="mean length L",
                                       style=style, layout=lay),
                "dist": W.Dropdown(options=DISTS, value=dist, description="lengths", style=style,
                                   layout=W.Layout(width="470px")),          # its longest choice whole
                "chunk": W.SelectionSlider(options=pick(CHUNK_OPTIONS, chunk), value=chunk,
                                           description="chunk (keys)", style=style, layout=lay),
                "S": W.SelectionSlider(options=pick(S_OPTIONS, S), value=S, description="S (most pieces)",
                                       style=style, layout=lay),
                "budget": W.SelectionSlider(options=pick(BUDGET_OPTIONS, budget), value=budget,
                                            description="budget (0: by row)", style=style, layout=lay),
            }
            self.readout = W.HTML()
            self.image = W.Image(format="png", layout=W.Layout(width="800px"))
            self.image.add_class("fdlib-worklist-image")
            self._fig = Figure(figsize=(9.5, 3.4), dpi=80, layout="constrained")   # drawn into the image only
            for w in self.controls.values():
                w.observe(lambda _change: self.update(), names="value")
            super().__init__([W.HBox([W.VBox(list(self.controls.values())), self.readout]), self.image])
            self.add_class("fdlib-worklist-explorer")
            self.update()

        def update(self):
            c = {k: w.value for k, w in self.controls.items()}
            self.lengths = ragged_lengths(c["dist"], c["B"], c["L"], self.seed)
            self.items = worklist.work_list(self.lengths, c["chunk"], c["S"], self.N, c["budget"])
            cut = (f"sized by the batch: a budget of {c['budget']} items, unit "
                   f"{worklist.balanced_chunk(self.lengths, c['chunk'], c['budget'], self.N)} keys" if c["budget"]
                   else "each row cut by its own length")
            draw_work_list(self.lengths, c["chunk"], c["S"], self.N, self.items, fig=self._fig,
                           title=f"{c['dist']}, mean {c['L']}, B = {c['B']}; {cut}")
            buf = io.BytesIO()
            self._fig.savefig(buf, format="png", bbox_inches="tight")   # the legend and labels outside the axes too
            self.image.value = buf.getvalue()
            pieces = [sum(1 for it in self.items if it.b == b) for b in range(len(self.lengths))]
            keys = [it.end - it.start for it in self.items]
            self.readout.value = (
                f"<div style='font-family:monospace;font-size:0.9em;line-height:1.4'>"
                f"{len(self.items)} items (room for {room_text(len(self.lengths), c['S'], c['budget'])})<br>"
                f"pieces per row: {min(pieces)} to {max(pieces)}<br>"
                f"keys per piece: {min(keys)} to {max(keys)}<br>"
                f"first program: row {self.items[0].b}, {keys[0]} keys</div>")

    return WorkListExplorer


_CLS = None


def worklist_explorer(**defaults):
    """The work-list explorer (an ipywidgets VBox): ``B, L`` (the mean length), ``dist`` (``"constant"``,
    ``"uniform"`` or ``"zipf"``), ``chunk, S, N, seed``, and ``budget``: 0, each row cut by its own length (what
    Lab 06's exercise lists), or the items a batch's pieces are sized to (what ``method="worklist"`` runs,
    :func:`fdlib.worklist.balanced_chunk`)."""
    global _CLS
    if _CLS is None:
        _CLS = _make_class()
    return _CLS(**defaults)
