"""Potentials written for other JAX libraries, run by jaxdd unchanged.

Each submodule wraps one library's way of writing a potential into a :class:`~jaxdd.BaseModel`
that ``jaxdd.compute``, ``DistributedModel``, ``DomainParallel``, ``trace_and_validate`` and the
ASE calculator run like any other. The submodules import their library on import, so this
package imports none of them:

- :mod:`jaxdd.interop.jax_md`: jax-md neighbour-list potentials (``energy_fn(R, neighbor)``).
"""

__all__ = ["jax_md"]
