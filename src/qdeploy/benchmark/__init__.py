"""Benchmark stage: latency statistics and throughput of one engine (memory: qdeploy.utils.memory)."""
from qdeploy.benchmark.latency import benchmark, latency_stats

__all__ = ["benchmark", "latency_stats"]
