"""Energies, forces and stress of the pretrained SevenNet models, evaluated by sevenn itself.

Needs torch, e3nn, ase, matscipy and ``sevenn`` 0.13.0 (with its pretrained checkpoints, which
ship inside the wheel), kept in a virtual environment of their own outside the repository
(``/work/venv-torch``: the CPU wheel of torch 2.13.0 first, then ``e3nn torch_geometric ase numpy
matscipy braceexpand pyyaml tqdm scikit-learn pandas requests sevenn==0.13.0``); the tests read
what this writes and need none of them. Run from the repository root::

    /work/venv-torch/bin/python tests/data/sevennet/make_reference.py

Writes ``reference.npz`` next to this file (``np.savez_compressed``, about 60 kB):

* ``systems/<name>/{numbers,positions,cell,pbc}`` for four small systems, each rattled by
  0.05 Å with a fixed seed so that the forces are not zero:

  - ``triclinic_close``: HfSi3O8 (12 atoms) in a triclinic periodic cell, with one Si-O pair
    at 1.0 Å (1.1 Å before the rattle; the next shortest distance is 1.6 Å);
  - ``slab``: Cu(100), 2x2 surface cell, 4 layers (16 atoms), 6 Å of vacuum on each side,
    pbc (True, True, False);
  - ``oxide``: rocksalt MgO, the conventional cell doubled along x (16 atoms), sheared by about
    1 %;
  - ``molecule``: ethanol and a water molecule 3 Å apart (12 atoms) in a 14 Å box, pbc False;

* ``<model>/<modal>/<name>/...`` for the models ``7net-0`` (SevenNet_0__11Jul2024),
  ``7net-l3i5`` and ``7net-mf-0`` (SevenNet_MF_0), with ``<modal>`` ``default`` for the
  single-fidelity models and ``PBE`` and ``R2SCAN`` for ``7net-mf-0``:

  - ``energy`` [eV] (total, a 0-d array), ``forces`` [eV/Å] (N, 3), ``energies`` [eV] (N,):
    the per-atom energies (sevenn's ``atomic_energy``; they sum to ``energy``);
  - ``stress`` [eV/Å³] (6,): what ``atoms.get_stress()`` returns from ``SevenNetCalculator``,
    ASE's Voigt order xx, yy, zz, yz, xz, xy and ASE's sign (stress = (1/V) dE/dstrain); NaN for
    ``molecule`` (pbc False: sevenn divides the virial by the volume of the box it is given, a
    number without meaning there);
  - ``stress3x3`` [eV/Å³] (3, 3): the same stress in full, sigma_ab = (1/V) sum_edges r_a dE/dr_b
    over sevenn's edge vectors r (NaN for ``molecule``); its Voigt components equal ``stress``;
  - ``virial`` [eV] (3, 3): - sum_edges r_a dE/dr_b = -V sigma, finite for every system
    (``molecule`` included);

  all in float64: the model built by sevenn's own loader (``sevenn.util.load_checkpoint`` and
  ``build_model``, which applies the v0.9 checkpoints' backward-compatibility sort of the
  convolution weights), then ``.double()``, evaluated on float64 inputs by a
  ``SevenNetCalculator`` whose only change is that it does not cast the graph to float32 (and
  a hook widens sevenn's float32 one-hot vectors: see :func:`_model64`);

  - ``energy_f32``, ``forces_f32``, ``energies_f32``, ``stress_f32``: the plain float32
    ``SevenNetCalculator`` (sevenn's default), for information;

* ``silu_cst``: the constant ``e3nn.math.normalize2mom`` computed for SiLU (every one of the
  models' ``normalize2mom`` modules wraps SiLU, with this one value);
* ``meta/sevenn_version``, ``meta/torch_version``, ``meta/e3nn_version``,
  ``meta/<model>/cutoff`` [Å], ``meta/neighbour_list`` (the neighbour-list code sevenn used).

``python tests/data/sevennet/make_reference.py time`` instead times one float32 energy, forces
and stress call of ``7net-0`` on 1000 atoms of diamond Si with one torch thread (run it under
``taskset -c 1``). :func:`live_reference` gives the float64 result for any ``ase.Atoms`` to tests
that have torch and sevenn.
"""

from __future__ import annotations

import contextlib
import functools
import pathlib
import sys
import warnings

import numpy as np
from ase import Atoms
from ase.build import bulk, fcc100, molecule

HERE = pathlib.Path(__file__).resolve().parent
CHECKPOINTS = {
    "7net-0": "SevenNet_0__11Jul2024/checkpoint_sevennet_0.pth",
    "7net-l3i5": "SevenNet_l3i5/checkpoint_l3i5.pth",
    "7net-mf-0": "SevenNet_MF_0/checkpoint_sevennet_mf_0.pth",
}
MODALS = {"7net-0": ["default"], "7net-l3i5": ["default"], "7net-mf-0": ["PBE", "R2SCAN"]}
RATTLE = 0.05


def checkpoint_path(model_name: str) -> pathlib.Path:
    """The checkpoint of pretrained model ``model_name`` inside the installed sevenn package."""
    import sevenn

    return pathlib.Path(sevenn.__file__).parent / "pretrained_potentials" / CHECKPOINTS[model_name]


@contextlib.contextmanager
def _default_dtype(dtype):
    import torch

    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


@functools.lru_cache(maxsize=None)
def _model64(model_name: str):
    """sevenn's model of ``model_name`` in float64.

    Built under float32 (torch's default) and converted with ``.double()`` afterwards: the
    backward-compatibility sort that sevenn applies to v0.9 checkpoints compares the float32
    Wigner 3j buffers stored in the checkpoint with freshly computed ones, and fails (``Float
    did not match Double``) when the model is built with float64 as the default dtype. So the
    Wigner 3j buffers (and every other constant in the checkpoint) are float32 values widened to
    float64. The Wigner 3j buffers are then replaced by float64 ones (``e3nn.o3.wigner_3j``,
    which they equal, signs included, after sevenn's patch): the coupling coefficients are
    constants of e3nn, not trained weights, and float32 roundings of them would move the
    float64 references by up to 3e-10 relative in energy and 2e-7 eV/Å in forces (the
    triclinic cell's close pair). The trained weights stay the checkpoint's float32 values.

    sevenn's ``OnehotEmbedding`` (species and modality one-hot vectors) casts its output with
    ``.float()`` whatever the model's dtype; a forward hook widens it to float64 (0 and 1:
    exact).
    """
    import sevenn.util
    import torch
    from sevenn.nn.node_embedding import OnehotEmbedding

    def widen(module, inputs, data):
        for key in {module.key_output, module.key_additional_output} - {None}:
            data[key] = data[key].to(torch.float64)
        return data

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = sevenn.util.load_checkpoint(str(checkpoint_path(model_name))).build_model()
    for module in model.modules():
        if isinstance(module, OnehotEmbedding):
            module.register_forward_hook(widen)
    model = model.double().eval()
    from e3nn.o3 import wigner_3j

    with torch.no_grad():
        for name, buffer in model.named_buffers():
            key = name.rsplit(".", 1)[-1]
            if key.startswith("_w3j_"):
                l1, l2, l3 = map(int, key[len("_w3j_"):].split("_"))
                exact = wigner_3j(l1, l2, l3, dtype=torch.float64)
                assert torch.allclose(buffer, exact, atol=1e-6), name
                buffer.copy_(exact)
    return model


def _calculator_class():
    """``SevenNetCalculator`` with the graph kept in float64 (sevenn casts it to float32)."""
    import torch
    from ase.calculators.calculator import Calculator, all_changes
    from sevenn import _keys as KEY
    from sevenn.atom_graph_data import AtomGraphData
    from sevenn.calculator import SevenNetCalculator
    from sevenn.train.dataload import unlabeled_atoms_to_graph
    from sevenn.util import dtype_correct

    class Float64Calculator(SevenNetCalculator):
        def graph(self, atoms):
            dct = unlabeled_atoms_to_graph(atoms, self.cutoff, with_shift=False)
            data = AtomGraphData(**{k: dtype_correct(v, float_dtype=torch.float64) for k, v in dct.items()})
            if self.modal:
                data[KEY.DATA_MODALITY] = self.modal
            return data.to(self.device)

        def calculate(self, atoms=None, properties=None, system_changes=all_changes):
            Calculator.calculate(self, atoms, properties, system_changes)
            with _default_dtype(torch.float64):
                self.results = self.output_to_results(self.model(self.graph(self.atoms)))

        def stress3x3(self, atoms):
            """sum_edges r_a dE/dr_b over sevenn's edges (eV): the model run up to its
            force/stress module, then the gradient of the energy with respect to the edge
            vectors."""
            model = self.model
            with _default_dtype(torch.float64):
                data = model._preprocess(self.graph(atoms))
                for name, module in model._modules.items():
                    if name == "force_output":
                        break
                    data = module(data)
                r = data[KEY.EDGE_VEC]
                (g,) = torch.autograd.grad(data[KEY.PRED_TOTAL_ENERGY].sum(), [r])
            return (r.T @ g).detach().numpy()

    return Float64Calculator


def calculator(model_name: str, modal: str | None = None, dtype: str = "float64"):
    """A ``SevenNetCalculator`` of ``model_name`` (``modal`` for ``7net-mf-0``; None or
    ``"default"`` otherwise) in ``dtype``: float64 as described in the module docstring, or
    sevenn's own float32 calculator."""
    from sevenn.calculator import SevenNetCalculator

    modal = None if modal in (None, "default") else modal
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if dtype == "float32":
            return SevenNetCalculator(str(checkpoint_path(model_name)), modal=modal, device="cpu")
        return _calculator_class()(_model64(model_name), file_type="model_instance", modal=modal, device="cpu")


def live_reference(model_name: str, modal: str | None, atoms: Atoms):
    """(energy [eV], forces [eV/Å] (N, 3), stress [eV/Å³] (6, ASE's Voigt order and sign)) of
    ``atoms`` from sevenn in float64; ``modal`` is ``"PBE"`` or ``"R2SCAN"`` for ``7net-mf-0``,
    None or ``"default"`` for the others."""
    atoms = atoms.copy()
    atoms.calc = calculator(model_name, modal)
    return atoms.get_potential_energy(), atoms.get_forces(), atoms.get_stress()


def silu_cst() -> float:
    """The ``normalize2mom`` constant of SiLU, checked to be the only one in every model."""
    import torch
    from e3nn.math import normalize2mom

    values = set()
    for name in CHECKPOINTS:
        for module in _model64(name).modules():
            if isinstance(module, normalize2mom):
                assert module.f is torch.nn.functional.silu, module.f
                values.add(module.cst)
    assert len(values) == 1, values
    return values.pop()


def make_systems() -> dict[str, Atoms]:
    rng = np.random.default_rng(20240711)

    # HfSi3O8 on a jittered 2x2x3 grid of a triclinic cell, then one O moved to 1.1 Å of a Si
    cell = np.array([[5.3, 0.0, 0.0], [1.2, 5.0, 0.0], [-0.8, 0.9, 5.6]])
    grid = np.array([[i, j, k] for i in range(2) for j in range(2) for k in range(3)], float)
    frac = (grid + 0.25 + rng.uniform(-0.04, 0.04, grid.shape)) / [2, 2, 3]
    tri = Atoms("HfSi3O8", cell=cell, pbc=True, scaled_positions=frac[[0, 3, 6, 9, 1, 2, 4, 5, 7, 8, 10, 11]])
    d = tri.get_distance(1, 5, mic=True, vector=True)  # Si 1 and its grid neighbour O 5
    tri.positions[5] = tri.positions[1] + 1.1 * d / np.linalg.norm(d)
    tri.rattle(RATTLE, seed=1)
    tri.wrap()

    slab = fcc100("Cu", size=(2, 2, 4), a=3.61, vacuum=6.0)
    slab.pbc = (True, True, False)
    slab.rattle(RATTLE, seed=2)

    oxide = bulk("MgO", "rocksalt", a=4.21, cubic=True).repeat((2, 1, 1))
    strain = np.eye(3) + 0.01 * np.array([[1.0, 0.6, -0.4], [0.6, -0.5, 0.8], [-0.4, 0.8, 0.3]])
    oxide.set_cell(oxide.cell.array @ strain, scale_atoms=True)
    oxide.rattle(RATTLE, seed=3)
    oxide.wrap()

    mol = molecule("CH3CH2OH")
    water = molecule("H2O")
    o = mol.positions[mol.numbers == 8][0]
    water.translate(o + np.array([0.0, -3.0, 0.5]) - water.positions[water.numbers == 8][0])
    mol += water
    mol.cell = [14.0, 14.0, 14.0]
    mol.center()
    mol.pbc = False
    mol.rattle(RATTLE, seed=4)

    systems = {"triclinic_close": tri, "slab": slab, "oxide": oxide, "molecule": mol}
    for name, a in systems.items():  # the close pair alone is close
        dist = a.get_all_distances(mic=bool(a.pbc.any())) + 10 * np.eye(len(a))
        close = np.argwhere(np.triu(dist < 1.5))
        expected = [[1, 5]] if name == "triclinic_close" else []
        if name == "molecule":  # bonds within the molecules, the molecules 2 Å apart or more
            close = np.argwhere(np.triu(dist < 0.8))
            assert dist[:9, 9:].min() > 2.0, dist[:9, 9:].min()
        assert close.tolist() == expected, (name, close, dist.min())
    return systems


def evaluate(model_name: str, modal: str, atoms: Atoms) -> dict[str, np.ndarray]:
    out = {}
    calc = calculator(model_name, modal)
    a = atoms.copy()
    a.calc = calc
    out["energy"] = np.array(a.get_potential_energy())
    out["forces"] = a.get_forces()
    out["energies"] = a.get_potential_energies()
    stress = a.get_stress()
    s = calc.stress3x3(atoms)
    volume = atoms.get_volume()
    out["virial"] = -s
    out["stress3x3"] = s / volume
    voigt = out["stress3x3"][[0, 1, 2, 1, 2, 0], [0, 1, 2, 2, 0, 1]]
    assert np.allclose(voigt, stress, rtol=1e-9, atol=1e-12), (voigt, stress)
    out["stress"] = stress
    if not atoms.pbc.any():
        out["stress"] = np.full(6, np.nan)
        out["stress3x3"] = np.full((3, 3), np.nan)
    assert np.isclose(out["energies"].sum(), out["energy"], rtol=1e-12)

    b = atoms.copy()
    b.calc = calculator(model_name, modal, "float32")
    out["energy_f32"] = np.array(b.get_potential_energy())
    out["forces_f32"] = b.get_forces()
    out["energies_f32"] = b.get_potential_energies()
    out["stress_f32"] = b.get_stress() if atoms.pbc.any() else np.full(6, np.nan)
    return out


def time_si(repeats: int = 3) -> float:
    """Median seconds of one float32 energy, forces and stress call of 7net-0 on 1000 atoms of
    diamond Si (one torch thread), after a warm-up call."""
    import time

    import torch

    torch.set_num_threads(1)
    atoms = bulk("Si", "diamond", a=5.43, cubic=True) * (5, 5, 5)
    atoms.rattle(0.01, seed=0)
    atoms.calc = calculator("7net-0", None, "float32")
    times = []
    for k in range(repeats + 1):
        atoms.calc.reset()
        t = time.perf_counter()
        atoms.get_potential_energy(), atoms.get_forces(), atoms.get_stress()
        if k:
            times.append(time.perf_counter() - t)
    print(f"7net-0 float32, {len(atoms)} atoms Si, 1 thread: {['%.2f' % t for t in times]} s, "
          f"median {np.median(times):.2f} s")
    return float(np.median(times))


def main():
    import e3nn
    import sevenn
    import sevenn.train.dataload as dataload
    import torch

    if sys.argv[1:] == ["time"]:
        time_si()
        return
    systems = make_systems()
    out = {}
    for name, a in systems.items():
        out[f"systems/{name}/numbers"] = a.numbers.astype(np.int64)
        out[f"systems/{name}/positions"] = a.positions
        out[f"systems/{name}/cell"] = a.cell.array
        out[f"systems/{name}/pbc"] = a.pbc
    for model_name, modals in MODALS.items():
        out[f"meta/{model_name}/cutoff"] = np.array(float(_model64(model_name).cutoff))
        for modal in modals:
            for name, a in systems.items():
                for key, value in evaluate(model_name, modal, a).items():
                    out[f"{model_name}/{modal}/{name}/{key}"] = value
                p = f"{model_name}/{modal}/{name}/"
                print(f"{model_name:10s} {modal:8s} {name:16s} E = {float(out[p + 'energy']):.10f} eV"
                      f"  (float32 {float(out[p + 'energy_f32']):.6f})")
    out["silu_cst"] = np.array(silu_cst())
    out["meta/sevenn_version"] = np.array(sevenn.__version__)
    out["meta/torch_version"] = np.array(torch.__version__)
    out["meta/e3nn_version"] = np.array(e3nn.__version__)
    out["meta/neighbour_list"] = np.array(dataload._graph_build_f.__name__)
    np.savez_compressed(HERE / "reference.npz", **out)
    print("wrote", HERE / "reference.npz", f"({(HERE / 'reference.npz').stat().st_size} bytes)")


if __name__ == "__main__":
    main()
