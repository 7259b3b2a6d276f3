"""Command line: ``python -m fxfuse demo [files...]`` and ``python -m fxfuse explain path/to/model.py``."""
from __future__ import annotations

import argparse
import sys


def explain_file(argv) -> int:
    parser = argparse.ArgumentParser(prog="python -m fxfuse explain",
                                     description="Report what fxfuse fuses in a KernelBench-style model file.")
    parser.add_argument("file", help="a file defining Model, get_inputs() and get_init_inputs()")
    parser.add_argument("--small", action="store_true", help="use the file's SMALL sizes, if it has them")
    args = parser.parse_args(argv)

    from .api import explain
    from .modelfile import load_model_file

    model, inputs = load_model_file(args.file, small=args.small).build()
    # Shapes are propagated on fake tensors, so full sizes cost no compute here.
    print(explain(model, inputs))
    return 0


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["demo"]:
        from .demo import main as demo_main
        return demo_main(argv[1:])
    if argv[:1] == ["explain"]:
        return explain_file(argv[1:])
    print("usage: python -m fxfuse {demo [files...] | explain path/to/model.py}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
