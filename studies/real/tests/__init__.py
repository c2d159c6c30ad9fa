"""The study's tests: ``python -m pytest studies`` (needs the ``study`` extra)."""
