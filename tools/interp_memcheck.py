"""A memcheck for Triton's interpreter: every address a kernel loads or stores (where its mask is on) must lie in a
live tensor's storage. The interpreter reads host memory through raw pointers and checks nothing, so an address
past a tensor's end reads whatever lies there (or writes over it); compute-sanitizer does this on a GPU.

    python tools/interp_memcheck.py [--D 256] [--page 16] [--B 2] [--heads 16:2] [--L 1024] [--splits 8]
                                    [--methods unified,split] [--block-n 32] [--table-regs N] [--repeat N]

Runs ``fdlib.plan(..., method=M, num_splits=S).run`` on one batch in the interpreter, with the plan's tiles set to
BLOCK_N = ``--block-n`` keys (a GPU's tiles: 32 keys at D = 256; the interpreter's own are 16), checks every
masked and unmasked load and store and every atomic, and the result against float64. Prints each out-of-bounds
access (kernel line, address) and exits 1 if any. ``--gpu``: the same batch on the GPU with the plan's own tiles and no check of
its own (run it under ``compute-sanitizer --tool memcheck``).
"""
from __future__ import annotations

import argparse
import gc
import os
import sys

if __name__ == "__main__" and "--gpu" not in sys.argv[1:]:   # run as a script: the interpreter, unless --gpu
    os.environ.setdefault("FDLIB_INTERPRET", "1")
    os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
import torch  # noqa: E402

import fdlib  # noqa: E402,I001
from fdlib.kernels.config import TileConfig  # noqa: E402

KERNELS = os.path.join(os.path.dirname(os.path.abspath(fdlib.__file__)), "kernels")


class Storages:
    """Address ranges [start, end) of every live tensor's storage, refreshed when an address falls outside."""

    def __init__(self):
        self.checked = 0                      # addresses checked so far
        self.ranges = np.zeros((0, 2), np.uint64)
        self.refresh()

    def refresh(self):
        try:   # torch.compile's fake tensors hold no memory (and warn when asked for an address)
            from torch._subclasses.fake_tensor import FakeTensor
        except ImportError:
            FakeTensor = ()
        spans = set()
        for obj in gc.get_objects():
            try:
                if isinstance(obj, torch.Tensor) and not isinstance(obj, FakeTensor) and obj.device.type == "cpu":
                    s = obj.untyped_storage()
                    if s.nbytes():
                        spans.add((s.data_ptr(), s.data_ptr() + s.nbytes()))
            except Exception:  # noqa: BLE001 - a tensor without storage (meta, sparse) holds no address
                pass
        self.ranges = np.array(sorted(spans), np.uint64).reshape(-1, 2)

    def outside(self, addrs: np.ndarray, nbytes: int) -> np.ndarray:
        """The addresses of ``addrs`` whose ``nbytes`` bytes lie in no storage."""
        addrs = np.unique(addrs.astype(np.uint64))

        def miss(a):
            if not len(self.ranges):
                return a
            i = np.searchsorted(self.ranges[:, 0], a, side="right") - 1
            ok = (i >= 0) & (a + np.uint64(nbytes) <= self.ranges[np.maximum(i, 0), 1])
            return a[~ok]
        out = miss(addrs)
        if len(out):
            self.refresh()
            out = miss(out)
        return out


def kernel_line() -> str:
    f = sys._getframe(2)
    while f is not None:
        if os.path.dirname(os.path.abspath(f.f_code.co_filename)) == KERNELS:
            return f"{os.path.basename(f.f_code.co_filename)}:{f.f_lineno}"
        f = f.f_back
    return "?"


def install(report: list) -> Storages:
    """Wrap the interpreter's loads and stores; each access outside every storage goes to ``report``.
    ``uninstall(st)`` puts them back."""
    from triton.runtime.interpreter import InterpreterBuilder as B
    st = Storages()

    def check(what, ptrs, mask=None):
        data = np.asarray(ptrs.data).astype(np.uint64)
        if mask is not None:
            data = np.broadcast_to(data, np.shape(mask.data))[np.asarray(mask.data).astype(bool)]
        try:
            nbytes = max(1, ptrs.get_element_ty().primitive_bitwidth // 8)
        except AttributeError:
            nbytes = 1
        st.checked += data.size
        bad = st.outside(data.ravel(), nbytes)
        if len(bad):
            report.append(f"{what} at {kernel_line()}: {len(bad)} addresses outside every tensor, "
                          f"e.g. {int(bad[0]):#x}")

    def wrapped(original, what, at_ptr, at_mask):
        def op(self, *args, **kw):
            check(what, args[at_ptr], None if at_mask is None else args[at_mask])
            return original(self, *args, **kw)
        return op
    st.saved = {name: getattr(B, name) for name in WRAPPED}
    for name, (what, at_ptr, at_mask) in WRAPPED.items():
        setattr(B, name, wrapped(st.saved[name], what, at_ptr, at_mask))
    return st


WRAPPED = {"create_masked_load": ("load", 0, 1), "create_masked_store": ("store", 0, 2),
           "create_atomic_cas": ("atomic cas", 0, None), "create_atomic_rmw": ("atomic", 1, 3)}
"""The interpreter's memory operations checked, (what, the pointers' argument, the mask's or None) of each: its
unmasked loads and stores are masked ones with every lane on (``create_load``, ``create_store``), so they pass
here too; block pointers and tensor descriptors are not checked (fdlib's kernels use neither)."""


def uninstall(st: Storages) -> None:
    from triton.runtime.interpreter import InterpreterBuilder as B
    for name, fn in st.saved.items():
        setattr(B, name, fn)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--D", type=int, default=256)
    ap.add_argument("--page", type=int, default=16, help="page size (0: a contiguous cache)")
    ap.add_argument("--B", type=int, default=2)
    ap.add_argument("--heads", default="16:2")
    ap.add_argument("--L", type=int, default=1024)
    ap.add_argument("--ragged", action="store_true", help="lengths L, L-1, ..., not all L")
    ap.add_argument("--splits", type=int, default=8)
    ap.add_argument("--methods", default="unified,split")
    ap.add_argument("--block-n", type=int, default=32)
    ap.add_argument("--dtype", default="float16")
    ap.add_argument("--gpu", action="store_true", help="on the GPU, the plan's own tiles, no check of its own")
    ap.add_argument("--table-regs", type=int, default=None,
                    help="the unified plan's TABLE_REGS (block-table entries in registers; 0: none) instead of "
                    "its own, at any head dim")
    ap.add_argument("--repeat", type=int, default=1, help="run each plan this many times (a fault that comes "
                    "now and then)")
    args = ap.parse_args(argv)
    plan_module = sys.modules["fdlib.plan"]
    kept = plan_module.tile_config, plan_module.table_regs_for
    if not args.gpu:
        tile = TileConfig(args.block_n, 4, 3)
        plan_module.tile_config = lambda *a, **k: tile
    if args.table_regs is not None:   # at every head dim (the plan's own holds none above TABLE_REGS_MAX_D)
        plan_module.table_regs_for = lambda chunk, page, D: args.table_regs
    try:
        return _run(args)
    finally:
        plan_module.tile_config, plan_module.table_regs_for = kept


def _run(args) -> int:
    from fdlib.bench.ragged import _inputs
    try:
        hq, hk = (int(x) for x in args.heads.split(":"))
    except ValueError:
        raise SystemExit(f"--heads: expected H_q:H_kv (e.g. 16:2), got {args.heads!r}") from None
    lens = [max(1, args.L - i) for i in range(args.B)] if args.ragged else [args.L] * args.B
    shape = dict(dtype=args.dtype, B=args.B, H_q=hq, H_kv=hk, D=args.D)
    q, k, v, lens_t, bt = _inputs(shape, lens, args.page, 0)
    report: list[str] = []
    st = install(report) if not args.gpu else None
    bad = 0
    try:
        for method in args.methods.split(","):
            report.clear()
            checked = st.checked if st else 0
            L_max = k.shape[1] * (bt.shape[1] if bt is not None else 1)
            p = fdlib.plan(args.B, hq, hk, args.D, L_max, dtype=q.dtype, lengths=lens, method=method,
                           num_splits=args.splits, page_size=args.page or None)
            for _ in range(args.repeat):
                out = p.run(q, k, v, lens_t, block_table=bt)
            if args.gpu:
                torch.cuda.synchronize()
            ref = ref_out(q, k, v, lens, bt, args.page)
            err = float((out.double() - ref).norm() / ref.norm())
            d = p.decision
            print(f"{method}: {d.kernel} splits={d.splits} chunk={d.chunk} tile={d.tile} table_regs={d.table_regs} "
                  f"rel err {err:.2e}; {(st.checked if st else 0) - checked} addresses checked, {len(report)} "
                  f"accesses out of bounds")
            for r in sorted(set(report))[:20]:
                print("   ", r)
            bad += bool(report) or not err < 1e-2
    finally:
        if st is not None:
            uninstall(st)
    return 1 if bad else 0


def ref_out(q, k, v, lens, bt, page):
    """float64 attention of each row over its keys (gathered through the table where paged)."""
    B, Hq, D = q.shape
    outs = []
    for b in range(B):
        L = lens[b]
        if page:
            idx = bt[b, :-(-L // page)].long()
            kb, vb = k[idx].reshape(-1, *k.shape[2:])[:L], v[idx].reshape(-1, *v.shape[2:])[:L]
        else:
            kb, vb = k[b, :L], v[b, :L]
        Hk = kb.shape[1]
        kb = kb.double().repeat_interleave(Hq // Hk, dim=1)   # [L, Hq, D]
        vb = vb.double().repeat_interleave(Hq // Hk, dim=1)
        s = torch.einsum("hd,lhd->hl", q[b].double(), kb) / D ** 0.5
        outs.append(torch.einsum("hl,lhd->hd", s.softmax(-1), vb))
    return torch.stack(outs).to(q.device)


if __name__ == "__main__":
    raise SystemExit(main())
