"""The most a pre hook call may take whatever its server's timeout says, where the front end knows it in advance.

In NRI mode containerd gives each of a plugin's calls ``plugin_request_timeout`` and drops a plugin that
answers later, so koordrp answers in that time less a margin, with or without its hooks: a server
whose own timeout is longer waits in vain past that limit. koordrp learns the limit when containerd
configures the plugin; ``koordrp check`` reads it from containerd's config. In the proxy each call's
limit is its share of kubelet's deadline (minutes), so nothing is known in advance.
"""

from dataclasses import dataclass

from koordrp.hooks.types import HookServerConfig

ANSWER_MARGIN = 0.1
"""Seconds of containerd's deadline kept for koordrp's answer to reach it: containerd drops a plugin
that answers late (it takes a missed deadline as the plugin's death) and goes on without it."""

SHORTEN = "its timeout-seconds (in a file without one, as koordlet writes it: koordrp's --hook-timeout)"
"""What an operator shortens so that a server's pre hook calls fit the limit."""


@dataclass(frozen=True)
class PreHookLimit:
    seconds: float
    """What a pre hook call may take at most."""
    source: str
    """Where it comes from, in words an operator can act on."""
    remedy: str
    """What an operator can change besides a server's timeout."""

    def exceeded_by(self, server: HookServerConfig) -> bool:
        """Whether ``server`` may take longer than its pre hook calls can wait."""
        return server.timeout > self.seconds and any(hook.is_pre for hook in server.hooks)

    def effective(self, server: HookServerConfig) -> str:
        """How a registration line names the time its pre hooks get: "" when its own timeout decides."""
        return f"; pre hooks {self.seconds:g}s" if self.exceeded_by(server) else ""

    def warning(self, server: HookServerConfig) -> str:
        return (
            f"hook server {server.name} ({server.endpoint}) may take {server.timeout:g}s to answer (its timeout-seconds, "
            f"or --hook-timeout), but its pre hooks get {self.seconds:g}s: {self.source}. An answer later than that "
            f"comes after the call went on without it (a PreCreateContainer answer's resources are still applied to "
            f"the created container), and later pre hook calls skip it until one answers in time (its post hooks still "
            f"get {server.timeout:g}s); set "
            f"{SHORTEN} to {self.seconds:g} or less, or {self.remedy}"
        )


def pre_hook_limit(request_timeout: float) -> PreHookLimit:
    """What pre hooks get when containerd's NRI gives each call ``request_timeout`` seconds."""
    return PreHookLimit(
        max(request_timeout - ANSWER_MARGIN, 0.0),
        f"containerd's NRI gives each call {request_timeout:g}s (plugin_request_timeout) and koordrp keeps "
        f"{ANSWER_MARGIN:g}s of it to answer",
        "raise plugin_request_timeout in containerd's config (then every NRI event on the node may wait that long "
        'for a server that does not answer: docs/operating/nri-mode.md, "Time")',
    )
