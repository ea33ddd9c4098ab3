"""The parameter server: a sans-IO core (store, paces, aggregation, evaluation, registry,
validation) and a thin MQTT adapter that drives it."""
