"""jaxdd: machine-learning interatomic potentials under spatial domain decomposition, in JAX.

The public surface lives here. The packages, from the bottom layer up:

* ``jaxdd.data`` — atoms and geometry: ``AtomicData``, ``Batch``, the wrap rule, units, example systems;
* ``jaxdd.ops``, ``jaxdd.ffi`` — the kernels: named ops and their compiled providers;
* ``jaxdd.neighbors`` — neighbour lists and the capacities they fill;
* ``jaxdd.spec`` — how a model distributes: its distribution spec, presets, adapters of helpers;
* ``jaxdd.model`` — what a model declares: the model protocol, the species base, its context, checkpoints;
* ``jaxdd.decomposition`` — partition, halo plans, migration, node blocks, the rank helpers;
* ``jaxdd.dispatch`` — the interpreter that gives each operation its distributed meaning, and the intent verbs;
* ``jaxdd.engine`` — the single-device driver, rank programs and ``DistributedModel``;
* ``jaxdd.dynamics``, ``jaxdd.interop`` (ASE, jax-md), ``jaxdd.validate``, ``jaxdd.models`` (the zoo).

``python -m jaxdd.demo`` and ``python -m jaxdd.launch`` are the command-line entry points;
``jaxdd.programs`` bounds the compiled programs the process holds.
"""

from .engine.distributed import DistributedModel, DomainConfig
from .engine.driver import compute, energy_and_derivatives
from .spec.adapters import AdapterRegistry, JitAdapter, MethodAdapter, ModuleForwardAdapter, PythonAdapter
from .model.context import DDContext, current_dd_context
from .dispatch import DispatchError, DispatchReport, DispatchWarning, register_rule
from .dispatch.intent import LOCAL, OWNED, Scope, autograd_target, refresh_neighbors, scatter_to_owners, system_sum, to_local
from .data import AtomicData, Batch, as_batch
from .model.base import BaseModel, ModelConfig, ModelOutputs, NeighborConfig, NeighborListFormat
from .model.species import SpeciesModel
from .ops import SpecError, register_op
from .spec import CompilePolicy, DistributionSpec, MLIPSpec, OpAdapter, OutputKind
from .neighbors import NeighborCapacity, NeighborList, build_neighbor_list, edge_vectors, neighbor_capacity, neighbor_list
from .dynamics import FIRE, CRescale, DomainParallel, HeatFlux, Langevin, MTKBarostat, NoseHooverChain, VelocityVerlet, register_integrator
from .model.checkpoint import CheckpointError
from . import interop  # noqa: E402  (jaxdd.interop.ase.Calculator; the module imports ase, a core dependency)
from . import ffi  # noqa: E402  (custom FFI kernels as named ops; the compiled library loads on first use)
from . import engine  # noqa: E402
from . import _moved  # noqa: E402


_moved.install()


def __getattr__(name: str):
    """Earlier submodule paths (``jaxdd.decomposition.halo``, ``jaxdd.engine.distributed``, ...): see :mod:`jaxdd._moved`."""
    return _moved.moved_attribute(__name__, name)


__version__ = "0.1.0"

__all__ = [
    "ffi",
    "interop",
    "AdapterRegistry",
    "DDContext",
    "DispatchError",
    "DispatchReport",
    "DispatchWarning",
    "LOCAL",
    "OWNED",
    "Scope",
    "autograd_target",
    "current_dd_context",
    "refresh_neighbors",
    "scatter_to_owners",
    "system_sum",
    "to_local",
    "CheckpointError",
    "CompilePolicy",
    "DistributedModel",
    "DistributionSpec",
    "DomainConfig",
    "DomainParallel",
    "FIRE",
    "Langevin",
    "NoseHooverChain",
    "MTKBarostat",
    "CRescale",
    "HeatFlux",
    "register_integrator",
    "VelocityVerlet",
    "JitAdapter",
    "MLIPSpec",
    "MethodAdapter",
    "ModuleForwardAdapter",
    "OpAdapter",
    "OutputKind",
    "PythonAdapter",
    "SpecError",
    "register_op",
    "register_rule",
    "AtomicData",
    "Batch",
    "BaseModel",
    "SpeciesModel",
    "ModelConfig",
    "ModelOutputs",
    "NeighborCapacity",
    "NeighborConfig",
    "NeighborList",
    "NeighborListFormat",
    "as_batch",
    "build_neighbor_list",
    "compute",
    "edge_vectors",
    "energy_and_derivatives",
    "neighbor_capacity",
    "neighbor_list",
]
