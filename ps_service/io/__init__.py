"""The server's input and output: its MQTT driver (mqtt.py), the /metrics endpoint and dashboard
(prometheus.py, dashboard/), its signed checkpoint file (checkpoint.py)."""
