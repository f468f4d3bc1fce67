"""The edge aggregator: fuses the devices' views of each frame and runs the local and edge exits.

Entry class: :class:`edge.aggregator.EdgeAggregator`. Needs onnxruntime, paho-mqtt and numpy;
never torch.
"""
