"""Low-precision formats: the FP8 quantisation contract (`fp8`) and its Triton kernels (`triton_fp8`)."""
