"""Specification of ``python -m jaxdd.lammps``: its help, and its usage errors.

Like ``python -m jaxdd.validate``: exit status 2 for a usage error, with one line on stderr
that names the thing that is wrong and says what to do. Each error here is found before
LAMMPS starts or the model compiles (the script, the model path, the types, the units), so
these run without the ``lammps`` module; the runs themselves are in ``test_lammps_live.py``.
"""

from __future__ import annotations

import pytest

from jaxdd.lammps.__main__ import main

SCRIPT = """\
units           {units}
atom_style      atomic
lattice         fcc 5.26
region          box block 0 2 0 2 0 2
create_box      {types} box
create_atoms    1 box
mass            * 39.948
{fix}
fix             1 all nve
run             10
"""
FIX = "fix             ml all external pf/callback 1 1"


def script(tmp_path, units="metal", types=1, fix=FIX):
    path = tmp_path / "in.test"
    path.write_text(SCRIPT.format(units=units, types=types, fix=fix))
    return str(path)


def run(capsys, *argv):
    status = main(list(argv))
    err = capsys.readouterr().err
    return status, err


def test_help_names_the_script_the_model_and_the_types(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--help"])
    out = capsys.readouterr().out
    assert exit_.value.code == 0
    assert all(option in out for option in ("-in", "--model", "--types", "--grid"))


def test_a_missing_option_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--model", "bridge_systems:argon_lj"])
    assert exit_.value.code == 2
    assert "-in" in capsys.readouterr().err


def test_a_bad_grid_is_a_usage_error(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["-in", script(tmp_path), "--model", "bridge_systems:argon_lj", "--grid", "2,2"])
    assert exit_.value.code == 2
    assert "--grid must be three integers" in capsys.readouterr().err


def test_a_model_module_that_cannot_be_imported_is_a_usage_error_naming_it(tmp_path, capsys):
    status, err = run(capsys, "-in", script(tmp_path), "--model", "no_such_module:factory", "--types", "1=Ar")
    assert status == 2
    assert "cannot import module 'no_such_module'" in err and err.count("\n") == 1


def test_a_model_factory_the_module_lacks_is_a_usage_error_naming_it(tmp_path, capsys):
    status, err = run(capsys, "-in", script(tmp_path), "--model", "bridge_systems:no_such_factory", "--types", "1=Ar")
    assert status == 2
    assert "has no attribute 'no_such_factory'" in err


def test_a_factory_that_fails_is_a_usage_error_naming_it(tmp_path, capsys):
    status, err = run(capsys, "-in", script(tmp_path), "--model", "bridge_systems:mesh_of", "--types", "1=Ar")
    assert status == 2
    assert "bridge_systems:mesh_of" in err


def test_an_atom_type_without_a_species_is_a_usage_error_naming_the_type(tmp_path, capsys):
    status, err = run(capsys, "-in", script(tmp_path, types=2), "--model", "bridge_systems:argon_lj", "--types", "1=Ar")
    assert status == 2
    assert "atom type 2 of the 2 in the LAMMPS system has no species: add 2=<element> to --types" in err


def test_an_unreadable_types_option_is_a_usage_error(tmp_path, capsys):
    status, err = run(capsys, "-in", script(tmp_path), "--model", "bridge_systems:argon_lj", "--types", "1:Ar")
    assert status == 2
    assert "'1:Ar' is not TYPE=SPECIES" in err


def test_a_script_without_a_fix_external_is_a_usage_error_saying_what_to_add(tmp_path, capsys):
    status, err = run(capsys, "-in", script(tmp_path, fix=""), "--model", "bridge_systems:argon_lj", "--types", "1=Ar")
    assert status == 2
    assert "names no fix of style external" in err and "fix jaxdd all external pf/callback 1 1" in err


def test_a_fix_id_the_script_lacks_is_a_usage_error_naming_the_ones_it_has(tmp_path, capsys):
    status, err = run(capsys, "-in", script(tmp_path), "--model", "bridge_systems:argon_lj", "--types", "1=Ar",
                      "--fix", "other")
    assert status == 2
    assert "no fix 'other' of style external (its fix external: ml)" in err


def test_a_script_that_cannot_be_read_is_a_usage_error(tmp_path, capsys):
    status, err = run(capsys, "-in", str(tmp_path / "missing.in"), "--model", "bridge_systems:argon_lj")
    assert status == 2
    assert "cannot read the input script" in err


@pytest.mark.parametrize("units", ["real", "lj"])
def test_a_non_metal_unit_system_is_a_usage_error_saying_to_use_metal(tmp_path, capsys, units):
    status, err = run(capsys, "-in", script(tmp_path, units=units), "--model", "bridge_systems:argon_lj",
                      "--types", "1=Ar")
    assert status == 2
    assert f"units {units}: the jaxdd bridge runs LAMMPS's units metal only" in err


def test_a_script_without_a_units_command_is_refused_as_lammps_default_lj(tmp_path, capsys):
    path = tmp_path / "in.nounits"
    path.write_text(SCRIPT.format(units="metal", types=1, fix=FIX).replace("units           metal\n", ""))
    status, err = run(capsys, "-in", str(path), "--model", "bridge_systems:argon_lj", "--types", "1=Ar")
    assert status == 2
    assert "units lj" in err and "default unit style is lj" in err


def test_a_distributed_model_is_taken_with_its_own_config_and_a_conflicting_option_is_named(tmp_path, capsys):
    # docs/lammps.md allows a factory returning a DistributedModel; it used to be refused as "not a model wrapper".
    status, err = run(capsys, "-in", script(tmp_path), "--model", "bridge_systems:argon_distributed", "--types",
                      "1=Ar", "--skin", "3")
    assert status == 2 and "not a model wrapper" not in err
    assert "--skin 3.0 differs from the DomainConfig.skin 1.0 of the DistributedModel" in err
    status, err = run(capsys, "-in", script(tmp_path), "--model", "bridge_systems:argon_distributed", "--types",
                      "1=Ar", "--grid", "1,1,2")
    assert status == 2 and "grid (1, 1, 2) differs from the DistributedModel's DomainConfig.grid (1, 1, 1)" in err
