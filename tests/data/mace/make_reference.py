"""Build the mace-torch reference models and their energies, forces and stress.

Needs torch and mace-torch (the ``mace`` extra: ``pip install -e '.[mace]'``); the
tests read what this writes and do not need either. Run from the repository root::

    python tests/data/mace/make_reference.py

Writes, next to this file:

* ``residual.npz``: ``ScaleShiftMACE``, elements H, C, O, 2 interactions
  (``RealAgnosticResidualInteractionBlock``), hidden irreps ``16x0e + 16x1o``, ``max_ell`` 3,
  correlation 3, cutoff 5 Å, E0s (-1.2, -3.4, -5.6) eV, scale 1.3 and shift -0.2 eV;
* ``plain.npz``: the same with ``RealAgnosticInteractionBlock``;
* ``trained.npz``: ``residual``'s architecture fitted for a few epochs to energies and forces
  of a Morse potential on 24 jittered H/C/O crystals (weights that are not random);
* ``reference.npz``: six systems (periodic cubic, triclinic, a (T,T,F) slab, a molecule, a batch
  of two (a small triclinic crystal and the molecule in a vacuum box), one with an atom without
  neighbours) and each model's energy [eV], forces [eV/Å] and
  stress [eV/Å³] on them, evaluated by mace-torch in float64.

and the foundation-model families (``python tests/data/mace/make_reference.py families``
writes these alone, reading the systems of ``reference.npz``), each at the published
architecture with the widths reduced (4 channels, radial MLP [8, 8]; ``max_ell`` 3,
correlation 3) and every weight perturbed from its initial value (biases and trainable
constants included), so that each file stays near 50 kB:

* ``mp0b3.npz``: MACE-MP-0b3-like: residual blocks, ZBL pair repulsion, l = 2 node features
  (``max_ell`` 2 here: the product basis of l = 2 features on degree-3 harmonics alone is 150 kB);
* ``mpa0.npz``: MACE-MPA-0-like: a density block first, density-residual blocks after, ZBL and
  the Agnesi distance transform;
* ``twohead.npz``: a fine-tune with a replay head: two heads (``pt_head`` and ``default``), each
  with its own E0s, scale and shift;
* ``options.npz``: plain ``MACE`` with the remaining options: Gaussian basis, Soft transform,
  ``apply_cutoff=False``, ``edge_irreps`` (first layer too), ``NonLinearBiasReadoutBlock``,
  two heads;
* ``chebyshev.npz``: density blocks on a 4-function Chebyshev basis of the Agnesi-transformed
  length;
* ``mh.npz``: MACE-MH-like: ``RealAgnosticResidualNonLinearInteractionBlock`` and
  ``NonLinearBiasReadoutBlock``, two heads, ZBL and the Agnesi transform;
* ``old036.npz``: a ``.model`` file pickled by mace-torch 0.3.6 (a MACE-MP-0b-like model:
  residual blocks, ZBL, the Agnesi transform), read by the current mace-torch and exported; the
  script installs 0.3.6 in a scratch virtual environment (``$MACE_OLD_VENV``, default
  ``/tmp/mace-torch-0.3.6``) and takes its references from 0.3.6 itself;
* ``families.npz``: their energies, forces and stress (every head) on the systems of
  ``reference.npz`` and on ``close``: a periodic cell with pairs at 0.7 to 1.1 Å, where ZBL and
  the distance transforms matter.

Model files are written with :func:`jaxdd.models.mace.export_torch` (configuration and state
dict as numpy arrays).
"""

from __future__ import annotations

import os
import pathlib

os.environ.setdefault("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")  # e3nn 0.4 loads its constants with pickle

import numpy as np
import torch
from ase import Atoms
from ase.build import bulk
from ase.calculators.morse import MorsePotential
from ase.neighborlist import primitive_neighbor_list

HERE = pathlib.Path(__file__).resolve().parent
# mace-torch takes its product bases from cuequivariance when that is installed (and the option
# is on): other bases, so other models from the same seed. Off, every environment builds the
# models the stored references were made with.
REDUCED_CG = False
SPECIES = [1, 6, 8]
R_MAX = 5.0


def build_model(interaction: str, seed: int):
    from e3nn import o3
    from mace import modules

    torch.manual_seed(seed)
    cls = getattr(modules, interaction)
    return modules.ScaleShiftMACE(
        r_max=R_MAX, num_bessel=8, num_polynomial_cutoff=5, max_ell=3, interaction_cls=cls,
        interaction_cls_first=cls, num_interactions=2, num_elements=3,
        hidden_irreps=o3.Irreps("16x0e + 16x1o"), MLP_irreps=o3.Irreps("16x0e"),
        atomic_energies=np.array([-1.2, -3.4, -5.6]), avg_num_neighbors=12.0, atomic_numbers=SPECIES,
        correlation=3, gate=torch.nn.functional.silu, atomic_inter_scale=1.3, atomic_inter_shift=-0.2,
        radial_MLP=[32, 32, 32], use_reduced_cg=REDUCED_CG,
    )


def to_batch(systems, head=0):
    """mace-torch's input dictionary for a list of ase.Atoms (edges i -> j within R_MAX)."""
    pos, cells, edges, shifts, unit, attrs, batch = [], [], [], [], [], [], []
    offset = 0
    for g, a in enumerate(systems):
        cell = a.cell.array if a.cell.rank == 3 else np.zeros((3, 3))
        i, j, s = primitive_neighbor_list("ijS", a.pbc, cell, a.positions, R_MAX, self_interaction=False)
        pos.append(a.positions)
        cells.append(cell)
        edges.append(np.stack([i + offset, j + offset]))
        shifts.append(s @ cell)
        unit.append(s.astype(float))
        attrs.append(np.eye(len(SPECIES))[[SPECIES.index(z) for z in a.numbers]])
        batch.append(np.full(len(a), g))
        offset += len(a)
    t = torch.tensor
    return dict(positions=t(np.concatenate(pos)), cell=t(np.concatenate(cells)),
                edge_index=t(np.concatenate(edges, 1)), shifts=t(np.concatenate(shifts)),
                unit_shifts=t(np.concatenate(unit)), node_attrs=t(np.concatenate(attrs)),
                batch=t(np.concatenate(batch)), ptr=t(np.cumsum([0] + [len(a) for a in systems])),
                head=t(np.full(len(systems), head)))


def evaluate(model, systems, head=0):
    """(energy [S], forces [V, 3], stress [S, 3, 3]) of head number ``head``; stress is NaN for
    systems without a cell."""
    out = model(to_batch(systems, head), compute_force=True, compute_stress=True)
    stress = out["stress"].detach().numpy().copy()
    for g, a in enumerate(systems):
        if a.cell.rank < 3:
            stress[g] = np.nan
    return out["energy"].detach().numpy(), out["forces"].detach().numpy(), stress


def jitter(atoms, rng, sigma=0.1):
    atoms = atoms.copy()
    atoms.numbers = rng.choice(SPECIES, len(atoms))
    atoms.positions += rng.normal(0.0, sigma, atoms.positions.shape)
    return atoms


def make_systems(rng):
    """The six reference systems; the fifth is a batch of two."""
    cubic = jitter(bulk("C", "diamond", a=3.6, cubic=True).repeat(2), rng)  # 64 atoms, 7.2 Å
    tri = Atoms("C" * 20, cell=[[6.4, 0.0, 0.0], [1.7, 6.1, 0.0], [-0.9, 1.2, 6.6]], pbc=True)
    tri.set_scaled_positions(rng.random((20, 3)))
    tri = _spread(tri, rng)
    slab = jitter(bulk("C", "diamond", a=3.6, cubic=True).repeat((2, 2, 1)), rng)
    slab.cell[2, 2] = 14.0
    slab.pbc = (True, True, False)
    molecule = Atoms("CCOHHHHO", positions=[[0, 0, 0], [1.52, 0, 0], [2.1, 1.2, 0], [-0.5, 0.9, 0.3],
                                            [-0.4, -0.9, 0.4], [1.9, -0.6, 0.8], [3.0, 1.2, 0.3], [-0.6, 0.1, -1.3]])
    small = Atoms("CHO", cell=[[4.1, 0, 0], [0.6, 3.9, 0], [0.3, 0.5, 4.4]], pbc=True,
                  scaled_positions=[[0.1, 0.2, 0.3], [0.55, 0.45, 0.6], [0.8, 0.9, 0.05]])
    boxed = molecule.copy()  # in a vacuum box (pbc False): its stress is defined
    boxed.cell = [[11.0, 0, 0], [0, 10.0, 0], [0, 0, 12.0]]
    lone = molecule.copy() + Atoms("O", positions=[[20.0, 0.0, 0.0]])
    return {"cubic": [cubic], "triclinic": [tri], "slab": [slab], "molecule": [molecule],
            "batch": [small, boxed], "isolated": [lone]}


def _spread(atoms, rng, min_distance=1.1):
    """Random positions with no two atoms closer than ``min_distance`` Å (periodic)."""
    for _ in range(1000):
        d = atoms.get_all_distances(mic=True) + np.eye(len(atoms)) * 10
        i, j = np.unravel_index(np.argmin(d), d.shape)
        if d[i, j] >= min_distance:
            break
        atoms.positions[i] += rng.normal(0, 0.5, 3)
        atoms.wrap()
    atoms.numbers = rng.choice(SPECIES, len(atoms))
    return atoms


def train(model, rng, epochs=30):
    """A few epochs of Adam on Morse energies and forces (weights that are not random)."""
    data = []
    for _ in range(24):
        a = jitter(bulk("C", "diamond", a=3.7, cubic=True).repeat((2, 1, 1)), rng, sigma=0.15)
        a.calc = MorsePotential(epsilon=0.3, r0=1.6, rho0=4.0, rcut1=4.0, rcut2=R_MAX)
        data.append((a, a.get_potential_energy(), a.get_forces()))
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    for _ in range(epochs):
        for a, e, f in data:
            optimizer.zero_grad()
            out = model(to_batch([a]), training=True, compute_force=True)
            e0 = sum(model.atomic_energies_fn.atomic_energies[SPECIES.index(z)] for z in a.numbers)
            loss = ((out["energy"][0] - e0 - e) / len(a)) ** 2 + torch.mean((out["forces"] - torch.tensor(f)) ** 2)
            loss.backward()
            optimizer.step()
    return model


FAMILY_SEEDS = {"mp0b3": 11, "mpa0": 12, "twohead": 13, "options": 14, "chebyshev": 15, "mh": 16}
HEADS = ["pt_head", "default"]


def build_family(name: str):
    """The reduced-width model of family ``name`` (see the module docstring), weights perturbed."""
    from e3nn import o3
    from mace import modules

    torch.manual_seed(FAMILY_SEEDS[name])
    residual = modules.RealAgnosticResidualInteractionBlock
    kwargs = dict(r_max=R_MAX, num_bessel=8, num_polynomial_cutoff=5, max_ell=3, interaction_cls=residual,
                  interaction_cls_first=residual, num_interactions=2, num_elements=3,
                  hidden_irreps=o3.Irreps("4x0e + 4x1o"), MLP_irreps=o3.Irreps("4x0e"),
                  atomic_energies=np.array([-1.2, -3.4, -5.6]), avg_num_neighbors=12.0, atomic_numbers=SPECIES,
                  correlation=3, gate=torch.nn.functional.silu, radial_MLP=[8, 8],
                  atomic_inter_scale=1.3, atomic_inter_shift=-0.2, use_reduced_cg=REDUCED_CG)
    two_e0 = np.array([[-1.2, -3.4, -5.6], [-1.0, -3.0, -5.0]])
    if name == "mp0b3":
        kwargs.update(pair_repulsion=True, hidden_irreps=o3.Irreps("4x0e + 4x1o + 4x2e"), max_ell=2)
    elif name == "mpa0":
        kwargs.update(interaction_cls_first=modules.RealAgnosticDensityInteractionBlock,
                      interaction_cls=modules.RealAgnosticDensityResidualInteractionBlock,
                      pair_repulsion=True, distance_transform="Agnesi")
    elif name == "twohead":
        kwargs.update(heads=HEADS, atomic_energies=two_e0, atomic_inter_scale=[1.3, 0.9],
                      atomic_inter_shift=[-0.2, 0.1])
    elif name == "options":
        for key in ("atomic_inter_scale", "atomic_inter_shift"):
            kwargs.pop(key)
        kwargs.update(radial_type="gaussian", distance_transform="Soft", apply_cutoff=False,
                      edge_irreps=o3.Irreps("2x0e + 2x1o"), use_edge_irreps_first=True,
                      readout_cls=modules.NonLinearBiasReadoutBlock, heads=HEADS, atomic_energies=two_e0,
                      interaction_cls=modules.RealAgnosticInteractionBlock)
        model = modules.MACE(**kwargs)
    elif name == "chebyshev":
        kwargs.update(radial_type="chebyshev", num_bessel=4, distance_transform="Agnesi",
                      interaction_cls_first=modules.RealAgnosticDensityInteractionBlock,
                      interaction_cls=modules.RealAgnosticDensityInteractionBlock)
    elif name == "mh":
        nonlinear = modules.RealAgnosticResidualNonLinearInteractionBlock
        kwargs.update(interaction_cls_first=nonlinear, interaction_cls=nonlinear, pair_repulsion=True,
                      distance_transform="Agnesi", readout_cls=modules.NonLinearBiasReadoutBlock, heads=HEADS,
                      atomic_energies=two_e0, atomic_inter_scale=[1.3, 0.9], atomic_inter_shift=[-0.2, 0.1])
    if name != "options":
        model = modules.ScaleShiftMACE(**kwargs)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return model


def close_pairs():
    """A periodic H/C/O cell with close pairs: C-C 1.1 Å, C-O 0.95 Å, O-O 0.9 Å, C-H 0.7 Å."""
    atoms = Atoms("CCCOOOHC", cell=[[7.0, 0, 0], [0.8, 6.6, 0], [-0.5, 0.7, 7.2]], pbc=True,
                  positions=[[1.0, 1.0, 1.0], [2.1, 1.0, 1.0], [4.0, 3.0, 2.0], [4.0, 3.95, 2.0],
                             [1.5, 4.5, 4.5], [1.5, 4.5, 5.4], [5.0, 1.5, 5.0], [5.7, 1.5, 5.0]])
    return atoms


def stored_systems():
    """The systems of reference.npz, and ``close``."""
    ref = np.load(HERE / "reference.npz")
    out, names = {}, sorted({k.split("/")[1] for k in ref.files if k.startswith("system/")})
    for name in names:
        group, k = [], 0
        while f"system/{name}/{k}/numbers" in ref:
            p = f"system/{name}/{k}/"
            group.append(Atoms(numbers=ref[p + "numbers"], positions=ref[p + "positions"], cell=ref[p + "cell"],
                               pbc=ref[p + "pbc"]))
            k += 1
        out[name] = group
    out["close"] = [close_pairs()]
    return out


OLD_RELEASE = "0.3.6"


def build_old_model():
    """The model of ``old036.npz``, built with the arguments mace-torch 0.3.6 knows."""
    from e3nn import o3
    from mace import modules

    torch.manual_seed(17)
    residual = modules.RealAgnosticResidualInteractionBlock
    model = modules.ScaleShiftMACE(
        r_max=R_MAX, num_bessel=8, num_polynomial_cutoff=5, max_ell=3, interaction_cls=residual,
        interaction_cls_first=residual, num_interactions=2, num_elements=3, hidden_irreps=o3.Irreps("4x0e + 4x1o"),
        MLP_irreps=o3.Irreps("4x0e"), atomic_energies=np.array([-1.2, -3.4, -5.6]), avg_num_neighbors=12.0,
        atomic_numbers=SPECIES, correlation=3, gate=torch.nn.functional.silu, radial_MLP=[8, 8],
        pair_repulsion=True, distance_transform="Agnesi", atomic_inter_scale=1.3, atomic_inter_shift=-0.2)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return model


def write_old(folder):
    """Under the old release: save ``old.model`` and its numbers on the systems in
    ``folder/systems.npz`` to ``folder/old_reference.npz``."""
    folder = pathlib.Path(folder)
    torch.set_default_dtype(torch.float64)
    model = build_old_model()
    torch.save(model, folder / "old.model")
    with np.load(folder / "systems.npz") as f:
        stored = {k: f[k] for k in f.files}
    out = {}
    for name in sorted({k.split("/")[0] for k in stored}):
        group, k = [], 0
        while f"{name}/{k}/numbers" in stored:
            p = f"{name}/{k}/"
            group.append(Atoms(numbers=stored[p + "numbers"], positions=stored[p + "positions"],
                               cell=stored[p + "cell"], pbc=stored[p + "pbc"]))
            k += 1
        e, f_, s = evaluate(model, group)
        out[f"{name}/energy"], out[f"{name}/forces"], out[f"{name}/stress"] = e, f_, s
    np.savez(folder / "old_reference.npz", **out)


def old_release(systems):
    """Write ``old036.npz`` (a file pickled by mace-torch 0.3.6, exported by this mace-torch) and
    return 0.3.6's own energies, forces and stress on ``systems`` as ``old036/...`` entries."""
    import subprocess
    import sys
    import tempfile

    from jaxdd.models.mace import export_torch

    venv = pathlib.Path(os.environ.get("MACE_OLD_VENV", f"/tmp/mace-torch-{OLD_RELEASE}"))
    python = venv / "bin" / "python"
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        # The torch already installed here (a local CPU build), not whatever pip would pick.
        subprocess.run([str(python), "-m", "pip", "install", "-q", f"torch=={torch.__version__.split('+')[0]}",
                        f"mace-torch=={OLD_RELEASE}"], check=True)
    with tempfile.TemporaryDirectory() as tmp:
        flat = {f"{name}/{k}/{key}": value for name, group in systems.items() for k, a in enumerate(group)
                for key, value in (("numbers", a.numbers), ("positions", a.positions), ("cell", a.cell.array),
                                   ("pbc", a.pbc))}
        np.savez(pathlib.Path(tmp) / "systems.npz", **flat)
        subprocess.run([str(python), __file__, "_old", tmp], check=True)
        export_torch(pathlib.Path(tmp) / "old.model", HERE / "old036.npz")
        with np.load(pathlib.Path(tmp) / "old_reference.npz") as f:
            return {f"old036/{k}": f[k] for k in f.files}


def families():
    """Write the family models, ``old036.npz`` and ``families.npz``."""
    from jaxdd.models.mace import export_torch

    systems = stored_systems()
    out = {}
    for k, a in enumerate(systems["close"]):
        out[f"system/close/{k}/numbers"], out[f"system/close/{k}/positions"] = a.numbers, a.positions
        out[f"system/close/{k}/cell"], out[f"system/close/{k}/pbc"] = a.cell.array, a.pbc
    for model_name in FAMILY_SEEDS:
        model = build_family(model_name)
        export_torch(model, HERE / f"{model_name}.npz")
        heads = list(model.heads) if len(model.heads) > 1 else [None]
        for h, head in enumerate(heads):
            key = model_name if head is None else f"{model_name}:{head}"
            for name, group in systems.items():
                e, f, s = evaluate(model, group, h)
                out[f"{key}/{name}/energy"], out[f"{key}/{name}/forces"], out[f"{key}/{name}/stress"] = e, f, s
    out.update(old_release(systems))
    np.savez_compressed(HERE / "families.npz", **out)
    print("wrote", [f"{m}.npz" for m in FAMILY_SEEDS], "old036.npz families.npz")


def main():
    import sys

    if sys.argv[1:2] == ["_old"]:  # under the old release, from old_release(): no jaxdd there
        write_old(sys.argv[2])
        return
    sys.path.insert(0, str(HERE.parents[2]))
    from jaxdd.models.mace import export_torch

    torch.set_default_dtype(torch.float64)
    if sys.argv[1:] == ["families"]:
        families()
        return
    rng = np.random.default_rng(20261202)
    models = {"residual": build_model("RealAgnosticResidualInteractionBlock", 1),
              "plain": build_model("RealAgnosticInteractionBlock", 2)}
    models["trained"] = train(build_model("RealAgnosticResidualInteractionBlock", 3), rng)
    systems = make_systems(rng)
    out = {}
    for name, group in systems.items():
        for k, a in enumerate(group):
            out[f"system/{name}/{k}/numbers"] = a.numbers
            out[f"system/{name}/{k}/positions"] = a.positions
            out[f"system/{name}/{k}/cell"] = a.cell.array
            out[f"system/{name}/{k}/pbc"] = a.pbc
    for model_name, model in models.items():
        export_torch(model, HERE / f"{model_name}.npz")
        for name, group in systems.items():
            e, f, s = evaluate(model, group)
            out[f"{model_name}/{name}/energy"], out[f"{model_name}/{name}/forces"] = e, f
            out[f"{model_name}/{name}/stress"] = s
    np.savez_compressed(HERE / "reference.npz", **out)
    families()
    print("wrote", sorted(p.name for p in HERE.glob("*.npz")))


if __name__ == "__main__":
    main()
