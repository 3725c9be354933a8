"""`deepinfer simulate | sweep | generate | serve | profile | measure-acceptance | bench`: the
command line.

Each command lives in its own module and imports the simulator or the real
executor inside its run function, so `deepinfer --help` stays light.
Exit codes: 0 success, 2 bad input (trace, option, model config), 3 the
engine stalled (the message is the diagnosis). A usage error (a bad flag) is one line.
"""

from __future__ import annotations

import argparse
import sys
from typing import NoReturn

from deepinfer import __version__
from deepinfer.entrypoints.cli.bench import add_bench_parser
from deepinfer.entrypoints.cli.generate import add_generate_parser
from deepinfer.entrypoints.cli.measure_acceptance import add_measure_acceptance_parser
from deepinfer.entrypoints.cli.profile import add_profile_parser
from deepinfer.entrypoints.cli.serve import add_serve_parser
from deepinfer.entrypoints.cli.simulate import add_simulate_parser
from deepinfer.entrypoints.cli.sweep import add_sweep_parser
from deepinfer.errors import SchedulerStalled

EXIT_BAD_INPUT = 2
EXIT_STALLED = 3
EXIT_INTERNAL = 1


class _Parser(argparse.ArgumentParser):
    """A usage error is one line naming the flag (and where to look), then exit 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_BAD_INPUT, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="deepinfer",
        description="Inference engine and scheduler simulator for DeepSeek-architecture models.",
    )
    parser.add_argument("--version", action="version", version=f"deepinfer {__version__}")
    parser.add_argument(
        "--debug",
        action="store_true",
        help="show the full traceback of an error (before the command)",
    )
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    add_simulate_parser(sub)
    add_sweep_parser(sub)
    add_generate_parser(sub)
    add_serve_parser(sub)
    add_profile_parser(sub)
    add_measure_acceptance_parser(sub)
    add_bench_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except SchedulerStalled as e:
        print(f"deepinfer: the engine stalled:\n{e}", file=sys.stderr)
        return EXIT_STALLED
    except (ValueError, OSError) as e:  # bad input: a file, a line, a field, a flag
        if args.debug:
            raise
        print(f"deepinfer: {_one_line(e)}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except Exception as e:  # a bug: one line, the traceback on request
        if args.debug:
            raise
        print(
            f"deepinfer: internal error: {type(e).__name__}: {_one_line(e)} (run with "
            "--debug for the traceback, and please report it)",
            file=sys.stderr,
        )
        return EXIT_INTERNAL


def _one_line(e: BaseException) -> str:
    if isinstance(e, OSError) and e.filename is not None:
        return f"{e.filename}: {e.strerror or e}"
    return " ".join(str(e).split())
