"""Liveness links (``processes.links``) against real sockets: a peer process SIGKILLed is
named at once; one that ends after marking itself done is not."""

import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
from helpers import KeyValueStore

from ntp_jax.processes.heartbeat import Heartbeat
from ntp_jax.processes.links import LINK_PREFIX, Links

# Process 1 of 2, by hand: connect to process 0's link, say its index, then wait.
_PEER = ("import socket, struct, sys, time\n"
         "host, port = sys.argv[1].rsplit(':', 1)\n"
         "conn = socket.create_connection((host, int(port)))\n"
         "conn.sendall(struct.pack('!I', 1))\n"
         "assert conn.recv(1) == b'\\x01'\n"  # process 0's answer: the link is live
         "print('linked', flush=True)\n"
         "time.sleep(float(sys.argv[2]))\n")


def _linked_peer(store, closed, lives_s):
  """Process 0's links, and process 1 (a child) linked to them."""
  links = Links(store, 0, 2, lambda peer, why: closed.append((peer, why, time.monotonic())),
                lambda peer: f"ntp_jax/done/{peer}" in store.values, timeout_s=20)
  problems = []
  setup = threading.Thread(target=lambda: problems.extend(links.connect()))
  setup.start()
  while f"{LINK_PREFIX}/0" not in store.values:
    time.sleep(0.01)
  child = subprocess.Popen([sys.executable, "-c", _PEER, store.values[f"{LINK_PREFIX}/0"],
                            str(lives_s)], stdout=subprocess.PIPE, text=True)
  assert child.stdout.readline().strip() == "linked"
  setup.join(timeout=20)
  assert problems == [] and links.linked == {1}
  return links, child


def test_a_peer_killed_is_named_within_a_fraction_of_a_second():
  store, closed = KeyValueStore(), []
  links, child = _linked_peer(store, closed, lives_s=60)
  try:
    child.send_signal(signal.SIGKILL)
    killed = time.monotonic()
    child.wait(timeout=10)
    deadline = killed + 5
    while not closed and time.monotonic() < deadline:
      time.sleep(0.01)
  finally:
    if child.poll() is None:
      child.kill()
    links.close()
  assert [(peer, why) for peer, why, _ in closed] == [(1, "its liveness link closed")]
  assert closed[0][2] - killed < 0.5


def test_a_peer_that_marked_itself_done_is_not_lost():
  store, closed = KeyValueStore(), []
  store.key_value_set("ntp_jax/done/1", "1")  # what Heartbeat.stop writes before the end
  links, child = _linked_peer(store, closed, lives_s=0.5)
  try:
    child.wait(timeout=10)
    time.sleep(0.5)  # the watch reads the link's end well within this
  finally:
    links.close()
  assert closed == [] and links.linked == set()


def test_a_connection_never_accepted_is_no_link_and_no_loss():
  """Process 1's connection to a process 0 that never accepts it (still in the backlog when
  0's set-up ends): it is not counted, so its reset later names nobody lost; the peer is
  said in one line and left to the heartbeat."""
  store, closed = KeyValueStore(), []
  silent = socket.create_server(("127.0.0.1", 0))  # listens, never accepts
  store.key_value_set(f"{LINK_PREFIX}/0", f"127.0.0.1:{silent.getsockname()[1]}")
  links = Links(store, 1, 2, lambda peer, why: closed.append(peer), lambda peer: False,
                timeout_s=0.5)
  try:
    problems = links.connect()
    silent.close()  # the queued connection is reset now
    time.sleep(0.3)
  finally:
    links.close()
  assert links.linked == set() and closed == []
  assert len(problems) == 1 and problems[0].startswith("process 0: "), problems


@pytest.mark.parametrize("takes_over", [False, True])
def test_a_closed_link_is_the_heartbeats_verdict_at_once(takes_over):
  """``Heartbeat.report_closed`` gives the verdict the heartbeat would give after its
  timeout (one, however many watchers report it), offered to the main thread or not."""
  store, ended = KeyValueStore(), []
  beat = Heartbeat(store, 0, 3, timeout_s=60, on_lost=ended.append,
                   takeover_s=30 if takes_over else None)
  beat.report_closed(2, "its liveness link closed")
  beat.report_closed(2, "its liveness link was reset")
  deadline = time.monotonic() + 5
  while not (beat.lost_processes if takes_over else ended) and time.monotonic() < deadline:
    time.sleep(0.01)
  time.sleep(0.2)  # a second verdict, were there one, would have come by now
  assert beat._verdicts == 1
  if takes_over:
    assert beat.wait_for_verdict() == "lost process 2 of 3: its liveness link closed"
    assert beat.take_over() == {2} and ended == []
  else:
    assert ended == ["lost process 2 of 3: its liveness link closed; process 0 stops; "
                     "restart the job from its last checkpoint"]
