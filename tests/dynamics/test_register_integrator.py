"""Integrators register under the one duplicate-name rule of jaxdd.registry."""

from __future__ import annotations

import dataclasses

import pytest

from jaxdd.dynamics import INTEGRATORS, VelocityVerlet, register_integrator


def _half_kick():
    @dataclasses.dataclass(frozen=True)
    class RegistryTestIntegrator(VelocityVerlet):
        """Velocity Verlet under another name."""

    return RegistryTestIntegrator


def test_a_different_integrator_under_a_taken_name_is_refused_unless_replaced():
    cls = register_integrator(_half_kick())
    try:
        assert INTEGRATORS["RegistryTestIntegrator"] is cls
        assert register_integrator(_half_kick()) is not cls  # the same class defined again: allowed

        @dataclasses.dataclass(frozen=True)
        class RegistryTestIntegrator(VelocityVerlet):
            """Another class of the same name."""

            def converged(self, state, ctx):
                return True

        with pytest.raises(ValueError, match="integrator 'RegistryTestIntegrator' is already registered.*replace=True"):
            register_integrator(RegistryTestIntegrator)
        assert register_integrator(replace=True)(RegistryTestIntegrator) is INTEGRATORS["RegistryTestIntegrator"]
    finally:
        INTEGRATORS.unregister("RegistryTestIntegrator")


def test_the_built_in_integrators_are_registered():
    assert {"VelocityVerlet", "Langevin", "FIRE"} <= set(INTEGRATORS)
