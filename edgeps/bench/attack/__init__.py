"""``edgeps bench attack``: the hostile-client audit, against real deployments of ``edgeps broker
init`` (TLS, passwords, ACLs, client ids pinned to accounts), on three paths:

* ``flat``: one broker, the server, three devices on it;
* ``sites``: a core broker and a site broker bridged to it, the site's aggregator (``edgeps
  aggregator --site s1``) beside it, the three devices on the site; a second site (``s2``) whose
  aggregator account is the attacker's;
* ``workers``: one broker, two ingest workers (``edgeps aggregator --shared``) and the server
  behind them (``--sites-only``), the three devices on it.

On each path, a clean job (three honest devices) and one job per attack, in which the third device
(or, for ``site_flood``, site s2's aggregator account) is hostile within its ACL, does what the
audit did (``ATTACKS``). Each entry of ``attacks`` says what the job reached (``clean_metric``,
``attacked_metric``: final held-out accuracy; ``attacked_mean``: the mean over the second half of
its versions, while the attack went on), how many times a server, aggregator or worker process
exited (``crashes``; a supervisor restarts an aggregator or worker that exits), the resident memory
of those processes before and after (MiB), and versions per second against the clean job's."""
