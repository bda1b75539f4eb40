"""koordrp's command line: its options (``Options``), their defaults, and which options each mode uses.

Flag names and defaults are koord-runtime-proxy's, so that a node's unit files carry over. ``twistd koordrp``
(``koordrp.tap``) and ``koordrp check``, which reads a live koordrp's command line, share them: nothing here
imports the daemon.
"""

from __future__ import annotations

import grp

from twisted.python import usage

from koordrp import koordrp_version
from koordrp.unix import EndpointError, parse_unix_endpoint

DEFAULT_PROXY_ENDPOINT = "/var/run/koord-runtimeproxy/runtimeproxy.sock"
DEFAULT_RUNTIME_ENDPOINT = "/var/run/containerd/containerd.sock"
DEFAULT_DOCKER_ENDPOINT = "/var/run/docker.sock"
DEFAULT_SKIP_HOOK_KEY = "runtimeproxy.koordinator.sh/skip-hookserver"
DEFAULT_SKIP_HOOK_VALUE = "true"
DEFAULT_HOOK_CONFIG_DIR = "/etc/runtime/hookserver.d"
DEFAULT_STATE_DIR = "/var/run/koord-runtimeproxy/state"
DEFAULT_NRI_SOCKET = "/var/run/nri/nri.sock"
DEFAULT_NRI_PLUGIN_NAME = "koordrp"
DEFAULT_NRI_PLUGIN_INDEX = "10"
RUNTIME_MODES = ("Containerd", "Docker", "NRI")
DEFAULT_HOOK_TIMEOUT = 60.0
"""koordrp's --hook-timeout: the hard cap on one hook call. Within it, a call's hooks get half of what is
left of the CRI call's deadline (kubelet gives 2 minutes): Koordinator's proxy has no cap of its own,
and koordlet's answers (which it computes writing cgroups) take seconds on a loaded node. The cap
bounds calls that come with no deadline (Docker mode)."""
DEFAULT_RECONCILE_INTERVAL = 60.0
"""How often the store is reconciled with the runtime by default: two listings (or one) a minute."""

NOT_USED_IN_NRI_MODE = ("remote-runtime-service-endpoint", "remote-image-service-endpoint")
"""NRI mode reaches containerd by its NRI socket alone."""


class Options(usage.Options):
    synopsis = "[options]"
    longdesc = (
        "Serve CRI v1 on a unix socket in front of the container runtime, calling Koordinator runtime "
        "hook servers around the pod and container lifecycle."
    )

    optParameters = [
        ["koord-runtimeproxy-endpoint", None, DEFAULT_PROXY_ENDPOINT, "unix socket koordrp serves CRI on"],
        [
            "remote-runtime-service-endpoint",
            None,
            None,
            "backend runtime socket (not used in NRI mode) "
            f"[default: {DEFAULT_RUNTIME_ENDPOINT}, or {DEFAULT_DOCKER_ENDPOINT} in Docker mode]",
        ],
        [
            "remote-image-service-endpoint",
            None,
            None,
            "backend image service socket (not used in NRI mode) [default: the runtime service endpoint]",
        ],
        [
            "backend-runtime-mode",
            None,
            "Containerd",
            "backend runtime: Containerd or Docker (koordrp serves kubelet's calls on its socket), "
            "or NRI (koordrp is a plugin of containerd ≥ 1.7, which kubelet calls directly)",
        ],
        ["nri-socket", None, DEFAULT_NRI_SOCKET, "NRI mode: containerd's NRI socket"],
        ["nri-plugin-name", None, DEFAULT_NRI_PLUGIN_NAME, "NRI mode: the plugin name koordrp registers"],
        [
            "nri-plugin-index",
            None,
            DEFAULT_NRI_PLUGIN_INDEX,
            "NRI mode: the plugin's index, two digits: containerd calls plugins in ascending index order",
        ],
        ["runtime-hook-server-key", None, DEFAULT_SKIP_HOOK_KEY, "pod label key that skips all hooks"],
        ["runtime-hook-server-val", None, DEFAULT_SKIP_HOOK_VALUE, "pod label value that skips all hooks"],
        ["hook-config-dir", None, DEFAULT_HOOK_CONFIG_DIR, "directory of hook server registrations (*.json)"],
        [
            "state-dir",
            None,
            DEFAULT_STATE_DIR,
            "directory (0700) where koordrp keeps what kubelet asked, where hooks changed it, across restarts",
        ],
        [
            "metrics-endpoint",
            None,
            None,
            "Twisted endpoint for /metrics, /healthz and /livez, e.g. tcp:9316:interface=127.0.0.1 [default: off]",
        ],
        ["socket-group", None, None, "group (name or id) given access to the CRI socket [default: koordrp's group]"],
        [
            "hook-timeout",
            None,
            DEFAULT_HOOK_TIMEOUT,
            "seconds a hook call may take at most, unless its file sets timeout-seconds; within that, "
            "hooks may use half of what is left of the CRI call's own deadline",
            float,
        ],
        [
            "grace-period",
            None,
            10.0,
            "seconds a stop (SIGTERM) may take: calls in flight and post hooks still running get this long, then are cut "
            "(NRI mode: koordrp stays containerd's plugin meanwhile); keep it below the unit's TimeoutStopSec",
            float,
        ],
        [
            "reconcile-interval",
            None,
            DEFAULT_RECONCILE_INTERVAL,
            "seconds between readings of the runtime that make koordrp forget the pods and containers removed "
            "behind its back (and learn those made behind it); NRI mode: between synchronizations, of the pods "
            "containerd does not tell of, while there are any; 0: only at start (CRI mode: and when the runtime is "
            "back after an outage; NRI mode: and at each synchronization)",
            float,
        ],
        ["max-workers", None, 64, "CRI worker threads (streams hold one each)", int],
    ]

    def opt_version(self) -> None:
        """Print koordrp's version and exit."""
        print(f"koordrp {koordrp_version()}")
        raise SystemExit(0)

    def _endpoint(self, flag: str, value: str) -> None:
        try:
            self[flag] = parse_unix_endpoint(value)
        except EndpointError as error:
            raise usage.UsageError(f"--{flag}: {error}") from None

    def opt_koord_runtimeproxy_endpoint(self, value: str) -> None:
        self._endpoint("koord-runtimeproxy-endpoint", value)

    def opt_remote_runtime_service_endpoint(self, value: str) -> None:
        self._endpoint("remote-runtime-service-endpoint", value)

    def opt_remote_image_service_endpoint(self, value: str) -> None:
        self._endpoint("remote-image-service-endpoint", value)

    def opt_backend_runtime_mode(self, value: str) -> None:
        if value not in RUNTIME_MODES:
            raise usage.UsageError(f"--backend-runtime-mode: {value!r} is not one of {', '.join(RUNTIME_MODES)}")
        self["backend-runtime-mode"] = value

    def opt_nri_socket(self, value: str) -> None:
        self._absolute("nri-socket", value)

    def opt_nri_plugin_index(self, value: str) -> None:
        if len(value) != 2 or not value.isdigit():
            raise usage.UsageError(f"--nri-plugin-index: {value!r} is not two digits (NRI's plugin index)")
        self["nri-plugin-index"] = value

    def opt_nri_plugin_name(self, value: str) -> None:
        if not value or "/" in value:
            raise usage.UsageError(f"--nri-plugin-name: {value!r} is not a plugin name")
        self["nri-plugin-name"] = value

    def opt_socket_group(self, value: str) -> None:
        try:
            self["socket-group"] = int(value) if value.isdigit() else grp.getgrnam(value).gr_gid
        except KeyError:
            raise usage.UsageError(f"--socket-group: no group named {value!r}") from None

    def opt_metrics_endpoint(self, value: str) -> None:
        # Only with the flag: twisted.web and prometheus_client cost ~6 MB, and koordrp check reads no such endpoint.
        from twisted.application import strports
        from twisted.internet.protocol import Factory

        from koordrp.web import unix_listening

        try:
            strports.service(value, Factory())
            unix_listening(value)
        except (ValueError, KeyError, TypeError) as error:
            raise usage.UsageError(f"--metrics-endpoint: {value!r} is not a Twisted endpoint: {error}") from None
        self["metrics-endpoint"] = value

    def _absolute(self, flag: str, value: str) -> None:
        if not value.startswith("/"):
            raise usage.UsageError(f"--{flag}: {value!r} is not an absolute path")
        self[flag] = value

    def opt_hook_config_dir(self, value: str) -> None:
        self._absolute("hook-config-dir", value)

    def opt_state_dir(self, value: str) -> None:
        self._absolute("state-dir", value)

    def unused(self) -> list[str]:
        """The options given that the mode does not use."""
        if self["backend-runtime-mode"] != "NRI":
            return []
        return [f"--{flag}" for flag in NOT_USED_IN_NRI_MODE if flag in self._given]

    def postOptions(self) -> None:
        self._given = {flag for flag in NOT_USED_IN_NRI_MODE if self[flag] is not None}
        docker = self["backend-runtime-mode"] == "Docker"
        if self["remote-runtime-service-endpoint"] is None:
            self["remote-runtime-service-endpoint"] = DEFAULT_DOCKER_ENDPOINT if docker else DEFAULT_RUNTIME_ENDPOINT
        if docker and self["remote-image-service-endpoint"] is not None:
            raise usage.UsageError(
                "--remote-image-service-endpoint: not used in Docker mode (dockerd serves images itself)"
            )
        if self["remote-image-service-endpoint"] is None:
            self["remote-image-service-endpoint"] = self["remote-runtime-service-endpoint"]
        if not 0 < self["hook-timeout"] < float("inf"):
            raise usage.UsageError("--hook-timeout: must be a number of seconds > 0")
        if not 0 <= self["reconcile-interval"] < float("inf"):
            raise usage.UsageError("--reconcile-interval: must be a number of seconds >= 0 (0: off)")
        if not self["grace-period"] >= 0:
            raise usage.UsageError("--grace-period: must be a number of seconds >= 0")
        if self["max-workers"] < 2:
            raise usage.UsageError("--max-workers: must be at least 2")
        if not self["runtime-hook-server-key"]:
            raise usage.UsageError("--runtime-hook-server-key: must not be empty")
