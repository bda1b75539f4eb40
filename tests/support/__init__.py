"""Test support: a private containerd with locally built images, CRI helpers.

Nothing here talks to a system containerd: every instance lives under a temp
directory the caller owns, and is torn down completely by ``Containerd.stop``.
"""
