"""Compile every fdlib kernel for an H100/H200 (sm_90) on a machine without a GPU: Triton's front end, its
optimisation passes and LLVM down to PTX run on the CPU, so a kernel that would fail to compile on the GPU
fails here (CI has no GPU). Nothing is launched.

    python tools/compile_check.py            # prints one line per kernel; exits 1 if any fails

Contiguous (PAGE=0) and paged (PAGE=16) variants; fp16, GQA group 4, D=128 (and fp32, D=80 for stage 1); one
query token and several (Q_LEN=4, 5, and 16 with group 16: the most rows a program holds); and each kernel's
TIMELINE=True variant (per-program SM id and times from %smid and %globaltimer); the unified-max kernels (pass 1
with ticket or atomic partials, pass 2's exact recompute), contiguous and paged; the batch-invariant kernel
(with and without ONE_CHUNK and ALONE, ALONE at the plan's FEW_STAGES pipeline stages, and SHARE: chunks a
program chosen on the device) and the stream-K
kernel; and every kernel over 8-bit KV caches (e4m3 and int8, scales per tensor, head and token:
:func:`kv8_cases`).
"""
import os
import re
import sys

os.environ.pop("TRITON_INTERPRET", None)
os.environ.pop("FDLIB_INTERPRET", None)
import torch  # noqa: E402

torch.cuda.is_available = lambda: True       # fdlib then defines compiled kernels; nothing here touches a device
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

import fdlib  # noqa: E402,F401
from fdlib import runtime  # noqa: E402
from fdlib.kernels import (balanced, invariant, persistent, stage1, stage2, streamk, tile, unified, unified_max,  # noqa: E402
                           worklist)
from fdlib.kernels.config import block_sizes, tile_config_for  # noqa: E402
from fdlib.plan import FEW_STAGES  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)


def compile_kernel(kernel, ptr_types, meta, num_warps=4, num_stages=3, aligned=False):
    """Compile ``kernel`` with pointer types for its first arguments, fp32 qk_scale, i32 scalars, ``meta``.
    ``aligned``: tell the compiler what a GPU launch tells it of real tensors, pointers and the K/V row strides
    divisible by 16 (Triton's specialisation), without which it vectorises and pipelines less."""
    sig, constexprs, attrs = {}, {}, {}
    if "K_SCALE" in kernel.arg_names:   # a 16-bit cache unless the case names its scales (8-bit caches)
        meta = {"K_SCALE": 0, "V_SCALE": 0, **meta}
    if "ORDER_B" in kernel.arg_names:   # b order unless the case names a longest-first launch
        meta = {"ORDER_B": 0, **meta}
    if "SHARE" in kernel.arg_names:     # per_program from the host unless the case names the device share
        meta = {"SHARE": False, "BLOCK_B": 16, **meta}
    if "WORK" in kernel.arg_names:      # no work list unless the case names one
        meta = {"WORK": 0, "WORK_B": 0, "WORK_P": 0, "WORK_S": 0, **meta}
    for i, name in enumerate(kernel.arg_names):
        if name in meta:
            sig[name], constexprs[(i,)] = "constexpr", meta[name]
        elif kernel.params[i].is_constexpr:
            raise ValueError(f"{name}: a constexpr of {kernel.__name__} missing from the case's meta")
        elif i < len(ptr_types):
            sig[name] = ptr_types[i]
            if aligned:
                attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            sig[name] = "fp32" if name in ("qk_scale", "lo2", "hi2", "v_mul") else "i32"
            if aligned and name in ("stride_kb", "stride_kl", "stride_kh", "stride_vb", "stride_vl", "stride_vh"):
                attrs[(i,)] = [["tt.divisibility", 16]]
    return triton.compile(ASTSource(fn=kernel, signature=sig, constexprs=constexprs, attrs=attrs), target=TARGET,
                          options=dict(num_warps=num_warps, num_stages=num_stages))


def pipeline_waits(compiled) -> list[int]:
    """The ``num`` of every async wait inside a loop body of ``compiled``'s TTGIR (scf.for, up to its scf.yield):
    how many groups of K/V copies stay in flight while a tile is computed (num_stages - 1 where the loop is
    pipelined; 0 where it waits for all)."""
    lines, waits = compiled.asm["ttgir"].split("\n"), []
    for i, line in enumerate(lines):
        if "scf.for" not in line:
            continue
        indent = len(line) - len(line.lstrip())
        for body in lines[i + 1:]:
            if body.strip().startswith("scf.yield") and len(body) - len(body.lstrip()) == indent + 2:
                break
            waits += [int(n) for n in re.findall(r"async_wait.*num = (\d+)", body)]
    return waits


UNIFIED = ["*fp32", "*fp32", "*i32", "*fp16", "*fp32", "*i32", "*i32"]    # O_PART ... BT after Q, K, V, LENS
NO_SCALES = ["*i32", "*i32"]    # KS, VS after TIMES: a 16-bit cache's launch passes the flag for both
STAGE1 = ["*fp32", "*fp32", "*i32", "*i32"]
PERSISTENT = ["*fp16", "*fp32", "*i32", "*i32"]


def cases():
    """(name, kernel, pointer types, constexprs[, warps]). Every kernel's last pointer is TIMES: the flag (i32)
    stands in for it when TIMELINE=False; a TIMELINE=True variant of each kernel gets an int64 buffer."""
    g, D = 4, 128
    h16 = ["*fp16"] * 3 + ["*i32"]
    for q_len in (1, 4):
        BG, BD = block_sizes(g * q_len, D)
        cfg = tile_config_for(D, 1 << 30, compiled_mode=True, q_rows=g * q_len if q_len > 1 else 1)
        common = dict(GROUP=g, D=D, BLOCK_G=BG, BLOCK_D=BD, FP32_DOT=False, TILE_UPDATE=tile.tile_update, Q_LEN=q_len,
                      TIMELINE=False)
        block_h, block_s = tile.combine_blocks(g * q_len, 16, BD)
        q = f" q_len={q_len}" if q_len > 1 else ""
        for page in (0, 16):
            yield (f"unified PAGE={page}{q}", unified.unified_kernel, h16 + UNIFIED + ["*i32"] + NO_SCALES,
                   dict(common, BLOCK_N=cfg.BLOCK_N, BLOCK_H=block_h, BLOCK_S=block_s, TAKE_TICKET=tile.take_ticket,
                        PAGE=page, PACK=1, ORDER_B=0, TABLE_REGS=0))
            if page and q_len == 1:   # sequences launched longest first (auto's ragged batches over pages)
                yield (f"unified PAGE={page} ORDER_B=128", unified.unified_kernel, h16 + UNIFIED + ["*i32"] + NO_SCALES,
                       dict(common, BLOCK_N=cfg.BLOCK_N, BLOCK_H=block_h, BLOCK_S=block_s,
                            TAKE_TICKET=tile.take_ticket, PAGE=page, PACK=1, ORDER_B=128, TABLE_REGS=0))
            if page:   # the block table of a split in registers (fdlib.plan.table_regs_for)
                yield (f"unified PAGE={page}{q} TABLE_REGS=64", unified.unified_kernel, h16 + UNIFIED + ["*i32"] + NO_SCALES,
                       dict(common, BLOCK_N=cfg.BLOCK_N, BLOCK_H=block_h, BLOCK_S=block_s,
                            TAKE_TICKET=tile.take_ticket, PAGE=page, PACK=1, ORDER_B=0, TABLE_REGS=64))
            for work_b, work_p in ((0, 0), (16, 0), (0, 33), (16, 33)):   # a work list: the schedule kernel's or
                yield (f"unified PAGE={page}{q} WORK WORK_B={work_b} WORK_P={work_p}",   # listed in registers;
                       unified.unified_kernel, h16 + UNIFIED + ["*i32"] + NO_SCALES,    # pieces sized by the batch
                       dict(common, BLOCK_N=cfg.BLOCK_N, BLOCK_H=block_h, BLOCK_S=block_s, TAKE_TICKET=tile.take_ticket,
                            PAGE=page, PACK=1, ORDER_B=0, TABLE_REGS=0, WORK=2 + 64 * 32, WORK_B=work_b,
                            WORK_P=work_p, WORK_S=32))
            # ONE_CHUNK: the loop without the per-tile chunk-end work; ALONE: no partial stored, no ticket
            for one, alone in ((False, False), (True, False), (False, True), (True, True)):
                name = f"invariant PAGE={page}{q}{' ONE_CHUNK' if one else ''}{' ALONE' if alone else ''}"
                meta = dict(common, BLOCK_N=cfg.BLOCK_N, TAKE_TICKET=tile.take_ticket, PAGE=page,
                            CHUNKS=invariant.CHUNKS, MIN_TILES=invariant.MIN_TILES, ONE_CHUNK=one, ALONE=alone,
                            FOLD_G=g * q_len, FOLD_C=invariant.CHUNKS)
                yield name, invariant.invariant_kernel, h16 + UNIFIED + ["*i32"] + NO_SCALES, meta
                if alone and not one and q_len == 1:   # short rows of large batches: FEW_STAGES pipeline stages
                    yield (f"{name} num_stages={FEW_STAGES}", invariant.invariant_kernel, h16 + UNIFIED + ["*i32"] + NO_SCALES,
                           meta, cfg.num_warps, FEW_STAGES)
                    yield (f"{name} ORDER_B=128", invariant.invariant_kernel, h16 + UNIFIED + ["*i32"] + NO_SCALES,
                           dict(meta, ORDER_B=128))   # rows launched longest first (fdlib.plan.INVARIANT_ORDER)
                if not one and not alone:   # chunks a program chosen on the device (fdlib.plan.INVARIANT_SHARE)
                    yield (f"{name} SHARE BLOCK_B=32", invariant.invariant_kernel,
                           h16 + UNIFIED + ["*i32"] + NO_SCALES, dict(meta, SHARE=True, BLOCK_B=32))
            yield (f"stage1 PAGE={page}{q}", stage1.stage1_kernel, h16 + STAGE1 + ["*i32"] + NO_SCALES,
                   dict(common, BLOCK_N=cfg.BLOCK_N, PAGE=page, PACK=1))
            if q_len == 1:   # packed KV heads: two of 64 dims read as one of 128, the pair's 2·g query heads
                packed = dict(common, GROUP=2 * g, BLOCK_G=block_sizes(2 * g, D)[0], BLOCK_N=cfg.BLOCK_N, PAGE=page,
                              PACK=2)
                ph, ps = tile.combine_blocks(2 * g, 16, BD)
                yield (f"unified PACK=2 PAGE={page}", unified.unified_kernel, h16 + UNIFIED + ["*i32"] + NO_SCALES,
                       dict(packed, BLOCK_H=ph, BLOCK_S=ps, TAKE_TICKET=tile.take_ticket, ORDER_B=0, TABLE_REGS=0))
                yield f"stage1 PACK=2 PAGE={page}", stage1.stage1_kernel, h16 + STAGE1 + ["*i32"] + NO_SCALES, packed
            yield (f"persistent PAGE={page}{q}", persistent.persistent_kernel, h16 + PERSISTENT + ["*i32"] + NO_SCALES,
                   dict(common, BLOCK_N=min(64, cfg.BLOCK_N), ROWS=2, PAGE=page, CHUNKS=0, MIN_TILES=1))
            # the batch-invariant plan's persistent walk of short rows: its 128-key tiles at FEW_STAGES stages
            yield (f"persistent invariant PAGE={page}{q}", persistent.persistent_kernel, h16 + PERSISTENT + ["*i32"] + NO_SCALES,
                   dict(common, BLOCK_N=cfg.BLOCK_N, ROWS=2, PAGE=page, CHUNKS=invariant.CHUNKS,
                        MIN_TILES=invariant.MIN_TILES), cfg.num_warps, FEW_STAGES)
            yield (f"streamk PAGE={page}{q}", streamk.streamk_kernel, h16 + UNIFIED + ["*i32"] + NO_SCALES,
                   dict(common, BLOCK_N=64, BLOCK_H=block_h, BLOCK_S=block_s, BLOCK_B=128, BLOCK_W=streamk.ROW_WINDOW,
                        ALIGN=streamk.ALIGN_IDLE, PAGE=page))
            yield (f"balanced PAGE={page}{q}", balanced.balanced_kernel, h16 + UNIFIED + ["*i32"] + NO_SCALES,
                   dict(common, BLOCK_N=cfg.BLOCK_N, BLOCK_H=block_h, BLOCK_S=block_s, BLOCK_B=64, PAGE=page))
    # the TIMELINE=True variants (per-program SM id and start/end times, DecodePlan.run(timeline=...))
    BG, BD = block_sizes(g, D)
    timed = dict(GROUP=g, D=D, BLOCK_G=BG, BLOCK_D=BD, FP32_DOT=False, TILE_UPDATE=tile.tile_update, Q_LEN=1,
                 TIMELINE=True, PAGE=16)
    yield ("unified TIMELINE", unified.unified_kernel, h16 + UNIFIED + ["*i64"] + NO_SCALES,
           dict(timed, BLOCK_N=128, BLOCK_H=4, BLOCK_S=16, TAKE_TICKET=tile.take_ticket, PACK=1, ORDER_B=0,
                TABLE_REGS=0))
    yield ("invariant TIMELINE", invariant.invariant_kernel, h16 + UNIFIED + ["*i64"] + NO_SCALES,
           dict(timed, BLOCK_N=128, TAKE_TICKET=tile.take_ticket, CHUNKS=16, MIN_TILES=1, ONE_CHUNK=False, ALONE=False,
                FOLD_G=g, FOLD_C=16))
    yield ("invariant SHARE TIMELINE", invariant.invariant_kernel, h16 + UNIFIED + ["*i64"] + NO_SCALES,
           dict(timed, BLOCK_N=128, TAKE_TICKET=tile.take_ticket, CHUNKS=16, MIN_TILES=1, ONE_CHUNK=False, ALONE=False,
                FOLD_G=g, FOLD_C=16, SHARE=True, BLOCK_B=128))
    yield ("stage1 TIMELINE", stage1.stage1_kernel, h16 + STAGE1 + ["*i64"] + NO_SCALES, dict(timed, BLOCK_N=128, PACK=1))
    yield ("persistent TIMELINE", persistent.persistent_kernel, h16 + PERSISTENT + ["*i64"] + NO_SCALES,
           dict(timed, BLOCK_N=64, ROWS=2, CHUNKS=0, MIN_TILES=1))
    yield ("streamk TIMELINE", streamk.streamk_kernel, h16 + UNIFIED + ["*i64"] + NO_SCALES,
           dict(timed, BLOCK_N=64, BLOCK_H=4, BLOCK_S=16, BLOCK_B=128, BLOCK_W=streamk.ROW_WINDOW,
                ALIGN=streamk.ALIGN_IDLE))
    yield ("balanced TIMELINE", balanced.balanced_kernel, h16 + UNIFIED + ["*i64"] + NO_SCALES,
           dict(timed, BLOCK_N=128, BLOCK_H=4, BLOCK_S=16, BLOCK_B=64))
    # the most query rows a program can hold: group 16 × q_len 16 = 256 rows (8 warps, 16-key tiles)
    BG, BD = block_sizes(256, D)
    cfg = tile_config_for(D, 1 << 30, compiled_mode=True, q_rows=256)
    bh, bs = tile.combine_blocks(256, 16, BD)
    yield ("unified group 16 q_len=16", unified.unified_kernel, h16 + UNIFIED + ["*i32"] + NO_SCALES,
           dict(GROUP=16, D=D, BLOCK_G=BG, BLOCK_D=BD, FP32_DOT=False, TILE_UPDATE=tile.tile_update, Q_LEN=16,
                BLOCK_N=cfg.BLOCK_N, BLOCK_H=bh, BLOCK_S=bs, TAKE_TICKET=tile.take_ticket, PAGE=0, TIMELINE=False,
                PACK=1, ORDER_B=0, TABLE_REGS=0),
           cfg.num_warps)
    f32 = ["*fp32"] * 3 + ["*i64", "*fp32", "*fp32", "*i32", "*i32", "*i32"] + NO_SCALES
    for group, q_len in ((3, 1), (3, 5)):
        BG3, BD80 = block_sizes(group * q_len, 80)
        yield (f"stage1 fp32 D=80 group {group}" + (f" q_len={q_len}" if q_len > 1 else ""), stage1.stage1_kernel,
               f32, dict(GROUP=group, D=80, BLOCK_G=BG3, BLOCK_D=BD80, FP32_DOT=True, TILE_UPDATE=tile.tile_update,
                         BLOCK_N=64, PAGE=0, Q_LEN=q_len, TIMELINE=False, PACK=1))
    for pack, head_group in ((1, 1), (2, 4)):
        yield (f"stage2 PACK={pack}", stage2.stage2_kernel, ["*fp32", "*fp32", "*fp16", "*fp32"],
               dict(D=128, BLOCK_S=16, BLOCK_D=128, PACK=pack, HEAD_GROUP=head_group))
    yield from kv8_cases()
    yield from schedule_cases()
    # FlashDecoding++'s unified max: pass 1 (ticket or atomic partials) and pass 2 (exact recompute of marked rows)
    BG, BD = block_sizes(g, D)
    um = dict(GROUP=g, D=D, BLOCK_G=BG, BLOCK_N=64, BLOCK_D=BD, BLOCK_H=4, BLOCK_S=16, FP32_DOT=False)
    um_ptrs = h16 + ["*fp32", "*fp32", "*fp32", "*i32", "*i32", "*fp16", "*fp32", "*i32", "*i32", "*i32"]
    for page in (0, 16):
        for atomic in (False, True):
            yield (f"unified_max pass 1 PAGE={page}{' atomic' if atomic else ''}", unified_max.unified_max_kernel,
                   um_ptrs, dict(um, PAGE=page, ATOMIC=atomic))
        yield (f"unified_max pass 2 PAGE={page}", unified_max.recompute_kernel,
               h16 + ["*i32", "*fp32", "*fp32", "*i32", "*fp16", "*fp32", "*i32", "*i32"], dict(um, PAGE=page))


SCALE_MODES = {"tensor": 1, "head": 2, "token": 3}   # fdlib.quant.SCALE_CODES: the kernels' K_SCALE / V_SCALE


def schedule_cases():
    """The work list's schedule kernel (fdlib.kernels.worklist) for S = 16 and 64."""
    for S, balanced in ((16, False), (32, True), (64, False)):
        yield (f"schedule S={S} BALANCED={balanced}", worklist.schedule_kernel, ["*i32", "*i32", "*i32"],
               dict(S=S, BLOCK_N=128, BLOCK_R=worklist.SCHEDULE_ROWS, BLOCK_C=worklist.SCHEDULE_COLS,
                    BLOCK_S=S, BALANCED=balanced), 4)


def kv8_cases():
    """8-bit KV caches (:mod:`fdlib.quant`), fp16 q: every kernel over an e4m3 cache with per-token scales, contiguous
    and paged (the most code: the scales' loads beside each tile, read ahead with the K/V rows over pages), and
    per-tensor, per-head, mixed and int8 variants of the unified kernel and others, each at the tiles a plan of
    1-byte elements takes (:func:`fdlib.kernels.config.tile_config_for` with ``elem_bytes=1``)."""
    g, D = 4, 128
    kinds = {"e4m3": "*fp8e4nv", "int8": "*i8"}

    def ptrs(kind, tail, k="token", v="token", q="*fp16"):
        scales = ["*fp32" if m != "tensor" else "*i32" for m in (k, v)]   # a per-tensor scale's pointer: the flag
        return [q, kinds[kind], kinds[kind], "*i32"] + tail + ["*i32"] + scales

    def common(q_len=1, k="token", v="token"):
        BG, BD = block_sizes(g * q_len, D)
        return dict(GROUP=g, D=D, BLOCK_G=BG, BLOCK_D=BD, FP32_DOT=False, TILE_UPDATE=tile.tile_update, Q_LEN=q_len,
                    TIMELINE=False, K_SCALE=SCALE_MODES[k], V_SCALE=SCALE_MODES[v])

    def cfg(page, q_len=1, persistent_tiles=False):
        if persistent_tiles:
            from fdlib.kernels.config import persistent_config
            return persistent_config(D, 1, q_rows=g * q_len if q_len > 1 else 1, compiled_mode=True, paged=page)
        return tile_config_for(D, 1 << 30, compiled_mode=True, elem_bytes=1, q_rows=g * q_len if q_len > 1 else 1,
                               paged=page)

    def unified_case(kind, page, q_len=1, k="token", v="token", q="*fp16", **extra):
        c = cfg(page, q_len)
        bh, bs = tile.combine_blocks(g * q_len, 16, block_sizes(g * q_len, D)[1])
        meta = dict(common(q_len, k, v), BLOCK_N=c.BLOCK_N, BLOCK_H=bh, BLOCK_S=bs, TAKE_TICKET=tile.take_ticket,
                    PAGE=page, PACK=1, ORDER_B=0, TABLE_REGS=0)
        meta.update(extra)
        name = (f"unified {kind} K:{k} V:{v} PAGE={page}" + (f" q_len={q_len}" if q_len > 1 else "")
                + "".join(f" {n}={x}" for n, x in extra.items()) + (" bf16" if q == "*bf16" else ""))
        return name, unified.unified_kernel, ptrs(kind, UNIFIED, k, v, q), meta

    for page in (0, 16):
        c, cp = cfg(page), cfg(page, persistent_tiles=True)
        bh, bs = tile.combine_blocks(g, 16, block_sizes(g, D)[1])
        yield unified_case("e4m3", page)
        yield (f"stage1 e4m3 K:token V:token PAGE={page}", stage1.stage1_kernel, ptrs("e4m3", STAGE1),
               dict(common(), BLOCK_N=c.BLOCK_N, PAGE=page, PACK=1))
        yield (f"persistent e4m3 K:token V:token PAGE={page}", persistent.persistent_kernel, ptrs("e4m3", PERSISTENT),
               dict(common(), BLOCK_N=cp.BLOCK_N, ROWS=2, PAGE=page, CHUNKS=0, MIN_TILES=1))
        yield (f"streamk e4m3 K:token V:token PAGE={page}", streamk.streamk_kernel, ptrs("e4m3", UNIFIED),
               dict(common(), BLOCK_N=cp.BLOCK_N, BLOCK_H=bh, BLOCK_S=bs, BLOCK_B=128, BLOCK_W=streamk.ROW_WINDOW,
                    ALIGN=streamk.ALIGN_IDLE, PAGE=page))
        yield (f"balanced e4m3 K:token V:token PAGE={page}", balanced.balanced_kernel, ptrs("e4m3", UNIFIED),
               dict(common(), BLOCK_N=c.BLOCK_N, BLOCK_H=bh, BLOCK_S=bs, BLOCK_B=64, PAGE=page))
        inv = tile_config_for(D, 1 << 30, compiled_mode=True, elem_bytes=1, rows=1 << 30)
        for one, alone, share in ((False, False, False), (False, True, False), (False, False, True)):
            yield (f"invariant e4m3 K:token V:token PAGE={page}{' ALONE' if alone else ''}{' SHARE' if share else ''}",
                   invariant.invariant_kernel, ptrs("e4m3", UNIFIED),
                   dict(common(), BLOCK_N=inv.BLOCK_N, TAKE_TICKET=tile.take_ticket, PAGE=page, CHUNKS=invariant.CHUNKS,
                        MIN_TILES=invariant.MIN_TILES, ONE_CHUNK=one, ALONE=alone, FOLD_G=g, FOLD_C=invariant.CHUNKS,
                        SHARE=share, BLOCK_B=32))
        yield (f"persistent invariant e4m3 K:token V:token PAGE={page}", persistent.persistent_kernel,
               ptrs("e4m3", PERSISTENT), dict(common(), BLOCK_N=inv.BLOCK_N, ROWS=2, PAGE=page,
                                              CHUNKS=invariant.CHUNKS, MIN_TILES=invariant.MIN_TILES),
               inv.num_warps, FEW_STAGES)
    yield unified_case("e4m3", 16, TABLE_REGS=64)
    yield unified_case("e4m3", 0, q_len=4)
    yield unified_case("e4m3", 16, q_len=4, TABLE_REGS=64)
    yield unified_case("e4m3", 0, k="tensor", v="tensor")
    yield unified_case("e4m3", 0, k="head", v="head")
    yield unified_case("e4m3", 16, k="token", v="head")
    yield unified_case("int8", 0, k="tensor", v="tensor")
    yield unified_case("int8", 0, k="head", v="head")
    yield unified_case("int8", 16)
    yield unified_case("e4m3", 0, q="*bf16")
    yield unified_case("int8", 16, k="head", v="head", q="*bf16")
    c = cfg(0)
    yield (f"stage1 int8 K:head V:head PAGE=0", stage1.stage1_kernel, ptrs("int8", STAGE1, "head", "head"),
           dict(common(1, "head", "head"), BLOCK_N=c.BLOCK_N, PAGE=0, PACK=1))
    packed = dict(common(1, "tensor", "tensor"), GROUP=2 * g, BLOCK_G=block_sizes(2 * g, D)[0], BLOCK_N=c.BLOCK_N,
                  PAGE=0, PACK=2)   # two KV heads of 64 dims read as one: per-tensor scales only
    ph, ps = tile.combine_blocks(2 * g, 16, block_sizes(2 * g, D)[1])
    yield ("unified e4m3 K:tensor V:tensor PACK=2 PAGE=0", unified.unified_kernel,
           ptrs("e4m3", UNIFIED, "tensor", "tensor"),
           dict(packed, BLOCK_H=ph, BLOCK_S=ps, TAKE_TICKET=tile.take_ticket, ORDER_B=0, TABLE_REGS=0))


KV8 = {"e4m3": "*fp8e4nv", "int8": "*i8"}


def append_case(kv: str, token: bool):
    """fdlib.hf.append's kernel (its pointers lie among its scalars): bf16 K/V quantized into an 8-bit cache."""
    from fdlib.hf import append
    kernel = append._append_kernel
    out = "*i8" if kv == "int8" else "*u8"   # an e4m3 cache is written as its bytes (NaN as 0x7F)
    pointers = {"K": "*bf16", "V": "*bf16", "SLOTS": "*i64", "REAL": "*u8", "POS": "*i64", "KO": out, "VO": out,
                "KS": "*fp32", "VS": "*fp32", "NF": "*i32"}
    meta = dict(D=128, BLOCK_D=128, QMAX=448 if kv == "e4m3" else 127, TOKEN=token, INT8=kv == "int8", HAS_REAL=True)
    sig = {n: "constexpr" if n in meta else pointers.get(n, "i32") for n in kernel.arg_names}
    constexprs = {(i,): meta[n] for i, n in enumerate(kernel.arg_names) if n in meta}
    return triton.compile(ASTSource(fn=kernel, signature=sig, constexprs=constexprs), target=TARGET,
                          options=dict(num_warps=4, num_stages=1))


def main() -> int:
    assert runtime.MODE == "gpu", runtime.MODE
    failed = 0
    appends = [(f"hf append {kv} {'token' if token else 'head'}", None, (kv, token), None)
               for kv in ("e4m3", "int8") for token in (True, False)]
    for name, kernel, ptrs, meta, *warps in [*cases(), *appends]:
        try:
            k = append_case(*ptrs) if kernel is None else compile_kernel(kernel, ptrs, meta, *warps)
            print(f"ok    {name}: {len(k.asm['ptx'])} characters of PTX, {k.metadata.shared} bytes of shared memory")
        except Exception as e:  # noqa: BLE001 - report every kernel, then fail
            failed += 1
            print(f"FAIL  {name}: {type(e).__name__}: {str(e)[:2000]}")
    print(f"compiled for sm_90 with triton {triton.__version__}: {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
