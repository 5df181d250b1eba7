"""Shipped presets: development.toml and production.toml."""
