"""The GPU's SM clock and board power while a benchmark runs, read from NVML.

On a power-limited GPU the clock a kernel runs at depends on the power it draws, and that depends
on the data as well as on the code: at video-model sizes attention kernels (SDPA's,
FlashAttention-3's, fp4video's loops) can run at the board's power limit, below the top clock. A
speed ratio between two kernels is then a ratio of clock cycles *and* of clocks; ``bench kernel``
prints both sides with :class:`ClockSampler`.

NVML comes from ``nvidia-ml-py`` (``pip install fp4video[bench]``); without it, or without an
NVIDIA driver, the sampler reports why and the tables leave the columns empty.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

#: NVML's "clocks event reason" bit for the software power cap (the same value under its older
#: name, ``nvmlClocksThrottleReasonSwPowerCap``)
SW_POWER_CAP = 0x4


@dataclass(frozen=True)
class PowerSample:
    """Means over a timed window: SM clock (MHz), board power (W), and the share of samples in
    which the driver reported the software power cap holding the clock down."""

    mhz: float
    watts: float
    capped: float


def _nvml():
    """(pynvml module, None) once NVML is initialized, else (None, why)."""
    try:
        import pynvml
    except ImportError:
        return None, "NVML is not installed (pip install nvidia-ml-py, or fp4video[bench])"
    try:
        pynvml.nvmlInit()
    except Exception as e:  # pynvml.NVMLError: no driver, no permission
        return None, f"NVML did not start ({type(e).__name__}: {e})"
    return pynvml, None


def nvml_handle(device_index: int = 0):
    """(pynvml, handle) of CUDA device ``device_index`` (found by its PCI bus id where torch knows
    it, so that CUDA_VISIBLE_DEVICES cannot pick another GPU), or (None, why)."""
    nvml, why = _nvml()
    if nvml is None:
        return None, why
    try:
        import torch

        props = torch.cuda.get_device_properties(device_index)
        if all(hasattr(props, a) for a in ("pci_domain_id", "pci_bus_id", "pci_device_id")):
            bus = f"{props.pci_domain_id:08X}:{props.pci_bus_id:02X}:{props.pci_device_id:02X}.0"
            return nvml, nvml.nvmlDeviceGetHandleByPciBusId(bus)
        return nvml, nvml.nvmlDeviceGetHandleByIndex(device_index)
    except Exception as e:
        return None, f"NVML has no handle for CUDA device {device_index} ({type(e).__name__}: {e})"


class ClockSampler:
    """Samples the SM clock, the board power and the power-cap flag every ``interval`` seconds
    in a thread while a ``with`` block runs; :attr:`result` is then their :class:`PowerSample`
    over the block's last three quarters (the clock settles at the start), or None, with
    :attr:`why`, where NVML is missing or too few samples came (a block shorter than ~8 intervals).

    One sampler (``ClockSampler.for_device(0)``: one NVML handle) serves every block of a run;
    each ``with`` starts afresh."""

    def __init__(self, nvml, handle, why: str | None = None, interval: float = 0.02):
        self._nvml, self._handle, self.interval = nvml, handle, interval
        self._setup_why = self.why = why
        reasons = None
        if nvml is not None:
            reasons = (getattr(nvml, "nvmlDeviceGetCurrentClocksEventReasons", None)
                       or getattr(nvml, "nvmlDeviceGetCurrentClocksThrottleReasons", None))
        self._reasons = reasons
        self.result: PowerSample | None = None
        self._samples: list[tuple[float, float, bool]] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @classmethod
    def for_device(cls, device_index: int = 0, interval: float = 0.02) -> ClockSampler:
        nvml, handle = nvml_handle(device_index)
        return cls(nvml, handle if nvml is not None else None, None if nvml is not None else handle, interval)

    @property
    def available(self) -> bool:
        return self._nvml is not None

    def _sample(self):
        nvml, h = self._nvml, self._handle
        while not self._stop.is_set():
            try:
                capped = bool(self._reasons(h) & SW_POWER_CAP) if self._reasons is not None else False
                self._samples.append((float(nvml.nvmlDeviceGetClockInfo(h, nvml.NVML_CLOCK_SM)),
                                      nvml.nvmlDeviceGetPowerUsage(h) / 1000.0, capped))
            except Exception as e:  # a query this driver refuses: stop sampling, say why
                self.why = f"NVML query failed ({type(e).__name__}: {e})"
                return
            time.sleep(self.interval)

    def __enter__(self) -> ClockSampler:
        self._samples, self.result, self.why = [], None, self._setup_why
        if self.available:
            self._stop.clear()
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None
        self.result = summarize(self._samples)
        if self.result is None and self.available and self.why is None:
            self.why = f"{len(self._samples)} samples: too few for a mean (a longer window is needed)"


def summarize(samples: list[tuple[float, float, bool]]) -> PowerSample | None:
    """:class:`PowerSample` over all but the first quarter of ``samples`` (MHz, W, capped), or
    None for fewer than 8."""
    if len(samples) < 8:
        return None
    late = samples[len(samples) // 4:]
    n = len(late)
    return PowerSample(sum(s[0] for s in late) / n, sum(s[1] for s in late) / n, sum(s[2] for s in late) / n)
