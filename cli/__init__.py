"""The tierserve command: serve, fleet, config, plugins, models, top (installed as tierserve.cli)."""
