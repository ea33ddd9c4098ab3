"""The wire contract of edgeps: topic tree, JSON message models, binary tensor frame, codecs.

Everything a device written in another language needs lives here and in docs/PROTOCOL.md.
"""
