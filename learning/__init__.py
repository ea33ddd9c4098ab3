"""Learning code shared by server and devices: datasets, partitions, the numpy reference model.

Imports only numpy at module level, so a device can use it without scikit-learn.
"""
