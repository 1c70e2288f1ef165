"""The communication worker: one thread per process group that synchronizes buckets, in submission
order, while the backward pass goes on (``zen.async_sync``), on its own CUDA stream on a GPU."""

from __future__ import annotations

import atexit
import logging
import queue
import threading
import weakref

import torch

log = logging.getLogger(__name__)

__all__ = ["CommWorker"]


class CommWorker:
    """A communication thread that completes futures for buckets, one at a time, in submission order.

    One worker serves every ZEN hook over the same process group (``CommWorker.acquire``), so the
    collectives of all buckets reach the group in the order the buckets were handed over — the same
    order on every rank, because DDP hands buckets over in the same order everywhere — and nothing
    else of ZEN's issues collectives on that group concurrently.

    Correctness conditions the worker keeps:

    * CPU: the worker runs with the submitting thread's intra-op thread count, so reductions inside
      the schemes split work the same way as in the blocking path (bitwise-equal results).
    * CUDA: the worker computes on its own stream. ``submit`` records an event on the producer's
      current stream (the gradients in the bucket are written there) and the worker's stream waits
      on it; every submitted tensor is ``record_stream``-ed on the worker's stream so the caching
      allocator does not reuse its memory while the worker still reads or writes it. The future is
      created with the device, so ``set_result`` records an event on the worker's stream and
      whoever waits on the future (DDP's reducer) makes its own stream wait on that event.
    * Failure: an exception inside a job is logged at ERROR on this rank at once and set on that
      job's future (DDP re-raises it in the training thread when it waits for the bucket). Every
      later job fails fast with a RuntimeError naming the first failure, instead of running
      collectives that the peers would no longer match. Peers that already entered a collective
      this rank never reaches wait until the process group's timeout (``timeout=`` of
      ``init_process_group``; set it to minutes, not the 30-minute default, for jobs that must fail
      fast).
    * Exit: the thread is a daemon (it never keeps the process alive); ``close`` drains the queue and
      joins the thread, and an ``atexit`` handler closes every live worker with a bounded wait, so a
      normal interpreter exit does not find the thread inside torch code.

    Args:
        device: the device of the gradients (a CUDA device gets its own stream).
        name: the thread's name (for stack dumps).
    """

    _STOP = object()
    _live: dict[int, "CommWorker"] = {}
    _live_lock = threading.Lock()

    def __init__(self, device: torch.device, name: str = "zen-comm") -> None:
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self._stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._num_threads = torch.get_num_threads()
        self._queue: "queue.SimpleQueue" = queue.SimpleQueue()
        self._failed: BaseException | None = None
        self._closed = False
        self._refs = 0
        self._key: int | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()
        _ALL_WORKERS.add(self)

    # --- one worker per process group ------------------------------------------------------------------
    @classmethod
    def acquire(cls, group, device: torch.device) -> "CommWorker":
        """The worker of ``group`` (created on first use); pair every call with ``release``."""
        key = id(group)
        with cls._live_lock:
            w = cls._live.get(key)
            if w is None or w._closed:
                w = cls(device, name=f"zen-comm-{key:x}")
                w._key = key
                w._group = group  # keeps id(group) unique while the worker lives
                cls._live[key] = w
            w._refs += 1
            return w

    def release(self) -> None:
        """Drop one reference; the last one closes the worker."""
        with self._live_lock:
            self._refs -= 1
            last = self._refs <= 0
            if last and self._key is not None and self._live.get(self._key) is self:
                del self._live[self._key]
        if last:
            self.close()

    # --- jobs ------------------------------------------------------------------------------------------
    def submit(self, fn, tensors: "list[torch.Tensor]" = ()) -> torch.futures.Future:
        """Run ``fn()`` on the worker after every job submitted before; its result completes the future.

        1. Refuse a closed worker (RuntimeError) and fail fast after an earlier failure.
        2. CUDA: order the worker's stream after the producer's current stream; mark ``tensors`` as
           used by the worker's stream.
        3. Enqueue.

        Args:
            fn: a callable without arguments returning a tensor.
            tensors: tensors ``fn`` reads or writes that were produced on the caller's stream.

        Returns:
            A future completed by the worker (with the exception ``fn`` raised, if any).

        Raises:
            RuntimeError: the worker was closed.
        """
        # Step 1: state.
        if self._closed:
            raise RuntimeError(f"zen: the communication worker was closed ({self._thread.name!r}, by its owner's "
                               "close(): ZenHookState.close() or OuterSync.close()); build a new state to "
                               "synchronize again")
        cuda = self._stream is not None
        fut: torch.futures.Future = torch.futures.Future(devices=[self.device]) if cuda else torch.futures.Future()
        if self._failed is not None:
            fut.set_exception(self._fail_fast_error())
            return fut
        # Step 2: stream order and allocator safety.
        ready = None
        if cuda:
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(self.device))
            for t in tensors:
                t.record_stream(self._stream)
        # Step 3: FIFO.
        self._queue.put((fn, fut, ready))
        return fut

    def drain(self, timeout_s: float | None = None) -> bool:
        """Wait until every job submitted so far has finished; False if ``timeout_s`` passed first."""
        if self._closed or not self._thread.is_alive():
            return True
        done = threading.Event()
        self._queue.put((done.set, None, None))
        return done.wait(timeout_s)

    def close(self, timeout_s: float | None = 60.0) -> None:
        """Finish the queued jobs, stop and join the thread (idempotent).

        A thread stuck in a collective that its peers never join is left behind after ``timeout_s``
        (it is a daemon: it does not keep the process alive), with a warning.
        """
        if self._closed:
            return
        self._closed = True
        _ALL_WORKERS.discard(self)
        if threading.current_thread() is self._thread:
            return  # closing from a job: the loop ends at the stop marker
        self._queue.put(self._STOP)
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            log.warning("zen: communication worker %s still busy after %.0f s at close (a collective its peers "
                        "did not join?); leaving the daemon thread behind", self._thread.name, timeout_s or 0)

    def _fail_fast_error(self) -> RuntimeError:
        return RuntimeError(f"zen: an earlier bucket failed on this rank ({type(self._failed).__name__}: "
                            f"{self._failed}); no further buckets are synchronized")

    def _run(self) -> None:
        torch.set_num_threads(self._num_threads)
        if self._stream is not None:
            # A new thread's current device is cuda:0: entering and leaving a stream context there would
            # create a context on GPU 0 from every rank of the node (~0.5 GiB each).
            torch.cuda.set_device(self.device)
        while True:
            item = self._queue.get()
            if item is self._STOP:
                return
            fn, fut, ready = item
            if fut is None:  # a drain marker
                fn()
                continue
            try:
                if self._failed is not None:
                    raise self._fail_fast_error()
                with torch.no_grad():
                    if self._stream is None:
                        fut.set_result(fn())
                    else:
                        with torch.cuda.stream(self._stream):
                            self._stream.wait_event(ready)
                            # set_result inside the stream context: the future records its event here.
                            fut.set_result(fn())
            except BaseException as e:  # noqa: BLE001 - every failure must reach the future
                if self._failed is None:
                    self._failed = e
                    log.error("zen: bucket synchronization failed on this rank: %r; peers waiting in a collective "
                              "of it wait until the process group timeout", e)
                fut.set_exception(e)


_ALL_WORKERS: "weakref.WeakSet[CommWorker]" = weakref.WeakSet()


@atexit.register
def _close_workers_at_exit() -> None:
    # Registered at import, so it runs after atexit handlers registered later (LIFO) — e.g. a
    # destroy_process_group registered by the training script runs first only if registered after.
    for w in list(_ALL_WORKERS):
        w.close(timeout_s=5.0)
