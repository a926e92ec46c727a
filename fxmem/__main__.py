"""``python -m fxmem COMMAND``: the demos, the report of a script, the memory estimate of a model.
``python -m fxmem COMMAND --help`` for each command's flags and their defaults.

A mistake in the arguments (a missing file, a bad value) is one line on stderr and exit status 2,
not a traceback: the message says what was wrong and what is allowed.
"""

import argparse
import sys

COMMANDS = {"demo": "train a small GPT with torch.compile's default and with fxmem, side by side",
            "dpsgd-demo": "train a tiny Llama with DP-SGD (Poisson batches, noise), printing loss and epsilon",
            "report": "run SCRIPT.py [args] and print the memory report of every graph fxmem compiled",
            "estimate": "predict a training step's memory per level and the largest batch that fits a device"}


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in COMMANDS:
        print("usage: python -m fxmem COMMAND [args]   (python -m fxmem COMMAND --help for its flags)\n\ncommands:")
        for name, text in COMMANDS.items():
            print(f"  {name:10s} {text}")
        if argv and argv[0] not in ("-h", "--help"):
            print(f"\nfxmem: unknown command {argv[0]!r}", file=sys.stderr)
        raise SystemExit(0 if not argv or argv[0] in ("-h", "--help") else 2)
    command, rest = argv[0], argv[1:]
    try:
        _run(command, rest)
    except (ValueError, FileNotFoundError, ImportError) as e:
        if _SCRIPT_RUNNING:  # the user's script failed: its traceback is theirs to read
            raise
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        first = first.removeprefix(f"{command}: ")  # messages name their function for Python callers
        print(f"python -m fxmem {command}: error: {first}", file=sys.stderr)
        raise SystemExit(2) from None


_SCRIPT_RUNNING = False


def _run(command: str, argv: list[str]) -> None:
    if command == "report":
        _report(argv)
    elif command == "estimate":
        from .estimate import main as estimate

        estimate(argv)
    elif command == "dpsgd-demo":
        from .dpsgd.demo import main as dpsgd_demo

        dpsgd_demo(argv)
    else:
        from .demo import main as demo

        demo(argv)


def report_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m fxmem report",
                                description="Run a training script as `python SCRIPT.py ARGS` would, then print the "
                                            "memory report of every graph fxmem compiled in it.")
    p.add_argument("script", metavar="SCRIPT.py", help="the script to run (its torch.compile calls use "
                                                       "backend='fxmem')")
    p.add_argument("args", nargs=argparse.REMAINDER, help="the script's own arguments")
    return p


def _report(argv: list[str]) -> None:
    import os
    import runpy

    a = report_parser().parse_args(argv)
    if not a.script.endswith(".py"):
        raise ValueError(f"the script must be a .py file, got {a.script!r}")
    if not os.path.isfile(a.script):
        raise FileNotFoundError(f"no such script: {a.script}")
    from . import report

    global _SCRIPT_RUNNING
    sys.argv, _SCRIPT_RUNNING = [a.script, *a.args], True
    runpy.run_path(a.script, run_name="__main__")
    print(report())


if __name__ == "__main__":
    main()
