"""The kube-scheduler extender service: wire format, HTTP server, request handlers."""
