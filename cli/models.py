"""``tierserve models ...``: list, load, unload and alias a running server's models, and its LoRA adapters."""

from __future__ import annotations

import argparse
import json
import urllib.parse
from collections.abc import Callable
from typing import Any

from tierserve.core.errors import TierserveError

CallServer = Callable[..., Any]


def _print(value: Any) -> None:
    print(json.dumps(value, indent=2))


def _models_table(models: list[dict[str, Any]]) -> str:
    """One line per served name: id, status, what it runs on, its aliases or adapter rank."""
    rows = [("ID", "STATUS", "RUNS ON", "DETAILS")]
    for model in models:
        runs_on = model.get("parent") or model.get("root") or model["id"]
        details = []
        if model.get("aliases"):
            details.append("aliases: " + ", ".join(model["aliases"]))
        if model.get("lora_rank"):
            details.append(f"LoRA rank {model['lora_rank']}")
        if model.get("memory_bytes"):
            details.append(f"~{model['memory_bytes'] / 2**20:.1f} MiB")
        rows.append((model["id"], str(model.get("status", "")), str(runs_on), "; ".join(details)))
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    return "\n".join(f"{r[0]:<{widths[0]}}  {r[1]:<{widths[1]}}  {r[2]:<{widths[2]}}  {r[3]}".rstrip() for r in rows)


def _key_values(pairs: list[str], flag: str) -> dict[str, str]:
    out = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep or not name or not value:
            raise TierserveError(f"{flag} {pair!r}: expected NAME=PATH")
        out[name] = value
    return out


def add_model_commands(commands: Any, add_server_arguments: Callable[[argparse.ArgumentParser], None], call: CallServer) -> None:
    """The ``models`` command group; ``call(args, method, path, body)`` does one JSON request."""

    def cmd_list(args: argparse.Namespace) -> int:
        models = call(args, "GET", "/v1/models")["data"]
        print(json.dumps(models, indent=2) if args.json else _models_table(models))
        return 0

    def cmd_load(args: argparse.Namespace) -> int:
        body: dict[str, Any] = {"name": args.name, "path": args.path}
        for key in ("version", "backend", "dtype", "quantization", "device", "kv_share", "max_loras"):
            value = getattr(args, key)
            if value is not None:
                body[key] = value
        if args.aliases:
            body["aliases"] = args.aliases
        if args.lora:
            body["lora_adapters"] = _key_values(args.lora, "--lora")
            body.setdefault("max_loras", len(body["lora_adapters"]))
        _print(call(args, "POST", "/v1/models", body))
        return 0

    def cmd_unload(args: argparse.Namespace) -> int:
        _print(call(args, "DELETE", f"/v1/models/{urllib.parse.quote(args.model_id, safe='@')}"))
        return 0

    def cmd_alias(args: argparse.Namespace) -> int:
        _print(call(args, "POST", "/v1/models/aliases", {"alias": args.alias, "model": args.model_id, "warm": args.warm}))
        return 0

    def cmd_load_lora(args: argparse.Namespace) -> int:
        body = {"lora_name": args.lora_name, "lora_path": args.lora_path}
        if args.model:
            body["model"] = args.model
        _print(call(args, "POST", "/v1/load_lora_adapter", body))
        return 0

    def cmd_unload_lora(args: argparse.Namespace) -> int:
        _print(call(args, "POST", "/v1/unload_lora_adapter", {"lora_name": args.lora_name}))
        return 0

    from tierserve.cli.pull import cmd_local_models

    models = commands.add_parser(
        "models",
        help="alone: the models cached on this machine (size, source) and the catalogue; with a command: list, "
        "load, unload and alias a running server's models",
    )
    models.add_argument("--json", action="store_true", help="machine-readable output (the local listing)")
    models.set_defaults(handler=cmd_local_models)
    sub = models.add_subparsers(dest="models_command")
    listing = sub.add_parser("list", help="served names: versions, aliases, LoRA adapters (GET /v1/models)")
    add_server_arguments(listing)
    listing.add_argument("--json", action="store_true", help="machine-readable output")
    listing.set_defaults(handler=cmd_list)

    load = sub.add_parser("load", help="load a model version (POST /v1/models; admin key)")
    add_server_arguments(load)
    load.add_argument("name", help="the model's name")
    load.add_argument("--path", required=True, help="checkpoint directory or builtin:NAME")
    load.add_argument("--version", help="its version (default: 1)")
    load.add_argument("--alias", dest="aliases", action="append", metavar="ALIAS", help="another name for it (repeatable)")
    load.add_argument("--backend", help="model backend (default: auto)")
    load.add_argument("--dtype", help="float32, bfloat16, float16 or auto")
    load.add_argument("--quantization", help="none or int8")
    load.add_argument("--device", help="auto, cpu, cuda, cuda:N")
    load.add_argument("--kv-share", type=float, help="its share of kv_cache.l1_capacity (0-1]")
    load.add_argument("--max-loras", type=int, help="LoRA adapter slots")
    load.add_argument("--lora", action="append", metavar="NAME=PATH", help="a LoRA adapter to load with it (repeatable)")
    load.set_defaults(handler=cmd_load)

    unload = sub.add_parser("unload", help="drain and free a version (DELETE /v1/models/ID; admin key)")
    add_server_arguments(unload)
    unload.add_argument("model_id", help="name@version")
    unload.set_defaults(handler=cmd_unload)

    alias = sub.add_parser("alias", help="point an alias at a ready version (POST /v1/models/aliases; admin key)")
    add_server_arguments(alias)
    alias.add_argument("alias", help="the alias (e.g. the model's name)")
    alias.add_argument("model_id", help="the version it points at from now on (name@version)")
    alias.add_argument("--warm", action="store_true", help="first replay the old version's most used prompts")
    alias.set_defaults(handler=cmd_alias)

    load_lora = sub.add_parser("load-lora", help="load a PEFT LoRA adapter (POST /v1/load_lora_adapter; admin key)")
    add_server_arguments(load_lora)
    load_lora.add_argument("lora_name", help="the name requests send as model")
    load_lora.add_argument("lora_path", help="the adapter directory (adapter_config.json + safetensors)")
    load_lora.add_argument("--model", help="the base model (default: the server's default model)")
    load_lora.set_defaults(handler=cmd_load_lora)

    unload_lora = sub.add_parser("unload-lora", help="unload a LoRA adapter (POST /v1/unload_lora_adapter; admin key)")
    add_server_arguments(unload_lora)
    unload_lora.add_argument("lora_name")
    unload_lora.set_defaults(handler=cmd_unload_lora)
