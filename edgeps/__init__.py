"""edgeps: MQTT parameter-server training for fleets of edge devices."""

__version__ = "0.1.0"
