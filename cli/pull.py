"""``tierserve pull NAME``, ``tierserve models`` (the local model cache), and pulling on first use for ``serve``."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict

from tierserve.core.sections import Settings


def cmd_pull(args: argparse.Namespace) -> int:
    from tierserve.models.catalogue import pull

    path = pull(args.name, progress=not args.quiet)
    print(path)
    return 0


def cmd_local_models(args: argparse.Namespace) -> int:
    """What the local cache holds (with size and source), then the catalogue entries not pulled yet."""
    from tierserve.models.catalogue import CATALOGUE, cached_models, models_dir

    cached = cached_models()
    if args.json:
        print(json.dumps({
            "cache": str(models_dir()),
            "cached": [asdict(model) for model in cached],
            "catalogue": [
                {"name": e.name, "aliases": list(e.aliases), "source": f"pip:{e.distribution}", "size": e.size,
                 "license": e.license, "description": e.description,
                 "pulled": any(model.name == e.name for model in cached)}
                for e in CATALOGUE
            ],
        }, indent=2))
        return 0
    rows = [("NAME", "SIZE", "SOURCE", "PATH")]
    rows += [(m.name, f"{m.size / 2**20:.1f} MiB", m.source, m.path) for m in cached]
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    print(f"models cached in {models_dir()}:")
    if len(rows) == 1:
        print("  (none yet)")
    else:
        for row in rows:
            print(f"  {row[0]:<{widths[0]}}  {row[1]:>{widths[1]}}  {row[2]:<{widths[2]}}  {row[3]}")
    missing = [e for e in CATALOGUE if not any(model.name == e.name for model in cached)]
    if missing:
        print("in the catalogue, not pulled (tierserve pull NAME, or serve --model NAME pulls on first use):")
        for entry in missing:
            aliases = f" (alias {', '.join(entry.aliases)})" if entry.aliases else ""
            print(f"  {entry.name}{aliases}  {entry.size / 2**20:.1f} MiB  {entry.license}  {entry.description}")
    return 0


def pull_named_models(settings: Settings) -> None:
    """Pull every catalogue model the settings name that is not cached yet, saying so (``serve``, ``fleet``)."""
    from pathlib import Path

    from tierserve.models.catalogue import cached_path, catalogue_entry, pull

    paths = [settings.model.path, *(entry.path for entry in settings.models)]
    for reference in dict.fromkeys(paths):
        entry = catalogue_entry(reference)
        if entry is None or Path(reference).expanduser().exists() or cached_path(entry).is_file():
            continue
        print(
            f"tierserve: {reference} is not pulled yet: fetching it now ({entry.size / 2**20:.0f} MiB, "
            f"pip:{entry.distribution} without its dependencies, {entry.license}) into {cached_path(entry)}",
            file=sys.stderr,
        )
        pull(reference, progress=True)


def add_pull_commands(commands: argparse._SubParsersAction) -> None:
    pull = commands.add_parser(
        "pull", help="fetch a catalogue model (smollm2) or a Hugging Face id into the local cache, with progress"
    )
    pull.add_argument("name", help="catalogue name (smollm2, smollm2-135m-instruct) or org/name[:file.gguf]")
    pull.add_argument("--quiet", action="store_true", help="no progress bar")
    pull.set_defaults(handler=cmd_pull)
