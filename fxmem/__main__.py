"""``python -m fxmem demo``: the main job. ``python -m fxmem demo --help`` for its flags."""

import sys


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    commands = {"demo": "train a small GPT with torch.compile's default and with fxmem, side by side"}
    if not argv or argv[0] not in commands:
        print("usage: python -m fxmem COMMAND [args]\n\ncommands:")
        for name, text in commands.items():
            print(f"  {name:8s} {text}")
        raise SystemExit(0 if not argv or argv[0] in ("-h", "--help") else 2)
    from .demo import main as demo

    demo(argv[1:])


if __name__ == "__main__":
    main()
