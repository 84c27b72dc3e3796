"""kubelet's gRPC APIs (device plugin v1beta1) and the device-plugin directory."""
