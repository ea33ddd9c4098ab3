"""Deploying the broker: accounts, ACLs and TLS for a job (``edgeps broker init``: secure.py, its
certificates: certs.py), and site brokers bridged to a core broker (sites.py). The runtime side,
how a process talks to a broker, is the package above (client, driver, transport)."""
