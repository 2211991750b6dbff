"""Molecular dynamics and minimisation under domain decomposition (``DomainParallel``)."""

from .domain_parallel import DomainParallel, MDState, RunStats
from .integrators import FIRE, KB_EV_PER_K, Langevin, RankState, StepContext, VelocityVerlet
from .io import ExtXYZWriter, Progress

__all__ = ["DomainParallel", "MDState", "RunStats", "VelocityVerlet", "Langevin", "FIRE", "RankState",
           "StepContext", "ExtXYZWriter", "Progress", "KB_EV_PER_K"]
