"""Loading settings: presets, TOML files, environment and ``--set`` layered, shorthands mapped, names resolved.

    config.py    load_settings / EffectiveSettings: the one entry point, and ``config show``
    layers.py    reading each layer (preset, file, environment, override) through pydantic-settings' sources
    merge.py     merging the layers, recording each value's source
    resolve.py   component names against the plugin registries, tiers, ``[plugins.NAME]`` tables
    secrets.py   redacting secrets from settings and logs
    logs.py      structlog set-up from ``[logging]``

The schema itself (the sections, the tier list, table validation) is a contract plugins see: it lives in
``tierserve.core.sections``, ``core.tier_settings`` and ``core.tables``.
"""
