"""Deprecated alias of :mod:`jaxdd.pme_grid` (the PME charge grid; not a device mesh)."""

import warnings

from .pme_grid import *  # noqa: F401,F403
from .pme_grid import __all__  # noqa: F401

warnings.warn("jaxdd.mesh is deprecated: it was renamed jaxdd.pme_grid (the PME charge grid); import that instead",
              DeprecationWarning, stacklevel=2)
