"""The edge aggregator: fuses the devices' views of each frame and runs the local and edge exits.

Entry class: :class:`ddnn.edge.aggregator.EdgeAggregator`, built and run by
:meth:`ddnn.edge.service.EdgeService.from_settings` from
:class:`ddnn.edge.settings.EdgeSettings` (what ``ddnn edge`` does). Its parts, in a frame's
order: :mod:`ddnn.edge.ingest` (device messages in), :mod:`ddnn.edge.assembler` (frames by
deadline), :mod:`ddnn.edge.scheduler` (where and when a ready frame runs),
:mod:`ddnn.edge.path` (the exit decisions in one sequence, over :mod:`ddnn.edge.pipeline`),
:mod:`ddnn.edge.pulls` and :mod:`ddnn.edge.escalation` (pulls), :mod:`ddnn.edge.cloud_stage`
(the cloud), :mod:`ddnn.edge.answers` (every answer), :mod:`ddnn.edge.fanout` and
:mod:`ddnn.edge.sinks` (results out); what they observe goes to :mod:`ddnn.edge.events`
(docs/architecture.md has the picture).
Needs onnxruntime, paho-mqtt and numpy; never torch.
"""
