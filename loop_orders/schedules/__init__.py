"""The registered schedules, one module each. Importing this package registers them all.

To add a loop order: write `loop_orders/schedules/<name>.py` with a kernel factory, a
`Schedule` subclass decorated with `@register` (model, loop nest, tile sizing, launch), and
import it here. Tests and experiments pick it up from the registry.
"""

from . import dense, kv_outer, q_outer  # noqa: F401  (registration side effects)
