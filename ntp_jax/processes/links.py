"""Liveness links: one TCP connection between every two processes, to name a dead one at once.

The heartbeat (``processes.heartbeat``) names a silent process after
``distributed.heartbeat_timeout_s``. But a process that dies (a crash, SIGKILL, a GPU
failure that ends it) has its sockets closed by its kernel at once, and the peer end of a
TCP connection then reads end-of-file (or a reset) within a network round trip. So every
process keeps one idle connection to every other, and a connection that closes names its
peer lost in milliseconds, before any heartbeat or collective bound would. A whole host
that dies closes nothing: its processes are still found by the heartbeat.

A link that closes is a loss only when its peer did not end normally: a process that
finishes marks itself done in the coordination service first (``Heartbeat.stop``), and
that mark is read before the loss is declared.

Set-up: each process listens on a port of its own, publishes ``host:port`` under
``ntp_jax/link/<process>`` in the coordination service's key-value store, connects to every
process with a lower index and accepts a connection from every higher one (the connecting
process sends its index, the accepting one answers, and only then does either count the
link). ``N`` processes keep ``N - 1`` sockets each.
"""

from __future__ import annotations

import selectors
import socket
import struct
import threading
import time
from collections.abc import Callable

LINK_PREFIX = "ntp_jax/link"
_INDEX = struct.Struct("!I")  # the connecting process's index, its first and only bytes
_ACCEPTED = b"\x01"  # the accepting process's answer: only then is the link live
CONNECT_S = 5.0  # a reachable peer answers in milliseconds; a firewall's silence costs this


def local_address(coordinator: str | None) -> str:
  """The address of this host that reaches ``coordinator`` (``host:port``, ``[v6]:port``);
  127.0.0.1 without one or when no route is found. No packet is sent (a UDP socket's
  connect only picks the route)."""
  if not coordinator:
    return "127.0.0.1"
  host, _, port = coordinator.rpartition(":")
  host = host.strip("[]")
  family = socket.AF_INET6 if ":" in host else socket.AF_INET
  try:
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
      probe.connect((host, int(port) if port.isdigit() else 1))
      return probe.getsockname()[0]
  except OSError:
    return "127.0.0.1"


def _joined(host: str, port: int) -> str:
  return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class Links:
  """This process's liveness links to every other process of the job.

  Args:
    client: the coordination service's key-value client (``key_value_set``,
      ``blocking_key_value_get``, ``key_value_try_get``).
    process_id, num_processes: this process and the job's count.
    on_closed: called from the links' thread as ``on_closed(peer, why)`` once per peer whose
      link closed while it had not finished (not for a peer marked done).
    is_done: ``is_done(peer)``: the peer ended normally (its done mark is written).
    address: the host address the peers reach this process at (``local_address``).
    timeout_s: how long the set-up waits for each peer's address and connection.
  """

  def __init__(self, client, process_id: int, num_processes: int,
               on_closed: Callable[[int, str], None], is_done: Callable[[int], bool],
               address: str = "127.0.0.1", timeout_s: float = 30.0):
    self.client, self.process_id, self.num_processes = client, process_id, num_processes
    self.on_closed, self.is_done = on_closed, is_done
    self.address, self.timeout_s = address, timeout_s
    self.linked: set[int] = set()  # peers with a live link
    self._selector = selectors.DefaultSelector()
    self._stop = threading.Event()
    self._thread = threading.Thread(target=self._watch, name="ntp-links", daemon=True)

  def connect(self) -> list[str]:
    """Link to every peer; returns one line per peer that could not be linked (empty when
    all are). Every process of the job must call it at the same point (it waits for the
    peers' addresses, up to ``timeout_s``)."""
    v6 = ":" in self.address
    listener = socket.create_server(("::" if v6 else "", 0), backlog=max(1, self.num_processes),
                                    family=socket.AF_INET6 if v6 else socket.AF_INET)
    port = listener.getsockname()[1]
    self.client.key_value_set(f"{LINK_PREFIX}/{self.process_id}", _joined(self.address, port),
                              allow_overwrite=True)
    problems: list[str] = []
    for peer in range(self.process_id):  # lower indices: this process connects
      conn = None
      try:
        where = self.client.blocking_key_value_get(f"{LINK_PREFIX}/{peer}",
                                                   int(self.timeout_s * 1000))
        host, _, peer_port = where.rpartition(":")
        conn = socket.create_connection((host.strip("[]"), int(peer_port)),
                                        timeout=min(CONNECT_S, self.timeout_s))
        conn.settimeout(self.timeout_s)  # the peer accepts once its own connects are done
        conn.sendall(_INDEX.pack(self.process_id))
        if _read_exactly(conn, len(_ACCEPTED)) != _ACCEPTED:
          raise ConnectionError("unexpected answer")
        self._add(peer, conn)
      except Exception as err:  # noqa: BLE001 -- any failure: that peer has the heartbeat only
        if conn is not None:
          conn.close()
        problems.append(f"process {peer}: {err}")
    listener.settimeout(self.timeout_s)
    deadline = time.monotonic() + self.timeout_s
    higher = set(range(self.process_id + 1, self.num_processes))
    while higher - self.linked and time.monotonic() < deadline:
      try:
        conn, _ = listener.accept()
      except OSError:  # the wait ran out
        break
      try:
        conn.settimeout(self.timeout_s)
        peer = _INDEX.unpack(_read_exactly(conn, _INDEX.size))[0]
        if peer not in higher or peer in self.linked:
          raise ConnectionError(f"not a peer of this job: {peer}")
        conn.sendall(_ACCEPTED)
        self._add(peer, conn)
      except OSError:  # one connection went wrong: the others may still come
        conn.close()
    problems += [f"process {p}: no connection in {self.timeout_s:g} s"
                 for p in sorted(higher - self.linked)]
    listener.close()  # a connection still queued is refused: its peer never counted it
    self._thread.start()
    return problems

  def _add(self, peer: int, conn: socket.socket) -> None:
    conn.setblocking(False)
    self._selector.register(conn, selectors.EVENT_READ, peer)
    self.linked.add(peer)

  def _watch(self) -> None:
    while not self._stop.is_set():
      for key, _ in self._selector.select(timeout=0.2):
        peer, conn = key.data, key.fileobj
        try:
          data = conn.recv(64)
        except BlockingIOError:
          continue
        except OSError as err:  # a reset: the peer's kernel dropped the connection
          data, why = b"", f"its liveness link was reset ({err.strerror or err})"
        else:
          why = "its liveness link closed"
        if data:  # nothing is ever sent after the index; ignore stray bytes
          continue
        self._selector.unregister(conn)
        conn.close()
        self.linked.discard(peer)
        if not self._stop.is_set() and not self.is_done(peer):
          self.on_closed(peer, why)

  def close(self) -> None:
    """This process is finishing: stop watching, then close every link."""
    self._stop.set()
    if self._thread.is_alive():
      self._thread.join(timeout=2.0)  # it wakes every 0.2 s
    for key in list(self._selector.get_map().values()):
      key.fileobj.close()
    self._selector.close()


def _read_exactly(conn: socket.socket, n: int) -> bytes:
  data = b""
  while len(data) < n:
    chunk = conn.recv(n - len(data))
    if not chunk:
      raise ConnectionError("closed during the link's set-up")
    data += chunk
  return data
