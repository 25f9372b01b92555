"""Do two checkouts compile fdlib's 16-bit kernels to the same code? For every case of each tree's
``tools/compile_check.py`` (8-bit caches left out: the older tree may have none), built for sm_90 on the CPU with the
alignment facts of a GPU launch, compare the TTGIR (Triton's GPU IR after its optimisations, before LLVM) with SSA
values renumbered in the order they are defined (their names follow Python variable names and argument positions)
and without the kernel's signature line (a tree may have added parameters the case does not use). The PTX differs in instruction order and register
numbers whenever the parameter list does, so it is not compared.

    python tools/same_ir.py /path/to/other/checkout          # exit 0: every shared case the same
    python tools/same_ir.py /path/to/other/checkout unified  # only cases whose name contains "unified"
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

DUMP = r'''
import json, os, re, sys
root, out, only = sys.argv[1], sys.argv[2], sys.argv[3:]
sys.path.insert(0, os.path.join(root, "tools"))
os.chdir(os.path.join(root, "tools"))
import compile_check as cc
res = {}
for name, kernel, ptrs, meta, *warps in cc.cases():
    if meta.get("K_SCALE", 0) or meta.get("V_SCALE", 0) or (only and not any(o in name for o in only)):
        continue
    ir = cc.compile_kernel(kernel, ptrs, meta, *warps, aligned=True).asm["ttgir"]
    ids, count, lines = {}, [0], []

    def rename(m):   # a definition (a name before "=") gets a fresh number; a use, its latest definition's
        name, define = m.group(1), m.group(2) or ""
        if define or name not in ids:
            ids[name] = "%v" + str(count[0])
            count[0] += 1
        return ids[name] + define
    for l in ir.split("\n"):
        if "tt.func public" in l or l.startswith("#loc"):
            continue
        l = re.sub(r"\s*loc\([^()]*(\([^()]*\)[^()]*)*\)", "", l)
        lines.append(re.sub(r"(%[A-Za-z_0-9]+)((?::\d+)?\s*=(?!=))?", rename, l))
    res[name] = lines
    print(name, flush=True)
json.dump(res, open(out, "w"))
'''


def dump(root: str, only: list[str]) -> dict:
    """{case name: normalised TTGIR lines} of the tree at ``root``, built in a fresh process on its own sources."""
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "FDLIB_INTERPRET")}
    env["PYTHONPATH"] = root
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "ir.json")
        subprocess.run([sys.executable, "-c", DUMP, root, out, *only], cwd=root, env=env, check=True,
                       stdout=subprocess.DEVNULL)
        return json.load(open(out))


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0].startswith("-"):
        print(__doc__, file=sys.stderr)
        return 2
    other, only = os.path.abspath(argv[0]), argv[1:]
    a, b = dump(other, only), dump(HERE, only)
    shared = sorted(set(a) & set(b))
    differ = [n for n in shared if a[n] != b[n]]
    for n in differ:
        print(f"DIFFERS  {n}")
    for n in sorted(set(a) ^ set(b)):
        print(f"only in {'the other tree' if n in a else 'this tree'}: {n}")
    print(f"{len(shared) - len(differ)} of {len(shared)} shared cases compile to the same TTGIR")
    return 1 if differ or not shared else 0


if __name__ == "__main__":
    sys.exit(main())
