"""What the tests share, in one package: test modules import helpers from here (never from
each other), and :mod:`tests.support.plugin` — loaded by ``tests/conftest.py`` — holds the
fixtures, registers one marker per tier (``pytest -m edge``) and checks the import names.

* :mod:`~tests.support.polling`: ``wait_for``, the one poll (never a guessed sleep);
* :mod:`~tests.support.data`: generated datasets and bundles, versions of a bundle, exit
  thresholds that reach every tier;
* :mod:`~tests.support.cloud`: the cloud in this process, its readiness, inference requests;
* :mod:`~tests.support.hierarchy`: an edge and devices in this process, checked against
  ``ddnn evaluate``;
* :mod:`~tests.support.processes`: the tiers as real ``ddnn`` processes;
* :mod:`~tests.support.ota`: over-the-air updaters and a file server;
* :mod:`~tests.support.brokers`: Mosquitto with TLS, passwords and the ACL;
* :mod:`~tests.support.stubs`: stand-ins for parts of a tier.
"""
