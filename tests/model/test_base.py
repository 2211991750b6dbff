"""Specification of jaxdd.model.base: ModelConfig, NeighborConfig, ModelOutputs and BaseModel,
and the promise that a wrapper's parameters are traced leaves (equinox and flax.nnx)."""

import math
from collections.abc import Mapping

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxdd
from jaxdd import AtomicData, Batch, BaseModel, ModelConfig, ModelOutputs, NeighborConfig, NeighborListFormat
from jaxdd.engine.driver import energy_and_derivatives
from jaxdd.models.lj import LennardJones
from jaxdd.data.segments import per_system_sum
from jaxdd.data.systems import fcc_lattice

CUTOFF = 2.5


def config(**kw):
    kw.setdefault("outputs", frozenset({"energy", "forces", "stress"}))
    return ModelConfig(**kw)


# --------------------------------------------------------------------------- ModelConfig


def test_active_outputs_default_to_outputs():
    cfg = ModelConfig(outputs={"energy", "forces"}, autograd_outputs={"forces"}, autograd_inputs={"positions"})
    assert cfg.active_outputs == frozenset({"energy", "forces"})


def test_active_outputs_outside_outputs_are_refused_by_name():
    with pytest.raises(ValueError, match="dipole"):
        config(active_outputs={"energy", "dipole"})


def test_autograd_outputs_outside_outputs_are_refused_by_name():
    with pytest.raises(ValueError, match="stress"):
        ModelConfig(outputs={"energy", "forces"}, autograd_outputs={"forces", "stress"},
                    autograd_inputs={"positions", "cell"})


def test_autograd_outputs_other_than_forces_and_stress_are_refused():
    with pytest.raises(ValueError, match="hessian"):
        ModelConfig(outputs={"energy", "hessian"}, autograd_outputs={"hessian"}, autograd_inputs={"positions"})


def test_autograd_outputs_without_energy_are_refused():
    with pytest.raises(ValueError, match="'energy'"):
        ModelConfig(outputs={"forces"}, autograd_outputs={"forces"}, autograd_inputs={"positions"})


def test_autograd_forces_need_positions_among_the_autograd_inputs():
    with pytest.raises(ValueError, match="positions"):
        config(autograd_outputs={"forces"}, autograd_inputs={"cell"})


def test_autograd_stress_needs_the_cell_among_the_autograd_inputs():
    with pytest.raises(ValueError, match="cell"):
        config(autograd_outputs={"forces", "stress"}, autograd_inputs={"positions"})


def test_outputs_given_as_a_bare_string_are_refused():
    with pytest.raises(ValueError, match="string"):
        ModelConfig(outputs="energy")


def test_check_outputs_refuses_unknown_keys_listing_the_available_ones():
    cfg = config()
    with pytest.raises(ValueError) as info:
        cfg.check_outputs(("energy", "dipole"))
    message = str(info.value)
    assert "dipole" in message
    assert "['energy', 'forces', 'stress']" in message


# ------------------------------------------------------------------------ NeighborConfig


@pytest.mark.parametrize("cutoff", [0.0, -1.0, math.nan, math.inf, True])
def test_neighbor_config_refuses_a_cutoff_that_is_not_positive_and_finite(cutoff):
    with pytest.raises(ValueError, match="cutoff"):
        NeighborConfig(cutoff=cutoff)


@pytest.mark.parametrize("cutoff", [np.float32(2.5), np.float64(2.5), np.int64(3)])
def test_neighbor_config_accepts_numpy_scalars_as_python_floats(cutoff):
    config = NeighborConfig(cutoff=cutoff)
    assert type(config.cutoff) is float and config.cutoff == float(cutoff)


@pytest.mark.parametrize("max_neighbors", [0, 2.5, True, "8"])
def test_neighbor_config_refuses_a_max_neighbors_that_is_not_a_positive_integer(max_neighbors):
    with pytest.raises(ValueError, match="max_neighbors"):
        NeighborConfig(cutoff=CUTOFF, max_neighbors=max_neighbors)


def test_neighbor_config_refuses_a_negative_skin():
    with pytest.raises(ValueError, match="skin"):
        NeighborConfig(cutoff=CUTOFF, skin=-0.1)


def test_search_cutoff_is_cutoff_plus_skin():
    assert NeighborConfig(cutoff=CUTOFF, skin=0.3).search_cutoff == pytest.approx(2.8, rel=1e-15)


@pytest.mark.parametrize(
    "given, expected",
    [
        (NeighborListFormat.COO, NeighborListFormat.COO),
        (NeighborListFormat.MATRIX, NeighborListFormat.MATRIX),
        ("coo", NeighborListFormat.COO),
        ("matrix", NeighborListFormat.MATRIX),
    ],
)
def test_neighbor_config_format_accepts_the_enum_or_its_string_value(given, expected):
    assert NeighborConfig(cutoff=CUTOFF, format=given).format is expected


# -------------------------------------------------------------------------- ModelOutputs


def outputs():
    return ModelOutputs([("forces", jnp.ones((2, 3))), ("energy", jnp.asarray([1.5]))])


def test_model_outputs_is_a_mapping_that_keeps_insertion_order():
    out = outputs()
    assert isinstance(out, Mapping)
    assert list(out) == ["forces", "energy"]
    assert len(out) == 2


def test_model_outputs_refuses_attribute_assignment():
    out = outputs()
    with pytest.raises(AttributeError, match="immutable"):
        out.energy = jnp.zeros(1)


def test_model_outputs_replace_returns_a_new_mapping_and_leaves_the_old_one():
    out = outputs()
    new = out.replace(energy=jnp.asarray([2.0]), stress=jnp.zeros((1, 3, 3)))
    assert new is not out
    assert list(new) == ["forces", "energy", "stress"]
    assert float(new["energy"][0]) == 2.0
    assert list(out) == ["forces", "energy"]
    assert float(out["energy"][0]) == 1.5


def test_model_outputs_pytree_round_trip_keeps_keys_and_order():
    out = outputs()
    leaves, treedef = jax.tree_util.tree_flatten(out)
    back = jax.tree_util.tree_unflatten(treedef, [2 * x for x in leaves])
    assert isinstance(back, ModelOutputs)
    assert list(back) == ["forces", "energy"]
    np.testing.assert_array_equal(back["energy"], [3.0])


def test_jit_can_return_model_outputs():
    @jax.jit
    def f(x):
        return ModelOutputs([("stress", x[:, None, None] * jnp.eye(3)), ("energy", 2 * x)])

    out = f(jnp.asarray([1.0, 2.0]))
    assert isinstance(out, ModelOutputs)
    assert list(out) == ["stress", "energy"]
    np.testing.assert_array_equal(out["energy"], [2.0, 4.0])


def test_missing_key_error_lists_the_available_keys():
    with pytest.raises(KeyError, match=r"'stress'.*\['forces', 'energy'\]"):
        outputs()["stress"]


# ----------------------------------------------------------------------------- BaseModel


class Plain(BaseModel):
    model_config = ModelConfig(outputs=frozenset({"energy"}), neighbor_config=NeighborConfig(cutoff=3.25, skin=0.5))

    def adapt_input(self, data, **kwargs):
        return {}


def test_default_distribution_spec_is_none():
    assert Plain().distribution_spec is None


def test_distributed_setup_is_a_no_op_hook():
    model = Plain()
    before = dict(vars(model))
    assert model.distributed_setup(object()) is None
    assert vars(model) == before


def test_a_wrapper_with_an_inner_model_and_adapt_input_works_through_call():
    class Wrapped(BaseModel):
        model_config = ModelConfig(outputs=frozenset({"energy"}))

        def __init__(self):
            self.model = lambda x, y: {"energy": x * y}

        def adapt_input(self, data, **kwargs):
            return {"x": data["a"], "y": data["b"]}

    out = Wrapped()({"a": 2.0, "b": 3.0})
    assert isinstance(out, ModelOutputs)
    assert out["energy"] == 6.0


class GuideForm(BaseModel):
    """A wrapper as the PyTorch guide writes it: forward(self, data) adapts input and output."""

    model_config = ModelConfig(outputs=frozenset({"energy"}))

    def __init__(self):
        self.model = lambda x, y: {"energy": x * y}
        self.adapted = 0

    def adapt_input(self, data, **kwargs):
        return {"x": data["a"], "y": data["b"]}

    def adapt_output(self, raw, data):
        self.adapted += 1
        return dict(raw)

    def forward(self, data):
        return self.adapt_output(self.model(**self.adapt_input(data)), data)


def test_the_guides_forward_of_data_is_called_with_the_batch_and_adapts_the_output_once():
    model = GuideForm()
    out = model({"a": 2.0, "b": 3.0})
    assert isinstance(out, ModelOutputs) and out["energy"] == 6.0
    assert model.adapted == 1


def test_the_guides_forward_of_data_works_without_an_adapt_input():
    class NoAdapter(BaseModel):
        model_config = ModelConfig(outputs=frozenset({"energy"}))

        def forward(self, data):
            return {"energy": data["a"] + 1.0}

    assert NoAdapter()({"a": 2.0})["energy"] == 3.0


def test_a_forward_of_one_input_named_as_adapt_input_returns_it_takes_it_by_keyword():
    class OneInput(BaseModel):
        model_config = ModelConfig(outputs=frozenset({"energy"}))

        def adapt_input(self, data, **kwargs):
            return {"x": data["a"] * 10.0}

        def forward(self, x):
            return {"energy": x}

    assert OneInput()({"a": 2.0})["energy"] == 20.0


def test_a_forward_that_cannot_take_the_adapted_inputs_is_refused_showing_both_forms():
    class Mismatch(BaseModel):
        model_config = ModelConfig(outputs=frozenset({"energy"}))

        def adapt_input(self, data, **kwargs):
            return {"positions": data["a"]}

        def forward(self, coords, species):
            return {"energy": coords}

    with pytest.raises(TypeError, match=r"Mismatch.forward\(coords, species\) cannot take .*\['positions'\].*"
                                        r"forward\(self, \*\*inputs\).*forward\(self, data\)"):
        Mismatch()({"a": 2.0})


def test_a_wrapper_with_neither_forward_nor_model_is_refused_naming_its_class():
    class Neither(BaseModel):
        model_config = ModelConfig(outputs=frozenset({"energy"}))

        def adapt_input(self, data, **kwargs):
            return {}

    with pytest.raises(NotImplementedError, match="Neither"):
        Neither()(None)


def test_a_wrapper_whose_model_is_not_callable_is_refused_naming_its_class():
    class NotCallable(BaseModel):
        model_config = ModelConfig(outputs=frozenset({"energy"}))
        model = 3.0

        def adapt_input(self, data, **kwargs):
            return {}

    with pytest.raises(NotImplementedError, match="NotCallable"):
        NotCallable()(None)


def test_a_wrapper_without_adapt_input_is_refused_naming_its_class():
    class NoAdapter(BaseModel):
        model_config = ModelConfig(outputs=frozenset({"energy"}))

    with pytest.raises(NotImplementedError, match="NoAdapter"):
        NoAdapter()(None)


def test_cutoff_reads_the_neighbor_config():
    assert Plain().cutoff == 3.25


def test_cutoff_is_none_without_a_neighbor_config():
    class NoNeighbors(Plain):
        model_config = ModelConfig(outputs=frozenset({"energy"}))

    assert NoNeighbors().cutoff is None


# ------------------------------------------------- parameters are traced: equinox (LJ)


def lj_system():
    atoms = fcc_lattice(3, 1.6796)
    atoms.rattle(0.05, seed=3)
    return AtomicData.from_ase(atoms)


LJ_DATA = lj_system()
LJ_CAPACITY = jaxdd.neighbor_capacity(LJ_DATA.positions, LJ_DATA.cell, LJ_DATA.pbc, cutoff=CUTOFF)
LJ_TRACES = []


class CountingLJ(LennardJones):
    """LennardJones that records every time its forward pass is traced."""

    def forward(self, **inputs):
        LJ_TRACES.append(1)
        return super().forward(**inputs)


def with_epsilon(model, epsilon):
    # A float64 array, as the constructor stores: a weakly typed scalar would be another type.
    return eqx.tree_at(lambda m: m.epsilon, model, jnp.asarray(epsilon, jnp.float64))


def lj_run(model):
    return jaxdd.compute(model, LJ_DATA, ("energy", "forces"), capacity=LJ_CAPACITY)


def test_lj_energy_and_forces_scale_exactly_with_epsilon():
    model = CountingLJ(1.0, 1.0, CUTOFF)
    one = lj_run(model)
    two = lj_run(with_epsilon(model, 2.0))
    np.testing.assert_array_equal(np.asarray(two["energy"]), 2 * np.asarray(one["energy"]))
    np.testing.assert_array_equal(np.asarray(two["forces"]), 2 * np.asarray(one["forces"]))


def test_new_lj_parameters_do_not_retrace_the_compiled_call():
    model = CountingLJ(1.0, 1.0, CUTOFF)
    lj_run(model)
    traces = len(LJ_TRACES)
    lj_run(with_epsilon(model, 2.0))
    lj_run(with_epsilon(model, 0.37))
    assert traces >= 1
    assert len(LJ_TRACES) == traces


def lj_loss_inputs():
    batch = Batch.from_data(LJ_DATA)
    nl, _ = jaxdd.neighbor_list(batch.positions, batch.cell, batch.pbc, batch.batch_idx, batch.atom_mask,
                                cutoff=CUTOFF)
    return batch.replace(neighbors=nl)


def test_grad_of_the_energy_with_respect_to_epsilon_is_energy_over_epsilon():
    batch = lj_loss_inputs()
    model = LennardJones(1.0, 0.7, CUTOFF)

    def total_energy(m):
        return jnp.sum(energy_and_derivatives(m, batch, ("energy",))["energy"])

    energy, grads = jax.jit(jax.value_and_grad(total_energy))(model)
    assert float(grads.epsilon) == pytest.approx(float(energy) / 0.7, rel=1e-12)


def test_grad_of_a_force_loss_with_respect_to_epsilon_goes_through_the_framework_forces():
    # Forces are proportional to epsilon, so d/d(eps) sum F^2 = 2 sum F^2 / eps.
    batch = lj_loss_inputs()
    model = LennardJones(1.0, 0.7, CUTOFF)

    def force_loss(m):
        return jnp.sum(energy_and_derivatives(m, batch, ("forces",))["forces"] ** 2)

    loss, grads = jax.jit(jax.value_and_grad(force_loss))(model)
    assert float(loss) > 0
    assert float(grads.epsilon) == pytest.approx(2 * float(loss) / 0.7, rel=1e-12)


# ------------------------------------------------------- parameters are traced: flax.nnx


NNX_TRACES = []


class NnxPair(nnx.Module, BaseModel):
    """A smooth pair energy: scale * sum over pairs of exp(-r^2) (1 - r^2/rc^2)^2."""

    def __init__(self, scale: float, cutoff: float = CUTOFF):
        self.scale = nnx.Param(jnp.asarray(scale, jnp.float64))
        self.model_config = ModelConfig(
            outputs=frozenset({"energy", "forces"}),
            autograd_outputs=frozenset({"forces"}),
            autograd_inputs=frozenset({"positions"}),
            neighbor_config=NeighborConfig(cutoff=cutoff),
        )

    def adapt_input(self, data, **kwargs):
        return dict(positions=data.positions, cell=data.cell, batch_idx=data.batch_idx,
                    neighbors=data.neighbors, n_systems=data.n_systems)

    def forward(self, positions, cell, batch_idx, neighbors, n_systems):
        NNX_TRACES.append(1)
        rc2 = self.model_config.neighbor_config.cutoff ** 2
        vec = jaxdd.edge_vectors(positions, cell, batch_idx, neighbors)
        r2 = jnp.sum(vec * vec, axis=-1)
        inside = neighbors.mask & (r2 < rc2)
        pair = jnp.where(inside, jnp.exp(-r2) * (1.0 - r2 / rc2) ** 2, 0.0)
        atomic = jax.ops.segment_sum(0.5 * pair, neighbors.receivers, positions.shape[0])
        return {"energy": self.scale[...] * per_system_sum(atomic, batch_idx, n_systems)}


def random_periodic_system():
    rng = np.random.default_rng(11)
    cell = np.array([[4.2, 0.0, 0.0], [0.6, 3.9, 0.0], [-0.4, 0.5, 4.4]])
    positions = rng.random((20, 3)) @ cell
    return AtomicData(positions, np.full(20, 6), cell, True)


NNX_DATA = random_periodic_system()
NNX_CAPACITY = jaxdd.neighbor_capacity(NNX_DATA.positions, NNX_DATA.cell, NNX_DATA.pbc, cutoff=CUTOFF, headroom=1.3)


def nnx_run(model, data=NNX_DATA):
    return jaxdd.compute(model, data, ("energy", "forces"), capacity=NNX_CAPACITY)


def test_nnx_wrapper_forces_equal_minus_the_finite_difference_gradient():
    model = NnxPair(0.8)
    forces = np.asarray(nnx_run(model)["forces"])
    positions = np.asarray(NNX_DATA.positions)
    h = 1e-5
    fd = np.zeros_like(positions)
    for atom in range(positions.shape[0]):
        for axis in range(3):
            energies = []
            for step in (h, -h):
                moved = positions.copy()
                moved[atom, axis] += step
                energies.append(float(nnx_run(model, NNX_DATA.replace(positions=moved))["energy"][0]))
            fd[atom, axis] = -(energies[0] - energies[1]) / (2 * h)
    assert np.abs(forces).max() > 1e-2  # the test system is not trivially at rest
    np.testing.assert_allclose(forces, fd, rtol=0, atol=1e-7)


def test_compute_defaults_to_the_active_outputs_of_the_model():
    out = jaxdd.compute(NnxPair(0.8), NNX_DATA, capacity=NNX_CAPACITY)
    assert list(out) == ["energy", "forces"]


def test_nnx_parameter_change_changes_the_energy_without_retracing():
    model = NnxPair(1.0)
    one = float(nnx_run(model)["energy"][0])
    traces = len(NNX_TRACES)
    model.scale[...] = 2.0
    two = float(nnx_run(model)["energy"][0])
    assert traces >= 1
    assert len(NNX_TRACES) == traces
    assert two == 2 * one
