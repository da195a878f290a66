"""The CPU processor's backend: numpy kernels, no Ray inside."""
