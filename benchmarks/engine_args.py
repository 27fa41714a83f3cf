"""The engine options every benchmark takes, and loading the engine from them."""
from __future__ import annotations

import argparse

import torch

from ddscope import Engine


def add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", help="target dir (default: bundled demo target)")
    p.add_argument("--drafter", help="drafter dir (default: bundled demo drafter)")
    p.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch threads")


def load_engine(args: argparse.Namespace) -> Engine:
    torch.set_num_threads(args.threads)
    return Engine.load(args.target, args.drafter)
