"""Graph readouts as jraph and the codes built on it write them run distributed unchanged.

Each model builds the graph of every node row its own way — jraph's ``jnp.repeat`` over node
counts from ``ptr``, from ``bincount(batch_idx)``, with a padding graph, by cumulative sums of
the counts, or fixed by shapes as jax-md does — and sums atomic
energies per graph with ``segment_sum``. On two systems of different sizes, distributed on
(2, 2, 2) and (3, 2, 1), each equals one device with no fallback.
"""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxdd
from jaxdd import BaseModel, ModelConfig, NeighborConfig, edge_vectors
from jaxdd.engine import DistributedModel, DomainConfig

CUTOFF = 2.2


def _counts_from_ptr(data):
    return jnp.diff(data.ptr)


def repeat_over_ptr_counts(data, n):
    """jraph: ``jnp.repeat(arange(n_graph), n_node, total_repeat_length=sum_n_node)``."""
    n_node = _counts_from_ptr(data)
    return jnp.repeat(jnp.arange(n_node.shape[0]), n_node, total_repeat_length=n), n_node.shape[0]


def repeat_with_a_padding_graph(data, n):
    """``jraph.pad_with_graphs``: the padding rows form one more graph after the real ones."""
    counts = jnp.bincount(data.batch_idx, length=data.n_systems)
    n_node = jnp.concatenate([counts, jnp.array([n]) - jnp.sum(counts, keepdims=True)])
    return jnp.repeat(jnp.arange(n_node.shape[0]), n_node, total_repeat_length=n), n_node.shape[0]


def cumsum_offsets(data, n):
    """By hand: a one at each graph's first node (cumsum offsets of n_node), summed up."""
    n_node = _counts_from_ptr(data)
    offsets = jnp.cumsum(n_node) - n_node
    starts = jnp.zeros(n, jnp.int32).at[offsets[1:]].add(1)
    return jnp.cumsum(starts), n_node.shape[0]


PATTERNS = {f.__name__: f for f in (repeat_over_ptr_counts, repeat_with_a_padding_graph, cumsum_offsets)}


class GraphReadout(BaseModel):
    """Two rounds of messages, then atomic energies summed per graph with the model's own graph index."""

    def __init__(self, pattern):
        self.pattern = pattern
        self.w = jnp.linspace(0.3, 1.1, 6)
        self.model_config = ModelConfig(outputs={"energy", "forces"}, autograd_outputs={"forces"},
                                        autograd_inputs={"positions"}, neighbor_config=NeighborConfig(CUTOFF))

    def adapt_input(self, data):
        return dict(data=data)

    def forward(self, data):
        nl, n = data.neighbors, data.positions.shape[0]
        vec = edge_vectors(data.positions, data.cell, data.batch_idx, nl)
        r2 = jnp.where(nl.mask, jnp.sum(vec * vec, -1), 1.0)
        env = jnp.where(nl.mask & (r2 < CUTOFF**2), (1 - r2 / CUTOFF**2) ** 2, 0.0)
        h = jnp.ones((n, 6)) * self.w
        for _ in range(2):
            h = h + jax.ops.segment_sum(jnp.tanh(h[nl.senders]) * env[:, None], nl.receivers, n)
        atomic = jnp.where(data.atom_mask, jnp.sum(jnp.tanh(h), -1), 0.0)
        graph, n_graph = PATTERNS[self.pattern](data, n)
        per_graph = jax.ops.segment_sum(atomic, graph, n_graph)  # jraph.segment_sum is this
        return {"energy": per_graph[: data.n_systems]}


def two_systems():
    rng = np.random.default_rng(4)
    out = []
    for n, a in ((6, 1.5), (5, 1.45)):
        k = np.stack(np.meshgrid(*[np.arange(n)] * 3, indexing="ij"), -1).reshape(-1, 3)
        out.append(jaxdd.AtomicData(positions=(k + rng.uniform(-0.15, 0.15, k.shape)) * a,
                                    atomic_numbers=np.ones(len(k), int), cell=np.eye(3) * n * a, pbc=[True] * 3))
    return jaxdd.Batch.from_data_list(out)


def one_graph_fixed_by_shapes(data, n):
    """A single-system jraph model: ``n_node = [n]`` from the shapes, one graph of every row."""
    return jnp.repeat(jnp.arange(1), jnp.array([n]), total_repeat_length=n), 1


PATTERNS[one_graph_fixed_by_shapes.__name__] = one_graph_fixed_by_shapes


def assert_distributed_equals_one_device(model, data, grid):
    ref = jaxdd.compute(model, data)
    dm = DistributedModel(model, DomainConfig(cutoff=CUTOFF, grid=grid))
    with warnings.catch_warnings():
        warnings.simplefilter("error", jaxdd.DispatchWarning)
        got = dm(data)
    np.testing.assert_allclose(np.asarray(got["energy"]), np.asarray(ref["energy"]), rtol=1e-10, atol=0)
    np.testing.assert_allclose(np.asarray(got["forces"]), np.asarray(ref["forces"]), rtol=0, atol=1e-9)
    assert not dm.dispatch_report.fallbacks
    return dm.dispatch_report


@pytest.mark.parametrize("grid", [pytest.param((2, 2, 2), marks=pytest.mark.slow), (3, 2, 1)], ids=["2x2x2", "3x2x1"])
# The padding-graph pattern on one system runs in the default suite as the idiom
# dummy_graph_padding (tests/dispatch/test_dispatch_idioms.py); here, on two systems, it is slow.
@pytest.mark.parametrize("pattern", ["repeat_over_ptr_counts",
                                     pytest.param("repeat_with_a_padding_graph", marks=pytest.mark.slow),
                                     pytest.param("cumsum_offsets", marks=pytest.mark.slow)])
def test_a_graph_readout_runs_distributed_unchanged(pattern, grid):
    report = assert_distributed_equals_one_device(GraphReadout(pattern), two_systems(), grid)
    assert report.counts["graph_index.local"] >= 1


@pytest.mark.slow
def test_a_single_system_readout_fixed_by_shapes_runs_distributed_unchanged():
    data = jaxdd.as_batch(two_systems().to_data_list()[0])
    assert_distributed_equals_one_device(GraphReadout("one_graph_fixed_by_shapes"), data, (2, 2, 1))
