"""Every zoo model passes the validator at world sizes 2, 4 and 8 (slow: 18 validations)."""

import pytest

from jaxdd.models.bp import BehlerParrinello
from jaxdd.models.lj import LennardJones
from jaxdd.models.mpnn import SchNet
from jaxdd.models.nequip import NequIP
from jaxdd.models.qeq import ChargeEquilibration
from jaxdd.models.uma_like import InternalGraphBackbone
from jaxdd.data.systems import lj_melt_data
from jaxdd.validate import trace_and_validate
from test_zoo_models import SPECIES, system
from test_zoo_qeq_backbone import MOLECULES

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::RuntimeWarning")]

CASES = {
    "lj": (lambda: LennardJones(1.0, 1.0, 2.5), lambda: lj_melt_data(6)),
    "bp": (lambda: BehlerParrinello(SPECIES, 5.0, max_neighbors=48), lambda: system("bulk")),
    "schnet": (lambda: SchNet(SPECIES, 5.0), lambda: system("bulk")),
    "nequip": (lambda: NequIP(SPECIES, 5.0), lambda: system("bulk")),
    "qeq": (ChargeEquilibration, lambda: MOLECULES),
    "uma_like": (InternalGraphBackbone, lambda: MOLECULES),
}
# The molecules have no cell (open boundaries), so no stress there.
OUTPUTS = {"qeq": ("energy", "forces", "charges"), "uma_like": ("energy", "forces")}


@pytest.mark.parametrize("world_size", [2, 4, 8])
@pytest.mark.parametrize("name", list(CASES))
def test_zoo_model_passes_the_validator(name, world_size):
    factory, sample = CASES[name]
    report = trace_and_validate(factory, sample(), world_size=world_size, atol=1e-8, rtol=1e-9,
                                outputs=OUTPUTS.get(name))
    assert report.ok, report.summary()
    assert report.fix_applied is None  # each model ships a spec that is right as it is
