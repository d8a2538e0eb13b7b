"""The replay's model of time: how long a reload plan's transfers take, and the other data movements.

Bandwidths are :class:`saria.config.Bandwidths` in GB/s (1e9 bytes/s): shared GPU ingress
``B_GPU``, SSD reads ``B_disk`` (per drive x drives) and DRAM->GPU copies ``B_DRAM``. A plan reads
``D`` bytes from DRAM and ``S`` bytes from SSD (``ReloadPlan.dram_bytes`` / ``ssd_bytes``, GDN
checkpoints included). With ``r_D = min(B_DRAM, B_GPU)`` and ``r_S = min(B_disk, B_GPU)``:

* ``serial``: one tier after the other, ``D / r_D + S / r_S`` (LMCache's serial tier loading; a
  plan with ``serial=True`` always loads this way).
* ``overlap`` (uncoordinated): both start together, DRAM copies take ingress at ``r_D`` and the SSD
  reads get what is left, ``min(B_disk, B_GPU - r_D)`` (nothing with the paper's 48/20/48 GB/s:
  Figure 16's SSD stall during the DRAM burst), then ``r_S`` once DRAM is done.
* ``coordinated`` (paper Eq. 4): while SSD reads run, DRAM is paced at
  ``B_pace = min(B_DRAM, B_GPU - B_disk)`` and SSD reads at ``r_S``; DRAM runs at ``r_D`` after
  the SSD part ends. When the SSDs alone nearly saturate ingress (``B_disk >=
  COORDINATION_SATURATION x B_GPU``, 0.95, from ``saria.config`` as the data plane's coordinator)
  coordination is off and this is ``overlap``.
* ``ideal``: perfect sharing, ``max(D / B_DRAM, S / B_disk, (D + S) / B_GPU)`` (paper §3.2,
  Figure 4's "ideal overlap"), a lower bound for the others.

Prefill computes the prompt tokens not reloaded at ``prefill_tps`` tokens/s (or from the model's
FLOPs on a device, and overlapped with the reload layer by layer or not:
:mod:`saria.replay.layerwise`). Data movements that follow a request (stores and promotions GPU->DRAM at ``B_DRAM``, SSD writes at the drives' write
bandwidth) take ``bytes / rate`` on their own FIFO lanes.
"""

from __future__ import annotations

from saria.config import COORDINATION_SATURATION, Bandwidths

__all__ = ["GB", "LOADING_MODES", "transfer_seconds"]

GB = 1e9
LOADING_MODES = ("coordinated", "overlap", "serial", "ideal")


def transfer_seconds(dram_bytes: int, ssd_bytes: int, bw: Bandwidths, mode: str) -> float:
    """Seconds to load ``dram_bytes`` from DRAM and ``ssd_bytes`` from SSD into the GPU under
    ``mode`` (see the module docstring)."""
    if mode not in LOADING_MODES:
        raise ValueError(f"loading mode must be one of {LOADING_MODES}, got {mode!r}")
    if dram_bytes < 0 or ssd_bytes < 0:
        raise ValueError(f"byte counts must be >= 0, got DRAM {dram_bytes}, SSD {ssd_bytes}")
    d, s = float(dram_bytes), float(ssd_bytes)
    gpu, disk, dram = bw.gpu_gbps * GB, bw.disk_gbps * GB, bw.dram_gbps * GB
    r_d, r_s = min(dram, gpu), min(disk, gpu)
    if d == 0.0 or s == 0.0 or mode == "serial":
        return d / r_d + s / r_s
    if mode == "ideal":
        return max(d / dram, s / disk, (d + s) / gpu)
    if mode == "coordinated" and disk < COORDINATION_SATURATION * gpu:
        pace = min(dram, gpu - disk)
        t_s = s / r_s
        left = d - pace * t_s
        return t_s if left <= 0.0 else t_s + left / r_d
    # Uncoordinated overlap: DRAM at full rate, SSD on the residual ingress until DRAM is done.
    t_d = d / r_d
    residual = min(disk, gpu - r_d)
    left = s - residual * t_d
    return t_d if left <= 0.0 else t_d + left / r_s
