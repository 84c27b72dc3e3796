"""The simulated GPU node: an execution engine per GPU, its server, workloads and the backend."""
