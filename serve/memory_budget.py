"""Sizing the cache arena from device memory (vLLM's `gpu_memory_utilization`).

The engine may use `utilization` of each device's memory (the allocator's `bytes_limit`: on a GPU,
XLA_PYTHON_CLIENT_MEM_FRACTION of it, 75 % by default) for everything it keeps there: the weights (and
LoRA slots) already placed, the step programs' temporaries and the arena. The arena gets the rest. The
temporaries are measured, not guessed: XLA's memory analysis of the largest step programs, compiled against a
provisional arena (a step's temporaries do not depend on the arena's size, which it updates in place).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class MemoryPlan:
    utilization: float
    bytes_limit: int  # the smallest device's allocator limit
    bytes_in_use: int  # the fullest device's bytes before the arena (weights, adapters, ...)
    step_temp_bytes: int  # the largest step program's temporaries and unaliased outputs
    cache_bytes: int  # one rank's arena

    def as_dict(self) -> dict:
        return asdict(self)


def device_memory(devices) -> list[dict]:
    """Each device's allocator statistics; a clear error on backends that keep none (CPU)."""
    stats = [d.memory_stats() for d in devices]
    if any(s is None or "bytes_limit" not in s or "bytes_in_use" not in s for s in stats):
        raise ValueError(f"gpu_memory_utilization: {devices[0].platform} devices report no memory statistics; "
                         f"size the cache with cache_bytes (k3jax serve --cache-mb)")
    return stats


def step_temp_bytes(compiled) -> int:
    """A compiled step's device memory beyond its arguments: temporaries and outputs not aliased to inputs."""
    m = compiled.memory_analysis()
    return int(m.temp_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes)


def largest_programs(shapes: list[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    """The (rows, tokens, pages) programs whose temporaries bound the rest: the most tokens at the widest
    context, and the most rows of one token (decode) at the widest context."""
    widest = max(p for _, _, p in shapes)
    wide = [s for s in shapes if s[2] == widest]
    most_tokens = max(wide, key=lambda s: (s[0] * s[1], s[0]))
    most_rows = max(wide, key=lambda s: (s[0], -s[1]))
    return sorted({most_tokens, most_rows})


def plan_cache_bytes(utilization: float, stats: list[dict], freed: int, temp: int, unit_bytes: int,
                     unit_extra: int, min_units: int) -> MemoryPlan:
    """The arena's bytes (a whole number of units) -> MemoryPlan. `freed`: bytes per device in use now that
    the new arena replaces (the provisional one); `unit_extra`: bytes each unit costs beside its own (the
    token ids kept per page position)."""
    limit = min(int(s["bytes_limit"]) for s in stats)
    used = max(int(s["bytes_in_use"]) for s in stats) - freed
    room = int(utilization * limit) - used - temp
    units = max(0, room) // (unit_bytes + unit_extra)
    if units < min_units:
        raise ValueError(f"gpu_memory_utilization={utilization}: {utilization:.0%} of {limit / 2**30:.2f} GiB less "
                         f"{used / 2**30:.2f} GiB in use (weights) and {temp / 2**30:.2f} GiB of step temporaries "
                         f"leaves {max(0, room) / 2**20:.1f} MiB for the cache, under the {min_units} units of "
                         f"{unit_bytes} B the arena needs at least; raise it or use more devices")
    return MemoryPlan(utilization, limit, used, temp, units * unit_bytes)
