"""grpc client futures as Deferreds on the reactor: how koordrp calls hook servers and the runtime.

The call leaves at once; grpc reports its end on a thread of its own, and the Deferred fires on the
reactor. Cancelling the Deferred (the caller went away, a timeout) cancels the grpc call, so the
server hears of it at once.
"""

from functools import partial
from typing import Callable, TypeVar

import grpc
from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IReactorFromThreads

Done = TypeVar("Done")
Result = TypeVar("Result")


def when_done(
    future: "grpc.Future[Done]",
    reactor: IReactorFromThreads,
    read: "Callable[[grpc.Future[Done]], Result]",
    handed: "Callable[[Result, Callable[[], None]], None] | None" = None,
) -> "Deferred[Result]":
    """Fires on the reactor with what ``read`` makes of ``future`` once it is done (its answer or its error).

    ``read`` runs on grpc's thread, so the reactor gets a plain value. ``handed``, if given, is handed
    that value there instead, with what fires the Deferred, which it must have run on the reactor: a
    thread waiting for the answer can take it first and choose when the reactor is woken for it.
    """

    def cancel(_: object) -> None:
        future.cancel()

    done: Deferred[Result] = Deferred(cancel)

    def settle(result: Result) -> None:
        if not done.called:  # a cancelled Deferred has fired already
            done.callback(result)

    def unread(error: BaseException) -> None:
        if not done.called:
            done.errback(error)

    def finished(finished: "grpc.Future[Done]") -> None:
        if finished.cancelled():
            return  # by ``cancel``: the Deferred has fired already
        try:
            result = read(finished)
        except BaseException as error:
            # Never lost on grpc's thread, where nobody would see it: the reactor's Deferred fails with it.
            reactor.callFromThread(unread, error)
            return
        if handed is None:
            reactor.callFromThread(settle, result)
        else:
            handed(result, partial(settle, result))

    future.add_done_callback(finished)
    return done


def failed_call(error: BaseException) -> grpc.Call | None:
    """The grpc call behind a future's error, with its status; None for an error that is not grpc's."""
    if isinstance(error, grpc.RpcError) and isinstance(error, grpc.Call):
        return error
    return None
