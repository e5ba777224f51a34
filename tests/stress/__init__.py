"""Stress tools: the request storm shared by `tests/integration/test_storm.py` and the full-size `storm.py`."""
