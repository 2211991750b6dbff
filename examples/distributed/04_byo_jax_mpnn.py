"""Bring your own JAX model, the whole arc of the guide, with a Behler-Parrinello network.

    python examples/distributed/04_byo_jax_mpnn.py

1. Wrap: the model (``jaxdd.models.bp.BehlerParrinello``) is a flax network behind the
   ``BaseModel`` protocol; its code knows nothing about ranks.
2. Spec: the message-passing preset ``SPEC_MPNN_HALO`` (what the wrapper returns).
3. Validate: ``trace_and_validate`` runs it on one device and on four ranks and compares.
4. Save the spec beside a checkpoint of the parameters; load both.
5. Run ``DistributedModel`` with the loaded spec, as production would.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

os.environ.setdefault("JAX_NUM_CPU_DEVICES", "4")

import jax  # noqa: E402

jax.config.update("jax_enable_x64", True)

import numpy as np  # noqa: E402

import jaxdd  # noqa: E402
from jaxdd.model import checkpoint  # noqa: E402
from jaxdd.engine import DistributedModel, DomainConfig, default_mesh  # noqa: E402
from jaxdd.models.bp import BehlerParrinello  # noqa: E402
from jaxdd.data.systems import fcc_lattice  # noqa: E402
from jaxdd.validate import trace_and_validate  # noqa: E402

SPECIES = (1, 6, 7, 8)


def make_model():
    """The factory the validator calls: a fresh wrapper with deterministic parameters."""
    return BehlerParrinello(SPECIES, cutoff=5.0, max_neighbors=48, seed=0)


def sample():
    """Rattled fcc (a = 4.1 Å) of mixed H, C, N, O: 864 atoms, periodic (large enough that no
    rank of four holds every atom)."""
    atoms = fcc_lattice(6, 4.1)
    atoms.numbers = np.random.default_rng(0).choice(SPECIES, len(atoms))
    atoms.rattle(0.15, seed=1)
    return jaxdd.AtomicData.from_ase(atoms)


def main(world_size: int = 4):
    data = sample()
    report = trace_and_validate(make_model, data, world_size=world_size, atol=1e-8, rtol=1e-9, progress=print)
    print(report.summary())
    if not report.ok:
        raise SystemExit(1)

    folder = Path(tempfile.mkdtemp()) / "bp"
    checkpoint.save(folder, make_model(), spec=report.spec)
    model, spec = checkpoint.load(folder, like=BehlerParrinello(SPECIES, cutoff=5.0, max_neighbors=48, seed=1))

    devices = jax.devices()[:world_size] if len(jax.devices()) >= world_size else jax.devices()[:1]
    dist = DistributedModel(model, DomainConfig(cutoff=5.0, mesh=default_mesh(devices)), spec=spec)
    got = dist(data, outputs=("energy", "forces", "stress"))
    ref = jaxdd.compute(model, data, outputs=("energy", "forces", "stress"))
    d_energy = abs(float(got["energy"][0] - ref["energy"][0])) / abs(float(ref["energy"][0]))
    d_forces = float(np.abs(np.asarray(got["forces"] - ref["forces"])).max())
    d_stress = float(np.abs(np.asarray(got["stress"] - ref["stress"])).max())
    print(f"loaded checkpoint + spec on {len(devices)} device(s): energy rel {d_energy:.1e}, forces abs {d_forces:.1e}, "
          f"stress abs {d_stress:.1e}")
    return d_energy, d_forces, d_stress


if __name__ == "__main__":
    main()
