"""Why a distributed run differs: halo completeness, undeclared helpers, errors explained."""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import sysconfig
import types
from collections import Counter
from collections.abc import Iterable

import jax
import jax.numpy as jnp
import numpy as np

from ..data import Batch
from ..dispatch import DispatchError
from ..model.protocol import model_config
from ..decomposition.graph_partition import block_neighbor_list
from ..neighbors import NeighborCapacity, build_neighbor_list, neighbor_list
from ..ops import SpecError
from .report import HaloCompleteness, HelperDiagnostic

__all__ = ["halo_completeness", "HelperRecorder", "helper_diagnostics", "diagnose", "watched_modules"]

_STDLIB = sysconfig.get_paths()["stdlib"]
_NOT_HELPERS = ("jax", "jaxlib", "numpy", "flax", "equinox", "jraph", "e3nn_jax", "optax", "jaxdd", "ase", "scipy",
                "haiku", "orbax", "chex", "typing", "collections", "functools", "math", "dataclasses")


# --------------------------------------------------------------------------- halo completeness


def _edge_sets(receivers, senders, shifts, owned: Iterable[int]) -> dict[int, Counter]:
    sets = {int(a): Counter() for a in owned}
    for r, s, sh in zip(receivers, senders, shifts):
        if int(r) in sets:
            sets[int(r)][(int(s), *map(int, sh))] += 1
    return sets


def halo_completeness(dist, batch: Batch) -> HaloCompleteness:
    """Compare, atom by atom, each owned atom's neighbours on its rank with one device.

    Neighbours are matched by identity: (global index of the neighbour, its lattice image),
    never by rounded positions.

    Args:
      dist: a :class:`~jaxdd.DistributedModel`.
      batch: the batch it runs.
    """
    batch = batch if isinstance(batch, Batch) else Batch.from_data_list([batch])
    cutoff = model_config(dist.model).neighbor_config.search_cutoff
    nl, _ = neighbor_list(batch.positions, batch.cell, batch.pbc, batch.batch_idx, batch.atom_mask, cutoff=cutoff)
    m = np.asarray(nl.mask)
    real = np.nonzero(np.asarray(batch.atom_mask))[0]
    ref = _edge_sets(np.asarray(nl.receivers)[m], np.asarray(nl.senders)[m], np.asarray(nl.shifts)[m], real)

    got: dict[int, Counter] = {int(a): Counter() for a in real}
    for gr, gs, shift in _rank_edges(dist, batch, cutoff):
        for a, b, sh in zip(gr, gs, shift):
            got[int(a)][(int(b), *map(int, sh))] += 1
    bad = [a for a in ref if ref[a] != got.get(a, Counter())]
    missing, extra = [], []
    for a in bad[:20]:
        missing += [(a, k[0]) for k in (ref[a] - got[a])]
        extra += [(a, k[0]) for k in (got[a] - ref[a])]
    return HaloCompleteness(matches=not bad, checked=len(ref), atoms=tuple(bad[:20]), missing=tuple(missing[:20]),
                            extra=tuple(extra[:20]))


# One compiled search per shape (called op by op, each rank's search compiled dozens of small programs).
_block = jax.jit(block_neighbor_list, static_argnames=("n_block", "cutoff", "capacity", "format"))


def _rank_edges(dist, batch: Batch, cutoff: float):
    """Per rank: (receivers, senders, image shifts) of its list, as global atoms and shifts
    relative to the batch's own positions."""
    part, plan = dist.plan(batch)
    inputs, local_pos = dist.rank_inputs(batch, part, plan)
    cap = dist.size_neighbors(inputs, local_pos)
    cap = NeighborCapacity(cap.max_edges, cap.max_neighbors, cap.max_candidates, cap.search_range)
    local = inputs.local
    n_sys = batch.n_systems
    n_owned = plan.layout.n_owned
    for r in range(local_pos.shape[0]):
        ids = plan.local_ids[r]
        if dist.strategy == "graph_partition":  # positions as given; senders index every rank's rows
            lnl = _block(
                jnp.asarray(local_pos.reshape(-1, 3)), inputs.cell, local.pbc[0], local.batch_idx.reshape(-1),
                local.atom_mask.reshape(-1), r, n_owned, cutoff=cutoff, capacity=cap)
            lm = np.asarray(lnl.mask)
            yield ids[np.asarray(lnl.receivers)[lm]], plan.local_ids.reshape(-1)[np.asarray(lnl.senders)[lm]], \
                np.asarray(lnl.shifts)[lm]
            continue
        # A rank searches the periodic axes of its local pbc (those the grid leaves whole) in the
        # cell, and open boundaries when its ghost rows are the images on every axis.
        periodic = bool(np.asarray(local.pbc[r]).any())
        lnl = build_neighbor_list(
            jnp.asarray(local_pos[r]),
            jnp.asarray(inputs.cell) if periodic else jnp.broadcast_to(jnp.eye(3, dtype=local_pos.dtype), (n_sys, 3, 3)),
            jnp.asarray(local.pbc[r]), local.batch_idx[r], local.atom_mask[r], cutoff=cutoff, capacity=cap,
            n_receivers=n_owned)
        lm = np.asarray(lnl.mask)
        lr, ls = np.asarray(lnl.receivers)[lm], np.asarray(lnl.senders)[lm]
        gr, gs = ids[lr], ids[ls]
        yield gr, gs, (plan.local_shifts[r][ls] - plan.local_shifts[r][lr] - part.wraps[gs] + part.wraps[gr]
                       + np.asarray(lnl.shifts)[lm])


# --------------------------------------------------------------------------- helpers


def watched_modules(model) -> tuple[str, ...]:
    """Modules a model's code reaches that are neither jaxdd nor the usual frameworks: the
    model's own module and the modules it (and they) import, two levels deep."""
    start = inspect.getmodule(type(model))
    seen, order = set(), []

    def visit(mod, depth):
        if mod is None or mod.__name__ in seen or mod.__name__.split(".")[0] in _NOT_HELPERS:
            return
        path = getattr(mod, "__file__", None)
        if mod.__name__ in ("builtins", "__main__") or not path or path.startswith(_STDLIB):
            return
        seen.add(mod.__name__)
        order.append(mod.__name__)
        if depth >= 2:
            return
        for value in list(vars(mod).values()):
            if isinstance(value, types.ModuleType):
                visit(value, depth + 1)
            else:
                visit(inspect.getmodule(value) if callable(value) else None, depth + 1)

    visit(start, 0)
    return tuple(order)


@dataclasses.dataclass
class _Call:
    module: str
    name: str
    fn: object
    args: tuple
    kwargs: dict
    result: object


class HelperRecorder:
    """Records calls (with concrete values) into the module-level functions of ``modules``
    while active; restores every function on exit."""

    def __init__(self, modules: Iterable[str]):
        self.modules = tuple(modules)
        self.calls: list[_Call] = []
        self._patched = []

    def __enter__(self):
        for name in self.modules:
            try:
                mod = importlib.import_module(name)
            except ImportError:
                continue
            for attr, fn in list(vars(mod).items()):
                if not inspect.isfunction(fn) or fn.__module__ != mod.__name__ or attr.startswith("__"):
                    continue
                self._patched.append((mod, attr, fn))
                setattr(mod, attr, self._wrap(mod.__name__, attr, fn))
        return self

    def _wrap(self, module, name, fn):
        def recorded(*args, **kwargs):
            result = fn(*args, **kwargs)
            leaves = jax.tree_util.tree_leaves((args, kwargs, result))
            if not any(isinstance(x, jax.core.Tracer) for x in leaves):
                self.calls.append(_Call(module, name, fn, args, kwargs, result))
            return result

        recorded.__wrapped__ = fn
        return recorded

    def __exit__(self, *exc):
        for mod, attr, fn in reversed(self._patched):
            setattr(mod, attr, fn)
        self._patched.clear()
        return False


def helper_diagnostics(calls, n_atoms: int, owner: np.ndarray, declared: Iterable[str]) -> tuple[HelperDiagnostic, ...]:
    """Calls that reduce per-atom rows (leading axis ``n_atoms``) to fewer rows and whose
    results over each rank's own atoms add up to the single-device result: per-system
    reductions that are wrong under decomposition unless an adapter replaces them.

    Args:
      calls: the recorded helper calls (their args and result) of a single-device run.
      n_atoms: the sample's atom rows.
      owner: [n_atoms] rank owning each atom (negative: none).
      declared: the helpers an adapter replaces already (left out).
    """
    declared = set(declared)
    found = {}
    ranks = sorted(set(int(o) for o in owner if o >= 0))
    for call in calls:
        result = call.result
        if not hasattr(result, "shape") or np.ndim(result) < 1 or result.shape[0] >= n_atoms:
            continue
        per_atom = [i for i, a in enumerate(call.args) if hasattr(a, "shape") and np.ndim(a) >= 1 and a.shape[0] == n_atoms]
        if not per_atom or len(ranks) < 2:
            continue
        try:
            total = 0
            for r in ranks:
                rows = np.nonzero(owner == r)[0]
                args = [a[rows] if i in per_atom else a for i, a in enumerate(call.args)]
                total = total + np.asarray(call.fn(*args, **call.kwargs), np.float64)
        except Exception:  # the helper does not take a subset of rows: not this pattern
            continue
        ref = np.asarray(result, np.float64)
        if total.shape == ref.shape and np.allclose(total, ref, rtol=1e-6, atol=1e-9):
            key = f"{call.module}:{call.name}"
            target = f"{call.module}.{call.name}"
            found[key] = HelperDiagnostic(key, n_atoms, int(ref.shape[0]), target in declared)
    return tuple(found.values())


# --------------------------------------------------------------------------- errors


def diagnose(exc: BaseException | None = None, *, nan: bool = False, internal_forces: bool = False,
             unfollowed: tuple[str, ...] = (), padding: bool = False) -> str | None:
    """A one-line ``Diagnosis`` with the fix, for an error or a symptom (None when unknown).

    Args:
      exc: the exception a run raised, if any.
      nan: the outputs came back NaN.
      internal_forces: the forces disagree with one device while the model computes them
        itself (``forces`` not among its autograd outputs).
      unfollowed: what the dispatch could not follow (each with the user's file and line),
        in a run whose numbers agreed with one device on this sample.
      padding: the single-device outputs change with the number of padding atom rows.
    """
    if padding:
        return ("the model's per-system outputs change when padding atom rows are appended on one device: its "
                "readout sums padding rows (atom_mask False), which no rank holds; mask them, e.g. "
                "jnp.where(data.atom_mask, atomic_energies, 0.0), or sum with "
                "jax.ops.segment_sum(atomic_energies, data.batch_idx, data.n_systems) (padding rows' batch_idx "
                "is n_systems, so they are dropped)")
    if unfollowed:
        return (f"the numbers agree on this sample, but the dispatch could not follow {len(unfollowed)} value(s), "
                f"first: {unfollowed[0]}; DistributedModel refuses such a model by default, since another system "
                "can differ; declare it (jaxdd.system_sum, jaxdd.to_local, an adapter on the spec) or pass "
                "DomainConfig(allow_unfollowed=True) after checking")
    if nan:
        return ("NaN in the distributed outputs but not in the reference: a padded edge or a ghost row reaches a "
                "sqrt or a division; use safe norms, e.g. where(mask, sqrt(where(mask, r2, 1)), 0)")
    if internal_forces:
        return ("the model computes its forces itself (a gradient taken inside the model): ghost rows of primal and "
                "cotangent values obey different rules under decomposition; let jaxdd differentiate the energy "
                "(autograd_outputs={'forces'}) or declare kernel-direct forces as a PER_NODE output with ScatterOutputs")
    if exc is None:
        return None
    msg = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if isinstance(exc, SpecError) and "not registered" in msg:
        return f"{msg} — import the module that registers it in the factory's module, so the sharded run sees it too"
    if "overflowed" in msg:
        return (f"{msg} — atoms may sit on top of each other, or the sample is far denser than the capacity headroom "
                "allows; check the sample or raise DomainConfig.capacity_factor")
    if isinstance(exc, DispatchError):
        return f"the dispatch refused the model: {msg}"
    if "ghost" in msg and "cutoff" in msg:
        return f"{msg} — the ghost shell must be at least the model's cutoff + skin"
    return f"{type(exc).__name__}: {msg}"
