"""Result sinks: a failing one never silences the others."""

from ddnn.bundle import load_bundle
from ddnn.edge.aggregator import EdgeAggregator
from ddnn.edge.settings import EdgeSettings
from ddnn.result import result_for
from ddnn.runtime import BundleRuntime
from ddnn.topics import Topics


class Broken:
    def start(self): pass
    def publish(self, result): raise OSError("No space left on device")
    def close(self): pass


class Kept:
    def __init__(self): self.results = []
    def start(self): pass
    def publish(self, result): self.results.append(result)
    def close(self): pass


def test_a_failing_sink_does_not_stop_the_others(tiny_bundle):
    runtime = BundleRuntime(load_bundle(tiny_bundle))
    m = runtime.manifest
    kept = Kept()
    agg = EdgeAggregator(runtime, EdgeSettings(bundle=tiny_bundle, http_port=0), Topics(),
                         devices=[f"cam{v}" for v in range(m.views)], sinks=[Broken(), kept])
    for frame in range(3):
        agg.publish_result(result_for(frame=frame, scores=[1.0] + [0.0] * (m.num_classes - 1),
                                      classes=m.classes, exit="local", entropy=0.1,
                                      views=["cam0"]))
    assert [r.frame for r in kept.results] == [0, 1, 2]
    assert agg.answered == 3 and agg.recent.after(-1)[-1]["frame"] == 2
    assert agg.metrics.dropped.value(reason="sink") == 3
