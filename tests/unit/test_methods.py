"""Routing of CRI methods to backends and forwarding styles."""

from twisted.trial.unittest import SynchronousTestCase

from koordrp.cri.methods import BackendRole, Cardinality, route


class RouteTests(SynchronousTestCase):
    def test_image_services_of_any_version_go_to_the_image_backend(self) -> None:
        for method in ("/runtime.v1.ImageService/PullImage", "/runtime.v1alpha2.ImageService/ListImages"):
            self.assertIs(route(method).role, BackendRole.IMAGE)
        self.assertIs(route("/runtime.v1.RuntimeService/Version").role, BackendRole.RUNTIME)
        self.assertIs(route("/grpc.health.v1.Health/Check").role, BackendRole.RUNTIME)

    def test_known_cardinalities_come_from_the_cri_stubs(self) -> None:
        self.assertIs(route("/runtime.v1.RuntimeService/Version").cardinality, Cardinality.UNARY_UNARY)
        self.assertIs(route("/runtime.v1.RuntimeService/GetContainerEvents").cardinality, Cardinality.UNARY_STREAM)

    def test_unknown_methods_are_relayed_as_streams(self) -> None:
        unknown = route("/runtime.v2.RuntimeService/Whatever")
        self.assertIs(unknown.cardinality, Cardinality.STREAM_STREAM)
        self.assertTrue(unknown.cancellable)

    def test_only_working_unary_methods_pay_for_cancellation(self) -> None:
        self.assertTrue(route("/runtime.v1.RuntimeService/ExecSync").cancellable)
        self.assertTrue(route("/runtime.v1.ImageService/PullImage").cancellable)
        self.assertFalse(route("/runtime.v1.RuntimeService/ListContainers").cancellable)
