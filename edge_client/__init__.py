"""The edge device: a sans-IO training core, trainer backends and a thin MQTT adapter."""
