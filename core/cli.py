"""The ``tierserve`` command line: plugins, config show, serve."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any

from tierserve.core import __version__
from tierserve.core.config import LoadedSettings, load_settings, parse_override
from tierserve.core.errors import TierserveError
from tierserve.core.plugins import load_plugins


def _add_settings_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", default="development", help="shipped preset name or a .toml path (default: development)")
    parser.add_argument("--config", dest="config_file", metavar="FILE", help="TOML file layered over the preset")
    parser.add_argument(
        "--set",
        dest="assignments",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="override one setting (repeatable), e.g. --set kv_cache.l1_capacity=1000",
    )


def _settings_from(args: argparse.Namespace, flags: dict[tuple[str, str], Any] | None = None) -> LoadedSettings:
    overrides: dict[tuple[str, str], Any] = {}
    for assignment in args.assignments:
        section, key, value = parse_override(assignment)
        overrides[(section, key)] = value
    overrides.update({k: v for k, v in (flags or {}).items() if v is not None})
    return load_settings(preset=args.preset, config_file=args.config_file, overrides=overrides)


def cmd_plugins(args: argparse.Namespace) -> int:
    manager = load_plugins()
    plugins = manager.plugins()
    if args.json:
        payload = {
            "plugins": [p.as_dict() for p in plugins],
            "failures": [f.as_dict() for f in manager.failures],
        }
        print(json.dumps(payload, indent=2))
        return 0
    for plugin in plugins:
        print(f"{plugin.name} {plugin.version} ({plugin.source})")
        print(f"  hooks: {', '.join(plugin.hooks) or '-'}")
        for kind, names in plugin.components.items():
            print(f"  {kind}: {', '.join(names)}")
    for failure in manager.failures:
        print(f"FAILED {failure.name} ({failure.source}): {failure.error}")
    return 0


def _format_value(value: Any) -> str:
    return json.dumps(value) if value is not None else "(unset)"


def cmd_config_show(args: argparse.Namespace) -> int:
    loaded = _settings_from(args)
    explained = loaded.explain()
    if args.json:
        print(json.dumps(explained, indent=2))
        return 0
    for section, values in explained.items():
        print(f"[{section}]")
        width = max(len(key) for key in values)
        for key, item in values.items():
            print(f"{key.ljust(width)} = {_format_value(item['value'])}    # {item['source']}")
        print()
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    flags = {
        ("server", "host"): args.host,
        ("server", "port"): args.port,
        ("model", "path"): args.model,
    }
    _settings_from(args, flags)  # validates every source before anything else happens
    print(
        "error: this build of tierserve has no engine or HTTP server yet; "
        "'tierserve serve' only validated the settings (see 'tierserve config show').",
        file=sys.stderr,
    )
    return 2


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tierserve", description="Plugin-based LLM server with a tiered KV cache.")
    parser.add_argument("--version", action="version", version=f"tierserve {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)

    plugins = commands.add_parser("plugins", help="list loaded plugins and the components they registered")
    plugins.add_argument("--json", action="store_true", help="machine-readable output")
    plugins.set_defaults(handler=cmd_plugins)

    config = commands.add_parser("config", help="inspect settings")
    config_commands = config.add_subparsers(dest="config_command", required=True)
    show = config_commands.add_parser("show", help="resolved settings with the source of each value")
    _add_settings_arguments(show)
    show.add_argument("--json", action="store_true", help="machine-readable output")
    show.set_defaults(handler=cmd_config_show)

    serve = commands.add_parser("serve", help="serve the OpenAI-compatible API")
    _add_settings_arguments(serve)
    serve.add_argument("--host", help="bind address (server.host)")
    serve.add_argument("--port", type=int, help="bind port (server.port)")
    serve.add_argument("--model", help="checkpoint directory or builtin:NAME (model.path)")
    serve.set_defaults(handler=cmd_serve)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.handler(args)
    except TierserveError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
