"""jax-md neighbour-list potentials as jaxdd models, their code unchanged.

jax-md builds a potential from a factory ``(displacement_fn, box, ...) -> (neighbor_fn,
energy_fn)`` — ``energy.lennard_jones_neighbor_list``, ``energy.morse_neighbor_list``,
``energy.soft_sphere_neighbor_list``, ``energy.load_gnome_model_neighbor_list``, or one of
the user's — and evaluates ``energy_fn(R, neighbor, **kwargs)``. :class:`JaxMDModel` calls the
factory once with a displacement function of its own and then, on every call, turns jaxdd's
neighbour list into jax-md's ``NeighborList`` and calls ``energy_fn``. jaxdd builds and
grows the list and takes forces and stress from the energy; ``neighbor_fn`` is never used.

Conventions, jax-md beside jaxdd (``docs/porting.md``):

- ``box`` is the matrix whose *columns* are the lattice vectors (``box = cell.T``); jaxdd's
  ``cell`` has them as rows.
- ``displacement_fn(Ra, Rb) = Ra - Rb`` (receiver minus sender) and ``neighbor.idx[0]`` are
  the receivers; jaxdd's edge vector is sender minus receiver. Each side keeps its own.
- Padding entries of ``neighbor.idx`` point at ``len(R)``, as jaxdd's do.
- ``Sparse`` is jaxdd's full COO list, ``OrderedSparse`` its half list, ``Dense`` its MATRIX.
- Periodic displacements are minimum-image, as in ``space.periodic_general``: a periodic
  cell must be wider than twice the cutoff on every axis (checked).

The box reaches the displacement as ``energy_fn(R, neighbor, box=box)`` — how jax-md passes a
changing box (NPT, strain) — so stress follows from the cell jaxdd differentiates.

The list holds the pairs closer than ``cutoff``; a potential reaching further would lose the
rest of its pairs. A ``cutoff`` shorter than the potential's own range is refused where the
range can be read: from the arguments of one of jax-md's factories (:data:`RANGES`), given as
the factory itself, a ``functools.partial`` of it, or a wrapper of it made with
``functools.wraps`` (partials of such wrappers too: their arguments are taken to be handed on),
or declared as ``interaction_range=``. A lambda or a factory of the user's own that is not
such a wrapper hides its arguments until it runs: its range is not guessed, ``cutoff`` is taken
as given, and a :class:`RangeUnreadWarning` says so and asks for ``interaction_range=``.
"""

from __future__ import annotations

import functools
import inspect
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

try:
    from jax_md import energy, partition
except ImportError as exc:  # an optional library: say how to get it
    raise ImportError("jaxdd.interop.jax_md wraps jax-md potentials and needs jax-md: pip install 'jax-md>=0.2.29' "
                      "(it is among jaxdd's test dependencies: pip install -e '.[test]')") from exc

from ..model.base import BaseModel, ModelConfig, NeighborConfig
from ..model.protocol import check_cell_width
from ..neighbors import NeighborListFormat

__all__ = ["JaxMDModel", "FORMATS", "RANGES", "RangeUnreadWarning", "displacement", "read_interaction_range"]

#: jax-md's neighbour formats and the jaxdd list each is made from: (format, half_list).
FORMATS = {
    partition.NeighborListFormat.Sparse: (NeighborListFormat.COO, False),
    partition.NeighborListFormat.OrderedSparse: (NeighborListFormat.COO, True),
    partition.NeighborListFormat.Dense: (NeighborListFormat.MATRIX, False),
}


def _number(x) -> float:
    return float(np.max(np.asarray(x, dtype=np.float64)))


def _nequip_r_max(cfg) -> float:
    return float((energy.nequip.default_config() if cfg is None else cfg).r_max)


#: jax-md's neighbour-list factories whose interaction range jaxdd reads from their arguments,
#: as jax_md/energy.py (0.2.29) defines it — the radius of the neighbour list each builds, beyond
#: which its energy is zero: ``{factory: (how, factors(arguments))}``, the range the product of
#: the factors. Lennard-Jones' ``r_cutoff`` (and ``r_onset``) count the largest σ; Morse's
#: ``r_cutoff`` is a distance, whatever σ is; soft spheres end at σ (a per-species matrix: its largest).
RANGES: dict[Callable, tuple[str, Callable[[Mapping[str, Any]], tuple[float, ...]]]] = {
    energy.lennard_jones_neighbor_list: ("r_cutoff × max(sigma)",
                                         lambda a: (_number(a["r_cutoff"]), _number(a["sigma"]))),
    energy.morse_neighbor_list: ("r_cutoff", lambda a: (_number(a["r_cutoff"]),)),
    energy.soft_sphere_neighbor_list: ("max(sigma)", lambda a: (_number(a["sigma"]),)),
    energy.bks_neighbor_list: ("cutoff", lambda a: (_number(a["cutoff"]),)),
    energy.bks_silica_neighbor_list: ("cutoff", lambda a: (_number(a["cutoff"]),)),
    energy.nequip_neighbor_list: ("cfg.r_max", lambda a: (_nequip_r_max(a["cfg"]),)),
    energy.stillinger_weber_neighbor_list: ("cutoff", lambda a: (_number(a["cutoff"]),)),
    energy.edip_neighbor_list: ("cutoff", lambda a: (_number(a["cutoff"]),)),
    energy.eam_neighbor_list: ("cutoff", lambda a: (_number(a["cutoff"]),)),
    energy.graph_network_neighbor_list: ("r_cutoff", lambda a: (_number(a["r_cutoff"]),)),
}

#: A cutoff short of the range by less than this fraction is rounding (jax-md may compute
#: ``r_cutoff × σ`` in float32), not a shorter list.
_ROUNDING = 1e-6


def read_interaction_range(factory: Callable) -> tuple[float, str] | None:
    """The interaction range of a jax-md factory, read from its arguments, and how it was read.

    Args:
        factory: one of :data:`RANGES` (with its defaults), or a ``functools.partial`` of one
            with its arguments (``partial(energy.lennard_jones_neighbor_list, sigma=...,
            r_cutoff=...)``).
    Returns:
        ``(range, how)``, ``how`` naming the factory and the arguments; None where the range
        cannot be read (a lambda, a factory of the user's own, a factory not in :data:`RANGES`):
        it is never guessed.
    """
    func, args, kwargs = _unwrapped(factory)
    try:
        rule = RANGES.get(func)
    except TypeError:  # an unhashable callable
        return None
    if rule is None:
        return None
    how, read = rule
    try:
        bound = inspect.signature(func).bind_partial(None, None, *args, **kwargs)  # displacement_fn, box
        bound.apply_defaults()
        factors = read(bound.arguments)
    except (TypeError, ValueError, KeyError, AttributeError):  # arguments jax-md itself would refuse
        return None
    value = float(np.prod(factors))
    if not np.isfinite(value):
        return None
    shown = " × ".join(f"{f:.10g}" for f in factors)
    return value, f"energy.{func.__name__}: {how} = {shown}"


def _unwrapped(factory: Callable) -> tuple[Callable, tuple, dict]:
    """(function, positional arguments after ``(displacement_fn, box)``, keywords) of
    ``factory``, through ``functools.partial`` (outermost arguments last) and wrappers made with
    ``functools.wraps`` (``__wrapped__``), which are taken to hand their arguments on."""
    func, args, kwargs = factory, (), {}
    for _ in range(32):
        if isinstance(func, functools.partial):
            args, kwargs = (*func.args, *args), {**func.keywords, **kwargs}
            func = func.func
        elif callable(getattr(func, "__wrapped__", None)):
            func = func.__wrapped__
        else:
            break
    return func, args, kwargs


def _named(factory: Callable) -> str:
    """How ``factory`` is named in a message."""
    func = _unwrapped(factory)[0]
    name = getattr(func, "__qualname__", None) or type(func).__name__
    module = getattr(func, "__module__", None)
    return f"{module}.{name}" if module else name


class RangeUnreadWarning(UserWarning):
    """A JaxMDModel whose potential's interaction range could not be read nor was declared:
    its ``cutoff`` is taken as given, unchecked."""


def _check_cutoff(factory: Callable, cutoff: float, declared: float | None) -> float | None:
    """The potential's range, read or declared, after refusing a ``cutoff`` shorter than it."""
    if declared is not None:
        declared = float(declared)
        if not declared > 0.0 or not np.isfinite(declared):
            raise ValueError(f"interaction_range must be a positive distance, got {declared!r}")
    read = read_interaction_range(factory)
    if read is not None and declared is not None and abs(declared - read[0]) > _ROUNDING * read[0]:
        raise ValueError(
            f"interaction_range={declared:.10g} disagrees with the range read from the factory's arguments, "
            f"{read[0]:.10g} ({read[1]}): drop interaction_range= (it is for factories whose range cannot be read)"
        )
    if read is not None:
        reach, how = read
    elif declared is not None:
        reach, how = declared, f"declared as interaction_range={declared:.10g}"
    else:
        warnings.warn(
            f"JaxMDModel cannot read the interaction range of the factory {_named(factory)} (a lambda, or a "
            f"function of your own, hides the arguments of the jax-md potential it builds): cutoff={cutoff:.10g} is "
            "taken as given, and pairs of the potential beyond it would be dropped without a word. Pass "
            "interaction_range= (the distance beyond which its energy is zero: r_cutoff × max(sigma) for "
            "lennard_jones, r_cutoff for morse, cutoff for stillinger_weber), or give jax-md's factory as a "
            "functools.partial, whose arguments are read", RangeUnreadWarning, stacklevel=4)
        return None
    if cutoff < reach * (1.0 - _ROUNDING):
        raise ValueError(
            f"cutoff={cutoff:.10g} is shorter than the jax-md potential's own interaction range, {reach:.10g} "
            f"({how}): its pairs between {cutoff:.10g} and {reach:.10g} would be missing from the energy, forces "
            f"and stress. Pass cutoff >= {reach:.10g}; jax-md's pair potentials reach r_cutoff × max(sigma) "
            "(lennard_jones), r_cutoff (morse) or max(sigma) (soft_sphere), the radius of their own neighbour list"
        )
    return reach


def displacement(Ra, Rb, box=None, *, periodic: bool, fractional_coordinates: bool, perturbation=None, **unused):
    """jax-md's displacement ``Ra - Rb`` [3], Å, as ``space.free`` or ``space.periodic_general``.

    Args:
        Ra, Rb: [3] positions (Å), or fractional coordinates when ``fractional_coordinates``.
        box: [3, 3] lattice vectors as columns (Å); required when ``periodic`` or fractional.
        periodic: wrap to the minimum image.
        perturbation: [3, 3] applied to the result (jax-md's ``quantity.stress`` strains with it).
        unused: other keyword arguments of the energy call (jax-md's ``t=``, parameters).
    Returns:
        [3] Å. Plain autodiff everywhere: forces on Cartesian positions and the cell come out
        by the chain rule.
    """
    dR = Ra - Rb
    if periodic or fractional_coordinates:
        dR = _periodic(dR, box, periodic, fractional_coordinates)
    # Padding entries of a neighbour list point past the last row, and JAX clamps such a read to
    # the last row: a padding pair then has Ra == Rb. jax-md masks its energy, but 1/r terms
    # (Lennard-Jones) still send NaN through the mask's gradient. A zero displacement becomes a
    # unit one, as jax-md's own featurizer does for its padding (jnp.where(mask, dR, 1)); two
    # distinct atoms are never at one point, and self-images are refused (minimum image).
    dR = jnp.where(jnp.all(dR == 0, axis=-1, keepdims=True), jnp.ones_like(dR), dR)
    return dR if perturbation is None else perturbation @ dR


def _periodic(dR, box, periodic: bool, fractional_coordinates: bool):
    if box is None:
        raise TypeError(
            "the jax-md potential called its displacement function without box=: jaxdd passes the cell as "
            "energy_fn(R, neighbor, box=box), and the potential must hand its keyword arguments on to the "
            "displacement, as jax-md's own potentials do (smap.pair_neighbor_list, nn.util.neighbor_list_featurizer)"
        )
    if not fractional_coordinates:
        dR = _inverse_3x3(box) @ dR
    if periodic:
        dR = dR - jnp.round(dR)
    return box @ dR


def _inverse_3x3(m):
    """The inverse of a [3, 3] matrix from its adjugate, in plain arithmetic that XLA fuses.

    Not ``jnp.linalg.solve``: mapped over every pair it is one LAPACK triangular solve with
    a right-hand side per pair, which on CPUs wakes OpenBLAS threads that then spin beside
    the devices' own (2.7 s of CPU in a 10 s run of two CPU devices on two cores)."""
    c0, c1, c2 = jnp.cross(m[1], m[2]), jnp.cross(m[2], m[0]), jnp.cross(m[0], m[1])
    return jnp.stack([c0, c1, c2], axis=1) / jnp.dot(m[0], c0)


def _no_update(position, neighbor, **kwargs):
    raise RuntimeError(
        "a NeighborList handed to a jax-md potential by jaxdd cannot update itself: jaxdd builds, "
        "rebuilds and grows the neighbour list (jaxdd.compute, DistributedModel, DomainParallel)"
    )


def _format(fmt) -> partition.NeighborListFormat:
    if isinstance(fmt, str):
        try:
            return partition.NeighborListFormat[fmt]
        except KeyError:
            pass
    elif isinstance(fmt, partition.NeighborListFormat):
        return fmt
    raise ValueError(f"format must be one of jax-md's {[f.name for f in FORMATS]} (jax_md.partition.Sparse, ...), "
                     f"got {fmt!r}")


class JaxMDModel(eqx.Module, BaseModel):
    """A jax-md neighbour-list potential as a jaxdd model.

    Args:
        factory: ``factory(displacement_fn, box) -> (neighbor_fn, energy_fn)``, or
            ``(neighbor_fn, init_fn, energy_fn)`` whose ``energy_fn(params, R, neighbor)``
            takes ``params`` first (``energy.nequip_neighbor_list``). Called once, here.
            Given as one of jax-md's factories in :data:`RANGES` or a ``functools.partial`` of
            one (``partial(energy.lennard_jones_neighbor_list, sigma=..., r_cutoff=...)``), its
            interaction range is read from its arguments, through ``functools.wraps`` wrappers
            too; a lambda or a factory of your own hides them, and its range is neither read
            nor guessed: a :class:`RangeUnreadWarning` asks for ``interaction_range=``.
        cutoff: the neighbour list holds every pair closer than this (plus ``skin``); it must
            be at least the potential's interaction range: ``r_cutoff × max(sigma)`` for
            ``lennard_jones_neighbor_list`` (its ``r_cutoff`` counts σ), ``r_cutoff`` for
            ``morse_neighbor_list`` (a distance), ``max(sigma)`` for ``soft_sphere_neighbor_list``.
            A shorter one is refused (ValueError) where the range is read or declared; where it
            is not, it is taken as given with a :class:`RangeUnreadWarning`.
        format: the jax-md neighbour format handed to ``energy_fn``: ``partition.Sparse``
            (default), ``partition.OrderedSparse`` or ``partition.Dense`` (or their names).
        periodic: ``True`` for ``space.periodic`` / ``space.periodic_general`` (every axis
            periodic), ``False`` for ``space.free`` (no axis periodic).
        fractional_coordinates: ``energy_fn`` receives fractional coordinates, as with
            ``space.periodic_general(box, fractional_coordinates=True)``.
        species: atomic numbers, in the order of jax-md's species ids (row ``k`` of a
            ``[K, K]`` parameter matrix, column ``k`` of a one-hot), or None for one species.
        species_as: how the species reach ``energy_fn``: ``"species"`` (ids [N] int32, as
            ``smap.pair_neighbor_list`` takes them) or ``"atoms"`` (one-hot [N, K], as jax-md's
            NequIP and GNoME take them). Needs ``species``.
        params: the weights of a three-function factory (a pytree; traced, never baked in).
        skin: extra neighbour range (Å) beyond ``cutoff``.
        energy_kwargs: further keyword arguments for every ``energy_fn`` call.
        interaction_range: the potential's own range, for a factory whose range cannot be read
            (a lambda, your own): ``cutoff`` is then checked against it. Where the range is
            read, a declared one must agree with it.

    Attributes:
        interaction_range: the range ``cutoff`` was checked against, read or declared; None
            where it could not be read and none was declared.

    Outputs ``energy [1]`` (eV), and ``forces [N, 3]`` and ``stress [1, 3, 3]`` from its derivatives.
    """

    energy_fn: Callable = eqx.field(static=True)
    params: Any
    energy_kwargs: dict
    format: partition.NeighborListFormat = eqx.field(static=True)
    periodic: bool = eqx.field(static=True)
    fractional_coordinates: bool = eqx.field(static=True)
    species: tuple[int, ...] | None = eqx.field(static=True)
    species_as: str = eqx.field(static=True)
    takes_params: bool = eqx.field(static=True)
    interaction_range: float | None = eqx.field(static=True)
    model_config: ModelConfig = eqx.field(static=True)

    def __init__(self, factory: Callable, *, cutoff: float, format=partition.NeighborListFormat.Sparse,
                 periodic: bool = True, fractional_coordinates: bool = False,
                 species: Sequence[int] | None = None, species_as: str = "species", params: Any = None,
                 skin: float = 0.0, energy_kwargs: Mapping[str, Any] | None = None,
                 interaction_range: float | None = None):
        self.format = _format(format)
        self.periodic = bool(periodic)
        self.fractional_coordinates = bool(fractional_coordinates)
        if species_as not in ("species", "atoms"):
            raise ValueError(f"species_as must be 'species' (integer ids) or 'atoms' (one-hot), got {species_as!r}")
        if species is not None:
            species = tuple(int(z) for z in species)
            if len(set(species)) != len(species) or min(species, default=1) < 1:
                raise ValueError(f"species must be distinct atomic numbers >= 1, got {species}")
        elif species_as == "atoms":
            raise ValueError("species_as='atoms' hands energy_fn a one-hot of the species: give species= "
                             "(the atomic numbers of its columns)")
        self.species = species
        self.species_as = species_as
        jaxdd_format, half = FORMATS[self.format]
        self.model_config = ModelConfig(
            outputs={"energy", "forces", "stress"}, autograd_outputs={"forces", "stress"},
            autograd_inputs={"positions", "cell"},
            neighbor_config=NeighborConfig(cutoff=cutoff, skin=skin, format=jaxdd_format, half_list=half),
            padding_atoms=False,
        )
        # refused before the factory runs: a cutoff short of the potential's own range drops pairs
        self.interaction_range = _check_cutoff(factory, float(self.model_config.neighbor_config.cutoff),
                                               interaction_range)

        # The box a factory sees is only for its neighbor_fn, which jaxdd never calls: a cube
        # wide enough for any cell list it may size. jax-md probes the displacement's output
        # shape while it builds (canonicalize_displacement_or_metric) without a box; only
        # then does the displacement fall back on this one. Afterwards a call without box=
        # is an error, never a silent placeholder.
        placeholder = jnp.eye(3) * (1.0 if self.fractional_coordinates else 8.0 * (cutoff + skin))
        building = [True]
        periodic_, fractional_ = self.periodic, self.fractional_coordinates

        def disp(Ra, Rb, box=None, **kwargs):
            if box is None and building[0]:
                box = placeholder
            return displacement(Ra, Rb, box, periodic=periodic_, fractional_coordinates=fractional_, **kwargs)

        try:
            made = factory(disp, placeholder)
        finally:
            building[0] = False
        if not isinstance(made, tuple) or len(made) not in (2, 3) or not callable(made[-1]):
            raise ValueError(
                f"factory must return (neighbor_fn, energy_fn) or (neighbor_fn, init_fn, energy_fn), as jax-md's "
                f"energy.*_neighbor_list functions do; {getattr(factory, '__name__', factory)!r} returned {type(made).__name__}"
            )
        self.takes_params = len(made) == 3
        if self.takes_params and params is None:
            raise ValueError(
                "this factory returns (neighbor_fn, init_fn, energy_fn), whose energy_fn takes the weights first: "
                "pass params= (for instance init_fn(key, R, neighbor) on a jax-md list, or trained weights)"
            )
        if not self.takes_params and params is not None:
            raise ValueError("params= is for factories returning (neighbor_fn, init_fn, energy_fn); this one "
                             "returns (neighbor_fn, energy_fn), whose weights live inside energy_fn")
        self.energy_fn = made[-1]
        self.params = params
        self.energy_kwargs = dict(energy_kwargs or {})

    # ------------------------------------------------------------------ checks on the host

    def validate_input(self, data) -> None:
        if data.n_systems != 1:
            raise ValueError(f"a jax-md potential evaluates one system; this batch has {data.n_systems}: "
                             "compute the systems one at a time")
        pbc = np.asarray(data.pbc)[0]
        if self.periodic and not pbc.all() or not self.periodic and pbc.any():
            space = "space.periodic / periodic_general" if self.periodic else "space.free"
            raise ValueError(
                f"the system's pbc is {pbc.tolist()} but the jax-md potential was wrapped with periodic="
                f"{self.periodic} ({space}); jax-md's spaces are periodic on every axis or on none: wrap it with "
                f"periodic={bool(pbc.any())} or give the system pbc={[self.periodic] * 3}"
            )
        if self.fractional_coordinates and not self.periodic:
            raise ValueError("fractional_coordinates=True needs a periodic cell (periodic=True)")
        check_cell_width(self, data.cell, data.pbc)
        if self.species is not None:
            mask = np.asarray(data.atom_mask)
            z = np.asarray(data.atomic_numbers)[mask]
            bad = np.flatnonzero(~np.isin(z, self.species))
            if bad.size:
                rows = np.flatnonzero(mask)[bad]
                raise ValueError(f"atoms {rows[:8].tolist()} have atomic numbers {sorted(set(z[bad].tolist()))} "
                                 f"outside the jax-md potential's species {self.species}")

    def minimum_image_cutoff(self) -> float | None:
        """The neighbour range (Å) of a periodic potential, whose displacements are minimum-image."""
        return self.model_config.neighbor_config.search_cutoff if self.periodic else None

    # ------------------------------------------------------------------ the call

    def adapt_input(self, data, **kwargs) -> dict:
        if data.neighbors is None:
            raise ValueError("JaxMDModel needs data.neighbors; call it through jaxdd.compute or DistributedModel")
        return dict(data=data)

    def forward(self, data):
        cell = data.cell[0]
        box = cell.T  # jax-md: lattice vectors are columns
        R = data.positions
        if self.fractional_coordinates:
            R = R @ _inverse_3x3(box).T  # no LAPACK (see _inverse_3x3)
        kwargs = dict(self.energy_kwargs)
        if self.periodic:
            kwargs["box"] = box
        if self.species is not None:
            kwargs[self.species_as] = self._species(data.atomic_numbers, R.dtype)
        neighbor = self._neighbor_list(data.neighbors, R)
        args = (self.params, R, neighbor) if self.takes_params else (R, neighbor)
        energy = self.energy_fn(*args, **kwargs)
        if jnp.ndim(energy) != 0:
            raise ValueError(
                f"energy_fn returned shape {jnp.shape(energy)}, not a scalar: wrap the total energy "
                "(jax-md's per_particle=True gives per-atom energies; jaxdd takes the total)"
            )
        return {"energy": jnp.reshape(energy, (1,)).astype(R.dtype)}

    def _species(self, atomic_numbers, dtype):
        table = np.zeros(max(self.species) + 1, np.int32)
        table[list(self.species)] = np.arange(len(self.species))
        ids = jnp.asarray(table)[jnp.clip(atomic_numbers, 0, table.size - 1)]
        if self.species_as == "species":
            return ids
        real = (atomic_numbers > 0)[:, None]
        return jnp.where(real, jax.nn.one_hot(ids, len(self.species), dtype=dtype), 0)

    def _neighbor_list(self, nl, R) -> partition.NeighborList:
        if self.format is partition.NeighborListFormat.Dense:
            idx = nl.matrix
        else:
            idx = jnp.stack([nl.receivers, nl.senders])
        return partition.NeighborList(
            idx=idx, reference_position=R, error=partition.PartitionError(jnp.zeros((), jnp.uint8)),
            cell_list_capacity=None, max_occupancy=idx.shape[-1], format=self.format, cell_size=None,
            cell_list_fn=None, update_fn=_no_update,
        )

