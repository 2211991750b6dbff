"""Specification of the charge-equilibration model, the internal-graph backbone and checkpoints."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from ase.build import molecule

import jaxdd
from jaxdd.model import checkpoint
from jaxdd.dispatch import DispatchError, DispatchWarning
from jaxdd.engine import DistributedModel, DomainConfig, default_mesh
from jaxdd.models.qeq import ChargeEquilibration
from jaxdd.models.uma_like import InternalGraphBackbone
from jaxdd.spec import SPEC_MPNN_HALO, OutputKind

pytestmark = pytest.mark.filterwarnings("ignore:the ghost shell of some ranks covers every atom:RuntimeWarning")

NAMES = ["H2O", "CH4", "NH3", "C2H6", "CH3OH", "HCOOH", "C6H6", "CO2"]


def molecules(charged=False):
    """Eight small molecules, each its own open system, laid out on a 4 x 2 grid 8 Å apart."""
    mols = []
    for k, name in enumerate(NAMES):
        m = molecule(name)
        m.rattle(0.02, seed=k)
        m.positions += [8.0 * (k % 4), 8.0 * (k // 4), 0.0]
        if charged and name == "NH3":
            m.set_initial_charges([1.0, 0, 0, 0])  # formal charge: NH3 counted as +1
        mols.append(m)
    return jaxdd.Batch.from_ase(mols, dtype=np.float64)


MOLECULES = molecules(charged=True)
MESH = default_mesh(jax.devices()[:4])
OUT = ("energy", "forces", "charges")


def run(model, spec, data=MOLECULES, outputs=OUT, allow_unfollowed=False):
    dm = DistributedModel(model, DomainConfig(5.0, mesh=MESH, allow_unfollowed=allow_unfollowed), spec=spec)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DispatchWarning)
        return dm(data, outputs=outputs)


@pytest.fixture(scope="module")
def qeq_reference():
    return jaxdd.compute(ChargeEquilibration(), MOLECULES, outputs=OUT)


def test_qeq_conserves_each_molecules_total_charge(qeq_reference):
    q = np.asarray(qeq_reference["charges"])
    totals = np.bincount(np.asarray(MOLECULES.batch_idx), q, minlength=len(NAMES))
    expected = np.array([1.0 if n == "NH3" else 0.0 for n in NAMES])
    np.testing.assert_allclose(totals, expected, atol=1e-12)


def test_qeq_with_its_adapter_equals_single_device(qeq_reference):
    model = ChargeEquilibration()
    got = run(model, model.distribution_spec)
    e_ref = np.asarray(qeq_reference["energy"])
    assert np.max(np.abs(np.asarray(got["energy"]) - e_ref) / np.abs(e_ref)) <= 1e-10
    assert float(jnp.max(jnp.abs(got["forces"] - qeq_reference["forces"]))) <= 1e-9
    assert float(jnp.max(jnp.abs(got["charges"] - qeq_reference["charges"]))) <= 1e-10


def test_qeq_without_its_adapter_is_refused_naming_the_helper():
    with pytest.raises(DispatchError, match=r"could not follow(.|\n)*qeq_helpers.py:\d+"):
        run(ChargeEquilibration(), SPEC_MPNN_HALO.with_output_kinds(charges=OutputKind.PER_NODE))


def test_qeq_without_its_adapter_allowed_to_run_diverges(qeq_reference):
    got = run(ChargeEquilibration(), SPEC_MPNN_HALO.with_output_kinds(charges=OutputKind.PER_NODE),
              allow_unfollowed=True)
    # Per-rank partial sums of a helper that assumes contiguous molecules: wrong, even NaN.
    assert not np.allclose(np.asarray(got["charges"]), np.asarray(qeq_reference["charges"]), atol=1e-3)


def test_internal_graph_backbone_with_deep_local_halo_equals_single_device():
    model = InternalGraphBackbone()
    ref = jaxdd.compute(model, MOLECULES, outputs=("energy", "forces"))
    got = run(model, model.distribution_spec, outputs=("energy", "forces"))
    assert np.max(np.abs(np.asarray(got["energy"] - ref["energy"])) / np.abs(np.asarray(ref["energy"]))) <= 1e-10
    assert float(jnp.max(jnp.abs(got["forces"] - ref["forces"]))) <= 1e-9


def test_internal_graph_backbone_refuses_cells_thinner_than_twice_the_cutoff():
    data = jaxdd.AtomicData(positions=np.zeros((1, 3)), atomic_numbers=[6], cell=np.eye(3) * 8.0, pbc=[True] * 3)
    with pytest.raises(ValueError, match="twice the cutoff"):
        jaxdd.compute(InternalGraphBackbone(), data)


def test_checkpoint_round_trip_gives_identical_outputs(tmp_path, qeq_reference):
    model = ChargeEquilibration(seed=3)
    path = checkpoint.save(tmp_path / "qeq", model)
    loaded, spec = checkpoint.load(path, like=ChargeEquilibration(seed=99))
    assert spec == model.distribution_spec
    a = jaxdd.compute(model, MOLECULES, outputs=OUT)
    b = jaxdd.compute(loaded, MOLECULES, outputs=OUT)
    for key in OUT:
        np.testing.assert_array_equal(np.asarray(a[key]), np.asarray(b[key]))


def test_checkpoint_refuses_a_mismatched_wrapper(tmp_path):
    path = checkpoint.save(tmp_path / "qeq", ChargeEquilibration(features=16))
    with pytest.raises(ValueError, match="same settings"):
        checkpoint.load(path, like=ChargeEquilibration(features=8))


@pytest.mark.parametrize("damage, name, problem", [
    (lambda ck: (ck / "params" / "_METADATA").write_text('{"tree_metadata": {'), "_METADATA", "is not valid JSON"),
    (lambda ck: (ck / "params" / "manifest.ocdbt").unlink(), "manifest.ocdbt", "is missing"),
], ids=["truncated metadata", "removed manifest"])
def test_loading_a_damaged_checkpoint_names_the_file_not_a_mismatch(tmp_path, damage, name, problem):
    path = checkpoint.save(tmp_path / "qeq", ChargeEquilibration())
    if not (path / "params" / name).exists():
        pytest.skip(f"this orbax writes no {name}")
    damage(path)
    with pytest.raises(jaxdd.CheckpointError, match=f"{path / 'params' / name} {problem}"):
        checkpoint.load(path, like=ChargeEquilibration())


def test_checkpoint_never_overwrites(tmp_path):
    checkpoint.save(tmp_path / "ck", ChargeEquilibration())
    with pytest.raises(FileExistsError):
        checkpoint.save(tmp_path / "ck", ChargeEquilibration())


@pytest.mark.parametrize("name", ["bp", "schnet", "nequip", "qeq", "uma_like"])
def test_every_zoo_model_checkpoint_round_trip_is_bit_identical(name, tmp_path):
    from test_zoo_models import FACTORIES

    make = FACTORIES[name]
    model = make(seed=1)
    loaded, spec = checkpoint.load(checkpoint.save(tmp_path / name, model), like=make(seed=2))
    assert spec == model.distribution_spec
    a = jaxdd.compute(model, MOLECULES, outputs=("energy", "forces"))
    b = jaxdd.compute(loaded, MOLECULES, outputs=("energy", "forces"))
    for key in ("energy", "forces"):
        np.testing.assert_array_equal(np.asarray(a[key]), np.asarray(b[key]))


@pytest.mark.parametrize("make", [ChargeEquilibration, InternalGraphBackbone], ids=["qeq", "uma_like"])
def test_float32_model_gives_float32_outputs_close_to_float64(make):
    single = jaxdd.Batch.from_ase(MOLECULES.to_ase(), dtype=np.float32)
    lo = jaxdd.compute(make(dtype=jnp.float32), single, outputs=("energy", "forces"))
    hi = jaxdd.compute(make(), MOLECULES, outputs=("energy", "forces"))
    assert lo["energy"].dtype == jnp.float32 and lo["forces"].dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(lo["energy"]), np.asarray(hi["energy"]), rtol=1e-4, atol=1e-4)
