"""The engine options every benchmark takes, and loading the engine from them."""
from __future__ import annotations

import argparse

import torch

from ddscope import Engine


def parser(doc: str | None) -> argparse.ArgumentParser:
    """A benchmark's argument parser, its docstring as help, with the engine options on it."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", help="target dir (default: bundled demo target)")
    p.add_argument("--drafter", help="drafter dir (default: bundled demo drafter)")
    p.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch threads")
    return p


def load_engine(args: argparse.Namespace) -> Engine:
    torch.set_num_threads(args.threads)
    return Engine.load(args.target, args.drafter)
