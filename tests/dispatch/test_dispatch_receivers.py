"""Specification: a sum onto the receivers of the framework's neighbour list needs one exchange.

Outside a deep halo a rank's list has only its owned atoms as receivers (padding edges point
past every row), so ``segment_sum(messages, receivers)`` leaves nothing on a ghost row: the
owners' sums are complete and are only copied to their ghosts (``scatter_add.owned_rows``),
where an index into any row needs ghost partials sent home first (``halo_correction``).
Receivers keep that stricter meaning only while their values provably stay owned rows.
"""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxdd
from jaxdd import AtomicData, BaseModel, ModelConfig, NeighborConfig, ffi
from jaxdd.dispatch import Dispatcher, DispatchReport, Kind, Layout
from jaxdd.engine import DistributedModel, DomainConfig, default_mesh
from jaxdd.neighbors import build_neighbor_list, local_neighbor_list, neighbor_capacity
from jaxdd.data.segments import per_system_sum
from jaxdd.data.systems import fcc_lattice
from plain_helpers import density_energies

pytestmark = pytest.mark.filterwarnings("ignore:the ghost shell of some ranks covers every atom:RuntimeWarning")

CUTOFF = 5.0
N_ROWS, N_EDGES = 6, 10
OWNED = Layout(Kind.EDGE, 0, Kind.OWNED_NODE)  # the list's receivers
SENDERS = Layout(Kind.EDGE, 0, Kind.NODE)
INDEX = ((N_EDGES,), jnp.int32)


def index_meaning(fn, *layouts):
    """What the first output of ``fn`` (traced on edge index arrays tagged ``layouts``) indexes."""
    closed = jax.make_jaxpr(fn)(*[jax.ShapeDtypeStruct(*INDEX)] * len(layouts))
    plan = Dispatcher(None, DispatchReport(), (N_ROWS, N_EDGES, 1)).analyse(closed.jaxpr, layouts, closed.consts)
    return plan.outs[0].index


# ----------------------------------------------------------------------------- what keeps receivers owned


@pytest.mark.parametrize("axis", [0, -1], ids=["rows", "columns"])
def test_receivers_stacked_with_senders_and_taken_apart_stay_owned(axis):
    def unstack(r, s):
        pairs = jnp.stack([r, s], axis=axis)
        return pairs[0] if axis == 0 else pairs[:, 0]

    assert index_meaning(unstack, OWNED, SENDERS) is Kind.OWNED_NODE


def test_receivers_unpacked_from_jax_md_style_idx_stay_owned():
    def unpack(r, s):
        receivers, _ = jnp.stack([r, s])
        return receivers

    assert index_meaning(unpack, OWNED, SENDERS) is Kind.OWNED_NODE


@pytest.mark.parametrize("axis", [0, -1], ids=["rows", "columns"])
def test_receivers_taken_apart_by_lax_unstack_stay_owned(axis):
    # JAX 0.11 lowers tuple unpacking (``receivers, senders = idx``) to ``unstack``.
    def unstack(r, s):
        return jax.lax.unstack(jnp.stack([r, s], axis=axis), axis=axis % 2)[0]

    assert index_meaning(unstack, OWNED, SENDERS) is Kind.OWNED_NODE


def test_the_other_piece_of_an_unstack_keeps_its_own_meaning():
    assert index_meaning(lambda r, s: jax.lax.unstack(jnp.stack([r, s]))[1], OWNED, SENDERS) is Kind.NODE


def test_the_other_row_of_a_stack_keeps_its_own_meaning():
    assert index_meaning(lambda r, s: jnp.stack([r, s])[1], OWNED, SENDERS) is Kind.NODE


def test_jnp_wrap_of_negative_indices_keeps_receivers_owned():
    # x.at[i] wraps negative i as i + len(x); for receivers (>= 0) it is never taken.
    assert index_meaning(lambda r: jnp.where(r < 0, r + N_ROWS, r), OWNED) is Kind.OWNED_NODE


def test_padding_past_every_row_keeps_receivers_owned():
    assert index_meaning(lambda r: jnp.where(r > 2, r, N_ROWS), OWNED) is Kind.OWNED_NODE


@pytest.mark.parametrize("fn", [lambda r: r + 1, lambda r: jnp.where(r > 2, r, 0), lambda r: jnp.maximum(r, 3)],
                         ids=["shifted", "padded-with-a-row", "clamped"])
def test_arithmetic_that_may_reach_a_ghost_row_makes_receivers_plain_node_indices(fn):
    assert index_meaning(fn, OWNED) is Kind.NODE


def test_a_select_between_receivers_and_senders_indexes_any_node():
    assert index_meaning(lambda r, s: jnp.where(r > 2, r, s), OWNED, SENDERS) is Kind.NODE


def test_receivers_carried_through_a_loop_unchanged_stay_owned():
    def carried(r):
        return jax.lax.fori_loop(0, 3, lambda i, x: x, r)

    assert index_meaning(carried, OWNED) is Kind.OWNED_NODE


# ----------------------------------------------------------------------------- what the rank's lists hold


def rows(n, seed=0):
    rng = np.random.default_rng(seed)
    return jnp.asarray(rng.uniform(0.0, 9.0, (n, 3))), jnp.zeros(n, jnp.int32), jnp.ones(n, bool)


KERNEL = pytest.param("kernel", marks=pytest.mark.skipif(not ffi.available(), reason="compiled kernels not built"))


@pytest.mark.parametrize("backend", ["jnp", KERNEL])
@pytest.mark.parametrize("half", [False, True], ids=["full", "half"])
def test_a_rank_list_receives_only_on_its_first_rows_and_pads_past_every_row(backend, half):
    n, n_owned = 80, 30
    x, system, mask = rows(n)
    open_cell, no_pbc = jnp.eye(3)[None], jnp.zeros((1, 3), bool)
    capacity = neighbor_capacity(x, open_cell, no_pbc, system, mask, cutoff=3.0, half=half, n_receivers=n_owned,
                                 headroom=1.5)
    nl = local_neighbor_list(x, system, mask, n_systems=1, cutoff=3.0, capacity=capacity, half=half,
                             n_receivers=n_owned, backend=backend)
    real = np.asarray(nl.mask)
    receivers = np.asarray(nl.receivers)
    assert real.sum() > 0
    assert receivers[real].max() < n_owned
    assert (receivers[~real] == n).all()


def test_a_periodic_rank_list_receives_only_on_its_first_rows():
    n, n_owned = 80, 30
    x, system, mask = rows(n)
    cell, pbc = jnp.eye(3)[None] * 9.0, jnp.array([[True, True, False]])
    capacity = neighbor_capacity(x, cell, pbc, system, mask, cutoff=3.0, n_receivers=n_owned, headroom=1.5)
    nl = build_neighbor_list(x, cell, pbc, system, mask, cutoff=3.0, capacity=capacity, n_receivers=n_owned)
    real = np.asarray(nl.mask)
    assert np.asarray(nl.receivers)[real].max() < n_owned
    assert (np.asarray(nl.receivers)[~real] == n).all()


# ----------------------------------------------------------------------------- distributed


class ReceiverSums(eqx.Module, BaseModel):
    """Two message passes summed onto receivers; ``via_senders`` routes the receivers through a
    select against the senders that never picks them (same values, meaning lost)."""

    via_senders: bool = eqx.field(static=True)
    model_config: ModelConfig = eqx.field(static=True, default=ModelConfig(
        outputs=frozenset({"energy", "forces"}), autograd_outputs=frozenset({"forces"}),
        autograd_inputs=frozenset({"positions"}), neighbor_config=NeighborConfig(cutoff=CUTOFF)))

    def adapt_input(self, data, **kwargs):
        return {"data": data}

    def forward(self, data):
        nl = data.neighbors
        receivers = jnp.where(nl.receivers >= 0, nl.receivers, nl.senders) if self.via_senders else nl.receivers
        atomic = density_energies(data.positions, nl.senders, receivers, nl.shifts @ data.cell[0], nl.mask, CUTOFF)
        return {"energy": per_system_sum(atomic, data.batch_idx, data.n_systems)}


def bulk() -> AtomicData:
    """A jittered fcc crystal of 108 atoms."""
    atoms = fcc_lattice(3, 4.1)
    jitter = np.random.default_rng(5).normal(0, 0.08, atoms.positions.shape)
    return AtomicData(atoms.positions + jitter, np.full(len(atoms), 6), np.asarray(atoms.cell), True)


def exchanges(dm, data) -> int:
    """Collective permutes in the compiled program of energy and forces."""
    hlo = dm.lower(data, ("energy", "forces")).as_text()
    return hlo.count("collective_permute") + hlo.count("collective-permute")


def run(via_senders, grid=(2, 2, 1)):
    model, data = ReceiverSums(via_senders), bulk()
    dm = DistributedModel(model, DomainConfig(cutoff=CUTOFF, mesh=default_mesh(jax.devices()[:4]), grid=grid))
    return dm, data, dm(data, ("energy", "forces")), jaxdd.compute(model, data, ("energy", "forces"))


def assert_same(got, want):
    assert abs(float(got["energy"][0]) - float(want["energy"][0])) <= 1e-10 * abs(float(want["energy"][0]))
    np.testing.assert_allclose(np.asarray(got["forces"]), np.asarray(want["forces"]), rtol=0, atol=1e-9)


def test_sums_onto_receivers_copy_owners_totals_only():
    dm, _, got, want = run(via_senders=False)
    assert_same(got, want)
    assert dm.dispatch_report.counts["scatter_add.owned_rows"] == 2
    assert "scatter_add.halo_correction" not in dm.dispatch_report.counts


def test_sums_onto_indices_that_lost_the_meaning_send_ghost_partials_home():
    dm, _, got, want = run(via_senders=True)
    assert_same(got, want)
    assert dm.dispatch_report.counts["scatter_add.halo_correction"] == 2


def test_sums_onto_receivers_make_fewer_exchanges():
    owned, data, _, _ = run(via_senders=False)
    corrected, _, _, _ = run(via_senders=True)
    assert 0 < exchanges(owned, data) < exchanges(corrected, data)
