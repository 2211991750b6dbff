"""Specification: two JAX MLIP libraries run under domain decomposition unchanged.

- InstaDeep's ``mlip`` 0.2.5 (flax, on ``e3j`` 0.1.1): MACE, NequIP, ViSNet, eSEN and eSEN with a
  mixture of experts, each a small random float64 network;
- ``nequix`` 0.4.5 (an equinox NequIP).

Each is wrapped as docs/porting.md shows (its sections "InstaDeep's mlip" and "nequix": the
wrappers below are the page's): a jaxdd ``BaseModel`` whose ``forward`` builds the library's own
inputs from jaxdd's ``data.neighbors``. Specified here:

- on one device the wrapper equals the library's own evaluation on the graph the library builds
  for the same atoms (mlip's ``ForceField`` on ``Graph.from_chemical_system``, ``Nequix.__call__``
  on nequix's padded jraph graph): energy, forces and stress;
- under ``DistributedModel`` on grids (2, 2, 1) and (3, 2, 1), cubic and triclinic cells, each
  equals ``jaxdd.compute`` on one device (float64: energy to 1e-10 relative, forces and stress to
  1e-9 eV/Å and eV/Å³) under the default spec, with nothing guessed or left rank-local and no
  ``allow_unfollowed``;
- mlip's own padding convention (a padding graph, node and edge counts from the masks) equals the
  one-graph wrapper on one device; distributed it is refused (a count over every rank's rows meets
  a rank's row numbers) naming the line and showing the mask-based sum to write instead;
- e3j's ``GraphCSR.mask_edges`` (``sender < count_nonzero(node_mask)``), called as documented,
  equals one device on (3, 2, 1) and, in the slow sweep, (2, 1, 1) and (2, 2, 1);
- nequix's padding edges need a unit vector: with zero vectors the stress is NaN;
- the ``python mlip`` / ``python nequix`` blocks of docs/porting.md run (slow).

MACE, eSEN with experts and nequix are in the default suite on one grid and cell each (about 110 s
on 2 cores cold, 45 s with the compilation cache); their other grid and cell, and NequIP, ViSNet
and plain eSEN, are in the slow sweep. Every test skips, naming the library, when it is not
installed.
"""

from __future__ import annotations

import dataclasses
import functools
import re
import warnings
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxdd
from jaxdd import BaseModel, ModelConfig, NeighborConfig, edge_vectors
from jaxdd.dispatch import DispatchWarning
from jaxdd.engine import DistributedModel, DomainConfig, default_mesh

pytestmark = [
    # a 8.8 Å cell on 4 or 6 ranks: ghost shells reach round the cell (said by a RuntimeWarning)
    pytest.mark.filterwarnings("ignore:the ghost shell of some ranks covers every atom:RuntimeWarning"),
    # mlip's species table: int64 values set into an int32 table (jax's FutureWarning, mlip's code)
    pytest.mark.filterwarnings("ignore:scatter inputs have incompatible types:FutureWarning"),
]

ROOT = Path(__file__).resolve().parents[2]
CUTOFF = 3.0  # Å
SPECIES = (1, 6, 8)
GRIDS = [(2, 2, 1), (3, 2, 1)]


def needs(library: str):
    """Skip the test, naming the library, where it is not installed."""
    hint = {"mlip": "pip install -e '.[mlip]'", "e3j": "pip install -e '.[mlip]'",
            "nequix": "pip install --no-deps nequix"}[library]
    # mlip has a __version__ to check; nequix (0.4.5) and e3j have none
    return pytest.importorskip(library, minversion="0.2.5" if library == "mlip" else None,
                               reason=f"{library} is not installed ({hint})")


def f64(tree):
    return jax.tree.map(lambda x: x.astype(jnp.float64) if eqx.is_inexact_array(x) else x, tree)


# ----------------------------------------------------------------------------- the wrappers (docs/porting.md)


class MlipModel(eqx.Module, BaseModel):
    """The network of an mlip ForceField (MACE, NequIP, ViSNet, eSEN) on one mlip Graph of all
    the rows; its atomic energies summed per system. One system per call."""

    params: Any
    network: Any = eqx.field(static=True)
    charge: int = eqx.field(static=True)
    model_config: ModelConfig = eqx.field(static=True)

    def __init__(self, force_field, charge: int = 0, dtype=jnp.float64):
        self.network, self.charge = force_field.predictor.mlip_network, charge
        self.params = jax.tree.map(lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x,
                                   force_field.params["params"]["mlip_network"])
        self.model_config = ModelConfig(
            outputs={"energy", "forces", "stress"}, autograd_outputs={"forces", "stress"},
            autograd_inputs={"positions", "cell"},
            neighbor_config=NeighborConfig(self.network.dataset_info.graph_cutoff_angstrom))

    def adapt_input(self, data):
        return dict(data=data)

    def forward(self, data):
        from mlip.graph import EdgeOrdering, Graph, GraphEdges, GraphGlobals, GraphNodes

        if data.n_systems != 1:
            raise ValueError(f"MlipModel evaluates one system per call, got {data.n_systems}")
        nl = data.neighbors
        graph = Graph(
            nodes=GraphNodes(positions=data.positions, atomic_numbers=data.atomic_numbers),
            edges=GraphEdges(shifts=-nl.shifts.astype(data.positions.dtype)),  # receiver - sender
            globals=GraphGlobals(cell=data.cell, weight=jnp.ones(1), charge=jnp.full(1, self.charge, jnp.int32)),
            n_node=jnp.array([data.positions.shape[0]]),  # one graph of every row, padding included
            n_edge=jnp.array([nl.senders.shape[0]]),
            senders=nl.senders, receivers=nl.receivers,
        ).sort_edges(EdgeOrdering.SENDER)
        graph = self.network.apply({"params": self.params}, graph)
        atomic = jnp.where(data.atom_mask, graph.nodes.features["energy"], 0.0)  # padding rows have one too
        return {"energy": jax.ops.segment_sum(atomic, data.batch_idx, data.n_systems)}


class MlipPaddingGraphModel(MlipModel):
    """mlip's own padding convention (jraph's ``pad_with_graphs``): the real graph, then a padding
    graph holding the padding rows and edges, counted from the masks; one padding node appended
    at row ``n_rows`` (where jaxdd's padding edges point; mlip needs at least one), and the
    predictor's own energy (``ForceFieldPredictor.compute_energy``, its energy head)."""

    predictor: Any = eqx.field(static=True)
    predictor_params: Any

    def __init__(self, force_field, charge: int = 0):
        super().__init__(force_field, charge)
        self.predictor = force_field.predictor
        self.predictor_params = f64(force_field.params)

    def forward(self, data):
        from mlip.graph import EdgeOrdering, Graph, GraphEdges, GraphGlobals, GraphNodes

        nl = data.neighbors
        n_rows, n_slots = data.positions.shape[0], nl.senders.shape[0]
        n_atoms, n_edges = jnp.count_nonzero(data.atom_mask), jnp.count_nonzero(nl.mask)
        positions = jnp.concatenate([data.positions, jnp.zeros((1, 3), data.positions.dtype)])
        numbers = jnp.concatenate([data.atomic_numbers, jnp.zeros_like(data.atomic_numbers[:1])])
        graph = Graph(
            nodes=GraphNodes(positions=positions, atomic_numbers=numbers),
            edges=GraphEdges(shifts=-nl.shifts.astype(data.positions.dtype)),
            globals=GraphGlobals(cell=jnp.concatenate([data.cell, jnp.zeros_like(data.cell)]), weight=jnp.ones(2),
                                 charge=jnp.full(2, self.charge, jnp.int32)),
            n_node=jnp.stack([n_atoms, n_rows + 1 - n_atoms]), n_edge=jnp.stack([n_edges, n_slots - n_edges]),
            senders=nl.senders, receivers=nl.receivers,
        ).sort_edges(EdgeOrdering.SENDER)
        _, graph = self.predictor.apply(self.predictor_params, positions, jnp.zeros((2, 3, 3)), graph,
                                        method="compute_energy")
        return {"energy": graph.globals.energy[:1]}


class NequixModel(eqx.Module, BaseModel):
    """nequix's atomic energies (Nequix.node_energies) summed per system."""

    net: Any
    species: jax.Array  # nequix's species index of each atomic number
    unit_padding: bool = eqx.field(static=True)
    model_config: ModelConfig = eqx.field(static=True)

    def __init__(self, net, atomic_numbers, dtype=jnp.float64, unit_padding: bool = True):
        self.net = jax.tree.map(lambda x: x.astype(dtype) if eqx.is_inexact_array(x) else x, net)
        table = np.zeros(max(atomic_numbers) + 1, np.int32)
        table[sorted(atomic_numbers)] = np.arange(len(atomic_numbers))
        self.species = jnp.asarray(table)
        self.unit_padding = unit_padding  # False only to show the NaN it avoids
        self.model_config = ModelConfig(
            outputs={"energy", "forces", "stress"}, autograd_outputs={"forces", "stress"},
            autograd_inputs={"positions", "cell"}, neighbor_config=NeighborConfig(net.cutoff))

    def adapt_input(self, data):
        return dict(data=data)

    def forward(self, data):
        nl = data.neighbors
        vectors = edge_vectors(data.positions, data.cell, data.batch_idx, nl)  # sender - receiver, as nequix's
        if self.unit_padding:
            vectors = jnp.where(nl.mask[:, None], vectors, jnp.array([1.0, 0.0, 0.0]))  # no r = 0: no NaN
        species = self.species[data.atomic_numbers]
        node = self.net.node_energies(vectors, species, nl.senders, nl.receivers)[:, 0]
        atomic = jnp.where(data.atom_mask, node, 0.0)
        return {"energy": jax.ops.segment_sum(atomic, data.batch_idx, data.n_systems)}


# ----------------------------------------------------------------------------- the networks (small, random, seed 0)

MLIP_MODELS = ["mace", "nequip", "visnet", "esen", "esen_moe"]


@functools.lru_cache(maxsize=None)
def mlip_force_field(name: str):
    needs("mlip")
    from mlip.data import DatasetInfo
    from mlip.models import Esen, ForceField, Mace, Nequip, Visnet
    from mlip.models.esen.config import EsenMoEConfig
    from mlip.typing.properties import Properties

    info = DatasetInfo(atomic_energies_map={1: -0.5, 6: -1.5, 8: -2.0}, graph_cutoff_angstrom=CUTOFF,
                       avg_num_neighbors=8.0, avg_r_min_angstrom=1.5)
    esen = dict(num_layers=2, sphere_channels=8, hidden_channels=8, edge_channels=8, l_max=2, m_max=2, num_rbf=8)
    network = {
        "mace": lambda: Mace(Mace.Config(num_layers=2, num_channels=8, l_max=2, correlation=2,
                                         readout_irreps=("4x0e", "0e"), num_rbf=4, radial_mlp_hidden=[8]), info),
        "nequip": lambda: Nequip(Nequip.Config(num_layers=2, target_irreps="4x0e + 4x0o + 2x1o + 2x1e", l_max=2,
                                               num_rbf=4, radial_mlp_hidden=[8]), info),
        "visnet": lambda: Visnet(Visnet.Config(num_layers=2, num_channels=8, l_max=2, num_heads=2, num_rbf=8), info),
        "esen": lambda: Esen(Esen.Config(**esen), info),
        "esen_moe": lambda: Esen(Esen.Config(**esen, moe=EsenMoEConfig(num_experts=3, embed_dim=4,
                                                                        router_hidden_dims=[8])), info),
    }[name]()
    return ForceField.from_mlip_network(network, required_properties=Properties(stress=True), seed=0)


@functools.lru_cache(maxsize=None)
def nequix_net():
    needs("nequix")
    from nequix.model import Nequix

    return Nequix(jax.random.key(0), n_species=len(SPECIES), lmax=2, cutoff=CUTOFF, hidden_irreps="8x0e + 4x1o + 2x2e",
                  n_layers=2, radial_basis_size=6, radial_mlp_size=8, radial_mlp_layers=2, avg_n_neighbors=8.0,
                  atom_energies=[-0.5, -1.5, -2.0])


def wrapper(name: str):
    return NequixModel(nequix_net(), SPECIES) if name == "nequix" else MlipModel(mlip_force_field(name))


# ----------------------------------------------------------------------------- the systems


@functools.lru_cache(maxsize=None)
def periodic_system(cell_kind: str, n: int = 4, spacing: float = 2.2, seed: int = 0) -> jaxdd.AtomicData:
    """n³ = 64 atoms (H, C, O at random) jittered about a simple-cubic lattice in a periodic cell
    of side n·spacing = 8.8 Å, cubic or sheared (triclinic)."""
    rng = np.random.default_rng(seed)
    k = np.stack(np.meshgrid(*[np.arange(n)] * 3, indexing="ij"), -1).reshape(-1, 3)
    cell = np.eye(3) * n * spacing
    if cell_kind == "triclinic":
        cell = cell + np.array([[0.0, 0.0, 0.0], [0.15, 0.0, 0.0], [0.1, -0.2, 0.0]]) * n * spacing
    frac = (k + 0.5 + rng.uniform(-0.12, 0.12, k.shape)) / n
    return jaxdd.AtomicData(positions=frac @ cell, atomic_numbers=np.asarray(SPECIES)[rng.integers(0, 3, len(k))],
                            cell=cell, pbc=np.array([True] * 3))


OUTPUTS = ("energy", "forces", "stress")


@functools.lru_cache(maxsize=None)
def one_device(name: str, cell_kind: str):
    return jaxdd.compute(wrapper(name), periodic_system(cell_kind), OUTPUTS)


def distributed(model, data, grid):
    """(outputs, dispatch report, DispatchWarnings issued) of the default-spec run on ``grid``."""
    mesh = default_mesh(jax.devices()[:int(np.prod(grid))])
    dist = DistributedModel(model, DomainConfig(cutoff=CUTOFF, mesh=mesh, grid=grid))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", DispatchWarning)
        out = dist(data, OUTPUTS)
    return out, dist.dispatch_report, [w for w in caught if issubclass(w.category, DispatchWarning)]


def assert_equal(got, ref, *, energy_rtol=1e-10, atol=1e-9):
    e = float(ref["energy"][0])
    assert abs(float(got["energy"][0]) - e) <= energy_rtol * abs(e)
    for key in ("forces", "stress"):
        assert np.isfinite(np.asarray(ref[key])).all()
        np.testing.assert_allclose(np.asarray(got[key]), np.asarray(ref[key]), rtol=0, atol=atol, err_msg=key)
    assert np.abs(np.asarray(ref["forces"])).max() > 1e-3  # the forces are not trivially zero


def grid_id(grid):
    return "x".join(map(str, grid))


# The first case of each model: in the default suite for those in DEFAULT, in the slow sweep for
# the others; the second (other grid, other cell) always in the slow sweep. mlip's networks are
# costly to compile (15-35 s each on 2 cores, eSEN the most), so MACE and eSEN with experts (eSEN's
# Wigner matrices, its edge sort, the router) are the default representatives.
DEFAULT = {"mace": ((2, 2, 1), "cubic"), "esen_moe": ((3, 2, 1), "triclinic"), "nequix": ((2, 2, 1), "cubic")}
FIRST = {"nequip": ((3, 2, 1), "triclinic"), "visnet": ((2, 2, 1), "triclinic"), "esen": ((3, 2, 1), "cubic")}


def cases(names):
    out = []
    for name in names:
        grid, kind = DEFAULT.get(name) or FIRST[name]
        other = "triclinic" if kind == "cubic" else "cubic"
        out.append(pytest.param(name, grid, kind, id=f"{name}-{grid_id(grid)}-{kind}",
                                marks=() if name in DEFAULT else pytest.mark.slow))
        (grid2,) = [g for g in GRIDS if g != grid]
        out.append(pytest.param(name, grid2, other, id=f"{name}-{grid_id(grid2)}-{other}", marks=pytest.mark.slow))
    return out


# ----------------------------------------------------------------------------- mlip


def own_graph_cases(names):
    """MACE and nequix against their library on the cubic cell in the default suite; the rest in
    the slow sweep."""
    return [pytest.param(name, kind, id=f"{name}-{kind}",
                         marks=() if (name, kind) in {("mace", "cubic"), ("nequix", "cubic")} else pytest.mark.slow)
            for name in names for kind in ("cubic", "triclinic")]


@pytest.mark.parametrize("name, kind", own_graph_cases(MLIP_MODELS))
def test_mlip_wrapper_equals_mlip_force_field_on_its_own_graph(name, kind):
    """The wrapper on jaxdd's list equals mlip's ForceField on the matscipy graph mlip builds:
    the edge direction (shifts = -jaxdd's) and the padding are right."""
    needs("mlip")
    from mlip.data.chemical_system import ChemicalSystem
    from mlip.graph import Graph

    ff = mlip_force_field(name)
    ff = dataclasses.replace(ff, params=f64(ff.params))
    data = periodic_system(kind)
    graph = Graph.from_chemical_system(ChemicalSystem.from_ase_atoms(data.to_ase(), get_property_fields=False), CUTOFF)
    own = jax.jit(ff.predict)(graph.replace_globals(charge=jnp.zeros(1, jnp.int32)))
    got = one_device(name, kind)
    assert abs(float(got["energy"][0] - own.energy[0])) <= 1e-10 * abs(float(own.energy[0]))
    np.testing.assert_allclose(np.asarray(got["forces"]), np.asarray(own.forces), rtol=0, atol=1e-10)
    np.testing.assert_allclose(np.asarray(got["stress"]), np.asarray(own.stress), rtol=0, atol=1e-10)


@pytest.mark.parametrize("name, grid, kind", cases(MLIP_MODELS))
def test_mlip_model_distributed_equals_one_device(name, grid, kind):
    needs("mlip")
    got, report, dispatch_warnings = distributed(wrapper(name), periodic_system(kind), grid)
    assert_equal(got, one_device(name, kind))
    assert report.fallbacks == []
    assert dispatch_warnings == []


def test_mlip_padding_graph_equals_one_graph_on_one_device():
    """mlip's padding graph (counts from the masks, one padding node appended) gives the same
    numbers as the one-graph wrapper on one device."""
    needs("mlip")
    data = periodic_system("cubic")
    got = jaxdd.compute(MlipPaddingGraphModel(mlip_force_field("mace")), data, OUTPUTS)
    assert_equal(got, one_device("mace", "cubic"), energy_rtol=1e-13, atol=1e-12)


@pytest.mark.slow
def test_the_validator_passes_esen_as_it_is_with_no_deep_halo():
    """eSEN's edge sort and per-edge Wigner scatters stay rank-local: the validator's first spec
    passes, and no fix (a deep halo) is tried."""
    needs("mlip")
    from jaxdd.validate import trace_and_validate

    report = trace_and_validate(lambda: MlipModel(mlip_force_field("esen")),
                                periodic_system("cubic"), world_size=4, atol=1e-9, rtol=1e-10)
    assert report.ok, report.summary()
    assert report.fix_applied is None and len(report.attempts) == 1, report.summary()


def test_mlip_padding_graph_is_refused_showing_the_mask_based_sum():
    """mlip's padding graph counts its nodes from the mask, a count over every rank's rows that
    meets a rank's row numbers: refused naming the line, with the local form to write instead."""
    needs("mlip")
    with pytest.raises(jaxdd.DispatchError) as refusal:
        distributed(MlipPaddingGraphModel(mlip_force_field("mace")), periodic_system("cubic"), (2, 2, 1))
    message = str(refusal.value)
    assert re.search(r"\.py:\d+", message)  # the line of mlip's or e3j's code
    assert "jnp.sum(jnp.where(atom_mask, atomic_energies, 0.0))" in message  # the mask-based sum
    assert "docs/dispatch.md" in message


# ----------------------------------------------------------------------------- e3j's mask_edges


class E3jMaskEdgesModel(BaseModel):
    """Two message passes over the edges e3j's ``GraphCSR.mask_edges`` keeps (as documented:
    ``n = count_nonzero(node_mask)``, edges to rows past ``n`` sent to ``DUMMY_INDEX``), their
    messages read and summed with out-of-range indices dropped."""

    def __init__(self):
        self.w = jnp.linspace(0.3, 1.1, 6)
        self.model_config = ModelConfig(outputs={"energy", "forces", "stress"}, autograd_outputs={"forces", "stress"},
                                        autograd_inputs={"positions", "cell"},
                                        neighbor_config=NeighborConfig(CUTOFF))

    def adapt_input(self, data):
        return dict(data=data)

    def forward(self, data):
        from e3j.data.graph import GraphCSR

        nl, n = data.neighbors, data.positions.shape[0]
        senders, receivers = GraphCSR.mask_edges(nl.senders, nl.receivers, data.atom_mask)
        vec = edge_vectors(data.positions, data.cell, data.batch_idx, nl)
        r2 = jnp.where(nl.mask, jnp.sum(vec * vec, -1), 1.0)
        env = jnp.where(nl.mask & (r2 < CUTOFF**2), (1 - r2 / CUTOFF**2) ** 2, 0.0)
        h = jnp.ones((n, 6)) * self.w
        for _ in range(2):
            m = jnp.tanh(h.at[senders].get(mode="fill", fill_value=0.0)) * env[:, None]
            h = h + jax.ops.segment_sum(m, receivers, n)
        atomic = jnp.where(data.atom_mask, jnp.sum(jnp.tanh(h), -1), 0.0)
        return {"energy": jax.ops.segment_sum(atomic, data.batch_idx, data.n_systems)}


@pytest.mark.parametrize("grid", [pytest.param((3, 2, 1), id="3x2x1"),
                                  pytest.param((2, 1, 1), id="2x1x1", marks=pytest.mark.slow),
                                  pytest.param((2, 2, 1), id="2x2x1", marks=pytest.mark.slow)])
def test_e3j_mask_edges_distributed_equals_one_device(grid):
    """``count_nonzero(atom_mask)`` compared with row numbers means a real atom of the rank."""
    needs("e3j")
    data = periodic_system("triclinic")
    got, report, dispatch_warnings = distributed(E3jMaskEdgesModel(), data, grid)
    assert_equal(got, jaxdd.compute(E3jMaskEdgesModel(), data, OUTPUTS))
    assert report.counts["compare.real_rows"] >= 2  # the sender test and the receiver test
    assert report.fallbacks == [] and dispatch_warnings == []


# ----------------------------------------------------------------------------- nequix


@pytest.mark.parametrize("name, kind", own_graph_cases(["nequix"]))
def test_nequix_wrapper_equals_nequix_call_on_its_own_graph(name, kind):
    """The wrapper equals Nequix.__call__ on the jraph graph nequix builds and pads itself (as its
    ASE calculator does), energy, forces and stress."""
    needs("nequix")
    pytest.importorskip("matscipy", reason="matscipy is not installed (nequix.data builds its graph with it)")
    import jraph
    from nequix.data import atomic_numbers_to_indices, dict_to_graphstuple, preprocess_graph

    atoms = periodic_system(kind).to_ase()
    graph = dict_to_graphstuple(preprocess_graph(atoms, atomic_numbers_to_indices(list(SPECIES)), CUTOFF, False))
    graph = graph._replace(nodes={**graph.nodes, "positions": jnp.asarray(atoms.positions)},  # float64
                           edges={"shifts": jnp.asarray(graph.edges["shifts"], jnp.float64)},
                           globals={**graph.globals, "cell": jnp.asarray(atoms.cell.array)[None]})
    n, n_edge = int(graph.n_node[0]), int(graph.n_edge[0])
    # unpadded, jraph's masks would take the one graph for padding: zero forces and stress
    graph = jraph.pad_with_graphs(graph, n_node=n + 8, n_edge=n_edge + 8, n_graph=2)
    energy, forces, stress = eqx.filter_jit(f64(nequix_net()))(graph)
    got = one_device(name, kind)
    assert abs(float(got["energy"][0] - energy[0])) <= 1e-10 * abs(float(energy[0]))
    np.testing.assert_allclose(np.asarray(got["forces"]), np.asarray(forces[:n]), rtol=0, atol=1e-10)
    np.testing.assert_allclose(np.asarray(got["stress"]), np.asarray(stress[:1]), rtol=0, atol=1e-10)


def test_nequix_padding_edges_of_zero_length_give_a_nan_stress():
    """nequix's sqrt and normalised harmonics at r = 0: zero padding vectors make the stress NaN,
    the unit vector of the wrapper keeps it finite (and changes no number)."""
    needs("nequix")
    data = periodic_system("cubic")
    raw = jaxdd.compute(NequixModel(nequix_net(), SPECIES, unit_padding=False), data, OUTPUTS)
    assert np.isnan(np.asarray(raw["stress"])).any()
    ref = one_device("nequix", "cubic")
    assert float(raw["energy"][0]) == pytest.approx(float(ref["energy"][0]), rel=1e-14)


@pytest.mark.parametrize("name, grid, kind", cases(["nequix"]))
def test_nequix_distributed_equals_one_device(name, grid, kind):
    needs("nequix")
    got, report, dispatch_warnings = distributed(wrapper(name), periodic_system(kind), grid)
    assert_equal(got, one_device(name, kind))
    assert report.fallbacks == []
    assert dispatch_warnings == []


# ----------------------------------------------------------------------------- docs/porting.md


@pytest.mark.slow
@pytest.mark.parametrize("library", ["mlip", "nequix"])
def test_porting_page_section_runs(library):
    """The ``python mlip`` / ``python nequix`` blocks of docs/porting.md (left out of
    tests/project/test_docs.py, which runs the page's plain ``python`` blocks without either library)."""
    needs(library)
    blocks = re.findall(r"```python %s\n(.*?)```" % library, (ROOT / "docs" / "porting.md").read_text(), re.S)
    assert len(blocks) == 2
    namespace = {}
    for block in blocks:
        exec(compile(block, str(ROOT / "docs" / "porting.md"), "exec"), namespace)


def test_the_wrappers_here_are_the_porting_pages():
    """The wrappers of this file are docs/porting.md's (the test-only switches aside)."""
    text = (ROOT / "docs" / "porting.md").read_text()
    source = Path(__file__).read_text()
    for library, cls in (("mlip", "MlipModel"), ("nequix", "NequixModel")):
        (doc,) = [b for b in re.findall(r"```python %s\n(.*?)```" % library, text, re.S) if f"class {cls}(" in b]
        doc_class = doc[doc.index(f"class {cls}("):]
        here = source[source.index(f"class {cls}("):]
        here = here[:here.index("\n\n\n")]
        for line in doc_class.strip().splitlines():
            assert line.rstrip() in here or _is_doc_only(line), f"{cls}: {line.strip()!r} not in the test's wrapper"


def _is_doc_only(line: str) -> bool:
    # lines the test's copy words differently: the type of nequix's net (imported lazily here)
    return line.strip() in {"net: Nequix", "def __init__(self, net: Nequix, atomic_numbers, dtype=jnp.float64):",
                            "def __init__(self, force_field: ForceField, charge: int = 0, dtype=jnp.float64):"}
