"""dense: standard attention, S and P in HBM (Algorithm 0), and its backward (Algorithm 3).

Importing the package registers both passes (`forward`, `backward`).
"""

from . import backward, forward  # noqa: F401  (registers them)
