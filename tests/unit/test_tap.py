"""Command-line options of ``twistd koordrp`` and the service tree they build."""

import os
import subprocess
import sys
from pathlib import Path

from twisted.application.service import IServiceCollection
from twisted.python import usage
from twisted.trial.unittest import SynchronousTestCase

from koordrp import defaults, tap
from koordrp.checkpoint import DirectoryCheckpoint
from koordrp.nri.listing import NRIListingService
from koordrp.cri.server import CRIProxyService
from koordrp.docker.service import DockerProxyService
from koordrp.hooks.client import HookClients
from koordrp.hooks.dispatcher import Dispatcher
from koordrp.hooks.registry import HookRegistry
from koordrp.nri.plugin import PluginIdentity
from koordrp.nri.service import NRIService, NRISettings
from koordrp.shutdown import OrderlyStopOnSIGTERM
from koordrp.systemd import SystemdNotifier
from tests.fake.reactor import InlineThreadsReactor
from tests.support.logs import logged_events


def parse(*argv: str) -> defaults.Options:
    options = defaults.Options()
    options.parseOptions(list(argv))
    return options


class OptionsTests(SynchronousTestCase):
    def test_defaults_are_koord_runtime_proxys(self) -> None:
        options = parse()
        self.assertEqual(options["koord-runtimeproxy-endpoint"], "/var/run/koord-runtimeproxy/runtimeproxy.sock")
        self.assertEqual(options["remote-runtime-service-endpoint"], "/var/run/containerd/containerd.sock")
        self.assertEqual(options["remote-image-service-endpoint"], "/var/run/containerd/containerd.sock")
        self.assertEqual(options["backend-runtime-mode"], "Containerd")
        self.assertEqual(options["runtime-hook-server-key"], "runtimeproxy.koordinator.sh/skip-hookserver")
        self.assertEqual(options["runtime-hook-server-val"], "true")
        self.assertEqual(options["hook-config-dir"], "/etc/runtime/hookserver.d")

    def test_endpoints_accept_paths_and_unix_urls(self) -> None:
        options = parse(
            "--koord-runtimeproxy-endpoint=unix:///run/k/proxy.sock",
            "--remote-runtime-service-endpoint=/run/containerd//containerd.sock",
            "--remote-image-service-endpoint=unix:///run/images.sock",
        )
        self.assertEqual(options["koord-runtimeproxy-endpoint"], "/run/k/proxy.sock")
        self.assertEqual(options["remote-runtime-service-endpoint"], "/run/containerd/containerd.sock")
        self.assertEqual(options["remote-image-service-endpoint"], "/run/images.sock")

    def test_socket_group_by_name_or_id(self) -> None:
        self.assertEqual(parse("--socket-group=root")["socket-group"], 0)
        self.assertEqual(parse("--socket-group=4242")["socket-group"], 4242)
        self.assertIsNone(parse()["socket-group"])

    def test_image_endpoint_follows_the_runtime_endpoint(self) -> None:
        options = parse("--remote-runtime-service-endpoint=unix:///run/c.sock")
        self.assertEqual(options["remote-image-service-endpoint"], "/run/c.sock")

    def test_bad_values_are_usage_errors_naming_the_flag(self) -> None:
        cases = {
            "--koord-runtimeproxy-endpoint=relative.sock": "--koord-runtimeproxy-endpoint",
            "--remote-runtime-service-endpoint=tcp://127.0.0.1:1": "--remote-runtime-service-endpoint",
            "--remote-image-service-endpoint=": "--remote-image-service-endpoint",
            "--backend-runtime-mode=Podman": "--backend-runtime-mode",
            "--hook-config-dir=hooks": "--hook-config-dir",
            "--grace-period=-1": "--grace-period",
            "--max-workers=1": "--max-workers",
            "--runtime-hook-server-key=": "--runtime-hook-server-key",
            "--hook-timeout=0": "--hook-timeout",
            "--socket-group=no-such-group-here": "--socket-group",
            "--nri-socket=nri.sock": "--nri-socket",
            "--nri-plugin-index=1": "--nri-plugin-index",
            "--nri-plugin-index=ab": "--nri-plugin-index",
            "--nri-plugin-name=a/b": "--nri-plugin-name",
            "--reconcile-interval=-1": "--reconcile-interval",
            "--reconcile-interval=inf": "--reconcile-interval",
        }
        for argument, flag in cases.items():
            with self.assertRaises(usage.UsageError) as error:
                parse(argument)
            self.assertIn(flag, str(error.exception), argument)

    def test_docker_mode_talks_to_dockerd_and_has_no_image_endpoint(self) -> None:
        options = parse("--backend-runtime-mode=Docker")
        self.assertEqual(options["remote-runtime-service-endpoint"], "/var/run/docker.sock")
        options = parse("--backend-runtime-mode=Docker", "--remote-runtime-service-endpoint=/run/d.sock")
        self.assertEqual(options["remote-runtime-service-endpoint"], "/run/d.sock")
        with self.assertRaises(usage.UsageError) as error:
            parse("--backend-runtime-mode=Docker", "--remote-image-service-endpoint=/run/i.sock")
        self.assertIn("--remote-image-service-endpoint", str(error.exception))


class GrpcLogTests(SynchronousTestCase):
    """grpc's core logs to stderr at ERROR only in the daemon, unless the operator says otherwise."""

    def verbosity(self, **environ: str) -> str:
        code = "import koordrp.tap, os, sys; sys.stdout.write(os.environ['GRPC_VERBOSITY'])"
        env = {key: value for key, value in os.environ.items() if key != "GRPC_VERBOSITY"} | environ
        checkout = Path(__file__).resolve().parents[2]  # this koordrp, not an installed one
        return subprocess.run([sys.executable, "-c", code], cwd=checkout, env=env, capture_output=True, text=True, check=True).stdout

    def test_errors_only_unless_the_operator_sets_it(self) -> None:
        self.assertEqual(self.verbosity(), "ERROR")
        self.assertEqual(self.verbosity(GRPC_VERBOSITY="DEBUG"), "DEBUG")


class MakeServiceTests(SynchronousTestCase):
    def test_nri_mode_makes_koordrp_a_plugin_of_containerds_nri(self) -> None:
        top = tap.makeService(
            parse("--backend-runtime-mode=NRI", "--nri-plugin-index=05", "--state-dir=/run/k"), reactor=InlineThreadsReactor()
        )
        plugin = list(IServiceCollection(top))[1]
        assert isinstance(plugin, NRIService)
        self.assertEqual(plugin.settings, NRISettings(defaults.DEFAULT_NRI_SOCKET, PluginIdentity("koordrp", "05"), "/run/k"))
        self.assertFalse(plugin.running)

    def test_one_bound_covers_the_stop_of_every_mode(self) -> None:
        for mode in ("Containerd", "Docker", "NRI"):
            top = tap.makeService(parse(f"--backend-runtime-mode={mode}", "--grace-period=7"), reactor=InlineThreadsReactor())
            front_end = list(IServiceCollection(top))[1]
            self.assertEqual(front_end.settings.grace_period, 7.0, mode)

    def test_stopping_the_daemon_closes_the_hook_channels(self) -> None:
        reactor = InlineThreadsReactor()
        clients = HookClients(reactor)
        client = clients.get("/run/koordlet.sock")
        top = tap.Koordrp(DirectoryCheckpoint(self.mktemp()), Dispatcher(clients, reactor))
        self.successResultOf(top.stopService())
        self.assertIsNot(clients.get("/run/koordlet.sock"), client)

    def test_nri_mode_lists_by_nri_alone_unless_told_not_to(self) -> None:
        services = list(IServiceCollection(tap.makeService(parse("--backend-runtime-mode=NRI"), reactor=InlineThreadsReactor())))
        self.assertIsInstance(services[2], NRIListingService)
        off = tap.makeService(parse("--backend-runtime-mode=NRI", "--reconcile-interval=0"), reactor=InlineThreadsReactor())
        self.assertNotIn(NRIListingService, [type(s) for s in IServiceCollection(off)])

    def test_nri_mode_names_the_runtimes_sockets_given_as_unused_with_one_warning_each(self) -> None:
        events = logged_events(self)
        self.assertEqual(parse("--backend-runtime-mode=NRI").unused(), [])
        argv = ("--remote-runtime-service-endpoint=/run/c.sock", "--remote-image-service-endpoint=/run/i.sock")
        self.assertEqual(parse(*argv).unused(), [])  # what a proxy uses
        options = parse("--backend-runtime-mode=NRI", *argv)
        self.assertEqual(options.unused(), ["--remote-runtime-service-endpoint", "--remote-image-service-endpoint"])
        tap.makeService(options, reactor=InlineThreadsReactor())
        said = [event["flag"] for event in events if "is not used in NRI mode" in event.get("log_format", "")]
        self.assertEqual(said, options.unused())

    def test_the_interval_reaches_the_front_end(self) -> None:
        self.assertEqual(parse()["reconcile-interval"], 60.0)
        for mode, kind in (("Containerd", CRIProxyService), ("Docker", DockerProxyService)):
            options = parse(f"--backend-runtime-mode={mode}", "--reconcile-interval=7.5")
            proxy = list(IServiceCollection(tap.makeService(options, reactor=InlineThreadsReactor())))[1]
            assert isinstance(proxy, (CRIProxyService, DockerProxyService))
            self.assertEqual((type(proxy), proxy.settings.reconcile_interval), (kind, 7.5))

    def test_builds_a_cri_proxy_without_starting_grpc(self) -> None:
        top = tap.makeService(parse("--koord-runtimeproxy-endpoint=/run/p.sock"), reactor=InlineThreadsReactor())
        services = list(IServiceCollection(top))
        self.assertEqual(
            [type(s) for s in services], [HookRegistry, CRIProxyService, SystemdNotifier, OrderlyStopOnSIGTERM]
        )
        proxy = services[1]
        assert isinstance(proxy, CRIProxyService)
        self.assertEqual(proxy.settings.listen_path, "/run/p.sock")
        self.assertFalse(proxy.running)
