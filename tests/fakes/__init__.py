"""Test doubles for platform facilities (NVML, ...) on machines that lack them."""
