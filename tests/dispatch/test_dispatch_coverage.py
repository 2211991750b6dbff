"""Specification: every primitive that community models put in their programs has a meaning
under decomposition that somebody decided on.

A corpus of models as their libraries' users write them — e3x and a flax model over a stacked
``[2, n_edges]`` index array (``test_community_models.py``), jax-md's pair potentials and its
NequIP (through ``jaxdd.interop.jax_md.JaxMDModel``), a jraph ``GraphNetwork`` and a jraph
``GraphConvolution`` model, jaxdd's e3nn-jax NequIP, a flax MLP and an equinox MLP — is traced
inside the jaxdd model protocol on a small periodic system, and every equation is walked,
into the bodies of calls, custom derivatives, loops, branches and remat. Each primitive found
must have an explicitly registered rule (``jaxdd.dispatch.registry.rule_for``); the elementwise
ones are registered from the documented allow-list
``jaxdd.dispatch.rules.coverage.ELEMENTWISE_PRIMITIVES``, so a new primitive fails here until
someone decides what it means.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import jraph
import numpy as np
import pytest

import jaxdd
from jaxdd import BaseModel, ModelConfig, NeighborConfig, edge_vectors
from jaxdd.data import as_batch
from jaxdd.dispatch import Dispatcher, DispatchReport, Kind, Layout, registry
from jaxdd.dispatch.equations import equations
from jaxdd.dispatch.rules import coverage
from jaxdd.dispatch.rules.elementwise import elementwise
from jaxdd.models.nequip import NequIP
from jaxdd.neighbors import build_neighbor_list, neighbor_capacity

jax_md = pytest.importorskip("jax_md", reason="jax-md is a test dependency (pip install -e '.[test]')")
from jax_md import energy, partition  # noqa: E402
from jax_md._nn import nequip as md_nequip  # noqa: E402

from jaxdd.interop.jax_md import JaxMDModel  # noqa: E402
from test_community_models import MODELS as COMMUNITY_MODELS  # noqa: E402

# jax-md's NequIP init casts int64 indices into int32 arrays (its code, not jaxdd's).
pytestmark = pytest.mark.filterwarnings("ignore:scatter inputs have incompatible types:FutureWarning")

CUTOFF = 3.0  # Å, the corpus' own models
N_SPECIES = 9  # embedding rows, indexed by atomic number (H, C, O)

# jax-md's conventions, as tests/interop/test_interop_jax_md.py writes them.
JAX_MD_SPECIES = (6, 8)
JAX_MD_CUTOFF = 2.0


def periodic_system(n=4, spacing=2.0, species=(1, 6, 8), seed=0) -> jaxdd.AtomicData:
    """n³ atoms on a jittered simple-cubic lattice in a periodic cube of side n·spacing Å."""
    rng = np.random.default_rng(seed)
    k = np.stack(np.meshgrid(*[np.arange(n)] * 3, indexing="ij"), -1).reshape(-1, 3)
    return jaxdd.AtomicData(positions=(k + 0.5 + rng.uniform(-0.1, 0.1, k.shape)) * spacing,
                            atomic_numbers=np.asarray(species)[rng.integers(0, len(species), len(k))],
                            cell=np.eye(3) * n * spacing, pbc=np.array([True] * 3))


def jax_md_system() -> jaxdd.AtomicData:
    """A periodic C/O system jax-md's potentials accept (cell wider than twice JAX_MD_CUTOFF)."""
    return periodic_system(n=4, spacing=1.3, species=JAX_MD_SPECIES)


def descriptors(data, n_rbf: int = 8):
    """Per-atom radial descriptors [n_atoms, n_rbf]: Gaussians of the neighbour distances,
    cosine-cut at CUTOFF, summed onto each receiver."""
    nl = data.neighbors
    v = edge_vectors(data.positions, data.cell, data.batch_idx, nl)
    r = jnp.sqrt(jnp.where(nl.mask, jnp.sum(v * v, axis=-1), 1.0))
    envelope = jnp.where(nl.mask & (r < CUTOFF), 0.5 * (jnp.cos(jnp.pi * r / CUTOFF) + 1.0), 0.0)
    g = jnp.exp(-((r[:, None] - jnp.linspace(0.5, CUTOFF, n_rbf)) ** 2)) * envelope[:, None]
    return jax.ops.segment_sum(g, nl.receivers, num_segments=data.n_atoms)


class AtomicEnergyModel(eqx.Module, BaseModel):
    """``atomic(params, data) -> [n_atoms]`` (eV) summed per system; forces and stress by autograd."""

    params: Any
    atomic: Callable = eqx.field(static=True)
    model_config: ModelConfig = eqx.field(static=True)

    def __init__(self, atomic, params):
        self.atomic, self.params = atomic, params
        self.model_config = ModelConfig(
            outputs=frozenset({"energy", "forces", "stress"}), autograd_outputs=frozenset({"forces", "stress"}),
            autograd_inputs=frozenset({"positions", "cell"}), neighbor_config=NeighborConfig(cutoff=CUTOFF))

    def adapt_input(self, data):
        return dict(data=data)

    def forward(self, data):
        atomic = jnp.where(data.atom_mask, self.atomic(self.params, data), 0.0)
        return {"energy": jax.ops.segment_sum(atomic, data.batch_idx, num_segments=data.n_systems)}


# ----------------------------------------------------------------------------- the corpus


class FlaxMLP(nn.Module):
    """A flax MLP of the radial descriptors: one energy per atom."""

    @nn.compact
    def __call__(self, x):
        for width in (16, 16):
            x = nn.tanh(nn.Dense(width, param_dtype=jnp.float64)(x))
        return nn.Dense(1, param_dtype=jnp.float64)(x)[:, 0]


def flax_mlp():
    """FlaxMLP of the descriptors, random weights from its own init."""
    net = FlaxMLP()
    params = jax.jit(net.init)(jax.random.PRNGKey(0), jnp.zeros((1, 8)))  # one program, not one per operation
    return AtomicEnergyModel(lambda p, data: net.apply(p, descriptors(data)), params)


def equinox_mlp():
    """An ``eqx.nn.MLP`` of the descriptors, vmapped over atoms."""
    mlp = eqx.nn.MLP(8, "scalar", 16, 2, activation=jax.nn.softplus, key=jax.random.PRNGKey(1), dtype=jnp.float64)
    return AtomicEnergyModel(lambda m, data: jax.vmap(m)(descriptors(data)), mlp)


def _graph(data, node_features):
    """A jraph GraphsTuple of jaxdd's neighbour list: padding edges point past the last node."""
    nl = data.neighbors
    v = edge_vectors(data.positions, data.cell, data.batch_idx, nl)
    r = jnp.sqrt(jnp.where(nl.mask, jnp.sum(v * v, axis=-1), 1.0))
    envelope = jnp.where(nl.mask & (r < CUTOFF), 0.5 * (jnp.cos(jnp.pi * r / CUTOFF) + 1.0), 0.0)
    return jraph.GraphsTuple(nodes=node_features, edges=jnp.stack([r, envelope], axis=-1), senders=nl.senders,
                             receivers=nl.receivers, n_node=jnp.array([data.n_atoms]),
                             n_edge=jnp.array([nl.senders.shape[0]]), globals=jnp.zeros((1, 1)))


def jraph_graph_network():
    """A jraph GraphNetwork with attention over incoming edges and a global readout."""

    def atomic(p, data):
        def edge_fn(edges, sent, received, globals_):
            return jnp.tanh(jnp.concatenate([sent, received, edges], axis=-1) @ p["edge"]) * edges[:, 1:2]

        def node_fn(nodes, sent, received, globals_):
            return nodes + jnp.tanh(received @ p["node"])

        def logit_fn(edges, sent, received, globals_):
            return jnp.sum(sent * received, axis=-1)

        net = jraph.GraphNetwork(edge_fn, node_fn, update_global_fn=lambda nodes, edges, g: nodes,
                                 attention_logit_fn=logit_fn, attention_reduce_fn=lambda e, w: e * w[:, None])
        graph = net(_graph(data, p["embed"][data.atomic_numbers]))
        return graph.nodes @ p["readout"]

    keys = jax.random.split(jax.random.PRNGKey(2), 4)
    params = {"embed": jax.random.normal(keys[0], (N_SPECIES, 4)), "edge": jax.random.normal(keys[1], (10, 4)),
              "node": jax.random.normal(keys[2], (4, 4)), "readout": jax.random.normal(keys[3], (4,))}
    return AtomicEnergyModel(atomic, params)


def jraph_graph_convolution():
    """Two jraph GraphConvolution layers (symmetric degree normalisation), then a linear readout."""

    def atomic(p, data):
        graph = _graph(data, p["embed"][data.atomic_numbers])
        for w in p["layers"]:
            graph = jraph.GraphConvolution(lambda x, w=w: jax.nn.silu(x @ w))(graph)
        return graph.nodes @ p["readout"]

    keys = jax.random.split(jax.random.PRNGKey(3), 4)
    params = {"embed": jax.random.normal(keys[0], (N_SPECIES, 4)),
              "layers": [jax.random.normal(k, (4, 4)) for k in keys[1:3]], "readout": jax.random.normal(keys[3], (4,))}
    return AtomicEnergyModel(atomic, params)


def e3nn_nequip():
    """jaxdd's e3nn-jax NequIP, two small layers."""
    return NequIP(species=(1, 6, 8), cutoff=CUTOFF, hidden_irreps="4x0e + 2x1o", n_layers=2, n_basis=4,
                  radial_hidden=8, readout_hidden=8, avg_num_neighbors=10.0)


def _jax_md(factory, fmt, **kwargs):
    """A jax-md factory as a jaxdd model, periodic with Cartesian positions."""
    return JaxMDModel(factory, cutoff=JAX_MD_CUTOFF, format=fmt, periodic=True, species=JAX_MD_SPECIES, **kwargs)


def jax_md_pair(name, fmt):
    """jax-md's ``energy.<name>_neighbor_list`` in neighbour format ``fmt``, species as ids."""
    ids = jnp.asarray(np.searchsorted(JAX_MD_SPECIES, jax_md_system().atomic_numbers))
    sigma, eps = jnp.array([[1.0, 1.1], [1.1, 1.2]]), jnp.array([[1.0, 0.8], [0.8, 0.6]])
    factories = {
        "lennard_jones": lambda d, b, **kw: energy.lennard_jones_neighbor_list(
            d, b, species=ids, sigma=sigma, epsilon=eps, r_onset=1.3, r_cutoff=JAX_MD_CUTOFF / 1.2, **kw),
        "morse": lambda d, b, **kw: energy.morse_neighbor_list(
            d, b, species=ids, sigma=1.1, epsilon=eps, alpha=4.0, r_onset=1.5, r_cutoff=JAX_MD_CUTOFF, **kw),
        "soft_sphere": lambda d, b, **kw: energy.soft_sphere_neighbor_list(
            d, b, species=ids, sigma=jnp.array([[1.6, 1.8], [1.8, 2.0]]), epsilon=eps, alpha=2.5, **kw),
    }
    return _jax_md(lambda d, b: factories[name](d, b, format=fmt), fmt)


def jax_md_nequip():
    """jax-md's NequIP, random weights from its own init, species as one-hot atoms."""
    cfg = md_nequip.default_config()
    cfg.graph_net_steps, cfg.hidden_irreps, cfg.sh_irreps = 2, "8x0e + 4x1o", "1x0e + 1x1o"
    cfg.n_elements, cfg.r_max, cfg.shift, cfg.scale = len(JAX_MD_SPECIES), JAX_MD_CUTOFF, 0.3, 1.7
    cfg.radial_net_n_hidden, cfg.n_neighbors = 8, 6.0
    data = jax_md_system()
    box = jnp.asarray(data.cell).T
    neighbor_fn, init_fn, _ = energy.nequip_neighbor_list(lambda a, b, **kw: a - b, box, cfg)
    R = jnp.asarray(data.positions)
    atoms = jax.nn.one_hot(np.searchsorted(JAX_MD_SPECIES, data.atomic_numbers), len(JAX_MD_SPECIES))
    nbrs = neighbor_fn.allocate(R)
    # The weights' shapes only: the corpus is traced, never run (see corpus_primitives).
    params = jax.eval_shape(lambda key: jax.tree.map(lambda x: x.astype(jnp.float64),
                                                     init_fn(key, R, nbrs, atoms=atoms)), jax.random.PRNGKey(0))
    return _jax_md(lambda d, b: energy.nequip_neighbor_list(d, b, cfg), partition.Sparse, species_as="atoms",
                   params=params)


#: name -> (model builder, system builder).
CORPUS: dict[str, tuple[Callable, Callable]] = {
    "e3x": (COMMUNITY_MODELS["e3x"], periodic_system),
    "stacked_index_flax": (COMMUNITY_MODELS["stacked_index_flax"], periodic_system),
    "jax_md_lennard_jones_sparse": (lambda: jax_md_pair("lennard_jones", partition.Sparse), jax_md_system),
    "jax_md_morse_ordered_sparse": (lambda: jax_md_pair("morse", partition.OrderedSparse), jax_md_system),
    "jax_md_soft_sphere_dense": (lambda: jax_md_pair("soft_sphere", partition.Dense), jax_md_system),
    "jax_md_nequip": (jax_md_nequip, jax_md_system),
    "jraph_graph_network": (jraph_graph_network, periodic_system),
    "jraph_graph_convolution": (jraph_graph_convolution, periodic_system),
    "e3nn_nequip": (e3nn_nequip, periodic_system),
    "flax_mlp": (flax_mlp, periodic_system),
    "equinox_mlp": (equinox_mlp, periodic_system),
}


# ----------------------------------------------------------------------------- tracing and walking


def traced(model, data):
    """The ClosedJaxpr of ``model(batch)`` on one device, as the dispatch traces it: the batch
    with the neighbour list the model's ``NeighborConfig`` asks for.

    Only the primitives matter, so nothing runs: the list is built abstractly (its capacity
    sized for the system) and the model's arrays may be shapes (``jax.ShapeDtypeStruct``)."""
    batch = as_batch(data)
    nc = model.model_config.neighbor_config
    sizes = dict(cutoff=nc.search_cutoff, half=nc.half_list)
    capacity = neighbor_capacity(batch.positions, batch.cell, batch.pbc, batch.batch_idx, batch.atom_mask, **sizes)
    nl = jax.eval_shape(lambda b: build_neighbor_list(b.positions, b.cell, b.pbc, b.batch_idx, b.atom_mask,
                                                      capacity=capacity, format=nc.format, **sizes), batch)
    return eqx.filter_make_jaxpr(lambda m, b, n: m(b.replace(neighbors=n)))(model, batch, nl)[0]


SHAPES_ONLY = {"e3x", "stacked_index_flax", "jraph_graph_network", "jraph_graph_convolution", "flax_mlp",
               "equinox_mlp"}


@functools.lru_cache(maxsize=None)
def corpus_primitives() -> dict[str, frozenset[str]]:
    """Model name -> names of the primitives in its traced program. The flax, equinox, jraph
    and e3x models are built with the shapes of their weights only (their initialisers traced,
    not compiled); jax-md's NequIP gets its weights' shapes from jax.eval_shape; the others
    read their system or their weights' values as they are built."""
    found = {}
    for name, (build, system) in CORPUS.items():
        closed = traced(eqx.filter_eval_shape(build) if name in SHAPES_ONLY else build(), system())
        found[name] = frozenset(eqn.primitive.name for eqn in equations(closed.jaxpr))
    return found


# ----------------------------------------------------------------------------- specification


def test_every_primitive_of_the_corpus_has_a_registered_rule():
    missing: dict[str, list[str]] = {}
    for model, names in corpus_primitives().items():
        for name in names:
            if registry.rule_for(name) is None:
                missing.setdefault(name, []).append(model)
    assert not missing, "primitives with no dispatch rule (register one, or add a truly elementwise one to " \
                        "jaxdd.dispatch.rules.coverage.ELEMENTWISE_PRIMITIVES):\n" + "\n".join(
                            f"  {p}: {', '.join(sorted(models))}" for p, models in sorted(missing.items()))


def test_the_elementwise_allow_list_is_registered_with_the_elementwise_rule():
    wrong = sorted(p for p in coverage.ELEMENTWISE_PRIMITIVES if registry.rule_for(p) is not elementwise)
    assert not wrong, f"allow-listed primitives whose rule is not the elementwise rule: {wrong}"


def test_the_allow_list_shadows_no_rule_of_another_family():
    # A name that a prefix rule covers (reduce_*, scatter*, cum*) has its family's meaning;
    # listing it as elementwise would quietly replace that meaning.
    prefixes = [p[:-1] for p in registry.registered_rules() if p.endswith("*")]
    shadowed = sorted(p for p in coverage.ELEMENTWISE_PRIMITIVES if any(p.startswith(q) for q in prefixes))
    assert not shadowed, f"allow-listed primitives inside a prefix family: {shadowed}"


@pytest.mark.parametrize("primitive", ["gather", "scatter-add", "dot_general", "reduce_max", "select_n", "iota",
                                       "sort", "cumsum", "argmax", "clamp", "split", "rev"])
def test_primitives_that_move_or_reduce_rows_are_not_on_the_elementwise_allow_list(primitive):
    assert primitive not in coverage.ELEMENTWISE_PRIMITIVES


def test_the_walk_enters_every_kind_of_body():
    @jax.custom_jvp
    def custom_jvp(x):
        return jnp.sin(x)

    custom_jvp.defjvp(lambda p, t: (custom_jvp(p[0]), jnp.cos(p[0]) * t[0]))

    @jax.custom_vjp
    def custom_vjp(x):
        return jnp.cos(x)

    custom_vjp.defvjp(lambda x: (custom_vjp(x), x), lambda x, g: (-jnp.sin(x) * g,))

    def program(x):  # each body holds a primitive found nowhere else
        x = jax.jit(jnp.exp)(x)
        x = custom_jvp(x) + custom_vjp(x)
        x = jax.lax.scan(lambda c, _: (jnp.tanh(c), None), x, None, length=2)[0]
        x = jax.lax.while_loop(lambda c: c[1] < 2, lambda c: (jnp.log1p(c[0]), c[1] + 1), (x, 0))[0]
        x = jax.lax.cond(jnp.sum(x) > 0, jnp.sqrt, jnp.abs, x)
        return jax.checkpoint(jnp.expm1)(x)

    found = {eqn.primitive.name for eqn in equations(jax.make_jaxpr(program)(jnp.ones(3)).jaxpr)}
    assert {"exp", "sin", "cos", "tanh", "log1p", "sqrt", "abs", "expm1"} <= found


def test_the_corpus_reaches_primitives_inside_library_bodies():
    found = corpus_primitives()
    assert "reduce_max" in found["e3x"]  # e3x.ops.norm's largest |x| over edges, inside its custom_jvp
    assert "logistic" in found["jax_md_nequip"]  # the swish of its radial network, inside jax.nn's jit body
    assert "split" in found["e3nn_nequip"]  # e3nn's irreps chunks


def test_every_corpus_model_reads_through_the_neighbour_list():
    found = corpus_primitives()
    assert set(found) == set(CORPUS)
    assert [name for name, prims in found.items() if "gather" not in prims] == []


# ----------------------------------------------------------------------------- the rules of the coverage module

N_ROWS, N_EDGES = 6, 10
NODES, EDGES = Layout(Kind.NODE), Layout(Kind.EDGE)
SENDERS = Layout(Kind.EDGE, 0, Kind.NODE)  # per edge, values index atoms


def analysed(fn, shapes, layouts):
    """(output layouts, notes) of ``fn`` traced on ``shapes`` with inputs tagged ``layouts``."""
    closed = jax.make_jaxpr(fn)(*[jax.ShapeDtypeStruct(s, d) for s, d in shapes])
    d = Dispatcher(None, DispatchReport(), (N_ROWS, N_EDGES, 1))
    plan = d.analyse(closed.jaxpr, tuple(layouts), closed.consts)
    return plan.outs, plan.notes


def test_stop_gradient_keeps_what_an_index_array_points_at():
    (out,), notes = analysed(lambda h, s: h[jax.lax.stop_gradient(s)], [((N_ROWS, 3), jnp.float64),
                                                                        ((N_EDGES,), jnp.int32)], [NODES, SENDERS])
    assert out.kind is Kind.EDGE and notes == ()


def test_split_across_the_edge_axis_keeps_each_rows_index_meaning():
    def gather_through_rows(h, s, r):
        first, second = jnp.split(jnp.stack([s, r]), 2, axis=0)
        return h[first[0]] - h[second[0]]

    index = ((N_EDGES,), jnp.int32)
    (out,), notes = analysed(gather_through_rows, [((N_ROWS, 3), jnp.float64), index, index], [NODES, SENDERS, SENDERS])
    assert out.kind is Kind.EDGE and notes == ()


def test_split_along_the_atom_axis_keeps_the_first_piece_and_records_the_rest():
    (first, rest), notes = analysed(lambda h: jnp.split(h, [2]), [((N_ROWS, 3), jnp.float64)], [NODES])
    assert first == NODES and rest.kind is None
    assert any("split of the per-node axis" in n for n in notes)


def test_solving_every_edge_vector_against_one_cell_keeps_the_edge_axis():
    def fractional(v, cell):
        return jax.vmap(lambda d: jnp.linalg.solve(cell.T, d))(v)

    (out,), notes = analysed(fractional, [((N_EDGES, 3), jnp.float64), ((3, 3), jnp.float64)],
                             [EDGES, Layout()])
    assert out.kind is Kind.EDGE and out.axis == 0 and notes == ()


def test_a_linear_system_over_atoms_is_recorded_as_rank_local():
    (out,), notes = analysed(jnp.linalg.solve, [((N_ROWS, N_ROWS), jnp.float64), ((N_ROWS,), jnp.float64)],
                             [NODES, NODES])
    assert out.kind is None
    assert any("coupling every rank's rows" in n for n in notes)
