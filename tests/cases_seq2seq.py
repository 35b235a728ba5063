"""seq2seq cases (eigenhooks/models/seq2seq.py)."""

CASES: dict = {}
