"""Networking with real VMs against a fake internet (issue 5, "Must show"): one daemon,
one fake internet and one long-lived sandbox for the whole package (``conftest.py``)."""
