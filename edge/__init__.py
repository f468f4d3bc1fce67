"""The edge aggregator: fuses the devices' views of each frame and runs the local and edge exits.

Entry class: :class:`edge.aggregator.EdgeAggregator`, built and run by
:meth:`edge.service.EdgeService.from_settings` from :class:`edge.settings.EdgeSettings` (what
``ddnn edge`` does). Its parts: :mod:`edge.ingest` (device messages in), :mod:`edge.assembler`
(frames by deadline), :mod:`edge.pipeline` (the exits), :mod:`edge.sinks` (results out).
Needs onnxruntime, paho-mqtt and numpy; never torch.
"""
