"""The registered schedules, one module or package each. Importing this package registers
them all.

To add a loop order, write `loop_orders/schedules/<name>.py` with a `Schedule` subclass
decorated with `@register` (docs/architecture.md), or a package `<name>/` whose `__init__`
imports its `forward` and `backward` modules; every module and package here is imported, in
name order, so nothing else needs an edit.
"""

import importlib
import pkgutil

for _module in sorted(m.name for m in pkgutil.iter_modules(__path__)):
    importlib.import_module(f"{__name__}.{_module}")
