"""Fit an MLIP's parameters under domain decomposition, with the same steps as on one device.

    python examples/distributed/06_fit_on_a_large_cell.py [--steps 5] [--n-cells 3]

A SchNet (``jaxdd.models.mpnn.SchNet``) is fitted for a few Adam steps (optax) to the
energy and forces of a reference SchNet with other parameters, on a rattled fcc cell of H,
C, N and O (108 atoms, 12.3 Å box) cut into a (2, 2, 2) grid of ranks (8 virtual CPU devices
on a CPU). The loss is the squared error of the energy per atom (eV²) plus the mean
squared force error ((eV/Å)²).

The cell is small so that the example runs in seconds: every rank's 5 Å ghost shell then
reaches across the whole 12.3 Å cell, and jaxdd warns that decomposition gains nothing here.
The numbers are what the example checks, and every rank still computes only its owned
atoms' energies, with ghost forces sent home through the halo exchanges. From
``--n-cells 6`` (864 atoms) the shells no longer cover the cell.

1. ``DistributedModel.prepare`` does the host work once: partition, halo plan, capacities
   sized for these positions, every rank's rows placed on the mesh.
2. ``DistributedModel.apply(model, prepared)`` is a pure function of the model, so
   ``eqx.filter_value_and_grad`` of the loss gives the parameter gradients, and the whole
   optimizer step (forward, backward through the halo exchanges, Adam update) is one
   ``eqx.filter_jit`` program, compiled once and reused for every step.
3. The same steps run on one device with ``jaxdd.compute``; the losses agree step by step
   (to 1e-9 relative) and go down.

``main()`` returns the per-step losses of both paths.
"""

from __future__ import annotations

import os

# Eight virtual CPU devices, set before JAX starts (a GPU node uses its GPUs instead).
os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")

import jax  # noqa: E402

jax.config.update("jax_enable_x64", True)

import equinox as eqx  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import jaxdd  # noqa: E402
from jaxdd.engine import DistributedModel, DomainConfig  # noqa: E402
from jaxdd.models.mpnn import SchNet  # noqa: E402
from jaxdd.data.systems import fcc_lattice  # noqa: E402

SPECIES = (1, 6, 7, 8)
CUTOFF = 5.0  # Å
KEYS = ("energy", "forces")


def sample(n_cells: int = 3) -> jaxdd.AtomicData:
    """Rattled fcc (a = 4.1 Å, n_cells per axis) of mixed H, C, N, O: 4 n_cells³ atoms, periodic."""
    atoms = fcc_lattice(n_cells, 4.1)
    rng = np.random.default_rng(0)
    positions = atoms.positions + rng.normal(0.0, 0.1, atoms.positions.shape)
    return jaxdd.AtomicData(positions, rng.choice(SPECIES, len(atoms)), np.asarray(atoms.cell), True)


def loss_fn(out, target) -> jax.Array:
    """Squared energy-per-atom error (eV²) + mean squared force component error ((eV/Å)²)."""
    n = out["forces"].shape[0]
    d_energy = (out["energy"] - target["energy"]) / n
    return jnp.sum(d_energy**2) + jnp.mean((out["forces"] - target["forces"]) ** 2)


def main(steps: int = 5, learning_rate: float = 1e-3, n_cells: int = 3):
    data = sample(n_cells)
    # The reference: the same architecture with other parameters, on one device.
    target = jaxdd.compute(SchNet(SPECIES, CUTOFF, seed=1), data, KEYS)
    target = {k: jnp.asarray(target[k]) for k in KEYS}
    start = SchNet(SPECIES, CUTOFF, seed=0)
    opt = optax.adam(learning_rate)

    # Distributed: 8 ranks when there are 8 devices, else every device there is.
    grid = (2, 2, 2) if len(jax.devices()) >= 8 else None
    dm = DistributedModel(start, DomainConfig(cutoff=CUTOFF, grid=grid))
    # Host work once: the positions do not change while the parameters are fitted.
    prepared = dm.prepare(data, KEYS)

    @eqx.filter_jit
    def dd_step(model, opt_state, prepared):
        # Under jit an overflowing neighbour list would give NaN, never a silently wrong
        # loss; prepare sized the capacities for these positions, so none overflows.
        loss, grads = eqx.filter_value_and_grad(lambda m: loss_fn(dm.apply(m, prepared), target))(model)
        updates, opt_state = opt.update(grads, opt_state, eqx.filter(model, eqx.is_inexact_array))
        return eqx.apply_updates(model, updates), opt_state, loss

    # One device: jaxdd.compute sizes its neighbour list on the host on every call, so the
    # gradient runs eagerly (compute's own program is jitted) and only the update is jitted.
    @eqx.filter_jit
    def update(model, grads, opt_state):
        updates, opt_state = opt.update(grads, opt_state, eqx.filter(model, eqx.is_inexact_array))
        return eqx.apply_updates(model, updates), opt_state

    def single_step(model, opt_state):
        loss, grads = eqx.filter_value_and_grad(lambda m: loss_fn(jaxdd.compute(m, data, KEYS), target))(model)
        model, opt_state = update(model, grads, opt_state)
        return model, opt_state, loss

    losses = {}
    for name, step, extra in (("distributed", dd_step, (prepared,)), ("one device", single_step, ())):
        model, opt_state, history = start, opt.init(eqx.filter(start, eqx.is_inexact_array)), []
        for _ in range(steps):
            model, opt_state, loss = step(model, opt_state, *extra)
            history.append(float(loss))
        losses[name] = np.asarray(history)

    dd, one = losses["distributed"], losses["one device"]
    print(f"{len(data.positions)} atoms, grid {prepared.program.layout.grid} over {dm.config.n_ranks} device(s); "
          f"Adam, lr {learning_rate}")
    print(f"{'step':>4} {'loss, distributed':>20} {'loss, one device':>20} {'rel. difference':>16}")
    for i, (a, b) in enumerate(zip(dd, one)):
        print(f"{i:>4} {a:>20.12e} {b:>20.12e} {abs(a - b) / abs(b):>16.1e}")
    return dd, one


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--n-cells", type=int, default=3, help="fcc cells per axis (4 n³ atoms)")
    args = parser.parse_args()
    main(steps=args.steps, n_cells=args.n_cells)
