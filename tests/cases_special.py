"""special cases (eigenhooks/models/special.py)."""

CASES: dict = {}
