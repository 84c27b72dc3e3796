"""The kubelet side of the DRA driver gpu.vcuda.io: plugin registration, the DRA gRPC service
(v1 and v1beta1) and the CDI specs of prepared claims."""
