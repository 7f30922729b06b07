"""The `--config` option every command takes, in one place.

`gpuguard --config FILE COMMAND` and `gpuguard COMMAND --config FILE` must mean the same. argparse copies every
default of a command's own parser over the values parsed before the command, so a command's `--config` with the
default None silently replaced the file named before it: `gpuguard --config site.yaml check` checked against the
built-in defaults. A command's option therefore has no default (SUPPRESS); the top-level parser (or a command's
stand-alone parser) gives the one default.
"""

from __future__ import annotations

import argparse

CONFIG_HELP = "config file (default $GPUGUARD_CONFIG or /etc/gpuguard/config.yaml)"


def add_config_option(p: argparse.ArgumentParser, help: str = CONFIG_HELP, top_level: bool = False) -> None:
    """`--config FILE` on `p`. `top_level`: `p` is parsed on its own (the `gpuguard` parser, or a command's stand-alone
    parser), so it gives the default None; otherwise it is a command's parser under `gpuguard` and keeps a value
    given before the command."""
    p.add_argument("--config", default=None if top_level else argparse.SUPPRESS, help=help)


def hoist_config(argv: list[str]) -> tuple[list[str], list[str]]:
    """(`--config FILE` options given before the command, the rest): `gpuguard --config F prolog` -> (["--config",
    "F"], ["prolog"]), for the entry points that do not go through argparse (the hooks, the lean `xid scan`)."""
    lead: list[str] = []
    rest = list(argv)
    while rest and (rest[0] == "--config" or rest[0].startswith("--config=")):
        if rest[0] == "--config":
            if len(rest) < 2:
                break
            lead += rest[:2]
            rest = rest[2:]
        else:
            lead += ["--config", rest[0].split("=", 1)[1]]
            rest = rest[1:]
    return lead, rest
