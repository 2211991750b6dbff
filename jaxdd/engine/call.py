"""One evaluation of a rank program: the compiled program a ``DistributedModel`` call runs."""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from .. import programs
from ..dispatch import DispatchError, DispatchReport, Kind, unfollowed_error
from ..model.base import ModelOutputs
from ..spec import OutputKind
from .rank_neighbors import neighbor_needs
from .rank_program import RankInputs, RankProgram, RankRows, rank_evaluate, run_ranks

__all__ = ["run_program", "per_node_keys"]


def per_node_keys(program: RankProgram) -> set[str]:
    """The outputs of ``program`` with one row per atom: forces, the per-atom energies and
    virials, declared PER_NODE keys."""
    spec = program.spec
    return {k for k in program.outputs
            if k in ("forces", program.virial_key) or (program.use_node_energy and k == program.energy_key)
            or spec.kind_of(k) is OutputKind.PER_NODE}


@programs.track
@eqx.filter_jit
def run_program(model, inputs: RankInputs):
    """(outputs over the gather rows [N'], overflow [] bool, the neighbour sizes needed) of one
    evaluation of ``model`` on ``inputs`` (its program static)."""
    program = inputs.program
    axes = program.axes
    # Forces and stress the model computes itself (a kernel's direct forces) are its outputs,
    # laid out like any other; only autograd outputs are derived here.
    want_forces = "forces" in program.outputs and "forces" in program.autograd
    want_stress = "stress" in program.outputs and "stress" in program.autograd
    want_virials = program.virial_key is not None
    spec = program.spec
    n_owned = program.layout.n_owned
    report = DispatchReport(policy=program.policy)
    per_node = per_node_keys(program)

    def rank_fn(model, report, local, own_pos, own_sys, owned_rows, routing, cell, system_mask):
        per_system, out, lays, nl, g_pos, g_strain, w_atoms = rank_evaluate(
            model, RankRows(local, own_pos, own_sys, owned_rows, routing, cell, system_mask), program, report,
            forces=want_forces, stress=want_stress, virials=want_virials)
        results = {}
        for key in program.outputs:  # one fixed order on every rank
            if key == "energy":
                results[key] = per_system
            elif key == "forces" and want_forces:
                results[key] = -g_pos
            elif key == "stress" and want_stress:
                volume = jnp.abs(jnp.linalg.det(cell))
                safe = jnp.where(volume > 0, volume, 1.0)[:, None, None]
                results[key] = jax.lax.psum(g_strain, axes) / safe
            elif key == program.virial_key:
                results[key] = w_atoms
            elif key in per_node:
                results[key] = out[key][:n_owned]
            elif key in spec.all_reduce_outputs:
                results[key] = jax.lax.psum(out[key], axes)
            else:
                if lays[key].kind in (Kind.NODE, Kind.EDGE):
                    raise DispatchError(
                        f"output {key!r} is declared {spec.kind_of(key).value} but is laid out per "
                        f"{lays[key].kind.value} after dispatch; declare it PER_NODE or reduce it over atoms in the model"
                    )
                if lays[key].local:
                    report.note(f"output {key!r} differs between ranks (a per-rank partial?); rank 0's value is "
                                "returned: list it in all_reduce_outputs if the ranks' values should be summed")
                results[key] = out[key]  # complete on every rank: the dispatch reduced it
        overflow, needed = neighbor_needs(nl, axes)
        return results, overflow, needed

    replicated_out = ({k: k not in per_node for k in program.outputs}, True, True)
    try:
        (results, overflow, needed), _ = run_ranks(
            rank_fn, program, model=model,
            ranked=(inputs.local, inputs.own_pos, inputs.own_sys, inputs.owned_rows, inputs.routing),
            replicated=(inputs.cell, inputs.system_mask), replicated_out=replicated_out, report=report)
    finally:  # a refused program's report still says what the dispatch saw (the validator reads it)
        program.sink.put(program, report)
    if program.strict and report.fallbacks:  # notes on the outputs, made after the energy
        raise unfollowed_error(report, type(model).__name__)
    outputs = {}
    for key in program.outputs:
        value = results[key]
        if key in per_node:
            flat = value.reshape((-1,) + value.shape[2:])
            flat = jnp.concatenate([flat, jnp.zeros((1,) + flat.shape[1:], flat.dtype)])
            # Replicated: every process holds whole outputs (in the batch's order) it can read.
            value = jax.lax.with_sharding_constraint(flat[inputs.gather], NamedSharding(program.mesh, P()))
        outputs[key] = value
    return ModelOutputs(outputs), overflow, needed
