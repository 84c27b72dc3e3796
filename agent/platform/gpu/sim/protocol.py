"""The GPU server's wire format: one JSON object per line over a unix stream socket.

A client sends requests ``{"op": ..., ...}`` and reads one reply per request, in order:
``{"ok": true, ...}`` or ``{"ok": false, "error": "..."}``. A connection that sent
``subscribe`` receives health events instead, one line each: ``{"event": {...}}``.

Requests (a workload's connection is its CUDA context: closing it destroys the context and
drops its queued work, as a process exit does):

- ``open {gpu, share, mps_pipe, memory_limit_mib}``: make this connection a context on GPU
  ``gpu`` (``share``: the MPS active-thread percentage the client read from its
  environment, 100 when unset; ``mps_pipe``: its CUDA_MPS_PIPE_DIRECTORY, if set;
  ``memory_limit_mib``: its pinned device-memory limit, if set). Both apply only under an
  MPS server; while a server holds the GPU, only its clients (same pipe directory) may
  open. The server takes the pid from SO_PEERCRED and the cgroup from /proc. Reply
  ``{context, mps}``.
- ``mps_attach {gpu, pipe}``: this connection is the GPU's MPS server (a control daemon
  serving ``pipe``) until it closes; then its clients' contexts are destroyed.
- ``memlimit {gpu, cgroup, mib}``: the driver's hard memory limit for a cgroup directory
  (full path) and everything below it; ``mib`` null clears it.
- ``launch {count, kernel_ms}`` / ``graph {kernels, kernel_ms}``: queue kernels / one graph;
  the reply comes once all are queued (at once while the queue has room).
- ``sync``: the reply comes when the context's queue is empty.
- ``alloc {mib}`` (negative frees): device memory; an error when the GPU cannot hold it.
- ``poll {since: {gpu: µs}}``: what NVML would report now: per GPU ``{index, lost,
  utilization, samples: [[pid, µs, sm]], memory: [[pid, bytes]]}``, plus ``hang: [call,
  seconds left]`` while an injected hang lasts.
- ``truth``: exact GPU time and memory (now and peak) per context and GPU, and the peak
  memory of contexts that are gone (for tests, benches and the demo).
- ``event {gpu, kind, xid, detail}``: inject a health event (``sim-event``).
- ``hang {gpu, call, seconds}``: fault injection (``sim-event --hang``): for ``seconds``,
  the agent's backend blocks in the GPU's ``call`` (an NVML function name, ``*`` for
  every per-GPU call), as a driver stuck in an ioctl holds the calling thread.
- ``subscribe``: become an event stream; the GPUs lost now are sent first.

MIG (:mod:`.migops`; docs/mig.md): ``open`` takes ``mig`` (a MIG device's UUID) to open the
context on that device, and a GPU in MIG mode opens contexts nowhere else.

- ``nvml {call, gpu, ...}``: one of NVML's MIG functions by its pynvml name (:mod:`.migcalls`);
  a refusal carries NVML's return code as ``nvml``.
- ``mig_state``: every GPU's MIG mode (current, pending) and MIG devices.
- ``mig_truth``: exact figures per MIG device (``work_s`` in seconds of the whole GPU).
- ``gpu_reset {gpu}``: the pending MIG mode applies and every MIG instance goes (refused while
  processes use the GPU).
- ``event`` takes ``gi``: the MIG GPU instance an XID is attributed to.
"""

from __future__ import annotations

import json
from typing import Any

from agent.errors import SimulationError

MAX_LINE = 1 << 20  # a request or reply longer than this is refused


def encode(message: dict[str, Any]) -> bytes:
    return (json.dumps(message, separators=(",", ":")) + "\n").encode()


def decode(line: bytes) -> dict[str, Any]:
    try:
        message = json.loads(line)
    except ValueError as err:
        raise SimulationError(f"malformed message {line[:80]!r}: {err}") from err
    if not isinstance(message, dict):
        raise SimulationError(f"malformed message {line[:80]!r}: not an object")
    return message


class LineBuffer:
    """Bytes in, complete lines out."""

    def __init__(self) -> None:
        self._data = bytearray()

    def feed(self, data: bytes) -> list[bytes]:
        self._data += data
        lines = []
        while True:
            end = self._data.find(b"\n")
            if end < 0:
                break
            lines.append(bytes(self._data[:end]))
            del self._data[: end + 1]
        if len(self._data) > MAX_LINE:
            raise SimulationError(f"a message longer than {MAX_LINE} bytes")
        return lines
