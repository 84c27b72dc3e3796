"""GuardedBackend: per-GPU backend calls under a deadline. A call that hangs (a driver stuck
in an ioctl) is stood in for by a call that blocks until the test lets it go: on a small
stand-in backend, and on the real NvmlBackend over the fake NVML."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from agent.errors import DeviceSamplesUnsupportedError, GpuError, GpuHungError, MigChangeError, NvmlError
from agent.platform.gpu import guarded as guarded_module
from agent.platform.gpu.guarded import GuardedBackend
from agent.platform.gpu.inventory import (
    CALL_DEVICE_SAMPLES,
    CALL_PROCESS_MEMORY,
    CALL_PROCESS_SAMPLES,
    DeviceEvent,
    DeviceSample,
    GpuInfo,
    ProcessMemory,
    ProcessSample,
    Topology,
)
from agent.platform.gpu.migcontrol import MigControl
from agent.platform.gpu.migstate import NOT_CAPABLE, MigInfo
from agent.platform.gpu.nvml import open_nvml_backend
from tests.fakes.fake_nvml import FakeGpu, FakeNvml

DEADLINE_S = 0.3
SAMPLE = ProcessSample(pid=42, timestamp_us=1_000, sm_util=30)
DEVICE_SAMPLE = DeviceSample(timestamp_us=1_000, util=80)


def wait_until(condition: Callable[[], bool], timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


class HeldBackend:
    """Two GPUs whose per-GPU calls block while the GPU is held (``hold``/``let_go``)."""

    def __init__(self) -> None:
        self._free = {0: threading.Event(), 1: threading.Event()}
        for event in self._free.values():
            event.set()
        self.fail_with: Exception | None = None
        self.closed = False
        self.device_calls: list[tuple[int, int]] = []  # (index, since_us) of device_samples

    def hold(self, index: int) -> None:
        self._free[index].clear()

    def let_go(self, index: int) -> None:
        self._free[index].set()

    def _enter(self, index: int) -> None:
        if not self._free[index].wait(30):
            raise AssertionError("held for 30 s: the test never let the call go")
        if self.fail_with is not None:
            raise self.fail_with

    @property
    def name(self) -> str:
        return "held"

    def gpus(self) -> Sequence[GpuInfo]:
        return [GpuInfo(i, f"GPU-{i}", "test", 1024, i, f"0:{i}", 0) for i in (0, 1)]

    def topology(self) -> Topology:
        return Topology()

    def wait_events(self, timeout_s: float) -> list[DeviceEvent]:
        return []

    def process_samples(self, index: int, since_us: int) -> list[ProcessSample]:
        self._enter(index)
        return [SAMPLE]

    def process_memory(self, index: int) -> list[ProcessMemory]:
        self._enter(index)
        return [ProcessMemory(42, 1 << 20)]

    def device_utilization(self, index: int) -> int:
        self._enter(index)
        return 55

    def sample_period_s(self, index: int) -> float | None:
        self._enter(index)
        return 0.1

    def device_samples(self, index: int, since_us: int) -> list[DeviceSample]:
        self._enter(index)
        self.device_calls.append((index, since_us))
        return [DEVICE_SAMPLE]

    def mps_control_command(self) -> list[str]:
        return []

    def mig(self, index: int) -> MigInfo:
        return NOT_CAPABLE

    def mig_control(self) -> MigControl:
        raise MigChangeError("no MIG on this backend")

    def memory_limits_support(self) -> str | None:
        return None

    def set_memory_limit(self, index: int, cgroup: Path, limit_bytes: int | None) -> None:
        self._enter(index)

    def close(self) -> None:
        self.closed = True


@pytest.fixture
def held() -> HeldBackend:
    return HeldBackend()


@pytest.fixture
def guarded(held: HeldBackend) -> Iterator[GuardedBackend]:
    backend = GuardedBackend(held, deadline_s=DEADLINE_S)
    yield backend
    for index in (0, 1):
        held.let_go(index)
    backend.close()


def test_a_hung_call_degrades_only_its_gpu_until_it_returns(
    held: HeldBackend, guarded: GuardedBackend, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="agent.platform.gpu.guarded")
    threads_before = threading.active_count()
    held.hold(1)
    started = time.monotonic()
    with pytest.raises(GpuHungError) as hung:
        guarded.process_samples(1, 0)
    waited = time.monotonic() - started
    assert DEADLINE_S <= waited < DEADLINE_S + 0.5, "the caller waits the deadline, no more"
    assert hung.value.call == CALL_PROCESS_SAMPLES
    assert guarded.degraded(1) == f"{CALL_PROCESS_SAMPLES} did not return within {DEADLINE_S:g} s"
    assert guarded.degraded(0) is None
    assert guarded.process_samples(0, 0) == [SAMPLE]  # the other GPU is not affected

    # While the call is stuck, every call on its GPU fails at once, whatever the function,
    # and no thread is added per call: the GPU's one worker is the one stuck thread.
    started = time.monotonic()
    for _ in range(20):
        with pytest.raises(GpuHungError, match=CALL_PROCESS_SAMPLES):
            guarded.process_memory(1)
    assert time.monotonic() - started < DEADLINE_S, "a call waited behind the stuck one"
    assert threading.active_count() - threads_before <= 2  # one worker per GPU, no more
    assert guarded.call_timeouts() == {(1, CALL_PROCESS_SAMPLES): 1}

    held.let_go(1)
    assert wait_until(lambda: guarded.degraded(1) is None), "the GPU did not recover"
    assert guarded.process_memory(1) == [ProcessMemory(42, 1 << 20)]
    assert guarded.call_timeouts() == {(1, CALL_PROCESS_SAMPLES): 1}
    messages = [r.getMessage() for r in caplog.records]
    assert any(m.startswith(f"GPU 1 degraded: {CALL_PROCESS_SAMPLES} has not returned") for m in messages)
    assert any(m.startswith(f"GPU 1 recovered: {CALL_PROCESS_SAMPLES} returned after") for m in messages)


def test_a_caller_that_waited_the_deadline_sees_the_gpu_degraded_when_the_worker_started_late(
    held: HeldBackend, guarded: GuardedBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    # On a busy host the worker thread picks a call up some time after it was submitted
    # (CI saw it): the caller's wait, not the worker's clock, says the deadline has passed.
    run = guarded_module._GpuWorker._run

    def late_run(worker: Any) -> None:
        time.sleep(DEADLINE_S / 3)
        run(worker)

    monkeypatch.setattr(guarded_module._GpuWorker, "_run", late_run)
    held.hold(1)
    with pytest.raises(GpuHungError, match=f"{CALL_PROCESS_SAMPLES} did not return within"):
        guarded.process_samples(1, 0)
    assert guarded.degraded(1) == f"{CALL_PROCESS_SAMPLES} did not return within {DEADLINE_S:g} s"
    assert guarded.call_timeouts() == {(1, CALL_PROCESS_SAMPLES): 1}
    held.let_go(1)
    assert wait_until(lambda: guarded.degraded(1) is None), "the GPU did not recover"


def test_submitted_calls_are_not_waited_for_and_collected_when_done(
    held: HeldBackend, guarded: GuardedBackend
) -> None:
    held.hold(0)
    samples = guarded.submit_process_samples(0, 0)
    utilization = guarded.submit_device_utilization(0)  # queued behind it on GPU 0's worker
    assert not samples.wait(0.05) and not samples.done()
    held.let_go(0)
    assert samples.wait(5) and utilization.wait(5)
    assert (samples.result(), utilization.result()) == ([SAMPLE], 55)
    assert guarded.degraded(0) is None


def test_a_stuck_call_unseen_until_it_returns_still_counts_as_a_timeout(
    held: HeldBackend, guarded: GuardedBackend
) -> None:
    held.hold(1)
    pending = guarded.submit_process_samples(1, 0)
    time.sleep(DEADLINE_S + 0.1)  # the hang itself: nobody asks about the GPU meanwhile
    held.let_go(1)
    assert pending.wait(5)
    assert guarded.call_timeouts() == {(1, CALL_PROCESS_SAMPLES): 1}


def test_errors_of_a_call_are_raised_in_the_callers_thread(
    held: HeldBackend, guarded: GuardedBackend
) -> None:
    held.fail_with = NvmlError(999, "unknown error", 0)
    with pytest.raises(NvmlError, match="unknown error"):
        guarded.process_samples(0, 0)
    assert guarded.degraded(0) is None


def test_close_fails_queued_calls_and_closes_the_backend(held: HeldBackend) -> None:
    guarded = GuardedBackend(held, deadline_s=DEADLINE_S)
    held.hold(0)
    running = guarded.submit_process_samples(0, 0)
    queued = guarded.submit_device_utilization(0)
    guarded.close()
    assert held.closed
    assert queued.wait(1)
    with pytest.raises(GpuError, match="closed"):
        queued.result()
    held.let_go(0)
    assert running.wait(5)


def test_nvml_backend_call_that_hangs_names_the_nvml_function(tmp_path: Path) -> None:
    fake = FakeNvml([FakeGpu(uuid=f"GPU-{i}", bus_id=f"00000000:0{i}:00.0", minor=i) for i in (0, 1)])
    free = threading.Event()
    real = fake.nvmlDeviceGetComputeRunningProcesses

    def hangs(handle: Any) -> Any:  # the driver stuck in its ioctl until the test lets go
        free.wait(30)
        return real(handle)

    guarded = GuardedBackend(open_nvml_backend(fake, sysfs_root=tmp_path), deadline_s=DEADLINE_S)
    try:
        fake.nvmlDeviceGetComputeRunningProcesses = hangs  # type: ignore[method-assign]
        with pytest.raises(GpuHungError) as hung:
            guarded.process_memory(1)
        assert hung.value.call == CALL_PROCESS_MEMORY
        assert CALL_PROCESS_MEMORY in (guarded.degraded(1) or "")
        assert guarded.device_utilization(0) == 0  # GPU 0's calls still answer
        free.set()
        assert wait_until(lambda: guarded.degraded(1) is None)
        assert guarded.process_memory(1) == []
    finally:
        free.set()
        guarded.close()


def test_device_samples_pass_through_and_a_hung_one_degrades_its_gpu(
    held: HeldBackend, guarded: GuardedBackend
) -> None:
    assert guarded.device_samples(0, 500) == [DEVICE_SAMPLE]
    assert held.device_calls == [(0, 500)]
    held.hold(1)
    started = time.monotonic()
    with pytest.raises(GpuHungError) as hung:
        guarded.device_samples(1, 700)
    assert DEADLINE_S <= time.monotonic() - started < DEADLINE_S + 0.5
    assert (hung.value.gpu_index, hung.value.call) == (1, CALL_DEVICE_SAMPLES)
    assert guarded.degraded(1) == f"{CALL_DEVICE_SAMPLES} did not return within {DEADLINE_S:g} s"
    assert guarded.degraded(0) is None
    started = time.monotonic()
    for call in (lambda: guarded.process_samples(1, 0), lambda: guarded.device_samples(1, 0)):
        with pytest.raises(GpuHungError, match=CALL_DEVICE_SAMPLES):
            call()
    assert time.monotonic() - started < DEADLINE_S, "a call waited behind the stuck one"
    assert guarded.device_samples(0, 0) == [DEVICE_SAMPLE]  # the other GPU answers
    assert guarded.call_timeouts() == {(1, CALL_DEVICE_SAMPLES): 1}
    held.let_go(1)
    assert wait_until(lambda: guarded.degraded(1) is None), "the GPU did not recover"
    assert guarded.device_samples(1, 900) == [DEVICE_SAMPLE]
    assert held.device_calls == [(0, 500), (0, 0), (1, 700), (1, 900)]  # the stuck call, then the new


def test_submitted_device_samples_are_collected_when_done(held: HeldBackend, guarded: GuardedBackend) -> None:
    held.hold(0)
    pending = guarded.submit_device_samples(0, 42)
    assert not pending.wait(0.05) and not pending.done()
    with pytest.raises(GpuError, match="nvmlDeviceGetSamples has not returned yet"):
        pending.result()
    held.let_go(0)
    assert pending.wait(5)
    assert pending.result() == [DEVICE_SAMPLE]
    assert held.device_calls == [(0, 42)]


def test_unsupported_device_samples_raise_in_the_callers_thread_without_degrading(
    held: HeldBackend, guarded: GuardedBackend
) -> None:
    held.fail_with = DeviceSamplesUnsupportedError("GPU 0: nvmlDeviceGetSamples: Not Supported")
    with pytest.raises(DeviceSamplesUnsupportedError, match="Not Supported"):
        guarded.device_samples(0, 0)
    pending = guarded.submit_device_samples(0, 0)
    assert pending.wait(5)
    with pytest.raises(DeviceSamplesUnsupportedError):
        pending.result()
    assert guarded.degraded(0) is None and guarded.call_timeouts() == {}


def test_nvml_device_samples_that_hang_name_nvml_get_samples(tmp_path: Path) -> None:
    fake = FakeNvml([FakeGpu(uuid=f"GPU-{i}", bus_id=f"00000000:0{i}:00.0", minor=i) for i in (0, 1)])
    fake.set_utilization_samples(1, [100, 200], [30, 60])
    free = threading.Event()
    real = fake.nvmlDeviceGetSamples

    def hangs(handle: Any, samplingType: int, timeStamp: int) -> tuple[int, list[Any]]:
        free.wait(30)
        return real(handle, samplingType, timeStamp)

    guarded = GuardedBackend(open_nvml_backend(fake, sysfs_root=tmp_path), deadline_s=DEADLINE_S)
    try:
        fake.nvmlDeviceGetSamples = hangs  # type: ignore[method-assign]
        with pytest.raises(GpuHungError) as hung:
            guarded.device_samples(1, 0)
        assert hung.value.call == CALL_DEVICE_SAMPLES
        assert guarded.degraded(1) == f"{CALL_DEVICE_SAMPLES} did not return within {DEADLINE_S:g} s"
        assert guarded.device_utilization(0) == 0  # GPU 0's calls still answer
        free.set()
        assert wait_until(lambda: guarded.degraded(1) is None)
        assert guarded.device_samples(1, 100) == [DeviceSample(200, 60)]
    finally:
        free.set()
        guarded.close()
