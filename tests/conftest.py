"""The suite's fixtures live in ``tests/support/plugin.py``; helpers are imported from ``support.*``."""

pytest_plugins = ["support.plugin"]
