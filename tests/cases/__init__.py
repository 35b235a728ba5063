"""All architecture cases, gathered from tests/cases/*.py (one file per kind); their models of the families
in ``harness.FAMILY_CONFIGS`` are built from that one registry."""

from .decoders import CASES as DECODERS
from .encoders import CASES as ENCODERS
from .gpt import CASES as GPT
from .seq2seq import CASES as SEQ2SEQ
from .special import CASES as SPECIAL
from .vision import CASES as VISION

CASES = {**GPT, **DECODERS, **SPECIAL, **ENCODERS, **SEQ2SEQ, **VISION}
assert len(CASES) == sum(map(len, (GPT, DECODERS, SPECIAL, ENCODERS, SEQ2SEQ, VISION))), "duplicate case names"
