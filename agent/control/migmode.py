"""What the MIG controls (a geometry, isolated shares on demand, dynamic MIG through DRA)
say alike about a GPU's MIG mode: whether processes keep it from changing, and that a mode
change waits for a GPU reset."""

from __future__ import annotations

from agent.platform.gpu.inventory import GpuBackend


def pids_on(backend: GpuBackend, index: int) -> str | None:
    """``"pids 12, 34"``: the processes using GPU ``index`` (its MIG mode and instances change
    only while none does); None when none does. GpuError when they cannot be listed."""
    processes = backend.process_memory(index)
    if not processes:
        return None
    return "pids " + ", ".join(str(p.pid) for p in sorted(processes, key=lambda p: p.pid))


def pending_reset(index: int, then: str) -> str:
    """A GPU whose new MIG mode waits for its reset; ``then``: what happens after it."""
    return (
        f"GPU {index}: MIG mode is enabled, pending a GPU reset (nvidia-smi --gpu-reset -i {index}, or "
        f"a reboot where the GPU cannot be reset); {then}"
    )
