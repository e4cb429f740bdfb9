"""Where kernels run: GPU or simulator, arrays in and out, launches and timing, the disk cache
of compiled kernels, and the inline PTX (`intrinsics`, the only module that writes any)."""
