"""The test suite's shared support is one package, :mod:`tests.support`, loaded here as a pytest
plugin: fixtures (real brokers and servers on free ports, a trained tiny bundle), markers per
tier, and the end-of-session check of import names."""

pytest_plugins = ["tests.support.plugin"]
