"""Registers, spills, stack and shared memory of the kernels fdlib compiles for some shapes (GPU only).

    python tools/kernel_resources.py [--out FILE.json] [B:H_q:H_kv:D:L:method ...]

Each item plans and runs ``method`` (``invariant`` for ``batch_invariant=True``) once on random fp16 inputs;
then every kernel Triton compiled in this process is listed with what the driver reports when it loads it
(registers a thread, spilled bytes) and what ``cuobjdump -res-usage`` reads from its cubin (the stack frame), with
the constexprs that tell its variants apart. Default items: the short rows of a large batch and a long row of a
small one, through ``auto`` and the batch-invariant plan.
"""
from __future__ import annotations

import datetime
import json
import os
import re
import subprocess
import sys
import tempfile

import torch
import triton

import fdlib
from fdlib import kernels as _kernels  # noqa: F401  (the modules whose JIT functions are listed)

ITEMS = ["64:32:32:128:512:auto", "64:32:32:128:512:invariant", "4:32:8:128:8192:auto",
         "4:32:8:128:8192:invariant", "8:16:4:64:65536:auto"]
SHOWN = ("GROUP", "D", "BLOCK_N", "BLOCK_G", "PAGE", "ONE_CHUNK", "ALONE", "ROWS", "Q_LEN", "CHUNKS", "FOLD_C")


def run_item(item: str):
    B, Hq, Hkv, D, L, method = item.split(":")
    B, Hq, Hkv, D, L = map(int, (B, Hq, Hkv, D, L))
    kw = dict(batch_invariant=True) if method == "invariant" else dict(method=method)
    p = fdlib.plan(B, Hq, Hkv, D, L, dtype=torch.float16, device="cuda", **kw)
    q = torch.randn(B, Hq, D, device="cuda", dtype=torch.float16)
    k = torch.randn(B, L, Hkv, D, device="cuda", dtype=torch.float16)
    p.run(q, k, torch.randn_like(k), torch.full((B,), L, dtype=torch.int32, device="cuda"))
    torch.cuda.synchronize()
    return str(p)


def stack_bytes(cubin: bytes) -> int | None:
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        r = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True)
    m = re.search(r"STACK:(\d+)", r.stdout)
    return int(m.group(1)) if m else None


def compiled_kernels():
    from triton.runtime.jit import JITFunction
    seen = set()
    for mod in list(sys.modules.values()):
        if not getattr(mod, "__name__", "").startswith("fdlib.kernels"):
            continue
        for fn in vars(mod).values():
            if isinstance(fn, JITFunction) and id(fn) not in seen:
                seen.add(id(fn))
                for caches in fn.device_caches.values():
                    for k in caches[0].values():
                        yield fn.__name__, k


def kernel_rows(shown_names=SHOWN) -> list[dict]:
    """One row per kernel this process compiled: registers a thread and spills (the driver's), the stack frame
    (cuobjdump's), shared memory, warps, stages, and the constexprs named in ``shown_names``."""
    rows = []
    for name, k in compiled_kernels():
        k._init_handles()
        names = k.src.fn.arg_names if hasattr(k.src, "fn") else []
        shown = {}
        for key, v in getattr(k.src, "constants", {}).items():
            idx = key[0] if isinstance(key, tuple) else key
            nm = names[idx] if isinstance(idx, int) and idx < len(names) else str(idx)
            if nm in shown_names:
                shown[nm] = v if isinstance(v, (int, bool, float, str)) else str(v)
        rows.append(dict(kernel=name, registers=k.n_regs, spilled_bytes=k.n_spills,
                         stack_bytes=stack_bytes(k.asm["cubin"]), shared_bytes=k.metadata.shared,
                         num_warps=k.metadata.num_warps, num_stages=k.metadata.num_stages,
                         maxnreg=getattr(k.metadata, "maxnreg", None), constexprs=shown))
    return rows


def row_text(r: dict) -> str:
    """One line of :func:`kernel_rows`' row ``r``."""
    return (f"{r['kernel']:<24} regs {r['registers']:>3}  spills {r['spilled_bytes']:>6} B  stack "
            f"{r['stack_bytes']} B  smem {r['shared_bytes']:>6} B  warps {r['num_warps']}  stages {r['num_stages']}  "
            f"maxnreg {r['maxnreg']}  {r['constexprs']}")


def main(argv):
    out = None
    if argv[:1] == ["--out"]:
        out, argv = argv[1], argv[2:]
    items = argv or ITEMS
    plans = {it: run_item(it) for it in items}
    rows = kernel_rows()
    for r in rows:
        print(row_text(r))
    if out:
        with open(out, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                           date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                           git_commit=os.environ.get("FDLIB_GIT_COMMIT"), command=" ".join(sys.argv),
                           plans=plans, kernels=rows), f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1:])
