"""GPU backends (NVML, simulated) behind the ``GpuBackend`` interface."""
