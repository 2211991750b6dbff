"""Code run in a child process in which some packages cannot be imported: how the tests show that
published weights load and run without the packages (and torch) that ship them."""

import os
import subprocess
import sys
import textwrap

_HEADER = """
import sys
class _Blocked:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {blocked!r}:
            raise ImportError(name + " is blocked in this test")
sys.meta_path.insert(0, _Blocked())
import jax
jax.config.update("jax_enable_x64", True)
"""


def run_blocking(blocked, body: str) -> str:
    """Run ``body`` (Python source) in a float64 child process on the CPU in which importing any of
    ``blocked`` (top-level package names) fails; afterwards none of them may be loaded.

    Args:
      blocked: package names, e.g. ``("torch", "chgnet")``.
      body: the code to run (dedented here).

    Returns:
      the child's standard output (the test asserts that it exited with status 0).
    """
    blocked = tuple(blocked)
    script = (_HEADER.format(blocked=blocked) + textwrap.dedent(body)
              + f"\nassert not any(m.split('.')[0] in {blocked!r} for m in sys.modules)\n")
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout
