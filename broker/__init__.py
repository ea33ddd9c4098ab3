"""The platform's broker: Mosquitto with the project's configuration, or an embedded fallback."""
