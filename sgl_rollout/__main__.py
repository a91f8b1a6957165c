"""``python -m sgl_rollout {demo,doctor}`` (also the ``sgl-rollout`` command)."""

import sys

USAGE = "usage: sgl-rollout {demo,doctor} [options]   (sgl-rollout demo --help for the demo's options)"


def main(argv=None) -> int:
    """Dispatch to a subcommand; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    cmd, rest = argv[0], argv[1:]
    if cmd == "doctor":
        from .doctor import main as doctor

        return doctor(rest)
    if cmd == "demo":
        from .demo import main as demo

        return demo(rest)
    print(f"unknown command {cmd!r}\n{USAGE}", file=sys.stderr)
    return 2


if __name__ == "__main__":  # SGLang spawns its scheduler: engine starts must sit behind this guard
    sys.exit(main())
