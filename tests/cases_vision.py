"""vision cases (eigenhooks/models/vision.py)."""

CASES: dict = {}
