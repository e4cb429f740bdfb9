"""kv_outer: FlashAttention Algorithm 1 (K/V blocks outer), and its backward, Algorithm 4.

Importing the package registers both passes (`forward`, `backward`).
"""

from . import backward, forward  # noqa: F401  (registers them)
