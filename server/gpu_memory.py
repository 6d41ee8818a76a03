"""The GPU memory TensorFlow's allocator holds, as Prometheus metrics (`ServerMetrics`
registers it): no samples on a machine without a GPU."""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector


class GpuMemoryCollector(Collector):
    """Memory TensorFlow's allocator holds on each GPU; no samples on a machine without one."""

    def __init__(self) -> None:
        import tensorflow as tf

        self._tf = tf
        count = len(tf.config.list_physical_devices("GPU"))
        self._devices = [f"GPU:{index}" for index in range(count)]

    def describe(self) -> Iterable[Metric]:
        return []

    def collect(self) -> Iterable[Metric]:
        if not self._devices:
            return
        used = GaugeMetricFamily(
            "pergrad_gpu_memory_used_bytes",
            "GPU memory TensorFlow's allocator holds now.",
            labels=["device"],
        )
        peak = GaugeMetricFamily(
            "pergrad_gpu_memory_peak_bytes",
            "Most GPU memory TensorFlow's allocator has held since the server started.",
            labels=["device"],
        )
        for device in self._devices:
            try:
                info = self._tf.config.experimental.get_memory_info(device)
            except ValueError:  # a device TensorFlow has not initialised
                continue
            used.add_metric([device], info["current"])
            peak.add_metric([device], info["peak"])
        yield used
        yield peak
