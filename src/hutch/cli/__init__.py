"""The ``hutch`` command line: a thin layer over :mod:`hutch.sdk` (see ``main.py``)."""
