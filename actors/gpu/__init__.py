"""The GPU processor's backend: OpenCL kernels (pyopencl), no Ray inside."""
