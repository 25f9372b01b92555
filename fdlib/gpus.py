"""The GPUs fdlib models: datasheet presets, the live GPU, and the one resolver every module uses.

SM counts, memory bandwidth and L2 size from the vendors' datasheets. ``bandwidth_tbs`` is the datasheet
peak; a program that streams memory reaches less (on one H200 the course measured a 4.65 TB/s read
ceiling against 4.8 TB/s on paper, see ``results/h200/``).

* :func:`live_gpu` describes the CUDA device this process sees (None without one), :func:`sm_count` its SMs;
* :func:`resolve` turns what a caller passes (a :class:`GPU`, a preset name, ``"live"``, or None) into a
  :class:`GPU`: the cost model, the calibration and the explorer all go through it;
* :func:`choices` lists the names :func:`resolve` accepts, for pickers.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass


@dataclass(frozen=True)
class GPU:
    name: str
    sms: int
    bandwidth_tbs: float       # datasheet peak HBM/GDDR bandwidth, TB/s
    l2_mb: float
    regs_per_sm: int = 65536
    smem_per_sm_kb: int = 228  # shared memory a CTA set can use per SM (Hopper 228, Ampere 164, Ada 100)
    max_warps_per_sm: int = 64
    max_blocks_per_sm: int = 32


PRESETS: dict[str, GPU] = {g.name: g for g in [
    GPU("A100 SXM4 80GB", sms=108, bandwidth_tbs=2.039, l2_mb=40, smem_per_sm_kb=164),
    GPU("H100 SXM", sms=132, bandwidth_tbs=3.35, l2_mb=50, smem_per_sm_kb=228),
    GPU("H200", sms=132, bandwidth_tbs=4.8, l2_mb=60, smem_per_sm_kb=228),
    GPU("L4", sms=58, bandwidth_tbs=0.3, l2_mb=48, smem_per_sm_kb=100, max_warps_per_sm=48, max_blocks_per_sm=24),
    GPU("RTX 4090", sms=128, bandwidth_tbs=1.008, l2_mb=72, smem_per_sm_kb=100, max_warps_per_sm=48,
        max_blocks_per_sm=24),
]}


def live_gpu() -> GPU | None:
    """The current CUDA device, with its real SM count and L2 (bandwidth from the matching preset, if any)."""
    import torch
    if not torch.cuda.is_available():
        return None
    return _live_gpu(torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _live_gpu(index: int) -> GPU:
    import torch
    prop = torch.cuda.get_device_properties(index)
    name = prop.name
    base = next((g for key, g in PRESETS.items() if key.split()[0] in name and key.split()[-1] in name), None)
    base = base or next((g for key, g in PRESETS.items() if key.split()[0] in name), None)
    bw = base.bandwidth_tbs if base else 1.0
    smem = (getattr(prop, "shared_memory_per_multiprocessor", 0) // 1024) or (base.smem_per_sm_kb if base else 100)
    return GPU(f"{name} (live)", sms=prop.multi_processor_count, bandwidth_tbs=bw,
               l2_mb=getattr(prop, "L2_cache_size", 0) / 2**20, smem_per_sm_kb=smem)


def sm_count() -> int | None:
    """SMs of the live GPU (:func:`live_gpu`); None when this process sees no CUDA GPU."""
    gpu = live_gpu()
    return gpu.sms if gpu is not None else None


def choices() -> list[str]:
    """Names :func:`resolve` accepts besides ``"live"``: the presets, then the live GPU when there is one."""
    live = live_gpu()
    return list(PRESETS) + ([live.name] if live is not None else [])


def resolve(gpu: GPU | str | None = None) -> GPU:
    """The :class:`GPU` meant by ``gpu``: itself; a preset's name; ``"live"`` or the live GPU's name (a CUDA GPU
    must be visible); None: the live GPU, or the H200 preset without one."""
    if isinstance(gpu, GPU):
        return gpu
    live = live_gpu()
    if gpu is None:
        return live or PRESETS["H200"]
    if gpu in PRESETS:
        return PRESETS[gpu]
    if live is not None and gpu in (live.name, "live"):
        return live
    if gpu == "live":
        raise ValueError(f"gpu: 'live' needs a CUDA GPU and this process sees none; expected one of {sorted(PRESETS)}")
    raise ValueError(f"gpu: expected a fdlib.gpus.GPU, one of {choices()} or 'live' (on a GPU), got {gpu!r}")
