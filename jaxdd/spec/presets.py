"""The shipped presets (``SPEC_MPNN_HALO`` ...), stored once as JSON under ``specs/`` (the
package data of :mod:`jaxdd.specs`) and loaded here when jaxdd.spec is imported."""

from __future__ import annotations

import importlib.resources
from collections.abc import Mapping

from .frozen_map import FrozenMap
from .mlip_spec import MLIPSpec

__all__ = ["PRESETS", "SPEC_MPNN_HALO", "SPEC_LJ_HALO", "SPEC_UMA_HALO", "SPEC_EWALD_HALO", "SPEC_PME_HALO",
           "SPEC_DFTD3_HALO", "SPEC_MPNN_GP"]


def _preset(name: str) -> MLIPSpec:
    ref = importlib.resources.files("jaxdd.specs").joinpath(f"{name}.json")
    return MLIPSpec.from_json(ref.read_bytes(), source=f"jaxdd/specs/{name}.json")


#: Preset name (file stem under ``specs/``) → spec.
PRESETS: Mapping[str, MLIPSpec] = FrozenMap(
    (name, _preset(name))
    for name in ("mpnn_halo", "lj_halo", "uma_halo", "ewald_halo", "pme_halo", "dftd3_halo", "mpnn_gp")
)

SPEC_MPNN_HALO = PRESETS["mpnn_halo"]  # scatter-heavy MPNNs with autograd forces
SPEC_LJ_HALO = PRESETS["lj_halo"]  # pair potentials (Lennard-Jones, Morse, Buckingham)
SPEC_UMA_HALO = PRESETS["uma_halo"]  # backbones that build their own graph: scatter "local"
SPEC_EWALD_HALO = PRESETS["ewald_halo"]  # Ewald: real space on the halo, structure factors by system_sum
SPEC_PME_HALO = PRESETS["pme_halo"]  # PME: distributed mesh by the jaxdd.mesh verb (replicated mode adds an OpAdapter)
SPEC_DFTD3_HALO = PRESETS["dftd3_halo"]  # DFT-D3 dispersion
SPEC_MPNN_GP = PRESETS["mpnn_gp"]  # MPNNs under graph parallelism
