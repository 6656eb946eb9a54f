"""How hard a training run worked its machine: peak resident memory, and GPU utilisation and memory sampled in a
background thread while the loop runs (pipeline.model.train records the summary in the stage's manifest)."""

from __future__ import annotations

import logging
import threading
from typing import Any

import torch

log = logging.getLogger(__name__)
LOW_UTILISATION = 70.0  # mean GPU utilisation (%) below which the micro-batch is probably too small


def peak_rss_mb() -> float:
    """This process's peak resident memory so far (model load included), in MiB.

    VmHWM belongs to the process's own address space; ru_maxrss would not do for a spawned training rank, as Linux
    carries the high-water mark of the parent it was forked from across the exec."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return round(int(line.split()[1]) / 1024, 1)
    except OSError:
        pass
    import resource

    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)  # KiB on Linux


class UtilisationWatch:
    """Samples GPU utilisation and memory in a background thread (NVML when importable, else torch's counters)."""

    def __init__(self, device: str, interval_s: float = 1.0):
        self.device, self.interval_s = device, interval_s
        self.util: list[float] = []
        self.mem_mb: list[float] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._nvml: Any = None

    def __enter__(self) -> UtilisationWatch:
        if self.device != "cuda":
            return self
        try:
            import pynvml

            pynvml.nvmlInit()
            self._nvml = pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())
        except Exception:  # noqa: BLE001 - NVML is optional; torch's counters are the fallback
            self._nvml = None
        torch.cuda.reset_peak_memory_stats()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        if self._nvml is not None:
            import pynvml

            self.util.append(float(pynvml.nvmlDeviceGetUtilizationRates(self._nvml).gpu))
            self.mem_mb.append(pynvml.nvmlDeviceGetMemoryInfo(self._nvml).used / 2**20)
        else:
            try:
                self.util.append(float(torch.cuda.utilization()))
            except Exception:  # noqa: BLE001 - torch.cuda.utilization itself needs NVML
                pass
            self.mem_mb.append(torch.cuda.memory_allocated() / 2**20)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._sample()

    def __exit__(self, *exc: Any) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()

    def summary(self) -> dict[str, Any]:
        if self.device != "cuda":
            return {"device": self.device, "peak_rss_mb": peak_rss_mb()}
        mean = sum(self.util) / len(self.util) if self.util else None
        out = {
            "device": "cuda",
            "source": "nvml" if self._nvml is not None else "torch",
            "samples": len(self.util),
            "mean_utilisation_percent": None if mean is None else round(mean, 1),
            "peak_allocated_mb": round(torch.cuda.max_memory_allocated() / 2**20, 1),
            "peak_used_mb": round(max(self.mem_mb), 1) if self.mem_mb else None,
        }
        if mean is not None and mean < LOW_UTILISATION:
            log.warning("GPU utilisation averaged %.0f%% (< %.0f%%) during training: the micro-batch is probably "
                        "too small for this GPU; raise train.batch_size", mean, LOW_UTILISATION)
        return out
