"""The registered schedules, one module each. Importing this package registers them all.

To add a loop order, write `loop_orders/schedules/<name>.py` with a `Schedule` subclass
decorated with `@register` (README, "Adding a schedule"); every module of this package is
imported here, in name order, so nothing else needs an edit.
"""

import importlib
import pkgutil

for _module in sorted(m.name for m in pkgutil.iter_modules(__path__)):
    importlib.import_module(f"{__name__}.{_module}")
