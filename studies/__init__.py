"""The real-data study: a research study built on the package, with its own extra."""
