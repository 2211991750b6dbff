"""Small machine-learning interatomic potentials written as plain, single-device JAX.

These are ordinary models in the style of each library (plain ``jax.numpy``, jraph,
e3nn-jax, flax.linen) and deliberately do not import jaxdd: tests run the very same
functions distributed and compare against this single-device reference.

Common contract
---------------
Every model ``<name>`` comes as a pair::

    init_<name>(key, n_species=4) -> params
    <name>(params, vectors, senders, receivers, edge_mask, species, batch_idx, n_systems)
        -> energy [n_systems]

``params`` is a pytree of float arrays (for ``flax_scan`` the flax variables dict
``{"params": ...}``). Inputs:

- ``vectors``: [E, 3] float edge vectors, sender position - receiver position including
  the periodic shift, in Å. Padding edges may hold arbitrary vectors (often exactly
  zero) and have ``edge_mask`` False.
- ``senders``, ``receivers``: [E] int32 node indices. Padding edges hold N (one past the
  last node, out of range). They are only used in out-of-range-safe ways: aggregation
  by ``segment_sum``-style scatters (out-of-range ids are dropped) and gathers
  ``h[senders]`` (clamped by JAX) whose results are always multiplied by the masked
  cutoff envelope.
- ``edge_mask``: [E] bool, True for real edges.
- ``species``: [N] int32 in [0, n_species); padding nodes hold 0.
- ``batch_idx``: [N] int32 system of each node; padding nodes hold ``n_systems`` (out of
  range, dropped by the per-system sums).
- ``n_systems``: python int (static).

All models use the cutoff ``CUTOFF`` = 5.0 Å with a smooth cosine envelope that goes
to zero (with zero slope) at the cutoff, and a safe edge length for masked edges so that
gradients with respect to ``vectors`` are never NaN, also for zero padding vectors.
Energies follow the dtype of ``vectors`` (nothing hard-codes float32; under
``jax_enable_x64`` the parameters are float64 too) and are O(1) per atom. A layer's output
at one atom depends on atoms up to ``n_layers * CUTOFF`` away.

Models (``MODELS[name] = (init_fn, fn, n_layers)``):

- ``mpnn_segment_sum`` (3 layers): Gaussian radial basis x MLP filter times an MLP of
  the sender features, aggregated with ``jax.ops.segment_sum`` over receivers; residual
  MLP node update; per-atom readout MLP summed per system with ``jax.ops.segment_sum``.
- ``mpnn_jraph`` (3 layers): the same architecture around a ``jraph.GraphsTuple``,
  aggregating with ``jraph.segment_sum``; readout by ``jraph.segment_sum`` over batch_idx.
- ``e3nn_equivariant`` (2 layers): e3nn-jax; spherical harmonics (lmax 2) of the edge
  vectors, ``tensor_product`` of sender features with them weighted per irrep by a radial
  MLP, ``e3nn.scatter_sum`` aggregation, gated update, scalar readout.
- ``flax_scan`` (3 layers): a ``flax.linen`` module with ``nn.scan`` over 3 identical
  message-passing layers (parameters stacked along a leading axis).
- ``custom_vjp_mpnn`` (2 layers): like ``mpnn_segment_sum`` but its cutoff envelope and
  its message/update nonlinearity (shifted softplus) are ``jax.custom_vjp`` functions
  with hand-written backward passes.
- ``sum_readout`` (2 layers): single system only; the energy is
  ``jnp.sum(atomic * node_mask)`` over all atoms, returned with shape [1].
- ``mpnn_mol_sum`` (2 layers): per-system energies through
  ``plain_helpers.mol_sum`` (a cumulative sum over atoms assumed contiguous and ordered
  per system), called through the module attribute so tests can monkeypatch it.

Run ``python tests/plain_models.py`` for a self-check (finite energies and forces,
padding invariance, rotation invariance, finite-difference forces, batching).
"""

import math

import e3nn_jax as e3nn
import flax.linen as nn
import jax
import jax.numpy as jnp
import jraph

import plain_helpers

CUTOFF = 5.0
N_RBF = 8
FEATURES = 16
# Aggregated messages are divided by a constant so that node features stay O(1) (as
# NequIP/MACE do with avg_num_neighbors). About 30 atoms lie within 5 Å at liquid-like
# densities and messages of mixed sign add up like a random walk, so ~sqrt(30).
MESSAGE_NORM = 5.0


# --------------------------------------------------------------------------------------
# Shared plain-JAX building blocks
# --------------------------------------------------------------------------------------


def _dense_init(key, fan_in, fan_out):
    return {
        "w": jax.random.normal(key, (fan_in, fan_out)) / math.sqrt(fan_in),
        "b": jnp.zeros((fan_out,)),
    }


def _mlp_init(key, sizes):
    keys = jax.random.split(key, len(sizes) - 1)
    return [_dense_init(k, a, b) for k, a, b in zip(keys, sizes[:-1], sizes[1:])]


def _mlp(layers, x, act=jax.nn.silu):
    """Dense layers with ``act`` between them (none after the last)."""
    for i, layer in enumerate(layers):
        x = x @ layer["w"] + layer["b"]
        if i < len(layers) - 1:
            x = act(x)
    return x


def edge_lengths(vectors, edge_mask):
    """|vectors| for real edges, 0 for padding edges; NaN-free gradients for both."""
    r2 = jnp.sum(vectors * vectors, axis=-1)
    safe = jnp.where(edge_mask, r2, 1.0)
    return jnp.where(edge_mask, jnp.sqrt(safe), 0.0)


def cosine_cutoff(r, cutoff=CUTOFF):
    """0.5 (cos(pi r / rc) + 1) inside the cutoff, 0 outside; C1 at the cutoff."""
    return jnp.where(r < cutoff, 0.5 * (jnp.cos(jnp.pi * r / cutoff) + 1.0), 0.0)


def gaussian_rbf(r, n=N_RBF, cutoff=CUTOFF):
    """[E] -> [E, n] Gaussians centred on a uniform grid over [0, cutoff]."""
    centers = jnp.linspace(0.0, cutoff, n, dtype=r.dtype)
    width = cutoff / (n - 1)
    return jnp.exp(-0.5 * ((r[:, None] - centers) / width) ** 2)


def _init_mpnn(key, n_species, n_layers):
    k_embed, k_layers, k_readout = jax.random.split(key, 3)
    layers = []
    for k in jax.random.split(k_layers, n_layers):
        k_filter, k_message, k_update = jax.random.split(k, 3)
        layers.append(
            {
                "filter": _mlp_init(k_filter, [N_RBF, FEATURES, FEATURES]),
                "message": _mlp_init(k_message, [FEATURES, FEATURES]),
                "update": _mlp_init(k_update, [FEATURES, FEATURES, FEATURES]),
            }
        )
    return {
        "embed": jax.random.normal(k_embed, (n_species, FEATURES)),
        "layers": layers,
        "readout": _mlp_init(k_readout, [FEATURES, FEATURES, 1]),
    }


def _interaction(p, h, rbf, envelope, senders, receivers, act=jax.nn.silu):
    """One message-passing layer: h_i += MLP(sum_j filter(r_ij) * act(W h_j) * fc(r_ij))."""
    n_nodes = h.shape[0]
    messages = act(_mlp(p["message"], h[senders])) * _mlp(p["filter"], rbf, act)
    messages = messages * envelope[:, None]  # zero on padding edges
    aggregated = jax.ops.segment_sum(messages, receivers, num_segments=n_nodes)
    return h + _mlp(p["update"], aggregated / MESSAGE_NORM, act)


def _atomic_energies(
    params, vectors, senders, receivers, edge_mask, species, act=jax.nn.silu, cutoff_fn=cosine_cutoff
):
    r = edge_lengths(vectors, edge_mask)
    envelope = jnp.where(edge_mask, cutoff_fn(r), 0.0)
    rbf = gaussian_rbf(r)
    h = params["embed"][species]
    for p in params["layers"]:
        h = _interaction(p, h, rbf, envelope, senders, receivers, act)
    return _mlp(params["readout"], h, act)[:, 0]


# --------------------------------------------------------------------------------------
# 1. mpnn_segment_sum
# --------------------------------------------------------------------------------------


def init_mpnn_segment_sum(key, n_species=4):
    return _init_mpnn(key, n_species, n_layers=3)


def mpnn_segment_sum(params, vectors, senders, receivers, edge_mask, species, batch_idx, n_systems):
    atomic = _atomic_energies(params, vectors, senders, receivers, edge_mask, species)
    return jax.ops.segment_sum(atomic, batch_idx, num_segments=n_systems)


# --------------------------------------------------------------------------------------
# 2. mpnn_jraph
# --------------------------------------------------------------------------------------


def init_mpnn_jraph(key, n_species=4):
    return _init_mpnn(key, n_species, n_layers=3)


def _jraph_interaction(p, graph):
    nodes = graph.nodes
    edges = graph.edges
    sent = nodes[graph.senders]
    messages = jax.nn.silu(_mlp(p["message"], sent)) * _mlp(p["filter"], edges["rbf"])
    messages = messages * edges["envelope"][:, None]
    aggregated = jraph.segment_sum(messages, graph.receivers, num_segments=nodes.shape[0])
    return graph._replace(nodes=nodes + _mlp(p["update"], aggregated / MESSAGE_NORM))


def mpnn_jraph(params, vectors, senders, receivers, edge_mask, species, batch_idx, n_systems):
    r = edge_lengths(vectors, edge_mask)
    graph = jraph.GraphsTuple(
        nodes=params["embed"][species],
        edges={"rbf": gaussian_rbf(r), "envelope": jnp.where(edge_mask, cosine_cutoff(r), 0.0)},
        senders=senders,
        receivers=receivers,
        globals=None,
        n_node=jnp.array([species.shape[0]]),
        n_edge=jnp.array([senders.shape[0]]),
    )
    for p in params["layers"]:
        graph = _jraph_interaction(p, graph)
    atomic = _mlp(params["readout"], graph.nodes)[:, 0]
    return jraph.segment_sum(atomic, batch_idx, num_segments=n_systems)


# --------------------------------------------------------------------------------------
# 3. e3nn_equivariant
# --------------------------------------------------------------------------------------

E3NN_SCALARS = 8
E3NN_VECTORS = 4
E3NN_LAYERS = 2
E3NN_SH_IRREPS = e3nn.Irreps("0e + 1o + 2e")
E3NN_HIDDEN = e3nn.Irreps(f"{E3NN_SCALARS}x0e + {E3NN_VECTORS}x1o")
# Before the gate: scalars, then one gate scalar per vector, then the vectors.
E3NN_GATE_INPUT = e3nn.Irreps(f"{E3NN_SCALARS}x0e + {E3NN_VECTORS}x0e + {E3NN_VECTORS}x1o")
E3NN_MESSAGE_FILTER = "0e + 1o"


def _e3nn_layer_irreps():
    """(input irreps, tensor-product irreps) of each interaction layer."""
    irreps_in = e3nn.Irreps(f"{E3NN_SCALARS}x0e")
    out = []
    for _ in range(E3NN_LAYERS):
        irreps_tp = e3nn.tensor_product(irreps_in, E3NN_SH_IRREPS, filter_ir_out=E3NN_MESSAGE_FILTER)
        out.append((irreps_in, irreps_tp))
        irreps_in = E3NN_HIDDEN
    return out


def _init_functional_linear(key, linear):
    keys = jax.random.split(key, len(linear.instructions))
    return [ins.weight_std * jax.random.normal(k, ins.path_shape) for k, ins in zip(keys, linear.instructions)]


def init_e3nn_equivariant(key, n_species=4):
    k_embed, k_layers, k_readout = jax.random.split(key, 3)
    layers = []
    for k, (irreps_in, irreps_tp) in zip(jax.random.split(k_layers, E3NN_LAYERS), _e3nn_layer_irreps()):
        k_radial, k_msg, k_self = jax.random.split(k, 3)
        layers.append(
            {
                "radial": _mlp_init(k_radial, [N_RBF, FEATURES, irreps_tp.num_irreps]),
                "linear_messages": _init_functional_linear(
                    k_msg, e3nn.FunctionalLinear(irreps_tp, E3NN_GATE_INPUT)
                ),
                "linear_self": _init_functional_linear(
                    k_self, e3nn.FunctionalLinear(irreps_in, E3NN_GATE_INPUT)
                ),
            }
        )
    return {
        "embed": jax.random.normal(k_embed, (n_species, E3NN_SCALARS)),
        "layers": layers,
        "readout": _mlp_init(k_readout, [E3NN_SCALARS, FEATURES, 1]),
    }


def e3nn_equivariant(params, vectors, senders, receivers, edge_mask, species, batch_idx, n_systems):
    n_nodes = species.shape[0]
    r = edge_lengths(vectors, edge_mask)
    envelope = jnp.where(edge_mask, cosine_cutoff(r), 0.0)
    radial_basis = e3nn.soft_one_hot_linspace(
        r, start=0.0, end=CUTOFF, number=N_RBF, basis="smooth_finite", cutoff=True
    )
    sh = e3nn.spherical_harmonics(E3NN_SH_IRREPS, vectors, normalize=True, normalization="component")

    h = e3nn.IrrepsArray(f"{E3NN_SCALARS}x0e", params["embed"][species])
    for p, (irreps_in, irreps_tp) in zip(params["layers"], _e3nn_layer_irreps()):
        messages = e3nn.tensor_product(h[senders], sh, filter_ir_out=E3NN_MESSAGE_FILTER)
        # One radial weight per irrep of the message, vanishing at the cutoff and on padding.
        weights = _mlp(p["radial"], radial_basis) * envelope[:, None]
        messages = messages * weights
        aggregated = e3nn.scatter_sum(messages, dst=receivers, output_size=n_nodes) / MESSAGE_NORM

        linear_messages = e3nn.FunctionalLinear(irreps_tp, E3NN_GATE_INPUT)
        linear_self = e3nn.FunctionalLinear(irreps_in, E3NN_GATE_INPUT)
        pre = e3nn.vmap(lambda x: linear_messages(p["linear_messages"], x))(aggregated)
        pre = pre + e3nn.vmap(lambda x: linear_self(p["linear_self"], x))(h)
        h = e3nn.gate(pre, even_act=jax.nn.silu, even_gate_act=jax.nn.sigmoid, odd_act=jnp.tanh)

    scalars = h.filter(keep="0e").array
    atomic = _mlp(params["readout"], scalars)[:, 0]
    return e3nn.scatter_sum(atomic, dst=batch_idx, output_size=n_systems, mode="drop")


# --------------------------------------------------------------------------------------
# 4. flax_scan
# --------------------------------------------------------------------------------------


class ScanInteraction(nn.Module):
    """One message-passing layer, written for ``nn.scan`` as ``(carry, *broadcast) -> (carry, None)``."""

    features: int
    dtype: object = None

    @nn.compact
    def __call__(self, h, rbf, envelope, senders, receivers):
        dense = lambda n, name: nn.Dense(n, dtype=self.dtype, param_dtype=self.dtype, name=name)  # noqa: E731
        filt = dense(self.features, "filter_out")(nn.silu(dense(self.features, "filter_in")(rbf)))
        messages = nn.silu(dense(self.features, "message")(h[senders])) * filt * envelope[:, None]
        aggregated = jax.ops.segment_sum(messages, receivers, num_segments=h.shape[0])
        update = nn.silu(dense(self.features, "update_in")(aggregated / MESSAGE_NORM))
        return h + dense(self.features, "update_out")(update), None


class FlaxScanMPNN(nn.Module):
    n_species: int = 4
    features: int = FEATURES
    n_layers: int = 3

    @nn.compact
    def __call__(self, vectors, senders, receivers, edge_mask, species, batch_idx, n_systems):
        dtype = vectors.dtype  # compute (and, at init, parameter) dtype follows the inputs
        r = edge_lengths(vectors, edge_mask)
        envelope = jnp.where(edge_mask, cosine_cutoff(r), 0.0)
        rbf = gaussian_rbf(r)

        h = nn.Embed(
            self.n_species,
            self.features,
            dtype=dtype,
            param_dtype=dtype,
            embedding_init=nn.initializers.normal(1.0),
            name="species_embedding",
        )(species)
        ScanStack = nn.scan(
            ScanInteraction,
            variable_axes={"params": 0},
            split_rngs={"params": True},
            in_axes=nn.broadcast,
            length=self.n_layers,
        )
        h, _ = ScanStack(self.features, dtype=dtype, name="interactions")(h, rbf, envelope, senders, receivers)

        x = nn.silu(nn.Dense(self.features, dtype=dtype, param_dtype=dtype, name="readout_in")(h))
        atomic = nn.Dense(1, dtype=dtype, param_dtype=dtype, name="readout_out")(x)[:, 0]
        # n_systems is a python int attribute of the call, never traced.
        return jax.ops.segment_sum(atomic, batch_idx, num_segments=n_systems)


def init_flax_scan(key, n_species=4):
    # Parameter shapes do not depend on the graph size: a one-edge dummy graph suffices.
    vectors = jnp.zeros((1, 3))
    index = jnp.zeros((1,), jnp.int32)
    return FlaxScanMPNN(n_species=n_species).init(
        key, vectors, index, index, jnp.zeros((1,), bool), index, index, 1
    )


def flax_scan(params, vectors, senders, receivers, edge_mask, species, batch_idx, n_systems):
    n_species = params["params"]["species_embedding"]["embedding"].shape[0]
    return FlaxScanMPNN(n_species=n_species).apply(
        params, vectors, senders, receivers, edge_mask, species, batch_idx, n_systems
    )


# --------------------------------------------------------------------------------------
# 5. custom_vjp_mpnn
# --------------------------------------------------------------------------------------


@jax.custom_vjp
def shifted_softplus(x):
    """log(1 + e^x) - log 2 (SchNet's nonlinearity), with a hand-written backward."""
    return jnp.logaddexp(x, 0.0) - math.log(2.0)


def _shifted_softplus_fwd(x):
    return shifted_softplus(x), x


def _shifted_softplus_bwd(x, g):
    return (g * jax.nn.sigmoid(x),)


shifted_softplus.defvjp(_shifted_softplus_fwd, _shifted_softplus_bwd)


@jax.custom_vjp
def custom_cosine_cutoff(r):
    """Same values as ``cosine_cutoff``, with a hand-written backward."""
    return jnp.where(r < CUTOFF, 0.5 * (jnp.cos(jnp.pi * r / CUTOFF) + 1.0), 0.0)


def _custom_cosine_cutoff_fwd(r):
    return custom_cosine_cutoff(r), r


def _custom_cosine_cutoff_bwd(r, g):
    slope = jnp.where(r < CUTOFF, -0.5 * (jnp.pi / CUTOFF) * jnp.sin(jnp.pi * r / CUTOFF), 0.0)
    return (g * slope,)


custom_cosine_cutoff.defvjp(_custom_cosine_cutoff_fwd, _custom_cosine_cutoff_bwd)


def init_custom_vjp_mpnn(key, n_species=4):
    return _init_mpnn(key, n_species, n_layers=2)


def custom_vjp_mpnn(params, vectors, senders, receivers, edge_mask, species, batch_idx, n_systems):
    atomic = _atomic_energies(
        params,
        vectors,
        senders,
        receivers,
        edge_mask,
        species,
        act=shifted_softplus,
        cutoff_fn=custom_cosine_cutoff,
    )
    return jax.ops.segment_sum(atomic, batch_idx, num_segments=n_systems)


# --------------------------------------------------------------------------------------
# 6. sum_readout (single system)
# --------------------------------------------------------------------------------------


def init_sum_readout(key, n_species=4):
    return _init_mpnn(key, n_species, n_layers=2)


def sum_readout(params, vectors, senders, receivers, edge_mask, species, batch_idx, n_systems):
    """Single-system model: the total energy is a plain sum over all (real) atoms."""
    atomic = _atomic_energies(params, vectors, senders, receivers, edge_mask, species)
    node_mask = batch_idx < n_systems
    energy = jnp.sum(atomic * node_mask)
    return energy[None]


# --------------------------------------------------------------------------------------
# 7. mpnn_mol_sum
# --------------------------------------------------------------------------------------


def init_mpnn_mol_sum(key, n_species=4):
    return _init_mpnn(key, n_species, n_layers=2)


def mpnn_mol_sum(params, vectors, senders, receivers, edge_mask, species, batch_idx, n_systems):
    atomic = _atomic_energies(params, vectors, senders, receivers, edge_mask, species)
    atomic = jnp.where(batch_idx < n_systems, atomic, 0.0)
    # Through the module attribute on purpose: tests monkeypatch plain_helpers.mol_sum.
    return plain_helpers.mol_sum(atomic, batch_idx, n_systems)


MODELS = {
    "mpnn_segment_sum": (init_mpnn_segment_sum, mpnn_segment_sum, 3),
    "mpnn_jraph": (init_mpnn_jraph, mpnn_jraph, 3),
    "e3nn_equivariant": (init_e3nn_equivariant, e3nn_equivariant, E3NN_LAYERS),
    "flax_scan": (init_flax_scan, flax_scan, 3),
    "custom_vjp_mpnn": (init_custom_vjp_mpnn, custom_vjp_mpnn, 2),
    "sum_readout": (init_sum_readout, sum_readout, 2),
    "mpnn_mol_sum": (init_mpnn_mol_sum, mpnn_mol_sum, 2),
}

# Models whose output is correct for several systems in one batch.
MULTI_SYSTEM_MODELS = tuple(name for name in MODELS if name != "sum_readout")


# --------------------------------------------------------------------------------------
# Self-check
# --------------------------------------------------------------------------------------


def _self_check():  # pragma: no cover - run by hand: python tests/plain_models.py
    import itertools
    import time

    import numpy as np
    from jax.test_util import check_grads

    jax.config.update("jax_enable_x64", True)
    rng = np.random.default_rng(0)

    def random_system(n_atoms, box, n_species=4):
        pos = rng.uniform(0.0, box, size=(n_atoms, 3))
        cell = np.eye(3) * box
        species = rng.integers(0, n_species, size=n_atoms)
        return pos, cell, species

    def neighbours(pos, cell):
        """All periodic images within CUTOFF (brute force; box > CUTOFF, one shell)."""
        assert np.all(np.diag(cell) > CUTOFF)
        senders, receivers, shifts = [], [], []
        for n in itertools.product([-1, 0, 1], repeat=3):
            shift = np.asarray(n, float) @ cell
            d = pos[None, :, :] - pos[:, None, :] + shift  # d[i, j] = pos[j] - pos[i] + shift
            dist = np.linalg.norm(d, axis=-1)
            ok = dist < CUTOFF
            if n == (0, 0, 0):
                np.fill_diagonal(ok, False)
            i, j = np.nonzero(ok)
            receivers.append(i)
            senders.append(j)
            shifts.append(np.broadcast_to(shift, (len(i), 3)))
        return np.concatenate(senders), np.concatenate(receivers), np.concatenate(shifts)

    def batch(systems, n_pad_nodes=1, n_pad_edges=5):
        """Concatenate systems [(pos, cell, species)] into one padded graph."""
        pos, species, batch_idx, senders, receivers, shifts = [], [], [], [], [], []
        offset = 0
        for s, (p, cell, z) in enumerate(systems):
            snd, rcv, sh = neighbours(p, cell)
            pos.append(p)
            species.append(z)
            batch_idx.append(np.full(len(p), s))
            senders.append(snd + offset)
            receivers.append(rcv + offset)
            shifts.append(sh)
            offset += len(p)
        n_systems = len(systems)
        n_nodes = offset + n_pad_nodes
        n_real_edges = sum(len(x) for x in senders)
        pos.append(np.zeros((n_pad_nodes, 3)))
        species.append(np.zeros(n_pad_nodes, int))
        batch_idx.append(np.full(n_pad_nodes, n_systems))
        senders.append(np.full(n_pad_edges, n_nodes))
        receivers.append(np.full(n_pad_edges, n_nodes))
        shifts.append(np.zeros((n_pad_edges, 3)))
        edge_mask = np.arange(n_real_edges + n_pad_edges) < n_real_edges
        return dict(
            pos=jnp.asarray(np.concatenate(pos)),
            shifts=jnp.asarray(np.concatenate(shifts)),
            senders=jnp.asarray(np.concatenate(senders), jnp.int32),
            receivers=jnp.asarray(np.concatenate(receivers), jnp.int32),
            edge_mask=jnp.asarray(edge_mask),
            species=jnp.asarray(np.concatenate(species), jnp.int32),
            batch_idx=jnp.asarray(np.concatenate(batch_idx), jnp.int32),
            n_systems=n_systems,
        )

    def edge_vectors(g, pos, shifts, pad_vectors=None):
        v = pos[g["senders"]] - pos[g["receivers"]] + shifts
        pad = jnp.zeros_like(v) if pad_vectors is None else pad_vectors
        return jnp.where(g["edge_mask"][:, None], v, pad)

    def args(g, vectors):
        return (vectors, g["senders"], g["receivers"], g["edge_mask"], g["species"], g["batch_idx"])

    def rotation_matrix(seed):
        q, r = np.linalg.qr(np.random.default_rng(seed).normal(size=(3, 3)))
        q = q * np.sign(np.diag(r))
        return jnp.asarray(q * np.sign(np.linalg.det(q)))

    # custom_vjp backward passes against numerical differentiation.
    x = jnp.linspace(-4.0, 6.0, 41)
    check_grads(shifted_softplus, (x,), order=2, modes=["rev"])
    check_grads(custom_cosine_cutoff, (jnp.linspace(0.1, 4.9, 25),), order=2, modes=["rev"])
    np.testing.assert_allclose(jax.grad(lambda t: custom_cosine_cutoff(t).sum())(x),
                               jax.grad(lambda t: cosine_cutoff(t).sum())(x), rtol=1e-12, atol=1e-15)
    print("custom_vjp backwards (shifted_softplus, custom_cosine_cutoff): check_grads order 2 OK")

    system_a = random_system(40, 9.0)
    system_b = random_system(30, 8.0)
    g_a = batch([system_a])
    g_a_nopad = batch([system_a], n_pad_nodes=0, n_pad_edges=0)
    g_ab = batch([system_a, system_b])
    n_edges = int(g_a["edge_mask"].sum())
    print(f"system A: 40 atoms, {n_edges} edges (+5 padding edges, +1 padding node); "
          f"system B: 30 atoms; batch A+B: {int(g_ab['edge_mask'].sum())} edges")

    rot = rotation_matrix(1)
    garbage = jnp.asarray(rng.normal(size=g_a["shifts"].shape) * 2.0)
    direction = jnp.asarray(rng.normal(size=g_a["pos"].shape)).at[-1].set(0.0)

    header = (f"{'model':18s} {'E/atom':>9s} {'|F|max':>7s} {'pad':>8s} {'garbage':>8s} "
              f"{'rot E':>8s} {'rot F':>8s} {'FD F':>8s} {'batch':>8s} {'f32->':>8s} {'time':>6s}")
    print(header)
    print("-" * len(header))
    failures = []
    for name, (init_fn, fn, _) in MODELS.items():
        t0 = time.perf_counter()
        params = init_fn(jax.random.PRNGKey(0))
        energy = jax.jit(fn, static_argnums=7)

        def total_energy(pos, shifts, g, pad_vectors=None):
            return energy(params, *args(g, edge_vectors(g, pos, shifts, pad_vectors)), g["n_systems"]).sum()

        grad_pos = jax.grad(total_energy)

        e = energy(params, *args(g_a, edge_vectors(g_a, g_a["pos"], g_a["shifts"])), 1)
        assert e.shape == (1,) and e.dtype == jnp.float64, (e.shape, e.dtype)
        e0 = float(e[0])
        forces = -grad_pos(g_a["pos"], g_a["shifts"], g_a)
        # Gradient w.r.t. the vectors themselves, zero padding vectors included.
        g_vec = jax.grad(lambda v: energy(params, *args(g_a, v), 1).sum())(
            edge_vectors(g_a, g_a["pos"], g_a["shifts"]))
        finite = bool(np.isfinite(e0) and jnp.all(jnp.isfinite(forces)) and jnp.all(jnp.isfinite(g_vec)))
        pad_grad_zero = bool(jnp.all(g_vec[~g_a["edge_mask"]] == 0.0))

        def rel(a, b):
            return float(jnp.max(jnp.abs(a - b)) / max(float(jnp.max(jnp.abs(b))), 1e-300))

        e_nopad = total_energy(g_a_nopad["pos"], g_a_nopad["shifts"], g_a_nopad)
        d_pad = rel(e_nopad, e0)
        d_garbage = rel(total_energy(g_a["pos"], g_a["shifts"], g_a, garbage), e0)
        d_rot = rel(total_energy(g_a["pos"] @ rot.T, g_a["shifts"] @ rot.T, g_a), e0)
        forces_rot = -grad_pos(g_a["pos"] @ rot.T, g_a["shifts"] @ rot.T, g_a)
        d_rot_f = rel(forces_rot, forces @ rot.T)
        eps = 1e-5
        fd = (total_energy(g_a["pos"] + eps * direction, g_a["shifts"], g_a)
              - total_energy(g_a["pos"] - eps * direction, g_a["shifts"], g_a)) / (2 * eps)
        d_fd = abs(float(fd) + float(jnp.sum(forces * direction))) / max(abs(float(fd)), 1e-12)

        if name in MULTI_SYSTEM_MODELS:
            e_ab = energy(params, *args(g_ab, edge_vectors(g_ab, g_ab["pos"], g_ab["shifts"])), 2)
            g_b = batch([system_b])
            e_b = energy(params, *args(g_b, edge_vectors(g_b, g_b["pos"], g_b["shifts"])), 1)
            d_batch = rel(e_ab, jnp.array([e0, float(e_b[0])]))
        else:
            d_batch = float("nan")

        vec32 = edge_vectors(g_a, g_a["pos"], g_a["shifts"]).astype(jnp.float32)
        e32 = energy(params, *args(g_a, vec32), 1)
        dtype32 = str(e32.dtype)

        ok = (finite and pad_grad_zero and d_pad < 1e-12 and d_garbage < 1e-12 and d_rot < 1e-10
              and d_rot_f < 1e-9 and d_fd < 1e-6 and (np.isnan(d_batch) or d_batch < 1e-12)
              and bool(jnp.isfinite(e32).all()))
        if not ok:
            failures.append(name)
        print(f"{name:18s} {e0 / 40:9.4f} {float(jnp.max(jnp.abs(forces))):7.3f} {d_pad:8.1e} "
              f"{d_garbage:8.1e} {d_rot:8.1e} {d_rot_f:8.1e} {d_fd:8.1e} {d_batch:8.1e} "
              f"{dtype32:>8s} {time.perf_counter() - t0:6.1f}" + ("" if ok else "  FAIL"))

    print("columns: relative differences (pad: unpadded vs padded; garbage: random padding vectors; "
          "rot: rotated energy / forces; FD F: central difference vs forces; batch: A+B batch vs "
          "separate); f32->: output dtype for float32 vectors")
    if failures:
        raise SystemExit(f"FAILED: {failures}")
    print("all checks passed")


if __name__ == "__main__":
    _self_check()
