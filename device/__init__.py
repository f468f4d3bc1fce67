"""The device agent: runs a bundle's device segment on a camera's frames and talks to the edge.

Entry class: :class:`device.agent.DeviceAgent`. Needs onnxruntime, paho-mqtt and numpy; never torch.
"""
