"""Reading one hookserver.d registration: bytes in, a HookServerConfig or a one-line reason out."""

import json
import math
from typing import NoReturn

from koordrp.unix import EndpointError, parse_unix_endpoint
from koordrp.hooks.types import HOOKS_BY_NAME, FailurePolicy, HookServerConfig, HookType
from koordrp.text import json_type

MAX_CONFIG_BYTES = 1 << 20
"""A registration is a few hundred bytes; anything past this is a mistake and is not read whole."""

TOO_LARGE = "larger than 1 MiB"

# sun_path holds 108 bytes including the terminating NUL; grpcio refuses anything longer, and it
# would only say so on the first hook call, far from the file that caused it.
MAX_SOCKET_PATH_BYTES = 107

_SHOWN_CHARS = 80

_POLICIES_BY_NAME = {policy.value: policy for policy in FailurePolicy}


class HookConfigError(ValueError):
    """A registration koordrp refuses; ``reason`` is one line an operator can act on."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def parse_hook_server_config(name: str, data: bytes, default_timeout: float) -> HookServerConfig:
    """Parse the registration file ``name`` holding ``data``, the way Koordinator's proxy reads it.

    Fields koordrp does not know are ignored, so that files written for newer proxies still load;
    so are stage names it has no hook point for (koordlet lists ``PreRemoveRunPodSandbox`` when
    Resctrl is on), which ``ignored_stages`` keeps for the log. No ``runtime-hooks`` (koordlet
    leaves it out when every stage is disabled) registers the server for nothing.
    """
    if len(data) > MAX_CONFIG_BYTES:
        raise HookConfigError(TOO_LARGE)
    document = _decode(data)
    if not isinstance(document, dict):
        raise HookConfigError(f"not a JSON object (found {json_type(document)})")
    hooks, ignored = _hooks(document)
    return HookServerConfig(
        name=name,
        endpoint=_endpoint(document),
        failure_policy=_failure_policy(document),
        hooks=hooks,
        timeout=_timeout(document, default_timeout),
        ignored_stages=ignored,
        apply_pod_resources=_flag(document, "apply-pod-resources"),
    )


def _decode(data: bytes) -> object:
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise HookConfigError(f"not valid UTF-8 (byte offset {error.start})") from None
    try:
        return json.loads(text, parse_constant=_refuse_constant)
    except json.JSONDecodeError as error:
        raise HookConfigError(f"not valid JSON: {error.msg} at line {error.lineno} column {error.colno}") from None
    except HookConfigError:
        raise
    except ValueError:
        # The only other refusal json has: an integer literal past Python's int/str conversion limit.
        raise HookConfigError("not valid JSON: a number has too many digits") from None
    except RecursionError:
        # json recurses once per nesting level; a hostile file must not reach the reactor as a crash.
        raise HookConfigError("not valid JSON: nested too deeply") from None


def _refuse_constant(constant: str) -> NoReturn:
    # Python's json reads NaN and Infinity; JSON (and Koordinator's Go decoder) does not.
    raise HookConfigError(f"not valid JSON: {constant} is not a JSON value")


def _show(value: object) -> str:
    """``value`` as JSON, cut short: a reason is one log line, whatever the file holds."""
    text = json.dumps(value)
    return text if len(text) <= _SHOWN_CHARS else text[: _SHOWN_CHARS - 3] + "..."


def _endpoint(document: dict[str, object]) -> str:
    value = document.get("remote-endpoint")
    if value is None:
        raise HookConfigError('"remote-endpoint" is missing')
    if not isinstance(value, str):
        raise HookConfigError(f'"remote-endpoint" must be a string, not {json_type(value)}')
    if "\0" in value:
        raise HookConfigError('"remote-endpoint" contains a NUL character')
    try:
        encoded = value.encode("utf-8")
    except UnicodeEncodeError:  # JSON can spell a lone surrogate, which no path can hold
        raise HookConfigError('"remote-endpoint" is not valid Unicode') from None
    # Checked before parsing, whose message quotes the value in full: a reason stays one short line.
    if len(encoded) > 4 * MAX_SOCKET_PATH_BYTES:
        raise HookConfigError(f'"remote-endpoint" {_show(value)} is too long for a unix socket path')
    try:
        # ".." is resolved by the text, as os.path.normpath does ("/run/a/../k.sock" is "/run/k.sock"): the path that
        # results is the one koordrp checks (koordrp.trust: its symbolic links followed as the kernel does) and
        # dials; the text as written is never given to the kernel.
        path = parse_unix_endpoint(value)
    except EndpointError as error:
        raise HookConfigError(f'"remote-endpoint": {error}') from None
    if len(path.encode("utf-8")) > MAX_SOCKET_PATH_BYTES:
        raise HookConfigError(
            f'"remote-endpoint": {path!r} is longer than the {MAX_SOCKET_PATH_BYTES} bytes a unix socket path may hold'
        )
    return path


def _failure_policy(document: dict[str, object]) -> FailurePolicy:
    value = document.get("failure-policy")
    # Koordinator's PolicyNone (""), like an absent policy, ignores failures.
    if value is None or value == "":
        return FailurePolicy.IGNORE
    if isinstance(value, str) and value in _POLICIES_BY_NAME:
        return _POLICIES_BY_NAME[value]
    known = " or ".join(f'"{name}"' for name in _POLICIES_BY_NAME)
    shown = _show(value) if isinstance(value, str) else f"a {json_type(value)}"
    raise HookConfigError(f'"failure-policy" must be {known}, not {shown}')


def _hooks(document: dict[str, object]) -> tuple[frozenset[HookType], tuple[str, ...]]:
    """The hooks the file asks for, and the stage names among them koordrp has no hook point for."""
    value = document.get("runtime-hooks")
    if value is None:
        return frozenset(), ()
    if not isinstance(value, list):
        raise HookConfigError(f'"runtime-hooks" must be a list of hook names, not {json_type(value)}')
    hooks: set[HookType] = set()
    ignored: list[str] = []
    for index, item in enumerate(value):
        if not isinstance(item, str):
            raise HookConfigError(f'"runtime-hooks"[{index}] must be a string, not {json_type(item)}')
        hook = HOOKS_BY_NAME.get(item)
        if hook is not None:
            hooks.add(hook)
        elif _show(item) not in ignored:
            ignored.append(_show(item))
    return frozenset(hooks), tuple(ignored)


def _timeout(document: dict[str, object], default: float) -> float:
    value = document.get("timeout-seconds")
    if value is None:
        return default
    # bool is an int subclass, but `true` is not a number of seconds.
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        try:
            seconds = float(value)
        except OverflowError:  # an integer literal too long for a float
            seconds = math.inf
        if math.isfinite(seconds) and seconds > 0:
            return seconds
        raise HookConfigError(f'"timeout-seconds" must be a positive finite number, not {_show(value)}')
    raise HookConfigError(f'"timeout-seconds" must be a positive finite number, not {json_type(value)}')


def _flag(document: dict[str, object], key: str) -> bool:
    value = document.get(key)
    if value is None:
        return False
    if isinstance(value, bool):
        return value
    raise HookConfigError(f'"{key}" must be true or false, not {_show(value) if isinstance(value, str) else json_type(value)}')


def permission_problem(mode: int, owner: int, koordrp_uid: int) -> str | None:
    """Why a registration file may not be trusted, or None.

    A hook server can rewrite every container's environment, resources and cgroup, so registering
    one must take what changing koordrp itself takes: the rule sudo and sshd apply to their
    configuration. A file others can write, or (when koordrp runs as root) one root does not own,
    is refused.
    """
    if mode & 0o022:
        return f"is group- or world-writable (mode {mode & 0o7777:04o}); only its owner may be able to change it"
    if koordrp_uid == 0 and owner != 0:
        return f"is owned by uid {owner}, not root; only root may register hook servers"
    return None
