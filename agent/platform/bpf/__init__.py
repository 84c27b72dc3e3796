"""BPF programs loaded with bcc: NVIDIA ioctl attribution, cgroup v2 device rules, feature probes."""
