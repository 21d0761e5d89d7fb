"""`nanomm-bench`: one command for the workbench's questions, a subcommand each (vLLM's `vllm bench` convention).

    nanomm-bench load --demo --topology 1e1p1d --rate 2 4      # drive real servers with a mix of pictures
    nanomm-bench simulate --topologies dp2 1e1pd 1e1p1d         # the same questions, in the simulator
    nanomm-bench autoscale --replay lessons/data/15-day.json    # the autoscaling day, replayed in the simulator
    nanomm-bench stage-costs --emulate h200:qwen2-vl-2b         # the costs the simulators run on, measured
    nanomm-bench validate --host-costs host.json --quick        # the simulator against the twin
    nanomm-bench day --policy load                              # the shifting day on Ray Serve, per policy
    nanomm-bench soak --clients 4 --seconds 5                   # many streaming clients for a while: leaks
    nanomm-bench long-chats --chats 2 --turns 4                 # old-picture policies over long chats
    nanomm-bench shapes --per-kind 4 --timed 2                  # JSON answers with and without a schema

Lessons: lessons/11-serving-under-load.md, 13-three-topologies.md, 15-scaling-each-pool.md,
16-long-conversations.md and 18-answers-in-a-shape.md. Each subcommand's module has `add_cli_args(parser)` and
`main(args)`, and may have `check_args(parser, args)` for what argparse alone cannot check; `parse` and `run` build
the same arguments for tests and other Python callers.
"""

import argparse
import importlib
import shlex
import sys

from nanomm.topology import parse_topology

SUBCOMMANDS = {  # name: the module under nanomm/bench that runs it
    "load": "load",
    "simulate": "simulate",
    "autoscale": "autoscale",
    "stage-costs": "stage_costs",
    "validate": "validate",
    "day": "day",
    "soak": "soak",
    "long-chats": "long_chats",
    "shapes": "shapes",
}


def topology_arg(text: str):
    """--topology / --topologies: a name of the one grammar (nanomm/topology.py); a usage error names the grammar."""
    try:
        return parse_topology(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def module_of(name: str):
    return importlib.import_module(f"nanomm.bench.{SUBCOMMANDS[name]}")


def summary_of(module) -> str:
    return (module.__doc__ or "").strip().splitlines()[0]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="nanomm-bench", description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="\n".join(__doc__.splitlines()[1:12]))
    subcommands = parser.add_subparsers(dest="subcommand", required=True, metavar="SUBCOMMAND")
    for name in SUBCOMMANDS:
        module = module_of(name)
        sub = subcommands.add_parser(name, help=summary_of(module), description=summary_of(module))
        module.add_cli_args(sub)
        sub.set_defaults(module=module, parser=sub)
    return parser


def finish(parser: argparse.ArgumentParser, module, args: argparse.Namespace, argv: list[str], name: str):
    """The module's own checks, and the command line every result file records."""
    if hasattr(module, "check_args"):
        module.check_args(parser, args)
    args.command_line = shlex.join(["nanomm-bench", name, *argv])
    return args


def parse(module, argv: list[str] | None = None) -> argparse.Namespace:
    """One subcommand's arguments, as `nanomm-bench NAME ARGV...` would parse them."""
    name = next(n for n, m in SUBCOMMANDS.items() if f"nanomm.bench.{m}" == module.__name__)
    parser = argparse.ArgumentParser(prog=f"nanomm-bench {name}", description=summary_of(module))
    module.add_cli_args(parser)
    argv = list(sys.argv[1:] if argv is None else argv)
    return finish(parser, module, parser.parse_args(argv), argv, name)


def run(module, argv: list[str] | None = None) -> int:
    return module.main(parse(module, argv))


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    finish(args.parser, args.module, args, argv[1:], args.subcommand)
    return args.module.main(args) or 0


if __name__ == "__main__":
    sys.exit(main())
