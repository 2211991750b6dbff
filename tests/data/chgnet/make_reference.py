"""Energies, forces, stress and magnetic moments of the pretrained CHGNet models, evaluated by
chgnet itself in float64.

Needs torch, pymatgen, ase and ``chgnet`` 0.4.2 (whose wheel ships the three pretrained models),
kept in a virtual environment of their own outside the repository::

    python -m venv /path/venv-torch && /path/venv-torch/bin/pip install torch ase chgnet==0.4.2
    /path/venv-torch/bin/python tests/data/chgnet/make_reference.py

It writes ``reference.npz`` beside itself; jaxdd's tests read that file without torch or chgnet.

The structures (``systems/<name>/numbers``, ``positions`` [Å], ``cell`` [Å], ``pbc``), each
rattled by 0.05 Å:

* ``fe2o3``: corundum Fe2O3 in its primitive rhombohedral cell (10 atoms), strained by about
  1 %: a magnetic oxide in a non-orthogonal cell;
* ``li2o``: antifluorite Li2O, the conventional cubic cell (12 atoms), strained by about 1 %;
* ``limno2_triclinic``: Li2Mn2O4 ordered on the rocksalt lattice in a triclinic cell (8
  atoms; the cubic cell sheared by up to 12 %);
* ``close_pair``: rocksalt LiH (8 atoms) with one H moved to 0.7 Å of a Li: the short-distance
  end of the radial basis;
* ``isolated``: a LiF pair 1.6 Å apart and a Na atom more than 7 Å from every atom in a 10 Å
  cubic box: no angles at all (no atom has two bonds within 3 Å) and an isolated atom (no
  neighbour within the cutoff; chgnet's converter is told to ``ignore`` it rather than raise);
* ``slab``: a Cu(100) slab of 3 layers, pbc (True, True, False), with 4 Å of vacuum between
  its periodic images along z: chgnet takes the Atoms' pbc through pymatgen (no neighbours
  across z), as jaxdd does.

For the models ``0.3.0``, ``0.2.0`` and ``r2scan`` (``<model>/<name>/...``):

* ``energy`` [eV], the total: chgnet returns energy per atom (``e``), multiplied back by the
  number of atoms; ``energies`` [eV] (N,): chgnet's site energies (the readout's per-atom
  energy plus the composition model's, AtomRef, reference energy of the element), which sum
  to ``energy``;
* ``forces`` [eV/Å] (N, 3);
* ``stress`` [eV/Å³] (3, 3), ASE's convention, stress = (1/V) dE/dε: chgnet returns
  ``s = (1/V) dE/dε × 160.21766208`` in GPa, with the same sign (positive under tension); it is
  divided here by chgnet's own factor 160.21766208, so the conversion is exact. The sign is
  checked against a central difference of chgnet's energy under strain (:func:`_check_sign`);
* ``magmoms`` [μB] (N,): chgnet's site magnetic moments ``|Linear(h_i)|`` (``m``).

How chgnet is run in float64 (:func:`model64`): the model is loaded with torch's default dtype
set to float64 and converted with ``.double()`` (the checkpoints' float32 weights widened); the
module-level ``TORCH_DTYPE`` of ``chgnet.graph.converter``, ``chgnet.graph.crystalgraph`` and
``chgnet.model.model`` (float32, used for the fractional coordinates, lattice, images, strain
and volumes) is set to float64; and ``AtomRef._assemble_graphs``, which casts the composition
fractions with ``.float()`` whatever the model's dtype, returns them in float64. With the
default dtype float64, the constant 1/√2 of chgnet's Fourier basis (``1 /
torch.sqrt(torch.tensor([2]))``) is computed in float64 too.

Also stored: ``meta/chgnet_version``, ``meta/torch_version``, ``meta/pymatgen_version`` and
``meta/<model>/atom_cutoff``, ``meta/<model>/bond_cutoff`` [Å]. :func:`live_reference` gives the
float64 result for any ``ase.Atoms`` to tests that have torch and chgnet.
"""

from __future__ import annotations

import contextlib
import functools
import pathlib
import warnings

import numpy as np
from ase import Atoms
from ase.build import bulk, fcc100
from ase.spacegroup import crystal

HERE = pathlib.Path(__file__).resolve().parent
MODELS = ("0.3.0", "0.2.0", "r2scan")
RATTLE = 0.05
#: chgnet's factor from eV/Å³ to GPa (chgnet/model/model.py, ``CHGNet._compute``).
GPA_PER_EV_A3 = 160.21766208


@contextlib.contextmanager
def float64():
    """torch's default dtype and chgnet's TORCH_DTYPE set to float64, AtomRef's composition
    fractions left in the default dtype, for the duration of the block."""
    import chgnet.graph.converter
    import chgnet.graph.crystalgraph
    import chgnet.model.model
    import torch
    from chgnet.model.composition_model import AtomRef

    modules = (chgnet.graph.converter, chgnet.graph.crystalgraph, chgnet.model.model)
    saved = torch.get_default_dtype(), [m.TORCH_DTYPE for m in modules], AtomRef._assemble_graphs

    def assemble(self, graphs):
        feas = []
        for graph in graphs:
            fea = torch.bincount(graph.atomic_number - 1, minlength=self.max_num_elements)
            if self.is_intensive:
                fea = fea / graph.atomic_number.shape[0]
            feas.append(fea)
        return torch.stack(feas, dim=0).to(torch.get_default_dtype())

    torch.set_default_dtype(torch.float64)
    for m in modules:
        m.TORCH_DTYPE = torch.float64
    AtomRef._assemble_graphs = assemble
    try:
        yield
    finally:
        torch.set_default_dtype(saved[0])
        for m, dtype in zip(modules, saved[1]):
            m.TORCH_DTYPE = dtype
        AtomRef._assemble_graphs = saved[2]


@functools.lru_cache(maxsize=None)
def model64(name: str):
    """chgnet's pretrained model ``name`` in float64, its converter ignoring isolated atoms."""
    from chgnet.model import CHGNet

    with float64(), warnings.catch_warnings(), contextlib.redirect_stdout(None):
        warnings.simplefilter("ignore")
        model = CHGNet.load(model_name=name, use_device="cpu", verbose=False).double().eval()
    model.graph_converter.set_isolated_atom_response("ignore")
    return model


def live_reference(name: str, atoms: Atoms) -> dict[str, np.ndarray]:
    """chgnet's float64 ``energy`` (total, eV), ``energies`` (N,) eV, ``forces`` (N, 3) eV/Å,
    ``stress`` (3, 3) eV/Å³ (ASE's sign) and ``magmoms`` (N,) μB of ``atoms`` for model ``name``."""
    from pymatgen.io.ase import AseAtomsAdaptor

    model = model64(name)
    with float64():
        graph = model.graph_converter(AseAtomsAdaptor.get_structure(atoms))
        pred = model.predict_graph(graph, task="efsm", return_site_energies=True)
    n = len(atoms)
    out = {"energy": np.array(float(pred["e"]) * n), "energies": np.asarray(pred["site_energies"], np.float64),
           "forces": np.asarray(pred["f"], np.float64), "stress": np.asarray(pred["s"], np.float64) / GPA_PER_EV_A3,
           "magmoms": np.asarray(pred["m"], np.float64)}
    assert np.isclose(out["energies"].sum(), out["energy"], rtol=1e-12, atol=0), (out["energies"].sum(), out["energy"])
    return out


def _check_sign(name: str, atoms: Atoms, stress: np.ndarray, delta: float = 1e-5) -> None:
    """``stress`` equals (1/V) dE/dε by central differences of chgnet's energy under the
    symmetric strains ε_xx and ε_xy (positions strained with the cell)."""
    for a, b in ((0, 0), (0, 1)):
        eps = np.zeros((3, 3))
        eps[a, b] = eps[b, a] = delta / (1 if a == b else 2)
        energies = []
        for sign in (1, -1):
            strained = atoms.copy()
            strained.set_cell(atoms.cell.array @ (np.eye(3) + sign * eps), scale_atoms=True)
            energies.append(float(live_reference(name, strained)["energy"]))
        d_e = (energies[0] - energies[1]) / (2 * delta)
        want = d_e / atoms.get_volume()
        got = stress[a, b] if a == b else 0.5 * (stress[a, b] + stress[b, a])
        assert abs(got - want) < 1e-6 * max(1.0, abs(want)), (name, a, b, got, want)


def make_systems() -> dict[str, Atoms]:
    rng = np.random.default_rng(20231201)

    def strained(atoms, size):
        sym = rng.uniform(-1, 1, (3, 3))
        atoms.set_cell(atoms.cell.array @ (np.eye(3) + size * 0.5 * (sym + sym.T)), scale_atoms=True)
        return atoms

    fe2o3 = crystal(["Fe", "O"], basis=[(0, 0, 0.3553), (0.3059, 0, 0.25)], spacegroup=167,
                    cellpar=[5.035, 5.035, 13.747, 90, 90, 120], primitive_cell=True)
    fe2o3 = strained(fe2o3, 0.01)

    li2o = strained(bulk("Li2O", "fluorite", a=4.61, cubic=True), 0.01)

    limno2 = bulk("MnO", "rocksalt", a=4.2, cubic=True)  # 4 Mn, 4 O
    limno2.numbers[[0, 6]] = 3  # two of the Mn become Li
    assert sorted(limno2.get_chemical_symbols()) == sorted(["Li"] * 2 + ["Mn"] * 2 + ["O"] * 4)
    shear = np.array([[1.0, 0.12, -0.07], [0.05, 1.0, 0.09], [-0.04, 0.1, 1.0]])
    limno2.set_cell(limno2.cell.array @ shear, scale_atoms=True)

    close = bulk("LiH", "rocksalt", a=4.08, cubic=True)  # Li at even, H at odd indices
    li, h = 0, 1
    d = close.get_distance(li, h, mic=True, vector=True)
    close.positions[h] = close.positions[li] + 0.7 * d / np.linalg.norm(d)

    isolated = Atoms("LiFNa", positions=[[0.2, 0.3, 0.1], [1.8, 0.3, 0.1], [5.3, 5.1, 5.4]], cell=np.eye(3) * 10.0,
                     pbc=True)

    slab = fcc100("Cu", size=(2, 2, 3), a=3.61, vacuum=2.0)
    slab.pbc = (True, True, False)

    systems = {"fe2o3": fe2o3, "li2o": li2o, "limno2_triclinic": limno2, "close_pair": close, "isolated": isolated,
               "slab": slab}
    for seed, (name, atoms) in enumerate(systems.items()):
        if name != "isolated":
            atoms.rattle(RATTLE, seed=seed)
        if atoms.pbc.all():
            atoms.wrap()
    dist = close.get_all_distances(mic=True) + 10 * np.eye(len(close))
    assert np.argwhere(np.triu(dist < 1.2)).tolist() == [[0, 1]], dist.min()
    dist = isolated.get_all_distances(mic=True) + 100 * np.eye(3)
    assert dist[2].min() > 7.0 and dist[0, 1] < 3.0, dist
    return systems


def main():
    import chgnet
    import pymatgen.core
    import torch

    systems = make_systems()
    out = {}
    for name, a in systems.items():
        out[f"systems/{name}/numbers"] = a.numbers.astype(np.int64)
        out[f"systems/{name}/positions"] = a.positions
        out[f"systems/{name}/cell"] = a.cell.array
        out[f"systems/{name}/pbc"] = a.pbc
    for model in MODELS:
        out[f"meta/{model}/atom_cutoff"] = np.array(float(model64(model).graph_converter.atom_graph_cutoff))
        out[f"meta/{model}/bond_cutoff"] = np.array(float(model64(model).graph_converter.bond_graph_cutoff))
        for name, a in systems.items():
            result = live_reference(model, a)
            for key, value in result.items():
                out[f"{model}/{name}/{key}"] = value
            print(f"{model:7s} {name:18s} E = {float(result['energy']):.10f} eV  |F|max = "
                  f"{np.abs(result['forces']).max():.4f} eV/Å  m = {np.round(result['magmoms'], 3).tolist()}")
        _check_sign(model, systems["li2o"], out[f"{model}/li2o/stress"])
    out["meta/chgnet_version"] = np.array(chgnet.__version__)
    out["meta/torch_version"] = np.array(torch.__version__)
    out["meta/pymatgen_version"] = np.array(pymatgen.core.__version__)
    np.savez_compressed(HERE / "reference.npz", **out)
    print("wrote", HERE / "reference.npz", f"({(HERE / 'reference.npz').stat().st_size} bytes)")


if __name__ == "__main__":
    main()
