"""What the jaxdd distribution holds.

The source tree has three top-level folders that ship: ``jaxdd/`` (the library),
``models/`` (the model zoo, installed as ``jaxdd.models``) and ``specs/`` (the
preset specs, installed as package data ``jaxdd/specs/*.json``). Nothing may
install a top-level ``models`` or ``specs``.

The wheel is built once per module, offline
(``pip wheel --no-deps --no-build-isolation``), from a copy of the source tree in
a temporary folder, so the build leaves nothing behind in the repository. The kernel
library the editable install compiled goes into that copy's build folder, where
setuptools takes it as up to date (it is newer than every source) and packages it
instead of compiling csrc/ again; the slow test at the end builds from the sources alone.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path, PurePosixPath

import pytest

REPO = Path(__file__).resolve().parents[2]

# Top-level keys of a version-2 spec file (DESIGN.md, "Spec JSON (version 2)").
SPEC_KEYS = {
    "version",
    "core",
    "system_reductions",
    "node_energy_key",
    "node_virial_key",
    "owned_only_outputs",
    "all_reduce_outputs",
    "output_kinds",
    "compile",
}

# Source folder -> the package it is installed as.
SHIPPED_TREES = {"jaxdd": "jaxdd", "models": "jaxdd/models"}

_IGNORED_WITHOUT_GIT = shutil.ignore_patterns(
    ".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", ".pytest_cache", ".hypothesis"
)


def _source_spec_files() -> list[Path]:
    return sorted((REPO / "specs").glob("*.json"))


def _copy_source_tree(dest: Path) -> None:
    """Copy what a fresh checkout would hold: tracked files plus untracked files
    that git does not ignore (falls back to a filtered copy without git)."""
    try:
        listing = subprocess.run(
            ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            cwd=REPO,
            check=True,
            capture_output=True,
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        shutil.copytree(REPO, dest, ignore=_IGNORED_WITHOUT_GIT, dirs_exist_ok=True)
        return
    for rel in sorted({r for r in listing.decode().split("\0") if r}):
        src = REPO / rel
        if not src.is_file():  # deleted in the work tree, or a submodule
            continue
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, target)


def _shipped_python_files(tree: Path) -> dict[str, str]:
    """Installed path -> source path of every module in a package folder of
    ``jaxdd/`` and ``models/`` (a folder holding ``__init__.py``)."""
    shipped = {}
    for folder, installed in SHIPPED_TREES.items():
        root = tree / folder
        for init in sorted(root.rglob("__init__.py")):
            package = init.parent
            if "__pycache__" in package.parts:
                continue
            for module in sorted(package.glob("*.py")):
                rel = PurePosixPath(module.relative_to(root).as_posix())
                shipped[str(PurePosixPath(installed) / rel)] = str(module.relative_to(tree))
    return shipped


@pytest.fixture(scope="module")
def source_copy(tmp_path_factory) -> Path:
    src = tmp_path_factory.mktemp("source")
    _copy_source_tree(src)
    return src


def _built_library() -> Path | None:
    """The kernel library of the installed jaxdd (the editable install compiles it into
    jaxdd/ffi/), or None when there is none."""
    import importlib.util

    spec = importlib.util.find_spec("jaxdd.ffi._kernels")
    return Path(spec.origin) if spec and spec.origin and spec.origin.endswith(".so") else None


def _build_wheel(source: Path, out: Path) -> Path:
    env = dict(os.environ, PIP_DISABLE_PIP_VERSION_CHECK="1", PIP_NO_INPUT="1")
    result = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", ".", "--no-deps", "--no-build-isolation", "-w", str(out)],
        cwd=source,
        env=env,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, (
        "building the wheel failed (the test extra, pip install -e '.[test]', provides "
        f"setuptools and wheel):\n{result.stdout}\n{result.stderr}"
    )
    wheels = sorted(out.glob("jaxdd-*.whl"))
    assert len(wheels) == 1, f"expected one jaxdd wheel, found {[w.name for w in wheels]}"
    return wheels[0]


@pytest.fixture(scope="module")
def wheel(source_copy, tmp_path_factory) -> zipfile.ZipFile:
    library = _built_library()
    if library is not None:  # setuptools' build_ext skips an extension newer than its sources
        import sysconfig

        build_lib = source_copy / "build" / f"lib.{sysconfig.get_platform()}-{sys.implementation.cache_tag}"
        (build_lib / "jaxdd" / "ffi").mkdir(parents=True, exist_ok=True)
        shutil.copy2(library, build_lib / "jaxdd" / "ffi" / library.name)
    with zipfile.ZipFile(_build_wheel(source_copy, tmp_path_factory.mktemp("wheelhouse"))) as zf:
        yield zf


@pytest.fixture(scope="module")
def wheel_names(wheel) -> set[str]:
    return set(wheel.namelist())


def test_wheel_holds_the_library_and_the_model_zoo_inside_it(wheel_names):
    for path in ("jaxdd/__init__.py", "jaxdd/models/__init__.py", "jaxdd/models/lj.py"):
        assert path in wheel_names, f"{path} missing from the wheel"


def test_wheel_holds_every_module_of_jaxdd_and_models_at_its_installed_path(source_copy, wheel_names):
    expected = _shipped_python_files(source_copy)
    missing = {installed: src for installed, src in expected.items() if installed not in wheel_names}
    assert not missing, (
        "modules left out of the wheel (a new subpackage must be added to "
        f"[tool.setuptools] packages in pyproject.toml): {missing}"
    )


def test_wheel_holds_the_compiled_kernel_library(wheel_names):
    # Built from csrc/ by the build (setup.py): no hand step, no committed file.
    libs = sorted(n for n in wheel_names if n.startswith("jaxdd/ffi/_kernels") and n.endswith(".so"))
    assert libs, "jaxdd/ffi/_kernels*.so (the CPU kernels) missing from the wheel"


def test_no_compiled_library_is_committed():
    try:
        listing = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, check=True, capture_output=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    prebuilt = sorted(f for f in listing.decode().split("\0") if f.endswith((".so", ".dylib", ".pyd")))
    assert not prebuilt, f"compiled libraries are build outputs and must not be committed: {prebuilt}"


def test_wheel_ships_every_spec_json_as_package_data(wheel_names):
    specs = _source_spec_files()
    assert specs, "the source tree has no specs/*.json"
    missing = [p.name for p in specs if f"jaxdd/specs/{p.name}" not in wheel_names]
    assert not missing, f"spec files missing from the wheel under jaxdd/specs/: {missing}"


def test_wheel_installs_no_top_level_models_or_specs(wheel_names):
    offending = sorted(n for n in wheel_names if n.split("/", 1)[0] in ("models", "specs"))
    assert not offending, f"the wheel installs top-level models/ or specs/: {offending}"


def test_wheel_installs_only_the_jaxdd_package(wheel_names):
    top = {n.split("/", 1)[0] for n in wheel_names}
    top = {t for t in top if not t.endswith(".dist-info")}
    assert top == {"jaxdd"}


@pytest.mark.parametrize("name", [p.name for p in _source_spec_files()])
def test_shipped_spec_is_version_2_with_every_top_level_key(wheel, name):
    spec = json.loads(wheel.read(f"jaxdd/specs/{name}"))
    assert spec["version"] == 2
    assert SPEC_KEYS <= set(spec), f"missing keys: {sorted(SPEC_KEYS - set(spec))}"
    assert {"policy", "custom_ops", "third_party_helpers"} <= set(spec["core"])


@pytest.mark.parametrize("name", [p.name for p in _source_spec_files()])
def test_spec_file_is_canonical_json_with_sorted_lists(name):
    text = (REPO / "specs" / name).read_text()
    spec = json.loads(text)
    assert text == json.dumps(spec, indent=2, sort_keys=True) + "\n", (
        "spec files are written with indent 2, sorted keys and a trailing newline"
    )
    for key in ("owned_only_outputs", "all_reduce_outputs", "output_kinds"):
        assert spec[key] == sorted(spec[key]), f"{key} is not sorted"


def test_editable_install_maps_jaxdd_models_to_the_models_folder(tmp_path):
    # Run from a folder outside the repository, so only the installed import
    # machinery (not the current folder on sys.path) can find jaxdd.
    probe = (
        "import importlib.util, json\n"
        "spec = importlib.util.find_spec('jaxdd')\n"
        "models = importlib.util.find_spec('jaxdd.models') if spec else None\n"
        "print(json.dumps([spec and spec.origin, models and models.origin]))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    result = subprocess.run(
        [sys.executable, "-c", probe], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
    jaxdd_origin, models_origin = json.loads(result.stdout.strip().splitlines()[-1])
    if jaxdd_origin is None or Path(jaxdd_origin).resolve() != (REPO / "jaxdd" / "__init__.py").resolve():
        pytest.skip("jaxdd is not installed in editable mode from this repository")
    assert models_origin is not None, "jaxdd.models cannot be found from outside the repository"
    assert Path(models_origin).resolve() == (REPO / "models" / "__init__.py").resolve()


def test_setup_declares_the_kernel_library_from_every_kernel_source():
    # What lets the prebuilt library above stand for a build: setup.py's extension is
    # jaxdd.ffi._kernels, compiled from every .cc under csrc/.
    probe = ("import json, setuptools  # setuptools first: its distutils\n"
             "import distutils.core as core\n"
             "dist = core.run_setup('setup.py', stop_after='init')\n"
             "print(json.dumps([[e.name, sorted(e.sources)] for e in dist.ext_modules]))\n")
    result = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    sources = sorted(p.relative_to(REPO).as_posix() for p in (REPO / "csrc").rglob("*.cc")
                     if "third_party" not in p.parts)
    assert json.loads(result.stdout.splitlines()[-1]) == [["jaxdd.ffi._kernels", sources]]


@pytest.mark.slow
def test_a_wheel_built_from_the_sources_alone_compiles_its_kernel_library(tmp_path):
    clean = tmp_path / "source"
    _copy_source_tree(clean)
    with zipfile.ZipFile(_build_wheel(clean, tmp_path / "wheelhouse")) as zf:
        libs = [n for n in zf.namelist() if n.startswith("jaxdd/ffi/_kernels") and n.endswith(".so")]
    assert libs, "the wheel built from the sources holds no jaxdd/ffi/_kernels*.so"
