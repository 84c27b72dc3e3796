"""Kubernetes API adapters: the pod model, the pod cache, node and event writers."""
