"""The edge aggregator: fuses the devices' views of each frame and runs the local and edge exits.

Entry class: :class:`ddnn.edge.aggregator.EdgeAggregator`, built and run by
:meth:`ddnn.edge.service.EdgeService.from_settings` from
:class:`ddnn.edge.settings.EdgeSettings` (what ``ddnn edge`` does). Its parts:
:mod:`ddnn.edge.ingest` (device messages in), :mod:`ddnn.edge.assembler` (frames by deadline),
:mod:`ddnn.edge.scheduler` (where and when a ready frame runs), :mod:`ddnn.edge.pipeline` (the
exits), :mod:`ddnn.edge.pulls` (feature pulls), :mod:`ddnn.edge.cloud_stage` (the cloud),
:mod:`ddnn.edge.fanout` and :mod:`ddnn.edge.sinks` (results out).
Needs onnxruntime, paho-mqtt and numpy; never torch.
"""
