"""/metrics in Prometheus's text format (prometheus-client), with llama-server's metric names under `ninfer:`."""

from __future__ import annotations

import weakref
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.registry import Collector

from ninfer.engine import EngineThread


class _SchedulerCollector(Collector):
    def __init__(self, sched: EngineThread):
        self._sched = weakref.ref(sched)  # (the registry that holds this must not keep the thread alive)

    @property
    def sched(self) -> EngineThread:
        sched = self._sched()
        assert sched is not None, "a metrics scrape of a server that is gone"
        return sched

    def collect(self) -> Iterator[Metric]:
        st = self.sched.stats
        yield CounterMetricFamily("ninfer:prompt_tokens", "Prompt tokens evaluated", value=st["prompt_tokens"])
        yield CounterMetricFamily("ninfer:tokens_predicted", "Tokens generated", value=st["predicted_tokens"])
        yield CounterMetricFamily("ninfer:prompt_tokens_shared", "Prompt tokens taken from another slot's cache",
                                  value=st["prefix_shared_tokens"])
        yield CounterMetricFamily("ninfer:requests_finished", "Requests that left a slot", value=st["requests_done"])
        yield CounterMetricFamily("ninfer:requests_cancelled", "Requests cancelled (client gone)",
                                  value=st["cancelled"])
        yield CounterMetricFamily("ninfer:tokens_after_cancel", "Tokens generated after a cancellation arrived",
                                  value=st["tokens_after_cancel"])
        yield CounterMetricFamily("ninfer:requests_timed_out", "Requests stopped by their deadline",
                                  value=st["timed_out"])
        yield CounterMetricFamily("ninfer:requests_rejected", "Requests refused with 503 (queue full)",
                                  value=st["rejected"])
        yield CounterMetricFamily("ninfer:decode_steps", "Batched decode steps run", value=st["decode_steps"])
        for k, what in (("hits", "found staged by the prefetch thread"), ("stalls", "waited for while it staged them"),
                        ("misses", "read without being staged ahead"), ("staged", "staged by the prefetch thread")):
            yield CounterMetricFamily(f"ninfer:kv_prefetch_{k}", f"Tiered KV cache: L3 block-layers {what}",
                                      value=st[f"kv_prefetch_{k}"])
        yield CounterMetricFamily("ninfer:draft_tokens", "Tokens drafted by speculative decoding",
                                  value=st["draft_tokens"])
        yield CounterMetricFamily("ninfer:draft_tokens_accepted", "Drafted tokens the model accepted",
                                  value=st["draft_accepted"])
        pps = st["prompt_tokens"] / st["prompt_s"] if st["prompt_s"] else 0.0
        tps = st["predicted_tokens"] / st["predicted_s"] if st["predicted_s"] else 0.0
        yield GaugeMetricFamily("ninfer:prompt_tokens_seconds", "Average prompt throughput in tokens/s", value=pps)
        yield GaugeMetricFamily("ninfer:predicted_tokens_seconds", "Average generation throughput in tokens/s "
                                "(tokens over time spent in decode steps)", value=tps)
        blocks, ratio = self.sched.kv_usage()
        yield GaugeMetricFamily("ninfer:kv_cache_usage_ratio", "KV cache blocks in use / blocks available",
                                value=ratio)
        yield GaugeMetricFamily("ninfer:kv_cache_blocks", "KV cache blocks in use", value=blocks)
        yield GaugeMetricFamily("ninfer:requests_processing", "Requests in a slot", value=self.sched.processing())
        yield GaugeMetricFamily("ninfer:requests_deferred", "Requests waiting for a slot", value=self.sched.deferred())


# One registry per engine thread, made on the first scrape (and gone with the thread).
_registries: weakref.WeakKeyDictionary[EngineThread, CollectorRegistry] = weakref.WeakKeyDictionary()


def render(sched: EngineThread) -> tuple[bytes, str]:
    registry = _registries.get(sched)
    if registry is None:
        registry = CollectorRegistry(auto_describe=False)
        registry.register(_SchedulerCollector(sched))
        _registries[sched] = registry
    return generate_latest(registry), CONTENT_TYPE_LATEST
