"""The built-in dispatch rules, one module per family; importing this package registers them.

Every rule takes what the rule protocol says, ``rule(ctx, eqn, ins) -> Decision``
(:data:`jaxdd.dispatch.registry.Rule`); its docstring says in a line or two what it decides.

- :mod:`.elementwise`: the default rule, ``select_n``, casts, graph-parallel index bounds;
- :mod:`.reductions`: ``reduce_*``, ``dot_general`` over atoms, cumulative ops, argmax/argmin;
- :mod:`.shapes`: broadcasts, reshapes, transposes, slices, concatenation, pad, iota, sort;
- :mod:`.indexing`: gather and scatter (halo correction, per-system collectives, graph parallel);
- :mod:`.control_flow`: calls, custom derivatives, remat, scan, while, cond;
- :mod:`.custom_ops`: named ops with an :class:`~jaxdd.spec.OpAdapter` on the spec;
- :mod:`.verbs`: the intent verbs of :mod:`jaxdd.dispatch.intent`;
- :mod:`.coverage`: the elementwise allow-list, identities, ``split``, small linear algebra.
"""

from . import control_flow, custom_ops, elementwise, indexing, reductions, shapes, verbs
from . import coverage  # noqa: F401  (registers its rules; after the families it must not shadow)

__all__ = ["control_flow", "custom_ops", "elementwise", "indexing", "reductions", "shapes", "verbs"]
