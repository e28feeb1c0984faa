"""One rank's UCX worker, its endpoints to every peer, and the loop that waits on UCX requests.

Waiting is UCX's blocking progress mode: a waiting thread progresses the worker, polls for a few
microseconds (yielding the CPU between polls), then arms the worker (``ucp_worker_arm``) and
sleeps in ``epoll`` on the worker's file descriptor, so a blocked collective costs no CPU while
the peer computes. One waiting thread at a time sleeps in epoll (the
leader); other threads that wait meanwhile (point-to-point lanes beside the collective lane) sleep
on a condition the leader signals after each progress round. A thread that posts a request while
the leader sleeps wakes it through a pipe, because a new request may need progress that no UCX
event would announce.

A dead peer is noticed through a lifeline: a TCP connection from every rank to every other rank,
in the same epoll set. UCX endpoints run without UCX's own error handling by default, because
UCX allows shared memory and CMA only then (error handling restricts it to TCP and RDMA); the
kernel closes a dead process's sockets at once, so every rank learns within milliseconds which
rank died. A rank that closes its group says goodbye on the lifeline first, and one that aborts
says so, so neither reads as a crash.
"""

from __future__ import annotations

import errno
import ipaddress
import os
import select
import socket
import threading
import time
from typing import Any

from pluribus.arrays import byte_view
from pluribus.backend import SUBGROUP_TAG_SHIFT
from pluribus.errors import DistTimeoutError, PeerError, PluribusError
from pluribus.lifeline import MAX_LINE, tell
from pluribus.store import AUTH_TOKEN_ENV
from pluribus.tcp_mesh import connect_mesh, listen_address

from .probe import load_ucxx, transports

# A UCX tag is 64 bits: [source rank: 19][sub-group tag space: 19][tag within the space: 26].
# pluribus tags follow the core's tag budget (pluribus.backend: every tag of a group below
# 2**26, ``k << 40`` for sub-group ``k``). Putting the source in the tag lets one worker-wide
# receive match exactly one peer's messages.
SRC_BITS, SPACE_BITS, LOW_BITS = 19, 19, 26
SUBGROUP_SHIFT = SUBGROUP_TAG_SHIFT
#: The largest pluribus tag this layout carries (declared to the core as ``max_tag``).
MAX_TAG = (((1 << SPACE_BITS) - 1) << SUBGROUP_SHIFT) | ((1 << LOW_BITS) - 1)
_LOW_MASK = (1 << SUBGROUP_SHIFT) - 1

#: Lifeline lines: goodbye, abort (with the reason), timed out (with the timeout's message).
_BYE, _ABORT, _TIMED_OUT = b"B", b"A", b"T"
#: A peer that closed cleanly may still have messages in flight; fail waits on it after this long.
CLOSE_GRACE = 1.0
#: While UCX keeps reporting events (so the wait never sleeps in epoll), look at the lifelines
#: this often.
LIFELINE_LOOK = 0.005


def ucx_tag(src: int, tag: int) -> int:
    """The 64-bit UCX tag of a message from ``src`` with pluribus tag ``tag``."""
    space, low = tag >> SUBGROUP_SHIFT, tag & _LOW_MASK
    if tag < 0 or low >> LOW_BITS or space >> SPACE_BITS or src >> SRC_BITS:
        raise ValueError(
            f"tag {tag} from rank {src} does not fit the ucc backend's 64-bit UCX tag (at most "
            f"2**{SRC_BITS} ranks, 2**{SPACE_BITS} sub-groups, tags below 2**{LOW_BITS})"
        )
    return (src << (SPACE_BITS + LOW_BITS)) | (space << LOW_BITS) | low


class Op:
    """A UCX request in flight, with the buffer it uses (kept alive until it completes)."""

    __slots__ = ("request", "buffer", "peer", "kind", "tag", "nbytes", "cuda")

    def __init__(self, request, buffer, peer: int, kind: str, tag: int, nbytes: int, cuda: bool):
        self.request = request
        self.buffer = buffer
        self.peer = peer
        self.kind = kind
        self.tag = tag
        self.nbytes = nbytes
        self.cuda = cuda

    def describe(self) -> str:
        way = "to" if self.kind == "send" else "from"
        return f"{self.kind} of {self.nbytes} bytes {way} rank {self.peer} (tag {self.tag})"


class Transport:
    """UCX worker + endpoints + lifelines of one rank of the world the backend was created for."""

    def __init__(self, rank: int, size: int, store, timeout: float, options: dict[str, Any]):
        self.rank = rank
        self.size = size
        self.store = store
        self.timeout = timeout
        self.spin = float(options.get("ucc_spin_us", 50.0)) * 1e-6
        # CUDA copies complete without a file-descriptor event, so a wait on GPU memory polls;
        # it spins (yielding the core) this long before it polls every 0.5 ms.
        self.cuda_spin = float(options.get("ucc_cuda_spin_us", 20000.0)) * 1e-6
        self.spin_yield = bool(options.get("ucc_spin_yield", True))
        error_handling = bool(options.get("ucc_error_handling", False))
        host = (
            options.get("ucc_host")
            or os.environ.get("PLURIBUS_UCC_HOST")
            or listen_address(options)
        )
        token = options.get("auth_token") or os.environ.get(AUTH_TOKEN_ENV)

        self.ucx = ucx = load_ucxx()
        from ucxx._lib.arr import Array

        self._array = Array
        self._tag = ucx.UCXXTag
        _prepare_cuda(options.get("ucc_cuda", "auto"))
        config = _ucx_config(options, error_handling, host)
        self.context = ucx.UCXContext(config, feature_flags=(ucx.Feature.TAG, ucx.Feature.WAKEUP))
        self.worker = ucx.UCXWorker(self.context)
        self.worker.init_blocking_progress_mode()
        self.cuda_transports = any(
            name.startswith("cuda") for name in transports(self.context.info)
        )

        self.lock = threading.Lock()
        self.cond = threading.Condition(self.lock)
        self.leader_sleeping = False
        self.closed = False
        self.aborted: str | None = None
        self.dead: dict[int, str] = {}
        self.aborted_peers: dict[int, str] = {}
        self.timed_out_peers: set[int] = set()  # aborted because a collective timed out
        self._inbox: dict[int, bytearray] = {}
        self.said_bye: dict[int, float] = {}
        self.graveyard: list[Op] = []
        self.wake_r, self.wake_w = os.pipe()
        os.set_blocking(self.wake_r, False)
        os.set_blocking(self.wake_w, False)
        self.poller = select.epoll()
        self.poller.register(self.worker.epoll_file_descriptor, select.EPOLLIN)
        self.poller.register(self.wake_r, select.EPOLLIN)
        self.lifelines: dict[int, socket.socket] = {}
        self._fd_peer: dict[int, int] = {}
        self._subgroups = 0

        try:
            store.set(f"addr/{rank}", self.worker.address.tobytes())
            self.endpoints = {}
            for peer in range(size):
                if peer == rank:
                    continue
                address = ucx.UCXAddress.create_from_buffer(store.get(f"addr/{peer}", timeout))
                self.endpoints[peer] = ucx.UCXEndpoint.create_from_worker_address(
                    self.worker, address, error_handling
                )
            lifelines = connect_mesh(
                rank, size, store, timeout, "ucc lifeline", "lifeline", host, token=token
            )
            for peer, sock in lifelines.items():
                self._add_lifeline(peer, sock)
        except BaseException:
            self.close()
            raise

    # -- wire-up ---------------------------------------------------------------------------------
    def _add_lifeline(self, peer: int, sock: socket.socket) -> None:
        sock.setblocking(False)
        self.lifelines[peer] = sock
        self._fd_peer[sock.fileno()] = peer
        self.poller.register(sock.fileno(), select.EPOLLIN | select.EPOLLRDHUP)

    def next_tag_space(self) -> int:
        """A fresh sub-group tag space, agreed by the members through the world's store."""
        return int(self.store.add("subgroup-tag-spaces", 1))

    # -- requests --------------------------------------------------------------------------------
    def post_send(self, array: Any, peer: int, tag: int) -> Op:
        return self._post("send", array, peer, tag)

    def post_recv(self, array: Any, peer: int, tag: int) -> Op:
        return self._post("recv", array, peer, tag)

    def _post(self, kind: str, array: Any, peer: int, tag: int) -> Op:
        # As bytes: the buffer protocol knows no float16 or bfloat16, and UCX needs only bytes.
        buffer = self._array(byte_view(array))
        cuda = bool(buffer.cuda)
        if cuda and not self.cuda_transports:
            raise TypeError(
                f"rank {self.rank}: UCX found no CUDA transport here, so the ucc backend cannot "
                "carry cupy arrays; check that the GPU driver is visible and UCX_TLS includes "
                "cuda_copy,cuda_ipc (or unset it), or set PLURIBUS_GPU_STAGING=1 to copy "
                "through host memory"
            )
        if cuda:
            _make_device_current(array)
        ucx_tag_value = self._tag(ucx_tag(self.rank if kind == "send" else peer, tag))
        with self.lock:
            self._raise_if_unusable((peer,))
            if kind == "send":
                request = self.endpoints[peer].tag_send(buffer, ucx_tag_value)
            else:
                request = self.worker.tag_recv(buffer, ucx_tag_value)
            if self.leader_sleeping:
                self._wake()
        return Op(request, buffer, peer, kind, tag, buffer.nbytes, cuda)

    def _wake(self) -> None:
        try:
            os.write(self.wake_w, b"x")
        except BlockingIOError:
            pass  # the pipe is full of wake-ups already

    def wait(
        self,
        ops: list[Op],
        watch: tuple[int, ...],
        what: str,
        timeout: float,
        mismatch_error=None,
    ) -> None:
        """Block until every op completes, the deadline passes, or a rank in ``watch`` fails.

        ``watch`` are the ranks whose failure dooms the operation (the whole group for a
        collective). On failure the ops still in flight are cancelled.
        """
        if not ops:
            return
        deadline = time.monotonic() + timeout
        cuda = any(op.cuda for op in ops)
        spin_until = time.monotonic() + (self.cuda_spin if cuda else self.spin)
        next_lifeline_look = spin_until
        with self.lock:
            try:
                while True:
                    if self.closed or self.aborted is not None:
                        self._raise_if_unusable(())
                    self.worker.progress()
                    if all(op.request.completed for op in ops):
                        break
                    self._raise_if_unusable(watch, ops)
                    now = time.monotonic()
                    if now >= deadline:
                        pending = [op.describe() for op in ops if not op.request.completed]
                        raise DistTimeoutError(
                            f"rank {self.rank}: {what} did not complete within "
                            f"{timeout:.0f}s; still waiting for: {'; '.join(pending[:4])}"
                            f"{' ...' if len(pending) > 4 else ''}. A peer may be stuck in a "
                            "different collective, or call init_process_group(timeout=...) "
                            "with a longer timeout"
                        )
                    if self.leader_sleeping:
                        self.cond.wait(min(deadline - now, 0.05))
                        continue
                    if now < spin_until:
                        # Let other threads post, and other processes (the peer on a shared
                        # core) run, while this one polls.
                        self.lock.release()
                        if self.spin_yield:
                            os.sched_yield()
                        self.lock.acquire()
                        continue
                    if not self.worker.arm():
                        # UCX has events to process first. A peer that died mid-transfer can
                        # keep UCX busy like this for good, so the lifelines are still read.
                        if now >= next_lifeline_look:
                            self._handle_events(self.poller.poll(0))
                            next_lifeline_look = now + LIFELINE_LOOK
                        continue
                    # CUDA copies complete without a file-descriptor event: poll them.
                    sleep = 0.0005 if cuda else min(deadline - now, 1.0)
                    self.leader_sleeping = True
                    self.lock.release()
                    try:
                        events = self.poller.poll(sleep)
                    finally:
                        self.lock.acquire()
                        self.leader_sleeping = False
                    self._handle_events(events)
                    self.cond.notify_all()
            except BaseException:
                self._bury(ops)
                raise
            finally:
                self.cond.notify_all()
            for op in ops:
                self._check_op(op, what, mismatch_error)
            ops.clear()

    def _check_op(self, op: Op, what: str, mismatch_error) -> None:
        try:
            op.request.check_error()
        except Exception as exc:
            name = type(exc).__name__
            if "Truncated" in name:
                error = mismatch_error or ValueError
                cause = "the ranks passed arrays of different sizes"
                if mismatch_error is not None:
                    cause += (
                        f", or rank {op.peer} sent it for another collective: an earlier call "
                        "mismatched (the root of a broadcast returns before the others can tell "
                        "it; ucc_check_calls=True names such a call)"
                    )
                raise error(
                    f"rank {self.rank}: {what}: rank {op.peer} sent more than the "
                    f"{op.nbytes} bytes this rank expected; {cause}"
                ) from exc
            if op.peer in self.dead or op.peer in self.aborted_peers:
                raise self._peer_error(op.peer, what) from exc
            raise PluribusError(
                f"rank {self.rank}: {what}: UCX failed the {op.describe()}: {name}: {exc}"
            ) from exc

    def _handle_events(self, events) -> None:
        for fd, _mask in events:
            if fd == self.wake_r:
                try:
                    while os.read(self.wake_r, 4096):
                        pass
                except BlockingIOError:
                    pass
                continue
            peer = self._fd_peer.get(fd)
            if peer is not None:
                self._read_lifeline(peer)

    def _read_lifeline(self, peer: int) -> None:
        """Read what ``peer`` said on its lifeline: lines of goodbye or abort, or end of file."""
        sock = self.lifelines.get(peer)
        if sock is None:
            return
        try:
            data = sock.recv(4096)
        except BlockingIOError:
            return
        except OSError as exc:
            data, reason = b"", f"its connection failed ({exc})"
        else:
            reason = "its process exited or was killed"
        inbox = self._inbox.setdefault(peer, bytearray())
        inbox += data
        while b"\n" in inbox:
            line, _, rest = bytes(inbox).partition(b"\n")
            inbox[:] = rest
            if line.startswith((_ABORT, _TIMED_OUT)):
                said = line[1:].decode(errors="replace") or "no reason given"
                self.aborted_peers.setdefault(peer, said)
                if line.startswith(_TIMED_OUT):
                    self.timed_out_peers.add(peer)
            elif line.startswith(_BYE):
                self.said_bye.setdefault(peer, time.monotonic())
        if len(inbox) > MAX_LINE:
            data, reason = b"", "its lifeline carried a malformed message"
        if data:
            return
        if peer not in self.said_bye and peer not in self.aborted_peers:
            self.dead.setdefault(peer, reason)
        self.poller.unregister(sock.fileno())
        self._fd_peer.pop(sock.fileno(), None)

    def _peer_error(self, peer: int, what: str) -> PeerError | DistTimeoutError:
        if peer in self.timed_out_peers and peer not in self.dead:
            return DistTimeoutError(
                f"rank {self.rank}: {what} failed because the group timed out on rank {peer}: "
                f"{self.aborted_peers[peer]}"
            )
        if peer in self.dead:
            why = f"rank {peer} is gone: {self.dead[peer]}"
        else:
            why = f"rank {peer} aborted ({self.aborted_peers[peer]})"
        return PeerError(
            f"rank {self.rank}: {what} failed because {why}. Restart the job (pluribus-run "
            "restarts it when given --max-restarts)",
            peer,
        )

    def _raise_if_unusable(self, watch, ops: list[Op] | None = None) -> None:
        if self.aborted is not None:
            raise PluribusError(f"rank {self.rank}: the ucc backend was aborted: {self.aborted}")
        if self.closed:
            raise PluribusError(f"rank {self.rank}: the ucc backend was closed")
        # A crashed rank is the cause; ranks that aborted because of it come second.
        for failed in (self.dead, self.aborted_peers):
            for peer in watch:
                if peer in failed:
                    raise self._peer_error(peer, "the operation")
        if ops is None:
            return
        now = time.monotonic()
        for op in ops:
            since = self.said_bye.get(op.peer)
            if since is not None and now - since > CLOSE_GRACE and not op.request.completed:
                raise PeerError(
                    f"rank {self.rank}: {op.describe()} cannot complete: rank {op.peer} closed "
                    "its process group (destroy_process_group) before sending or receiving it; "
                    "every rank must finish the same operations before destroying the group",
                    op.peer,
                )

    def _bury(self, ops: list[Op]) -> None:
        """Keep failed ops' buffers alive: UCX may still touch them until it cancels them."""
        self.graveyard.extend(op for op in ops if not op.request.completed)
        ops.clear()

    def bury(self, ops: list[Op]) -> None:
        with self.lock:
            self._bury(list(ops))

    # -- failure and shutdown --------------------------------------------------------------------
    def abort(self, reason: str, timed_out: bool = False) -> None:
        """Stop this rank's transport and tell every peer why (``timed_out``: a collective
        timed out here, which the peers report as a timeout, not as this rank's failure)."""
        with self.lock:
            if self.aborted is not None or self.closed:
                return
            self.aborted = reason
            code = _TIMED_OUT if timed_out else _ABORT
            self._tell_peers(code + reason.replace("\n", " ").encode()[:2000] + b"\n")
            self._wake()
            self.cond.notify_all()

    def _tell_peers(self, message: bytes) -> None:
        tell(self.lifelines.values(), message)

    def close(self) -> None:
        with self.lock:
            if self.closed:
                return
            self.closed = True
            self._tell_peers(_BYE + b"\n")
            self._wake()
            self.cond.notify_all()
            self._release()

    def _release(self) -> None:
        # Flush and close endpoints to live peers; a dead peer's endpoint is only released.
        for peer, endpoint in list(getattr(self, "endpoints", {}).items()):
            if peer not in self.dead and peer not in self.aborted_peers:
                try:
                    endpoint.close_blocking(period=10**8, max_attempts=5)
                except Exception:
                    pass
        self.endpoints = {}
        try:
            self.worker.cancel_inflight_requests(period=10**8, max_attempts=5)
        except Exception:
            pass
        self.graveyard.clear()
        for sock in self.lifelines.values():
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()
        self.lifelines.clear()
        self.poller.close()
        for fd in (self.wake_r, self.wake_w):
            try:
                os.close(fd)
            except OSError as exc:
                if exc.errno != errno.EBADF:
                    raise
        self.worker = None
        self.context = None


def _ucx_config(options: dict, error_handling: bool, host: str) -> dict[str, str]:
    """The UCX context's options: the user's ``ucc_config`` and UCX_* variables win; otherwise

    - no CMA without UCX's error handling: CMA reads the peer's memory with process_vm_readv,
      and UCX aborts the whole process when that peer has died, where the lifelines would have
      turned the death into a PeerError; shared memory (posix, sysv) carries the data instead;
    - a job whose ranks meet on loopback (one host) keeps UCX's network transports on loopback
      too, so that no rank listens on the host's external addresses.
    """
    config = {str(k): str(v) for k, v in dict(options.get("ucc_config", {})).items()}
    if not error_handling and "TLS" not in config and "UCX_TLS" not in os.environ:
        config["TLS"] = "^cma"
    if _is_loopback(host) and "NET_DEVICES" not in config and "UCX_NET_DEVICES" not in os.environ:
        config["NET_DEVICES"] = "lo"
    return config


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(socket.gethostbyname(host)).is_loopback
    except (OSError, ValueError):
        return False


_thread_devices = threading.local()


def _make_device_current(array: Any) -> None:
    """UCX's CUDA transports use the calling thread's current context: make it the array's."""
    device = array.device.id
    if getattr(_thread_devices, "device", None) != device:
        import cupy

        cupy.cuda.runtime.setDevice(device)
        _thread_devices.device = device


def _prepare_cuda(mode: Any) -> None:
    """Make the current GPU's context exist before UCX starts, so UCX sees CUDA memory from the
    first message. ``mode`` "auto" does so only when the program already imported cupy (the
    backend never imports it on its own); True imports cupy and requires a GPU; False skips it.
    """
    import sys

    if mode is False or mode == "false":
        return
    cupy = sys.modules.get("cupy")
    if cupy is None and mode is not True and mode != "true":
        return
    if cupy is None:
        import cupy
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception:
        count = 0
    if count == 0:
        if mode is True or mode == "true":
            raise RuntimeError("ucc_cuda=True but cupy sees no CUDA GPU here")
        return
    cupy.cuda.Device().use()
    cupy.cuda.runtime.free(0)
