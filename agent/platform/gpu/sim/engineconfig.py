"""The physics of one simulated GPU, as a settings object: time-slicing, queues, MPS, and
how the driver and NVML report its use (docs/gpu-model.md has what each field models and
why; ``EngineConfig.ideal`` the hardware's inconveniences turned off)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from agent.errors import InvalidSpecError
from agent.platform.gpu.sim.nvmllib import AGGREGATIONS
from agent.platform.gpu.sim.perfmon import NVML_VIEWS, SAMPLE_CREDITS
from agent.platform.gpu.sim.spec import DEFAULT_SAMPLE_PERIOD_S

MAX_SAMPLE_PERIOD_S = 1.0
MPS_SAMPLES = ("server", "client")  # whom NVML credits with an MPS client's work


@dataclass(frozen=True)
class EngineConfig:
    """The physics of one simulated GPU."""

    memory_bytes: int = 80 * 1024**3
    timeslice_s: float = 0.002  # time-slicing between contexts without MPS
    sample_period_s: float = DEFAULT_SAMPLE_PERIOD_S  # NVML's per-process sample period
    sample_delay_s: float = 0.25  # a sample becomes visible this long after its period ends...
    sample_jitter_s: float = 0.25  # ...plus up to this much more (uniform, seeded)
    queue_depth: int = 1024  # launches a context's queue holds before a launch blocks
    mps: bool = False  # clients run concurrently, each within its active-thread percentage
    mps_samples: str = "server"  # under an attached MPS server: "server" or "client" samples
    sm_count: int | None = 132  # MPS shares are whole TPCs of these SMs (None: as given)
    # MPS throughput by active-thread percentage as recorded on this product (mpspartition);
    # None: a client's throughput is its whole TPCs' share of the SMs.
    mps_curve: tuple[tuple[float, float], ...] | None = None
    seed: int = 0
    nvml_view: str = "driver"  # "driver": as NVIDIA's driver samples; "exact": the ideal (perfmon.py)
    nvml_aggregation: str = "per-sample"  # what NVML makes of the driver's samples (nvmllib.py)
    sm_activity: float = 0.867  # SM activity a context's kernels show (an H100 matmul loop's)
    switch_s: float = 0.00025  # a time-slice switch between contexts: busy, no work done
    sample_credit: str = "resident"  # what a driver sample credits its process with (perfmon.py)
    credit_window_s: float = 1.0  # ...averaged over this much time ("resident")
    host_wake_s: float = 0.00005  # after a sync, the host thread runs again this much later (mean)

    @classmethod
    def ideal(cls, **fields: Any) -> EngineConfig:
        """The engine without the hardware's inconveniences: free context switches and host
        wake-ups, SM activity of 1 and NVML's exact view (the comparison the realistic
        default is measured against; tests of queue mechanics)."""
        base: dict[str, Any] = {"switch_s": 0.0, "host_wake_s": 0.0, "sm_activity": 1.0, "nvml_view": "exact"}
        return cls(**(base | fields))

    def problems(self) -> list[str]:
        """Every invalid field, named."""
        found = []
        if self.memory_bytes <= 0:
            found.append(f"GPU memory must be > 0, got {self.memory_bytes}")
        if not 0.0001 <= self.timeslice_s <= 1.0:
            found.append(f"timeslice must be 0.1..1000 ms, got {self.timeslice_s * 1000:g} ms")
        if not 0.01 <= self.sample_period_s <= MAX_SAMPLE_PERIOD_S:
            found.append(f"sample period must be 0.01..1 s, got {self.sample_period_s:g} s")
        if not 0 <= self.sample_delay_s <= 30:
            found.append(f"sample delay must be 0..30 s, got {self.sample_delay_s:g} s")
        if not 0 <= self.sample_jitter_s <= 30:
            found.append(f"sample jitter must be 0..30 s, got {self.sample_jitter_s:g} s")
        if not 1 <= self.queue_depth <= 1_000_000:
            found.append(f"queue depth must be 1..1000000 launches, got {self.queue_depth}")
        if self.mps_samples not in MPS_SAMPLES:
            found.append(f"MPS samples must be one of {', '.join(MPS_SAMPLES)}, got {self.mps_samples!r}")
        if self.nvml_view not in NVML_VIEWS:
            found.append(f"NVML view must be one of {', '.join(NVML_VIEWS)}, got {self.nvml_view!r}")
        if self.nvml_aggregation not in AGGREGATIONS:
            found.append(
                f"NVML aggregation must be one of {', '.join(AGGREGATIONS)}, got {self.nvml_aggregation!r}"
            )
        if not 0.01 <= self.sm_activity <= 1.0:
            found.append(f"SM activity must be 0.01..1, got {self.sm_activity:g}")
        if self.sample_credit not in SAMPLE_CREDITS:
            found.append(
                f"sample credit must be one of {', '.join(SAMPLE_CREDITS)}, got {self.sample_credit!r}"
            )
        if not 0 < self.credit_window_s <= 10:
            found.append(f"credit window must be > 0 and <= 10 s, got {self.credit_window_s:g} s")
        if not 0 <= self.host_wake_s <= 0.1:
            found.append(f"host wake-up must be 0..100 ms, got {self.host_wake_s * 1000:g} ms")
        if not 0 <= self.switch_s <= 0.1:
            found.append(f"context switch must be 0..100 ms, got {self.switch_s * 1000:g} ms")
        return found

    def validate(self) -> None:
        found = self.problems()
        if found:
            raise InvalidSpecError("; ".join(found))
