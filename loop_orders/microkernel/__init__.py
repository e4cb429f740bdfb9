"""The micro-kernel layer: device functions for one tile, shared by every loop nest.

`spec` names the forward builds and the `MicroKernel` interface they return; `cuda_cores`
(the CUDA-core build, and `MicroKernelSchedule`, which picks a build for a problem) and
`tensor_cores` (mma.sync, 16-bit and TF32) are the builds; `tiles` holds the tile copies,
counters and loops they share, `stream` the K/V loop past a resident query block (q_outer,
split_kv) on any build, `grad_tiles` the backward's tile and `grad_tensor_cores` its
tensor-core products.
"""
