"""The device agent: runs a bundle's device segment on a camera's frames and talks to the edge.

Entry point: :class:`ddnn.device.service.DeviceService`, built from
:class:`ddnn.device.settings.DeviceSettings` by ``DeviceService.from_settings``; the per-frame
work is :class:`ddnn.device.agent.DeviceAgent`. Needs onnxruntime, paho-mqtt, Pillow and numpy;
never torch.
"""
