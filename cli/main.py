"""The ``tierserve`` command line: plugins, config show, serve, fleet, pull, quantize, cache, models, top."""

from __future__ import annotations

import argparse
import contextlib
import json
import signal
import sys
import urllib.parse
from collections.abc import Sequence
from typing import Any

from tierserve.core import __version__
from tierserve.settings.config import LoadedSettings, load_settings, parse_override
from tierserve.core.errors import TierserveError
from tierserve.core.plugins import load_plugins


def _add_settings_arguments(parser: argparse.ArgumentParser, plugin_modules: bool = True) -> None:
    parser.add_argument("--preset", default="development", help="shipped preset name or a .toml path (default: development)")
    parser.add_argument("--config", dest="config_file", metavar="FILE", help="TOML file layered over the preset")
    parser.add_argument(
        "--set",
        dest="assignments",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="override one setting (repeatable), e.g. --set kv_cache.l1_capacity=1000 or --set plugins.ngram.max_n=3",
    )
    if plugin_modules:  # not for fleet: its replicas load the installed plugins on every node
        _add_plugin_argument(parser)


def _add_plugin_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--plugin",
        dest="plugin_modules",
        action="append",
        default=[],
        metavar="PATH_OR_MODULE",
        help="load a plugin that is not installed (repeatable): a .py file, a package folder or a module name",
    )


def _overrides_from(args: argparse.Namespace, flags: dict[tuple[str, str], Any] | None = None) -> dict[tuple[str, str], Any]:
    """``--set`` assignments, then the command's own flags that were given."""
    overrides: dict[tuple[str, str], Any] = {}
    for assignment in args.assignments:
        section, key, value = parse_override(assignment)
        overrides[(section, key)] = value
    overrides.update({k: v for k, v in (flags or {}).items() if v is not None})
    return overrides


def _settings_from(args: argparse.Namespace, flags: dict[tuple[str, str], Any] | None = None) -> LoadedSettings:
    return load_settings(
        preset=args.preset, config_file=args.config_file, overrides=_overrides_from(args, flags),
        plugin_modules=getattr(args, "plugin_modules", ()),
    )  # fmt: skip


def cmd_plugins(args: argparse.Namespace) -> int:
    """The plugins found and their components; exit 1 when any failed to load (named last, or in the JSON)."""
    # structlog's default writes to stdout: a failing plugin's log line belongs on stderr, not in the listing
    with contextlib.redirect_stdout(sys.stderr):
        manager = load_plugins(modules=args.plugin_modules)
        plugins = manager.plugins()
    status = 1 if manager.failures else 0
    if args.json:
        print(json.dumps(manager.as_dict(), indent=2))
        return status
    for plugin in plugins:
        print(f"{plugin.name} {plugin.version} ({plugin.source})")
        print(f"  hooks: {', '.join(plugin.hooks) or '-'}")
        for kind, names in plugin.components.items():
            described = []
            for name in names:
                description = manager.registry(kind).get(name).metadata.get("description")
                described.append(f"{name} ({description})" if description else name)
            print(f"  {kind}: {', '.join(described)}")
        for name, keys in plugin.settings.items():
            print(f"  settings of {name}: {', '.join(keys) or '-'}")
    for failure in manager.failures:
        print(f"FAILED {failure.name} ({failure.source}): {failure.error}")
    return status


def _format_value(value: Any) -> str:
    return json.dumps(value) if value is not None else "(unset)"


def _print_table(header: str, values: dict[str, dict[str, Any]]) -> None:
    print(header)
    width = max((len(key) for key in values), default=0)
    for key, item in values.items():
        print(f"{key.ljust(width)} = {_format_value(item['value'])}    # {item['source']}")
    print()


def cmd_config_show(args: argparse.Namespace) -> int:
    # logging is not configured for this command, and structlog's default prints to stdout: resolving the
    # model may write the builtin one first and log that, which belongs on stderr, not in the output
    with contextlib.redirect_stdout(sys.stderr):
        loaded = _settings_from(args)
        explained = loaded.explain()
        backend = explained["model"]["backend"]
        if str(backend["value"]).lower() == "auto":  # say which backend auto picks for this checkpoint
            from tierserve.models.backend_choice import backend_candidates

            candidates = backend_candidates(loaded.settings, loaded.plugins.registry("backends"))
            backend["chosen"] = candidates[0]
            backend["source"] += f"; runs {candidates[0]} for this checkpoint"
    if args.json:
        print(json.dumps(explained, indent=2))
        return 0
    for section, values in explained.items():
        if section == "shorthands":  # [kv_cache] keys written into the tier list
            if values:
                print("# [kv_cache] shorthands, and where they landed")
            for item in values:
                print(f"{item['key']} = {_format_value(item['value'])} ({item['source']}) -> {item['landed']}")
            if values:
                print()
        elif isinstance(values, list):  # an array of tables: [[kv_cache.tiers]]
            if not values:
                print(f"# [[{section}]]: none\n")
            for table in values:
                _print_table(f"[[{section}]]", table)
        else:
            _print_table(f"[{section}]", values)
    return 0


class _Stopped(Exception):
    """SIGTERM, raised again by uvicorn once its graceful shutdown is done."""


def _stopped(signum: int, frame: object) -> None:
    raise _Stopped


def cmd_serve(args: argparse.Namespace) -> int:
    flags = {
        ("server", "host"): args.host,
        ("server", "port"): args.port,
        ("model", "path"): args.model,
    }
    loaded = _settings_from(args, flags)  # every source validated before the model loads
    from tierserve.cli.pull import pull_named_models

    pull_named_models(loaded.settings)  # a catalogue model is fetched here, before the server starts, with progress
    import uvicorn

    from tierserve.settings.logs import configure_logging
    from tierserve.settings.secrets import settings_secrets
    from tierserve.server.app import server_config

    configure_logging(loaded.settings.logging, secrets=settings_secrets(loaded.settings))
    failures: list[str] = []

    def stop(reason: str) -> None:  # a server whose model cannot load would only ever answer 503
        failures.append(reason)
        server.should_exit = True

    server = uvicorn.Server(server_config(loaded, on_load_failure=stop))
    # uvicorn shuts down gracefully on SIGINT and SIGTERM, then raises the signal again for the caller: with
    # this handler as the caller's, a stop that was asked for ends with status 0 (not "killed by SIGTERM")
    signal.signal(signal.SIGTERM, _stopped)
    try:
        server.run()
    except (KeyboardInterrupt, _Stopped):
        pass
    if failures:
        print(f"tierserve serve: the model failed to load: {failures[0]}", file=sys.stderr)
        return 1
    return 0 if server.started else 1


def cmd_fleet(args: argparse.Namespace) -> int:
    flags = {
        ("server", "host"): args.host,
        ("server", "port"): args.port,
        ("model", "path"): args.model,
        ("fleet", "replicas"): args.replicas,
    }
    loaded = _settings_from(args, flags)  # validated here, before any replica loads them again
    from tierserve.cli.pull import pull_named_models

    pull_named_models(loaded.settings)  # once here, not once per replica
    try:
        from ray import serve

        from tierserve.fleet.app import APP_NAME, run_fleet
        from tierserve.fleet.settings_sources import SettingsSources
    except ImportError as exc:
        raise TierserveError(f"tierserve fleet needs Ray Serve ({exc.name} is missing): pip install 'tierserve[fleet]'") from None
    from tierserve.settings.logs import configure_logging
    from tierserve.settings.secrets import settings_secrets

    configure_logging(loaded.settings.logging, secrets=settings_secrets(loaded.settings))
    sources = SettingsSources.of(args.preset, args.config_file, _overrides_from(args, flags))
    try:
        run_fleet(sources, address=args.address, blocking=True)
    except KeyboardInterrupt:
        pass
    finally:
        if args.address:  # a shared cluster: remove only this application
            serve.delete(APP_NAME)
        else:  # the cluster this command started: every process of it ends with it
            import os

            import ray
            import structlog

            from tierserve.fleet.processes import end_processes, process_tree

            started = process_tree(os.getpid())[1:]
            serve.shutdown()
            ray.shutdown()
            killed = end_processes(started)
            if killed:
                structlog.get_logger(__name__).warning("fleet_processes_killed", count=len(killed), reason="still running after ray.shutdown")
    return 0


DEFAULT_SERVER_URL = "http://127.0.0.1:8000"


def server_url(args: argparse.Namespace) -> str:
    """The server a command talks to: ``--url``, else ``$TIERSERVE_URL``, else the default."""
    import os

    return (args.url or os.environ.get("TIERSERVE_URL") or DEFAULT_SERVER_URL).rstrip("/")


def _call_server(args: argparse.Namespace, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
    """One JSON request to a running server; an HTTP error or an unreachable server becomes a TierserveError."""
    import os
    import urllib.error
    import urllib.request

    base = server_url(args)
    api_key = args.api_key or os.environ.get("TIERSERVE_API_KEY")
    headers = {"Accept": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    data = None
    if body is not None:
        data = json.dumps(body).encode()
        headers["Content-Type"] = "application/json"
    request = urllib.request.Request(f"{base}{path}", data=data, headers=headers, method=method)
    try:
        with urllib.request.urlopen(request, timeout=args.timeout) as response:
            return json.loads(response.read() or b"null")
    except urllib.error.HTTPError as exc:
        raw = exc.read()
        try:
            message = json.loads(raw)["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = raw.decode(errors="replace").strip() or exc.reason
        raise TierserveError(f"{method} {base}{path}: HTTP {exc.code}: {message}") from None
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise TierserveError(
            f"cannot reach the server at {base} ({reason}); is 'tierserve serve' running? "
            "Point --url (or TIERSERVE_URL) at it."
        ) from None


def cmd_cache_stats(args: argparse.Namespace) -> int:
    print(json.dumps(_call_server(args, "GET", "/v1/cache/stats"), indent=2))
    return 0


def cmd_cache_clear(args: argparse.Namespace) -> int:
    tiers = args.tiers or ["all"]
    body = {"tiers": "all" if "all" in tiers else tiers}
    print(json.dumps(_call_server(args, "POST", "/v1/cache/clear", body), indent=2))
    return 0


def cmd_cache_offload(args: argparse.Namespace) -> int:
    print(json.dumps(_call_server(args, "POST", "/v1/cache/offload"), indent=2))
    return 0


def cmd_cache_warm(args: argparse.Namespace) -> int:
    prompts = list(args.prompts)
    if args.file:
        from tierserve.engine import read_warm_prompts

        try:
            prompts += read_warm_prompts(args.file)
        except (OSError, ValueError) as exc:
            raise TierserveError(f"--file {args.file}: {exc}") from None
    body: dict[str, Any] = {"prompts": prompts} if prompts else {}  # no prompts: the most used prefixes
    if args.cache_salt:
        body["cache_salt"] = args.cache_salt
    if args.cache_key:
        body["cache_key"] = args.cache_key
    if args.limit_blocks:
        body["limit_blocks"] = args.limit_blocks
    print(json.dumps(_call_server(args, "POST", "/v1/cache/warm", body), indent=2))
    return 0


def cmd_cache_keys(args: argparse.Namespace) -> int:
    query = f"?{urllib.parse.urlencode({'cache_salt': args.cache_salt})}" if args.cache_salt else ""
    print(json.dumps(_call_server(args, "GET", f"/v1/cache/keys{query}"), indent=2))
    return 0


def cmd_cache_forget(args: argparse.Namespace) -> int:
    query = f"?{urllib.parse.urlencode({'cache_salt': args.cache_salt})}" if args.cache_salt else ""
    path = f"/v1/cache/keys/{urllib.parse.quote(args.key, safe='')}{query}"
    print(json.dumps(_call_server(args, "DELETE", path), indent=2))
    return 0


def _add_server_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", help=f"server base URL (default: $TIERSERVE_URL or {DEFAULT_SERVER_URL})")
    parser.add_argument("--api-key", help="API key, sent as a bearer token (default: $TIERSERVE_API_KEY)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for the server (default: 600)")


def _add_cache_commands(commands: Any) -> None:
    cache = commands.add_parser("cache", help="inspect and manage a running server's KV cache")
    cache_commands = cache.add_subparsers(dest="cache_command", required=True)
    stats = cache_commands.add_parser("stats", help="cache statistics, alerts and trends (GET /v1/cache/stats)")
    _add_server_arguments(stats)
    stats.set_defaults(handler=cmd_cache_stats)
    clear = cache_commands.add_parser("clear", help="drop cached prefixes (POST /v1/cache/clear; admin key)")
    _add_server_arguments(clear)
    clear.add_argument(
        "--tier",
        dest="tiers",
        action="append",
        metavar="TIER",
        help="tier to clear: l1, a lower tier's name from the settings (l2, l3, ...), or all (repeatable; default: all)",
    )
    clear.set_defaults(handler=cmd_cache_clear)
    offload = cache_commands.add_parser(
        "offload", help="move idle L1 prefixes to L2/L3, freeing the live pool (POST /v1/cache/offload; admin key)"
    )
    _add_server_arguments(offload)
    offload.set_defaults(handler=cmd_cache_offload)
    warm = cache_commands.add_parser(
        "warm", help="prefill prompts, or with none promote the most used prefixes (POST /v1/cache/warm; admin key)"
    )
    _add_server_arguments(warm)
    warm.add_argument("prompts", nargs="*", metavar="PROMPT", help="prompts to warm (none: the most used prefixes)")
    warm.add_argument("--file", help="more prompts: a JSON list of strings, or one prompt per line")
    warm.add_argument("--cache-salt", help="warm under this cache salt (the one requests will send)")
    warm.add_argument("--cache-key", help="name and pin the (single) warmed prompt's prefix")
    warm.add_argument("--limit-blocks", type=int, help="with no prompts: blocks promoted at most")
    warm.set_defaults(handler=cmd_cache_warm)
    keys = cache_commands.add_parser("keys", help="list named prefixes (GET /v1/cache/keys; admin key)")
    _add_server_arguments(keys)
    keys.add_argument("--cache-salt", help="only this tenant's keys")
    keys.set_defaults(handler=cmd_cache_keys)
    forget = cache_commands.add_parser(
        "forget", help="unpin and evict a named prefix (DELETE /v1/cache/keys/KEY; admin key)"
    )
    _add_server_arguments(forget)
    forget.add_argument("key", help="the cache_key")
    forget.add_argument("--cache-salt", help="the tenant the key belongs to")
    forget.set_defaults(handler=cmd_cache_forget)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tierserve", description="Plugin-based LLM server with a tiered KV cache.")
    parser.add_argument("--version", action="version", version=f"tierserve {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)

    plugins = commands.add_parser("plugins", help="list loaded plugins and the components they registered")
    plugins.add_argument("--json", action="store_true", help="machine-readable output")
    _add_plugin_argument(plugins)
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
    serve.add_argument("--model", help="a checkpoint directory or .gguf file, builtin:NAME, a catalogue name (smollm2) or a Hugging Face id (model.path)")
    serve.set_defaults(handler=cmd_serve)

    fleet = commands.add_parser(
        "fleet", help="serve the same API from engine replicas on Ray Serve ([fleet]; pip install 'tierserve[fleet]')"
    )
    _add_settings_arguments(fleet, plugin_modules=False)
    fleet.add_argument("--host", help="bind address of the ingress (server.host)")
    fleet.add_argument("--port", type=int, help="bind port of the ingress (server.port)")
    fleet.add_argument("--model", help="a checkpoint directory or .gguf file, builtin:NAME, a catalogue name (smollm2) or a Hugging Face id (model.path)")
    fleet.add_argument("--replicas", type=int, help="engine replicas (fleet.replicas)")
    fleet.add_argument("--address", help="a running Ray cluster to join (default: start one here)")
    fleet.set_defaults(handler=cmd_fleet)

    _add_cache_commands(commands)
    from tierserve.cli.models import add_model_commands

    add_model_commands(commands, _add_server_arguments, _call_server)
    from tierserve.cli.pull import add_pull_commands
    from tierserve.cli.quantize import add_quantize_command
    from tierserve.cli.top import add_top_command

    add_pull_commands(commands)
    add_quantize_command(commands)

    add_top_command(commands, _add_server_arguments, _call_server)
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
