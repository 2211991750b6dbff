"""Specification by corpus: the index idioms of real MLIP code, each in a small model, under
decomposition either equal one device or are refused naming the user's line — never wrong.

Every model is one small message-passing energy (``IdiomModel``) with one idiom from
``IDIOMS`` inserted after its first layer: the idiom reads the layer's node features, the
neighbour list, the masks and the species, and returns either one value per atom row (which
then scales the node features read by the final layer through the senders, so a wrong ghost
row shows in the energy) or a scalar added to the energy. Idioms of angle models (bonds,
triplets, reverse bonds: M3GNet, DimeNet) are registered with ``bonds=True``; their model reads a
MATRIX list that carries bonds within ``BOND_CUTOFF``. Each model runs through
``DistributedModel`` on (3, 2, 1) (uneven: real ghosts on three ranks along x) and, in the slow
set, (2, 1, 1), and is compared with ``jaxdd.compute`` in float64. The outcome is

- ``equal``: energy within 1e-10 relative, forces within 1e-9 absolute;
- ``refused``: a ``jaxdd.DispatchError`` whose message names this file's line;
- ``wrong``: it ran and the numbers differ — always a failure, as is an unnamed refusal or
  any other exception.

``EXPECTED`` says which outcome a sound dispatch gives for each idiom: ``equal`` where the
single-device meaning is local to a rank's rows and edges, ``refused`` where it depends on a
global row order or a global selection that the ranks do not have. A refusal where ``equal``
is expected is reported as an expected failure (the dispatch is not there yet); entries not
met by the current dispatch carry a ``# today: ...`` comment.

The outcome table is printed by the last test of the module (``pytest -s`` or ``-rA``), or
standalone: ``python tests/dispatch/test_dispatch_idioms.py [idiom | idiom+idiom ...] [--grid 2,1,1 | --all-grids] [-v]``
(-v prints each refusal whole).
"""

from __future__ import annotations

if __name__ == "__main__":  # standalone: 8 virtual CPU devices and float64, as under pytest
    import conftest  # noqa: F401

import dataclasses
import functools
import re
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxdd
from jaxdd import BaseModel, ModelConfig, NeighborConfig, edge_vectors
from jaxdd.data import as_batch
from jaxdd.engine import DistributedModel, DomainConfig
from jaxdd.neighbors import (NeighborListFormat, bond_partners, bond_vectors, build_neighbor_list, neighbor_capacity,
                             reverse_bonds, triplet_cosines, triplet_mask)

CUTOFF = 2.2
BOND_CUTOFF = 1.9  # about five of the six nearest neighbours of the jittered lattice
F = 4  # node feature width
DUMMY = int(jnp.iinfo(jnp.int32).max)  # e3j's out-of-range index
GRIDS = {"3x2x1": (3, 2, 1), "2x1x1": (2, 1, 1)}
E_RTOL, F_ATOL = 1e-10, 1e-9

# A cell three cutoffs wide: every rank's ghost shell holds every atom on (2, 1, 1) (jaxdd
# warns that decomposition gains nothing there), and real ghosts on (3, 2, 1).
pytestmark = pytest.mark.filterwarnings("ignore:the ghost shell of some ranks covers every atom:RuntimeWarning")


def system(n=4, spacing=1.65, seed=0) -> jaxdd.AtomicData:
    """n³ atoms (H and O) on a jittered simple-cubic lattice in a periodic cube of n·spacing Å."""
    rng = np.random.default_rng(seed)
    k = np.stack(np.meshgrid(*[np.arange(n)] * 3, indexing="ij"), -1).reshape(-1, 3)
    return jaxdd.AtomicData(positions=(k + 0.5 + rng.uniform(-0.15, 0.15, k.shape)) * spacing,
                            atomic_numbers=np.array([1, 8])[rng.integers(0, 2, len(k))],
                            cell=np.eye(3) * n * spacing, pbc=np.array([True] * 3))


# ----------------------------------------------------------------------------- the base model


@dataclasses.dataclass
class Ctx:
    """What an idiom sees: the rank's (or the device's) rows and edges after one layer."""

    data: object
    n: int  # node rows
    E: int  # edge slots
    snd: jax.Array
    rcv: jax.Array
    emask: jax.Array  # real edges
    amask: jax.Array  # real atoms
    vec: jax.Array  # [E, 3]
    r: jax.Array  # [E], 1 on padding edges
    env: jax.Array  # [E], 0 on padding edges and beyond the cutoff
    Z: jax.Array  # atomic numbers
    sp: jax.Array  # species 0 (H) / 1 (O)
    h: jax.Array  # [n, F] node features
    p: dict  # parameters
    nl: object = None  # the neighbour list (a MATRIX list with bonds for the idioms of BONDS)

    def msg(self, h=None, snd=None, env=None):
        """Messages tanh(h[senders]) · envelope, [E, F]."""
        h = self.h if h is None else h
        return jnp.tanh(h[self.snd if snd is None else snd]) * (self.env if env is None else env)[:, None]

    def node_out(self, h):
        """A per-node output of features [n, F]."""
        return jnp.sum(jnp.tanh(h), -1)


def params():
    k = jax.random.split(jax.random.PRNGKey(7), 8)
    return {"embed": 0.5 + 0.5 * jax.random.uniform(k[0], (2, F)), "table": 0.3 * jax.random.normal(k[1], (9, F)),
            "pair": 1.0 + 0.2 * jax.random.normal(k[2], (2, 2)), "w": jnp.linspace(0.3, 1.1, F),
            "mix": 0.4 * jax.random.normal(k[3], (F, F)), "wig": 0.3 * jax.random.normal(k[4], (9,)),
            "mu": jnp.array([-0.3, 0.7])}


class IdiomModel(BaseModel):
    """One layer of messages, the idioms in order, then a readout through one more layer."""

    def __init__(self, *idioms):
        self.idioms = idioms
        self.p = params()
        self.model_config = ModelConfig(outputs={"energy", "forces"}, autograd_outputs={"forces"},
                                        autograd_inputs={"positions"}, neighbor_config=neighbor_config(idioms))

    def adapt_input(self, data):
        return dict(data=data)

    def forward(self, data):
        nl, n, p = data.neighbors, data.positions.shape[0], self.p
        vec = edge_vectors(data.positions, data.cell, data.batch_idx, nl)
        r2 = jnp.where(nl.mask, jnp.sum(vec * vec, -1), 1.0)
        env = jnp.where(nl.mask & (r2 < CUTOFF**2), (1 - r2 / CUTOFF**2) ** 2, 0.0)
        sp = (data.atomic_numbers == 8).astype(jnp.int32)
        h = p["embed"][sp]
        h = h + jax.ops.segment_sum(jnp.tanh(h[nl.senders]) * env[:, None], nl.receivers, n)
        c = Ctx(data, n, nl.senders.shape[0], nl.senders, nl.receivers, nl.mask, data.atom_mask, vec, jnp.sqrt(r2),
                env, data.atomic_numbers, sp, h, p, nl)
        extra = 0.0
        for name in self.idioms:
            out = IDIOMS[name](c)
            if out.ndim == 1:  # per node: scales the features the next layer reads through the senders
                c = dataclasses.replace(c, h=c.h * (1.0 + 0.3 * jnp.tanh(out))[:, None])
            else:
                extra = extra + out
        h = c.h + jax.ops.segment_sum(jnp.tanh(c.h[nl.senders] @ p["mix"]) * env[:, None], nl.receivers, n)
        atomic = jnp.where(data.atom_mask, jnp.sum(jnp.tanh(h) * p["w"], -1), 0.0)
        energy = jax.ops.segment_sum(atomic, data.batch_idx, data.n_systems)
        return {"energy": energy + extra}


# ----------------------------------------------------------------------------- the idioms
# Each takes a Ctx and returns [n] (per node) or [] (an energy term). Registered in order.

IDIOMS: dict = {}
EXPECTED: dict = {}
BONDS: set = set()  # idioms that read bonds: their model asks for a MATRIX list with bonds


def idiom(expected, bonds=False):
    def register(fn):
        IDIOMS[fn.__name__] = fn
        EXPECTED[fn.__name__] = expected
        if bonds:
            BONDS.add(fn.__name__)
        return fn
    return register


def neighbor_config(idioms) -> NeighborConfig:
    """The list a model of ``idioms`` reads: COO, or a MATRIX list with bonds when one reads bonds."""
    if BONDS.intersection(idioms):
        return NeighborConfig(CUTOFF, format=NeighborListFormat.MATRIX, bond_cutoff=BOND_CUTOFF)
    return NeighborConfig(CUTOFF)


def _pass(c, m, rcv=None, **kw):
    """Node features after one more sum of the edge messages ``m`` [E, F] onto ``rcv``."""
    return c.node_out(c.h + jax.ops.segment_sum(m, c.rcv if rcv is None else rcv, c.n, **kw))


# --- masks


@idiom("equal")
def mask_where_atomic(c):
    return jnp.where(c.amask, jnp.sum(jnp.sin(c.h), -1), 0.0)


@idiom("equal")
def mask_float_weights(c):
    return c.amask.astype(c.h.dtype) * jnp.sum(c.h**2, -1)


@idiom("equal")
def edge_mask_from_node_mask(c):
    keep = c.amask[c.snd] & c.amask[c.rcv]
    return _pass(c, jnp.where(keep[:, None], c.msg(), 0.0))


@idiom("equal")
def edge_mask_and_list_mask(c):
    keep = c.emask & c.amask[c.rcv] & (c.r < 0.9 * CUTOFF)
    return _pass(c, jnp.where(keep[:, None], c.msg(), 0.0))


# --- counts of real atoms meeting row numbers


@idiom("equal")
def count_nonzero_mask_edges(c):
    """e3j's ``GraphCSR.mask_edges``: n = count_nonzero(node_mask); out-of-range edges to DUMMY."""
    n_real = jnp.count_nonzero(c.amask)
    keep = (c.snd < n_real) & (c.rcv < n_real)
    snd, rcv = jnp.where(keep, c.snd, DUMMY), jnp.where(keep, c.rcv, DUMMY)
    return _pass(c, c.msg(snd=snd), rcv)


@idiom("equal")
def sum_mask_mask_edges(c):
    n_real = jnp.sum(c.amask)
    keep = (c.snd < n_real) & (c.rcv < n_real)
    snd, rcv = jnp.where(keep, c.snd, DUMMY), jnp.where(keep, c.rcv, DUMMY)
    return _pass(c, jnp.tanh(c.h.at[snd].get(mode="fill", fill_value=0.0)) * c.env[:, None], rcv)


@idiom("equal")
def count_int_sum_receivers_only(c):
    n_real = jnp.sum(c.amask.astype(jnp.int32))
    return _pass(c, c.msg(), jnp.where(c.rcv < n_real, c.rcv, c.n))


@idiom("equal")
def arange_below_count_node_mask(c):
    node_mask = jnp.arange(c.n) < jnp.count_nonzero(c.amask)
    return jnp.where(node_mask, jnp.sum(jnp.cos(c.h), -1), 0.0)


@idiom("equal")
def arange_below_count_edge_mask(c):
    node_mask = jnp.arange(c.n) < jnp.count_nonzero(c.amask)
    keep = node_mask[c.snd] & node_mask[c.rcv]
    return _pass(c, jnp.where(keep[:, None], c.msg(), 0.0))


@idiom("refused")
def arange_below_edge_count(c):
    """jraph-style edge padding: the first count_nonzero(edge mask) edge slots are real."""
    keep = jnp.arange(c.E) < jnp.count_nonzero(c.emask)
    return _pass(c, jnp.where(keep[:, None], c.msg(), 0.0))


# --- means, counts and maxima over atoms and edges


@idiom("equal")
def mean_over_atoms(c):
    x = jnp.sum(jnp.tanh(c.h), -1)
    mean = jnp.sum(jnp.where(c.amask, x, 0.0)) / jnp.count_nonzero(c.amask)
    return (x - mean) ** 2


@idiom("refused")
def jnp_mean_over_rows(c):
    """``jnp.mean`` divides by the row count of the array, a static shape: the local rows differ."""
    return jnp.mean(jnp.sum(c.h**2, -1)) * jnp.ones(c.n)


@idiom("equal")
def average_neighbours_normaliser(c):
    avg = jnp.count_nonzero(c.emask & (c.env > 0)) / jnp.count_nonzero(c.amask)
    return c.node_out(c.h + jax.ops.segment_sum(c.msg(), c.rcv, c.n) / avg)


@idiom("equal")
def energy_per_atom(c):
    x = jnp.where(c.amask, jnp.sum(c.h**2, -1), 0.0)
    return jnp.sum(x) / jnp.sum(c.amask)


@idiom("equal")
def max_over_atoms_normaliser(c):
    x = jnp.sum(jnp.tanh(c.h), -1)
    return x / jnp.max(jnp.where(c.amask, jnp.abs(x), 0.0))


@idiom("equal")
def max_over_edges_normaliser(c):
    rmax = jnp.max(jnp.where(c.emask, c.r, 0.0))
    return _pass(c, c.msg() * (c.r / rmax)[:, None])


@idiom("refused")
def argmax_atom_readout(c):
    x = jnp.sum(c.h, -1)
    return x[jnp.argmax(jnp.where(c.amask, x, -jnp.inf))]


# --- cumulative sums and searchsorted


def _sorted_by_receiver(c):
    perm = jnp.argsort(c.rcv)
    return perm, c.snd[perm], c.rcv[perm], c.env[perm]


@idiom("refused")
def cumsum_csr_segment_sum(c):
    """Per-node sums of receiver-sorted edges as differences of a cumulative sum at CSR offsets."""
    _, snd, rcv, env = _sorted_by_receiver(c)
    deg = jax.ops.segment_sum(jnp.ones_like(rcv), rcv, c.n)
    offsets = jnp.cumsum(deg) - deg
    cs = jnp.concatenate([jnp.zeros((1, F)), jnp.cumsum(c.msg(snd=snd, env=env), axis=0)])
    return c.node_out(c.h + cs[offsets + deg] - cs[offsets])


@idiom("equal")
def cumsum_graph_starts(c):
    """Graph index by hand: a one at each graph's first row (cumsum offsets of n_node), summed up."""
    n_node = jnp.diff(c.data.ptr)
    offsets = jnp.cumsum(n_node) - n_node
    graph = jnp.cumsum(jnp.zeros(c.n, jnp.int32).at[offsets[1:]].add(1))
    atomic = jnp.where(c.amask, jnp.sum(c.h**2, -1), 0.0)
    return jax.ops.segment_sum(atomic, graph, n_node.shape[0])[0]


@idiom("refused")
def searchsorted_graph_index(c):
    """Each row's graph from the pointer array: searchsorted(ptr[1:], row, 'right')."""
    graph = jnp.searchsorted(c.data.ptr[1:], jnp.arange(c.n), side="right")
    atomic = jnp.where(c.amask, jnp.sum(c.h**2, -1), 0.0)
    return jax.ops.segment_sum(atomic, graph, c.data.ptr.shape[0])[0]


@idiom("equal")  # today: refused (arange(n) taken as node rows by shape; searchsorted's gather not followed)
def searchsorted_csr_degree(c):
    """Degree of every node from receiver-sorted edges: searchsorted right - left."""
    rs = jnp.sort(jnp.where(c.env > 0, c.rcv, c.n))
    rows = jnp.arange(c.n)
    deg = jnp.searchsorted(rs, rows, side="right") - jnp.searchsorted(rs, rows, side="left")
    return c.node_out(c.h) * jnp.log1p(deg.astype(c.h.dtype))


# --- sorting edges (mlip's Graph.sort_edges) and permutations


@idiom("equal")
def argsort_edges_by_receiver(c):
    perm, snd, rcv, env = _sorted_by_receiver(c)
    return _pass(c, c.msg(snd=snd, env=env), rcv)


@idiom("equal")
def argsort_edges_by_sender(c):
    perm = jnp.argsort(c.snd)
    snd, rcv, env, vec = c.snd[perm], c.rcv[perm], c.env[perm], c.vec[perm]
    return _pass(c, c.msg(snd=snd, env=env) * (1 + 0.1 * jnp.tanh(vec[:, :1])), rcv)


@idiom("equal")
def sorted_segment_sum_indices_are_sorted(c):
    perm, snd, rcv, env = _sorted_by_receiver(c)
    return _pass(c, c.msg(snd=snd, env=env), rcv, indices_are_sorted=True)


@idiom("equal")
def lax_sort_multi_operand(c):
    rcv, snd, env = jax.lax.sort((c.rcv, c.snd, c.env), num_keys=1)
    return _pass(c, c.msg(snd=snd, env=env), rcv)


@idiom("equal")
def lexsort_edges(c):
    perm = jnp.lexsort((c.snd, c.rcv))
    return _pass(c, c.msg(snd=c.snd[perm], env=c.env[perm]), c.rcv[perm])


@idiom("equal")
def inverse_permutation(c):
    perm = jnp.argsort(c.rcv, stable=True)
    inv = jnp.argsort(perm)
    m_sorted = c.msg(snd=c.snd[perm], env=c.env[perm])
    return _pass(c, m_sorted[inv])


@idiom("equal")  # today: refused (jnp.nonzero's count over every rank meets edge numbers)
def nonzero_compacts_edges(c):
    """Real edges first, by ``jnp.nonzero(edge_mask, size=n_edges)``."""
    (idx,) = jnp.nonzero(c.emask & (c.env > 0), size=c.E, fill_value=c.E)
    snd, rcv = c.snd.at[idx].get(mode="fill", fill_value=c.n), c.rcv.at[idx].get(mode="fill", fill_value=c.n)
    env = c.env.at[idx].get(mode="fill", fill_value=0.0)
    return _pass(c, c.msg(snd=snd, env=env), rcv)


@idiom("refused")
def sort_atoms_by_species_and_back(c):
    perm = jnp.argsort(c.sp, stable=True)
    out_sorted = jnp.sum(jnp.tanh(c.h[perm] * 1.3), -1)
    return out_sorted[jnp.argsort(perm)]


@idiom("refused")
def unique_species_static_size(c):
    """Species ids found at run time: jnp.unique(Z, size=2) (pad rows' Z = 0 join in on a rank)."""
    found = jnp.unique(c.Z, size=2, fill_value=0)
    return c.p["table"][jnp.searchsorted(found, c.Z), 0] * jnp.sum(c.h, -1)


# --- segment max / min / softmax


@idiom("equal")
def segment_max_receivers(c):
    v = jnp.where((c.env > 0)[:, None], c.msg(), -jnp.inf)
    mx = jax.ops.segment_max(v, c.rcv, c.n)
    return c.node_out(c.h + jnp.where(jnp.isfinite(mx), mx, 0.0))


@idiom("equal")
def segment_min_receivers(c):
    rmin = jax.ops.segment_min(jnp.where(c.env > 0, c.r, jnp.inf), c.rcv, c.n)
    return jnp.where(jnp.isfinite(rmin), jnp.exp(-rmin), 0.0) * jnp.sum(c.h, -1)


@idiom("equal")
def segment_max_senders(c):
    """A max scattered onto senders: a ghost sender's partial max belongs to its owner."""
    mx = jax.ops.segment_max(jnp.where(c.env > 0, c.env * c.sp[c.rcv], -jnp.inf), c.snd, c.n)
    return jnp.where(jnp.isfinite(mx), mx, 0.0) + 0.1 * jnp.sum(c.h, -1)


@idiom("equal")
def segment_softmax_receivers(c):
    logits = jnp.where(c.env > 0, jnp.sum(c.h[c.snd] * c.h[c.rcv], -1), -jnp.inf)
    mx = jax.ops.segment_max(logits, c.rcv, c.n)
    ex = jnp.where(c.env > 0, jnp.exp(logits - mx[c.rcv]), 0.0)
    den = jax.ops.segment_sum(ex, c.rcv, c.n)
    a = ex / jnp.where(den[c.rcv] > 0, den[c.rcv], 1.0)
    return _pass(c, c.msg() * a[:, None])


# --- top_k


@idiom("equal")
def top_k_along_rows(c):
    vals, idx = jax.lax.top_k(jnp.concatenate([c.h, c.h @ c.p["mix"]], -1), 3)
    return jnp.sum(vals, -1) + 0.01 * jnp.sum(idx, -1)


@idiom("refused")
def top_k_over_edges(c):
    vals, _ = jax.lax.top_k(c.env * jnp.sum(c.h[c.snd], -1), 4)
    return jnp.sum(vals)


@idiom("refused")
def top_k_over_atoms(c):
    vals, _ = jax.lax.top_k(jnp.where(c.amask, jnp.sum(c.h**2, -1), -jnp.inf), 3)
    return jnp.sum(vals)


# --- species tables


@idiom("equal")
def one_hot_species_matmul(c):
    return jnp.sum(jax.nn.one_hot(c.sp, 2) @ c.p["mix"][:2] * c.h, -1)


@idiom("equal")
def one_hot_atomic_number_matmul(c):
    return jnp.sum(jax.nn.one_hot(c.Z, 9) @ c.p["table"] * c.h, -1)


@idiom("equal")
def table_of_atomic_number(c):
    return jnp.sum(c.p["table"][c.Z] * jnp.tanh(c.h), -1)


@idiom("equal")
def species_pair_table(c):
    pair = c.p["pair"][c.sp[c.snd], c.sp[c.rcv]]
    return _pass(c, c.msg() * pair[:, None])


@idiom("equal")
def scatter_receivers_by_neighbour_species(c):
    """Per node and neighbour species: ``zeros((n, 2)).at[receivers, species[senders]].add(env)``."""
    rho = jnp.zeros((c.n, 2)).at[c.rcv, c.sp[c.snd]].add(c.env)
    return jnp.sum(rho * c.p["mu"], -1) + jnp.sum(c.h, -1)


@idiom("equal")
def scatter_senders_by_neighbour_species(c):
    rho = jnp.zeros((c.n, 2)).at[c.snd, c.sp[c.rcv]].add(c.env)
    return jnp.sum(rho * c.p["mu"], -1) + jnp.sum(c.h, -1)


# --- repeat over counts (jraph graph index) and padding graphs


@idiom("equal")  # today: refused (the count as a position in the repeat's scatter)
def repeat_one_graph_of_real_atoms(c):
    n_node = jnp.count_nonzero(c.amask)[None]
    graph = jnp.repeat(jnp.arange(1), n_node, total_repeat_length=c.n)
    return jax.ops.segment_sum(jnp.where(c.amask, jnp.sum(c.h**2, -1), 0.0), graph, 1)[0]


@idiom("equal")
def dummy_graph_padding(c):
    """mlip: n_node = [count_nonzero(mask), n - count]; the padding rows form a dummy graph."""
    count = jnp.count_nonzero(c.amask)
    n_node = jnp.stack([count, c.n - count])
    graph = jnp.repeat(jnp.arange(2), n_node, total_repeat_length=c.n)
    return jax.ops.segment_sum(jnp.sum(c.h**2, -1), graph, 2)[0]


@idiom("equal")  # today: refused (jnp.repeat's iota/slice/gather over per-node counts not followed)
def repeat_csr_to_receivers(c):
    """Receivers rebuilt from degrees: repeat(arange(n), deg) over receiver-sorted edges."""
    perm, snd, rcv, env = _sorted_by_receiver(c)
    deg = jax.ops.segment_sum(jnp.ones_like(rcv), rcv, c.n)
    rebuilt = jnp.repeat(jnp.arange(c.n), deg, total_repeat_length=c.E)  # padding slots: the last row, env 0
    return _pass(c, c.msg(snd=snd, env=env), rebuilt)


# --- sentinels past the rows


@idiom("equal")
def sentinel_int32_max_dropped(c):
    rcv = jnp.where(c.emask & (c.r < 0.95 * CUTOFF), c.rcv, DUMMY)
    return _pass(c, c.msg(), rcv)


@idiom("equal")
def sentinel_gather_fill(c):
    snd = jnp.where(c.emask, c.snd, DUMMY)
    h_s = c.h.at[snd].get(mode="fill", fill_value=0.0)
    return _pass(c, jnp.tanh(h_s) * c.env[:, None])


@idiom("equal")
def sentinel_row_count(c):
    rcv = jnp.where(c.env > 0, c.rcv, c.n)
    return _pass(c, c.msg(), rcv)


@idiom("equal")
def clipped_indices(c):
    snd, rcv = jnp.clip(c.snd, 0, c.n - 1), jnp.clip(c.rcv, 0, c.n - 1)
    return _pass(c, c.msg(snd=snd), jnp.where(c.emask, rcv, c.n))


# --- dynamic slices by counts


@idiom("refused")
def dynamic_slice_from_ptr(c):
    """A system's rows from its pointer: ptr holds global row numbers, which a rank does not have."""
    atomic = jnp.where(c.amask, jnp.sum(c.h**2, -1), 0.0)
    block = jax.lax.dynamic_slice(jnp.concatenate([atomic, jnp.zeros(c.n)]), (c.data.ptr[0],), (c.n,))
    return jnp.sum(jnp.where(jnp.arange(c.n) < jnp.count_nonzero(c.amask), block, 0.0))


@idiom("equal")
def dynamic_slice_columns_by_count(c):
    """A dynamic slice across the feature axis, its start from a count over every rank's atoms."""
    k = jnp.count_nonzero(c.amask) % 2
    return jnp.sum(jax.lax.dynamic_slice(c.h, (0, k), (c.n, 2)) ** 2, -1)


@idiom("refused")
def dynamic_slice_last_real_atoms(c):
    x = jnp.sum(c.h**2, -1)
    return jnp.sum(jax.lax.dynamic_slice(x, (jnp.count_nonzero(c.amask) - 3,), (3,)))


# --- per-edge matrices filled at constant index columns (mlip eSEN's Wigner matrices)


def _rotation(c):
    """A per-edge 3×3 block from the unit edge vector."""
    u = c.vec / c.r[:, None]
    return jnp.eye(3) - u[:, :, None] * u[:, None, :] + 0.1 * u[:, None, :]


@idiom("equal")
def wigner_blocks_at_constant_columns(c):
    d = jnp.zeros((c.E, 9, 9))
    d = d.at[:, 0, 0].set(1.0)
    d = d.at[:, 1:4, 1:4].set(_rotation(c))
    d = d.at[:, 4:9, 4:9].set(jnp.eye(5) * c.r[:, None, None])
    f = jnp.concatenate([c.h[c.snd], c.h[c.snd], c.h[c.snd][:, :1]], -1)  # [E, 9]
    g = jnp.einsum("eij,ej->ei", d, f) * c.env[:, None]
    return c.node_out(c.h + jax.ops.segment_sum(g, c.rcv, c.n)[:, :F] @ c.p["mix"])


@idiom("equal")
def wigner_diagonal_add(c):
    i = jnp.arange(9)
    d = jnp.zeros((c.E, 9, 9)).at[:, i, i].add(c.r[:, None] * c.p["wig"])
    d = d.at[:, 0, 1:4].set(c.vec)
    f = jnp.concatenate([c.h[c.snd]] * 2 + [c.h[c.snd][:, :1]], -1)
    g = jnp.einsum("eij,ej->ei", d, f) * c.env[:, None]
    return c.node_out(c.h + jax.ops.segment_sum(g[:, :F], c.rcv, c.n))


# --- bincount, take_along_axis, degree normalisation, scatters onto senders


@idiom("equal")
def bincount_weighted_degree(c):
    deg = jnp.bincount(c.rcv, weights=c.env, length=c.n)
    return c.node_out(c.h) * deg


@idiom("equal")
def bincount_species_composition(c):
    comp = jnp.bincount(c.sp, weights=c.amask.astype(c.h.dtype), length=2)
    return jnp.sum(comp * c.p["mu"]) * jnp.sum(jnp.where(c.amask, c.h[:, 0], 0.0))


@idiom("equal")
def take_along_axis_features(c):
    idx = jnp.argsort(c.h @ c.p["mix"], axis=1)
    return jnp.sum(jnp.take_along_axis(c.h, idx, axis=1) * c.p["w"], -1)


@idiom("equal")
def take_along_axis_gathers_senders(c):
    h_s = jnp.take_along_axis(c.h, jnp.broadcast_to(c.snd[:, None], (c.E, F)), axis=0, mode="clip")
    return _pass(c, jnp.tanh(h_s) * c.env[:, None])


@idiom("equal")
def gcn_degree_normalisation(c):
    deg = jax.ops.segment_sum((c.env > 0).astype(c.h.dtype), c.rcv, c.n)
    norm = jax.lax.rsqrt(jnp.maximum(deg, 1.0))
    return _pass(c, c.msg() * (norm[c.snd] * norm[c.rcv])[:, None])


@idiom("equal")
def segment_sum_onto_senders(c):
    return _pass(c, jnp.tanh(c.h[c.rcv]) * c.env[:, None], c.snd)


@idiom("equal")
def stacked_edge_index(c):
    idx = jnp.stack([c.snd, c.rcv])
    snd, rcv = idx
    return _pass(c, c.msg(snd=snd), rcv)


@idiom("equal")
def iota_row_scatter(c):
    x = jnp.zeros(c.n).at[jnp.arange(c.n)].add(jnp.sum(c.h**2, -1))
    return x


# --- the MATRIX rows and the neighbour counts, read through atom indices


@idiom("equal", bonds=True)
def matrix_message_rounds(c):
    """Two rounds of messages over the MATRIX rows: the second reads, through the matrix, rows
    the first made from this rank's neighbour rows (a ghost has none here)."""
    m = c.nl.matrix
    filled = m < c.n
    shift = jnp.einsum("vki,vij->vkj", c.nl.matrix_shifts.astype(c.h.dtype), c.data.cell[c.data.batch_idx])
    v = c.data.positions.at[m].get(mode="fill", fill_value=0.0) - c.data.positions[:, None] + shift
    r2 = jnp.where(filled, jnp.sum(v * v, -1), 1.0)
    env = jnp.where(filled & (r2 < CUTOFF**2), (1 - r2 / CUTOFF**2) ** 2, 0.0)
    h = c.h
    for _ in range(2):
        h = h + jnp.sum(jnp.tanh(h.at[m].get(mode="fill", fill_value=0.0)) * env[..., None], 1)
    return c.node_out(h)


@idiom("equal", bonds=True)
def matrix_message_rounds_in_scan(c):
    """The same rounds as a ``lax.scan`` over layers: the carry becomes stale in the first
    iteration, and the second reads it through the matrix."""
    m = c.nl.matrix
    filled = m < c.n
    shift = jnp.einsum("vki,vij->vkj", c.nl.matrix_shifts.astype(c.h.dtype), c.data.cell[c.data.batch_idx])
    v = c.data.positions.at[m].get(mode="fill", fill_value=0.0) - c.data.positions[:, None] + shift
    r2 = jnp.where(filled, jnp.sum(v * v, -1), 1.0)
    env = jnp.where(filled & (r2 < CUTOFF**2), (1 - r2 / CUTOFF**2) ** 2, 0.0)

    def layer(h, w):
        return h + jnp.sum(jnp.tanh(h.at[m].get(mode="fill", fill_value=0.0) * w) * env[..., None], 1), None

    h, _ = jax.lax.scan(layer, c.h, jnp.stack([c.p["w"], 1.0 - c.p["w"]]))
    return c.node_out(h)


@idiom("equal")
def degree_of_senders_from_num_neighbors(c):
    """The list's own neighbour counts read at the senders (a ghost's count is its owner's)."""
    deg = c.data.neighbors.num_neighbors.astype(c.h.dtype)
    return _pass(c, c.msg() / jnp.maximum(deg[c.snd], 1.0)[:, None])


# --- bonds, triplets and reverse bonds (angle models)


def _bonds(c):
    """(partner [n, B], bond vectors [n, B, 3], envelope [n, B]: zero beyond BOND_CUTOFF)."""
    partner = bond_partners(c.nl)
    vec = bond_vectors(c.data.positions, c.data.cell, c.data.batch_idx, c.nl)
    r2 = jnp.sum(vec * vec, -1)
    return partner, vec, jnp.where(c.nl.bonds.mask, (1 - r2 / BOND_CUTOFF**2) ** 2, 0.0)


@idiom("equal", bonds=True)
def m3gnet_three_body_bond_update(c):
    """M3GNet: bond features updated by a sum over the angles at their atom, then summed into it."""
    partner, vec, u = _bonds(c)
    bonds = c.nl.bonds
    e = u[..., None] * jnp.tanh(c.h.at[partner].get(mode="fill", fill_value=0.0) @ c.p["mix"])  # [n, B, F]
    angular = jnp.where(triplet_mask(bonds), (1 + triplet_cosines(vec, bonds)) ** 2 * u[:, None, :], 0.0)
    e = e + u[..., None] * jnp.tanh(jnp.einsum("vbc,vcf->vbf", angular, e))
    return c.node_out(c.h + jnp.sum(e, 1))


@idiom("equal", bonds=True)
def dimenet_directional_messages(c):
    """DimeNet: message j → i from the messages k → j arriving at j, weighted by the angle at j,
    read through the reverse bond (written out: ``x.at[partner, reverse].get``)."""
    partner, vec, u = _bonds(c)
    bonds = c.nl.bonds
    m = u[..., None] * jnp.tanh(c.h.at[partner].get(mode="fill", fill_value=0.0))  # on bond (j, c): k → j
    turn = jnp.where(triplet_mask(bonds), 1 + triplet_cosines(vec, bonds), 0.0)
    arriving = jnp.einsum("vbc,vcf->vbf", turn, m)  # at j, for each of its bonds
    m_ji = m + u[..., None] * jnp.tanh(arriving.at[partner, bonds.reverse].get(mode="fill", fill_value=0.0))
    return c.node_out(c.h + jnp.sum(u[..., None] * m_ji, 1))


@idiom("equal", bonds=True)
def bond_symmetrised_through_reverse(c):
    """CHGNet-style bond features averaged with their reverse (jaxdd.neighbors.reverse_bonds)."""
    partner, _, u = _bonds(c)
    e = u[..., None] * jnp.tanh(c.h.at[partner].get(mode="fill", fill_value=0.0) @ c.p["mix"] + c.h[:, None, :])
    e = 0.5 * (e + reverse_bonds(e, c.nl))
    return c.node_out(c.h + jnp.sum(e * c.p["w"], 1))


@idiom("equal", bonds=True)
def bond_values_scattered_onto_partners(c):
    """A per-bond value summed onto the bond's partner atom (a ghost's share goes home)."""
    partner, _, u = _bonds(c)
    onto = jnp.zeros(c.n).at[partner].add(u * jnp.sum(jnp.tanh(c.h), -1)[:, None])
    return onto + 0.1 * jnp.sum(c.h, -1)


@idiom("equal", bonds=True)
def angles_per_atom(c):
    """The number of angles of each atom as a feature."""
    count = jnp.sum(triplet_mask(c.nl.bonds), (1, 2)).astype(c.h.dtype)
    return 0.05 * count * jnp.sum(jnp.sin(c.h), -1)


# ----------------------------------------------------------------------------- running one model


_REFERENCE: dict = {}
RESULTS: dict = {}  # (idioms, grid) -> (outcome, detail, seconds)
MESSAGES: dict = {}  # (idioms, grid) -> the whole refusal
LINE = re.compile(r"test_dispatch_idioms\.py:(\d+)")


@functools.lru_cache(maxsize=None)
def one_device_batch(bonds: bool = False) -> jaxdd.Batch:
    """The system as one device sees it, with jaxdd's neighbour list for CUTOFF (a MATRIX list
    with bonds within BOND_CUTOFF when ``bonds``)."""
    b = as_batch(system())
    extra = dict(format=NeighborListFormat.MATRIX, bond_cutoff=BOND_CUTOFF) if bonds else {}
    capacity = neighbor_capacity(b.positions, b.cell, b.pbc, b.batch_idx, b.atom_mask, cutoff=CUTOFF,
                                 bond_cutoff=extra.get("bond_cutoff"))
    nl = build_neighbor_list(b.positions, b.cell, b.pbc, b.batch_idx, b.atom_mask, capacity=capacity, cutoff=CUTOFF,
                             **extra)
    assert not bool(nl.overflow)
    return b.replace(neighbors=nl)


def reference(idioms) -> tuple[np.ndarray, np.ndarray]:
    """(energy, forces) on one device: the model and its gradient on the one-device batch, one
    small jit (a fifth of ``jaxdd.compute``'s compile time, which builds the neighbour list in the
    program; the two agree to rounding: test_the_reference_is_jaxdd_compute)."""
    if idioms not in _REFERENCE:
        model, b = IdiomModel(*idioms), one_device_batch(bool(BONDS.intersection(idioms)))
        e, g = jax.jit(jax.value_and_grad(lambda pos: jnp.sum(model(b.replace(positions=pos))["energy"])))(b.positions)
        _REFERENCE[idioms] = (np.asarray(e)[None], -np.asarray(g))
    return _REFERENCE[idioms]


def outcome(idioms: tuple, grid: tuple, data=None) -> tuple[str, str]:
    """('equal' | 'refused' | 'wrong' | 'error', detail) of the model of ``idioms`` on ``grid``."""
    data = system() if data is None else data
    e_ref, f_ref = reference(idioms)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", jaxdd.DispatchWarning)
            warnings.filterwarnings("ignore", "the ghost shell of some ranks", RuntimeWarning)
            got = DistributedModel(IdiomModel(*idioms), DomainConfig(cutoff=CUTOFF, grid=grid))(data)
    except jaxdd.DispatchError as e:
        MESSAGES[idioms, grid] = str(e)
        lines = LINE.findall(str(e))
        first = str(e).splitlines()[0]
        if lines:
            return "refused", f"line {lines[0]}: {_named(int(lines[0]))}; {first[:160]}"
        return "refused-unnamed", first[:300]
    except Exception as e:  # noqa: BLE001 - any other failure is reported, and fails
        return "error", f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
    de = float(np.max(np.abs(np.asarray(got["energy"]) - e_ref) / np.abs(e_ref)))
    df = float(np.max(np.abs(np.asarray(got["forces"]) - f_ref)))
    verdict = "equal" if de <= E_RTOL and df <= F_ATOL else "wrong"
    return verdict, f"dE/E={de:.1e} dF={df:.1e}"


def _named(line: int) -> str:
    """The idiom (or base) whose source holds ``line`` of this file."""
    import inspect
    for name, fn in list(IDIOMS.items()) + [("IdiomModel.forward", IdiomModel.forward)]:
        src, start = inspect.getsourcelines(fn)
        if start <= line < start + len(src):
            return name
    return "?"


def run(idioms: tuple, grid_id: str) -> tuple[str, str]:
    t = time.perf_counter()
    verdict, detail = outcome(idioms, GRIDS[grid_id])
    RESULTS[("+".join(idioms), grid_id)] = (verdict, detail, time.perf_counter() - t)
    return verdict, detail


def check(verdict: str, detail: str, expected: str | None):
    assert verdict != "wrong", f"distributed result differs from one device: {detail}"
    assert verdict != "refused-unnamed", f"refused without naming the model's line: {detail}"
    assert verdict != "error", f"failed other than by a DispatchError: {detail}"
    if verdict == "refused" and expected == "equal":
        pytest.xfail(f"refused, but a sound dispatch runs it: {detail}")


def table(results=None) -> str:
    results = RESULTS if results is None else results
    rows = [("idiom", "grid", "outcome", "expected", "s", "line / error")]
    for (name, grid), (verdict, detail, secs) in results.items():
        exp = "/".join(EXPECTED.get(n, "?") for n in name.split("+"))
        rows.append((name, grid, verdict, exp, f"{secs:.1f}", detail))
    widths = [max(len(r[i]) for r in rows) for i in range(5)]
    return "\n".join("  ".join(r[i].ljust(widths[i]) for i in range(5)) + "  " + r[5] for r in rows)


# ----------------------------------------------------------------------------- the tests


@pytest.mark.slow
def test_the_reference_is_jaxdd_compute():
    ref = jaxdd.compute(IdiomModel("segment_max_senders"), system())
    e, f = reference(("segment_max_senders",))
    np.testing.assert_allclose(np.asarray(ref["energy"]), e, rtol=1e-12, atol=0)
    np.testing.assert_allclose(np.asarray(ref["forces"]), f, rtol=0, atol=1e-12)


def test_the_corpus_is_large_and_every_idiom_has_an_expected_outcome():
    assert len(IDIOMS) >= 40 and set(DEFAULT) <= set(IDIOMS)
    assert set(EXPECTED) == set(IDIOMS) and set(EXPECTED.values()) <= {"equal", "refused"}


#: The default run: one idiom of each family that the dispatch changes meaning for, on (3, 2, 1).
#: Every idiom on both grids is the slow set (compiling a distributed program costs ~4 s cold, so
#: the whole corpus on one grid alone would take ~3 minutes).
DEFAULT = ("count_nonzero_mask_edges", "arange_below_count_node_mask", "arange_below_edge_count", "mean_over_atoms",
           "jnp_mean_over_rows", "argsort_edges_by_receiver", "inverse_permutation",
           "wigner_blocks_at_constant_columns", "segment_max_senders", "segment_softmax_receivers",
           "dummy_graph_padding", "sentinel_int32_max_dropped", "top_k_over_edges", "unique_species_static_size",
           "degree_of_senders_from_num_neighbors", "dimenet_directional_messages")


def _cases():
    for name in IDIOMS:
        for grid_id in GRIDS:
            slow = () if name in DEFAULT and grid_id == "3x2x1" else (pytest.mark.slow,)
            yield pytest.param(name, grid_id, marks=slow, id=f"{name}-{grid_id}")


@pytest.mark.parametrize("name,grid_id", list(_cases()))
def test_an_idiom_is_equal_or_refused_naming_its_line(name, grid_id):
    check(*run((name,), grid_id), EXPECTED[name])


@pytest.mark.slow
def test_pairs_of_idioms_are_never_wrong():
    hypothesis = pytest.importorskip("hypothesis")
    st = hypothesis.strategies
    names = list(IDIOMS)

    # No shrinking: a failing pair is already two idioms, and each try compiles a program.
    @hypothesis.settings(max_examples=12, phases=[hypothesis.Phase.explicit, hypothesis.Phase.generate])
    @hypothesis.given(st.sampled_from(names), st.sampled_from(names))
    def pair(a, b):
        verdict, detail = run((a, b), "3x2x1")
        check(verdict, detail, None)

    pair()


def test_zz_print_the_outcome_table():
    """Last in the module: the table of what ran before it (``pytest -s`` / ``-rA`` shows it)."""
    if RESULTS:
        print("\n" + table())


if __name__ == "__main__":
    import sys

    args = sys.argv[1:]
    grids = ["3x2x1"]
    if "--grid" in args:
        i = args.index("--grid")
        grids = ["x".join(args[i + 1].split(","))]
        del args[i:i + 2]
    verbose = "-v" in args
    if verbose:
        args.remove("-v")
    if "--all-grids" in args:
        args.remove("--all-grids")
        grids = list(GRIDS)
    for name in args or list(IDIOMS):
        for g in grids:
            run(tuple(name.split("+")), g)
            print(table({k: v for k, v in RESULTS.items() if k == (name, g)}).splitlines()[-1], flush=True)
            if verbose and (tuple(name.split("+")), GRIDS[g]) in MESSAGES:
                print("    " + MESSAGES[tuple(name.split("+")), GRIDS[g]].replace("\n", "\n    "), flush=True)
    print(table())
