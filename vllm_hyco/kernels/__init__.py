"""Triton kernels and their torch twins (the twin is the CPU path and the test oracle)."""
