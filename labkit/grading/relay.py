"""The relay: the only way the ranks of a communication exercise talk, run by the GRADER.

0.2's ring all-reduce must use send/recv only and send 2(N-1)/N of the tensor per rank
(Patarasuk & Yuan 2009); 7.3's vocab-parallel cross-entropy must use a few all-reduces of N values
(Megatron-LM, Shoeybi et al. 2019, sec. 3). A count made next to the learner's code is a claim the
learner controls, so these ranks get **no process group**: their ``torch.distributed`` calls are
messages to a :class:`Relay` in the case's own process, which delivers every message, computes
every all-reduce itself and keeps the log the case judges (:attr:`Relay.sent`,
:attr:`Relay.reduced`).

* :class:`Relay` (grader side): a Unix socket in the kernel's folder (:data:`SOCKET_DIR`, when
  the kernel has a network of its own; else TCP on 127.0.0.1), one thread per rank; a rank proves
  it belongs to this case with the relay's random token. Messages are :mod:`labkit.grading.wire`
  data (never pickle), size-limited before decoding.
* :func:`run_ranks` (kernel side): forks the ranks, which replace ``torch.distributed``'s send,
  isend, recv, irecv, all_reduce, get_rank and get_world_size by relay calls (other collectives
  raise, naming themselves). It runs in the learner's kernel: nothing it says is trusted.

Point-to-point calls keep the semantics of gloo, the backend the notebooks run on: a blocking
``send`` returns only once the receiver has posted the matching ``recv`` (gloo's
``transport/tcp/pair.cc`` writes a message only after the receiver's "recv posted" notice; a
2-rank ``dist.send`` before ``dist.recv`` on both ranks ends in "Timed out waiting ... for send
operation to complete" even for one element), ``isend``/``irecv`` post at once and their
``wait()`` blocks until the match (torch.distributed documents ``send``/``recv`` as synchronous,
``isend``/``irecv`` as returning a request to wait on). Messages between one pair of ranks match
in order: the k-th send from a to b is the k-th receive b posts from a. So a ring in which every
rank sends first deadlocks here as on gloo; the relay sees that as a state (every rank joined and
either blocked in it with nothing that can arrive, or gone) and releases every waiting rank at
once with an error describing who waits for whom (also in :attr:`Relay.problems`).

The relay cannot see ranks that move data by other means (files, pipes, shared memory), so the
cases also require that the relay's messages alone carry what each rank's output needs.
"""
from __future__ import annotations

import os
import pickle
import secrets
import signal
import socket
import struct
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable

import torch

from . import wire

__all__ = ["Relay", "Message", "Reduction", "RelayGroup", "run_ranks", "REDUCE_OPS"]

MAX_FRAME = 4 * 2 ** 20  # bytes of one message on the relay's wire
MAX_TOTAL = 32 * 2 ** 20  # bytes of tensors the relay keeps for one case (a flood is refused)
REDUCE_OPS = ("sum", "max", "min", "product")


@dataclass(frozen=True)
class Message:
    """One send the relay delivered: ``src`` -> ``dst``, the tensor's values (a CPU copy)."""

    src: int
    dst: int
    tensor: torch.Tensor


@dataclass(frozen=True)
class Reduction:
    """Rank ``rank``'s contribution to its ``index``-th all-reduce: ``op`` and its tensor."""

    rank: int
    index: int
    op: str
    tensor: torch.Tensor


def _write(sock: socket.socket, obj: Any) -> None:
    data = wire.dumps(obj, MAX_FRAME)
    sock.sendall(struct.pack("<Q", len(data)) + data)


def _read_exact(sock: socket.socket, n: int) -> bytes | None:
    chunks, got = [], 0
    while got < n:
        chunk = sock.recv(min(n - got, 1 << 20))
        if not chunk:
            return None
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def _read(sock: socket.socket) -> Any:
    head = _read_exact(sock, 8)
    if head is None:
        return None
    (n,) = struct.unpack("<Q", head)
    if n > MAX_FRAME:
        raise wire.WireError(f"a relay message of {n} bytes (limit {MAX_FRAME})")
    data = _read_exact(sock, n)
    return None if data is None else wire.loads(data, MAX_FRAME)


# where the relay listens when set: a folder of the kernel's own (the grader's jail gives each kernel its own
# network namespace, whose 127.0.0.1 is not the grader's; a Unix socket in the kernel's socket folder, which the
# jail binds into the kernel's file system, is reachable by that kernel alone). None: TCP on 127.0.0.1.
SOCKET_DIR: str | None = None


class Relay:
    """Grader side: delivers the messages of ``world_size`` ranks and logs them (see the module).

    Use as a context manager; pass :meth:`address` to the kernel side (:func:`run_ranks`).
    A deadlock is a state, declared as soon as it holds: all ``world_size`` ranks have joined and
    each is either blocked here with nothing that can arrive or gone. A rank still starting or
    computing (slow on a loaded machine) is neither, so only a real deadlock is reported; the
    case's own deadline bounds everything else. Each waiting rank then gets an error describing
    the deadlock (who waits for whom), which is also the first of :attr:`problems`. ``max_messages``: sends
    plus all-reduce calls in all before the relay refuses more (a runaway loop); it also keeps at most :data:`MAX_TOTAL`
    bytes of tensors and accepts at most ``4 * world_size + 4`` connections (a hostile kernel
    cannot make this process build unbounded memory or threads). After the ``with`` block :attr:`sent`
    (list of :class:`Message`, in delivery order), :attr:`reduced` (list of
    :class:`Reduction`) and :attr:`problems` (protocol errors the relay answered, e.g.
    mismatched shapes) are what the case judges.
    """

    def __init__(self, world_size: int, max_messages: int = 512):
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size must be an integer >= 1, got {world_size!r}")
        self.world_size, self.max_messages = world_size, max_messages
        self.token = secrets.token_hex(16)
        self.sent: list[Message] = []
        self.reduced: list[Reduction] = []
        self.problems: list[str] = []
        self._cond = threading.Condition()
        self._mail: dict[tuple[int, int], dict[int, torch.Tensor]] = {}  # (src, dst) -> k -> message k
        self._sends: dict[tuple[int, int], int] = {}  # (src, dst) -> sends posted
        self._recvs: dict[tuple[int, int], int] = {}  # (src, dst) -> receives posted (by dst)
        self._open: set[tuple] = set()  # (rank, "send"|"recv", peer, k): posted by isend/irecv, not waited on
        self._calls = [0] * world_size       # all-reduces issued per rank
        self._rounds: dict[int, dict] = {}   # index -> {rank: Reduction}, "result"
        self._ranks: set[int] = set()
        self._gone: set[int] = set()  # ranks whose connection closed
        self._blocked: dict[int, Callable[[], bool]] = {}  # rank -> what its wait needs (while it waits)
        self._waiting_for: dict[int, tuple] = {}  # rank -> (kind, peer, its wait in words) while it waits
        self._deadlock: str | None = None  # the deadlock, in words, once declared
        self._conns: list[socket.socket] = []
        self._threads: list[threading.Thread] = []
        self._closed = False
        self._bytes = 0
        self._path = None
        if SOCKET_DIR:
            self._path = os.path.join(SOCKET_DIR, f"relay-{secrets.token_hex(8)}")
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            # made 0666 as it is created (the folder admits the kernel's uid alone): never a chmod by name
            # afterwards, which would follow a link the kernel (who owns the folder) put in its place
            mask = os.umask(0o111)
            try:
                self._sock.bind(self._path)
            finally:
                os.umask(mask)
            self._sock.listen(4 * world_size + 4)
        else:
            self._sock = socket.create_server(("127.0.0.1", 0))
        self._sock.settimeout(0.2)

    def address(self) -> list:
        """``[host, port, token]`` (``["unix", path, token]`` with :data:`SOCKET_DIR`): what a rank
        needs to join (it travels to the kernel as data)."""
        if self._path:
            return ["unix", self._path, self.token]
        return ["127.0.0.1", self._sock.getsockname()[1], self.token]

    def __enter__(self) -> "Relay":
        t = threading.Thread(target=self._accept, daemon=True, name="labkit-relay")
        t.start()
        self._threads.append(t)
        return self

    def __exit__(self, *exc) -> bool:
        self.close()
        return False

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        for conn in self._conns:  # wakes a thread blocked reading it
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        for s in [self._sock, *self._conns]:
            try:
                s.close()
            except OSError:
                pass
        if self._path:
            try:
                os.unlink(self._path)
            except OSError:
                pass
        for t in self._threads:
            t.join(1.0)

    # --------------------------------------------------------------- per connection

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._sock.accept()
            except socket.timeout:
                continue
            except OSError:
                return
            if len(self._conns) >= 4 * self.world_size + 4:
                conn.close()
                continue
            conn.settimeout(None)
            self._conns.append(conn)
            t = threading.Thread(target=self._serve, args=(conn,), daemon=True, name="labkit-relay-rank")
            t.start()
            self._threads.append(t)

    def _serve(self, conn: socket.socket) -> None:
        rank_joined = [None]
        try:
            hello = _read(conn)
            rank = hello.get("rank") if isinstance(hello, dict) else None
            with self._cond:
                ok = (isinstance(hello, dict) and hello.get("token") == self.token and type(rank) is int
                      and 0 <= rank < self.world_size and rank not in self._ranks)
                if ok:
                    self._ranks.add(rank)
            if not ok:
                return
            rank_joined[0] = rank
            _write(conn, {"ok": True})
            while True:
                req = _read(conn)
                if req is None:
                    return
                _write(conn, self._handle(rank, req))
        except (OSError, wire.WireError, ValueError):
            return
        finally:
            try:
                conn.close()
            except OSError:
                pass
            if rank_joined[0] is not None:
                with self._cond:
                    self._gone.add(rank_joined[0])
                    self._cond.notify_all()

    def _handle(self, rank: int, req: Any) -> dict:
        if not isinstance(req, dict):
            return {"error": "not a relay request"}
        op = req.get("op")
        if op in ("send", "all_reduce"):
            t = req.get("tensor")
            size = t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0
            with self._cond:
                if len(self.sent) + len(self.reduced) >= self.max_messages:
                    return self._refuse(f"rank {rank} sent more than {self.max_messages} messages")
                if self._bytes + size > MAX_TOTAL:
                    return self._refuse(f"rank {rank} sent more than {MAX_TOTAL // 2 ** 20} MiB in all")
                self._bytes += size
        if op == "send":
            return self._send(rank, req.get("dst"), req.get("tensor"), req.get("wait") is not False)
        if op == "recv":
            return self._recv(rank, req.get("src"), req.get("shape"), req.get("dtype"), req.get("wait") is not False)
        if op in ("wait", "test"):
            return self._complete(rank, req.get("kind"), req.get("peer"), req.get("index"), req.get("shape"),
                                  req.get("dtype"), op == "wait")
        if op == "all_reduce":
            return self._all_reduce(rank, req.get("reduce"), req.get("tensor"))
        return self._refuse(f"rank {rank} asked the relay for {str(op)[:40]!r}")

    def _refuse(self, why: str) -> dict:
        self.problems.append(why)
        return {"error": why}

    def _send(self, rank: int, dst: Any, tensor: Any, wait: bool) -> dict:
        """Post rank's next message to ``dst``; a blocking send (``wait``) then waits for the match."""
        if type(dst) is not int or not 0 <= dst < self.world_size or dst == rank:
            return self._refuse(f"rank {rank} sent to rank {dst!r} (ranks are 0..{self.world_size - 1}, not itself)")
        if not isinstance(tensor, torch.Tensor):
            return self._refuse(f"rank {rank} sent a {type(tensor).__name__}, not a tensor")
        msg = Message(rank, dst, tensor.detach().cpu().clone())
        with self._cond:
            k = self._sends.get((rank, dst), 0)
            self._sends[(rank, dst)] = k + 1
            self.sent.append(msg)
            self._mail.setdefault((rank, dst), {})[k] = msg.tensor
            self._cond.notify_all()
            if not wait:
                self._open.add((rank, "send", dst, k))
                return {"ok": k}
        return self._complete(rank, "send", dst, k, None, None, True, blocking=True)

    def _recv(self, rank: int, src: Any, shape: Any, dtype: Any, wait: bool) -> dict:
        """Post rank's next receive from ``src``; a blocking recv (``wait``) then waits for the message."""
        if type(src) is not int or not 0 <= src < self.world_size or src == rank:
            return self._refuse(f"rank {rank} received from rank {src!r} (ranks are 0..{self.world_size - 1}, "
                                f"not itself)")
        with self._cond:
            k = self._recvs.get((src, rank), 0)
            self._recvs[(src, rank)] = k + 1
            self._cond.notify_all()
            if not wait:
                self._open.add((rank, "recv", src, k))
                return {"ok": k}
        return self._complete(rank, "recv", src, k, shape, dtype, True, blocking=True)

    def _complete(self, rank: int, kind: Any, peer: Any, k: Any, shape: Any, dtype: Any, wait: bool,
                  blocking: bool = False) -> dict:
        """Wait for (``wait``) or test the ``k``-th send of ``rank`` to ``peer`` / receive from ``peer``:
        a send is complete once ``peer`` has posted its ``k``-th receive from ``rank``, a receive once
        ``peer`` has posted its ``k``-th send to ``rank`` (whose values it returns)."""
        key = (rank, kind, peer, k)
        with self._cond:
            if not blocking:
                if key not in self._open:
                    return self._refuse(f"rank {rank} waited on a request the relay never gave it ({str(key)[:80]})")
            if kind == "send":
                def ready():
                    return self._recvs.get((rank, peer), 0) > k
                how = "a blocking send" if blocking else "the wait() of an isend"
                doing = (f"in {how} to rank {peer} (message {k + 1} from rank {rank} to rank {peer}), which "
                         f"has not posted the matching recv")
            else:
                box = self._mail.setdefault((peer, rank), {})

                def ready():
                    return k in box
                how = "a recv" if blocking else "the wait() of an irecv"
                doing = (f"in {how} from rank {peer} (message {k + 1} from rank {peer} to rank {rank}), which "
                         f"rank {peer} has not sent")
            if not wait:
                return {"ok": ready()}
            if not self._wait(rank, ready, (kind, peer, doing)):
                return {"error": self._deadlock_error(rank)}
            self._open.discard(key)
            if kind == "send":
                return {"ok": True}
            got = box.pop(k)
        if list(got.shape) != list(shape or ()) or str(got.dtype).replace("torch.", "") != dtype:
            return self._refuse(f"rank {rank} received into a {dtype} tensor of shape {list(shape or ())} the "
                                f"message rank {peer} sent as {str(got.dtype).replace('torch.', '')} of shape "
                                f"{list(got.shape)} (a send and its receive must match)")
        return {"ok": got}

    def _all_reduce(self, rank: int, op: Any, tensor: Any) -> dict:
        if op not in REDUCE_OPS or not isinstance(tensor, torch.Tensor):
            return self._refuse(f"rank {rank} asked for an all-reduce the relay does not run ({str(op)[:20]})")
        with self._cond:
            index = self._calls[rank]
            self._calls[rank] += 1
            item = Reduction(rank, index, op, tensor.detach().cpu().clone())
            self.reduced.append(item)
            round_ = self._rounds.setdefault(index, {})
            round_[rank] = item
            self._cond.notify_all()

            def ready():
                return len(round_) >= self.world_size + ("result" in round_)
            def doing():
                missing = sorted(set(range(self.world_size)) - set(round_))
                return f"in its all-reduce number {index + 1}, which rank(s) {missing} never made"
            if not self._wait(rank, ready, ("all_reduce", None, doing)):
                return {"error": self._deadlock_error(rank)}
            if "result" not in round_:
                round_["result"] = self._reduce(index, [round_[r] for r in range(self.world_size)])
            result = round_["result"]
        if isinstance(result, str):
            return {"error": result}
        return {"ok": result}

    def _wait(self, rank: int, ready: Callable[[], bool], doing: tuple) -> bool:
        """Block (holding ``self._cond``) until ``ready()``: True; False when the relay closes or a
        deadlock is declared (see the class), which releases every waiting rank at once. ``doing``:
        (kind, peer, what it waits for in words, or a function giving them) for the description."""
        self._blocked[rank], self._waiting_for[rank] = ready, doing
        try:
            while not ready():
                if self._closed or self._deadlock is not None:
                    return False
                if self._deadlocked():
                    self._deadlock = self._describe_deadlock()
                    self.problems.insert(0, self._deadlock)
                    self._cond.notify_all()
                    return False
                self._cond.wait(0.2)
            return True
        finally:
            del self._blocked[rank], self._waiting_for[rank]

    def _deadlocked(self) -> bool:
        """Every rank joined and is gone or blocked in the relay, and no blocked wait can go on
        (a blocked rank makes no request, so nothing can change: an exact test, no clock)."""
        return (len(self._ranks) == self.world_size
                and all(r in self._blocked or r in self._gone for r in range(self.world_size))
                and not any(ready() for ready in self._blocked.values()))

    def _describe_deadlock(self) -> str:
        waits = dict(sorted(self._waiting_for.items()))
        if all(kind == "send" for kind, _, _ in waits.values()):
            pairs = ", ".join(f"rank {r} to rank {peer}" for r, (_, peer, _) in waits.items())
            return (f"deadlock: every rank still running is blocked in a send ({pairs}) and none is receiving. "
                    f"A send completes only once its receiver has posted the matching recv (dist.send is "
                    f"synchronous on gloo, the backend here), so while every rank waits in a send, nobody ever "
                    f"receives")
        said = "; ".join(f"rank {r} waits {w() if callable(w) else w}" for r, (_, _, w) in waits.items())
        gone = sorted(self._gone)
        if gone:
            said += f"; rank(s) {gone} ended"
        return f"deadlock: no rank can go on: {said}"

    def _deadlock_error(self, rank: int) -> str:
        if self._deadlock is None:
            return f"rank {rank}: the relay closed while it waited"
        return f"rank {rank} was stopped by a {self._deadlock}"

    def _reduce(self, index: int, items: list[Reduction]):
        first = items[0]
        for it in items[1:]:
            if it.op != first.op or it.tensor.shape != first.tensor.shape or it.tensor.dtype != first.tensor.dtype:
                why = (f"all-reduce number {index + 1}: rank {first.rank} gave {first.op} of "
                       f"{first.tensor.dtype} {list(first.tensor.shape)}, rank {it.rank} {it.op} of "
                       f"{it.tensor.dtype} {list(it.tensor.shape)} (every rank must make the same call)")
                self.problems.append(why)
                return why
        stack = torch.stack([it.tensor for it in items])
        fn = {"sum": lambda s: s.sum(0), "max": lambda s: s.amax(0), "min": lambda s: s.amin(0),
              "product": lambda s: s.prod(0)}[first.op]
        wide = stack.double() if stack.is_floating_point() else stack
        return fn(wide).to(first.tensor.dtype)


# ===================================================================== kernel side


class RelayGroup:
    """What ``ctx.group`` is on a relay rank: answers ``rank()`` and ``size()`` like a ProcessGroup."""

    def __init__(self, rank: int, size: int):
        self._rank, self._size = rank, size

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size

    def __repr__(self) -> str:
        return f"RelayGroup(rank={self._rank}, size={self._size})"


class _Client:
    def __init__(self, address, rank: int):
        host, port, token = address
        self.rank = rank
        if host == "unix":
            self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self.sock.connect(str(port))
        else:
            self.sock = socket.create_connection((str(host), int(port)))
        _write(self.sock, {"token": token, "rank": rank})
        if _read(self.sock) != {"ok": True}:
            raise RuntimeError(f"rank {rank} could not join the grader's relay")

    def call(self, req: dict):
        _write(self.sock, req)
        reply = _read(self.sock)
        if not isinstance(reply, dict) or "ok" not in reply:
            raise RuntimeError(str(reply.get("error") if isinstance(reply, dict) else "the relay closed"))
        return reply["ok"]


class _Done:
    """A finished request (what an async all_reduce returns: the relay answered it already)."""

    def wait(self, *a, **k) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


class _Request:
    """What isend/irecv return: a send or receive the relay has posted; ``wait()`` blocks until it
    matches (the receiver posts its recv / the sender its send), ``is_completed()`` asks without
    blocking. ``into``: the tensor an irecv fills."""

    def __init__(self, client: "_Client", kind: str, peer: int, index: int, into: torch.Tensor | None = None):
        self._client, self._into, self._done = client, into, False
        self._req = {"kind": kind, "peer": peer, "index": index}
        if into is not None:
            self._req.update(shape=list(into.shape), dtype=str(into.dtype).replace("torch.", ""))

    def wait(self, *a, **k) -> bool:
        if not self._done:
            got = self._client.call({"op": "wait", **self._req})
            self._done = True
            if self._into is not None:
                with torch.no_grad():
                    self._into.copy_(got)
        return True

    def is_completed(self) -> bool:
        return self._done or bool(self._client.call({"op": "test", **self._req}))


def _op_name(op) -> str:
    """"sum" for ``ReduceOp.SUM`` (one of :data:`REDUCE_OPS`), else the op as text (which the relay refuses)."""
    return next((name for name in REDUCE_OPS if op == getattr(torch.distributed.ReduceOp, name.upper())), str(op))


def _install(client: _Client, world_size: int, allowed: tuple, refuse: Callable[[str], BaseException]) -> None:
    """In a relay rank: torch.distributed's calls become relay requests (see the module)."""
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    def send(tensor, dst=None, group=None, tag=0, group_dst=None):
        client.call({"op": "send", "dst": dst if group_dst is None else group_dst, "tensor": tensor.detach()})
        # returns once the receiver has posted the matching recv (gloo's dist.send: see the module)

    def recv(tensor, src=None, group=None, tag=0, group_src=None):
        src = src if group_src is None else group_src
        got = client.call({"op": "recv", "src": src, "shape": list(tensor.shape),
                           "dtype": str(tensor.dtype).replace("torch.", "")})
        with torch.no_grad():
            tensor.copy_(got)
        return src

    def isend(tensor, dst=None, group=None, tag=0, group_dst=None):
        dst = dst if group_dst is None else group_dst
        k = client.call({"op": "send", "dst": dst, "tensor": tensor.detach(), "wait": False})
        return _Request(client, "send", dst, k)

    def irecv(tensor, src=None, group=None, tag=0, group_src=None):
        src = src if group_src is None else group_src
        k = client.call({"op": "recv", "src": src, "wait": False})
        return _Request(client, "recv", src, k, into=tensor)

    def all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        got = client.call({"op": "all_reduce", "reduce": _op_name(op), "tensor": tensor.detach()})
        with torch.no_grad():
            tensor.copy_(got)
        return _Done() if async_op else None

    table = {"send": send, "recv": recv, "isend": isend, "irecv": irecv, "all_reduce": all_reduce}
    for mod in (dist, c10d):
        for name in ("all_gather", "all_gather_into_tensor", "all_gather_object", "gather", "scatter",
                     "broadcast", "reduce", "reduce_scatter", "reduce_scatter_tensor", "all_to_all",
                     "all_to_all_single", "all_reduce_coalesced", "batch_isend_irecv", "barrier",
                     *table):
            if not hasattr(mod, name):
                continue
            if name in allowed:
                setattr(mod, name, table[name])
            else:
                setattr(mod, name, _refusing(name, refuse))
        mod.get_rank = lambda group=None: client.rank
        mod.get_world_size = lambda group=None: world_size


def _refusing(name: str, refuse: Callable[[str], BaseException]) -> Callable:
    def call(*args, **kwargs):
        raise refuse(name)
    return call


def _rank_main(body, rank, world_size, address, allowed, refuse, wfd, args) -> None:
    try:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        torch.set_num_threads(1)  # a forked child can hang in threaded kernels otherwise
        from ..dist import DistContext

        client = _Client(address, rank)
        _install(client, world_size, allowed, refuse)
        ctx = DistContext(rank, world_size, rank, "relay", torch.device("cpu"), RelayGroup(rank, world_size))
        payload = pickle.dumps(("ok", body(ctx, *args)))
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        payload = pickle.dumps(("error", (type(e).__name__, str(e)[:2000], traceback.format_exc()[-4000:])))
    try:
        view = memoryview(struct.pack("<Q", len(payload)) + payload)
        while view:
            view = view[os.write(wfd, view):]
    finally:
        os._exit(0)


def _waiting(error: tuple) -> bool:
    """A rank's error that only says it waited for a peer (the peer's own error is the cause)."""
    kind, message = error[0], error[1]
    return kind == "ProcessDied" or any(s in message for s in ("deadlock", "timed out", "connection closed"))


def _refused(name: str) -> BaseException:
    return RuntimeError(f"{name} is not available on these ranks: they talk through the grader's relay")


def run_ranks(body: Callable, world_size: int, address, *args, allowed=("send", "recv", "isend", "irecv"),
              refuse: Callable[[str], BaseException] = _refused, timeout: float = 15.0) -> list:
    """Kernel side: ``body(ctx, *args)`` on ``world_size`` forked ranks whose communication goes
    through the relay at ``address``; their results in rank order.

    ``allowed``: the torch.distributed calls that reach the relay (the others raise
    ``refuse(name)``). Raises :class:`labkit.dist.RankError` for the rank that failed by cause
    (one that raised by itself before one that gave up waiting for a peer), or when the
    ranks are not done after ``timeout`` seconds. Every rank is killed and reaped before this
    returns."""
    import select

    from ..dist import RankError

    pids, fds = [], {}
    try:
        for rank in range(world_size):
            r, w = os.pipe()
            pid = os.fork()
            if pid == 0:
                os.close(r)
                for fd in fds:
                    os.close(fd)
                _rank_main(body, rank, world_size, address, allowed, refuse, w, args)
            os.close(w)
            pids.append(pid)
            fds[r] = rank
        bufs = {fd: b"" for fd in fds}
        results, errors = {}, {}
        poller = select.poll()
        for fd in fds:
            poller.register(fd, select.POLLIN | select.POLLHUP)
        deadline, grace = time.monotonic() + timeout, None
        while len(results) + len(errors) < world_size:
            left = deadline - time.monotonic() if grace is None else grace - time.monotonic()
            if left <= 0:
                if errors:
                    break
                raise RankError(0, "TimeoutError", f"the ranks were not done after {timeout:g} s", "")
            for fd, _ in poller.poll(max(1, int(left * 1000))):
                rank = fds[fd]
                chunk = os.read(fd, 1 << 20)
                bufs[fd] += chunk
                buf = bufs[fd]
                if len(buf) >= 8 and len(buf) >= 8 + struct.unpack("<Q", buf[:8])[0]:
                    kind, value = pickle.loads(buf[8:])
                    (results if kind == "ok" else errors)[rank] = value
                elif not chunk:
                    errors[rank] = ("ProcessDied", "the rank ended without a result (killed, or it exited)", "")
                else:
                    continue
                poller.unregister(fd)
                if rank in errors and grace is None:
                    grace = time.monotonic() + 0.5  # the others may fail by themselves too: say the cause
        if errors:
            rank = min(errors, key=lambda r: (_waiting(errors[r]), r))
            raise RankError(rank, *errors[rank])
        return [results[r] for r in range(world_size)]
    finally:
        for fd in fds:
            try:
                os.close(fd)
            except OSError:
                pass
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            try:
                os.waitpid(pid, 0)
            except ChildProcessError:
                pass
