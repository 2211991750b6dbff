"""An ASE calculator over a jaxdd model, on one device or under domain decomposition.

``Calculator(model)`` lets ASE optimisers, dynamics and tools drive a jaxdd model::

    atoms.calc = jaxdd.interop.ase.Calculator(LennardJones(3.4, 0.0104, 8.5, shift=True))
    atoms.calc = jaxdd.interop.ase.Calculator(DistributedModel(model, DomainConfig(8.5)))

Results follow ASE's conventions: energy in eV, forces ``[N, 3]`` in eV/Å, stress as the
Voigt 6-vector (xx, yy, zz, yz, xz, xy) in eV/Å³ with ASE's sign ((1/V) dE/dε, negative
under compression), per-atom energies ``[N]`` in eV, charges ``[N]`` in e and magnetic moments
``[N]`` in μB where the model predicts them (``ChargeEquilibration``, ``CHGNet``); all numpy float64.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

import jax
import numpy as np
from ase.calculators.calculator import Calculator as _AseCalculator
from ase.calculators.calculator import PropertyNotImplementedError, all_changes
from ase.stress import full_3x3_to_voigt_6_stress

from ..data import AtomicData, as_batch
from ..engine.distributed import DistributedModel
from ..engine.driver import compute, program_capacity
from ..model.protocol import bucketed_atoms, pad_atoms
from ..model.base import BaseModel, ModelConfig
from ..neighbors import neighbor_capacity
from ..spec import OutputKind

__all__ = ["Calculator"]

# jaxdd output key -> ASE property name.
_ASE_NAME = {"energy": "energy", "forces": "forces", "stress": "stress", "atomic_energies": "energies",
             "charges": "charges", "magmoms": "magmoms"}
# Per-atom outputs handed to ASE as [N] float64 arrays under their ASE names.
_PER_ATOM = ("atomic_energies", "charges", "magmoms")

# Headroom of the single-device neighbour capacity: atoms move between calls, and every
# new capacity is a new compiled program, so the first sizing leaves room to move.
_HEADROOM = 1.25


class Calculator(_AseCalculator):
    """ASE calculator evaluating a jaxdd model wrapper or a :class:`~jaxdd.DistributedModel`.

    model: a model wrapper (:class:`~jaxdd.BaseModel`, evaluated with ``jaxdd.compute`` on
        one device) or a ``DistributedModel`` (evaluated by calling it, over its mesh).
    outputs: the model outputs the calculator may ask for, among ``energy``, ``forces``,
        ``stress``, ``atomic_energies``, ``charges`` and ``magmoms`` (default: those the model
        provides); they set ``implemented_properties`` (``atomic_energies`` becomes ASE's
        ``energies``, and ``free_energy`` always equals ``energy``).
    dtype: floating dtype of the positions handed to the model (float64 needs
        ``jax_enable_x64``). Results are float64 whatever it is.

    Each evaluation asks the model only for what ASE requested (plus the energy). Stress
    needs a cell of non-zero volume; on other atoms it raises ``PropertyNotImplementedError``.
    """

    def __init__(self, model, outputs: Iterable[str] | None = None, dtype=np.float64):
        if isinstance(model, DistributedModel):
            config = model.model.model_config
        elif isinstance(model, BaseModel) or isinstance(getattr(model, "model_config", None), ModelConfig):
            config = model.model_config
        else:
            got = f"the class {model.__name__} (pass an instance)" if isinstance(model, type) else type(model).__name__
            raise ValueError(
                "Calculator: model must be a jaxdd model wrapper (a jaxdd.BaseModel with a ModelConfig, "
                f"e.g. jaxdd.models.lj.LennardJones(...)) or a jaxdd.DistributedModel, got {got}"
            )
        if not isinstance(config, ModelConfig):
            raise ValueError(
                f"Calculator: model {type(model).__name__} has no ModelConfig in .model_config; "
                "mix in jaxdd.BaseModel and declare one"
            )
        self.model = model
        self.outputs = _check_outputs(outputs, config, model)
        self.dtype = _check_dtype(dtype)
        self.implemented_properties = ["energy", "free_energy"] + [
            _ASE_NAME[k] for k in self.outputs if k != "energy"
        ]
        # Single-device neighbour capacity, kept across calls so that moved atoms reuse
        # the compiled program; re-sized when the atom count changes or it overflows.
        self._capacity = None
        self._capacity_atoms = None
        super().__init__()

    @property
    def distributed(self) -> bool:
        """Whether the model runs under domain decomposition."""
        return isinstance(self.model, DistributedModel)

    def calculate(self, atoms=None, properties=("energy",), system_changes=all_changes):
        """Evaluate the model on ``atoms`` for ``properties`` and store them in ``self.results``.

        results: ``energy``, ``free_energy`` (float, eV); ``forces`` [N, 3] eV/Å;
        ``stress`` [6] eV/Å³ (Voigt xx, yy, zz, yz, xz, xy); ``energies`` [N] eV; ``charges`` [N] e;
        ``magmoms`` [N] μB.

        Args:
          atoms: the ASE ``Atoms`` (None: the calculator's own).
          properties: the names wanted, among ``implemented_properties``.
          system_changes: what changed since the last call (ASE's list); any change clears the results.
        """
        super().calculate(atoms, properties, system_changes)
        atoms = self.atoms
        if system_changes:
            # Cleared first, so that a refusal below leaves no results of other atoms behind.
            self.results = {}
        unknown = [p for p in properties if p not in self.implemented_properties]
        if unknown:
            raise PropertyNotImplementedError(
                f"{unknown} not implemented; this calculator provides {self.implemented_properties}"
            )
        keys = ["energy"] + [k for k in self.outputs if k != "energy" and _ASE_NAME[k] in properties]
        if "stress" in keys and not atoms.cell.volume > 0:
            raise PropertyNotImplementedError(
                f"stress needs a cell of non-zero volume, but these atoms (pbc={atoms.pbc.tolist()}) have "
                f"cell volume {atoms.cell.volume:g} Å³; give them a cell (e.g. atoms.center(vacuum=5.0)) "
                "or do not ask for stress"
            )
        if self.dtype == np.float64 and not jax.config.read("jax_enable_x64"):
            raise ValueError(
                "Calculator(dtype=float64) needs 64-bit JAX: call jax.config.update('jax_enable_x64', True) "
                "before the first calculation, or pass dtype=np.float32"
            )
        data = AtomicData.from_ase(atoms, dtype=self.dtype)
        out = self.model(data, tuple(keys)) if self.distributed else self._compute(data, tuple(keys))

        energy = float(np.asarray(out["energy"], np.float64)[0])
        self.results["energy"] = energy
        self.results["free_energy"] = energy
        if "forces" in out:
            self.results["forces"] = np.array(out["forces"], np.float64)
        if "stress" in out:
            self.results["stress"] = full_3x3_to_voigt_6_stress(np.array(out["stress"][0], np.float64))
        for key in _PER_ATOM:
            if key in out:
                self.results[_ASE_NAME[key]] = np.array(out[key], np.float64)

    def _compute(self, data: AtomicData, keys: tuple[str, ...]):
        """``jaxdd.compute`` with a neighbour capacity that persists between calls."""
        nc = self._model_config().neighbor_config
        if nc is None:
            return compute(self.model, data, keys)
        if self._capacity is None or self._capacity_atoms != data.n_atoms:
            self._capacity = self._size(data, nc)
            self._capacity_atoms = data.n_atoms
        try:
            return compute(self.model, data, keys, capacity=self._capacity, max_rebuilds=0)
        except RuntimeError:
            # Overflow of the kept capacity: size again from these positions. Any other
            # RuntimeError raises again from the second call.
            self._capacity = _union(self._capacity, self._size(data, nc))
            return compute(self.model, data, keys, capacity=self._capacity)

    def _size(self, data: AtomicData, nc):
        # Sized on the atom rows compute runs with, and rounded up to capacity buckets, so
        # that structures of similar size share one compiled program.
        b = as_batch(data)
        b = pad_atoms(b, bucketed_atoms(b))
        return program_capacity(neighbor_capacity(b.positions, b.cell, b.pbc, b.batch_idx, b.atom_mask,
                                                  cutoff=nc.search_cutoff, half=nc.half_list, headroom=_HEADROOM,
                                                  bond_cutoff=nc.bond_search_cutoff), nc)

    def _model_config(self) -> ModelConfig:
        return (self.model.model if self.distributed else self.model).model_config


def _check_outputs(outputs, config: ModelConfig, model) -> tuple[str, ...]:
    provided = [k for k in _ASE_NAME if k in config.outputs]
    if isinstance(model, DistributedModel):
        # The sharded program lays out only outputs whose kind it knows.
        provided = [k for k in provided if k in ("energy", "forces", "stress", model.energy_key)
                    or model.spec.kind_of(k) is not OutputKind.UNKNOWN]
    if "energy" not in config.outputs:
        raise ValueError(
            f"Calculator: {type(model).__name__} provides no 'energy' (outputs {sorted(config.outputs)}); "
            "an ASE calculator needs the energy"
        )
    if outputs is None:
        return tuple(provided)
    outputs = (outputs,) if isinstance(outputs, str) else tuple(dict.fromkeys(outputs))
    unknown = [k for k in outputs if k not in _ASE_NAME]
    if unknown:
        raise ValueError(f"Calculator: outputs {unknown} are not among the keys it maps to ASE, {list(_ASE_NAME)}")
    missing = [k for k in outputs if k not in provided]
    if missing:
        raise ValueError(
            f"Calculator: outputs {missing} are not provided by {type(model).__name__} here "
            f"(it provides {provided})"
        )
    return tuple(["energy"] + [k for k in outputs if k != "energy"])


def _check_dtype(dtype):
    try:
        dt = np.dtype(dtype)
    except TypeError:
        dt = None
    if dt is None or not np.issubdtype(dt, np.floating):
        raise ValueError(f"Calculator: dtype must be a floating dtype (np.float64 or np.float32), got {dtype!r}")
    return dt


def _union(a, b):
    """The smallest capacity holding both ``a`` and ``b``."""
    return dataclasses.replace(
        a,
        max_edges=max(a.max_edges, b.max_edges),
        max_neighbors=max(a.max_neighbors, b.max_neighbors),
        max_candidates=max(a.max_candidates, b.max_candidates),
        search_range=tuple(max(x, y) for x, y in zip(a.search_range, b.search_range)),
        max_bonds=max(a.max_bonds, b.max_bonds),
    )
