"""Real-data study: context-point posteriors against their peers (see README.md)."""
