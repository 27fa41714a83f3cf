"""ddscope: DDTree speculative decoding you can see into."""
from ddscope.engine import Engine, Generation, Step

__all__ = ["Engine", "Generation", "Step"]
__version__ = "0.1.0"
