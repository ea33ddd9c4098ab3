"""The site role (``edgeps aggregator``): a site aggregator beside a site broker, or an ingest
worker beside the server, taking commits through the server's door and summing them into site
commits (docs/SCALING.md). ``aggregator``: its sans-IO core; ``sums``: what a site commit holds;
``config``: its options.

With ``shared`` it is an ingest worker beside the server instead: it reads a share of every
device's commits from MQTT 5 shared subscriptions on the core broker and sends a site commit per
batch, one commit a device in each (the server then checks sequence numbers in a window: a
worker's site commit may pass another's), and alone any commit whose device the barrier already
lists as committed for its round (a resend whose first copy another worker had).

Either way it subscribes to the commit topic of each device of its ``--devices`` or whose status
it saw (the server's rule), not to ``grad/+``, and leaves a flooding device's out for a while, as
the server does: the broker then drops the flood (for an ingest worker, once every worker left it).
"""
