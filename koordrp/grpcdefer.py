"""grpc client futures as Deferreds on the reactor: how koordrp calls hook servers and the runtime.

The call leaves at once; grpc reports its end on a thread of its own, and the Deferred fires on the
reactor. Cancelling the Deferred (the caller went away, a timeout) cancels the grpc call, so the
server hears of it at once.
"""

from typing import TypeVar

import grpc
from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IReactorFromThreads

Result = TypeVar("Result")


def when_done(future: "grpc.Future[Result]", reactor: IReactorFromThreads) -> "Deferred[grpc.Future[Result]]":
    """Fires on the reactor with ``future`` once it is done, its answer or its error inside."""
    def cancel(_: object) -> None:
        future.cancel()

    done: Deferred[grpc.Future[Result]] = Deferred(cancel)

    def settle(finished: "grpc.Future[Result]") -> None:
        if not done.called:  # a cancelled Deferred has fired already
            done.callback(finished)

    future.add_done_callback(lambda finished: reactor.callFromThread(settle, finished))
    return done


def failed_call(error: BaseException) -> grpc.Call | None:
    """The grpc call behind a future's error, with its status; None for an error that is not grpc's."""
    if isinstance(error, grpc.RpcError) and isinstance(error, grpc.Call):
        return error
    return None
