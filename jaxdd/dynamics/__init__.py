"""Molecular dynamics and minimisation under domain decomposition (``DomainParallel``)."""

from .domain_parallel import DomainParallel, MDState, RunStats
from .integrators import FIRE, INTEGRATORS, Dynamics, KB_EV_PER_K, Langevin, RankState, StepContext, VelocityVerlet, register_integrator
from .crescale import CRescale
from .heat_flux import HeatFlux, heat_flux
from .nose_hoover import MTKBarostat, NoseHooverChain
from .io import ExtXYZWriter, Progress

__all__ = ["DomainParallel", "MDState", "RunStats", "VelocityVerlet", "Langevin", "FIRE", "RankState",
           "StepContext", "ExtXYZWriter", "Progress", "KB_EV_PER_K", "NoseHooverChain", "MTKBarostat", "CRescale", "HeatFlux", "heat_flux",
           "INTEGRATORS", "register_integrator", "Dynamics"]
