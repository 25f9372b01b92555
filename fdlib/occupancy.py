r"""How a launch's programs land on a GPU's SMs, wave by wave.

A kernel launch of P programs (thread blocks), of which at most ``r`` fit on one SM at a time
(limited by registers, shared memory, warps and blocks per SM), runs on S SMs in

.. math:: \text{waves} = \lceil P / (r\,S) \rceil

waves. Every wave but the last is full; the last (the *tail*) holds :math:`P - (\text{waves}-1)\,rS`
programs. The fraction of SM slots doing work over the whole launch is the wave efficiency

.. math:: \eta = \frac{P}{\text{waves}\cdot r S}

(FlashAttention-2's split heuristic keeps splits whose η is at least 85% of the best). This is a model:
the hardware dispatches blocks as slots free up, not in lock-step waves, but when all programs do
the same work it predicts the busy/idle pattern well. The cost model (:mod:`fdlib.costmodel`) uses
:func:`waves` for its wave term and :func:`programs_per_sm` for r; the explorer widget draws :func:`schedule`.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .gpus import GPU


@dataclass(frozen=True)
class Schedule:
    programs: int
    programs_per_sm: int
    sms: int
    waves: int
    tail_programs: int          # programs in the last wave
    wave_efficiency: float      # programs / (waves * slots)
    busy_sms_last_wave: int

    @property
    def slots(self) -> int:
        return self.sms * self.programs_per_sm

    @property
    def busy_sms_first_wave(self) -> int:
        return min(self.sms, self.programs)

    @property
    def utilization(self) -> float:
        """Fraction of SMs with at least one program, averaged over the waves (what the SM map shows)."""
        if self.programs == 0:
            return 0.0
        full = self.waves - 1
        return (full * self.sms + self.busy_sms_last_wave) / (self.waves * self.sms)


def waves(programs, programs_per_sm, sms):
    """⌈programs / (programs_per_sm · sms)⌉ (at least 1 for a non-empty launch); works on NumPy arrays too."""
    return -(-programs // (programs_per_sm * sms))


def schedule(programs: int, programs_per_sm: int, sms: int) -> Schedule:
    """Waves, tail and efficiency of ``programs`` blocks on ``sms`` SMs with ``programs_per_sm`` slots each."""
    for name, v in (("programs", programs), ("programs_per_sm", programs_per_sm), ("sms", sms)):
        if not isinstance(v, (int, np.integer)) or v < (0 if name == "programs" else 1):
            raise ValueError(f"{name}: expected an integer >= {0 if name == 'programs' else 1}, got {v!r}")
    slots = sms * programs_per_sm
    w = max(1, waves(programs, programs_per_sm, sms)) if programs else 0
    tail = programs - (w - 1) * slots if programs else 0
    eff = programs / (w * slots) if programs else 0.0
    return Schedule(programs, programs_per_sm, sms, w, tail, eff, min(sms, tail))


def placement(s: Schedule) -> np.ndarray:
    """``[waves, sms]`` array: how many programs each SM runs in each wave (blocks go round-robin over SMs)."""
    grid = np.zeros((max(s.waves, 1), s.sms), dtype=int)
    for w in range(s.waves):
        n = s.slots if w < s.waves - 1 else s.tail_programs
        full, extra = divmod(n, s.sms)
        grid[w, :] = full
        grid[w, :extra] += 1
    return grid


def programs_per_sm(gpu: GPU, num_warps: int, regs_per_thread: int, smem_bytes: int) -> int:
    """Blocks of ``num_warps`` warps, ``regs_per_thread`` registers and ``smem_bytes`` shared memory that fit on one SM."""
    by_warps = gpu.max_warps_per_sm // max(num_warps, 1)
    by_regs = gpu.regs_per_sm // max(regs_per_thread * 32 * num_warps, 1)
    by_smem = (gpu.smem_per_sm_kb * 1024) // smem_bytes if smem_bytes > 0 else gpu.max_blocks_per_sm
    return max(1, min(by_warps, by_regs, by_smem, gpu.max_blocks_per_sm))
