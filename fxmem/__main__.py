"""``python -m fxmem demo``: the main job; ``python -m fxmem dpsgd-demo``: private training.
``python -m fxmem demo --help`` for their flags."""

import sys


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    commands = {"demo": "train a small GPT with torch.compile's default and with fxmem, side by side",
                "dpsgd-demo": "train a tiny Llama with DP-SGD (Poisson batches, noise), printing loss and epsilon",
                "report": "run SCRIPT.py [args] and print the memory report of every graph fxmem compiled"}
    if not argv or argv[0] not in commands:
        print("usage: python -m fxmem COMMAND [args]\n\ncommands:")
        for name, text in commands.items():
            print(f"  {name:10s} {text}")
        raise SystemExit(0 if not argv or argv[0] in ("-h", "--help") else 2)
    if argv[0] == "report":
        _report(argv[1:])
        return
    if argv[0] == "dpsgd-demo":
        from .dpsgd.demo import main as dpsgd_demo

        dpsgd_demo(argv[1:])
        return
    from .demo import main as demo

    demo(argv[1:])


def _report(argv: list[str]) -> None:
    import runpy

    if not argv or not argv[0].endswith(".py"):
        print("usage: python -m fxmem report SCRIPT.py [args]", file=sys.stderr)
        raise SystemExit(2)
    from . import report

    sys.argv = argv
    runpy.run_path(argv[0], run_name="__main__")
    print(report())


if __name__ == "__main__":
    main()
