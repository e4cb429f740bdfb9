"""Hardware instructions the kernels want and Numba does not offer as such.

`exp2(x)`: 2^x in float32 as the single MUFU.EX2 instruction (PTX `ex2.approx.ftz.f32`).
Numba lowers `math.exp2` to `ex2.approx.f32`, which flushes no subnormals and so takes three
more instructions around the MUFU (a compare and two multiplies that rescale subnormal
inputs). The online softmax only ever exponentiates differences s - m <= 0 of a row's scores
and its running max, where a weight below 2^-126 is as good as 0, so the flushing version is
exact enough; both give 2^-inf = 0 and propagate NaN. The simulator runs `math.exp2`.
"""

from __future__ import annotations

import math

from .runtime import SIMULATOR, cuda

if SIMULATOR:
    exp2 = math.exp2
else:
    from llvmlite import ir
    from numba import types
    from numba.cuda.extending import intrinsic

    @intrinsic
    def _ex2_approx_ftz(typingctx, x):
        if not isinstance(x, types.Float):
            return None

        def codegen(context, builder, sig, args):
            arg = context.cast(builder, args[0], sig.args[0], types.float32)
            f32 = ir.FloatType()
            asm = ir.InlineAsm(ir.FunctionType(f32, [f32]), "ex2.approx.ftz.f32 $0, $1;",
                               "=f,f")
            return builder.call(asm, [arg])

        return types.float32(x), codegen

    @cuda.jit(device=True, inline="always")
    def exp2(x):
        return _ex2_approx_ftz(x)
