"""Specification by probes: bad or unstable settings of the dynamics, the domain configuration,
prepare/apply and the validate CLI are refused before anything runs, with an error that names
the argument; edge cases that are fine run and give sane physics. (The MACE import's probes
are in test_bad_inputs_mace.py, JaxMDModel's in test_bad_inputs_jax_md.py.)
"""

from __future__ import annotations

import functools
import json
import math
import re
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh

import jaxdd
from jaxdd.engine import DistributedModel, DomainConfig
from jaxdd.dynamics import (FIRE, CRescale, DomainParallel, HeatFlux, Langevin, MTKBarostat, NoseHooverChain,
                            VelocityVerlet)
from jaxdd.models.lj import LennardJones
from jaxdd.data import as_batch
from jaxdd.data.systems import lj_melt_data
from jaxdd.validate.__main__ import main as validate_main

CUTOFF, SKIN, DT = 2.5, 0.3, 0.005
MODEL = LennardJones(1.0, 1.0, CUTOFF)

pytestmark = pytest.mark.filterwarnings("ignore:the ghost shell of some ranks covers every atom:RuntimeWarning")


def mesh_of(n):
    return Mesh(np.asarray(jax.devices()[:n]), ("dd",), axis_types=(AxisType.Auto,))


@functools.lru_cache(maxsize=None)
def melt():
    """108 LJ atoms at T* = 1.44 (float64)."""
    return lj_melt_data(3, temperature=1.44, dtype=np.float64)


def dist_model(grid=(1, 1, 1), **config) -> DistributedModel:
    return DistributedModel(MODEL, DomainConfig(CUTOFF, skin=SKIN, mesh=mesh_of(math.prod(grid)), grid=grid,
                                                **config))


# ----------------------------------------------------------------------------- refused at construction

NVT = dict(dt=DT, temperature=1.0, period=100 * DT, kB=1.0)
NPT = dict(dt=DT, temperature=1.0, pressure=1.0, t_period=100 * DT, p_period=1000 * DT, kB=1.0)
CRS = dict(NPT, compressibility=0.3)

REFUSED = {
    # integrators: numbers
    "dt zero": (lambda: VelocityVerlet(0.0), "VelocityVerlet.dt"),
    "dt negative": (lambda: VelocityVerlet(-0.1), "VelocityVerlet.dt"),
    "dt nan": (lambda: VelocityVerlet(float("nan")), "VelocityVerlet.dt"),
    "dt inf": (lambda: VelocityVerlet(float("inf")), "VelocityVerlet.dt"),
    "dt a bool": (lambda: VelocityVerlet(True), "VelocityVerlet.dt"),
    "dt a string": (lambda: VelocityVerlet("0.005"), "VelocityVerlet.dt"),
    "dt an array of one": (lambda: VelocityVerlet(np.array([0.005])), "VelocityVerlet.dt"),
    "dt complex": (lambda: VelocityVerlet(np.complex128(0.005)), "VelocityVerlet.dt"),
    # integrators: stability (damping times of a few dt diverge)
    "nvt period a tenth of dt": (lambda: NoseHooverChain(**dict(NVT, period=DT / 10)), "NoseHooverChain.period"),
    "nvt period half of dt": (lambda: NoseHooverChain(**dict(NVT, period=DT / 2)), "NoseHooverChain.period"),
    "nvt period five dt": (lambda: NoseHooverChain(**dict(NVT, period=5 * DT)), "NoseHooverChain.period"),
    "npt t_period of dt": (lambda: MTKBarostat(**dict(NPT, t_period=DT)), "MTKBarostat.t_period"),
    "npt p_period of 5 dt": (lambda: MTKBarostat(**dict(NPT, p_period=5 * DT)), "MTKBarostat.p_period"),
    "crescale t_period of dt": (lambda: CRescale(**dict(CRS, t_period=DT)), "CRescale.t_period"),
    "crescale p_period of 2 dt": (lambda: CRescale(**dict(CRS, p_period=2 * DT)), "CRescale.p_period"),
    "nvt period 9.9 dt written in decimal": (lambda: NoseHooverChain(**dict(NVT, dt=0.021, period=0.2079)),
                                             "NoseHooverChain.period"),
    # integrators: other settings
    "nvt chain zero": (lambda: NoseHooverChain(**dict(NVT, chain=0)), "NoseHooverChain.chain"),
    "nvt loops zero": (lambda: NoseHooverChain(**dict(NVT, loops=0)), "NoseHooverChain.loops"),
    "nvt temperature negative": (lambda: NoseHooverChain(**dict(NVT, temperature=-1.0)), "NoseHooverChain.temperature"),
    "npt pressure nan": (lambda: MTKBarostat(**dict(NPT, pressure=float("nan"))), "MTKBarostat.pressure"),
    "npt couple unknown": (lambda: MTKBarostat(**dict(NPT, couple="xyz")), "couple"),
    "crescale compressibility zero": (lambda: CRescale(**dict(CRS, compressibility=0.0)), "CRescale.compressibility"),
    "crescale couple tri": (lambda: CRescale(**dict(CRS, couple="tri")), "couple"),
    "langevin friction negative": (lambda: Langevin(DT, 1.0, -1.0, kB=1.0), "Langevin.friction"),
    "langevin temperature inf": (lambda: Langevin(DT, float("inf"), 1.0, kB=1.0), "Langevin.temperature"),
    "fire fmax zero": (lambda: FIRE(fmax=0.0), "FIRE.fmax"),
    "heat flux every zero": (lambda: HeatFlux(every=0), "HeatFlux.every"),
    "heat flux every a float": (lambda: HeatFlux(every=1.5), "HeatFlux.every"),
    # the domain configuration
    "cutoff zero": (lambda: DomainConfig(0.0), "DomainConfig.cutoff"),
    "cutoff nan": (lambda: DomainConfig(float("nan")), "DomainConfig.cutoff"),
    "skin negative": (lambda: DomainConfig(CUTOFF, skin=-0.1), "DomainConfig.skin"),
    "ghost width below the cutoff": (lambda: DomainConfig(CUTOFF, ghost_width=1.0), "DomainConfig.ghost_width"),
    "strategy unknown": (lambda: DomainConfig(CUTOFF, strategy="spatial"), "DomainConfig.strategy"),
    "neighbour backend unknown": (lambda: DomainConfig(CUTOFF, neighbor_backend="gpu"), "DomainConfig.neighbor_backend"),
    "capacity factor below one": (lambda: DomainConfig(CUTOFF, capacity_factor=0.5), "DomainConfig.capacity_factor"),
    "hysteresis not below the skin": (lambda: DomainConfig(CUTOFF, skin=0.3, migration_hysteresis=0.3),
                                      "DomainConfig.migration_hysteresis"),
    "grid of two": (lambda: DomainConfig(CUTOFF, grid=(2, 2)), "DomainConfig.grid"),
    "grid with a zero": (lambda: DomainConfig(CUTOFF, grid=(0, 1, 1)), r"DomainConfig.grid\[0\]"),
    "grid unlike the mesh": (lambda: DomainConfig(CUTOFF, grid=(2, 1, 1), mesh=mesh_of(4)), "DomainConfig.grid"),
    "memory limit zero": (lambda: DomainConfig(CUTOFF, memory_limit=0), "DomainConfig.memory_limit"),
    "balance unknown": (lambda: DomainConfig(CUTOFF, balance="sometimes"), "DomainConfig.balance"),
    "balance with node blocks": (lambda: DomainConfig(CUTOFF, balance="static", strategy="graph_partition"),
                                 "DomainConfig.balance"),
    "balance_every without balance": (lambda: DomainConfig(CUTOFF, balance_every=50), "DomainConfig.balance_every"),
    "balance_every with static balance": (lambda: DomainConfig(CUTOFF, balance="static", balance_every=50),
                                          "DomainConfig.balance_every"),
    "balance_every zero": (lambda: DomainConfig(CUTOFF, balance="dynamic", balance_every=0),
                           "DomainConfig.balance_every"),
    "balance_by without balance": (lambda: DomainConfig(CUTOFF, balance_by="pairs"), "DomainConfig.balance_by"),
    "balance_by unknown": (lambda: DomainConfig(CUTOFF, balance="static", balance_by="bonds"),
                           "DomainConfig.balance_by"),
    # DomainParallel
    "dynamics of a bare model": (lambda: DomainParallel(MODEL, VelocityVerlet(DT)), "dist_model"),
    "integrator by name": (lambda: DomainParallel(dist_model(), "verlet"), "integrator"),
    "kB negative": (lambda: DomainParallel(dist_model(), VelocityVerlet(DT), kB=-1.0), "kB"),
    "kB unlike the thermostat's": (lambda: DomainParallel(dist_model(), NoseHooverChain(**NVT), kB=2.0), "kB"),
    "dynamics without a skin": (lambda: DomainParallel(DistributedModel(MODEL, DomainConfig(CUTOFF, mesh=mesh_of(1))),
                                                       VelocityVerlet(DT)), "DomainConfig.skin"),
}


@pytest.mark.parametrize("name", list(REFUSED))
def test_a_bad_setting_is_refused_naming_its_argument(name):
    build, argument = REFUSED[name]
    with pytest.raises(ValueError, match=argument):
        build()


def test_ten_steps_written_in_decimal_are_ten_steps():
    """0.21 / 0.021 is 9.999999999999998 in floating point: within rounding of ten steps, accepted."""
    assert NoseHooverChain(**dict(NVT, dt=0.021, period=0.21)).period == 0.21
    assert MTKBarostat(**dict(NPT, dt=0.021, t_period=0.21, p_period=0.21)).p_period == 0.21
    assert CRescale(**dict(CRS, dt=0.021, t_period=0.21, p_period=0.21)).t_period == 0.21


def test_a_negative_pressure_is_a_setting_not_an_error():
    """Tension is a pressure below zero: accepted, and the message of a bad one says no bound."""
    assert MTKBarostat(**dict(NPT, pressure=-0.5)).pressure == -0.5
    with pytest.raises(ValueError, match=r"pressure must be a finite number, got nan"):
        CRescale(**dict(CRS, pressure=float("nan")))


@pytest.mark.parametrize("dt", [np.float32(DT), np.float64(DT), np.asarray(DT), jnp.asarray(DT), 1], ids=[
    "numpy-float32", "numpy-float64", "0-d-numpy", "0-d-jax", "int"])
def test_a_time_step_given_as_a_numpy_scalar_or_0d_array_is_a_number(dt):
    assert VelocityVerlet(dt).dt == float(dt)


# ----------------------------------------------------------------------------- refused at run time


@functools.lru_cache(maxsize=None)
def md_of(integrator, grid=(1, 1, 1), strategy=None) -> DomainParallel:
    kB = None if getattr(integrator, "kB", None) is not None else 1.0
    return DomainParallel(dist_model(grid, strategy=strategy), integrator, kB=kB)


# The check is the device loop's, whatever the integrator: NVT is in the slow set.
@pytest.mark.parametrize("integrator", [
    VelocityVerlet(0.5), pytest.param(NoseHooverChain(**dict(NVT, dt=0.5, period=50.0)), marks=pytest.mark.slow)],
    ids=["nve", "nvt"])
def test_a_time_step_far_too_large_is_refused_on_one_device_as_on_many(integrator):
    md = md_of(integrator)
    with pytest.raises(RuntimeError, match=r"more than 0\.15 Å .*dt = 0\.5"):
        md.run(md.init(melt()), 20)


def test_a_barostat_moving_the_cell_too_fast_is_named_as_the_cause():
    # p_period = 10 dt passes the constructor's bound; the cell then moves the atoms more than the
    # skin allows at step 1, and the message named dt alone.
    md = md_of(MTKBarostat(**dict(NPT, p_period=10 * DT)))
    with pytest.raises(RuntimeError, match=r"dt = 0\.005\), or the cell changes too fast: p_period = 0\.05 is 10 time "
                                           r"steps .*lengthen it"):
        md.run(md.init(melt()), 20)


def test_a_negative_step_count_is_refused():
    md = md_of(VelocityVerlet(DT))
    with pytest.raises(ValueError, match="n_steps"):
        md.run(md.init(melt()), -1)


def test_a_trajectory_without_trajectory_every_is_refused(tmp_path):
    md = md_of(VelocityVerlet(DT))
    with pytest.raises(ValueError, match="trajectory_every"):
        md.run(md.init(melt()), 1, trajectory=tmp_path / "t.xyz")


def test_an_observer_without_every_is_refused():
    md = md_of(VelocityVerlet(DT))
    with pytest.raises(ValueError, match=r"observers\[0\]"):
        md.run(md.init(melt()), 1, observers=[print])


def test_a_heat_flux_on_node_blocks_is_refused_before_any_step():
    md = md_of(VelocityVerlet(DT), (2, 1, 1), "graph_partition")
    state = md.init(melt())
    with pytest.raises(ValueError, match="strategy='halo'"):
        md.run(state, 10, observers=[HeatFlux(every=5)])
    assert md.last_run is None or md.last_run.steps == 0


def test_restoring_a_folder_that_is_not_there_names_it(tmp_path):
    md = md_of(VelocityVerlet(DT))
    with pytest.raises(FileNotFoundError, match=str(tmp_path / "nowhere")):
        md.restore(tmp_path / "nowhere")


# ----------------------------------------------------------------------------- edge cases that run


def test_a_float32_time_step_runs_as_the_float64_one():
    """np.float32(0.005) is the float 0.004999999888: the trajectory is the dt = 0.005 one to
    within what that difference makes, and the energy is held (the unshifted cutoff's jumps)."""
    md32, md64 = md_of(VelocityVerlet(np.float32(DT))), md_of(VelocityVerlet(DT))
    start = md32.init(melt())
    got, want = md32.run(start, 50), md64.run(md64.init(melt()), 50)
    np.testing.assert_allclose(np.asarray(md32.gather(got).positions), np.asarray(md64.gather(want).positions),
                               rtol=0, atol=1e-6)
    e0, e1 = (float(md32.thermo(s)["total_energy"][0]) for s in (start, got))
    assert math.isfinite(e1) and abs(e1 - e0) < 5e-3 * abs(e0)


# The slow set, beside test_checkpoint_compat.py, which restores a checkpoint of an earlier jaxdd
# for each run kind (one device, a halo grid, node blocks) and continues it bit for bit.
@pytest.mark.slow
@pytest.mark.parametrize("grid, strategy", [((1, 1, 1), None), ((2, 1, 1), "graph_partition"), ((2, 1, 1), None)],
                         ids=["one-device", "graph-parallel", "halo"])
def test_a_checkpoint_restores_bit_for_bit_on_every_run_kind(grid, strategy, tmp_path):
    md = md_of(NoseHooverChain(**NVT), grid, strategy)
    half = md.run(md.init(melt()), 5)
    md.save(tmp_path / "ck", half)
    resumed = md.run(md.restore(tmp_path / "ck"), 5)
    straight = md.run(half, 5)
    np.testing.assert_array_equal(np.asarray(md.gather(resumed).positions), np.asarray(md.gather(straight).positions))
    np.testing.assert_array_equal(np.asarray(md.thermo(resumed)["conserved"]), np.asarray(md.thermo(straight)["conserved"]))


@pytest.mark.slow
def test_a_balanced_run_restores_bit_for_bit(tmp_path):
    md = DomainParallel(dist_model((2, 1, 1), balance="dynamic", balance_every=3), VelocityVerlet(DT), kB=1.0)
    half = md.run(md.init(melt()), 4)
    md.save(tmp_path / "ck", half)
    resumed = md.run(md.restore(tmp_path / "ck"), 4)
    straight = md.run(half, 4)
    np.testing.assert_array_equal(np.asarray(md.gather(resumed).positions), np.asarray(md.gather(straight).positions))


# ----------------------------------------------------------------------------- checkpoints that know they are whole


@pytest.fixture(scope="module")
def node_block_checkpoints(tmp_path_factory):
    """(md, state, two checkpoints of that state): node blocks on 2 ranks, the run the heat-flux
    probe compiles; each save has its own id."""
    md = md_of(VelocityVerlet(DT), (2, 1, 1), "graph_partition")
    state = md.init(melt())
    folder = tmp_path_factory.mktemp("whole")
    return md, state, md.save(folder / "a", state), md.save(folder / "b", state)


def _flip_velocities(ck, state):
    """Flip 16 bytes inside the stored velocities (found by their bytes in the array files: the
    rows' or the plan's copy of them, whichever file comes first)."""
    velocities = np.asarray(state.rows.velocities)[0]
    for file in sorted((ck / "arrays").rglob("*")):
        data = bytearray(file.read_bytes()) if file.is_file() else b""
        at = next((at for row in velocities[2:] if (at := data.find(row.tobytes())) >= 0), -1)
        if at >= 0:
            data[at:at + 16] = bytes(b ^ 0xFF for b in data[at:at + 16])
            return file.write_bytes(bytes(data))
    pytest.skip("this orbax stores the velocities compressed: no bytes of theirs to flip")


def _edit_md_json(ck, **changes):
    meta = json.loads((ck / "md.json").read_text())
    meta.update(changes)
    for key in [k for k, v in changes.items() if v is None]:
        del meta[key]
    (ck / "md.json").write_text(json.dumps(meta, indent=1))


# (damage done to a copy of checkpoint a (b: the other save of the same state), file named, what it must say)
ALTERED = {
    "bytes flipped in the velocities": (lambda ck, b, state: _flip_velocities(ck, state), "arrays",
                                        r"holds data of the array ranked/(local__)?velocities that does not match its checksum"),
    "md.json of another checkpoint": (lambda ck, b, state: shutil.copy(b / "md.json", ck / "md.json"), "md.json",
                                      "belongs to another checkpoint"),
    "dtype edited to float16": (lambda ck, b, state: _edit_md_json(ck, dtype="float16"), "md.json",
                                "field 'dtype' must be the dtype of a run .*got float16"),
    "step edited": (lambda ck, b, state: _edit_md_json(ck, step=7), "md.json",
                    "does not match the checksum it records"),
    "checksums removed": (lambda ck, b, state: _edit_md_json(ck, checksums=None), "md.json",
                          "has no checksums or no checkpoint id"),
    "format and checksums removed": (lambda ck, b, state: _edit_md_json(ck, checksums=None, format=None),
                                     "md.json", "has no checksums, but the arrays .* were written with them"),
    "spec.json edited": (lambda ck, b, state: (ck / "spec.json").write_text(
        (ck / "spec.json").read_text().replace("}", ' }', 1)), "spec.json", "does not match its checksum"),
}


@pytest.mark.parametrize("damage", ALTERED)
def test_an_altered_checkpoint_is_refused_naming_the_file(node_block_checkpoints, tmp_path, damage):
    md, state, a, b = node_block_checkpoints
    alter, name, problem = ALTERED[damage]
    ck = shutil.copytree(a, tmp_path / "ck")
    alter(ck, b, state)
    with pytest.raises(jaxdd.CheckpointError, match=f"damaged checkpoint: {re.escape(str(ck / name))} {problem}"):
        md.restore(ck)


def test_an_intact_checkpoint_restores_its_checked_arrays(node_block_checkpoints):
    md, state, a, _ = node_block_checkpoints
    restored = md.restore(a)
    np.testing.assert_array_equal(np.asarray(md.gather(restored).velocities), np.asarray(md.gather(state).velocities))


def test_a_halo_grid_state_saved_through_node_blocks_names_the_mismatch(node_block_checkpoints, tmp_path):
    md, *_ = node_block_checkpoints
    halo = md_of(VelocityVerlet(DT), (2, 1, 1))
    batch = as_batch(melt())
    batch = batch.replace(masses=jnp.ones_like(batch.positions[:, 0]))
    placed = halo.placement.place(batch, np.asarray(batch.positions), np.asarray(batch.velocities))
    state = jaxdd.dynamics.MDState.start(placed, step=0, extra={})  # placed, not evaluated: nothing compiles
    with pytest.raises(ValueError, match=r"placed on a halo grid .* runs node blocks .*strategy='graph_partition'.*"
                                         "save it with the DomainParallel that ran it"):
        md.save(tmp_path / "ck", state)
    assert not (tmp_path / "ck").exists() or not any((tmp_path / "ck").iterdir())


# ----------------------------------------------------------------------------- prepare / apply


def test_prepare_with_an_unknown_output_names_it():
    with pytest.raises(ValueError, match="dipole"):
        dist_model().prepare(melt(), ("energy", "dipole"))


def test_apply_refuses_inputs_it_did_not_prepare():
    with pytest.raises(TypeError, match="DistributedModel.prepare"):
        dist_model().apply(MODEL, melt())


def test_apply_refuses_a_model_of_another_cutoff():
    dm = dist_model()
    inputs = dm.prepare(melt())
    with pytest.raises(ValueError, match="neighbour configuration"):
        dm.apply(LennardJones(1.0, 1.0, 3.0), inputs)


# ----------------------------------------------------------------------------- the validate CLI


@pytest.mark.parametrize("args, named", [
    (["--world-size", "0"], "--world-size"),
    (["--builtin", "nonesuch"], "nonesuch"),
    (["no_such_module:make", "--builtin", "molecules"], "no_such_module"),
    (["--spec", "no_such_preset"], "no_such_preset"),
], ids=["world-size", "builtin", "factory", "spec"])
def test_a_validate_usage_error_exits_2_naming_the_argument(args, named, capsys):
    try:
        code = validate_main(args)
    except SystemExit as exit_:  # argparse's own usage errors
        code = exit_.code
    assert code == 2
    captured = capsys.readouterr()
    assert named in captured.err + captured.out


class ReadoutOfEveryRow(jaxdd.BaseModel):
    """A pair energy plus 0.1 per row, summed over every row: padding rows count on one device."""

    def __init__(self):
        self.model_config = jaxdd.ModelConfig(outputs={"energy", "forces"}, autograd_outputs={"forces"},
                                              autograd_inputs={"positions"},
                                              neighbor_config=jaxdd.NeighborConfig(CUTOFF))

    def adapt_input(self, data):
        return dict(data=data)

    def forward(self, data):
        nl = data.neighbors
        vec = jaxdd.edge_vectors(data.positions, data.cell, data.batch_idx, nl)
        pair = jnp.where(nl.mask, jnp.exp(-jnp.sum(vec * vec, -1)), 0.0)
        atomic = jax.ops.segment_sum(pair, nl.receivers, data.positions.shape[0]) + 0.1
        return {"energy": jnp.sum(atomic)[None]}


def test_a_readout_of_padding_rows_is_named_as_the_cause_of_a_mismatch():
    from jaxdd.validate import trace_and_validate

    report = trace_and_validate(ReadoutOfEveryRow, melt(), world_size=2, auto_fix=False)
    assert not report.ok
    assert "readout sums padding rows" in report.summary() and "data.atom_mask" in report.next_action
