"""tierserve's fixtures for plugin tests: tierserve_plugins, tierserve_engine, tierserve_client."""

pytest_plugins = ["tierserve.testing.fixtures"]
