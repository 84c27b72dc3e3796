"""cgroups: layout and driver detection, pod/container path resolution, GPU device rules."""
