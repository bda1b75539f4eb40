"""JSON lines logging for twistd: ``twistd -n --logger=koordrp.jsonlogs.to_stdout koordrp …``.

Each event becomes one JSON object on its own line, with the structured fields koordrp logs
(method, namespace, pod, uid, container, hooks, outcome, duration_ms, hook server, …) as keys and
``log_level``/``log_namespace``/``log_time`` from twisted.logger; journald or a log shipper can
read them without parsing text. twistd calls the factory with no arguments.
"""

import sys

from twisted.logger import ILogObserver, jsonFileLogObserver


def to_stdout() -> ILogObserver:
    return jsonFileLogObserver(sys.stdout, recordSeparator="")
