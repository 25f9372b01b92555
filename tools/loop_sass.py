"""Count the SASS instructions of each kernel's K/V loop, built for an H100/H200 (sm_90) on a machine without a
GPU: Triton compiles to a cubin on the CPU (ptxas ships with it), ``nvdisasm`` lists its instructions, and the
loop is the innermost backward-branch region holding tensor-core instructions (HMMA); a tile that ends no row
skips the largest conditional forward branch inside it (a row walker's end of a row). Nothing is launched.

    python tools/loop_sass.py            # per kernel: the loop's instructions, a tile's, the commonest opcodes

The memory-bound loops run at about two warps a scheduler, so a tile's instruction count bounds how fast they
can issue their copies (Nsight Compute over pages, ``results/h200/ncu-paged-74aec37.txt``). Cases: the unified,
stream-K and persistent kernels, fp16, GQA group 4, D = 128, 64-key tiles, contiguous (PAGE = 0) and over pages
of 16, each compiled as a GPU launch specialises it (``compile_check.compile_kernel(..., aligned=True)``).
"""
import collections
import os
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import compile_check as cc  # noqa: E402  (sets up the sm_90 build on the CPU before fdlib is imported)

from fdlib.kernels import persistent, streamk, tile, unified  # noqa: E402
from fdlib.kernels.config import block_sizes  # noqa: E402

NVDISASM = os.path.join(os.path.dirname(cc.triton.__file__), "backends", "nvidia", "bin", "nvdisasm")


def sass_lines(compiled) -> tuple[list[tuple[int, str]], dict[str, int]]:
    """(address, instruction) of every instruction of ``compiled``'s cubin, and each label's address."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        text = subprocess.run([NVDISASM, "-c", f.name], capture_output=True, text=True, check=True).stdout
    code, labels, pending = [], {}, None
    for line in text.split("\n"):
        label = re.match(r"\s*\.L_x_(\d+):", line)
        if label:
            pending = label.group(1)
            continue
        ins = re.search(r"/\*([0-9a-f]{4,})\*/\s+(.*?);", line)
        if ins:
            addr = int(ins.group(1), 16)
            code.append((addr, ins.group(2).strip()))
            if pending is not None:
                labels[pending], pending = addr, None
    return code, labels


def kv_loops(compiled) -> list[tuple[list[str], int]]:
    """Every innermost loop (a backward branch's region holding no other such loop) that holds tensor-core
    instructions, smallest first: its instructions, and how many of them a tile skips when no conditional branch
    inside the loop is taken (a row's end). A kernel with two tile loops (stream-K: a share inside one row, and
    the general walk over rows) has two."""
    code, labels = sass_lines(compiled)
    loops = []
    for addr, ins in code:
        target = re.search(r"BRA\s.*\.L_x_(\d+)", ins)
        if target and labels.get(target.group(1), addr) < addr:
            body = [(a, i) for a, i in code if labels[target.group(1)] <= a <= addr]
            if any("MMA" in i for _, i in body):
                loops.append(body)
    inner = [b for b in loops if not any(o is not b and b[0][0] <= o[0][0] and o[-1][0] <= b[-1][0] for o in loops)]
    out = []
    for body in sorted(inner, key=len):
        skipped, end = 0, body[-1][0]
        for a, ins in body:   # forward conditional branches over the rare work (stores at a row's end)
            target = re.search(r"^@!?P\w+\s+BRA\s.*\.L_x_(\d+)", ins)
            if target and a < labels[target.group(1)] <= end:
                skipped = max(skipped, sum(1 for b, _ in body if a < b < labels[target.group(1)]))
        out.append(([i for _, i in body], skipped))
    return out


def kv_loop(compiled) -> tuple[list[str], int]:
    """The smallest of :func:`kv_loops`: the loop a kernel with one tile loop runs."""
    return kv_loops(compiled)[0]


def opcode(ins: str) -> str:
    return re.sub(r"^@!?U?P\w+\s+", "", ins).split()[0].split(".")[0]


def cases():
    g, D = 4, 128
    BG, BD = block_sizes(g, D)
    h16 = ["*fp16"] * 3 + ["*i32"]
    common = dict(GROUP=g, D=D, BLOCK_G=BG, BLOCK_D=BD, FP32_DOT=False, TILE_UPDATE=tile.tile_update, Q_LEN=1,
                  TIMELINE=False, BLOCK_N=64)
    bh, bs = tile.combine_blocks(g, 16, BD)
    uni, per = h16 + cc.UNIFIED + ["*i32"] + cc.NO_SCALES, h16 + cc.PERSISTENT + ["*i32"] + cc.NO_SCALES
    for page in (0, 16):
        unified_meta = dict(common, BLOCK_H=bh, BLOCK_S=bs, TAKE_TICKET=tile.take_ticket, PAGE=page, PACK=1,
                            ORDER_B=0, TABLE_REGS=0)
        yield f"unified PAGE={page}", unified.unified_kernel, uni, unified_meta
        if page:   # a split's block table held in registers (fdlib.plan.table_regs_for)
            yield (f"unified PAGE={page} TABLE_REGS=64", unified.unified_kernel, uni,
                   dict(unified_meta, TABLE_REGS=64))
        yield (f"streamk PAGE={page}", streamk.streamk_kernel, uni,
               dict(common, BLOCK_H=bh, BLOCK_S=bs, BLOCK_B=128, BLOCK_W=streamk.ROW_WINDOW,
                    ALIGN=streamk.ALIGN_IDLE, PAGE=page))
        yield (f"persistent PAGE={page}", persistent.persistent_kernel, per,
               dict(common, ROWS=2, PAGE=page, CHUNKS=0, MIN_TILES=1))


def main() -> int:
    for name, kernel, ptrs, meta in cases():
        body, skipped = kv_loop(cc.compile_kernel(kernel, ptrs, meta, aligned=True))
        ops = collections.Counter(opcode(i) for i in body)
        print(f"{name:<31} {len(body):>5} instructions in the loop, {len(body) - skipped:>5} a tile that ends no "
              f"row;  " + ", ".join(f"{o} {n}" for o, n in ops.most_common(8)))
    print(f"sm_90, triton {cc.triton.__version__}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
