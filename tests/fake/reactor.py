"""A reactor for SynchronousTestCase: Twisted's MemoryReactorClock whose threads run inline."""

from typing import Any, Callable

from twisted.internet.interfaces import IReactorThreads
from twisted.internet.testing import MemoryReactorClock
from twisted.python.threadpool import ThreadPool
from zope.interface import implementer


class InlineThreadPool(ThreadPool):
    """Runs each job at once in the caller's thread, as Buildbot's non-thread pool does."""

    def callInThreadWithCallback(
        self, onResult: Callable[[bool, Any], object] | None, func: Callable[..., Any], *args: Any, **kw: Any
    ) -> None:
        try:
            result = func(*args, **kw)
        except BaseException as error:
            if onResult is not None:
                onResult(False, error)
        else:
            if onResult is not None:
                onResult(True, result)


@implementer(IReactorThreads)
class InlineThreadsReactor(MemoryReactorClock):
    """A memory reactor plus the thread methods koordrp's services use, all run inline and recorded."""

    def __init__(self) -> None:
        super().__init__()
        self.pool = InlineThreadPool()
        self.from_threads: list[tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]]] = []

    def getThreadPool(self) -> ThreadPool:
        return self.pool

    # Parameters named as IReactorFromThreads and IReactorInThreads name them.
    def callFromThread(self, callable: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        self.from_threads.append((callable, args, kwargs))
        callable(*args, **kwargs)

    def callInThread(self, callable: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        callable(*args, **kwargs)

    def suggestThreadPoolSize(self, size: int) -> None:
        pass
