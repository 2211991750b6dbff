"""Checkpoints of a dynamics run: ``DomainParallel.save`` writes them and ``restore`` reads them
back, here together (orbax arrays + ``md.json`` + ``spec.json``), and a damaged one is refused
with a :class:`~jaxdd.CheckpointError` naming the file at fault: checksums of every array and of
the metadata, and the id binding them, are :mod:`~jaxdd.dynamics.checkpoint_integrity`'s.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from ..model.checkpoint import array_tree, damaged, read_json, restore_arrays
from ..data import Batch
from ..decomposition.halo import Exchange, HaloLayout, HaloRouting
from ..engine.atom_order import atom_order, unwrapped_positions
from ..engine.placed import AtomRows, Placed, RankPlan
from ..neighbors import NeighborCapacity
from ..neighbors.capacity import Capacities
from . import checkpoint_integrity as integrity
from .integrators import INTEGRATORS
from .state import MDState

__all__ = ["save", "restore", "read_md_json", "read_md_arrays", "fingerprint", "barrier"]


def save(md, path, state: MDState) -> Path:
    """Write ``state`` of the :class:`~jaxdd.dynamics.DomainParallel` ``md`` to the folder ``path``.

    Stored as the ranks hold it, each process writing its own devices' rows (nothing is
    gathered): the per-rank atom arrays, the halo plan and its layout, the energy, the
    integrator and its state (random streams are keyed by seed and step), capacities,
    the batch the run started from and the spec, with a sha256 of every array block, of
    md.json and of spec.json and an id shared by md.json and the arrays. Never overwrites;
    ValueError before anything is written when ``state`` is not of ``md``'s kind of run.

    Args:
      md: the run. path: a new or empty folder. state: the state to write.

    Returns:
      The folder's absolute path.
    """
    import orbax.checkpoint as ocp

    path = Path(path).absolute()
    if path.exists() and any(path.iterdir()):
        raise FileExistsError(f"checkpoint folder {path} is not empty; choose a new path")
    check_saveable(md, state)
    barrier("jaxdd.save.checked")  # every process has looked before any writes
    path.mkdir(parents=True, exist_ok=True)
    t = state.template
    # The layout on disk names the rows and the plan's arrays as the dicts of earlier states did.
    tree = dict(
        ranked={**state.rows.as_dict(), **flat_plan(state.plan)}, energy=state.energy, extra=state.extra,
        plan_cell=state.plan.plan_cell, virial=state.virial,
        **({"cuts": np.asarray(md.placement.cuts)} if md.placement.cuts is not None else {}),
        template={k: np.asarray(v) for k, v in batch_fields(t).items()},
    )
    tree, empty = without_empty(tree)
    checkpoint_id = integrity.new_id()
    digests = integrity.array_digests(tree, str(np.dtype(t.positions.dtype)))
    tree[integrity.ID_KEY] = checkpoint_id
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(path / "arrays", tree)
    checkpointer.wait_until_finished()
    dm = md.dist_model
    meta = dict(
        step=state.step, converged=state.converged, dtype=str(np.dtype(t.positions.dtype)),
        integrator={"kind": type(md.integrator).__name__, **dataclasses.asdict(md.integrator)},
        n_ranks=dm.config.n_ranks, grid=list(md.placement.grid), layout=layout_json(state.layout),
        halo_capacity=[dm.capacities.owned, list(dm.capacities.exchange)], n_migrate=dm.capacities.migrate,
        nl_capacity=dataclasses.asdict(dm.capacities.neighbors), extra=sorted(state.extra),
        ghost_width=state.ghost_width, model=fingerprint(dm.model), empty=empty,
    )
    if jax.process_index() == 0:  # orbax coordinates the arrays; the small files need one writer
        spec = dm.spec.save(path / "spec.json") if dm.spec is not None else None
        meta = integrity.seal(meta, checkpoint_id, digests, spec)
        (path / "md.json").write_text(json.dumps(meta, indent=1))
    barrier("jaxdd.save.done")
    return path


def restore(md, path) -> MDState:
    """The state saved at ``path``, for the :class:`~jaxdd.dynamics.DomainParallel` ``md``.

    On the rank grid it was saved from, every rank reads back its own rows and plan, so the
    run continues bit for bit; on another, the saved atoms are read whole and partitioned
    afresh (the trajectory then agrees to round-off). A damaged checkpoint raises
    :class:`jaxdd.CheckpointError` naming the file at fault.

    Args:
      md: the run to continue. path: a folder :func:`save` wrote.
    """
    path = Path(path).absolute()
    meta, saved = read_md_json(path, INTEGRATORS)  # CheckpointError naming a damaged file
    fmt = integrity.check_md_json(path / "md.json", meta)  # md.json and spec.json as written
    if saved != md.integrator:
        raise ValueError(f"the checkpoint was written with {saved!r}, this DomainParallel runs {md.integrator!r}; "
                         "restore it with the same integrator")
    dm = md.dist_model
    if np.dtype(meta["dtype"]) == np.float64 and not jax.config.jax_enable_x64:
        raise ValueError(f"{path} holds a float64 run but JAX runs in float32 here; enable float64 before "
                         "restoring: jax.config.update('jax_enable_x64', True)")
    mesh = dm.config.mesh
    same = meta["n_ranks"] == dm.config.n_ranks and (dm.config.grid is None or list(dm.config.grid) == meta["grid"])
    ranked = NamedSharding(mesh, P(tuple(mesh.axis_names)))
    replicated = NamedSharding(mesh, P())
    sharding_of = (lambda group: ranked if group == "ranked" and same else replicated)  # noqa: E731
    a = read_md_arrays(path / "arrays", sharding_of)
    integrity.check_arrays(path / "arrays", path / "md.json", meta, fmt, a)  # bound to md.json, as written
    check_dtypes(path / "arrays", a, meta["dtype"])
    a = with_empty(a, meta.get("empty", {}), sharding_of)
    dtype = np.dtype(meta["dtype"])
    fields = {k: np.asarray(v) for k, v in a["template"].items()}
    template = Batch.unchecked(**{k: jnp.asarray(fields[k], dtype) if k in _FLOAT_FIELDS else jnp.asarray(fields[k])
                                  for k in fields}, **{k: None for k in _OPTIONAL_FIELDS if k not in fields},
                               velocities=None, neighbors=None)
    extra = dict(a["extra"])
    energy = a["energy"]
    dm.model.validate_input(template)  # the saved atoms' species and fields suit this model
    # A balanced run's cuts fit its own grid; on another one the blocks are placed afresh.
    md.placement.cuts = np.asarray(a["cuts"], np.float64) if "cuts" in a and same else None
    if same:
        md.placement.grid = tuple(meta["grid"])
        dm.sizing.use(Capacities(
            owned=meta["halo_capacity"][0], exchange=meta["halo_capacity"][1], migrate=meta["n_migrate"],
            neighbors=NeighborCapacity(**{k: (tuple(v) if isinstance(v, list) else v)
                                          for k, v in meta["nl_capacity"].items()})))
        md.placement.reset_frame(template)
        rows, plan = unflat_plan(a["ranked"], template, replicated)
        if "plan_cell" in a:
            plan = plan.replace(plan_cell=jax.device_put(np.asarray(a["plan_cell"]), replicated))
        placed = Placed(rows=rows, plan=plan, template=template, layout=layout_of(meta["layout"]),
                        ghost_width=meta.get("ghost_width"))
        state = MDState.start(placed, step=meta["step"], extra=extra, energy=energy, virial=a.get("virial"),
                              converged=bool(meta["converged"]))
    else:
        held = {k: np.asarray(v) for k, v in a["ranked"].items()}
        n = template.n_atoms
        atoms = {k: atom_order(held["ids"], held[k], n) for k in ("positions", "image", "velocities", "forces")}
        positions = unwrapped_positions(template, atoms["positions"], atoms["image"])
        state = MDState.start(md.placement.place(template, positions, atoms["velocities"], atoms["forces"]),
                              step=meta["step"], extra=extra, energy=energy,
                              virial=None if a.get("virial") is None else np.asarray(a["virial"]),
                              converged=bool(meta["converged"]))
    if meta.get("model") != fingerprint(dm.model):
        # Another model (weights, cutoff) than the one that wrote the checkpoint: its plan is
        # checked (planned again if too narrow) and its energy and forces are this model's.
        fitting = md.fitting(state)
        state = fitting if fitting is not state else md.with_forces(state)
    return state


def fingerprint(model) -> dict:
    """What identifies a model in a checkpoint: its class, neighbour range and a digest of
    its array leaves (its weights)."""
    import hashlib

    digest = hashlib.sha256()
    for leaf in jax.tree_util.tree_leaves(model):
        if isinstance(leaf, (jax.Array, np.ndarray)):
            a = np.asarray(leaf)
            digest.update(f"{a.dtype}{a.shape}".encode())
            digest.update(np.ascontiguousarray(a).tobytes())
        elif isinstance(leaf, (bool, int, float, str)):
            digest.update(repr(leaf).encode())
    nc = model.model_config.neighbor_config
    return dict(kind=type(model).__name__, search_cutoff=None if nc is None else float(nc.search_cutoff),
                digest=digest.hexdigest())


_OPTIONAL_FIELDS = ("charges", "masses")
_FLOAT_FIELDS = ("positions", "cell", "charges", "masses")


def batch_fields(batch: Batch) -> dict:
    """The batch's arrays by field name (absent optional fields, velocities and the neighbour
    list left out)."""
    names = ("positions", "atomic_numbers", "cell", "pbc", "batch_idx", "ptr", "atom_mask", "system_mask",
             *_OPTIONAL_FIELDS)
    return {k: getattr(batch, k) for k in names if getattr(batch, k) is not None}


def without_empty(tree: dict) -> tuple[dict, dict]:
    """(``tree`` without its arrays of no elements, ``{"group/name": [shape, dtype]}`` of them).
    Orbax cannot save an empty array, and a plan with nothing to send (one rank, node
    blocks) has empty routing tables; they are written as their shape and dtype."""
    kept, empty = {}, {}
    for group, value in tree.items():
        if isinstance(value, dict):
            kept[group] = {}
            for name, x in value.items():
                if np.size(x) == 0:
                    empty[f"{group}/{name}"] = [list(np.shape(x)), str(np.dtype(x.dtype))]
                else:
                    kept[group][name] = x
        elif np.size(value) == 0:
            empty[group] = [list(np.shape(value)), str(np.dtype(value.dtype))]
        else:
            kept[group] = value
    return kept, empty


def with_empty(arrays: dict, empty: dict, sharding_of) -> dict:
    """``arrays`` read back with the empty ones :func:`without_empty` took out put back,
    each placed with ``sharding_of(group)``."""
    arrays = {k: dict(v) if isinstance(v, dict) else v for k, v in arrays.items()}
    for key, (shape, dtype) in empty.items():
        group, _, name = key.partition("/")
        x = jax.device_put(np.zeros(shape, np.dtype(dtype)), sharding_of(group))
        if name:
            arrays.setdefault(group, {})[name] = x
        else:
            arrays[group] = x
    return arrays


def flat_plan(plan: RankPlan) -> dict:
    """The per-rank arrays of ``plan`` by flat name (``local__positions``, ``routing__send_idx``,
    ``owned_rows`` ...; cell and system mask come from the batch)."""
    out = {f"local__{k}": v for k, v in batch_fields(plan.local).items()}
    if plan.local.velocities is not None:
        out["local__velocities"] = plan.local.velocities
    out.update({f"routing__{f.name}": getattr(plan.routing, f.name) for f in dataclasses.fields(plan.routing)})
    out["owned_rows"] = plan.owned_rows
    return out


def unflat_plan(ranked: dict, template: Batch, replicated) -> tuple[AtomRows, RankPlan]:
    """(rows, plan) from the names of :func:`flat_plan` and :meth:`~jaxdd.engine.placed.AtomRows.as_dict`,
    as :meth:`~jaxdd.engine.run_placement.Placement.place` lays them out.

    Args:
      ranked: the checkpoint's ``ranked`` arrays by name.
      template: the batch (its cell and system mask, placed with ``replicated``).
      replicated: the sharding of arrays every rank holds whole.
    """
    arrays = AtomRows(**{k: v for k, v in ranked.items() if "__" not in k and k != "owned_rows"})
    local = {k[len("local__"):]: v for k, v in ranked.items() if k.startswith("local__")}
    local = Batch.unchecked(**local, **{k: None for k in (*_OPTIONAL_FIELDS, "velocities") if k not in local},
                            neighbors=None)
    routing = HaloRouting(**{k[len("routing__"):]: v for k, v in ranked.items() if k.startswith("routing__")})
    cell = jax.device_put(np.asarray(template.cell), replicated)
    plan = RankPlan(local=local, owned_rows=ranked["owned_rows"], routing=routing, cell=cell, plan_cell=cell,
                    system_mask=jax.device_put(np.asarray(template.system_mask), replicated))
    return arrays, plan


def layout_json(layout: HaloLayout) -> dict:
    return dict(grid=list(layout.grid), n_owned=layout.n_owned,
                exchanges=[dict(axis=e.axis, direction=e.direction, hop=e.hop, pairs=[list(p) for p in e.pairs],
                                offset=e.offset, capacity=e.capacity) for e in layout.exchanges])


def layout_of(data: dict) -> HaloLayout:
    return HaloLayout(grid=tuple(data["grid"]), n_owned=data["n_owned"], exchanges=tuple(
        Exchange(e["axis"], e["direction"], e["hop"], tuple(tuple(p) for p in e["pairs"]), e["offset"], e["capacity"])
        for e in data["exchanges"]))


def check_saveable(md, state: MDState) -> None:
    """ValueError unless ``state`` is of the run ``md`` saves (node blocks or a halo grid, its
    rank grid), naming the mismatch and what to do.

    Args:
      md: the :class:`~jaxdd.dynamics.DomainParallel` saving. state: the state to save.
    """
    layout, grid = state.layout, md.placement.grid
    halo_state = bool(layout.exchanges) or layout.grid == (1, 1, 1)
    if md.node_blocks and bool(layout.exchanges):
        raise ValueError(f"the state was placed on a halo grid {layout.grid} (its plan exchanges ghost rows) but this "
                         "DomainParallel runs node blocks (DomainConfig strategy='graph_partition'); save it with "
                         "the DomainParallel that ran it, one with the halo strategy")
    if not md.node_blocks and not halo_state:
        raise ValueError(f"the state was placed as node blocks on {layout.grid[0]} ranks (strategy='graph_partition') "
                         "but this DomainParallel runs a halo grid; save it with the DomainParallel that ran it")
    if grid is None or md.dist_model.capacities is None:
        raise ValueError("this DomainParallel has placed no state yet (no rank grid, no capacities); save the state "
                         "with the DomainParallel that ran it, or md.restore / md.init first")
    if tuple(layout.grid) != tuple(grid):
        raise ValueError(f"the state was placed on the rank grid {tuple(layout.grid)} but this DomainParallel runs "
                         f"{tuple(grid)}; save it with the DomainParallel that ran it")


#: Arrays stored in the run's float dtype (md.json's ``dtype``).
_RUN_FLOAT_ARRAYS = ("ranked/positions", "ranked/velocities", "ranked/forces", "template/positions")


def check_dtypes(folder: Path, arrays: dict, dtype: str) -> None:
    """CheckpointError naming ``folder`` and the array when an array of atoms is not of the
    run's ``dtype`` (md.json's ``dtype``) or a float array is of a dtype no run has.

    Args:
      folder: the ``arrays/`` folder. arrays: the arrays read (two-level dict). dtype: md.json's dtype.
    """
    for group, value in arrays.items():
        for name, x in (value.items() if isinstance(value, dict) else [(None, value)]):
            key, got = group if name is None else f"{group}/{name}", np.dtype(x.dtype)
            if key in _RUN_FLOAT_ARRAYS and str(got) != dtype:
                raise damaged(folder, f"holds the array {key} as {got}, but md.json's field 'dtype' is {dtype}")
            if got.kind == "f" and str(got) not in integrity.RUN_DTYPES:
                raise damaged(folder, f"holds the array {key} as {got}, a dtype no run has "
                                      f"({' or '.join(integrity.RUN_DTYPES)})")


def barrier(name: str) -> None:
    """Wait for every process at the barrier ``name`` (nothing with one process)."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


# ----------------------------------------------------------------------------- reading


def _int(low):
    return lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= low


def _ints(low, n=None):
    return lambda v: isinstance(v, list) and (n is None or len(v) == n) and all(map(_int(low), v))


_EXCHANGE_KEYS = ("axis", "direction", "hop", "pairs", "offset", "capacity")


def _layout(v) -> bool:
    return (isinstance(v, dict) and _ints(1, 3)(v.get("grid")) and _int(0)(v.get("n_owned"))
            and isinstance(v.get("exchanges"), list)
            and all(isinstance(e, dict) and all(k in e for k in _EXCHANGE_KEYS) for e in v["exchanges"]))


# What DomainParallel.save writes into md.json: key -> (what it must be, test).
_MD_FIELDS = {
    "step": ("a step count (an integer >= 0)", _int(0)),
    "converged": ("true or false", lambda v: isinstance(v, bool)),
    "dtype": (f"the dtype of a run ({' or '.join(integrity.RUN_DTYPES)})", lambda v: v in integrity.RUN_DTYPES),
    "integrator": ("an object naming the integrator's kind", lambda v: isinstance(v, dict) and isinstance(v.get("kind"), str)),
    "n_ranks": ("a rank count (an integer >= 1)", _int(1)),
    "grid": ("3 integers >= 1", _ints(1, 3)),
    "layout": ("the halo layout (grid, n_owned, exchanges)", _layout),
    "halo_capacity": ("[owned rows, [rows per exchange]]", lambda v: isinstance(v, list) and len(v) == 2
                      and _int(0)(v[0]) and _ints(0)(v[1])),
    "n_migrate": ("an integer >= 0", _int(0)),
    "nl_capacity": ("the neighbour-list capacity (an object)", lambda v: isinstance(v, dict)),
    "extra": ("a list of names", lambda v: isinstance(v, list) and all(isinstance(k, str) for k in v)),
}


def read_md_json(path: Path, integrators: dict):
    """(md.json of the dynamics checkpoint ``path`` as a dict, the integrator it names).

    FileNotFoundError when ``path`` holds no md.json; CheckpointError naming md.json when it is
    empty, cut short, lacks a field or holds a value ``DomainParallel.save`` never writes.

    Args:
      path: the checkpoint's folder.
      integrators: the known integrator classes by name.
    """
    file = Path(path) / "md.json"
    if not file.exists():
        raise FileNotFoundError(f"{path} holds no dynamics checkpoint (no md.json)")
    meta = read_json(file)
    for key, (want, ok) in _MD_FIELDS.items():
        if key not in meta:
            raise damaged(file, f"has no field {key!r}")
        if not ok(meta[key]):
            raise damaged(file, f"field {key!r} must be {want}, got {str(meta[key])[:200]}")
    settings = dict(meta["integrator"])
    kind = settings.pop("kind")
    if kind not in integrators:
        raise damaged(file, f"names the integrator {kind!r}, which is not one of {sorted(integrators)}")
    try:
        integrator = integrators[kind](**settings)
    except (TypeError, ValueError) as exc:
        raise damaged(file, f"holds {kind} settings that cannot be used ({exc})") from None
    return meta, integrator


_MD_GROUPS = ("ranked", "energy", "extra", "template")


def read_md_arrays(folder: Path, sharding_of) -> dict:
    """The arrays of a dynamics checkpoint (its ``arrays/`` folder), each group placed with
    ``sharding_of(group)``. CheckpointError naming the folder or file when it is missing,
    damaged, or lacks a group ``DomainParallel.save`` writes."""
    tree = array_tree(folder)
    missing = [g for g in _MD_GROUPS if g not in tree]
    if missing:
        raise damaged(folder, f"holds no {', '.join(missing)} arrays")
    target = {group: jax.tree_util.tree_map(
        lambda m, group=group: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=sharding_of(group)), tree[group])
        for group in tree}
    return restore_arrays(folder, target)
