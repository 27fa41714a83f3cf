"""The physical floor of a step: what a model's verify step must read, compute and exchange, against what a
card can do. `ddscope bench limit` prints it; `analyze`, `sweep` and `diagnose` set measurements beside it."""
from ddscope.bench.limit.floor import Floor, FloorError, break_even, experts_touched, floor_line, step_floor
from ddscope.bench.limit.hardware import CARDS, Hardware, HardwareError, hardware_named
from ddscope.bench.limit.shape import ConfigError, ModelShape, load_shape, model_shape

__all__ = ["CARDS", "ConfigError", "Floor", "FloorError", "Hardware", "HardwareError", "ModelShape", "break_even",
           "experts_touched", "floor_line", "hardware_named", "load_shape", "model_shape", "step_floor"]
