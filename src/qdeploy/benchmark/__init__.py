"""Benchmark stage: latency statistics, throughput and memory of one engine."""
from qdeploy.benchmark.latency import benchmark, latency_stats
from qdeploy.benchmark.memory import MemoryProbe

__all__ = ["benchmark", "latency_stats", "MemoryProbe"]
