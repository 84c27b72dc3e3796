"""vcuda-agent: share NVIDIA GPUs between Kubernetes pods with limits that hold."""

__version__ = "0.1.0"
