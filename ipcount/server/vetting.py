"""What the epoch server accepts from a request (pure: no Spark, no sockets).

A request is the command line a DAG task would spark-submit: ``["epoch", --flags...]``.
The server runs it for a pipeline it was given (its own configuration, or a file in its
pipelines directory), never one the request makes up: table locations, brokers, the
pipeline id and config files are the server's. So each setting flag of the request is

* a per-run setting (:data:`PER_RUN_SETTINGS`, the epoch DAG's Params): taken;
* the caller's business (:data:`CALLER_SETTINGS`, e.g. its own Spark master): ignored;
* a file of the Kafka login's secrets (:data:`SECRET_FILE_SETTINGS`): replaced by the
  server's own, so a request can neither read another file nor log in as someone else;
* anything else: it must name the served pipeline's own value, or the request is refused.

The command then runs with the served pipeline's settings first, the request's flags after
them and the server's secret files last.
"""
from __future__ import annotations

import argparse
import json
from dataclasses import fields
from pathlib import Path
from typing import Callable, Sequence

from ipcount.rules.config import (CALLER_SETTINGS, IDENTIFIER, PER_RUN_SETTINGS, SECRET_FILE_SETTINGS,
                                  PipelineConfig, flag, setting_arg)
from ipcount.rules.errors import BadRequestError, ConfigError

SERVED_COMMANDS = ("epoch", "backfill", "rebuild")
MAX_ARGS, MAX_ARG_CHARS = 200, 4_096
MAX_EPOCHS = 1_000  # one request's --epochs: the chain catching up, not a lock held for good
MAX_BODY_BYTES = 256 * 1_024
DEFAULT_PIPELINE_ID = PipelineConfig().pipeline_id

Parse = Callable[[Sequence[str]], argparse.Namespace]  # the CLI's parser; raises BadRequestError
PipelineOf = Callable[[str], "PipelineConfig | None"]   # the served pipeline of an id, or None


def command_line(args: Sequence[str], parse: Parse, pipeline_of: PipelineOf) -> list[str]:
    """The command line to run for a request's ``args``; :class:`BadRequestError` naming
    what was refused and why."""
    if not args or args[0] not in SERVED_COMMANDS:
        raise BadRequestError(f"the epoch server runs {', '.join(SERVED_COMMANDS)}; got "
                              f"{args[0][:40] if args else 'nothing'!r}")
    if len(args) > MAX_ARGS or any(len(a) > MAX_ARG_CHARS for a in args):
        raise BadRequestError(f"a request holds at most {MAX_ARGS} arguments of at most {MAX_ARG_CHARS} characters")
    ns = parse(args)
    if getattr(ns, "config", None):
        raise BadRequestError("--config: the epoch server runs with its own configuration; a request cannot name a "
                              "config file")
    given = {f.name: getattr(ns, f.name) for f in fields(PipelineConfig) if getattr(ns, f.name, None) is not None}
    pipeline_id = str(given.get("pipeline_id", DEFAULT_PIPELINE_ID))
    served = pipeline_of(pipeline_id)
    if served is None:
        raise BadRequestError(f"this epoch server serves no pipeline {pipeline_id!r} (--pipeline-id)")
    exempt = (*PER_RUN_SETTINGS, *CALLER_SETTINGS, *SECRET_FILE_SETTINGS)
    owned = {k: v for k, v in given.items() if k not in exempt}
    try:
        wanted = served.replace(**owned)
    except ConfigError as e:
        raise BadRequestError(f"a pipeline setting of the request is invalid: {e}") from None
    differing = [name for name in owned if getattr(wanted, name) != getattr(served, name)]
    if differing:
        # (Names only: a setting's value may one day be a secret.)
        raise BadRequestError(f"{', '.join(flag(n) for n in differing)}: the epoch server runs pipeline "
                              f"{pipeline_id!r} with its own settings, and a request may set only the per-run ones "
                              f"({', '.join(flag(n) for n in PER_RUN_SETTINGS)})")
    if (getattr(ns, "epochs", None) or 0) > MAX_EPOCHS:
        raise BadRequestError(f"--epochs: at most {MAX_EPOCHS} in one request")
    own_secrets = [setting_arg(name, getattr(served, name)) for name in SECRET_FILE_SETTINGS]
    return [args[0], *served.to_args(), *args[1:], *own_secrets]


def parser_of(build: Callable[[], argparse.ArgumentParser]) -> Parse:
    """A :data:`Parse` from a parser factory (the CLI's): argparse's complaint, and its
    ``--help``, become a :class:`BadRequestError` instead of an exit."""
    import contextlib
    import io

    def parse(args: Sequence[str]) -> argparse.Namespace:
        said = io.StringIO()
        try:
            with contextlib.redirect_stderr(said), contextlib.redirect_stdout(said):
                return build().parse_args(list(args))
        except SystemExit:
            lines = said.getvalue().strip().splitlines()
            raise BadRequestError(f"bad flags for `{args[0]}`: {lines[-1] if lines else 'see ipcount --help'}") from None
    return parse


class Pipelines:
    """The pipelines a server runs commands for: its own configuration and, given a
    directory, one file per pipeline in it (``<pipeline_id>.toml`` or ``.json``, read at
    each request, so pipelines can be added while it runs)."""

    def __init__(self, own: PipelineConfig, directory: str | None = None) -> None:
        self.own, self.directory = own, directory

    def __call__(self, pipeline_id: str) -> PipelineConfig | None:
        if pipeline_id == self.own.pipeline_id:
            return self.own
        if not self.directory or not IDENTIFIER.match(pipeline_id):
            return None
        for suffix in (".toml", ".json"):
            path = Path(self.directory) / f"{pipeline_id}{suffix}"
            if path.is_file():
                try:  # the file alone, not this process's IPCOUNT_*
                    cfg = PipelineConfig.load(path, environ={})
                except ConfigError as e:
                    raise BadRequestError(f"the epoch server's pipeline file is invalid: {e}") from None
                if cfg.pipeline_id != pipeline_id:
                    raise BadRequestError(f"the epoch server's pipeline file {path.name} is for pipeline "
                                          f"{cfg.pipeline_id!r}, not {pipeline_id!r}")
                return cfg
        return None

    @staticmethod
    def add(directory: str | Path, cfg: PipelineConfig) -> Path:
        """Write ``cfg`` where a server with ``--pipelines-dir directory`` finds it."""
        path = Path(directory) / f"{cfg.pipeline_id}.json"
        path.write_text(json.dumps({"ipcount": cfg.to_dict()}, indent=1))
        return path
