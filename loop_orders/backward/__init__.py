"""The registered backward schedules, one module each (named after the forward schedule it
differentiates). Importing this package registers them all: every module of the package is
imported here, in name order.
"""

import importlib
import pkgutil

for _module in sorted(m.name for m in pkgutil.iter_modules(__path__)):
    importlib.import_module(f"{__name__}.{_module}")
