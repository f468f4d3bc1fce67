"""Offline side of ddnn (torch): dataset generation, the DDNN network, joint training,
calibration and export."""
