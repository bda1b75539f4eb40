"""Parsing one hookserver.d registration."""

import json

from twisted.trial.unittest import SynchronousTestCase

from koordrp.hooks.config import MAX_CONFIG_BYTES, HookConfigError, parse_hook_server_config, permission_problem
from koordrp.hooks.types import FailurePolicy, HookServerConfig, HookType

KOORDLET = {
    "remote-endpoint": "/var/run/koordlet/koordlet.sock",
    "failure-policy": "Ignore",
    "runtime-hooks": ["PreRunPodSandbox", "PreCreateContainer", "PreStartContainer"],
}


def encode(document: object) -> bytes:
    return json.dumps(document).encode()


def with_fields(**changes: object) -> bytes:
    document: dict[str, object] = dict(KOORDLET)
    for key, value in changes.items():
        key = key.replace("_", "-")
        if value is _MISSING:
            document.pop(key, None)
        else:
            document[key] = value
    return encode(document)


_MISSING = object()


def extended(member: bytes) -> bytes:
    """KOORDLET with one more member spelled out raw, for what json.dumps will not write."""
    return encode(KOORDLET)[:-1] + b", " + member + b"}"


class AcceptTests(SynchronousTestCase):
    def parse(self, data: bytes, default_timeout: float = 3.0) -> HookServerConfig:
        return parse_hook_server_config("koordlet.json", data, default_timeout)

    def test_koordinators_example(self) -> None:
        self.assertEqual(
            self.parse(encode(KOORDLET)),
            HookServerConfig(
                name="koordlet.json",
                endpoint="/var/run/koordlet/koordlet.sock",
                failure_policy=FailurePolicy.IGNORE,
                hooks=frozenset(
                    {HookType.PRE_RUN_POD_SANDBOX, HookType.PRE_CREATE_CONTAINER, HookType.PRE_START_CONTAINER}
                ),
                timeout=3.0,
            ),
        )

    def test_every_hook_name_is_known(self) -> None:
        config = self.parse(with_fields(runtime_hooks=[hook.value for hook in HookType]))
        self.assertEqual(config.hooks, frozenset(HookType))

    def test_no_hooks_and_repeated_hooks(self) -> None:
        self.assertEqual(self.parse(with_fields(runtime_hooks=[])).hooks, frozenset())
        repeated = self.parse(with_fields(runtime_hooks=["PostStopContainer", "PostStopContainer"]))
        self.assertEqual(repeated.hooks, frozenset({HookType.POST_STOP_CONTAINER}))

    def test_fail_policy(self) -> None:
        self.assertEqual(self.parse(with_fields(failure_policy="Fail")).failure_policy, FailurePolicy.FAIL)

    def test_absent_or_null_policy_means_ignore(self) -> None:
        self.assertEqual(self.parse(with_fields(failure_policy=_MISSING)).failure_policy, FailurePolicy.IGNORE)
        self.assertEqual(self.parse(with_fields(failure_policy=None)).failure_policy, FailurePolicy.IGNORE)

    def test_unix_url_is_normalised_to_a_path(self) -> None:
        config = self.parse(with_fields(remote_endpoint="unix:///var/run//koordlet/./koordlet.sock"))
        self.assertEqual(config.endpoint, "/var/run/koordlet/koordlet.sock")

    def test_plain_path_is_normalised(self) -> None:
        self.assertEqual(self.parse(with_fields(remote_endpoint="/run/a/../k.sock")).endpoint, "/run/k.sock")

    def test_default_timeout_applies_when_absent_or_null(self) -> None:
        self.assertEqual(self.parse(encode(KOORDLET), default_timeout=7.5).timeout, 7.5)
        self.assertEqual(self.parse(with_fields(timeout_seconds=None), default_timeout=7.5).timeout, 7.5)

    def test_timeout_seconds(self) -> None:
        self.assertEqual(self.parse(with_fields(timeout_seconds=2)).timeout, 2.0)
        self.assertEqual(self.parse(with_fields(timeout_seconds=0.25)).timeout, 0.25)
        self.assertIsInstance(self.parse(with_fields(timeout_seconds=2)).timeout, float)

    def test_a_server_asks_for_its_pod_resources_answers_to_apply(self) -> None:
        self.assertFalse(self.parse(encode(KOORDLET)).apply_pod_resources)  # koordlet's file lacks it
        self.assertTrue(self.parse(with_fields(apply_pod_resources=True)).apply_pod_resources)
        self.assertFalse(self.parse(with_fields(apply_pod_resources=False)).apply_pod_resources)

    def test_unknown_fields_are_ignored(self) -> None:
        data = with_fields(**{"future_field": {"nested": [1, 2]}, "x": None})
        self.assertEqual(self.parse(data), self.parse(encode(KOORDLET)))

    def test_name_is_kept(self) -> None:
        self.assertEqual(parse_hook_server_config("10-a.json", encode(KOORDLET), 1.0).name, "10-a.json")

    def test_whitespace_and_exactly_max_size(self) -> None:
        body = encode(KOORDLET)
        padded = body + b" " * (MAX_CONFIG_BYTES - len(body))
        self.assertEqual(len(padded), MAX_CONFIG_BYTES)
        self.assertEqual(self.parse(padded).endpoint, "/var/run/koordlet/koordlet.sock")


class RejectTests(SynchronousTestCase):
    def reason(self, data: bytes) -> str:
        error: HookConfigError = self.assertRaises(HookConfigError, parse_hook_server_config, "bad.json", data, 3.0)
        self.assertIsInstance(error, ValueError)
        self.assertEqual(str(error), error.reason)
        self.assertNotIn("\n", error.reason)
        self.assertLess(len(error.reason), 300)
        return error.reason

    def test_not_utf8(self) -> None:
        self.assertEqual(self.reason(b'{"remote-endpoint": "/a\xff.sock"}'), "not valid UTF-8 (byte offset 23)")

    def test_not_json(self) -> None:
        self.assertIn("not valid JSON", self.reason(b"{remote-endpoint: /a.sock}"))
        self.assertIn("not valid JSON", self.reason(b""))
        self.assertIn("not valid JSON", self.reason(encode(KOORDLET)[:-1]))

    def test_nan_and_infinity_are_not_json(self) -> None:
        self.assertEqual(self.reason(extended(b'"timeout-seconds": NaN')), "not valid JSON: NaN is not a JSON value")
        self.assertIn("Infinity", self.reason(extended(b'"timeout-seconds": -Infinity')))

    def test_deep_nesting(self) -> None:
        self.assertEqual(self.reason(b"[" * 200_000 + b"]" * 200_000), "not valid JSON: nested too deeply")

    def test_integer_too_long_for_python(self) -> None:
        reason = self.reason(extended(b'"x": ' + b"9" * 5000))
        self.assertEqual(reason, "not valid JSON: a number has too many digits")

    def test_not_an_object(self) -> None:
        self.assertEqual(self.reason(b"[]"), "not a JSON object (found array)")
        self.assertEqual(self.reason(b'"x"'), "not a JSON object (found string)")
        self.assertEqual(self.reason(b"null"), "not a JSON object (found null)")
        self.assertEqual(self.reason(b"1"), "not a JSON object (found number)")

    def test_larger_than_the_limit(self) -> None:
        self.assertEqual(self.reason(encode(KOORDLET) + b" " * MAX_CONFIG_BYTES), "larger than 1 MiB")

    def test_endpoint_missing(self) -> None:
        self.assertEqual(self.reason(with_fields(remote_endpoint=_MISSING)), '"remote-endpoint" is missing')
        self.assertEqual(self.reason(with_fields(remote_endpoint=None)), '"remote-endpoint" is missing')

    def test_endpoint_not_a_string(self) -> None:
        self.assertEqual(self.reason(with_fields(remote_endpoint=7)), '"remote-endpoint" must be a string, not number')
        self.assertEqual(
            self.reason(with_fields(remote_endpoint=["/a.sock"])), '"remote-endpoint" must be a string, not array'
        )

    def test_endpoint_not_absolute(self) -> None:
        for value in ("koordlet.sock", "", "unix://relative.sock", "tcp://127.0.0.1:9318", "unix:/a.sock"):
            with self.subTest(value=value):
                self.assertTrue(self.reason(with_fields(remote_endpoint=value)).startswith('"remote-endpoint": '))

    def test_endpoint_nul_and_lone_surrogate(self) -> None:
        self.assertIn("NUL", self.reason(with_fields(remote_endpoint="/a\0.sock")))
        self.assertIn("Unicode", self.reason(b'{"remote-endpoint": "/a\\ud800.sock", "runtime-hooks": []}'))

    def test_endpoint_too_long_for_a_socket(self) -> None:
        self.assertIn("107 bytes", self.reason(with_fields(remote_endpoint="/" + "a" * 107)))
        self.parse_ok(with_fields(remote_endpoint="/" + "a" * 106))
        self.assertIn("too long", self.reason(with_fields(remote_endpoint="/" + "a" * 100_000)))

    def parse_ok(self, data: bytes) -> None:
        parse_hook_server_config("ok.json", data, 3.0)

    def test_unknown_policy(self) -> None:
        self.assertEqual(
            self.reason(with_fields(failure_policy="fail")), '"failure-policy" must be "Fail" or "Ignore", not "fail"'
        )
        self.assertIn("not a boolean", self.reason(with_fields(failure_policy=True)))

    def test_an_empty_or_absent_policy_is_ignore_as_in_koordinator(self) -> None:
        for data in (with_fields(failure_policy=""), with_fields(failure_policy=_MISSING)):
            self.assertIs(parse_hook_server_config("k.json", data, 3.0).failure_policy, FailurePolicy.IGNORE)

    def test_no_hooks_registers_the_server_for_none(self) -> None:
        for data in (with_fields(runtime_hooks=_MISSING), with_fields(runtime_hooks=None), with_fields(runtime_hooks=[])):
            config = parse_hook_server_config("k.json", data, 3.0)
            self.assertEqual((config.hooks, config.ignored_stages), (frozenset(), ()))

    def test_hooks_not_a_list(self) -> None:
        self.assertEqual(
            self.reason(with_fields(runtime_hooks="PreRunPodSandbox")),
            '"runtime-hooks" must be a list of hook names, not string',
        )

    def test_hooks_not_strings(self) -> None:
        self.assertEqual(
            self.reason(with_fields(runtime_hooks=["PreRunPodSandbox", 3])),
            '"runtime-hooks"[1] must be a string, not number',
        )

    def test_stages_without_a_hook_point_are_ignored_and_named(self) -> None:
        data = with_fields(runtime_hooks=["PreRunPodSandbox", "PreRemoveRunPodSandbox", "PreRemoveRunPodSandbox"])
        config = parse_hook_server_config("koordlet.json", data, 3.0)
        self.assertEqual(config.hooks, frozenset({HookType.PRE_RUN_POD_SANDBOX}))
        self.assertEqual(config.ignored_stages, ('"PreRemoveRunPodSandbox"',))

    def test_an_ignored_stage_is_shown_short(self) -> None:
        config = parse_hook_server_config("k.json", with_fields(runtime_hooks=["x" * 10_000]), 3.0)
        [shown] = config.ignored_stages
        self.assertTrue(shown.startswith('"xxxx') and len(shown) <= 80, shown)

    def test_timeout_not_positive(self) -> None:
        for value in (0, -1, 0.0, -0.5):
            with self.subTest(value=value):
                self.assertIn("positive finite number", self.reason(with_fields(timeout_seconds=value)))

    def test_timeout_not_finite(self) -> None:
        self.assertIn("positive finite number", self.reason(extended(b'"timeout-seconds": 1e400')))
        self.assertIn("positive finite number", self.reason(extended(b'"timeout-seconds": 1' + b"0" * 400)))

    def test_timeout_not_a_number(self) -> None:
        reason = self.reason(with_fields(timeout_seconds=True))
        self.assertEqual(reason, '"timeout-seconds" must be a positive finite number, not boolean')
        self.assertIn("not string", self.reason(with_fields(timeout_seconds="3")))
        self.assertIn("not object", self.reason(with_fields(timeout_seconds={})))


    def test_apply_pod_resources_not_a_boolean(self) -> None:
        self.assertEqual(self.reason(with_fields(apply_pod_resources="yes")), '"apply-pod-resources" must be true or false, not "yes"')
        self.assertIn("not number", self.reason(with_fields(apply_pod_resources=1)))


class PermissionTests(SynchronousTestCase):
    def test_only_files_nobody_else_can_change_are_trusted(self) -> None:
        self.assertIsNone(permission_problem(0o100644, 0, 0))
        self.assertIsNone(permission_problem(0o100600, 1000, 1000))
        self.assertIn("world-writable", permission_problem(0o100646, 0, 0) or "")
        self.assertIn("group- or world-writable", permission_problem(0o100664, 0, 0) or "")
        self.assertIn("not root", permission_problem(0o100644, 1000, 0) or "")


class ClimbingEndpointTests(SynchronousTestCase):
    """".." is resolved by the text: the path that results is the one koordrp checks (koordrp.trust) and dials."""

    def test_an_endpoint_that_climbs_is_the_path_it_climbs_to(self) -> None:
        for written, meant in (
            ("/var/run/../../etc/passwd", "/etc/passwd"),
            ("unix:///run/./koordlet//../koordlet/k.sock", "/run/koordlet/k.sock"),
            ("/../../run/k.sock", "/run/k.sock"),
        ):
            self.assertEqual(parse_hook_server_config("k.json", encode({"remote-endpoint": written}), 3.0).endpoint, meant)
