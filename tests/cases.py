"""All architecture cases, gathered from tests/cases_*.py (one file per kind)."""

from cases_decoders import CASES as DECODERS
from cases_encoders import CASES as ENCODERS
from cases_gpt import CASES as GPT
from cases_seq2seq import CASES as SEQ2SEQ
from cases_special import CASES as SPECIAL
from cases_vision import CASES as VISION

CASES = {**GPT, **DECODERS, **SPECIAL, **ENCODERS, **SEQ2SEQ, **VISION}
assert len(CASES) == sum(map(len, (GPT, DECODERS, SPECIAL, ENCODERS, SEQ2SEQ, VISION))), "duplicate case names"
