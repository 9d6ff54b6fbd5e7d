"""benches/gpu_busy.py's measure of GPU busy time: the union of the device's intervals."""

import importlib.util
from pathlib import Path

spec = importlib.util.spec_from_file_location("gpu_busy", Path(__file__).parents[2] / "benches" / "gpu_busy.py")
gpu_busy = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gpu_busy)


def test_overlapping_and_nested_intervals_count_once():
    union = gpu_busy.union_length
    assert union([]) == 0
    assert union([(0, 10), (5, 15), (20, 30)]) == 25
    assert union([(20, 30), (0, 100), (40, 50)]) == 100  # (nested, unsorted)
    assert union([(0, 5), (5, 8)]) == 8  # (touching)
