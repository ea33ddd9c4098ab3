"""The parameter server itself: its core, the Job record it owns, and the concerns over it
(admission, commands, versions, readout, checkpoint state)."""
