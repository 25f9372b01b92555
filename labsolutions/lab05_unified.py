"""Lab 05 reference solutions: the cost model's prediction and choice, and the unified kernel's ticket."""
import math  # noqa: F401  (available to the solutions, as in the notebook)

import triton
import triton.language as tl

from fdlib.grading import solution


@solution("lab05.predict_time")
def predict_time(lengths, H_kv, D, dtype_bytes, splits, gpu, cal, block_n, r):
    """Predicted µs of one unified decode step asking for `splits` splits, and the split count actually used."""
    from fdlib.costmodel import SECOND_PROGRAM
    from fdlib.kernels.config import chunk_for
    chunk, used = chunk_for(max(max(lengths), 1), splits, block_n)          # keys per split, splits used
    P = sum(H_kv * max(1, -(-L // chunk)) for L in lengths)                 # programs (a length-0 row: 1)
    slots = r * gpu.sms
    W = -(-P // slots)                                                      # waves: a partial wave counts whole
    n = 1 + (min(-(-P // gpu.sms), r) - 1) * SECOND_PROGRAM                 # the busiest SM's load
    kv_mb = 2 * sum(lengths) * H_kv * D * dtype_bytes / 1e6                 # all of K and V
    prog_mb = 2 * chunk * D * dtype_bytes / 1e6                             # one program's K and V slice
    t_bw = kv_mb / cal.bw_tbs                                               # the GPU's streaming limit
    t_prog = W * n * prog_mb / cal.rho_tbs                                  # one SM's streaming limit
    t = cal.t_launch_us + P / slots * cal.t_wave_us + (t_bw ** 4 + t_prog ** 4) ** 0.25
    if used > 1:
        t += cal.t_merge_us + used * cal.t_split_us                         # the merge of `used` partials
    return t, used


@solution("lab05.choose_splits")
def choose_splits(lengths, H_kv, D, dtype_bytes, gpu, cal, block_n, r, predict):
    """The smallest split count (as used) predicted within 1% of the fastest candidate."""
    from fdlib.costmodel import CANDIDATES
    preds = [predict(lengths, H_kv, D, dtype_bytes, s, gpu, cal, block_n, r) for s in CANDIDATES]
    best = min(t for t, _ in preds)
    return min(used for t, used in preds if t <= best * 1.01)


@solution("lab05.take_ticket")
@triton.jit
def take_ticket(counter_ptr, n_splits):
    """is_last: this program is the last of its row to take a ticket (and the counter is reset to 0)."""
    tl.debug_barrier()                     # all threads of this program have stored their part of the partial
    # release: our partial is visible before the ticket; acquire: the last one sees every earlier partial
    ticket = tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu")
    is_last = ticket == n_splits - 1
    if is_last:
        tl.atomic_xchg(counter_ptr, 0, sem="relaxed", scope="gpu")      # ready for the next call
    return is_last
