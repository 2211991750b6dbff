"""Bring your own kernel: a graph transformer whose message passing is a compiled FFI call.

    python examples/distributed/05_byo_graph_transformer.py

1. Wrap: ``jaxdd.models.graph_transformer.GraphTransformer`` aggregates neighbour
   messages with one fused C++ kernel, the named op ``"jaxdd_ffi::attention_message"``
   (``jaxdd.ffi``; an XLA FFI call with a ``custom_vjp`` whose backward is a second kernel).
   The dispatch cannot see into it.
2. Spec: so the spec declares it, ``OpAdapter(op, output_transforms={0: ScatterOutputs()})``:
   the kernel writes messages onto receivers only (owned atoms), and the transform sends
   ghost partials home and refreshes ghost rows before the next layer reads them.
3. Validate: ``trace_and_validate`` runs the model on one device and on four ranks and
   compares energy and forces (the forces run through the kernel's custom VJP).
4. Save the spec as JSON and load it back: the op handle resolves by name.
5. Run ``DistributedModel`` with the loaded spec, as production would.

Without step 2 the sharded energy is wrong (tests/ffi/test_ffi_models.py shows the validator
failing it). Needs the compiled kernels (``pip install -e .`` builds them).
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
from jaxdd.engine import DistributedModel, DomainConfig, default_mesh  # noqa: E402
from jaxdd.models.graph_transformer import GraphTransformer  # noqa: E402
from jaxdd.ops import ScatterOutputs  # noqa: E402
from jaxdd.spec import SPEC_MPNN_HALO, MLIPSpec, OpAdapter  # noqa: E402
from jaxdd.data.systems import fcc_lattice  # noqa: E402
from jaxdd.validate import trace_and_validate  # noqa: E402

SPECIES = (1, 6, 8)
CUTOFF = 4.0

# Step 2: what the wrapper's distribution_spec returns, spelled out.
SPEC = SPEC_MPNN_HALO.with_custom_ops(
    OpAdapter("jaxdd_ffi::attention_message", arg_transforms={}, output_transforms={0: ScatterOutputs()})
)


def make_model():
    """The factory the validator calls: a fresh wrapper with deterministic parameters."""
    return GraphTransformer(SPECIES, CUTOFF, features=8, n_layers=2, seed=0)


def sample():
    """Rattled fcc (a = 3 Å) of mixed H, C, O: 864 atoms, periodic (no rank of four holds every atom)."""
    atoms = fcc_lattice(6, 3.0)
    atoms.numbers = np.random.default_rng(0).choice(SPECIES, len(atoms))
    atoms.rattle(0.1, seed=1)
    return jaxdd.AtomicData.from_ase(atoms)


def main(world_size: int = 4):
    assert make_model().distribution_spec == SPEC
    data = sample()
    report = trace_and_validate(make_model, data, world_size=world_size, atol=1e-9, rtol=1e-10,
                                outputs=("energy", "forces"), progress=print)
    print(report.summary())
    if not report.ok:
        raise SystemExit(1)

    path = report.spec.save(Path(tempfile.mkdtemp()) / "graph_transformer_spec.json")
    spec = MLIPSpec.load(path)
    print(f"spec saved to {path} and loaded: custom ops {[a.op.name for a in spec.distribution.custom_ops]}")

    devices = jax.devices()[:world_size] if len(jax.devices()) >= world_size else jax.devices()[:1]
    model = make_model()
    dist = DistributedModel(model, DomainConfig(cutoff=CUTOFF, mesh=default_mesh(devices)), spec=spec)
    got = dist(data, outputs=("energy", "forces"))
    ref = jaxdd.compute(model, data, outputs=("energy", "forces"))
    d_energy = abs(float(got["energy"][0] - ref["energy"][0])) / abs(float(ref["energy"][0]))
    d_forces = float(np.abs(np.asarray(got["forces"] - ref["forces"])).max())
    print(f"loaded spec on {len(devices)} device(s): energy rel {d_energy:.1e}, forces abs {d_forces:.1e}")
    return d_energy, d_forces


if __name__ == "__main__":
    main()
