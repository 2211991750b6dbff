"""Specification of ``bench/md_lj.py``, the molecular-dynamics benchmark on the LJ melt.

The script runs in a subprocess on the CPU, as a user would start it, on a tiny melt; it
must set its own device count (two virtual CPU devices) before JAX starts.
"""

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from jaxdd import ffi
from jaxdd.data.systems import LAMMPS_MELT_ENERGY_PER_ATOM

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "bench" / "md_lj.py"

# Output in the format of `lmp -in in.lj` (shortened): the thermo table and the loop-time line.
LAMMPS_LOG = """\
LAMMPS (7 Feb 2024 - Update 1)
Created 32000 atoms
Per MPI rank memory allocation (min/avg/max) = 3.222 | 3.222 | 3.222 Mbytes
   Step          Temp          E_pair         E_mol          TotEng         Press
         0   1.44          -6.7733681      0             -4.6218056     -5.0244179
        50   0.70303849    -5.6796164      0             -4.6291711      0.70751195
       100   0.72628044    -5.7150774      0             -4.6299107      0.45695019
Loop time of 1.39 on 1 procs for 100 steps with 32000 atoms

Performance: 31079.137 tau/day, 71.942 timesteps/s, 2.302 Matom-step/s
99.6% CPU use with 1 MPI tasks x 1 OpenMP threads

MPI task timing breakdown:
Section |  min time  |  avg time  |  max time  |%varavg| %total
---------------------------------------------------------------
Pair    | 1.1        | 1.1        | 1.1        |   0.0 | 79.14
Neigh   | 0.15       | 0.15       | 0.15       |   0.0 | 10.79
Comm    | 0.05       | 0.05       | 0.05       |   0.0 |  3.60
Output  | 2.1e-05    | 2.1e-05    | 2.1e-05    |   0.0 |  0.00
Modify  | 0.07       | 0.07       | 0.07       |   0.0 |  5.04
Other   |            | 0.02       |            |       |  1.44

Nlocal:          32000 ave       32000 max       32000 min
"""


#: A stand-in for ``lmp`` (and ``mpirun -np N``): LAMMPS's log for the melt, whose loop time
#: grows by 10% at each call, so that each run's figure is told apart.
FAKE_LAMMPS = """\
import os, sys
from pathlib import Path
if sys.argv[1] == "-np":  # mpirun -np N lmp -in in.lj
    os.environ["FAKE_PROCS"] = sys.argv[2]
    os.execv(sys.executable, [sys.executable, sys.argv[3], *sys.argv[4:]])
count = Path(os.environ["FAKE_COUNT"])
k = int(count.read_text()) if count.exists() else 0
count.write_text(str(k + 1))
print("   Step          Temp          E_pair")
print("         0   1.44          -6.7733681")
print(f"Loop time of {1.0 + 0.1 * k} on {os.environ.get('FAKE_PROCS', '1')} procs for 5 steps with 256 atoms")
"""


def fake_lammps(directory) -> dict:
    """Environment entries that put the stand-in ``lmp`` and ``mpirun`` first on the PATH."""
    bin_dir = directory / "bin"
    bin_dir.mkdir()
    for name in ("lmp", "mpirun"):
        exe = bin_dir / name
        exe.write_text(f"#!{sys.executable}\n{FAKE_LAMMPS}")
        exe.chmod(0o755)
    return {"PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}", "FAKE_COUNT": str(directory / "count")}


def run_script(directory, *extra, env_extra=None):
    path = directory / "md_lj.json"
    env = {k: v for k, v in os.environ.items() if k != "JAX_NUM_CPU_DEVICES"}  # the script sets it
    env["JAX_PLATFORMS"] = "cpu"
    env.update(env_extra or {})
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--n-cells", "4", "--steps", "5", "--devices", "1,2", "--dtypes", "float64",
         "--json", str(path), *extra],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, f"md_lj.py exited {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout, path


# The tests of the benchmark's tiny run (a subprocess, ~13 s) run with the slow set.
@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    directory = tmp_path_factory.mktemp("bench")
    return run_script(directory, "--paths", "jnp", env_extra=fake_lammps(directory))


@pytest.mark.slow
def test_prints_a_row_per_device_count_and_lammps(tiny_run):
    out, _ = tiny_run
    for devices in (1, 2):
        row = re.search(rf"^jaxdd \(jnp\)\s+{devices}\s+float64\s+([\d,]+)\s", out, flags=re.MULTILINE)
        assert row, out
        assert float(row.group(1).replace(",", "")) > 0
    for cores in (1, 2):
        assert re.search(rf"^LAMMPS lj/cut\s+{cores}\s.*measured in this run; the fastest of the runs beside", out,
                         flags=re.MULTILINE), out
    assert re.search(r"^target \(best jaxdd path >= 0\.8x LAMMPS on equal cores\): (met|NOT met)", out,
                     flags=re.MULTILINE), out
    assert re.search(r"^target \(jnp path >= 0\.3x LAMMPS on equal cores\): (met|NOT met): 1 core .*, 2 cores ", out,
                     flags=re.MULTILINE), out


@pytest.mark.slow
def test_writes_its_figures_as_json(tiny_run):
    _, path = tiny_run
    record = json.loads(path.read_text())
    assert record["n_atoms"] == 256 and record["steps"] == 5
    rows = {(r["devices"], r["dtype"]): r for r in record["results"] if r["path"] == "jnp"}
    assert set(rows) == {(1, "float64"), (2, "float64")}
    for r in rows.values():
        assert r["steps"] == 5 and r["atom_steps_per_second"] > 0 and r["recompiles"] == 0
        # Step 0 is the perfect lattice: LAMMPS's energy per atom.
        assert abs(r["pe_per_atom_first"] - LAMMPS_MELT_ENERGY_PER_ATOM) < 1e-9
        assert r["ratio_to_lammps"] > 0
        assert r["pe_per_atom_first"] == pytest.approx(r["lammps_beside"]["pe_per_atom_first"], abs=1e-7)
    # The decomposition does not change the trajectory: same energy after 5 steps on 1 and 2 devices.
    assert abs(rows[1, "float64"]["pe_per_atom_last"] - rows[2, "float64"]["pe_per_atom_last"]) < 1e-10
    assert record["fused"]["available"] is ffi.available()
    assert {v["source"] for v in record["lammps"].values()} == {"measured in this run"}
    assert record["target"]["met"] in (True, False) and record["target"]["jnp_met"] in (True, False)


@pytest.mark.slow
def test_each_row_is_the_fastest_of_its_timed_runs(tiny_run):
    _, path = tiny_run
    record = json.loads(path.read_text())
    assert record["repeats"] == 3
    for r in record["results"]:
        assert len(r["seconds_of_each_run"]) == 3 and r["seconds"] == min(r["seconds_of_each_run"])


@pytest.mark.slow
def test_each_ratio_is_to_the_lammps_runs_beside_its_row(tiny_run):
    # The stand-in LAMMPS slows down at every call: rows measured later see a slower LAMMPS,
    # and each row's ratio is to the fastest of the runs made right before it.
    _, path = tiny_run
    record = json.loads(path.read_text())
    rows = record["results"]
    beside = [r["lammps_beside"] for r in rows]
    assert [b["procs"] for b in beside] == [r["devices"] for r in rows]
    assert all(len(b["seconds_of_each_run"]) == 3 and b["seconds"] == min(b["seconds_of_each_run"]) for b in beside)
    assert beside[0]["atom_steps_per_second"] > beside[1]["atom_steps_per_second"]
    for r, b in zip(rows, beside):
        assert r["ratio_to_lammps"] == pytest.approx(r["atom_steps_per_second"] / b["atom_steps_per_second"])
    # The LAMMPS rows of the table show the fastest run on each core count.
    assert record["lammps"]["1"]["atom_steps_per_second"] == beside[0]["atom_steps_per_second"]


def test_without_lammps_the_recorded_reference_is_used_and_labelled(tmp_path):
    spec = importlib.util.spec_from_file_location("md_lj", SCRIPT)
    md_lj = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(md_lj)
    args = md_lj.parse_args(["--no-lammps"])
    lmp, notes = md_lj.find_lammps(args)
    assert lmp is None and notes == ["LAMMPS not run (--no-lammps)"]
    rows = [dict(devices=n, lammps_beside=None) for n in (1, 2)]
    figures = md_lj.lammps_figures(rows, args, notes)
    assert {n: f["atom_steps_per_second"] for n, f in figures.items()} == md_lj.LAMMPS_REFERENCE
    assert {f["source"] for f in figures.values()} == {md_lj.REFERENCE_LABEL}


@pytest.mark.slow
def test_fused_path_runs_beside_the_jnp_path_on_the_same_trajectory(tmp_path):
    out, path = run_script(tmp_path, "--paths", "jnp,fused", "--no-lammps")
    if not ffi.available():
        assert re.search(r"^fused kernels\s.*not available in this build", out, flags=re.MULTILINE), out
        return
    rows = {(r["path"], r["devices"]): r for r in json.loads(path.read_text())["results"]}
    for devices in (1, 2):
        assert re.search(rf"^jaxdd \(fused\)\s+{devices}\s+float64\s+[\d,]+\s", out, flags=re.MULTILINE), out
        fused, jnp_ = rows["fused", devices], rows["jnp", devices]
        assert abs(fused["pe_per_atom_last"] - jnp_["pe_per_atom_last"]) < 1e-10


def load_md_lj():
    spec = importlib.util.spec_from_file_location("md_lj", SCRIPT)
    md_lj = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(md_lj)
    return md_lj


def test_lammps_runs_with_the_suffix_asked_for_and_its_style_is_named(tmp_path):
    lmp = tmp_path / "lmp"
    lmp.write_text(f"#!{sys.executable}\nimport sys\nprint(' '.join(sys.argv[1:]))\n"
                   "print('Loop time of 1.0 on 1 procs for 5 steps with 256 atoms')\n")
    lmp.chmod(0o755)
    md_lj = load_md_lj()
    figures = md_lj.run_lammps(str(lmp), 1, 4, 5, suffix="opt")
    assert figures["command"].endswith("-in in.lj -sf opt") and figures["style"] == "lj/cut/opt"
    assert md_lj.run_lammps(str(lmp), 1, 4, 5)["style"] == "lj/cut"


def test_parses_lammps_loop_time_and_thermo():
    md_lj = load_md_lj()
    figures = md_lj.parse_lammps_log(LAMMPS_LOG)
    assert (figures["procs"], figures["steps"], figures["n_atoms"]) == (1, 100, 32000)
    assert figures["atom_steps_per_second"] == pytest.approx(100 * 32000 / 1.39)
    assert figures["pe_per_atom_first"] == pytest.approx(-6.7733681)
    assert figures["pe_per_atom_last"] == pytest.approx(-5.7150774)
    assert (figures["thermo_first_step"], figures["thermo_last_step"]) == (0, 100)
    # LAMMPS's own breakdown of its loop, average seconds and share of each section.
    assert list(figures["breakdown"]) == ["Pair", "Neigh", "Comm", "Output", "Modify", "Other"]
    assert figures["breakdown"]["Pair"] == dict(avg_seconds=1.1, percent=79.14)
    with pytest.raises(ValueError, match="Loop time"):
        md_lj.parse_lammps_log("ERROR: Unknown command")
