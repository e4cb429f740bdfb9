"""q_outer: FlashAttention-2's order (a query block on chip, K/V streamed), its backward, and its
warp-specialised float32 kernel.

Importing the package registers both passes (`forward`, `backward`).
"""

from . import backward, forward  # noqa: F401  (registers them)
