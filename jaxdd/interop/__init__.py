"""Potentials written for other JAX libraries, run by jaxdd unchanged.

Each submodule wraps one library's way of writing a potential into a :class:`~jaxdd.BaseModel`
that ``jaxdd.compute``, ``DistributedModel``, ``DomainParallel``, ``trace_and_validate`` and the
ASE calculator run like any other, and the other way round, ASE drives any jaxdd model:

- :mod:`jaxdd.interop.ase`: ``Calculator``, an ASE calculator around a jaxdd model (ASE is a core
  dependency, so this package imports it);
- :mod:`jaxdd.interop.jax_md`: jax-md neighbour-list potentials (``energy_fn(R, neighbor)``; it
  imports jax-md on import, so this package leaves it to be imported by name);
- :mod:`jaxdd.interop.pth`: files written by ``torch.save`` (published weights), read without torch;
- :mod:`jaxdd.interop.carrier`: the files of a wheel that carries published weights (sevenn,
  chgnet), found without importing it.
"""

from . import ase, carrier, pth

__all__ = ["ase", "carrier", "jax_md", "pth"]
