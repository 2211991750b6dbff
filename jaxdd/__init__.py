"""jaxdd: machine-learning interatomic potentials under spatial domain decomposition, in JAX.

The public surface lives here; subpackages named for one concept hold the rest
(``jaxdd.data``, ``jaxdd.neighbors``, ``jaxdd.model``, ``jaxdd.driver``, ``jaxdd.models`` ...); the
layers of the decomposition are ``jaxdd.decomposition`` (partition, halo plans, migration, node
blocks, the rank helpers) and above the dispatch ``jaxdd.engine`` (rank programs, ``DistributedModel``).
"""

from .engine.distributed import DistributedModel, DomainConfig
from .driver import compute, energy_and_derivatives
from .adapters import AdapterRegistry, JitAdapter, MethodAdapter, ModuleForwardAdapter, PythonAdapter
from .context import DDContext, current_dd_context
from .dispatch import DispatchError, DispatchReport, DispatchWarning, register_rule
from .intent import LOCAL, OWNED, Scope, autograd_target, refresh_neighbors, scatter_to_owners, system_sum, to_local
from .data import AtomicData, Batch, as_batch
from .model import BaseModel, ModelConfig, ModelOutputs, NeighborConfig, NeighborListFormat
from .ops import SpecError, register_op
from .spec import CompilePolicy, DistributionSpec, MLIPSpec, OpAdapter, OutputKind
from .neighbors import NeighborCapacity, NeighborList, build_neighbor_list, edge_vectors, neighbor_capacity, neighbor_list
from .dynamics import FIRE, CRescale, DomainParallel, HeatFlux, Langevin, MTKBarostat, NoseHooverChain, VelocityVerlet, register_integrator
from .checkpoint import CheckpointError
from . import ase  # noqa: E402  (jaxdd.ase.Calculator; the module imports ase, a core dependency)
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
