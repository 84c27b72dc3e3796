"""The kubelet device plugin for nvidia.com/vcuda-core."""
