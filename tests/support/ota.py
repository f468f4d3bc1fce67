"""Over-the-air updaters built from the flat words the OTA tests speak, a fast retry, and a
plain file server for bundles."""

from __future__ import annotations

import contextlib
import functools
import threading
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from ddnn.plumbing.ota import BundleUpdater
from ddnn.plumbing.ota_settings import UpdateHooks, UpdatePolicy, UpdateSource
from ddnn.plumbing.retry import RetryPolicy

FAST = RetryPolicy(initial=0.05, maximum=0.2)


class Quiet(SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


@contextlib.contextmanager
def serving(root: Path, port: int):
    """Files under ``root`` on ``http://127.0.0.1:port`` until the block ends."""
    server = ThreadingHTTPServer(("127.0.0.1", port),
                                 functools.partial(Quiet, directory=str(root)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield
    finally:
        server.shutdown()
        server.server_close()




# BundleUpdater's option groups and hooks, from the flat keywords the OTA tests speak.
_HOOKS = ("on_result", "on_announce", "on_retry", "on_refused", "on_rollback")
_POLICY = ("allow_unsigned", "allow_downgrade", "probation")
_SOURCE = {"cloud": "origin", "token": "token", "ca_file": "ca_file", "cert_file": "cert_file",
           "key_file": "key_file"}


def bundle_updater(running, apply, **kw) -> BundleUpdater:
    """A started :class:`BundleUpdater` of ``running`` applying with ``apply``; ``kw``: its
    keywords, or a hook, a policy or a source field by name (``cloud`` is the source's
    origin)."""
    hooks = UpdateHooks(apply=apply, **{k: kw.pop(k) for k in _HOOKS if k in kw})
    policy = UpdatePolicy(**{k: kw.pop(k) for k in _POLICY if k in kw})
    source = UpdateSource(**{v: kw.pop(k) for k, v in _SOURCE.items() if k in kw})
    return BundleUpdater(running, hooks, policy=policy, source=source, **kw).start()
