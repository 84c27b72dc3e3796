"""The NVML library's part of ``nvmlDeviceGetProcessUtilization`` on a simulated GPU: what
it makes of the driver's per-process samples (:mod:`.perfmon`) for one call with a
``lastSeenTimeStamp``.

NVML's aggregation is closed source; what is known (docs/reference.md, "The driver's samples"):
"one utilization sample structure is returned per process running, that had some non-zero
utilization during the last sample period", samples are newer than ``lastSeenTimeStamp``,
and a call with an old ``lastSeenTimeStamp`` returns "the utilization over a larger period
of time". Two readings of that, both modelled (``EngineConfig.nvml_aggregation``), to be
settled by a trace from a real GPU (``bench/gpu_suite.py`` records the raw calls):

- ``per-sample``: every driver sample newer than ``lastSeenTimeStamp`` that credits a
  process with non-zero utilization is returned as it is (a process may appear several
  times in one answer, each with its sample's timestamp);
- ``per-call``: one entry per process per call: its newest sample's timestamp, and the
  mean of its credited utilization over all the driver's samples in the call's span
  (so a process resident at a third of the instants reads a third of their utilization).

Under the ``exact`` engine view the samples are already per process and period and pass
through as ``per-sample``.
"""

from __future__ import annotations

from collections.abc import Sequence

from agent.platform.gpu.sim.perfmon import NO_PROCESS, Sample

AGGREGATIONS = ("per-sample", "per-call", "per-call-last")


def process_utilization(samples: Sequence[Sample], since_us: int, aggregation: str) -> list[Sample]:
    """What ``nvmlDeviceGetProcessUtilization(lastSeenTimeStamp=since_us)`` returns over the
    driver's visible ``samples`` (in timestamp order)."""
    newer = [s for s in samples if s.timestamp_us > since_us]
    if aggregation == "per-sample":
        return [s for s in newer if s.pid != NO_PROCESS and s.sm_util > 0]
    spans = len({s.timestamp_us for s in newer})
    if spans == 0:
        return []
    sums: dict[int, int] = {}
    newest: dict[int, int] = {}
    for s in newer:
        if s.pid == NO_PROCESS:
            continue
        sums[s.pid] = sums.get(s.pid, 0) + s.sm_util
        newest[s.pid] = max(newest.get(s.pid, 0), s.timestamp_us)
    if aggregation == "per-call-last":
        last = max(s.timestamp_us for s in newer)
        credited = {s.pid for s in newer if s.timestamp_us == last and s.sm_util > 0}
        return [Sample(pid, last, round(sums[pid] / spans)) for pid in sorted(credited) if sums[pid] > 0]
    out = [Sample(pid, newest[pid], round(total / spans)) for pid, total in sums.items()]
    return sorted((s for s in out if s.sm_util > 0), key=lambda s: s.timestamp_us)
