"""The model protocol: what a wrapper declares and how jaxdd calls it.

A wrapper is a JAX pytree (an ``equinox.Module`` or a ``flax.nnx.Module``) that mixes in
:class:`BaseModel` and declares a :class:`ModelConfig`. Its parameters are pytree leaves,
so ``jax.jit`` traces them: a new set of weights never recompiles and never bakes
constants into the program. The wrapper is single-device in design; distribution is
declared on its spec (``distribution_spec``), never coded into its body.

Call protocol: ``wrapper(data) -> ModelOutputs`` where ``data`` is a :class:`~jaxdd.Batch`
whose ``neighbors`` field holds the neighbour list the wrapper's :class:`NeighborConfig`
asked for. Outputs the wrapper lists in ``autograd_outputs`` (forces, stress) are derived
by the framework from its ``energy``; the wrapper itself must not take gradients.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import numbers
import operator
from collections.abc import Iterable, Mapping
from typing import Any

import jax
import numpy as np

from ..neighbors import NeighborListFormat

__all__ = [
    "NeighborListFormat",
    "NeighborConfig",
    "ModelConfig",
    "ModelOutputs",
    "BaseModel",
    "AUTOGRAD_OUTPUTS",
]

#: Outputs the framework can derive from the energy, and the inputs each needs.
AUTOGRAD_OUTPUTS = {"forces": frozenset({"positions"}), "stress": frozenset({"positions", "cell"})}
_AUTOGRAD_INPUTS = frozenset({"positions", "cell"})


@dataclasses.dataclass(frozen=True)
class NeighborConfig:
    """The neighbour list a model needs.

    cutoff: interaction range (Å), > 0. skin: extra search range (Å), >= 0; the list then
    also holds pairs up to ``cutoff + skin`` and the model must mask by its own cutoff.
    format: COO edges or a per-atom MATRIX. half_list: each pair once instead of twice.
    max_neighbors: optional starting MATRIX width (grown on overflow, never truncated).
    bond_cutoff: optional bond range (Å), 0 < bond_cutoff <= cutoff: the list then carries
    ``bonds``, a :class:`~jaxdd.neighbors.BondList` of the neighbours closer than it (MATRIX
    format and a full list required; with a skin, bonds are listed to ``bond_cutoff + skin``;
    docs/angle_models.md). max_bonds: optional starting bond width (needs ``bond_cutoff``; grown
    on overflow, never truncated).
    """

    cutoff: float
    format: NeighborListFormat = NeighborListFormat.COO
    half_list: bool = False
    skin: float = 0.0
    max_neighbors: int | None = None
    bond_cutoff: float | None = None
    max_bonds: int | None = None

    def __post_init__(self):
        c = self.cutoff
        if not _is_real(c) or not math.isfinite(c) or c <= 0:
            raise ValueError(f"NeighborConfig.cutoff must be a positive finite number (Å), got {c!r}")
        s = self.skin
        if not _is_real(s) or not math.isfinite(s) or s < 0:
            raise ValueError(f"NeighborConfig.skin must be a finite number >= 0 (Å), got {s!r}")
        object.__setattr__(self, "max_neighbors", _slots("max_neighbors", self.max_neighbors))
        object.__setattr__(self, "cutoff", float(c))
        object.__setattr__(self, "skin", float(s))
        object.__setattr__(self, "format", NeighborListFormat(self.format))
        object.__setattr__(self, "half_list", bool(self.half_list))
        bc = self.bond_cutoff
        if bc is not None:
            if not _is_real(bc) or not math.isfinite(bc) or not 0 < bc <= c:
                raise ValueError(f"NeighborConfig.bond_cutoff must be a number in (0, cutoff = {c}] Å or None, got {bc!r}")
            if self.format is not NeighborListFormat.MATRIX:
                raise ValueError("NeighborConfig.bond_cutoff needs format=MATRIX: bonds are slots of the per-atom "
                                 f"neighbour rows, got format={self.format.name}")
            if self.half_list:
                raise ValueError("NeighborConfig.bond_cutoff needs half_list=False: a bond's reverse lies in its "
                                 "partner's row")
            object.__setattr__(self, "bond_cutoff", float(bc))
        object.__setattr__(self, "max_bonds", _slots("max_bonds", self.max_bonds))
        if self.max_bonds is not None and bc is None:
            raise ValueError("NeighborConfig.max_bonds sizes the bond list: it needs a bond_cutoff")

    @property
    def search_cutoff(self) -> float:
        """Range the neighbour list is built with: cutoff + skin (Å)."""
        return self.cutoff + self.skin

    @property
    def bond_search_cutoff(self) -> float | None:
        """Range the bonds are listed to: bond_cutoff + skin (Å; None without a bond cutoff). With
        a skin the model masks its bonds by its own bond cutoff, as it masks pairs by its cutoff."""
        return None if self.bond_cutoff is None else self.bond_cutoff + self.skin


def _slots(name: str, k):
    """A slot count of NeighborConfig checked: None, or an integer >= 1."""
    if k is None:
        return None
    try:
        if isinstance(k, bool):
            raise TypeError
        k = operator.index(k)
    except TypeError:
        raise ValueError(f"NeighborConfig.{name} must be an integer >= 1 or None, got {k!r}") from None
    if k < 1:
        raise ValueError(f"NeighborConfig.{name} must be an integer >= 1 or None, got {k!r}")
    return k


def _is_real(x) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, (bool, np.bool_))


def _frozen(name, value) -> frozenset:
    if isinstance(value, str):
        raise ValueError(f"ModelConfig.{name} must be a collection of output names, not the string {value!r}")
    return frozenset(value)


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """What a wrapper computes and what the framework derives for it.

    outputs: every key the wrapper can provide (including autograd ones).
    active_outputs: keys computed by default (defaults to ``outputs``).
    autograd_outputs: keys the framework derives from ``energy`` (``forces``, ``stress``).
    autograd_inputs: inputs those gradients are taken with respect to (``positions``, ``cell``).
    neighbor_config: the neighbour list to build, or None if the model builds its own.
    padding_atoms: whether ``jaxdd.compute`` may append padding atom rows (``atom_mask`` False)
        so that one program serves systems of nearby sizes. False for a function that sums over
        every row it is given (a jax-md potential): it then sees exactly the system's atoms.
        Under decomposition the dispatch masks padding and ghost rows out of every sum.
    """

    outputs: frozenset
    active_outputs: frozenset | None = None
    autograd_outputs: frozenset = frozenset()
    autograd_inputs: frozenset = frozenset()
    neighbor_config: NeighborConfig | None = None
    padding_atoms: bool = True

    def __post_init__(self):
        outputs = _frozen("outputs", self.outputs)
        active = outputs if self.active_outputs is None else _frozen("active_outputs", self.active_outputs)
        auto = _frozen("autograd_outputs", self.autograd_outputs)
        inputs = _frozen("autograd_inputs", self.autograd_inputs)
        if not outputs:
            raise ValueError("ModelConfig.outputs is empty: declare at least 'energy'")
        for name, keys in (("active_outputs", active), ("autograd_outputs", auto)):
            extra = sorted(keys - outputs)
            if extra:
                raise ValueError(f"ModelConfig.{name} has {extra} that are not in outputs {sorted(outputs)}")
        unknown = sorted(auto - AUTOGRAD_OUTPUTS.keys())
        if unknown:
            raise ValueError(
                f"ModelConfig.autograd_outputs has {unknown}; the framework derives only {sorted(AUTOGRAD_OUTPUTS)}"
            )
        if auto and "energy" not in outputs:
            raise ValueError("ModelConfig.autograd_outputs needs 'energy' in outputs: gradients are taken of it")
        bad_inputs = sorted(inputs - _AUTOGRAD_INPUTS)
        if bad_inputs:
            raise ValueError(f"ModelConfig.autograd_inputs has {bad_inputs}; allowed: {sorted(_AUTOGRAD_INPUTS)}")
        for key in sorted(auto):
            missing = sorted(AUTOGRAD_OUTPUTS[key] - inputs)
            if missing:
                raise ValueError(f"autograd output {key!r} needs {missing} in ModelConfig.autograd_inputs")
        if self.neighbor_config is not None and not isinstance(self.neighbor_config, NeighborConfig):
            raise ValueError(f"ModelConfig.neighbor_config must be a NeighborConfig or None, got {self.neighbor_config!r}")
        object.__setattr__(self, "outputs", outputs)
        object.__setattr__(self, "active_outputs", active)
        object.__setattr__(self, "autograd_outputs", auto)
        object.__setattr__(self, "autograd_inputs", inputs)
        object.__setattr__(self, "padding_atoms", bool(self.padding_atoms))

    def with_active_outputs(self, keys: Iterable[str]) -> "ModelConfig":
        """A copy computing ``keys`` by default (``active_outputs``)."""
        return dataclasses.replace(self, active_outputs=frozenset(keys))

    def check_outputs(self, keys: Iterable[str]) -> tuple[str, ...]:
        """Validate requested output keys; returns them as a tuple in request order."""
        if isinstance(keys, str):
            keys = (keys,)
        keys = tuple(dict.fromkeys(keys))
        if not keys:
            raise ValueError("outputs is empty: ask for at least one of " + str(sorted(self.outputs)))
        unknown = [k for k in keys if k not in self.outputs]
        if unknown:
            raise ValueError(f"unknown output key(s) {unknown}; this model provides {sorted(self.outputs)}")
        return keys


@jax.tree_util.register_pytree_node_class
class ModelOutputs(Mapping):
    """An ordered, immutable mapping ``key -> array``; a JAX pytree.

    Standard keys: ``energy [S]`` eV, ``forces [V, 3]`` eV/Å, ``stress [S, 3, 3]`` eV/Å³
    (``(1/V) dE/dε``, ASE's sign), ``atomic_energies [V]`` eV.
    """

    __slots__ = ("_data",)

    def __init__(self, items: Mapping[str, Any] | Iterable[tuple[str, Any]] = ()):
        object.__setattr__(self, "_data", dict(items))

    def __getitem__(self, key):
        try:
            return self._data[key]
        except KeyError:
            raise KeyError(f"{key!r} is not among these outputs: {list(self._data)}") from None

    def __iter__(self):
        return iter(self._data)

    def __len__(self):
        return len(self._data)

    def __setattr__(self, name, value):
        raise AttributeError("ModelOutputs is immutable; use .replace(**items)")

    def replace(self, **items) -> "ModelOutputs":
        """A copy with the keys of ``items`` added or replaced."""
        return ModelOutputs({**self._data, **items})

    def __repr__(self):
        body = ", ".join(f"{k}: {getattr(v, 'shape', v)}" for k, v in self._data.items())
        return f"ModelOutputs({body})"

    def tree_flatten(self):
        """The pytree children (the arrays) and aux data (the keys, in order)."""
        return tuple(self._data.values()), tuple(self._data)

    @classmethod
    def tree_unflatten(cls, keys, values):
        """Rebuild from the ``keys`` of :meth:`tree_flatten` and their ``values``."""
        return cls(zip(keys, values))


def _takes_one_positional(sig: inspect.Signature) -> bool:
    """Whether a bound ``forward`` takes exactly one positional argument (the guide's ``data``)."""
    params = list(sig.parameters.values())
    return (len(params) == 1 and params[0].default is inspect.Parameter.empty
            and params[0].kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD))


def _as_outputs(raw) -> "ModelOutputs":
    return raw if isinstance(raw, ModelOutputs) else ModelOutputs(raw)


class BaseModel:
    """Mixin for model wrappers.

    A subclass provides ``model_config`` (a :class:`ModelConfig`), ``adapt_input`` (Batch →
    keyword arguments of the inner model) and either an inner callable ``model`` or its own
    ``forward(**inputs)``. ``adapt_output`` turns the inner model's return into
    :class:`ModelOutputs`. The PyTorch guide's ``forward(self, data)``, which calls
    ``adapt_input`` and ``adapt_output`` itself, works too: when ``forward`` takes one positional
    argument and not the keywords ``adapt_input`` returns, it is called with the batch.
    Optional hooks: ``validate_input`` (host-side checks of a Batch before anything is
    traced), ``distribution_spec`` and ``distributed_setup``.
    """

    model_config: ModelConfig

    def adapt_input(self, data, **kwargs) -> dict:
        """The inner model's keyword arguments for a Batch.

        Args:
          data: the Batch (neighbours attached when the model asks for a list).
          kwargs: keyword arguments passed to the wrapper's call, for the subclass to use.

        Returns:
          A dict of the inputs :meth:`forward` takes.
        """
        raise NotImplementedError(f"{type(self).__name__} must implement adapt_input(data) -> dict of model inputs")

    def forward(self, **inputs):
        """Run the inner model (by default the callable ``self.model``).

        Args:
          inputs: the keyword arguments :meth:`adapt_input` returns.

        Returns:
          The inner model's raw output, for :meth:`adapt_output`.
        """
        inner = getattr(self, "model", None)
        if inner is None or not callable(inner):
            raise NotImplementedError(
                f"{type(self).__name__} has no inner callable 'model': implement forward(**inputs) instead"
            )
        return inner(**inputs)

    def adapt_output(self, raw, data) -> ModelOutputs:
        """Turn the inner model's return into ModelOutputs.

        Args:
          raw: what :meth:`forward` returned (by default a mapping ``key -> array``).
          data: the Batch it was computed on.

        Returns:
          ModelOutputs with the model's keys (``energy [S]`` eV, ...).
        """
        return raw if isinstance(raw, ModelOutputs) else ModelOutputs(raw)

    def __call__(self, data, **kwargs) -> ModelOutputs:
        sig = inspect.signature(self.forward)
        takes_data = _takes_one_positional(sig)
        if takes_data and not kwargs and type(self).adapt_input is BaseModel.adapt_input:
            return _as_outputs(self.forward(data))  # the guide's forward(self, data), no adapt_input
        inputs = self.adapt_input(data, **kwargs)
        try:
            sig.bind(**inputs)
        except TypeError as exc:
            if takes_data and not kwargs:
                # The PyTorch guide's form: forward(self, data) adapts the input and the output itself.
                return _as_outputs(self.forward(data))
            raise TypeError(
                f"{type(self).__name__}.forward{sig} cannot take the inputs adapt_input returns "
                f"({sorted(inputs)}): {exc}. Write forward(self, **inputs) (or with those keyword names), or "
                "forward(self, data) as the PyTorch guide does, calling adapt_input and adapt_output itself"
            ) from None
        return self.adapt_output(self.forward(**inputs), data)

    def validate_input(self, data) -> None:
        """Host-side checks of a concrete Batch ``data``; raise ValueError naming the atom or field."""

    def minimum_image_cutoff(self) -> float | None:
        """The range (Å) of the model's minimum-image displacements, or None (the default: the
        model reads jaxdd's neighbour lists, which handle any cell).

        Every periodic cell must be wider than twice it; the drivers check that whenever the
        cell changes (a barostat, LAMMPS's ``fix deform``), not only when atoms are placed
        (:func:`~jaxdd.model.protocol.check_cell_width`).
        """
        return None

    @property
    def cutoff(self) -> float | None:
        """The interaction range of the model's neighbour list (Å), or None if it builds none."""
        nc = self.model_config.neighbor_config
        return None if nc is None else nc.cutoff

    @property
    def distribution_spec(self):
        """The model's distribution spec, or None to let jaxdd choose a default."""
        return None

    def distributed_setup(self, ctx) -> None:
        """Called with the :class:`~jaxdd.DDContext` each time the model is traced for a decomposition,
        inside the DD scope; install helper replacements that need it with ``ctx.adapters.install(...)``
        (they are restored when tracing ends)."""
