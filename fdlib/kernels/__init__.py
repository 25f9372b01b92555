"""Triton kernels. Import :mod:`fdlib` (which decides the runtime) before these modules."""
