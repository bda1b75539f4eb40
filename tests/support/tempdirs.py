"""Temporary directories short enough for unix socket paths (about 107 bytes at most)."""

import shutil
import tempfile

from twisted.trial.unittest import SynchronousTestCase


def short_tempdir(test: SynchronousTestCase, prefix: str = "krp-") -> str:
    path = tempfile.mkdtemp(prefix=prefix, dir="/tmp")
    test.addCleanup(shutil.rmtree, path, True)
    return path
