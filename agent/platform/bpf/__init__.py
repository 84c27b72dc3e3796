"""BPF programs (NVIDIA ioctl attribution, cgroup v2 device rules, memory quotas, feature probes),
compiled by bcc in a short-lived child process and used here through raw syscalls."""
