"""Optimization profiles: min/opt/max shape per input, derived from the config or given explicitly, and checked."""
from __future__ import annotations

from dataclasses import dataclass

from qdeploy.errors import ConfigError


@dataclass(frozen=True)
class InputProfile:
    name: str
    min: tuple
    opt: tuple
    max: tuple

    def to_json(self) -> dict:
        return {"input": self.name, "min": list(self.min), "opt": list(self.opt), "max": list(self.max)}

    def shape_arg(self, which: str) -> str:
        """trtexec's ``name:1x3x224x224`` form."""
        return f"{self.name}:" + "x".join(str(d) for d in getattr(self, which))


def derive_profile(input_name: str, channels: int, input_size: tuple, batch_sizes: list[int]) -> InputProfile:
    """One profile covering every configured batch size: min = the smallest, opt = max = the largest.

    opt is the largest batch because TensorRT picks its kernels for opt; the small batches still run (min..max),
    measured as they are. Give ``profiles`` explicitly to tune for another batch."""
    if not batch_sizes:
        raise ConfigError("bench.batch_sizes is empty: cannot derive a TensorRT optimization profile")
    h, w = input_size
    lo, hi = min(batch_sizes), max(batch_sizes)
    return InputProfile(input_name, (lo, channels, h, w), (hi, channels, h, w), (hi, channels, h, w))


def check_profile(p: InputProfile, rank: int | None = None) -> InputProfile:
    """Every dimension positive, the same rank in min/opt/max, and min <= opt <= max (naming the input and dim)."""
    shapes = {"min": p.min, "opt": p.opt, "max": p.max}
    ranks = {len(s) for s in shapes.values()}
    if len(ranks) != 1:
        raise ConfigError(f"profile of input '{p.name}': min/opt/max have different ranks "
                          f"({', '.join(f'{k} {list(v)}' for k, v in shapes.items())})")
    if rank is not None and ranks != {rank}:
        raise ConfigError(f"profile of input '{p.name}': shapes have rank {ranks.pop()} but the input has rank {rank}")
    for k, s in shapes.items():
        if any(not isinstance(d, int) or d < 1 for d in s):
            raise ConfigError(f"profile of input '{p.name}': {k} {list(s)} has a dimension that is not a positive integer")
    for i, (a, b, c) in enumerate(zip(p.min, p.opt, p.max)):
        if not a <= b <= c:
            raise ConfigError(f"profile of input '{p.name}': dimension {i} needs min <= opt <= max, got min {a}, opt {b}, "
                              f"max {c}" + (" (opt outside min..max)" if a <= c else " (min above max)"))
    return p


def explicit_profiles(spec: list[dict]) -> list[InputProfile]:
    """``profiles: [{input: NAME, min: [...], opt: [...], max: [...]}]`` from a variant's options."""
    out = []
    for i, entry in enumerate(spec):
        missing = [k for k in ("input", "min", "opt", "max") if k not in entry]
        if missing:
            raise ConfigError(f"profiles[{i}]: missing {', '.join(missing)} (each profile entry names input, min, opt, max)")
        out.append(check_profile(InputProfile(str(entry["input"]), tuple(entry["min"]), tuple(entry["opt"]), tuple(entry["max"]))))
    return out
