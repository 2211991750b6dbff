"""How a distributed call is compiled and differentiated: :class:`CompilePolicy`."""

from __future__ import annotations

import dataclasses
import math

from ..data.checks import integral
from ..ops import SpecError
from ..ops.errors import check_always_true, check_choice

__all__ = ["CompilePolicy", "FORCE_STRATEGIES"]

FORCE_STRATEGIES = ("framework_from_node_energy", "framework_from_global_energy", "model_internal")


@dataclasses.dataclass(frozen=True)
class CompilePolicy:
    """How a distributed call is compiled and differentiated.

    capacity_factor: headroom over the sizes a partition needs when capacities are chosen (>= 1).
    growth_factor: capacity multiplier when a capacity overflows (> 1).
    max_regrowths: overflow → grow → re-jit rounds before giving up (>= 1).
    force_strategy: ``framework_from_node_energy`` (forces from the sum of owned per-atom
        energies), ``framework_from_global_energy`` (from the all-reduced energy; graph
        parallel), or ``model_internal`` (the model returns forces as a PER_NODE output).
    stress_via_strain: stress from the derivative with respect to a strain of positions and
        cell: the only way jaxdd derives stress, so False is refused (a model that computes
        its own stress returns it as an output that is not in ``autograd_outputs``).
    """

    capacity_factor: float = 1.2
    growth_factor: float = 1.5
    max_regrowths: int = 8
    force_strategy: str = "framework_from_node_energy"
    stress_via_strain: bool = True

    def __post_init__(self):
        for field, low, strict in (("capacity_factor", 1.0, False), ("growth_factor", 1.0, True)):
            v = getattr(self, field)
            try:
                finite = not isinstance(v, bool) and isinstance(v, (int, float)) and math.isfinite(float(v))
            except OverflowError:
                finite = False
            if not finite or v < low or (strict and v == low):
                raise SpecError(f"CompilePolicy.{field} must be a finite number {'>' if strict else '>='} {low}, got {v!r}")
            object.__setattr__(self, field, float(v))
        object.__setattr__(self, "max_regrowths",
                           integral("CompilePolicy.max_regrowths", self.max_regrowths, minimum=1, error=SpecError))
        check_choice("CompilePolicy", "force_strategy", self.force_strategy, FORCE_STRATEGIES)
        check_always_true(
            "CompilePolicy", "stress_via_strain", self.stress_via_strain,
            "jaxdd derives stress only from the derivative with respect to a strain of positions and cell; a model "
            "that computes its own stress returns 'stress' as an output and leaves it out of "
            "ModelConfig.autograd_outputs")

    def to_dict(self) -> dict:
        """The ``compile`` object of a version-2 spec file: field name → value."""
        return dataclasses.asdict(self)
